//! The read model of the counters: snapshots of the maps (read by
//! `crate::datapath`), per-backend totals, interval tails and blame. No I/O,
//! no text (the agent renders them).

pub mod hedges;

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use selector_common::{
    BackendStats,
    blame::{self, TAIL_QUANTILE},
    latency, split_backend_id,
};
use serde::{Deserialize, Serialize};

use crate::config::settings::BackendPlan;

/// Everything the table needs, read at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub at: Instant,
    /// (issued, completed, expired) per backend.
    pub accounting: Vec<(u64, u64, u64)>,
    pub stats: Vec<BackendStats>,
    pub latency: Vec<Vec<u64>>,
    pub inflight: usize,
    /// Packets passed untouched: (direction, reason, count).
    pub passed: Vec<(String, String, u64)>,
    /// Packets pulled, by direction.
    pub headers_pulled: HeadersPulled,
    /// Hedging counters per backend.
    pub hedges: Vec<hedges::HedgeCounts>,
    /// Service time per backend, ns (0: not measured).
    pub service_ns: Vec<u64>,
    /// Outlier ejection per backend (empty: not read).
    pub ejection: Vec<EjectionState>,
}

/// A backend's outlier ejection (`selector_common::ejection`), as fields of
/// its status object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EjectionState {
    /// `healthy`, `ejected` (no read moved to it; reads addressed to it go
    /// elsewhere) or `half_open` (one read probes it). Drain is apart.
    #[serde(default)]
    pub ejection_state: String,
    /// Ejections since start (a failed probe's too).
    #[serde(default)]
    pub ejections: u64,
    /// Time ejected or half-open since start, ns.
    #[serde(default)]
    pub ejected_ns: u64,
    /// Failures in a row now (expired requests, error replies).
    #[serde(default)]
    pub failures_in_a_row: u64,
    /// Slow (`selector_common::slowness`): not chosen while another
    /// eligible member is not, until a probe finds it fast.
    #[serde(default)]
    pub slow: bool,
    /// The memory of its slowness: a peak-sensitive moving average of its
    /// replies' latency and of how long reads waited on it, ns.
    #[serde(default)]
    pub slowness_ns: u64,
    /// Reads that probed it while slow, since start.
    #[serde(default)]
    pub slow_probes: u64,
}

impl Snapshot {
    /// Pending requests of backend `i`: `issued - completed - expired`.
    pub fn pending(&self, i: usize) -> u64 {
        let (issued, completed, expired) = self.accounting[i];
        selector_common::pending_of(issued, completed, expired)
    }

    /// Requests of backend `i` that expired unanswered.
    pub fn expired(&self, i: usize) -> u64 {
        self.accounting[i].2
    }
}

/// One backend's counters since start (also an element of `selector status
/// --json`; see [`crate::api::Status`]). Fields added later default when
/// absent, so a newer `selector status` reads an older agent's reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BackendTotals {
    pub backend: SocketAddr,
    /// Group number, from 1 in `--group` order.
    pub group: u32,
    /// Position in the group; 0 is the primary.
    pub position: u32,
    pub pending: u64,
    /// Requests sent to this backend (after steering) and tracked.
    pub issued: u64,
    /// Tracked requests this backend answered.
    pub completed: u64,
    /// Requests expired unanswered (timeouts).
    pub expired: u64,
    /// The kernel's per-backend counters, as fields of this object.
    #[serde(flatten)]
    pub stats: BackendStats,
    /// Latency quantiles since start: upper edge of the histogram bucket.
    pub p50_ns: Option<u64>,
    pub p99_ns: Option<u64>,
    #[serde(default)]
    pub p999_ns: Option<u64>,
    /// The latency histogram since start: the buckets that hold requests,
    /// fastest first.
    #[serde(default)]
    pub latency_buckets: Vec<LatencyBucket>,
    #[serde(flatten)]
    pub tail: BackendTail,
    /// Hedging counters, as fields of this object.
    #[serde(flatten)]
    pub hedges: hedges::HedgeCounts,
    /// Recent time per completed request (the latency policy's service
    /// time); `None` until measured.
    #[serde(default)]
    pub service_ns: Option<u64>,
    /// Outlier ejection, as fields of this object.
    #[serde(flatten, default)]
    pub ejection: EjectionState,
}

/// One bucket of a latency histogram: `count` requests answered after at
/// least `lower_ns` and less than `upper_ns` (`None`: the open last bucket).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LatencyBucket {
    pub lower_ns: u64,
    pub upper_ns: Option<u64>,
    pub count: u64,
}

/// The non-empty buckets of a kernel latency histogram.
pub fn latency_buckets(counts: &[u64]) -> Vec<LatencyBucket> {
    counts
        .iter()
        .enumerate()
        .filter(|(_, count)| **count > 0)
        .map(|(i, count)| {
            let i = i as u32;
            let upper = latency::bucket_upper_ns(i);
            LatencyBucket {
                lower_ns: latency::bucket_lower_ns(i),
                upper_ns: (upper != u64::MAX).then_some(upper + 1),
                count: *count,
            }
        })
        .collect()
}

/// A backend's part of the interval tails (see [`selector_common::blame`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct BackendTail {
    /// Its answered requests in the last interval's tail.
    pub tail_requests: u64,
    /// Its share of the last interval's tail; `None` before the first
    /// interval with a reply.
    pub tail_blame: Option<f64>,
    /// Its answered requests in the tails of every interval so far.
    pub tail_requests_total: u64,
}

/// One interval's tail: how many of the slowest answered requests (the
/// p99 bucket over all backends and slower) each backend had.
#[derive(Clone, Debug, PartialEq)]
pub struct IntervalTail {
    pub length: Duration,
    /// Requests answered in the interval, all backends together.
    pub answered: u64,
    /// The interval's p99 over all backends (upper edge of its bucket).
    pub p99_ns: Option<u64>,
    /// Per backend, its answered requests in the tail.
    pub tail_requests: Vec<u64>,
}

impl IntervalTail {
    /// The tail of the interval from `before` to `now`.
    pub fn between(before: &Snapshot, now: &Snapshot) -> Self {
        let histograms: Vec<Vec<u64>> = now
            .latency
            .iter()
            .zip(&before.latency)
            .map(|(now, before)| delta(now, before))
            .collect();
        let start = blame::tail_start(&histograms, TAIL_QUANTILE);
        Self {
            length: now.at.saturating_duration_since(before.at),
            answered: histograms.iter().flatten().sum(),
            p99_ns: start.map(|s| latency::bucket_edge_ns(s as u32)),
            tail_requests: histograms
                .iter()
                .map(|h| start.map_or(0, |s| blame::tail_requests(h, s)))
                .collect(),
        }
    }

    /// Backend `i`'s share of the tail; `None` if nothing was answered.
    pub fn blame(&self, i: usize) -> Option<f64> {
        blame::share(self.tail_requests[i], self.tail_requests.iter().sum())
    }
}

/// The interval tails so far: the last one, and each backend's tail
/// requests summed over all of them. Kept by the agent whether or not it
/// prints the table, for `status` and the metrics.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TailHistory {
    /// Intervals recorded so far.
    pub intervals: u64,
    pub last: Option<IntervalTail>,
    pub tail_requests_total: Vec<u64>,
}

impl TailHistory {
    pub fn record(&mut self, tail: IntervalTail) {
        if self.tail_requests_total.len() < tail.tail_requests.len() {
            self.tail_requests_total.resize(tail.tail_requests.len(), 0);
        }
        for (total, n) in self.tail_requests_total.iter_mut().zip(&tail.tail_requests) {
            *total += n;
        }
        self.intervals += 1;
        self.last = Some(tail);
    }

    /// Backend `i`'s part of the tails.
    pub fn backend(&self, i: usize) -> BackendTail {
        let last = self.last.as_ref();
        BackendTail {
            tail_requests: last
                .and_then(|t| t.tail_requests.get(i).copied())
                .unwrap_or(0),
            tail_blame: last
                .filter(|t| i < t.tail_requests.len())
                .and_then(|t| t.blame(i)),
            tail_requests_total: self.tail_requests_total.get(i).copied().unwrap_or(0),
        }
    }

    /// The last interval, as `selector status --json` shows it.
    pub fn last_interval(&self) -> Option<LastInterval> {
        self.last.as_ref().map(|t| LastInterval {
            number: self.intervals,
            length_ms: t.length.as_millis() as u64,
            answered: t.answered,
            p99_ns: t.p99_ns,
            tail_requests: t.tail_requests.iter().sum(),
        })
    }
}

/// The last completed interval (`last_interval` in `selector status --json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastInterval {
    /// Counts from 1; a new number means new blame figures.
    pub number: u64,
    pub length_ms: u64,
    /// Requests answered in it, all backends together.
    pub answered: u64,
    /// Its p99 over all backends (upper edge of the bucket); the tail is
    /// this bucket and slower ones.
    pub p99_ns: Option<u64>,
    /// Answered requests in its tail, all backends together.
    pub tail_requests: u64,
}

/// Packets of one kind passed untouched.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassedCount {
    /// `egress` or `ingress`.
    pub direction: String,
    pub reason: String,
    pub count: u64,
}

/// Packets whose skb the programs pulled (`bpf_skb_pull_data`: bytes
/// moved out of page fragments into the linear part, the head copied when
/// shared): only datagrams to or from a member whose descriptor bytes were
/// not linear, and packets whose very headers were not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeadersPulled {
    pub egress: u64,
    pub ingress: u64,
}

/// Per-backend totals of a snapshot, in `backends` order, with their part
/// of the interval tails.
pub fn totals(backends: &[BackendPlan], now: &Snapshot, tails: &TailHistory) -> Vec<BackendTotals> {
    backends
        .iter()
        .enumerate()
        .map(|(i, b)| BackendTotals {
            backend: b.addr,
            group: b.group + 1,
            position: split_backend_id(b.index).1 as u32,
            pending: now.pending(i),
            issued: now.accounting[i].0,
            completed: now.accounting[i].1,
            expired: now.expired(i),
            stats: now.stats[i],
            p50_ns: latency::quantile_ns(&now.latency[i], 0.5),
            p99_ns: latency::quantile_ns(&now.latency[i], 0.99),
            p999_ns: latency::quantile_ns(&now.latency[i], 0.999),
            latency_buckets: latency_buckets(&now.latency[i]),
            tail: tails.backend(i),
            hedges: now.hedges.get(i).copied().unwrap_or_default(),
            service_ns: now.service_ns.get(i).copied().filter(|s| *s != 0),
            ejection: now.ejection.get(i).cloned().unwrap_or_default(),
        })
        .collect()
}

pub fn passed_counts(passed: &[(String, String, u64)]) -> Vec<PassedCount> {
    passed
        .iter()
        .map(|(direction, reason, count)| PassedCount {
            direction: direction.clone(),
            reason: reason.clone(),
            count: *count,
        })
        .collect()
}

/// Per-bucket growth from `before` to `now`.
pub fn delta(now: &[u64], before: &[u64]) -> Vec<u64> {
    now.iter()
        .zip(before)
        .map(|(a, b)| a.saturating_sub(*b))
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Duration;

    pub(crate) fn snap(at: Instant, requests: u64, away: u64, lat_us: &[u64]) -> Snapshot {
        let mut hist = vec![0u64; latency::LATENCY_BUCKETS as usize];
        for us in lat_us {
            hist[latency::bucket(us * 1000) as usize] += 1;
        }
        Snapshot {
            at,
            accounting: vec![(9, 0, 2)],
            stats: vec![BackendStats {
                requests,
                redirected_away: away,
                ..Default::default()
            }],
            latency: vec![hist],
            inflight: 7,
            passed: vec![("egress".into(), "not_a_backend".into(), 3)],
            headers_pulled: HeadersPulled::default(),
            hedges: vec![],
            service_ns: vec![0],
            ejection: vec![],
        }
    }

    /// Two backends; latencies (µs) answered by each.
    fn two_backends(at: Instant, primary_us: &[u64], replica_us: &[u64]) -> Snapshot {
        let mut s = snap(at, 0, 0, primary_us);
        let replica = snap(at, 0, 0, replica_us);
        s.latency.push(replica.latency[0].clone());
        s.stats.push(replica.stats[0]);
        s.accounting.push(replica.accounting[0]);
        s
    }

    #[test]
    fn interval_tails_blame_the_slow_backend_and_add_up() {
        let t0 = Instant::now();
        let start = two_backends(t0, &[100], &[100]);
        let fast = [100u64; 98];
        let mut slow = vec![100u64; 98];
        slow.extend([25_000, 26_000]);
        let first = two_backends(t0 + Duration::from_millis(500), &slow, &fast);
        let tail = IntervalTail::between(&start, &first);
        assert_eq!(tail.length, Duration::from_millis(500));
        assert_eq!(tail.answered, 196); // 198 answered by then, 2 before
        assert_eq!(tail.tail_requests, [2, 0]);
        assert_eq!(
            tail.p99_ns,
            Some(latency::bucket_edge_ns(latency::bucket(25_000_000)))
        );
        assert_eq!((tail.blame(0), tail.blame(1)), (Some(1.0), Some(0.0)));

        let mut tails = TailHistory::default();
        assert_eq!(tails.backend(0), BackendTail::default());
        assert_eq!(tails.last_interval(), None);
        tails.record(tail);
        // Nothing answered in the next interval: no blame, totals kept.
        tails.record(IntervalTail::between(&first, &first));
        assert_eq!(
            tails.backend(0),
            BackendTail {
                tail_requests: 0,
                tail_blame: None,
                tail_requests_total: 2
            }
        );
        let last = tails.last_interval().unwrap();
        assert_eq!((last.number, last.answered, last.p99_ns), (2, 0, None));
    }
}
