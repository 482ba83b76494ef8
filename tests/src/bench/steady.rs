//! Latency with nothing stalling (`--only steady`): what a read pays for
//! the selector when there is nothing to steer around. One read at a time
//! from the client namespace to replica 0, paced (a read every
//! `1 / rate`, the next sent only after the last is answered), over a
//! connected socket as an application would: DNS queries to NSD (ids
//! scattered, as a resolver's) and memcached gets to memcached (ids in
//! order, as its clients number them), both real servers, on two replicas that
//! make up the agent's group. Attached to the client's interface during a
//! segment: nothing, the release agent in observe mode, the agent with
//! `--threshold 1` (both otherwise at their shipped defaults), or the
//! benchmark object's empty programs on the same TC hooks (the floor). The
//! four alternate in segments, the order rotating each round. A row's
//! figure is the median of its segments' medians; the target is at most
//! 2 us above the no-agent row's, for observe and threshold 1.
//!
//! The agent rows check that the agent saw what was measured: its status
//! must count at least every answered read as a request and a response of
//! the group, or the run fails (a group on the wrong port would otherwise
//! measure an idle agent).

use std::{
    fmt::Write as _,
    net::{SocketAddr, SocketAddrV4, UdpSocket},
    path::{Path, PathBuf},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use hdrhistogram::Histogram;

use super::{
    agent_process::{AgentChild, agent_status, check_agent, start_agent},
    median,
    scenario::check_interrupted,
};
use crate::{
    Testbed,
    dns::{DNS_PORT, Nsd, QTYPE_A, ZONE, query},
    memcached::{frame, key_for, parse_get_response, preload, value_for},
    netns::Namespace,
    topology::{CLIENT_IFACE, MEMCACHED_PORT, replica_addr},
};

/// How long a read waits for its answer before it counts as unanswered.
const REPLY_TIMEOUT: Duration = Duration::from_millis(100);
/// The most a row's median may exceed the no-agent row's (issue target).
pub const TARGET_NS: u64 = 2_000;

/// A protocol measured, with its real server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Dns,
    Memcached,
}

impl Protocol {
    pub const ALL: [Protocol; 2] = [Protocol::Dns, Protocol::Memcached];

    /// The id `--only` takes (`steady` selects both).
    pub fn id(self) -> &'static str {
        match self {
            Protocol::Dns => "steady_dns",
            Protocol::Memcached => "steady_memcached",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Protocol::Dns => "DNS A queries to NSD",
            Protocol::Memcached => "memcached gets to memcached",
        }
    }

    /// Whether `--only` names this protocol: its id, or `steady`. Never
    /// selected by an empty `--only`.
    pub fn selected_by(self, only: &[String]) -> bool {
        only.iter().any(|o| o == self.id() || o == "steady")
    }

    /// Whether `name` is one of these measurements' `--only` names.
    pub fn is_name(name: &str) -> bool {
        name == "steady" || Self::ALL.iter().any(|p| p.id() == name)
    }

    pub fn port(self) -> u16 {
        match self {
            Protocol::Dns => DNS_PORT,
            Protocol::Memcached => MEMCACHED_PORT,
        }
    }

    /// The agent's `--proto` (memcached is its default).
    fn agent_flags(self) -> &'static [&'static str] {
        match self {
            Protocol::Dns => &["--proto", "dns"],
            Protocol::Memcached => &[],
        }
    }

    /// The id of the `i`th read: in order for memcached (as its clients
    /// number requests), scattered for DNS (as resolvers pick ids, RFC
    /// 5452: an odd multiplier walks every 16-bit id in a jumbled order).
    fn request_id(self, i: u64, seed: u16) -> u16 {
        match self {
            Protocol::Dns => (i as u16).wrapping_mul(40_503).wrapping_add(seed),
            Protocol::Memcached => i as u16,
        }
    }

    pub fn request(self, id: u16) -> Vec<u8> {
        match self {
            Protocol::Dns => query(id, ZONE, QTYPE_A),
            Protocol::Memcached => frame(id, format!("get {}\r\n", key_for(0)).as_bytes()),
        }
    }

    /// The request id `reply` answers, if it is a datagram of this protocol.
    pub fn reply_id(reply: &[u8]) -> Option<u16> {
        (reply.len() >= 8).then(|| u16::from_be_bytes([reply[0], reply[1]]))
    }

    /// Whether `reply` is the right answer: NOERROR with an answer record,
    /// or the preloaded key's value.
    pub fn answered(self, reply: &[u8]) -> bool {
        match self {
            Protocol::Dns => {
                reply.len() >= 12
                    && reply[2] & 0x80 != 0
                    && reply[3] & 0x0f == 0
                    && u16::from_be_bytes([reply[6], reply[7]]) >= 1
            }
            Protocol::Memcached => {
                reply.get(8..).and_then(parse_get_response) == Some(value_for(0).as_bytes())
            }
        }
    }
}

/// What is attached to the client's interface during a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    Nothing,
    Observe,
    Threshold1,
    /// The benchmark object's empty TC programs.
    Empty,
}

impl Attached {
    pub const ALL: [Attached; 4] = [
        Attached::Nothing,
        Attached::Observe,
        Attached::Threshold1,
        Attached::Empty,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Attached::Nothing => "no agent",
            Attached::Observe => "observe",
            Attached::Threshold1 => "threshold 1",
            Attached::Empty => "empty programs",
        }
    }

    /// The agent's policy flags (`None`: no agent).
    fn policy_flags(self) -> Option<&'static [&'static str]> {
        match self {
            Attached::Observe => Some(&["--policy", "observe"]),
            Attached::Threshold1 => Some(&["--policy", "threshold", "--threshold", "1"]),
            Attached::Nothing | Attached::Empty => None,
        }
    }

    /// Whether the row has a target (the agent's rows).
    pub fn has_target(self) -> bool {
        self.policy_flags().is_some()
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct SteadyOptions {
    pub protocols: Vec<Protocol>,
    /// Reads per second (one at a time).
    pub rate: u32,
    pub segment: Duration,
    /// Segments per row.
    pub rounds: usize,
    /// The release `selector` binary.
    pub agent: PathBuf,
}

/// One row: a protocol with an attachment, over all its segments.
#[derive(Clone, Debug)]
pub struct RowLatency {
    pub protocol: Protocol,
    pub attached: Attached,
    pub reads: u64,
    /// Unanswered within `REPLY_TIMEOUT`, or a wrong answer.
    pub failed: u64,
    /// Every answered read's latency, nanoseconds.
    pub hist: Histogram<u64>,
    /// Each segment's median, nanoseconds, in run order.
    pub segment_p50: Vec<u64>,
    /// Reads the agent moved off the primary (agent rows).
    pub redirected: u64,
}

impl RowLatency {
    /// The median of the segments' medians, nanoseconds.
    pub fn p50(&self) -> u64 {
        median(self.segment_p50.iter().map(|&v| v as f64).collect()) as u64
    }
}

pub struct SteadyReport {
    pub command: String,
    pub opts: SteadyOptions,
    pub rows: Vec<RowLatency>,
}

fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 10_000_000_000, 3).expect("valid bounds")
}

/// Runs every selected protocol's rows on one testbed of two replicas,
/// each with NSD and memcached.
pub fn measure(o: &SteadyOptions, command: &str) -> Result<SteadyReport> {
    check_agent(&o.agent)?;
    ensure!(
        !o.protocols.is_empty(),
        "no steady-latency protocol selected"
    );
    ensure!(
        o.segment.as_secs_f64() * f64::from(o.rate) >= 1.0,
        "a segment of {:?} at {} reads/s holds no read: raise --steady-segment or --steady-rate",
        o.segment,
        o.rate
    );
    let mut tb = Testbed::new("stdy", 2)?;
    tb.start_memcached()?;
    let endpoints = tb.replica_endpoints();
    for r in &tb.replicas {
        r.wait_ready(&tb.client)?;
    }
    preload(&tb.client, &endpoints, 1)?;
    let mut nameservers = Vec::new();
    for (i, ns) in tb.replica_ns.iter().enumerate() {
        let nsd = Nsd::start(ns, (replica_addr(i), DNS_PORT))?;
        nsd.wait_ready(&tb.client)?;
        nameservers.push(nsd);
    }
    // The servers and the reading thread share one CPU (the last): where
    // the scheduler puts them otherwise changes from segment to segment
    // (a wakeup across CPUs or none), and with it a segment's median by
    // more than the 2 us measured.
    let cpu = serving_cpu();
    if let Some(cpu) = cpu {
        for ns in &tb.replica_ns {
            pin_namespace(ns, cpu)?;
        }
    }
    let mut rows: Vec<RowLatency> = o
        .protocols
        .iter()
        .flat_map(|&protocol| {
            Attached::ALL.map(|attached| RowLatency {
                protocol,
                attached,
                reads: 0,
                failed: 0,
                hist: latency_histogram(),
                segment_p50: Vec::new(),
                redirected: 0,
            })
        })
        .collect();
    for round in 0..o.rounds {
        let mut order = Attached::ALL;
        order.rotate_left(round % Attached::ALL.len());
        for &protocol in &o.protocols {
            for attached in order {
                check_interrupted()?;
                let seg = segment(&tb, o, protocol, attached, cpu)
                    .with_context(|| format!("{}, {}", protocol.label(), attached.label()))?;
                let p50 = seg.hist.value_at_quantile(0.5);
                eprintln!(
                    "bench: steady: round {}/{}: {}, {}: {} reads, {} failed, median {:.1} us",
                    round + 1,
                    o.rounds,
                    protocol.label(),
                    attached.label(),
                    seg.reads,
                    seg.failed,
                    p50 as f64 / 1000.0
                );
                let row = rows
                    .iter_mut()
                    .find(|r| r.protocol == protocol && r.attached == attached)
                    .expect("a row per protocol and attachment");
                row.reads += seg.reads;
                row.failed += seg.failed;
                row.hist.add(&seg.hist)?;
                row.segment_p50.push(p50);
                row.redirected += seg.redirected;
            }
        }
    }
    drop(nameservers);
    Ok(SteadyReport {
        command: command.to_string(),
        opts: o.clone(),
        rows,
    })
}

/// One segment's reads.
struct Segment {
    reads: u64,
    failed: u64,
    hist: Histogram<u64>,
    redirected: u64,
}

fn segment(
    tb: &Testbed,
    o: &SteadyOptions,
    protocol: Protocol,
    attached: Attached,
    cpu: Option<usize>,
) -> Result<Segment> {
    let group: Vec<String> = (0..tb.replica_ns.len())
        .map(|i| SocketAddrV4::new(replica_addr(i), protocol.port()).to_string())
        .collect();
    let agent = attached
        .policy_flags()
        .map(|policy| {
            let args: Vec<String> = ["--iface", CLIENT_IFACE, "--group", &group.join(",")]
                .into_iter()
                .chain(protocol.agent_flags().iter().copied())
                .chain(policy.iter().copied())
                .map(ToString::to_string)
                .collect();
            start_agent(&tb.client, &o.agent, &args)
        })
        .transpose()?;
    // Detached when dropped, after the segment.
    let _empty = if attached == Attached::Empty {
        Some(super::throughput::empty_programs(&tb.client)?)
    } else {
        None
    };
    let target = SocketAddr::V4(SocketAddrV4::new(replica_addr(0), protocol.port()));
    let (rate, length) = (o.rate, o.segment);
    let load = tb.client.run(move || {
        if let Some(cpu) = cpu {
            pin_task(0, cpu)?;
        }
        paced_reads(protocol, target, rate, length)
    })??;
    // A median of what little was answered would pass for a latency.
    ensure!(
        load.failed * 100 <= load.reads,
        "{} of {} reads unanswered or answered wrong: nothing is steady here",
        load.failed,
        load.reads
    );
    let redirected = match agent {
        Some(child) => agent_saw(&tb.client, &o.agent, child, &load)?,
        None => 0,
    };
    Ok(Segment { redirected, ..load })
}

/// The CPU the servers and the reader share: the last this process may
/// run on, if it may run on two or more.
fn serving_cpu() -> Option<usize> {
    // SAFETY: a zeroed cpu_set_t filled by the kernel, read with its macros.
    let allowed: Vec<usize> = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&cpu| libc::CPU_ISSET(cpu, &set))
            .collect()
    };
    (allowed.len() >= 2).then(|| allowed[allowed.len() - 1])
}

/// Pins task `tid` (0: the calling thread) to `cpu`.
fn pin_task(tid: i32, cpu: usize) -> Result<()> {
    // SAFETY: a zeroed cpu_set_t with one bit set, passed with its size.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        ensure!(
            libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0,
            "pinning task {tid} to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

/// Pins every thread of every process in `ns` to `cpu`.
fn pin_namespace(ns: &Namespace, cpu: usize) -> Result<()> {
    let pids = crate::netns::pids_in(&ns.name);
    ensure!(!pids.is_empty(), "no process in {}", ns.name);
    for pid in pids {
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
            let tid: i32 = task?.file_name().to_string_lossy().parse()?;
            pin_task(tid, cpu)?;
        }
    }
    Ok(())
}

/// The agent's status must count every answered read of the segment as a
/// request and a response; then the agent is stopped. Reads it moved.
fn agent_saw(client: &Namespace, agent: &Path, child: AgentChild, load: &Segment) -> Result<u64> {
    let status = agent_status(client, agent);
    drop(child);
    let status = status?;
    let sum = |f: fn(&selector_common::BackendStats) -> u64| -> u64 {
        status.backends.iter().map(|b| f(&b.stats)).sum()
    };
    let answered = load.reads - load.failed;
    let (requests, responses) = (sum(|s| s.requests), sum(|s| s.responses));
    ensure!(
        requests >= answered && responses >= answered,
        "the agent counted {requests} requests and {responses} responses for {answered} \
         answered reads: it did not see the measured traffic"
    );
    Ok(sum(|s| s.redirected_away))
}

/// Runs on a thread in the client namespace: a read every `1 / rate` for
/// `length`, each sent after the last was answered (or timed out), its
/// latency from just before the send to its answer.
fn paced_reads(
    protocol: Protocol,
    target: SocketAddr,
    rate: u32,
    length: Duration,
) -> Result<Segment> {
    let socket = UdpSocket::bind("0.0.0.0:0")?;
    socket.connect(target)?;
    socket.set_read_timeout(Some(REPLY_TIMEOUT))?;
    let interval = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
    let total = (length.as_secs_f64() * f64::from(rate)) as u64;
    let mut hist = latency_histogram();
    let (mut failed, mut buf) = (0, [0u8; 2048]);
    let start = Instant::now();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as u16);
    for i in 0..total {
        if let Some(wait) =
            (start + interval.mul_f64(i as f64)).checked_duration_since(Instant::now())
        {
            thread::sleep(wait);
        }
        let id = protocol.request_id(i, seed);
        let request = protocol.request(id);
        let sent = Instant::now();
        if socket.send(&request).is_err() {
            // A queued ICMP error (nothing listening): this read fails.
            failed += 1;
            continue;
        }
        let mut shortened = false;
        let answer = loop {
            match socket.recv(&mut buf) {
                Ok(n) if Protocol::reply_id(&buf[..n]) == Some(id) => {
                    break Some((sent.elapsed(), protocol.answered(&buf[..n])));
                }
                // A late answer to an earlier read: wait out only what is
                // left of this one's time.
                Ok(_) => match REPLY_TIMEOUT.checked_sub(sent.elapsed()) {
                    Some(left) if !left.is_zero() => {
                        socket.set_read_timeout(Some(left))?;
                        shortened = true;
                    }
                    _ => break None,
                },
                Err(_) => break None,
            }
        };
        if shortened {
            socket.set_read_timeout(Some(REPLY_TIMEOUT))?;
        }
        match answer {
            Some((latency, true)) => {
                hist.saturating_record(latency.as_nanos() as u64);
            }
            _ => failed += 1,
        }
    }
    Ok(Segment {
        reads: total,
        failed,
        hist,
        redirected: 0,
    })
}

impl SteadyReport {
    /// The no-agent row of `protocol`.
    fn baseline(&self, protocol: Protocol) -> Option<&RowLatency> {
        self.rows
            .iter()
            .find(|r| r.protocol == protocol && r.attached == Attached::Nothing)
    }

    /// A row's median minus its protocol's no-agent median, nanoseconds.
    pub fn above_no_agent(&self, row: &RowLatency) -> Option<i64> {
        self.baseline(row.protocol)
            .map(|b| row.p50() as i64 - b.p50() as i64)
    }

    pub fn markdown(&self) -> String {
        let o = &self.opts;
        let us = |ns: u64| format!("{:.1}", ns as f64 / 1000.0);
        let mut md = String::new();
        let _ = writeln!(md, "\n## Latency with nothing stalling\n");
        let _ = writeln!(md, "Command: `{}`\n", self.command);
        let _ = writeln!(
            md,
            "One read at a time from the client to replica 0 over a connected socket, {} a \
             second, latency from the send to the answer; {} segments of {:.1} s per row, the \
             rows of a protocol interleaved (order rotating each round). The agent at its \
             shipped defaults but `--policy`, its group the two replicas; empty programs: the \
             benchmark object's on the same TC hooks (the floor). Figure: the median of the \
             segments' medians. Target: observe and threshold 1 at most {} us above no agent.\n",
            o.rate,
            o.rounds,
            o.segment.as_secs_f64(),
            TARGET_NS / 1000
        );
        let _ = writeln!(
            md,
            "| protocol | row | reads | failed | median (us) | above no agent (us) | target met | p90 (us) | p99 (us) | segment medians (us) | moved |\n|---|---|---:|---:|---:|---:|---|---:|---:|---|---:|"
        );
        for r in &self.rows {
            let above = self.above_no_agent(r);
            let met = match (r.attached.has_target(), above) {
                (true, Some(ns)) if ns <= TARGET_NS as i64 => "yes",
                (true, Some(_)) => "no",
                _ => "-",
            };
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {met} | {} | {} | {} | {} |",
                r.protocol.label(),
                r.attached.label(),
                r.reads,
                r.failed,
                us(r.p50()),
                above.map_or("-".into(), |ns| format!("{:+.1}", ns as f64 / 1000.0)),
                us(r.hist.value_at_quantile(0.9)),
                us(r.hist.value_at_quantile(0.99)),
                r.segment_p50
                    .iter()
                    .map(|&v| us(v))
                    .collect::<Vec<_>>()
                    .join(", "),
                if r.attached.has_target() {
                    r.redirected.to_string()
                } else {
                    "-".into()
                }
            );
        }
        md
    }

    pub fn csv(&self) -> String {
        let mut csv = String::from("id,attached,segment,median_ns\n");
        for r in &self.rows {
            for (i, v) in r.segment_p50.iter().enumerate() {
                let _ = writeln!(
                    csv,
                    "{},{},{},{v}",
                    r.protocol.id(),
                    r.attached.label(),
                    i + 1
                );
            }
        }
        csv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocols_are_selected_by_id_or_by_steady_and_never_by_default() {
        let only = |s: &[&str]| s.iter().map(ToString::to_string).collect::<Vec<_>>();
        assert!(
            Protocol::ALL
                .iter()
                .all(|p| p.selected_by(&only(&["steady"])))
        );
        assert!(!Protocol::Dns.selected_by(&[]));
        assert!(Protocol::Dns.selected_by(&only(&["steady_dns"])));
        assert!(!Protocol::Memcached.selected_by(&only(&["steady_dns", "throughput"])));
        assert!(Protocol::is_name("steady_memcached"));
        assert!(!Protocol::is_name("no_stall"));
    }

    #[test]
    fn only_right_answers_count() {
        let mut dns = query(7, ZONE, QTYPE_A);
        assert!(!Protocol::Dns.answered(&dns), "a query is no answer");
        dns[2] |= 0x80;
        assert!(!Protocol::Dns.answered(&dns), "no answer record");
        dns[7] = 1;
        assert!(Protocol::Dns.answered(&dns));
        dns[3] |= 2;
        assert!(!Protocol::Dns.answered(&dns), "SERVFAIL");
        let value = value_for(0);
        let body = format!(
            "VALUE {} 0 {}\r\n{value}\r\nEND\r\n",
            key_for(0),
            value.len()
        );
        assert!(Protocol::Memcached.answered(&frame(7, body.as_bytes())));
        assert!(!Protocol::Memcached.answered(&frame(7, b"SERVER_ERROR busy\r\n")));
        assert!(!Protocol::Memcached.answered(&frame(7, b"END\r\n")));
        assert_eq!(Protocol::reply_id(&frame(7, b"END\r\n")), Some(7));
    }
}
