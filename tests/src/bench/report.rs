//! Results: one row per policy, the ratios, the targets, the per-packet
//! costs; as markdown and CSV, with the plots, under the output directory.

use std::{fmt::Write as _, path::Path, time::Duration};

use anyhow::{Context as _, Result};
use hdrhistogram::Histogram;

use super::{
    client::{ClientReport, Counts, decode_histogram, histogram},
    packet_cost::{CostRow, Method},
    plots,
    rows::Row,
    scenario::Options,
};

/// The selector's own counters for a row (its STATS map).
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelCounts {
    pub requests: u64,
    pub redirected: u64,
    pub untracked: u64,
    pub expired: u64,
    /// Reads over the overload cap, by what was done with them.
    pub overload_passed: u64,
    pub overload_dropped: u64,
    pub overload_rejected: u64,
    /// Hedged reads: copies sent, and copies whose reply came first.
    pub hedges_sent: u64,
    pub hedges_won: u64,
    /// Runs and kernel-measured run time of the programs on the live
    /// traffic (BPF run-time statistics; zero where they were off).
    pub egress_runs: u64,
    pub egress_ns: u64,
    pub ingress_runs: u64,
    pub ingress_ns: u64,
}

impl KernelCounts {
    pub fn add(&mut self, o: &Self) {
        self.requests += o.requests;
        self.redirected += o.redirected;
        self.untracked += o.untracked;
        self.expired += o.expired;
        self.overload_passed += o.overload_passed;
        self.overload_dropped += o.overload_dropped;
        self.overload_rejected += o.overload_rejected;
        self.hedges_sent += o.hedges_sent;
        self.hedges_won += o.hedges_won;
        self.egress_runs += o.egress_runs;
        self.egress_ns += o.egress_ns;
        self.ingress_runs += o.ingress_runs;
        self.ingress_ns += o.ingress_ns;
    }

    /// Mean ns per run of the egress and the ingress program, if measured.
    pub fn live_ns(&self) -> Option<(f64, f64)> {
        (self.egress_runs > 0 && self.ingress_runs > 0).then(|| {
            (
                self.egress_ns as f64 / self.egress_runs as f64,
                self.ingress_ns as f64 / self.ingress_runs as f64,
            )
        })
    }
}

/// What one row measured, all client processes merged.
#[derive(Clone, Debug)]
pub struct RowResult {
    pub row: Row,
    /// The row's own rate (`--only ID@RATE`), if not the benchmark's.
    pub at: Option<u32>,
    /// Reads per second asked of all client processes together.
    pub offered: u32,
    pub duration: Duration,
    /// Latency from the intended send time, microseconds.
    pub hist: Histogram<u64>,
    /// Latency of the `SERVER_ERROR` replies only.
    pub rejected_hist: Histogram<u64>,
    /// Latency of the replies to reads intended in the overload stop window.
    pub window_hist: Histogram<u64>,
    pub counts: Counts,
    /// Per replica: reads it answered, by intended send time, 1 ms bins.
    pub served: Vec<Vec<u64>>,
    /// Stalls of the primary, seconds from the start of the load.
    pub stalls: Vec<(f64, f64)>,
    /// Rows with several client hosts: latency per host, in host order.
    pub hosts: Vec<Histogram<u64>>,
    pub kernel: Option<KernelCounts>,
    /// Overload rows: datagrams the replicas' hosts dropped because the
    /// memcached socket's receive buffer was full (UDP RcvbufErrors).
    pub replica_buffer_drops: Option<u64>,
    /// Each appended segment (round) on its own: p99, p99.9 and p99.99
    /// (microseconds) and reads lost.
    pub rounds: Vec<Round>,
}

/// One round (segment) of a row on its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Round {
    pub p99_us: u64,
    pub p999_us: u64,
    pub p9999_us: u64,
    pub lost: u64,
}

impl RowResult {
    /// A row run at `offered` reads/s, its own rate if `at` is set.
    pub fn new(row: Row, at: Option<u32>, offered: u32, duration: Duration) -> Self {
        Self {
            row,
            at,
            offered,
            duration,
            hist: histogram(),
            rejected_hist: histogram(),
            window_hist: histogram(),
            counts: Counts::default(),
            served: Vec::new(),
            stalls: Vec::new(),
            hosts: Vec::new(),
            kernel: None,
            replica_buffer_drops: None,
            rounds: Vec::new(),
        }
    }

    /// The row's id, with `@RATE` if it ran at its own rate.
    pub fn id(&self) -> String {
        match self.at {
            Some(rate) => format!("{}@{rate}", self.row.id()),
            None => self.row.id(),
        }
    }

    /// The row's label, with the rate if it ran at its own.
    pub fn label(&self) -> String {
        match self.at {
            Some(rate) => format!("{} at {rate}/s", self.row.label()),
            None => self.row.label(),
        }
    }

    /// Merges one client host's report: into the row, and as that host's
    /// own latency.
    pub fn add_host(&mut self, r: &ClientReport, hist: &Histogram<u64>) -> Result<()> {
        self.add(r, hist)?;
        self.hosts.push(hist.clone());
        Ok(())
    }

    /// Merges one client process's report.
    pub fn add(&mut self, r: &ClientReport, hist: &Histogram<u64>) -> Result<()> {
        self.hist.add(hist).context("merging histograms")?;
        for (mine, theirs) in [
            (&mut self.rejected_hist, &r.rejected_histogram),
            (&mut self.window_hist, &r.window_histogram),
        ] {
            if !theirs.is_empty() {
                mine.add(decode_histogram(theirs)?)
                    .context("merging histograms")?;
            }
        }
        self.counts.add(&r.counts);
        if self.served.len() < r.served.len() {
            self.served.resize(r.served.len(), Vec::new());
        }
        for (mine, theirs) in self.served.iter_mut().zip(&r.served) {
            if mine.len() < theirs.len() {
                mine.resize(theirs.len(), 0);
            }
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += u64::from(*t);
            }
        }
        Ok(())
    }

    /// Appends a later segment of the same row: its time series after this
    /// one's (time then counts load time, segment after segment).
    pub fn append(&mut self, seg: RowResult) -> Result<()> {
        self.rounds.push(Round {
            p99_us: seg.us(0.99),
            p999_us: seg.us(0.999),
            p9999_us: seg.us(0.9999),
            lost: seg.counts.lost,
        });
        let offset_ms = self.duration.as_millis() as usize;
        let offset = self.duration.as_secs_f64();
        self.hist.add(&seg.hist).context("merging histograms")?;
        self.rejected_hist
            .add(&seg.rejected_hist)
            .context("merging histograms")?;
        self.window_hist
            .add(&seg.window_hist)
            .context("merging histograms")?;
        self.counts.add(&seg.counts);
        if self.served.len() < seg.served.len() {
            self.served.resize(seg.served.len(), Vec::new());
        }
        let seg_ms = seg.duration.as_millis() as usize;
        for (i, mine) in self.served.iter_mut().enumerate() {
            mine.resize(offset_ms, 0);
            let theirs = seg.served.get(i).map_or(&[][..], |v| &v[..]);
            mine.extend((0..seg_ms).map(|b| theirs.get(b).copied().unwrap_or(0)));
        }
        self.stalls
            .extend(seg.stalls.iter().map(|(a, b)| (a + offset, b + offset)));
        if self.hosts.len() < seg.hosts.len() {
            self.hosts.resize(seg.hosts.len(), histogram());
        }
        for (mine, theirs) in self.hosts.iter_mut().zip(&seg.hosts) {
            mine.add(theirs).context("merging histograms")?;
        }
        self.kernel = match (self.kernel, seg.kernel) {
            (Some(mut k), Some(s)) => {
                k.add(&s);
                Some(k)
            }
            (k, s) => k.or(s),
        };
        self.duration += seg.duration;
        Ok(())
    }

    /// Reads answered per second.
    pub fn rate(&self) -> f64 {
        self.counts.received as f64 / self.duration.as_secs_f64()
    }

    /// Latency at quantile `q`, microseconds.
    pub fn us(&self, q: f64) -> u64 {
        self.hist.value_at_quantile(q)
    }

    pub fn served_totals(&self) -> Vec<u64> {
        self.served.iter().map(|s| s.iter().sum()).collect()
    }

    /// The median over rounds of `of` (the lower middle of an even count).
    pub fn round_median(&self, of: impl Fn(&Round) -> u64) -> Option<u64> {
        let mut v: Vec<u64> = self.rounds.iter().map(of).collect();
        v.sort_unstable();
        v.get(v.len().saturating_sub(1) / 2).copied()
    }

    /// Each replica's share of the answered reads.
    pub fn shares(&self) -> Vec<f64> {
        shares_of(&self.served_totals())
    }

    /// Per replica, the reads it answered of those sent while the primary
    /// was stalled (by intended send time, in whole 1 ms bins that overlap
    /// a stall).
    pub fn served_in_stalls(&self) -> Vec<u64> {
        let in_stall = |ms: usize| {
            let (from, to) = (ms as f64 / 1000.0, (ms + 1) as f64 / 1000.0);
            self.stalls.iter().any(|(a, b)| from < *b && to > *a)
        };
        self.served
            .iter()
            .map(|bins| {
                bins.iter()
                    .enumerate()
                    .filter(|(ms, _)| in_stall(*ms))
                    .map(|(_, n)| n)
                    .sum()
            })
            .collect()
    }

    /// Each replica's share of the reads sent while the primary stalled.
    pub fn shares_in_stalls(&self) -> Vec<f64> {
        shares_of(&self.served_in_stalls())
    }

    /// Share of reads answered by a replica other than the primary.
    pub fn redirected(&self) -> f64 {
        1.0 - self.shares().first().copied().unwrap_or(1.0)
    }

    /// Per replica, the longest run of milliseconds (by send time) in
    /// which it answered no read.
    pub fn longest_gaps_ms(&self) -> Vec<u64> {
        let ms = self.duration.as_millis() as usize;
        self.served
            .iter()
            .map(|bins| {
                let (mut longest, mut run) = (0u64, 0u64);
                for b in bins.iter().take(ms) {
                    run = if *b == 0 { run + 1 } else { 0 };
                    longest = longest.max(run);
                }
                longest
            })
            .collect()
    }

    /// p50, p90, p99, p99.9, p99.99 and max, formatted.
    pub fn latencies(&self) -> [String; 6] {
        [0.5, 0.9, 0.99, 0.999, 0.9999, 1.0].map(|q| format_us(self.us(q)))
    }

    /// Reads that waited at least half a stall (the row's mean stall), from
    /// the intended send time: the reads stuck on the stalled primary.
    /// `None` in rows without stalls.
    pub fn stuck(&self) -> Option<u64> {
        if self.stalls.is_empty() {
            return None;
        }
        let total: f64 = self.stalls.iter().map(|(a, b)| b - a).sum();
        let half_us = (total / self.stalls.len() as f64 * 1e6 / 2.0) as u64;
        Some(self.hist.count_between(half_us.max(1), u64::MAX))
    }

    /// `stuck` formatted as a count and a share of the reads sent.
    pub fn stuck_text(&self) -> String {
        self.stuck().map_or("-".into(), |n| {
            format!(
                "{n} ({:.2}%)",
                100.0 * n as f64 / self.counts.sent.max(1) as f64
            )
        })
    }

    /// Hedge copies sent, as a share of the reads sent ("-" without the
    /// selector).
    pub fn extra_reads(&self) -> Option<f64> {
        self.kernel
            .map(|k| k.hedges_sent as f64 / self.counts.sent.max(1) as f64)
    }

    /// Replies that carried a value (not a `SERVER_ERROR`, not wrong).
    pub fn values(&self) -> u64 {
        self.counts.received - self.counts.rejected - self.counts.wrong
    }

    /// p50, p99 and max of a histogram, formatted ("-" when empty).
    pub fn summary(h: &Histogram<u64>) -> [String; 3] {
        [0.5, 0.99, 1.0].map(|q| {
            if h.is_empty() {
                "-".into()
            } else {
                format_us(h.value_at_quantile(q))
            }
        })
    }

    pub fn one_line(&self) -> String {
        if let Row::Overload { .. } = self.row {
            let [r50, r99, rmax] = Self::summary(&self.rejected_hist);
            let [w50, w99, wmax] = Self::summary(&self.window_hist);
            return format!(
                "{:<32} sent {} values {} SERVER_ERROR {} lost {}; rejected p50 {r50} p99 {r99} max {rmax}; \
                 stop window p50 {w50} p99 {w99} max {wmax}",
                self.label(),
                self.counts.sent,
                self.values(),
                self.counts.rejected,
                self.counts.lost
            );
        }
        let [p50, _, p99, p999, p9999, max] = self.latencies();
        format!(
            "{:<32} {:>7.0}/s p50 {p50:>8} p99 {p99:>8} p99.9 {p999:>8} p99.99 {p9999:>8} max {max:>8} \
             redirected {:>5.1}% hedged {:>4.2}% lost {}",
            self.label(),
            self.rate(),
            100.0 * self.redirected(),
            100.0 * self.extra_reads().unwrap_or(0.0),
            self.counts.lost
        )
    }
}

/// Each count's share of their sum.
fn shares_of(counts: &[u64]) -> Vec<f64> {
    let all: u64 = counts.iter().sum();
    counts
        .iter()
        .map(|n| *n as f64 / all.max(1) as f64)
        .collect()
}

pub fn format_us(us: u64) -> String {
    if us < 1000 {
        format!("{us} us")
    } else if us < 1_000_000 {
        format!("{:.1} ms", us as f64 / 1000.0)
    } else {
        format!("{:.2} s", us as f64 / 1e6)
    }
}

/// A target from the issue and whether this run met it.
#[derive(Clone, Debug)]
pub struct Target {
    pub name: String,
    pub measured: String,
    pub met: bool,
}

impl Target {
    /// `mine` (µs) at most `factor` times `base`.
    fn at_most(name: String, prefix: &str, mine: u64, base: u64, factor: f64) -> Self {
        Self {
            name,
            measured: format!(
                "{prefix}{} vs {} = {:.2}x",
                format_us(mine),
                format_us(base),
                ratio(mine, base)
            ),
            met: mine as f64 <= factor * base as f64,
        }
    }
}

/// The machine the run was on.
#[derive(Clone, Debug)]
pub struct Machine {
    pub cores: usize,
    pub kernel: String,
    pub cpu: String,
}

impl Machine {
    pub fn this() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu = read("/proc/cpuinfo")
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        Self {
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
            cpu,
        }
    }
}

pub struct Report {
    pub command: String,
    /// The benchmark's rate (`--rate`); rows with their own carry theirs.
    pub default_rate: u32,
    pub parameters: String,
    pub machine: Machine,
    pub rows: Vec<RowResult>,
    /// The overload scenario's rows, and what it was.
    pub overload: Vec<RowResult>,
    pub overload_parameters: String,
    pub costs: Vec<CostRow>,
}

fn ratio(a: u64, b: u64) -> f64 {
    a as f64 / b.max(1) as f64
}

impl Report {
    pub fn new(
        opts: &Options,
        rows: Vec<RowResult>,
        overload: Vec<RowResult>,
        costs: Vec<CostRow>,
    ) -> Self {
        let parameters = format!(
            "{}{} rows of {:.0} s each (in {} interleaved rounds); {} reads/s from {} client processes on connected UDP sockets; \
             the primary stopped (SIGSTOP) for {} ms every {} ms; slow list: speculative timeout {} ms, \
             expiry {} ms; thresholds {:?} (selector and client reorder), absolute {}; {} keys; \
             request timeout {} ms; rows marked *at N/s* run at N reads/s instead; the herding rows \
             from {} client hosts with one client process and one selector each",
            if opts.quick { "quick mode: " } else { "" },
            rows.len(),
            opts.duration.as_secs_f64(),
            opts.rounds,
            opts.rate,
            opts.clients,
            opts.stall.as_millis(),
            opts.stall_every.as_millis(),
            opts.slow_list_timeout.as_millis(),
            opts.slow_list_expiry.as_millis(),
            opts.thresholds,
            opts.absolute_threshold,
            opts.keys,
            opts.drain.as_millis(),
            opts.herding_hosts,
        );
        let overload_parameters = format!(
            "{}{} reads/s from {} client processes for {:.1} s per row, every replica stopped \
             (SIGSTOP) for {} ms in the middle; the selector at its defaults (threshold policy) \
             with `max_pending` as in the row; request timeout and drain {} ms after the last send; \
             rows run once each, one after the other (after the stall rows, if any)",
            if opts.quick { "quick mode: " } else { "" },
            opts.overload_rate,
            opts.clients,
            opts.overload_duration.as_secs_f64(),
            opts.overload_stop.as_millis(),
            opts.overload_drain().as_millis(),
        );
        Self {
            command: opts.command.clone(),
            default_rate: opts.rate,
            parameters,
            machine: Machine::this(),
            rows,
            overload,
            overload_parameters,
            costs,
        }
    }

    /// `row` at the benchmark's rate.
    pub fn row(&self, row: &Row) -> Option<&RowResult> {
        self.row_at(row, self.default_rate)
    }

    /// `row` at `offered` reads/s: under its own id if it has one there,
    /// else the benchmark's row if that ran at this rate.
    pub fn row_at(&self, row: &Row, offered: u32) -> Option<&RowResult> {
        let at = |r: &&RowResult| &r.row == row && r.offered == offered;
        let mut found = self.rows.iter().filter(at);
        let first = found.next()?;
        Some(found.find(|r| r.at.is_some()).unwrap_or(first))
    }

    /// The selector threshold row with the lowest p99 (then p99.9).
    pub fn best_selector(&self) -> Option<&RowResult> {
        self.rows
            .iter()
            .filter(|r| r.row.is_selector_threshold() && r.offered == self.default_rate)
            .min_by_key(|r| (r.us(0.99), r.us(0.999)))
    }

    pub fn targets(&self) -> Vec<Target> {
        let mut t = self.stall_targets();
        t.extend(self.hedge_targets());
        t.extend(self.latency_targets());
        t
    }

    /// Issue 8's target for the latency policy: at every rate it ran at,
    /// p99 within 1.2x of the no-stall p99 at the same rate.
    pub fn latency_targets(&self) -> Vec<Target> {
        self.rows
            .iter()
            .filter(|r| matches!(r.row, Row::Latency(_)))
            .filter_map(|r| {
                let nostall = self.row_at(&Row::NoStall, r.offered)?;
                Some(Target::at_most(
                    format!("{}: p99 within 1.2x of the no-stall p99", r.label()),
                    "",
                    r.us(0.99),
                    nostall.us(0.99),
                    1.2,
                ))
            })
            .collect()
    }

    /// Issue 8's targets for each hedged row, against threshold 1 without
    /// hedging (the same policy), primary only and no stall, in this run.
    pub fn hedge_targets(&self) -> Vec<Target> {
        let mut t = Vec::new();
        for r in self.rows.iter().filter(|r| matches!(r.row, Row::Hedged(_))) {
            let (Some(plain), Some(nostall), Some(primary)) = (
                self.row_at(&Row::Threshold(1), r.offered),
                self.row_at(&Row::NoStall, r.offered),
                self.row_at(&Row::PrimaryOnly, r.offered),
            ) else {
                continue;
            };
            let who = r.label();
            let p999 = r.us(0.999);
            t.push(Target::at_most(
                format!("{who}: p99.9 at most 2x the no-stall p99.9"),
                "",
                p999,
                nostall.us(0.999),
                2.0,
            ));
            for (base, q, what, factor) in [
                (primary, 0.999, "p99.9", 5.0),
                (plain, 0.999, "p99.9", 5.0),
                (plain, 0.9999, "p99.99", 3.0),
            ] {
                let mine = r.us(q);
                t.push(Target {
                    name: format!(
                        "{who}: {what} at least {factor}x lower than {}",
                        base.label()
                    ),
                    measured: format!(
                        "{} vs {} = {:.1}x lower (stuck reads: {} vs {})",
                        format_us(mine),
                        format_us(base.us(q)),
                        ratio(base.us(q), mine),
                        r.stuck_text(),
                        base.stuck_text()
                    ),
                    met: base.us(q) as f64 >= factor * mine as f64,
                });
            }
            let extra = r.extra_reads().unwrap_or(0.0);
            let budget = f64::from(
                selector_user::config::defaults::RunDefaults::default()
                    .tunables
                    .hedging
                    .budget_percent,
            ) / 100.0;
            t.push(Target {
                name: format!("{who}: extra reads at most the budget"),
                measured: format!(
                    "{:.2}% of reads (budget {:.0}%)",
                    100.0 * extra,
                    100.0 * budget
                ),
                met: extra <= budget,
            });
        }
        t
    }

    fn stall_targets(&self) -> Vec<Target> {
        let mut t = Vec::new();
        let (Some(best), Some(nostall), Some(primary)) = (
            self.best_selector(),
            self.row(&Row::NoStall),
            self.row(&Row::PrimaryOnly),
        ) else {
            return t;
        };
        let b99 = best.us(0.99);
        let who = best.label();
        t.push(Target::at_most(
            "selector p99 (best threshold) within 1.2x of the no-stall p99".into(),
            &format!("{who}: "),
            b99,
            nostall.us(0.99),
            1.2,
        ));
        let lower = |q: f64, what: &str, factor: f64| Target {
            name: format!("selector {what} at least {factor}x lower than primary only"),
            measured: format!(
                "{} vs {} = {:.1}x lower",
                format_us(best.us(q)),
                format_us(primary.us(q)),
                ratio(primary.us(q), best.us(q))
            ),
            met: primary.us(q) as f64 >= factor * best.us(q) as f64,
        };
        t.push(lower(0.99, "p99", 5.0));
        t.push(lower(0.999, "p99.9", 3.0));
        for other in [Row::SlowList, Row::Nginx] {
            if let Some(o) = self.row(&other) {
                t.push(Target {
                    name: format!("selector p99 better than {}", other.label()),
                    measured: format!("{} vs {}", format_us(b99), format_us(o.us(0.99))),
                    met: b99 < o.us(0.99),
                });
            }
        }
        if let Some(obs) = self.row(&Row::Observe) {
            let r = obs.rate() / primary.rate().max(1e-9);
            t.push(Target {
                name: "observe mode: achieved rate at least 0.97 of no selector".into(),
                measured: format!("{:.0}/s vs {:.0}/s = {r:.3}", obs.rate(), primary.rate()),
                met: r >= 0.97,
            });
            let d = obs.us(0.5) as f64 / primary.us(0.5).max(1) as f64 - 1.0;
            t.push(Target {
                name: "observe mode: p50 within 3% of no selector".into(),
                measured: format!(
                    "{} vs {} = {:+.1}%",
                    format_us(obs.us(0.5)),
                    format_us(primary.us(0.5)),
                    100.0 * d
                ),
                met: d.abs() <= 0.03,
            });
        }
        let targeted: Vec<&CostRow> = self.costs.iter().filter(|c| c.target).collect();
        if !targeted.is_empty() {
            let worst = targeted
                .iter()
                .max_by(|a, b| a.over_empty().total_cmp(&b.over_empty()))
                .expect("non-empty");
            t.push(Target {
                name: "per-packet cost at most 4x the empty program".into(),
                measured: format!(
                    "worst: {} {}, {:.1}x",
                    worst.program,
                    worst.case,
                    worst.over_empty()
                ),
                met: targeted.iter().all(|c| c.over_empty() <= 4.0),
            });
            let spread = |c: &CostRow| c.large_over_small().max(1.0 / c.large_over_small());
            let worst = targeted
                .iter()
                .max_by(|a, b| spread(a).total_cmp(&spread(b)))
                .expect("non-empty");
            t.push(Target {
                name: "per-packet cost within 1.2x between the small and the large in-flight table"
                    .into(),
                measured: format!(
                    "worst: {} {}, {:.2}x",
                    worst.program,
                    worst.case,
                    worst.large_over_small()
                ),
                met: targeted.iter().all(|c| spread(c) <= 1.2),
            });
        }
        for r in super::packet_cost::reference_ratios(&self.costs) {
            t.push(Target {
                name: format!("{} at most 1.5x", r.path),
                measured: format!(
                    "{:.2}x / {:.2}x (small / large table); without the empty program's time {:.2}x / {:.2}x",
                    r.small, r.large, r.small_net, r.large_net
                ),
                met: r.worst() <= 1.5,
            });
        }
        t
    }

    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let m = &self.machine;
        let _ = writeln!(md, "# selector benchmark\n");
        let _ = writeln!(md, "Command: `{}`\n", self.command);
        let _ = writeln!(
            md,
            "Machine: {} cores ({}), kernel {}\n",
            m.cores, m.cpu, m.kernel
        );
        if !self.rows.is_empty() {
            self.stall_markdown(&mut md);
        }
        self.overload_markdown(&mut md);
        self.cost_markdown(&mut md);
        self.notes_markdown(&mut md);
        md
    }

    fn stall_markdown(&self, md: &mut String) {
        let _ = writeln!(md, "Scenario: {}.\n", self.parameters);
        let _ = writeln!(md, "## Read latency with the primary stalling\n");
        let _ = writeln!(
            md,
            "Latency from the intended send time. *redirected*: reads answered by a replica other \
             than the primary (by the replica's mark in the value; for nginx, which has no primary, \
             reads not served by replica 0). *gap*: per replica, the longest stretch of send time in \
             which it answered no read. *stuck*: reads that waited at least half a stall, and their \
             share of the reads sent (one per stall is 0.1% at 2000 reads/s, exactly the p99.9's \
             share, so the p99.9 then lands on either side of them).\n"
        );
        let replicas = self.rows.iter().map(|r| r.served.len()).max().unwrap_or(0);
        let names = (0..replicas)
            .map(|i| format!("r{i}"))
            .collect::<Vec<_>>()
            .join("/");
        let _ = writeln!(
            md,
            "| policy | reads/s | p50 | p90 | p99 | p99.9 | p99.99 | max | redirected | hedged | reads {names} (%) | gap {names} (ms) | lost | stuck |"
        );
        let _ = writeln!(
            md,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in &self.rows {
            let shares = r
                .shares()
                .iter()
                .map(|s| format!("{:.1}", 100.0 * s))
                .collect::<Vec<_>>()
                .join("/");
            let gaps = r
                .longest_gaps_ms()
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join("/");
            let _ = writeln!(
                md,
                "| {} | {:.0} | {} | {:.1}% | {} | {} | {} | {} | {} |",
                r.label(),
                r.rate(),
                r.latencies().join(" | "),
                100.0 * r.redirected(),
                r.extra_reads()
                    .map_or("-".into(), |x| format!("{:.2}%", 100.0 * x)),
                shares,
                gaps,
                r.counts.lost,
                r.stuck_text()
            );
        }
        self.rounds_markdown(md);
        let _ = writeln!(md, "\n## Ratios (lower is better)\n");
        let _ = writeln!(
            md,
            "Against primary only and no stall at the same rate (`-`: not run at it).\n"
        );
        let _ = writeln!(
            md,
            "| policy | p99 / primary only | p99.9 / primary only | p99 / no stall | p99.9 / no stall |"
        );
        let _ = writeln!(md, "|---|---:|---:|---:|---:|");
        for r in &self.rows {
            let primary = self.row_at(&Row::PrimaryOnly, r.offered);
            let nostall = self.row_at(&Row::NoStall, r.offered);
            let vs = |base: Option<&RowResult>, q: f64| {
                base.map_or("-".into(), |b| format!("{:.3}", ratio(r.us(q), b.us(q))))
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} |",
                r.label(),
                vs(primary, 0.99),
                vs(primary, 0.999),
                vs(nostall, 0.99),
                vs(nostall, 0.999)
            );
        }
        let _ = writeln!(md, "\n## Targets\n");
        for t in self.targets() {
            let _ = writeln!(
                md,
                "- {} **{}**: {}",
                t.name,
                if t.met { "met" } else { "NOT met" },
                t.measured
            );
        }
        self.herding_markdown(md);
    }

    fn overload_markdown(&self, md: &mut String) {
        if self.overload.is_empty() {
            return;
        }
        let _ = writeln!(md, "\n## Overload: every replica stopped\n");
        let _ = writeln!(md, "Scenario: {}.\n", self.overload_parameters);
        let _ = writeln!(
            md,
            "*value*: answered with the key's value; *SERVER_ERROR*: answered by the selector's \
             reject; *lost*: no reply by the end of the drain. Latency from the intended send \
             time: of the SERVER_ERROR replies, and of every reply to a read intended during \
             the stop.\n"
        );
        let _ = writeln!(
            md,
            "| on overload | sent | value | SERVER_ERROR | lost | rejected p50 | rejected p99 | rejected max | stop window p50 | stop window p99 | stop window max |"
        );
        let _ = writeln!(
            md,
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for r in &self.overload {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} |",
                r.label(),
                r.counts.sent,
                r.values(),
                r.counts.rejected,
                r.counts.lost,
                RowResult::summary(&r.rejected_hist).join(" | "),
                RowResult::summary(&r.window_hist).join(" | "),
            );
        }
    }

    fn cost_markdown(&self, md: &mut String) {
        if self.costs.is_empty() {
            return;
        }
        let _ = writeln!(md, "\n## Per-packet cost (BPF_PROG_TEST_RUN)\n");
        let _ = writeln!(
            md,
            "ns per packet as the kernel measured it, with the in-flight table holding the small \
             / large number of other entries; *empty*: the empty program of the same kind measured \
             the same way. *per packet*: each packet its own request, one run each (a stateful \
             path runs only once per request); *repeat*: one packet run many times.\n"
        );
        let _ = writeln!(
            md,
            "| program | case | method | small | large | empty (small/large) | x empty | large / small |"
        );
        let _ = writeln!(md, "|---|---|---|---:|---:|---:|---:|---:|");
        for c in &self.costs {
            let _ = writeln!(
                md,
                "| {} | {}{} | {} | {:.1} | {:.1} | {:.1} / {:.1} | {:.2} | {:.2} |",
                c.program,
                c.case,
                if c.target { "" } else { " (context)" },
                match c.method {
                    Method::Repeat => "repeat",
                    Method::PerPacket => "per packet",
                },
                c.small_ns,
                c.large_ns,
                c.empty_small_ns,
                c.empty_large_ns,
                c.over_empty(),
                c.large_over_small()
            );
        }
        let ratios = super::packet_cost::reference_ratios(&self.costs);
        if !ratios.is_empty() {
            let _ = writeln!(
                md,
                "\nAgainst the reference programs (target: at most 1.5x), small / large table; \
                 in brackets without the empty program's time:\n"
            );
            for r in ratios {
                let _ = writeln!(
                    md,
                    "- {}: {:.2}x / {:.2}x ({:.2}x / {:.2}x)",
                    r.path, r.small, r.large, r.small_net, r.large_net
                );
            }
        }
    }

    fn notes_markdown(&self, md: &mut String) {
        let _ = writeln!(md, "\n## Checks\n");
        for r in self.rows.iter().chain(&self.overload) {
            let kernel = r.kernel.map_or(String::new(), |k| {
                let live = k.live_ns().map_or(String::new(), |(e, i)| {
                    format!(
                        "; on this traffic the egress program took {e:.0} ns per run ({} runs), \
                         the ingress program {i:.0} ns ({} runs)",
                        k.egress_runs, k.ingress_runs
                    )
                });
                let overload = if k.overload_passed + k.overload_dropped + k.overload_rejected > 0 {
                    format!(
                        ", over the cap {} passed / {} dropped / {} rejected",
                        k.overload_passed, k.overload_dropped, k.overload_rejected
                    )
                } else {
                    String::new()
                };
                format!(
                    "; selector counted {} requests, redirected {} ({:.1}%), untracked {}, expired {}{overload}{live}",
                    k.requests,
                    k.redirected,
                    100.0 * k.redirected as f64 / k.requests.max(1) as f64,
                    k.untracked,
                    k.expired
                )
            });
            let buffers = r.replica_buffer_drops.map_or(String::new(), |d| {
                format!(", requests dropped at the replicas' full receive buffers {d}")
            });
            let _ = writeln!(
                md,
                "- {}: sent {}, answered {} ({} SERVER_ERROR), lost {}, wrong values {}, late replies {}, retries {}, \
                 sends over 1 ms late {} (at most {}), {} stalls{buffers}{}",
                r.label(),
                r.counts.sent,
                r.counts.received,
                r.counts.rejected,
                r.counts.lost,
                r.counts.wrong,
                r.counts.late,
                r.counts.retries,
                r.counts.late_sends,
                format_us(r.counts.max_send_lag_us),
                r.stalls.len(),
                kernel
            );
        }
    }

    pub fn csv(&self) -> String {
        let mut out = String::from(
            "id,label,reads_per_s,p50_us,p90_us,p99_us,p999_us,max_us,redirected,\
             share_r0,share_r1,share_r2,gap_r0_ms,gap_r1_ms,gap_r2_ms,\
             p99_vs_primary,p999_vs_primary,p99_vs_no_stall,p999_vs_no_stall,\
             sent,received,lost,wrong,late,retries,max_send_lag_us,stalls,\
             kernel_requests,kernel_redirected,p9999_us,kernel_hedges_sent,kernel_hedges_won,\
             offered_per_s,rounds,median_round_p99_us,median_round_p999_us,median_round_p9999_us,\
             rounds_with_lost,stuck\n",
        );
        for r in &self.rows {
            let primary = self.row_at(&Row::PrimaryOnly, r.offered);
            let nostall = self.row_at(&Row::NoStall, r.offered);
            let shares = r.shares();
            let gaps = r.longest_gaps_ms();
            let col = |v: &[f64], i: usize| v.get(i).map_or(String::new(), |x| format!("{x:.4}"));
            let gap = |i: usize| gaps.get(i).map_or(String::new(), u64::to_string);
            let vs = |base: Option<&RowResult>, q: f64| {
                base.map_or(String::new(), |b| format!("{:.4}", ratio(r.us(q), b.us(q))))
            };
            let k = r.kernel.unwrap_or_default();
            let median =
                |of: fn(&Round) -> u64| r.round_median(of).map_or(String::new(), |v| v.to_string());
            let _ = writeln!(
                out,
                "{},{},{:.1},{},{},{},{},{},{:.4},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
                r.id(),
                r.label().replace(',', ";"),
                r.rate(),
                r.us(0.5),
                r.us(0.9),
                r.us(0.99),
                r.us(0.999),
                r.hist.max(),
                r.redirected(),
                col(&shares, 0),
                col(&shares, 1),
                col(&shares, 2),
                gap(0),
                gap(1),
                gap(2),
                vs(primary, 0.99),
                vs(primary, 0.999),
                vs(nostall, 0.99),
                vs(nostall, 0.999),
                r.counts.sent,
                r.counts.received,
                r.counts.lost,
                r.counts.wrong,
                r.counts.late,
                r.counts.retries,
                r.counts.max_send_lag_us,
                r.stalls.len(),
                k.requests,
                k.redirected,
                r.us(0.9999),
                k.hedges_sent,
                k.hedges_won,
                r.offered,
                r.rounds.len(),
                median(|x| x.p99_us),
                median(|x| x.p999_us),
                median(|x| x.p9999_us),
                r.rounds.iter().filter(|x| x.lost > 0).count(),
                r.stuck().map_or(String::new(), |n| n.to_string())
            );
        }
        out
    }

    /// Rows with several client hosts: each row over all hosts (`all`),
    /// then each host; latencies in microseconds, shares of the reads
    /// sent during stalls (`stall_`) and of all reads, per replica.
    pub fn herding_csv(&self) -> String {
        let mut out = String::from(
            "id,label,host,reads,p50_us,p99_us,p999_us,max_us,stall_reads,\
             stall_share_r0,stall_share_r1,stall_share_r2,share_r0,share_r1,share_r2\n",
        );
        for r in self.rows.iter().filter(|r| r.row.several_hosts()) {
            let q = |h: &Histogram<u64>| {
                [0.5, 0.99, 0.999, 1.0].map(|q| h.value_at_quantile(q).to_string())
            };
            let shares = |v: Vec<f64>| {
                (0..3)
                    .map(|i| v.get(i).map_or(String::new(), |x| format!("{x:.4}")))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let label = r.label().replace(',', ";");
            let _ = writeln!(
                out,
                "{},{label},all,{},{},{},{},{}",
                r.id(),
                r.hist.len(),
                q(&r.hist).join(","),
                r.served_in_stalls().iter().sum::<u64>(),
                shares(r.shares_in_stalls()),
                shares(r.shares())
            );
            for (host, h) in r.hosts.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{},{label},{host},{},{},,,,,,,",
                    r.id(),
                    h.len(),
                    q(h).join(",")
                );
            }
        }
        out
    }

    /// Each row's median round: a busy moment of a shared machine (a
    /// second-long pause loses reads, recorded at the timeout) moves the
    /// whole row's tail, but only its own round's.
    fn rounds_markdown(&self, md: &mut String) {
        if self.rows.iter().all(|r| r.rounds.len() < 2) {
            return;
        }
        let _ = writeln!(md, "\n## Median round\n");
        let _ = writeln!(
            md,
            "Each row's percentiles in each round on its own, then the median over its rounds; \
             *rounds with lost reads*: rounds in which a read was not answered within the request \
             timeout (a pause of the machine, or of a replica).\n"
        );
        let _ = writeln!(
            md,
            "| policy | rounds | median p99 | median p99.9 | median p99.99 | rounds with lost reads |"
        );
        let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|");
        for r in &self.rows {
            let median = |of: fn(&Round) -> u64| r.round_median(of).map_or("-".into(), format_us);
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} |",
                r.label(),
                r.rounds.len(),
                median(|x| x.p99_us),
                median(|x| x.p999_us),
                median(|x| x.p9999_us),
                r.rounds.iter().filter(|x| x.lost > 0).count()
            );
        }
    }

    fn herding_markdown(&self, md: &mut String) {
        let rows: Vec<&RowResult> = self.rows.iter().filter(|r| r.row.several_hosts()).collect();
        let Some(hosts) = rows.iter().map(|r| r.hosts.len()).max() else {
            return;
        };
        let _ = writeln!(md, "\n## Several client hosts: herding\n");
        let _ = writeln!(
            md,
            "{hosts} client hosts on the same switch, each with its own selector (threshold 1) and \
             one client process, together at the row's rate, reading from the same replicas while \
             the primary stalls. *in stalls*: of the reads sent while the primary was stalled \
             (by intended send time), each replica's share of those it answered. Latency per \
             host from the intended send time.\n"
        );
        let names = |prefix: &str, n: usize| {
            (0..n)
                .map(|i| format!("{prefix}{i}"))
                .collect::<Vec<_>>()
                .join("/")
        };
        let replicas = rows.iter().map(|r| r.served.len()).max().unwrap_or(0);
        let _ = writeln!(
            md,
            "| row | p99 | p99.9 | reads in stalls | in stalls {} (%) | all reads {} (%) | p99 per host {} | p99.9 per host {} |",
            names("r", replicas),
            names("r", replicas),
            names("h", hosts),
            names("h", hosts)
        );
        let _ = writeln!(md, "|---|---:|---:|---:|---:|---:|---:|---:|");
        let percent = |v: Vec<f64>| {
            v.iter()
                .map(|x| format!("{:.1}", 100.0 * x))
                .collect::<Vec<_>>()
                .join("/")
        };
        let per_host = |r: &RowResult, q: f64| {
            r.hosts
                .iter()
                .map(|h| format_us(h.value_at_quantile(q)))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        for r in rows {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                r.label(),
                format_us(r.us(0.99)),
                format_us(r.us(0.999)),
                r.served_in_stalls().iter().sum::<u64>(),
                percent(r.shares_in_stalls()),
                percent(r.shares()),
                per_host(r, 0.99),
                per_host(r, 0.999)
            );
        }
    }

    /// The overload rows; latencies in microseconds (empty: no reply).
    pub fn overload_csv(&self) -> String {
        let mut out = String::from(
            "id,label,max_pending,sent,values,rejected,lost,wrong,late,\
             rejected_p50_us,rejected_p99_us,rejected_max_us,\
             window_p50_us,window_p99_us,window_max_us,window_replies,\
             stop_start_s,stop_end_s,kernel_overload_passed,kernel_overload_dropped,kernel_overload_rejected,\
             replica_buffer_drops\n",
        );
        for r in &self.overload {
            let q = |h: &Histogram<u64>, q: f64| {
                if h.is_empty() {
                    String::new()
                } else {
                    h.value_at_quantile(q).to_string()
                }
            };
            let cap = match r.row {
                Row::Overload { cap, .. } => cap,
                _ => 0,
            };
            let (from, to) = r.stalls.first().copied().unwrap_or_default();
            let k = r.kernel.unwrap_or_default();
            let _ = writeln!(
                out,
                "{},{},{cap},{},{},{},{},{},{},{},{},{},{},{},{},{},{from:.3},{to:.3},{},{},{},{}",
                r.id(),
                r.label().replace(',', ";"),
                r.counts.sent,
                r.values(),
                r.counts.rejected,
                r.counts.lost,
                r.counts.wrong,
                r.counts.late,
                q(&r.rejected_hist, 0.5),
                q(&r.rejected_hist, 0.99),
                q(&r.rejected_hist, 1.0),
                q(&r.window_hist, 0.5),
                q(&r.window_hist, 0.99),
                q(&r.window_hist, 1.0),
                r.window_hist.len(),
                k.overload_passed,
                k.overload_dropped,
                k.overload_rejected,
                r.replica_buffer_drops.unwrap_or_default()
            );
        }
        out
    }

    pub fn cost_csv(&self) -> String {
        let mut out = String::from(
            "program,case,method,target,small_ns,large_ns,empty_small_ns,empty_large_ns,over_empty,large_over_small\n",
        );
        for c in &self.costs {
            let _ = writeln!(
                out,
                "{},{},{:?},{},{:.2},{:.2},{:.2},{:.2},{:.3},{:.3}",
                c.program,
                c.case,
                c.method,
                c.target,
                c.small_ns,
                c.large_ns,
                c.empty_small_ns,
                c.empty_large_ns,
                c.over_empty(),
                c.large_over_small()
            );
        }
        out
    }

    /// Writes results.md, results.csv, overload.csv, herding.csv,
    /// packet_cost.csv and the plots.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let write = |name: &str, text: &str| {
            std::fs::write(dir.join(name), text).with_context(|| format!("writing {name}"))
        };
        write("results.md", &self.markdown())?;
        write("results.csv", &self.csv())?;
        write("overload.csv", &self.overload_csv())?;
        write("herding.csv", &self.herding_csv())?;
        write("packet_cost.csv", &self.cost_csv())?;
        // The numbers stand without the pictures: a missing font only
        // costs the plots.
        if self.rows.is_empty() {
            return Ok(());
        }
        if let Err(e) = plots::draw(dir, self) {
            eprintln!("bench: plots skipped: {e:#}");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(row: Row, served: Vec<Vec<u64>>) -> RowResult {
        let mut r = RowResult::new(row, None, 4000, Duration::from_millis(10));
        r.served = served;
        r
    }

    #[test]
    fn gaps_and_shares_come_from_the_bins() {
        let r = result(
            Row::Threshold(1),
            vec![
                vec![1, 1, 0, 0, 0, 1, 1, 1, 1, 1],
                vec![0, 0, 1, 1, 1, 0, 0, 0, 0, 0],
                vec![0; 10],
            ],
        );
        assert_eq!(r.longest_gaps_ms(), vec![3, 5, 10]);
        assert_eq!(r.served_totals(), vec![7, 3, 0]);
        assert!((r.redirected() - 0.3).abs() < 1e-9);
    }

    #[test]
    fn shares_in_stalls_count_the_bins_a_stall_overlaps() {
        let mut r = result(
            Row::Herding(selector_common::TieBreak::First),
            vec![vec![5; 10], vec![0, 0, 1, 1, 1, 0, 0, 0, 2, 0], vec![0; 10]],
        );
        // Bins 2 to 4, and bin 8 (a stall from 8.2 to 8.9 ms).
        r.stalls = vec![(0.0021, 0.0049), (0.0082, 0.0089)];
        assert_eq!(r.served_in_stalls(), vec![20, 5, 0]);
        assert!((r.shares_in_stalls()[1] - 0.2).abs() < 1e-9);
    }

    #[test]
    fn stuck_reads_waited_at_least_half_the_mean_stall() {
        let mut r = result(Row::Threshold(1), vec![vec![0; 10]; 3]);
        for us in [100, 200, 12_000, 12_600, 25_000] {
            r.hist.record(us).unwrap();
        }
        r.counts.sent = 5;
        assert_eq!(r.stuck(), None, "no stalls, nothing stuck");
        assert_eq!(r.stuck_text(), "-");
        // Stalls of 24 and 26 ms: half the mean is 12.5 ms.
        r.stalls = vec![(0.25, 0.274), (0.75, 0.776)];
        assert_eq!(r.stuck(), Some(2));
        assert_eq!(r.stuck_text(), "2 (40.00%)");
    }

    #[test]
    fn rows_at_their_own_rate_are_found_at_it() {
        let mut report = Report {
            command: String::new(),
            default_rate: 4000,
            parameters: String::new(),
            machine: Machine::this(),
            rows: vec![
                result(Row::NoStall, vec![]),
                RowResult::new(Row::NoStall, Some(2000), 2000, Duration::ZERO),
                RowResult::new(Row::NoStall, Some(4000), 4000, Duration::ZERO),
            ],
            overload: Vec::new(),
            overload_parameters: String::new(),
            costs: Vec::new(),
        };
        assert_eq!(
            report.row_at(&Row::NoStall, 2000).unwrap().id(),
            "no_stall@2000"
        );
        assert_eq!(report.row(&Row::NoStall).unwrap().id(), "no_stall@4000");
        assert_eq!(report.rows[1].label(), "no stall (limit) at 2000/s");
        report.rows.truncate(1);
        assert_eq!(report.row(&Row::NoStall).unwrap().id(), "no_stall");
        assert!(report.row_at(&Row::NoStall, 2000).is_none());
    }

    #[test]
    fn the_median_round_ignores_one_bad_round() {
        let mut r = RowResult::new(Row::NoStall, None, 4000, Duration::ZERO);
        for us in [900, 1_000_000, 1000] {
            let mut seg = RowResult::new(Row::NoStall, None, 4000, Duration::from_millis(10));
            seg.hist.record(us).unwrap();
            r.append(seg).unwrap();
        }
        assert_eq!(r.rounds.len(), 3);
        let median = r.round_median(|x| x.p99_us).unwrap();
        assert!((999..=1001).contains(&median), "{median}");
        assert!(r.us(0.99) > 900_000);
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(format_us(87), "87 us");
        assert_eq!(format_us(25_400), "25.4 ms");
        assert_eq!(format_us(1_250_000), "1.25 s");
    }
}
