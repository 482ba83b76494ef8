//! The agent on legacy tc (clsact and cls_bpf filters), as on kernels
//! without TCX (6.1): forced here with `SELECTOR_TC_ATTACH=netlink`, chosen
//! by the probe on such kernels (`cargo xtask test-kernels` runs this file
//! there). Real memcached replicas in namespaces, the agent binary.

use std::{
    io::{BufRead as _, BufReader},
    process::Stdio,
    thread,
    time::Duration,
};

use selector_testbed::{
    LoadSpec, Testbed,
    agent::{self, Agent, AgentProcess, selector_binary},
    netns::Namespace,
    run_load,
    topology::CLIENT_IFACE,
};
use selector_user::{
    api::Status,
    host::tc_attach::{FILTER_PRIORITY, OVERRIDE_VAR},
};

const GROUP: &str = "10.77.0.10:11211,10.77.0.11:11211,10.77.0.12:11211";
const KEYS: usize = 100;

/// Starts `selector run` on legacy tc with `--ingress INGRESS`; (the agent
/// and the rest of its output, its first line).
fn spawn_on_legacy_tc(ns: &Namespace, ingress: &str) -> (Agent, String) {
    let mut child = ns
        .command(selector_binary().to_str().unwrap())
        .args(["run", "--iface", CLIENT_IFACE, "--group", GROUP])
        .args(["--threshold", "1", "--quiet", "--ingress", ingress])
        .env(OVERRIDE_VAR, "netlink")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    ((AgentProcess(child), lines), first)
}

/// `tc filter show dev eth0 DIRECTION` in the client namespace.
fn filters(tb: &Testbed, direction: &str) -> String {
    let out = tb
        .client
        .exec("tc", &["filter", "show", "dev", CLIENT_IFACE, direction])
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Another component's filter (u32, matching nothing), which ours must
/// leave alone.
fn add_foreign_filter(tb: &Testbed) {
    let _ = tb
        .client
        .exec("tc", &["qdisc", "add", "dev", CLIENT_IFACE, "clsact"]);
    tb.client
        .exec(
            "tc",
            &[
                "filter",
                "add",
                "dev",
                CLIENT_IFACE,
                "egress",
                "pref",
                "7",
                "protocol",
                "all",
                "u32",
                "match",
                "u32",
                "0x5e1ec7ed",
                "0xffffffff",
                "at",
                "0",
            ],
        )
        .unwrap();
}

/// TCX programs on the client's interface, both directions (none on a
/// kernel without TCX, where the query itself is refused).
fn tcx_programs(tb: &Testbed) -> usize {
    use aya::programs::{SchedClassifier, TcAttachType};
    tb.client
        .run(|| {
            [TcAttachType::Egress, TcAttachType::Ingress]
                .into_iter()
                .map(|side| {
                    SchedClassifier::query_tcx(CLIENT_IFACE, side).map_or(0, |(_, p)| p.len())
                })
                .sum()
        })
        .unwrap()
}

fn ours(listing: &str, program: &str) -> bool {
    listing.contains(program) && listing.contains(&format!("pref {FILTER_PRIORITY} "))
}

#[test]
fn legacy_tc_filters_steer_beside_other_filters_and_go_with_the_agent() {
    let mut tb = Testbed::new("ltca", 3).unwrap();
    tb.start_memcached().unwrap();
    selector_testbed::preload(&tb.client, &tb.replica_endpoints(), KEYS).unwrap();
    add_foreign_filter(&tb);
    let ((mut agent, _lines), first) = spawn_on_legacy_tc(&tb.client, "tc");
    assert!(first.contains("tc by netlink"), "{first}");
    let egress = filters(&tb, "egress");
    assert!(ours(&egress, "selector_egress"), "{egress}");
    assert!(egress.contains("5e1ec7ed"), "{egress}");
    assert!(
        ours(&filters(&tb, "ingress"), "selector_ingress_tc"),
        "{}",
        filters(&tb, "ingress")
    );
    assert_eq!(tcx_programs(&tb), 0, "filters, not TCX links");

    let report = selector_testbed::pods::load_with_stall(&tb, KEYS);
    let status: Status = agent::status_json(&tb.client, CLIENT_IFACE);
    assert_eq!(status.tc_attach, "netlink");
    let away = status.backends[0].stats.redirected_away;
    assert!(away > 0, "reads must leave the stalled primary: {status:?}");
    assert_eq!(
        report.lost(),
        0,
        "{} of {} answered",
        report.received,
        report.sent
    );
    assert_eq!(report.wrong_values, 0);
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);

    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    let egress = filters(&tb, "egress");
    assert!(!egress.contains("selector_"), "{egress}");
    assert!(egress.contains("5e1ec7ed"), "{egress}");
    assert!(!filters(&tb, "ingress").contains("selector_"));
    tb.replicas.clear();
}

/// Filters outlive a killed agent (SIGKILL, an OOM kill), and with the
/// reply path a filter too (`--ingress auto` on legacy tc) the reads it
/// had moved are still answered; a restart (the unit's, the DaemonSet's)
/// replaces the filters and steers; `selector detach` removes what a
/// killed agent left.
#[test]
fn a_killed_agents_filters_answer_its_moved_reads_and_a_restart_replaces_them() {
    let mut tb = Testbed::new("ltcb", 3).unwrap();
    tb.start_memcached().unwrap();
    selector_testbed::preload(&tb.client, &tb.replica_endpoints(), KEYS).unwrap();
    add_foreign_filter(&tb);
    let ((mut agent, _lines), first) = spawn_on_legacy_tc(&tb.client, "auto");
    assert!(first.contains("tc by netlink"), "{first}");
    assert!(ours(&filters(&tb, "ingress"), "selector_ingress_tc"));

    // Killed while the primary stalls and its reads are being moved.
    let spec = LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: 2000,
        duration: Duration::from_millis(1200),
        keys: KEYS,
        drain: Duration::from_secs(2),
    };
    let load = tb.client.spawn(move || run_load(&spec)).unwrap();
    thread::sleep(Duration::from_millis(500));
    tb.replicas[0].stop();
    thread::sleep(Duration::from_millis(30));
    agent.kill().unwrap();
    agent.wait().unwrap();
    thread::sleep(Duration::from_millis(30));
    tb.replicas[0].resume();
    let report = load.join().unwrap().expect("load");
    assert_eq!(
        report.lost(),
        0,
        "{} of {} answered after the kill",
        report.received,
        report.sent
    );
    assert_eq!(report.wrong_values, 0);
    assert!(ours(&filters(&tb, "egress"), "selector_egress"));

    // Started again: it replaces them and steers.
    let ((mut agent, mut lines), first) = spawn_on_legacy_tc(&tb.client, "auto");
    assert!(
        first.contains("removed tc filter selector_egress and tc filter selector_ingress_tc"),
        "{first}"
    );
    let attached = lines.next().and_then(Result::ok).unwrap_or_default();
    assert!(
        attached.contains("attached to") && attached.contains("tc by netlink"),
        "the restart must start: {attached}"
    );
    let egress = filters(&tb, "egress");
    assert_eq!(
        egress.matches(" selector_egress direct-action").count(),
        1,
        "{egress}"
    );
    assert!(egress.contains("5e1ec7ed"), "{egress}");
    let report = selector_testbed::pods::load_with_stall(&tb, KEYS);
    assert_eq!(report.lost(), 0);
    let status: Status = agent::status_json(&tb.client, CLIENT_IFACE);
    assert!(status.backends[0].stats.redirected_away > 0, "{status:?}");
    agent.kill().unwrap();
    agent.wait().unwrap();

    let (code, out) = agent::run_selector(&tb.client, &["detach", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("tc filter selector_egress"), "{out}");
    let egress = filters(&tb, "egress");
    assert!(!egress.contains("selector_"), "{egress}");
    assert!(egress.contains("5e1ec7ed"), "{egress}");
    assert!(!filters(&tb, "ingress").contains("selector_"));
    let (code, out) = agent::run_selector(&tb.client, &["detach", "--iface", CLIENT_IFACE]);
    assert_ne!(code, 0, "nothing left to detach: {out}");
    tb.replicas.clear();
}
