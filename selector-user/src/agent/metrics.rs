//! The metrics of the agent's [`Status`] (the document `selector status
//! --json` prints), in the OpenMetrics text format (encoded with
//! `prometheus-client`) or in the classic Prometheus text format 0.0.4.
//! Served by [`crate::agent::endpoint`].
//!
//! Per-backend metrics carry the labels `backend` (addr:port) and `group`
//! (from 1 in `--group` order). Counters are totals since the agent started.

use std::fmt;

use anyhow::Result;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _, MetricEncoder, NoLabelSet},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::{Registry, Unit},
};
use selector_common::latency::{self, LATENCY_BUCKETS};

use crate::{api::Status, telemetry::BackendTotals};

pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const PROMETHEUS_TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// The liveness probe's path (see [`health::liveness`]).
pub const LIVENESS_PATH: &str = "/healthz";
/// The readiness probe's path (see [`health::readiness`]).
pub const READINESS_PATH: &str = "/readyz";

/// Which exposition format a scrape gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    OpenMetrics,
    PrometheusText,
}

/// The exposition of `status` in `format`.
pub fn render(format: Format, status: &Status) -> String {
    let openmetrics = openmetrics(status);
    match format {
        Format::OpenMetrics => openmetrics,
        Format::PrometheusText => prometheus_text(&openmetrics),
    }
}

/// The exposition of several attachments' statuses in `format`, each
/// labelled (see [`openmetrics_labelled`]); `None` for an attachment that
/// did not answer.
pub fn render_labelled(format: Format, statuses: &[(String, Option<Status>)]) -> String {
    let openmetrics = openmetrics_labelled(statuses);
    match format {
        Format::OpenMetrics => openmetrics,
        Format::PrometheusText => prometheus_text(&openmetrics),
    }
}

/// The family saying which attachments of an agent of several answered
/// the scrape: 1, or 0 for one not started yet or ended (a shutdown ends
/// them one by one), whose samples are then absent.
pub const ATTACHMENT_UP: &str = "selector_attachment_up";

/// Several attachments' statuses as one OpenMetrics exposition: each
/// metric family once (a family may not repeat), with the samples of every
/// attachment that answered (`Some`), each carrying the label `attachment`
/// with its name; then [`ATTACHMENT_UP`] for each.
pub fn openmetrics_labelled(statuses: &[(String, Option<Status>)]) -> String {
    // (family name, its descriptor lines, its samples), in order of first
    // appearance.
    let mut families: Vec<(String, Vec<String>, Vec<String>)> = Vec::new();
    for (label, status) in statuses {
        let Some(status) = status else { continue };
        let text = openmetrics(status);
        let mut current = None;
        for line in text.lines().filter(|line| *line != "# EOF") {
            match line.strip_prefix("# ") {
                Some(descriptor) => {
                    let name = descriptor.split(' ').nth(1).unwrap_or_default();
                    let at = match families.iter().position(|f| f.0 == name) {
                        Some(at) => at,
                        None => {
                            families.push((name.to_string(), Vec::new(), Vec::new()));
                            families.len() - 1
                        }
                    };
                    if !families[at].1.iter().any(|l| l == line) {
                        families[at].1.push(line.to_string());
                    }
                    current = Some(at);
                }
                None => {
                    if let Some(at) = current {
                        families[at].2.push(with_label(line, "attachment", label));
                    }
                }
            }
        }
    }
    let mut out = String::new();
    for (_, descriptors, samples) in families {
        for line in descriptors.iter().chain(&samples) {
            out += line;
            out.push('\n');
        }
    }
    out += &format!(
        "# HELP {ATTACHMENT_UP} Whether the attachment answered this scrape.\n\
         # TYPE {ATTACHMENT_UP} gauge\n"
    );
    for (label, status) in statuses {
        let up = format!("{ATTACHMENT_UP} {}", u8::from(status.is_some()));
        out += &with_label(&up, "attachment", label);
        out.push('\n');
    }
    out += "# EOF\n";
    out
}

/// `sample` (`name{labels} value` or `name value`) with `key="value"`
/// first among its labels.
fn with_label(sample: &str, key: &str, value: &str) -> String {
    let escaped = value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n");
    let end = sample.find(['{', ' ']).unwrap_or(sample.len());
    let (name, rest) = sample.split_at(end);
    match rest.strip_prefix('{') {
        Some(labels) if labels.starts_with('}') => format!("{name}{{{key}=\"{escaped}\"{labels}"),
        Some(labels) => format!("{name}{{{key}=\"{escaped}\",{labels}"),
        None => format!("{name}{{{key}=\"{escaped}\"}}{rest}"),
    }
}

/// `status` in the OpenMetrics text format.
pub fn openmetrics(status: &Status) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(StatusCollector(status.clone())));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)
        .expect("writing to a String does not fail");
    out
}

/// The classic Prometheus text format of an OpenMetrics exposition written
/// by [`openmetrics`]: a counter family is named with its `_total` suffix,
/// and the `# UNIT` and `# EOF` lines go. (Enough for what this module
/// writes: no quotes in help texts, no `_created` samples, no exemplars.)
pub fn prometheus_text(openmetrics: &str) -> String {
    let counters: Vec<&str> = openmetrics
        .lines()
        .filter_map(|line| line.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let descriptor = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|kind| Some((kind, line.strip_prefix(kind)?)));
        match descriptor {
            Some((kind, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let suffix = if counters.contains(&name) {
                    "_total"
                } else {
                    ""
                };
                out += &format!("{kind}{name}{suffix} {tail}");
            }
            None => out += line,
        }
        out.push('\n');
    }
    out
}

/// The metrics of one status, encoded on each scrape.
#[derive(Debug)]
struct StatusCollector(Status);

type BackendLabels = [(&'static str, String); 2];

/// A per-backend counter: name (without `_total`), help, and its value.
type BackendCounter = (&'static str, &'static str, fn(&BackendTotals) -> u64);

fn backend_labels(b: &BackendTotals) -> BackendLabels {
    [
        ("backend", b.backend.to_string()),
        ("group", b.group.to_string()),
    ]
}

impl Collector for StatusCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        let status = &self.0;
        let backends = &status.backends;
        let e = &mut encoder;
        crate::api::build_info::encode_metric(e, &status.build)?;
        let counters: [BackendCounter; 13] = [
            (
                "selector_requests",
                "Requests the application addressed to the backend (as primary).",
                |b| b.stats.requests,
            ),
            (
                "selector_issued",
                "Requests sent to the backend after steering and tracked.",
                |b| b.issued,
            ),
            (
                "selector_responses",
                "Tracked requests the backend answered.",
                |b| b.stats.responses,
            ),
            (
                "selector_timeouts",
                "Tracked requests to the backend expired unanswered (--timeout).",
                |b| b.expired,
            ),
            (
                "selector_untracked",
                "Requests addressed to the backend passed untracked (in-flight table full).",
                |b| b.stats.untracked,
            ),
            (
                "selector_no_reply",
                "Requests addressed to the backend that expect no reply (never tracked).",
                |b| b.stats.no_reply,
            ),
            (
                "selector_id_collisions",
                "Requests reusing the id of one in flight to another member (left alone).",
                |b| b.stats.id_collisions,
            ),
            (
                "selector_unmatched_responses",
                "Replies from the backend that matched no request in flight.",
                |b| b.stats.unmatched_responses,
            ),
            (
                "selector_late_responses",
                "Reply datagrams after their request completed or expired, within --grace.",
                |b| b.stats.late_responses,
            ),
            (
                "selector_error_replies",
                "Replies from the backend that were errors (DNS FORMERR/SERVFAIL/NOTIMP/REFUSED, memcached SERVER_ERROR, --error-marker): failures of the backend.",
                |b| b.stats.error_replies,
            ),
            (
                "selector_error_replies_moved",
                "Error replies from the backend to reads the selector moved to it.",
                |b| b.stats.error_replies_moved,
            ),
            (
                "selector_stale_replies",
                "Reply datagrams from the backend to an older request whose id the application reused for a request still waiting: dropped.",
                |b| b.stats.stale_replies,
            ),
            (
                "selector_ejections",
                "Times the backend was ejected (failures in a row, or a failed probe).",
                |b| b.ejection.ejections,
            ),
        ];
        for (name, help, value) in counters {
            per_backend(
                e,
                name,
                help,
                None,
                MetricType::Counter,
                backends,
                |b, m| ConstCounter::new(value(b)).encode(m),
            )?;
        }
        per_backend_by(
            e,
            "selector_redirected",
            "Reads redirected away from the backend (their primary) or to it.",
            "direction",
            backends,
            |b| {
                vec![
                    ("away", b.stats.redirected_away),
                    ("to", b.stats.redirected_to),
                ]
            },
        )?;
        per_backend_by(
            e,
            "selector_overloaded",
            "Reads addressed to the backend over a pending cap, by what was done.",
            "action",
            backends,
            |b| {
                vec![
                    ("passed", b.stats.overload_passed),
                    ("dropped", b.stats.overload_dropped),
                    ("rejected", b.stats.overload_rejected),
                ]
            },
        )?;
        per_backend(
            e,
            "selector_pending",
            "Requests pending at the backend now.",
            None,
            MetricType::Gauge,
            backends,
            |b, m| ConstGauge::new(b.pending).encode(m),
        )?;
        per_backend(
            e,
            "selector_drained",
            "1 if the backend is drained (never chosen), else 0.",
            None,
            MetricType::Gauge,
            backends,
            |b, m| ConstGauge::new(u64::from(status.drained.contains(&b.backend))).encode(m),
        )?;
        per_backend(
            e,
            "selector_ejected",
            "Time the backend spent ejected or half-open.",
            Some(&Unit::Seconds),
            MetricType::Counter,
            backends,
            |b, m| ConstCounter::new(b.ejection.ejected_ns as f64 / 1e9).encode(m),
        )?;
        per_backend(
            e,
            "selector_ejection_state",
            "Outlier ejection: 0 healthy, 1 ejected (no read moved to it), 2 half-open (one read probes it). Drain is selector_drained.",
            None,
            MetricType::Gauge,
            backends,
            |b, m| {
                let code = match b.ejection.ejection_state.as_str() {
                    "ejected" => 1,
                    "half_open" => 2,
                    _ => 0,
                };
                ConstGauge::new(code).encode(m)
            },
        )?;
        per_backend(
            e,
            "selector_slow",
            "1 while the backend is slow: not chosen while another eligible member is not, until a probe read finds it fast.",
            None,
            MetricType::Gauge,
            backends,
            |b, m| ConstGauge::new(i64::from(b.ejection.slow)).encode(m),
        )?;
        per_backend(
            e,
            "selector_slowness",
            "The memory of the backend's slowness: a peak-sensitive moving average of its replies' latency and of how long reads waited on it.",
            Some(&Unit::Seconds),
            MetricType::Gauge,
            backends,
            |b, m| ConstGauge::new(b.ejection.slowness_ns as f64 / 1e9).encode(m),
        )?;
        per_backend(
            e,
            "selector_service_time",
            "Recent time per completed request at the backend: the latency policy's service time (0 until measured).",
            Some(&Unit::Seconds),
            MetricType::Gauge,
            backends,
            |b, m| ConstGauge::new(b.service_ns.unwrap_or(0) as f64 / 1e9).encode(m),
        )?;
        per_backend_by(
            e,
            "selector_hedges",
            "Hedged reads by the backend the copy went to: copies sent, and of those, won (reply reached the application first) and lost.",
            "outcome",
            backends,
            |b| {
                vec![
                    ("sent", b.hedges.hedges_sent),
                    ("won", b.hedges.hedges_won),
                    ("lost", b.hedges.hedges_lost),
                ]
            },
        )?;
        per_backend(
            e,
            "selector_response_latency",
            "Request-to-reply latency measured in the kernel (bucket edges of its log-linear histogram; the sum estimates each request at its bucket's middle).",
            Some(&Unit::Seconds),
            MetricType::Histogram,
            backends,
            encode_latency,
        )?;
        per_backend(
            e,
            "selector_tail_requests",
            "The backend's answered requests in the tail (p99 bucket over all backends and slower) of each interval.",
            None,
            MetricType::Counter,
            backends,
            |b, m| ConstCounter::new(b.tail.tail_requests_total).encode(m),
        )?;
        let mut family = e.encode_descriptor(
            "selector_tail_blame_ratio",
            "The backend's share of the last interval's tail (absent before an interval with a reply).",
            None,
            MetricType::Gauge,
        )?;
        for b in backends {
            if let Some(blame) = b.tail.tail_blame {
                ConstGauge::new(blame).encode(family.encode_family(&backend_labels(b))?)?;
            }
        }
        let family = e.encode_descriptor(
            "selector_interval_p99",
            "The last interval's p99 latency over all backends (upper bucket edge).",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        if let Some(p99) = status.last_interval.as_ref().and_then(|i| i.p99_ns) {
            ConstGauge::new(p99 as f64 / 1e9).encode(family)?;
        }
        let family = e.encode_descriptor(
            "selector_in_flight",
            "Entries in the in-flight table now.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(status.in_flight as u64).encode(family)?;
        let family = e.encode_descriptor(
            "selector_members_routed_elsewhere",
            "Members whose route leaves by another interface than the attached one: requests to them are not seen.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(status.routed_elsewhere.len() as u64).encode(family)?;
        let family = e.encode_descriptor(
            "selector_config_reload_success",
            "1 if the last configuration reload applied (or none was tried since the start), 0 if it was refused.",
            None,
            MetricType::Gauge,
        )?;
        if let Some(success) = status.config_reload_success {
            ConstGauge::new(u64::from(success)).encode(family)?;
        }
        let family = e.encode_descriptor(
            "selector_config_reload_timestamp",
            "When the configuration in force was loaded (the start, or the last reload that applied), since the Unix epoch.",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        if let Some(seconds) = status.config_reload_timestamp_seconds {
            ConstGauge::new(seconds).encode(family)?;
        }
        let family = e.encode_descriptor(
            "selector_heartbeat_fresh",
            "1 while the agent's heartbeat is within --heartbeat-bound (the kernel programs steer), 0 once stale (they move no read).",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(u64::from(status.heartbeat.fresh)).encode(family)?;
        let family = e.encode_descriptor(
            "selector_heartbeat_age",
            "Time since the agent's last sweep wrote its heartbeat.",
            Some(&Unit::Seconds),
            MetricType::Gauge,
        )?;
        ConstGauge::new(status.heartbeat.age_ms as f64 / 1e3).encode(family)?;
        let mut family = e.encode_descriptor(
            "selector_passed",
            "Packets passed untouched, by direction and reason.",
            None,
            MetricType::Counter,
        )?;
        for p in &status.passed {
            let labels = [
                ("direction", p.direction.as_str()),
                ("reason", p.reason.as_str()),
            ];
            ConstCounter::new(p.count).encode(family.encode_family(&labels)?)?;
        }
        let mut family = e.encode_descriptor(
            "selector_headers_pulled",
            "Packets whose skb the programs pulled (bytes moved from page fragments into the linear part), by direction.",
            None,
            MetricType::Counter,
        )?;
        let pulled = status.headers_pulled;
        for (direction, count) in [("egress", pulled.egress), ("ingress", pulled.ingress)] {
            ConstCounter::new(count).encode(family.encode_family(&[("direction", direction)])?)?;
        }
        Ok(())
    }
}

/// One metric family with a sample per backend.
fn per_backend(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    metric_type: MetricType,
    backends: &[BackendTotals],
    sample: impl Fn(&BackendTotals, MetricEncoder) -> Result<(), fmt::Error>,
) -> Result<(), fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, unit, metric_type)?;
    for b in backends {
        sample(b, family.encode_family(&backend_labels(b))?)?;
    }
    Ok(())
}

/// A counter per backend and value of one more label (`direction`,
/// `action`, `outcome`, ...).
fn per_backend_by(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    label: &'static str,
    backends: &[BackendTotals],
    counts: impl Fn(&BackendTotals) -> Vec<(&'static str, u64)>,
) -> Result<(), fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
    for b in backends {
        for (value, count) in counts(b) {
            let labels = (backend_labels(b), [(label, value)]);
            ConstCounter::new(count).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// A backend's kernel histogram as a Prometheus histogram: every bucket,
/// `le` its inclusive upper edge in seconds (latencies are whole
/// nanoseconds), the open last bucket `+Inf`.
fn encode_latency(b: &BackendTotals, mut encoder: MetricEncoder) -> Result<(), fmt::Error> {
    let mut counts = [0u64; LATENCY_BUCKETS as usize];
    for bucket in &b.latency_buckets {
        counts[latency::bucket(bucket.lower_ns) as usize] += bucket.count;
    }
    let (buckets, sum) = prometheus_buckets(&counts);
    let count = counts.iter().sum();
    encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
}

/// (upper edge in seconds, count) per bucket, and the estimated sum in
/// seconds (each request at its bucket's middle; the open bucket's at its
/// lower edge).
fn prometheus_buckets(counts: &[u64]) -> (Vec<(f64, u64)>, f64) {
    let mut sum = 0.0;
    let buckets = counts
        .iter()
        .enumerate()
        .map(|(i, count)| {
            let i = i as u32;
            let (lower, upper) = (latency::bucket_lower_ns(i), latency::bucket_upper_ns(i));
            let (le, middle_ns) = if upper == u64::MAX {
                (f64::INFINITY, lower as f64)
            } else {
                (upper as f64 / 1e9, (lower + upper + 1) as f64 / 2.0)
            };
            sum += *count as f64 * middle_ns / 1e9;
            (le, *count)
        })
        .collect();
    (buckets, sum)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::{
        api::SettingsInForce,
        config::settings::Settings,
        telemetry::{BackendTail, HeadersPulled, LastInterval, PassedCount, latency_buckets},
    };
    use selector_common::BackendStats;

    pub(crate) fn status() -> Status {
        let primary = "10.0.0.1:11211".parse().unwrap();
        let replica = "10.0.0.2:11211".parse().unwrap();
        let mut primary_latency = [0u64; LATENCY_BUCKETS as usize];
        primary_latency[latency::bucket(100_000) as usize] = 8;
        primary_latency[latency::bucket(25_000_000) as usize] = 2;
        let backend = |addr, position, stats: BackendStats, latency: &[u64], tail| BackendTotals {
            backend: addr,
            group: 1,
            position,
            pending: 3,
            issued: stats.requests,
            completed: stats.responses,
            expired: 1,
            stats,
            p50_ns: None,
            p99_ns: None,
            p999_ns: None,
            latency_buckets: latency_buckets(latency),
            tail,
            hedges: Default::default(),
            service_ns: None,
            ejection: Default::default(),
        };
        Status {
            iface: "eth0".into(),
            settings: SettingsInForce::from(&Settings::new("eth0", vec![vec![primary, replica]])),
            in_flight: 3,
            last_interval: Some(LastInterval {
                number: 1,
                length_ms: 1000,
                answered: 10,
                p99_ns: Some(25_000_000),
                tail_requests: 2,
            }),
            drained: vec![replica],
            groups_over_cap: vec![],
            hedges: Default::default(),
            tc_attach: "tcx".into(),
            config_reload_success: Some(true),
            config_reload_timestamp_seconds: Some(1_764_748_800.5),
            build: crate::api::build_info::BuildInfo {
                version: "0.1.0".into(),
                commit: "8ab3247".into(),
            },
            heartbeat: crate::api::Heartbeat {
                bound_ms: 1000,
                age_ms: 250,
                fresh: true,
            },
            netns: None,
            routed_elsewhere: vec![crate::api::RoutedElsewhere {
                backend: "10.0.0.9:11211".parse().unwrap(),
                iface: "eth1".into(),
            }],
            passed: vec![PassedCount {
                direction: "egress".into(),
                reason: "not_a_backend".into(),
                count: 12,
            }],
            headers_pulled: HeadersPulled {
                egress: 1,
                ingress: 7,
            },
            backends: vec![
                backend(
                    primary,
                    0,
                    BackendStats {
                        requests: 11,
                        responses: 10,
                        redirected_away: 4,
                        ..Default::default()
                    },
                    &primary_latency,
                    BackendTail {
                        tail_requests: 2,
                        tail_blame: Some(1.0),
                        tail_requests_total: 5,
                    },
                ),
                backend(
                    replica,
                    1,
                    BackendStats {
                        redirected_to: 4,
                        ..Default::default()
                    },
                    &[0; LATENCY_BUCKETS as usize],
                    BackendTail::default(),
                ),
            ],
        }
    }

    /// The value of the sample line that starts with `series` (name and labels).
    fn sample(text: &str, series: &str) -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    const PRIMARY: &str = r#"{backend="10.0.0.1:11211",group="1"}"#;

    #[test]
    fn counters_and_gauges_carry_backend_and_group() {
        let mut status = status();
        status.backends[0].service_ns = Some(500_000);
        status.backends[0].hedges.hedges_sent = 4;
        status.backends[0].hedges.hedges_won = 3;
        let text = openmetrics(&status);
        assert_eq!(
            sample(&text, &format!("selector_service_time_seconds{PRIMARY}")),
            0.0005
        );
        assert_eq!(
            sample(
                &text,
                r#"selector_hedges_total{backend="10.0.0.1:11211",group="1",outcome="won"}"#
            ),
            3.0
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert_eq!(
            sample(&text, &format!("selector_requests_total{PRIMARY}")),
            11.0
        );
        assert_eq!(
            sample(&text, &format!("selector_responses_total{PRIMARY}")),
            10.0
        );
        assert_eq!(
            sample(&text, &format!("selector_timeouts_total{PRIMARY}")),
            1.0
        );
        assert_eq!(sample(&text, &format!("selector_pending{PRIMARY}")), 3.0);
        assert_eq!(
            sample(
                &text,
                r#"selector_redirected_total{backend="10.0.0.1:11211",group="1",direction="away"}"#
            ),
            4.0
        );
        assert_eq!(
            sample(
                &text,
                r#"selector_redirected_total{backend="10.0.0.2:11211",group="1",direction="to"}"#
            ),
            4.0
        );
        assert_eq!(
            sample(
                &text,
                r#"selector_drained{backend="10.0.0.2:11211",group="1"}"#
            ),
            1.0
        );
        assert_eq!(
            sample(&text, &format!("selector_tail_blame_ratio{PRIMARY}")),
            1.0
        );
        assert_eq!(
            sample(&text, &format!("selector_tail_requests_total{PRIMARY}")),
            5.0
        );
        // No blame without tail requests: no sample rather than a made-up one.
        assert!(!text.contains(r#"selector_tail_blame_ratio{backend="10.0.0.2:11211""#));
        assert_eq!(sample(&text, "selector_interval_p99_seconds"), 0.025);
        assert_eq!(sample(&text, "selector_in_flight"), 3.0);
        assert_eq!(sample(&text, "selector_heartbeat_fresh"), 1.0);
        assert_eq!(sample(&text, "selector_heartbeat_age_seconds"), 0.25);
        assert_eq!(
            sample(
                &text,
                r#"selector_passed_total{direction="egress",reason="not_a_backend"}"#
            ),
            12.0
        );
        assert_eq!(
            sample(
                &text,
                r#"selector_headers_pulled_total{direction="egress"}"#
            ),
            1.0
        );
        assert_eq!(
            sample(
                &text,
                r#"selector_headers_pulled_total{direction="ingress"}"#
            ),
            7.0
        );
        assert!(
            text.contains("# UNIT selector_response_latency_seconds seconds\n"),
            "{text}"
        );
        assert_eq!(sample(&text, "selector_config_reload_success"), 1.0);
        assert_eq!(sample(&text, "selector_members_routed_elsewhere"), 1.0);
        assert_eq!(
            sample(&text, "selector_config_reload_timestamp_seconds"),
            1_764_748_800.5
        );
        status.config_reload_success = Some(false);
        let text = openmetrics(&status);
        assert_eq!(sample(&text, "selector_config_reload_success"), 0.0);
    }

    #[test]
    fn the_latency_histogram_is_cumulative_in_seconds() {
        let text = openmetrics(&status());
        let bucket_lines: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("selector_response_latency_seconds_bucket{"))
            .filter(|l| l.contains(r#"backend="10.0.0.1:11211""#))
            .collect();
        assert_eq!(bucket_lines.len(), LATENCY_BUCKETS as usize);
        // The 100 µs bucket [96, 112) µs: le is its last nanosecond.
        let fast = bucket_lines
            .iter()
            .find(|l| l.contains(r#"le="0.000111999""#))
            .unwrap_or_else(|| panic!("{bucket_lines:#?}"));
        assert!(fast.ends_with(" 8"), "{fast}");
        assert!(bucket_lines.last().unwrap().contains(r#"le="+Inf""#));
        assert!(bucket_lines.last().unwrap().ends_with(" 10"));
        let mut last = 0;
        for line in &bucket_lines {
            let n: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(n >= last, "not cumulative: {line}");
            last = n;
        }
        let count = sample(
            &text,
            &format!("selector_response_latency_seconds_count{PRIMARY}"),
        );
        assert_eq!(count, 10.0);
        let sum = sample(
            &text,
            &format!("selector_response_latency_seconds_sum{PRIMARY}"),
        );
        // 8 at 104 µs and 2 in [24.576, 28.672) ms, each at its middle.
        assert!(
            (sum - (8.0 * 104e-6 + 2.0 * 26.624e-3)).abs() < 1e-9,
            "{sum}"
        );
    }

    #[test]
    fn several_attachments_share_each_family_and_label_every_sample() {
        let mut pod = status();
        pod.backends[0].stats.requests = 7;
        let text = openmetrics_labelled(&[
            ("eth0".to_string(), Some(status())),
            ("eth0@/run/netns/pod \"1\"".to_string(), Some(pod)),
        ]);
        let alone = openmetrics(&status());
        // Every family once, in the order a single status has them.
        let types = |text: &str| -> Vec<String> {
            text.lines()
                .filter(|l| l.starts_with("# TYPE "))
                .map(str::to_string)
                .collect()
        };
        let up = format!("# TYPE {ATTACHMENT_UP} gauge");
        assert_eq!(types(&text), [types(&alone), vec![up]].concat());
        assert!(text.ends_with("# EOF\n") && text.matches("# EOF").count() == 1);
        // Every sample twice, once per attachment, labelled first; the
        // label's quotes escaped.
        let samples = |text: &str| text.lines().filter(|l| !l.starts_with('#')).count();
        assert_eq!(samples(&text), 2 * samples(&alone) + 2);
        assert!(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .all(|l| l.contains("{attachment=\"eth0")),
            "{text}"
        );
        let primary = r#"backend="10.0.0.1:11211",group="1"}"#;
        assert_eq!(
            sample(
                &text,
                &format!("selector_requests_total{{attachment=\"eth0\",{primary}")
            ),
            11.0
        );
        assert_eq!(
            sample(
                &text,
                &format!(
                    r#"selector_requests_total{{attachment="eth0@/run/netns/pod \"1\"",{primary}"#
                )
            ),
            7.0
        );
        // A sample without labels gets the one label.
        assert_eq!(
            sample(&text, r#"selector_in_flight{attachment="eth0"}"#),
            3.0
        );
        let classic = render_labelled(Format::PrometheusText, &[("a".into(), Some(status()))]);
        assert!(
            classic.contains("selector_in_flight{attachment=\"a\"} 3\n"),
            "{classic}"
        );
        assert!(!classic.contains("# EOF"), "{classic}");
    }

    #[test]
    fn an_attachment_that_did_not_answer_is_down_and_the_others_are_served() {
        let text =
            openmetrics_labelled(&[("a".to_string(), Some(status())), ("b".to_string(), None)]);
        assert_eq!(
            sample(&text, r#"selector_attachment_up{attachment="a"}"#),
            1.0
        );
        assert_eq!(
            sample(&text, r#"selector_attachment_up{attachment="b"}"#),
            0.0
        );
        assert_eq!(sample(&text, r#"selector_in_flight{attachment="a"}"#), 3.0);
        assert!(!text.contains(r#"{attachment="b","#), "{text}");
        assert!(
            !text.contains(r#"selector_in_flight{attachment="b"}"#),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
        // None answered (the last one ended): the families of the up
        // gauge alone.
        let text = render_labelled(Format::PrometheusText, &[("a".to_string(), None)]);
        assert_eq!(
            text,
            format!(
                "# HELP {ATTACHMENT_UP} Whether the attachment answered this scrape.\n\
                 # TYPE {ATTACHMENT_UP} gauge\n\
                 {ATTACHMENT_UP}{{attachment=\"a\"}} 0\n"
            )
        );
    }

    #[test]
    fn the_prometheus_text_format_names_counters_with_total() {
        let text = prometheus_text(&openmetrics(&status()));
        assert!(
            text.contains("# TYPE selector_requests_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP selector_requests_total Requests"),
            "{text}"
        );
        assert!(text.contains("# TYPE selector_pending gauge\n"), "{text}");
        assert!(text.contains("# TYPE selector_response_latency_seconds histogram\n"));
        assert!(
            !text.contains("# UNIT") && !text.contains("# EOF"),
            "{text}"
        );
        assert_eq!(
            sample(&text, &format!("selector_requests_total{PRIMARY}")),
            11.0
        );
    }
}
