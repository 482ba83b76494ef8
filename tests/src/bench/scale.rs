//! The scale measurement (`--only scale`): 64 groups of 8 members and an
//! in-flight table sized for 1 M requests.
//!
//! - **Sweep and telemetry cost**, in this process: the programs loaded
//!   (not attached) with that configuration, the table filled with live
//!   requests, and the agent's per-interval work timed: one sweep (which
//!   visits the marked slots), one telemetry snapshot (what the live table
//!   and `status` read), and the sweep that expires every request at once.
//! - **Agent CPU under load**: the release `selector run` in a client
//!   namespace, real UDP requests at a fixed rate (100 k/s by default) from
//!   this process spread over the 64 primaries, and a responder in a server
//!   namespace answering every request (or none, so every request expires
//!   and the table holds rate x timeout). The agent's CPU is its
//!   utime + stime from /proc/PID/stat over a window.

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddrV4, UdpSocket},
    os::fd::AsRawFd as _,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, ensure};
use selector_common::{InflightKey, MAX_GROUP_MEMBERS, MAX_GROUPS};
use selector_user::{Selector, Settings, host::sys};

use super::{
    agent_process::{AgentChild, check_agent, start_agent},
    median,
};
use crate::{
    memcached::frame,
    netns::{Namespace, unique_tag},
};

const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 88, 0, 1);
const SERVER: Ipv4Addr = Ipv4Addr::new(10, 88, 0, 2);
const FIRST_PORT: u16 = 20_000;
const IFACE: &str = "eth0";

/// What to measure.
#[derive(Clone, Debug)]
pub struct ScaleOptions {
    /// The agent's `--inflight-max` (the table gets four times as many slots).
    pub inflight_max: u32,
    /// Live requests planted for the in-process sweep and telemetry timing.
    pub planted: u32,
    /// Requests per second of the load.
    pub rate: u32,
    /// Length of the CPU window (after a warm-up of 2 s).
    pub window: Duration,
    /// The release `selector` binary.
    pub agent: PathBuf,
}

/// The in-process timings, ms (medians of several runs).
#[derive(Clone, Debug)]
pub struct IntervalCost {
    pub slots: usize,
    pub planted: u32,
    /// The first sweep with every planted request live and none stale:
    /// it reads each of them.
    pub sweep_live_first_ms: f64,
    /// The sweeps after it (none due: their words are skipped).
    pub sweep_live_ms: f64,
    /// A telemetry snapshot (counters, histograms, in-flight count).
    pub snapshot_ms: f64,
    /// The sweep that expires every planted request.
    pub sweep_expire_all_ms: f64,
    /// A sweep of the table once empty (the mark words alone).
    pub sweep_empty_ms: f64,
}

/// One load run with the agent attached.
#[derive(Clone, Debug)]
pub struct CpuRun {
    pub answered: bool,
    pub sent_per_s: f64,
    pub replies_per_s: f64,
    /// Agent CPU over the window, as a share of one core.
    pub cpu_share: f64,
}

#[derive(Clone, Debug)]
pub struct ScaleReport {
    pub command: String,
    pub opts: ScaleOptions,
    pub cost: IntervalCost,
    pub idle: CpuRun,
    pub runs: Vec<CpuRun>,
}

/// The 64 x 8 backends: group g member m at SERVER:(20000 + 8g + m).
fn groups() -> Vec<Vec<SocketAddrV4>> {
    (0..MAX_GROUPS as u16)
        .map(|g| {
            (0..MAX_GROUP_MEMBERS as u16)
                .map(|m| SocketAddrV4::new(SERVER, FIRST_PORT + g * 8 + m))
                .collect()
        })
        .collect()
}

fn time_ms(f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let start = Instant::now();
    f()?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

/// Times the agent's per-interval work on a loaded, unattached selector.
fn interval_cost(o: &ScaleOptions) -> Result<IntervalCost> {
    let settings = Settings {
        inflight_max: o.inflight_max,
        ..Settings::new(
            "lo",
            groups()
                .into_iter()
                .map(|g| g.into_iter().map(Into::into).collect())
                .collect(),
        )
    };
    let mut sel = Selector::load(&settings).context("loading the programs")?;
    let now = sys::monotonic_ns();
    let mut planted = 0u32;
    let mut tried = 0u32;
    while planted < o.planted {
        ensure!(
            tried - planted <= o.planted / 100 + 100,
            "in-flight table too full to plant {} requests",
            o.planted
        );
        let key = InflightKey::ipv4(
            [10, 89, (tried >> 24) as u8, (tried >> 16) as u8],
            (tried & 0xffff) as u16,
            tried % MAX_GROUPS,
            u64::from(tried),
        );
        let backend = (tried % MAX_GROUPS) * MAX_GROUP_MEMBERS as u32;
        if sel.plant_inflight(&key, backend, backend, now) {
            sel.add_to_issued(backend, 1);
            planted += 1;
        }
        tried += 1;
    }
    let slots = selector_common::inflight::slots_for(o.inflight_max) as usize;
    let mut sweeps = Vec::new();
    let mut snapshots = Vec::new();
    for _ in 0..5 {
        // The first visits every request; the others skip words whose
        // requests are not due yet (`SweepSchedule`).
        let first = sweeps.is_empty();
        sweeps.push(time_ms(|| {
            let r = sel.sweep(now)?;
            ensure!(r.expired == 0, "a fresh request expired");
            ensure!(
                !first || r.visited == u64::from(planted),
                "the first sweep visited {} of {planted}",
                r.visited
            );
            Ok(())
        })?);
        snapshots.push(time_ms(|| {
            let s = sel.snapshot()?;
            ensure!(
                s.inflight == planted as usize,
                "in-flight count {}",
                s.inflight
            );
            Ok(())
        })?);
    }
    let later = now + 3_600_000_000_000;
    let sweep_expire_all_ms = time_ms(|| {
        let r = sel.sweep(later)?;
        ensure!(
            r.expired == u64::from(planted),
            "expired {} of {planted}",
            r.expired
        );
        Ok(())
    })?;
    let mut empty = Vec::new();
    for _ in 0..5 {
        empty.push(time_ms(|| sel.sweep(later).map(drop))?);
    }
    Ok(IntervalCost {
        slots,
        planted,
        sweep_live_first_ms: sweeps[0],
        sweep_live_ms: median(sweeps[1..].to_vec()),
        snapshot_ms: median(snapshots),
        sweep_expire_all_ms,
        sweep_empty_ms: median(empty),
    })
}

/// Client and server namespaces joined by a veth pair.
struct Pair {
    client: Namespace,
    server: Namespace,
}

impl Pair {
    fn new() -> Result<Self> {
        let tag = unique_tag();
        let client = Namespace::create(&format!("scale-{tag}-c"))?;
        let server = Namespace::create(&format!("scale-{tag}-s"))?;
        client.ip(&[
            "link",
            "add",
            IFACE,
            "type",
            "veth",
            "peer",
            "name",
            IFACE,
            "netns",
            &server.name,
        ])?;
        for (ns, addr) in [(&client, CLIENT), (&server, SERVER)] {
            ns.ip(&["addr", "add", &format!("{addr}/24"), "dev", IFACE])?;
            ns.ip(&["link", "set", IFACE, "up"])?;
        }
        Ok(Self { client, server })
    }
}

/// Echoes every datagram to every backend port back from that port: a
/// one-datagram memcached reply with the request's id (the header is
/// echoed). Runs until `stop`.
fn respond(stop: Arc<AtomicBool>) -> Result<()> {
    let sockets: Vec<UdpSocket> = groups()
        .iter()
        .flatten()
        .map(|&a| {
            let s = UdpSocket::bind(a)?;
            s.set_nonblocking(true)?;
            Ok(s)
        })
        .collect::<Result<_>>()?;
    // SAFETY: plain epoll calls on descriptors this function owns.
    let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    ensure!(
        epoll >= 0,
        "epoll_create1: {}",
        std::io::Error::last_os_error()
    );
    for (i, s) in sockets.iter().enumerate() {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: i as u64,
        };
        // SAFETY: as above.
        let rc = unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, s.as_raw_fd(), &mut ev) };
        ensure!(rc == 0, "epoll_ctl: {}", std::io::Error::last_os_error());
    }
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 64];
    let mut buf = [0u8; 1500];
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: as above; `events` outlives the call.
        let n = unsafe { libc::epoll_wait(epoll, events.as_mut_ptr(), 64, 100) };
        for ev in events.iter().take(n.max(0) as usize) {
            let s = &sockets[ev.u64 as usize];
            while let Ok((len, from)) = s.recv_from(&mut buf) {
                let _ = s.send_to(&buf[..len], from);
            }
        }
    }
    // SAFETY: our own descriptor, closed once.
    unsafe { libc::close(epoll) };
    Ok(())
}

/// Sends `rate` requests per second round-robin to the 64 primaries from
/// two sockets (one thread each, replies counted by one more thread each)
/// until `stop`; the counters are read by the caller.
fn load(rate: u32, stop: Arc<AtomicBool>, sent: Arc<AtomicU64>, replies: Arc<AtomicU64>) {
    const SENDERS: u32 = 2;
    let primaries: Vec<SocketAddrV4> = groups().iter().map(|g| g[0]).collect();
    let mut handles = Vec::new();
    for t in 0..SENDERS {
        let socket = UdpSocket::bind((CLIENT, 0)).expect("a client socket");
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("a read timeout");
        let receiver = socket.try_clone().expect("a second handle");
        let (stop_r, replies) = (stop.clone(), replies.clone());
        handles.push(thread::spawn(move || {
            let mut buf = [0u8; 1500];
            while !stop_r.load(Ordering::Relaxed) {
                if receiver.recv(&mut buf).is_ok() {
                    replies.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
        let (stop, sent, primaries) = (stop.clone(), sent.clone(), primaries.clone());
        handles.push(thread::spawn(move || {
            let per_s = f64::from(rate / SENDERS);
            let start = Instant::now();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let due = (start.elapsed().as_secs_f64() * per_s) as u64;
                while n < due {
                    let to = primaries[((n + u64::from(t)) % primaries.len() as u64) as usize];
                    let request = frame(n as u16, b"get k\r\n");
                    if socket.send_to(&request, to).is_ok() {
                        sent.fetch_add(1, Ordering::Relaxed);
                    }
                    n += 1;
                }
                thread::sleep(Duration::from_micros(200));
            }
        }));
    }
    for h in handles {
        let _ = h.join();
    }
}

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces), from field 3.
    let rest = stat.rsplit_once(')').context("/proc/PID/stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks as f64 / hz)
}

fn start_scale_agent(pair: &Pair, o: &ScaleOptions) -> Result<AgentChild> {
    let mut args: Vec<String> = [
        "--iface",
        IFACE,
        "--inflight-max",
        &o.inflight_max.to_string(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    for g in groups() {
        let members: Vec<String> = g.iter().map(ToString::to_string).collect();
        args.extend(["--group".to_string(), members.join(",")]);
    }
    start_agent(&pair.client, &o.agent, &args)
}

/// Agent CPU over the window with the load running (`rate` 0: idle).
fn cpu_run(o: &ScaleOptions, rate: u32, answered: bool) -> Result<CpuRun> {
    let pair = Pair::new()?;
    let agent = start_scale_agent(&pair, o)?;
    let stop = Arc::new(AtomicBool::new(false));
    let responder = answered
        .then(|| {
            let stop = stop.clone();
            pair.server.spawn(move || respond(stop))
        })
        .transpose()?;
    let (sent, replies) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let loader = (rate > 0)
        .then(|| {
            let (stop, sent, replies) = (stop.clone(), sent.clone(), replies.clone());
            pair.client.spawn(move || load(rate, stop, sent, replies))
        })
        .transpose()?;
    thread::sleep(Duration::from_secs(2));
    let pid = agent.0.id();
    let (cpu0, sent0, replies0, t0) = (
        cpu_seconds(pid)?,
        sent.load(Ordering::Relaxed),
        replies.load(Ordering::Relaxed),
        Instant::now(),
    );
    thread::sleep(o.window);
    let (cpu1, sent1, replies1, secs) = (
        cpu_seconds(pid)?,
        sent.load(Ordering::Relaxed),
        replies.load(Ordering::Relaxed),
        t0.elapsed().as_secs_f64(),
    );
    stop.store(true, Ordering::Relaxed);
    if let Some(h) = loader {
        h.join().map_err(|_| anyhow::anyhow!("the load panicked"))?;
    }
    if let Some(h) = responder {
        h.join()
            .map_err(|_| anyhow::anyhow!("the responder panicked"))??;
    }
    drop(agent);
    Ok(CpuRun {
        answered,
        sent_per_s: (sent1 - sent0) as f64 / secs,
        replies_per_s: (replies1 - replies0) as f64 / secs,
        cpu_share: (cpu1 - cpu0) / secs,
    })
}

/// Runs every scale measurement.
pub fn measure(o: &ScaleOptions, command: &str) -> Result<ScaleReport> {
    check_agent(&o.agent)?;
    eprintln!(
        "bench: scale: sweep and telemetry cost with {} live requests",
        o.planted
    );
    let ns = Namespace::create(&format!("scale-{}-l", unique_tag()))?;
    let cost = {
        let o = o.clone();
        ns.run(move || interval_cost(&o))??
    };
    drop(ns);
    eprintln!("bench: scale: agent CPU, idle");
    let idle = cpu_run(o, 0, true)?;
    let mut runs = Vec::new();
    for answered in [true, false] {
        eprintln!(
            "bench: scale: agent CPU at {} requests/s, {}",
            o.rate,
            if answered { "answered" } else { "unanswered" }
        );
        runs.push(cpu_run(o, o.rate, answered)?);
    }
    Ok(ScaleReport {
        command: command.to_string(),
        opts: o.clone(),
        cost,
        idle,
        runs,
    })
}

impl ScaleReport {
    pub fn markdown(&self) -> String {
        let c = &self.cost;
        let mut md = String::new();
        let _ = writeln!(md, "\n## Scale: 64 groups of 8 members\n");
        let _ = writeln!(md, "Command: `{}`\n", self.command);
        let _ = writeln!(
            md,
            "In-process, `--inflight-max {}` ({} slots, {} MB), {} live requests planted (medians of 5):\n",
            self.opts.inflight_max,
            c.slots,
            (c.slots * 64) >> 20,
            c.planted
        );
        let _ = writeln!(md, "| agent work | ms |\n|---|---:|");
        let _ = writeln!(
            md,
            "| first sweep, {} live requests, none stale (every one read) | {:.2} |",
            c.planted, c.sweep_live_first_ms
        );
        let _ = writeln!(
            md,
            "| later sweeps, none due yet (their mark words skipped) | {:.3} |",
            c.sweep_live_ms
        );
        let _ = writeln!(
            md,
            "| telemetry snapshot (512 backends' counters, histograms, in-flight count) | {:.2} |",
            c.snapshot_ms
        );
        let _ = writeln!(
            md,
            "| sweep expiring all {} | {:.2} |",
            c.planted, c.sweep_expire_all_ms
        );
        let _ = writeln!(md, "| sweep, table empty | {:.3} |", c.sweep_empty_ms);
        let _ = writeln!(
            md,
            "\nThe release agent (`selector run`, 64 `--group`s of 8, `--inflight-max {}`, \
             `--ingress tc`, defaults otherwise: sweep every 250 ms, telemetry every 1 s) under \
             real UDP requests from this process over a veth pair, CPU from /proc/PID/stat \
             (utime + stime) over {:.0} s after a 2 s warm-up:\n",
            self.opts.inflight_max,
            self.opts.window.as_secs_f64()
        );
        let _ = writeln!(
            md,
            "| load | requests/s sent | replies/s | agent CPU (% of a core) |\n|---|---:|---:|---:|"
        );
        for r in std::iter::once(&self.idle).chain(&self.runs) {
            let load = if r.sent_per_s == 0.0 {
                "idle".to_string()
            } else if r.answered {
                "every request answered".to_string()
            } else {
                "no request answered (all expire)".to_string()
            };
            let _ = writeln!(
                md,
                "| {load} | {:.0} | {:.0} | {:.2} |",
                r.sent_per_s,
                r.replies_per_s,
                100.0 * r.cpu_share
            );
        }
        md
    }
}
