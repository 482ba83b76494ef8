//! The kernel's announcements of neighbour and route changes (rtnetlink's
//! multicast groups), so that the agent re-reads the backends' next hops
//! when they change instead of dumping the neighbour table on a short
//! timer. A burst of announcements is read at once and reported as one
//! change; announcements lost to a full socket buffer (ENOBUFS) are
//! reported as a change of everything.
//!
//! A neighbour's announcement is a change only if what a refresh reads of
//! it changed since its last one: its usable link-layer address, or none
//! (`Neighbour::usable_address`). The kernel announces every state a
//! managed entry passes through (reachable, stale, delay, probe, and back;
//! an unreachable one incomplete, failed, and again), each of which cost
//! a refresh.

use std::{collections::HashMap, io::ErrorKind, net::IpAddr};

use anyhow::{Context as _, Result};
use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_ROUTE};
use tokio::io::{Interest, unix::AsyncFd};

use crate::host::neighbours::neighbour_entry;

/// What the announcements read at once were about.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// A neighbour entry on the watched interface was added, changed or
    /// deleted.
    pub neighbours: bool,
    /// A route (IPv4 or IPv6, any table) was added or deleted.
    pub routes: bool,
}

impl Changes {
    const EVERYTHING: Changes = Changes {
        neighbours: true,
        routes: true,
    };

    fn any(self) -> bool {
        self.neighbours || self.routes
    }
}

/// A socket subscribed to neighbour and route announcements, in the
/// calling thread's network namespace.
pub struct RouteEvents {
    socket: AsyncFd<Socket>,
    /// Neighbour announcements of other interfaces are ignored.
    ifindex: u32,
    /// What each neighbour's last announcement said (`Announced`).
    announced: Announced,
    buf: Vec<u8>,
}

/// Each neighbour's usable link-layer address (or none) as last announced:
/// a neighbour not in it may have anything.
type Announced = HashMap<IpAddr, Option<Vec<u8>>>;

impl RouteEvents {
    /// Subscribes to the announcements of neighbours on `ifindex` and of
    /// routes. Needs a tokio runtime.
    pub fn subscribe(ifindex: u32) -> Result<Self> {
        let groups = libc::RTMGRP_NEIGH | libc::RTMGRP_IPV4_ROUTE | libc::RTMGRP_IPV6_ROUTE;
        let mut socket = Socket::new(NETLINK_ROUTE).context("opening a netlink socket")?;
        socket
            .bind(&NetlinkAddr::new(0, groups as u32))
            .context("subscribing to neighbour and route announcements")?;
        socket.set_non_blocking(true)?;
        // SAFETY: the socket's descriptor is open and owned by the socket,
        // which the AsyncFd owns for its whole life.
        let socket = unsafe { AsyncFd::register_with_interest(socket, Interest::READABLE) }
            .map_err(std::io::Error::from)?;
        Ok(Self {
            socket,
            ifindex,
            announced: HashMap::new(),
            buf: Vec::with_capacity(1 << 16),
        })
    }

    /// Waits for announcements that concern the next hops, reads every
    /// one there is, and says what changed. Cancel-safe: nothing is read
    /// before readiness, and what is read is reported.
    pub async fn changed(&mut self) -> Changes {
        loop {
            let Ok(mut ready) = self.socket.readable_mut().await else {
                return Changes::EVERYTHING;
            };
            let mut changes = Changes::default();
            loop {
                self.buf.clear();
                match ready.get_inner_mut().recv(&mut self.buf, 0) {
                    Ok(n) => classify(
                        &self.buf[..n],
                        self.ifindex,
                        &mut self.announced,
                        &mut changes,
                    ),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        ready.clear_ready();
                        break;
                    }
                    // The socket buffer overflowed: some announcements are
                    // lost, so anything may have changed.
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                        changes = Changes::EVERYTHING;
                        self.announced.clear();
                    }
                    Err(_) => {
                        ready.clear_ready();
                        return Changes::EVERYTHING;
                    }
                }
            }
            if changes.any() {
                return changes;
            }
        }
    }
}

/// Adds what the announcements in `datagram` are about to `changes`,
/// keeping each neighbour's in `announced`.
fn classify(datagram: &[u8], ifindex: u32, announced: &mut Announced, changes: &mut Changes) {
    let mut at = 0;
    while at < datagram.len() {
        let Ok(message) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&datagram[at..])
        else {
            // Undecodable: re-read everything rather than miss a change.
            *changes = Changes::EVERYTHING;
            return;
        };
        let len = message.header.length as usize;
        if let NetlinkPayload::InnerMessage(m) = message.payload {
            match m {
                RouteNetlinkMessage::NewNeighbour(n) if n.header.ifindex == ifindex => {
                    match neighbour_entry(n) {
                        Some((addr, entry)) => {
                            let now = entry.usable_address().map(<[u8]>::to_vec);
                            if announced.get(&addr) != Some(&now) {
                                changes.neighbours = true;
                                announced.insert(addr, now);
                            }
                        }
                        None => changes.neighbours = true,
                    }
                }
                RouteNetlinkMessage::DelNeighbour(n) if n.header.ifindex == ifindex => {
                    // Gone is as good as unresolved to a refresh.
                    match neighbour_entry(n) {
                        Some((addr, _)) => {
                            if announced.insert(addr, None) != Some(None) {
                                changes.neighbours = true;
                            }
                        }
                        None => changes.neighbours = true,
                    }
                }
                RouteNetlinkMessage::NewRoute(_) | RouteNetlinkMessage::DelRoute(_) => {
                    changes.routes = true
                }
                _ => {}
            }
        }
        if len == 0 {
            break;
        }
        at += len;
    }
    // Bounded: forgetting only makes the next announcements changes.
    if announced.len() > MAX_ANNOUNCED {
        announced.clear();
    }
}

/// Neighbours remembered at most (the kernel's own table holds 1024 per
/// family by default, gc_thresh3).
const MAX_ANNOUNCED: usize = 4096;

#[cfg(test)]
mod tests {
    use netlink_packet_core::NetlinkHeader;
    use netlink_packet_route::{
        neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState},
        route::RouteMessage,
    };

    use super::*;

    fn datagram(messages: Vec<RouteNetlinkMessage>) -> Vec<u8> {
        let mut out = Vec::new();
        for m in messages {
            let mut packet =
                NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::InnerMessage(m));
            packet.finalize();
            let mut buf = vec![0; packet.buffer_len()];
            packet.serialize(&mut buf);
            out.extend(buf);
        }
        out
    }

    fn neighbour_on(ifindex: u32) -> NeighbourMessage {
        let mut n = NeighbourMessage::default();
        n.header.ifindex = ifindex;
        n
    }

    #[test]
    fn neighbours_of_the_interface_and_routes_are_changes() {
        let classified = |messages| {
            let mut c = Changes::default();
            classify(&datagram(messages), 7, &mut Announced::new(), &mut c);
            c
        };
        assert_eq!(
            classified(vec![RouteNetlinkMessage::NewNeighbour(neighbour_on(3))]),
            Changes::default(),
            "another interface's neighbour"
        );
        assert_eq!(
            classified(vec![
                RouteNetlinkMessage::NewNeighbour(neighbour_on(3)),
                RouteNetlinkMessage::DelNeighbour(neighbour_on(7)),
            ]),
            Changes {
                neighbours: true,
                routes: false
            }
        );
        assert_eq!(
            classified(vec![RouteNetlinkMessage::NewRoute(RouteMessage::default())]),
            Changes {
                neighbours: false,
                routes: true
            }
        );
        let mut c = Changes::default();
        classify(&[1, 2, 3], 7, &mut Announced::new(), &mut c);
        assert_eq!(c, Changes::EVERYTHING, "junk: everything re-read");
    }

    /// The neighbour 10.0.0.2 on interface 7 in `state`, with `mac`.
    fn neighbour(state: NeighbourState, mac: Option<u8>) -> NeighbourMessage {
        let mut n = neighbour_on(7);
        n.header.family = netlink_packet_route::AddressFamily::Inet;
        n.header.state = state;
        n.attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(
                [10, 0, 0, 2].into(),
            )));
        if let Some(m) = mac {
            n.attributes
                .push(NeighbourAttribute::LinkLayerAddress(vec![2, 0, 0, 0, 0, m]));
        }
        n
    }

    #[test]
    fn a_neighbour_is_a_change_only_when_its_usable_address_changes() {
        use NeighbourState as S;
        let mut announced = Announced::new();
        let mut changed = |m: RouteNetlinkMessage| {
            let mut c = Changes::default();
            classify(&datagram(vec![m]), 7, &mut announced, &mut c);
            c.neighbours
        };
        let new = |state: NeighbourState, mac: Option<u8>| {
            RouteNetlinkMessage::NewNeighbour(neighbour(state, mac))
        };
        // The first word of a neighbour: it may have been anything.
        assert!(changed(new(S::Incomplete, None)));
        // Unreachable, announced again and again: nothing to re-read.
        assert!(!changed(new(S::Failed, None)));
        assert!(!changed(new(S::Incomplete, None)));
        assert!(changed(new(S::Reachable, Some(1))));
        for state in [S::Stale, S::Delay, S::Probe, S::Reachable] {
            assert!(!changed(new(state, Some(1))), "{state:?}");
        }
        assert!(changed(new(S::Reachable, Some(2))), "a new address");
        assert!(changed(new(S::Failed, Some(2))), "no longer usable");
        // Deleted while unusable: still unusable.
        assert!(!changed(RouteNetlinkMessage::DelNeighbour(neighbour(
            S::Failed,
            None
        ))));
        assert!(changed(new(S::Reachable, Some(2))));
        assert!(changed(RouteNetlinkMessage::DelNeighbour(neighbour(
            S::Reachable,
            Some(2)
        ))));
    }
}
