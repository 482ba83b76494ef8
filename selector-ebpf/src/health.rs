//! Outlier ejection and slowness in the kernel (`selector_common::ejection`,
//! `selector_common::slowness`): the members the policy skips, the probe
//! egress takes (a half-open or a slow member's), and
//! the failures in a row and good replies the reply path counts. The agent
//! decides; these only read its word and count.

use core::intrinsics::{AtomicOrdering, atomic_cxchg, atomic_xadd};

use selector_common::{ejection, split_backend_id};

use crate::maps::{HEALTH, member_index};

/// The health word of `group`: its ejected, failing and slow members
/// (0 if the map is missing, which it never is).
#[inline(always)]
pub fn word(group: u32) -> u64 {
    match HEALTH.get_ptr(group) {
        // SAFETY: a field of a live array element, written atomically.
        Some(h) => unsafe { core::ptr::read_volatile(&raw const (*h).bits) },
        None => 0,
    }
}

/// Takes member `position`'s half-open probe if it is offered: true for
/// the one caller whose compare-and-swap sets the member ejected again.
#[inline(always)]
pub fn take_probe(group: u32, position: usize) -> bool {
    let Some(h) = HEALTH.get_ptr_mut(group) else {
        return false;
    };
    let p = unsafe { &raw mut (*h).bits };
    let bits = unsafe { core::ptr::read_volatile(p) };
    let Some(next) = ejection::take_probe(bits, position) else {
        return false;
    };
    let (_, won) = unsafe {
        atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(p, bits, next)
    };
    won
}

/// A reply from `backend` completed its request: an error (`error` 1)
/// adds one to its failures in a row, a good reply (0) ends the run and
/// counts one good reply. A plain store of `(failures + 1) * error`, which
/// may overwrite a failure the sweep added at the same moment (ejection
/// then comes one failure later; no count of requests depends on it). The
/// error that brings the run to the agent's `eject_after` marks the member
/// failing, if the agent says its group has room for it
/// (`ejection::failing_after`): no read is moved to it from here on, not
/// only from the agent's next check.
#[inline(always)]
pub fn replied(backend: u32, error: u64) {
    let (group, position) = split_backend_id(backend);
    let Some(h) = HEALTH.get_ptr_mut(group) else {
        return;
    };
    let position = member_index(position);
    unsafe {
        let failures = &raw mut (*h).failures[position];
        let before = core::ptr::read_volatile(failures);
        let run = before.wrapping_add(1) * error;
        // A good reply after a good reply changes nothing: no store, so
        // the line all CPUs read stays clean in their caches.
        if run != before {
            core::ptr::write_volatile(failures, run);
        }
        let bits = &raw mut (*h).bits;
        let word = core::ptr::read_volatile(bits);
        let failing = ejection::failing_after(word, position, run);
        if failing != 0 {
            // Lost to a concurrent change of the word: the agent's check
            // ejects the member a moment later all the same.
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::SeqCst }>(
                bits,
                word,
                word | failing,
            );
        }
        atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(
            &raw mut (*h).good[position],
            1 - error,
        );
    }
}
