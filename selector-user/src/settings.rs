//! Validated configuration. Everything is checked here, before anything is
//! loaded or attached, so a bad flag never leaves a half-configured host.

use std::{collections::HashMap, fmt, net::SocketAddrV4, time::Duration};

use anyhow::{Result, bail};
use selector_common::{Descriptor, MAX_GROUP_MEMBERS, MAX_GROUPS, OnOverload, Policy, backend_id};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IngressMode {
    /// XDP on the interface (default).
    Xdp,
    /// TC ingress, for devices where XDP does not fit.
    Tc,
}

/// What the agent runs with.
#[derive(Clone, Debug)]
pub struct Settings {
    pub iface: String,
    /// Replica groups, members in preference order.
    pub groups: Vec<Vec<SocketAddrV4>>,
    pub policy: Policy,
    pub threshold: u32,
    pub descriptor: Descriptor,
    /// In-flight entries older than this are expired by the sweep.
    pub timeout: Duration,
    pub inflight_max: u32,
    pub ingress: IngressMode,
    /// Pending requests per backend at which it counts as full (0: no bound).
    pub max_pending: u32,
    /// Pending requests per client socket at which it is full (0: no bound).
    pub max_pending_client: u32,
    /// What a read gets when everything it may go to is full.
    pub on_overload: OnOverload,
    /// The skb mark bit of the selector's own re-sent packets.
    pub mark: u32,
    /// How long a redirected read's late reply is still rewritten after its
    /// request completed or expired.
    pub grace: Duration,
}

/// One backend as the maps will hold it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendPlan {
    /// Backend id: `group * 8 + position`.
    pub index: u32,
    pub addr: SocketAddrV4,
    pub group: u32,
}

impl fmt::Display for BackendPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.addr)
    }
}

impl Settings {
    /// Checks everything and numbers the backends (group order, member order).
    pub fn plan(&self) -> Result<Vec<BackendPlan>> {
        if self.iface.is_empty() {
            bail!("--iface is required");
        }
        if self.groups.is_empty() {
            bail!("at least one --group is required");
        }
        if self.groups.len() > MAX_GROUPS as usize {
            bail!(
                "at most {MAX_GROUPS} groups are supported, got {}",
                self.groups.len()
            );
        }
        if self.threshold == 0 && self.policy != Policy::Observe {
            bail!("--threshold must be at least 1");
        }
        if let Err(e) = self.descriptor.validate() {
            bail!("bad protocol descriptor: {e}");
        }
        if self.timeout.is_zero() {
            bail!("--timeout must be greater than 0");
        }
        if self.inflight_max == 0 {
            bail!("--inflight-max must be at least 1");
        }
        let mut seen: HashMap<SocketAddrV4, usize> = HashMap::new();
        let mut plan = Vec::new();
        for (g, members) in self.groups.iter().enumerate() {
            if members.is_empty() {
                bail!("group {} is empty", g + 1);
            }
            if members.len() > MAX_GROUP_MEMBERS {
                bail!(
                    "group {} has {} members; at most {MAX_GROUP_MEMBERS} are supported",
                    g + 1,
                    members.len()
                );
            }
            for (position, addr) in members.iter().enumerate() {
                if addr.port() == 0 {
                    bail!("backend {addr} has port 0");
                }
                if addr.ip().is_unspecified()
                    || addr.ip().is_broadcast()
                    || addr.ip().is_multicast()
                {
                    bail!("backend {addr} is not a unicast address");
                }
                if let Some(other) = seen.insert(*addr, g) {
                    if other == g {
                        bail!("backend {addr} appears twice in group {}", g + 1);
                    }
                    bail!(
                        "backend {addr} is in group {} and group {}",
                        other + 1,
                        g + 1
                    );
                }
                plan.push(BackendPlan {
                    index: backend_id(g as u32, position),
                    addr: *addr,
                    group: g as u32,
                });
            }
        }
        Ok(plan)
    }
}

/// Parses `A:P,B:P,...`.
pub fn parse_group(s: &str) -> Result<Vec<SocketAddrV4>, String> {
    s.split(',')
        .map(|m| {
            let m = m.trim();
            m.parse::<SocketAddrV4>()
                .map_err(|_| format!("'{m}' is not an IPv4 address:port"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(groups: &[&str]) -> Settings {
        Settings {
            iface: "eth0".into(),
            groups: groups.iter().map(|g| parse_group(g).unwrap()).collect(),
            policy: Policy::Threshold,
            threshold: 1,
            descriptor: Descriptor::memcached(),
            timeout: Duration::from_millis(500),
            inflight_max: 1024,
            ingress: IngressMode::Xdp,
            max_pending: 0,
            max_pending_client: 0,
            on_overload: selector_common::OnOverload::Pass,
            mark: selector_common::MARK_REDIRECTED,
            grace: std::time::Duration::from_secs(1),
        }
    }

    fn err(s: &Settings) -> String {
        s.plan().unwrap_err().to_string()
    }

    #[test]
    fn numbers_backends_in_group_order() {
        let p = settings(&["10.0.0.1:1,10.0.0.2:1", "10.0.0.3:1"])
            .plan()
            .unwrap();
        assert_eq!(p.len(), 3);
        assert_eq!((p[1].index, p[1].group), (1, 0));
        assert_eq!((p[2].index, p[2].group), (8, 1));
        assert_eq!(p[1].addr, "10.0.0.2:1".parse().unwrap());
    }

    #[test]
    fn rejects_duplicates_and_shared_backends() {
        assert!(err(&settings(&["10.0.0.1:1,10.0.0.1:1"])).contains("twice"));
        assert!(err(&settings(&["10.0.0.1:1", "10.0.0.1:1"])).contains("group 1 and group 2"));
        // Same address, other port: a different backend.
        assert!(settings(&["10.0.0.1:1,10.0.0.1:2"]).plan().is_ok());
    }

    #[test]
    fn rejects_oversized_groups() {
        let nine: Vec<String> = (1..=9).map(|i| format!("10.0.0.{i}:1")).collect();
        assert!(err(&settings(&[&nine.join(",")])).contains("at most 8"));
        let eight = nine[..8].join(",");
        assert!(settings(&[&eight]).plan().is_ok());
    }

    #[test]
    fn rejects_missing_and_bad_values() {
        let mut s = settings(&["10.0.0.1:1"]);
        s.iface.clear();
        assert!(err(&s).contains("--iface"));
        assert!(err(&settings(&[])).contains("--group"));
        let mut s = settings(&["10.0.0.1:1"]);
        s.threshold = 0;
        assert!(err(&s).contains("--threshold"));
        s.policy = Policy::Observe;
        assert!(s.plan().is_ok());
        let mut s = settings(&["10.0.0.1:1"]);
        s.timeout = Duration::ZERO;
        assert!(err(&s).contains("--timeout"));
        assert!(err(&settings(&["10.0.0.1:0"])).contains("port 0"));
        assert!(err(&settings(&["0.0.0.0:1"])).contains("unicast"));
        let mut s = settings(&["10.0.0.1:1"]);
        s.descriptor.id_len = 0;
        assert!(err(&s).contains("descriptor"));
    }

    #[test]
    fn parse_group_reports_the_bad_member() {
        assert_eq!(parse_group("10.0.0.1:1, 10.0.0.2:2").unwrap().len(), 2);
        assert!(
            parse_group("10.0.0.1:1,nope")
                .unwrap_err()
                .contains("'nope'")
        );
        assert!(parse_group("10.0.0.1").is_err());
    }
}
