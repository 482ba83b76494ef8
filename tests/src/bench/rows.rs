//! The rows of the benchmark: every policy compared, in the order they run.

use std::time::Duration;

use anyhow::{Context as _, Result};
use selector_common::{OnOverload, Policy, TieBreak};
use selector_user::config::hedge::HedgeAfter;

use super::client::ClientPolicy;

/// The latency policy's budget in the benchmark: the agent's default.
/// Reads sent in a stall's first `budget` wait it out, 0.2% of reads with
/// 1 ms of a stall every 500 ms, under the p99 the target is about.
pub fn latency_budget_ms() -> u32 {
    selector_user::config::defaults::RunDefaults::default()
        .tunables
        .budget
        .as_millis() as u32
}

/// One policy under test.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Row {
    /// Primary only, no stalls: the limit to approach.
    NoStall,
    /// Primary only, no selector.
    PrimaryOnly,
    /// BookKeeper issue 709 in each client process.
    SlowList,
    /// BookKeeper issue 1489 in each client process, at this threshold.
    Reorder(u32),
    /// nginx stream proxy on the client host, `least_conn`.
    Nginx,
    /// The selector attached, observe mode (counts, never redirects).
    Observe,
    /// The selector, threshold policy.
    Threshold(u32),
    /// The selector, absolute policy.
    Absolute(u32),
    /// The selector, threshold 1, with hedged reads after this delay (the
    /// row to compare with is `Threshold(1)`).
    Hedged(HedgeAfter),
    /// The selector, latency policy, with this budget in milliseconds.
    Latency(u32),
    /// Several client hosts, each with its own selector (threshold 1, this
    /// tie-break) and one client process, reading from the same replicas.
    Herding(TieBreak),
    /// The overload scenario (every replica stopped at once): the selector
    /// at its defaults with `max_pending` (0: no bound) and `on_overload`.
    Overload { on: OnOverload, cap: u32 },
}

impl Row {
    /// Every row, in run order.
    pub fn all(thresholds: &[u32], absolute: u32) -> Vec<Row> {
        let mut rows = vec![Row::NoStall, Row::PrimaryOnly, Row::SlowList];
        rows.extend(thresholds.iter().map(|t| Row::Reorder(*t)));
        rows.extend([Row::Nginx, Row::Observe]);
        rows.extend(thresholds.iter().map(|t| Row::Threshold(*t)));
        rows.push(Row::Absolute(absolute));
        rows.extend(Self::hedged());
        rows.push(Row::Latency(latency_budget_ms()));
        rows.extend(Self::herding());
        rows
    }

    /// The herding rows: BookKeeper's first strict minimum, and random.
    pub fn herding() -> [Row; 2] {
        [
            Row::Herding(TieBreak::First),
            Row::Herding(TieBreak::Random),
        ]
    }

    /// The hedged-read rows: a fixed 2 ms delay and `auto`.
    pub fn hedged() -> [Row; 2] {
        [
            Row::Hedged(HedgeAfter::Fixed(Duration::from_millis(2))),
            Row::Hedged(HedgeAfter::Auto),
        ]
    }

    /// The overload scenario's rows, in run order: no cap (reads pass, as
    /// by default), then the cap with `drop` and with `reject`.
    pub fn overload(cap: u32) -> Vec<Row> {
        vec![
            Row::Overload {
                on: OnOverload::Pass,
                cap: 0,
            },
            Row::Overload {
                on: OnOverload::Drop,
                cap,
            },
            Row::Overload {
                on: OnOverload::Reject,
                cap,
            },
        ]
    }

    /// Whether `--only` names this row: its id, or the id's part before
    /// the first `_` (`overload`, `reorder`, `selector`, ...).
    pub fn selected_by(&self, only: &[String]) -> bool {
        let id = self.id();
        only.is_empty()
            || only
                .iter()
                .any(|o| *o == id || id.split('_').next() == Some(o.as_str()))
    }

    /// A short machine-readable name (CSV, file names).
    pub fn id(&self) -> String {
        match self {
            Row::NoStall => "no_stall".into(),
            Row::PrimaryOnly => "primary_only".into(),
            Row::SlowList => "slow_list".into(),
            Row::Reorder(t) => format!("reorder_t{t}"),
            Row::Nginx => "nginx_least_conn".into(),
            Row::Observe => "selector_observe".into(),
            Row::Threshold(t) => format!("selector_t{t}"),
            Row::Absolute(t) => format!("selector_abs{t}"),
            Row::Hedged(HedgeAfter::Fixed(d)) => format!("hedge_{}ms", d.as_millis()),
            Row::Hedged(HedgeAfter::Auto) => "hedge_auto".into(),
            Row::Hedged(HedgeAfter::Off) => "hedge_off".into(),
            Row::Overload { on, .. } => format!("overload_{}", on.name()),
            Row::Latency(b) => format!("latency_{b}ms"),
            Row::Herding(t) => format!("herding_{}", t.name()),
        }
    }

    /// The name in tables and plots.
    pub fn label(&self) -> String {
        match self {
            Row::NoStall => "no stall (limit)".into(),
            Row::PrimaryOnly => "primary only".into(),
            Row::SlowList => "slow list (BK 709)".into(),
            Row::Reorder(t) => format!("client reorder t={t} (BK 1489)"),
            Row::Nginx => "nginx least_conn".into(),
            Row::Observe => "selector observe".into(),
            Row::Threshold(t) => format!("selector threshold {t}"),
            Row::Absolute(t) => format!("selector absolute {t}"),
            Row::Hedged(HedgeAfter::Fixed(d)) => {
                format!("selector threshold 1, hedge after {} ms", d.as_millis())
            }
            Row::Hedged(HedgeAfter::Auto) => "selector threshold 1, hedge auto".into(),
            Row::Hedged(HedgeAfter::Off) => "selector threshold 1, hedge off".into(),
            Row::Overload { on, cap: 0 } => format!("overload {}, no cap", on.name()),
            Row::Overload { on, cap } => format!("overload {}, max_pending {cap}", on.name()),
            Row::Latency(b) => format!("selector latency, budget {b} ms"),
            Row::Herding(t) => format!("client hosts, threshold 1, tie-break {}", t.name()),
        }
    }

    pub fn stalls(&self) -> bool {
        *self != Row::NoStall
    }

    /// The selector's policy and threshold, for rows that attach it.
    pub fn selector(&self) -> Option<(Policy, u32)> {
        match self {
            Row::Observe => Some((Policy::Observe, 1)),
            Row::Threshold(t) => Some((Policy::Threshold, *t)),
            Row::Absolute(t) => Some((Policy::Absolute, *t)),
            Row::Hedged(_) => Some((Policy::Threshold, 1)),
            Row::Latency(_) => Some((Policy::Latency, 1)),
            Row::Herding(_) => Some((Policy::Threshold, 1)),
            _ => None,
        }
    }

    /// The latency policy's budget in this row (other rows: the default).
    pub fn budget(&self) -> Option<Duration> {
        match self {
            Row::Latency(ms) => Some(Duration::from_millis(u64::from(*ms))),
            _ => None,
        }
    }

    /// The selector's tie-break in this row.
    pub fn tie_break(&self) -> TieBreak {
        match self {
            Row::Herding(t) => *t,
            _ => TieBreak::First,
        }
    }

    /// Whether this row's reads come from several client hosts, each with
    /// its own selector and one client process.
    pub fn several_hosts(&self) -> bool {
        matches!(self, Row::Herding(_))
    }

    /// When the selector hedges reads in this row.
    pub fn hedge_after(&self) -> HedgeAfter {
        match self {
            Row::Hedged(after) => *after,
            _ => HedgeAfter::Off,
        }
    }

    /// What the client processes do (rows without a client-side policy
    /// send every read to one address: the primary, or the proxy).
    pub fn client_policy(&self, slow_timeout_ms: u64, slow_expiry_ms: u64) -> ClientPolicy {
        match self {
            Row::SlowList => ClientPolicy::SlowList {
                timeout_ms: slow_timeout_ms,
                expiry_ms: slow_expiry_ms,
            },
            Row::Reorder(t) => ClientPolicy::Reorder { threshold: *t },
            _ => ClientPolicy::Primary,
        }
    }

    /// Whether the client processes talk to every replica themselves.
    pub fn client_side_choice(&self) -> bool {
        matches!(self, Row::SlowList | Row::Reorder(_))
    }

    pub fn is_selector_threshold(&self) -> bool {
        matches!(self, Row::Threshold(_))
    }
}

/// The rows `--only` selects, each with the rate its entry names
/// (`ID@RATE`, e.g. `hedge@2000`: every hedge row at 2000 reads/s) or none
/// (the benchmark's `--rate`); in the order of `rows`, each row's rates in
/// the order given. No entries: every row at the benchmark's rate.
pub fn plan(rows: &[Row], only: &[String]) -> Result<Vec<(Row, Option<u32>)>> {
    let mut entries = Vec::new();
    for entry in only {
        entries.push(match entry.split_once('@') {
            Some((id, rate)) => {
                let rate: u32 = rate
                    .parse()
                    .with_context(|| format!("the rate in `--only {entry}`"))?;
                (vec![id.to_string()], Some(rate.max(1)))
            }
            None => (vec![entry.clone()], None),
        });
    }
    let mut planned = Vec::new();
    for row in rows {
        if entries.is_empty() {
            planned.push((row.clone(), None));
        }
        for (id, rate) in &entries {
            let pick = (row.clone(), *rate);
            if row.selected_by(id) && !planned.contains(&pick) {
                planned.push(pick);
            }
        }
    }
    Ok(planned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_has_a_row_with_a_unique_id() {
        let rows = Row::all(&[1, 10, 100], 10);
        assert_eq!(rows.len(), 17);
        assert_eq!(
            Row::herding().map(|r| r.id()),
            ["herding_first".to_string(), "herding_random".into()]
        );
        assert_eq!(Row::herding()[1].tie_break(), TieBreak::Random);
        assert_eq!(Row::Latency(2).id(), "latency_2ms");
        assert_eq!(Row::Latency(2).selector(), Some((Policy::Latency, 1)));
        assert_eq!(Row::Latency(2).budget(), Some(Duration::from_millis(2)));
        assert_eq!(
            Row::hedged().map(|r| r.id()),
            ["hedge_2ms".to_string(), "hedge_auto".into()]
        );
        assert_eq!(Row::hedged()[1].selector(), Some((Policy::Threshold, 1)));
        let mut ids: Vec<String> = rows.iter().map(Row::id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), rows.len());
        assert_eq!(rows[0], Row::NoStall);
        assert!(!Row::NoStall.stalls() && Row::PrimaryOnly.stalls());
        assert_eq!(Row::Observe.selector(), Some((Policy::Observe, 1)));
    }

    #[test]
    fn overload_rows_are_selected_by_id_or_prefix() {
        let rows = Row::overload(32);
        let ids: Vec<String> = rows.iter().map(Row::id).collect();
        assert_eq!(ids, ["overload_pass", "overload_drop", "overload_reject"]);
        let only = |s: &str| vec![s.to_string()];
        assert!(rows.iter().all(|r| r.selected_by(&only("overload"))));
        assert!(rows[2].selected_by(&only("overload_reject")));
        assert!(!rows[1].selected_by(&only("overload_reject")));
        assert!(!Row::PrimaryOnly.selected_by(&only("overload")));
        assert!(Row::PrimaryOnly.selected_by(&[]));
    }

    #[test]
    fn only_entries_with_a_rate_plan_rows_at_that_rate() {
        let rows = Row::all(&[1, 10], 10);
        let only = |s: &[&str]| s.iter().map(ToString::to_string).collect::<Vec<_>>();
        let planned = plan(
            &rows,
            &only(&["hedge@2000", "no_stall@2000", "no_stall@4000", "hedge_auto"]),
        )
        .unwrap();
        let auto = Row::Hedged(HedgeAfter::Auto);
        assert_eq!(
            planned,
            vec![
                (Row::NoStall, Some(2000)),
                (Row::NoStall, Some(4000)),
                (Row::hedged()[0].clone(), Some(2000)),
                (auto.clone(), Some(2000)),
                (auto, None),
            ]
        );
        assert_eq!(plan(&rows, &[]).unwrap().len(), rows.len());
        assert!(plan(&rows, &only(&["hedge@fast"])).is_err());
        assert!(plan(&rows, &only(&["overload"])).unwrap().is_empty());
    }
}
