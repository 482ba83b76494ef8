//! The run-time tunables: what `selector set` changes in place and a
//! reload rewrites. One patch type, [`TunablesPatch`], is all three ways
//! in: the flags (flattened into `selector run` and `selector set`), the
//! config file's keys (flattened into `Options`) and the control socket's
//! `set` request. A tunable is declared once, here: its flag, help, key,
//! wire name and how it lands in [`Settings`].
//!
//! The values in force are [`Tunables`], a part of `Settings` of their
//! own: its type says they may change while attached. Its `Default` is
//! the tunables' defaults, [`Tunables::check`] their validation and its
//! serialization their part of `selector status --json`.
//!
//! Names: the flag and the file key are kebab-case (`max-pending`); the
//! wire keeps the snake_case names it always had (`max_pending`), and
//! either is accepted wherever a patch is read, so old clients still work.
//!
//! Adding a tunable: a field here in [`Tunables`] (with its default, check
//! and `shown` default) and in [`TunablesPatch`] (with its flag's help),
//! where the kernel takes it (`datapath::loader::Selector::write_config`),
//! and its row in docs/reference/config.md; `cargo xtask docs` writes the
//! sample config's lines and the status example's (docs/development.md).

use std::{fmt, str::FromStr, time::Duration};

use anyhow::Result;
use clap::Args;
use selector_common::{OnOverload, Policy, TieBreak};
use serde::{Deserialize, Serialize};

use crate::config::{
    hedge::{HedgeAfter, HedgeSettings},
    settings::{MAX_TIMEOUT_MS, Protocol, SettingKey, Settings, invalid, millis},
};

/// The tunables in force. Serialized as `selector status --json` shows
/// them, among the other settings; one an older agent's status lacks
/// reads as its default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Tunables {
    pub policy: Policy,
    pub threshold: u32,
    /// Pending requests per backend beyond which it is not chosen (0: no bound).
    pub max_pending: u32,
    /// Pending requests per client socket beyond which its reads are
    /// overloaded (0: no bound).
    pub max_pending_client: u32,
    pub on_overload: OnOverload,
    /// `--hedge-after`, `--hedge-budget`.
    #[serde(flatten)]
    pub hedging: HedgeSettings,
    /// Latency policy: expected wait over the best member's at which a
    /// read leaves its primary (1 µs to `MAX_TIMEOUT_MS`, whole µs).
    #[serde(rename = "budget_us", with = "whole_micros")]
    pub budget: Duration,
    /// How every policy picks among equally loaded members.
    #[serde(default = "bookkeepers_tie_break")]
    pub tie_break: TieBreak,
    /// Whether members that were slow recently are left alone
    /// (`crate::datapath::slowness`).
    #[serde(default)]
    pub avoid_slow: AvoidSlow,
}

/// `--avoid-slow`: the memory of slowness on or off.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AvoidSlow {
    /// Slow replicas get no read while another is not slow
    #[default]
    On,
    /// Pending counts alone
    Off,
}

impl AvoidSlow {
    pub fn name(self) -> &'static str {
        match self {
            Self::On => "on",
            Self::Off => "off",
        }
    }
}

/// What an agent from before `--tie-break` did.
fn bookkeepers_tie_break() -> TieBreak {
    TieBreak::First
}

impl Default for Tunables {
    fn default() -> Self {
        Self {
            policy: Policy::Threshold,
            threshold: 4,
            max_pending: 0,
            max_pending_client: 0,
            on_overload: OnOverload::Pass,
            hedging: HedgeSettings {
                after: HedgeAfter::Off,
                // Hedges per second at most 5% of reads (plus the burst of
                // `selector_common::hedge::BURST`).
                budget_percent: 5,
            },
            // A read leaves a primary whose expected wait is this much over
            // the best replica's. Reads sent in the first budget of a stall
            // wait it out, so the budget sets their share: 1 ms of a stall
            // every 500 ms is 0.2% of reads, under the p99.
            budget: Duration::from_millis(1),
            // Many client hosts with equal counts spread out (no herding);
            // `First` is BookKeeper's rule.
            tie_break: TieBreak::Random,
            // Slowness is remembered: a replica throttled ten times a
            // second is left, not chosen again after each stall.
            avoid_slow: AvoidSlow::On,
        }
    }
}

impl Tunables {
    /// Checks them as `selector run` and `selector set` do; `timeout` and
    /// `protocol` are the settings they depend on.
    pub fn check(&self, timeout: Duration, protocol: Protocol) -> Result<()> {
        if self.threshold == 0 && self.policy != Policy::Observe {
            return invalid(SettingKey::Flag("threshold"), "must be at least 1");
        }
        if self.budget < Duration::from_micros(1)
            || self.budget > Duration::from_millis(MAX_TIMEOUT_MS)
        {
            return invalid(
                SettingKey::Flag("budget"),
                format!("must be 0.001 to {MAX_TIMEOUT_MS} ms"),
            );
        }
        if self.on_overload == OnOverload::Reject && !protocol.has_error_reply() {
            return invalid(
                SettingKey::Flag("on-overload"),
                "reject needs --proto memcached or dns (a custom protocol has no error reply)",
            );
        }
        self.hedging.check(timeout)
    }

    /// The budget in whole microseconds, as the kernel holds it.
    pub fn budget_us(&self) -> u32 {
        self.budget.as_micros().min(u128::from(u32::MAX)) as u32
    }

    /// What `--help` shows as `[default: ...]` of each tunable's flag.
    pub fn shown(&self) -> Vec<(&'static str, String)> {
        vec![
            ("policy", self.policy.name().into()),
            ("threshold", self.threshold.to_string()),
            ("max-pending", self.max_pending.to_string()),
            ("on-overload", self.on_overload.name().into()),
            ("max-pending-client", self.max_pending_client.to_string()),
            ("hedge-after", self.hedging.after.to_string()),
            ("hedge-budget", self.hedging.budget_percent.to_string()),
            ("budget", Millis(self.budget).to_string()),
            ("tie-break", self.tie_break.name().into()),
            ("avoid-slow", self.avoid_slow.name().into()),
        ]
    }

    /// In one line, in `selector set` flag order (what `set`, a reload and
    /// the status print).
    pub fn describe(&self) -> String {
        format!(
            "policy {}, threshold {}, max-pending {}, max-pending-client {}, on-overload {}, budget {} ms, tie-break {}, avoid-slow {}",
            self.policy.name(),
            self.threshold,
            self.max_pending,
            self.max_pending_client,
            self.on_overload.name(),
            Millis(self.budget),
            self.tie_break.name(),
            self.avoid_slow.name()
        )
    }
}

/// A duration as whole microseconds (status's `budget_us`).
mod whole_micros {
    use std::time::Duration;

    use serde::{Deserialize as _, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_micros().min(u128::from(u64::MAX)) as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_micros)
    }
}

/// A duration given in milliseconds, fractions allowed (`2`, `0.5`), held
/// in whole microseconds: the unit of `--budget` and its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Millis(pub Duration);

impl FromStr for Millis {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let ms: f64 = s
            .parse()
            .map_err(|_| format!("'{s}' is not a number of milliseconds"))?;
        millis(ms)
            .map(Self)
            .ok_or_else(|| format!("'{s}' is not a number of milliseconds"))
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0.as_secs_f64() * 1000.0)
    }
}

impl Serialize for Millis {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(self.0.as_secs_f64() * 1000.0)
    }
}

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let ms = f64::deserialize(d)?;
        millis(ms).map(Self).ok_or_else(|| {
            serde::de::Error::custom(format!("{ms} is not a number of milliseconds"))
        })
    }
}

/// Each tunable, optional: absent ones keep the value in force (or, for
/// `selector run`, the file's, else the default).
#[derive(Clone, Debug, Default, PartialEq, Eq, Args, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all(serialize = "snake_case", deserialize = "kebab-case")
)]
pub struct TunablesPatch {
    /// The rule that moves reads off their primary [default: threshold].
    #[arg(long, value_enum)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<Policy>,
    /// Pending requests: the margin (threshold policy) or the limit
    /// (absolute policy) at which reads leave the primary [default: 4].
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<u32>,
    /// Pending requests per backend at which it is no longer chosen; when
    /// the primary and every eligible replica are there, --on-overload
    /// applies (0: no bound) [default: 0].
    #[arg(long, value_name = "N")]
    #[serde(
        default,
        alias = "max_pending",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_pending: Option<u32>,
    /// What a read gets when its backends are at --max-pending or its
    /// client socket at --max-pending-client [default: pass].
    #[arg(long, value_enum)]
    #[serde(
        default,
        alias = "on_overload",
        skip_serializing_if = "Option::is_none"
    )]
    pub on_overload: Option<OnOverload>,
    /// Pending requests per client socket at which its reads are
    /// overloaded (0: no bound) [default: 0].
    #[arg(long, value_name = "N")]
    #[serde(
        default,
        alias = "max_pending_client",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_pending_client: Option<u32>,
    /// Hedged reads: a read still pending after MS milliseconds (decimals
    /// allowed; at most half of --timeout) gets one copy, sent to the least
    /// pending other replica of its group; the first reply reaches the
    /// application, the later one is dropped. `auto`: after the primary's
    /// recent p95 latency. `off`: never. The copies need CAP_NET_RAW
    /// [default: off].
    #[arg(long, value_name = "MS|auto|off")]
    #[serde(
        default,
        alias = "hedge_after",
        skip_serializing_if = "Option::is_none"
    )]
    pub hedge_after: Option<HedgeAfter>,
    /// Hedges at most this percentage of reads (1-100; plus a burst of 10)
    /// [default: 5].
    #[arg(long, value_name = "PERCENT")]
    #[serde(
        default,
        alias = "hedge_budget",
        skip_serializing_if = "Option::is_none"
    )]
    pub hedge_budget: Option<u32>,
    /// Latency policy: milliseconds of expected wait (pending x recent time
    /// per completed request) over the best replica's at which a read
    /// leaves its primary; fractions allowed (0.001 to 3600000)
    /// [default: 1].
    #[arg(long, value_name = "MS")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Millis>,
    /// The budget in microseconds, as `set` requests carried it before
    /// `budget`: still accepted on the wire, never sent.
    #[arg(skip)]
    #[serde(default, skip_serializing, rename = "budget_us")]
    pub legacy_budget_us: Option<u64>,
    /// How the best of several equally loaded replicas is picked: `random`,
    /// one of them at random, so that many client hosts seeing the same idle
    /// replicas spread out instead of all moving to one; `first`, the first
    /// in group order, as BookKeeper does (the faithful choice when one
    /// client is alone, or to keep reads on a preferred replica)
    /// [default: random].
    #[arg(long, value_enum)]
    #[serde(default, alias = "tie_break", skip_serializing_if = "Option::is_none")]
    pub tie_break: Option<TieBreak>,
    /// Whether a replica that was slow recently is left alone: `on`, a
    /// replica whose recent latency (or a read's wait on it) is over 1.5x
    /// and 2 ms over the fastest member's is chosen for no read while
    /// another is not slow, and single probe reads say when it is fast
    /// again (a replica throttled at its CPU limit stalls ten times a
    /// second, and the counts forget it between stalls); `off`, counts
    /// alone [default: on].
    #[arg(long, value_enum)]
    #[serde(default, alias = "avoid_slow", skip_serializing_if = "Option::is_none")]
    pub avoid_slow: Option<AvoidSlow>,
}

impl TunablesPatch {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// The tunables' flags, in the order `selector set --help` lists them.
    pub fn flags() -> Vec<String> {
        Self::augment_args(clap::Command::new("set"))
            .get_arguments()
            .filter_map(|a| a.get_long().map(|long| format!("--{long}")))
            .collect()
    }

    /// `self` laid over `under`, field by field: a field `self` gives wins.
    pub fn over(self, under: Self) -> Self {
        let budget = self.budget_in_force();
        let under_budget = under.budget_in_force();
        Self {
            policy: self.policy.or(under.policy),
            threshold: self.threshold.or(under.threshold),
            max_pending: self.max_pending.or(under.max_pending),
            on_overload: self.on_overload.or(under.on_overload),
            max_pending_client: self.max_pending_client.or(under.max_pending_client),
            hedge_after: self.hedge_after.or(under.hedge_after),
            hedge_budget: self.hedge_budget.or(under.hedge_budget),
            budget: budget.or(under_budget),
            legacy_budget_us: None,
            tie_break: self.tie_break.or(under.tie_break),
            avoid_slow: self.avoid_slow.or(under.avoid_slow),
        }
    }

    /// `--budget`, or the legacy `budget_us` when only that was sent.
    fn budget_in_force(&self) -> Option<Millis> {
        self.budget.or(self
            .legacy_budget_us
            .map(|us| Millis(Duration::from_micros(us))))
    }

    /// `tunables` with the given ones in place; not checked (see
    /// [`Self::applied_to`]).
    pub fn apply(&self, tunables: Tunables) -> Tunables {
        Tunables {
            policy: self.policy.unwrap_or(tunables.policy),
            threshold: self.threshold.unwrap_or(tunables.threshold),
            max_pending: self.max_pending.unwrap_or(tunables.max_pending),
            max_pending_client: self
                .max_pending_client
                .unwrap_or(tunables.max_pending_client),
            on_overload: self.on_overload.unwrap_or(tunables.on_overload),
            hedging: HedgeSettings {
                after: self.hedge_after.unwrap_or(tunables.hedging.after),
                budget_percent: self.hedge_budget.unwrap_or(tunables.hedging.budget_percent),
            },
            budget: self.budget_in_force().map_or(tunables.budget, |b| b.0),
            tie_break: self.tie_break.unwrap_or(tunables.tie_break),
            avoid_slow: self.avoid_slow.unwrap_or(tunables.avoid_slow),
        }
    }

    /// `settings` with this patch applied, checked as `selector run` would.
    pub fn applied_to(&self, settings: &Settings) -> Result<Settings> {
        let changed = Settings {
            tunables: self.apply(settings.tunables),
            ..settings.clone()
        };
        changed.check_tunables()?;
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_keep_whole_microseconds_and_refuse_what_is_not_a_duration() {
        assert_eq!("0.5".parse(), Ok(Millis(Duration::from_micros(500))));
        assert_eq!("2".parse(), Ok(Millis(Duration::from_millis(2))));
        assert_eq!("0.0004".parse(), Ok(Millis(Duration::ZERO)));
        for bad in ["-1", "NaN", "inf", "soon", ""] {
            assert!(bad.parse::<Millis>().is_err(), "{bad}");
        }
        assert_eq!(Millis(Duration::from_micros(1500)).to_string(), "1.5");
    }

    /// The wire keeps its snake_case names; kebab-case (the file's) is
    /// taken too, and an old request's `budget_us` means microseconds.
    #[test]
    fn the_wire_names_are_unchanged_and_old_requests_are_taken() {
        let patch = TunablesPatch {
            max_pending: Some(5),
            budget: Some(Millis(Duration::from_micros(2500))),
            tie_break: Some(TieBreak::First),
            ..Default::default()
        };
        let wire = serde_json::to_value(&patch).unwrap();
        assert_eq!(wire["max_pending"], 5);
        assert_eq!(wire["budget"], 2.5);
        assert_eq!(wire["tie_break"], "first");
        assert!(wire.get("budget_us").is_none(), "{wire}");
        let back: TunablesPatch = serde_json::from_value(wire).unwrap();
        assert_eq!(back, patch);
        let old: TunablesPatch = serde_json::from_str(
            r#"{"max_pending":5,"on_overload":"drop","max_pending_client":2,
                "hedge_after":"auto","hedge_budget":7,"budget_us":2500,"tie_break":"first"}"#,
        )
        .unwrap();
        let d = Tunables::default();
        let s = old.apply(d);
        assert_eq!((s.max_pending, s.max_pending_client), (5, 2));
        assert_eq!(s.on_overload, OnOverload::Drop);
        assert_eq!(s.hedging.after, HedgeAfter::Auto);
        assert_eq!(s.hedging.budget_percent, 7);
        assert_eq!(s.budget, Duration::from_micros(2500));
        assert_eq!(s.tie_break, TieBreak::First);
        let kebab: TunablesPatch =
            serde_json::from_str(r#"{"max-pending":5,"tie-break":"first"}"#).unwrap();
        assert_eq!(kebab.apply(d).max_pending, 5);
        assert!(serde_json::from_str::<TunablesPatch>(r#"{"treshold":1}"#).is_err());
    }

    #[test]
    fn a_patch_over_another_wins_field_by_field() {
        let flags = TunablesPatch {
            threshold: Some(2),
            ..Default::default()
        };
        let file = TunablesPatch {
            threshold: Some(9),
            max_pending: Some(3),
            legacy_budget_us: Some(700),
            ..Default::default()
        };
        let merged = flags.over(file);
        assert_eq!((merged.threshold, merged.max_pending), (Some(2), Some(3)));
        assert_eq!(merged.budget, Some(Millis(Duration::from_micros(700))));
    }

    #[test]
    fn an_applied_patch_is_checked_and_an_empty_one_changes_nothing() {
        let d = Settings::new("eth0", vec![]);
        assert!(TunablesPatch::default().is_empty());
        let same = TunablesPatch::default().applied_to(&d).unwrap();
        assert_eq!(format!("{same:?}"), format!("{d:?}"));
        let zero = TunablesPatch {
            threshold: Some(0),
            ..Default::default()
        };
        assert!(
            zero.applied_to(&d)
                .unwrap_err()
                .to_string()
                .contains("--threshold")
        );
    }

    #[test]
    fn the_flag_list_is_the_patch_s_fields() {
        let flags = TunablesPatch::flags();
        assert_eq!(flags.first().map(String::as_str), Some("--policy"));
        assert!(flags.contains(&"--tie-break".to_string()), "{flags:?}");
        assert!(flags.contains(&"--avoid-slow".to_string()), "{flags:?}");
        assert_eq!(flags.len(), 10, "{flags:?}");
    }
}
