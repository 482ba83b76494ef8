//! Real memcached replicas (UDP) and a memcached UDP client with an
//! open-loop load generator.

use std::{
    io::ErrorKind,
    net::{SocketAddrV4, UdpSocket},
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
        let child = ns
            .command("memcached")
            .args([
                "-U",
                &addr.port().to_string(),
                "-p",
                "0",
                "-l",
                &addr.ip().to_string(),
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
        let addr = self.addr;
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

    pub fn pid(&self) -> i32 {
        // `ip netns exec` execs memcached in place, so the pid is memcached's.
        self.child.id() as i32
    }

    /// SIGSTOP: the replica stalls, as in a GC pause.
    pub fn stop(&self) {
        unsafe { libc::kill(self.pid(), libc::SIGSTOP) };
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

/// A memcached UDP client on a connected socket, as an application would
/// use one: it only accepts datagrams from the address it sent to.
pub struct MemcachedClient {
    pub socket: UdpSocket,
    next_id: std::cell::Cell<u16>,
}

impl MemcachedClient {
    /// Must be called on a thread inside the client namespace.
    pub fn connect(addr: SocketAddrV4) -> Result<Self> {
        let socket = UdpSocket::bind("0.0.0.0:0")?;
        socket.connect(addr)?;
        // A large receive buffer, so a busy CI machine that briefly starves
        // the receiving thread does not drop replies and fail a test.
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
pub fn preload(client: &Namespace, replicas: &[SocketAddrV4], keys: usize) -> Result<()> {
    for &addr in replicas {
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
    pub target: SocketAddrV4,
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
    pub wrong_values: u64,
    pub duplicates: u64,
    pub latency_us: Histogram<u64>,
    pub elapsed: Duration,
}

impl LoadReport {
    pub fn lost(&self) -> u64 {
        self.sent.saturating_sub(self.received)
    }
}

struct Outstanding {
    intended: Instant,
    key: usize,
}

/// Runs the load; must be called on a thread inside the client namespace.
pub fn run_load(spec: &LoadSpec) -> Result<LoadReport> {
    let client = MemcachedClient::connect(spec.target)?;
    let socket = client.socket.try_clone()?;
    socket.set_read_timeout(Some(Duration::from_millis(20)))?;
    let table: Arc<Mutex<Vec<Option<Outstanding>>>> =
        Arc::new(Mutex::new((0..=u16::MAX as usize).map(|_| None).collect()));
    let total = (f64::from(spec.rate) * spec.duration.as_secs_f64()) as u64;
    let start = Instant::now();
    let send_end = Arc::new(Mutex::new(None::<Instant>));

    let receiver = {
        let table = table.clone();
        let send_end = send_end.clone();
        let drain = spec.drain;
        std::thread::spawn(move || -> Result<(u64, u64, u64, Histogram<u64>)> {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
            let (mut received, mut wrong, mut dups) = (0u64, 0u64, 0u64);
            let mut buf = [0u8; 2048];
            loop {
                match socket.recv(&mut buf) {
                    Ok(n) if n >= 8 => {
                        let now = Instant::now();
                        let id = u16::from_be_bytes([buf[0], buf[1]]) as usize;
                        let Some(o) = table.lock().unwrap()[id].take() else {
                            dups += 1;
                            continue;
                        };
                        received += 1;
                        let ok = parse_get_response(&buf[8..n])
                            .is_some_and(|v| v == value_for(o.key).as_bytes());
                        if !ok {
                            wrong += 1;
                        }
                        let us = now.duration_since(o.intended).as_micros() as u64;
                        hist.saturating_record(us.max(1));
                    }
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.kind(),
                            ErrorKind::WouldBlock
                                | ErrorKind::TimedOut
                                | ErrorKind::ConnectionRefused
                        ) => {}
                    Err(e) => return Err(e.into()),
                }
                if let Some(end) = *send_end.lock().unwrap() {
                    let all_in = table.lock().unwrap().iter().all(Option::is_none);
                    if all_in || end.elapsed() >= drain {
                        return Ok((received, wrong, dups, hist));
                    }
                }
            }
        })
    };

    let interval = Duration::from_secs_f64(1.0 / f64::from(spec.rate.max(1)));
    let (mut sent, mut refused) = (0u64, 0u64);
    for i in 0..total {
        let intended = start + interval.mul_f64(i as f64);
        let now = Instant::now();
        if intended > now {
            std::thread::sleep(intended - now);
        }
        let id = (i % (u16::MAX as u64 + 1)) as u16;
        let key = (i as usize) % spec.keys.max(1);
        table.lock().unwrap()[id as usize] = Some(Outstanding { intended, key });
        let request = frame(id, format!("get {}\r\n", key_for(key)).as_bytes());
        match client.socket.send(&request) {
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
    let (received, wrong_values, duplicates, latency_us) = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("receiver panicked"))??;
    Ok(LoadReport {
        sent,
        refused,
        received,
        wrong_values,
        duplicates,
        latency_us,
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
