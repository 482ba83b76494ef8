//! The control protocol between `selector status|set|drain|undrain` and a
//! running agent.
//!
//! Transport: a Unix socket per agent, `/run/selector/net-INODE/IFACE.sock`
//! (see [`socket`]): one per network namespace and interface, in
//! directories only the agent's user may enter. Only root or the agent's
//! own user may use it, and a client trusts only a root or same-user
//! agent. A command without `--iface` finds the one agent of its namespace
//! there (`cli::find_agent`).
//!
//! One request, one reply, each a single line of JSON:
//!
//! ```text
//! {"request":"status"}
//! {"request":"set","policy":"threshold","threshold":2,"max_pending":5,
//!  "max_pending_client":0,"on_overload":"drop","budget":2,
//!  "tie_break":"random"}    (every field optional; `TunablesPatch`)
//! {"request":"drain","backend":"10.0.0.2:11211","drained":true}
//! {"request":"reload"}
//!
//! {"reply":"status", ...Status...}
//! {"reply":"done","message":"policy threshold, threshold 2, ..."}
//! {"reply":"error","message":"threshold must be at least 1"}
//! ```
//!
//! An agent of several attachments (`selector run --attachment`) has one
//! more socket, for all of them ([`socket::Endpoint::Attachments`]): the
//! same requests, each naming its attachment by label ([`Routed`]); a
//! status naming none is answered with every attachment's:
//!
//! ```text
//! {"attachment":"eth0@/run/netns/pod-a","request":"drain",...}
//! {"request":"status"}
//! {"reply":"attachments","attachments":[{"attachment":"eth0@/run/netns/pod-a",
//!  "status":{...Status...}}, ...]}
//! ```
//!
//! [`Status`] is also what `selector status --json` prints.

pub mod build_info;
pub mod socket;

pub use socket::send;

use serde::{Deserialize, Serialize};

use crate::{
    config::settings::Settings,
    config::tunables::{Tunables, TunablesPatch},
    telemetry::{BackendTotals, HeadersPulled, LastInterval, PassedCount},
};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum Request {
    /// Settings, totals and pending counts.
    Status,
    /// Change the run-time tunables.
    Set(TunablesPatch),
    /// Drain (never choose) or undrain a backend.
    Drain {
        backend: std::net::SocketAddr,
        drained: bool,
    },
    /// Read the config file again and apply it (see [`crate::agent::reload`]).
    Reload,
}

/// A request to the endpoint of an agent of several attachments: for the
/// attachment labelled `attachment` (`IFACE` or `IFACE@NETNS`, as in the
/// metrics). Only a status may name none: then it is every attachment's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Routed {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attachment: Option<String>,
    #[serde(flatten)]
    pub request: Request,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    Status(Box<Status>),
    /// Each attachment's status, in the order of the agent's
    /// `--attachment` flags, and those that gave none (not started yet,
    /// stopping, or too slow), each with why.
    Attachments {
        attachments: Vec<AttachmentStatus>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        unavailable: Vec<Unavailable>,
    },
    /// A change was applied; the message says what is in force now.
    Done {
        message: String,
    },
    Error {
        message: String,
    },
}

/// The running agent's state: the reply to `status`, and the document
/// `selector status --json` prints. Counters are totals since the agent
/// started. The schema only grows: fields are added, never renamed or
/// removed, and a reader takes a missing added field as its default.
///
/// The tail of an interval (`--interval`) is its answered requests in the
/// latency bucket of the p99 over all backends, or slower; a backend's
/// blame is its share of them (see `selector_common::blame`).
///
/// ```text
/// {
///   "iface": "eth0",
///   "settings": {                  settings in force
///     "policy": "threshold",       threshold | absolute | observe | latency
///     "threshold": 4,
///     "max_pending": 0,            per backend; 0 = no bound
///     "max_pending_client": 0,     per client socket; 0 = no bound
///     "on_overload": "pass",       pass | drop | reject
///     "proto": "memcached",        memcached | dns | custom
///     "timeout_ms": 1000,
///     "grace_ms": 1000,
///     "mark": 16777216,            the skb mark bit, as a number
///     "inflight_max": 65536,
///     "ingress": "xdp",            xdp | tc
///     "hedge_after": "off",        off | auto | milliseconds ("2", "0.5")
///     "hedge_budget_percent": 5,
///     "budget_us": 1000,           latency policy's budget, microseconds
///     "tie_break": "random"        random | first
///   },
///   "in_flight": 3,                requests pending now, all backends (the sum of `pending`; a hedge copy counts at its target)
///   "last_interval": {             the last interval ended; null before
///     "number": 12,                from 1; a new number means new blame
///     "length_ms": 1000,
///     "answered": 2000,            requests answered in it, all backends
///     "p99_ns": 28000000,          its p99 over all backends (bucket edge)
///     "tail_requests": 25          answered in the p99 bucket or slower
///   },
///   "drained": ["10.0.0.2:11211"],  the operator's (`selector drain`), apart from ejection
///   "groups_over_cap": [2],        groups with more members failing than
///                                  --max-ejected allows: none ejected,
///                                  steered by counts alone
///   "passed": [                    packets passed untouched, by reason
///     {"direction": "egress", "reason": "not_a_backend", "count": 12}
///   ],
///   "backends": [                  in --group order
///     {"backend": "10.0.0.1:11211",
///      "group": 1,                 from 1, in --group order
///      "position": 0,              0 = the primary
///      "pending": 2,               issued - completed - expired
///      "issued": 900, "completed": 880,
///      "requests": 900, "responses": 880,
///      "redirected_away": 40, "redirected_to": 0,
///      "expired": 18,              requests that timed out
///      "untracked": 0, "no_reply": 0, "id_collisions": 0,
///      "unmatched_responses": 1, "late_responses": 0,
///      "overload_passed": 0, "overload_dropped": 0, "overload_rejected": 0,
///      "p50_ns": 112000,           null until a reply was seen;
///      "p99_ns": 28000000,         upper edge of a histogram bucket
///      "p999_ns": 30000000,
///      "latency_buckets": [        the histogram's non-empty buckets:
///        {"lower_ns": 96000,       count requests answered in
///         "upper_ns": 112000,      [lower_ns, upper_ns); upper_ns null
///         "count": 860}, ...],     for the open last bucket (29.4 s up)
///      "tail_requests": 24,        its requests in the last interval's tail
///      "tail_blame": 0.96,         its share of that tail; null if empty
///      "tail_requests_total": 310, its tail requests over all intervals
///      "hedges_sent": 3,           copies sent to this backend
///      "hedges_won": 2,            ... whose reply reached the application first
///      "hedges_lost": 1,           ... beaten by the first member's reply
///      "hedge_replies_dropped": 2, later replies from it dropped in the kernel
///      "hedge_errors_held": 0,     its error replies to hedged reads dropped
///                                  while the other copy could still answer
///      "hedge_over_budget": 0, "hedge_no_target": 0, "hedge_queue_full": 0,
///      "hedge_ring_full": 0, "hedge_too_large": 0,   reads to it (as primary) not hedged
///      "hedge_send_failed": 0,     copies to it the socket refused
///      "hedge_delay_ns": 2000000,  delay for reads to it; null when off
///      "service_ns": 250000,       recent time per completed request (the
///                                  latency policy's); null until measured
///      "error_replies": 0,         replies that were errors (DNS FORMERR,
///                                  SERVFAIL, NOTIMP, REFUSED; memcached
///                                  SERVER_ERROR; --error-marker)
///      "error_replies_moved": 0,   ... to reads moved here by the selector
///      "stale_replies": 0,         replies to an older request whose id the
///                                  application reused: dropped
///      "ejection_state": "healthy", healthy | ejected | half_open
///      "ejections": 0,             since start (a failed probe's too)
///      "ejected_ns": 0,            time ejected or half-open since start
///      "failures_in_a_row": 0,     expired requests and error replies
///      "slow": false,              not chosen while another member is not,
///                                  until a probe read finds it fast
///      "slowness_ns": 210000,      its memory of slowness: a peak-sensitive
///                                  average of latency and of reads' waits
///      "slow_probes": 0}           reads that probed it while slow
///   ],
///   "hedges": {...},               the hedge fields above, summed (delay null)
///   "config_reload_success": true, false if the last reload was refused
///   "config_reload_timestamp_seconds": 1764748800.25
///                                  when the configuration in force was
///                                  loaded (the start, or the last reload
///                                  that applied), seconds since the epoch
///   "build": {"version": "0.1.0", "commit": "8ab3247"}
///                                  the agent's; commit `-dirty` if built
///                                  from changed sources, `unknown` without git
///   "heartbeat": {                 the agent's heartbeat, as the programs see it
///     "bound_ms": 1000,            --heartbeat-bound; 0 = never stale
///     "age_ms": 120,               since the last sweep wrote it
///     "fresh": true                false: the programs move no read
///   }
///   "netns": {"path": "/run/netns/pod1", "id": "net:[4026532301]"}
///                                  the network namespace attached in
///                                  (`--netns`); null: the agent's own
///   "routed_elsewhere": [{"backend": "10.0.0.3:11211", "iface": "eth1"}]
///                                  members whose route leaves by another
///                                  interface: the selector does not see
///                                  requests to them
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Status {
    pub iface: String,
    pub settings: SettingsInForce,
    pub in_flight: usize,
    #[serde(default)]
    pub last_interval: Option<LastInterval>,
    pub drained: Vec<std::net::SocketAddr>,
    /// Groups (from 1) with more members failing than `--max-ejected`
    /// allows: none ejected, steered by counts alone.
    #[serde(default)]
    pub groups_over_cap: Vec<u32>,
    pub passed: Vec<PassedCount>,
    /// Packets whose skb the programs pulled, by direction.
    #[serde(default)]
    pub headers_pulled: HeadersPulled,
    pub backends: Vec<BackendTotals>,
    /// Hedging totals over all backends.
    #[serde(default)]
    pub hedges: crate::telemetry::hedges::HedgeCounts,
    /// How the TC programs are attached: `tcx` (links) or `netlink`
    /// (legacy tc filters, on kernels without TCX).
    #[serde(default)]
    pub tc_attach: String,
    /// False if the last reload was refused (the previous configuration
    /// runs); `None` from an agent that predates it.
    #[serde(default)]
    pub config_reload_success: Option<bool>,
    /// When the configuration in force was loaded (the start, or the last
    /// reload that applied), seconds since the Unix epoch.
    #[serde(default)]
    pub config_reload_timestamp_seconds: Option<f64>,
    /// The agent's version and git commit (empty from an agent too old to say).
    #[serde(default)]
    pub build: crate::api::build_info::BuildInfo,
    /// The agent's heartbeat as the kernel programs see it.
    #[serde(default)]
    pub heartbeat: Heartbeat,
    /// The network namespace the agent attached in, with `--netns`.
    #[serde(default)]
    pub netns: Option<NetnsInfo>,
    /// Members whose route leaves by another interface than the attached
    /// one: requests to them pass no selector program, so they are never
    /// counted (their pending count stays 0) or steered.
    #[serde(default)]
    pub routed_elsewhere: Vec<RoutedElsewhere>,
}

/// The heartbeat part of [`Status`] (see `selector_common::Config::agent_alive`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// `--heartbeat-bound`; 0: the programs never take the agent for gone.
    pub bound_ms: u64,
    /// Since the last sweep wrote it.
    pub age_ms: u64,
    /// Within the bound: the programs steer (false: they move no read).
    pub fresh: bool,
}

/// `--netns` as given, and the namespace's identity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetnsInfo {
    pub path: String,
    /// `net:[INODE]`, as /proc/PID/ns/net links show it.
    pub id: String,
}

/// A member whose route leaves by another interface.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutedElsewhere {
    pub backend: std::net::SocketAddr,
    /// The interface its route leaves by.
    pub iface: String,
}

/// The settings part of [`Status`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SettingsInForce {
    /// `policy`, `threshold`, `max_pending`, `max_pending_client`,
    /// `on_overload`, `hedge_after`, `hedge_budget_percent`, `budget_us`
    /// and `tie_break`.
    #[serde(flatten)]
    pub tunables: Tunables,
    pub proto: String,
    pub timeout_ms: u64,
    pub grace_ms: u64,
    pub mark: u32,
    pub inflight_max: u32,
    pub ingress: String,
}

impl From<&Settings> for SettingsInForce {
    fn from(s: &Settings) -> Self {
        Self {
            tunables: s.tunables,
            proto: s.protocol().name().into(),
            timeout_ms: s.timeout.as_millis() as u64,
            grace_ms: s.grace.as_millis() as u64,
            mark: s.mark,
            inflight_max: s.inflight_max,
            ingress: s.ingress.name().into(),
        }
    }
}

/// One attachment's status in the reply of an agent of several.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttachmentStatus {
    pub attachment: String,
    pub status: Status,
}

/// An attachment of an agent of several that gave no status, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Unavailable {
    pub attachment: String,
    pub reason: String,
}

/// Longest request line the agent reads.
pub const MAX_REQUEST_BYTES: u64 = 4096;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::settings::OnOverload;
    use crate::telemetry::{BackendTail, LatencyBucket};
    use selector_common::BackendStats;
    use selector_common::{Policy, TieBreak};

    fn round_trip<T: Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(
        value: &T,
    ) {
        let line = serde_json::to_string(value).unwrap();
        assert!(!line.contains('\n'), "one line: {line}");
        assert_eq!(&serde_json::from_str::<T>(&line).unwrap(), value, "{line}");
    }

    fn backend() -> std::net::SocketAddr {
        "10.0.0.2:11211".parse().unwrap()
    }

    #[test]
    fn requests_round_trip() {
        for r in [
            Request::Status,
            Request::Set(TunablesPatch {
                policy: Some(Policy::Absolute),
                threshold: Some(12),
                max_pending: Some(5),
                max_pending_client: Some(2),
                on_overload: Some(OnOverload::Reject),
                hedge_after: Some("0.5".parse().unwrap()),
                hedge_budget: Some(10),
                budget: Some(crate::config::tunables::Millis(
                    std::time::Duration::from_micros(2500),
                )),
                tie_break: Some(TieBreak::Random),
                ..Default::default()
            }),
            Request::Set(TunablesPatch {
                threshold: Some(3),
                ..Default::default()
            }),
            Request::Drain {
                backend: backend(),
                drained: true,
            },
            Request::Drain {
                backend: backend(),
                drained: false,
            },
            Request::Reload,
        ] {
            round_trip(&r);
            round_trip(&Routed {
                attachment: Some("eth0@/run/netns/pod-a".into()),
                request: r.clone(),
            });
            // A plain request is a routed one naming no attachment.
            let plain = serde_json::to_string(&r).unwrap();
            assert_eq!(
                serde_json::from_str::<Routed>(&plain).unwrap(),
                Routed {
                    attachment: None,
                    request: r
                }
            );
        }
        let drain: Routed = serde_json::from_str(
            r#"{"attachment":"eth0","request":"drain","backend":"10.0.0.2:11211","drained":true}"#,
        )
        .unwrap();
        assert_eq!(drain.attachment.as_deref(), Some("eth0"));
        assert_eq!(
            drain.request,
            Request::Drain {
                backend: backend(),
                drained: true
            }
        );
    }

    #[test]
    fn the_wire_form_is_the_documented_one() {
        let set = Request::Set(TunablesPatch {
            max_pending: Some(5),
            on_overload: Some(OnOverload::Drop),
            ..Default::default()
        });
        assert_eq!(
            serde_json::to_string(&set).unwrap(),
            r#"{"request":"set","max_pending":5,"on_overload":"drop"}"#
        );
        // A request of an older client: `budget_us` in microseconds.
        let old: Request =
            serde_json::from_str(r#"{"request":"set","max_pending":5,"budget_us":2000}"#).unwrap();
        let Request::Set(old) = old else {
            panic!("not a set request: {old:?}");
        };
        let settings = old.applied_to(&Settings::new("eth0", vec![vec![backend()]]));
        assert_eq!(
            settings.unwrap().tunables.budget,
            std::time::Duration::from_millis(2)
        );
        assert_eq!(
            serde_json::to_string(&Request::Status).unwrap(),
            r#"{"request":"status"}"#
        );
        assert_eq!(
            serde_json::to_string(&Request::Reload).unwrap(),
            r#"{"request":"reload"}"#
        );
        let drain: Request = serde_json::from_str(
            r#"{"request":"drain","backend":"10.0.0.2:11211","drained":true}"#,
        )
        .unwrap();
        assert_eq!(
            drain,
            Request::Drain {
                backend: backend(),
                drained: true
            }
        );
    }

    #[test]
    fn replies_round_trip() {
        let settings = Settings::new("eth0", vec![vec![backend()]]);
        let status = Status {
            iface: "eth0".into(),
            settings: SettingsInForce::from(&settings),
            in_flight: 3,
            last_interval: Some(LastInterval {
                number: 4,
                length_ms: 1000,
                answered: 10,
                p99_ns: Some(112_000),
                tail_requests: 2,
            }),
            drained: vec![backend()],
            groups_over_cap: vec![],
            passed: vec![PassedCount {
                direction: "ingress".into(),
                reason: "fragment".into(),
                count: 4,
            }],
            headers_pulled: HeadersPulled {
                egress: 0,
                ingress: 5,
            },
            backends: vec![BackendTotals {
                backend: backend(),
                group: 1,
                position: 0,
                pending: 1,
                issued: 10,
                completed: 9,
                expired: 0,
                stats: BackendStats {
                    requests: 10,
                    responses: 9,
                    redirected_away: 2,
                    ..Default::default()
                },
                p50_ns: Some(112_000),
                p99_ns: None,
                p999_ns: None,
                latency_buckets: vec![LatencyBucket {
                    lower_ns: 96_000,
                    upper_ns: Some(112_000),
                    count: 9,
                }],
                tail: BackendTail {
                    tail_requests: 2,
                    tail_blame: Some(1.0),
                    tail_requests_total: 7,
                },
                hedges: crate::telemetry::hedges::HedgeCounts {
                    hedges_sent: 2,
                    hedges_won: 1,
                    ..Default::default()
                },
                service_ns: Some(250_000),
                ejection: Default::default(),
            }],
            hedges: Default::default(),
            tc_attach: "tcx".into(),
            config_reload_success: Some(false),
            config_reload_timestamp_seconds: Some(1_764_748_800.25),
            build: crate::api::build_info::BuildInfo {
                version: "0.1.0".into(),
                commit: "8ab3247-dirty".into(),
            },
            heartbeat: Heartbeat {
                bound_ms: 1000,
                age_ms: 120,
                fresh: true,
            },
            netns: Some(NetnsInfo {
                path: "/run/netns/pod1".into(),
                id: "net:[4026532301]".into(),
            }),
            routed_elsewhere: vec![RoutedElsewhere {
                backend: "10.0.0.3:11211".parse().unwrap(),
                iface: "eth1".into(),
            }],
        };
        round_trip(&Reply::Status(Box::new(status.clone())));
        round_trip(&Reply::Attachments {
            attachments: vec![AttachmentStatus {
                attachment: "eth0@/run/netns/pod-a".into(),
                status: status.clone(),
            }],
            unavailable: vec![Unavailable {
                attachment: "eth0@/run/netns/pod-b".into(),
                reason: "not started yet".into(),
            }],
        });
        round_trip(&Reply::Done {
            message: "10.0.0.2:11211 drained".into(),
        });
        round_trip(&Reply::Error {
            message: "nope".into(),
        });
        let json: serde_json::Value = serde_json::to_value(&status).unwrap();
        assert_eq!(json["settings"]["on_overload"], "pass");
        assert_eq!(json["settings"]["mark"], 0x0100_0000);
        assert_eq!(json["heartbeat"]["fresh"], true);
        assert_eq!(json["heartbeat"]["bound_ms"], 1000);
        assert_eq!(json["backends"][0]["backend"], "10.0.0.2:11211");
        assert!(json["backends"][0]["p99_ns"].is_null());
        assert_eq!(json["backends"][0]["tail_blame"], 1.0);
        assert_eq!(json["backends"][0]["tail_requests_total"], 7);
        assert_eq!(
            json["backends"][0]["latency_buckets"][0]["upper_ns"],
            112_000
        );
        assert_eq!(json["last_interval"]["length_ms"], 1000);
        assert_eq!(json["backends"][0]["hedges_sent"], 2);
        assert_eq!(json["backends"][0]["hedges_won"], 1);
        assert_eq!(json["settings"]["hedge_after"], "off");
        assert_eq!(json["config_reload_success"], false);
        assert_eq!(json["config_reload_timestamp_seconds"], 1_764_748_800.25);
        let text = status.render();
        assert!(
            text.contains(
                "policy threshold, threshold 4, max-pending 0, max-pending-client 0, on-overload pass"
            ),
            "{text}"
        );
        assert!(text.contains("mark 0x01000000"), "{text}");
        assert!(text.contains("drained: 10.0.0.2:11211"), "{text}");
        assert_eq!(json["netns"]["path"], "/run/netns/pod1");
        assert_eq!(json["netns"]["id"], "net:[4026532301]");
        assert_eq!(json["routed_elsewhere"][0]["backend"], "10.0.0.3:11211");
        assert_eq!(json["routed_elsewhere"][0]["iface"], "eth1");
        assert!(
            text.starts_with("selector on eth0 in netns /run/netns/pod1 (net:[4026532301]): "),
            "{text}"
        );
        assert!(
            text.contains("warning: the route to 10.0.0.3:11211 leaves by eth1, not eth0"),
            "{text}"
        );
        assert!(
            text.contains("passed untouched: ingress fragment 4"),
            "{text}"
        );
        assert_eq!(json["build"]["version"], "0.1.0");
        assert_eq!(json["build"]["commit"], "8ab3247-dirty");
        assert!(
            text.ends_with("agent: selector 0.1.0 (commit 8ab3247-dirty)\n"),
            "{text}"
        );
    }

    #[test]
    fn a_status_without_the_added_fields_still_reads() {
        // What an agent from before the tail blame and histograms replies.
        let older = r#"{"reply":"status","iface":"eth0",
            "settings":{"policy":"threshold","threshold":4,"max_pending":0,
              "max_pending_client":0,"on_overload":"pass","proto":"memcached",
              "timeout_ms":1000,"grace_ms":1000,"mark":16777216,
              "inflight_max":65536,"ingress":"xdp"},
            "in_flight":0,"drained":[],"passed":[],
            "backends":[{"backend":"10.0.0.2:11211","group":1,"position":0,
              "pending":0,"issued":1,"completed":1,"expired":0,
              "requests":1,"responses":1,"redirected_away":0,"redirected_to":0,
              "untracked":0,"no_reply":0,"id_collisions":0,
              "unmatched_responses":0,"late_responses":0,"overload_passed":0,
              "overload_dropped":0,"overload_rejected":0,
              "p50_ns":112000,"p99_ns":112000}]}"#;
        let Reply::Status(status) = serde_json::from_str(older).unwrap() else {
            panic!("not a status");
        };
        assert_eq!(status.last_interval, None);
        assert_eq!(status.config_reload_success, None);
        let b = &status.backends[0];
        assert_eq!((b.p999_ns, b.latency_buckets.len()), (None, 0));
        assert_eq!(b.tail, BackendTail::default());
        assert_eq!(status.build, Default::default());
        assert!(!status.render().contains("agent:"));
    }

    #[test]
    fn bad_requests_are_rejected() {
        for bad in [
            r#"{"request":"set","threshold":"x"}"#,
            r#"{"request":"set","policy":"fastest"}"#,
            r#"{"request":"set","on_overload":"throttle"}"#,
            r#"{"request":"set","colour":"blue"}"#,
            r#"{"request":"set","hedge_after":"soon"}"#,
            r#"{"request":"drain"}"#,
            r#"{"request":"drain","backend":"10.0.0.1","drained":true}"#,
            r#"{"request":"reboot"}"#,
            "status",
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
        let e = serde_json::from_str::<Request>(r#"{"request":"set","policy":"fastest"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown variant `fastest`, expected one of `threshold`"),
            "{e}"
        );
    }

    #[test]
    fn a_change_is_checked_like_the_run_flags() {
        let settings = Settings::new("eth0", vec![vec![backend()]]);
        let change = TunablesPatch {
            max_pending: Some(5),
            on_overload: Some(OnOverload::Drop),
            ..Default::default()
        };
        let changed = change.applied_to(&settings).unwrap();
        assert_eq!(
            (changed.tunables.max_pending, changed.tunables.on_overload),
            (5, OnOverload::Drop)
        );
        assert_eq!(changed.tunables.threshold, settings.tunables.threshold);
        let zero = TunablesPatch {
            threshold: Some(0),
            ..Default::default()
        };
        assert!(zero.applied_to(&settings).is_err());
        let custom = Settings {
            descriptor: selector_common::Descriptor::custom(4, 4, 0, b"").unwrap(),
            ..settings
        };
        let reject = TunablesPatch {
            on_overload: Some(OnOverload::Reject),
            ..Default::default()
        };
        assert!(reject.applied_to(&custom).is_err());
        assert!(TunablesPatch::default().is_empty());
    }
}
