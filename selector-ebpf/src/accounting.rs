//! Counting: pending requests (atomic, shared by all CPUs), per-backend
//! statistics and latency histograms (per CPU).

use core::intrinsics::{AtomicOrdering, atomic_xadd};

use selector_common::{BackendStats, latency};

use crate::maps::{EXPIRED, LATENCY, PENDING, STATS};

/// Requests outstanding at `backend`.
#[inline(always)]
pub fn pending(backend: u32) -> u64 {
    let Some(counters) = PENDING.get_ptr(backend) else {
        return 0;
    };
    let expired = EXPIRED.get_ptr(backend).map_or(0, |p| unsafe { p.read_volatile() });
    unsafe { counters.read_volatile() }.pending(expired)
}

#[inline(always)]
pub fn add_issued(backend: u32) {
    if let Some(c) = PENDING.get_ptr_mut(backend) {
        // The return value must stay unused: see DESIGN.md on XADD.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*c).issued, 1) };
    }
}

#[inline(always)]
pub fn add_completed(backend: u32) {
    if let Some(c) = PENDING.get_ptr_mut(backend) {
        unsafe {
            atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*c).completed, 1)
        };
    }
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
