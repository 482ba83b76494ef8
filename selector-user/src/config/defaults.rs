//! Every default of `selector run`, declared once: the tunables' in
//! `Tunables::default` (config/tunables.rs, beside the rest of each
//! tunable), the others here. [`Settings::new`], the config file's
//! resolution (`Options::resolve`) and the `[default: ...]` of `--help`
//! all take them from [`RunDefaults::default`]; a test checks the help
//! against [`RunDefaults::shown`].
//!
//! [`Settings::new`]: crate::config::settings::Settings::new

use std::time::Duration;

use selector_common::{
    DEFAULT_INFLIGHT_MAX, MARK_REDIRECTED,
    ejection::{
        DEFAULT_EJECT_AFTER, DEFAULT_EJECT_BASE_MS, DEFAULT_EJECT_MAX_MS,
        DEFAULT_MAX_EJECTED_PERCENT,
    },
};

use crate::config::{
    ejection::EjectionSettings,
    settings::{
        HEARTBEAT_SWEEPS, IngressMode, MAX_DEFAULT_HEARTBEAT_BOUND, MIN_DEFAULT_HEARTBEAT_BOUND,
        Protocol,
    },
    tunables::Tunables,
};

/// The defaults of `selector run`. `--grace` defaults to the timeout in
/// force and `--heartbeat-bound` to a few sweep periods
/// (`settings::default_heartbeat_bound`): both follow other settings.
#[derive(Clone, Debug, PartialEq)]
pub struct RunDefaults {
    /// The tunables' defaults: [`Tunables`]'s own `Default`.
    pub tunables: Tunables,
    pub protocol: Protocol,
    pub read_prefix_offset: u16,
    pub no_reply_offset: u16,
    pub error_offset: u16,
    pub ejection: EjectionSettings,
    pub timeout: Duration,
    pub mark: u32,
    pub inflight_max: u32,
    pub interval: Duration,
    pub ingress: IngressMode,
}

impl Default for RunDefaults {
    fn default() -> Self {
        Self {
            tunables: Tunables::default(),
            protocol: Protocol::Memcached,
            read_prefix_offset: 0,
            no_reply_offset: 0,
            error_offset: 0,
            // The peers' values (Envoy, Finagle: 5 failures; 5 s to 5 min),
            // kept where the kernel side's tests use them too.
            ejection: EjectionSettings {
                eject_after: DEFAULT_EJECT_AFTER,
                base: Duration::from_millis(DEFAULT_EJECT_BASE_MS),
                max: Duration::from_millis(DEFAULT_EJECT_MAX_MS),
                max_ejected_percent: DEFAULT_MAX_EJECTED_PERCENT,
            },
            timeout: Duration::from_millis(1000),
            mark: MARK_REDIRECTED,
            inflight_max: DEFAULT_INFLIGHT_MAX,
            interval: Duration::from_millis(1000),
            ingress: IngressMode::Auto,
        }
    }
}

/// Milliseconds, as the flags take them (fractions only where there are).
fn ms(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms.fract() == 0.0 {
        format!("{ms:.0}")
    } else {
        ms.to_string()
    }
}

impl RunDefaults {
    /// What `--help` shows as `[default: ...]`, by flag (without dashes).
    pub fn shown(&self) -> Vec<(&'static str, String)> {
        let mut shown = self.tunables.shown();
        shown.extend([
            ("proto", self.protocol.name().into()),
            ("read-prefix-offset", self.read_prefix_offset.to_string()),
            ("no-reply-offset", self.no_reply_offset.to_string()),
            ("error-offset", self.error_offset.to_string()),
            ("eject-after", self.ejection.eject_after.to_string()),
            ("eject-base", ms(self.ejection.base)),
            ("eject-max", ms(self.ejection.max)),
            ("max-ejected", self.ejection.max_ejected_percent.to_string()),
            ("timeout", ms(self.timeout)),
            (
                "heartbeat-bound",
                format!(
                    "{HEARTBEAT_SWEEPS} sweep periods, within {} to {}",
                    ms(MIN_DEFAULT_HEARTBEAT_BOUND),
                    ms(MAX_DEFAULT_HEARTBEAT_BOUND)
                ),
            ),
            ("mark", format!("{:#010x}", self.mark)),
            ("inflight-max", self.inflight_max.to_string()),
            ("interval", ms(self.interval)),
            ("ingress", self.ingress.name().into()),
        ]);
        shown
    }
}
