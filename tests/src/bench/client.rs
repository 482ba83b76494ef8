//! One benchmark client process: an open-loop memcached UDP reader on
//! connected sockets, with the client-side policies users would pick
//! instead of the selector (BookKeeper's issue-709 slow list with
//! speculative retry, and issue-1489 reordering by per-process pending
//! counts).
//!
//! The parent starts several of these in the client namespace (the hidden
//! `client` subcommand of `selector-bench`), all on one schedule: process
//! `c` of `C` sends read `i` at `start + (i + c/C) * C/rate`, so together
//! they send at `rate`, evenly spaced. Latency runs from that intended send
//! time, so a stalled replica or a late sender is never hidden (no
//! coordinated omission).
//!
//! Which replica served a read: every replica holds its own marked value
//! for each key (`marked_value`), so the reply's data names the replica that
//! answered, whatever rewrote the addresses on the way (the selector, nginx).

use std::{
    collections::VecDeque,
    io::ErrorKind,
    net::{SocketAddrV4, UdpSocket},
    os::fd::AsRawFd as _,
};

use anyhow::{Context as _, Result, bail};
use hdrhistogram::{
    Histogram,
    serialization::{Deserializer, Serializer as _, V2Serializer},
};
use selector_common::{Policy, policy::GroupLoad};
use serde::{Deserialize, Serialize};

use crate::memcached::{frame, key_for, parse_get_response};

/// Where a client process decides which replica a read goes to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientPolicy {
    /// Every read to `targets[0]` (the primary, a proxy, or the primary
    /// with the selector steering underneath).
    Primary,
    /// BookKeeper issue 709: a read not answered within `timeout_ms` is
    /// sent again to the next replica, and the replica that did not answer
    /// goes on the slow list for `expiry_ms`; slow replicas are tried last.
    SlowList { timeout_ms: u64, expiry_ms: u64 },
    /// BookKeeper issue 1489 in this process: pending reads per replica,
    /// counted by this process alone; a read leaves the primary when
    /// `pending[primary] >= pending[best] + threshold`.
    Reorder { threshold: u32 },
}

/// What one client process does.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ClientSpec {
    /// This process's index and how many run together.
    pub index: usize,
    pub clients: usize,
    pub policy: ClientPolicy,
    /// Connected sockets, one per target, in preference order.
    pub targets: Vec<SocketAddrV4>,
    /// Replicas whose marks may appear in replies.
    pub replicas: usize,
    /// Reads per second of all processes together.
    pub rate: f64,
    /// CLOCK_MONOTONIC time of the first intended send.
    pub start_ns: u64,
    pub duration_ms: u64,
    /// After the last send, how long to wait for stragglers.
    pub drain_ms: u64,
    /// A read unanswered this long is lost (recorded at this latency).
    pub request_timeout_ms: u64,
    pub keys: usize,
    /// Reads intended to be sent in this CLOCK_MONOTONIC window (start,
    /// end) also have their replies' latency recorded apart (the overload
    /// scenario's stop window).
    #[serde(default)]
    pub window_ns: Option<(u64, u64)>,
}

/// Counts of what happened to the reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub sent: u64,
    pub received: u64,
    /// Reads never answered within the request timeout.
    pub lost: u64,
    /// Replies that were `SERVER_ERROR` (the selector's overload reject),
    /// counted in `received` too.
    pub rejected: u64,
    /// Replies whose data was not a marked value of the key asked for
    /// (nor a `SERVER_ERROR`).
    pub wrong: u64,
    /// Replies to reads already answered or given up (a speculative
    /// retry's loser, or a reply after the timeout).
    pub late: u64,
    /// Speculative retries sent (slow list).
    pub retries: u64,
    /// How far behind its schedule the sender fell, at most.
    pub max_send_lag_us: u64,
    /// Sends more than 1 ms behind their intended time.
    pub late_sends: u64,
}

impl Counts {
    pub fn add(&mut self, o: &Self) {
        self.sent += o.sent;
        self.received += o.received;
        self.lost += o.lost;
        self.rejected += o.rejected;
        self.wrong += o.wrong;
        self.late += o.late;
        self.retries += o.retries;
        self.max_send_lag_us = self.max_send_lag_us.max(o.max_send_lag_us);
        self.late_sends += o.late_sends;
    }
}

/// What one client process saw.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClientReport {
    pub counts: Counts,
    /// HDR histogram of latency in microseconds, V2 format, hex.
    pub histogram: String,
    /// The same, of the `SERVER_ERROR` replies only.
    #[serde(default)]
    pub rejected_histogram: String,
    /// The same, of the replies to reads intended in `ClientSpec::window_ns`.
    #[serde(default)]
    pub window_histogram: String,
    /// Per replica, reads it answered, by intended send time in 1 ms bins.
    pub served: Vec<Vec<u32>>,
}

/// The value replica `replica` holds for key `i`: same length everywhere.
pub fn marked_value(i: usize, replica: usize) -> String {
    format!("v{i:06}-replica-{replica}-{}", "x".repeat(12))
}

/// The replica whose mark a reply carries for key `i`, if it is one.
pub fn replica_of(data: &[u8], i: usize) -> Option<usize> {
    let text = std::str::from_utf8(data).ok()?;
    let rest = text.strip_prefix(&format!("v{i:06}-replica-"))?;
    let (digits, pad) = rest.split_once('-')?;
    let replica = digits.parse().ok()?;
    (pad == "x".repeat(12)).then_some(replica)
}

pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")
}

pub fn encode_histogram(h: &Histogram<u64>) -> Result<String> {
    let mut bytes = Vec::new();
    V2Serializer::new()
        .serialize(h, &mut bytes)
        .map_err(|e| anyhow::anyhow!("serializing a histogram: {e:?}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

pub fn decode_histogram(hex: &str) -> Result<Histogram<u64>> {
    if !hex.len().is_multiple_of(2) {
        bail!("odd-length histogram encoding");
    }
    let bytes = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()?;
    Deserializer::new()
        .deserialize(&mut &bytes[..])
        .map_err(|e| anyhow::anyhow!("reading a histogram: {e:?}"))
}

/// Entry point of the hidden `client` subcommand: runs `spec` (JSON) and
/// prints the report (JSON) on stdout.
pub fn main(spec_json: &str) -> Result<()> {
    let spec: ClientSpec = serde_json::from_str(spec_json).context("client spec")?;
    let report = run(&spec)?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

const ID_SPACE: usize = u16::MAX as usize + 1;

/// One outstanding read, by request id.
#[derive(Clone, Copy, Default)]
struct Slot {
    active: bool,
    /// Bumped on each reuse, so queued timers of an earlier read are ignored.
    generation: u32,
    intended_ns: u64,
    key: usize,
    /// Targets this read was sent to (bit per target) and the latest one.
    tried: u8,
    last: usize,
}

/// Per-process routing state of the client-side policies.
struct Router {
    policy: ClientPolicy,
    /// Reads sent to each target and not yet answered or given up.
    pending: Vec<u64>,
    /// Slow list: a target is slow until this time.
    slow_until: Vec<u64>,
}

impl Router {
    fn new(policy: ClientPolicy, targets: usize) -> Self {
        Self {
            policy,
            pending: vec![0; targets],
            slow_until: vec![0; targets],
        }
    }

    /// Targets in the order the slow list tries them: not slow first,
    /// each part in preference order.
    fn slow_list_order(&self, now: u64) -> impl Iterator<Item = usize> + '_ {
        let n = self.slow_until.len();
        let fast = (0..n).filter(move |&t| self.slow_until[t] <= now);
        let slow = (0..n).filter(move |&t| self.slow_until[t] > now);
        fast.chain(slow)
    }

    /// The target of a new read.
    fn first_target(&self, now: u64) -> usize {
        match &self.policy {
            ClientPolicy::Primary => 0,
            ClientPolicy::SlowList { .. } => self.slow_list_order(now).next().unwrap_or(0),
            ClientPolicy::Reorder { threshold } => {
                let mut load = GroupLoad {
                    len: self.pending.len(),
                    usable: ((1u16 << self.pending.len()) - 1) as u8,
                    ..GroupLoad::default()
                };
                load.pending[..self.pending.len()].copy_from_slice(&self.pending);
                // The same rule the kernel applies, on this process's counts.
                selector_common::policy::choose(Policy::Threshold, *threshold, 0, &load)
            }
        }
    }

    /// Slow list: `target` missed the speculative timeout. Returns the
    /// next target to try, if one is left.
    fn on_speculative_timeout(&mut self, slot: &Slot, now: u64) -> Option<usize> {
        let ClientPolicy::SlowList { expiry_ms, .. } = self.policy else {
            return None;
        };
        self.slow_until[slot.last] = now + expiry_ms * 1_000_000;
        self.slow_list_order(now)
            .find(|t| slot.tried & (1 << t) == 0)
    }
}

/// The open loop. Single-threaded: it sends what is due, fires timers,
/// then waits in ppoll for replies or the next due time.
pub fn run(spec: &ClientSpec) -> Result<ClientReport> {
    if spec.targets.is_empty() || spec.targets.len() > 8 || spec.clients == 0 || spec.rate <= 0.0 {
        bail!("bad client spec");
    }
    set_timer_slack();
    let sockets = spec
        .targets
        .iter()
        .map(|t| connect(*t))
        .collect::<Result<Vec<_>>>()?;
    let mut fds: Vec<libc::pollfd> = sockets
        .iter()
        .map(|s| libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();

    let interval_ns = 1e9 * spec.clients as f64 / spec.rate;
    let total = (spec.duration_ms as f64 * 1e6 / interval_ns) as u64;
    let phase_ns = interval_ns * spec.index as f64 / spec.clients as f64;
    let intended = |i: u64| spec.start_ns + (phase_ns + interval_ns * i as f64) as u64;
    let timeout_ns = spec.request_timeout_ms * 1_000_000;
    let speculative_ns = match spec.policy {
        ClientPolicy::SlowList { timeout_ms, .. } => Some(timeout_ms * 1_000_000),
        _ => None,
    };
    let bins = spec.duration_ms as usize + 1;

    let mut router = Router::new(spec.policy.clone(), sockets.len());
    let mut slots = vec![Slot::default(); ID_SPACE];
    let mut speculative: VecDeque<(u64, u16, u32)> = VecDeque::new();
    let mut expiry: VecDeque<(u64, u16, u32)> = VecDeque::new();
    let mut hist = histogram();
    let mut rejected_hist = histogram();
    let mut window_hist = histogram();
    let mut served = vec![vec![0u32; bins]; spec.replicas];
    let mut report = ClientReport::default();
    let mut outstanding = 0u64;
    let mut buf = [0u8; 2048];
    let mut next = 0u64;
    let send_end = intended(total.max(1) - 1);

    let send = |socket: &UdpSocket, id: u16, key: usize| -> bool {
        let request = frame(id, format!("get {}\r\n", key_for(key)).as_bytes());
        // A refused send is a pending ICMP error from an earlier datagram;
        // the read is then left to time out, as an application would see.
        socket.send(&request).is_ok()
    };

    loop {
        let now = monotonic_ns();
        // Sends that are due.
        while next < total && intended(next) <= now {
            let at = intended(next);
            let lag_us = (now - at) / 1000;
            report.counts.max_send_lag_us = report.counts.max_send_lag_us.max(lag_us);
            report.counts.late_sends += u64::from(lag_us > 1000);
            let id = (next % ID_SPACE as u64) as u16;
            let slot = &mut slots[id as usize];
            if slot.active {
                // The id wrapped while a read was still out: it is lost.
                give_up(slot, &mut router, &mut hist, &mut report, timeout_ns);
                outstanding -= 1;
            }
            let target = router.first_target(now);
            let key = (next as usize * spec.clients + spec.index) % spec.keys.max(1);
            *slot = Slot {
                active: true,
                generation: slot.generation.wrapping_add(1),
                intended_ns: at,
                key,
                tried: 1 << target,
                last: target,
            };
            router.pending[target] += 1;
            outstanding += 1;
            send(&sockets[target], id, key);
            report.counts.sent += 1;
            if let Some(after) = speculative_ns {
                speculative.push_back((now + after, id, slot.generation));
            }
            expiry.push_back((at + timeout_ns, id, slot.generation));
            next += 1;
        }
        // Speculative retries that are due (slow list).
        while let Some(&(deadline, id, generation)) = speculative.front() {
            if deadline > now {
                break;
            }
            speculative.pop_front();
            let slot = &mut slots[id as usize];
            if !slot.active || slot.generation != generation {
                continue;
            }
            if let Some(t) = router.on_speculative_timeout(slot, now) {
                slot.tried |= 1 << t;
                slot.last = t;
                send(&sockets[t], id, slot.key);
                report.counts.retries += 1;
                if let Some(after) = speculative_ns {
                    speculative.push_back((now + after, id, generation));
                }
            }
        }
        // Reads that timed out.
        while let Some(&(deadline, id, generation)) = expiry.front() {
            if deadline > now {
                break;
            }
            expiry.pop_front();
            let slot = &mut slots[id as usize];
            if slot.active && slot.generation == generation {
                give_up(slot, &mut router, &mut hist, &mut report, timeout_ns);
                outstanding -= 1;
            }
        }
        let drain_end = send_end + spec.drain_ms * 1_000_000;
        if next >= total && (outstanding == 0 || now >= drain_end) {
            break;
        }

        // Wait for a reply or the next due time.
        let mut wake = drain_end;
        if next < total {
            wake = wake.min(intended(next));
        }
        if let Some(&(d, _, _)) = speculative.front() {
            wake = wake.min(d);
        }
        if let Some(&(d, _, _)) = expiry.front() {
            wake = wake.min(d);
        }
        let wait = wake.saturating_sub(monotonic_ns());
        let ts = libc::timespec {
            tv_sec: (wait / 1_000_000_000) as libc::time_t,
            tv_nsec: (wait % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: valid pollfd array and timespec.
        let ready = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as _, &ts, std::ptr::null()) };
        if ready <= 0 {
            continue;
        }
        for (t, socket) in sockets.iter().enumerate() {
            if fds[t].revents == 0 {
                continue;
            }
            fds[t].revents = 0;
            loop {
                let n = match socket.recv(&mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::ConnectionRefused => continue,
                    Err(e) => return Err(e.into()),
                };
                if n < 8 {
                    continue;
                }
                let now = monotonic_ns();
                let id = u16::from_be_bytes([buf[0], buf[1]]) as usize;
                let slot = &mut slots[id];
                if !slot.active {
                    report.counts.late += 1;
                    continue;
                }
                slot.active = false;
                outstanding -= 1;
                router.pending[slot.last] = router.pending[slot.last].saturating_sub(1);
                report.counts.received += 1;
                let us = ((now - slot.intended_ns) / 1000).max(1);
                hist.saturating_record(us);
                if spec
                    .window_ns
                    .is_some_and(|(from, to)| (from..to).contains(&slot.intended_ns))
                {
                    window_hist.saturating_record(us);
                }
                if is_server_error(&buf[8..n]) {
                    report.counts.rejected += 1;
                    rejected_hist.saturating_record(us);
                    continue;
                }
                let replica = parse_get_response(&buf[8..n]).and_then(|d| replica_of(d, slot.key));
                match replica {
                    Some(r) if r < served.len() => {
                        let bin = ((slot.intended_ns - spec.start_ns) / 1_000_000) as usize;
                        served[r][bin.min(bins - 1)] += 1;
                    }
                    _ => report.counts.wrong += 1,
                }
            }
        }
    }
    for slot in slots.iter_mut().filter(|s| s.active) {
        give_up(slot, &mut router, &mut hist, &mut report, timeout_ns);
    }
    report.histogram = encode_histogram(&hist)?;
    report.rejected_histogram = encode_histogram(&rejected_hist)?;
    report.window_histogram = encode_histogram(&window_hist)?;
    report.served = served;
    Ok(report)
}

/// A memcached error reply (what the selector's `reject` answers with).
pub fn is_server_error(body: &[u8]) -> bool {
    body.starts_with(b"SERVER_ERROR")
}

/// A read that will not be answered in time: lost, recorded at the timeout.
fn give_up(
    slot: &mut Slot,
    router: &mut Router,
    hist: &mut Histogram<u64>,
    report: &mut ClientReport,
    timeout_ns: u64,
) {
    slot.active = false;
    router.pending[slot.last] = router.pending[slot.last].saturating_sub(1);
    report.counts.lost += 1;
    hist.saturating_record((timeout_ns / 1000).max(1));
}

fn connect(target: SocketAddrV4) -> Result<UdpSocket> {
    let socket = UdpSocket::bind("0.0.0.0:0")?;
    socket.connect(target)?;
    socket.set_nonblocking(true)?;
    // Room for every reply of a stall's backlog while this process waits.
    let size: libc::c_int = 4 << 20;
    // SAFETY: valid socket and option value; as root, FORCE lifts rmem_max.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            &size as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    Ok(socket)
}

/// Sleeps end within microseconds of their deadline (the default slack
/// is 50 us, which would add to every intended-time latency).
fn set_timer_slack() {
    // SAFETY: prctl with a plain integer argument.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong) };
}

pub fn monotonic_ns() -> u64 {
    selector_user::host::sys::monotonic_ns()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_name_the_replica_and_the_key() {
        let v = marked_value(42, 2);
        assert_eq!(v.len(), marked_value(42, 0).len());
        assert_eq!(replica_of(v.as_bytes(), 42), Some(2));
        assert_eq!(replica_of(v.as_bytes(), 43), None);
        assert_eq!(replica_of(b"value-000042", 42), None);
    }

    #[test]
    fn server_errors_are_told_from_values() {
        assert!(is_server_error(b"SERVER_ERROR overloaded\r\n"));
        assert!(!is_server_error(b"VALUE k 0 3\r\nabc\r\nEND\r\n"));
        assert!(!is_server_error(b"END\r\n"));
    }

    #[test]
    fn histograms_round_trip() {
        let mut h = histogram();
        h.record(120).unwrap();
        h.record(25_000).unwrap();
        let back = decode_histogram(&encode_histogram(&h).unwrap()).unwrap();
        assert_eq!(back.len(), 2);
        assert_eq!(back.max(), h.max());
    }

    #[test]
    fn slow_list_tries_slow_replicas_last_and_expires() {
        let mut r = Router::new(
            ClientPolicy::SlowList {
                timeout_ms: 30,
                expiry_ms: 1000,
            },
            3,
        );
        assert_eq!(r.first_target(0), 0);
        let slot = Slot {
            tried: 1,
            last: 0,
            ..Slot::default()
        };
        // The primary missed the timeout: retry on the next, primary slow.
        assert_eq!(r.on_speculative_timeout(&slot, 10), Some(1));
        assert_eq!(r.first_target(20), 1);
        assert_eq!(r.slow_list_order(20).collect::<Vec<_>>(), vec![1, 2, 0]);
        // After the expiry the primary is first again.
        assert_eq!(r.first_target(10 + 1_000_000_000), 0);
    }

    #[test]
    fn reorder_uses_the_bookkeeper_rule_on_local_counts() {
        let mut r = Router::new(ClientPolicy::Reorder { threshold: 2 }, 3);
        r.pending = vec![1, 0, 0];
        assert_eq!(r.first_target(0), 0);
        r.pending = vec![2, 0, 1];
        assert_eq!(r.first_target(0), 1);
    }
}
