//! Which build of the agent this is: the crate version and the git commit
//! it was built from (set by `build.rs`: a short hash, `-dirty` when the
//! sources differed from it, `unknown` without git). `selector --version`,
//! `selector status` and the `selector_build_info` metric show it.

use std::fmt;

use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, gauge::ConstGauge},
};
use serde::{Deserialize, Serialize};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
pub const COMMIT: &str = env!("SELECTOR_GIT_COMMIT");

/// What `selector --version` prints after the name.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("SELECTOR_GIT_COMMIT"),
    ")"
);

/// The `build` part of [`crate::api::Status`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildInfo {
    pub version: String,
    pub commit: String,
}

impl BuildInfo {
    /// This binary's.
    pub fn current() -> Self {
        Self {
            version: VERSION.into(),
            commit: COMMIT.into(),
        }
    }
}

impl fmt::Display for BuildInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "selector {} (commit {})", self.version, self.commit)
    }
}

/// `selector_build_info{version="0.1.0",commit="8ab3247"} 1`, the usual
/// form of a build's identity (a constant 1 carrying labels); nothing for a
/// status without one.
pub fn encode_metric(encoder: &mut DescriptorEncoder, build: &BuildInfo) -> fmt::Result {
    if build.version.is_empty() {
        return Ok(());
    }
    let mut family = encoder.encode_descriptor(
        "selector_build_info",
        "The agent's version and the git commit it was built from (-dirty: from changed sources); always 1.",
        None,
        MetricType::Gauge,
    )?;
    let labels = [
        ("version", build.version.as_str()),
        ("commit", build.commit.as_str()),
    ];
    ConstGauge::new(1u64).encode(family.encode_family(&labels)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        agent::metrics::{Format, render},
        api::Status,
    };

    #[test]
    fn the_metrics_carry_the_build() {
        let mut status: Status = serde_json::from_str(
            r#"{"iface":"eth0","settings":{"policy":"threshold","threshold":4,
              "max_pending":0,"max_pending_client":0,"on_overload":"pass",
              "proto":"memcached","timeout_ms":1000,"grace_ms":1000,
              "mark":16777216,"inflight_max":65536,"ingress":"tc"},
              "in_flight":0,"drained":[],"passed":[],"backends":[]}"#,
        )
        .unwrap();
        status.build = BuildInfo::current();
        let line = format!("selector_build_info{{version=\"{VERSION}\",commit=\"{COMMIT}\"}} 1\n");
        for format in [Format::OpenMetrics, Format::PrometheusText] {
            let text = render(format, &status);
            assert!(text.contains(&line), "{format:?}: {text}");
            assert!(
                text.contains("# TYPE selector_build_info gauge\n"),
                "{text}"
            );
        }
        // An older agent's status says nothing of its build: no made-up one.
        status.build = BuildInfo::default();
        assert!(!render(Format::OpenMetrics, &status).contains("selector_build_info"));
    }

    #[test]
    fn the_commit_is_a_short_hash_or_says_why_not() {
        let hash = COMMIT.strip_suffix("-dirty").unwrap_or(COMMIT);
        let is_hash = hash.len() >= 7 && hash.chars().all(|c| c.is_ascii_hexdigit());
        // Building from a checkout here: git is there, so a hash.
        assert!(is_hash, "commit {COMMIT:?}");
        assert_eq!(
            BuildInfo::current().to_string(),
            format!("selector {VERSION} (commit {COMMIT})")
        );
        assert!(LONG_VERSION.starts_with(VERSION) && LONG_VERSION.contains(COMMIT));
    }
}
