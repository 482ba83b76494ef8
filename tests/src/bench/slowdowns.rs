//! Slowdowns as production has them (`--only slowdowns`): not the short
//! SIGSTOP stalls of the main experiment but a replica slow often or for
//! long. Three replicas, each running NSD and memcached; per case:
//!
//! - `none`: nothing slow (the limit to approach);
//! - `throttled_30`, `throttled_60`: the primary in a CPU cgroup with a
//!   CFS quota of 30% (60%) of a CPU per 100 ms period and a busy process
//!   beside it, as a pod at its CPU limit: ten stalls a second;
//! - `slower`: every replica behind a relay that holds each reply, the
//!   primary's 40 ms and the others' 20 ms (a server persistently twice as
//!   slow; its limit row reads from a fast replica);
//! - `loss`: 5% of the datagrams to and from the primary lost at the
//!   switch;
//! - `kube_proxy` (DNS only): lookups to a Service address that kube-proxy's
//!   iptables rules send to one of the three at random per lookup, one of
//!   them throttled at 30%.
//!
//! DNS is getaddrinfo(3) through glibc (the primary the first nameserver
//! of the resolv.conf, or the Service address); memcached is gets at a
//! steady rate on one connected socket, open loop. Rows: no agent, the
//! agent with `--avoid-slow off` (the count rule alone, the baseline),
//! the agent's defaults, and the defaults with hedging the other way (DNS:
//! the `--resolv-conf` recipe hedges, the row without does not; memcached:
//! the defaults do not, the row with `--hedge-after auto` does).
//! Interleaved over rounds, a fresh agent per segment. Results go to
//! `slowdowns.md`.

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context as _, Result};
use hdrhistogram::Histogram;
use selector_user::api::Status;

use super::{
    agent_process::{agent_status, check_agent, start_agent},
    client::histogram,
    median,
    open_loop::open_loop,
    report::format_us,
    resolver::{LookupLoad, run_lookups},
    scenario::check_interrupted,
    steady::Protocol,
};
use crate::{
    Testbed,
    dns::{DNS_PORT, NetnsResolvConf, Nsd},
    faults::{DelayingRelay, WireFault, install_wire_fault_on},
    memcached::{Replica, preload, wait_until_serving},
    slowdowns::{CpuThrottle, install_kube_proxy},
    topology::{CLIENT_IFACE, MEMCACHED_PORT, replica_addr},
};

/// A slowdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Case {
    None,
    Throttled(u32),
    Slower,
    Loss,
    KubeProxy,
}

/// The Service address of the `kube_proxy` case (inside the testbed).
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
/// The `slower` case's delays: the others', and the primary's.
const FAST_DELAY: Duration = Duration::from_millis(20);
const SLOW_DELAY: Duration = Duration::from_millis(40);
/// Loss of the `loss` case, each way, percent.
const LOSS_PERCENT: u32 = 5;
/// The replica throttled in the `kube_proxy` case.
const KUBE_THROTTLED: usize = 1;

impl Case {
    pub const ALL: [Case; 6] = [
        Case::None,
        Case::Throttled(30),
        Case::Throttled(60),
        Case::Slower,
        Case::Loss,
        Case::KubeProxy,
    ];

    pub fn id(self) -> String {
        match self {
            Case::None => "none".into(),
            Case::Throttled(p) => format!("throttled_{p}"),
            Case::Slower => "slower".into(),
            Case::Loss => "loss".into(),
            Case::KubeProxy => "kube_proxy".into(),
        }
    }

    pub fn label(self) -> String {
        match self {
            Case::None => "nothing slow (the limit)".into(),
            Case::Throttled(p) => format!("primary CPU-throttled, quota {p}% and a busy process"),
            Case::Slower => format!(
                "primary persistently 2x slower ({} ms against {} ms)",
                SLOW_DELAY.as_millis(),
                FAST_DELAY.as_millis()
            ),
            Case::Loss => format!("{LOSS_PERCENT}% of the primary's datagrams lost, each way"),
            Case::KubeProxy => {
                "a Service's address, kube-proxy's random endpoint per lookup, one of three throttled at 30%"
                    .into()
            }
        }
    }

    fn protocols(self) -> &'static [Protocol] {
        match self {
            Case::KubeProxy => &[Protocol::Dns],
            _ => &Protocol::ALL,
        }
    }
}

/// One row of a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Row {
    NoAgent,
    /// The `slower` case's limit: no agent, reads to a fast replica.
    FastReplica,
    CountsOnly,
    Defaults,
    /// The defaults with hedging the other way from the protocol's default.
    HedgingFlipped,
}

impl Row {
    fn all(case: Case) -> Vec<Row> {
        let mut rows = vec![Row::NoAgent];
        if case == Case::Slower {
            rows.push(Row::FastReplica);
        }
        rows.extend([Row::CountsOnly, Row::Defaults, Row::HedgingFlipped]);
        rows
    }

    pub fn label(self, protocol: Protocol) -> &'static str {
        match (self, protocol) {
            (Row::NoAgent, _) => "no agent",
            (Row::FastReplica, _) => "no agent, reads to a fast replica (the limit)",
            (Row::CountsOnly, _) => "agent, --avoid-slow off (counts alone)",
            (Row::Defaults, Protocol::Dns) => "agent defaults (recipe: hedge auto)",
            (Row::Defaults, Protocol::Memcached) => "agent defaults (no hedging)",
            (Row::HedgingFlipped, Protocol::Dns) => "agent defaults, --hedge-after off",
            (Row::HedgingFlipped, Protocol::Memcached) => "agent defaults, --hedge-after auto",
        }
    }

    fn has_agent(self) -> bool {
        !matches!(self, Row::NoAgent | Row::FastReplica)
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct SlowdownOptions {
    pub agent: PathBuf,
    /// Reads (lookups) per second.
    pub rate: u32,
    pub segment: Duration,
    pub rounds: u32,
    /// Case ids to run (empty: all).
    pub cases: Vec<String>,
}

/// One row's results over its segments.
pub struct RowResult {
    pub case: Case,
    pub protocol: Protocol,
    pub row: Row,
    pub reads: u64,
    pub failed: u64,
    /// Latency of the good reads, microseconds.
    pub hist: Histogram<u64>,
    pub segment_p99: Vec<u64>,
    pub redirected: u64,
    /// Reads moved to the slow replica (not its probes).
    pub moved_to_slow: u64,
    pub probes: u64,
    pub hedges_sent: u64,
    pub hedges_won: u64,
}

pub struct SlowdownReport {
    pub command: String,
    pub opts: SlowdownOptions,
    pub rows: Vec<RowResult>,
}

/// The replica that is slow in `case`, if one is.
fn slow_replica(case: Case) -> Option<usize> {
    match case {
        Case::None => None,
        Case::KubeProxy => Some(KUBE_THROTTLED),
        _ => Some(0),
    }
}

/// Whether `--only` names the slowdowns, or one of their cases
/// (`slowdowns_throttled_30`).
pub fn is_slowdown_id(entry: &str) -> bool {
    entry == "slowdowns"
        || entry
            .strip_prefix("slowdowns_")
            .is_some_and(|c| Case::ALL.iter().any(|k| k.id() == c))
}

/// Runs the selected cases, each on a testbed of its own.
pub fn measure(o: &SlowdownOptions, command: &str) -> Result<SlowdownReport> {
    check_agent(&o.agent)?;
    let mut rows = Vec::new();
    for case in Case::ALL {
        if !o.cases.is_empty() && !o.cases.contains(&case.id()) {
            continue;
        }
        check_interrupted()?;
        eprintln!("bench: slowdowns: {}", case.label());
        rows.extend(measure_case(o, case).with_context(|| case.label())?);
    }
    Ok(SlowdownReport {
        command: command.to_string(),
        opts: o.clone(),
        rows,
    })
}

/// A case's servers and slowdown, removed on drop.
struct Bed {
    tb: Testbed,
    _nsd: Vec<Nsd>,
    _relays: Vec<DelayingRelay>,
    _throttle: Option<CpuThrottle>,
}

fn bed(case: Case) -> Result<Bed> {
    let mut tb = Testbed::new("slwd", 3)?;
    let mut nsd = Vec::new();
    let mut relays = Vec::new();
    for i in 0..3 {
        let ns = &tb.replica_ns[i];
        let front = |port| SocketAddrV4::new(replica_addr(i), port);
        if case == Case::Slower {
            // The servers on loopback, a relay at the replica's address.
            let local = |port| SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
            let delay = if i == 0 { SLOW_DELAY } else { FAST_DELAY };
            let server = Nsd::start(ns, local(DNS_PORT))?;
            server.wait_ready(ns)?;
            nsd.push(server);
            tb.replicas.push(Replica::start(ns, local(MEMCACHED_PORT))?);
            for port in [DNS_PORT, MEMCACHED_PORT] {
                relays.push(DelayingRelay::start_fixed(
                    ns,
                    front(port),
                    local(port),
                    delay,
                )?);
            }
        } else {
            let server = Nsd::start(ns, front(DNS_PORT))?;
            server.wait_ready(ns)?;
            nsd.push(server);
            tb.replicas.push(Replica::start(ns, front(MEMCACHED_PORT))?);
        }
    }
    for endpoint in tb.replica_endpoints() {
        wait_until_serving(&tb.client, endpoint)?;
    }
    preload(&tb.client, &tb.replica_endpoints(), 1)?;
    match case {
        Case::Loss => {
            let primary =
                [DNS_PORT, MEMCACHED_PORT].map(|port| SocketAddrV4::new(replica_addr(0), port));
            install_wire_fault_on(&tb, WireFault::Drop, LOSS_PERCENT, &primary)?
        }
        Case::KubeProxy => {
            let endpoints: Vec<Ipv4Addr> = (0..3).map(replica_addr).collect();
            install_kube_proxy(&tb.client, CLIENT_IFACE, VIP, DNS_PORT, &endpoints)?;
        }
        _ => {}
    }
    let throttle = match case {
        Case::Throttled(p) => Some(CpuThrottle::start(&tb.replica_ns[0], p)?),
        Case::KubeProxy => Some(CpuThrottle::start(&tb.replica_ns[KUBE_THROTTLED], 30)?),
        _ => None,
    };
    Ok(Bed {
        tb,
        _nsd: nsd,
        _relays: relays,
        _throttle: throttle,
    })
}

fn measure_case(o: &SlowdownOptions, case: Case) -> Result<Vec<RowResult>> {
    let bed = bed(case)?;
    let tb = &bed.tb;
    let mut results = Vec::new();
    for &protocol in case.protocols() {
        for row in Row::all(case) {
            results.push(RowResult {
                case,
                protocol,
                row,
                reads: 0,
                failed: 0,
                hist: histogram(),
                segment_p99: Vec::new(),
                redirected: 0,
                moved_to_slow: 0,
                probes: 0,
                hedges_sent: 0,
                hedges_won: 0,
            });
        }
    }
    // glibc's defaults but the timeout: a lookup whose reply is lost takes
    // 2 s, not 5.
    let nameservers = |first: usize| -> String {
        let mut order: Vec<usize> = (0..3).collect();
        order.rotate_left(first);
        let mut text: String = order
            .iter()
            .map(|&i| format!("nameserver {}\n", replica_addr(i)))
            .collect();
        text += "options timeout:2\n";
        text
    };
    let conf = NetnsResolvConf::write(
        &tb.client.name,
        &match case {
            Case::KubeProxy => format!("nameserver {VIP}\noptions timeout:2\n"),
            _ => nameservers(0),
        },
    )?;
    for round in 0..o.rounds {
        for r in &mut results {
            check_interrupted()?;
            // The limit row's lookups ask a fast replica first.
            let fast_first = r.row == Row::FastReplica && r.protocol == Protocol::Dns;
            if fast_first {
                std::fs::write(conf.path(), nameservers(1))?;
            }
            let seg = segment(tb, o, case, r.protocol, r.row, &conf.path());
            if fast_first {
                std::fs::write(conf.path(), nameservers(0))?;
            }
            let seg =
                seg.with_context(|| format!("{} (round {})", r.row.label(r.protocol), round + 1))?;
            eprintln!(
                "bench: slowdowns round {}: {}, {}, {}: {} reads, {} failed, p99 {}",
                round + 1,
                case.id(),
                r.protocol.label(),
                r.row.label(r.protocol),
                seg.reads,
                seg.failed,
                format_us(seg.hist.value_at_quantile(0.99)),
            );
            r.reads += seg.reads;
            r.failed += seg.failed;
            r.hist.add(&seg.hist)?;
            r.segment_p99.push(seg.hist.value_at_quantile(0.99));
            if let Some(s) = seg.status {
                let b = &s.backends;
                r.redirected += b.iter().map(|b| b.stats.redirected_away).sum::<u64>();
                r.hedges_sent += b.iter().map(|b| b.hedges.hedges_sent).sum::<u64>();
                r.hedges_won += b.iter().map(|b| b.hedges.hedges_won).sum::<u64>();
                if let Some(slow) = slow_replica(case).and_then(|i| b.get(i)) {
                    r.probes += slow.ejection.slow_probes;
                    r.moved_to_slow += slow
                        .stats
                        .redirected_to
                        .saturating_sub(slow.ejection.slow_probes);
                }
            }
        }
    }
    drop(conf);
    Ok(results)
}

struct Segment {
    reads: u64,
    failed: u64,
    hist: Histogram<u64>,
    status: Option<Status>,
}

fn segment(
    tb: &Testbed,
    o: &SlowdownOptions,
    case: Case,
    protocol: Protocol,
    row: Row,
    conf: &std::path::Path,
) -> Result<Segment> {
    let agent = if row.has_agent() {
        let mut args: Vec<String> = vec!["--iface".into(), CLIENT_IFACE.into()];
        let group = |port: u16| -> String {
            (0..3)
                .map(|i| SocketAddrV4::new(replica_addr(i), port).to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        match (case, protocol) {
            // The recipe's hedging is the rows' (below).
            (Case::KubeProxy, _) => {
                args.extend(["--group", &group(DNS_PORT), "--proto", "dns"].map(String::from));
                if row != Row::HedgingFlipped {
                    args.extend(["--hedge-after", "auto"].map(String::from));
                }
            }
            (_, Protocol::Dns) => args.push("--resolv-conf".into()),
            (_, Protocol::Memcached) => args.extend(["--group".into(), group(MEMCACHED_PORT)]),
        }
        match (row, protocol) {
            (Row::CountsOnly, _) => args.extend(["--avoid-slow", "off"].map(String::from)),
            (Row::HedgingFlipped, Protocol::Dns) => {
                args.extend(["--hedge-after", "off"].map(String::from))
            }
            (Row::HedgingFlipped, Protocol::Memcached) => {
                args.extend(["--hedge-after", "auto"].map(String::from))
            }
            _ => {}
        }
        Some(start_agent(&tb.client, &o.agent, &args)?)
    } else {
        None
    };
    let (rate, duration) = (o.rate, o.segment);
    let (reads, failed, hist) = match protocol {
        Protocol::Dns => {
            let spec = LookupLoad {
                resolv_conf: conf.to_path_buf(),
                rate,
                duration,
            };
            let r = tb.client.spawn(move || run_lookups(&spec))?.join();
            let r = r.map_err(|_| anyhow::anyhow!("the lookups panicked"))??;
            (r.lookups, r.failed, r.latency_us)
        }
        Protocol::Memcached => {
            let first = if row == Row::FastReplica { 1 } else { 0 };
            let target = SocketAddr::V4(SocketAddrV4::new(replica_addr(first), MEMCACHED_PORT));
            let r = tb
                .client
                .spawn(move || paced_reads(protocol, target, rate, duration))?
                .join()
                .map_err(|_| anyhow::anyhow!("the reads panicked"))??;
            (r.0, r.1, r.2)
        }
    };
    let status = agent
        .map(|child| {
            let s = agent_status(&tb.client, &o.agent);
            drop(child);
            s
        })
        .transpose()?;
    Ok(Segment {
        reads,
        failed,
        hist,
        status,
    })
}

/// Reads of `protocol` to `target` at `rate` for `duration`, open loop
/// ([`open_loop`]); a read unanswered 2 s after the last send failed.
/// (reads, failed, latency in microseconds).
pub fn paced_reads(
    protocol: Protocol,
    target: SocketAddr,
    rate: u32,
    duration: Duration,
) -> Result<(u64, u64, Histogram<u64>)> {
    let r = open_loop(
        target,
        rate,
        duration,
        Duration::from_secs(2),
        |id| protocol.request(id),
        move |reply| protocol.answered(reply),
    )?;
    Ok((r.sent, r.failed(), r.latency_us))
}

impl SlowdownReport {
    pub fn markdown(&self) -> String {
        let o = &self.opts;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "## Slowdowns as production has them\n\n\
             `{}`. {} reads/s: DNS as getaddrinfo(3) through glibc (A and AAAA, \
             {} lookups/s), memcached as gets on one connected socket, open \
             loop; latency from each read's intended start. Three replicas, \
             each NSD and memcached; {} rounds of {} s per row, interleaved, a \
             fresh agent per segment. \"moved to slow\" counts reads moved to \
             the slow replica other than its probes.\n",
            self.command,
            o.rate,
            o.rate,
            o.rounds,
            o.segment.as_secs_f64()
        );
        let limit = |protocol: Protocol| {
            self.rows
                .iter()
                .find(|r| r.case == Case::None && r.protocol == protocol && r.row == Row::NoAgent)
                .map(|r| r.hist.value_at_quantile(0.99))
        };
        for case in Case::ALL {
            for protocol in Protocol::ALL {
                let rows: Vec<&RowResult> = self
                    .rows
                    .iter()
                    .filter(|r| r.case == case && r.protocol == protocol)
                    .collect();
                if rows.is_empty() {
                    continue;
                }
                let _ = writeln!(out, "### {}: {}\n", case.label(), protocol.label());
                out += "| row | reads | failed | p50 | p99 | p99.9 | p99 per round | p99 / limit | moved | moved to slow | probes | hedges sent / won |\n";
                out += "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|\n";
                let case_limit = rows
                    .iter()
                    .find(|r| r.row == Row::FastReplica)
                    .map(|r| r.hist.value_at_quantile(0.99))
                    .or(limit(protocol));
                for r in &rows {
                    let p99 = r.hist.value_at_quantile(0.99);
                    let agent = r.row.has_agent();
                    let dash = |v: String| if agent { v } else { "-".into() };
                    let _ = writeln!(
                        out,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                        r.row.label(protocol),
                        r.reads,
                        r.failed,
                        format_us(r.hist.value_at_quantile(0.5)),
                        format_us(p99),
                        format_us(r.hist.value_at_quantile(0.999)),
                        r.segment_p99
                            .iter()
                            .map(|&v| format_us(v))
                            .collect::<Vec<_>>()
                            .join(", "),
                        case_limit.map_or("-".into(), |l| format!(
                            "x{:.1}",
                            p99 as f64 / l.max(1) as f64
                        )),
                        dash(r.redirected.to_string()),
                        dash(r.moved_to_slow.to_string()),
                        dash(r.probes.to_string()),
                        dash(format!("{} / {}", r.hedges_sent, r.hedges_won)),
                    );
                }
                let best = rows
                    .iter()
                    .filter(|r| r.row != Row::FastReplica)
                    .min_by_key(|r| {
                        (
                            r.failed,
                            median(r.segment_p99.iter().map(|&v| v as f64).collect()) as u64,
                        )
                    });
                if let Some(best) = best {
                    let _ = writeln!(
                        out,
                        "\nWins (fewest failed, then median round p99): {}.\n",
                        best.row.label(protocol)
                    );
                }
            }
        }
        out
    }
}
