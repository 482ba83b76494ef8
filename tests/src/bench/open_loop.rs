//! An open-loop read load on one connected UDP socket: each read sent at
//! its intended time whatever came back, its latency from that time (so a
//! stall's queue counts), ids in sequence. Shared by the failures and the
//! slowdowns benchmarks (and the slowness tests).

use std::{
    io::ErrorKind,
    net::{SocketAddr, UdpSocket},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Result, ensure};
use hdrhistogram::Histogram;

use super::{client::histogram, steady::Protocol};

/// What an open-loop load saw.
pub struct OpenLoopReport {
    pub sent: u64,
    /// Replies `good` said yes to.
    pub good: u64,
    /// Replies it said no to (an error answer, a wrong value).
    pub errors: u64,
    /// Latency of the good replies, microseconds.
    pub latency_us: Histogram<u64>,
}

impl OpenLoopReport {
    /// Reads with no good reply.
    pub fn failed(&self) -> u64 {
        self.sent - self.good
    }
}

/// Sends `request(id)` to `target` at `rate` for `duration`, then waits up
/// to `drain` for the stragglers; must run on a thread inside the client's
/// namespace. At most 65,536 reads (the ids must not wrap).
pub fn open_loop(
    target: SocketAddr,
    rate: u32,
    duration: Duration,
    drain: Duration,
    request: impl Fn(u16) -> Vec<u8>,
    good: impl Fn(&[u8]) -> bool + Send + 'static,
) -> Result<OpenLoopReport> {
    let total = (f64::from(rate) * duration.as_secs_f64()) as u64;
    ensure!(
        total <= u64::from(u16::MAX) + 1,
        "{total} reads: ids would wrap"
    );
    let sender = UdpSocket::bind("0.0.0.0:0")?;
    sender.connect(target)?;
    let socket = sender.try_clone()?;
    socket.set_read_timeout(Some(Duration::from_millis(20)))?;
    let table: Arc<Mutex<Vec<Option<Instant>>>> =
        Arc::new(Mutex::new(vec![None; u16::MAX as usize + 1]));
    let send_end = Arc::new(Mutex::new(None::<Instant>));
    let receiver = {
        let (table, send_end) = (table.clone(), send_end.clone());
        thread::spawn(move || -> Result<(u64, u64, Histogram<u64>)> {
            let (mut good_replies, mut errors, mut hist) = (0u64, 0u64, histogram());
            let mut buf = [0u8; 4096];
            loop {
                match socket.recv(&mut buf) {
                    Ok(n) => {
                        let now = Instant::now();
                        let reply = &buf[..n];
                        let Some(id) = Protocol::reply_id(reply) else {
                            continue;
                        };
                        // A second reply to one read (none expected) is
                        // not counted.
                        let Some(intended) = table.lock().unwrap()[id as usize].take() else {
                            continue;
                        };
                        if good(reply) {
                            good_replies += 1;
                            let us = now.duration_since(intended).as_micros() as u64;
                            hist.saturating_record(us.max(1));
                        } else {
                            errors += 1;
                        }
                    }
                    Err(e) if crate::receive::nothing_yet(&e) => {}
                    Err(e) => return Err(e.into()),
                }
                if crate::receive::done(&send_end, &table, drain) {
                    return Ok((good_replies, errors, hist));
                }
            }
        })
    };
    let start = Instant::now();
    let interval = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    for seq in 0..total {
        let intended = start + interval.mul_f64(seq as f64);
        if let Some(wait) = intended.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        let id = seq as u16;
        table.lock().unwrap()[id as usize] = Some(intended);
        match sender.send(&request(id)) {
            // A pending ICMP error instead of a send: the read is lost.
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
            r => {
                r?;
            }
        }
    }
    *send_end.lock().unwrap() = Some(Instant::now());
    let (good, errors, latency_us) = receiver
        .join()
        .map_err(|_| anyhow::anyhow!("the receiver panicked"))??;
    Ok(OpenLoopReport {
        sent: total,
        good,
        errors,
        latency_us,
    })
}
