//! Traffic the selector does not steer (`--only untouched`): what being
//! attached costs everything else the host sends and receives through the
//! interface. Real tools between the client namespace and replica 0, with
//! no agent, with the release agent at its shipped defaults (only
//! `--iface` and `--group`), and with the benchmark object's empty
//! programs on the same TC hooks (the floor: what being attached at all
//! costs), in interleaved segments:
//! - TCP bulk throughput, the client sending and the client receiving
//!   (iperf3, `-R` for the second);
//! - TCP request/response rate: one 64-byte request and its echo at a time
//!   on one connection (sockperf `ping-pong --tcp`; netperf's TCP_RR is not
//!   in Debian's main archive);
//! - UDP to a port no member listens on, as fast as the sender goes
//!   (iperf3 `-u -b 0`), its rate as received.
//!
//! Segmentation and receive offloads are on at both ends (the testbed
//! turns them off for its checksum tests), as on a host with a real NIC:
//! TCP sends and receives large skbs whose payload is in page fragments
//! (`topology::offloads_on`).
//! Each row's ratio is the median of its agent segments over the median of
//! its no-agent segments, all from the same run; so is the empty programs'.

use std::{
    fmt::Write as _,
    net::Ipv4Addr,
    path::PathBuf,
    process::{Child, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context as _, Result, bail, ensure};
use selector_user::telemetry::HeadersPulled;

use super::{
    agent_process::{agent_status, check_agent, start_agent},
    median,
};
use crate::{
    Testbed,
    netns::Namespace,
    topology::{CLIENT_IFACE, offloads_on, replica_addr},
};

/// iperf3's port on replica 0 (TCP and UDP): no member's.
const IPERF_PORT: u16 = 5201;
/// sockperf's TCP port on replica 0.
const SOCKPERF_PORT: u16 = 11111;
/// Bytes of a sockperf request (and of its echo).
const RR_BYTES: &str = "64";
/// Bytes of an iperf3 UDP datagram's payload.
const UDP_BYTES: &str = "1400";

/// One row: a tool's measurement of traffic the selector does not steer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measure {
    TcpSend,
    TcpReceive,
    TcpRr,
    UdpOther,
}

impl Measure {
    pub const ALL: [Measure; 4] = [
        Measure::TcpSend,
        Measure::TcpReceive,
        Measure::TcpRr,
        Measure::UdpOther,
    ];

    /// The id `--only` takes (`untouched` selects every row).
    pub fn id(self) -> &'static str {
        match self {
            Measure::TcpSend => "untouched_tcp_send",
            Measure::TcpReceive => "untouched_tcp_receive",
            Measure::TcpRr => "untouched_tcp_rr",
            Measure::UdpOther => "untouched_udp_other",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Measure::TcpSend => "TCP bulk, client sends (iperf3)",
            Measure::TcpReceive => "TCP bulk, client receives (iperf3 -R)",
            Measure::TcpRr => "TCP request/response, 64 bytes (sockperf ping-pong)",
            Measure::UdpOther => "UDP to a non-member port, 1400 bytes (iperf3 -u -b 0)",
        }
    }

    pub fn unit(self) -> &'static str {
        match self {
            Measure::TcpRr => "transactions/s",
            _ => "Gbit/s",
        }
    }

    /// Whether `--only` names this row: its id, or `untouched`. Never
    /// selected by an empty `--only` (the rows are not part of the default
    /// run, as the throughput and scale measurements are not).
    pub fn selected_by(self, only: &[String]) -> bool {
        only.iter().any(|o| o == self.id() || o == "untouched")
    }

    /// Whether `name` is one of these rows' `--only` names.
    pub fn is_name(name: &str) -> bool {
        name == "untouched" || Self::ALL.iter().any(|m| m.id() == name)
    }

    /// Runs one segment of `length` from the client; the value in the
    /// row's unit.
    fn run(self, client: &Namespace, server: Ipv4Addr, length: Duration) -> Result<f64> {
        let secs = format!("{}", length.as_secs().max(1));
        let server = server.to_string();
        let iperf = |extra: &[&str]| -> Result<serde_json::Value> {
            let port = IPERF_PORT.to_string();
            let mut args = vec!["-c", &server, "-p", &port, "-t", &secs, "-J"];
            args.extend_from_slice(extra);
            let out = client.exec("iperf3", &args)?;
            serde_json::from_slice(&out.stdout).context("iperf3's JSON")
        };
        let gbits = |v: &serde_json::Value, pointer: &str| -> Result<f64> {
            v.pointer(pointer)
                .and_then(serde_json::Value::as_f64)
                .map(|b| b / 1e9)
                .with_context(|| format!("iperf3's JSON has no {pointer}: {v}"))
        };
        match self {
            Measure::TcpSend => gbits(&iperf(&[])?, "/end/sum_received/bits_per_second"),
            Measure::TcpReceive => gbits(&iperf(&["-R"])?, "/end/sum_received/bits_per_second"),
            Measure::UdpOther => {
                let v = iperf(&["-u", "-b", "0", "-l", UDP_BYTES])?;
                // iperf3 3.12 reports UDP in one sum: the sender's rate and
                // the receiver's losses.
                let sent = gbits(&v, "/end/sum/bits_per_second")?;
                let lost = v
                    .pointer("/end/sum/lost_percent")
                    .and_then(serde_json::Value::as_f64)
                    .with_context(|| format!("iperf3's JSON has no lost_percent: {v}"))?;
                Ok(sent * (1.0 - lost / 100.0))
            }
            Measure::TcpRr => {
                let port = SOCKPERF_PORT.to_string();
                let out = client.exec(
                    "sockperf",
                    &[
                        "ping-pong",
                        "--tcp",
                        "-i",
                        &server,
                        "-p",
                        &port,
                        "-t",
                        &secs,
                        "-m",
                        RR_BYTES,
                        "--mps",
                        "max",
                    ],
                )?;
                let text = format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                sockperf_rate(&text)
            }
        }
    }
}

/// Round trips per second from sockperf's summary: `ReceivedMessages` of
/// the `[Valid Duration]` line over its `RunTime`.
pub fn sockperf_rate(text: &str) -> Result<f64> {
    let line = text
        .lines()
        .find(|l| l.contains("[Valid Duration]"))
        .with_context(|| format!("no [Valid Duration] line in sockperf's output:\n{text}"))?;
    let field = |name: &str| -> Result<f64> {
        let at = line
            .find(name)
            .with_context(|| format!("no {name} in {line}"))?;
        let value: String = line[at + name.len()..]
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        value.parse().with_context(|| format!("{name} in {line}"))
    };
    let (time, received) = (field("RunTime=")?, field("ReceivedMessages=")?);
    ensure!(time > 0.0, "sockperf ran for no time: {line}");
    Ok(received / time)
}

/// What to run.
#[derive(Clone, Debug)]
pub struct UntouchedOptions {
    pub measures: Vec<Measure>,
    /// Length of one segment (whole seconds, at least 1).
    pub segment: Duration,
    /// Segments per row and attachment.
    pub rounds: usize,
    /// The release `selector` binary.
    pub agent: PathBuf,
}

/// One row's segments.
#[derive(Clone, Debug)]
pub struct RowResult {
    pub measure: Measure,
    /// Values without the agent, in run order.
    pub without: Vec<f64>,
    /// Values with the agent attached, in run order.
    pub with: Vec<f64>,
    /// Values with the empty programs attached, in run order.
    pub empty: Vec<f64>,
}

impl RowResult {
    pub fn ratio(&self) -> f64 {
        median(self.with.clone()) / median(self.without.clone())
    }

    /// The empty programs' median over the no-agent median: the floor.
    pub fn empty_ratio(&self) -> f64 {
        median(self.empty.clone()) / median(self.without.clone())
    }
}

#[derive(Clone, Debug)]
pub struct UntouchedReport {
    pub command: String,
    pub opts: UntouchedOptions,
    pub rows: Vec<RowResult>,
    /// Pulls the agent's programs counted over all its segments.
    pub pulled: HeadersPulled,
}

/// A server process in a namespace, killed on drop.
struct Server(Child);

impl Server {
    fn start(ns: &Namespace, program: &str, args: &[&str]) -> Result<Self> {
        let child = ns
            .command(program)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {program} (installed by `cargo xtask setup`)"))?;
        Ok(Self(child))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until a TCP socket listens on `port` in `ns` (asked of `ss`, not
/// by connecting: iperf3 takes any connection for a test's).
fn wait_listening(ns: &Namespace, port: u16) -> Result<()> {
    let filter = format!("sport = :{port}");
    for _ in 0..100 {
        let out = ns.exec("ss", &["-H", "-l", "-t", "-n", &filter])?;
        if !out.stdout.is_empty() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(50));
    }
    bail!("nothing listens on port {port} in {}", ns.name)
}

/// The agent's pull counts now.
fn pulled(client: &Namespace, agent: &std::path::Path) -> Result<HeadersPulled> {
    Ok(agent_status(client, agent)?.headers_pulled)
}

/// What is attached to the client's interface during a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Attached {
    Nothing,
    Agent,
    /// The benchmark object's empty TC programs.
    Empty,
}

impl Attached {
    fn label(self) -> &'static str {
        match self {
            Attached::Nothing => "no agent",
            Attached::Agent => "agent",
            Attached::Empty => "empty programs",
        }
    }
}

/// Runs every selected row on a fresh testbed (2 replicas, one group whose
/// members listen on no port the tools use).
pub fn measure(o: &UntouchedOptions, command: &str) -> Result<UntouchedReport> {
    check_agent(&o.agent)?;
    ensure!(!o.measures.is_empty(), "no untouched row selected");
    let tb = Testbed::new("untch", 2)?;
    for ns in [&tb.client, &tb.replica_ns[0]] {
        offloads_on(ns)?;
    }
    let server = replica_addr(0);
    let (iperf_port, rr_port) = (IPERF_PORT.to_string(), SOCKPERF_PORT.to_string());
    let _iperf = Server::start(&tb.replica_ns[0], "iperf3", &["-s", "-p", &iperf_port])?;
    let server_ip = server.to_string();
    let _sockperf = Server::start(
        &tb.replica_ns[0],
        "sockperf",
        &["server", "--tcp", "-i", &server_ip, "-p", &rr_port],
    )?;
    wait_listening(&tb.replica_ns[0], IPERF_PORT)?;
    wait_listening(&tb.replica_ns[0], SOCKPERF_PORT)?;
    let args: Vec<String> = ["--iface", CLIENT_IFACE, "--group", &tb.group_arg()]
        .iter()
        .map(ToString::to_string)
        .collect();
    let mut rows: Vec<RowResult> = o
        .measures
        .iter()
        .map(|&measure| RowResult {
            measure,
            without: Vec::new(),
            with: Vec::new(),
            empty: Vec::new(),
        })
        .collect();
    let mut total = HeadersPulled::default();
    for round in 0..o.rounds {
        // Rotate the order, so no attachment always follows another.
        let mut order = [Attached::Nothing, Attached::Agent, Attached::Empty];
        order.rotate_left(round % 3);
        for attached in order {
            let agent = if attached == Attached::Agent {
                let child = start_agent(&tb.client, &o.agent, &args)?;
                thread::sleep(Duration::from_millis(300));
                Some(child)
            } else {
                None
            };
            // Detached when dropped, after the segment.
            let _empty = if attached == Attached::Empty {
                Some(super::throughput::empty_programs(&tb.client)?)
            } else {
                None
            };
            for row in &mut rows {
                let value = row
                    .measure
                    .run(&tb.client, server, o.segment)
                    .with_context(|| row.measure.label())?;
                eprintln!(
                    "bench: untouched: round {}/{}: {}, {}: {value:.3} {}",
                    round + 1,
                    o.rounds,
                    row.measure.label(),
                    attached.label(),
                    row.measure.unit()
                );
                match attached {
                    Attached::Nothing => row.without.push(value),
                    Attached::Agent => row.with.push(value),
                    Attached::Empty => row.empty.push(value),
                }
            }
            if agent.is_some() {
                let p = pulled(&tb.client, &o.agent)?;
                total.egress += p.egress;
                total.ingress += p.ingress;
            }
        }
    }
    Ok(UntouchedReport {
        command: command.to_string(),
        opts: o.clone(),
        rows,
        pulled: total,
    })
}

impl UntouchedReport {
    pub fn markdown(&self) -> String {
        let mut md = String::new();
        let o = &self.opts;
        let _ = writeln!(md, "\n## Traffic the selector does not steer\n");
        let _ = writeln!(md, "Command: `{}`\n", self.command);
        let _ = writeln!(
            md,
            "Real tools from the client to replica 0 through the attached interface \
             (offloads on at both ends), {} segments of {} s per row with no agent, as many \
             with the release agent at its defaults and as many with empty programs on the same \
             TC hooks (the floor), interleaved; ratio: median with the agent (or the empty \
             programs) over median without. Target for TCP: at least 0.99x. Packets the agent's \
             programs pulled over all its segments: {} egress, {} ingress.\n",
            o.rounds,
            o.segment.as_secs().max(1),
            self.pulled.egress,
            self.pulled.ingress
        );
        let _ = writeln!(
            md,
            "| row | unit | no agent (median) | agent (median) | / no agent | empty programs / no agent | segments without | segments with | segments empty |\n|---|---|---:|---:|---:|---:|---|---|---|"
        );
        let fmt = |unit: &str, v: f64| {
            if unit == "Gbit/s" {
                format!("{v:.2}")
            } else {
                format!("{v:.0}")
            }
        };
        for r in &self.rows {
            let unit = r.measure.unit();
            let list = |values: &[f64]| {
                values
                    .iter()
                    .map(|v| fmt(unit, *v))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let _ = writeln!(
                md,
                "| {} | {unit} | {} | {} | {:.3} | {:.3} | {} | {} | {} |",
                r.measure.label(),
                fmt(unit, median(r.without.clone())),
                fmt(unit, median(r.with.clone())),
                r.ratio(),
                r.empty_ratio(),
                list(&r.without),
                list(&r.with),
                list(&r.empty)
            );
        }
        md
    }

    pub fn csv(&self) -> String {
        let mut csv = String::from("id,attached,segment,value,unit\n");
        for r in &self.rows {
            for (attached, values) in [("no", &r.without), ("yes", &r.with), ("empty", &r.empty)] {
                for (i, v) in values.iter().enumerate() {
                    let _ = writeln!(
                        csv,
                        "{},{attached},{},{v},{}",
                        r.measure.id(),
                        i + 1,
                        r.measure.unit()
                    );
                }
            }
        }
        csv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_selected_by_id_or_by_untouched_and_never_by_default() {
        let only = |s: &[&str]| s.iter().map(ToString::to_string).collect::<Vec<_>>();
        assert!(
            Measure::ALL
                .iter()
                .all(|m| m.selected_by(&only(&["untouched"])))
        );
        assert!(!Measure::TcpRr.selected_by(&[]));
        assert!(Measure::TcpRr.selected_by(&only(&["untouched_tcp_rr"])));
        assert!(!Measure::TcpSend.selected_by(&only(&["untouched_tcp_rr", "throughput"])));
        assert!(Measure::is_name("untouched_udp_other"));
        assert!(!Measure::is_name("selector_t1"));
    }

    #[test]
    fn the_rate_comes_from_sockperfs_valid_duration() {
        let text = "sockperf: [Total Run] RunTime=2.000 sec; Warm up time=400 msec; SentMessages=1000; ReceivedMessages=999\n\
                    sockperf: ========= Printing statistics for Server No: 0\n\
                    sockperf: [Valid Duration] RunTime=1.550 sec; SentMessages=31000; ReceivedMessages=31000\n";
        assert_eq!(sockperf_rate(text).unwrap(), 31000.0 / 1.55);
        assert!(sockperf_rate("nothing").is_err());
    }
}
