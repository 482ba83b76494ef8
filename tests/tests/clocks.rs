//! The agent's clock against the kernel's: the programs stamp requests
//! with `bpf_ktime_get_ns` (the kernel's CLOCK_MONOTONIC, which no time
//! namespace offsets), and the agent compares its own clock with those
//! stamps (sweeping expired requests, writing the heartbeat). An agent
//! started in a time namespace (CRIU, some container runtimes) must still
//! read the kernel's clock.

use std::{
    io::{BufRead as _, BufReader},
    process::Stdio,
};

use selector_testbed::{
    Testbed,
    agent::{AgentProcess, selector_binary, status_json},
    preload,
    topology::CLIENT_IFACE,
};
use selector_user::api::Status;

const GROUP: &str = "10.77.0.10:11211,10.77.0.11:11211,10.77.0.12:11211";
const KEYS: usize = 100;

/// Its CLOCK_MONOTONIC a day ahead of the kernel's: without taking the
/// namespace's offset back, every pending read looks a day old to the
/// sweep (expired at once, and a moved read's reply then not rewritten),
/// and the heartbeat a day fresh to the programs.
#[test]
fn an_agent_in_a_time_namespace_keeps_the_kernels_clock() {
    let mut tb = Testbed::new("clkt", 3).unwrap();
    tb.start_memcached().unwrap();
    preload(&tb.client, &tb.replica_endpoints(), KEYS).unwrap();
    let mut child = tb
        .client
        .command("unshare")
        .args([
            "--time",
            "--monotonic",
            "86400",
            "--fork",
            "--kill-child=SIGTERM",
        ])
        .arg("--")
        .arg(selector_binary())
        .args(["run", "--iface", CLIENT_IFACE, "--group", GROUP])
        .args(["--threshold", "1", "--timeout", "500", "--quiet"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    let mut agent = AgentProcess(child);
    assert!(first.starts_with("selector: attached to"), "{first}");

    let report = selector_testbed::pods::load_with_stall(&tb, KEYS);
    let status: Status = status_json(&tb.client, CLIENT_IFACE);
    assert_eq!(
        report.lost(),
        0,
        "{} of {} answered: {:#?}",
        report.received,
        report.sent,
        status.backends
    );
    assert_eq!(report.wrong_values, 0);
    let expired: u64 = status.backends.iter().map(|b| b.expired).sum();
    assert_eq!(
        expired, 0,
        "every read was answered: {:#?}",
        status.backends
    );
    assert!(
        status.backends[0].stats.redirected_away > 0,
        "the stall moved reads"
    );
    // unshare --fork waits for the agent and passes no signal on.
    let children =
        std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", agent.id())).unwrap();
    for pid in children.split_whitespace() {
        unsafe { libc::kill(pid.parse().unwrap(), libc::SIGTERM) };
    }
    assert!(agent.wait().unwrap().success(), "the agent stops cleanly");
    drop(lines);
    tb.replicas.clear();
}
