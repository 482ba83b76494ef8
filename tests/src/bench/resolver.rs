//! Lookups through glibc (`--only resolver`): the stub resolver recipe
//! (`selector run --resolv-conf`) as an application sees it, to decide
//! whether hedging should be on by default.
//!
//! NSD on replicas 0 and 1, the client namespace's resolv.conf naming them
//! in that order, and getaddrinfo(3) itself (glibc's stub resolver, A and
//! AAAA in parallel on one connected socket) at a steady rate from a pool
//! of threads, latency from each lookup's intended start. The first
//! nameserver stalls (SIGSTOP of its processes) for a moment at a fixed
//! period. Rows: no agent, the agent at its defaults (which hedge: the
//! recipe implies `--hedge-after auto`) and with threshold 1, each also
//! with `--hedge-after off`; interleaved over rounds, a fresh agent per
//! segment, one testbed. Results go to `resolver.md`.

use std::{
    ffi::CString,
    fmt::Write as _,
    net::{SocketAddr, ToSocketAddrs},
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};
use hdrhistogram::Histogram;

use super::{
    agent_process::{check_agent, start_agent},
    client::histogram,
    failures::{AgentCounts, Stalled, finish},
    median,
    report::format_us,
    scenario::check_interrupted,
};
use crate::{
    Testbed,
    dns::{APEX_A, DNS_PORT, NetnsResolvConf, Nsd, ZONE},
    topology::{CLIENT_IFACE, replica_addr},
};

/// One row. `--resolv-conf` implies `--hedge-after auto`: the rows
/// without hedges say `--hedge-after off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResolverRow {
    NoAgent,
    CountsOnly,
    Defaults,
    Threshold1CountsOnly,
    Threshold1,
}

impl ResolverRow {
    pub const ALL: [ResolverRow; 5] = [
        ResolverRow::NoAgent,
        ResolverRow::CountsOnly,
        ResolverRow::Defaults,
        ResolverRow::Threshold1CountsOnly,
        ResolverRow::Threshold1,
    ];

    pub fn label(self) -> &'static str {
        match self {
            ResolverRow::NoAgent => "no agent",
            ResolverRow::CountsOnly => "agent, hedge off",
            ResolverRow::Defaults => "agent defaults (hedge auto)",
            ResolverRow::Threshold1CountsOnly => "threshold 1, hedge off",
            ResolverRow::Threshold1 => "threshold 1 (hedge auto)",
        }
    }

    /// The agent's flags beyond the interface and `--resolv-conf` (`None`:
    /// no agent).
    fn agent_flags(self) -> Option<&'static [&'static str]> {
        match self {
            ResolverRow::NoAgent => None,
            ResolverRow::CountsOnly => Some(&["--hedge-after", "off"]),
            ResolverRow::Defaults => Some(&[]),
            ResolverRow::Threshold1CountsOnly => {
                Some(&["--threshold", "1", "--hedge-after", "off"])
            }
            ResolverRow::Threshold1 => Some(&["--threshold", "1"]),
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct ResolverOptions {
    /// The `selector` binary run as the agent.
    pub agent: PathBuf,
    /// Lookups per second.
    pub rate: u32,
    /// Length of one segment (one row, one round).
    pub segment: Duration,
    pub rounds: u32,
    /// The first nameserver's stalls.
    pub stall: Duration,
    pub stall_every: Duration,
}

/// What one row measured over all its segments.
pub struct ResolverResult {
    pub row: ResolverRow,
    pub lookups: u64,
    /// Lookups that failed or gave another address than the zone's.
    pub failed: u64,
    /// Latency of the good lookups, microseconds.
    pub hist: Histogram<u64>,
    /// Each segment's p99 and p99.9, microseconds.
    pub segment_p99: Vec<u64>,
    pub segment_p999: Vec<u64>,
    pub stalls: u32,
    /// Summed over the segments.
    pub hedges_sent: u64,
    pub hedges_won: u64,
    pub redirected: u64,
}

/// The measured rows.
pub struct ResolverReport {
    pub command: String,
    pub opts: ResolverOptions,
    pub rows: Vec<ResolverResult>,
}

/// Runs every row, `rounds` times interleaved, on one testbed.
pub fn measure(o: &ResolverOptions, command: &str) -> Result<ResolverReport> {
    check_agent(&o.agent)?;
    let tb = Testbed::new("rslv", 2)?;
    let mut servers = Vec::new();
    for i in 0..2 {
        let nsd = Nsd::start(&tb.replica_ns[i], (replica_addr(i), DNS_PORT))?;
        nsd.wait_ready(&tb.replica_ns[i])?;
        servers.push(nsd);
    }
    // glibc's defaults but the timeout: a lookup whose reply is lost then
    // takes 2 s, not 5, and is counted all the same.
    let conf = NetnsResolvConf::write(
        &tb.client.name,
        &format!(
            "nameserver {}\nnameserver {}\noptions timeout:2\n",
            replica_addr(0),
            replica_addr(1)
        ),
    )?;
    let primary = Stalled::of(&tb.replica_ns[0])?;
    let mut rows: Vec<ResolverResult> = ResolverRow::ALL
        .iter()
        .map(|&row| ResolverResult {
            row,
            lookups: 0,
            failed: 0,
            hist: histogram(),
            segment_p99: Vec::new(),
            segment_p999: Vec::new(),
            stalls: 0,
            hedges_sent: 0,
            hedges_won: 0,
            redirected: 0,
        })
        .collect();
    for round in 0..o.rounds {
        for r in &mut rows {
            check_interrupted()?;
            let seg = segment(&tb, o, r.row, &conf.path(), &primary)
                .with_context(|| format!("{} (round {})", r.row.label(), round + 1))?;
            eprintln!(
                "bench: resolver round {}: {}: {} lookups, {} failed, p99 {} p99.9 {}",
                round + 1,
                r.row.label(),
                seg.lookups,
                seg.failed,
                format_us(seg.hist.value_at_quantile(0.99)),
                format_us(seg.hist.value_at_quantile(0.999))
            );
            r.lookups += seg.lookups;
            r.failed += seg.failed;
            r.hist.add(&seg.hist)?;
            r.segment_p99.push(seg.hist.value_at_quantile(0.99));
            r.segment_p999.push(seg.hist.value_at_quantile(0.999));
            r.stalls += seg.stalls;
            if let Some(a) = seg.agent {
                r.hedges_sent += a.hedges_sent;
                r.hedges_won += a.hedges_won;
                r.redirected += a.redirected;
            }
        }
    }
    drop(servers);
    Ok(ResolverReport {
        command: command.to_string(),
        opts: o.clone(),
        rows,
    })
}

/// One segment's lookups and the agent's counts.
struct Segment {
    lookups: u64,
    failed: u64,
    hist: Histogram<u64>,
    stalls: u32,
    agent: Option<AgentCounts>,
}

fn segment(
    tb: &Testbed,
    o: &ResolverOptions,
    row: ResolverRow,
    conf: &std::path::Path,
    primary: &Stalled,
) -> Result<Segment> {
    let agent = row
        .agent_flags()
        .map(|flags| {
            let args: Vec<String> = ["--iface", CLIENT_IFACE, "--resolv-conf"]
                .iter()
                .chain(flags)
                .map(ToString::to_string)
                .collect();
            start_agent(&tb.client, &o.agent, &args)
        })
        .transpose()?;
    let spec = LookupLoad {
        resolv_conf: conf.to_path_buf(),
        rate: o.rate,
        duration: o.segment,
    };
    let start = Instant::now();
    let load = tb.client.spawn(move || run_lookups(&spec))?;
    let mut stalls = 0;
    let mut at = start + o.stall_every / 2;
    while at + o.stall <= start + o.segment {
        check_interrupted()?;
        if let Some(wait) = at.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        }
        primary.stall(o.stall)?;
        stalls += 1;
        at += o.stall_every;
    }
    let (load, agent) = finish(load, agent, &tb.client, &o.agent)?;
    Ok(Segment {
        lookups: load.lookups,
        failed: load.failed,
        hist: load.latency_us,
        stalls,
        agent,
    })
}

/// getaddrinfo(3) at `rate` for `duration`, glibc reading `resolv_conf` as
/// its /etc/resolv.conf.
pub struct LookupLoad {
    pub resolv_conf: PathBuf,
    pub rate: u32,
    pub duration: Duration,
}

pub struct LookupReport {
    pub lookups: u64,
    pub failed: u64,
    pub latency_us: Histogram<u64>,
}

/// Threads looking up at once: more than a stall holds at the rate (25 ms
/// at 300/s is 8), so that the load stays open-loop.
const LOOKERS: usize = 32;

/// Runs on a thread inside the client namespace. It takes a mount
/// namespace of its own (with its own filesystem context, so the rest of
/// the process keeps its own) in which `resolv_conf` is /etc/resolv.conf,
/// as `ip netns exec` arranges for a process; the lookers it starts share
/// both. Each lookup starts at its intended time (or as soon as a looker
/// is free) and its latency counts from the intended time.
pub fn run_lookups(spec: &LookupLoad) -> Result<LookupReport> {
    private_resolv_conf(&spec.resolv_conf)?;
    let total = (f64::from(spec.rate) * spec.duration.as_secs_f64()) as u64;
    let interval = Duration::from_secs_f64(1.0 / f64::from(spec.rate.max(1)));
    let next = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let merged = Arc::new(Mutex::new(histogram()));
    let start = Instant::now();
    let lookers: Vec<_> = (0..LOOKERS)
        .map(|_| {
            let (next, failed, merged) = (next.clone(), failed.clone(), merged.clone());
            thread::spawn(move || {
                let mut hist = histogram();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= total {
                        break;
                    }
                    let intended = start + interval.mul_f64(i as f64);
                    if let Some(wait) = intended.checked_duration_since(Instant::now()) {
                        thread::sleep(wait);
                    }
                    let answer: Option<Vec<SocketAddr>> =
                        (ZONE, 0).to_socket_addrs().ok().map(Iterator::collect);
                    let us = intended.elapsed().as_micros() as u64;
                    let right = answer.is_some_and(|a| a.iter().any(|s| s.ip() == APEX_A));
                    if right {
                        hist.saturating_record(us.max(1));
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                merged.lock().unwrap().add(&hist).expect("same bounds");
            })
        })
        .collect();
    for l in lookers {
        if l.join().is_err() {
            bail!("a looker panicked");
        }
    }
    let latency_us = std::mem::replace(&mut *merged.lock().unwrap(), histogram());
    Ok(LookupReport {
        lookups: total,
        failed: failed.load(Ordering::Relaxed),
        latency_us,
    })
}

/// This thread's own filesystem context and mount namespace, with `path`
/// bound over /etc/resolv.conf (glibc rereads the file when it changes).
fn private_resolv_conf(path: &std::path::Path) -> Result<()> {
    let cstr = |s: &str| CString::new(s).expect("no NUL");
    // SAFETY: unshare and mount on this thread's own context, with valid
    // NUL-terminated strings.
    unsafe {
        ensure!(
            libc::unshare(libc::CLONE_FS | libc::CLONE_NEWNS) == 0,
            "unshare: {}",
            std::io::Error::last_os_error()
        );
        let root = cstr("/");
        ensure!(
            libc::mount(
                std::ptr::null(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null()
            ) == 0,
            "making / private: {}",
            std::io::Error::last_os_error()
        );
        let from = cstr(path.to_str().context("resolv.conf path")?);
        let to = cstr("/etc/resolv.conf");
        ensure!(
            libc::mount(
                from.as_ptr(),
                to.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null()
            ) == 0,
            "binding {} over /etc/resolv.conf: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

impl ResolverReport {
    pub fn markdown(&self) -> String {
        let o = &self.opts;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "## Lookups through glibc's resolver\n\n\
             `{}`. getaddrinfo(3) for `{ZONE}` (A and AAAA) at {} lookups/s \
             from {LOOKERS} threads, glibc reading a resolv.conf that names \
             two NSD nameservers; the first stalls {} ms every {} ms. \
             Latency from each lookup's intended start. {} rounds of {} s \
             per row, interleaved; the agent runs `--resolv-conf` with the \
             row's flags.\n",
            self.command,
            o.rate,
            o.stall.as_millis(),
            o.stall_every.as_millis(),
            o.rounds,
            o.segment.as_secs_f64()
        );
        out += "| row | lookups | failed | p50 | p99 | p99.9 | max | p99 per round | p99.9 per round | median round p99 / p99.9 | redirected | hedges sent / won |\n";
        out += "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|\n";
        for r in &self.rows {
            let rounds = |v: &[u64]| {
                v.iter()
                    .map(|&us| format_us(us))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let med = |v: &[u64]| format_us(median(v.iter().map(|&x| x as f64).collect()) as u64);
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {} |",
                r.row.label(),
                r.lookups,
                r.failed,
                format_us(r.hist.value_at_quantile(0.5)),
                format_us(r.hist.value_at_quantile(0.99)),
                format_us(r.hist.value_at_quantile(0.999)),
                format_us(r.hist.max()),
                rounds(&r.segment_p99),
                rounds(&r.segment_p999),
                med(&r.segment_p99),
                med(&r.segment_p999),
                if r.row.agent_flags().is_some() {
                    r.redirected.to_string()
                } else {
                    "-".into()
                },
                if r.row.agent_flags().is_some() {
                    format!("{} / {}", r.hedges_sent, r.hedges_won)
                } else {
                    "-".into()
                },
            );
        }
        if let Some(none) = self.rows.iter().find(|r| r.row == ResolverRow::NoAgent) {
            out += "\nGains over no agent (p99, p99.9; higher is better):\n\n";
            for r in self.rows.iter().filter(|r| r.row != ResolverRow::NoAgent) {
                let gain = |q: f64| {
                    none.hist.value_at_quantile(q) as f64
                        / r.hist.value_at_quantile(q).max(1) as f64
                };
                let _ = writeln!(
                    out,
                    "- {}: x{:.1}, x{:.1}",
                    r.row.label(),
                    gain(0.99),
                    gain(0.999)
                );
            }
        }
        out
    }
}
