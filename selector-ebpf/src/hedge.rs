//! Hedged reads, kernel side: hand each tracked read to the agent's timer
//! (egress), and on the reply path decide which of the two replies reaches
//! the application and settle the hedge target's accounting. The protocol
//! is in `selector_common::hedge`.

use core::{
    ffi::c_void,
    intrinsics::{AtomicOrdering, atomic_cxchg},
    ptr::read_volatile,
};

use aya_ebpf::{bindings::BPF_RB_NO_WAKEUP, helpers::bpf_skb_load_bytes, programs::TcContext};
use selector_common::hedge::{
    AnswerStep, HedgeEvent, HedgeStats, PAYLOAD_MAX, answer_step, open_word, same_instance,
    settling_word,
};

use crate::{
    inflight::Reserved,
    maps::{HEDGE_CONFIG, HEDGE_EVENTS, HEDGE_STATS, INFLIGHT},
    packet::Datagram,
};

/// Compare-and-swaps a hedge word can see for one instance: at most one each
/// of SENT, TARGET_SETTLED, CLOSED, a WON bit and the two HELD bits change
/// it under a reader.
const WORD_RETRIES: u32 = 7;

/// Bumps one per-CPU hedging counter of `backend`.
#[inline(always)]
pub fn count(backend: u32, field: impl FnOnce(&mut HedgeStats) -> &mut u64) {
    if let Some(s) = HEDGE_STATS.get_ptr_mut(backend) {
        *field(unsafe { &mut *s }) += 1;
    }
}

/// Offers a tracked read to the agent: the hedge word its slot starts with
/// (0: never hedged, because hedging is off, the read is too long, or the
/// ring buffer is full; the last two are counted at `primary`).
///
/// Written so that nothing here branches on the request's length as the
/// parser computed it. The verifier tracks exactly every value that a branch
/// it can decide, or a helper's size argument, depends on, back along the
/// whole path that produced it: checking `dgram.payload_len` here made the
/// parser's length exact in every state of the egress program, which then
/// stopped merging the paths through the policy loops that differ only in
/// that length (617,000 instructions verified instead of 292,000). So the
/// length goes into the event first and is checked as read back from it
/// (the verifier knows nothing of ring buffer contents); a read too long to
/// hedge costs a reservation and a discard.
#[inline(always)]
pub fn offer(
    ctx: &TcContext,
    dgram: &Datagram,
    slot: &Reserved,
    primary: u32,
    chosen: u32,
    sent_ns: u64,
) -> u64 {
    if !HEDGE_CONFIG.get(0).is_some_and(|c| c.enabled != 0) {
        return 0;
    }
    let Some(mut entry) = HEDGE_EVENTS.reserve::<HedgeEvent>(0) else {
        count(primary, |s| &mut s.ring_full);
        return 0;
    };
    let event = entry.as_mut_ptr();
    let state = slot.live_state();
    let copied = unsafe {
        (*event).state = state;
        (*event).sent_ns = sent_ns;
        (*event).index = slot.index();
        (*event).primary = primary as u16;
        (*event).chosen = chosen as u16;
        // Below 64 KiB: a UDP payload.
        (*event).len = dgram.payload_len as u32;
        (*event)._pad = 0;
        let len = read_volatile(&raw const (*event).len);
        if len == 0 || len as usize > PAYLOAD_MAX {
            1
        } else {
            // The same length in 1..=PAYLOAD_MAX, in a form every verifier
            // bounds: 6.12's does not carry the checks above to the
            // helper's size argument ("invalid zero-sized read").
            let len = ((len - 1) & (PAYLOAD_MAX as u32 - 1)) + 1;
            bpf_skb_load_bytes(
                ctx.skb.skb as *const _,
                dgram.ip.layout.payload() as u32,
                (&raw mut (*event).payload) as *mut c_void,
                len,
            )
        }
    };
    if copied != 0 {
        entry.discard(0);
        count(primary, |s| &mut s.too_large);
        return 0;
    }
    // No wakeup: the agent drains the ring on its own timer, at least twice
    // per hedge delay, so a read costs no wakeup of a sleeping reader.
    entry.submit(u64::from(BPF_RB_NO_WAKEUP));
    open_word(state)
}

#[inline(always)]
fn word_ptr(index: u32) -> Option<*mut u64> {
    let p = INFLIGHT.get_ptr_mut(index)?;
    Some(unsafe { &raw mut (*p).hedge })
}

#[inline(always)]
fn cas(p: *mut u64, from: u64, to: u64) -> bool {
    let (_, won) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(p, from, to)
    };
    won
}

/// Who answers a hedgeable read, as decided for this reply.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// This reply (or an earlier datagram of it) reaches the application.
    /// `first`: this call made the decision. `word`: the hedge word it was
    /// made on (its SENT bit and target are final from then on).
    Mine { first: bool, word: u64 },
    /// The other reply did: drop this one.
    Theirs,
    /// An error, while the other copy may still answer: drop it
    /// (`selector_common::hedge::answer_step`).
    Held,
    /// The slot holds another instance now: this reply matches nothing.
    Gone,
}

/// Decides whether this reply (`mine`: `WON_CHOSEN` or `WON_HEDGE`; `error`:
/// an error reply; `chosen_live`: the chosen member's count was open when
/// the slot was read) reaches the application, on the hedge word of slot
/// `index` while it holds the instance of `state`.
#[inline(always)]
pub fn answer(index: u32, state: u64, mine: u64, error: bool, chosen_live: bool) -> Answer {
    let Some(p) = word_ptr(index) else {
        return Answer::Gone;
    };
    let mut i = 0;
    while i < WORD_RETRIES {
        let word = unsafe { read_volatile(p) };
        if !same_instance(word, state) {
            return Answer::Gone;
        }
        match answer_step(word, mine, error, chosen_live) {
            AnswerStep::AlreadyMine => {
                return Answer::Mine { first: false, word };
            }
            AnswerStep::Lost => return Answer::Theirs,
            AnswerStep::Held => return Answer::Held,
            AnswerStep::Claim(next) => {
                if cas(p, word, next) {
                    return Answer::Mine { first: true, word };
                }
            }
            AnswerStep::Hold(next) => {
                if cas(p, word, next) {
                    return Answer::Held;
                }
            }
        }
        i += 1;
    }
    // Unreachable by the bound above; never drop what cannot be decided.
    Answer::Gone
}

/// What `answer` would decide, without deciding anything: for a stale
/// reply, which reaches the application in no case. `Theirs` if the other
/// reply won (this one is a loser, as any), `Mine` if this side did,
/// `Gone` if nobody did yet or the slot holds another instance.
#[inline(always)]
pub fn peek(index: u32, state: u64, mine: u64) -> Answer {
    let Some(p) = word_ptr(index) else {
        return Answer::Gone;
    };
    let word = unsafe { read_volatile(p) };
    if !same_instance(word, state) {
        return Answer::Gone;
    }
    match answer_step(word, mine, false, false) {
        AnswerStep::AlreadyMine => Answer::Mine { first: false, word },
        AnswerStep::Lost => Answer::Theirs,
        AnswerStep::Claim(_) | AnswerStep::Hold(_) | AnswerStep::Held => Answer::Gone,
    }
}

/// Ends the hedge target's accounting for the instance of `state` in slot
/// `index`; true for the one caller (this reply path or the agent's sweep)
/// that does.
#[inline(always)]
pub fn settle_target(index: u32, state: u64) -> bool {
    let Some(p) = word_ptr(index) else {
        return false;
    };
    let mut i = 0;
    while i < WORD_RETRIES {
        let word = unsafe { read_volatile(p) };
        if !same_instance(word, state) {
            return false;
        }
        let Some(next) = settling_word(word) else {
            return false;
        };
        if cas(p, word, next) {
            return true;
        }
        i += 1;
    }
    false
}
