//! `selector run --attachment FILE --attachment FILE`: one agent, started
//! in a namespace standing in for the node's, serves two namespaces
//! standing in for pods, each with its own replicas, groups and counts: the
//! reads of each are moved off its stalled primary and rewritten back with
//! nothing lost, each pod's control socket answers for its attachment, one
//! metrics endpoint serves both, every sample labelled `attachment`, and
//! one control endpoint in the node's namespace routes each command to the
//! attachment it names by that label.

use std::{
    io::{BufRead as _, BufReader},
    net::SocketAddr,
    os::unix::net::UnixDatagram,
    path::Path,
    process::Stdio,
};

use selector_testbed::{
    Namespace, Testbed,
    agent::{self, Agent, Attached, selector_binary},
    pods::{ScratchDir, load_with_stall, moved_off_the_primary, node_namespace},
    preload,
    prometheus::{http_get, promtool_check},
    topology::CLIENT_IFACE,
};
use selector_user::api::{Request, Routed, socket::Endpoint};

const KEYS: usize = 200;
const METRICS: &str = "127.0.0.1:9655";

fn pod(prefix: &str) -> Testbed {
    let mut tb = Testbed::new(prefix, 3).expect("testbed");
    tb.start_memcached().expect("memcached");
    preload(&tb.client, &tb.replica_endpoints(), KEYS).expect("preload");
    tb
}

/// An attachment's file: the pod's eth0 and its replicas as one group.
fn attachment_file(dir: &std::path::Path, tb: &Testbed) -> std::path::PathBuf {
    let members: Vec<String> = tb
        .replica_endpoints()
        .iter()
        .map(|e| format!("\"{e}\""))
        .collect();
    let path = dir.join(format!("{}.toml", tb.client.name));
    std::fs::write(
        &path,
        format!(
            "iface = \"{CLIENT_IFACE}\"\nnetns = \"/run/netns/{}\"\nthreshold = 2\ningress = \"tc\"\ntimeout = 500\n\n[[group]]\nmembers = [{}]\n",
            tb.client.name,
            members.join(", ")
        ),
    )
    .unwrap();
    path
}

/// `selector run --attachment FILE ... --metrics-addr METRICS --quiet` in
/// `node` with `env`, once each attachment of `labels` said it attached
/// (in its own line, `[LABEL] attached to eth0`).
fn spawn_attachments(
    node: &Namespace,
    files: &[&Path],
    metrics: &str,
    env: &[(&str, &str)],
    labels: &[String],
) -> Agent {
    let mut child = node
        .command(selector_binary().to_str().unwrap())
        .args(run_args(files))
        .args(["--metrics-addr", metrics])
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let agent = agent::AgentProcess(child);
    let mut attached: Vec<&String> = Vec::new();
    while attached.len() < labels.len() {
        let line = lines
            .next()
            .expect("the agent ended before every attachment attached")
            .unwrap();
        if let Some(label) = labels
            .iter()
            .find(|l| line.starts_with(&format!("selector: [{l}] attached to {CLIENT_IFACE}")))
        {
            attached.push(label);
        }
    }
    (agent, lines)
}

/// The reply of this namespace's eth0 control socket to a reload that
/// names an attachment.
fn raw_request_to_eth0() -> String {
    let routed = Routed {
        attachment: Some(CLIENT_IFACE.into()),
        request: Request::Reload,
    };
    let reply = selector_user::api::send(&Endpoint::Interface(CLIENT_IFACE.into()), &routed);
    format!("{reply:?}")
}

/// `selector run --quiet` with each of `files` as an `--attachment`.
fn run_args(files: &[&Path]) -> Vec<String> {
    let mut args = vec!["run".to_string(), "--quiet".into()];
    for file in files {
        args.push("--attachment".into());
        args.push(file.to_str().unwrap().into());
    }
    args
}

/// The value of the sample line that starts with `series`, if any.
fn sample(text: &str, series: &str) -> Option<f64> {
    let line = text
        .lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))?;
    line.rsplit(' ').next()?.parse().ok()
}

#[test]
fn one_agent_steers_two_pods_with_one_labelled_metrics_endpoint() {
    let (a, b) = (pod("selaa"), pod("selab"));
    let node = node_namespace("sela");
    let dir = ScratchDir::new("attachments");
    let (file_a, file_b) = (
        attachment_file(dir.path(), &a),
        attachment_file(dir.path(), &b),
    );
    // systemd's notification socket, as a `Type=notify` unit has.
    let notify = dir.path().join("notify");
    let notifications = UnixDatagram::bind(&notify).unwrap();
    notifications
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let labels: Vec<String> = [&a, &b]
        .iter()
        .map(|tb| format!("{CLIENT_IFACE}@/run/netns/{}", tb.client.name))
        .collect();
    let (mut agent, lines) = spawn_attachments(
        &node,
        &[&file_a, &file_b],
        METRICS,
        &[
            ("NOTIFY_SOCKET", notify.to_str().unwrap()),
            ("WATCHDOG_USEC", "200000"),
        ],
        &labels,
    );
    for tb in [&a, &b] {
        let on_pod = agent::attached(&tb.client, CLIENT_IFACE);
        assert_eq!((on_pod.tcx_egress, on_pod.tcx_ingress), (1, 1));
    }
    // READY once both are ready, then the watchdog's pings.
    let mut buf = [0u8; 256];
    let n = notifications.recv(&mut buf).expect("READY from the agent");
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        "READY=1\nSTATUS=steering 2 attachments"
    );
    let n = notifications.recv(&mut buf).expect("a watchdog ping");
    assert_eq!(&buf[..n], b"WATCHDOG=1");
    // Read on, as systemd does (it ends with the agent's socket).
    std::thread::spawn(move || while notifications.recv(&mut buf).is_ok() {});
    assert_eq!(agent::attached(&node, CLIENT_IFACE), Attached::NOTHING);

    // Both pods stall at once; each pod's reads leave its own primary.
    let (report_a, report_b) = std::thread::scope(|s| {
        let ha = s.spawn(|| load_with_stall(&a, KEYS));
        let hb = s.spawn(|| load_with_stall(&b, KEYS));
        (ha.join().unwrap(), hb.join().unwrap())
    });
    for (tb, report) in [(&a, &report_a), (&b, &report_b)] {
        assert_eq!(report.lost(), 0, "{}: nothing may be lost", tb.client.name);
        assert_eq!((report.wrong_values, report.wrong_source), (0, 0));
        // Through the pod's own control socket.
        let status = agent::status_json::<serde_json::Value>(&tb.client, CLIENT_IFACE);
        moved_off_the_primary(&status);
        assert_eq!(
            status["backends"][0]["requests"].as_u64().unwrap(),
            report.sent,
            "{}: its own counts only",
            tb.client.name
        );
    }

    // One endpoint for both, in the node's namespace.
    let metrics: SocketAddr = METRICS.parse().unwrap();
    let scraped = node
        .run(move || http_get(metrics, "/metrics", None))
        .unwrap()
        .unwrap();
    assert_eq!(scraped.status, 200);
    let primary = a.replica_endpoints()[0];
    for (label, report) in labels.iter().zip([&report_a, &report_b]) {
        let up = sample(
            &scraped.body,
            &format!("selector_attachment_up{{attachment=\"{label}\"}}"),
        );
        assert_eq!(up, Some(1.0), "{label}:\n{}", scraped.body);
        let requests = sample(
            &scraped.body,
            &format!(
                "selector_requests_total{{attachment=\"{label}\",backend=\"{primary}\",group=\"1\"}}"
            ),
        );
        assert_eq!(
            requests,
            Some(report.sent as f64),
            "{label}:\n{}",
            scraped.body
        );
        let away = sample(
            &scraped.body,
            &format!(
                "selector_redirected_total{{attachment=\"{label}\",backend=\"{primary}\",group=\"1\",direction=\"away\"}}"
            ),
        );
        assert!(away.is_some_and(|v| v > 0.0), "{label}:\n{}", scraped.body);
    }
    let (valid, said) = promtool_check(&scraped.body);
    assert!(valid, "promtool: {said}\n{}", scraped.body);
    let ready = node
        .run(move || http_get(metrics, "/readyz", None))
        .unwrap()
        .unwrap();
    assert_eq!(ready.status, 200, "{}", ready.body);
    for label in &labels {
        assert!(
            ready.body.contains(&format!("{label}: ready")),
            "{}",
            ready.body
        );
    }

    // The one control endpoint, in the node's namespace: a bare status is
    // every attachment's, in the order given, each its own.
    let (code, out) = agent::run_selector(&node, &["status", "--json"]);
    assert_eq!(code, 0, "{out}");
    let all: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let listed: Vec<&str> = all["attachments"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["attachment"].as_str().unwrap())
        .collect();
    assert_eq!(listed, [labels[0].as_str(), labels[1].as_str()], "{all}");
    for (i, report) in [&report_a, &report_b].into_iter().enumerate() {
        let status = &all["attachments"][i]["status"];
        assert_eq!(
            status["backends"][0]["requests"].as_u64(),
            Some(report.sent),
            "{}: {status}",
            labels[i]
        );
    }
    let (code, text) = agent::run_selector(&node, &["status"]);
    assert_eq!(code, 0, "{text}");
    for label in &labels {
        assert!(text.contains(&format!("attachment {label}:\n")), "{text}");
    }
    // A change must name its attachment; an unknown one is refused.
    let (code, out) = agent::run_selector(&node, &["set", "--threshold", "5"]);
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("name one with --attachment"), "{out}");
    let (code, out) = agent::run_selector(
        &node,
        &[
            "set",
            "--attachment",
            "eth9@/run/netns/none",
            "--threshold",
            "5",
        ],
    );
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("no attachment eth9@/run/netns/none"), "{out}");
    // Set, drain and undrain reach the attachment named, and only it.
    let (code, out) = agent::run_selector(
        &node,
        &["set", "--attachment", &labels[1], "--threshold", "4"],
    );
    assert_eq!(code, 0, "{out}");
    let spare = b.replica_endpoints()[2].to_string();
    let (code, out) = agent::run_selector(&node, &["drain", "--attachment", &labels[1], &spare]);
    assert_eq!(code, 0, "{out}");
    let status_b = agent::status_json::<serde_json::Value>(&b.client, CLIENT_IFACE);
    assert_eq!(status_b["settings"]["threshold"], 4, "{status_b}");
    assert_eq!(
        status_b["drained"],
        serde_json::json!([spare]),
        "{status_b}"
    );
    let status_a = agent::status_json::<serde_json::Value>(&a.client, CLIENT_IFACE);
    assert_eq!(status_a["settings"]["threshold"], 2, "{status_a}");
    assert_eq!(status_a["drained"], serde_json::json!([]), "{status_a}");
    // The bare status pairs each label with its own attachment's status.
    let (code, out) = agent::run_selector(&node, &["status", "--json"]);
    assert_eq!(code, 0, "{out}");
    let all: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    for (i, threshold) in [2, 4].into_iter().enumerate() {
        assert_eq!(all["attachments"][i]["attachment"], labels[i].as_str());
        assert_eq!(
            all["attachments"][i]["status"]["settings"]["threshold"], threshold,
            "{all}"
        );
    }
    // A pod's own socket takes no request meant for the agent's endpoint.
    let said = a.client.run(raw_request_to_eth0).unwrap();
    assert!(
        said.contains("this is the control socket of one attachment"),
        "{said}"
    );
    let (code, out) = agent::run_selector(&node, &["undrain", "--attachment", &labels[1], &spare]);
    assert_eq!(code, 0, "{out}");
    let status_b = agent::status_json::<serde_json::Value>(&b.client, CLIENT_IFACE);
    assert_eq!(status_b["drained"], serde_json::json!([]), "{status_b}");

    // Each attachment reloads its own file, through the one endpoint or
    // its own socket; the other's settings stay.
    let file_a_text = std::fs::read_to_string(&file_a).unwrap();
    std::fs::write(
        &file_a,
        file_a_text.replace("threshold = 2", "threshold = 3"),
    )
    .unwrap();
    let (code, msg) = agent::run_selector(&node, &["reload", "--attachment", &labels[0]]);
    assert_eq!(code, 0, "{msg}");
    let (code, msg) = agent::run_selector(&b.client, &["reload", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 0, "{msg}");
    for (tb, threshold) in [(&a, 3), (&b, 2)] {
        let status = agent::status_json::<serde_json::Value>(&tb.client, CLIENT_IFACE);
        assert_eq!(status["settings"]["threshold"], threshold, "{status}");
        assert_eq!(status["config_reload_success"], true, "{status}");
    }
    // A second agent of several attachments in the node's namespace is
    // refused before it attaches anything.
    let args = run_args(&[&file_a, &file_b]);
    let (code, out) =
        agent::run_selector(&node, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains(
            "a selector of several attachments is already running in this network namespace"
        ),
        "{out}"
    );
    let ready = node
        .run(move || http_get(metrics, "/readyz", None))
        .unwrap()
        .unwrap();
    assert_eq!(ready.status, 200, "after the reloads: {}", ready.body);

    // A signal stops both, and both detach.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    let out: Vec<String> = lines.map(Result::unwrap).collect();
    for label in &labels {
        assert!(
            out.iter().any(|l| l.starts_with(&format!(
                "selector: [{label}] detaching from {CLIENT_IFACE}"
            ))),
            "{out:#?}"
        );
    }
    for tb in [&a, &b] {
        assert_eq!(agent::attached(&tb.client, CLIENT_IFACE), Attached::NOTHING);
    }
}

#[test]
fn an_attachment_that_cannot_attach_fails_the_start_and_leaves_nothing() {
    let a = pod("selaf");
    let node = node_namespace("self");
    let dir = ScratchDir::new("attachments");
    let good = attachment_file(dir.path(), &a);
    // An interface the pod does not have.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        std::fs::read_to_string(&good).unwrap().replace(
            &format!("iface = \"{CLIENT_IFACE}\""),
            "iface = \"nosuch0\"",
        ),
    )
    .unwrap();
    let args = run_args(&[&good, &bad]);
    let (code, out) =
        agent::run_selector(&node, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("nosuch0"), "{out}");
    assert_eq!(agent::attached(&a.client, CLIENT_IFACE), Attached::NOTHING);
}

#[test]
fn when_one_attachment_ends_the_agent_stops_the_others() {
    let (a, b) = (pod("selae"), pod("selag"));
    let node = node_namespace("sele");
    let dir = ScratchDir::new("attachments");
    let file_a = attachment_file(dir.path(), &a);
    // Its own file says how long it runs.
    let file_b = attachment_file(dir.path(), &b);
    let text = std::fs::read_to_string(&file_b).unwrap();
    std::fs::write(
        &file_b,
        text.replace("threshold = 2", "threshold = 2\nduration = 1"),
    )
    .unwrap();
    // An agent that waited for the other would be ended by `timeout`
    // (exit 124).
    let out = node
        .command("timeout")
        .arg("20")
        .arg(selector_binary())
        .args(run_args(&[&file_a, &file_b]))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(
        out.status.code(),
        Some(0),
        "the agent must end with its first attachment: {text}"
    );
    let out = text;
    let label_b = format!("{CLIENT_IFACE}@/run/netns/{}", b.client.name);
    assert!(
        out.contains(&format!("attachment {label_b} ended: stopping the others")),
        "{out}"
    );
    for tb in [&a, &b] {
        assert_eq!(agent::attached(&tb.client, CLIENT_IFACE), Attached::NOTHING);
    }
}

#[test]
fn an_attachment_in_the_agents_own_namespace_runs_beside_a_pods() {
    let a = pod("selan");
    let node = node_namespace("seli");
    let dir = ScratchDir::new("attachments");
    let in_pod = attachment_file(dir.path(), &a);
    // The node's own eth0 (no netns key): the same members, routed there.
    let on_node = dir.path().join("node.toml");
    std::fs::write(
        &on_node,
        std::fs::read_to_string(&in_pod)
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("netns"))
            .map(|l| format!("{l}\n"))
            .collect::<String>(),
    )
    .unwrap();
    let metrics = "127.0.0.1:9656";
    let pod_label = format!("{CLIENT_IFACE}@/run/netns/{}", a.client.name);
    let (mut agent, _lines) = spawn_attachments(
        &node,
        &[&on_node, &in_pod],
        metrics,
        &[],
        &[CLIENT_IFACE.to_string(), pod_label.clone()],
    );
    // Each on its own namespace's eth0.
    for ns in [&node, &a.client] {
        let on = agent::attached(ns, CLIENT_IFACE);
        assert_eq!((on.tcx_egress, on.tcx_ingress), (1, 1), "{}", ns.name);
    }
    let node_status = agent::status_json::<serde_json::Value>(&node, CLIENT_IFACE);
    assert!(node_status["netns"].is_null(), "{node_status}");
    // The node's eth0 lock is the agent's own attachment's: a bare status
    // is still the agent's, every attachment's.
    let (code, out) = agent::run_selector(&node, &["status", "--json"]);
    assert_eq!(code, 0, "{out}");
    let all: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(
        all["attachments"].as_array().map(Vec::len),
        Some(2),
        "{all}"
    );
    let pod_status = agent::status_json::<serde_json::Value>(&a.client, CLIENT_IFACE);
    assert_eq!(
        pod_status["netns"]["path"],
        format!("/run/netns/{}", a.client.name).as_str()
    );
    let metrics: SocketAddr = metrics.parse().unwrap();
    let scraped = node
        .run(move || http_get(metrics, "/metrics", None))
        .unwrap()
        .unwrap();
    for label in [CLIENT_IFACE.to_string(), pod_label] {
        assert!(
            sample(
                &scraped.body,
                &format!("selector_in_flight{{attachment=\"{label}\"}}")
            )
            .is_some(),
            "{label}:\n{}",
            scraped.body
        );
    }
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    for ns in [&node, &a.client] {
        assert_eq!(agent::attached(ns, CLIENT_IFACE), Attached::NOTHING);
    }
}
