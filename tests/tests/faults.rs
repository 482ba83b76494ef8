//! Faults under load, in network namespaces with real memcached replicas:
//! loss and duplication on the wire, replies delayed and reordered, a
//! replica killed and restarted, the agent restarted. After each, once the
//! load stopped and a timeout passed, every backend's count must add up
//! (issued = completed + expired, nothing pending), no reply may reach the
//! client from another address than the one it asked, and no UDP checksum
//! may fail.
//!
//! The client reads on an unconnected socket so that a reply from a wrong
//! source is counted instead of being dropped by the kernel. Each test
//! prints one figure line (`--nocapture` shows them).

use std::{thread, time::Duration};

use selector_testbed::{
    ClientSocket, LoadReport, LoadSpec, Testbed,
    agent::{self, Settled, SweptSelector, TotalsRow},
    faults::{WireFault, install_wire_fault, start_delayed_replicas, wire_fault_hits},
    preload, run_load_on,
    topology::CLIENT_IFACE,
    wait_for,
};
use selector_user::Settings;

const KEYS: usize = 200;
/// Request timeout: short, so lost requests expire within the test.
const TIMEOUT: Duration = Duration::from_millis(200);
/// Reads per second from the client.
const RATE: u32 = 2000;
const LOAD: Duration = Duration::from_secs(3);
/// A primary stall long enough to make the selector redirect reads.
const STALL: Duration = Duration::from_millis(50);

/// The one place the library tests build their settings.
fn settings(tb: &Testbed) -> Settings {
    Settings {
        timeout: TIMEOUT,
        ..Settings::new(CLIENT_IFACE, vec![tb.replica_group()])
    }
    .tuned(|t| {
        t.threshold = 2;
    })
}

/// Three memcached replicas holding the same keys.
fn testbed(prefix: &str) -> Testbed {
    Testbed::with_memcached(prefix, 3, KEYS).expect("testbed")
}

/// Starts `LOAD` of reads to the primary from an unconnected socket.
fn start_load(tb: &Testbed) -> thread::JoinHandle<anyhow::Result<LoadReport>> {
    let spec = LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: RATE,
        duration: LOAD,
        keys: KEYS,
        drain: TIMEOUT,
    };
    tb.client
        .spawn(move || run_load_on(&spec, ClientSocket::Unconnected))
        .expect("load")
}

fn finish_load(load: thread::JoinHandle<anyhow::Result<LoadReport>>) -> LoadReport {
    load.join().expect("load thread").expect("load")
}

/// Stops the primary for `STALL`, so reads are redirected for a while.
fn stall_primary(tb: &Testbed) {
    tb.replicas[0].stop();
    thread::sleep(STALL);
    tb.replicas[0].resume();
}

/// One backend's counters after the fault.
struct BackendTotals {
    backend: String,
    issued: u64,
    completed: u64,
    expired: u64,
    pending: u64,
}

fn library_totals(tb: &Testbed, settled: &Settled) -> Vec<BackendTotals> {
    tb.replica_endpoints()
        .iter()
        .zip(&settled.accounting)
        .zip(&settled.pending)
        .map(
            |((backend, &(issued, completed, expired)), &pending)| BackendTotals {
                backend: backend.to_string(),
                issued,
                completed,
                expired,
                pending,
            },
        )
        .collect()
}

fn agent_totals(rows: &[TotalsRow]) -> Vec<BackendTotals> {
    rows.iter()
        .map(|row| BackendTotals {
            backend: row.backend.clone(),
            issued: row.issued(),
            completed: row.responses,
            expired: row.timeouts,
            pending: row.pending,
        })
        .collect()
}

/// Whether a replica lost its data during the fault (then a read may miss).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Data {
    Kept,
    LostByARestart,
}

/// Prints the fault's figure line and returns every invariant it broke:
/// each backend's requests completed or expired exactly once and none left
/// pending, no reply from a wrong source, no reply with another key's value
/// (nor a miss, unless a replica lost its data), no UDP checksum error.
fn figure_and_broken_invariants(
    fault: &str,
    backends: &[BackendTotals],
    report: &LoadReport,
    tb: &Testbed,
    data: Data,
    notes: &str,
) -> Vec<String> {
    let rows: Vec<String> = backends
        .iter()
        .map(|b| {
            format!(
                "backend {} issued {} completed {} expired {} pending {}",
                b.backend, b.issued, b.completed, b.expired, b.pending
            )
        })
        .collect();
    println!(
        "fault {fault}: {}; replies lost {} of {} (wrong source {}, duplicates {}, out of order {}, misses {}){notes}",
        rows.join("; "),
        report.lost(),
        report.sent,
        report.wrong_source,
        report.duplicates,
        report.out_of_order,
        report.misses,
    );
    let mut broken = Vec::new();
    for b in backends {
        if b.issued != b.completed + b.expired {
            broken.push(format!(
                "{}: issued {} != completed {} + expired {}",
                b.backend, b.issued, b.completed, b.expired
            ));
        }
        if b.pending != 0 {
            broken.push(format!("{}: {} still pending", b.backend, b.pending));
        }
    }
    if report.wrong_source != 0 {
        broken.push(format!(
            "{} replies reached the client from a wrong source",
            report.wrong_source
        ));
    }
    let wrong_data = report.wrong_values - report.misses;
    if wrong_data != 0 {
        broken.push(format!("{wrong_data} replies carried another value"));
    }
    if data == Data::Kept && report.misses != 0 {
        broken.push(format!("{} misses from preloaded replicas", report.misses));
    }
    let checksum_errors = tb.udp_checksum_errors().expect("snmp");
    if checksum_errors != 0 {
        broken.push(format!("{checksum_errors} UDP checksum errors"));
    }
    broken
}

fn assert_none_broken(fault: &str, broken: &[String]) {
    assert!(broken.is_empty(), "fault {fault}: {}", broken.join("; "));
}

#[test]
fn loss_of_requests_and_replies_on_the_wire() {
    let tb = testbed("fl");
    let selector = SweptSelector::start(&tb, settings(&tb));
    install_wire_fault(&tb, WireFault::Drop, 5).expect("nft");
    let report = finish_load(start_load(&tb));
    let (requests_dropped, replies_dropped) = wire_fault_hits(&tb).expect("nft counters");
    let settled = selector.settle(TIMEOUT);

    let mut broken = figure_and_broken_invariants(
        "loss",
        &library_totals(&tb, &settled),
        &report,
        &tb,
        Data::Kept,
        &format!("; dropped {requests_dropped} requests, {replies_dropped} replies"),
    );
    if requests_dropped == 0 || replies_dropped == 0 {
        broken.push("the wire dropped nothing in one direction".into());
    }
    assert_none_broken("loss", &broken);
}

#[test]
fn duplication_of_requests_and_replies_on_the_wire() {
    let tb = testbed("fd");
    let selector = SweptSelector::start(&tb, settings(&tb));
    install_wire_fault(&tb, WireFault::Duplicate, 2).expect("nft");
    let load = start_load(&tb);
    // Redirected requests too get duplicated, and so do their replies.
    thread::sleep(LOAD / 2);
    stall_primary(&tb);
    let report = finish_load(load);
    let (requests_copied, replies_copied) = wire_fault_hits(&tb).expect("nft counters");
    let redirected = selector.selector.lock().unwrap().stats().unwrap()[0].redirected_away;
    let settled = selector.settle(TIMEOUT);

    let mut broken = figure_and_broken_invariants(
        "duplication",
        &library_totals(&tb, &settled),
        &report,
        &tb,
        Data::Kept,
        &format!(
            "; copied {requests_copied} requests, {replies_copied} replies; {redirected} redirected"
        ),
    );
    if requests_copied == 0 || replies_copied == 0 {
        broken.push("the wire copied nothing in one direction".into());
    }
    if report.duplicates == 0 {
        broken.push("no duplicate reply reached the client".into());
    }
    if redirected == 0 {
        broken.push("the stall redirected nothing".into());
    }
    if report.lost() != 0 {
        broken.push(format!("{} replies lost without loss", report.lost()));
    }
    assert_none_broken("duplication", &broken);
}

#[test]
fn replies_delayed_and_reordered() {
    let mut tb = Testbed::new("fr", 3).expect("testbed");
    // Declared after the testbed, so dropped before it.
    let _relays = start_delayed_replicas(&mut tb, Duration::from_millis(20)).expect("relays");
    // Straight to each memcached, not through its slow relay.
    for (ns, replica) in tb.replica_ns.iter().zip(&tb.replicas) {
        preload(ns, &[replica.addr], KEYS).expect("preload");
    }
    let selector = SweptSelector::start(&tb, settings(&tb));
    let report = finish_load(start_load(&tb));
    let stats = selector.selector.lock().unwrap().stats().unwrap();
    let redirected = stats[0].redirected_away;
    let moved = reads_moved(&tb);
    let settled = selector.settle(TIMEOUT);

    let mut broken = figure_and_broken_invariants(
        "delay-reorder",
        &library_totals(&tb, &settled),
        &report,
        &tb,
        Data::Kept,
        &format!("; {redirected} redirected, {moved} served by the other replicas"),
    );
    if report.out_of_order == 0 {
        broken.push("no reply overtook another".into());
    }
    // Slow replies keep the primary's count above the threshold: reads
    // must really reach the other replicas, each one it says it moved.
    if moved == 0 || moved != redirected {
        broken.push(format!(
            "the other replicas served {moved} reads, the selector moved {redirected}"
        ));
    }
    if report.lost() != 0 {
        broken.push(format!("{} replies lost without loss", report.lost()));
    }
    assert_none_broken("delay-reorder", &broken);
}

#[test]
fn replica_killed_and_restarted_mid_load() {
    let mut tb = testbed("fk");
    let selector = SweptSelector::start(&tb, settings(&tb));
    let load = start_load(&tb);
    thread::sleep(LOAD / 3);
    tb.replicas[0].crash();
    thread::sleep(LOAD / 6);
    tb.restart_replica(0).expect("restart");
    // Refill it from its own namespace, so no request of this test but the
    // load passes the selector.
    preload(&tb.replica_ns[0], &tb.replica_endpoints()[..1], KEYS).expect("preload");
    let completed_at_restart = selector.selector.lock().unwrap().accounting().unwrap()[0].1;
    let report = finish_load(load);
    let settled = selector.settle(TIMEOUT);
    let completed_after_restart = settled.accounting[0].1 - completed_at_restart;

    let mut broken = figure_and_broken_invariants(
        "kill-restart",
        &library_totals(&tb, &settled),
        &report,
        &tb,
        Data::LostByARestart,
        &format!("; the restarted primary completed {completed_after_restart}"),
    );
    if settled.accounting[0].2 == 0 {
        broken.push("nothing to the killed primary expired".into());
    }
    if completed_after_restart == 0 {
        broken.push("the restarted primary completed no reads".into());
    }
    assert_none_broken("kill-restart", &broken);
}

#[test]
fn agent_restarted_mid_load() {
    let tb = testbed("fa");
    let (group, timeout) = (tb.group_arg(), TIMEOUT.as_millis().to_string());
    let args = [
        "--iface",
        CLIENT_IFACE,
        "--group",
        &group,
        "--threshold",
        "2",
        "--timeout",
        &timeout,
        "--interval",
        "100",
        "--quiet",
    ];
    let (mut first, first_output) = agent::spawn_agent(&tb.client, &args);
    let load = start_load(&tb);
    thread::sleep(LOAD / 3);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(first.id() as i32, libc::SIGTERM) };
    assert!(first.wait().unwrap().success(), "first agent's exit");
    let first_summary: Vec<String> = first_output.map(Result::unwrap).collect();
    let (mut second, _second_output) = agent::spawn_agent(&tb.client, &args);
    // The second agent must steer too.
    thread::sleep(LOAD / 3);
    stall_primary(&tb);
    let report = finish_load(load);

    // Wait until the second agent's sweep has settled every count.
    let deadline = std::time::Instant::now() + TIMEOUT * 3 + Duration::from_secs(1);
    let rows = loop {
        let rows = agent::status(&tb.client, CLIENT_IFACE);
        if rows.iter().all(|r| r.pending == 0) || std::time::Instant::now() > deadline {
            break rows;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let first_pending: Vec<u64> = agent::totals_rows(&first_summary.join("\n"))
        .iter()
        .map(|r| r.pending)
        .collect();
    let mut broken = figure_and_broken_invariants(
        "agent-restart",
        &agent_totals(&rows),
        &report,
        &tb,
        Data::Kept,
        &format!(
            "; first agent left pending {first_pending:?}; second redirected {}",
            rows[0].away
        ),
    );
    if rows[0].away == 0 {
        broken.push("the second agent redirected nothing".into());
    }
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(second.id() as i32, libc::SIGTERM) };
    assert!(second.wait().unwrap().success(), "second agent's exit");
    assert_none_broken("agent-restart", &broken);
}

/// The reads the other replicas served: the load only asks the primary.
fn reads_moved(tb: &Testbed) -> u64 {
    tb.reads_moved().expect("memcached stats")
}

/// SIGKILL fails open: the kernel detaches both programs and reads go to
/// their primary again. The only replies the application can miss are
/// those to reads redirected just before the kill that come back after the
/// reply path is gone, from the replica's address (README Limits).
///
/// The kill comes while the primary is stopped and once the other replicas
/// have served moved reads; afterwards nothing may be attached, a second
/// stall may move no read, every read is answered, and the replies from a
/// wrong source can only be replies to reads moved before the kill.
#[test]
fn agent_killed_mid_load_fails_open() {
    let tb = testbed("fk");
    let group = tb.group_arg();
    let args = [
        "--iface",
        CLIENT_IFACE,
        "--group",
        &group,
        "--threshold",
        "1",
        "--quiet",
    ];
    let (mut agent, _output) = agent::spawn_agent(&tb.client, &args);
    let moved_at_start = reads_moved(&tb);
    let load = start_load(&tb);
    thread::sleep(LOAD / 3);
    // Kill it in the middle of a stall, once the stall has moved reads.
    let moved_before_stall = reads_moved(&tb);
    tb.replicas[0].stop();
    let moving = wait_for(Duration::from_secs(2), || {
        reads_moved(&tb) > moved_before_stall
    });
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(agent.id() as i32, libc::SIGKILL) };
    let _ = agent.wait();
    // Soon: reads queue at the stopped primary, whose socket buffer holds
    // only a few hundred.
    tb.replicas[0].resume();
    let detached = wait_for(Duration::from_secs(2), || {
        agent::attached(&tb.client, CLIENT_IFACE) == agent::Attached::NOTHING
    });
    let left_attached = agent::attached(&tb.client, CLIENT_IFACE);
    // Until the replicas have served every read moved before the kill (the
    // count holds still).
    let mut last = reads_moved(&tb);
    wait_for(Duration::from_secs(2), || {
        let now = reads_moved(&tb);
        std::mem::replace(&mut last, now) == now
    });
    let moved_at_kill = last - moved_at_start;
    // A second stall after the kill: nothing may steer any more.
    stall_primary(&tb);
    let report = finish_load(load);
    let moved_after_kill = reads_moved(&tb) - moved_at_start - moved_at_kill;
    println!(
        "fault agent-kill: {} reads sent, {moved_at_kill} moved before the kill, {moved_after_kill} after; {} answered from the primary's address, {} from a replica's (the kill window), {} unanswered",
        report.sent,
        report.received,
        report.wrong_source,
        report.lost() - report.wrong_source.min(report.lost()),
    );
    assert!(moving, "no read was moved during the stall before the kill");
    assert!(
        detached,
        "the killed agent left programs attached: {left_attached:?}"
    );
    assert_eq!(
        moved_after_kill, 0,
        "reads were moved after the agent was killed"
    );
    assert_eq!(
        report.lost(),
        report.wrong_source,
        "every read is answered: only the kill window's replies come from a replica"
    );
    assert!(
        report.wrong_source <= moved_at_kill,
        "{} replies from a wrong source, but only {moved_at_kill} reads were moved",
        report.wrong_source
    );
    assert_eq!(report.wrong_values, 0);
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);
}
