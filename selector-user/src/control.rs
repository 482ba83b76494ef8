//! Run-time control of a running agent. The agent listens on an abstract
//! Unix socket named after its interface; abstract names belong to the
//! network namespace, so each namespace's `eth0` has its own agent, and the
//! name disappears with the agent. One request line, one reply.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::SocketAddrV4,
    os::{linux::net::SocketAddrExt as _, unix::net::SocketAddr},
    time::Duration,
};

use anyhow::{Context as _, Result, anyhow, bail};
use selector_common::Policy;

use crate::{Selector, telemetry};

/// The abstract socket name of the agent on `iface`.
pub fn address(iface: &str) -> Result<SocketAddr> {
    Ok(SocketAddr::from_abstract_name(format!("selector/{iface}"))?)
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Totals, pending counts and settings.
    Status,
    /// Change policy and/or threshold.
    Set {
        policy: Option<Policy>,
        threshold: Option<u32>,
    },
    /// Drain (never choose) or undrain a backend.
    Drain {
        backend: SocketAddrV4,
        drained: bool,
    },
}

impl Request {
    /// The wire form: one line.
    pub fn encode(&self) -> String {
        match self {
            Request::Status => "status".into(),
            Request::Set { policy, threshold } => {
                let mut line = String::from("set");
                if let Some(p) = policy {
                    line += &format!(" policy={}", p.name());
                }
                if let Some(t) = threshold {
                    line += &format!(" threshold={t}");
                }
                line
            }
            Request::Drain { backend, drained } => {
                format!("{} {backend}", if *drained { "drain" } else { "undrain" })
            }
        }
    }

    pub fn decode(line: &str) -> Result<Self> {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("status") => Ok(Request::Status),
            Some("set") => {
                let (mut policy, mut threshold) = (None, None);
                for w in words {
                    match w.split_once('=') {
                        Some(("policy", v)) => {
                            policy = Some(
                                Policy::from_name(v)
                                    .ok_or_else(|| anyhow!("unknown policy '{v}'"))?,
                            )
                        }
                        Some(("threshold", v)) => {
                            threshold = Some(v.parse().map_err(|_| anyhow!("bad threshold '{v}'"))?)
                        }
                        _ => bail!("unknown setting '{w}'"),
                    }
                }
                if policy.is_none() && threshold.is_none() {
                    bail!("nothing to set");
                }
                Ok(Request::Set { policy, threshold })
            }
            Some(verb @ ("drain" | "undrain")) => {
                let addr = words
                    .next()
                    .ok_or_else(|| anyhow!("{verb} needs a backend"))?;
                let backend = addr
                    .parse()
                    .map_err(|_| anyhow!("'{addr}' is not an IPv4 address:port"))?;
                Ok(Request::Drain {
                    backend,
                    drained: verb == "drain",
                })
            }
            _ => bail!("unknown request '{line}'"),
        }
    }
}

/// Applies a request to the running selector; the reply text.
pub fn apply(selector: &mut Selector, request: &Request) -> Result<String> {
    match request {
        Request::Status => {
            let s = &selector.settings;
            let mut out = format!(
                "selector on {}: policy {} threshold {}, timeout {} ms, drained: {}\n",
                s.iface,
                s.policy.name(),
                s.threshold,
                s.timeout.as_millis(),
                match selector.drained()?.as_slice() {
                    [] => "none".to_string(),
                    drained => {
                        let names: Vec<String> = drained.iter().map(|a| a.to_string()).collect();
                        names.join(", ")
                    }
                }
            );
            let now = selector.snapshot()?;
            let totals = telemetry::totals(&selector.backends, &now);
            out += &telemetry::render_summary(&totals);
            out += &telemetry::render_footer(
                now.inflight,
                &totals,
                &telemetry::passed_counts(&now.passed),
            );
            Ok(out)
        }
        Request::Set { policy, threshold } => {
            let policy = policy.unwrap_or(selector.settings.policy);
            let threshold = threshold.unwrap_or(selector.settings.threshold);
            if threshold == 0 && policy != Policy::Observe {
                bail!("threshold must be at least 1");
            }
            selector.write_config(policy, threshold)?;
            Ok(format!(
                "policy {} threshold {}\n",
                policy.name(),
                threshold
            ))
        }
        Request::Drain { backend, drained } => {
            let id = selector
                .backend_index(*backend)
                .ok_or_else(|| anyhow!("{backend} is not a configured backend"))?;
            selector.set_drained(id, *drained)?;
            Ok(format!(
                "{backend} {}\n",
                if *drained { "drained" } else { "active" }
            ))
        }
    }
}

/// Sends one request to the agent on `iface` (in this network namespace)
/// and returns its reply; an error reply becomes an error.
pub fn send(iface: &str, request: &Request) -> Result<String> {
    let stream = std::os::unix::net::UnixStream::connect_addr(&address(iface)?)
        .with_context(|| format!("no selector is running on {iface} in this network namespace"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    (&stream).write_all(format!("{}\n", request.encode()).as_bytes())?;
    let mut reply = String::new();
    for line in BufReader::new(&stream).lines() {
        reply += &line?;
        reply.push('\n');
    }
    match reply.strip_prefix("error: ") {
        Some(e) => bail!("{}", e.trim_end()),
        None => Ok(reply),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for r in [
            Request::Status,
            Request::Set {
                policy: Some(Policy::Absolute),
                threshold: Some(12),
            },
            Request::Set {
                policy: None,
                threshold: Some(3),
            },
            Request::Drain {
                backend: "10.0.0.2:11211".parse().unwrap(),
                drained: true,
            },
            Request::Drain {
                backend: "10.0.0.2:11211".parse().unwrap(),
                drained: false,
            },
        ] {
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }
    }

    #[test]
    fn bad_requests_are_rejected() {
        assert!(Request::decode("set").is_err());
        assert!(Request::decode("set threshold=x").is_err());
        assert!(Request::decode("set policy=fastest").is_err());
        assert!(Request::decode("set colour=blue").is_err());
        assert!(Request::decode("drain").is_err());
        assert!(Request::decode("drain 10.0.0.1").is_err());
        assert!(Request::decode("reboot").is_err());
    }
}
