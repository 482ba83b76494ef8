//! The stub resolver's nameservers as a replica group. Every process on a
//! host resolves names through the first `nameserver` of /etc/resolv.conf
//! (glibc asks the others only after a timeout, and sends A and AAAA queries
//! in parallel on one connected socket), so the nameservers are a replica
//! group whose primary is the first: `selector run --resolv-conf` steers
//! lookups away from a stalled first nameserver, for every program at once.
//!
//! A host with systemd-resolved has only its local stub in
//! /etc/resolv.conf: that is no group to steer, and
//! [`refuse_resolved_stub`] says which file has the nameservers instead.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
};

/// The DNS port nameservers listen on.
const DNS_PORT: u16 = 53;

/// systemd-resolved's local listeners: its stub (127.0.0.53) and its
/// proxy stub (127.0.0.54). Lookups sent there are forwarded by resolved.
const RESOLVED_STUBS: [IpAddr; 2] = [
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53)),
    IpAddr::V4(Ipv4Addr::new(127, 0, 0, 54)),
];

/// Where systemd-resolved lists the upstream nameservers it forwards to.
pub const RESOLVED_UPSTREAM: &str = "/run/systemd/resolve/resolv.conf";

/// An error when `servers` (read from `path`) are only systemd-resolved's
/// local stub: every lookup goes to resolved on this host, so there is no
/// replica to steer to. The message points at `upstream` (the file
/// resolved writes its upstream nameservers to), saying to use it when
/// `upstream_exists`.
pub fn refuse_resolved_stub(
    path: &Path,
    servers: &[SocketAddr],
    upstream: &Path,
    upstream_exists: bool,
) -> Result<(), String> {
    if servers.is_empty() || !servers.iter().all(|s| RESOLVED_STUBS.contains(&s.ip())) {
        return Ok(());
    }
    let stubs: Vec<String> = servers.iter().map(|s| s.ip().to_string()).collect();
    let problem = format!(
        "{} names only systemd-resolved's local stub ({}), which forwards every lookup itself: \
         there is no replica group to steer",
        path.display(),
        stubs.join(", ")
    );
    let advice = if upstream_exists && path != upstream {
        format!(
            "the nameservers resolved forwards to are in {0}: use --resolv-conf {0}",
            upstream.display()
        )
    } else {
        format!(
            "systemd-resolved lists the nameservers it forwards to in {}, which is not there \
             (is systemd-resolved running?): give --resolv-conf a file that names the real nameservers",
            upstream.display()
        )
    };
    Err(format!("{problem}; {advice}"))
}

/// The nameservers of a resolv.conf that form the group, in order, and
/// the lines naming nameservers it could not use. A group is one address
/// family, that of the first nameserver (the primary every lookup goes
/// to): nameservers of the other family, and lines that are not an
/// address (a link-local one with a `%zone`, junk), are skipped.
pub fn nameservers(text: &str) -> (Vec<SocketAddr>, Vec<String>) {
    let mut servers: Vec<SocketAddr> = Vec::new();
    let mut skipped = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() != Some("nameserver") {
            continue;
        }
        match words.next().map(str::parse::<IpAddr>) {
            Some(Ok(ip)) if servers.first().is_none_or(|s| s.is_ipv4() == ip.is_ipv4()) => {
                servers.push(SocketAddr::new(ip, DNS_PORT))
            }
            _ => skipped.push(line.trim().to_string()),
        }
    }
    (servers, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nameservers_in_order_with_ipv6_and_junk_skipped() {
        let text = "# generated\nsearch example.test\nnameserver 10.0.0.53\n\
                    nameserver fd00::53\n  nameserver   10.0.1.53  # second\n\
                    options timeout:1\nnameserver bogus\n";
        let (servers, skipped) = nameservers(text);
        assert_eq!(
            servers,
            vec![
                "10.0.0.53:53".parse().unwrap(),
                "10.0.1.53:53".parse().unwrap()
            ]
        );
        assert_eq!(skipped, vec!["nameserver fd00::53", "nameserver bogus"]);
        assert_eq!(nameservers("search x\n"), (vec![], vec![]));
    }

    /// What systemd-resolved writes to /run/systemd/resolve/stub-resolv.conf
    /// (the usual target of the /etc/resolv.conf symlink), and to
    /// /run/systemd/resolve/resolv.conf.
    const RESOLVED_STUB_FILE: &str = "# This is /run/systemd/resolve/stub-resolv.conf managed by man:systemd-resolved(8).\n\
        nameserver 127.0.0.53\noptions edns0 trust-ad\nsearch example.test\n";
    const RESOLVED_UPSTREAM_FILE: &str = "# This is /run/systemd/resolve/resolv.conf managed by man:systemd-resolved(8).\n\
        nameserver 10.0.0.53\nnameserver 10.0.1.53\nsearch example.test\n";

    #[test]
    fn only_resolveds_stub_is_refused_pointing_at_the_upstream_file() {
        let etc = Path::new("/etc/resolv.conf");
        let upstream = Path::new(RESOLVED_UPSTREAM);
        let (stub, _) = nameservers(RESOLVED_STUB_FILE);
        let e = refuse_resolved_stub(etc, &stub, upstream, true).unwrap_err();
        assert!(
            e.starts_with("/etc/resolv.conf names only systemd-resolved's local stub (127.0.0.53)"),
            "{e}"
        );
        assert!(
            e.ends_with("use --resolv-conf /run/systemd/resolve/resolv.conf"),
            "{e}"
        );
        // Without the upstream file: say where it would be, and what to do.
        let e = refuse_resolved_stub(etc, &stub, upstream, false).unwrap_err();
        assert!(
            e.contains("in /run/systemd/resolve/resolv.conf, which is not there"),
            "{e}"
        );
        assert!(e.contains("names the real nameservers"), "{e}");
        assert!(!e.contains("use --resolv-conf /run"), "{e}");
        // The proxy stub too.
        let (proxy, _) = nameservers("nameserver 127.0.0.54\n");
        assert!(refuse_resolved_stub(etc, &proxy, upstream, true).is_err());
        // resolved's upstream list is a group.
        let (servers, _) = nameservers(RESOLVED_UPSTREAM_FILE);
        assert_eq!(servers.len(), 2);
        assert_eq!(
            refuse_resolved_stub(upstream, &servers, upstream, true),
            Ok(())
        );
        // The stub beside a real nameserver: the real one is a replica.
        let (mixed, _) = nameservers("nameserver 127.0.0.53\nnameserver 10.0.0.53\n");
        assert_eq!(refuse_resolved_stub(etc, &mixed, upstream, true), Ok(()));
        // Another local resolver (dnsmasq, unbound on 127.0.0.1) is the
        // operator's choice.
        let (local, _) = nameservers("nameserver 127.0.0.1\n");
        assert_eq!(refuse_resolved_stub(etc, &local, upstream, true), Ok(()));
    }

    #[test]
    fn an_ipv6_first_nameserver_makes_an_ipv6_group() {
        let text = "nameserver fd00::53\nnameserver 10.0.0.53\nnameserver fd00::54\n\
                    nameserver fe80::1%eth0\n";
        let (servers, skipped) = nameservers(text);
        assert_eq!(
            servers,
            vec![
                "[fd00::53]:53".parse().unwrap(),
                "[fd00::54]:53".parse().unwrap()
            ]
        );
        assert_eq!(
            skipped,
            vec!["nameserver 10.0.0.53", "nameserver fe80::1%eth0"]
        );
    }
}
