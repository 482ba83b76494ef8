//! The replica selection policy (BookKeeper issue 1489 / PR 1504).

use crate::{
    maps::{Group, GroupCounters, MAX_GROUP_MEMBERS, pending},
    service,
};

#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(
    feature = "user",
    derive(clap::ValueEnum, serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum Policy {
    /// Redirect when `pending[primary] >= pending[best] + threshold`.
    Threshold = 0,
    /// Redirect when `pending[primary] >= threshold`, to the least pending.
    Absolute = 1,
    /// Count, never redirect.
    Observe = 2,
    /// Redirect when the primary's expected wait (pending x recent time per
    /// completed request) is at least the budget over the best replica's.
    // See `choose_by_wait`.
    Latency = 3,
}

impl Policy {
    /// The name used on the command line and the control socket.
    pub fn name(self) -> &'static str {
        match self {
            Self::Threshold => "threshold",
            Self::Absolute => "absolute",
            Self::Observe => "observe",
            Self::Latency => "latency",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::Threshold,
            Self::Absolute,
            Self::Observe,
            Self::Latency,
        ]
        .into_iter()
        .find(|p| p.name() == name)
    }

    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Threshold),
            1 => Some(Self::Absolute),
            2 => Some(Self::Observe),
            3 => Some(Self::Latency),
            _ => None,
        }
    }
}

/// Which of several equally good members is the "best".
#[repr(u32)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(
    feature = "user",
    derive(clap::ValueEnum, serde::Serialize, serde::Deserialize),
    serde(rename_all = "snake_case")
)]
pub enum TieBreak {
    /// The first in group order (BookKeeper's first strict minimum).
    #[default]
    First = 0,
    /// One of them uniformly at random, so independent clients seeing the
    /// same counts do not all pick the same member (herding).
    Random = 1,
}

impl TieBreak {
    pub fn name(self) -> &'static str {
        match self {
            Self::First => "first",
            Self::Random => "random",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::First, Self::Random]
            .into_iter()
            .find(|t| t.name() == name)
    }

    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::First),
            1 => Some(Self::Random),
            _ => None,
        }
    }
}

/// The group as the policy sees it: pending counts by member position and a
/// bit per position that may be chosen (active, next hop known), and how a
/// tie for the least loaded is broken.
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupLoad {
    pub pending: [u64; MAX_GROUP_MEMBERS],
    pub usable: u8,
    pub len: usize,
    pub tie_break: TieBreak,
    /// A random number for `TieBreak::Random` (the caller draws it, so the
    /// choice is a pure function of its inputs).
    pub random: u32,
}

impl GroupLoad {
    /// The load of `group` from its counters. Straight-line code: the kernel
    /// verifier sees no branch per member here.
    #[inline(always)]
    pub fn of(group: &Group, counters: &GroupCounters) -> Self {
        let len = if (group.len as usize) < MAX_GROUP_MEMBERS {
            group.len as usize
        } else {
            MAX_GROUP_MEMBERS
        };
        let mut load = GroupLoad {
            len,
            usable: (group.active & ((1u32 << len) - 1)) as u8,
            ..GroupLoad::default()
        };
        let mut pos = 0;
        while pos < MAX_GROUP_MEMBERS {
            load.pending[pos] = pending(counters, pos);
            pos += 1;
        }
        load
    }

    #[inline(always)]
    fn is_usable(&self, pos: usize) -> bool {
        pos < self.len && pos < MAX_GROUP_MEMBERS && self.usable & (1 << pos) != 0
    }

    /// Usable member with the least pending count (ties: `tie_break`).
    #[inline(always)]
    pub fn least_pending(&self) -> Option<usize> {
        self.least(|pos| self.pending[pos % MAX_GROUP_MEMBERS])
            .map(|(pos, _)| pos)
    }

    /// Usable member with the least `cost(position)`, and that cost. Ties go
    /// to the first in group order, or with `TieBreak::Random` to one of
    /// them uniformly: reservoir sampling, the k-th tied member replacing
    /// the choice when the next mixed-radix digit of `random` (base k) is 0.
    /// Costs at or above 2^62 count as 2^62 - 1.
    ///
    /// Written without a branch per member (masks instead of `if`): the
    /// kernel verifier walks every path through the program, and eight
    /// members with a branch or two each multiplied its work past its
    /// limit. Costs are computed, not stored: the kernel's stack has no
    /// room for another array.
    #[inline(always)]
    pub fn least(&self, cost: impl Fn(usize) -> u64) -> Option<(usize, u64)> {
        let usable = u64::from(self.usable) & ((1u64 << (self.len % (MAX_GROUP_MEMBERS + 1))) - 1);
        let random_ties = u64::from(self.tie_break == TieBreak::Random);
        let mut digits = u64::from(self.random) & DIGITS_MASK;
        let mut best = 0u64;
        let mut best_cost = NO_COST;
        let mut ties = 0u64;
        // Only the group's members: a position past them is never usable.
        let len = self.len % (MAX_GROUP_MEMBERS + 1);
        let mut pos = 0;
        while pos < len {
            let unusable = 1 - ((usable >> pos) & 1);
            let c = clamp_cost(cost(pos)) | (unusable << 62);
            let less = is_less(c, best_cost);
            let equal = is_zero(c ^ best_cost) & (1 - unusable);
            ties = select(less, 1, ties + equal);
            // Only a tie consumes a digit (k is then at least 2).
            let k = ties + is_zero(ties);
            let quotient = divide_digits(digits, k);
            let drawn = is_zero(digits - quotient * k) & equal & random_ties;
            digits = select(equal, quotient, digits);
            let take = less | drawn;
            best = select(take, pos as u64, best);
            best_cost = select(take, c, best_cost);
            pos += 1;
        }
        if best_cost >= NO_COST {
            return None;
        }
        Some((best as usize % MAX_GROUP_MEMBERS, best_cost))
    }
}

/// The cost of a member that cannot be chosen: above every clamped cost.
const NO_COST: u64 = 1 << 62;

/// The bits of the random number the tie draw reads: 24, enough for the
/// 8! = 40,320 outcomes of eight tied members, and few enough that
/// `divide_digits` is a multiply.
const DIGITS_MASK: u64 = (1 << DIGITS_BITS) - 1;
const DIGITS_BITS: u32 = 24;

/// `2^(DIGITS_BITS + 3) / k + 1` for k = 1 to 8 (the others unused; a
/// power of two long, so that a mask bounds the index for the verifier).
const RECIPROCALS: [u64; 16] = {
    let mut r = [0; 16];
    let mut k = 1;
    while k <= MAX_GROUP_MEMBERS {
        r[k] = (1 << (DIGITS_BITS + 3)) / k as u64 + 1;
        k += 1;
    }
    r
};

/// `digits / k` for `digits` below `2^DIGITS_BITS` and `k` from 1 to 8,
/// exactly, as a multiply and a shift: a 64-bit division on each member
/// of the policy's pass was a twentieth of a request's time. (The error
/// of the reciprocal, below 1, times `digits` stays under `2^(DIGITS_BITS
/// + 3) / 8`, so the product never reaches the next multiple of `k`.)
#[inline(always)]
fn divide_digits(digits: u64, k: u64) -> u64 {
    (digits * RECIPROCALS[k as usize & 15]) >> (DIGITS_BITS + 3)
}

#[inline(always)]
pub(crate) fn clamp_cost(c: u64) -> u64 {
    let over = 1 - is_zero(c >> 62);
    (c | (over.wrapping_neg() >> 2)) & (NO_COST - 1)
}

/// 1 if `a < b`, else 0; both below 2^63. The difference goes through
/// `crate::opaque`, or the compiler recognises a comparison and emits a branch
/// (the BPF instruction set has no conditional move): each such branch
/// splits the kernel verifier's walk into two states with an exact flag
/// (0 or 1), which no longer merge, eight times per loop.
#[inline(always)]
pub(crate) fn is_less(a: u64, b: u64) -> u64 {
    crate::opaque::opaque(a.wrapping_sub(b)) >> 63
}

/// 1 if `x == 0`, else 0 (through `crate::opaque`, as `is_less`).
#[inline(always)]
pub(crate) fn is_zero(x: u64) -> u64 {
    1 - (crate::opaque::opaque(x | x.wrapping_neg()) >> 63)
}

/// `a` if `flag` is 1, `b` if it is 0. The mask goes through `crate::opaque`
/// so the compiler cannot turn it back into a branch.
#[inline(always)]
pub(crate) fn select(flag: u64, a: u64, b: u64) -> u64 {
    let mask = crate::opaque::opaque(flag.wrapping_neg());
    (a & mask) | (b & !mask)
}

/// The best member for a read to `primary` under `policy`, and its cost:
/// the least expected wait under the latency policy (see
/// `service::expected_wait_at`), the least pending count otherwise. One
/// pass with the cost picked by a mask, so the kernel verifier walks it
/// once whatever the policy.
#[inline(always)]
pub fn best_member(
    policy: Policy,
    primary: usize,
    load: &GroupLoad,
    service_ns: &[u64; MAX_GROUP_MEMBERS],
    budget_ns: u64,
) -> Option<(usize, u64)> {
    let by_wait = u64::from(policy == Policy::Latency);
    let primary_ns = service::primary_service_ns(primary, service_ns, budget_ns);
    load.least(|pos| {
        let pending = load.pending[pos % MAX_GROUP_MEMBERS];
        let wait = service::expected_wait_at(pos, &load.pending, service_ns, primary_ns);
        select(by_wait, wait, pending)
    })
}

/// Picks the member position a read for `primary` goes to, given the best
/// member (`best_member`). Returns `primary` whenever no other usable
/// member is better by the policy's margin; a drained primary is left for
/// the best usable member when there is one.
#[inline(always)]
pub fn choose_given(
    policy: Policy,
    threshold: u32,
    budget_ns: u64,
    primary: usize,
    load: &GroupLoad,
    service_ns: &[u64; MAX_GROUP_MEMBERS],
    best: Option<(usize, u64)>,
) -> usize {
    if policy == Policy::Observe || primary >= load.len || primary >= MAX_GROUP_MEMBERS {
        return primary;
    }
    let Some((best, best_cost)) = best else {
        return primary;
    };
    if !load.is_usable(primary) {
        return best;
    }
    let primary_pending = load.pending[primary];
    let over = match policy {
        Policy::Threshold => primary_pending >= best_cost.saturating_add(u64::from(threshold)),
        Policy::Absolute => primary_pending >= u64::from(threshold),
        Policy::Latency => {
            let primary_ns = service::primary_service_ns(primary, service_ns, budget_ns);
            service::expected_wait_at(primary, &load.pending, service_ns, primary_ns)
                >= best_cost.saturating_add(budget_ns)
        }
        Policy::Observe => false,
    };
    if over { best } else { primary }
}

/// `choose_given` for the count policies (threshold, absolute, observe).
pub fn choose(policy: Policy, threshold: u32, primary: usize, load: &GroupLoad) -> usize {
    if policy == Policy::Latency {
        return primary;
    }
    let none = [0; MAX_GROUP_MEMBERS];
    let best = best_member(policy, primary, load, &none, 0);
    choose_given(policy, threshold, 0, primary, load, &none, best)
}

/// The latency policy: a read leaves `primary` when its expected wait is at
/// least `budget_ns` over the least expected wait of a usable member.
pub fn choose_by_wait(
    primary: usize,
    load: &GroupLoad,
    service_ns: &[u64; MAX_GROUP_MEMBERS],
    budget_ns: u64,
) -> usize {
    let best = best_member(Policy::Latency, primary, load, service_ns, budget_ns);
    choose_given(
        Policy::Latency,
        0,
        budget_ns,
        primary,
        load,
        service_ns,
        best,
    )
}

/// Where a request goes once the pending bounds are applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Admission {
    /// Send it to this member.
    Send(usize),
    /// Every member it may go to is at the bound (or its client is):
    /// the overload response applies.
    Overloaded,
}

/// Applies `max_pending` (per backend; 0: no bound) to the policy's choice.
/// A full member is swapped for the policy's `best` member when the
/// request `may_move` (a read, with steering on) and that member has room.
#[inline(always)]
pub fn admit(
    chosen: usize,
    best: Option<usize>,
    max_pending: u32,
    may_move: bool,
    load: &GroupLoad,
) -> Admission {
    let cap = u64::from(max_pending);
    // The index masked after the check, opaquely (the compiler drops a
    // mask it can prove changes nothing): Linux 6.1's verifier refuses a
    // variable stack offset it cannot bound below ("math between fp
    // pointer and register with unbounded min value").
    let at = |pos: usize| load.pending[crate::opaque::opaque_usize(pos) % MAX_GROUP_MEMBERS];
    if cap == 0 || chosen >= MAX_GROUP_MEMBERS || at(chosen) < cap {
        return Admission::Send(chosen);
    }
    if may_move
        && let Some(best) = best
        && at(best) < cap
    {
        return Admission::Send(best);
    }
    Admission::Overloaded
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(pending: &[u64]) -> GroupLoad {
        let mut l = GroupLoad {
            len: pending.len(),
            usable: ((1u16 << pending.len()) - 1) as u8,
            ..Default::default()
        };
        l.pending[..pending.len()].copy_from_slice(pending);
        l
    }

    #[test]
    fn threshold_stays_below_and_moves_at_threshold() {
        assert_eq!(choose(Policy::Threshold, 3, 0, &load(&[4, 2, 5])), 0);
        assert_eq!(choose(Policy::Threshold, 3, 0, &load(&[5, 2, 5])), 1);
    }

    #[test]
    fn threshold_best_is_first_strict_minimum() {
        // Members 1 and 2 tie at the minimum: the first in group order wins.
        assert_eq!(choose(Policy::Threshold, 1, 0, &load(&[3, 1, 1])), 1);
        assert_eq!(choose(Policy::Threshold, 1, 2, &load(&[1, 1, 3])), 0);
    }

    #[test]
    fn threshold_primary_tied_with_an_earlier_member_stays_only_if_threshold_positive() {
        // Primary 2 ties member 0 at 0 pending: 0 >= 0 + 1 is false.
        assert_eq!(choose(Policy::Threshold, 1, 2, &load(&[0, 4, 0])), 2);
    }

    #[test]
    fn primary_that_is_the_minimum_stays() {
        assert_eq!(choose(Policy::Threshold, 1, 1, &load(&[5, 0, 5])), 1);
        assert_eq!(choose(Policy::Absolute, 10, 1, &load(&[5, 0, 5])), 1);
    }

    #[test]
    fn absolute_compares_primary_alone() {
        assert_eq!(choose(Policy::Absolute, 4, 0, &load(&[3, 9, 9])), 0);
        assert_eq!(choose(Policy::Absolute, 4, 0, &load(&[4, 9, 2])), 2);
    }

    #[test]
    fn observe_never_moves() {
        assert_eq!(choose(Policy::Observe, 1, 0, &load(&[100, 0, 0])), 0);
    }

    #[test]
    fn drained_members_are_never_chosen() {
        let mut l = load(&[9, 0, 3]);
        l.usable &= !(1 << 1);
        assert_eq!(choose(Policy::Threshold, 1, 0, &l), 2);
        assert_eq!(choose(Policy::Absolute, 1, 0, &l), 2);
    }

    #[test]
    fn drained_primary_goes_to_least_pending_usable() {
        let mut l = load(&[0, 5, 3]);
        l.usable &= !1;
        assert_eq!(choose(Policy::Threshold, 100, 0, &l), 2);
    }

    #[test]
    fn nothing_usable_keeps_primary() {
        let mut l = load(&[9, 0, 0]);
        l.usable = 0;
        assert_eq!(choose(Policy::Threshold, 1, 0, &l), 0);
    }

    #[test]
    fn one_member_group_never_moves() {
        assert_eq!(choose(Policy::Threshold, 1, 0, &load(&[1000])), 0);
        assert_eq!(choose(Policy::Absolute, 1, 0, &load(&[1000])), 0);
    }

    #[test]
    fn huge_pending_does_not_overflow() {
        assert_eq!(
            choose(Policy::Threshold, u32::MAX, 0, &load(&[u64::MAX, u64::MAX])),
            0
        );
    }

    #[test]
    fn primary_out_of_range_is_returned_unchanged() {
        assert_eq!(choose(Policy::Threshold, 1, 5, &load(&[9, 0])), 5);
    }

    #[test]
    fn load_of_a_group_masks_inactive_and_absent_members() {
        let group = Group {
            len: 3,
            active: 0b1111_1101,
            ..Default::default()
        };
        let mut counters = GroupCounters {
            issued: [5, 6, 7, 0, 0, 0, 0, 0],
            completed: [1, 1, 1, 0, 0, 0, 0, 0],
            ..Default::default()
        };
        counters.expired[2] = 2;
        let load = GroupLoad::of(&group, &counters);
        assert_eq!(load.len, 3);
        assert_eq!(load.usable, 0b101);
        assert_eq!(&load.pending[..3], &[4, 5, 4]);
        assert_eq!(load.least_pending(), Some(0));
        let full = Group {
            len: 8,
            active: u32::MAX,
            ..Default::default()
        };
        assert_eq!(GroupLoad::of(&full, &counters).usable, 0xff);
    }

    #[test]
    fn admission_moves_off_a_full_member_or_reports_overload() {
        let l = load(&[5, 2, 5]);
        assert_eq!(admit(0, l.least_pending(), 0, true, &l), Admission::Send(0));
        assert_eq!(admit(0, l.least_pending(), 6, true, &l), Admission::Send(0));
        assert_eq!(admit(0, l.least_pending(), 5, true, &l), Admission::Send(1));
        assert_eq!(
            admit(0, l.least_pending(), 5, false, &l),
            Admission::Overloaded
        );
        assert_eq!(
            admit(0, l.least_pending(), 2, true, &l),
            Admission::Overloaded
        );
        let mut drained = l;
        drained.usable &= !(1 << 1);
        assert_eq!(
            admit(0, drained.least_pending(), 5, true, &drained),
            Admission::Overloaded
        );
    }

    fn random(l: GroupLoad, random: u32) -> GroupLoad {
        GroupLoad {
            tie_break: TieBreak::Random,
            random,
            ..l
        }
    }

    #[test]
    fn the_digits_divide_exactly_by_every_tie_count() {
        for k in 1..=MAX_GROUP_MEMBERS as u64 {
            for digits in 0..=DIGITS_MASK {
                assert_eq!(divide_digits(digits, k), digits / k, "{digits} / {k}");
            }
        }
    }

    #[test]
    fn random_tie_break_spreads_over_every_tied_usable_member() {
        // Members 1, 2 and 4 tie at the minimum; 3 is drained.
        let mut l = load(&[9, 1, 1, 1, 1]);
        l.usable &= !(1 << 3);
        let mut seen = [0u32; 5];
        for r in 0..300 {
            seen[choose(Policy::Threshold, 1, 0, &random(l, r))] += 1;
        }
        assert_eq!(seen, [0, 100, 100, 0, 100]);
        // `first` keeps BookKeeper's first strict minimum whatever the number.
        assert_eq!(
            choose(Policy::Threshold, 1, 0, &GroupLoad { random: 2, ..l }),
            1
        );
        // No tie: the minimum, whatever the number.
        let l = random(load(&[9, 3, 1, 2]), 7);
        assert_eq!(l.least_pending(), Some(2));
    }

    #[test]
    fn random_tie_break_applies_to_admission_and_to_a_drained_primary() {
        let l = load(&[5, 2, 2]);
        let admitted: std::collections::BTreeSet<_> = (0..16)
            .map(|r| admit(0, random(l, r).least_pending(), 5, true, &random(l, r)))
            .collect();
        assert_eq!(
            admitted.into_iter().collect::<std::vec::Vec<_>>(),
            [Admission::Send(1), Admission::Send(2)]
        );
        let mut drained = load(&[0, 3, 3]);
        drained.usable &= !1;
        let chosen: std::collections::BTreeSet<_> = (0..16)
            .map(|r| choose(Policy::Absolute, 100, 0, &random(drained, r)))
            .collect();
        assert_eq!(chosen.into_iter().collect::<std::vec::Vec<_>>(), [1, 2]);
    }

    #[test]
    fn the_branch_free_helpers_compare_and_select() {
        assert_eq!((is_less(1, 2), is_less(2, 2), is_less(3, 2)), (1, 0, 0));
        assert_eq!(is_less(0, NO_COST), 1);
        assert_eq!((is_zero(0), is_zero(1), is_zero(1 << 63)), (1, 0, 0));
        assert_eq!((select(1, 7, 9), select(0, 7, 9)), (7, 9));
        assert_eq!(clamp_cost(5), 5);
        assert_eq!(clamp_cost(u64::MAX), NO_COST - 1);
        assert_eq!(clamp_cost(NO_COST), NO_COST - 1);
        // Huge costs still lose to small ones and tie among themselves.
        let l = load(&[u64::MAX, u64::MAX - 1, 3]);
        assert_eq!(l.least_pending(), Some(2));
        assert_eq!(load(&[u64::MAX, u64::MAX]).least_pending(), Some(0));
        assert_eq!(load(&[]).least_pending(), None);
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn latency_policy_moves_when_the_expected_wait_exceeds_the_budget() {
        let service = [MS, MS, MS, 0, 0, 0, 0, 0];
        // 2 ms over the best: moves; 1 ms over: stays.
        assert_eq!(choose_by_wait(0, &load(&[3, 1, 2]), &service, 2 * MS), 1);
        assert_eq!(choose_by_wait(0, &load(&[2, 1, 2]), &service, 2 * MS), 0);
        // The same counts at a tenth of the service time: stays.
        let fast = [MS / 10, MS / 10, MS / 10, 0, 0, 0, 0, 0];
        assert_eq!(choose_by_wait(0, &load(&[3, 1, 2]), &fast, 2 * MS), 0);
        assert_eq!(choose_by_wait(0, &load(&[21, 1, 2]), &fast, 2 * MS), 1);
        // A faster replica with more pending can be the better one.
        let service = [MS, MS, MS / 4, 0, 0, 0, 0, 0];
        assert_eq!(choose_by_wait(0, &load(&[6, 3, 4]), &service, 2 * MS), 2);
        // The policy never moves on counts alone.
        assert_eq!(choose(Policy::Latency, 1, 0, &load(&[100, 0, 0])), 0);
    }

    #[test]
    fn latency_policy_keeps_drained_members_out_and_ties_random() {
        let service = [MS; 8];
        let mut l = load(&[9, 0, 0, 0]);
        l.usable &= !(1 << 1);
        assert_eq!(choose_by_wait(0, &l, &service, 2 * MS), 2);
        let chosen: std::collections::BTreeSet<_> = (0..16)
            .map(|r| choose_by_wait(0, &random(l, r), &service, 2 * MS))
            .collect();
        assert_eq!(chosen.into_iter().collect::<std::vec::Vec<_>>(), [2, 3]);
        let mut drained_primary = load(&[0, 2, 1]);
        drained_primary.usable &= !1;
        assert_eq!(choose_by_wait(0, &drained_primary, &service, 2 * MS), 2);
        assert_eq!(choose_by_wait(7, &load(&[1, 0]), &service, MS), 7);
    }

    /// What a stall of the primary looks like to a policy: reads to the
    /// primary every `1/rate`, each answered `LATENCY` later by whoever it
    /// went to, except that the primary answers nothing from `STALL_AT`
    /// for `STALL`, then everything it holds at once. Service times come
    /// from `service::next_service_ns` on every completion, as in the
    /// kernel. Returns how long after the stall began the first read left
    /// the primary.
    fn first_move_after_stall(
        rate: u64,
        mut choose_at: impl FnMut(&GroupLoad, &[u64; 8]) -> usize,
    ) -> Option<u64> {
        use crate::service::next_service_ns;
        const LATENCY: u64 = MS / 10;
        const STALL_AT: u64 = 500 * MS;
        const STALL: u64 = 25 * MS;
        let gap = 1_000_000_000 / rate;
        let mut l = load(&[0, 0, 0]);
        let mut service = [0u64; 8];
        let mut last = [0u64; 8];
        // (completion time, member), kept sorted by time.
        let mut outstanding: std::vec::Vec<(u64, usize)> = std::vec::Vec::new();
        let mut now = gap;
        while now < STALL_AT + STALL {
            outstanding.sort();
            while let Some(&(done, member)) = outstanding.first() {
                if done > now {
                    break;
                }
                outstanding.remove(0);
                l.pending[member] -= 1;
                service[member] = next_service_ns(service[member], last[member], done);
                last[member] = done;
            }
            let to = choose_at(&l, &service);
            if to != 0 && now >= STALL_AT {
                return Some(now - STALL_AT);
            }
            let stalled = to == 0 && now + LATENCY > STALL_AT;
            let done = if stalled {
                (now + LATENCY).max(STALL_AT + STALL)
            } else {
                now + LATENCY
            };
            l.pending[to] += 1;
            outstanding.push((done, to));
            now += gap;
        }
        None
    }

    extern crate std;

    #[test]
    fn a_time_budget_moves_reads_after_the_same_time_at_any_rate() {
        let budget = 2 * MS;
        for rate in [1000, 8000] {
            let moved = first_move_after_stall(rate, |l, s| choose_by_wait(0, l, s, budget))
                .unwrap_or_else(|| panic!("never moved at {rate}/s"));
            // Within one inter-arrival gap of the budget.
            assert!(
                (budget..=budget + 1_000_000_000 / rate).contains(&moved),
                "{rate}/s: moved {moved} ns after the stall began"
            );
        }
        // A count threshold of 16 (2 ms at 8000/s) waits 16 ms at 1000/s.
        let at = |rate| first_move_after_stall(rate, |l, _| choose(Policy::Threshold, 16, 0, l));
        assert!(at(8000).unwrap() <= 2 * MS + MS / 8, "{:?}", at(8000));
        assert!(at(1000).unwrap() >= 15 * MS, "{:?}", at(1000));
    }

    #[test]
    fn policy_round_trips_through_u32() {
        for p in [
            Policy::Threshold,
            Policy::Absolute,
            Policy::Observe,
            Policy::Latency,
        ] {
            assert_eq!(Policy::from_u32(p as u32), Some(p));
            assert_eq!(Policy::from_name(p.name()), Some(p));
        }
        assert_eq!(Policy::from_name("fastest"), None);
        assert_eq!(Policy::from_u32(4), None);
        for t in [TieBreak::First, TieBreak::Random] {
            assert_eq!(TieBreak::from_u32(t as u32), Some(t));
            assert_eq!(TieBreak::from_name(t.name()), Some(t));
        }
        assert_eq!(TieBreak::from_u32(2), None);
    }
}
