//! The experiment: three memcached replicas, client processes reading from
//! the primary at a fixed rate, the primary stopped for a short while at a
//! fixed period, one row per policy, all in one run.

use std::{
    io::Read as _,
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use selector_common::{Policy, programs};
use selector_user::{
    IngressMode, Selector, Settings,
    config::{
        defaults::RunDefaults,
        hedge::HedgeSettings,
        settings::{ReplyPath, default_heartbeat_bound, sweep_period},
    },
    datapath::next_hops,
};

use super::{
    client::{
        ClientPolicy, ClientReport, ClientSpec, decode_histogram, marked_value, monotonic_ns,
    },
    nginx::Nginx,
    packet_cost::{self, CostOptions},
    report::{KernelCounts, Report, RowResult},
    rows::{self, Row},
};
use crate::{
    Namespace, Testbed,
    memcached::{MemcachedClient, Replica, key_for},
    topology::CLIENT_IFACE,
};

/// Everything the benchmark can be told.
#[derive(Clone, Debug)]
pub struct Options {
    /// The binary whose hidden `client` subcommand runs a client process.
    pub client_exe: PathBuf,
    pub out: PathBuf,
    pub quick: bool,
    pub clients: usize,
    /// Reads per second, all client processes together.
    pub rate: u32,
    /// Length of each row's load, in total.
    pub duration: Duration,
    /// Every row runs in this many segments, interleaved with the other
    /// rows (round 1 of every row, then round 2, ...), so a machine that
    /// gets busier or quieter during the run affects every row alike.
    pub rounds: u32,
    pub stall: Duration,
    pub stall_every: Duration,
    pub slow_list_timeout: Duration,
    pub slow_list_expiry: Duration,
    /// Selector thresholds (and the client reorder's, the same values).
    pub thresholds: Vec<u32>,
    pub absolute_threshold: u32,
    pub keys: usize,
    /// Wait for stragglers after the last send; also the request timeout.
    pub drain: Duration,
    pub cost: CostOptions,
    /// Where the selector's response program attaches in its rows (the
    /// agent's default, `auto`, unless told).
    pub ingress: IngressMode,
    /// Run only the rows with these ids, or ids starting with one of
    /// these and `_` (all when empty); `ID@RATE` runs them at RATE reads/s
    /// (`rows::plan`).
    pub only: Vec<String>,
    /// Client hosts in the herding rows, each with its own selector.
    pub herding_hosts: usize,
    /// The overload scenario: reads per second, length of each row, how
    /// long every replica is stopped (in the middle), and the
    /// `max_pending` of its drop and reject rows.
    pub overload_rate: u32,
    pub overload_duration: Duration,
    pub overload_stop: Duration,
    pub overload_max_pending: u32,
    /// Skip the per-packet cost.
    pub skip_cost: bool,
    /// The command line, for the report.
    pub command: String,
}

impl Options {
    /// Length of one segment of a row.
    pub fn segment(&self) -> Duration {
        self.duration / self.rounds.max(1)
    }

    /// The overload rows' drain after the last send, also their request
    /// timeout and the selector's: the stop plus the usual drain, so a read
    /// that waits out the whole stop is late, not lost.
    pub fn overload_drain(&self) -> Duration {
        self.overload_stop + self.drain
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

/// Ctrl-C or SIGTERM end the run between steps, through the normal error
/// path, so every namespace and process is still removed.
pub fn stop_on_signals() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

/// An error once Ctrl-C or SIGTERM came (after `stop_on_signals`).
pub(crate) fn check_interrupted() -> Result<()> {
    if INTERRUPTED.load(Ordering::Relaxed) {
        bail!("interrupted");
    }
    Ok(())
}

/// Runs every row and the per-packet costs, writes the report and plots
/// under `opts.out`, and returns the report. The testbed (namespaces,
/// memcached, nginx, client processes, the selector) is gone when this
/// returns, whether it succeeds or not.
pub fn run(opts: &Options) -> Result<Report> {
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;
    let rows = rows::plan(
        &Row::all(&opts.thresholds, opts.absolute_threshold),
        &opts.only,
    )?;
    let overload_rows: Vec<Row> = Row::overload(opts.overload_max_pending)
        .into_iter()
        .filter(|r| r.selected_by(&opts.only))
        .collect();
    let segment = opts.segment();
    if !rows.is_empty() {
        eprintln!(
            "bench: {} rows of {} x {:.1} s at {} reads/s (unless the row says) from {} client processes; primary stalls {} ms every {} ms",
            rows.len(),
            opts.rounds,
            segment.as_secs_f64(),
            opts.rate,
            opts.clients,
            opts.stall.as_millis(),
            opts.stall_every.as_millis()
        );
    }
    if !overload_rows.is_empty() {
        eprintln!(
            "bench: {} overload rows of {:.1} s at {} reads/s; every replica stopped for {} ms in the middle",
            overload_rows.len(),
            opts.overload_duration.as_secs_f64(),
            opts.overload_rate,
            opts.overload_stop.as_millis()
        );
    }
    let (results, overload, costs) = {
        let hosts = if rows.iter().any(|(r, _)| r.several_hosts()) {
            opts.herding_hosts
        } else {
            1
        };
        let mut tb = Testbed::with_clients("bench", 3, hosts)?;
        tb.start_memcached()?;
        preload_marked(&tb.client, &tb.replica_endpoints(), opts.keys)?;
        let mut results: Vec<RowResult> = rows
            .iter()
            .map(|(r, at)| RowResult::new(r.clone(), *at, at.unwrap_or(opts.rate), Duration::ZERO))
            .collect();
        for round in 1..=opts.rounds {
            for ((row, at), result) in rows.iter().zip(&mut results) {
                check_interrupted()?;
                let r = run_row(&tb, opts, row, *at, segment)
                    .with_context(|| format!("row {}", result.label()))?;
                eprintln!("bench: round {round}/{}: {}", opts.rounds, r.one_line());
                result.append(r)?;
            }
        }
        // The overload rows stop every replica for a long while: one block
        // after the stall rows, each row once.
        let mut overload = Vec::new();
        for row in &overload_rows {
            check_interrupted()?;
            let r =
                run_overload_row(&tb, opts, row).with_context(|| format!("row {}", row.label()))?;
            eprintln!("bench: {}", r.one_line());
            overload.push(r);
        }
        check_interrupted()?;
        let costs = if opts.skip_cost {
            Vec::new()
        } else {
            eprintln!("bench: per-packet cost (BPF_PROG_TEST_RUN)");
            packet_cost::measure(&tb.client, &opts.cost)?
        };
        (results, overload, costs)
    };
    let report = Report::new(opts, results, overload, costs);
    report.write(&opts.out)?;
    Ok(report)
}

/// Stores, on each replica, its own marked value for every key.
pub fn preload_marked(client: &Namespace, replicas: &[SocketAddrV4], keys: usize) -> Result<()> {
    for (r, &addr) in replicas.iter().enumerate() {
        client.run(move || -> Result<()> {
            let c = MemcachedClient::connect(addr)?;
            for i in 0..keys {
                c.set(&key_for(i), &marked_value(i, r))?;
            }
            Ok(())
        })??;
    }
    Ok(())
}

/// The selector attached in the client namespace and swept as the agent
/// sweeps at its defaults (`sweep_period` of the default `--interval`, the
/// row's timeout and the default heartbeat bound) until dropped.
struct Attached {
    selector: Arc<Mutex<Selector>>,
    /// Kernel run-time statistics of every BPF program while held.
    _stats: Option<std::os::fd::OwnedFd>,
    stop: Option<mpsc::Sender<()>>,
    sweeper: Option<thread::JoinHandle<Result<()>>>,
}

impl Attached {
    /// Attaches in `ns` (a client host).
    fn start(ns: &Namespace, settings: Settings) -> Result<Self> {
        // What `selector run` derives when `--interval` and
        // `--heartbeat-bound` are not given.
        let interval = RunDefaults::default().interval;
        let settings = Settings {
            heartbeat_bound: default_heartbeat_bound(interval, settings.timeout),
            ..settings
        };
        let sweep_every = sweep_period(interval, settings.timeout, settings.heartbeat_bound);
        // Not in observe mode, whose row measures the cost of being attached
        // (the statistics add two clock reads per program run).
        let stats = if settings.tunables.policy == Policy::Observe {
            None
        } else {
            Some(aya::sys::enable_stats(aya::sys::Stats::RunTime).context("BPF run-time stats")?)
        };
        let selector = ns.run(move || {
            let mut selector = Selector::attach(&settings)?;
            next_hops::publish_once(&mut selector, Duration::from_secs(1));
            anyhow::Ok(selector)
        })??;
        let selector = Arc::new(Mutex::new(selector));
        let (stop, stopped) = mpsc::channel::<()>();
        let sweeper = {
            let selector = selector.clone();
            thread::spawn(move || -> Result<()> {
                let mut next_sweep = Instant::now() + sweep_every;
                while let Err(mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(Duration::from_millis(10))
                {
                    let mut s = selector.lock().unwrap_or_else(|e| e.into_inner());
                    let now = Instant::now();
                    if now >= next_sweep {
                        s.sweep(monotonic_ns())?;
                        next_sweep = now + sweep_every;
                    }
                    // `--hedge-after auto`: the delays follow the latencies
                    // when due, as in the agent's loop (never otherwise).
                    // Compared with the time now, not `now`: before `auto`
                    // begins, the due time is the moment it is asked for,
                    // which is always after `now`.
                    if s.hedge_refresh_due()
                        .is_some_and(|due| due <= Instant::now())
                    {
                        s.refresh_hedge_delays()?;
                    }
                    // The memory of slowness, at the agent's step while
                    // reads flow (`--avoid-slow`, on by default).
                    s.check_slowness(monotonic_ns());
                }
                Ok(())
            })
        };
        Ok(Self {
            selector,
            _stats: stats,
            stop: Some(stop),
            sweeper: Some(sweeper),
        })
    }

    fn counts(&self) -> Result<KernelCounts> {
        let s = self.selector.lock().unwrap_or_else(|e| e.into_inner());
        let stats = s.stats()?;
        let run = |name: &str| -> Result<(u64, u64)> {
            let info = s.ebpf().program(name).context("program")?.info()?;
            Ok((info.run_count(), info.run_time().as_nanos() as u64))
        };
        let hedges = s.hedge_counts()?;
        let (egress_runs, egress_ns) = run(programs::EGRESS)?;
        let ingress = match s.reply_path {
            ReplyPath::Xdp => programs::INGRESS_XDP,
            ReplyPath::Tc => programs::INGRESS_TC,
        };
        let (ingress_runs, ingress_ns) = run(ingress)?;
        Ok(KernelCounts {
            requests: stats.iter().map(|b| b.requests).sum(),
            redirected: stats.iter().map(|b| b.redirected_away).sum(),
            untracked: stats.iter().map(|b| b.untracked).sum(),
            expired: s.expired().iter().sum(),
            overload_passed: stats.iter().map(|b| b.overload_passed).sum(),
            overload_dropped: stats.iter().map(|b| b.overload_dropped).sum(),
            overload_rejected: stats.iter().map(|b| b.overload_rejected).sum(),
            hedges_sent: hedges.iter().map(|h| h.hedges_sent).sum(),
            hedges_won: hedges.iter().map(|h| h.hedges_won).sum(),
            egress_runs,
            egress_ns,
            ingress_runs,
            ingress_ns,
        })
    }

    fn finish(mut self) -> Result<()> {
        self.stop.take();
        match self.sweeper.take().map(thread::JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => bail!("the sweeper panicked"),
            None => Ok(()),
        }
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.stop.take();
        if let Some(s) = self.sweeper.take() {
            let _ = s.join();
        }
    }
}

/// Client processes; any still running on drop are killed.
struct Clients(Vec<Child>);

impl Drop for Clients {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Clients {
    /// Starts a client process in `ns` for each of `specs`.
    fn start(&mut self, ns: &Namespace, exe: &PathBuf, specs: &[ClientSpec]) -> Result<()> {
        for spec in specs {
            let child = Command::new("ip")
                .args(["netns", "exec", &ns.name])
                .arg(exe)
                .args(["client", "--spec", &serde_json::to_string(spec)?])
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .context("starting a client process")?;
            self.0.push(child);
        }
        Ok(())
    }

    /// Waits for every process and reads its report.
    fn collect(&mut self) -> Result<Vec<ClientReport>> {
        let mut reports = Vec::new();
        for child in &mut self.0 {
            let mut out = String::new();
            if let Some(mut stdout) = child.stdout.take() {
                stdout.read_to_string(&mut out)?;
            }
            let status = child.wait()?;
            if !status.success() {
                bail!("a client process failed ({status})");
            }
            reports.push(serde_json::from_str(out.trim()).context("a client's report")?);
        }
        Ok(reports)
    }
}

/// Stops `replica` for `stall` every `every`, from `every / 2` on, while
/// the load runs; returns the stalls as (start, end) seconds from `start_ns`.
fn drive_stalls(
    replica: &Replica,
    start_ns: u64,
    duration: Duration,
    stall: Duration,
    every: Duration,
) -> Vec<(f64, f64)> {
    let mut stalls = Vec::new();
    let end = start_ns + duration.as_nanos() as u64;
    let mut at = start_ns + every.as_nanos() as u64 / 2;
    while at + stall.as_nanos() as u64 <= end && !INTERRUPTED.load(Ordering::Relaxed) {
        sleep_until(at);
        replica.stop();
        let stopped = monotonic_ns();
        sleep_until(stopped + stall.as_nanos() as u64);
        replica.resume();
        let resumed = monotonic_ns();
        let secs = |t: u64| (t.saturating_sub(start_ns)) as f64 / 1e9;
        stalls.push((secs(stopped), secs(resumed)));
        at += every.as_nanos() as u64;
    }
    stalls
}

/// Stops every replica at `at` for `stop`, then resumes them all; returns
/// the stop as (start, end) seconds from `start_ns`.
fn stop_all(replicas: &[Replica], start_ns: u64, at: u64, stop: Duration) -> Option<(f64, f64)> {
    sleep_until(at);
    if INTERRUPTED.load(Ordering::Relaxed) {
        return None;
    }
    for r in replicas {
        r.stop();
    }
    let stopped = monotonic_ns();
    sleep_until(stopped + stop.as_nanos() as u64);
    for r in replicas {
        r.resume();
    }
    let resumed = monotonic_ns();
    let secs = |t: u64| (t.saturating_sub(start_ns)) as f64 / 1e9;
    Some((secs(stopped), secs(resumed)))
}

fn sleep_until(t: u64) {
    let now = monotonic_ns();
    if t > now {
        thread::sleep(Duration::from_nanos(t - now));
    }
}

/// Where nginx listens: the client host's loopback.
const PROXY: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::LOCALHOST, 11311);

/// One segment of a stall row at `at` reads/s (the benchmark's rate if
/// none). Rows with several hosts run one client process and one selector
/// on each client host; the others run every client process on the client.
fn run_row(
    tb: &Testbed,
    opts: &Options,
    row: &Row,
    at: Option<u32>,
    duration: Duration,
) -> Result<RowResult> {
    let replicas = tb.replica_endpoints();
    let rate = at.unwrap_or(opts.rate);
    let hosts: Vec<&Namespace> = if row.several_hosts() {
        tb.clients()
    } else {
        vec![&tb.client]
    };
    let attached = match row.selector() {
        Some((policy, threshold)) => hosts
            .iter()
            .map(|ns| {
                Attached::start(
                    ns,
                    Settings {
                        timeout: opts.drain,
                        ingress: opts.ingress,
                        ..Settings::new(
                            CLIENT_IFACE,
                            vec![replicas.iter().map(|&r| r.into()).collect()],
                        )
                    }
                    .tuned(|t| {
                        t.policy = policy;
                        t.threshold = threshold;
                        t.tie_break = row.tie_break();
                        t.hedging = HedgeSettings {
                            after: row.hedge_after(),
                            ..Default::default()
                        };
                        t.budget = row
                            .budget()
                            .unwrap_or(Settings::new(CLIENT_IFACE, vec![]).tunables.budget);
                    }),
                )
            })
            .collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    let nginx = match row {
        Row::Nginx => Some(Nginx::start(
            &tb.client,
            &opts.out.join("nginx"),
            PROXY,
            &replicas,
        )?),
        _ => None,
    };
    let targets = if row.client_side_choice() {
        replicas.clone()
    } else if let Some(n) = &nginx {
        vec![n.listen]
    } else {
        vec![replicas[0]]
    };
    // Time for every process to start before the first send.
    let start_ns = monotonic_ns() + 500_000_000;
    // One process per host with several hosts, else `opts.clients` on the
    // client; all on one schedule.
    let processes = if row.several_hosts() {
        hosts.len()
    } else {
        opts.clients
    };
    let specs: Vec<ClientSpec> = (0..processes)
        .map(|index| ClientSpec {
            index,
            clients: processes,
            policy: row.client_policy(
                opts.slow_list_timeout.as_millis() as u64,
                opts.slow_list_expiry.as_millis() as u64,
            ),
            targets: targets.clone(),
            replicas: replicas.len(),
            rate: f64::from(rate),
            start_ns,
            duration_ms: duration.as_millis() as u64,
            drain_ms: opts.drain.as_millis() as u64,
            request_timeout_ms: opts.drain.as_millis() as u64,
            keys: opts.keys,
            window_ns: None,
        })
        .collect();
    let mut clients = Clients(Vec::new());
    if row.several_hosts() {
        for (ns, spec) in hosts.iter().zip(&specs) {
            clients.start(ns, &opts.client_exe, std::slice::from_ref(spec))?;
        }
    } else {
        clients.start(&tb.client, &opts.client_exe, &specs)?;
    }
    let (reports, stalls) = thread::scope(|s| {
        let driver = row.stalls().then(|| {
            s.spawn(|| {
                drive_stalls(
                    &tb.replicas[0],
                    start_ns,
                    duration,
                    opts.stall,
                    opts.stall_every,
                )
            })
        });
        let reports = clients.collect();
        let stalls = driver.map(|d| d.join().unwrap_or_default());
        (reports, stalls.unwrap_or_default())
    });
    let reports = reports?;
    let mut kernel = None::<KernelCounts>;
    for a in attached {
        let counts = a.counts()?;
        a.finish()?;
        kernel
            .get_or_insert_with(KernelCounts::default)
            .add(&counts);
    }
    drop(nginx);
    let mut result = RowResult::new(row.clone(), at, rate, duration);
    result.stalls = stalls;
    result.kernel = kernel;
    for r in &reports {
        let hist = decode_histogram(&r.histogram)?;
        if row.several_hosts() {
            result.add_host(r, &hist)?;
        } else {
            result.add(r, &hist)?;
        }
    }
    Ok(result)
}

/// One row of the overload scenario: the selector attached with the row's
/// cap and overload action, reads to the primary at `overload_rate`, and
/// every replica stopped for `overload_stop` in the middle of the load.
fn run_overload_row(tb: &Testbed, opts: &Options, row: &Row) -> Result<RowResult> {
    let Row::Overload { on, cap } = *row else {
        bail!("not an overload row");
    };
    let replicas = tb.replica_endpoints();
    let drain = opts.overload_drain();
    let attached = Attached::start(
        &tb.client,
        Settings {
            timeout: drain,
            grace: drain,
            ingress: opts.ingress,
            ..Settings::new(
                CLIENT_IFACE,
                vec![replicas.iter().map(|&r| r.into()).collect()],
            )
        }
        .tuned(|t| {
            t.max_pending = cap;
            t.on_overload = on;
        }),
    )?;
    let duration = opts.overload_duration;
    let start_ns = monotonic_ns() + 500_000_000;
    let stop_ns = opts.overload_stop.as_nanos() as u64;
    let stop_at = start_ns + (duration.as_nanos() as u64).saturating_sub(stop_ns) / 2;
    let specs: Vec<ClientSpec> = (0..opts.clients)
        .map(|index| ClientSpec {
            index,
            clients: opts.clients,
            policy: ClientPolicy::Primary,
            targets: vec![replicas[0]],
            replicas: replicas.len(),
            rate: f64::from(opts.overload_rate),
            start_ns,
            duration_ms: duration.as_millis() as u64,
            drain_ms: drain.as_millis() as u64,
            request_timeout_ms: drain.as_millis() as u64,
            keys: opts.keys,
            window_ns: Some((stop_at, stop_at + stop_ns)),
        })
        .collect();
    let buffer_drops_before = replica_buffer_drops(tb)?;
    let mut clients = Clients(Vec::new());
    clients.start(&tb.client, &opts.client_exe, &specs)?;
    let (reports, stop) = thread::scope(|s| {
        let driver = s.spawn(|| stop_all(&tb.replicas, start_ns, stop_at, opts.overload_stop));
        let reports = clients.collect();
        (reports, driver.join().ok().flatten())
    });
    let reports = reports?;
    let counts = attached.counts()?;
    attached.finish()?;
    let mut result = RowResult::new(row.clone(), None, opts.overload_rate, duration);
    result.stalls = stop.into_iter().collect();
    result.kernel = Some(counts);
    result.replica_buffer_drops = Some(replica_buffer_drops(tb)? - buffer_drops_before);
    for r in &reports {
        result.add(r, &decode_histogram(&r.histogram)?)?;
    }
    Ok(result)
}

/// UDP datagrams dropped so far on the replicas' hosts because a socket's
/// receive buffer was full.
fn replica_buffer_drops(tb: &Testbed) -> Result<u64> {
    tb.replica_ns
        .iter()
        .map(|ns| ns.snmp("Udp", "RcvbufErrors"))
        .sum()
}
