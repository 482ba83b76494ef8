//! Closed-loop throughput (`--only throughput`): the cost of being
//! attached at full speed. 8 client threads in the client namespace, each
//! on its own connected UDP socket, send a memcached `get` to the primary
//! and wait for its reply before the next (as memcaslap's UDP gets do), no
//! stalls, against real memcached. Rows: no agent, the release agent in
//! observe mode, and armed with `--threshold 1` (it redirects whenever the
//! primary has one more pending than a replica), at the agent's default
//! `--ingress auto` (TC ingress on the veth), and observe with `--ingress
//! xdp` as context. Each row runs in segments interleaved with the other
//! rows (the order rotating each round); ratios are of medians of the
//! segments' ops/s to the no-agent row's.

use std::{
    fmt::Write as _,
    net::SocketAddrV4,
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::Result;

use super::agent_process::{check_agent, start_agent};
use crate::{
    Testbed,
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

/// One row: the agent's flags, or no agent.
#[derive(Clone, Debug)]
pub struct Config {
    pub label: &'static str,
    pub agent_args: Option<&'static [&'static str]>,
    /// Part of the target (the others are context).
    pub target: bool,
}

const CONFIGS: [Config; 4] = [
    Config {
        label: "no agent",
        agent_args: None,
        target: false,
    },
    Config {
        label: "observe (ingress auto: tc)",
        agent_args: Some(&["--policy", "observe"]),
        target: true,
    },
    Config {
        label: "threshold 1 (ingress auto: tc)",
        agent_args: Some(&["--policy", "threshold", "--threshold", "1"]),
        target: true,
    },
    Config {
        label: "observe, --ingress xdp",
        agent_args: Some(&["--policy", "observe", "--ingress", "xdp"]),
        target: false,
    },
];

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
        let mut v = self.segments.clone();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
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
    let group = tb.group_arg();
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
            let _agent = match row.config.agent_args {
                Some(extra) => {
                    let mut args: Vec<String> = ["--iface", CLIENT_IFACE, "--group", &group]
                        .iter()
                        .map(ToString::to_string)
                        .collect();
                    args.extend(extra.iter().map(ToString::to_string));
                    Some(start_agent(&tb.client, &o.agent, &args)?)
                }
                None => None,
            };
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
