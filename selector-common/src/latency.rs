//! The kernel latency histogram's buckets: log-linear, four sub-buckets per
//! power of two of microseconds, so relative error stays under 25% from 1 µs
//! to about 8 s in a fixed, small array.

pub const SUB_BUCKET_BITS: u32 = 2;
pub const SUB_BUCKETS: u64 = 1 << SUB_BUCKET_BITS;
/// Buckets per backend.
pub const LATENCY_BUCKETS: u32 = 96;

/// Index of the highest set bit; `v` must be non-zero. Branchy on purpose:
/// no loops and no count-leading-zeros instruction in the kernel.
#[inline(always)]
fn highest_bit(mut v: u64) -> u32 {
    let mut n = 0;
    if v >> 32 != 0 {
        v >>= 32;
        n += 32;
    }
    if v >> 16 != 0 {
        v >>= 16;
        n += 16;
    }
    if v >> 8 != 0 {
        v >>= 8;
        n += 8;
    }
    if v >> 4 != 0 {
        v >>= 4;
        n += 4;
    }
    if v >> 2 != 0 {
        v >>= 2;
        n += 2;
    }
    if v >> 1 != 0 {
        n += 1;
    }
    n
}

/// `ns / 1000` by a multiply and a shift below 2^32 ns (about 4.3 s,
/// every latency but a timeout's): a 64-bit divide is the dearest
/// instruction of the reply path. Exact: 2^41 / 1000 rounded up exceeds it
/// by 448/1000, under the 2^(41 - 32) / 1000 the shift tolerates, and the
/// product stays below 2^64.
#[inline(always)]
pub fn micros(ns: u64) -> u64 {
    const SHIFT: u32 = 41;
    const RECIPROCAL: u64 = (1 << SHIFT) / 1000 + 1;
    if ns >> 32 == 0 {
        (ns * RECIPROCAL) >> SHIFT
    } else {
        ns / 1000
    }
}

/// Bucket of a latency in nanoseconds.
#[inline(always)]
pub fn bucket(latency_ns: u64) -> u32 {
    let us = micros(latency_ns);
    if us < SUB_BUCKETS {
        return us as u32;
    }
    let msb = highest_bit(us);
    let sub = ((us >> (msb - SUB_BUCKET_BITS)) & (SUB_BUCKETS - 1)) as u32;
    let index = (msb - SUB_BUCKET_BITS + 1) * SUB_BUCKETS as u32 + sub;
    if index >= LATENCY_BUCKETS {
        LATENCY_BUCKETS - 1
    } else {
        index
    }
}

/// Smallest latency (ns) that lands in `index`.
pub fn bucket_lower_ns(index: u32) -> u64 {
    if u64::from(index) < SUB_BUCKETS {
        return u64::from(index) * 1000;
    }
    let group = index / SUB_BUCKETS as u32; // >= 1
    let sub = u64::from(index % SUB_BUCKETS as u32);
    let msb = group + SUB_BUCKET_BITS - 1;
    ((1u64 << msb) + (sub << (msb - SUB_BUCKET_BITS))) * 1000
}

/// Largest latency (ns) that lands in `index` (the last bucket is open).
pub fn bucket_upper_ns(index: u32) -> u64 {
    if index + 1 >= LATENCY_BUCKETS {
        u64::MAX
    } else {
        bucket_lower_ns(index + 1) - 1
    }
}

/// The bucket holding quantile `q` (0..=1) of a bucketed histogram: the
/// bucket of the `ceil(q * total)`-th smallest value, or `None` if empty.
pub fn quantile_bucket(counts: &[u64], q: f64) -> Option<usize> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let exact = q * total as f64;
    let mut rank = exact as u64;
    if (rank as f64) < exact {
        rank += 1; // ceil without std
    }
    let rank = rank.clamp(1, total);
    let mut seen = 0;
    for (i, c) in counts.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return Some(i);
        }
    }
    None
}

/// The exclusive upper edge (ns) of bucket `index`, or its lower edge for
/// the open last bucket: how quantiles are reported.
pub fn bucket_edge_ns(index: u32) -> u64 {
    let upper = bucket_upper_ns(index);
    if upper == u64::MAX {
        bucket_lower_ns(index)
    } else {
        upper + 1
    }
}

/// The value at quantile `q` (0..=1) of a bucketed histogram, reported as the
/// upper edge of its bucket (a conservative estimate), or `None` if empty.
pub fn quantile_ns(counts: &[u64], q: f64) -> Option<u64> {
    quantile_bucket(counts, q).map(|i| bucket_edge_ns(i as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micros_is_exact_division() {
        let edges = [0, 999, 1000, 1 << 31, (1 << 32) - 1, 1 << 32, u64::MAX];
        for ns in edges {
            assert_eq!(micros(ns), ns / 1000, "{ns}");
        }
        // Every multiple of 1000 below 2^32 and its neighbours, where a
        // reciprocal off by one would fail first.
        let mut k = 0u64;
        while k * 1000 < 1 << 32 {
            for ns in [k * 1000, (k * 1000).saturating_sub(1), k * 1000 + 999] {
                if ns < 1 << 32 {
                    assert_eq!(micros(ns), ns / 1000, "{ns}");
                }
            }
            k += 1;
        }
    }

    #[test]
    fn small_values_get_their_own_bucket() {
        assert_eq!(bucket(0), 0);
        assert_eq!(bucket(999), 0);
        assert_eq!(bucket(1000), 1);
        assert_eq!(bucket(3999), 3);
        assert_eq!(bucket(4000), 4);
    }

    #[test]
    fn buckets_are_monotonic_and_match_their_bounds() {
        let mut last = 0;
        let mut ns = 0u64;
        while ns < 20_000_000_000 {
            let b = bucket(ns);
            assert!(b >= last, "bucket went down at {ns}");
            assert!(bucket_lower_ns(b) <= ns, "{ns} below bucket {b}");
            assert!(ns <= bucket_upper_ns(b), "{ns} above bucket {b}");
            last = b;
            ns = ns * 9 / 8 + 997;
        }
        assert_eq!(bucket(u64::MAX), LATENCY_BUCKETS - 1);
    }

    #[test]
    fn every_bucket_boundary_round_trips() {
        for i in 0..LATENCY_BUCKETS {
            assert_eq!(bucket(bucket_lower_ns(i)), i);
        }
    }

    #[test]
    fn relative_error_is_bounded() {
        for i in SUB_BUCKETS as u32..LATENCY_BUCKETS - 1 {
            let lo = bucket_lower_ns(i) as f64;
            let hi = (bucket_upper_ns(i) + 1) as f64;
            assert!(hi / lo <= 1.25 + 1e-9, "bucket {i}: {lo}..{hi}");
        }
        // Range reaches past 8 seconds.
        assert!(bucket_lower_ns(LATENCY_BUCKETS - 1) > 8_000_000_000);
    }

    #[test]
    fn quantiles() {
        let mut counts = [0u64; LATENCY_BUCKETS as usize];
        assert_eq!(quantile_ns(&counts, 0.5), None);
        counts[bucket(100_000) as usize] += 99;
        counts[bucket(30_000_000) as usize] += 1;
        let p50 = quantile_ns(&counts, 0.5).unwrap();
        assert!((100_000..=125_000).contains(&p50), "{p50}");
        let p99 = quantile_ns(&counts, 0.99).unwrap();
        assert!(p99 <= 125_000);
        let p999 = quantile_ns(&counts, 0.999).unwrap();
        assert!((30_000_000..=37_500_000).contains(&p999), "{p999}");
        assert_eq!(
            quantile_bucket(&counts, 0.5),
            Some(bucket(100_000) as usize)
        );
        assert_eq!(
            quantile_bucket(&counts, 1.0),
            Some(bucket(30_000_000) as usize)
        );
        assert_eq!(
            quantile_ns(&counts, 0.5),
            Some(bucket_edge_ns(bucket(100_000)))
        );
    }

    #[test]
    fn the_last_bucket_reports_its_lower_edge() {
        let last = LATENCY_BUCKETS - 1;
        assert_eq!(bucket_edge_ns(last), bucket_lower_ns(last));
        assert_eq!(bucket_edge_ns(4), bucket_lower_ns(5));
    }
}
