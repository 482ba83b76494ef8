//! Tail blame (RobinHood, OSDI 2018): which backends the slowest requests of
//! an interval waited on, from the interval's per-backend latency histograms.
//!
//! The *tail* of an interval is every answered request in the bucket that
//! holds the p99 of all backends' requests together, or in a slower bucket.
//! The p99 bucket itself is included: the histogram cannot order requests
//! within one bucket (25% wide), and including it keeps the tail non-empty
//! whenever the interval had a reply, so the shares always sum to one. A
//! backend's *blame* is its share of the tail.

use crate::latency::{LATENCY_BUCKETS, quantile_bucket};

/// The quantile above which requests count as the tail.
pub const TAIL_QUANTILE: f64 = 0.99;

/// The first bucket of the tail at quantile `q` of all `histograms` merged
/// (one per backend, bucket counts of one interval); `None` with no requests.
pub fn tail_start<H: AsRef<[u64]>>(histograms: &[H], q: f64) -> Option<usize> {
    let mut merged = [0u64; LATENCY_BUCKETS as usize];
    for histogram in histograms {
        for (sum, count) in merged.iter_mut().zip(histogram.as_ref()) {
            *sum = sum.saturating_add(*count);
        }
    }
    quantile_bucket(&merged, q)
}

/// Requests of one backend's `histogram` in the tail starting at bucket `start`.
pub fn tail_requests(histogram: &[u64], start: usize) -> u64 {
    histogram.iter().skip(start).sum()
}

/// `part` as a share of `whole`; `None` when `whole` is zero.
pub fn share(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::latency::bucket;

    const BUCKETS: usize = LATENCY_BUCKETS as usize;

    /// A histogram with `n` requests at each latency (µs) given.
    fn histogram(requests: &[(u64, u64)]) -> [u64; BUCKETS] {
        let mut h = [0; BUCKETS];
        for (us, n) in requests {
            h[bucket(us * 1000) as usize] += n;
        }
        h
    }

    #[test]
    fn a_stalled_backend_takes_the_blame() {
        // 980 fast requests on each of two replicas; the primary answers
        // 980 fast and 40 after a 25 ms stall.
        let primary = histogram(&[(100, 980), (25_000, 40)]);
        let replica = histogram(&[(100, 980)]);
        let all = [primary, replica, replica];
        let start = tail_start(&all, TAIL_QUANTILE).unwrap();
        assert_eq!(start, bucket(25_000_000) as usize);
        let tail: [u64; 3] = core::array::from_fn(|i| tail_requests(&all[i], start));
        assert_eq!(tail, [40, 0, 0]);
        assert_eq!(share(tail[0], tail.iter().sum()), Some(1.0));
    }

    #[test]
    fn the_p99_bucket_is_part_of_the_tail() {
        // 100 requests: the p99 (the 99th) is in the 2 ms bucket; the one
        // slower request and the p99 bucket's own requests are the tail.
        let a = histogram(&[(100, 90), (2_000, 2)]);
        let b = histogram(&[(100, 5), (2_000, 2), (9_000, 1)]);
        let start = tail_start(&[a, b], TAIL_QUANTILE).unwrap();
        assert_eq!(start, bucket(2_000_000) as usize);
        assert_eq!((tail_requests(&a, start), tail_requests(&b, start)), (2, 3));
        assert_eq!(share(2, 5), Some(0.4));
    }

    #[test]
    fn shares_follow_the_tail_not_the_traffic() {
        // The busy backend is fast; the quiet one is slow: the quiet one is blamed.
        let busy = histogram(&[(100, 10_000)]);
        let quiet = histogram(&[(100, 50), (5_000, 150)]);
        let start = tail_start(&[busy, quiet], TAIL_QUANTILE).unwrap();
        let (b, q) = (tail_requests(&busy, start), tail_requests(&quiet, start));
        assert_eq!((b, q), (0, 150));
    }

    #[test]
    fn no_requests_no_tail() {
        let empty = [0u64; BUCKETS];
        assert_eq!(tail_start(&[empty, empty], TAIL_QUANTILE), None);
        assert_eq!(tail_start::<[u64; BUCKETS]>(&[], TAIL_QUANTILE), None);
        assert_eq!(share(0, 0), None);
    }

    #[test]
    fn shorter_histograms_count_as_empty_buckets() {
        let short = [0u64, 3];
        let full = histogram(&[(3, 1)]);
        let start = tail_start(&[&short[..], &full[..]], 1.0).unwrap();
        assert_eq!(start, 3);
        assert_eq!(
            (tail_requests(&short, start), tail_requests(&full, start)),
            (0, 1)
        );
    }
}
