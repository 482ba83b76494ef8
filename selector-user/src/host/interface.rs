//! What the host says about a network interface: its index, and its
//! addresses (getifaddrs(3), through nix), and whether it can carry the
//! settings' groups.

use std::{io, net::IpAddr};

use anyhow::{Result, bail};
use nix::net::if_;

use crate::config::settings::{ReplyPath, Settings, is_ipv6_group};

/// The interface index of `iface` in this network namespace.
pub fn index(iface: &str) -> anyhow::Result<u32> {
    if_::if_nametoindex(iface).map_err(|_| anyhow::anyhow!("interface '{iface}' not found"))
}

/// The name of interface `index` in this network namespace, if it exists.
pub fn name(index: u32) -> Option<String> {
    if_::if_nameindex()
        .ok()?
        .iter()
        .find(|i| i.index() == index)
        .map(|i| i.name().to_string_lossy().into_owned())
}

/// What `--ingress auto` picks for a device of `kind` (see
/// [`crate::host::neighbours::Netlink::link_kind`]). A virtual device (veth, the
/// interface of every container; bridge, vlan, macvlan, ...) has no native
/// XDP worth its cost: XDP there puts the device on an XDP receive path that
/// costs more than the program, so TC ingress. A device a hardware driver
/// made gets XDP in native (driver) mode, falling back to TC ingress at
/// attach if the driver has none; but not where the request path is a
/// legacy tc filter (`legacy_tc`): a filter outlives a killed agent and an XDP
/// link does not, and a request moved with no reply path left to rewrite
/// its reply is lost, so the reply path is a filter too.
pub fn auto_ingress(kind: Option<&str>, legacy_tc: bool) -> (ReplyPath, String) {
    match (kind, legacy_tc) {
        (Some(kind), _) => (
            ReplyPath::Tc,
            format!("auto: a {kind} device, no native XDP worth its cost"),
        ),
        (None, true) => (
            ReplyPath::Tc,
            "auto: legacy tc filters outlive a crash, an XDP link would not".into(),
        ),
        (None, false) => (ReplyPath::Xdp, "auto: a driver's device, native XDP".into()),
    }
}

/// The IPv4 and IPv6 addresses of `iface` in this network namespace;
/// `None` if there is no such interface. getifaddrs lists every interface
/// (an AF_PACKET entry each) plus one entry per address.
pub fn addresses(iface: &str) -> io::Result<Option<Vec<IpAddr>>> {
    let mut found = false;
    let mut addrs = Vec::new();
    for entry in nix::ifaddrs::getifaddrs()?.filter(|e| e.interface_name == iface) {
        found = true;
        let Some(addr) = entry.address else {
            continue;
        };
        if let Some(v4) = addr.as_sockaddr_in() {
            addrs.push(IpAddr::V4(v4.ip()));
        } else if let Some(v6) = addr.as_sockaddr_in6() {
            addrs.push(IpAddr::V6(v6.ip()));
        }
    }
    Ok(found.then_some(addrs))
}

/// Checks the host side: the interface exists in this network namespace
/// and has an address of each family the groups use (a redirect leaves
/// from the interface's own address).
pub fn check(settings: &Settings) -> Result<()> {
    let Some(addrs) = addresses(&settings.iface)? else {
        bail!("interface '{}' not found", settings.iface)
    };
    let wants_v6 = settings.groups.iter().any(|m| is_ipv6_group(m));
    let wants_v4 = settings.groups.iter().any(|m| !is_ipv6_group(m)) || !wants_v6;
    if wants_v4 && !addrs.iter().any(IpAddr::is_ipv4) {
        bail!("interface '{}' has no IPv4 address", settings.iface)
    }
    if wants_v6 && !addrs.iter().any(IpAddr::is_ipv6) {
        bail!(
            "interface '{}' has no IPv6 address (an IPv6 group needs one)",
            settings.iface
        )
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_checks_name_the_problem() {
        let s = Settings::new("nosuch0", vec![]);
        assert_eq!(
            check(&s).unwrap_err().to_string(),
            "interface 'nosuch0' not found"
        );
    }

    #[test]
    fn loopback_exists_and_a_made_up_name_does_not() {
        // `lo` exists in every namespace (its address only once it is up).
        assert!(addresses("lo").unwrap().is_some());
        // The test runs in the host's namespace, whose loopback is up.
        let lo = addresses("lo").unwrap().unwrap();
        assert!(lo.contains(&IpAddr::from([127, 0, 0, 1])), "{lo:?}");
        assert_eq!(addresses("nosuch-if0").unwrap(), None);
        let lo = index("lo").unwrap();
        assert_eq!(name(lo).as_deref(), Some("lo"));
        assert_eq!(name(u32::MAX), None);
    }

    #[test]
    fn auto_ingress_is_tc_on_virtual_devices_and_native_xdp_on_drivers() {
        for kind in ["veth", "bridge", "vlan", "macvlan", "dummy"] {
            for legacy_tc in [false, true] {
                let (mode, why) = auto_ingress(Some(kind), legacy_tc);
                assert_eq!(mode, ReplyPath::Tc);
                assert!(why.contains(kind), "{why}");
            }
        }
        assert_eq!(auto_ingress(None, false).0, ReplyPath::Xdp);
    }

    /// Legacy tc filters stay attached after a SIGKILL; an XDP link goes
    /// with the process. The reply path must stay with the request path.
    #[test]
    fn auto_ingress_beside_legacy_tc_filters_is_a_filter_too() {
        let (mode, why) = auto_ingress(None, true);
        assert_eq!(mode, ReplyPath::Tc, "{why}");
    }
}
