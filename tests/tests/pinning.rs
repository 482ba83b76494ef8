//! Restarts without loss (`selector run --pin DIR`), in network namespaces
//! with real memcached replicas: an agent SIGKILLed under load with the
//! primary stalling, and a new agent adopting its pins; `selector detach`;
//! adoption refused when the settings that shape the maps differ.
//!
//! Each test mounts a bpf filesystem of its own on a unique temporary
//! directory (unmounted at the end, also on failure, which drops every pin
//! left in it). `ip netns exec` gives the agent a mount namespace with a
//! fresh /sys, so /sys/fs/bpf would not reach it; a mount made here does.

use std::{
    io::{BufRead as _, BufReader, Read as _},
    net::SocketAddrV4,
    path::Path,
    process::{Child, ChildStdout, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use aya::maps::{Array, Map, MapData, PerCpuArray};
use selector_common::{BackendStats, GroupCounters, names, pending};
use selector_testbed::{
    ClientSocket, LoadReport, LoadSpec, MemcachedClient, Testbed, agent, bpffs::Bpffs, run_load_on,
    topology::CLIENT_IFACE, wait_for,
};
use selector_user::api::Status;

const KEYS: usize = 200;
const TIMEOUT: Duration = Duration::from_millis(200);
const RATE: u32 = 2000;
const LOAD: Duration = Duration::from_secs(3);
/// The load run once the restarted agent has adopted the pins.
const AFTER_ADOPTION: Duration = Duration::from_millis(1500);
/// The primary stalls this long every `STALL_EVERY` while the load runs.
const STALL: Duration = Duration::from_millis(40);
const STALL_EVERY: Duration = Duration::from_millis(250);

/// A running agent and its output (kept open for its totals). Killed if a
/// test fails half-way.
struct Running(Option<Child>, Option<BufReader<ChildStdout>>);

impl Running {
    fn signal(&mut self, signal: i32) -> std::process::ExitStatus {
        let mut child = self.0.take().expect("agent running");
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(child.id() as i32, signal) };
        let mut rest = String::new();
        if let Some(mut out) = self.1.take() {
            let _ = out.read_to_string(&mut rest);
        }
        child.wait().unwrap()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn testbed(prefix: &str) -> Testbed {
    Testbed::with_memcached(prefix, 3, KEYS).expect("testbed")
}

/// `selector run` arguments: threshold 1, short timeout, pinned.
fn run_args(group: &str, pin: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--iface",
        CLIENT_IFACE,
        "--group",
        group,
        "--threshold",
        "1",
        "--timeout",
        &TIMEOUT.as_millis().to_string(),
        "--interval",
        "100",
        "--quiet",
        "--pin",
        pin,
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    args.extend(extra.iter().map(ToString::to_string));
    args
}

/// Starts `selector run ARGS`; returns it and its "attached" line (after
/// any warnings).
fn spawn(tb: &Testbed, args: &[String]) -> (Running, String) {
    let mut child = tb
        .client
        .command(agent::selector_binary().to_str().unwrap())
        .arg("run")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut stderr = child.stderr.take().unwrap();
    let mut line = String::new();
    // Past its warnings (a slot freed on adoption, say).
    while {
        line.clear();
        stdout.read_line(&mut line).unwrap();
        line.starts_with("selector: warning:")
    } {}
    if !line.starts_with("selector: attached to") {
        let mut error = String::new();
        let _ = stderr.read_to_string(&mut error);
        let _ = child.wait();
        panic!("selector run {}: {line}{error}", args.join(" "));
    }
    (Running(Some(child), Some(stdout)), line)
}

fn status(tb: &Testbed) -> Status {
    agent::status_json(&tb.client, CLIENT_IFACE)
}

/// Selector programs attached through TCX on the client's interface (egress,
/// and ingress: `--ingress auto` on a veth is TC).
fn attached(tb: &Testbed) -> usize {
    tb.client
        .run(|| selector_user::datapath::detach::tcx_programs_on(CLIENT_IFACE).map(|p| p.len()))
        .unwrap()
        .unwrap()
}

/// Stalls the primary for `STALL` every `STALL_EVERY` until told to stop.
fn stall_primary_periodically(tb: &Testbed, stop: Arc<AtomicBool>) -> thread::JoinHandle<u32> {
    let pid = tb.replicas[0].pid();
    thread::spawn(move || {
        let mut stalls = 0;
        while !stop.load(Ordering::Relaxed) {
            thread::sleep(STALL_EVERY - STALL);
            // SAFETY: signals to our own memcached child.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            selector_testbed::netns::wait_stopped(pid);
            thread::sleep(STALL);
            unsafe { libc::kill(pid, libc::SIGCONT) };
            stalls += 1;
        }
        stalls
    })
}

fn start_load(tb: &Testbed, duration: Duration) -> thread::JoinHandle<anyhow::Result<LoadReport>> {
    let spec = LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: RATE,
        duration,
        keys: KEYS,
        drain: TIMEOUT * 2,
    };
    tb.client
        .spawn(move || run_load_on(&spec, ClientSocket::Unconnected))
        .expect("load")
}

fn sum(status: &Status, f: impl Fn(&selector_user::telemetry::BackendTotals) -> u64) -> u64 {
    status.backends.iter().map(f).sum()
}

/// SIGKILL of a pinned agent under load with the primary stalling, then a
/// new agent with the same DIR: the kernel steers on while no agent runs
/// (within the heartbeat bound),
/// the new agent adopts the maps and links, and nothing is lost.
#[test]
fn agent_killed_and_restarted_with_pins_loses_nothing() {
    let tb = testbed("pk");
    let bpffs = Bpffs::mount();
    // The programs steer without an agent only within the heartbeat bound
    // (see the heartbeat test below): one well past the restart.
    let args = run_args(
        &tb.group_arg(),
        &bpffs.arg(),
        &["--heartbeat-bound", "5000"],
    );
    let (mut first, line) = spawn(&tb, &args);
    assert!(line.contains("pinned under"), "{line}");

    let stop_stalls = Arc::new(AtomicBool::new(false));
    let stalls = stall_primary_periodically(&tb, stop_stalls.clone());
    let load = start_load(&tb, LOAD);
    thread::sleep(LOAD / 3);
    let before_kill = status(&tb);
    first.signal(libc::SIGKILL);
    // No agent, stalls going on: until the pinned programs have moved reads.
    let moved_before_kill = sum(&before_kill, |b| b.stats.redirected_away);
    let members = tb.replicas.len();
    let moved = || -> u64 { pinned_counts(&bpffs, members).iter().map(|c| c.1).sum() };
    wait_for(Duration::from_secs(3), || moved() > moved_before_kill);
    assert_eq!(attached(&tb), 2, "the pinned programs stay attached");
    let (_second, line) = spawn(&tb, &args);
    assert!(line.contains("adopted the pins"), "{line}");
    let at_restart = status(&tb);
    let report = load.join().expect("load thread").expect("load");
    // However long the adoption took, a second load runs under the new
    // agent, stalls going on.
    let after = start_load(&tb, AFTER_ADOPTION)
        .join()
        .expect("load thread")
        .expect("load");
    stop_stalls.store(true, Ordering::Relaxed);
    let stalls = stalls.join().unwrap();

    // One timeout (and a few sweeps) after the load: nothing pending.
    let deadline = Instant::now() + TIMEOUT * 3 + Duration::from_secs(1);
    let end = loop {
        let s = status(&tb);
        if s.backends.iter().all(|b| b.pending == 0) || Instant::now() > deadline {
            break s;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let requests = |s: &Status| sum(s, |b| b.stats.requests);
    let away = |s: &Status| sum(s, |b| b.stats.redirected_away);
    println!(
        "pinning kill-restart: {} reads sent, {} answered, {} lost, {} from a wrong source, {} wrong values; {stalls} stalls; \
         requests counted {} before the kill, {} at the restart, {} at the end; redirected {} before the kill, {} at the restart, {} at the end; \
         issued {} completed {} expired {} pending {}",
        report.sent + after.sent,
        report.received + after.received,
        report.lost() + after.lost(),
        report.wrong_source + after.wrong_source,
        report.wrong_values + after.wrong_values,
        requests(&before_kill),
        requests(&at_restart),
        requests(&end),
        away(&before_kill),
        away(&at_restart),
        away(&end),
        sum(&end, |b| b.issued),
        sum(&end, |b| b.completed),
        sum(&end, |b| b.expired),
        sum(&end, |b| b.pending),
    );
    for r in [&report, &after] {
        assert_eq!(r.lost(), 0, "every read answered");
        assert_eq!(r.wrong_source, 0, "every reply from the address asked");
        assert_eq!(r.wrong_values, 0);
    }
    assert_eq!(
        requests(&end),
        report.sent + after.sent,
        "requests counted == reads sent"
    );
    for b in &end.backends {
        assert_eq!(b.issued, b.completed + b.expired, "{}", b.backend);
        assert_eq!(b.pending, 0, "{}", b.backend);
    }
    assert!(
        requests(&at_restart) > requests(&before_kill),
        "the kernel counted while no agent ran"
    );
    assert!(
        away(&at_restart) > away(&before_kill),
        "the kernel steered while no agent ran"
    );
    assert!(away(&end) > away(&at_restart), "the adopting agent steers");
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);
}

/// A pinned agent's plain exit leaves everything attached and pinned; an
/// unpinned agent is refused next to it; `selector detach --pin` removes
/// it all, after which a fresh unpinned agent attaches; detach says so,
/// with a non-zero exit, when nothing is there.
#[test]
fn sigterm_leaves_pins_and_detach_removes_them() {
    let tb = testbed("pd");
    let bpffs = Bpffs::mount();
    let group = tb.group_arg();
    let args = run_args(&group, &bpffs.arg(), &[]);
    let (mut agent, _) = spawn(&tb, &args);
    assert!(agent.signal(libc::SIGTERM).success());
    let pins = bpffs.dir().join(CLIENT_IFACE);
    for link in [
        "links/egress",
        "links/ingress_tc",
        "maps/COUNTERS",
        "progs/egress",
    ] {
        assert!(pins.join(link).exists(), "{link} pinned after SIGTERM");
    }
    assert_eq!(attached(&tb), 2);

    let unpinned = [
        "run",
        "--iface",
        CLIENT_IFACE,
        "--group",
        &group,
        "--duration",
        "1",
    ];
    let (code, out) = agent::run_selector(&tb.client, &unpinned);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("already attached"), "{out}");

    let pin = bpffs.arg();
    let detach = ["detach", "--iface", CLIENT_IFACE, "--pin", &pin];
    let (code, out) = agent::run_selector(&tb.client, &detach);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("unpinned links [egress, ingress_tc]"), "{out}");
    assert!(!pins.exists(), "{} removed", pins.display());
    assert_eq!(attached(&tb), 0, "unpinning detached the programs");
    let (code, out) = agent::run_selector(&tb.client, &detach);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("nothing is pinned"), "{out}");

    // A fresh, unpinned agent attaches; detach refuses while it runs.
    let unpinned_args: Vec<String> = ["--iface", CLIENT_IFACE, "--group", &group, "--quiet"]
        .iter()
        .map(ToString::to_string)
        .collect();
    let (mut fresh, _) = spawn(&tb, &unpinned_args);
    let (code, out) = agent::run_selector(&tb.client, &["detach", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("is running"), "{out}");
    assert!(fresh.signal(libc::SIGTERM).success());
    let (code, out) = agent::run_selector(&tb.client, &["detach", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("nothing of the selector is attached"), "{out}");

    // Without --pin, detach cuts pinned links too; the pins stay for
    // `detach --pin`, and an adoption of severed links is refused.
    let (mut agent, _) = spawn(&tb, &args);
    assert!(agent.signal(libc::SIGTERM).success());
    let (code, out) = agent::run_selector(&tb.client, &["detach", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(attached(&tb), 0, "{out}");
    let run: Vec<&str> = std::iter::once("run")
        .chain(args.iter().map(String::as_str))
        .collect();
    let (code, out) = agent::run_selector(&tb.client, &run);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("selector detach"), "{out}");
    let (code, out) = agent::run_selector(&tb.client, &detach);
    assert_eq!(code, 0, "{out}");
    assert!(!pins.exists());
}

/// Settings that shape the maps must match the pinned agent's: otherwise
/// the new agent refuses, naming the difference and `selector detach`,
/// and the pinned programs steer on untouched.
#[test]
fn adoption_with_other_map_shaping_settings_is_refused_and_other_groups_apply() {
    let tb = testbed("pm");
    let bpffs = Bpffs::mount();
    let group = tb.group_arg();
    let pin = bpffs.arg();
    let args = run_args(&group, &pin, &[]);
    let (mut agent, _) = spawn(&tb, &args);
    assert!(!agent.signal(libc::SIGKILL).success());
    let two = tb.replica_endpoints()[..2]
        .iter()
        .map(SocketAddrV4::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let cases: [(Vec<String>, &str); 2] = [
        (
            run_args(&group, &pin, &["--inflight-max", "1000"]),
            "--inflight-max differs",
        ),
        (
            run_args(&group, &pin, &["--ingress", "xdp"]),
            "--ingress differs",
        ),
    ];
    for (args, expected) in cases {
        let run: Vec<&str> = std::iter::once("run")
            .chain(args.iter().map(String::as_str))
            .collect();
        let (code, out) = agent::run_selector(&tb.client, &run);
        assert_eq!(code, 1, "{out}");
        assert!(out.contains(expected), "{expected}: {out}");
        assert!(out.contains("selector detach --iface eth0 --pin"), "{out}");
        assert_eq!(attached(&tb), 2, "the pinned programs stay");
    }
    // Other settings may change: tunables are rewritten in the config map,
    // groups applied over the pinned ones as a reload would.
    let (second, line) = spawn(&tb, &run_args(&two, &pin, &["--max-pending", "50"]));
    assert!(line.contains("adopted the pins"), "{line}");
    let s = status(&tb);
    assert_eq!(s.settings.tunables.max_pending, 50);
    assert_eq!(s.backends.len(), 3, "the third member retires: {s:?}");
    drop(second);
    let (code, out) = agent::run_selector(
        &tb.client,
        &["detach", "--iface", CLIENT_IFACE, "--pin", &pin],
    );
    assert_eq!(code, 0, "{out}");
    assert!(!Path::new(&pin).join(CLIENT_IFACE).exists());
}

/// The issue operators hit: a member removed by a reload, the agent killed,
/// then the file changed again (that member back, another gone) and a new
/// agent started on the pins. It adopts them, takes the groups as the
/// pinned maps hold them and applies the file over them as a reload: the
/// member back gets a free position, the one gone retires, and reads leave
/// a stalled primary for the member back with nothing lost.
#[test]
fn adoption_after_reloads_applies_the_file_over_the_pinned_groups() {
    let tb = testbed("pr");
    let bpffs = Bpffs::mount();
    let pin = bpffs.arg();
    let [r0, r1, r2]: [SocketAddrV4; 3] = tb.replica_endpoints()[..3].try_into().unwrap();
    let dir = std::env::temp_dir().join(format!("selector-pin-reload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("selector.toml");
    let write = |members: &[SocketAddrV4]| {
        let members: Vec<String> = members.iter().map(|m| format!("\"{m}\"")).collect();
        std::fs::write(
            &file,
            format!(
                "iface = \"{CLIENT_IFACE}\"\nquiet = true\nthreshold = 1\ntimeout = {}\ninterval = 100\n\n[[group]]\nname = \"users\"\nmembers = [{}]\n",
                TIMEOUT.as_millis(),
                members.join(", ")
            ),
        )
        .unwrap();
    };
    let args: Vec<String> = ["--config", file.to_str().unwrap(), "--pin", &pin]
        .iter()
        .map(ToString::to_string)
        .collect();
    write(&[r0, r1, r2]);
    let (mut first, _) = spawn(&tb, &args);
    write(&[r0, r1]);
    let (code, out) = agent::run_selector(&tb.client, &["reload", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 0, "{out}");
    assert!(!first.signal(libc::SIGKILL).success());

    write(&[r0, r2]);
    let (second, line) = spawn(&tb, &args);
    assert!(line.contains("adopted the pins"), "{line}");
    let s = status(&tb);
    let listed: Vec<String> = s.backends.iter().map(|b| b.backend.to_string()).collect();
    assert!(listed.contains(&r2.to_string()), "{listed:?}");

    let stop_stalls = Arc::new(AtomicBool::new(false));
    let stalls = stall_primary_periodically(&tb, stop_stalls.clone());
    let report = start_load(&tb, LOAD).join().unwrap().unwrap();
    stop_stalls.store(true, Ordering::Relaxed);
    stalls.join().unwrap();
    let end = status(&tb);
    let to_r2 = end
        .backends
        .iter()
        .find(|b| b.backend.to_string() == r2.to_string())
        .map(|b| b.stats.redirected_to);
    println!(
        "adoption after reloads: {} reads, {} lost, {} wrong source; moved to {r2}: {to_r2:?}",
        report.sent,
        report.lost(),
        report.wrong_source
    );
    assert_eq!(report.lost(), 0);
    assert_eq!(report.wrong_source, 0);
    assert!(
        to_r2.is_some_and(|n| n > 0),
        "reads moved to the member back"
    );
    drop(second);
    let (code, out) = agent::run_selector(
        &tb.client,
        &["detach", "--iface", CLIENT_IFACE, "--pin", &pin],
    );
    assert_eq!(code, 0, "{out}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--ingress auto` (the default) adopts whichever reply path the pins
/// hold, here XDP where `auto` would pick TC on a veth; an explicit other
/// kind is still refused.
#[test]
fn auto_ingress_adopts_the_pinned_reply_path() {
    let tb = testbed("pa");
    let bpffs = Bpffs::mount();
    let group = tb.group_arg();
    let pin = bpffs.arg();
    let (mut first, line) = spawn(&tb, &run_args(&group, &pin, &["--ingress", "xdp"]));
    assert!(line.contains("(xdp ingress"), "{line}");
    assert!(!first.signal(libc::SIGKILL).success());
    let (second, line) = spawn(&tb, &run_args(&group, &pin, &[]));
    assert!(line.contains("adopted the pins"), "{line}");
    assert!(line.contains("(xdp ingress"), "{line}");
    assert_eq!(status(&tb).settings.ingress, "xdp");
    drop(second);
    let tc = run_args(&group, &pin, &["--ingress", "tc"]);
    let run: Vec<&str> = std::iter::once("run")
        .chain(tc.iter().map(String::as_str))
        .collect();
    let (code, out) = agent::run_selector(&tb.client, &run);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("--ingress differs"), "{out}");
    let (code, out) = agent::run_selector(
        &tb.client,
        &["detach", "--iface", CLIENT_IFACE, "--pin", &pin],
    );
    assert_eq!(code, 0, "{out}");
}

/// The default heartbeat bound of an agent started with `run_args`: a few
/// sweep periods (50 ms at --timeout 200), but at least 1 s.
const HEARTBEAT_BOUND: Duration = Duration::from_secs(1);

/// What the pinned maps say of the group's members (no agent needed):
/// per member, (requests addressed to it, reads moved away from it, pending).
fn pinned_counts(bpffs: &Bpffs, members: usize) -> Vec<(u64, u64, u64)> {
    let maps = bpffs.dir().join(CLIENT_IFACE).join("maps");
    let stats = MapData::from_pin(maps.join(names::STATS)).unwrap();
    let stats: PerCpuArray<_, BackendStats> =
        PerCpuArray::try_from(Map::PerCpuArray(stats)).unwrap();
    let counters = MapData::from_pin(maps.join(names::COUNTERS)).unwrap();
    let counters: Array<_, GroupCounters> = Array::try_from(Map::Array(counters)).unwrap();
    let group = counters.get(&0, 0).unwrap();
    (0..members)
        .map(|m| {
            let mut total = BackendStats::default();
            for cpu in stats.get(&(m as u32), 0).unwrap().iter() {
                total.add(cpu);
            }
            (total.requests, total.redirected_away, pending(&group, m))
        })
        .collect()
}

/// Drops the requests that reach replica `i` (in its own namespace, so the
/// selector on the client sees them leave and counts them pending), until
/// `lose_requests(.., false)`.
fn lose_requests(tb: &Testbed, i: usize, lose: bool) {
    let ns = &tb.replica_ns[i];
    let port = tb.replica_endpoints()[i].port().to_string();
    if lose {
        ns.exec("nft", &["add", "table", "inet", "heartbeat"])
            .unwrap();
        ns.exec(
            "nft",
            &[
                "add",
                "chain",
                "inet",
                "heartbeat",
                "input",
                "{ type filter hook input priority 0; }",
            ],
        )
        .unwrap();
        ns.exec(
            "nft",
            &[
                "add",
                "rule",
                "inet",
                "heartbeat",
                "input",
                "udp",
                "dport",
                &port,
                "drop",
            ],
        )
        .unwrap();
    } else {
        ns.exec("nft", &["delete", "table", "inet", "heartbeat"])
            .unwrap();
    }
}

/// Issue 20, item 3: a pinned agent SIGKILLed leaves lost reads pending on
/// the primary, and nothing expires them. Once the agent's heartbeat is
/// older than its bound, the programs move no read: every read goes to
/// the primary it was sent to, still counted; a new agent on the pins
/// resumes steering at once, and expires the lost reads.
#[test]
fn a_killed_agents_programs_stop_moving_reads_after_the_heartbeat_bound() {
    let tb = testbed("ph");
    let bpffs = Bpffs::mount();
    let members = tb.replicas.len();
    let args = run_args(&tb.group_arg(), &bpffs.arg(), &[]);
    let (mut first, _) = spawn(&tb, &args);
    let heartbeat = status(&tb).heartbeat;
    assert!(heartbeat.fresh, "{heartbeat:?}");
    assert_eq!(
        Duration::from_millis(heartbeat.bound_ms),
        HEARTBEAT_BOUND,
        "the default"
    );
    first.signal(libc::SIGKILL);
    let killed = Instant::now();

    // Reads to the primary that are never answered: pending for good, as
    // no agent sweeps. (While the heartbeat is fresh the next reads move.)
    lose_requests(&tb, 0, true);
    let primary = tb.replica_endpoints()[0];
    let lost_reads = 3;
    tb.client
        .run(move || {
            let c = MemcachedClient::connect(primary).unwrap();
            for i in 0..lost_reads {
                let _ = c.request(
                    format!("get key{i}\r\n").as_bytes(),
                    Duration::from_millis(50),
                );
            }
        })
        .unwrap();
    lose_requests(&tb, 0, false);
    thread::sleep(
        (killed + HEARTBEAT_BOUND + Duration::from_millis(500))
            .saturating_duration_since(Instant::now()),
    );
    let stale = pinned_counts(&bpffs, members);
    assert!(
        stale[0].2 >= 1,
        "a lost read holds the primary's count: {stale:?}"
    );

    // The primary is healthy; its leftover count must not move its reads.
    let healthy = start_load(&tb, Duration::from_millis(500))
        .join()
        .expect("load thread")
        .expect("load");
    let after = pinned_counts(&bpffs, members);
    let moved: u64 = (0..members).map(|m| after[m].1 - stale[m].1).sum();
    let counted: u64 = (0..members).map(|m| after[m].0 - stale[m].0).sum();
    println!(
        "heartbeat: {} reads with the agent gone {:?}, {} answered, {} moved; counts before {stale:?}, after {after:?}",
        healthy.sent,
        killed.elapsed(),
        healthy.received,
        moved
    );
    assert_eq!(moved, 0, "no read moved once the heartbeat is stale");
    assert_eq!(counted, healthy.sent, "every read still counted");
    assert_eq!(healthy.lost(), 0);
    assert_eq!(healthy.wrong_source, 0);
    assert_eq!(
        after[0].2, stale[0].2,
        "the primary's leftover count stays exact: its reads completed"
    );

    // A new agent on the pins: steering resumes at once, and the lost
    // reads expire.
    let (_second, line) = spawn(&tb, &args);
    assert!(line.contains("adopted the pins"), "{line}");
    let adopted = status(&tb);
    assert!(adopted.heartbeat.fresh, "{:?}", adopted.heartbeat);
    let stop_stalls = Arc::new(AtomicBool::new(false));
    let stalls = stall_primary_periodically(&tb, stop_stalls.clone());
    let steered = start_load(&tb, Duration::from_secs(1))
        .join()
        .expect("load thread")
        .expect("load");
    stop_stalls.store(true, Ordering::Relaxed);
    stalls.join().unwrap();
    let deadline = Instant::now() + TIMEOUT * 3 + Duration::from_secs(1);
    let end = loop {
        let s = status(&tb);
        if s.backends.iter().all(|b| b.pending == 0) || Instant::now() > deadline {
            break s;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let away = |s: &Status| sum(s, |b| b.stats.redirected_away);
    assert!(away(&end) > away(&adopted), "the adopting agent steers");
    assert_eq!(steered.lost(), 0);
    assert_eq!(steered.wrong_source, 0);
    assert_eq!(
        sum(&end, |b| b.stats.requests),
        lost_reads + healthy.sent + steered.sent,
        "requests counted == reads sent"
    );
    for b in &end.backends {
        assert_eq!(b.issued, b.completed + b.expired, "{}", b.backend);
        assert_eq!(b.pending, 0, "{}", b.backend);
    }
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);
}

/// The pinned maps' heartbeat and group 0's ejection bits (no agent needed).
fn pinned_heartbeat_and_bits(bpffs: &Bpffs) -> (u64, u64) {
    use selector_common::{Config, GroupHealth};
    let maps = bpffs.dir().join(CLIENT_IFACE).join("maps");
    let config = MapData::from_pin(maps.join(names::CONFIG)).unwrap();
    let config: Array<_, Config> = Array::try_from(Map::Array(config)).unwrap();
    let health = MapData::from_pin(maps.join(names::HEALTH)).unwrap();
    let health: Array<_, GroupHealth> = Array::try_from(Map::Array(health)).unwrap();
    (
        config.get(&0, 0).unwrap().heartbeat_ns,
        health.get(&0, 0).unwrap().bits,
    )
}

/// Issue 38, item 4: an agent restarted on the pins keeps the ejections it
/// finds (a dead member is never eligible again, not even until its first
/// check), and a start that adopts the pins and then fails leaves the
/// heartbeat and the ejections as they were: the programs fail open at the
/// dead agent's bound instead of steering on counts nothing expires.
#[test]
fn adoption_keeps_the_ejections_and_a_failed_one_touches_no_heartbeat() {
    use selector_common::ejection::ejected_bit;
    let tb = testbed("pe");
    let bpffs = Bpffs::mount();
    // Ejection alone: at the defaults the dead member is slow first and
    // never ejected (tests/tests/slowness.rs).
    let args = run_args(&tb.group_arg(), &bpffs.arg(), &["--avoid-slow", "off"]);
    let (mut first, _) = spawn(&tb, &args);
    // Replica 1 dead: reads addressed to it, one at a time (a read sent
    // while another is pending there would be moved), expire until it is
    // out.
    lose_requests(&tb, 1, true);
    let dead = tb.replica_endpoints()[1];
    let ejected = |tb: &Testbed| status(tb).backends[1].ejection.ejection_state == "ejected";
    let reads = tb
        .client
        .spawn(move || {
            let c = MemcachedClient::connect(dead).unwrap();
            for i in 0..7 {
                let _ = c.request(
                    format!("get key{i}\r\n").as_bytes(),
                    TIMEOUT + Duration::from_millis(150),
                );
            }
        })
        .unwrap();
    reads.join().unwrap();
    assert!(
        wait_for(TIMEOUT * 4 + Duration::from_secs(1), || ejected(&tb)),
        "the dead member was never ejected: {:?}",
        status(&tb).backends[1].ejection
    );
    assert!(first.signal(libc::SIGTERM).success());

    // Restarted on the pins: still out, from its first status on.
    let (mut second, line) = spawn(&tb, &args);
    assert!(line.contains("adopted the pins"), "{line}");
    let adopted = status(&tb).backends[1].ejection.clone();
    assert_eq!(adopted.ejection_state, "ejected", "{adopted:?}");
    let (_, bits) = pinned_heartbeat_and_bits(&bpffs);
    assert_ne!(bits & ejected_bit(1), 0, "the kernel's bit stays set");
    second.signal(libc::SIGKILL);

    // A start that adopts and then fails (its groups split a running
    // one): nothing it wrote says an agent is here.
    let (beat, bits) = pinned_heartbeat_and_bits(&bpffs);
    let r = tb.replica_endpoints();
    let moving = run_args(
        &format!("{},{}", r[0], r[1]),
        &bpffs.arg(),
        &["--group", &r[2].to_string()],
    );
    let out = tb
        .client
        .command(agent::selector_binary().to_str().unwrap())
        .arg("run")
        .args(&moving)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("applying the groups over the pinned ones"),
        "{err}"
    );
    assert_eq!(
        pinned_heartbeat_and_bits(&bpffs),
        (beat, bits),
        "the failed start changed the heartbeat or the ejections"
    );
    lose_requests(&tb, 1, false);
}

/// An agent killed inside its hold of a free slot (its mark cleared, the
/// slot not yet released) leaves it held and unmarked in the pinned maps:
/// no sweep sees it and no request can take it. The next agent frees it
/// when it adopts the pins.
#[test]
fn a_slot_an_agent_was_killed_holding_is_freed_by_the_next() {
    use selector_common::inflight::{AGENT_HOLD, FREE, InflightSlot};
    let tb = testbed("ph");
    let bpffs = Bpffs::mount();
    let args = run_args(&tb.group_arg(), &bpffs.arg(), &[]);
    let (mut agent, _) = spawn(&tb, &args);
    assert!(agent.signal(libc::SIGTERM).success());
    let maps = bpffs.dir().join(CLIENT_IFACE).join("maps");
    let slots = |i: u32| -> u64 {
        let map = MapData::from_pin(maps.join(names::INFLIGHT)).unwrap();
        let slots: Array<_, InflightSlot> = Array::try_from(Map::Array(map)).unwrap();
        slots.get(&i, 0).unwrap().state
    };
    {
        let map = MapData::from_pin(maps.join(names::INFLIGHT)).unwrap();
        let mut table: Array<_, InflightSlot> = Array::try_from(Map::Array(map)).unwrap();
        let held = InflightSlot {
            state: AGENT_HOLD,
            ..Default::default()
        };
        table.set(77, held, 0).unwrap();
    }
    assert_eq!(slots(77), AGENT_HOLD);
    let (mut agent, line) = spawn(&tb, &args);
    assert!(line.contains("adopted the pins"), "{line}");
    assert_eq!(slots(77), FREE, "the adopting agent frees it");
    assert!(agent.signal(libc::SIGTERM).success());
    let (code, out) = agent::run_selector(
        &tb.client,
        &["detach", "--iface", CLIENT_IFACE, "--pin", &bpffs.arg()],
    );
    assert_eq!(code, 0, "{out}");
}
