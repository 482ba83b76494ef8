//! Counting: issued and completed requests (atomic, shared by all CPUs and
//! with the agent), per-client pending, per-backend statistics and latency
//! histograms (per CPU).

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use selector_common::{
    BackendStats, MAX_GROUP_MEMBERS, ejection, latency, policy::GroupLoad, service,
    split_backend_id,
};

use crate::maps::{CLIENT_PENDING, COUNTERS, GROUPS, LATENCY, SERVICE, STATS, member_index};

/// The load of group `group`: one lookup per map, no branch per member.
#[inline(always)]
pub fn group_load(group: u32) -> Option<GroupLoad> {
    group_load_and_health(group).map(|(load, _)| load)
}

/// `group_load`, and the group's health word it read.
#[inline(always)]
pub fn group_load_and_health(group: u32) -> Option<(GroupLoad, u64)> {
    let g = GROUPS.get(group)?;
    let counters = COUNTERS.get(group)?;
    let mut load = GroupLoad::of(g, counters);
    let health = crate::health::word(group);
    // Ejected members are never chosen, as drained ones; slow ones only
    // when every other is slow too.
    load.usable = ejection::eligible(load.usable, health);
    Some((load, health))
}

#[inline(always)]
fn atomic_add(field: *mut u64, value: u64) {
    // The return value stays unused: a plain XADD, no fetch needed.
    unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(field, value) };
}

#[inline(always)]
fn add(backend: u32, completed: bool) {
    let (group, position) = split_backend_id(backend);
    if let Some(c) = COUNTERS.get_ptr_mut(group) {
        let position = member_index(position);
        let field = if completed {
            unsafe { &raw mut (*c).completed[position] }
        } else {
            unsafe { &raw mut (*c).issued[position] }
        };
        atomic_add(field, 1);
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

#[inline(always)]
pub fn client_pending(slot: u32) -> u64 {
    CLIENT_PENDING.get(slot).copied().unwrap_or(0)
}

/// Loads a client socket's pending count and ignores it, to start that
/// line's cache miss early (see `inflight::touch_home`).
#[inline(always)]
pub fn touch_client(slot: u32) {
    if let Some(c) = CLIENT_PENDING.get_ptr(slot) {
        unsafe { core::ptr::read_volatile(c) };
    }
}

/// One more (`true`) or one fewer pending request of a client socket.
#[inline(always)]
pub fn client_add(slot: u32, more: bool) {
    if let Some(c) = CLIENT_PENDING.get_ptr_mut(slot) {
        atomic_add(c, if more { 1 } else { u64::MAX });
    }
}

/// Bumps one per-CPU counter of `backend`.
#[inline(always)]
pub fn count(backend: u32, field: impl FnOnce(&mut BackendStats) -> &mut u64) {
    if let Some(s) = STATS.get_ptr_mut(backend) {
        *field(unsafe { &mut *s }) += 1;
    }
}

/// One more response from `backend`, `error` (0 or 1) of them an error
/// reply and `moved_error` one to a moved read: one lookup, no branch.
#[inline(always)]
pub fn count_response(backend: u32, error: u64, moved_error: u64) {
    if let Some(s) = STATS.get_ptr_mut(backend) {
        let s = unsafe { &mut *s };
        s.responses += 1;
        s.error_replies += error;
        s.error_replies_moved += moved_error;
    }
}

#[inline(always)]
pub fn record_latency(backend: u32, latency_ns: u64) {
    let index = backend * latency::LATENCY_BUCKETS + latency::bucket(latency_ns);
    if let Some(c) = LATENCY.get_ptr_mut(index) {
        unsafe { *c += 1 };
    }
}

/// Folds a completion at `now_ns` into `backend`'s service time. Plain
/// loads and stores: completions on two CPUs at once may lose one sample,
/// which an average over many does not notice.
#[inline(always)]
pub fn record_service(backend: u32, now_ns: u64) {
    let (group, position) = split_backend_id(backend);
    if let Some(s) = SERVICE.get_ptr_mut(group) {
        let position = member_index(position);
        unsafe {
            let last = (*s).last_completion_ns[position];
            (*s).service_ns[position] =
                service::next_service_ns((*s).service_ns[position], last, now_ns);
            (*s).last_completion_ns[position] = now_ns;
        }
    }
}

/// Service times of group `group`'s members.
#[inline(always)]
pub fn group_service(group: u32) -> Option<&'static [u64; MAX_GROUP_MEMBERS]> {
    SERVICE.get(group).map(|s| &s.service_ns)
}
