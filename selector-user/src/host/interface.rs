//! What the host says about a network interface: its index, and its
//! addresses read with getifaddrs(3), and whether it can carry the
//! settings' groups.

use std::{
    ffi::CStr,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use anyhow::{Result, bail};

use crate::config::settings::{ReplyPath, Settings, is_ipv6_group};

/// The interface index of `iface` in this network namespace.
pub fn index(iface: &str) -> anyhow::Result<u32> {
    let name = std::ffi::CString::new(iface).map_err(|_| anyhow::anyhow!("bad interface name"))?;
    // SAFETY: valid NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        anyhow::bail!("interface '{iface}' not found");
    }
    Ok(index)
}

/// The name of interface `index` in this network namespace, if it exists.
pub fn name(index: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: a buffer of IF_NAMESIZE bytes, as if_indextoname needs.
    let name = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if name.is_null() {
        return None;
    }
    // SAFETY: on success the buffer holds a NUL-terminated name.
    Some(
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
    )
}

/// What `--ingress auto` picks for a device of `kind` (see
/// [`crate::host::neighbours::Netlink::link_kind`]). A virtual device (veth, the
/// interface of every container; bridge, vlan, macvlan, ...) has no native
/// XDP worth its cost: XDP there puts the device on an XDP receive path that
/// costs more than the program, so TC ingress. A device a hardware driver
/// made gets XDP in native (driver) mode, falling back to TC ingress at
/// attach if the driver has none.
pub fn auto_ingress(kind: Option<&str>) -> (ReplyPath, String) {
    match kind {
        Some(kind) => (
            ReplyPath::Tc,
            format!("auto: a {kind} device, no native XDP worth its cost"),
        ),
        None => (ReplyPath::Xdp, "auto: a driver's device, native XDP".into()),
    }
}

/// The IPv4 and IPv6 addresses of `iface` in this network namespace;
/// `None` if there is no such interface. getifaddrs lists every interface
/// (an AF_PACKET entry each) plus one entry per address.
pub fn addresses(iface: &str) -> io::Result<Option<Vec<IpAddr>>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list` on success; it is freed below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut found = false;
    let mut addrs = Vec::new();
    let mut entry = list;
    while !entry.is_null() {
        // SAFETY: a non-null entry of the list getifaddrs returned.
        let ifa = unsafe { &*entry };
        entry = ifa.ifa_next;
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        if ifa.ifa_name.is_null()
            || unsafe { CStr::from_ptr(ifa.ifa_name) }.to_bytes() != iface.as_bytes()
        {
            continue;
        }
        found = true;
        // SAFETY: ifa_addr, when set, points at a sockaddr whose family
        // says its layout: sockaddr_in for AF_INET, sockaddr_in6 for AF_INET6.
        let Some(addr) = (unsafe { ifa.ifa_addr.as_ref() }) else {
            continue;
        };
        match i32::from(addr.sa_family) {
            libc::AF_INET => {
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                addrs.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))));
            }
            libc::AF_INET6 => {
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                addrs.push(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)));
            }
            _ => {}
        }
    }
    // SAFETY: the list from getifaddrs, freed once, not used after.
    unsafe { libc::freeifaddrs(list) };
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
        assert_eq!(addresses("nosuch-if0").unwrap(), None);
        let lo = index("lo").unwrap();
        assert_eq!(name(lo).as_deref(), Some("lo"));
        assert_eq!(name(u32::MAX), None);
    }

    #[test]
    fn auto_ingress_is_tc_on_virtual_devices_and_native_xdp_on_drivers() {
        for kind in ["veth", "bridge", "vlan", "macvlan", "dummy"] {
            let (mode, why) = auto_ingress(Some(kind));
            assert_eq!(mode, ReplyPath::Tc);
            assert!(why.contains(kind), "{why}");
        }
        assert_eq!(auto_ingress(None).0, ReplyPath::Xdp);
    }
}
