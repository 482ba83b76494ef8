//! Keeping the backends' next hops resolved, through rtnetlink and without
//! traffic of the agent's own. A redirected request leaves through
//! `bpf_redirect_neigh`, which resolves the next hop itself but holds the
//! packet while it does. So at start the agent looks up each backend's
//! route and marks its next hop's neighbour entry *managed* (NTF_EXT_MANAGED,
//! Linux 5.16): the kernel resolves it at once and keeps it resolved, with
//! its own ARP probes, for as long as the entry is managed. Entries the
//! administrator made permanent (or that need no resolution) are left alone.
//! [`ManagedNeighbours::release`] deletes the entries the agent marked when
//! it detaches; the kernel re-resolves them on demand as it always does.
//! A pinned agent leaves them for the programs that steer on, and an
//! agent killed outright cannot delete them: `selector detach` does
//! ([`release_managed`]), finding them by the agent's protocol tag.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkHeader,
    NetlinkMessage, NetlinkPayload,
};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    link::{LinkAttribute, LinkInfo, LinkMessage, LinkXdp},
    neighbour::{
        NeighbourAddress, NeighbourAttribute, NeighbourExtFlags, NeighbourMessage, NeighbourState,
    },
    route::{RouteAddress, RouteAttribute, RouteMessage, RouteProtocol},
};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr, protocols::NETLINK_ROUTE};

/// Where packets to a backend go next: the interface and the address whose
/// link-layer address they are sent to (the backend itself when on-link,
/// else its gateway).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NextHop {
    pub ifindex: u32,
    pub via: IpAddr,
}

/// The protocol tag (NDA_PROTOCOL, Linux 5.2) of the entries the agent
/// marks managed: a value no routing daemon in iproute2's rt_protocols uses.
pub const NEIGHBOUR_PROTOCOL: u8 = 0xf5;

/// A neighbour entry as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Neighbour {
    pub state: NeighbourState,
    pub lladdr: Option<Vec<u8>>,
    pub managed: bool,
    /// Tagged by an agent ([`NEIGHBOUR_PROTOCOL`]).
    pub ours: bool,
}

impl Neighbour {
    /// The link-layer address a next hop may be written with: this
    /// entry's, if it is resolved (all a refresh of the next hops reads).
    pub fn usable_address(&self) -> Option<&[u8]> {
        self.lladdr.as_deref().filter(|_| self.is_resolved())
    }

    /// Has a usable link-layer address now.
    pub fn is_resolved(&self) -> bool {
        self.lladdr.is_some()
            && matches!(
                self.state,
                NeighbourState::Reachable
                    | NeighbourState::Stale
                    | NeighbourState::Delay
                    | NeighbourState::Probe
                    | NeighbourState::Permanent
                    | NeighbourState::Noarp
            )
    }

    /// Set by the administrator (or needing no resolution): not ours to manage.
    fn is_static(&self) -> bool {
        matches!(
            self.state,
            NeighbourState::Permanent | NeighbourState::Noarp
        )
    }
}

/// A NETLINK_ROUTE socket in the calling thread's network namespace.
pub struct Netlink {
    socket: Socket,
    sequence: u32,
}

impl Netlink {
    pub fn open() -> Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE).context("opening a netlink socket")?;
        socket.bind_auto()?;
        socket.connect(&NetlinkAddr::new(0, 0))?;
        Ok(Self {
            socket,
            sequence: 0,
        })
    }

    /// Sends one request and collects the replies until its ack or the end
    /// of the dump (or the answer, for a plain get).
    fn request(
        &mut self,
        message: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<Vec<RouteNetlinkMessage>> {
        self.sequence = self.sequence.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.sequence;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(message));
        packet.finalize();
        let mut buf = vec![0; packet.buffer_len()];
        packet.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        let wants_ack = flags & (NLM_F_ACK | NLM_F_DUMP) != 0;
        let mut replies = Vec::new();
        let mut received = Vec::with_capacity(1 << 16);
        loop {
            received.clear();
            let n = self.socket.recv(&mut received, 0)?;
            let mut at = 0;
            while at < n {
                let message = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&received[at..n])
                    .context("decoding a netlink reply")?;
                let len = message.header.length as usize;
                if message.header.sequence_number == self.sequence {
                    match message.payload {
                        NetlinkPayload::Error(e) if e.code.is_some() => {
                            return Err(e.to_io().into());
                        }
                        NetlinkPayload::Error(_) | NetlinkPayload::Done(_) => return Ok(replies),
                        NetlinkPayload::InnerMessage(m) => {
                            replies.push(m);
                            if !wants_ack {
                                return Ok(replies);
                            }
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
    }

    /// The route the kernel would use for `dst` (`ip route get`), IPv4 or
    /// IPv6.
    pub fn next_hop(&mut self, dst: IpAddr) -> Result<NextHop> {
        let mut query = RouteMessage::default();
        let (family, prefix, destination) = match dst {
            IpAddr::V4(a) => (AddressFamily::Inet, 32, RouteAddress::Inet(a)),
            IpAddr::V6(a) => (AddressFamily::Inet6, 128, RouteAddress::Inet6(a)),
        };
        query.header.address_family = family;
        query.header.destination_prefix_length = prefix;
        query
            .attributes
            .push(RouteAttribute::Destination(destination));
        let replies = self
            .request(RouteNetlinkMessage::GetRoute(query), 0)
            .with_context(|| format!("no route to {dst}"))?;
        let Some(RouteNetlinkMessage::NewRoute(route)) = replies.into_iter().next() else {
            bail!("no route to {dst}");
        };
        let mut hop = NextHop {
            ifindex: 0,
            via: dst,
        };
        for attribute in route.attributes {
            match attribute {
                RouteAttribute::Oif(index) => hop.ifindex = index,
                RouteAttribute::Gateway(RouteAddress::Inet(gateway)) => {
                    hop.via = IpAddr::V4(gateway)
                }
                RouteAttribute::Gateway(RouteAddress::Inet6(gateway)) => {
                    hop.via = IpAddr::V6(gateway)
                }
                _ => {}
            }
        }
        if hop.ifindex == 0 {
            bail!("the route to {dst} names no interface");
        }
        Ok(hop)
    }

    /// The neighbour entry for `hop`, if there is one.
    pub fn neighbour(&mut self, hop: NextHop) -> Result<Option<Neighbour>> {
        let query = neighbour_message(hop);
        let replies = match self.request(RouteNetlinkMessage::GetNeighbour(query), 0) {
            Ok(r) => r,
            Err(e) if is_not_found(&e) => return Ok(None),
            Err(e) => return Err(e),
        };
        Ok(replies.into_iter().find_map(|r| match r {
            RouteNetlinkMessage::NewNeighbour(n) => Some(parse_neighbour(n)),
            _ => None,
        }))
    }

    /// Marks `hop`'s entry managed (creating it), unless it is static.
    /// Returns whether the agent now manages it.
    pub fn manage(&mut self, hop: NextHop) -> Result<bool> {
        if self.neighbour(hop)?.is_some_and(|n| n.is_static()) {
            return Ok(false);
        }
        let mut entry = neighbour_message(hop);
        // NUD_NONE with the managed flag: the kernel starts resolving.
        entry.header.state = NeighbourState::None;
        entry
            .attributes
            .push(NeighbourAttribute::ExtFlags(NeighbourExtFlags::Managed));
        // Our tag: `selector detach` finds the entry by it when nothing
        // else says which entries the agent made (killed, unpinned).
        entry
            .attributes
            .push(NeighbourAttribute::Protocol(RouteProtocol::Other(
                NEIGHBOUR_PROTOCOL,
            )));
        self.request(
            RouteNetlinkMessage::NewNeighbour(entry),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        )
        .with_context(|| format!("marking the neighbour {} managed", hop.via))?;
        Ok(true)
    }

    /// The attributes of link `ifindex`.
    fn link_attributes(&mut self, ifindex: u32) -> Result<Vec<LinkAttribute>> {
        let mut query = LinkMessage::default();
        query.header.index = ifindex;
        let replies = self.request(RouteNetlinkMessage::GetLink(query), 0)?;
        Ok(replies
            .into_iter()
            .find_map(|r| match r {
                RouteNetlinkMessage::NewLink(link) => Some(link.attributes),
                _ => None,
            })
            .unwrap_or_default())
    }

    /// The interface's own link-layer address.
    pub fn link_address(&mut self, ifindex: u32) -> Result<Option<[u8; 6]>> {
        Ok(self
            .link_attributes(ifindex)?
            .into_iter()
            .find_map(|a| match a {
                LinkAttribute::Address(mac) => mac.try_into().ok(),
                _ => None,
            }))
    }

    /// The device's kind (IFLA_INFO_KIND: `veth`, `bridge`, `vlan`, ...);
    /// none for a device a hardware driver made.
    pub fn link_kind(&mut self, ifindex: u32) -> Result<Option<String>> {
        Ok(self
            .link_attributes(ifindex)?
            .into_iter()
            .find_map(|a| match a {
                LinkAttribute::LinkInfo(infos) => infos.into_iter().find_map(|i| match i {
                    LinkInfo::Kind(kind) => Some(kind.to_string()),
                    _ => None,
                }),
                _ => None,
            }))
    }

    /// The id of the XDP program attached to `ifindex` (IFLA_XDP_PROG_ID),
    /// if any.
    pub fn xdp_program(&mut self, ifindex: u32) -> Result<Option<u32>> {
        Ok(self
            .link_attributes(ifindex)?
            .into_iter()
            .find_map(|a| match a {
                LinkAttribute::Xdp(xdp) => xdp.into_iter().find_map(|x| match x {
                    LinkXdp::ProgId(id) if id != 0 => Some(id),
                    _ => None,
                }),
                _ => None,
            }))
    }

    /// Every IPv4 and IPv6 neighbour entry on `ifindex`, in one dump.
    pub fn neighbours_on(&mut self, ifindex: u32) -> Result<Vec<(IpAddr, Neighbour)>> {
        let mut query = NeighbourMessage::default();
        query.header.family = AddressFamily::Unspec;
        let replies = self.request(RouteNetlinkMessage::GetNeighbour(query), NLM_F_DUMP)?;
        Ok(replies
            .into_iter()
            .filter_map(|r| match r {
                RouteNetlinkMessage::NewNeighbour(n) if n.header.ifindex == ifindex => {
                    neighbour_entry(n)
                }
                _ => None,
            })
            .collect())
    }

    /// Deletes `hop`'s entry.
    pub fn forget(&mut self, hop: NextHop) -> Result<()> {
        match self.request(
            RouteNetlinkMessage::DelNeighbour(neighbour_message(hop)),
            NLM_F_ACK,
        ) {
            Err(e) if !is_not_found(&e) => Err(e),
            _ => Ok(()),
        }
    }
}

fn neighbour_message(hop: NextHop) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = match hop.via {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    };
    m.header.ifindex = hop.ifindex;
    m.attributes
        .push(NeighbourAttribute::Destination(match hop.via {
            IpAddr::V4(a) => NeighbourAddress::Inet(a),
            IpAddr::V6(a) => NeighbourAddress::Inet6(a),
        }));
    m
}

/// A neighbour message's address and entry (`None` without an address).
pub fn neighbour_entry(m: NeighbourMessage) -> Option<(IpAddr, Neighbour)> {
    let addr = m.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::Destination(NeighbourAddress::Inet(a)) => Some(IpAddr::V4(*a)),
        NeighbourAttribute::Destination(NeighbourAddress::Inet6(a)) => Some(IpAddr::V6(*a)),
        _ => None,
    })?;
    Some((addr, parse_neighbour(m)))
}

fn parse_neighbour(m: NeighbourMessage) -> Neighbour {
    let mut n = Neighbour {
        state: m.header.state,
        lladdr: None,
        managed: false,
        ours: false,
    };
    for attribute in m.attributes {
        match attribute {
            NeighbourAttribute::LinkLayerAddress(a) => n.lladdr = Some(a),
            NeighbourAttribute::ExtFlags(f) => n.managed = f.contains(NeighbourExtFlags::Managed),
            NeighbourAttribute::Protocol(p) => {
                n.ours = u8::from(p) == NEIGHBOUR_PROTOCOL;
            }
            _ => {}
        }
    }
    n
}

fn is_not_found(e: &anyhow::Error) -> bool {
    e.downcast_ref::<std::io::Error>()
        .and_then(std::io::Error::raw_os_error)
        == Some(libc::ENOENT)
}

/// The next hops the agent marked managed; [`Self::release`] deletes them.
#[derive(Debug, Default)]
pub struct ManagedNeighbours {
    hops: Vec<NextHop>,
}

impl ManagedNeighbours {
    pub fn hops(&self) -> &[NextHop] {
        &self.hops
    }

    /// Deletes the entries the agent marked (failures are only logged: the
    /// data path does not depend on them).
    pub fn release(self) {
        let Ok(mut netlink) = Netlink::open() else {
            return;
        };
        for hop in self.hops {
            if let Err(e) = netlink.forget(hop) {
                log::warn!("deleting the neighbour entry {}: {e:#}", hop.via);
            }
        }
    }
}

impl ManagedNeighbours {
    /// Marks every backend's next hop managed (those not marked yet), then
    /// waits up to `wait` for them to resolve. Returns the backends still
    /// unresolved.
    pub fn keep_resolved(
        &mut self,
        backends: &[SocketAddr],
        wait: Duration,
    ) -> Result<Vec<SocketAddr>> {
        let mut netlink = Netlink::open()?;
        let mut hops = Vec::new();
        for backend in backends {
            let hop = netlink.next_hop(backend.ip())?;
            if !self.hops.contains(&hop) && netlink.manage(hop)? {
                self.hops.push(hop);
            }
            hops.push((*backend, hop));
        }
        let deadline = Instant::now() + wait;
        loop {
            let mut unresolved = Vec::new();
            for (backend, hop) in &hops {
                if !netlink.neighbour(*hop)?.is_some_and(|n| n.is_resolved()) {
                    unresolved.push(*backend);
                }
            }
            if unresolved.is_empty() || Instant::now() >= deadline {
                return Ok(unresolved);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Deletes the managed entries an agent that is gone left (`selector
/// detach`): those on `ifindex` with the agent's tag, and those of the
/// next hops of `addrs` (its members, if known: entries of agents from
/// before the tag). An entry the kernel resolves on its own, or a static
/// one, is not managed and stays. Returns the addresses whose entries were
/// deleted.
pub fn release_managed(ifindex: u32, addrs: &[IpAddr]) -> Result<Vec<IpAddr>> {
    let mut netlink = Netlink::open()?;
    let mut released = Vec::new();
    for (via, n) in netlink.neighbours_on(ifindex)? {
        if n.ours && n.managed && !n.is_static() {
            netlink.forget(NextHop { ifindex, via })?;
            released.push(via);
        }
    }
    for addr in addrs {
        // No route any more: no entry of ours to find either.
        let Ok(hop) = netlink.next_hop(*addr) else {
            continue;
        };
        if released.contains(&hop.via) {
            continue;
        }
        if netlink
            .neighbour(hop)?
            .is_some_and(|n| n.managed && !n.is_static())
        {
            netlink.forget(hop)?;
            released.push(hop.via);
        }
    }
    Ok(released)
}

/// [`ManagedNeighbours::keep_resolved`] from nothing marked yet.
pub fn keep_resolved(
    backends: &[SocketAddr],
    wait: Duration,
) -> Result<(ManagedNeighbours, Vec<SocketAddr>)> {
    let mut managed = ManagedNeighbours::default();
    let unresolved = managed.keep_resolved(backends, wait)?;
    Ok((managed, unresolved))
}

/// [`keep_resolved`] for callers that keep the entries managed for the
/// namespace's lifetime (tests and benchmarks); an error counts every
/// backend as unresolved.
pub fn warm_up(backends: &[SocketAddr], wait: Duration) -> Vec<SocketAddr> {
    match keep_resolved(backends, wait) {
        Ok((_, unresolved)) => unresolved,
        Err(e) => {
            log::warn!("resolving the backends' next hops: {e:#}");
            backends.to_vec()
        }
    }
}
