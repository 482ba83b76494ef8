//! Next-hop warm-up. A redirected request leaves through
//! `bpf_redirect_neigh`, which resolves the replica's neighbour itself but
//! holds the packet while it does; probing every backend at start (and now
//! and then) keeps those entries resolved, so no redirect waits for ARP.

use std::{
    collections::HashSet,
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    time::{Duration, Instant},
};

/// The discard port: a probe there reaches the backend host (resolving the
/// neighbour) without touching the service or the selector's counters.
const PROBE_PORT: u16 = 9;

/// Sends one empty datagram towards each backend host.
pub fn probe(backends: &[SocketAddrV4]) {
    let Ok(socket) = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)) else {
        return;
    };
    for b in backends {
        let _ = socket.send_to(&[], (*b.ip(), PROBE_PORT));
    }
}

/// IPv4 neighbours the kernel has resolved (from /proc/net/arp).
pub fn resolved() -> HashSet<Ipv4Addr> {
    let Ok(table) = std::fs::read_to_string("/proc/net/arp") else {
        return HashSet::new();
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let mut cols = line.split_whitespace();
            let ip = cols.next()?.parse().ok()?;
            let flags = u32::from_str_radix(cols.nth(1)?.trim_start_matches("0x"), 16).ok()?;
            // ATF_COM: the entry is complete.
            (flags & 0x2 != 0).then_some(ip)
        })
        .collect()
}

/// Probes and waits (up to `wait`) for on-link backends to resolve. Returns
/// the backends still unresolved; those behind a router never show up here
/// and resolve through their gateway instead.
pub fn warm_up(backends: &[SocketAddrV4], wait: Duration) -> Vec<SocketAddrV4> {
    probe(backends);
    let deadline = Instant::now() + wait;
    loop {
        let known = resolved();
        let missing: Vec<_> = backends
            .iter()
            .filter(|b| !known.contains(b.ip()))
            .copied()
            .collect();
        if missing.is_empty() || Instant::now() >= deadline {
            return missing;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
