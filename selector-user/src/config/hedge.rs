//! The hedging settings (`--hedge-after`, `--hedge-budget`) and their checks.

use std::{fmt, str::FromStr, time::Duration};

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

/// The shortest fixed `--hedge-after`.
pub const MIN_FIXED_DELAY: Duration = Duration::from_micros(100);
/// `--hedge-after`: when a pending read gets its copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HedgeAfter {
    /// Never (the default).
    #[default]
    Off,
    /// After this long.
    Fixed(Duration),
    /// After the primary's recent p95 latency (The Tail at Scale), clamped.
    Auto,
}

impl fmt::Display for HedgeAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::Auto => f.write_str("auto"),
            Self::Fixed(d) => write!(f, "{}", d.as_secs_f64() * 1000.0),
        }
    }
}

impl FromStr for HedgeAfter {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            ms => {
                let value: f64 = ms
                    .parse()
                    .map_err(|_| format!("'{s}' is not off, auto or milliseconds"))?;
                if !(value.is_finite() && value > 0.0) {
                    return Err(format!("'{s}': milliseconds must be positive"));
                }
                Ok(Self::Fixed(Duration::from_nanos(
                    (value * 1e6).round() as u64
                )))
            }
        }
    }
}

impl Serialize for HedgeAfter {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for HedgeAfter {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// The hedging settings in force (in status as `hedge_after` and
/// `hedge_budget_percent`).
/// A field an older agent's status lacks reads as its default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct HedgeSettings {
    #[serde(rename = "hedge_after")]
    pub after: HedgeAfter,
    /// Hedges at most this percentage of reads (plus a burst).
    #[serde(rename = "hedge_budget_percent")]
    pub budget_percent: u32,
}

impl Default for HedgeSettings {
    fn default() -> Self {
        crate::config::tunables::Tunables::default().hedging
    }
}

impl HedgeSettings {
    /// Checks them against the request timeout: a hedge must go out well
    /// before the read expires.
    pub fn check(&self, timeout: Duration) -> Result<()> {
        if !(1..=100).contains(&self.budget_percent) {
            bail!("--hedge-budget must be 1 to 100 (percent of reads)");
        }
        if let HedgeAfter::Fixed(d) = self.after {
            if d < MIN_FIXED_DELAY {
                bail!("--hedge-after must be at least 0.1 ms");
            }
            if d > timeout / 2 {
                bail!(
                    "--hedge-after must be at most half of --timeout ({} ms)",
                    (timeout / 2).as_secs_f64() * 1000.0
                );
            }
        }
        Ok(())
    }

    pub fn enabled(&self) -> bool {
        self.after != HedgeAfter::Off
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hedge_after_parses_off_auto_and_milliseconds() {
        assert_eq!("off".parse(), Ok(HedgeAfter::Off));
        assert_eq!("auto".parse(), Ok(HedgeAfter::Auto));
        assert_eq!("2".parse(), Ok(HedgeAfter::Fixed(Duration::from_millis(2))));
        assert_eq!(
            "0.5".parse(),
            Ok(HedgeAfter::Fixed(Duration::from_micros(500)))
        );
        assert!("0".parse::<HedgeAfter>().is_err());
        assert!("-1".parse::<HedgeAfter>().is_err());
        assert!("soon".parse::<HedgeAfter>().is_err());
        for h in ["off", "auto", "2", "0.5"] {
            let v: HedgeAfter = h.parse().unwrap();
            assert_eq!(v.to_string(), h);
            let json = serde_json::to_string(&v).unwrap();
            assert_eq!(serde_json::from_str::<HedgeAfter>(&json).unwrap(), v);
        }
    }

    #[test]
    fn settings_are_checked_against_the_timeout() {
        let timeout = Duration::from_millis(100);
        let ok = HedgeSettings {
            after: HedgeAfter::Fixed(Duration::from_millis(2)),
            budget_percent: 5,
        };
        ok.check(timeout).unwrap();
        let late = HedgeSettings {
            after: HedgeAfter::Fixed(Duration::from_millis(60)),
            ..ok
        };
        assert!(
            late.check(timeout)
                .unwrap_err()
                .to_string()
                .contains("half")
        );
        let tiny = HedgeSettings {
            after: HedgeAfter::Fixed(Duration::from_micros(10)),
            ..ok
        };
        assert!(tiny.check(timeout).is_err());
        for budget in [0, 101] {
            let b = HedgeSettings {
                budget_percent: budget,
                ..ok
            };
            assert!(b.check(timeout).unwrap_err().to_string().contains("budget"));
        }
        HedgeSettings::default().check(timeout).unwrap();
        assert!(!HedgeSettings::default().enabled());
    }
}
