//! Outlier ejection (issue 20): a member that fails `eject_after` times in
//! a row (a read that expired, an error reply) is ejected: no read is moved
//! to it, and reads whose primary it is go to the best other member at
//! once. After an ejection time that doubles with each ejection in a row
//! (from `base_ns` up to `max_ns`, with jitter) it is half-open: exactly
//! one live read probes it; a good reply restores it, a failure ejects it
//! again, for longer. A group never has more than its cap ejected (never
//! the last eligible member); a group with more members failing than the
//! cap is *over the cap*: nothing in it is ejected, reads are steered by
//! counts alone, as if ejection were off (Envoy's panic threshold).
//!
//! The kernel keeps the counts ([`crate::GroupHealth`]): consecutive
//! failures (an error reply adds one, a good reply sets 0, the agent's
//! sweep adds one per expired request) and good replies. The agent runs
//! [`step_group`] on them and writes the result into the group's
//! [`crate::GroupHealth::bits`] word: an ejected bit per member (not
//! usable by the policy) and a probe bit (half-open, its probe not sent:
//! the member is usable, and the first read egress sends it takes the
//! probe with a compare-and-swap that sets its ejected bit again, so no
//! second read follows until the agent has seen the probe's result).

use crate::MAX_GROUP_MEMBERS;

/// Envoy's and Finagle's default: five failures in a row. mcrouter's three
/// would eject sooner, but a DNS replica answers SERVFAIL for a broken
/// zone and memcached SERVER_ERROR for one oversized value while healthy
/// for every other read; five in a row from chance alone is rare.
pub const DEFAULT_EJECT_AFTER: u32 = 5;
/// Finagle's least backoff (Envoy's base is 30 s): a replica that only
/// restarted is back within seconds, one that is down costs one probe read
/// per ejection.
pub const DEFAULT_EJECT_BASE_MS: u64 = 5_000;
/// Envoy's and Finagle's most: five minutes.
pub const DEFAULT_EJECT_MAX_MS: u64 = 300_000;
/// At most half a group (at least one, never the last): groups are small
/// (2 to 8 replicas), so Envoy's 10% would mean "one" for every group.
/// Beyond half failing the group is more likely cut off from the client
/// than broken, and steering by counts alone is safer.
pub const DEFAULT_MAX_EJECTED_PERCENT: u32 = 50;

/// In [`crate::GroupHealth::bits`]: bit `p` ejected, bit `PROBE_SHIFT + p`
/// half-open with its probe not taken yet.
pub const PROBE_SHIFT: u32 = 8;

#[inline(always)]
pub const fn ejected_bit(position: usize) -> u64 {
    1 << (position % MAX_GROUP_MEMBERS)
}

#[inline(always)]
pub const fn probe_bit(position: usize) -> u64 {
    1 << (PROBE_SHIFT as usize + position % MAX_GROUP_MEMBERS)
}

/// In [`crate::GroupHealth::bits`]: bit `FAILING_SHIFT + p` set by the
/// reply path when member `p`'s failures in a row reach `eject_after`
/// (below): not chosen from that reply on, until the agent's next check
/// ejects it or, over the cap, releases it. Without it the replies that
/// arrive between the run's last failure and the check (10 ms; a moved
/// read reaches a broken replica every 2 ms while a primary stalls) would
/// all be moved to the failing member and reach the application as errors.
pub const FAILING_SHIFT: u32 = 16;
/// Every member's failing bit.
pub const FAILING_MASK: u64 = 0xff << FAILING_SHIFT;
/// In [`crate::GroupHealth::bits`]: bit `EJECTABLE_SHIFT + p` set by the
/// agent when member `p` may be marked failing: it is eligible (not
/// drained) and healthy, and its group may have one more member out
/// ([`ejectable`]).
pub const EJECTABLE_SHIFT: u32 = 24;
/// Every member's ejectable bit.
pub const EJECTABLE_MASK: u64 = 0xff << EJECTABLE_SHIFT;
/// In [`crate::GroupHealth::bits`]: bit `SLOW_SHIFT + p` set by the agent
/// while member `p` is slow ([`crate::slowness`]): not chosen while an
/// eligible member is not.
pub const SLOW_SHIFT: u32 = 32;
/// Every member's slow bit.
pub const SLOW_MASK: u64 = 0xff << SLOW_SHIFT;
/// In [`crate::GroupHealth::bits`]: bit `SLOW_PROBE_SHIFT + p` set by the
/// agent to let one read probe slow member `p`: it is chosen as if not
/// slow until egress takes the probe (clearing this bit).
pub const SLOW_PROBE_SHIFT: u32 = 40;
/// Every member's slow-probe bit.
pub const SLOW_PROBE_MASK: u64 = 0xff << SLOW_PROBE_SHIFT;
/// In [`crate::GroupHealth::bits`]: bit `EXPLORE_SHIFT + p` set by the
/// agent to have one read sent to member `p`, whatever its primary: a
/// member no read went to lately has no measure of its speed
/// ([`crate::slowness`]). Egress takes it as it takes a probe.
pub const EXPLORE_SHIFT: u32 = 48;
/// Every member's explore bit.
pub const EXPLORE_MASK: u64 = 0xff << EXPLORE_SHIFT;
/// In [`crate::GroupHealth::bits`]: the agent's `eject_after` from bit
/// `EJECT_AFTER_SHIFT` up (0: ejection off, or a run too long for the
/// field, which the reply path then leaves to the agent).
pub const EJECT_AFTER_SHIFT: u32 = 56;
/// The `eject_after` field.
pub const EJECT_AFTER_MASK: u64 = 0xff << EJECT_AFTER_SHIFT;

#[inline(always)]
pub const fn failing_bit(position: usize) -> u64 {
    1 << (FAILING_SHIFT as usize + position % MAX_GROUP_MEMBERS)
}

/// The members the policy may not choose, from the health word: ejected,
/// or failing until the agent's next check.
#[inline(always)]
pub const fn ejected_mask(bits: u64) -> u32 {
    ((bits | bits >> FAILING_SHIFT) & 0xff) as u32
}

pub const fn slow_bit(position: usize) -> u64 {
    1 << (SLOW_SHIFT as usize + position % MAX_GROUP_MEMBERS)
}

pub const fn slow_probe_bit(position: usize) -> u64 {
    1 << (SLOW_PROBE_SHIFT as usize + position % MAX_GROUP_MEMBERS)
}

pub const fn explore_bit(position: usize) -> u64 {
    1 << (EXPLORE_SHIFT as usize + position % MAX_GROUP_MEMBERS)
}

/// Where a read the policy sent to `chosen` goes, given the health word:
/// to the first member of `usable` (the policy's eligible set) whose
/// explore bit or slow-probe bit is set, unless `chosen`'s own is (this
/// read measures it), else to `chosen`. A slow member's probe must reach
/// it even when it is no read's primary. Without a branch per member, for
/// the kernel verifier.
#[inline(always)]
pub fn explored(chosen: usize, usable: u8, bits: u64) -> usize {
    use crate::policy::{is_zero, select};
    let want = ((bits >> EXPLORE_SHIFT) | (bits >> SLOW_PROBE_SHIFT)) & 0xff & u64::from(usable);
    let own = (want >> (chosen % MAX_GROUP_MEMBERS)) & 1;
    let want = want & 0u64.wrapping_sub(1 - own);
    // The lowest set bit's position: the bits below it, counted (a
    // popcount of at most 7 bits, by halves).
    let below = (want & want.wrapping_neg()).wrapping_sub(1) & 0xff;
    let v = below - ((below >> 1) & 0x55);
    let v = (v & 0x33) + ((v >> 2) & 0x33);
    let position = (v + (v >> 4)) & 0x0f;
    select(is_zero(want), chosen as u64, position) as usize % MAX_GROUP_MEMBERS
}

/// The members of `usable` the policy may choose, given the health word:
/// none ejected or failing, and of those the ones not slow (or slow with
/// a probe offered), unless every one of them is slow: then all of them
/// (slowness only ranks; it never leaves a group with nothing to choose).
/// Without a branch, for the kernel verifier (see `policy::is_less`).
#[inline(always)]
pub fn eligible(usable: u8, bits: u64) -> u8 {
    let healthy = u64::from(usable) & !u64::from(ejected_mask(bits));
    let slow = (bits >> SLOW_SHIFT) & !(bits >> SLOW_PROBE_SHIFT) & 0xff;
    let fine = healthy & !slow;
    crate::policy::select(crate::policy::is_zero(fine), healthy, fine) as u8
}

/// The `eject_after` field for the health word: `eject_after` if it fits,
/// else 0 (the reply path marks nothing failing; the agent still ejects).
#[inline(always)]
pub const fn eject_after_field(eject_after: u64) -> u64 {
    if eject_after > 0xff {
        0
    } else {
        eject_after << EJECT_AFTER_SHIFT
    }
}

/// The health word's bit to set after a reply that left member `position`
/// with `run` failures in a row (0 after a good reply): its failing bit
/// when the run has just reached the agent's `eject_after`, the agent
/// marked the member ejectable, and no other member is failing, else 0.
/// Only at that one count, so that a run the agent chose not to eject is
/// not marked again by each of its later failures; and one member at a
/// time, so that what is out of the choice never exceeds what the cap
/// allows (the agent marks none ejectable when its group has no room).
#[inline(always)]
pub const fn failing_after(bits: u64, position: usize, run: u64) -> u64 {
    let eject_after = bits >> EJECT_AFTER_SHIFT;
    let ejectable = bits & (1 << (EJECTABLE_SHIFT as usize + position % MAX_GROUP_MEMBERS)) != 0;
    if eject_after != 0 && run == eject_after && ejectable && bits & FAILING_MASK == 0 {
        failing_bit(position)
    } else {
        0
    }
}

/// The ejectable bits of a group after a step: its eligible healthy
/// members, if the group may have one more member out (not over the cap,
/// fewer out than [`allowed`]); none if ejection is off.
pub fn ejectable(members: &[Member], seen: &[Seen], over_cap: bool, p: &Params) -> u64 {
    let n = members.len().min(seen.len()).min(MAX_GROUP_MEMBERS);
    if p.eject_after == 0 || over_cap {
        return 0;
    }
    let eligible = (0..n).filter(|&i| seen[i].eligible).count();
    let out = (0..n)
        .filter(|&i| seen[i].eligible && members[i].state != State::Healthy)
        .count();
    if out >= allowed(eligible, p.max_ejected_percent) {
        return 0;
    }
    (0..n)
        .filter(|&i| seen[i].eligible && members[i].state == State::Healthy)
        .fold(0, |mask, i| mask | 1 << (EJECTABLE_SHIFT as usize + i))
}

/// The health word once a read to `position` took what was offered it: a
/// half-open member's probe (ejected again until the agent sees the
/// result), a slow member's probe (slow again), its explore bit. `None` if
/// nothing was offered.
#[inline(always)]
pub const fn take_probe(bits: u64, position: usize) -> Option<u64> {
    let offered = bits & (probe_bit(position) | slow_probe_bit(position) | explore_bit(position));
    if offered == 0 {
        return None;
    }
    let ejected = if bits & probe_bit(position) != 0 {
        ejected_bit(position)
    } else {
        0
    };
    Some((bits & !offered) | ejected)
}

/// The agent's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Failures in a row that eject a member; 0: ejection off.
    pub eject_after: u64,
    pub base_ns: u64,
    pub max_ns: u64,
    pub max_ejected_percent: u32,
    /// A taken probe with no result after this long (untracked, or a
    /// request that never expects a reply) is offered again.
    pub probe_wait_ns: u64,
}

/// Where a member stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum State {
    #[default]
    Healthy,
    /// Not chosen until `until_ns`.
    Ejected { until_ns: u64 },
    /// One read may probe it. `good_at`: its good replies when the probe
    /// was offered; `taken_ns`: when the agent saw the probe taken (0: not
    /// yet).
    HalfOpen { good_at: u64, taken_ns: u64 },
}

impl State {
    pub fn name(self) -> &'static str {
        match self {
            Self::Healthy => "healthy",
            Self::Ejected { .. } => "ejected",
            Self::HalfOpen { .. } => "half_open",
        }
    }

    /// As a number for metrics: 0 healthy, 1 ejected, 2 half-open.
    pub fn code(self) -> u64 {
        match self {
            Self::Healthy => 0,
            Self::Ejected { .. } => 1,
            Self::HalfOpen { .. } => 2,
        }
    }
}

/// The agent's record of one member.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Member {
    pub state: State,
    /// Ejections without a healthy `max_ns` in between: the backoff's
    /// exponent.
    pub in_a_row: u32,
    /// Ejections ever (a failed probe's too).
    pub ejections: u64,
    /// Time out of the choice (ejected or half-open) before the current
    /// spell, ns.
    pub out_ns: u64,
    /// When the current spell out began, or when it was last restored.
    pub since_ns: u64,
}

impl Member {
    /// Time out of the choice ever, as of `now_ns`.
    pub fn time_out_ns(&self, now_ns: u64) -> u64 {
        match self.state {
            State::Healthy => self.out_ns,
            _ => self.out_ns + now_ns.saturating_sub(self.since_ns),
        }
    }

    fn eject(&mut self, p: &Params, now_ns: u64, random: u32) -> u64 {
        if self.state == State::Healthy {
            self.since_ns = now_ns;
        }
        self.in_a_row = self.in_a_row.saturating_add(1);
        self.ejections += 1;
        let d = ejection_ns(p.base_ns, p.max_ns, self.in_a_row, random);
        self.state = State::Ejected {
            until_ns: now_ns.saturating_add(d),
        };
        d
    }

    fn restore(&mut self, now_ns: u64) {
        if self.state != State::Healthy {
            self.out_ns = self.time_out_ns(now_ns);
            self.since_ns = now_ns;
        }
        self.state = State::Healthy;
    }
}

/// The length of ejection number `in_a_row` (from 1): `base` doubled per
/// ejection in a row, at most `max`, less up to a quarter at random
/// (`random` uniform over u32), so that clients ejecting a replica at the
/// same moment do not all probe it at the same moment.
pub fn ejection_ns(base_ns: u64, max_ns: u64, in_a_row: u32, random: u32) -> u64 {
    let doublings = in_a_row.saturating_sub(1).min(40);
    let d = base_ns
        .saturating_mul(1 << doublings)
        .min(max_ns.max(base_ns));
    let jitter = (((d / 4) as u128 * u128::from(random)) >> 32) as u64;
    d - jitter
}

/// How many of `eligible` members (not drained) may be ejected at once:
/// `percent` of them rounded down, at least one, never all.
pub fn allowed(eligible: usize, percent: u32) -> usize {
    if eligible <= 1 {
        return 0;
    }
    (eligible * percent as usize / 100).max(1).min(eligible - 1)
}

/// What the kernel and the sweep counted for a member, as the agent reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// Failures in a row.
    pub failures: u64,
    /// Good replies ever.
    pub good: u64,
    /// Not drained: may be chosen at all.
    pub eligible: bool,
    /// The probe bit is still set (the probe not taken yet).
    pub probe_offered: bool,
}

/// When a member last answered well, as the agent's checks see it, so
/// that the sweep counts an expired request as a failure *in a row* only
/// if no good reply came after it was sent. The sweep finds expiries in
/// batches, a timeout after their send, while good replies reset the run
/// at once: without this, a member that is back (or that loses one read
/// in two) would get a batch of its old expiries counted after its new
/// good replies, and be ejected while it answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GoodWatch {
    /// Good replies as of the last check.
    seen: u64,
    /// The check before the one that saw `seen` grow: some good reply came
    /// after this moment.
    since_ns: u64,
}

impl GoodWatch {
    /// A check at which the member has `good` good replies ever; the
    /// previous check was at `prev_check_ns`.
    pub fn observe(&mut self, good: u64, prev_check_ns: u64) {
        if good != self.seen {
            self.seen = good;
            self.since_ns = prev_check_ns;
        }
    }

    /// Whether a request sent at `sent_ns` that expired is one more failure
    /// in a row: no good reply is known to have come after its send.
    pub fn expiry_counts(&self, sent_ns: u64) -> bool {
        sent_ns >= self.since_ns
    }
}

/// A change [`step_group`] made, for the agent to apply and log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Ejected for `for_ns` after `failures` failures in a row (or a
    /// failed probe: `probe_failed`). Set the ejected bit, clear the probe bit.
    Ejected {
        position: usize,
        for_ns: u64,
        failures: u64,
        probe_failed: bool,
    },
    /// Half-open: reset its failure count, clear the ejected bit and set
    /// the probe bit (also when a probe is offered again: `again`).
    Probe { position: usize, again: bool },
    /// Healthy again: clear both bits. `probe`: by a good probe reply;
    /// else released (drained, ejection off, or the group over its cap).
    Restored { position: usize, probe: bool },
    /// The group has more members failing than its cap: steered by counts
    /// alone (`true`), or no longer (`false`).
    OverCap {
        over: bool,
        failing: usize,
        cap: usize,
    },
}

/// Room for every event of one step.
pub const MAX_EVENTS: usize = 2 * MAX_GROUP_MEMBERS + 1;

/// Events of one step, in order.
#[derive(Clone, Copy, Debug)]
pub struct Events {
    pub list: [Option<Event>; MAX_EVENTS],
    pub len: usize,
}

impl Events {
    fn push(&mut self, e: Event) {
        if self.len < MAX_EVENTS {
            self.list[self.len] = Some(e);
            self.len += 1;
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = Event> + '_ {
        self.list[..self.len].iter().flatten().copied()
    }
}

/// One step of a group's members (`members.len() == seen.len()`, at most
/// 8) at `now_ns`. `over_cap` is the group's state, kept by the caller;
/// `random` draws the jitter.
pub fn step_group(
    members: &mut [Member],
    seen: &[Seen],
    over_cap: &mut bool,
    p: &Params,
    now_ns: u64,
    mut random: impl FnMut() -> u32,
) -> Events {
    let mut events = Events {
        list: [None; MAX_EVENTS],
        len: 0,
    };
    let n = members.len().min(seen.len()).min(MAX_GROUP_MEMBERS);
    let restore_all = |members: &mut [Member], events: &mut Events| {
        for (position, m) in members.iter_mut().enumerate().take(n) {
            if m.state != State::Healthy {
                m.restore(now_ns);
                events.push(Event::Restored {
                    position,
                    probe: false,
                });
            }
        }
    };
    if p.eject_after == 0 {
        restore_all(members, &mut events);
        *over_cap = false;
        return events;
    }
    for position in 0..n {
        let (m, s) = (&mut members[position], seen[position]);
        if !s.eligible {
            // Drained: the operator's choice wins.
            if m.state != State::Healthy {
                m.restore(now_ns);
                events.push(Event::Restored {
                    position,
                    probe: false,
                });
            }
            continue;
        }
        match m.state {
            State::Ejected { until_ns } if now_ns >= until_ns => {
                m.state = State::HalfOpen {
                    good_at: s.good,
                    taken_ns: 0,
                };
                events.push(Event::Probe {
                    position,
                    again: false,
                });
            }
            State::HalfOpen { good_at, taken_ns } => {
                if s.failures > 0 {
                    let for_ns = m.eject(p, now_ns, random());
                    events.push(Event::Ejected {
                        position,
                        for_ns,
                        failures: s.failures,
                        probe_failed: true,
                    });
                } else if s.good > good_at {
                    m.restore(now_ns);
                    events.push(Event::Restored {
                        position,
                        probe: true,
                    });
                } else if taken_ns == 0 && !s.probe_offered {
                    m.state = State::HalfOpen {
                        good_at,
                        taken_ns: now_ns.max(1),
                    };
                } else if taken_ns != 0 && now_ns.saturating_sub(taken_ns) >= p.probe_wait_ns {
                    m.state = State::HalfOpen {
                        good_at: s.good,
                        taken_ns: 0,
                    };
                    events.push(Event::Probe {
                        position,
                        again: true,
                    });
                }
            }
            State::Healthy if m.in_a_row > 0 && now_ns.saturating_sub(m.since_ns) >= p.max_ns => {
                // Healthy for a whole maximum ejection: the next one starts
                // from the base again.
                m.in_a_row = 0;
            }
            _ => {}
        }
    }
    let eligible = (0..n).filter(|&i| seen[i].eligible).count();
    let failing_now = |m: &Member, s: &Seen| {
        s.eligible && (m.state != State::Healthy || s.failures >= p.eject_after)
    };
    let failing = (0..n)
        .filter(|&i| failing_now(&members[i], &seen[i]))
        .count();
    let cap = allowed(eligible, p.max_ejected_percent);
    if eligible <= 1 {
        // Nothing else to choose: no ejection, and nothing to say.
        restore_all(members, &mut events);
        *over_cap = false;
        return events;
    }
    if failing > cap {
        if !*over_cap {
            *over_cap = true;
            events.push(Event::OverCap {
                over: true,
                failing,
                cap,
            });
        }
        restore_all(members, &mut events);
        return events;
    }
    if *over_cap {
        *over_cap = false;
        events.push(Event::OverCap {
            over: false,
            failing,
            cap,
        });
    }
    for position in 0..n {
        let (m, s) = (&mut members[position], seen[position]);
        if s.eligible && m.state == State::Healthy && s.failures >= p.eject_after {
            let for_ns = m.eject(p, now_ns, random());
            events.push(Event::Ejected {
                position,
                for_ns,
                failures: s.failures,
                probe_failed: false,
            });
        }
    }
    events
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::vec::Vec;

    const MS: u64 = 1_000_000;

    fn params() -> Params {
        Params {
            eject_after: 5,
            base_ns: 1000 * MS,
            max_ns: 8000 * MS,
            max_ejected_percent: 50,
            probe_wait_ns: 2000 * MS,
        }
    }

    fn seen(failures: u64, good: u64) -> Seen {
        Seen {
            failures,
            good,
            eligible: true,
            probe_offered: false,
        }
    }

    /// A group of `n` with its state, stepped with no jitter.
    struct Group {
        members: Vec<Member>,
        over: bool,
        p: Params,
    }

    impl Group {
        fn new(n: usize) -> Self {
            Self {
                members: std::vec![Member::default(); n],
                over: false,
                p: params(),
            }
        }

        fn step(&mut self, seen: &[Seen], now: u64) -> Vec<Event> {
            step_group(&mut self.members, seen, &mut self.over, &self.p, now, || 0)
                .iter()
                .collect()
        }

        fn states(&self) -> Vec<&'static str> {
            self.members.iter().map(|m| m.state.name()).collect()
        }
    }

    #[test]
    fn five_failures_in_a_row_eject_and_four_do_not() {
        let mut g = Group::new(3);
        assert!(g.step(&[seen(4, 0), seen(0, 9), seen(0, 9)], 0).is_empty());
        let e = g.step(&[seen(5, 0), seen(0, 9), seen(0, 9)], MS);
        assert_eq!(
            e,
            [Event::Ejected {
                position: 0,
                for_ns: 1000 * MS,
                failures: 5,
                probe_failed: false
            }]
        );
        assert_eq!(g.states(), ["ejected", "healthy", "healthy"]);
        assert_eq!(g.members[0].ejections, 1);
    }

    #[test]
    fn half_open_then_a_good_probe_restores() {
        let mut g = Group::new(3);
        g.step(&[seen(5, 0), seen(0, 0), seen(0, 0)], 0);
        // Not before its time.
        assert!(
            g.step(&[seen(5, 0), seen(0, 0), seen(0, 0)], 999 * MS)
                .is_empty()
        );
        let e = g.step(&[seen(5, 3), seen(0, 0), seen(0, 0)], 1000 * MS);
        assert_eq!(
            e,
            [Event::Probe {
                position: 0,
                again: false
            }]
        );
        // The agent reset its failures; the probe is taken, no result yet.
        assert!(
            g.step(&[seen(0, 3), seen(0, 0), seen(0, 0)], 1001 * MS)
                .is_empty()
        );
        assert_eq!(g.states()[0], "half_open");
        let e = g.step(&[seen(0, 4), seen(0, 0), seen(0, 0)], 1002 * MS);
        assert_eq!(
            e,
            [Event::Restored {
                position: 0,
                probe: true
            }]
        );
        assert_eq!(g.members[0].time_out_ns(5000 * MS), 1002 * MS);
    }

    #[test]
    fn a_failed_probe_ejects_for_twice_as_long_up_to_the_maximum() {
        let mut g = Group::new(3);
        let ok = seen(0, 0);
        g.step(&[seen(5, 0), ok, ok], 0);
        let mut now = 0;
        let mut lengths = Vec::new();
        for _ in 0..6 {
            let Some(State::Ejected { until_ns }) = g.members.first().map(|m| m.state) else {
                panic!("{:?}", g.members[0]);
            };
            lengths.push((until_ns - now) / MS);
            now = until_ns;
            g.step(&[seen(0, 0), ok, ok], now);
            assert_eq!(g.states()[0], "half_open");
            now += MS;
            g.step(&[seen(1, 0), ok, ok], now);
        }
        assert_eq!(lengths, [1000, 2000, 4000, 8000, 8000, 8000]);
        assert_eq!(g.members[0].ejections, 7);
    }

    #[test]
    fn jitter_takes_off_at_most_a_quarter() {
        assert_eq!(ejection_ns(1000, 8000, 1, 0), 1000);
        assert_eq!(ejection_ns(1000, 8000, 1, u32::MAX), 751);
        assert_eq!(ejection_ns(1000, 8000, 1, 1 << 31), 875);
        assert_eq!(ejection_ns(1000, 8000, 60, 0), 8000);
        // A maximum below the base: the base.
        assert_eq!(ejection_ns(1000, 10, 3, 0), 1000);
        assert_eq!(ejection_ns(u64::MAX, u64::MAX, 50, 0), u64::MAX);
    }

    #[test]
    fn a_taken_probe_without_a_result_is_offered_again() {
        let mut g = Group::new(2);
        let ok = seen(0, 0);
        g.step(&[seen(5, 0), ok], 0);
        g.step(&[seen(0, 0), ok], 1000 * MS);
        // Still offered: nothing to wait for.
        let offered = Seen {
            probe_offered: true,
            ..seen(0, 0)
        };
        assert!(g.step(&[offered, ok], 5000 * MS).is_empty());
        // Taken at 5001 ms; offered again 2 s later.
        assert!(g.step(&[seen(0, 0), ok], 5001 * MS).is_empty());
        assert!(g.step(&[seen(0, 0), ok], 7000 * MS).is_empty());
        assert_eq!(
            g.step(&[seen(0, 0), ok], 7001 * MS),
            [Event::Probe {
                position: 0,
                again: true
            }]
        );
    }

    #[test]
    fn a_flapping_member_is_never_ejected() {
        // Every other read fails: its failures in a row never pass 1.
        let mut g = Group::new(3);
        for i in 0..1000u64 {
            let e = g.step(&[seen(i % 2, i / 2), seen(0, i), seen(0, i)], i * MS);
            assert!(e.is_empty(), "{e:?}");
        }
    }

    #[test]
    fn the_cap_and_the_last_member() {
        assert_eq!(allowed(1, 100), 0);
        assert_eq!(allowed(2, 50), 1);
        assert_eq!(allowed(3, 50), 1);
        assert_eq!(allowed(4, 50), 2);
        assert_eq!(allowed(8, 50), 4);
        assert_eq!(allowed(8, 10), 1);
        assert_eq!(allowed(3, 100), 2);
        assert_eq!(allowed(0, 50), 0);
        // One member: never ejected.
        let mut g = Group::new(1);
        assert!(g.step(&[seen(50, 0)], 0).is_empty());
        assert_eq!(g.states(), ["healthy"]);
    }

    #[test]
    fn a_group_over_its_cap_ejects_nothing_and_says_so() {
        let mut g = Group::new(3);
        let bad = seen(9, 0);
        let ok = seen(0, 0);
        // One failing: ejected. Then a second: over the cap of 1; the first
        // is released.
        g.step(&[bad, ok, ok], 0);
        assert_eq!(g.states(), ["ejected", "healthy", "healthy"]);
        let e = g.step(&[bad, bad, ok], MS);
        assert_eq!(
            e,
            [
                Event::OverCap {
                    over: true,
                    failing: 2,
                    cap: 1
                },
                Event::Restored {
                    position: 0,
                    probe: false
                }
            ]
        );
        assert_eq!(g.states(), ["healthy"; 3]);
        // All failing: still nothing ejected, said once.
        assert!(g.step(&[bad, bad, bad], 2 * MS).is_empty());
        assert_eq!(g.states(), ["healthy"; 3]);
        // Back under the cap: the one still failing is ejected.
        let e = g.step(&[ok, bad, ok], 3 * MS);
        assert_eq!(
            e[0],
            Event::OverCap {
                over: false,
                failing: 1,
                cap: 1
            }
        );
        assert_eq!(g.states(), ["healthy", "ejected", "healthy"]);
    }

    #[test]
    fn drained_members_are_not_ejected_or_counted() {
        let mut g = Group::new(3);
        let drained = Seen {
            eligible: false,
            ..seen(9, 0)
        };
        // Two eligible: cap 1, the failing one ejected; the drained one not.
        g.step(&[seen(9, 0), drained, seen(0, 0)], 0);
        assert_eq!(g.states(), ["ejected", "healthy", "healthy"]);
        // Draining an ejected member releases it: drain is shown apart.
        g.step(
            &[
                Seen {
                    eligible: false,
                    ..seen(9, 0)
                },
                drained,
                seen(0, 0),
            ],
            MS,
        );
        assert_eq!(g.states(), ["healthy"; 3]);
        // With one eligible member left, it is never ejected.
        assert!(g.step(&[drained, drained, seen(9, 0)], 2 * MS).is_empty());
    }

    #[test]
    fn ejection_off_releases_everything() {
        let mut g = Group::new(2);
        g.step(&[seen(9, 0), seen(0, 0)], 0);
        g.p.eject_after = 0;
        assert_eq!(
            g.step(&[seen(9, 0), seen(0, 0)], MS),
            [Event::Restored {
                position: 0,
                probe: false
            }]
        );
    }

    #[test]
    fn the_backoff_starts_over_after_a_healthy_maximum() {
        let mut g = Group::new(2);
        let ok = seen(0, 0);
        g.step(&[seen(5, 0), ok], 0);
        g.step(&[seen(0, 0), ok], 1000 * MS);
        g.step(&[seen(0, 1), ok], 1001 * MS);
        assert_eq!(g.members[0].in_a_row, 1);
        g.step(&[seen(0, 1), ok], 9000 * MS);
        assert_eq!(g.members[0].in_a_row, 1, "not a whole maximum yet");
        g.step(&[seen(0, 1), ok], 9001 * MS);
        assert_eq!(g.members[0].in_a_row, 0);
    }

    #[test]
    fn an_expiry_sent_before_a_later_good_reply_is_no_failure_in_a_row() {
        let mut w = GoodWatch::default();
        // Checks at 10, 20, 30 ms; good replies seen growing at 20 ms.
        w.observe(5, 0);
        w.observe(5, 10 * MS);
        w.observe(6, 10 * MS);
        assert!(!w.expiry_counts(5 * MS), "sent before the good reply");
        assert!(w.expiry_counts(10 * MS));
        assert!(w.expiry_counts(25 * MS));
        // No more good replies (a dead member): later expiries all count.
        w.observe(6, 20 * MS);
        w.observe(6, 30 * MS);
        assert!(w.expiry_counts(15 * MS));
        // A member never heard from: everything counts.
        assert!(GoodWatch::default().expiry_counts(0));
    }

    #[test]
    fn the_probe_word() {
        let bits = ejected_bit(1) | probe_bit(2);
        assert_eq!(ejected_mask(bits), 0b10);
        assert_eq!(take_probe(bits, 1), None);
        let taken = take_probe(bits, 2).unwrap();
        assert_eq!(ejected_mask(taken), 0b110);
        assert_eq!(take_probe(taken, 2), None);
    }

    #[test]
    fn the_reply_that_completes_a_run_marks_the_member_failing_once() {
        let bits = eject_after_field(5) | probe_bit(0) | EJECTABLE_MASK;
        assert_eq!(ejected_mask(bits), 0, "the fields are no member");
        for run in [0, 1, 4, 6, 7] {
            assert_eq!(failing_after(bits, 2, run), 0, "run {run}");
        }
        let failing = bits | failing_after(bits, 2, 5);
        assert_eq!(ejected_mask(failing), 0b100);
        assert_eq!(failing & FAILING_MASK, failing_bit(2));
        // One member at a time, and only an ejectable one.
        assert_eq!(failing_after(failing, 1, 5), 0);
        let not_ejectable = bits & !(1 << (EJECTABLE_SHIFT + 1));
        assert_eq!(failing_after(not_ejectable, 1, 5), 0);
        assert_eq!(failing_after(not_ejectable, 3, 5), failing_bit(3));
        // The probe word is untouched by it, and the probe still taken.
        assert_eq!(ejected_mask(take_probe(failing, 0).unwrap()), 0b101);
        // Ejection off, or a run too long for the field: never marked.
        assert_eq!(failing_after(eject_after_field(0), 1, 0), 0);
        assert_eq!(eject_after_field(256), 0);
        assert_eq!(failing_after(eject_after_field(256), 1, 256), 0);
        assert_eq!(eject_after_field(255) >> EJECT_AFTER_SHIFT, 255);
    }

    #[test]
    fn ejectable_members_respect_the_cap_drains_and_the_last_member() {
        let p = params();
        let healthy = [Member::default(); 4];
        let all = [seen(0, 0); 4];
        let bits = |mask: u64| mask << EJECTABLE_SHIFT;
        assert_eq!(ejectable(&healthy, &all, false, &p), bits(0b1111));
        // Half of four: two may be out; with one out, the others remain.
        let mut one_out = healthy;
        one_out[1].state = State::Ejected { until_ns: 1 };
        assert_eq!(ejectable(&one_out, &all, false, &p), bits(0b1101));
        let mut two_out = one_out;
        two_out[2].state = State::HalfOpen {
            good_at: 0,
            taken_ns: 0,
        };
        assert_eq!(ejectable(&two_out, &all, false, &p), 0);
        // Drained members are neither ejectable nor counted: with one
        // eligible member left, none.
        let mut drained = all;
        for s in &mut drained[1..] {
            s.eligible = false;
        }
        assert_eq!(ejectable(&healthy, &drained, false, &p), 0);
        drained[1].eligible = true;
        assert_eq!(ejectable(&healthy, &drained, false, &p), bits(0b11));
        // Over the cap, or ejection off: none.
        assert_eq!(ejectable(&healthy, &all, true, &p), 0);
        let off = Params {
            eject_after: 0,
            ..p
        };
        assert_eq!(ejectable(&healthy, &all, false, &off), 0);
    }
}
