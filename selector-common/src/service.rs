//! Service time per backend, for the latency policy: the recent time per
//! completed request (1 / throughput), kept by the reply path as a moving
//! average of the gaps between a backend's completions.
//!
//! Why 1 / throughput and not latency: the primary receives a steady
//! stream at rate λ, so normally `pending / throughput ≈ λ·latency / λ =
//! latency`, and during a stall completions stop, the estimate holds at
//! 1/λ while pending grows by λ per second, so `pending × service` is the
//! stall's age at any rate. `pending × latency` would be λ·age·latency:
//! the same stall would look eight times older at 8000 reads/s than at
//! 1000.

use crate::{
    maps::MAX_GROUP_MEMBERS,
    policy::{clamp_cost, is_less, is_zero, select},
};

/// Each completion moves the average 1/8 of the way to its gap.
pub const SERVICE_WEIGHT_SHIFT: u32 = 3;
/// Longest gap taken as a sample: after an idle minute the first gap does
/// not make the backend look slow for hundreds of completions.
pub const MAX_SERVICE_SAMPLE_NS: u64 = 100_000_000;
/// The service time after a completion at `now_ns`, from the previous
/// estimate (0: none yet) and the backend's previous completion (0: none).
#[inline(always)]
pub fn next_service_ns(previous_ns: u64, last_completion_ns: u64, now_ns: u64) -> u64 {
    if last_completion_ns == 0 {
        return previous_ns;
    }
    let mut gap = now_ns.saturating_sub(last_completion_ns);
    if gap > MAX_SERVICE_SAMPLE_NS {
        gap = MAX_SERVICE_SAMPLE_NS;
    }
    let next = if previous_ns == 0 {
        gap
    } else {
        previous_ns - (previous_ns >> SERVICE_WEIGHT_SHIFT) + (gap >> SERVICE_WEIGHT_SHIFT)
    };
    // 0 means "not measured".
    if next == 0 { 1 } else { next }
}

/// The primary's service time as the latency policy uses it: not measured
/// yet counts as `budget_ns` (an unmeasured group then behaves like count
/// threshold 1), and no more than `MAX_SERVICE_SAMPLE_NS`.
#[inline(always)]
pub fn primary_service_ns(
    primary: usize,
    service_ns: &[u64; MAX_GROUP_MEMBERS],
    budget_ns: u64,
) -> u64 {
    // Masks, not branches, for the kernel verifier (see `policy::is_less`).
    let s = clamp_cost(service_ns[primary % MAX_GROUP_MEMBERS]);
    let s = select(is_zero(s), clamp_cost(budget_ns), s);
    select(is_less(MAX_SERVICE_SAMPLE_NS, s), MAX_SERVICE_SAMPLE_NS, s)
}

/// Expected wait of a new request at member `pos`: `pending × service`,
/// 0 with nothing pending however slow the member. `primary_ns` is the
/// request's primary's service time (`primary_service_ns`), and bounds
/// every member's (a member not measured yet counts as the primary):
/// a replica that only gets the odd redirected read completes few
/// requests, so its 1 / throughput says how little it is used, not how
/// slow it is. At 1000 reads/s with 25 ms stalls every 500 ms, a replica
/// gets about 25 reads per stall, 50 per second: 20 ms per completion
/// against the primary's 1 ms. Unbounded, its one outstanding read would
/// weigh like a 20 ms old stall. Replicas are assumed to serve at least as
/// fast as the primary, which is what makes them worth reading from.
///
/// No overflow: services are at most `MAX_SERVICE_SAMPLE_NS` (2^27) and
/// pending counts at most the in-flight table (2^22 slots).
#[inline(always)]
pub fn expected_wait_at(
    pos: usize,
    pending: &[u64; MAX_GROUP_MEMBERS],
    service_ns: &[u64; MAX_GROUP_MEMBERS],
    primary_ns: u64,
) -> u64 {
    let own = clamp_cost(service_ns[pos % MAX_GROUP_MEMBERS]);
    // Without a branch, for the kernel verifier (see `GroupLoad::least`).
    let bounded = is_zero(own) | is_less(primary_ns, own);
    pending[pos % MAX_GROUP_MEMBERS].wrapping_mul(select(bounded, primary_ns, own))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_follows_the_gaps_between_completions() {
        // No previous completion: nothing to measure yet.
        assert_eq!(next_service_ns(0, 0, 5_000), 0);
        // The first gap is taken as is.
        assert_eq!(next_service_ns(0, 1_000, 2_000), 1_000);
        // Then 1/8 of the way to each new gap.
        assert_eq!(next_service_ns(8_000, 1_000, 17_000), 8_000 - 1_000 + 2_000);
        let mut s = 0;
        let mut last = 0;
        for i in 1..200u64 {
            let now = i * 125_000;
            s = next_service_ns(s, last, now);
            last = now;
        }
        assert!((124_000..=125_000).contains(&s), "{s}");
        // A burst of simultaneous completions drives it down, never to 0.
        for _ in 0..200 {
            s = next_service_ns(s, last, last);
        }
        assert!((1..8).contains(&s), "{s}");
        assert_eq!(next_service_ns(1, last, last), 1);
        // A long idle gap counts as the longest sample only.
        assert_eq!(
            next_service_ns(0, 1, 3_600_000_000_000),
            MAX_SERVICE_SAMPLE_NS
        );
    }

    #[test]
    fn replicas_are_bounded_by_the_primarys_service_time() {
        let pending = [4, 1, 2, 0, 0, 0, 0, 0];
        // Replica 1 rarely used (20 ms per completion), replica 2 faster
        // than the primary, replica 3 not measured, nothing pending at 4.
        let service = [1_000_000, 20_000_000, 500_000, 0, 9, 0, 0, 0];
        let primary = primary_service_ns(0, &service, 2_000_000);
        assert_eq!(primary, 1_000_000);
        let w = |pos, pending: &[u64; 8]| expected_wait_at(pos, pending, &service, primary);
        assert_eq!(
            [0, 1, 2, 4].map(|pos| w(pos, &pending)),
            [4_000_000, 1_000_000, 1_000_000, 0]
        );
        assert_eq!(w(3, &[0, 0, 0, 2, 0, 0, 0, 0]), 2_000_000);
        // An unmeasured primary counts as the budget, at most the longest sample.
        assert_eq!(primary_service_ns(3, &service, 2_000_000), 2_000_000);
        assert_eq!(
            primary_service_ns(1, &[0, u64::MAX, 0, 0, 0, 0, 0, 0], 1),
            MAX_SERVICE_SAMPLE_NS
        );
    }
}
