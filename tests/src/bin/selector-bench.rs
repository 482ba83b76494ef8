//! `cargo xtask bench`: the replica-stall benchmark (every policy, one run,
//! including several client hosts with a selector each), the overload
//! scenario (every replica stopped: no cap, drop, reject) and the per-packet
//! cost of the kernel programs. `--quick` runs a reduced version in under
//! two minutes. Results go to `--out` (default `target/bench/`): results.md,
//! results.csv, herding.csv, overload.csv, packet_cost.csv and PNG plots.
//! `--only throughput` (closed-loop throughput with the agent attached),
//! `--only scale` (64 groups of 8, a large in-flight table: sweep cost and
//! agent CPU), `--only untouched` (TCP and UDP the selector does not
//! steer, with and without the agent) write throughput.md, scale.md and
//! untouched.md. `--only failures` (a dead primary and a broken replica,
//! the agent at its defaults against primary only and ejection off)
//! writes failures.md and failures.csv. `--only slowdowns` (a replica
//! CPU-throttled, persistently slower, lossy, or behind kube-proxy's random
//! endpoint choice; DNS through glibc and memcached; or one case,
//! `slowdowns_throttled_30`) writes slowdowns.md. `--only resolver` (glibc's
//! getaddrinfo through a resolv.conf of two NSD nameservers, the first
//! stalling: no agent, the agent's defaults and threshold 1, each with and
//! without hedges) writes resolver.md. `--only steady` (one DNS query or
//! memcached get at a time against NSD and memcached, nothing stalling: no
//! agent, observe, threshold 1 and empty programs) writes steady.md and
//! steady.csv.

use std::{path::PathBuf, time::Duration};

use anyhow::Result;
use clap::{Parser, Subcommand};
use selector_testbed::bench::{
    self,
    agent_process::agent_beside,
    failures::FailureOptions,
    packet_cost::CostOptions,
    resolver::ResolverOptions,
    scale::ScaleOptions,
    slowdowns::SlowdownOptions,
    steady::{self, SteadyOptions},
    throughput::ThroughputOptions,
    untouched::{Measure, UntouchedOptions},
};
use selector_user::IngressMode;

#[derive(Parser)]
#[command(
    name = "selector-bench",
    about = "The BookKeeper replica-stall experiment: the selector against primary only, \
             the slow list, client-side reorder and nginx least_conn; plus per-packet cost"
)]
struct Args {
    #[command(subcommand)]
    command: Option<Sub>,
    /// A reduced run (short rows, fewer packets) that takes under two minutes.
    #[arg(long)]
    quick: bool,
    /// Client processes sending reads together.
    #[arg(long, default_value_t = 4)]
    clients: usize,
    /// Reads per second, all client processes together.
    #[arg(long, default_value_t = 4000)]
    rate: u32,
    /// Seconds of load per row [default: 45, quick: 4].
    #[arg(long)]
    duration: Option<f64>,
    /// Segments per row, interleaved with the other rows [default: 9, quick: 1].
    #[arg(long)]
    rounds: Option<u32>,
    /// How long the primary stalls (SIGSTOP), in milliseconds.
    #[arg(long, default_value_t = 25)]
    stall_ms: u64,
    /// How often the primary stalls, in milliseconds.
    #[arg(long, default_value_t = 500)]
    stall_every_ms: u64,
    /// Slow list: speculative retry timeout (30 ms as in BookKeeper issue 1489).
    #[arg(long, default_value_t = 30)]
    slow_list_timeout_ms: u64,
    /// Slow list: how long a slow replica is avoided (BookKeeper's default 60 s).
    #[arg(long, default_value_t = 60_000)]
    slow_list_expiry_ms: u64,
    /// Thresholds of the selector's threshold policy and of the client reorder.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 10, 100])]
    thresholds: Vec<u32>,
    /// Threshold of the selector's absolute policy row.
    #[arg(long, default_value_t = 10)]
    absolute_threshold: u32,
    /// Keys preloaded on every replica [default: 10000, quick: 2000].
    #[arg(long)]
    keys: Option<usize>,
    /// Wait for stragglers after the last send; also the request timeout.
    #[arg(long, default_value_t = 1000)]
    drain_ms: u64,
    /// Repeat count of the stateless per-packet measurements [default: 1000000, quick: 100000].
    #[arg(long)]
    packet_repeat: Option<u32>,
    /// Packets of the stateful per-packet measurements [default: 50000, quick: 5000].
    #[arg(long)]
    packet_fresh: Option<u32>,
    /// Other requests planted in the per-packet cost's small and large
    /// in-flight tables: the small one is the agent's default size (larger
    /// if its fill needs), the large one sized for its fill.
    #[arg(long, default_value_t = 1_000)]
    inflight_small: u32,
    #[arg(long, default_value_t = 1_000_000)]
    inflight_large: u32,
    /// The selector's response hook: auto (the agent's default: TC ingress
    /// on the testbed's veth devices), xdp or tc.
    #[arg(long, default_value = "auto", value_parser = ["auto", "xdp", "tc"])]
    ingress: String,
    /// Run only these rows (ids as in results.csv and overload.csv, or the
    /// part of an id before `_`, e.g. `overload`; comma-separated). `ID@RATE`
    /// runs the rows it names at RATE reads/s, as rows of their own
    /// (`hedge@2000,no_stall@2000`), interleaved with the others.
    /// `throughput`, `scale`, `resolver` and `failures` (or `failures_dead`,
    /// `failures_broken`, a row's id) and `slowdowns` (or
    /// `slowdowns_throttled_30`, a case's id) select those measurements, `untouched`
    /// the rows of traffic the selector does not steer (or one of them:
    /// `untouched_tcp_send`, `_tcp_receive`, `_tcp_rr`, `_udp_other`),
    /// `steady` the latency with nothing stalling (or `steady_dns`,
    /// `steady_memcached`);
    /// `cost`, which names no row, leaves only the per-packet cost.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Everything, in one run: the failure rows, the resolver rows, closed-loop throughput,
    /// the untouched traffic, the latency with nothing stalling and the agent at scale, then every row of the
    /// stall experiment with the per-packet cost (the report's command).
    #[arg(long, conflicts_with = "only")]
    all: bool,
    /// Client hosts in the herding rows (each with its own selector and one
    /// client process), at most 9.
    #[arg(long, default_value_t = 4)]
    herding_hosts: usize,
    /// Overload scenario: reads per second, all client processes together.
    #[arg(long, default_value_t = 2000)]
    overload_rate: u32,
    /// Overload scenario: seconds of load per row [default: 4, quick: 2].
    #[arg(long)]
    overload_duration: Option<f64>,
    /// Overload scenario: how long every replica is stopped, in the middle,
    /// in milliseconds [default: 1000, quick: 500].
    #[arg(long)]
    overload_stop_ms: Option<u64>,
    /// Overload scenario: max_pending of the drop and reject rows.
    #[arg(long, default_value_t = 32)]
    overload_max_pending: u32,
    /// Skip the per-packet cost measurement.
    #[arg(long)]
    skip_packet_cost: bool,
    /// Throughput: concurrent closed-loop gets.
    #[arg(long, default_value_t = 8)]
    throughput_concurrency: usize,
    /// Throughput: seconds per segment [default: 4, quick: 1].
    #[arg(long)]
    throughput_segment: Option<f64>,
    /// Throughput: segments per row [default: 7, quick: 2].
    #[arg(long)]
    throughput_rounds: Option<usize>,
    /// Untouched traffic: seconds per segment, whole [default: 3, quick: 1].
    #[arg(long)]
    untouched_segment: Option<u64>,
    /// Untouched traffic: segments per row, with and without the agent each
    /// [default: 6, quick: 2].
    #[arg(long)]
    untouched_rounds: Option<usize>,
    /// Scale: requests per second of the load.
    #[arg(long, default_value_t = 100_000)]
    scale_rate: u32,
    /// Scale: the agent's --inflight-max.
    #[arg(long, default_value_t = 1_048_576)]
    scale_inflight_max: u32,
    /// Scale: live requests planted for the in-process sweep timing [default: 1000000, quick: 100000].
    #[arg(long)]
    scale_planted: Option<u32>,
    /// Scale: seconds of each agent CPU window [default: 10, quick: 3].
    #[arg(long)]
    scale_window: Option<f64>,
    /// Failures: reads (queries) per second of the dead-primary and
    /// broken-replica rows.
    #[arg(long, default_value_t = 1000)]
    failure_rate: u32,
    /// Failures: how long the primary is dead, in milliseconds [default: 8000, quick: 1500].
    #[arg(long)]
    dead_outage_ms: Option<u64>,
    /// Failures: seconds of load of each broken-replica row [default: 14, quick: 2].
    #[arg(long)]
    broken_duration: Option<f64>,
    /// Steady latency: reads per second, one at a time.
    #[arg(long, default_value_t = 1000)]
    steady_rate: u32,
    /// Steady latency: seconds per segment [default: 2, quick: 1].
    #[arg(long)]
    steady_segment: Option<f64>,
    /// Steady latency: segments per row [default: 7, quick: 2].
    #[arg(long)]
    steady_rounds: Option<usize>,
    /// Resolver: lookups per second.
    #[arg(long, default_value_t = 300)]
    resolver_rate: u32,
    /// Resolver: seconds per segment [default: 20, quick: 3].
    #[arg(long)]
    resolver_segment: Option<f64>,
    /// Resolver: segments per row [default: 3, quick: 1].
    #[arg(long)]
    resolver_rounds: Option<u32>,
    /// Slowdowns: reads (lookups) per second.
    #[arg(long, default_value_t = 300)]
    slowdown_rate: u32,
    /// Slowdowns: seconds per segment [default: 10, quick: 3].
    #[arg(long)]
    slowdown_segment: Option<f64>,
    /// Slowdowns: segments per row [default: 2, quick: 1].
    #[arg(long)]
    slowdown_rounds: Option<u32>,
    /// The `selector` binary the rows that run the agent start
    /// [default: the one beside this binary].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Where results and plots go [default: target/bench in the workspace].
    #[arg(long)]
    out: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Sub {
    /// One client process (started by the benchmark itself).
    #[command(hide = true)]
    Client {
        #[arg(long)]
        spec: String,
    },
}

/// The quick mode's value or the full run's.
fn pick<T>(quick: bool, in_quick: T, in_full: T) -> T {
    if quick { in_quick } else { in_full }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(Sub::Client { spec }) = &args.command {
        return bench::client::main(spec);
    }
    bench::stop_on_signals();
    let out = args.out.clone().unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .map_or_else(|| PathBuf::from("target"), |root| root.join("target"))
            .join("bench")
    });
    let opts = bench::Options {
        client_exe: std::env::current_exe()?,
        out: out.clone(),
        quick: args.quick,
        clients: args.clients.max(1),
        rate: args.rate.max(1),
        duration: Duration::from_secs_f64(args.duration.unwrap_or(pick(args.quick, 4.0, 45.0))),
        rounds: args.rounds.unwrap_or(pick(args.quick, 1, 9)).max(1),
        stall: Duration::from_millis(args.stall_ms),
        stall_every: Duration::from_millis(args.stall_every_ms.max(1)),
        slow_list_timeout: Duration::from_millis(args.slow_list_timeout_ms),
        slow_list_expiry: Duration::from_millis(args.slow_list_expiry_ms),
        thresholds: args.thresholds.clone(),
        absolute_threshold: args.absolute_threshold,
        keys: args.keys.unwrap_or(pick(args.quick, 2000, 10_000)).max(1),
        drain: Duration::from_millis(args.drain_ms.max(1)),
        cost: CostOptions {
            repeat: args
                .packet_repeat
                .unwrap_or(pick(args.quick, 100_000, 1_000_000)),
            fresh: args.packet_fresh.unwrap_or(pick(args.quick, 5_000, 50_000)),
            inflight_small: args.inflight_small,
            inflight_large: args.inflight_large,
        },
        ingress: IngressMode::from_name(&args.ingress).unwrap_or(IngressMode::Auto),
        only: args.only.clone(),
        herding_hosts: args.herding_hosts.max(1),
        overload_rate: args.overload_rate.max(1),
        overload_duration: Duration::from_secs_f64(
            args.overload_duration.unwrap_or(pick(args.quick, 2.0, 4.0)),
        ),
        overload_stop: Duration::from_millis(
            args.overload_stop_ms.unwrap_or(pick(args.quick, 500, 1000)),
        ),
        overload_max_pending: args.overload_max_pending.max(1),
        skip_cost: args.skip_packet_cost,
        // What `cargo xtask bench ARGS` runs this binary with.
        command: std::iter::once("cargo xtask bench".to_string())
            .chain(std::env::args().skip(1))
            .collect::<Vec<_>>()
            .join(" "),
    };
    // The measurements that are not rows of the stall experiment, run
    // first when selected; the rest only if other ids are left.
    let extra = ["throughput", "scale", "resolver"];
    let mut opts = opts;
    if args.all {
        opts.only = [
            "failures",
            "slowdowns",
            "resolver",
            "throughput",
            "untouched",
            "steady",
            "scale",
        ]
        .map(String::from)
        .to_vec();
    }
    let selected = |id: &str| opts.only.iter().any(|o| o == id);
    let agent = match &args.agent {
        Some(a) => a.clone(),
        None => agent_beside(&std::env::current_exe()?),
    };
    std::fs::create_dir_all(&out)?;
    let failures: Vec<String> = opts
        .only
        .iter()
        .filter(|o| bench::failures::is_failure_id(o))
        .cloned()
        .collect();
    if !failures.is_empty() {
        let f = bench::failures::measure(
            &FailureOptions {
                agent: agent.clone(),
                rate: args.failure_rate.max(1),
                keys: opts.keys,
                before: Duration::from_secs_f64(pick(args.quick, 0.5, 1.0)),
                outage: Duration::from_millis(
                    args.dead_outage_ms.unwrap_or(pick(args.quick, 1500, 8000)),
                ),
                after: Duration::from_secs_f64(pick(args.quick, 0.5, 3.0)),
                broken: Duration::from_secs_f64(
                    args.broken_duration.unwrap_or(pick(args.quick, 2.0, 14.0)),
                ),
                stall: opts.stall,
                stall_every: opts.stall_every,
                drain: opts.drain,
                only: failures,
                quick: args.quick,
            },
            &opts.command,
        )?;
        f.write(&out)?;
        println!("{}", f.markdown());
    }
    let slowdowns: Vec<String> = opts
        .only
        .iter()
        .filter(|o| bench::slowdowns::is_slowdown_id(o))
        .cloned()
        .collect();
    if !slowdowns.is_empty() {
        let s = bench::slowdowns::measure(
            &SlowdownOptions {
                agent: agent.clone(),
                rate: args.slowdown_rate.max(1),
                segment: Duration::from_secs_f64(
                    args.slowdown_segment.unwrap_or(pick(args.quick, 3.0, 10.0)),
                ),
                rounds: args
                    .slowdown_rounds
                    .unwrap_or(pick(args.quick, 1, 2))
                    .max(1),
                cases: slowdowns
                    .iter()
                    .filter_map(|o| o.strip_prefix("slowdowns_"))
                    .map(String::from)
                    .collect(),
            },
            &opts.command,
        )?;
        std::fs::write(out.join("slowdowns.md"), s.markdown())?;
        println!("{}", s.markdown());
    }
    if selected("resolver") {
        let r = bench::resolver::measure(
            &ResolverOptions {
                agent: agent.clone(),
                rate: args.resolver_rate.max(1),
                segment: Duration::from_secs_f64(
                    args.resolver_segment.unwrap_or(pick(args.quick, 3.0, 20.0)),
                ),
                rounds: args
                    .resolver_rounds
                    .unwrap_or(pick(args.quick, 1, 3))
                    .max(1),
                stall: opts.stall,
                stall_every: opts.stall_every,
            },
            &opts.command,
        )?;
        std::fs::write(out.join("resolver.md"), r.markdown())?;
        println!("{}", r.markdown());
    }
    if selected("throughput") {
        let t = bench::throughput::measure(
            &ThroughputOptions {
                concurrency: args.throughput_concurrency.max(1),
                segment: Duration::from_secs_f64(
                    args.throughput_segment
                        .unwrap_or(pick(args.quick, 1.0, 4.0)),
                ),
                rounds: args
                    .throughput_rounds
                    .unwrap_or(pick(args.quick, 2, 7))
                    .max(1),
                keys: opts.keys,
                agent: agent.clone(),
            },
            &opts.command,
        )?;
        std::fs::write(out.join("throughput.md"), t.markdown())?;
        println!("{}", t.markdown());
    }
    let untouched: Vec<Measure> = Measure::ALL
        .into_iter()
        .filter(|m| m.selected_by(&opts.only))
        .collect();
    if !untouched.is_empty() {
        let u = bench::untouched::measure(
            &UntouchedOptions {
                measures: untouched,
                segment: Duration::from_secs(
                    args.untouched_segment
                        .unwrap_or(pick(args.quick, 1, 3))
                        .max(1),
                ),
                rounds: args
                    .untouched_rounds
                    .unwrap_or(pick(args.quick, 2, 6))
                    .max(1),
                agent: agent.clone(),
            },
            &opts.command,
        )?;
        std::fs::write(out.join("untouched.md"), u.markdown())?;
        std::fs::write(out.join("untouched.csv"), u.csv())?;
        println!("{}", u.markdown());
    }
    let protocols: Vec<steady::Protocol> = steady::Protocol::ALL
        .into_iter()
        .filter(|p| p.selected_by(&opts.only))
        .collect();
    if !protocols.is_empty() {
        let s = steady::measure(
            &SteadyOptions {
                protocols,
                rate: args.steady_rate.max(1),
                segment: Duration::from_secs_f64(
                    args.steady_segment.unwrap_or(pick(args.quick, 1.0, 2.0)),
                ),
                rounds: args.steady_rounds.unwrap_or(pick(args.quick, 2, 7)).max(1),
                agent: agent.clone(),
            },
            &opts.command,
        )?;
        std::fs::write(out.join("steady.md"), s.markdown())?;
        std::fs::write(out.join("steady.csv"), s.csv())?;
        println!("{}", s.markdown());
    }
    if selected("scale") {
        let s = bench::scale::measure(
            &ScaleOptions {
                inflight_max: args.scale_inflight_max.max(1),
                planted: args
                    .scale_planted
                    .unwrap_or(pick(args.quick, 100_000, 1_000_000)),
                rate: args.scale_rate,
                window: Duration::from_secs_f64(
                    args.scale_window.unwrap_or(pick(args.quick, 3.0, 10.0)),
                ),
                agent,
            },
            &opts.command,
        )?;
        std::fs::write(out.join("scale.md"), s.markdown())?;
        println!("{}", s.markdown());
    }
    // `--all` goes on with every row of the stall experiment.
    let had_only = !opts.only.is_empty() && !args.all;
    opts.only.retain(|o| {
        !extra.contains(&o.as_str())
            && !bench::failures::is_failure_id(o)
            && !bench::slowdowns::is_slowdown_id(o)
            && !Measure::is_name(o)
            && !steady::Protocol::is_name(o)
    });
    if had_only && opts.only.is_empty() {
        println!("written to {}", out.display());
        return Ok(());
    }
    let report = bench::run(&opts)?;
    println!("{}", report.markdown());
    println!("written to {}", out.display());
    Ok(())
}
