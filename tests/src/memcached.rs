//! Real memcached replicas (UDP) and a memcached UDP client with an
//! open-loop load generator.

use std::{
    io::ErrorKind,
    net::{Ipv6Addr, SocketAddr, SocketAddrV4, UdpSocket},
    process::{Child, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use hdrhistogram::Histogram;

use crate::netns::Namespace;

/// A memcached process serving UDP in a replica namespace.
pub struct Replica {
    pub addr: SocketAddrV4,
    child: Child,
}

impl Replica {
    pub fn start(ns: &Namespace, addr: SocketAddrV4) -> Result<Self> {
        Self::start_listening(ns, addr, &addr.ip().to_string())
    }

    /// Serves at `addr` and at `v6` (same port): one process that an IPv4
    /// and an IPv6 group can both name.
    pub fn start_dual_stack(ns: &Namespace, addr: SocketAddrV4, v6: Ipv6Addr) -> Result<Self> {
        Self::start_listening(ns, addr, &format!("{},{v6}", addr.ip()))
    }

    fn start_listening(ns: &Namespace, addr: SocketAddrV4, listen: &str) -> Result<Self> {
        let child = ns
            .command("memcached")
            .args([
                "-U",
                &addr.port().to_string(),
                "-p",
                "0",
                "-l",
                listen,
                "-u",
                "root",
                "-t",
                "1",
                "-m",
                "64",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting memcached (is it installed? run `cargo xtask setup`)")?;
        Ok(Self { addr, child })
    }

    /// Waits until the replica answers over UDP from the client namespace.
    pub fn wait_ready(&self, client: &Namespace) -> Result<()> {
        wait_until_serving(client, self.addr)
    }

    pub fn pid(&self) -> i32 {
        // `ip netns exec` execs memcached in place, so the pid is memcached's.
        self.child.id() as i32
    }

    /// SIGSTOP: the replica stalls, as in a GC pause. Returns once every
    /// thread is stopped: a busy machine can let a signalled process run
    /// (and answer) for a moment after kill(2) returns.
    /// Panics if it has not stopped within the wait: a stall that did not
    /// take effect would make the test that asked for it meaningless.
    pub fn stop(&self) {
        unsafe { libc::kill(self.pid(), libc::SIGSTOP) };
        assert!(
            crate::netns::wait_stopped(self.pid()),
            "memcached {} (pid {}) did not stop: thread states {:?}",
            self.addr,
            self.pid(),
            crate::netns::thread_states(self.pid())
        );
    }

    /// SIGKILL: the replica crashes; what it had queued is lost.
    pub fn crash(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGCONT: the replica resumes.
    pub fn resume(&self) {
        unsafe { libc::kill(self.pid(), libc::SIGCONT) };
    }
}

/// How many `get` keys the memcached at `addr` has served (`STAT cmd_get`),
/// asked from `ns` (the replica's own namespace, so that no selector sees
/// the request). A replica that no client targets directly only serves the
/// reads a selector moved to it.
pub fn gets_served(ns: &Namespace, addr: SocketAddrV4) -> Result<u64> {
    ns.run(move || -> Result<u64> {
        let c = MemcachedClient::connect(addr)?;
        // The first datagram of the reply holds the early STAT lines.
        let body = c.request(b"stats\r\n", Duration::from_secs(1))?;
        let text = String::from_utf8_lossy(&body);
        text.lines()
            .find_map(|l| l.strip_prefix("STAT cmd_get "))
            .with_context(|| format!("no cmd_get in the stats of {addr}: {text}"))?
            .trim()
            .parse()
            .context("cmd_get")
    })?
}

/// Waits until a memcached (or anything speaking for one) answers at `addr`
/// over UDP from `client`.
pub fn wait_until_serving(client: &Namespace, addr: impl Into<SocketAddr>) -> Result<()> {
    let addr = addr.into();
    client.run(move || -> Result<()> {
        let c = MemcachedClient::connect(addr)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if c.request(b"version\r\n", Duration::from_millis(50)).is_ok() {
                return Ok(());
            }
        }
        bail!("memcached at {addr} did not answer")
    })?
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.resume();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The 8-byte memcached UDP frame header.
pub fn frame(request_id: u16, body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(8 + body.len());
    f.extend_from_slice(&request_id.to_be_bytes());
    f.extend_from_slice(&[0, 0, 0, 1, 0, 0]);
    f.extend_from_slice(body);
    f
}

/// The value stored under key `i` on every replica.
pub fn value_for(i: usize) -> String {
    format!("value-{i:06}-{}", "x".repeat(16))
}

pub fn key_for(i: usize) -> String {
    format!("key:{i:06}")
}

/// Extracts the data of a single-key `get` response (`None` for a miss).
pub fn parse_get_response(body: &[u8]) -> Option<&[u8]> {
    if !body.starts_with(b"VALUE ") {
        return None;
    }
    let header_end = body.windows(2).position(|w| w == b"\r\n")?;
    let header = std::str::from_utf8(&body[..header_end]).ok()?;
    let len: usize = header.split_whitespace().nth(3)?.parse().ok()?;
    let start = header_end + 2;
    let data = body.get(start..start + len)?;
    // The data block must be followed by its CRLF and the END line.
    (body.get(start + len..)? == b"\r\nEND\r\n").then_some(data)
}

/// An unconnected client socket with a large receive buffer, so a busy CI
/// machine that briefly starves the receiving thread does not drop replies
/// and fail a test. Must be called on a thread inside the client namespace.
/// A UDP socket of `target`'s family, with a large receive buffer.
fn client_socket(target: SocketAddr) -> Result<UdpSocket> {
    let any = if target.is_ipv6() {
        "[::]:0"
    } else {
        "0.0.0.0:0"
    };
    let socket = UdpSocket::bind(any)?;
    let size: libc::c_int = 8 << 20;
    // SAFETY: valid socket and option value; as root, FORCE lifts rmem_max.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            &size as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    Ok(socket)
}

/// A memcached UDP client on a connected socket, as an application would
/// use one: it only accepts datagrams from the address it sent to.
pub struct MemcachedClient {
    pub socket: UdpSocket,
    next_id: std::cell::Cell<u16>,
}

impl MemcachedClient {
    /// Must be called on a thread inside the client namespace.
    pub fn connect(addr: impl Into<SocketAddr>) -> Result<Self> {
        let addr = addr.into();
        let socket = client_socket(addr)?;
        socket.connect(addr)?;
        Ok(Self {
            socket,
            next_id: std::cell::Cell::new(1),
        })
    }

    /// Sends one framed request and returns the response body.
    pub fn request(&self, body: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        let id = self.next_id.get();
        self.next_id.set(id.wrapping_add(1));
        self.socket.send(&frame(id, body))?;
        self.socket.set_read_timeout(Some(timeout))?;
        let mut buf = [0u8; 2048];
        let deadline = Instant::now() + timeout;
        loop {
            let n = self.socket.recv(&mut buf)?;
            if n >= 8 && u16::from_be_bytes([buf[0], buf[1]]) == id {
                return Ok(buf[8..n].to_vec());
            }
            if Instant::now() >= deadline {
                bail!("timed out");
            }
        }
    }

    pub fn set(&self, key: &str, value: &str) -> Result<()> {
        let cmd = format!("set {key} 0 0 {}\r\n{value}\r\n", value.len());
        let r = self.request(cmd.as_bytes(), Duration::from_secs(1))?;
        if r != b"STORED\r\n" {
            bail!("set {key}: {}", String::from_utf8_lossy(&r));
        }
        Ok(())
    }

    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let r = self.request(format!("get {key}\r\n").as_bytes(), Duration::from_secs(1))?;
        Ok(parse_get_response(&r).map(<[u8]>::to_vec))
    }
}

/// Stores `keys` keys on every replica (each directly, before load).
pub fn preload<A>(client: &Namespace, replicas: &[A], keys: usize) -> Result<()>
where
    A: Into<SocketAddr> + Copy,
{
    for &addr in replicas {
        let addr: SocketAddr = addr.into();
        client.run(move || -> Result<()> {
            let c = MemcachedClient::connect(addr)?;
            for i in 0..keys {
                c.set(&key_for(i), &value_for(i))?;
            }
            Ok(())
        })??;
    }
    Ok(())
}

/// An open-loop read load against one address.
#[derive(Clone, Debug)]
pub struct LoadSpec {
    pub target: SocketAddr,
    /// Requests per second.
    pub rate: u32,
    pub duration: Duration,
    pub keys: usize,
    /// How long to wait for stragglers after the last send.
    pub drain: Duration,
}

/// What a load run saw. Latency runs from the *intended* send time, so a
/// stalled sender does not hide the stall (no coordinated omission).
pub struct LoadReport {
    /// Requests that left the socket.
    pub sent: u64,
    /// Requests the socket refused to send (a pending ICMP error).
    pub refused: u64,
    pub received: u64,
    /// Replies without the key's value, cache misses included.
    pub wrong_values: u64,
    /// Of `wrong_values`, cache misses (a replica that lost its data).
    pub misses: u64,
    /// Replies to no outstanding request: duplicates, or late ones.
    pub duplicates: u64,
    /// Replies from another address than the one asked. Only an
    /// unconnected socket sees them: a connected one drops them, so the
    /// application would wait for a reply that never comes.
    pub wrong_source: u64,
    /// Replies that arrived after a reply to a later request.
    pub out_of_order: u64,
    pub latency_us: Histogram<u64>,
    pub elapsed: Duration,
}

impl LoadReport {
    pub fn lost(&self) -> u64 {
        self.sent.saturating_sub(self.received)
    }

    /// One line of what the client saw: replies, wrong values, latency
    /// percentiles (from the intended send time).
    pub fn describe(&self) -> String {
        let h = &self.latency_us;
        format!(
            "{} of {} replies (wrong values: {}); latency p50 {} us, p99 {} us, p99.9 {} us, max {} us",
            self.received,
            self.sent,
            self.wrong_values,
            h.value_at_quantile(0.5),
            h.value_at_quantile(0.99),
            h.value_at_quantile(0.999),
            h.max()
        )
    }
}

/// How the load client's socket takes replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientSocket {
    /// Connected, as an application would use one: the kernel drops a reply
    /// from any other source.
    Connected,
    /// Unconnected, so that a reply from a wrong source reaches the client
    /// and is counted (`LoadReport::wrong_source`) instead of vanishing.
    Unconnected,
}

struct Outstanding {
    /// Position in send order.
    seq: u64,
    intended: Instant,
    key: usize,
}

/// What the receiving thread counted.
struct Replies {
    received: u64,
    wrong_values: u64,
    misses: u64,
    duplicates: u64,
    wrong_source: u64,
    out_of_order: u64,
    latency_us: Histogram<u64>,
}

/// Runs the load on a connected socket; must be called on a thread inside
/// the client namespace.
pub fn run_load(spec: &LoadSpec) -> Result<LoadReport> {
    run_load_on(spec, ClientSocket::Connected)
}

/// Runs the load on a socket of the given kind; must be called on a thread
/// inside the client namespace.
pub fn run_load_on(spec: &LoadSpec, kind: ClientSocket) -> Result<LoadReport> {
    let sender = client_socket(spec.target)?;
    if kind == ClientSocket::Connected {
        sender.connect(spec.target)?;
    }
    let socket = sender.try_clone()?;
    socket.set_read_timeout(Some(Duration::from_millis(20)))?;
    let table: Arc<Mutex<Vec<Option<Outstanding>>>> =
        Arc::new(Mutex::new((0..=u16::MAX as usize).map(|_| None).collect()));
    let total = (f64::from(spec.rate) * spec.duration.as_secs_f64()) as u64;
    let start = Instant::now();
    let send_end = Arc::new(Mutex::new(None::<Instant>));

    let receiver = {
        let table = table.clone();
        let send_end = send_end.clone();
        let (drain, target) = (spec.drain, spec.target);
        std::thread::spawn(move || -> Result<Replies> {
            let mut r = Replies {
                received: 0,
                wrong_values: 0,
                misses: 0,
                duplicates: 0,
                wrong_source: 0,
                out_of_order: 0,
                latency_us: Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?,
            };
            let mut latest_seq = None::<u64>;
            let mut buf = [0u8; 2048];
            loop {
                match socket.recv_from(&mut buf) {
                    Ok((_, from)) if from != target => {
                        r.wrong_source += 1;
                    }
                    Ok((n, _)) if n >= 8 => {
                        let now = Instant::now();
                        let id = u16::from_be_bytes([buf[0], buf[1]]) as usize;
                        let Some(o) = table.lock().unwrap()[id].take() else {
                            r.duplicates += 1;
                            continue;
                        };
                        r.received += 1;
                        if latest_seq.is_some_and(|latest| o.seq < latest) {
                            r.out_of_order += 1;
                        } else {
                            latest_seq = Some(o.seq);
                        }
                        let body = &buf[8..n];
                        if parse_get_response(body) != Some(value_for(o.key).as_bytes()) {
                            r.wrong_values += 1;
                            if body == b"END\r\n" {
                                r.misses += 1;
                            }
                        }
                        let us = now.duration_since(o.intended).as_micros() as u64;
                        r.latency_us.saturating_record(us.max(1));
                    }
                    Ok(_) => {}
                    Err(e) if crate::receive::nothing_yet(&e) => {}
                    Err(e) => return Err(e.into()),
                }
                if crate::receive::done(&send_end, &table, drain) {
                    return Ok(r);
                }
            }
        })
    };

    let interval = Duration::from_secs_f64(1.0 / f64::from(spec.rate.max(1)));
    let (mut sent, mut refused) = (0u64, 0u64);
    for seq in 0..total {
        let intended = start + interval.mul_f64(seq as f64);
        let now = Instant::now();
        if intended > now {
            std::thread::sleep(intended - now);
        }
        let id = (seq % (u16::MAX as u64 + 1)) as u16;
        let key = (seq as usize) % spec.keys.max(1);
        table.lock().unwrap()[id as usize] = Some(Outstanding { seq, intended, key });
        let request = frame(id, format!("get {}\r\n", key_for(key)).as_bytes());
        let result = match kind {
            ClientSocket::Connected => sender.send(&request),
            ClientSocket::Unconnected => sender.send_to(&request, spec.target),
        };
        match result {
            // The socket reports an ICMP error from an earlier datagram (a
            // crashed replica) instead of sending; an application would
            // see a failed request.
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                table.lock().unwrap()[id as usize] = None;
                refused += 1;
            }
            r => {
                r?;
                sent += 1;
            }
        }
    }
    *send_end.lock().unwrap() = Some(Instant::now());
    let replies = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("receiver panicked"))??;
    Ok(LoadReport {
        sent,
        refused,
        received: replies.received,
        wrong_values: replies.wrong_values,
        misses: replies.misses,
        duplicates: replies.duplicates,
        wrong_source: replies.wrong_source,
        out_of_order: replies.out_of_order,
        latency_us: replies.latency_us,
        elapsed: start.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_get_responses() {
        assert_eq!(
            parse_get_response(b"VALUE k 0 3\r\nabc\r\nEND\r\n"),
            Some(&b"abc"[..])
        );
        assert_eq!(parse_get_response(b"END\r\n"), None);
        assert_eq!(parse_get_response(b"VALUE k 0 9\r\nabc\r\nEND\r\n"), None);
        assert_eq!(parse_get_response(b"VALUE k 0 2\r\nabc\r\nEND\r\n"), None);
        assert_eq!(parse_get_response(b"VALUE k 0 3\r\nabc\r\n"), None);
    }

    #[test]
    fn frames_carry_the_request_id() {
        let f = frame(0xbeef, b"get k\r\n");
        assert_eq!(&f[..8], &[0xbe, 0xef, 0, 0, 0, 1, 0, 0]);
        assert_eq!(&f[8..], b"get k\r\n");
    }
}
