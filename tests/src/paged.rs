//! A memcached-protocol replica of the tests' own whose every reply is a
//! paged skb, and an open-loop reader on a connected socket to go with it.
//!
//! memcached copies each reply into the skb's linear part; a NIC with
//! header split or a sender with scatter-gather does not. This replica
//! makes the kernel build its replies paged, in two ways, chosen by the
//! request id so that every kind of reply reaches every member:
//! - UDP_SEGMENT with a segment size above the reply: the whole payload in
//!   page fragments, only the headers linear, and CHECKSUM_PARTIAL (the
//!   receiver trusts it);
//! - corking (the 8-byte frame header sent with MSG_MORE, then the body):
//!   the header linear, the body in page fragments, and a full checksum the
//!   receiver verifies.
//!
//! Both need scatter-gather on the replica's interface, which needs tx
//! checksum offload (the testbed turns both off), so `start` turns them on
//! there.

use std::{
    io::ErrorKind,
    net::{SocketAddr, SocketAddrV4, UdpSocket},
    os::fd::AsRawFd as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{memcached::frame, netns::Namespace, topology::CLIENT_IFACE};

/// UDP payload sizes of the replies (frame header included): about 1 KB,
/// and 1400 bytes, which with IPv4 and UDP headers still fits the veth's
/// 1500-byte MTU unfragmented.
pub const REPLY_SIZES: [usize; 2] = [1024, 1400];
/// The UDP_SEGMENT size: the largest datagram payload of one 1500-byte IPv4
/// packet, above every reply, so no reply is split.
const GSO_SIZE: libc::c_int = 1472;

/// How the reply to request `id` is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sending {
    Segment,
    Corked,
}

impl Sending {
    pub fn of(id: u16) -> Self {
        if id & 2 == 0 {
            Self::Segment
        } else {
            Self::Corked
        }
    }
}

/// The reply body (after the frame header) to request `id`: a `get` hit of
/// `REPLY_SIZES[id % 2]` bytes in all, its data a pattern of the id, so a
/// reply that reaches the reader intact is known to be the one asked for.
pub fn reply_body(id: u16) -> Vec<u8> {
    let total = REPLY_SIZES[usize::from(id) % 2];
    // The frame header, "VALUE k 0 N\r\n", the data and "\r\nEND\r\n",
    // with N of three or four digits.
    let fixed = 8 + "VALUE k 0 \r\n".len() + "\r\nEND\r\n".len();
    let data_len = match total - fixed - 4 {
        n if n >= 1000 => n,
        _ => total - fixed - 3,
    };
    let mut body = format!("VALUE k 0 {data_len}\r\n").into_bytes();
    body.extend((0..data_len).map(|i| b'a' + ((usize::from(id) + i) % 26) as u8));
    body.extend_from_slice(b"\r\nEND\r\n");
    assert_eq!(8 + body.len(), total);
    body
}

/// A paged replica serving at one address in its namespace.
pub struct PagedReplica {
    pub addr: SocketAddrV4,
    paused: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    server: Option<thread::JoinHandle<std::io::Result<u64>>>,
}

impl PagedReplica {
    pub fn start(ns: &Namespace, addr: SocketAddrV4) -> Result<Self> {
        ns.exec("ethtool", &["-K", CLIENT_IFACE, "tx", "on", "sg", "on"])
            .context("offloads on")?;
        let paused = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let server = {
            let (paused, stop) = (paused.clone(), stop.clone());
            let socket = ns.run(move || UdpSocket::bind(addr))??;
            socket.set_read_timeout(Some(Duration::from_millis(20)))?;
            thread::spawn(move || serve(&socket, &paused, &stop))
        };
        Ok(Self {
            addr,
            paused,
            stop,
            server: Some(server),
        })
    }

    /// Stops answering (requests queue in the socket), as in a GC pause.
    pub fn pause(&self) {
        self.paused.store(true, Ordering::Relaxed);
    }

    /// Answers again, the queued requests first.
    pub fn resume(&self) {
        self.paused.store(false, Ordering::Relaxed);
    }

    /// Stops the server; how many replies it sent.
    pub fn finish(mut self) -> Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        let server = self.server.take().context("finished twice")?;
        let sent = server
            .join()
            .map_err(|_| anyhow::anyhow!("paged replica panicked"))??;
        Ok(sent)
    }
}

impl Drop for PagedReplica {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = self.server.take() {
            let _ = s.join();
        }
    }
}

fn serve(socket: &UdpSocket, paused: &AtomicBool, stop: &AtomicBool) -> std::io::Result<u64> {
    let (mut buf, mut sent) = ([0u8; 2048], 0);
    while !stop.load(Ordering::Relaxed) {
        if paused.load(Ordering::Relaxed) {
            thread::sleep(Duration::from_millis(1));
            continue;
        }
        let (n, from) = match socket.recv_from(&mut buf) {
            Ok(got) => got,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => continue,
            Err(e) => return Err(e),
        };
        if n < 8 {
            continue;
        }
        let id = u16::from_be_bytes([buf[0], buf[1]]);
        let body = reply_body(id);
        let SocketAddr::V4(to) = from else {
            continue;
        };
        match Sending::of(id) {
            Sending::Segment => {
                set_gso_size(socket, GSO_SIZE)?;
                socket.send_to(&frame(id, &body), from)?;
            }
            Sending::Corked => {
                set_gso_size(socket, 0)?;
                send_to(socket, &frame(id, &[]), to, libc::MSG_MORE)?;
                send_to(socket, &body, to, 0)?;
            }
        }
        sent += 1;
    }
    Ok(sent)
}

/// UDP_SEGMENT on every later send (0: off).
pub fn set_gso_size(socket: &UdpSocket, size: libc::c_int) -> std::io::Result<()> {
    // SAFETY: a valid socket and an int option.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_UDP,
            libc::UDP_SEGMENT,
            (&size as *const libc::c_int).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// sendto(2) with flags (std has no MSG_MORE).
fn send_to(socket: &UdpSocket, data: &[u8], to: SocketAddrV4, flags: i32) -> std::io::Result<()> {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: to.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(to.ip().octets()),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: a valid socket, buffer and IPv4 socket address.
    let rc = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            data.as_ptr().cast(),
            data.len(),
            flags,
            (&sin as *const libc::sockaddr_in).cast(),
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// What the reader saw.
#[derive(Clone, Copy, Debug, Default)]
pub struct ReadReport {
    pub sent: u64,
    /// Replies with the body their request asked for.
    pub answered: u64,
    /// Replies with another body (cut short, or corrupted).
    pub wrong_bodies: u64,
}

/// Sends `count` reads (at most 65536, so every request id is distinct) to
/// `target` at `rate` per second on a connected socket, which drops any
/// reply whose source is not `target`, and waits up to `drain` after the
/// last for the replies. Must be called on a thread inside the client
/// namespace.
pub fn read_paged(
    target: SocketAddrV4,
    rate: u32,
    count: usize,
    drain: Duration,
) -> Result<ReadReport> {
    if count > usize::from(u16::MAX) + 1 {
        bail!("at most 65536 distinct request ids");
    }
    let sender = UdpSocket::bind("0.0.0.0:0")?;
    sender.connect(target)?;
    let receiver = sender.try_clone()?;
    receiver.set_read_timeout(Some(Duration::from_millis(20)))?;
    let sending_done = Arc::new(AtomicBool::new(false));
    let reader = {
        let sending_done = sending_done.clone();
        thread::spawn(move || -> std::io::Result<ReadReport> {
            let mut seen = vec![false; count];
            let mut report = ReadReport::default();
            let mut buf = [0u8; 2048];
            let mut drain_end = None;
            while report.answered < count as u64 {
                if drain_end.is_none() && sending_done.load(Ordering::Relaxed) {
                    drain_end = Some(Instant::now() + drain);
                }
                if drain_end.is_some_and(|end| Instant::now() >= end) {
                    break;
                }
                let n = match receiver.recv(&mut buf) {
                    Ok(n) => n,
                    Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                let id = u16::from_be_bytes([buf[0], buf[1]]);
                if n < 8 || usize::from(id) >= count || buf[8..n] != reply_body(id)[..] {
                    report.wrong_bodies += 1;
                } else if !std::mem::replace(&mut seen[usize::from(id)], true) {
                    report.answered += 1;
                }
            }
            Ok(report)
        })
    };
    let interval = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let start = Instant::now();
    let mut sent = 0;
    for i in 0..count {
        let due = start + interval.mul_f64(i as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        sender.send(&frame(i as u16, b"get k\r\n"))?;
        sent += 1;
    }
    sending_done.store(true, Ordering::Relaxed);
    let mut report = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))??;
    report.sent = sent;
    Ok(report)
}
