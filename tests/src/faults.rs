//! Fault injectors for the testbed: loss and duplication on the wire
//! (nftables at the switch ports), and replies delayed and reordered by a
//! relay in front of a replica.
//!
//! This kernel has no netem. Faults on the wire live in the switch
//! namespace, so the selector on the client sees every request leave and
//! only the wire loses or copies it (a drop in the client's own output hook
//! would happen before TC egress).

use std::{
    collections::{BinaryHeap, HashMap},
    io::{ErrorKind, Write as _},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket},
    process::Stdio,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{
    memcached::{Replica, wait_until_serving},
    netns::Namespace,
    topology::{CLIENT_ADDR, Testbed, switch_port},
};

/// What happens to the datagrams a wire fault picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireFault {
    Drop,
    Duplicate,
}

/// The nftables table holding the wire faults in the switch namespace.
const TABLE: &str = "wire_faults";

/// Applies `fault` to `percent` % of the requests (client to replicas) and,
/// independently, of the replies (replicas to client), as they enter the
/// switch. Only UDP to and from the replicas' service ports is touched.
pub fn install_wire_fault(tb: &Testbed, fault: WireFault, percent: u32) -> Result<()> {
    install_wire_fault_on(tb, fault, percent, &tb.replica_endpoints())
}

/// `install_wire_fault` on the datagrams to and from `endpoints` (replica
/// addresses and service ports) alone.
pub fn install_wire_fault_on(
    tb: &Testbed,
    fault: WireFault,
    percent: u32,
    endpoints: &[SocketAddrV4],
) -> Result<()> {
    let client_port = switch_port(0);
    let pick = format!("numgen random mod 100 < {percent} counter");
    let mut requests = Vec::new();
    let mut replies = Vec::new();
    for replica in endpoints {
        let Some(i) =
            (0..tb.replica_ns.len()).find(|&i| crate::topology::replica_addr(i) == *replica.ip())
        else {
            bail!("{replica} is no replica of the testbed");
        };
        let replica_port = switch_port(i + 1);
        // A copy goes straight out of the port towards its receiver.
        let (to_replica, to_client) = match fault {
            WireFault::Drop => ("drop".to_string(), "drop".to_string()),
            WireFault::Duplicate => (
                format!("dup to \"{replica_port}\""),
                format!("dup to \"{client_port}\""),
            ),
        };
        requests.push(format!(
            "ip saddr {CLIENT_ADDR} ip daddr {} udp dport {} {pick} {to_replica}",
            replica.ip(),
            replica.port()
        ));
        replies.push(format!(
            "ip saddr {} udp sport {} ip daddr {CLIENT_ADDR} {pick} {to_client}",
            replica.ip(),
            replica.port()
        ));
    }
    let replica_ports: Vec<String> = (1..=tb.replica_ns.len())
        .map(|i| format!("\"{}\"", switch_port(i)))
        .collect();
    let ruleset = format!(
        "table netdev {TABLE} {{\n\
         chain requests {{\n\
         type filter hook ingress devices = {{ \"{client_port}\" }} priority 0;\n\
         {}\n}}\n\
         chain replies {{\n\
         type filter hook ingress devices = {{ {} }} priority 0;\n\
         {}\n}}\n}}\n",
        requests.join("\n"),
        replica_ports.join(", "),
        replies.join("\n"),
    );
    nft_script(&tb.switch, &ruleset)
}

/// Datagrams the wire fault picked so far: (requests, replies).
pub fn wire_fault_hits(tb: &Testbed) -> Result<(u64, u64)> {
    let out = tb.switch.exec("nft", &["list", "table", "netdev", TABLE])?;
    let text = String::from_utf8_lossy(&out.stdout);
    let (mut requests, mut replies) = (0, 0);
    let mut chain = "";
    for line in text.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("chain ") {
            chain = name.trim_end_matches(" {");
        }
        let Some(rest) = line.split("counter packets ").nth(1) else {
            continue;
        };
        let packets: u64 = rest
            .split_whitespace()
            .next()
            .context("counter without a value")?
            .parse()?;
        match chain {
            "requests" => requests += packets,
            "replies" => replies += packets,
            other => bail!("counter in unexpected chain {other}"),
        }
    }
    Ok((requests, replies))
}

/// The nftables table that cuts replicas off (`cut_off_replica`).
const CUT_TABLE: &str = "dead_replicas";

/// Drops every datagram to and from replica `i` at the switch, both ways
/// (a host that is gone: no reply, no ICMP), until `reconnect_replica`.
/// The client's selector sees every request leave.
pub fn cut_off_replica(tb: &Testbed, i: usize) -> Result<()> {
    cut_off_replicas(tb, &[i])
}

/// `cut_off_replica` for several replicas at once.
pub fn cut_off_replicas(tb: &Testbed, which: &[usize]) -> Result<()> {
    let ips: Vec<String> = which
        .iter()
        .map(|&i| tb.replica_endpoints()[i].ip().to_string())
        .collect();
    let ports: Vec<String> = which
        .iter()
        .map(|&i| format!("\"{}\"", switch_port(i + 1)))
        .collect();
    let ruleset = format!(
        "table netdev {CUT_TABLE} {{\n\
         chain to_replica {{\n\
         type filter hook ingress devices = {{ \"{}\" }} priority 0;\n\
         ip daddr {{ {} }} counter drop\n}}\n\
         chain from_replica {{\n\
         type filter hook ingress devices = {{ {} }} priority 0;\n\
         ip saddr {{ {} }} counter drop\n}}\n}}\n",
        switch_port(0),
        ips.join(", "),
        ports.join(", "),
        ips.join(", "),
    );
    nft_script(&tb.switch, &ruleset)
}

/// Replica `i` flaps: the switch drops every other request to it (by a
/// counter, not at random, so it never fails twice in a row) and no reply.
/// Undone by `reconnect_replica`.
pub fn flap_replica(tb: &Testbed, i: usize) -> Result<()> {
    let ip = tb.replica_endpoints()[i].ip().to_string();
    // The replies chain is there for `reconnect_replica`; its rule never
    // matches (no replica sends from 0.0.0.0).
    let ruleset = format!(
        "table netdev {CUT_TABLE} {{\n\
         chain to_replica {{\n\
         type filter hook ingress devices = {{ \"{}\" }} priority 0;\n\
         ip daddr {ip} numgen inc mod 2 == 0 counter drop\n}}\n\
         chain from_replica {{\n\
         type filter hook ingress devices = {{ \"{}\" }} priority 0;\n\
         ip saddr 0.0.0.0 counter drop\n}}\n}}\n",
        switch_port(0),
        switch_port(i + 1),
    );
    nft_script(&tb.switch, &ruleset)
}

/// Undoes `cut_off_replica(s)`; returns the datagrams it dropped:
/// (requests to the replicas, replies from them). An accept is put in
/// front of the drops first, in one transaction, so that the counters
/// read are final.
pub fn reconnect_replica(tb: &Testbed) -> Result<(u64, u64)> {
    nft_script(
        &tb.switch,
        &format!(
            "insert rule netdev {CUT_TABLE} to_replica accept\n\
             insert rule netdev {CUT_TABLE} from_replica accept\n"
        ),
    )?;
    let dropped = |chain: &str| -> Result<u64> {
        let out = tb
            .switch
            .exec("nft", &["list", "chain", "netdev", CUT_TABLE, chain])?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        Ok(text
            .split("counter packets ")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .context("no counter in the cut-off chain")?
            .parse()?)
    };
    let counts = (dropped("to_replica")?, dropped("from_replica")?);
    tb.switch
        .exec("nft", &["delete", "table", "netdev", CUT_TABLE])?;
    Ok(counts)
}

/// Loads an nftables script in `ns`.
fn nft_script(ns: &Namespace, script: &str) -> Result<()> {
    let mut child = ns
        .command("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running nft (is nftables installed? run `cargo xtask setup`)")?;
    child
        .stdin
        .take()
        .context("nft stdin")?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        bail!(
            "nft -f failed: {}\n{script}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A small xorshift generator: the delays need no quality, only variety.
struct XorShift(u64);

impl XorShift {
    fn seeded() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self(nanos | 1)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

/// A reply held back until `release`.
struct HeldReply {
    release: Instant,
    to: SocketAddr,
    datagram: Vec<u8>,
}

impl PartialEq for HeldReply {
    fn eq(&self, other: &Self) -> bool {
        self.release == other.release
    }
}

impl Eq for HeldReply {}

impl PartialOrd for HeldReply {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for HeldReply {
    /// Reversed, so the max-heap pops the earliest release first.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.release.cmp(&self.release)
    }
}

/// A UDP relay in a replica namespace that stands in for the replica at
/// its address: it forwards requests to a memcached in the same namespace
/// and sends each reply on after its own random delay, so replies overtake
/// each other. Stops and joins its threads on drop.
pub struct DelayingRelay {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<Result<()>>>,
}

/// Starts every replica as a memcached on the namespace's loopback behind a
/// `DelayingRelay` at the replica's address, and waits until each answers.
/// Drop the relays before the testbed.
pub fn start_delayed_replicas(tb: &mut Testbed, max_delay: Duration) -> Result<Vec<DelayingRelay>> {
    let mut relays = Vec::new();
    for (ns, endpoint) in tb.replica_ns.iter().zip(tb.replica_endpoints()) {
        let local = SocketAddrV4::new(Ipv4Addr::LOCALHOST, endpoint.port());
        tb.replicas.push(Replica::start(ns, local)?);
        relays.push(DelayingRelay::start(ns, endpoint, local, max_delay)?);
    }
    for endpoint in tb.replica_endpoints() {
        wait_until_serving(&tb.client, endpoint)?;
    }
    Ok(relays)
}

/// How often the relay's threads look at the stop flag when idle.
const RELAY_POLL: Duration = Duration::from_millis(10);

impl DelayingRelay {
    /// Serves `front` in `ns` for the memcached at `backend` (reachable from
    /// `ns`), delaying each reply by 0 to `max_delay`.
    pub fn start(
        ns: &Namespace,
        front: SocketAddrV4,
        backend: SocketAddrV4,
        max_delay: Duration,
    ) -> Result<Self> {
        Self::start_with(ns, front, backend, Delay::Random(max_delay))
    }

    /// Serves `front` as `start` does, every reply held back by `delay`
    /// exactly (in order): a server slower than the others by as much.
    pub fn start_fixed(
        ns: &Namespace,
        front: SocketAddrV4,
        backend: SocketAddrV4,
        delay: Duration,
    ) -> Result<Self> {
        Self::start_with(ns, front, backend, Delay::Fixed(delay))
    }

    fn start_with(
        ns: &Namespace,
        front: SocketAddrV4,
        backend: SocketAddrV4,
        delay: Delay,
    ) -> Result<Self> {
        // Sockets belong to the namespace they were made in.
        let (front, back) = ns.run(move || -> Result<(UdpSocket, UdpSocket)> {
            let front = UdpSocket::bind(front)?;
            front.set_read_timeout(Some(RELAY_POLL))?;
            let back = UdpSocket::bind("127.0.0.1:0")?;
            back.connect(backend)?;
            Ok((front, back))
        })??;
        // memcached echoes the request id, which says whom a reply is for.
        let clients: Arc<Mutex<HashMap<u16, SocketAddr>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let forward = {
            let (front, back) = (front.try_clone()?, back.try_clone()?);
            let (clients, stop) = (clients.clone(), stop.clone());
            std::thread::spawn(move || forward_requests(&front, &back, &clients, &stop))
        };
        let reply = {
            let stop = stop.clone();
            std::thread::spawn(move || delay_replies(&back, &front, &clients, &stop, delay))
        };
        Ok(Self {
            stop,
            threads: vec![forward, reply],
        })
    }

    /// Stops the relay; an error either thread met.
    pub fn stop(&mut self) -> Result<()> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            t.join()
                .map_err(|_| anyhow::anyhow!("relay thread panicked"))??;
        }
        Ok(())
    }
}

impl Drop for DelayingRelay {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// Errors a relay thread waits out: nothing to read yet, or an ICMP error
/// from a datagram to a memcached that was not listening yet.
fn is_transient(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::ConnectionRefused
    )
}

/// Client to memcached, remembering who asked under each request id.
fn forward_requests(
    front: &UdpSocket,
    back: &UdpSocket,
    clients: &Mutex<HashMap<u16, SocketAddr>>,
    stop: &AtomicBool,
) -> Result<()> {
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        match front.recv_from(&mut buf) {
            Ok((n, from)) if n >= 2 => {
                let id = u16::from_be_bytes([buf[0], buf[1]]);
                clients.lock().unwrap().insert(id, from);
                match back.send(&buf[..n]) {
                    Err(e) if !is_transient(&e) => return Err(e.into()),
                    _ => {}
                }
            }
            Ok(_) => {}
            Err(e) if is_transient(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// How long a relay holds each reply.
#[derive(Clone, Copy, Debug)]
enum Delay {
    /// 0 to this, at random (replies overtake each other).
    Random(Duration),
    /// This, every time.
    Fixed(Duration),
}

/// memcached to client, each reply held back by its delay.
fn delay_replies(
    back: &UdpSocket,
    front: &UdpSocket,
    clients: &Mutex<HashMap<u16, SocketAddr>>,
    stop: &AtomicBool,
    delay: Delay,
) -> Result<()> {
    let mut held = BinaryHeap::<HeldReply>::new();
    let mut random = XorShift::seeded();
    let mut hold = move || match delay {
        Delay::Random(max) => Duration::from_micros(random.below(max.as_micros() as u64 + 1)),
        Delay::Fixed(d) => d,
    };
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        while held.peek().is_some_and(|r| r.release <= now) {
            let r = held.pop().expect("peeked");
            front.send_to(&r.datagram, r.to)?;
        }
        let wait = held
            .peek()
            .map_or(RELAY_POLL, |r| r.release - now)
            .clamp(Duration::from_micros(50), RELAY_POLL);
        back.set_read_timeout(Some(wait))?;
        match back.recv(&mut buf) {
            Ok(n) if n >= 2 => {
                let id = u16::from_be_bytes([buf[0], buf[1]]);
                let Some(to) = clients.lock().unwrap().get(&id).copied() else {
                    continue;
                };
                held.push(HeldReply {
                    release: Instant::now() + hold(),
                    to,
                    datagram: buf[..n].to_vec(),
                });
            }
            Ok(_) => {}
            Err(e) if is_transient(&e) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}
