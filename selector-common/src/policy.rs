//! The replica selection policy (BookKeeper issue 1489 / PR 1504).

use crate::maps::{Group, GroupCounters, MAX_GROUP_MEMBERS, pending};

#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Redirect when `pending[primary] >= pending[best] + threshold`.
    Threshold = 0,
    /// Redirect when `pending[primary] >= threshold`, to the least pending.
    Absolute = 1,
    /// Count, never redirect.
    Observe = 2,
}

impl Policy {
    /// The name used on the command line and the control socket.
    pub fn name(self) -> &'static str {
        match self {
            Self::Threshold => "threshold",
            Self::Absolute => "absolute",
            Self::Observe => "observe",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [Self::Threshold, Self::Absolute, Self::Observe]
            .into_iter()
            .find(|p| p.name() == name)
    }

    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Threshold),
            1 => Some(Self::Absolute),
            2 => Some(Self::Observe),
            _ => None,
        }
    }
}

/// The group as the policy sees it: pending counts by member position and a
/// bit per position that may be chosen (active, next hop known).
#[derive(Clone, Copy, Debug, Default)]
pub struct GroupLoad {
    pub pending: [u64; MAX_GROUP_MEMBERS],
    pub usable: u8,
    pub len: usize,
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

    /// First usable member with the strict minimum pending count.
    #[inline(always)]
    pub fn least_pending(&self) -> Option<usize> {
        let mut best: Option<usize> = None;
        let mut best_pending = u64::MAX;
        let mut pos = 0;
        while pos < MAX_GROUP_MEMBERS {
            if self.is_usable(pos) && (best.is_none() || self.pending[pos] < best_pending) {
                best = Some(pos);
                best_pending = self.pending[pos];
            }
            pos += 1;
        }
        best
    }
}

/// Picks the member position a request for `primary` goes to. Returns
/// `primary` whenever no other usable member is better; a drained primary is
/// left for the least pending usable member when there is one.
pub fn choose(policy: Policy, threshold: u32, primary: usize, load: &GroupLoad) -> usize {
    if policy == Policy::Observe || primary >= load.len || primary >= MAX_GROUP_MEMBERS {
        return primary;
    }
    let Some(best) = load.least_pending() else {
        return primary;
    };
    if !load.is_usable(primary) {
        return best;
    }
    let primary_pending = load.pending[primary];
    let over = match policy {
        Policy::Threshold => {
            primary_pending
                >= load.pending[best % MAX_GROUP_MEMBERS].saturating_add(u64::from(threshold))
        }
        Policy::Absolute => primary_pending >= u64::from(threshold),
        Policy::Observe => false,
    };
    if over { best } else { primary }
}

/// Where a request goes once the pending bounds are applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Send it to this member.
    Send(usize),
    /// Every member it may go to is at the bound (or its client is):
    /// the overload response applies.
    Overloaded,
}

/// Applies `max_pending` (per backend; 0: no bound) to the policy's choice.
/// A full member is swapped for the least pending usable member when the
/// request `may_move` (a read, with steering on) and that member has room.
pub fn admit(chosen: usize, max_pending: u32, may_move: bool, load: &GroupLoad) -> Admission {
    let cap = u64::from(max_pending);
    if cap == 0 || chosen >= MAX_GROUP_MEMBERS || load.pending[chosen] < cap {
        return Admission::Send(chosen);
    }
    if may_move
        && let Some(best) = load.least_pending()
        && load.pending[best % MAX_GROUP_MEMBERS] < cap
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
        assert_eq!(admit(0, 0, true, &l), Admission::Send(0));
        assert_eq!(admit(0, 6, true, &l), Admission::Send(0));
        assert_eq!(admit(0, 5, true, &l), Admission::Send(1));
        assert_eq!(admit(0, 5, false, &l), Admission::Overloaded);
        assert_eq!(admit(0, 2, true, &l), Admission::Overloaded);
        let mut drained = l;
        drained.usable &= !(1 << 1);
        assert_eq!(admit(0, 5, true, &drained), Admission::Overloaded);
    }

    #[test]
    fn policy_round_trips_through_u32() {
        for p in [Policy::Threshold, Policy::Absolute, Policy::Observe] {
            assert_eq!(Policy::from_u32(p as u32), Some(p));
            assert_eq!(Policy::from_name(p.name()), Some(p));
        }
        assert_eq!(Policy::from_name("fastest"), None);
        assert_eq!(Policy::from_u32(3), None);
    }
}
