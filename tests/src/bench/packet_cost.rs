//! Per-packet cost through BPF_PROG_TEST_RUN: the kernel runs a program on
//! a packet and reports the time per run it measured itself.
//!
//! A large repeat count runs the *same* packet against the *same* maps
//! again and again, so only the first run of a stateful path is the path:
//! a tracked request becomes a retransmit of an in-flight request from the
//! second run on, a response finds its entry deleted, and a redirected
//! request, rewritten in place, is addressed to the replica. So:
//! - stateless paths (a packet for no backend, a retransmit, a response
//!   that matches nothing) and the empty programs run with a large repeat;
//! - the stateful paths (a new tracked request, a redirected one, the
//!   response that completes it) run once per packet, each with its own
//!   request id, many times, against the empty programs measured the same
//!   way; each request is completed by its response, so the in-flight
//!   table stays at the size under test.
//!
//! Everything is measured with the in-flight table holding a small and a
//! large number of other entries (1 thousand and 1 million by default), in
//! one map sized for the large case.
//!
//! The reference programs (the kernel crate's `reference` module: one hash
//! insert per request, one lookup and one delete per reply) run per packet
//! beside the selector's stateful paths, their hash map holding the same
//! other entries, so the selector's request and reply paths are also given
//! as ratios to the least work a request tracker does.

use std::{net::SocketAddrV4, time::Duration};

use anyhow::{Context as _, Result, bail, ensure};
use aya::{
    maps::HashMap,
    programs::{
        Program, ProgramError, SchedClassifier, TestRun, TestRunOptions, TestRunResult, Xdp,
    },
};
use etherparse::PacketBuilder;
use selector_common::{DEFAULT_INFLIGHT_MAX, Endpoint, InflightKey, TieBreak, bench, programs};
use selector_user::{Selector, Settings, datapath::bench::BenchPrograms, host::sys};

use crate::{memcached::frame, netns::Namespace};

const TC_ACT_PIPE: u32 = 3;
const TC_ACT_REDIRECT: u32 = 7;
const XDP_PASS: u32 = 2;
const CLIENT: [u8; 4] = [10, 77, 0, 1];
const PORT: u16 = 11211;
/// A port no member listens on.
const OTHER_PORT: u16 = 4433;
const GET: &[u8] = b"get key:000001\r\n";
const VALUE: &[u8] = b"VALUE key:000001 0 8\r\nvaluexyz\r\nEND\r\n";

fn replica(i: usize) -> [u8; 4] {
    [10, 77, 0, 10 + i as u8]
}

/// How much to measure.
#[derive(Clone, Debug)]
pub struct CostOptions {
    /// Repeat count of the stateless measurements.
    pub repeat: u32,
    /// Packets (each its own request) of the stateful measurements.
    pub fresh: u32,
    /// Other requests planted in the two in-flight tables compared: the
    /// small one is the agent's default size, the large one sized for its
    /// fill.
    pub inflight_small: u32,
    pub inflight_large: u32,
}

/// How a row was measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// One packet, `repeat` runs, kernel time / repeat.
    Repeat,
    /// `fresh` packets, one run each, mean kernel time.
    PerPacket,
}

/// One measured case at both table sizes, with its empty baseline.
#[derive(Clone, Debug)]
pub struct CostRow {
    pub program: &'static str,
    pub case: &'static str,
    pub method: Method,
    /// Part of the targets (the others are context).
    pub target: bool,
    /// ns per packet with the small and the large table.
    pub small_ns: f64,
    pub large_ns: f64,
    /// The empty program of the same kind, measured the same way.
    pub empty_small_ns: f64,
    pub empty_large_ns: f64,
}

impl CostRow {
    /// Cost over the empty program, at the larger of the two ratios.
    pub fn over_empty(&self) -> f64 {
        (self.small_ns / self.empty_small_ns).max(self.large_ns / self.empty_large_ns)
    }

    pub fn large_over_small(&self) -> f64 {
        self.large_ns / self.small_ns
    }
}

/// Measures inside `ns` (nothing is sent: test runs never reach a device,
/// but the programs see that namespace's loopback as their device).
pub fn measure(ns: &Namespace, opts: &CostOptions) -> Result<Vec<CostRow>> {
    let opts = opts.clone();
    ns.run(move || measure_here(&opts))?
}

struct Lab {
    sel: Selector,
    /// The baselines and the reference programs, from their own object.
    bench: BenchPrograms,
    /// Prefilled entries so far.
    filled: u32,
    /// Keys tried so far (a key whose probe window is full is skipped, as
    /// the kernel would pass that request untracked).
    keys_tried: u32,
    /// Measured requests that found their probe window full (not timed).
    skipped: u64,
}

/// (ns per packet, verdict of the first run).
type Timing = (f64, u32);

impl Lab {
    /// Runs program `name` (of kind `P`) on `data`, `repeat` times.
    fn run<P>(&mut self, name: &str, data: &[u8], repeat: u32) -> Result<Timing>
    where
        for<'p> &'p mut P: TryFrom<&'p mut Program, Error = ProgramError>,
        P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = TestRunResult>,
    {
        let ebpf = if bench::PROGRAMS.contains(&name) {
            self.bench.ebpf_mut()
        } else {
            self.sel.ebpf_mut()
        };
        let p: &mut P = ebpf
            .program_mut(name)
            .with_context(|| format!("{name} missing from the objects"))?
            .try_into()?;
        let r = p.test_run(TestRunOptions {
            data_in: Some(data),
            repeat,
            ..Default::default()
        })?;
        Ok((duration_ns(r.duration), r.return_value))
    }

    fn tc(&mut self, name: &str, data: &[u8], repeat: u32) -> Result<Timing> {
        self.run::<SchedClassifier>(name, data, repeat)
    }

    fn xdp(&mut self, name: &str, data: &[u8], repeat: u32) -> Result<Timing> {
        self.run::<Xdp>(name, data, repeat)
    }

    /// Adds other clients' requests until the table holds `target`.
    fn fill_to(&mut self, target: u32) -> Result<()> {
        let now = sys::monotonic_ns();
        while self.filled < target {
            let i = self.keys_tried;
            self.keys_tried += 1;
            ensure!(
                self.keys_tried - self.filled <= target / 100 + 100,
                "in-flight table too full: {} of {} keys found no free slot",
                self.keys_tried - self.filled,
                self.keys_tried
            );
            // Clients 10.78.x.y, 64 ports each, 16k ids per port.
            let key = InflightKey {
                client_addr: Endpoint::ipv4([10, 78, (i >> 22) as u8, (i >> 14) as u8], 0).addr,
                client_port: 30_000 + ((i >> 14) & 0x3f) as u16,
                _pad: 0,
                group: 0,
                request_id: u64::from(i & 0x3fff),
            };
            if self.sel.plant_inflight(&key, 0, 0, now) {
                self.reference()?.insert(key, now, 0)?;
                self.filled += 1;
            }
        }
        Ok(())
    }

    /// The reference programs' hash map.
    fn reference(&mut self) -> Result<HashMap<&mut aya::maps::MapData, InflightKey, u64>> {
        let map = self
            .bench
            .ebpf_mut()
            .map_mut(bench::REFERENCE)
            .context("the reference map")?;
        Ok(HashMap::try_from(map)?)
    }

    /// Requests (one per packet) through the reference request program,
    /// each completed by its reply through the reference reply program:
    /// (request ns, reply ns). The first request is checked to be inserted
    /// and then deleted, so both programs did their work.
    fn reference_requests_and_replies(&mut self, n: u32) -> Result<(f64, f64)> {
        let (mut requests, mut replies) = (0.0, 0.0);
        for i in 0..n {
            let (port, id) = fresh_request(i);
            let key = InflightKey::ipv4(CLIENT, port, 0, u64::from(id));
            requests += self
                .tc(bench::REFERENCE_REQUEST, &request(port, id, replica(0)), 1)?
                .0;
            if i == 0 {
                ensure!(
                    self.reference()?.get(&key, 0).is_ok(),
                    "the reference request inserted nothing"
                );
            }
            replies += self
                .xdp(bench::REFERENCE_REPLY, &response(port, id, 0), 1)?
                .0;
            if i == 0 {
                ensure!(
                    self.reference()?.get(&key, 0).is_err(),
                    "the reference reply deleted nothing"
                );
            }
        }
        let n = f64::from(n);
        Ok((requests / n, replies / n))
    }

    fn add_primary_issued(&mut self, delta: i64) -> Result<()> {
        self.sel.add_to_issued(0, delta);
        Ok(())
    }

    /// Requests (one per packet) through the egress program, each sent
    /// once more (a retransmit, one run) and then completed by its
    /// response through the ingress program: (egress ns, retransmit ns,
    /// ingress ns).
    fn requests_and_responses(
        &mut self,
        n: u32,
        served_by: usize,
        ids: fn(u32) -> (u16, u16),
    ) -> Result<(f64, f64, f64)> {
        let (mut egress, mut again, mut ingress) = (0.0, 0.0, 0.0);
        let want = if served_by == 0 {
            TC_ACT_PIPE
        } else {
            TC_ACT_REDIRECT
        };
        let mut measured = 0u32;
        for i in 0..n {
            let (port, id) = ids(i);
            let untracked_before = self.untracked()?;
            let (t, verdict) = self.tc(programs::EGRESS, &request(port, id, replica(0)), 1)?;
            if self.untracked()? > untracked_before {
                // Its probe window was full: passed untracked, another path.
                self.skipped += 1;
                continue;
            }
            ensure!(
                verdict == want,
                "egress verdict {verdict}, expected {want}: not the path under test"
            );
            egress += t;
            let (t, verdict) = self.tc(programs::EGRESS, &request(port, id, replica(0)), 1)?;
            ensure!(
                verdict == want,
                "retransmit verdict {verdict}, expected {want}"
            );
            again += t;
            let (t, _) = self.xdp(programs::INGRESS_XDP, &response(port, id, served_by), 1)?;
            ingress += t;
            measured += 1;
        }
        ensure!(
            measured >= n / 2,
            "only {measured} of {n} requests found a free slot"
        );
        let n = f64::from(measured);
        Ok((egress / n, again / n, ingress / n))
    }

    fn untracked(&self) -> Result<u64> {
        Ok(self.sel.stats()?.iter().map(|s| s.untracked).sum())
    }

    fn responses(&self) -> Result<u64> {
        Ok(self.sel.stats()?.iter().map(|s| s.responses).sum())
    }
}

/// The request of stateful packet `i`: its own (client port, request id),
/// the ids of a port in order, as memcached's clients number requests.
fn fresh_request(i: u32) -> (u16, u16) {
    (40_000 + (i >> 16) as u16, (i & 0xffff) as u16)
}

/// The same with the ids of a port scattered, as a resolver picks them (an
/// odd multiplier walks every 16-bit id in a jumbled order), on other ports
/// than `fresh_request`'s: no two requests of a row share a key.
fn scattered_request(i: u32) -> (u16, u16) {
    (20_000 + (i >> 16) as u16, (i as u16).wrapping_mul(40_503))
}

fn duration_ns(d: Duration) -> f64 {
    d.as_nanos() as f64
}

fn udp(src: ([u8; 4], u16), dst: ([u8; 4], u16), payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    PacketBuilder::ethernet2([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 0x10])
        .ipv4(src.0, dst.0, 64)
        .udp(src.1, dst.1)
        .write(&mut out, payload)
        .expect("a valid packet");
    out
}

fn request(port: u16, id: u16, to: [u8; 4]) -> Vec<u8> {
    udp((CLIENT, port), (to, PORT), &frame(id, GET))
}

fn response(port: u16, id: u16, from: usize) -> Vec<u8> {
    udp((replica(from), PORT), (CLIENT, port), &frame(id, VALUE))
}

/// Every measurement at one table size, in row order.
#[derive(Default)]
struct Sizes {
    ns: Vec<f64>,
    empty: Vec<f64>,
}

impl Sizes {
    /// Adds `other / n`, for a mean over `n` batches.
    fn add_share(&mut self, other: &Sizes, n: usize) {
        let share = |mine: &mut Vec<f64>, theirs: &[f64]| {
            mine.resize(theirs.len(), 0.0);
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += t / n as f64;
            }
        };
        share(&mut self.ns, &other.ns);
        share(&mut self.empty, &other.empty);
    }
}

/// Measurements are taken in this many batches, alternating between the
/// two table sizes, so a machine that gets busier or quieter meanwhile
/// affects both alike.
const BATCHES: usize = 5;

/// One batch of every measurement on `lab`: `fresh` packets per stateful
/// case, `r` repeats per stateless one.
fn measure_batch(lab: &mut Lab, fresh: u32, r: u32) -> Result<Sizes> {
    let o = CostOptions {
        repeat: r,
        fresh,
        inflight_small: 0,
        inflight_large: 0,
    };
    let req = request(50_000, 7, replica(0));
    let resp = response(50_000, 7, 0);
    let (empty_tc, _) = lab.tc(bench::BASELINE_TC, &req, r)?;
    let (empty_xdp, _) = lab.xdp(bench::BASELINE_XDP, &resp, r)?;
    let (reference_request, reference_reply) = lab.reference_requests_and_replies(fresh)?;
    let (mut empty_tc_1, mut empty_xdp_1) = (0.0, 0.0);
    for i in 0..o.fresh {
        let (port, id) = fresh_request(i);
        empty_tc_1 += lab
            .tc(bench::BASELINE_TC, &request(port, id, replica(0)), 1)?
            .0;
        empty_xdp_1 += lab.xdp(bench::BASELINE_XDP, &response(port, id, 0), 1)?.0;
    }
    let n = f64::from(o.fresh);
    let (empty_tc_1, empty_xdp_1) = (empty_tc_1 / n, empty_xdp_1 / n);

    let (before, skipped_before) = (lab.responses()?, lab.skipped);
    let (tracked, retransmit_1, completed) =
        lab.requests_and_responses(o.fresh, 0, fresh_request)?;
    let (tracked_scattered, _, _) = lab.requests_and_responses(o.fresh, 0, scattered_request)?;
    // The primary far over the threshold: every request is redirected.
    lab.add_primary_issued(1_000_000)?;
    let redirected = lab.requests_and_responses(o.fresh, 1, fresh_request);
    lab.add_primary_issued(-1_000_000)?;
    let (redirected, _, completed_redirected) = redirected?;
    let answered = lab.responses()? - before;
    if answered != 3 * u64::from(o.fresh) - (lab.skipped - skipped_before) {
        bail!(
            "only {answered} of {} responses completed a request",
            3 * o.fresh
        );
    }

    let (no_backend, v) = lab.tc(programs::EGRESS, &request(50_001, 8, [10, 77, 0, 99]), r)?;
    ensure!(v == TC_ACT_PIPE, "no-backend verdict {v}");
    let mut no_backend_1 = 0.0;
    for i in 0..o.fresh {
        let (port, id) = fresh_request(i);
        no_backend_1 += lab
            .tc(programs::EGRESS, &request(port, id, [10, 77, 0, 99]), 1)?
            .0;
    }
    let no_backend_1 = no_backend_1 / n;
    // UDP to a port no member listens on (QUIC, other services): passed
    // on its port's bit, before the endpoint lookup.
    let other_port = udp((CLIENT, 50_002), (replica(0), OTHER_PORT), &frame(9, GET));
    let (other_port, v) = lab.tc(programs::EGRESS, &other_port, r)?;
    ensure!(v == TC_ACT_PIPE, "other-port verdict {v}");
    // The first run tracks it; the other runs are retransmits.
    let (retransmit, _) = lab.tc(programs::EGRESS, &req, r)?;
    let (_, v) = lab.xdp(programs::INGRESS_XDP, &resp, 1)?;
    ensure!(v == XDP_PASS, "ingress verdict {v}");
    // Its entry is gone now: every run matches nothing.
    let (unmatched, _) = lab.xdp(programs::INGRESS_XDP, &resp, r)?;

    Ok(Sizes {
        ns: vec![
            tracked,
            tracked_scattered,
            redirected,
            no_backend,
            no_backend_1,
            other_port,
            retransmit,
            retransmit_1,
            completed,
            completed_redirected,
            unmatched,
            reference_request,
            reference_reply,
        ],
        empty: vec![
            empty_tc_1,
            empty_tc_1,
            empty_tc_1,
            empty_tc,
            empty_tc_1,
            empty_tc,
            empty_tc,
            empty_tc_1,
            empty_xdp_1,
            empty_xdp_1,
            empty_xdp,
            empty_tc_1,
            empty_xdp_1,
        ],
    })
}

/// (program, case, method, one of the targets), in row order.
const CASES: [(&str, &str, Method, bool); 13] = [
    ("egress (TC)", "tracked request", Method::PerPacket, true),
    ("egress (TC)", TRACKED_SCATTERED, Method::PerPacket, true),
    ("egress (TC)", "redirected request", Method::PerPacket, true),
    ("egress (TC)", "packet for no backend", Method::Repeat, true),
    (
        "egress (TC)",
        "packet for no backend",
        Method::PerPacket,
        false,
    ),
    (
        "egress (TC)",
        "datagram to a port no member has",
        Method::Repeat,
        false,
    ),
    (
        "egress (TC)",
        "retransmit of an in-flight request",
        Method::Repeat,
        false,
    ),
    (
        "egress (TC)",
        "retransmit of an in-flight request",
        Method::PerPacket,
        false,
    ),
    ("ingress (XDP)", "response", Method::PerPacket, true),
    (
        "ingress (XDP)",
        "response to a redirected request",
        Method::PerPacket,
        false,
    ),
    (
        "ingress (XDP)",
        "response matching nothing",
        Method::Repeat,
        false,
    ),
    (
        REFERENCE_TC,
        REFERENCE_REQUEST_CASE,
        Method::PerPacket,
        false,
    ),
    (
        REFERENCE_XDP,
        REFERENCE_REPLY_CASE,
        Method::PerPacket,
        false,
    ),
];

/// A tracked request whose client picks its ids out of order (DNS): no
/// two of a socket's requests in a row share a page of the table.
const TRACKED_SCATTERED: &str = "tracked request, ids scattered";
const REFERENCE_TC: &str = "reference (TC)";
const REFERENCE_XDP: &str = "reference (XDP)";
const REFERENCE_REQUEST_CASE: &str = "request: one hash insert";
const REFERENCE_REPLY_CASE: &str = "reply: one lookup and one delete";

/// One of the selector's paths over the reference's, measured the same
/// way in the same run.
#[derive(Clone, Debug)]
pub struct ReferenceRatio {
    pub path: &'static str,
    /// ns per packet over the reference's, with the small / large table.
    pub small: f64,
    pub large: f64,
    /// The same with the empty program's time taken off both sides (the
    /// work of the programs alone).
    pub small_net: f64,
    pub large_net: f64,
}

impl ReferenceRatio {
    pub fn worst(&self) -> f64 {
        self.small.max(self.large)
    }
}

/// The request path (a new tracked request) over the reference request,
/// and the reply path (the response that completes it) over the
/// reference reply; none if the rows are missing.
pub fn reference_ratios(costs: &[CostRow]) -> Vec<ReferenceRatio> {
    let row = |program: &str, case: &str| {
        costs
            .iter()
            .find(|c| c.program == program && c.case == case)
    };
    let ratio = |path, mine: Option<&CostRow>, base: Option<&CostRow>| {
        let (m, b) = (mine?, base?);
        Some(ReferenceRatio {
            path,
            small: m.small_ns / b.small_ns,
            large: m.large_ns / b.large_ns,
            small_net: (m.small_ns - m.empty_small_ns) / (b.small_ns - b.empty_small_ns),
            large_net: (m.large_ns - m.empty_large_ns) / (b.large_ns - b.empty_large_ns),
        })
    };
    [
        ratio(
            "request path (tracked request / reference request)",
            row("egress (TC)", "tracked request"),
            row(REFERENCE_TC, REFERENCE_REQUEST_CASE),
        ),
        ratio(
            "request path, ids scattered (tracked request / reference request)",
            row("egress (TC)", TRACKED_SCATTERED),
            row(REFERENCE_TC, REFERENCE_REQUEST_CASE),
        ),
        ratio(
            "reply path (response / reference reply)",
            row("ingress (XDP)", "response"),
            row(REFERENCE_XDP, REFERENCE_REPLY_CASE),
        ),
    ]
    .into_iter()
    .flatten()
    .collect()
}

fn measure_here(o: &CostOptions) -> Result<Vec<CostRow>> {
    ensure!(o.repeat > 0 && o.fresh > 0 && o.inflight_small < o.inflight_large);
    let replicas: Vec<SocketAddrV4> = (0..3)
        .map(|i| SocketAddrV4::new(replica(i).into(), PORT))
        .collect();
    let settings = |inflight_max| {
        Settings {
            inflight_max,
            ..Settings::new("lo", vec![replicas.iter().map(|&r| r.into()).collect()])
        }
        .tuned(|t| {
            t.threshold = 1;
            // The replies are built from the replica `first` picks (and the
            // costs in docs/bench/ were measured with it).
            t.tie_break = TieBreak::First;
        })
    };
    // Two copies of the programs and maps, one per table: the small one
    // the agent's default size (what ships), the large one sized for its
    // fill, which then finds the table about a quarter full, where a probe
    // window is rarely full.
    let mut labs = Vec::new();
    for fill in [o.inflight_small, o.inflight_large] {
        let inflight_max = fill.max(DEFAULT_INFLIGHT_MAX);
        // The reference map is sized alike, for the fill and the measured
        // requests.
        let reference_entries = inflight_max + o.fresh + 16;
        let sel = Selector::load(&settings(inflight_max)).context("loading the programs")?;
        let bench = BenchPrograms::load(reference_entries)?;
        let mut lab = Lab {
            sel,
            bench,
            filled: 0,
            keys_tried: 0,
            skipped: 0,
        };
        lab.fill_to(fill)?;
        labs.push(lab);
    }
    let (fresh, repeat) = (
        o.fresh.div_ceil(BATCHES as u32),
        o.repeat.div_ceil(BATCHES as u32),
    );
    let (mut small, mut large) = (Sizes::default(), Sizes::default());
    for _ in 0..BATCHES {
        small.add_share(&measure_batch(&mut labs[0], fresh, repeat)?, BATCHES);
        large.add_share(&measure_batch(&mut labs[1], fresh, repeat)?, BATCHES);
    }
    Ok(CASES
        .iter()
        .enumerate()
        .map(|(i, &(program, case, method, target))| CostRow {
            program,
            case,
            method,
            target,
            small_ns: small.ns[i],
            large_ns: large.ns[i],
            empty_small_ns: small.empty[i],
            empty_large_ns: large.empty[i],
        })
        .collect())
}
