//! The kernel's announcements of neighbour and route changes (rtnetlink's
//! multicast groups), so that the agent re-reads the backends' next hops
//! when they change instead of dumping the neighbour table on a short
//! timer. A burst of announcements is read at once and reported as one
//! change; announcements lost to a full socket buffer (ENOBUFS) are
//! reported as a change of everything.

use std::io::ErrorKind;

use anyhow::{Context as _, Result};
use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_ROUTE};
use tokio::io::{Interest, unix::AsyncFd};

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
    buf: Vec<u8>,
}

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
                    Ok(n) => classify(&self.buf[..n], self.ifindex, &mut changes),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        ready.clear_ready();
                        break;
                    }
                    // The socket buffer overflowed: some announcements are
                    // lost, so anything may have changed.
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                        changes = Changes::EVERYTHING;
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

/// Adds what the announcements in `datagram` are about to `changes`.
fn classify(datagram: &[u8], ifindex: u32, changes: &mut Changes) {
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
                RouteNetlinkMessage::NewNeighbour(n) | RouteNetlinkMessage::DelNeighbour(n)
                    if n.header.ifindex == ifindex =>
                {
                    changes.neighbours = true
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
}

#[cfg(test)]
mod tests {
    use netlink_packet_core::NetlinkHeader;
    use netlink_packet_route::{neighbour::NeighbourMessage, route::RouteMessage};

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
            classify(&datagram(messages), 7, &mut c);
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
        classify(&[1, 2, 3], 7, &mut c);
        assert_eq!(c, Changes::EVERYTHING, "junk: everything re-read");
    }
}
