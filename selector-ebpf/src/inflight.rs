//! The in-flight slot table, kernel side: find, insert, claim. The protocol
//! and why it closes the races are in `selector_common::inflight`.
//!
//! Ordering: fields are written with volatile stores before the state word
//! is published with an atomic exchange (a full barrier on every JIT); a
//! reader loads the state, the fields, then the state again. Loads are not
//! reordered with loads on x86-64, the architecture this is built and tested
//! on.

use core::{
    intrinsics::{AtomicOrdering, atomic_and, atomic_cxchg, atomic_or, atomic_xadd, atomic_xchg},
    ptr::{read_volatile, write_volatile},
};

use aya_ebpf::helpers::bpf_get_smp_processor_id;
use selector_common::{
    InflightKey,
    inflight::{
        FREE, PHASE_LINGER, PHASE_LIVE, PHASE_WRITING, PROBE_WINDOW, datagram_bit, datagram_step,
        datagrams_open, mark_of, phase, probe, rank, reply_rank, sequence, state, superseded,
        window_mark_words, window_marks as window_marks_of, with_phase,
    },
};

use crate::maps::{INFLIGHT, INFLIGHT_MARKS, MATCH_SCRATCH, SCRATCH, SEQUENCE};

/// What a reader needs of an occupied slot, read consistently, and the
/// state it was read in.
#[derive(Clone, Copy)]
pub struct Seen {
    pub index: u32,
    pub state: u64,
    pub primary: u32,
    pub chosen: u32,
    pub sent_ns: u64,
    /// The hedge word as read (it may gain bits later; see `crate::hedge`).
    pub hedge: u64,
}

/// Reads slot `index` if it is occupied by a published request holding
/// `key`: `None` if free, being written, another key's, or changed while read.
#[inline(always)]
fn read_if_holds(index: u32, key: &InflightKey) -> Option<Seen> {
    let p = INFLIGHT.get_ptr_mut(index)?;
    let before = unsafe { read_volatile(&raw const (*p).state) };
    if before == FREE || phase(before) == PHASE_WRITING {
        return None;
    }
    // The cheapest field first: most occupied slots hold other ids.
    let holds = unsafe {
        read_volatile(&raw const (*p).request_id) == key.request_id
            && read_volatile(&raw const (*p).client_port) == key.client_port
            && u32::from(read_volatile(&raw const (*p).group)) == key.group
            && read_volatile(&raw const (*p).client_addr) == key.client_addr
    };
    if !holds {
        return None;
    }
    let seen = unsafe {
        Seen {
            index,
            state: before,
            primary: u32::from(read_volatile(&raw const (*p).primary)),
            chosen: u32::from(read_volatile(&raw const (*p).chosen)),
            sent_ns: read_volatile(&raw const (*p).sent_ns),
            hedge: read_volatile(&raw const (*p).hedge),
        }
    };
    let after = unsafe { read_volatile(&raw const (*p).state) };
    (before == after).then_some(seen)
}

/// Loads the state of the window's first slot, where a new request most
/// likely goes, and ignores it: the load starts the cache and TLB misses
/// on that line (for a socket's next id in order, usually the page its
/// last ids took; for scattered ids, a random line of a table of up to
/// 256 MB) while the mark words are read and the request is admitted,
/// instead of when the slot is taken.
#[inline(always)]
pub fn touch_home(hash: u64, mask: u32) {
    if let Some(p) = INFLIGHT.get_ptr_mut(probe(hash, 0, mask)) {
        unsafe { read_volatile(&raw const (*p).state) };
    }
}

/// Loads the mark word of the window's first slot and ignores it (see
/// `touch_home`): a reply usually claims that slot, which clears its mark.
#[inline(always)]
pub fn touch_home_mark(hash: u64, mask: u32) {
    let (word, _) = mark_of(probe(hash, 0, mask));
    if let Some(p) = INFLIGHT_MARKS.get_ptr_mut(word) {
        unsafe { read_volatile(p) };
    }
}

/// Every probe of a window: `find` reads each slot.
pub const WHOLE_WINDOW: u64 = (1 << PROBE_WINDOW) - 1;

/// The marks of the probe window of `hash` (bit `i` for probe `i`): a slot
/// whose bit is clear is free or still being written, never `LIVE` or
/// `LINGER` (see `selector_common::inflight`), so a search for a request
/// that may not be there (a new request) reads one or two mark words
/// instead of eight slots' cache lines. Everything marked if a word is
/// missing.
#[inline(always)]
pub fn window_marks(hash: u64, mask: u32) -> u64 {
    let home = probe(hash, 0, mask);
    let (first, next) = window_mark_words(home, mask);
    let word = |w| {
        INFLIGHT_MARKS
            .get_ptr_mut(w)
            .map_or(u64::MAX, |p| unsafe { read_volatile(p) })
    };
    window_marks_of(home, mask, word(first), word(next))
}

/// The first slot in the key's probe window that holds it in `phase`
/// and satisfies `want`, reading only the probes whose bit is set in
/// `probes` (`WHOLE_WINDOW`, or `window_marks`). One small result per scan
/// keeps the verifier's view of the unrolled loop linear.
#[inline(always)]
pub fn find(
    key: &InflightKey,
    hash: u64,
    mask: u32,
    probes: u64,
    phase_wanted: u64,
    want: impl Fn(&Seen) -> bool,
) -> Option<Seen> {
    let mut i = 0;
    while i < PROBE_WINDOW {
        if (probes >> i) & 1 != 0
            && let Some(seen) = read_if_holds(probe(hash, i, mask), key)
            && phase(seen.state) == phase_wanted
            && want(&seen)
        {
            return Some(seen);
        }
        i += 1;
    }
    None
}

/// Which instance of `key` a reply from backend `from` (of `group`)
/// belongs to: the one in the key's window of the highest
/// `selector_common::inflight::rank` (the first of equals), read anew, and
/// whether the reply is *stale*: an older instance's while the window holds
/// a current one (the application reused the id and waits on that).
/// `None`: no instance was sent to `from`.
///
/// One pass over the window with no early way out, each slot's rank folded
/// into a best-so-far word in map memory without a branch: the verifier
/// does not track map contents, so every way through a slot's checks
/// continues as one state into the next slot, and one state leaves. Only
/// marked slots are read (`window_marks`, whose home word the reply path
/// started to fetch): a slot in use never loses its mark (the agent
/// clears a free slot's under its hold), but for the moment a claim that
/// frees it clears the mark before its compare-and-swap, when the slot is
/// being answered by that claim; so an instance a reply can belong to is
/// always marked. The unmarked slots' cache lines are not touched: a
/// quarter of the reply path's time on an idle window.
#[inline(always)]
pub fn match_reply(
    key: &InflightKey,
    hash: u64,
    mask: u32,
    group: u32,
    from: u32,
) -> Option<(Seen, bool)> {
    // [best: rank << 60 | (7 - probe) << 56 | slot index; OR of currents]
    // and [the best one's state word, unused].
    let slot = SCRATCH.get_ptr_mut(MATCH_SCRATCH)?;
    let best_state = SCRATCH.get_ptr_mut(MATCH_SCRATCH + 1)?;
    unsafe { write_volatile(slot, [0, 0]) };
    let probes = window_marks(hash, mask);
    let mut i = 0;
    while i < PROBE_WINDOW {
        if (probes >> i) & 1 != 0
            && let Some(seen) = read_if_holds(probe(hash, i, mask), key)
        {
            let (r, current) = reply_rank(seen.state, seen.chosen, seen.hedge, group, from);
            let mine = r << 60 | u64::from(PROBE_WINDOW - 1 - i) << 56 | u64::from(seen.index);
            unsafe {
                let [had, currents] = read_volatile(slot);
                // All ones if `mine` is greater (both below 2^63).
                let take = 0u64.wrapping_sub(had.wrapping_sub(mine) >> 63);
                write_volatile(
                    slot,
                    [had ^ ((had ^ mine) & take), currents | u64::from(current)],
                );
                let [had_state, _] = read_volatile(best_state);
                write_volatile(
                    best_state,
                    [had_state ^ ((had_state ^ seen.state) & take), 0],
                );
            }
        }
        i += 1;
    }
    let ([best, currents], [state, _]) =
        unsafe { (read_volatile(slot), read_volatile(best_state)) };
    let best_rank = best >> 60;
    if best_rank == rank::UNRELATED {
        return None;
    }
    // Read anew, and only as the same instance: the slot may have moved on
    // since (claimed or expired: a later phase, which the reply path
    // handles as any race with the sweep), or been freed and taken by
    // another request, whose rank this is not.
    let seen =
        read_if_holds((best & 0xffff_ffff) as u32, key).filter(|s| s.state >> 2 == state >> 2)?;
    Some((seen, currents & 1 != 0 && best_rank != rank::CURRENT))
}

/// Moves slot `index` from `from` to `to`; true if this caller made the move.
#[inline(always)]
pub fn cas(index: u32, from: u64, to: u64) -> bool {
    let Some(p) = INFLIGHT.get_ptr_mut(index) else {
        return false;
    };
    let (_, won) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
            &raw mut (*p).state,
            from,
            to,
        )
    };
    won
}

/// The reply path's claim: moves slot `index` from `from` to `to` like
/// [`cas`]. A claim that frees the slot clears its mark first, so the
/// agent's sweep never visits an answered request; a new inserter can take
/// the slot only after the free, so its own mark comes after this clear.
/// A claim that loses puts the mark back (the slot is someone else's now).
#[inline(always)]
pub fn claim(index: u32, from: u64, to: u64) -> bool {
    if to != FREE {
        return cas(index, from, to);
    }
    let (word, bit) = mark_of(index);
    let Some(p) = INFLIGHT_MARKS.get_ptr_mut(word) else {
        return cas(index, from, to);
    };
    unsafe { atomic_and::<u64, u64, { AtomicOrdering::SeqCst }>(p, !bit) };
    let won = cas(index, from, to);
    if !won {
        unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(p, bit) };
    }
    won
}

/// A unique instance number for a new request. The per-CPU counter is
/// bumped atomically: on a preemptible kernel two programs can interleave
/// on one CPU, and they must still get different numbers.
#[inline(always)]
fn next_sequence() -> Option<u64> {
    let c = SEQUENCE.get_ptr_mut(0)?;
    let before = unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::SeqCst }>(c, 1) };
    Some(sequence(before + 1, unsafe { bpf_get_smp_processor_id() }))
}

/// A slot owned by this inserter (state `WRITING`), not yet published.
pub struct Reserved {
    index: u32,
    seq: u64,
}

impl Reserved {
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The state word the request will have once published.
    pub fn live_state(&self) -> u64 {
        state(self.seq, PHASE_LIVE)
    }
}

/// Takes the first free slot in the window of `key`, else the first slot
/// of an older instance of `key` it supersedes
/// (`selector_common::inflight::superseded`).
#[inline(always)]
pub fn reserve(key: &InflightKey, hash: u64, mask: u32) -> Option<Reserved> {
    let seq = next_sequence()?;
    let writing = state(seq, PHASE_WRITING);
    let mut i = 0;
    while i < PROBE_WINDOW {
        let index = probe(hash, i, mask);
        if cas(index, FREE, writing) {
            mark(index);
            return Some(Reserved { index, seq });
        }
        i += 1;
    }
    // Taken from the exact state read: an actor still holding the older
    // instance's state (a late reply, the sweep, the hedge thread) fails
    // its compare-and-swap, and its hedge word gets this one's tag.
    let old = find(key, hash, mask, WHOLE_WINDOW, PHASE_LINGER, |s| {
        superseded(s.state, s.hedge)
    })?;
    // Still marked: it was lingering.
    cas(old.index, old.state, writing).then_some(Reserved {
        index: old.index,
        seq,
    })
}

/// Sets slot `index`'s mark, after the slot was taken, so the agent's sweep
/// visits it. A bit already set (the sweep has not cleared it since the
/// slot's last use) is left alone, sparing a write to a shared line.
#[inline(always)]
fn mark(index: u32) {
    let (word, bit) = mark_of(index);
    let Some(p) = INFLIGHT_MARKS.get_ptr_mut(word) else {
        return;
    };
    unsafe {
        if read_volatile(p) & bit == 0 {
            atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(p, bit);
        }
    }
}

/// The fields of a new request.
pub struct NewRequest {
    pub key: InflightKey,
    pub primary: u32,
    pub chosen: u32,
    pub sent_ns: u64,
    /// The initial hedge word: 0, or the open word of this instance.
    pub hedge: u64,
}

impl Reserved {
    /// Writes the request and makes it visible as `LIVE`.
    #[inline(always)]
    pub fn publish(self, req: &NewRequest) {
        let Some(p) = INFLIGHT.get_ptr_mut(self.index) else {
            return;
        };
        unsafe {
            write_volatile(&raw mut (*p).request_id, req.key.request_id);
            write_volatile(&raw mut (*p).client_addr, req.key.client_addr);
            write_volatile(&raw mut (*p).client_port, req.key.client_port);
            write_volatile(&raw mut (*p).group, req.key.group as u16);
            write_volatile(&raw mut (*p).primary, req.primary as u16);
            write_volatile(&raw mut (*p).chosen, req.chosen as u16);
            write_volatile(&raw mut (*p).sent_ns, req.sent_ns);
            write_volatile(
                &raw mut (*p).datagrams_seen,
                datagrams_open(state(self.seq, PHASE_LIVE)),
            );
            write_volatile(&raw mut (*p).hedge, req.hedge);
            atomic_xchg::<u64, { AtomicOrdering::SeqCst }>(
                &raw mut (*p).state,
                state(self.seq, PHASE_LIVE),
            );
        }
    }
}

/// Records reply datagram `seq` of `total` on slot `index` for the instance
/// of `state`; true when every datagram has now arrived (always, for a
/// one-datagram reply). Exactly one of several concurrent last datagrams
/// sees true, and a datagram of an instance whose slot has been freed and
/// taken since counts for nothing (`selector_common::inflight::datagram_step`).
#[inline(always)]
pub fn datagram_arrived(index: u32, state: u64, seq: u16, total: u16) -> bool {
    if total <= 1 {
        return true;
    }
    let Some(p) = INFLIGHT.get_ptr_mut(index) else {
        return false;
    };
    let word = unsafe { &raw mut (*p).datagrams_seen };
    // Each failed compare-and-swap is another datagram of the reply
    // arriving at the same moment: a few at most.
    let mut i = 0;
    while i < 4 {
        let seen = unsafe { read_volatile(word) };
        let Some((next, whole)) = datagram_step(seen, state, seq, total) else {
            return false;
        };
        let (_, won) = unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                word, seen, next,
            )
        };
        if won {
            return whole;
        }
        i += 1;
    }
    // Still contended: set the bit unconditionally, as before tags, so
    // that no datagram is lost (a reply that could never be whole would
    // expire though answered); the rare price is a bit in a slot retaken
    // at this very moment.
    let before =
        unsafe { atomic_or::<u64, u64, { AtomicOrdering::SeqCst }>(word, datagram_bit(seq)) };
    matches!(datagram_step(before, state, seq, total), Some((_, true)))
}

/// The state a claimed request moves to: a redirected read lingers so its
/// late datagrams are still rewritten, and so does a hedged one (`hedged`:
/// the hedge word's SENT, final once a reply won), so that the other reply
/// is still matched, dropped and settled; any other request frees its slot.
#[inline(always)]
pub fn claimed_state(seen: &Seen, hedged: bool) -> u64 {
    if seen.primary != seen.chosen || hedged {
        with_phase(seen.state, PHASE_LINGER)
    } else {
        FREE
    }
}
