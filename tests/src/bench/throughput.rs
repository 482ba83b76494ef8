//! Closed-loop throughput (`--only throughput`): the cost of being
//! attached at full speed. 8 client threads in the client namespace, each
//! on its own connected UDP socket, send a memcached `get` to the primary
//! and wait for its reply before the next (as memcaslap's UDP gets do), no
//! stalls, against real memcached. Rows: no agent, the release agent in
//! observe mode, and armed with `--threshold 1` (it redirects whenever the
//! primary has one more pending than a replica), at the agent's default
//! `--ingress auto` (TC ingress on the veth), and observe with `--ingress
//! xdp` as context. Three more rows split the cost of observe mode: the
//! empty programs on the same hooks (what attaching at all costs), the
//! reference programs on them (the per-packet cost's reference request and
//! reply: one hash insert per get, one lookup and delete per reply, the
//! least any request tracker does: the floor of the target), and observe's
//! programs left pinned after the agent exited (the kernel's share, without
//! the agent process on the CPUs). Each row runs in segments
//! interleaved with the other rows (the order rotating each round); ratios
//! are of medians of the segments' ops/s to the no-agent row's.

use std::{
    fmt::Write as _,
    net::SocketAddrV4,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use aya::programs::{SchedClassifier, TcAttachType, tc::SchedClassifierLinkId};
use selector_common::{InflightKey, bench};
use selector_user::datapath::bench::BenchPrograms;

use super::agent_process::{AgentChild, check_agent, start_agent};
use crate::{
    Testbed,
    bpffs::Bpffs,
    memcached::{MemcachedClient, frame, key_for},
    netns::Namespace,
    topology::CLIENT_IFACE,
};

/// What to run.
#[derive(Clone, Debug)]
pub struct ThroughputOptions {
    /// Concurrent requests (client threads).
    pub concurrency: usize,
    /// Length of one segment.
    pub segment: Duration,
    /// Segments per row.
    pub rounds: usize,
    pub keys: usize,
    /// The release `selector` binary.
    pub agent: PathBuf,
}

/// What is attached to the client's interface during a row.
#[derive(Clone, Copy, Debug)]
pub enum Attachment {
    None,
    /// `selector run` with these flags, running.
    Agent(&'static [&'static str]),
    /// The object's empty programs on TC egress and TC ingress.
    EmptyPrograms,
    /// The object's reference request on TC egress and reference reply on
    /// TC ingress.
    ReferencePrograms,
    /// `selector run --pin` with these flags, then stopped: its programs
    /// stay attached with no agent process.
    PinnedWithoutAgent(&'static [&'static str]),
}

/// One row.
#[derive(Clone, Debug)]
pub struct Config {
    pub label: &'static str,
    pub attachment: Attachment,
    /// Part of the target (the others are context).
    pub target: bool,
}

const OBSERVE: &[&str] = &["--policy", "observe"];

/// Every row, the no-agent baseline first.
pub const CONFIGS: [Config; 7] = [
    Config {
        label: "no agent",
        attachment: Attachment::None,
        target: false,
    },
    Config {
        label: "observe (ingress auto: tc)",
        attachment: Attachment::Agent(OBSERVE),
        target: true,
    },
    Config {
        label: "threshold 1 (ingress auto: tc)",
        attachment: Attachment::Agent(&["--policy", "threshold", "--threshold", "1"]),
        target: true,
    },
    Config {
        label: "observe, --ingress xdp",
        attachment: Attachment::Agent(&["--policy", "observe", "--ingress", "xdp"]),
        target: false,
    },
    Config {
        label: "empty programs on TC egress and ingress",
        attachment: Attachment::EmptyPrograms,
        target: false,
    },
    Config {
        label: "reference programs (one insert, one lookup and delete) on TC egress and ingress",
        attachment: Attachment::ReferencePrograms,
        target: false,
    },
    Config {
        label: "observe's programs pinned, agent exited",
        attachment: Attachment::PinnedWithoutAgent(OBSERVE),
        target: false,
    },
];

/// Holds a row's attachment for the length of its segment.
enum Attached {
    /// Stopped on drop.
    Agent {
        _child: AgentChild,
    },
    /// Detached on drop.
    Programs {
        _holder: Box<BenchPrograms>,
    },
    /// Detached by `finish`, which first checks they did their work.
    Reference(Box<ReferencePrograms>),
    Pinned {
        bpffs: Bpffs,
        agent: PathBuf,
    },
}

impl Attached {
    fn start(attachment: Attachment, agent: &Path, tb: &Testbed) -> Result<Option<Self>> {
        let group = tb.group_arg();
        let client = &tb.client;
        let args = |extra: &[&str]| -> Vec<String> {
            ["--iface", CLIENT_IFACE, "--group", &group]
                .iter()
                .chain(extra)
                .map(ToString::to_string)
                .collect()
        };
        Ok(match attachment {
            Attachment::None => None,
            Attachment::Agent(extra) => Some(Self::Agent {
                _child: start_agent(client, agent, &args(extra))?,
            }),
            Attachment::EmptyPrograms => Some(Self::Programs {
                _holder: Box::new(empty_programs(client)?),
            }),
            Attachment::ReferencePrograms => Some(Self::Reference(Box::new(
                ReferencePrograms::attach(client)?,
            ))),
            Attachment::PinnedWithoutAgent(extra) => {
                let bpffs = Bpffs::mount();
                let mut with_pin = args(extra);
                with_pin.extend(["--pin".to_string(), bpffs.arg()]);
                // Dropping the child stops it; its pinned programs stay.
                drop(start_agent(client, agent, &with_pin)?);
                Some(Self::Pinned {
                    bpffs,
                    agent: agent.to_path_buf(),
                })
            }
        })
    }

    /// Detaches what the row left behind; `load` is the segment's, which
    /// the reference programs' check repeats.
    fn finish(self, client: &Namespace, load: &Load) -> Result<()> {
        if let Self::Reference(reference) = self {
            return reference.check_and_detach(client, load);
        }
        if let Self::Pinned { bpffs, agent } = self {
            let status = client
                .command(agent.to_str().context("agent path")?)
                .args(["detach", "--iface", CLIENT_IFACE, "--pin", &bpffs.arg()])
                .stdout(Stdio::null())
                .status()?;
            ensure!(status.success(), "selector detach: {status}");
        }
        Ok(())
    }
}

/// The reference request on the client's TC egress and the reference
/// reply on its TC ingress (TCX, as the agent's programs), their map sized
/// as the agent's default in-flight table.
struct ReferencePrograms {
    holder: BenchPrograms,
    ingress: Option<SchedClassifierLinkId>,
}

/// Entries of the reference programs' map: the agent's default in-flight
/// table's slots (`--inflight-max`).
const REFERENCE_ENTRIES: u32 = 65_536;

impl ReferencePrograms {
    fn attach(client: &Namespace) -> Result<Self> {
        client.run(move || -> Result<Self> {
            let mut holder = BenchPrograms::load(REFERENCE_ENTRIES)?;
            let ebpf = holder.ebpf_mut();
            let request: &mut SchedClassifier = ebpf
                .program_mut(bench::REFERENCE_REQUEST)
                .context("the reference request program")?
                .try_into()?;
            request.attach(CLIENT_IFACE, TcAttachType::Egress)?;
            let reply: &mut SchedClassifier = ebpf
                .program_mut(bench::REFERENCE_REPLY_TC)
                .context("the reference reply program (TC)")?
                .try_into()?;
            let ingress = reply.attach(CLIENT_IFACE, TcAttachType::Ingress)?;
            Ok(Self {
                holder,
                ingress: Some(ingress),
            })
        })?
    }

    /// Keys in the reference map now.
    fn entries(&mut self) -> Result<usize> {
        let map = self
            .holder
            .ebpf_mut()
            .map_mut(bench::REFERENCE)
            .context("the reference map")?;
        let map: aya::maps::HashMap<_, InflightKey, u64> = aya::maps::HashMap::try_from(map)?;
        Ok(map.keys().filter(Result::is_ok).count())
    }

    /// Shows the row measured what it says, then detaches: every reply
    /// deleted its request's entry (at most the loops' last requests and
    /// the timed-out ones remain), and with the reply program detached a
    /// few more gets leave entries (the request program inserts).
    fn check_and_detach(mut self, client: &Namespace, load: &Load) -> Result<()> {
        let left = self.entries()?;
        ensure!(
            left as u64 <= load.concurrency as u64 + load.timeouts,
            "reference programs: {left} entries left after the segment, more than its \
             {} loops and {} timeouts: the reply program deletes nothing",
            load.concurrency,
            load.timeouts
        );
        if let Some(link) = self.ingress.take() {
            let reply: &mut SchedClassifier = self
                .holder
                .ebpf_mut()
                .program_mut(bench::REFERENCE_REPLY_TC)
                .context("the reference reply program (TC)")?
                .try_into()?;
            // A TCX link: closing it detaches, in whatever namespace.
            reply.detach(link)?;
        }
        closed_loop(
            client,
            load.primary,
            load.concurrency,
            load.keys,
            Duration::from_millis(100),
        )?;
        let inserted = self.entries()?;
        ensure!(
            inserted > left,
            "reference programs: no entry inserted by 100 ms of gets with the reply program \
             detached ({inserted} entries): the request program inserts nothing"
        );
        Ok(())
    }
}

/// A row's load, as the reference programs' check needs it.
struct Load {
    primary: SocketAddrV4,
    concurrency: usize,
    keys: usize,
    /// Requests of the measured segment that timed out.
    timeouts: u64,
}

/// The benchmark object's empty TC program attached to the interface's
/// egress and ingress (TCX), as the agent's programs are.
pub(super) fn empty_programs(client: &Namespace) -> Result<BenchPrograms> {
    client.run(move || -> Result<BenchPrograms> {
        let mut holder = BenchPrograms::load(1)?;
        let tc: &mut SchedClassifier = holder
            .ebpf_mut()
            .program_mut(bench::BASELINE_TC)
            .context("the empty TC program")?
            .try_into()?;
        tc.attach(CLIENT_IFACE, TcAttachType::Egress)?;
        tc.attach(CLIENT_IFACE, TcAttachType::Ingress)?;
        Ok(holder)
    })?
}

#[derive(Clone, Debug)]
pub struct RowThroughput {
    pub config: Config,
    /// ops/s of each segment, in run order.
    pub segments: Vec<f64>,
    /// Requests unanswered within 100 ms, all segments.
    pub timeouts: u64,
}

impl RowThroughput {
    pub fn median(&self) -> f64 {
        super::median(self.segments.clone())
    }
}

#[derive(Clone, Debug)]
pub struct ThroughputReport {
    pub command: String,
    pub opts: ThroughputOptions,
    pub rows: Vec<RowThroughput>,
}

/// `concurrency` closed loops against `primary` for `length`: (ops, timeouts).
fn closed_loop(
    client: &Namespace,
    primary: SocketAddrV4,
    concurrency: usize,
    keys: usize,
    length: Duration,
) -> Result<(u64, u64)> {
    let stop = Arc::new(AtomicBool::new(false));
    let (ops, timeouts) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut loops = Vec::new();
    for t in 0..concurrency {
        let (stop, ops, timeouts) = (stop.clone(), ops.clone(), timeouts.clone());
        loops.push(client.spawn(move || -> Result<()> {
            let c = MemcachedClient::connect(primary)?;
            c.socket
                .set_read_timeout(Some(Duration::from_millis(100)))?;
            let mut buf = [0u8; 2048];
            let mut id = (t as u16) << 12;
            let mut i = t;
            while !stop.load(Ordering::Relaxed) {
                id = id.wrapping_add(1);
                i = (i + 7) % keys;
                c.socket
                    .send(&frame(id, format!("get {}\r\n", key_for(i)).as_bytes()))?;
                loop {
                    match c.socket.recv(&mut buf) {
                        Ok(n) if n >= 8 && u16::from_be_bytes([buf[0], buf[1]]) == id => {
                            ops.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                        // A late reply to an earlier request: keep waiting.
                        Ok(_) => {}
                        Err(_) => {
                            timeouts.fetch_add(1, Ordering::Relaxed);
                            break;
                        }
                    }
                }
            }
            Ok(())
        })?);
    }
    thread::sleep(length);
    stop.store(true, Ordering::Relaxed);
    for l in loops {
        l.join()
            .map_err(|_| anyhow::anyhow!("a client loop panicked"))??;
    }
    Ok((
        ops.load(Ordering::Relaxed),
        timeouts.load(Ordering::Relaxed),
    ))
}

/// Runs every row on a fresh testbed (3 memcached replicas, one group).
pub fn measure(o: &ThroughputOptions, command: &str) -> Result<ThroughputReport> {
    check_agent(&o.agent)?;
    let tb = Testbed::with_memcached("tput", 3, o.keys)?;
    let primary = tb.replica_endpoints()[0];
    let mut rows: Vec<RowThroughput> = CONFIGS
        .iter()
        .map(|c| RowThroughput {
            config: c.clone(),
            segments: Vec::new(),
            timeouts: 0,
        })
        .collect();
    for round in 0..o.rounds {
        for k in 0..rows.len() {
            // Rotate the order so no row always follows the same one.
            let row = &mut rows[(k + round) % CONFIGS.len()];
            let attached = Attached::start(row.config.attachment, &o.agent, &tb)?;
            // A short warm-up, then the measured segment.
            closed_loop(
                &tb.client,
                primary,
                o.concurrency,
                o.keys,
                Duration::from_millis(300),
            )?;
            let (ops, timeouts) =
                closed_loop(&tb.client, primary, o.concurrency, o.keys, o.segment)?;
            let per_s = ops as f64 / o.segment.as_secs_f64();
            eprintln!(
                "bench: throughput: round {}/{}: {}: {per_s:.0} ops/s, {timeouts} timeouts",
                round + 1,
                o.rounds,
                row.config.label
            );
            row.segments.push(per_s);
            row.timeouts += timeouts;
            if let Some(a) = attached {
                let load = Load {
                    primary,
                    concurrency: o.concurrency,
                    keys: o.keys,
                    timeouts,
                };
                a.finish(&tb.client, &load)?;
            }
        }
    }
    Ok(ThroughputReport {
        command: command.to_string(),
        opts: o.clone(),
        rows,
    })
}

impl ThroughputReport {
    fn baseline(&self) -> f64 {
        self.rows[0].median()
    }

    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let o = &self.opts;
        let _ = writeln!(md, "\n## Closed-loop throughput\n");
        let _ = writeln!(md, "Command: `{}`\n", self.command);
        let _ = writeln!(
            md,
            "{} concurrent closed-loop UDP gets to the primary (3 memcached replicas, one group, \
             no stalls), {} interleaved segments of {:.1} s per row; ratio: median ops/s over \
             the no-agent row's median. Target: at least 0.97x.\n",
            o.concurrency,
            o.rounds,
            o.segment.as_secs_f64()
        );
        let _ = writeln!(
            md,
            "| row | median ops/s | / no agent | segments (ops/s) | timeouts | target |\n|---|---:|---:|---|---:|---|"
        );
        let base = self.baseline();
        for r in &self.rows {
            let ratio = r.median() / base;
            let segments: Vec<String> = r.segments.iter().map(|s| format!("{s:.0}")).collect();
            let target = if !r.config.target {
                "context"
            } else if ratio >= 0.97 {
                "met"
            } else {
                "missed"
            };
            let _ = writeln!(
                md,
                "| {} | {:.0} | {:.3} | {} | {} | {target} |",
                r.config.label,
                r.median(),
                ratio,
                segments.join(", "),
                r.timeouts
            );
        }
        md
    }
}
