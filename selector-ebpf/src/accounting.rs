//! Counting: pending requests (atomic, shared by all CPUs), per-backend
//! statistics and latency histograms (per CPU).

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use selector_common::{
    BackendStats, GroupExpired, MAX_GROUP_MEMBERS, latency, policy::GroupLoad, split_backend_id,
};

use crate::maps::{EXPIRED, GROUPS, LATENCY, PENDING, STATS};

/// The load of group `group`: one lookup per map, no branch per member.
#[inline(always)]
pub fn group_load(group: u32) -> Option<GroupLoad> {
    let g = GROUPS.get(group)?;
    let counters = PENDING.get(group)?;
    let expired = EXPIRED
        .get(group)
        .copied()
        .unwrap_or(GroupExpired::default());
    Some(GroupLoad::of(g, counters, &expired))
}

#[inline(always)]
fn add(backend: u32, completed: bool) {
    let (group, position) = split_backend_id(backend);
    if let Some(c) = PENDING.get_ptr_mut(group) {
        let position = position % MAX_GROUP_MEMBERS;
        let field = if completed {
            unsafe { &raw mut (*c).completed[position] }
        } else {
            unsafe { &raw mut (*c).issued[position] }
        };
        // The return value must stay unused: see DESIGN.md on XADD.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(field, 1) };
    }
}

#[inline(always)]
pub fn add_issued(backend: u32) {
    add(backend, false);
}

#[inline(always)]
pub fn add_completed(backend: u32) {
    add(backend, true);
}

/// Bumps one per-CPU counter of `backend`.
#[inline(always)]
pub fn count(backend: u32, field: impl FnOnce(&mut BackendStats) -> &mut u64) {
    if let Some(s) = STATS.get_ptr_mut(backend) {
        *field(unsafe { &mut *s }) += 1;
    }
}

#[inline(always)]
pub fn record_latency(backend: u32, latency_ns: u64) {
    let index = backend * latency::LATENCY_BUCKETS + latency::bucket(latency_ns);
    if let Some(c) = LATENCY.get_ptr_mut(index) {
        unsafe { *c += 1 };
    }
}
