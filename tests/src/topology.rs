//! The standard topology: a client and N replicas on one L2 segment (a
//! bridge in its own namespace), all addresses in 10.77.0.0/24 (and with
//! `dual_stack`, fd77::/64 too), nothing in the host's namespace.
//!
//! ```text
//! client 10.77.0.1 (eth0) --- [switch: br0] --- replica i 10.77.0.(10+i) (eth0)
//!        fd77::1                                          fd77::(10+i)
//! ```
//!
//! `with_clients` adds more client hosts, 10.77.0.(1+k), for experiments
//! with several independent client hosts (each with its own selector).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4};

use anyhow::Result;

use crate::{
    memcached::Replica,
    netns::{Namespace, unique_tag},
};

pub const CLIENT_ADDR: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
pub const MEMCACHED_PORT: u16 = 11211;
/// The client's interface, where the selector attaches.
pub const CLIENT_IFACE: &str = "eth0";

pub fn replica_addr(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 0, 10 + i as u8)
}

pub const CLIENT_ADDR6: Ipv6Addr = Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 1);

pub fn replica_addr6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 0x10 + i as u16)
}

/// The switch's port for host `host` (0 is the client, 1 + i replica i).
pub fn switch_port(host: usize) -> String {
    format!("p{host}")
}

/// Client hosts a testbed can have: 10.77.0.1 to .9, below the replicas.
pub const MAX_CLIENTS: usize = 9;

/// Client host `k`'s address (0 is `CLIENT_ADDR`).
pub fn client_addr(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, 0, 1 + k as u8)
}

/// Namespaces and replicas; everything goes away on drop (replicas first).
pub struct Testbed {
    pub replicas: Vec<Replica>,
    /// Replica i serves on `MEMCACHED_PORT + i * port_step` (0: all alike).
    pub port_step: u16,
    pub client: Namespace,
    /// Client hosts 1.. (`with_clients`), at `client_addr(k)`.
    pub more_clients: Vec<Namespace>,
    pub replica_ns: Vec<Namespace>,
    pub switch: Namespace,
    /// Every host has its fd77::/64 address too; memcached listens on both.
    pub dual_stack: bool,
}

impl Testbed {
    /// Creates the namespaces and links, with checksum offloads off on
    /// every host interface so that receivers really verify UDP checksums
    /// and senders put full checksums on the wire.
    pub fn new(prefix: &str, replicas: usize) -> Result<Self> {
        let tag = unique_tag();
        let switch = Namespace::create(&format!("{prefix}-{tag}-sw"))?;
        switch.ip(&["link", "add", "br0", "type", "bridge"])?;
        switch.ip(&["link", "set", "br0", "up"])?;
        let client = Namespace::create(&format!("{prefix}-{tag}-c"))?;
        let mut replica_ns = Vec::new();
        for i in 0..replicas {
            replica_ns.push(Namespace::create(&format!("{prefix}-{tag}-r{i}"))?);
        }
        let hosts: Vec<(&Namespace, Ipv4Addr)> = std::iter::once((&client, CLIENT_ADDR))
            .chain(
                replica_ns
                    .iter()
                    .enumerate()
                    .map(|(i, ns)| (ns, replica_addr(i))),
            )
            .collect();
        for (port, (ns, addr)) in hosts.iter().enumerate() {
            plug(&switch, &switch_port(port), ns, *addr)?;
        }
        Ok(Self {
            replicas: Vec::new(),
            port_step: 0,
            client,
            more_clients: Vec::new(),
            replica_ns,
            switch,
            dual_stack: false,
        })
    }

    /// [`Self::new`] with an IPv6 address on every host as well (client
    /// fd77::1, replica i fd77::(10+i)), usable at once: duplicate address
    /// detection is off (`nodad`), so no address stays tentative.
    pub fn dual_stack(prefix: &str, replicas: usize) -> Result<Self> {
        let mut tb = Self::new(prefix, replicas)?;
        let hosts = std::iter::once((&tb.client, CLIENT_ADDR6)).chain(
            tb.replica_ns
                .iter()
                .enumerate()
                .map(|(i, ns)| (ns, replica_addr6(i))),
        );
        for (ns, addr) in hosts {
            ns.ip(&[
                "addr",
                "add",
                &format!("{addr}/64"),
                "dev",
                CLIENT_IFACE,
                "nodad",
            ])?;
        }
        tb.dual_stack = true;
        Ok(tb)
    }

    /// A testbed with `clients` client hosts (at most `MAX_CLIENTS`): the
    /// client and `clients - 1` more, each on its own switch port.
    pub fn with_clients(prefix: &str, replicas: usize, clients: usize) -> Result<Self> {
        if clients > MAX_CLIENTS {
            anyhow::bail!("at most {MAX_CLIENTS} client hosts");
        }
        let mut tb = Self::new(prefix, replicas)?;
        let tag = unique_tag();
        for k in 1..clients {
            let ns = Namespace::create(&format!("{prefix}-{tag}-c{k}"))?;
            plug(&tb.switch, &format!("h{k}"), &ns, client_addr(k))?;
            tb.more_clients.push(ns);
        }
        Ok(tb)
    }

    /// Every client host, the client first.
    pub fn clients(&self) -> Vec<&Namespace> {
        std::iter::once(&self.client)
            .chain(&self.more_clients)
            .collect()
    }

    /// A testbed with memcached on every replica and `keys` keys preloaded.
    pub fn with_memcached(prefix: &str, replicas: usize, keys: usize) -> Result<Self> {
        let mut tb = Self::new(prefix, replicas)?;
        tb.start_memcached()?;
        crate::memcached::preload(&tb.client, &tb.replica_endpoints(), keys)?;
        Ok(tb)
    }

    /// The replicas as one `--group` argument, in order.
    pub fn group_arg(&self) -> String {
        let members: Vec<String> = self
            .replica_endpoints()
            .iter()
            .map(ToString::to_string)
            .collect();
        members.join(",")
    }

    /// Starts memcached (UDP) on every replica.
    pub fn start_memcached(&mut self) -> Result<()> {
        let endpoints = self.replica_endpoints();
        for (i, (ns, endpoint)) in self.replica_ns.iter().zip(endpoints).enumerate() {
            self.replicas.push(if self.dual_stack {
                Replica::start_dual_stack(ns, endpoint, replica_addr6(i))?
            } else {
                Replica::start(ns, endpoint)?
            });
        }
        for r in &self.replicas {
            r.wait_ready(&self.client)?;
        }
        Ok(())
    }

    /// Starts replica `i` again at its address (after a crash), empty, and
    /// waits until it answers, asking from its own namespace so that no
    /// request passes a selector on the client.
    pub fn restart_replica(&mut self, i: usize) -> Result<()> {
        let endpoint = self.replica_endpoints()[i];
        self.replicas[i] = Replica::start(&self.replica_ns[i], endpoint)?;
        self.replicas[i].wait_ready(&self.replica_ns[i])
    }

    pub fn replica_endpoints(&self) -> Vec<SocketAddrV4> {
        (0..self.replica_ns.len())
            .map(|i| SocketAddrV4::new(replica_addr(i), MEMCACHED_PORT + i as u16 * self.port_step))
            .collect()
    }

    /// The replicas' IPv4 endpoints as one group of `SocketAddr`s, as
    /// `Settings` takes them.
    pub fn replica_group(&self) -> Vec<SocketAddr> {
        self.replica_endpoints()
            .into_iter()
            .map(SocketAddr::from)
            .collect()
    }

    /// The replicas' IPv6 endpoints (same ports), for a `dual_stack` testbed.
    pub fn replica_endpoints6(&self) -> Vec<SocketAddr> {
        self.replica_endpoints()
            .iter()
            .enumerate()
            .map(|(i, e)| SocketAddr::from((replica_addr6(i), e.port())))
            .collect()
    }

    /// The `get` keys replica `i` has served (memcached's `cmd_get`),
    /// asked from its own namespace so that no selector sees the request.
    pub fn gets_served(&self, i: usize) -> Result<u64> {
        crate::memcached::gets_served(&self.replica_ns[i], self.replicas[i].addr)
    }

    /// The reads every replica but replica 0 has served: with a load that
    /// only asks replica 0 (the primary), exactly the reads a selector
    /// moved, counted by the replicas themselves, not by the selector.
    pub fn reads_moved(&self) -> Result<u64> {
        (1..self.replicas.len()).map(|i| self.gets_served(i)).sum()
    }

    /// UDP checksum errors (over IPv4 and IPv6) seen by every host so far.
    pub fn udp_checksum_errors(&self) -> Result<u64> {
        let mut total = 0;
        for ns in std::iter::once(&self.client).chain(&self.replica_ns) {
            total += ns.snmp("Udp", "InCsumErrors")? + ns.snmp6("Udp6InCsumErrors")?;
        }
        Ok(total)
    }
}

/// Connects `ns` to the switch's bridge on port `port` as `addr`/24 on
/// `CLIENT_IFACE`, with checksum offloads off.
fn plug(switch: &Namespace, port: &str, ns: &Namespace, addr: Ipv4Addr) -> Result<()> {
    // Create the pair inside the switch so no name touches the host.
    switch.ip(&[
        "link",
        "add",
        port,
        "type",
        "veth",
        "peer",
        "name",
        CLIENT_IFACE,
        "netns",
        &ns.name,
    ])?;
    switch.ip(&["link", "set", port, "master", "br0", "up"])?;
    ns.ip(&["addr", "add", &format!("{addr}/24"), "dev", CLIENT_IFACE])?;
    ns.ip(&["link", "set", CLIENT_IFACE, "up"])?;
    ns.exec("ethtool", &["-K", CLIENT_IFACE, "rx", "off", "tx", "off"])?;
    Ok(())
}

/// Transmit checksum, segmentation and receive offloads on at `ns`'s
/// interface (the testbed turns checksum offloads off, and with them
/// segmentation), as on a host with a real NIC: TCP then sends (TSO) and
/// receives (GRO) large skbs whose payload is in page fragments. Receive
/// checksum offload stays off: received UDP checksums are still verified.
pub fn offloads_on(ns: &Namespace) -> Result<()> {
    ns.exec(
        "ethtool",
        &[
            "-K",
            CLIENT_IFACE,
            "tx",
            "on",
            "sg",
            "on",
            "tso",
            "on",
            "gso",
            "on",
            "gro",
            "on",
        ],
    )?;
    Ok(())
}

impl Drop for Testbed {
    fn drop(&mut self) {
        // Replicas before their namespaces.
        self.replicas.clear();
    }
}
