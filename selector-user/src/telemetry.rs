//! Reading the maps into snapshots and printing the per-backend table.

use std::{fmt::Write as _, time::Instant};

use anyhow::Result;
use selector_common::{BackendStats, latency};

use crate::{Selector, settings::BackendPlan};

/// Everything the table needs, read at one moment.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub at: Instant,
    pub pending: Vec<u64>,
    pub stats: Vec<BackendStats>,
    pub expired: Vec<u64>,
    pub latency: Vec<Vec<u64>>,
    pub inflight: usize,
}

impl Selector {
    pub fn snapshot(&self) -> Result<Snapshot> {
        Ok(Snapshot {
            at: Instant::now(),
            pending: self.pending()?,
            stats: self.stats()?,
            expired: self.expired(),
            latency: self.latency()?,
            inflight: self.inflight()?.len(),
        })
    }
}

fn format_ns(ns: Option<u64>) -> String {
    match ns {
        None => "-".into(),
        Some(ns) if ns < 1_000_000 => format!("{}us", ns / 1000),
        Some(ns) if ns < 1_000_000_000 => format!("{:.1}ms", ns as f64 / 1e6),
        Some(ns) => format!("{:.2}s", ns as f64 / 1e9),
    }
}

fn delta(now: &[u64], before: &[u64]) -> Vec<u64> {
    now.iter()
        .zip(before)
        .map(|(a, b)| a.saturating_sub(*b))
        .collect()
}

/// The live table: rates and latency quantiles over the interval since
/// `before`, pending as of now.
pub fn render_table(backends: &[BackendPlan], before: &Snapshot, now: &Snapshot) -> String {
    let secs = now.at.duration_since(before.at).as_secs_f64().max(1e-3);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<22} {:>5} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "backend", "group", "pending", "req/s", "away/s", "to/s", "timeouts", "p50", "p99"
    );
    for (i, b) in backends.iter().enumerate() {
        let (s, p) = (&now.stats[i], &before.stats[i]);
        let hist = delta(&now.latency[i], &before.latency[i]);
        let rate = |a: u64, b: u64| a.saturating_sub(b) as f64 / secs;
        let _ = writeln!(
            out,
            "{:<22} {:>5} {:>8} {:>9.0} {:>9.0} {:>9.0} {:>9} {:>9} {:>9}",
            b.addr.to_string(),
            b.group + 1,
            now.pending[i],
            rate(s.requests, p.requests),
            rate(s.redirected_away, p.redirected_away),
            rate(s.redirected_to, p.redirected_to),
            now.expired[i],
            format_ns(latency::quantile_ns(&hist, 0.5)),
            format_ns(latency::quantile_ns(&hist, 0.99)),
        );
    }
    let untracked: u64 = now.stats.iter().map(|s| s.untracked).sum();
    let total = |f: fn(&BackendStats) -> u64| now.stats.iter().map(f).sum::<u64>();
    let _ = writeln!(
        out,
        "in flight {}  untracked {}  no reply expected {}  id collisions {}  unmatched replies {}",
        now.inflight,
        untracked,
        total(|s| s.no_reply),
        total(|s| s.id_collisions),
        total(|s| s.unmatched_responses),
    );
    out
}

/// Totals since start, printed on exit.
pub fn render_summary(backends: &[BackendPlan], now: &Snapshot) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8}",
        "backend", "requests", "responses", "away", "to", "timeouts", "p50", "p99", "pending"
    );
    for (i, b) in backends.iter().enumerate() {
        let s = &now.stats[i];
        let _ = writeln!(
            out,
            "{:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8}",
            b.addr.to_string(),
            s.requests,
            s.responses,
            s.redirected_away,
            s.redirected_to,
            now.expired[i],
            format_ns(latency::quantile_ns(&now.latency[i], 0.5)),
            format_ns(latency::quantile_ns(&now.latency[i], 0.99)),
            now.pending[i],
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn snap(at: Instant, requests: u64, away: u64, lat_us: &[u64]) -> Snapshot {
        let mut hist = vec![0u64; latency::LATENCY_BUCKETS as usize];
        for us in lat_us {
            hist[latency::bucket(us * 1000) as usize] += 1;
        }
        Snapshot {
            at,
            pending: vec![7],
            stats: vec![BackendStats {
                requests,
                redirected_away: away,
                ..Default::default()
            }],
            expired: vec![2],
            latency: vec![hist],
            inflight: 7,
        }
    }

    #[test]
    fn table_shows_interval_rates_and_quantiles() {
        let backends = [BackendPlan {
            index: 0,
            addr: "10.0.0.1:11211".parse().unwrap(),
            group: 0,
        }];
        let t0 = Instant::now();
        let before = snap(t0, 100, 10, &[100]);
        let now = snap(
            t0 + Duration::from_secs(2),
            2100,
            1010,
            &[100, 100, 100, 30_000],
        );
        let table = render_table(&backends, &before, &now);
        let row = table.lines().nth(1).unwrap();
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[0], "10.0.0.1:11211");
        assert_eq!(cols[2], "7"); // pending
        assert_eq!(cols[3], "1000"); // (2100-100)/2 s
        assert_eq!(cols[4], "500");
        assert_eq!(cols[6], "2"); // timeouts
        assert_eq!(cols[7], "112us"); // upper edge of 100 µs bucket [96, 112)
        assert!(cols[8].ends_with("ms"), "{row}");
        assert!(table.contains("in flight 7"));
    }

    #[test]
    fn durations_format_by_magnitude() {
        assert_eq!(format_ns(None), "-");
        assert_eq!(format_ns(Some(999_000)), "999us");
        assert_eq!(format_ns(Some(25_300_000)), "25.3ms");
        assert_eq!(format_ns(Some(2_500_000_000)), "2.50s");
    }
}
