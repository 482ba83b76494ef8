//! Hedged reads (The Tail at Scale): a read still pending after a delay gets
//! one copy, with the same request id, sent to the least pending other
//! usable member of its group; the first reply reaches the application and
//! the later one is dropped in the kernel.
//!
//! The egress program hands each tracked read to the agent through a ring
//! buffer ([`HedgeEvent`]: slot, state word, send time, request bytes). The
//! agent keeps a timer queue; at the delay it checks in the shared slot that
//! the same request instance is still live and unanswered, claims the hedge
//! with a compare-and-swap on the slot's *hedge word*, counts the copy in
//! the target's `issued`, and sends it from the client's own address and
//! port through a raw socket (carrying the `--mark` bit, so egress passes it
//! untouched).
//!
//! The hedge word is separate from the state word so that the fields a
//! reader copies while a slot is `LIVE` never change. It is written once by
//! the inserter (while it owns the slot), and afterwards only gains bits,
//! each by a compare-and-swap of the exact word read. Its top bits are a tag
//! of the request instance, so an actor holding a word of an older instance
//! of the slot can never change a newer one's.
//!
//! ```text
//! bit  0      SENT            the agent claimed the hedge and counted it issued at the target
//! bit  1      TARGET_SETTLED  the target's accounting ended (its reply, or expiry by the sweep)
//! bit  2      WON_CHOSEN      the reply of the member the read went to reached the application
//! bit  3      WON_HEDGE       the hedge target's reply reached the application
//! bit  4      CLOSED          the sweep expired the read before any hedge: none may start
//! bits 5-7    target position in the group (valid with SENT)
//! bit  8      HELD_CHOSEN     the chosen member's reply was an error, dropped while the target's copy was pending
//! bit  9      HELD_HEDGE      the target's reply was an error, dropped while the chosen member's copy was pending
//! bits 10-63  instance tag (from the state word's sequence number)
//! ```
//!
//! Error replies ([`answer_step`]): with a hedge out, an error reply does
//! not win while the other copy may still answer; it is dropped and its
//! HELD bit set, so that the other copy's reply wins if it is good, and
//! passes too if it is an error as well (an error reaches the application
//! only when both copies fail). The kernel keeps no packet: if the other
//! copy never answers (it expires), nothing reaches the application, which
//! retries or times out as it would on a lost reply.
//!
//! A word of 0 means "never hedged": hedging was off, the read did not fit
//! the event, or the ring buffer was full. The agent claims only from the
//! *open* word (tag, no bits), so once a reply won or the sweep closed the
//! read, no hedge can start; and SENT, once set, is final, so whoever ends
//! the chosen member's accounting knows whether the slot must linger for
//! the other reply.

use crate::{latency, policy::GroupLoad};

pub const SENT: u64 = 1 << 0;
pub const TARGET_SETTLED: u64 = 1 << 1;
pub const WON_CHOSEN: u64 = 1 << 2;
pub const WON_HEDGE: u64 = 1 << 3;
pub const CLOSED: u64 = 1 << 4;
pub const HELD_CHOSEN: u64 = 1 << 8;
pub const HELD_HEDGE: u64 = 1 << 9;
const WON: u64 = WON_CHOSEN | WON_HEDGE;
const TARGET_SHIFT: u32 = 5;
const TARGET_MASK: u64 = 0b111 << TARGET_SHIFT;
const TAG_SHIFT: u32 = 10;

/// Request bytes (UDP payload) an event carries; a longer read is not hedged.
/// A power of two: the kernel bounds the copy's length with a mask.
pub const PAYLOAD_MAX: usize = 512;
const _: () = assert!(PAYLOAD_MAX.is_power_of_two());

/// Size of the event ring buffer in bytes (a power-of-two number of pages):
/// about 1,900 events. Full: the read is not hedged, counted as `ring_full`.
pub const RING_BYTES: u32 = 1 << 20;

/// Hedges the budget allows beyond `budget × reads`: the token bucket
/// starts full and holds at most this many.
pub const BURST: u64 = 10;

/// `auto` never hedges sooner than this (below it the agent's timer and the
/// scheduler are the noise), nor later than [`AUTO_MAX_NS`] or half the
/// request timeout.
pub const AUTO_MIN_NS: u64 = 500_000;
pub const AUTO_MAX_NS: u64 = 50_000_000;
/// Replies of the primary in the recent window below which `auto` keeps
/// its previous delay (the ceiling before any).
pub const AUTO_MIN_SAMPLES: u64 = 20;

/// Map names, as the kernel object declares them.
pub mod names {
    pub const EVENTS: &str = "HEDGE_EVENTS";
    pub const CONFIG: &str = "HEDGE_CONFIG";
    pub const STATS: &str = "HEDGE_STATS";

    /// Every map above.
    pub const ALL: [&str; 3] = [EVENTS, CONFIG, STATS];
}

/// The instance tag of a state word: 53 bits of its sequence number and a
/// top bit, so a tag is never 0 (an open word is never the "never hedged" 0).
/// 53 bits hold the CPU id and 41 bits of its counter: two instances of
/// one slot with one tag are 2^41 requests of one CPU apart.
#[inline(always)]
pub const fn tag(state: u64) -> u64 {
    let seq = state >> 2;
    (seq & ((1 << 53) - 1)) | (1 << 53)
}

/// The word a hedgeable read starts with: its tag, no bits.
#[inline(always)]
pub const fn open_word(state: u64) -> u64 {
    tag(state) << TAG_SHIFT
}

/// Whether `word` belongs to the instance of `state`.
#[inline(always)]
pub const fn same_instance(word: u64, state: u64) -> bool {
    word != 0 && word >> TAG_SHIFT == tag(state)
}

/// Whether a reply of the instance of `state` reached the application
/// (a WON bit in its own hedge word). An answered instance may stay live
/// for the other member's count, but the application is done with it: it
/// may reuse the id, and a request with that id is a new instance, not a
/// retransmit of this one.
#[inline(always)]
pub const fn answered(word: u64, state: u64) -> bool {
    same_instance(word, state) && word & WON != 0
}

/// Whether the hedge target's count of `word`'s instance is still open:
/// a copy was sent and neither its reply nor the sweep ended its count.
#[inline(always)]
pub const fn target_open(word: u64) -> bool {
    word & SENT != 0 && word & TARGET_SETTLED == 0
}

/// The open word with the hedge to member `target` claimed.
#[inline(always)]
pub const fn claimed_word(open: u64, target: usize) -> u64 {
    open | SENT | (((target as u64) << TARGET_SHIFT) & TARGET_MASK)
}

#[inline(always)]
pub const fn is_sent(word: u64) -> bool {
    word & SENT != 0
}

/// The hedge target's position (meaningful with `SENT`).
#[inline(always)]
pub const fn target(word: u64) -> usize {
    ((word & TARGET_MASK) >> TARGET_SHIFT) as usize
}

/// Which reply reached the application, if one did.
#[inline(always)]
pub const fn winner(word: u64) -> u64 {
    word & WON
}

/// What a reply may do next, given the hedge word it read and its own
/// `won` bit (`WON_CHOSEN` or `WON_HEDGE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AnswerStep {
    /// This side already answers: pass (a further datagram of the winner).
    AlreadyMine,
    /// The other side answered: this reply is the loser, drop it.
    Lost,
    /// Nobody answered yet: try the compare-and-swap to this word.
    Claim(u64),
    /// An error while the other copy may still answer: try the
    /// compare-and-swap to this word (this side's HELD bit), then drop it.
    Hold(u64),
    /// An error of this side was held already (a duplicate): drop it.
    Held,
}

/// The step of a reply of side `mine` (`WON_CHOSEN` or `WON_HEDGE`) on
/// `word`: `error` if the reply is an error
/// (`Descriptor::is_error_reply`); `chosen_live` whether the chosen
/// member's count was still open when the slot was read (its copy may
/// still answer), for a reply of the hedge target.
///
/// The other copy may still answer when a hedge was sent and: for the
/// chosen member's reply, the target's count is open and no error of the
/// target was held; for the target's, the chosen member's count is open
/// and no error of it was held. The target's reply decides on the word
/// before it settles the target's count, so a settled count with no
/// HELD_HEDGE means the sweep expired it: that copy failed.
#[inline(always)]
pub const fn answer_step(word: u64, mine: u64, error: bool, chosen_live: bool) -> AnswerStep {
    let (held_mine, held_other) = if mine == WON_CHOSEN {
        (HELD_CHOSEN, HELD_HEDGE)
    } else {
        (HELD_HEDGE, HELD_CHOSEN)
    };
    let other_pending = word & held_other == 0
        && if mine == WON_CHOSEN {
            target_open(word)
        } else {
            word & SENT != 0 && chosen_live
        };
    if word & mine != 0 {
        AnswerStep::AlreadyMine
    } else if word & WON != 0 {
        AnswerStep::Lost
    } else if error && other_pending {
        if word & held_mine != 0 {
            AnswerStep::Held
        } else {
            AnswerStep::Hold(word | held_mine)
        }
    } else {
        AnswerStep::Claim(word | mine)
    }
}

/// The sweep's closing word for a read it expires: `None` if a hedge was
/// already sent or the word needs nothing (never hedgeable, answered, closed).
#[inline(always)]
pub const fn closing_word(word: u64) -> Option<u64> {
    if word == 0 || word & (SENT | WON | CLOSED) != 0 {
        None
    } else {
        Some(word | CLOSED)
    }
}

/// The word that settles the hedge target's accounting, if it is not yet.
#[inline(always)]
pub const fn settling_word(word: u64) -> Option<u64> {
    if word & SENT == 0 || word & TARGET_SETTLED != 0 {
        None
    } else {
        Some(word | TARGET_SETTLED)
    }
}

/// The members a hedge may go to, given the group's health word
/// ([`crate::GroupHealth::bits`]): not an ejected one, not a half-open
/// one whose probe is still offered, and not a slow one. Its one probe is
/// a read egress sends (egress takes the probe bit); a hedge copy bypasses
/// egress, so it would be a second read to a member that may still be
/// down. A copy to a slow member would only wait as the read does.
#[inline(always)]
pub const fn hedge_usable(usable: u8, health_bits: u64) -> u8 {
    let ejected = crate::ejection::ejected_mask(health_bits) as u8;
    let probing = (health_bits >> crate::ejection::PROBE_SHIFT) as u8;
    let slow = (health_bits >> crate::ejection::SLOW_SHIFT) as u8;
    usable & !ejected & !probing & !slow
}

/// `usable` without the members at or over `max_pending` pending requests
/// (0: no bound): a hedge copy is one more request to its target, and
/// `--max-pending` bounds what the selector sends a member.
pub fn within_max_pending(
    usable: u8,
    pending: &[u64; crate::MAX_GROUP_MEMBERS],
    max_pending: u32,
) -> u8 {
    if max_pending == 0 {
        return usable;
    }
    let mut out = usable;
    for (pos, p) in pending.iter().enumerate() {
        if *p >= u64::from(max_pending) {
            out &= !(1 << pos);
        }
    }
    out
}

/// The hedge target for a read that went to member `chosen`: the first
/// usable member other than `chosen` with the strict minimum pending count.
/// The caller takes ejected members out of `load.usable` first
/// ([`hedge_usable`]).
pub fn choose_target(load: &GroupLoad, chosen: usize) -> Option<usize> {
    let mut best: Option<usize> = None;
    let mut best_pending = u64::MAX;
    for pos in 0..load.len.min(crate::MAX_GROUP_MEMBERS) {
        if pos == chosen || load.usable & (1 << pos) == 0 {
            continue;
        }
        if best.is_none() || load.pending[pos] < best_pending {
            best = Some(pos);
            best_pending = load.pending[pos];
        }
    }
    best
}

/// One tracked read handed to the agent by the egress program.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HedgeEvent {
    /// The slot's `LIVE` state word: the instance this event is about.
    pub state: u64,
    /// `bpf_ktime_get_ns` at send (the slot's `sent_ns`).
    pub sent_ns: u64,
    pub index: u32,
    /// Backend ids.
    pub primary: u16,
    pub chosen: u16,
    /// Bytes of `payload` in use (the whole UDP payload).
    pub len: u32,
    pub _pad: u32,
    pub payload: [u8; PAYLOAD_MAX],
}

/// The kernel's hedging switch (one entry in `HEDGE_CONFIG`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HedgeConfig {
    /// Nonzero: tracked reads are handed to the agent.
    pub enabled: u32,
    pub _pad: u32,
}

/// Per-backend hedging counters kept by the kernel (per CPU).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HedgeStats {
    /// Hedges to this backend whose reply reached the application first.
    pub won: u64,
    /// Hedges to this backend beaten by the reply of the member the read
    /// went to.
    pub lost: u64,
    /// Reply datagrams from this backend dropped because the other reply of
    /// a hedged read had reached the application.
    pub replies_dropped: u64,
    /// Reads to this primary not handed to the agent: event ring full.
    pub ring_full: u64,
    /// Reads to this primary not handed to the agent: longer than
    /// [`PAYLOAD_MAX`].
    pub too_large: u64,
    /// Error replies from this backend to hedged reads dropped while the
    /// other copy could still answer (see [`answer_step`]).
    pub errors_held: u64,
}

impl HedgeStats {
    pub fn add(&mut self, o: &Self) {
        self.won += o.won;
        self.lost += o.lost;
        self.replies_dropped += o.replies_dropped;
        self.ring_full += o.ring_full;
        self.too_large += o.too_large;
        self.errors_held += o.errors_held;
    }
}

/// The hedge budget: a token bucket refilled by reads. Each read adds
/// `percent / 100` of a token, a hedge takes one, and the bucket holds at
/// most [`BURST`] (it starts full). Over any run, hedges ≤
/// `percent / 100 × reads + BURST`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBucket {
    /// Hundredths of a token.
    centi_tokens: u64,
    percent: u64,
}

impl TokenBucket {
    pub const fn new(percent: u32) -> Self {
        Self {
            centi_tokens: BURST * 100,
            percent: percent as u64,
        }
    }

    pub fn set_percent(&mut self, percent: u32) {
        self.percent = u64::from(percent);
    }

    /// One read seen.
    pub fn on_read(&mut self) {
        self.centi_tokens = (self.centi_tokens + self.percent).min(BURST * 100);
    }

    /// Takes a token for one hedge, if there is one.
    pub fn try_take(&mut self) -> bool {
        if self.centi_tokens >= 100 {
            self.centi_tokens -= 100;
            true
        } else {
            false
        }
    }

    /// Gives back a token taken for a hedge that was not sent.
    pub fn refund(&mut self) {
        self.centi_tokens = (self.centi_tokens + 100).min(BURST * 100);
    }
}

/// The `auto` delay: the p95 of the primary's recent replies (a histogram of
/// the kernel's latency buckets over the recent window), clamped to
/// [`AUTO_MIN_NS`] and `ceiling_ns`; `None` below [`AUTO_MIN_SAMPLES`].
pub fn auto_delay_ns(recent: &[u64], ceiling_ns: u64) -> Option<u64> {
    let samples: u64 = recent.iter().sum();
    if samples < AUTO_MIN_SAMPLES {
        return None;
    }
    let p95 = latency::quantile_ns(recent, 0.95)?;
    Some(p95.clamp(AUTO_MIN_NS, ceiling_ns.max(AUTO_MIN_NS)))
}

/// The highest `auto` delay for a request timeout: half of it, at most
/// [`AUTO_MAX_NS`].
pub const fn auto_ceiling_ns(timeout_ns: u64) -> u64 {
    let half = timeout_ns / 2;
    if half < AUTO_MAX_NS {
        half
    } else {
        AUTO_MAX_NS
    }
}

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), Copy, explicit padding, no pointers.
    unsafe impl aya::Pod for super::HedgeConfig {}
    unsafe impl aya::Pod for super::HedgeStats {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_at_max_pending_are_no_hedge_target() {
        let mut pending = [0u64; crate::MAX_GROUP_MEMBERS];
        pending[1] = 5;
        pending[2] = 4;
        assert_eq!(within_max_pending(0b111, &pending, 0), 0b111);
        assert_eq!(within_max_pending(0b111, &pending, 5), 0b101);
        assert_eq!(within_max_pending(0b111, &pending, 4), 0b001);
        assert_eq!(within_max_pending(0b110, &pending, 6), 0b110);
    }
    use crate::inflight::{PHASE_LINGER, PHASE_LIVE, sequence, state, with_phase};

    fn live(n: u64) -> u64 {
        state(sequence(n, 1), PHASE_LIVE)
    }

    #[test]
    fn words_carry_their_instance() {
        let s = live(7);
        let open = open_word(s);
        assert_ne!(open, 0);
        assert!(same_instance(open, s));
        assert!(same_instance(open, with_phase(s, PHASE_LINGER)));
        assert!(!same_instance(open, live(8)));
        assert!(!same_instance(0, s));
        let claimed = claimed_word(open, 5);
        assert!(is_sent(claimed) && !is_sent(open));
        assert_eq!(target(claimed), 5);
        assert!(same_instance(claimed, s));
        // A claim from an older instance's open word never matches a newer one.
        assert_ne!(open_word(live(8)), open);
    }

    #[test]
    fn one_reply_wins_and_further_datagrams_follow_it() {
        let open = claimed_word(open_word(live(1)), 1);
        let AnswerStep::Claim(chosen_won) = answer_step(open, WON_CHOSEN, false, true) else {
            panic!("nobody answered yet");
        };
        assert_eq!(
            answer_step(chosen_won, WON_CHOSEN, false, true),
            AnswerStep::AlreadyMine
        );
        assert_eq!(
            answer_step(chosen_won, WON_HEDGE, false, true),
            AnswerStep::Lost
        );
        assert_eq!(winner(chosen_won), WON_CHOSEN);
    }

    #[test]
    fn an_error_waits_for_the_other_copy_and_passes_when_both_fail() {
        use AnswerStep::{Claim, Held, Hold, Lost};
        let open = open_word(live(9));
        let sent = claimed_word(open, 1);
        // No hedge sent: the error is the only reply to come.
        assert_eq!(
            answer_step(open, WON_CHOSEN, true, true),
            Claim(open | WON_CHOSEN)
        );
        // The chosen member's error while the target's copy is out: held.
        let Hold(held) = answer_step(sent, WON_CHOSEN, true, true) else {
            panic!("not held")
        };
        assert_eq!(held, sent | HELD_CHOSEN);
        assert_eq!(
            answer_step(held, WON_CHOSEN, true, true),
            Held,
            "a duplicate"
        );
        // The target's reply then wins, good or an error (both failed).
        assert_eq!(
            answer_step(held, WON_HEDGE, false, false),
            Claim(held | WON_HEDGE)
        );
        assert_eq!(
            answer_step(held, WON_HEDGE, true, false),
            Claim(held | WON_HEDGE)
        );
        // The target's error first, the chosen member's copy out: held;
        // the chosen member's error then passes, its good reply too.
        let Hold(target_held) = answer_step(sent, WON_HEDGE, true, true) else {
            panic!("not held")
        };
        assert_eq!(target_held, sent | HELD_HEDGE);
        let settled = settling_word(target_held).unwrap();
        assert_eq!(
            answer_step(settled, WON_CHOSEN, true, true),
            Claim(settled | WON_CHOSEN)
        );
        assert_eq!(
            answer_step(settled, WON_CHOSEN, false, true),
            Claim(settled | WON_CHOSEN)
        );
        // The other copy already failed by expiry: the error passes.
        assert_eq!(
            answer_step(sent, WON_HEDGE, true, false),
            Claim(sent | WON_HEDGE)
        );
        let expired = settling_word(sent).unwrap();
        assert_eq!(
            answer_step(expired, WON_CHOSEN, true, true),
            Claim(expired | WON_CHOSEN)
        );
        // An error after the other reply won is a loser, as any.
        assert_eq!(answer_step(sent | WON_HEDGE, WON_CHOSEN, true, true), Lost);
        // Holding changes neither the instance nor what is settled.
        assert!(same_instance(held, live(9)));
        assert_eq!(settling_word(held), Some(held | TARGET_SETTLED));
        assert_eq!(closing_word(held), None);
    }

    #[test]
    fn an_answered_or_closed_read_cannot_be_hedged() {
        let open = open_word(live(3));
        let AnswerStep::Claim(answered) = answer_step(open, WON_CHOSEN, false, true) else {
            panic!()
        };
        // The agent claims only from the exact open word.
        assert_ne!(answered, open);
        let closed = closing_word(open).unwrap();
        assert_ne!(closed, open);
        assert_eq!(closing_word(closed), None);
        assert_eq!(closing_word(0), None);
        assert_eq!(closing_word(claimed_word(open, 1)), None);
    }

    #[test]
    fn the_target_settles_once_and_only_after_a_send() {
        let open = open_word(live(4));
        assert_eq!(settling_word(open), None);
        let sent = claimed_word(open, 2);
        let settled = settling_word(sent).unwrap();
        assert_eq!(settling_word(settled), None);
        // Settling does not decide the answer, and vice versa.
        assert_eq!(winner(settled), 0);
        let AnswerStep::Claim(won) = answer_step(settled, WON_HEDGE, false, true) else {
            panic!()
        };
        assert_eq!(settling_word(won), None);
    }

    fn load(pending: &[u64], usable: u8) -> GroupLoad {
        let mut l = GroupLoad {
            len: pending.len(),
            usable,
            ..Default::default()
        };
        l.pending[..pending.len()].copy_from_slice(pending);
        l
    }

    #[test]
    fn target_is_the_least_pending_other_usable_member() {
        assert_eq!(choose_target(&load(&[9, 3, 2], 0b111), 0), Some(2));
        // Ties: the first in group order.
        assert_eq!(choose_target(&load(&[9, 2, 2], 0b111), 0), Some(1));
        // Never the member the read went to, even if it is the least pending.
        assert_eq!(choose_target(&load(&[0, 5, 7], 0b111), 0), Some(1));
        // The primary is a fine target for a redirected read.
        assert_eq!(choose_target(&load(&[1, 0, 7], 0b111), 1), Some(0));
        // Drained members are skipped; none left: no hedge.
        assert_eq!(choose_target(&load(&[9, 0, 4], 0b101), 0), Some(2));
        assert_eq!(choose_target(&load(&[9, 0], 0b01), 0), None);
        assert_eq!(choose_target(&load(&[9], 0b1), 0), None);
    }

    #[test]
    fn ejected_and_probing_members_are_no_hedge_target() {
        use crate::ejection::{ejected_bit, probe_bit};
        assert_eq!(hedge_usable(0b111, 0), 0b111);
        assert_eq!(hedge_usable(0b111, ejected_bit(2)), 0b011);
        assert_eq!(hedge_usable(0b111, probe_bit(1)), 0b101);
        assert_eq!(hedge_usable(0b101, ejected_bit(0) | probe_bit(1)), 0b100);
        // The least pending member is ejected: the next one is the target.
        let mut l = load(&[9, 3, 0], 0b111);
        assert_eq!(choose_target(&l, 0), Some(2));
        l.usable = hedge_usable(l.usable, ejected_bit(2));
        assert_eq!(choose_target(&l, 0), Some(1));
        // Every other member out: no hedge.
        l.usable = hedge_usable(l.usable, ejected_bit(1));
        assert_eq!(choose_target(&l, 0), None);
    }

    #[test]
    fn the_budget_caps_hedges_at_a_share_of_reads_plus_the_burst() {
        for percent in [1u32, 5, 20, 100] {
            let mut bucket = TokenBucket::new(percent);
            let mut hedges = 0u64;
            let reads = 10_000u64;
            for _ in 0..reads {
                bucket.on_read();
                // Every read stuck: the agent asks for a hedge each time.
                if bucket.try_take() {
                    hedges += 1;
                }
            }
            let cap = reads * u64::from(percent) / 100 + BURST;
            assert!(hedges <= cap, "{percent}%: {hedges} > {cap}");
            assert!(hedges + 1 >= reads * u64::from(percent) / 100, "{percent}%");
        }
        let mut b = TokenBucket::new(5);
        for _ in 0..BURST {
            assert!(b.try_take());
        }
        assert!(!b.try_take());
        b.refund();
        assert!(b.try_take());
        for _ in 0..19 {
            b.on_read();
        }
        assert!(!b.try_take());
        b.on_read();
        assert!(b.try_take());
    }

    #[test]
    fn auto_delay_is_the_p95_clamped() {
        let mut h = [0u64; latency::LATENCY_BUCKETS as usize];
        assert_eq!(auto_delay_ns(&h, 10_000_000), None);
        h[latency::bucket(2_000_000) as usize] = 96;
        h[latency::bucket(30_000_000) as usize] = 4;
        let d = auto_delay_ns(&h, 10_000_000).unwrap();
        assert!((2_000_000..=2_500_000).contains(&d), "{d}");
        // Fast replies: the floor.
        let mut fast = [0u64; latency::LATENCY_BUCKETS as usize];
        fast[latency::bucket(50_000) as usize] = 100;
        assert_eq!(auto_delay_ns(&fast, 10_000_000), Some(AUTO_MIN_NS));
        // Slow replies: the ceiling.
        let mut slow = [0u64; latency::LATENCY_BUCKETS as usize];
        slow[latency::bucket(400_000_000) as usize] = 100;
        assert_eq!(auto_delay_ns(&slow, 10_000_000), Some(10_000_000));
        assert_eq!(auto_ceiling_ns(1_000_000_000), AUTO_MAX_NS);
        assert_eq!(auto_ceiling_ns(20_000_000), 10_000_000);
    }

    #[test]
    fn event_layout_has_no_implicit_padding() {
        assert_eq!(core::mem::size_of::<HedgeEvent>(), 32 + PAYLOAD_MAX);
        assert_eq!(core::mem::size_of::<HedgeStats>(), 48);
    }
}
