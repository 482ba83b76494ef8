//! The run-time tunables: the flags `selector run` starts with and
//! `selector set` changes, declared once so both take the same values.

use std::time::Duration;

use clap::Args;
use selector_common::{Policy, TieBreak};

use crate::{
    api::SettingsChange,
    config::hedge::HedgeAfter,
    config::settings::{OnOverload, parse_millis},
};

/// The flag names, in the order `selector set` lists them.
pub const TUNABLE_FLAGS: &str = "--policy, --threshold, --max-pending, --on-overload, \
    --max-pending-client, --hedge-after, --hedge-budget, --budget, --tie-break";

#[derive(Debug, Default, Args)]
pub struct Tunables {
    /// [default: threshold]
    #[arg(long, value_enum)]
    pub policy: Option<Policy>,
    /// Pending requests: the margin (threshold policy) or the limit
    /// (absolute policy) at which reads leave the primary [default: 4].
    #[arg(long)]
    pub threshold: Option<u32>,
    /// Pending requests per backend at which it is no longer chosen; when
    /// the primary and every eligible replica are there, --on-overload
    /// applies (0: no bound) [default: 0].
    #[arg(long, value_name = "N")]
    pub max_pending: Option<u32>,
    /// What a read gets when its backends are at --max-pending or its
    /// client socket at --max-pending-client [default: pass].
    #[arg(long, value_enum)]
    pub on_overload: Option<OnOverload>,
    /// Pending requests per client socket at which its reads are
    /// overloaded (0: no bound) [default: 0].
    #[arg(long, value_name = "N")]
    pub max_pending_client: Option<u32>,
    /// Hedged reads: a read still pending after MS milliseconds (decimals
    /// allowed; at most half of --timeout) gets one copy, sent to the least
    /// pending other replica of its group; the first reply reaches the
    /// application, the later one is dropped. `auto`: after the primary's
    /// recent p95 latency. `off`: never [default: off].
    #[arg(long, value_name = "MS|auto|off")]
    pub hedge_after: Option<HedgeAfter>,
    /// Hedges at most this percentage of reads (1-100; plus a burst of 10)
    /// [default: 5].
    #[arg(long, value_name = "PERCENT")]
    pub hedge_budget: Option<u32>,
    /// Latency policy: milliseconds of expected wait (pending x recent time
    /// per completed request) over the best replica's at which a read
    /// leaves its primary; fractions allowed (0.001 to 3600000)
    /// [default: 1].
    #[arg(long, value_name = "MS", value_parser = parse_millis)]
    pub budget: Option<Duration>,
    /// How the best of several equally loaded replicas is picked: `random`,
    /// one of them at random, so that many client hosts seeing the same idle
    /// replicas spread out instead of all moving to one; `first`, the first
    /// in group order, as BookKeeper does (the faithful choice when one
    /// client is alone, or to keep reads on a preferred replica)
    /// [default: random].
    #[arg(long, value_enum)]
    pub tie_break: Option<TieBreak>,
}

impl Tunables {
    /// The tunables given, as a change to the ones in force.
    pub fn change(&self) -> SettingsChange {
        SettingsChange {
            policy: self.policy,
            threshold: self.threshold,
            max_pending: self.max_pending,
            max_pending_client: self.max_pending_client,
            on_overload: self.on_overload,
            hedge_after: self.hedge_after,
            hedge_budget: self.hedge_budget,
            budget_us: self
                .budget
                .map(|b| b.as_micros().min(u128::from(u64::MAX)) as u64),
            tie_break: self.tie_break,
        }
    }

    /// The budget in milliseconds, as the config file holds it.
    pub fn budget_ms(&self) -> Option<f64> {
        self.budget.map(|b| b.as_secs_f64() * 1000.0)
    }
}
