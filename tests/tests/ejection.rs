//! Outlier ejection end to end (issue 20), with real NSD replicas in
//! network namespaces, the agent attached to the client, and a DNS client
//! on a connected socket that counts the answers it gets by rcode. A replica
//! that answers REFUSED to everything (a small responder of the test's own,
//! as a replica without its zone would) while the primary stalls: with
//! ejection the application sees a few error answers, without it many.

use std::{
    net::SocketAddr,
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use selector_testbed::{
    LoadReport, LoadSpec, Testbed,
    agent::{spawn_agent, status_json},
    dns::{DNS_PORT, Nsd},
    faults::{cut_off_replica, reconnect_replica},
    run_load,
    topology::{CLIENT_IFACE, replica_addr},
    wait_for,
};
use selector_user::api::Status;

/// Answers every query with REFUSED (rcode 5), at once.
const REFUSER: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 53))
while True:
    q, peer = s.recvfrom(4096)
    if len(q) < 12:
        continue
    r = bytearray(q)
    r[2] = 0x80 | (q[2] & 0x79)
    r[3] = 0x05
    s.sendto(bytes(r), peer)
"#;

/// Sends `n` queries for the zone's apex at `rate` per second, on one
/// connected socket, to the first member; prints `ok ERRORS lost`.
const CLIENT: &str = r#"
import socket, struct, sys, time
dst, n, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((dst, 53))
s.setblocking(False)
name = b"".join(bytes([len(p)]) + p.encode() for p in "example.test".split(".")) + b"\0"
ok = err = 0
seen = set()
def drain():
    global ok, err
    while True:
        try:
            r = s.recv(4096)
        except BlockingIOError:
            return
        i = struct.unpack(">H", r[:2])[0]
        if i in seen:
            continue
        seen.add(i)
        if r[3] & 0x0f in (0, 3):
            ok += 1
        else:
            err += 1
start = time.monotonic()
for i in range(n):
    while time.monotonic() < start + i / rate:
        drain()
        time.sleep(0.0002)
    s.send(struct.pack(">HHHHHH", i, 0x0100, 1, 0, 0, 0) + name + b"\0\x01\0\x01")
end = time.monotonic() + 1.5
while time.monotonic() < end:
    drain()
    time.sleep(0.001)
print(ok, err, n - ok - err)
"#;

struct Run {
    ok: u64,
    errors: u64,
    lost: u64,
    status: Status,
}

/// Three members: NSD on 0 and 1, the refuser on 2; the primary stalls
/// 50 ms every 400 ms while 3000 queries go out at 1000/s.
fn refused_replica_while_the_primary_stalls(prefix: &str, eject_after: &str) -> Run {
    let tb = Testbed::new(prefix, 3).unwrap();
    let servers: Vec<Nsd> = (0..2)
        .map(|i| {
            let nsd = Nsd::start(&tb.replica_ns[i], (replica_addr(i), DNS_PORT)).unwrap();
            nsd.wait_ready(&tb.replica_ns[i]).unwrap();
            nsd
        })
        .collect();
    let mut refuser = tb.replica_ns[2]
        .command("python3")
        .args(["-c", REFUSER, &replica_addr(2).to_string()])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let group: Vec<String> = (0..3)
        .map(|i| SocketAddr::from((replica_addr(i), DNS_PORT)).to_string())
        .collect();
    let (mut agent, _lines) = spawn_agent(
        &tb.client,
        &[
            "--iface",
            CLIENT_IFACE,
            "--proto",
            "dns",
            "--group",
            &group.join(","),
            "--eject-after",
            eject_after,
            "--quiet",
        ],
    );
    let client = tb
        .client
        .command("python3")
        .args(["-c", CLIENT, &replica_addr(0).to_string(), "3000", "1000"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(3);
    thread::sleep(Duration::from_millis(200));
    while Instant::now() < until {
        servers[0].stop();
        thread::sleep(Duration::from_millis(50));
        servers[0].resume();
        thread::sleep(Duration::from_millis(350));
    }
    let out = client.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let n: Vec<u64> = text
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    let status: Status = status_json(&tb.client, CLIENT_IFACE);
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    let _ = refuser.kill();
    let _ = refuser.wait();
    Run {
        ok: n[0],
        errors: n[1],
        lost: n[2],
        status,
    }
}

/// The namespace tests here count reads lost to a dead member, which a
/// second test loading the same two CPUs at once can inflate: they run
/// one at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn a_refusing_replica_is_ejected_and_the_application_sees_few_errors() {
    let _serial = one_at_a_time();
    let on = refused_replica_while_the_primary_stalls("ejon", "5");
    let off = refused_replica_while_the_primary_stalls("ejoff", "0");
    println!(
        "ejection on: {} ok, {} errors, {} lost; off: {} ok, {} errors, {} lost",
        on.ok, on.errors, on.lost, off.ok, off.errors, off.lost
    );
    let b = &on.status.backends;
    println!(
        "on: refuser {:?}, errors {} (moved {}); off: errors {}",
        b[2].ejection,
        b[2].stats.error_replies,
        b[2].stats.error_replies_moved,
        off.status.backends[2].stats.error_replies
    );
    // Reads left the stalling primary in both runs.
    assert!(b[0].stats.redirected_away > 0, "{b:#?}");
    assert!(off.status.backends[0].stats.redirected_away > 0);
    // Ejected: few errors reached the application, and what the kernel
    // counted is what the application saw.
    // Ejected, or half-open once its first ejection ran out (no timing
    // is asserted): never healthy, since it refuses everything.
    assert_ne!(b[2].ejection.ejection_state, "healthy", "{:?}", b[2]);
    assert!(b[2].ejection.ejections >= 1);
    // The issue's bound. The reply path holds the refuser out of the
    // choice from the error that makes the run of five, so what passes
    // beyond five is what was already on its way to it.
    assert!(
        on.errors <= 10,
        "{} error answers with ejection on",
        on.errors
    );
    assert_eq!(b[2].stats.error_replies_moved, on.errors);
    // Without ejection, every stall sends reads to the refuser.
    assert!(
        off.errors >= 3 * on.errors.max(10),
        "off {} vs on {}",
        off.errors,
        on.errors
    );
    assert_eq!(off.status.backends[2].ejection.ejection_state, "healthy");
    // The healthy replica and the primary were never ejected.
    assert_eq!(b[0].ejection.ejections + b[1].ejection.ejections, 0);
    assert!(
        on.lost <= 5 && off.lost <= 5,
        "lost {} / {}",
        on.lost,
        off.lost
    );
}

/// Keys preloaded on every memcached replica.
const KEYS: usize = 200;
/// Reads per second, as in the issue.
const RATE: u32 = 1000;
/// How long the primary is dead. The issue's 8 s would be followed, at
/// the defaults, by a failed probe and a second ejection of 7.5 to 10 s
/// before the primary could come back: too long for a test. 4 s is less
/// than the first ejection can be (5 s less a quarter of jitter), so the
/// first probe finds the primary back.
const OUTAGE: Duration = Duration::from_secs(4);

/// What one dead-primary run saw.
struct DeadRun {
    /// The load during the outage, as the client counted it.
    load: LoadReport,
    /// Reads the switch dropped on their way to the primary.
    dropped: u64,
    /// Replies the switch dropped on their way back (to reads sent just
    /// before the cut).
    replies_dropped: u64,
    /// Status at the end of the outage's load.
    status: Status,
}

impl DeadRun {
    /// The client lost the reads the switch dropped (and reads whose
    /// reply it dropped), none other.
    fn assert_lost_on_the_wire(&self) {
        let lost = self.load.lost();
        assert!(
            lost >= self.dropped && lost <= self.dropped + self.replies_dropped,
            "{lost} lost, {} requests and {} replies dropped",
            self.dropped,
            self.replies_dropped
        );
    }
}

/// Starts `RATE` reads per second to the primary on a connected socket (as
/// an application), for `duration`. A read is lost when no reply came
/// within `drain` of the last send: a reply from a dead replica never does.
fn start_reads(tb: &Testbed, duration: Duration) -> thread::JoinHandle<anyhow::Result<LoadReport>> {
    let spec = LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: RATE,
        duration,
        keys: KEYS,
        drain: Duration::from_millis(500),
    };
    tb.client.spawn(move || run_load(&spec)).expect("load")
}

/// One second of reads, then the primary dead for `OUTAGE` under load,
/// then one more second of reads with it back.
fn primary_dead_for_a_while(tb: &Testbed) -> (LoadReport, (u64, u64)) {
    let load = start_reads(tb, OUTAGE + Duration::from_secs(2));
    thread::sleep(Duration::from_secs(1));
    cut_off_replica(tb, 0).expect("nft");
    thread::sleep(OUTAGE);
    let dropped = reconnect_replica(tb).expect("nft");
    (load.join().expect("load").expect("load"), dropped)
}

fn dead_primary_run(
    prefix: &str,
    extra: &[&str],
) -> (Testbed, DeadRun, selector_testbed::agent::Agent) {
    let tb = Testbed::with_memcached(prefix, 3, KEYS).expect("testbed");
    let group = tb.group_arg();
    // Ejection alone: at the defaults the memory of slowness sees the dead
    // primary's first read wait and moves the rest off it before five
    // have expired (tests/tests/slowness.rs), so it would never be ejected.
    let mut args = vec![
        "--iface",
        CLIENT_IFACE,
        "--group",
        &group,
        "--quiet",
        "--avoid-slow",
        "off",
    ];
    args.extend_from_slice(extra);
    let agent = spawn_agent(&tb.client, &args);
    let (load, (dropped, replies_dropped)) = primary_dead_for_a_while(&tb);
    let status = status_json(&tb.client, CLIENT_IFACE);
    (
        tb,
        DeadRun {
            load,
            dropped,
            replies_dropped,
            status,
        },
        agent,
    )
}

fn stop(mut agent: selector_testbed::agent::Agent) {
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    assert!(agent.0.wait().unwrap().success());
}

#[test]
fn a_dead_primary_is_ejected_then_a_probe_restores_it() {
    let _serial = one_at_a_time();
    // At the defaults but slowness (ejection after 5 failures, threshold 4,
    // timeout 1 s).
    let (tb, on, agent) = dead_primary_run("deadon", &[]);
    let primary = &on.status.backends[0];
    println!(
        "ejection on: {} sent, {} lost, {} dropped at the switch; primary {:?}",
        on.load.sent,
        on.load.lost(),
        on.dropped,
        primary.ejection
    );
    // It was ejected (and not yet given up on: no timing asserted, so it
    // may be ejected, half-open or already back).
    assert!(primary.ejection.ejections >= 1, "{primary:?}");
    // The issue's bound. What the agent does: the sweep that expires the
    // fifth read in a row ejects right after it, so the primary gets one
    // timeout's worth of reads (threshold 4, plus one a replica's in-flight
    // read may add), and then whatever arrives while that sweep finishes
    // (the expiries free room before the ejection is written): 7 to 9 on
    // an idle machine, 11 once on a loaded CI run. So no tighter bound
    // that depends on the sweep's speed.
    assert!(on.load.lost() <= 20, "{} reads lost", on.load.lost());
    // Every read the switch dropped was one the client lost, and no other.
    on.assert_lost_on_the_wire();

    // Back: reads keep coming until one probes it and the agent restores it.
    let mut probes = 0u64;
    let restored = wait_for(Duration::from_secs(15), || {
        let more = start_reads(&tb, Duration::from_millis(200));
        probes += more.join().unwrap().unwrap().lost();
        let s: Status = status_json(&tb.client, CLIENT_IFACE);
        s.backends[0].ejection.ejection_state == "healthy"
    });
    let s: Status = status_json(&tb.client, CLIENT_IFACE);
    assert!(restored, "{:?}", s.backends[0]);
    assert_eq!(probes, 0, "reads lost while the primary was back");
    // And reads go to it again: with nothing stalling, all of them.
    let served = tb.gets_served(0).unwrap();
    let after = start_reads(&tb, Duration::from_millis(500))
        .join()
        .unwrap()
        .unwrap();
    let served_after = tb.gets_served(0).unwrap() - served;
    println!(
        "restored after {} ejection(s); then {} of {} reads served by the primary",
        s.backends[0].ejection.ejections, served_after, after.sent
    );
    assert_eq!(after.lost(), 0);
    assert!(
        served_after >= after.sent * 9 / 10,
        "{served_after} of {}",
        after.sent
    );
    stop(agent);
    drop(tb);

    let (tb, off, agent) = dead_primary_run("deadoff", &["--eject-after", "0"]);
    println!(
        "ejection off: {} sent, {} lost, {} dropped at the switch; primary {:?}",
        off.load.sent,
        off.load.lost(),
        off.dropped,
        off.status.backends[0].ejection
    );
    assert_eq!(off.status.backends[0].ejection.ejections, 0);
    off.assert_lost_on_the_wire();
    // Without ejection the dead primary gets about `threshold` reads per
    // timeout: one set per second of the outage, against the few before
    // an ejection.
    assert!(
        off.load.lost() > on.load.lost(),
        "lost {} without ejection, {} with",
        off.load.lost(),
        on.load.lost()
    );
    stop(agent);
    drop(tb);
}

/// The issue's "with hedging on, none": the reads the dead primary gets
/// before it is ejected are hedged to a replica, whose reply reaches the
/// application (rewritten to come from the primary).
#[test]
fn a_dead_primary_with_hedging_on_loses_no_read() {
    let _serial = one_at_a_time();
    let (tb, run, agent) = dead_primary_run("deadhedge", &["--hedge-after", "2"]);
    let s = &run.status;
    let won: u64 = s.backends.iter().map(|b| b.hedges.hedges_won).sum();
    println!(
        "hedging on: {} sent, {} lost, {} dropped at the switch, {} hedges won; primary {:?}",
        run.load.sent,
        run.load.lost(),
        run.dropped,
        won,
        s.backends[0].ejection
    );
    // The primary did get reads it never answered, and was ejected.
    assert!(run.dropped > 0);
    assert!(s.backends[0].ejection.ejections >= 1, "{:?}", s.backends[0]);
    // Each was answered by its hedge.
    assert!(
        won >= run.dropped,
        "{won} hedges won, {} dropped",
        run.dropped
    );
    assert_eq!(run.load.lost(), 0, "reads lost with hedging on");
    stop(agent);
    drop(tb);
}

/// Every member failing at once (all three cut off for `OUTAGE`, then
/// back): more members fail than `--max-ejected` (50%: one of three)
/// allows, so the group is steered by counts alone. No read is lost to the
/// cap: every read the client lost was one the switch dropped, and once
/// the members are back no read is lost and every member takes reads.
#[test]
fn every_member_failing_is_steered_by_counts_and_loses_no_read_to_the_cap() {
    let _serial = one_at_a_time();
    let tb = Testbed::with_memcached("deadall", 3, KEYS).expect("testbed");
    let group = tb.group_arg();
    let agent = spawn_agent(
        &tb.client,
        &["--iface", CLIENT_IFACE, "--group", &group, "--quiet"],
    );
    let load = start_reads(&tb, OUTAGE + Duration::from_secs(2));
    thread::sleep(Duration::from_secs(1));
    selector_testbed::faults::cut_off_replicas(&tb, &[0, 1, 2]).expect("nft");
    thread::sleep(OUTAGE);
    let during: Status = status_json(&tb.client, CLIENT_IFACE);
    let (dropped, replies_dropped) = reconnect_replica(&tb).expect("nft");
    let load = load.join().unwrap().unwrap();
    let after: Status = status_json(&tb.client, CLIENT_IFACE);
    let states = |s: &Status| -> Vec<String> {
        s.backends
            .iter()
            .map(|b| b.ejection.ejection_state.clone())
            .collect()
    };
    println!(
        "all dead: {} sent, {} lost, {} dropped at the switch; during {:?} over cap {:?}; after {:?}, ejections {:?}",
        load.sent,
        load.lost(),
        dropped,
        states(&during),
        during.groups_over_cap,
        states(&after),
        after
            .backends
            .iter()
            .map(|b| b.ejection.ejections)
            .collect::<Vec<_>>()
    );
    // At the end of the outage: over the cap, nothing ejected.
    assert_eq!(during.groups_over_cap, [1]);
    assert_eq!(states(&during), ["healthy"; 3]);
    // Every lost read was lost on the wire, none by the selector.
    assert!(
        load.lost() >= dropped && load.lost() <= dropped + replies_dropped,
        "{} lost, {dropped} requests and {replies_dropped} replies dropped",
        load.lost()
    );
    // Back: no read lost, and at most the cap ejected at any one time.
    let more = start_reads(&tb, Duration::from_secs(1))
        .join()
        .unwrap()
        .unwrap();
    let end: Status = status_json(&tb.client, CLIENT_IFACE);
    println!(
        "after: {} lost of {}, {:?}",
        more.lost(),
        more.sent,
        states(&end)
    );
    assert_eq!(more.lost(), 0);
    assert!(
        states(&end).iter().filter(|s| *s != "healthy").count() <= 1,
        "{:?}",
        states(&end)
    );
    stop(agent);
    drop(tb);
}

/// A flapping primary: the switch drops every other read to it for
/// `OUTAGE` at `RATE`. It never fails twice in a row, so it must not be
/// ejected (and restored on the next read, again and again); the sweep
/// finds its expiries in batches, after later reads it answered, and
/// those are no failures in a row. Threshold 1000, above the reads the
/// primary holds unanswered (half of a timeout's worth): every read stays
/// on it, so every dropped read is followed by an answered one, and each
/// sweep's batch holds far more than `--eject-after` (5) expiries. (With
/// a threshold the drops reach, reads leave the primary, and a run of
/// dropped reads with no read answered after them is a real failure run.)
#[test]
fn a_primary_losing_every_other_read_is_never_ejected() {
    let _serial = one_at_a_time();
    let tb = Testbed::with_memcached("flap", 3, KEYS).expect("testbed");
    let group = tb.group_arg();
    let agent = spawn_agent(
        &tb.client,
        &[
            "--iface",
            CLIENT_IFACE,
            "--group",
            &group,
            "--threshold",
            "1000",
            "--quiet",
            // Ejection's rule alone: slowness avoids a member whose reads
            // are lost, which is its own test.
            "--avoid-slow",
            "off",
        ],
    );
    let load = start_reads(&tb, OUTAGE + Duration::from_secs(2));
    thread::sleep(Duration::from_secs(1));
    selector_testbed::faults::flap_replica(&tb, 0).expect("nft");
    thread::sleep(OUTAGE);
    let (dropped, _) = reconnect_replica(&tb).expect("nft");
    let load = load.join().unwrap().unwrap();
    // Past the last expiry of a dropped read: every batch swept.
    thread::sleep(Duration::from_millis(1500));
    let s: Status = status_json(&tb.client, CLIENT_IFACE);
    let p = &s.backends[0];
    println!(
        "flapping: {} sent, {} lost, {} dropped; primary {:?}, {} expired",
        load.sent,
        load.lost(),
        dropped,
        p.ejection,
        p.expired
    );
    assert_eq!(p.ejection.ejections, 0, "{p:?}");
    assert_eq!(p.ejection.ejection_state, "healthy");
    assert!(dropped >= 10, "the primary lost {dropped} reads only");
    assert_eq!(load.lost(), dropped);
    stop(agent);
    drop(tb);
}

/// Stalls the primary (SIGSTOP) 50 ms every 400 ms for `duration`.
fn stall_primary_for(tb: &Testbed, duration: Duration) {
    let until = Instant::now() + duration;
    while Instant::now() < until {
        thread::sleep(Duration::from_millis(350));
        tb.replicas[0].stop();
        thread::sleep(Duration::from_millis(50));
        tb.replicas[0].resume();
    }
}

/// A dead secondary (cut off at the switch) while the primary stalls: few
/// reads are moved to it, and the moved reads go to the live replica. Its
/// lost reads hold its count for a timeout each, so the count rule alone
/// keeps reads off it most of the time (4 of 464 moved reads in a first
/// run, too few to make a run of five: no ejection within the test);
/// after five in a row it is ejected. Lost reads are only those the
/// switch dropped, and few.
#[test]
fn a_dead_secondary_is_ejected_and_moved_reads_go_to_the_live_one() {
    let _serial = one_at_a_time();
    let tb = Testbed::with_memcached("deadsec", 3, KEYS).expect("testbed");
    let group = tb.group_arg();
    let agent = spawn_agent(
        &tb.client,
        &["--iface", CLIENT_IFACE, "--group", &group, "--quiet"],
    );
    cut_off_replica(&tb, 1).expect("nft");
    let load = start_reads(&tb, OUTAGE);
    stall_primary_for(&tb, OUTAGE);
    let load = load.join().unwrap().unwrap();
    let s: Status = status_json(&tb.client, CLIENT_IFACE);
    let (dropped, replies_dropped) = reconnect_replica(&tb).expect("nft");
    let b = &s.backends;
    println!(
        "dead secondary: {} sent, {} lost, {dropped} dropped at the switch; moved to it {}, to the live one {}; {:?}",
        load.sent,
        load.lost(),
        b[1].stats.redirected_to,
        b[2].stats.redirected_to,
        b[1].ejection
    );
    assert_eq!(b[0].ejection.ejections + b[2].ejection.ejections, 0);
    // The stalls moved reads, and most went to the live replica.
    assert!(
        b[2].stats.redirected_to > 10 * b[1].stats.redirected_to.max(1),
        "{} moved to the live replica, {} to the dead one",
        b[2].stats.redirected_to,
        b[1].stats.redirected_to
    );
    // Lost on the wire only, and within the issue's bound for a dead
    // member.
    assert!(
        load.lost() >= dropped && load.lost() <= dropped + replies_dropped,
        "{} lost, {dropped} requests and {replies_dropped} replies dropped",
        load.lost()
    );
    assert!(load.lost() <= 20, "{} reads lost", load.lost());
    stop(agent);
    drop(tb);
}

/// Answers every memcached get with SERVER_ERROR at once, as a replica
/// out of memory would.
const SERVER_ERROR_REPLICA: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
while True:
    q, peer = s.recvfrom(4096)
    if len(q) < 8:
        continue
    s.sendto(q[:2] + b"\x00\x00\x00\x01\x00\x00SERVER_ERROR out of memory\r\n", peer)
"#;

/// A memcached replica answering SERVER_ERROR to every read while the
/// primary stalls: it is ejected after five, and the application sees
/// about that many errors; each one the kernel counted as an error reply
/// to a moved read.
#[test]
fn a_memcached_replica_answering_server_error_is_ejected() {
    let _serial = one_at_a_time();
    let mut tb = Testbed::with_memcached("mcerr", 3, KEYS).expect("testbed");
    tb.replicas[2].crash();
    let endpoint = tb.replica_endpoints()[2];
    let mut broken = tb.replica_ns[2]
        .command("python3")
        .args([
            "-c",
            SERVER_ERROR_REPLICA,
            &endpoint.ip().to_string(),
            &endpoint.port().to_string(),
        ])
        .spawn()
        .unwrap();
    let group = tb.group_arg();
    let agent = spawn_agent(
        &tb.client,
        &["--iface", CLIENT_IFACE, "--group", &group, "--quiet"],
    );
    let load = start_reads(&tb, OUTAGE);
    stall_primary_for(&tb, OUTAGE);
    let load = load.join().unwrap().unwrap();
    let s: Status = status_json(&tb.client, CLIENT_IFACE);
    let _ = broken.kill();
    let _ = broken.wait();
    let b = &s.backends;
    let errors = load.wrong_values - load.misses;
    println!(
        "SERVER_ERROR replica: {} sent, {} lost, {errors} error answers; kernel: {} error replies ({} moved), moved to it {}; {:?}",
        load.sent,
        load.lost(),
        b[2].stats.error_replies,
        b[2].stats.error_replies_moved,
        b[2].stats.redirected_to,
        b[2].ejection
    );
    assert!(b[0].stats.redirected_away > 0, "the stalls moved reads");
    assert!(b[2].ejection.ejections >= 1, "{:?}", b[2]);
    assert!(errors >= 5, "the run that ejected it reached the client");
    assert!(errors <= 10, "{errors} error answers");
    assert_eq!(b[2].stats.error_replies_moved, errors);
    assert_eq!(load.lost(), 0);
    assert_eq!(b[0].ejection.ejections + b[1].ejection.ejections, 0);
    stop(agent);
    drop(tb);
}

/// Context switches of every thread of process `pid` so far.
fn context_switches(pid: u32) -> u64 {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the agent's threads");
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// An idle agent (healthy replicas, no traffic) checks ejection a few
/// times a second, not every 10 ms: each wakeup takes a CPU from the
/// host's own work (100 a second cost TCP bulk about 3% on a 2-CPU VM).
/// Counted as the agent's context switches over 2 s: about 110 a second
/// with the 10 ms check, about 12 without (the sweep every 250 ms, the
/// idle ejection check, the interval and attachment ticks).
#[test]
fn an_idle_agent_wakes_a_few_times_a_second() {
    let _serial = one_at_a_time();
    let tb = Testbed::new("idle", 3).unwrap();
    let (agent, _lines) = spawn_agent(
        &tb.client,
        &["--iface", CLIENT_IFACE, "--group", &tb.group_arg()],
    );
    // Past its start (the first checks are short: nothing was seen yet).
    thread::sleep(Duration::from_millis(500));
    let before = context_switches(agent.id());
    let window = Duration::from_secs(2);
    thread::sleep(window);
    let per_s = (context_switches(agent.id()) - before) as f64 / window.as_secs_f64();
    assert!(
        per_s < 40.0,
        "an idle agent switched {per_s:.0} times a second"
    );
}
