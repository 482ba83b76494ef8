//! The in-flight table: an open-addressed array of slots shared by the
//! kernel programs and the agent (the map is `BPF_F_MMAPABLE`, so the agent
//! works on the same memory with the same atomic instructions).
//!
//! Why not a BPF hash map: two races cannot be closed on one.
//! - Reply, sweep and id reuse: a reply reads an entry, the sweep expires
//!   it, the client reuses the id, and the reply's delete by key removes
//!   the *new* entry. A delete by key cannot say which instance it means.
//! - Entry reuse: a preallocated hash element freed by one CPU can be
//!   handed to another key while a reader still holds a pointer to it.
//!
//! Here every slot has one 64-bit `state` word holding a sequence number
//! unique to the request instance (never reused) and a phase. Whoever moves
//! a slot out of `LIVE` with a compare-and-swap on the exact word it read
//! owns that request's accounting: the reply path (completed) or the sweep
//! (expired). A stale actor holds an old sequence number, so its CAS fails
//! whatever happened to the slot since; slot memory is never freed, so a
//! pointer into it never dangles. Fields are written only while the slot is
//! `WRITING` (owned by one inserter) and never change while `LIVE`, so a
//! reader that sees the same state word before and after reading them has a
//! consistent copy.
//!
//! Marks: one bit per slot in a second array, so the agent's sweep visits
//! only the slots that may be occupied instead of the whole table (at 1 M
//! requests the table is 4 M slots, 256 MB), and so the request path can
//! tell a new request from a retransmit by reading one or two mark words
//! instead of the eight cache lines of its probe window. An inserter sets
//! its slot's bit after it takes the slot and before it publishes it. Bits
//! are cleared in two places, each while no inserter can take the slot:
//! - the reply path clears the bit just before the compare-and-swap that
//!   frees the slot (an inserter can take it only after that), and sets it
//!   back if the claim loses;
//! - the agent clears the bit of a slot it sees free (freed by the sweep,
//!   or marked by a losing claim) only while holding it (`AGENT_HOLD`, a
//!   writing state), and releases it after.
//!
//! So a `LIVE` or `LINGER` slot is always marked, except between a reply's
//! clear and its compare-and-swap, when that reply is completing it. The
//! sweep visits the requests still in flight and the slots freed since,
//! never the slot of a request answered and freed by its reply; and a
//! request whose window has no marked slot holding its key is new.

use crate::maps::InflightKey;

/// Slot phases, the low two bits of `state`. A free slot's state is 0.
pub const PHASE_MASK: u64 = 0b11;
/// Outstanding: counted in `issued`, not yet completed or expired.
pub const PHASE_LIVE: u64 = 1;
/// Completed or expired, kept until `timeout + grace` after the send only so
/// that late or further reply datagrams of a redirected read are rewritten.
pub const PHASE_LINGER: u64 = 2;
/// Owned by one inserter while it writes the fields.
pub const PHASE_WRITING: u64 = 3;
/// The free state.
pub const FREE: u64 = 0;

/// Slots probed for one key: a key lives in one of the `PROBE_WINDOW`
/// slots from its home slot. All of them taken means the table is full for
/// that key: the request passes untracked.
pub const PROBE_WINDOW: u32 = 8;

/// The state word of request instance `seq` in `phase`. `seq` is nonzero
/// and unique per instance, so no state word ever repeats.
#[inline(always)]
pub const fn state(seq: u64, phase: u64) -> u64 {
    (seq << 2) | (phase & PHASE_MASK)
}

#[inline(always)]
pub const fn phase(state: u64) -> u64 {
    state & PHASE_MASK
}

/// The same instance in another phase.
#[inline(always)]
pub const fn with_phase(state: u64, phase: u64) -> u64 {
    (state & !PHASE_MASK) | (phase & PHASE_MASK)
}

/// A unique instance number from a per-CPU counter and the CPU's id: CPUs
/// never collide and a CPU's counter only grows (2^50 requests per CPU).
#[inline(always)]
pub const fn sequence(per_cpu_counter: u64, cpu: u32) -> u64 {
    ((per_cpu_counter & ((1 << 50) - 1)) << 12) | (cpu as u64 & 0xfff)
}

/// One slot. 64 bytes: one cache line.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InflightSlot {
    /// `FREE`, or `state(seq, phase)`.
    pub state: u64,
    pub request_id: u64,
    pub client_addr: [u8; 16],
    pub client_port: u16,
    pub group: u16,
    /// Backend ids (< 512).
    pub primary: u16,
    pub chosen: u16,
    /// `bpf_ktime_get_ns` (CLOCK_MONOTONIC) at send.
    pub sent_ns: u64,
    /// Bit `min(seq, 47)` set for each reply datagram seen (multi-datagram
    /// replies complete when every datagram has arrived), under a tag of
    /// the instance in the top 16 bits ([`datagram_step`]).
    pub datagrams_seen: u64,
    /// The hedge word (`crate::hedge`): 0 if the read may never be hedged,
    /// else its instance tag and the hedge's progress bits. The one field
    /// that changes while the slot is `LIVE`, only by compare-and-swap.
    pub hedge: u64,
}

impl InflightSlot {
    /// The key this slot's identity fields make.
    pub fn key(&self) -> InflightKey {
        InflightKey {
            client_addr: self.client_addr,
            client_port: self.client_port,
            _pad: 0,
            group: u32::from(self.group),
            request_id: self.request_id,
        }
    }
}

/// 64-bit mix (splitmix64's finaliser): cheap, and every input bit moves
/// every output bit, so neighbouring ids and ports spread over the table.
#[inline(always)]
pub const fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[inline(always)]
fn addr_words(addr: &[u8; 16]) -> (u64, u64) {
    let mut hi = 0u64;
    let mut lo = 0u64;
    let mut i = 0;
    while i < 8 {
        hi = (hi << 8) | addr[i] as u64;
        lo = (lo << 8) | addr[i + 8] as u64;
        i += 1;
    }
    (hi, lo)
}

/// The hash of a client socket (address and port).
#[inline(always)]
pub fn client_hash(addr: &[u8; 16], port: u16) -> u64 {
    let (hi, lo) = addr_words(addr);
    mix(hi ^ mix(lo ^ mix(u64::from(port))))
}

/// The `CLIENT_PENDING` slot of a client socket.
#[inline(always)]
pub fn client_slot(addr: &[u8; 16], port: u16) -> u32 {
    client_slot_of(client_hash(addr, port))
}

#[inline(always)]
const fn client_slot_of(client_hash: u64) -> u32 {
    (client_hash as u32) & (crate::maps::CLIENT_SLOTS - 1)
}

/// Where a key lives: its home slot hash, and its client socket's
/// `CLIENT_PENDING` slot. One client hash serves both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyHashes {
    pub home: u64,
    pub client_slot: u32,
}

/// Request ids per run of neighbouring pages of the table, and the slots
/// between two ids' homes in a run: 64 ids over 512 slots of 64 bytes,
/// 8 ids to each 4 KB page (and to each `INFLIGHT_MARKS` word).
pub const HOME_RUN: u64 = 64;
pub const HOME_STRIDE: u64 = 8;
const RUN_SLOTS: u64 = HOME_RUN * HOME_STRIDE;

/// A key's home: a place of `RUN_SLOTS` slots hashed from its socket, its
/// group and the run of `HOME_RUN` ids its id falls in, and in it a hashed
/// phase (below the stride) plus `HOME_STRIDE` slots per step of the id in
/// the run. A client numbering its requests in order (memcached's clients
/// do) so writes 8 requests in a row to one page and the next 8 to the
/// page after it, where a hash of the whole id sends each to a random line
/// of the table (16 MB by default, up to 1 GB): a TLB miss per request on
/// top of the cache miss, the most expensive loads of the request path
/// while the CPU idles between reads. The stride keeps a run's live keys
/// apart, and two runs over the same slots interleave unless their phases
/// agree: a socket with many requests in flight fills every 8th slot, not
/// a stretch of neighbours that other keys would probe past (runs of 8
/// neighbouring slots left 4% of keys with their window full at a quarter
/// load: `runs_of_ids_in_flight_leave_windows_free`). Ids that vary only in
/// their high bits still spread, one run each; random ids (DNS) spread as
/// before; a table smaller than a run spreads by the phase and the stride.
#[inline(always)]
pub fn key_hashes(key: &InflightKey) -> KeyHashes {
    let c = client_hash(&key.client_addr, key.client_port);
    let run = key.request_id / HOME_RUN;
    let base = mix(c ^ mix(run ^ (u64::from(key.group) << 48)));
    let in_run = base % HOME_STRIDE + key.request_id % HOME_RUN * HOME_STRIDE;
    KeyHashes {
        home: (base & !(RUN_SLOTS - 1)) | in_run,
        client_slot: client_slot_of(c),
    }
}

/// Slot count for a table that must hold `inflight_max` requests: a power of
/// two at least four times as large. At a quarter full, about 1 insert in
/// 10,000 finds its 8-slot window taken (at half full, 1 in 200).
pub const fn slots_for(inflight_max: u32) -> u32 {
    let want = if inflight_max == 0 {
        4
    } else {
        inflight_max as u64 * 4
    };
    let slots = want.next_power_of_two();
    if slots > 1 << 31 {
        1 << 31
    } else {
        slots as u32
    }
}

/// Slots per mark word.
pub const MARK_BITS: u32 = 64;

/// Mark words for a table of `slots` slots (at least one).
pub const fn mark_words(slots: u32) -> u32 {
    let words = slots.div_ceil(MARK_BITS);
    if words == 0 { 1 } else { words }
}

/// Slot `index`'s mark: (word, bit within it).
#[inline(always)]
pub const fn mark_of(index: u32) -> (u32, u64) {
    (index / MARK_BITS, 1 << (index % MARK_BITS))
}

/// The mark words a probe window reads: the word of its home slot and the
/// next one (wrapping; the same word when the table has one), where a
/// window that crosses a word boundary continues.
#[inline(always)]
pub const fn window_mark_words(home: u32, mask: u32) -> (u32, u32) {
    let word = home / MARK_BITS;
    let last = mask / MARK_BITS;
    (word, if word >= last { 0 } else { word + 1 })
}

/// The marks of the probe window starting at slot `home` (bit `i` for
/// probe `i`), from the two words `window_mark_words` names (`first`,
/// `next`). Straight-line, for the kernel verifier.
#[inline(always)]
pub const fn window_marks(home: u32, mask: u32, first: u64, next: u64) -> u64 {
    let mut marks = 0u64;
    let mut i = 0;
    while i < PROBE_WINDOW {
        // 1 once the window has crossed into the next word (never in a
        // table of one word: its home + 7 stays below 64).
        let crossed = (((home % MARK_BITS) + i) / MARK_BITS) as u64;
        let word = first ^ ((first ^ next) & crossed.wrapping_neg());
        let bit = (word >> (probe(home as u64, i, mask) % MARK_BITS)) & 1;
        marks |= bit << i;
        i += 1;
    }
    marks
}

/// Whether the instance of `state` (with hedge word `word`) is the one the
/// application still waits on: live, and no reply of it has reached the
/// application. A request whose key a current instance holds is a
/// retransmit of it; a key holds at most one current instance, the newest
/// (a new instance is made only when none is current).
#[inline(always)]
pub const fn is_current(state: u64, word: u64) -> bool {
    phase(state) == PHASE_LIVE && !crate::hedge::answered(word, state)
}

/// Whether a new instance of a key may take the slot of an older one (in
/// `state`, hedge word `word`) when no slot of its window is free: the
/// older one lingers (answered or expired) and none of its counts is open
/// (no hedge target still to settle). Its only use was to rewrite or drop
/// its late replies, and a newer instance of its key supersedes it: while
/// the newer one is current, those replies are dropped as stale anyway.
/// Without this, a client that reuses one id fills its window with
/// lingering instances (`timeout + grace` each) and its next requests pass
/// untracked, their replies taken for the lingering ones'.
#[inline(always)]
pub const fn superseded(state: u64, word: u64) -> bool {
    phase(state) == PHASE_LINGER
        && !(crate::hedge::same_instance(word, state) && crate::hedge::target_open(word))
}

/// The members (bit per position) at which the instance of `state`
/// (chosen backend `chosen`, hedge word `word`) has a count open: the
/// member it was sent to while it is live, and its hedge target until that
/// is settled. A hedge of another instance of the key is never sent to
/// one of them: both requests would then await that member's reply to one
/// id, which tells them apart only by the order it answers them in.
#[inline(always)]
pub const fn open_members(state: u64, chosen: u32, word: u64) -> u8 {
    let mut mask = 0u8;
    if phase(state) == PHASE_LIVE {
        mask |= 1 << (chosen as usize % crate::MAX_GROUP_MEMBERS);
    }
    if (phase(state) == PHASE_LIVE || phase(state) == PHASE_LINGER)
        && crate::hedge::same_instance(word, state)
        && crate::hedge::target_open(word)
    {
        mask |= 1 << (crate::hedge::target(word) % crate::MAX_GROUP_MEMBERS);
    }
    mask
}

/// Bits of [`InflightSlot::datagrams_seen`] for datagrams; the 16 above
/// them tag the instance.
pub const DATAGRAM_BITS: u32 = 48;

#[inline(always)]
const fn datagram_tag(state: u64) -> u64 {
    mix(state >> 2) & 0xffff
}

/// The datagram word an instance in `state` starts with: its tag, no
/// datagram seen.
#[inline(always)]
pub const fn datagrams_open(state: u64) -> u64 {
    datagram_tag(state) << DATAGRAM_BITS
}

/// The bit of reply datagram `seq` in the datagram word.
#[inline(always)]
pub const fn datagram_bit(seq: u16) -> u64 {
    let last = DATAGRAM_BITS as u16 - 1;
    1u64 << if seq < last { seq } else { last }
}

/// Reply datagram `seq` of `total` arriving for the instance of `state`,
/// whose slot's datagram word reads `word`: the word with its bit set, and
/// whether that makes the reply whole (true for one caller of several
/// racing last datagrams, the one whose compare-and-swap sets it). `None`
/// if the word is another instance's: the slot was freed and taken since
/// the reply read it, and the bit must not count for the new request. A
/// reply of more than 48 datagrams is whole once datagrams 0-46 and any
/// later one have arrived.
///
/// A word with tag 0 is taken as any instance's: slots written by an
/// earlier build (adopted pins, an upgrade's moment with the old egress
/// still attached) hold no tag, and their replies must still complete.
#[inline(always)]
pub const fn datagram_step(word: u64, state: u64, seq: u16, total: u16) -> Option<(u64, bool)> {
    let tag = word >> DATAGRAM_BITS;
    if tag != 0 && tag != datagram_tag(state) {
        return None;
    }
    let bit = datagram_bit(seq);
    let all = if total >= DATAGRAM_BITS as u16 {
        (1u64 << DATAGRAM_BITS) - 1
    } else {
        (1u64 << total) - 1
    };
    let next = word | bit;
    Some((next, word & all != all && next & all == all))
}

/// What an instance of a key is to a reply from one backend, by rank: the
/// reply path gives a reply to the instance of the highest rank in the
/// key's window ([`reply_rank`]).
///
/// Why this order. The application reuses an id once it has its answer,
/// or gives up on it; so a key may have, beside its one current instance,
/// older ones: an answered read whose other copy (hedged) is still out, or
/// a read moved to another replica and answered or expired, lingering so
/// its late datagrams are rewritten. A reply says only its id and where
/// it comes from. A backend with the count of an older instance still open
/// was sent that request before the current one (the current one was made
/// after the older was answered or ended), so its next reply is the older
/// one's: FIFO, as a replica answers one client. A backend whose count is
/// already ended (answered, or expired) sends only duplicates and late
/// replies; the current instance comes first there, since its reply is
/// awaited and theirs is not.
pub mod rank {
    /// Not sent to this backend.
    pub const UNRELATED: u64 = 0;
    /// Sent to this backend, whose count of it has ended (its reply came,
    /// or it expired): a duplicate or a late reply.
    pub const LATE: u64 = 1;
    /// The current instance ([`super::is_current`]), sent to this backend.
    pub const CURRENT: u64 = 2;
    /// An older instance whose count at this backend is still open: the
    /// member it went to, answered by its hedge's reply first, or the
    /// hedge target of one answered (or ended) by the other member.
    pub const OPEN: u64 = 3;
}

/// The [`rank`] of one instance of a key for a reply from backend `from`,
/// and whether the instance is current: `state` and `word` are the slot's
/// state and hedge words, `chosen` the backend it was sent to, `group`
/// the key's group. The reply path reads every instance of the key in its
/// window and gives the reply to the one of the highest rank; if that one
/// is not current but a current one exists, the reply is an older
/// instance's while the application waits on a newer one: its counts end
/// as always, but it is dropped, not delivered as the newer one's answer.
#[inline(always)]
pub fn reply_rank(state: u64, chosen: u32, word: u64, group: u32, from: u32) -> (u64, bool) {
    use crate::hedge;
    let word = if hedge::same_instance(word, state) {
        word
    } else {
        0
    };
    let live = phase(state) == PHASE_LIVE;
    let current = is_current(state, word);
    let to_target = hedge::is_sent(word) && crate::backend_id(group, hedge::target(word)) == from;
    let rank = if chosen != from && !to_target {
        rank::UNRELATED
    } else if current {
        rank::CURRENT
    } else if (live && chosen == from) || (to_target && hedge::target_open(word)) {
        rank::OPEN
    } else {
        rank::LATE
    };
    (rank, current)
}

/// The state the agent puts a free slot in while it clears the slot's
/// stale mark, so no inserter can take the slot, and set the bit, in
/// between: a writing phase with sequence 0, which no request instance
/// has (see `sequence`).
pub const AGENT_HOLD: u64 = state(0, PHASE_WRITING);

/// The `i`-th slot of the probe window of `hash` in a table of `mask + 1`
/// slots.
#[inline(always)]
pub const fn probe(hash: u64, i: u32, mask: u32) -> u32 {
    ((hash as u32).wrapping_add(i)) & mask
}

#[cfg(test)]
mod tests {
    extern crate std;
    use std::{vec, vec::Vec};

    use super::*;

    fn key(id: u64, port: u16) -> InflightKey {
        InflightKey::ipv4([10, 0, 0, 1], port, 0, id)
    }

    #[test]
    fn slot_is_one_cache_line() {
        assert_eq!(core::mem::size_of::<InflightSlot>(), 64);
    }

    #[test]
    fn states_are_unique_per_instance_and_phase() {
        let s = state(sequence(7, 3), PHASE_LIVE);
        assert_eq!(phase(s), PHASE_LIVE);
        assert_eq!(phase(with_phase(s, PHASE_LINGER)), PHASE_LINGER);
        assert_eq!(with_phase(with_phase(s, PHASE_LINGER), PHASE_LIVE), s);
        assert_ne!(
            state(sequence(7, 3), PHASE_LIVE),
            state(sequence(7, 4), PHASE_LIVE)
        );
        assert_ne!(
            state(sequence(7, 3), PHASE_LIVE),
            state(sequence(8, 3), PHASE_LIVE)
        );
        // Never the free word, whatever the counter and CPU.
        for (c, cpu) in [(0, 0), (1, 0), (0, 1), (u64::MAX, 4095)] {
            let seq = sequence(c, cpu);
            if seq != 0 {
                assert_ne!(state(seq, PHASE_LIVE), FREE);
            }
        }
    }

    #[test]
    fn slot_holds_exactly_its_key() {
        let k = key(0x1234, 40000);
        let slot = InflightSlot {
            request_id: k.request_id,
            client_addr: k.client_addr,
            client_port: k.client_port,
            group: 0,
            ..Default::default()
        };
        assert_eq!(slot.key(), k);
        assert_ne!(slot.key(), key(0x1235, 40000));
        assert_ne!(slot.key(), key(0x1234, 40001));
        let mut other_group = k;
        other_group.group = 1;
        assert_ne!(slot.key(), other_group);
    }

    #[test]
    fn table_size_is_a_power_of_two_with_headroom() {
        assert_eq!(slots_for(1), 4);
        assert_eq!(slots_for(1000), 4096);
        assert_eq!(slots_for(65536), 262144);
        assert_eq!(slots_for(u32::MAX), 1 << 31);
    }

    #[test]
    fn every_slot_has_its_own_mark() {
        assert_eq!(mark_words(4), 1);
        assert_eq!(mark_words(64), 1);
        assert_eq!(mark_words(65), 2);
        assert_eq!(mark_words(slots_for(1_000_000)), (1 << 22) / 64);
        let slots = 256u32;
        let mut seen = [0u64; 4];
        for i in 0..slots {
            let (word, bit) = mark_of(i);
            assert!(word < mark_words(slots));
            assert_eq!(bit.count_ones(), 1);
            assert_eq!(seen[word as usize] & bit, 0, "slot {i} shares a mark");
            seen[word as usize] |= bit;
        }
        assert!(seen.iter().all(|&w| w == u64::MAX));
    }

    /// Bit `i` set when the slot of probe `i` is marked, computed the slow
    /// way.
    fn marks_by_slot(home: u32, mask: u32, marked: &[u32]) -> u64 {
        (0..PROBE_WINDOW)
            .filter(|&i| marked.contains(&probe(u64::from(home), i, mask)))
            .fold(0, |m, i| m | 1 << i)
    }

    fn words_of(mask: u32, marked: &[u32]) -> Vec<u64> {
        let mut words = vec![0u64; mark_words(mask + 1) as usize];
        for &slot in marked {
            let (w, bit) = mark_of(slot);
            words[w as usize] |= bit;
        }
        words
    }

    #[test]
    fn window_marks_read_the_window_from_one_or_two_words() {
        for mask in [3u32, 31, 63, 127, 1023] {
            // Every slot marked by a pattern that differs per slot.
            let marked: Vec<u32> = (0..=mask).filter(|s| s % 3 != 1 && s % 7 != 2).collect();
            let words = words_of(mask, &marked);
            for home in 0..=mask {
                let (a, b) = window_mark_words(home, mask);
                assert!(a < words.len() as u32 && b < words.len() as u32);
                assert_eq!(
                    window_marks(home, mask, words[a as usize], words[b as usize]),
                    marks_by_slot(home, mask, &marked),
                    "mask {mask}, home {home}"
                );
            }
        }
        // Crossing a word, and wrapping from the table's last word to 0.
        assert_eq!(window_mark_words(60, 1023), (0, 1));
        assert_eq!(window_mark_words(1020, 1023), (15, 0));
        let words = words_of(1023, &[1023, 0, 2]);
        assert_eq!(window_marks(1020, 1023, words[15], words[0]), 0b0101_1000);
    }

    #[test]
    fn a_reply_goes_to_an_older_open_instance_first_then_the_current_one() {
        use crate::hedge::{
            TARGET_SETTLED, WON_CHOSEN, WON_HEDGE, claimed_word, open_word, settling_word,
        };
        let (p, r, q) = (0u32, 1u32, 2u32);
        // A: sent to P, hedged to R, R's reply won: P's count is open.
        let a = state(sequence(1, 0), PHASE_LIVE);
        let won_hedge = claimed_word(open_word(a), 1) | WON_HEDGE | TARGET_SETTLED;
        assert!(is_current(a, open_word(a)));
        assert!(is_current(a, claimed_word(open_word(a), 1)));
        assert!(!is_current(a, won_hedge), "answered");
        assert_eq!(reply_rank(a, p, won_hedge, 0, p), (rank::OPEN, false));
        assert_eq!(reply_rank(a, p, won_hedge, 0, r), (rank::LATE, false));
        assert_eq!(reply_rank(a, p, won_hedge, 0, q), (rank::UNRELATED, false));
        // B: the id reused, sent to P too: current, ranked below A at P.
        let b = state(sequence(2, 0), PHASE_LIVE);
        assert!(is_current(b, 0));
        assert_eq!(reply_rank(b, p, 0, 0, p), (rank::CURRENT, true));
        assert_eq!(reply_rank(b, p, 0, 0, r), (rank::UNRELATED, true));
        const { assert!(rank::OPEN > rank::CURRENT && rank::CURRENT > rank::LATE) };
        // A word of another instance (A's, read in B's slot) is no word.
        assert_eq!(reply_rank(b, p, won_hedge, 0, p), (rank::CURRENT, true));
        // P's first reply completed A (it lingers: hedged): P's next is B's.
        let a_done = with_phase(a, PHASE_LINGER);
        assert_eq!(reply_rank(a_done, p, won_hedge, 0, p), (rank::LATE, false));
        // B hedged to R: R's replies are B's, A's count there being ended.
        let b_hedged = claimed_word(open_word(b), 1);
        assert_eq!(reply_rank(b, p, b_hedged, 0, r), (rank::CURRENT, true));
        // A answered by P, its copy to R still out: R's next reply is A's.
        let won_chosen = claimed_word(open_word(a), 1) | WON_CHOSEN;
        assert!(!is_current(a, won_chosen));
        assert_eq!(reply_rank(a_done, p, won_chosen, 0, r), (rank::OPEN, false));
        let settled = settling_word(won_chosen).unwrap();
        assert_eq!(reply_rank(a_done, p, settled, 0, r), (rank::LATE, false));
        // A read moved to R, answered or expired, lingering: late at R.
        assert_eq!(reply_rank(a_done, r, 0, 0, r), (rank::LATE, false));
        assert_eq!(reply_rank(a_done, r, 0, 0, p), (rank::UNRELATED, false));
        // The target is a position in the key's group.
        let g1 = claimed_word(open_word(b), 1);
        let (p1, r1) = (crate::backend_id(1, 0), crate::backend_id(1, 1));
        assert_eq!(reply_rank(b, p1, g1, 1, r1), (rank::CURRENT, true));
        assert_eq!(reply_rank(b, p1, g1, 1, r), (rank::UNRELATED, true));
    }

    #[test]
    fn only_a_lingering_instance_with_no_open_count_is_superseded() {
        use crate::hedge::{
            TARGET_SETTLED, WON_CHOSEN, WON_HEDGE, claimed_word, open_word, settling_word,
        };
        let live = state(sequence(3, 0), PHASE_LIVE);
        let linger = with_phase(live, PHASE_LINGER);
        // Never hedged, or hedgeable and never sent.
        assert!(superseded(linger, 0));
        assert!(superseded(linger, open_word(live)));
        // A hedge sent and its target settled: nothing open.
        let won = claimed_word(open_word(live), 1) | WON_HEDGE | TARGET_SETTLED;
        assert!(superseded(linger, won));
        // Its target's count still open: taking the slot would leak it.
        let out = claimed_word(open_word(live), 1) | WON_CHOSEN;
        assert!(!superseded(linger, out));
        assert!(superseded(linger, settling_word(out).unwrap()));
        // A word of another instance says nothing of this one's counts.
        assert!(superseded(
            linger,
            open_word(state(sequence(4, 0), PHASE_LIVE))
        ));
        // Live (counts open) or being written: never.
        assert!(!superseded(live, 0));
        assert!(!superseded(with_phase(live, PHASE_WRITING), 0));
        assert!(!superseded(FREE, 0));
    }

    #[test]
    fn open_members_are_the_live_chosen_and_an_unsettled_target() {
        use crate::hedge::{TARGET_SETTLED, WON_CHOSEN, WON_HEDGE, claimed_word, open_word};
        let live = state(sequence(5, 0), PHASE_LIVE);
        let linger = with_phase(live, PHASE_LINGER);
        // Chosen backend id 10 is position 2 of group 1.
        assert_eq!(open_members(live, 10, 0), 0b100);
        assert_eq!(open_members(linger, 10, 0), 0);
        let sent = claimed_word(open_word(live), 1);
        assert_eq!(open_members(live, 10, sent), 0b110);
        assert_eq!(open_members(linger, 10, sent | WON_CHOSEN), 0b010);
        assert_eq!(
            open_members(live, 10, sent | WON_HEDGE | TARGET_SETTLED),
            0b100
        );
        assert_eq!(open_members(linger, 10, sent | TARGET_SETTLED), 0);
        assert_eq!(open_members(FREE, 10, sent), 0);
    }

    #[test]
    fn datagrams_count_only_for_their_own_instance() {
        let a = state(sequence(11, 2), PHASE_LIVE);
        let b = state(sequence(12, 2), PHASE_LIVE);
        let open = datagrams_open(a);
        assert_eq!(open & ((1 << DATAGRAM_BITS) - 1), 0);
        // Three datagrams: only the last to arrive completes, once.
        let (w, done) = datagram_step(open, a, 2, 3).unwrap();
        assert!(!done);
        let (w, done) = datagram_step(w, a, 0, 3).unwrap();
        assert!(!done);
        let (w, done) = datagram_step(w, a, 1, 3).unwrap();
        assert!(done);
        assert_eq!(datagram_step(w, a, 1, 3), Some((w, false)), "a duplicate");
        // The slot taken by another instance: the bit is not its.
        assert_ne!(datagrams_open(b), open);
        assert_eq!(datagram_step(datagrams_open(b), a, 0, 3), None);
        // An untagged word (an earlier build's slot) is any instance's.
        assert_ne!(datagrams_open(a), 0);
        let (w, done) = datagram_step(0, a, 1, 2).unwrap();
        assert_eq!((w, done), (datagram_bit(1), false));
        assert_eq!(datagram_step(w, a, 0, 2), Some((0b11, true)));
        // Same instance in another phase: same tag.
        assert_eq!(datagrams_open(with_phase(a, PHASE_LINGER)), open);
        // Long replies: datagrams 0-46 and any later one.
        let mut w = open;
        for seq in 0..47 {
            let (next, done) = datagram_step(w, a, seq, 100).unwrap();
            assert!(!done, "{seq}");
            w = next;
        }
        assert!(datagram_step(w, a, 99, 100).unwrap().1);
    }

    #[test]
    fn the_agent_hold_is_no_request_state() {
        assert_eq!(phase(AGENT_HOLD), PHASE_WRITING);
        for (c, cpu) in [(1, 0), (1, 4095), ((1 << 50) - 1, 7)] {
            assert_ne!(state(sequence(c, cpu), PHASE_WRITING), AGENT_HOLD);
        }
    }

    #[test]
    fn probe_wraps_within_the_table() {
        assert_eq!(probe(6, 0, 7), 6);
        assert_eq!(probe(6, 3, 7), 1);
        assert_eq!(probe(u64::MAX, 1, 1023), 0);
    }

    #[test]
    fn a_sockets_ids_in_order_share_a_page() {
        // Slots per 4 KB page.
        const PAGE: u32 = 64;
        let mask = (1u32 << 20) - 1;
        for port in [40000u16, 40001, 5353] {
            let home = |id| probe(key_hashes(&key(id, port)).home, 0, mask);
            for run in [0u64, 1, 4096 / HOME_RUN] {
                let first = run * HOME_RUN;
                for id in first + 1..first + HOME_RUN {
                    assert_eq!(
                        home(id) - home(id - 1),
                        HOME_STRIDE as u32,
                        "port {port} id {id}"
                    );
                    // 8 in a row to a page, and to a mark word.
                    let first_of_page = id - id % 8;
                    assert_eq!(home(id) / PAGE, home(first_of_page) / PAGE, "id {id}");
                    assert_eq!(home(id) / MARK_BITS, home(first_of_page) / MARK_BITS);
                }
            }
            assert!(
                home(HOME_RUN).abs_diff(home(HOME_RUN - 1)) > RUN_SLOTS as u32,
                "port {port}: the next run elsewhere"
            );
        }
    }

    /// Full probe windows among `per_socket` ids in order from each of 16
    /// sockets (ports from `first_port`), sent interleaved, into a table a
    /// quarter full, with homes from `home_of`.
    fn full_windows(first_port: u16, home_of: impl Fn(&InflightKey) -> u64) -> u32 {
        let slots = 1u32 << 16;
        let mask = slots - 1;
        let mut taken = std::vec![false; slots as usize];
        let (sockets, per_socket) = (16u16, u64::from(slots / 4) / 16);
        let mut full = 0;
        for id in 0..per_socket {
            for s in 0..sockets {
                let home = home_of(&key(id, first_port + s));
                match (0..PROBE_WINDOW)
                    .map(|i| probe(home, i, mask))
                    .find(|&j| !taken[j as usize])
                {
                    Some(j) => taken[j as usize] = true,
                    None => full += 1,
                }
            }
        }
        full
    }

    /// Sockets with many requests in flight at once, each numbering them in
    /// order, at the table's design load (a quarter full): about as few
    /// keys find their probe window full as with every id hashed alone (the
    /// layout before runs: a few in 100,000), where runs of 8 neighbouring
    /// slots left 4% and runs of 16 at a stride of 4 0.3%.
    #[test]
    fn runs_of_ids_in_flight_leave_windows_free() {
        let hashed_alone = |k: &InflightKey| {
            let c = client_hash(&k.client_addr, k.client_port);
            mix(c ^ mix(k.request_id ^ (u64::from(k.group) << 48)))
        };
        let (mut runs, mut alone) = (0, 0);
        for b in 0..8 {
            runs += full_windows(20_000 + 16 * b, |k| key_hashes(k).home);
            alone += full_windows(20_000 + 16 * b, hashed_alone);
        }
        std::println!("full windows: {runs} with runs, {alone} hashed alone, of 131072 keys");
        assert!(
            runs <= 2 * alone + 8,
            "{runs} keys found their window full, {alone} with every id hashed alone"
        );
    }

    #[test]
    fn hashes_spread_sequential_ids_and_ports() {
        // 4096 sequential ids from one socket over 8192 slots: no probe
        // window may see more than a handful of them.
        let mask = 8191u32;
        let mut load = [0u8; 8192];
        for id in 0..4096u64 {
            load[probe(key_hashes(&key(id, 40000)).home, 0, mask) as usize] += 1;
        }
        assert!(
            load.iter().all(|&n| n <= 6),
            "clustered: {:?}",
            load.iter().max()
        );
        assert_ne!(
            client_hash(&key(1, 1).client_addr, 1),
            client_hash(&key(1, 2).client_addr, 2)
        );
        let k = key(7, 40000);
        assert_eq!(
            key_hashes(&k).client_slot,
            client_slot(&k.client_addr, k.client_port)
        );
    }
}
