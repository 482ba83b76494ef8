//! Text for people: the live table, the exit summary and `selector status`.

use std::{fmt::Write as _, net::SocketAddr};

use selector_common::{BackendStats, latency};

use crate::{
    api::Status,
    config::{
        hedge::{HedgeAfter, HedgeSettings},
        settings::BackendPlan,
    },
    telemetry::{
        BackendTotals, EjectionState, PassedCount, Snapshot, TailHistory, delta,
        hedges::{HedgeCounts, total},
        passed_counts, totals,
    },
};

impl Status {
    /// The human form `selector status` prints.
    pub fn render(&self) -> String {
        let s = &self.settings;
        let drained = if self.drained.is_empty() {
            "none".to_string()
        } else {
            let names: Vec<String> = self.drained.iter().map(|a| a.to_string()).collect();
            names.join(", ")
        };
        let netns = self.netns.as_ref().map_or(String::new(), |n| {
            format!(" in netns {} ({})", n.path, n.id)
        });
        let mut out = format!(
            "selector on {}{netns}: {}\n\
             proto {}, timeout {} ms, grace {} ms, mark {:#010x}, {} ingress, tc {}, drained: {drained}\n",
            self.iface,
            s.tunables.describe(),
            s.proto,
            s.timeout_ms,
            s.grace_ms,
            s.mark,
            s.ingress,
            self.tc_attach,
        );
        let h = &self.heartbeat;
        if h.bound_ms != 0 && !h.fresh {
            out += &format!(
                "heartbeat stale: {} ms old, bound {} ms: the programs move no read\n",
                h.age_ms, h.bound_ms
            );
        }
        out += &render_summary(&self.backends);
        out += &render_footer(self.in_flight, &self.backends, &self.passed);
        if s.tunables.hedging.after != HedgeAfter::Off || self.hedges.hedges_sent > 0 {
            let counts: Vec<_> = self
                .backends
                .iter()
                .map(|b| (b.backend, b.hedges))
                .collect();
            out += &render_hedging(&s.tunables.hedging, &counts);
        }
        for r in &self.routed_elsewhere {
            out += &format!(
                "warning: the route to {} leaves by {}, not {}: requests to it are not seen\n",
                r.backend, r.iface, self.iface
            );
        }
        if !self.build.version.is_empty() {
            out += &format!("agent: {}\n", self.build);
        }
        out
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

fn format_share(share: Option<f64>) -> String {
    share.map_or_else(|| "-".into(), |s| format!("{s:.2}"))
}

/// Each backend's state for the live table, in `backends` order: the
/// operator's drain first (it overrides ejection, and is shown apart from
/// it), else outlier ejection's `healthy`, `ejected` or `half_open`.
pub fn state_labels(
    backends: &[BackendPlan],
    ejection: &[EjectionState],
    drained: &[SocketAddr],
) -> Vec<String> {
    backends
        .iter()
        .enumerate()
        .map(|(i, b)| {
            if drained.contains(&b.addr) {
                "drained".to_string()
            } else {
                ejection
                    .get(i)
                    .map_or("-", |e| {
                        if e.slow && e.ejection_state == "healthy" {
                            "slow"
                        } else {
                            e.ejection_state.as_str()
                        }
                    })
                    .to_string()
            }
        })
        .collect()
}

/// The live table: rates, latency quantiles and tail blame over the interval
/// since `before` (the last one `tails` recorded), pending and each
/// backend's state (`states`, from [`state_labels`]) as of now; then the
/// footer.
pub fn render_table(
    backends: &[BackendPlan],
    before: &Snapshot,
    now: &Snapshot,
    tails: &TailHistory,
    states: &[String],
) -> String {
    let secs = now.at.duration_since(before.at).as_secs_f64().max(1e-3);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<22} {:>5} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6}  state",
        "backend", "group", "pending", "req/s", "away/s", "to/s", "timeouts", "p50", "p99", "blame"
    );
    for (i, b) in backends.iter().enumerate() {
        let (s, p) = (&now.stats[i], &before.stats[i]);
        let hist = delta(&now.latency[i], &before.latency[i]);
        let rate = |a: u64, b: u64| a.saturating_sub(b) as f64 / secs;
        let _ = writeln!(
            out,
            "{:<22} {:>5} {:>8} {:>9.0} {:>9.0} {:>9.0} {:>9} {:>9} {:>9} {:>6}  {}",
            b.addr.to_string(),
            b.group + 1,
            now.pending(i),
            rate(s.requests, p.requests),
            rate(s.redirected_away, p.redirected_away),
            rate(s.redirected_to, p.redirected_to),
            now.expired(i),
            format_ns(latency::quantile_ns(&hist, 0.5)),
            format_ns(latency::quantile_ns(&hist, 0.99)),
            format_share(tails.backend(i).tail_blame),
            states.get(i).map_or("-", String::as_str),
        );
    }
    out += &render_footer(
        now.inflight,
        &totals(backends, now, tails),
        &passed_counts(&now.passed),
    );
    out
}

/// Totals since start, one row per backend (printed on exit and by `selector status`).
pub fn render_summary(totals: &[BackendTotals]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8}",
        "backend", "requests", "responses", "away", "to", "timeouts", "p50", "p99", "pending"
    );
    for t in totals {
        let _ = writeln!(
            out,
            "{:<22} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>8}",
            t.backend.to_string(),
            t.stats.requests,
            t.stats.responses,
            t.stats.redirected_away,
            t.stats.redirected_to,
            t.expired,
            format_ns(t.p50_ns),
            format_ns(t.p99_ns),
            t.pending,
        );
    }
    out
}

/// The counters that belong to no single row: entries in flight, requests
/// passed without tracking, and packets passed untouched by reason (those
/// with a count only: `status --json` has every one).
pub fn render_footer(in_flight: usize, totals: &[BackendTotals], passed: &[PassedCount]) -> String {
    let mut all = BackendStats::default();
    for t in totals {
        all.add(&t.stats);
    }
    let mut out = format!(
        "in flight {}  untracked {}  no reply expected {}  id collisions {}  unmatched replies {}  late replies {}\n\
         overloaded: passed {}  dropped {}  rejected {}\n",
        in_flight,
        all.untracked,
        all.no_reply,
        all.id_collisions,
        all.unmatched_responses,
        all.late_responses,
        all.overload_passed,
        all.overload_dropped,
        all.overload_rejected,
    );
    out += "passed untouched:";
    let passed: Vec<&PassedCount> = passed.iter().filter(|p| p.count != 0).collect();
    if passed.is_empty() {
        out += " none";
    }
    for (i, p) in passed.iter().enumerate() {
        let separator = if i == 0 { " " } else { ", " };
        let _ = write!(out, "{separator}{} {} {}", p.direction, p.reason, p.count);
    }
    out.push('\n');
    out
}

/// The hedging lines of `selector status` and of the exit summary.
pub fn render_hedging(settings: &HedgeSettings, counts: &[(SocketAddr, HedgeCounts)]) -> String {
    let mut all = HedgeCounts::default();
    for (_, c) in counts {
        all.add(c);
    }
    let mut out = format!(
        "hedging: after {}, budget {}%: sent {}  won {}  lost {}  replies dropped {}  errors held {}\n\
         not hedged: over budget {}  no target {}  queue full {}  ring full {}  too large {}  send failed {}\n",
        match settings.after {
            crate::config::hedge::HedgeAfter::Fixed(_) => format!("{} ms", settings.after),
            _ => settings.after.to_string(),
        },
        settings.budget_percent,
        all.hedges_sent,
        all.hedges_won,
        all.hedges_lost,
        all.hedge_replies_dropped,
        all.hedge_errors_held,
        all.hedge_over_budget,
        all.hedge_no_target,
        all.hedge_queue_full,
        all.hedge_ring_full,
        all.hedge_too_large,
        all.hedge_send_failed,
    );
    if all.hedges_sent + all.hedge_replies_dropped > 0 {
        let _ = writeln!(
            out,
            "{:<22} {:>8} {:>8} {:>8} {:>8} {:>9}",
            "hedges", "sent", "won", "lost", "dropped", "delay"
        );
        for (addr, c) in counts {
            let delay = c
                .hedge_delay_ns
                .map_or("-".to_string(), |d| format!("{:.2}ms", d as f64 / 1e6));
            let _ = writeln!(
                out,
                "{:<22} {:>8} {:>8} {:>8} {:>8} {:>9}",
                addr.to_string(),
                c.hedges_sent,
                c.hedges_won,
                c.hedges_lost,
                c.hedge_replies_dropped,
                delay
            );
        }
    }
    out
}

/// The live table's hedging line: rates over the interval, all backends.
pub fn render_hedging_interval(
    backends: &[BackendPlan],
    before: &Snapshot,
    now: &Snapshot,
) -> String {
    let secs = now.at.duration_since(before.at).as_secs_f64().max(1e-3);
    let (a, b) = (total(&now.hedges), total(&before.hedges));
    let rate = |n: u64, o: u64| n.saturating_sub(o) as f64 / secs;
    let delays: Vec<String> = backends
        .iter()
        .zip(&now.hedges)
        .filter_map(|(p, c)| {
            c.hedge_delay_ns
                .map(|d| format!("{} {:.2}ms", p.addr, d as f64 / 1e6))
        })
        .collect();
    format!(
        "hedges/s: sent {:.0}  won {:.0}  lost {:.0}  dropped {:.0}  over budget {:.0}; delay: {}\n",
        rate(a.hedges_sent, b.hedges_sent),
        rate(a.hedges_won, b.hedges_won),
        rate(a.hedges_lost, b.hedges_lost),
        rate(a.hedge_replies_dropped, b.hedge_replies_dropped),
        rate(a.hedge_over_budget, b.hedge_over_budget),
        if delays.is_empty() {
            "-".to_string()
        } else {
            delays.join(", ")
        },
    )
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::telemetry::{BackendTail, IntervalTail, LatencyBucket, tests::snap};

    #[test]
    fn the_hedge_delay_reads_as_a_delay_or_as_auto() {
        use crate::config::hedge::HedgeAfter;
        let line = |after| {
            let settings = HedgeSettings {
                after,
                budget_percent: 5,
            };
            render_hedging(&settings, &[])
                .lines()
                .next()
                .unwrap()
                .to_string()
        };
        assert!(
            line(HedgeAfter::Fixed(Duration::from_millis(2)))
                .starts_with("hedging: after 2 ms, budget 5%:")
        );
        assert!(line(HedgeAfter::Auto).starts_with("hedging: after auto, budget 5%:"));
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
        let mut tails = TailHistory::default();
        tails.record(IntervalTail::between(&before, &now));
        let table = render_table(&backends, &before, &now, &tails, &["healthy".into()]);
        assert!(table.lines().next().unwrap().ends_with(" state"), "{table}");
        let row = table.lines().nth(1).unwrap();
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(cols[0], "10.0.0.1:11211");
        assert_eq!(cols[2], "7"); // pending
        assert_eq!(cols[3], "1000"); // (2100-100)/2 s
        assert_eq!(cols[4], "500");
        assert_eq!(cols[6], "2"); // timeouts
        assert_eq!(cols[7], "112us"); // upper edge of 100 µs bucket [96, 112)
        assert!(cols[8].ends_with("ms"), "{row}");
        assert_eq!(cols[9], "1.00"); // the only backend has the whole tail
        assert_eq!(cols[10], "healthy");
        assert!(table.contains("in flight 7"));
        assert!(
            table.contains("passed untouched: egress not_a_backend 3"),
            "{table}"
        );
    }

    #[test]
    fn summary_rows_are_the_totals_since_start() {
        let backends = [
            BackendPlan {
                index: 0,
                addr: "10.0.0.1:11211".parse().unwrap(),
                group: 0,
            },
            BackendPlan {
                index: 9,
                addr: "10.0.0.2:11211".parse().unwrap(),
                group: 1,
            },
        ];
        let mut now = snap(Instant::now(), 50, 5, &[100]);
        now.stats.push(BackendStats {
            redirected_to: 5,
            ..Default::default()
        });
        now.accounting.push((5, 5, 0));
        now.latency.push(vec![0; latency::LATENCY_BUCKETS as usize]);
        let totals = totals(&backends, &now, &TailHistory::default());
        assert_eq!(
            totals[0].latency_buckets,
            [LatencyBucket {
                lower_ns: 96_000,
                upper_ns: Some(112_000),
                count: 1
            }]
        );
        assert_eq!(totals[0].p999_ns, Some(112_000));
        assert!(totals[1].latency_buckets.is_empty());
        assert_eq!(totals[1].tail, BackendTail::default());
        assert_eq!((totals[1].issued, totals[1].completed), (5, 5));
        assert_eq!((totals[1].group, totals[1].position), (2, 1));
        assert_eq!(totals[0].p50_ns, Some(112_000));
        assert_eq!(totals[1].p50_ns, None);
        let summary = render_summary(&totals);
        let cols: Vec<&str> = summary.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "10.0.0.1:11211",
                "50",
                "0",
                "5",
                "0",
                "2",
                "112us",
                "112us",
                "7"
            ]
        );
        let footer = render_footer(0, &totals, &[]);
        assert!(footer.ends_with("passed untouched: none\n"), "{footer}");
        // Only the reasons that counted a packet.
        let passed = |direction: &str, reason: &str, count| PassedCount {
            direction: direction.into(),
            reason: reason.into(),
            count,
        };
        let footer = render_footer(
            0,
            &totals,
            &[
                passed("egress", "not_a_backend", 0),
                passed("egress", "fragment", 2),
                passed("ingress", "not_a_backend", 0),
                passed("ingress", "truncated", 1),
            ],
        );
        assert!(
            footer.ends_with("passed untouched: egress fragment 2, ingress truncated 1\n"),
            "{footer}"
        );
        let footer = render_footer(0, &totals, &[passed("egress", "fragment", 0)]);
        assert!(footer.ends_with("passed untouched: none\n"), "{footer}");
    }

    #[test]
    fn the_table_shows_each_backends_ejection_state_and_drain_apart() {
        let plan = |index: u32, addr: &str| BackendPlan {
            index,
            addr: addr.parse().unwrap(),
            group: 0,
        };
        let backends = [
            plan(0, "10.0.0.1:11211"),
            plan(1, "10.0.0.2:11211"),
            plan(2, "10.0.0.3:11211"),
            plan(3, "10.0.0.4:11211"),
        ];
        let state = |s: &str| EjectionState {
            ejection_state: s.into(),
            ..Default::default()
        };
        let ejection = [
            state("healthy"),
            state("ejected"),
            state("half_open"),
            state("healthy"),
        ];
        let drained = [backends[3].addr];
        let states = state_labels(&backends, &ejection, &drained);
        assert_eq!(states, ["healthy", "ejected", "half_open", "drained"]);
        // Slow shows where nothing stronger (ejection, drain) does.
        let slow = |s: &str| EjectionState {
            slow: true,
            ..state(s)
        };
        assert_eq!(
            state_labels(
                &backends,
                &[
                    slow("healthy"),
                    slow("ejected"),
                    state("healthy"),
                    slow("healthy")
                ],
                &drained
            ),
            ["slow", "ejected", "healthy", "drained"]
        );
        let t0 = Instant::now();
        let mut before = snap(t0, 0, 0, &[]);
        let mut now = snap(t0 + Duration::from_secs(1), 0, 0, &[]);
        for s in [&mut before, &mut now] {
            for _ in 1..backends.len() {
                s.stats.push(BackendStats::default());
                s.accounting.push((0, 0, 0));
                s.latency.push(vec![0; latency::LATENCY_BUCKETS as usize]);
            }
        }
        let table = render_table(&backends, &before, &now, &TailHistory::default(), &states);
        let last: Vec<&str> = table
            .lines()
            .skip(1)
            .take(4)
            .map(|row| row.split_whitespace().last().unwrap())
            .collect();
        assert_eq!(
            last,
            ["healthy", "ejected", "half_open", "drained"],
            "{table}"
        );
    }

    #[test]
    fn durations_format_by_magnitude() {
        assert_eq!(format_ns(None), "-");
        assert_eq!(format_ns(Some(999_000)), "999us");
        assert_eq!(format_ns(Some(25_300_000)), "25.3ms");
        assert_eq!(format_ns(Some(2_500_000_000)), "2.50s");
    }
}
