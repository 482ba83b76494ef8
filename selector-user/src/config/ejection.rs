//! The outlier ejection settings (`--eject-after`, `--eject-base`,
//! `--eject-max`, `--max-ejected`) and their checks, in one place. The
//! state machine is `selector_common::ejection`.

use std::time::Duration;

use anyhow::{Result, bail};
use selector_common::MAX_TIMEOUT_MS;
use selector_common::ejection::Params;

/// Most failures in a row `--eject-after` takes.
pub const MAX_EJECT_AFTER: u32 = 1_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EjectionSettings {
    /// Failures in a row that eject a member; 0: ejection off.
    pub eject_after: u32,
    /// The first ejection's length; doubled for each one in a row.
    pub base: Duration,
    /// The longest ejection.
    pub max: Duration,
    /// The most of a group ejected at once (at least one, never the last).
    pub max_ejected_percent: u32,
}

impl Default for EjectionSettings {
    fn default() -> Self {
        crate::config::defaults::RunDefaults::default().ejection
    }
}

impl EjectionSettings {
    /// From the optional flags or keys, over the defaults.
    pub fn from_options(
        eject_after: Option<u32>,
        base_ms: Option<u64>,
        max_ms: Option<u64>,
        max_ejected_percent: Option<u32>,
    ) -> Self {
        let d = Self::default();
        Self {
            eject_after: eject_after.unwrap_or(d.eject_after),
            base: base_ms.map_or(d.base, Duration::from_millis),
            max: max_ms.map_or(d.max, Duration::from_millis),
            max_ejected_percent: max_ejected_percent.unwrap_or(d.max_ejected_percent),
        }
    }

    pub fn check(&self) -> Result<()> {
        if self.eject_after > MAX_EJECT_AFTER {
            bail!("--eject-after must be 0 (off) to {MAX_EJECT_AFTER}");
        }
        let ms = |d: Duration| d.as_millis();
        if !(1..=u128::from(MAX_TIMEOUT_MS)).contains(&ms(self.base)) {
            bail!("--eject-base must be 1 to {MAX_TIMEOUT_MS} ms");
        }
        if ms(self.max) < ms(self.base) || ms(self.max) > u128::from(MAX_TIMEOUT_MS) {
            bail!("--eject-max must be --eject-base to {MAX_TIMEOUT_MS} ms");
        }
        if !(1..=100).contains(&self.max_ejected_percent) {
            bail!("--max-ejected must be 1 to 100 (percent)");
        }
        Ok(())
    }

    /// The state machine's parameters; a probe with no result after two
    /// timeouts is offered again.
    pub fn params(&self, timeout: Duration) -> Params {
        let ns = |d: Duration| d.as_nanos().min(u128::from(u64::MAX)) as u64;
        Params {
            eject_after: u64::from(self.eject_after),
            base_ns: ns(self.base),
            max_ns: ns(self.max),
            max_ejected_percent: self.max_ejected_percent,
            probe_wait_ns: ns(timeout).saturating_mul(2),
        }
    }

    /// For the startup line and `status`.
    pub fn describe(&self) -> String {
        if self.eject_after == 0 {
            return "ejection off".into();
        }
        format!(
            "eject after {} failures for {}-{} ms, at most {}% of a group",
            self.eject_after,
            self.base.as_millis(),
            self.max.as_millis(),
            self.max_ejected_percent
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_check_and_bad_values_are_refused() {
        let d = EjectionSettings::default();
        d.check().unwrap();
        assert_eq!(d.eject_after, 5);
        let bad = |s: EjectionSettings, flag: &str| {
            let e = s.check().unwrap_err().to_string();
            assert!(e.starts_with(&format!("--{flag} ")), "{e}");
        };
        bad(
            EjectionSettings::from_options(None, Some(0), None, None),
            "eject-base",
        );
        bad(
            EjectionSettings::from_options(None, Some(2000), Some(1000), None),
            "eject-max",
        );
        bad(
            EjectionSettings::from_options(None, None, None, Some(0)),
            "max-ejected",
        );
        bad(
            EjectionSettings::from_options(None, None, None, Some(101)),
            "max-ejected",
        );
        bad(
            EjectionSettings::from_options(Some(MAX_EJECT_AFTER + 1), None, None, None),
            "eject-after",
        );
        EjectionSettings::from_options(Some(0), None, None, None)
            .check()
            .unwrap();
        assert_eq!(
            EjectionSettings::from_options(Some(0), None, None, None).describe(),
            "ejection off"
        );
    }
}
