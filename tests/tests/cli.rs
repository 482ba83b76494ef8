//! The `selector` binary: bad input gives one error line, a non-zero exit
//! and nothing attached; run-time control; SIGTERM stops steering, waits for
//! the redirected reads and detaches cleanly.

use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use aya::programs::{TcAttachType, Xdp, XdpMode};
use selector_common::bench;
use selector_testbed::{
    Testbed,
    agent::{self, Agent, TotalsRow, selector_binary},
    topology::CLIENT_IFACE,
    wait_for,
};
use selector_user::datapath::bench::BenchPrograms;

const GROUP: &str = "10.77.0.10:11211,10.77.0.11:11211,10.77.0.12:11211";

fn tcx_programs(tb: &Testbed, attach: TcAttachType) -> usize {
    tcx_programs_on(tb, CLIENT_IFACE, attach)
}

fn tcx_programs_on(tb: &Testbed, iface: &'static str, attach: TcAttachType) -> usize {
    let a = agent::attached(&tb.client, iface);
    match attach {
        TcAttachType::Egress => a.tcx_egress,
        _ => a.tcx_ingress,
    }
}

fn has_xdp(tb: &Testbed) -> bool {
    has_xdp_on(tb, CLIENT_IFACE)
}

fn has_xdp_on(tb: &Testbed, iface: &str) -> bool {
    agent::attached(&tb.client, iface).xdp
}

/// Neither TCX chain of `iface` holds a program, nor has it an XDP program.
#[track_caller]
fn assert_nothing_attached(tb: &Testbed, iface: &str) {
    assert_eq!(agent::attached(&tb.client, iface), agent::Attached::NOTHING);
}

#[test]
fn bad_input_is_one_error_line_and_nothing_is_attached() {
    let tb = Testbed::new("selc", 0).unwrap();
    let nine: Vec<String> = (1..=9).map(|i| format!("10.77.0.{i}:11211")).collect();
    let nine = nine.join(",");
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["run", "--iface", CLIENT_IFACE], "--group"),
        (
            vec!["run", "--iface", CLIENT_IFACE, "--group", "10.77.0.10"],
            "address:port",
        ),
        (
            vec![
                "run",
                "--iface",
                CLIENT_IFACE,
                "--group",
                "10.77.0.10:1,10.77.0.10:1",
            ],
            "twice",
        ),
        (
            vec![
                "run",
                "--iface",
                CLIENT_IFACE,
                "--group",
                "10.77.0.10:1",
                "--group",
                "10.77.0.10:1",
            ],
            "group 1 and group 2",
        ),
        (
            vec!["run", "--iface", CLIENT_IFACE, "--group", &nine],
            "at most 8",
        ),
        (
            vec!["run", "--iface", "nosuch0", "--group", GROUP],
            "interface 'nosuch0' not found",
        ),
    ];
    // One bad setting on an otherwise good command line.
    let bad_settings: [(&[&str], &str); 10] = [
        (&["--threshold", "0"], "--threshold"),
        (&["--proto", "custom"], "--req-id-offset"),
        (&["--policy", "fastest"], "fastest"),
        (&["--mark", "0x3"], "--mark must have exactly one bit set"),
        (&["--mark", "bit24"], "0x hex"),
        (&["--timeout", "0"], "--timeout must be at least 1 ms"),
        (
            &["--timeout", "3600001"],
            "--timeout must be at most 3600000 ms",
        ),
        (&["--grace", "3600001"], "--grace must be at most"),
        (
            &[
                "--proto",
                "custom",
                "--req-id-offset",
                "0",
                "--req-id-len",
                "4",
                "--on-overload",
                "reject",
            ],
            "--on-overload reject needs --proto memcached or dns",
        ),
        (&["--on-overload", "throttle"], "throttle"),
    ];
    for (setting, expect) in bad_settings {
        let mut args = vec!["run", "--iface", CLIENT_IFACE, "--group", GROUP];
        args.extend_from_slice(setting);
        cases.push((args, expect));
    }
    for (args, expect) in cases {
        let (code, stderr) = run_ctl(&tb, &args);
        assert_ne!(code, 0, "{args:?} must fail");
        assert_eq!(
            stderr.trim_end().lines().count(),
            1,
            "{args:?}: one line, got:\n{stderr}"
        );
        assert!(stderr.starts_with("error"), "{args:?}: {stderr}");
        assert!(
            stderr.contains(expect),
            "{args:?}: expected '{expect}' in: {stderr}"
        );
    }
    assert_nothing_attached(&tb, CLIENT_IFACE);
}

/// A `--duration` beyond what a timer can hold (it panicked once attached),
/// not a number, infinite, zero or negative is refused naming the flag, as
/// flag and as config file key, before anything is attached.
#[test]
fn an_impossible_duration_is_refused_before_anything_is_attached() {
    let tb = Testbed::new("seld", 0).unwrap();
    let dir = std::env::temp_dir().join(format!("selector-duration-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cases: Vec<(Vec<String>, String)> = Vec::new();
    for secs in ["1e20", "1e300", "NaN", "inf", "0", "-1"] {
        let args = ["run", "--iface", CLIENT_IFACE, "--group", GROUP, "--quiet"];
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        args.push(format!("--duration={secs}"));
        cases.push((args, "--duration".into()));
    }
    for (n, value) in ["1e20", "nan", "-inf"].iter().enumerate() {
        let path = dir.join(format!("{n}.toml"));
        std::fs::write(
            &path,
            format!(
                "iface = \"{CLIENT_IFACE}\"\nquiet = true\nduration = {value}\n[[group]]\nmembers = [\"10.77.0.10:11211\"]\n"
            ),
        )
        .unwrap();
        let path = path.to_str().unwrap().to_owned();
        cases.push((
            vec!["run".into(), "--config".into(), path.clone()],
            format!("{path}:3: duration:"),
        ));
    }
    for (args, expect) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let started = Instant::now();
        let (code, out) = run_ctl(&tb, &args);
        assert_eq!(code, 1, "{args:?} must fail with an error: {out}");
        assert!(
            !out.contains("attached to"),
            "{args:?}: refused only after attaching: {out}"
        );
        assert_eq!(
            out.trim_end().lines().count(),
            1,
            "{args:?}: one line: {out}"
        );
        assert!(out.starts_with("error"), "{args:?}: {out}");
        assert!(
            out.contains(&expect),
            "{args:?}: expected '{expect}' in: {out}"
        );
        assert!(started.elapsed() < Duration::from_secs(10), "{args:?}");
        assert_eq!(tcx_programs(&tb, TcAttachType::Egress), 0, "{args:?}");
        assert_eq!(tcx_programs(&tb, TcAttachType::Ingress), 0, "{args:?}");
        assert!(!has_xdp(&tb), "{args:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_interface_without_ipv4_is_refused_with_nothing_attached() {
    let tb = Testbed::new("selv", 0).unwrap();
    // A veth pair that is up, with an IPv6 address only.
    tb.client
        .ip(&[
            "link", "add", "v4less0", "type", "veth", "peer", "name", "v4less1",
        ])
        .unwrap();
    tb.client
        .ip(&["addr", "add", "fd00:77::1/64", "dev", "v4less0", "nodad"])
        .unwrap();
    for dev in ["v4less0", "v4less1"] {
        tb.client.ip(&["link", "set", dev, "up"]).unwrap();
    }
    let (code, stderr) = run_ctl(&tb, &["run", "--iface", "v4less0", "--group", GROUP]);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(
        stderr.trim_end(),
        "error: interface 'v4less0' has no IPv4 address"
    );
    assert_nothing_attached(&tb, "v4less0");
}

#[test]
fn failed_attach_detaches_what_it_attached() {
    let tb = Testbed::new("self", 3).unwrap();
    // Another XDP program holds the interface's XDP hook (not a selector
    // on TCX, which `run` would refuse before attaching anything).
    let holder = tb
        .client
        .run(move || -> anyhow::Result<BenchPrograms> {
            let mut holder = BenchPrograms::load(1)?;
            let xdp: &mut Xdp = holder
                .ebpf_mut()
                .program_mut(bench::BASELINE_XDP)
                .expect("baseline XDP program")
                .try_into()?;
            xdp.attach(CLIENT_IFACE, XdpMode::Default)?;
            Ok(holder)
        })
        .unwrap()
        .unwrap();
    assert!(has_xdp(&tb));
    // The second attaches nothing else once XDP fails.
    let (code, stderr) = run_ctl(
        &tb,
        &[
            "run",
            "--iface",
            CLIENT_IFACE,
            "--group",
            GROUP,
            "--ingress",
            "xdp",
        ],
    );
    assert_ne!(code, 0);
    assert!(stderr.contains("attaching XDP"), "{stderr}");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{stderr}");
    assert_eq!(tcx_programs(&tb, TcAttachType::Egress), 0, "no egress left");
    assert_eq!(tcx_programs(&tb, TcAttachType::Ingress), 0);
    drop(holder);
    assert_nothing_attached(&tb, CLIENT_IFACE);
}

#[test]
fn sigterm_detaches_cleanly_and_prints_totals() {
    let tb = Testbed::new("sels", 3).unwrap();
    // Default ingress: `auto`, which on a veth is TC.
    let (mut child, mut lines) = spawn_agent(&tb, &["--interval", "100"]);
    // The live table appears.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let line = lines.next().unwrap().unwrap();
        if line.starts_with("backend") {
            break;
        }
        assert!(Instant::now() < deadline, "no table printed");
    }
    assert_eq!(tcx_programs(&tb, TcAttachType::Egress), 1);
    assert_eq!(tcx_programs(&tb, TcAttachType::Ingress), 1);
    assert!(!has_xdp(&tb));
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    let position = |text: &str| {
        rest.iter()
            .position(|l| l.contains(text))
            .unwrap_or_else(|| panic!("no '{text}' in {rest:#?}"))
    };
    let stopping = position("selector: stopping: 0 redirected reads in flight");
    let detaching = position("detaching from eth0; totals:");
    assert!(stopping < detaching, "{rest:#?}");
    // The totals: a header and one row per backend.
    assert!(rest[detaching + 1].starts_with("backend"), "{rest:#?}");
    for backend in GROUP.split(',') {
        assert!(
            rest[detaching..].iter().any(|l| l.starts_with(backend)),
            "{rest:#?}"
        );
    }
    assert_nothing_attached(&tb, CLIENT_IFACE);
}

#[test]
fn sigterm_under_load_waits_for_redirected_reads_and_loses_no_reply() {
    let mut tb = Testbed::new("selg", 3).unwrap();
    tb.start_memcached().unwrap();
    selector_testbed::preload(&tb.client, &tb.replica_endpoints(), 100).unwrap();
    // `first`: every read leaving the primary goes to replica 1, stalled below.
    let (mut agent, mut lines) = spawn_agent(
        &tb,
        &["--threshold", "1", "--tie-break", "first", "--quiet"],
    );
    let spec = selector_testbed::LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: 2000,
        duration: Duration::from_millis(800),
        keys: 100,
        drain: Duration::from_millis(1500),
    };
    let load = tb
        .client
        .spawn(move || selector_testbed::run_load(&spec))
        .unwrap();
    // The first replica stalls, then the primary: reads leave the primary,
    // and the first one redirected goes to the stalled replica and waits
    // there. The agent is told to stop while it waits; if it detached at
    // once, the replica's late reply would not be rewritten and the
    // client's connected socket would drop it.
    tb.replicas[1].stop();
    tb.replicas[0].stop();
    let moved = wait_for(Duration::from_secs(2), || {
        agent::status(&tb.client, CLIENT_IFACE)
            .first()
            .is_some_and(|primary| primary.away > 0)
    });
    assert!(moved, "no read left the stalled primary");
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    // The agent says how many redirected reads it waits for as it stops:
    // the stalled replica holds at least one.
    let mut out: Vec<String> = Vec::new();
    let in_flight = loop {
        let line = lines
            .next()
            .expect("the agent ended without a stopping line")
            .unwrap();
        out.push(line.clone());
        if let Some(rest) = line.strip_prefix("selector: stopping: ") {
            let n = rest.split_whitespace().next().unwrap_or_default();
            break n.parse::<u64>().unwrap_or_else(|e| panic!("{e}: {line}"));
        }
    };
    tb.replicas[0].resume();
    tb.replicas[1].resume();
    assert!(in_flight > 0, "stopped with nothing in flight: {out:#?}");
    let report = load.join().unwrap().unwrap();
    assert!(agent.wait().unwrap().success());
    out.extend(lines.map(Result::unwrap));
    let stopping = line_index(&out, |l| l.starts_with("selector: stopping:"));
    let detaching = line_index(&out, |l| l.contains("detaching from eth0; totals:"));
    assert!(stopping < detaching, "{out:#?}");
    // The stop came while reads were being steered away from the primary.
    let primary = out[detaching..]
        .iter()
        .find(|l| l.starts_with("10.77.0.10:11211"))
        .unwrap_or_else(|| panic!("no totals row for the primary in {out:#?}"));
    let away: u64 = primary.split_whitespace().nth(3).unwrap().parse().unwrap();
    assert!(away > 0, "{out:#?}");
    assert!(report.sent > 1000, "{}", report.sent);
    assert_eq!(report.lost(), 0, "{out:#?}");
    assert_eq!(report.wrong_values, 0);
    assert_nothing_attached(&tb, CLIENT_IFACE);
    tb.replicas.clear();
}

#[test]
fn a_second_signal_cuts_the_wait_short() {
    let mut tb = Testbed::new("sel2", 3).unwrap();
    tb.start_memcached().unwrap();
    selector_testbed::preload(&tb.client, &tb.replica_endpoints(), 100).unwrap();
    let (mut agent, mut lines) = spawn_agent(&tb, &["--threshold", "1", "--quiet"]);
    let spec = selector_testbed::LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: 2000,
        duration: Duration::from_millis(400),
        keys: 100,
        drain: Duration::from_millis(100),
    };
    let load = tb
        .client
        .spawn(move || selector_testbed::run_load(&spec))
        .unwrap();
    // Every replica stalls: redirected reads stay in flight, and the agent
    // would wait for them (up to timeout + grace) after the first signal.
    for replica in &tb.replicas {
        replica.stop();
    }
    let moved = wait_for(Duration::from_secs(2), || {
        agent::status(&tb.client, CLIENT_IFACE)
            .first()
            .is_some_and(|primary| primary.away > 0)
    });
    assert!(moved, "no read left the stalled primary");
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let stopping = lines.next().unwrap().unwrap();
    assert!(stopping.starts_with("selector: stopping: "), "{stopping}");
    assert_ne!(
        stopping, "selector: stopping: 0 redirected reads in flight",
        "the stall must leave redirected reads in flight"
    );
    unsafe { libc::kill(agent.id() as i32, libc::SIGINT) };
    assert!(agent.wait().unwrap().success());
    let rest: Vec<String> = lines.map(Result::unwrap).collect();
    let second = line_index(&rest, |l| {
        l.starts_with("selector: second signal: detaching with ")
    });
    let detaching = line_index(&rest, |l| l.contains("detaching from eth0; totals:"));
    assert!(second < detaching, "{rest:#?}");
    assert_nothing_attached(&tb, CLIENT_IFACE);
    for replica in &tb.replicas {
        replica.resume();
    }
    let _ = load.join().unwrap();
    tb.replicas.clear();
}

#[test]
fn set_changes_show_in_the_json_status() {
    let tb = Testbed::new("selj", 3).unwrap();
    let (mut agent, _lines) = spawn_agent(&tb, &["--quiet", "--mark", "0x10", "--grace", "300"]);
    let (code, out) = run_ctl(
        &tb,
        &[
            "set",
            "--iface",
            CLIENT_IFACE,
            "--max-pending",
            "5",
            "--on-overload",
            "drop",
        ],
    );
    assert_eq!(
        (code, out.trim()),
        (
            0,
            "policy threshold, threshold 4, max-pending 5, max-pending-client 0, on-overload drop, budget 1 ms, tie-break random, avoid-slow on"
        )
    );
    let (code, out) = run_ctl(&tb, &["status", "--iface", CLIENT_IFACE, "--json"]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(
        out.trim_end().lines().count(),
        1,
        "one JSON document: {out}"
    );
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let settings = &status["settings"];
    assert_eq!(settings["max_pending"], 5, "{status}");
    assert_eq!(settings["on_overload"], "drop", "{status}");
    assert_eq!(settings["max_pending_client"], 0, "{status}");
    assert_eq!(settings["policy"], "threshold", "{status}");
    assert_eq!(settings["mark"], 0x10, "{status}");
    assert_eq!(settings["timeout_ms"], 1000, "{status}");
    assert_eq!(settings["grace_ms"], 300, "{status}");
    assert_eq!(settings["proto"], "memcached", "{status}");
    assert_eq!(status["iface"], CLIENT_IFACE);
    let (version, commit) = version_and_commit();
    assert_eq!(status["build"]["version"], version.as_str(), "{status}");
    assert_eq!(status["build"]["commit"], commit.as_str(), "{status}");
    assert!(status["passed"].is_array(), "{status}");
    let backends = status["backends"].as_array().unwrap();
    let names: Vec<&str> = backends
        .iter()
        .map(|b| b["backend"].as_str().unwrap())
        .collect();
    assert_eq!(names.join(","), GROUP);
    assert_eq!(backends[2]["position"], 2);
    assert_eq!(backends[0]["pending"], 0);

    // The human form says the same.
    let (_, out) = run_ctl(&tb, &["status", "--iface", CLIENT_IFACE]);
    assert!(out.contains("max-pending 5"), "{out}");
    assert!(out.contains("on-overload drop"), "{out}");
    assert!(out.contains("mark 0x00000010"), "{out}");
    assert!(out.contains("passed untouched:"), "{out}");
    assert!(
        out.contains(&format!("agent: selector {version} (commit {commit})")),
        "{out}"
    );

    // Hedging is set at run time too: a fixed delay, then `auto`, whose
    // delay starts at the ceiling (half the 1 s timeout, at most 50 ms).
    let hedging = |args: &[&str]| {
        let mut set = vec!["set", "--iface", CLIENT_IFACE];
        set.extend_from_slice(args);
        let (code, out) = run_ctl(&tb, &set);
        assert_eq!(code, 0, "{out}");
        let (_, out) = run_ctl(&tb, &["status", "--iface", CLIENT_IFACE, "--json"]);
        serde_json::from_str::<serde_json::Value>(&out).unwrap()
    };
    let status = hedging(&["--hedge-after", "2", "--hedge-budget", "10"]);
    assert_eq!(status["settings"]["hedge_after"], "2", "{status}");
    assert_eq!(status["settings"]["hedge_budget_percent"], 10, "{status}");
    assert_eq!(
        status["backends"][0]["hedge_delay_ns"], 2_000_000,
        "{status}"
    );
    let status = hedging(&["--hedge-after", "auto"]);
    assert_eq!(status["settings"]["hedge_after"], "auto", "{status}");
    assert_eq!(
        status["backends"][0]["hedge_delay_ns"], 50_000_000,
        "{status}"
    );
    let status = hedging(&["--hedge-after", "off"]);
    assert_eq!(status["settings"]["hedge_after"], "off", "{status}");
    assert!(
        status["backends"][0]["hedge_delay_ns"].is_null(),
        "{status}"
    );

    // A bad change is refused and changes nothing.
    let (code, err) = run_ctl(&tb, &["set", "--iface", CLIENT_IFACE]);
    assert_ne!(code, 0);
    assert!(err.contains("set needs at least one of"), "{err}");
    let (code, err) = run_ctl(
        &tb,
        &["set", "--iface", CLIENT_IFACE, "--on-overload", "throttle"],
    );
    assert_eq!(code, 2, "{err}");

    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
}

/// `selector --version`: "selector VERSION (commit HASH)".
fn version_and_commit() -> (String, String) {
    let out = std::process::Command::new(selector_binary())
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    let line = String::from_utf8(out.stdout).unwrap();
    let rest = line.trim_end().strip_prefix("selector ").expect(&line);
    let (version, commit) = rest.split_once(" (commit ").expect(&line);
    let commit = commit.strip_suffix(')').expect(&line);
    (version.to_owned(), commit.to_owned())
}

#[test]
fn version_names_the_commit_built_from() {
    let (version, commit) = version_and_commit();
    assert_eq!(version, env!("CARGO_PKG_VERSION"));
    let hash = commit.strip_suffix("-dirty").unwrap_or(&commit);
    assert!(
        hash.len() >= 7 && hash.chars().all(|c| c.is_ascii_hexdigit()),
        "{commit}"
    );
    // The checkout's HEAD (the binary was just built from it).
    let head = std::process::Command::new("git")
        .args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "HEAD"])
        .output()
        .unwrap();
    let head = String::from_utf8(head.stdout).unwrap();
    assert!(head.starts_with(hash), "{commit} is not HEAD {head}");
}

/// `selector ARGS` outside any namespace (nothing here touches the host):
/// (exit code, stdout, stderr).
fn selector_output(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(selector_binary())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn completions_and_man_pages_come_from_the_binary() {
    let (code, bash, err) = selector_output(&["completions", "bash"]);
    assert_eq!(code, 0, "{err}");
    // Loaded by a real bash, it completes the subcommands.
    let script = std::env::temp_dir().join(format!("selector-completion-{}", std::process::id()));
    std::fs::write(&script, &bash).unwrap();
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "source {}; COMP_WORDS=(selector ''); COMP_CWORD=1; _selector selector '' selector; echo \"${{COMPREPLY[@]}}\"",
            script.display()
        ))
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&script);
    let words = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = words.split_whitespace().collect();
    for subcommand in [
        "run", "set", "drain", "undrain", "status", "detach", "reload", "check",
    ] {
        assert!(words.contains(&subcommand), "{subcommand} not in {words:?}");
    }
    let (code, zsh, _) = selector_output(&["completions", "zsh"]);
    assert_eq!((code, zsh.starts_with("#compdef selector")), (0, true));
    let (code, _, err) = selector_output(&["completions", "tcsh"]);
    assert_eq!(code, 2, "{err}");

    let (code, man, err) = selector_output(&["man"]);
    assert_eq!(code, 0, "{err}");
    assert!(man.contains(".TH selector 1"), "{man}");
    let (code, man, _) = selector_output(&["man", "check"]);
    assert_eq!(code, 0);
    assert!(man.contains(".TH selector-check 1"), "{man}");
    let (code, _, err) = selector_output(&["man", "nosuch"]);
    assert_eq!(code, 1);
    assert!(err.starts_with("error: no subcommand 'nosuch'"), "{err}");

    // Both are listed where a newcomer looks, and --proto says what it is.
    let (code, help, _) = selector_output(&["--help"]);
    assert_eq!(code, 0);
    for listed in ["  completions  ", "  man  "] {
        assert!(help.contains(listed), "{listed:?} not in {help}");
    }
    let (_, help, _) = selector_output(&["run", "--help"]);
    assert!(help.contains("The protocol the groups speak"), "{help}");
}

/// A hedge thread that dies (a panic, planted here) must not leave the
/// agent saying hedging is on while nothing hedges: the agent stops as on
/// SIGTERM (steering off, redirected reads waited for, detach) and exits
/// with an error naming the failure, for its supervisor to restart it
/// (the unit's Restart=on-failure). The agent runs in this process, where
/// the panic can be planted.
#[test]
fn a_failed_hedge_thread_stops_the_agent_with_an_error() {
    use clap::Parser as _;
    use selector_user::cli::{Cli, Command};

    let tb = Testbed::new("selh", 3).unwrap();
    let cli = Cli::try_parse_from([
        "selector",
        "run",
        "--iface",
        CLIENT_IFACE,
        "--group",
        GROUP,
        "--hedge-after",
        "2",
        "--quiet",
        // Only a bound for a broken run: the failure must end it long before.
        "--duration",
        "60",
    ])
    .unwrap();
    let Command::Run(args) = cli.command else {
        unreachable!("a run command")
    };
    // Built before the agent starts: on a fresh clone the first `selector`
    // command builds the binary (over a minute on a loaded machine), and
    // the agent's --duration would run out meanwhile.
    selector_binary();
    let agent = tb
        .client
        .spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(selector_user::cli::run(*args, cli.log_format))
        })
        .unwrap();
    // A loaded machine (the suite runs two tests at a time) can take a
    // while to attach an agent built without optimisations.
    let deadline = Instant::now() + Duration::from_secs(40);
    let status = loop {
        if agent.is_finished() {
            let result = agent.join().unwrap().map_err(|e| format!("{e:#}"));
            panic!("the agent stopped before it answered: {result:?}");
        }
        let (code, out) = run_ctl(&tb, &["status", "--iface", CLIENT_IFACE, "--json"]);
        if code == 0 {
            break serde_json::from_str::<serde_json::Value>(&out).unwrap();
        }
        assert!(Instant::now() < deadline, "the agent never answered: {out}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        status["backends"][0]["hedge_delay_ns"], 2_000_000,
        "{status}"
    );
    let planted = Instant::now();
    selector_user::hedging::plant_hedge_thread_panic();
    let result = agent.join().unwrap();
    let err = result.expect_err("the agent must fail, not run its --duration out");
    assert!(
        planted.elapsed() < Duration::from_secs(4),
        "noticed late: {:?}",
        planted.elapsed()
    );
    let err = format!("{err:#}");
    assert!(err.contains("hedge thread"), "{err}");
    assert!(err.contains("planted"), "the panic's message: {err}");
    assert_nothing_attached(&tb, CLIENT_IFACE);
    // Gone as after SIGTERM: its managed neighbour entries too.
    let neighbours = tb
        .client
        .ip(&["neigh", "show", "dev", CLIENT_IFACE])
        .unwrap();
    let neighbours = String::from_utf8_lossy(&neighbours.stdout);
    assert!(!neighbours.contains("managed"), "{neighbours}");
}

/// `selector run | head -3`: the reader gone, the agent stops printing
/// and steers on; SIGTERM then stops it as usual (exit 0, detached), with
/// no panic. And `selector man | head -1` exits quietly.
#[test]
fn a_closed_stdout_ends_the_printing_never_the_agent() {
    let tb = Testbed::new("selpp", 3).unwrap();
    let (mut child, mut lines) = spawn_agent(&tb, &["--interval", "100"]);
    for _ in 0..3 {
        lines.next().unwrap().unwrap();
    }
    drop(lines); // as `head -3` exits
    // Several table intervals later it still runs and answers.
    std::thread::sleep(Duration::from_millis(500));
    assert!(child.try_wait().unwrap().is_none(), "the agent ended");
    let (code, out) = run_ctl(&tb, &["status", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 0, "{out}");
    assert_eq!(tcx_programs(&tb, TcAttachType::Egress), 1);
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "a graceful stop exits 0: {status}");
    assert_nothing_attached(&tb, CLIENT_IFACE);

    let mut man = std::process::Command::new(selector_binary())
        .args(["man", "run"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(man.stdout.take()); // a reader that read nothing and left
    let out = man.wait_with_output().unwrap();
    assert_eq!(
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).as_ref()
        ),
        (Some(0), "")
    );
}

/// SIGHUPs while the programs load (the verifier's EAGAIN) are no start
/// failure: the agent attaches, then applies the reload they asked for.
#[test]
fn a_sighup_while_the_programs_load_reloads_once_attached() {
    let tb = Testbed::new("selhu", 3).unwrap();
    let dir = std::env::temp_dir().join(format!("selector-hup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("selector.toml");
    let members: Vec<String> = GROUP.split(',').map(|m| format!("\"{m}\"")).collect();
    std::fs::write(
        &file,
        format!(
            "iface = \"{CLIENT_IFACE}\"\nquiet = true\n[[group]]\nmembers = [{}]\n",
            members.join(", ")
        ),
    )
    .unwrap();
    let mut child = agent::AgentProcess(
        tb.client
            .command(selector_binary().to_str().unwrap())
            .args(["run", "--config", file.to_str().unwrap()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let pid = child.id() as i32;
    // SIGHUP ends a process that has no handler yet: wait for the agent's.
    let catches_hangup = || {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                let mask = s
                    .lines()
                    .find_map(|l| l.strip_prefix("SigCgt:"))?
                    .trim()
                    .to_string();
                u64::from_str_radix(&mask, 16).ok()
            })
            .is_some_and(|mask| mask & (1 << (libc::SIGHUP - 1)) != 0)
    };
    assert!(
        wait_for(Duration::from_secs(10), catches_hangup),
        "no SIGHUP handler"
    );
    let mut lines =
        std::io::BufRead::lines(std::io::BufReader::new(child.0.stdout.take().unwrap()));
    let hangups = std::thread::spawn(move || {
        // Through the load (a few hundred ms here, seconds under emulation).
        for _ in 0..60 {
            if unsafe { libc::kill(pid, libc::SIGHUP) } != 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let first = lines.next().map(Result::unwrap).unwrap_or_default();
    hangups.join().unwrap();
    if !first.starts_with("selector: attached to") {
        let _ = child.0.wait();
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(&mut child.0.stderr.take().unwrap(), &mut err);
        panic!("the start failed: {first} {err}");
    }
    let reloaded = lines
        .by_ref()
        .map_while(Result::ok)
        .find(|l| l.starts_with("selector: reload"));
    assert!(reloaded.is_some(), "no reload after attaching");
    unsafe { libc::kill(pid, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// The shipped load generator of getting-started's "by hand" path: keys
/// stored on every replica, gets to the primary, every reply counted.
#[test]
fn the_load_generator_reads_from_real_replicas_and_says_what_it_saw() {
    let mut tb = Testbed::new("selld", 3).unwrap();
    tb.start_memcached().unwrap();
    let r = tb.replica_endpoints();
    let run = |args: &[&str]| {
        let out = tb
            .client
            .command(env!("CARGO_BIN_EXE_selector-load"))
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let all = format!("{},{},{}", r[0], r[1], r[2]);
    let (code, out, err) = run(&[
        "--target",
        &r[0].to_string(),
        "--store-on",
        &all,
        "--rate",
        "400",
        "--seconds",
        "1",
    ]);
    assert_eq!(code, Some(0), "{out}{err}");
    let last = out.lines().last().unwrap();
    let (received, rest) = last
        .strip_prefix("selector-load: ")
        .and_then(|l| l.split_once(" of "))
        .unwrap_or_else(|| panic!("{out}"));
    let sent = rest.split_whitespace().next().unwrap();
    assert_eq!(received, sent, "{out}");
    assert!(sent.parse::<u64>().unwrap() >= 350, "{out}");
    assert!(last.contains("(wrong values: 0); latency p50 "), "{out}");
    // Every replica has the keys: a read moved to another finds its value.
    use selector_testbed::memcached::{key_for, parse_get_response, value_for};
    for &replica in &r[1..] {
        let found = tb
            .client
            .spawn(move || {
                let client = selector_testbed::MemcachedClient::connect(replica).unwrap();
                let reply = client.request(
                    format!("get {}\r\n", key_for(499)).as_bytes(),
                    Duration::from_secs(1),
                );
                reply.is_ok_and(|body| parse_get_response(&body) == Some(value_for(499).as_bytes()))
            })
            .unwrap()
            .join()
            .unwrap();
        assert!(found, "{replica} has the keys");
    }
    let (code, _, err) = run(&["--target", &r[0].to_string(), "--rate", "0"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("--rate must be at least 1"), "{err}");
}

/// The demo ends with what the client saw with the agent and, in the same
/// run, without it.
#[test]
fn the_demo_ends_with_the_same_load_with_and_without_the_selector() {
    // The demo runs the agent binary beside itself.
    let agent = selector_binary();
    let demo = std::path::Path::new(env!("CARGO_BIN_EXE_selector-demo"));
    assert_eq!(agent.parent(), demo.parent(), "built side by side");
    let out = std::process::Command::new(demo)
        .args(["--seconds", "1", "--rate", "300"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = text.lines().collect();
    let saw = lines
        .iter()
        .position(|l| *l == "demo: the client saw")
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        lines[saw + 1].starts_with("  with the selector:    "),
        "{text}"
    );
    assert!(
        lines[saw + 2].starts_with("  without the selector: "),
        "{text}"
    );
    for line in &lines[saw + 1..=saw + 2] {
        assert!(
            line.contains(" replies (wrong values: 0); latency p50 "),
            "{text}"
        );
    }
    assert_eq!(
        lines.last(),
        Some(&"demo: removed every namespace and process it created")
    );
}

/// `--ingress auto` on a device without native XDP says once what it chose
/// and why, in the start line, not as an error.
#[test]
fn auto_ingress_without_native_xdp_says_what_it_chose() {
    // Loopback: no kind, so `auto` tries native XDP, which it lacks. The
    // members are routed by it.
    let ns = selector_testbed::Namespace::create(&format!(
        "selax-{}",
        selector_testbed::netns::unique_tag()
    ))
    .unwrap();
    ns.ip(&["addr", "add", "10.77.0.1/24", "dev", "lo"])
        .unwrap();
    let mut child = agent::AgentProcess(
        ns.command(selector_binary().to_str().unwrap())
            .args(["run", "--iface", "lo", "--group", GROUP, "--quiet"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines =
        std::io::BufRead::lines(std::io::BufReader::new(child.0.stdout.take().unwrap()));
    let first = lines.next().unwrap().unwrap();
    assert!(
        first.starts_with(
            "selector: attached to lo (tc ingress, tc by tcx; auto: lo has no native XDP ("
        ),
        "{first}"
    );
    assert!(!first.contains("try --ingress"), "{first}");
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
}

/// Starts `selector run` with the standard group and `extra` flags, and
/// waits for its "attached" line.
fn spawn_agent(tb: &Testbed, extra: &[&str]) -> Agent {
    let mut args = vec!["--iface", CLIENT_IFACE, "--group", GROUP];
    args.extend_from_slice(extra);
    agent::spawn_agent(&tb.client, &args)
}

/// One backend's row in `selector status`.
fn status_row(tb: &Testbed, backend: &str) -> TotalsRow {
    agent::status(&tb.client, CLIENT_IFACE)
        .into_iter()
        .find(|row| row.backend == backend)
        .unwrap_or_else(|| panic!("no row for {backend}"))
}

/// Runs a control command; (exit code, stdout + stderr).
fn run_ctl(tb: &Testbed, args: &[&str]) -> (i32, String) {
    agent::run_selector(&tb.client, args)
}

fn stalled_load(tb: &Testbed) {
    let primary = tb.replica_endpoints()[0].to_string();
    let counted_before = status_row(tb, &primary).requests;
    let spec = selector_testbed::LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: 2000,
        duration: Duration::from_millis(600),
        keys: 100,
        drain: Duration::from_millis(500),
    };
    let load = tb
        .client
        .spawn(move || selector_testbed::run_load(&spec))
        .unwrap();
    // The stall once the load runs.
    let running = wait_for(Duration::from_secs(2), || {
        status_row(tb, &primary).requests > counted_before
    });
    assert!(running, "the agent counted no read of the load");
    tb.replicas[0].stop();
    std::thread::sleep(Duration::from_millis(50));
    tb.replicas[0].resume();
    let report = load.join().unwrap().unwrap();
    assert_eq!(report.lost(), 0);
}

#[test]
fn running_agent_takes_policy_threshold_and_drain_changes() {
    let mut tb = Testbed::new("selr", 3).unwrap();
    tb.start_memcached().unwrap();
    selector_testbed::preload(&tb.client, &tb.replica_endpoints(), 100).unwrap();
    // `first`: the first replica takes the reads until it is drained.
    let (mut agent, _lines) = spawn_agent(
        &tb,
        &[
            "--policy",
            "observe",
            "--threshold",
            "2",
            "--tie-break",
            "first",
            "--quiet",
        ],
    );

    // A second agent on the same interface is refused before it attaches.
    let (code, err) = run_ctl(&tb, &["run", "--iface", CLIENT_IFACE, "--group", GROUP]);
    assert_ne!(code, 0);
    assert!(err.contains("already running on eth0"), "{err}");
    assert_eq!(tcx_programs(&tb, TcAttachType::Egress), 1);

    let (code, out) = run_ctl(&tb, &["status", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("policy observe, threshold 2,"), "{out}");

    let (primary, first, second) = ("10.77.0.10:11211", "10.77.0.11:11211", "10.77.0.12:11211");
    stalled_load(&tb);
    assert_eq!(status_row(&tb, primary).away, 0, "observe never redirects");

    let (code, out) = run_ctl(
        &tb,
        &["set", "--iface", CLIENT_IFACE, "--policy", "threshold"],
    );
    assert_eq!(
        (code, out.trim()),
        (
            0,
            "policy threshold, threshold 2, max-pending 0, max-pending-client 0, on-overload pass, budget 1 ms, tie-break first, avoid-slow on"
        )
    );
    stalled_load(&tb);
    let away = status_row(&tb, primary).away;
    assert!(away > 0, "threshold policy set at run time must redirect");
    let (to_first, to_second) = (status_row(&tb, first).to, status_row(&tb, second).to);
    assert_eq!(to_first + to_second, away);
    assert!(to_first > 0, "the first least-loaded replica takes reads");

    let (code, out) = run_ctl(&tb, &["drain", "--iface", CLIENT_IFACE, first]);
    assert_eq!((code, out.trim()), (0, "10.77.0.11:11211 drained"));
    let (code, out) = run_ctl(&tb, &["status", "--iface", CLIENT_IFACE]);
    assert!(
        code == 0 && out.contains("drained: 10.77.0.11:11211"),
        "{out}"
    );
    stalled_load(&tb);
    assert_eq!(
        status_row(&tb, first).to,
        to_first,
        "a drained replica gets nothing new"
    );
    assert!(
        status_row(&tb, second).to > to_second,
        "the other replica takes the reads"
    );

    // Only root (or the agent's own user) may control it.
    let out = tb
        .client
        .command("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(selector_binary())
        .args(["set", "--iface", CLIENT_IFACE, "--policy", "observe"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("permission denied"));
    let (_, out) = run_ctl(&tb, &["status", "--iface", CLIENT_IFACE]);
    assert!(out.contains("policy threshold"), "{out}");

    let (code, err) = run_ctl(&tb, &["set", "--iface", CLIENT_IFACE, "--threshold", "0"]);
    assert_ne!(code, 0);
    assert!(err.contains("threshold must be at least 1"), "{err}");
    let (code, err) = run_ctl(&tb, &["drain", "--iface", CLIENT_IFACE, "10.77.0.99:1"]);
    assert_ne!(code, 0);
    assert!(err.contains("not a configured backend"), "{err}");
    let (code, err) = run_ctl(&tb, &["status", "--iface", "nosuch0"]);
    assert_ne!(code, 0);
    assert!(err.contains("no selector is running on nosuch0"), "{err}");

    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    tb.replicas.clear();
}

#[test]
fn duration_ends_the_run_with_totals_and_nothing_attached() {
    let tb = Testbed::new("seld", 3).unwrap();
    let mut child = tb
        .client
        .command(selector_binary().to_str().unwrap())
        .args(["run", "--iface", CLIENT_IFACE, "--group", GROUP])
        .args(["--duration", "0.5", "--quiet"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // It must end by itself; the bound only keeps a broken build from
    // hanging the suite.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("--duration 0.5 did not end the run");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    assert!(out.contains("detaching from eth0; totals:"), "{out}");
    assert_nothing_attached(&tb, CLIENT_IFACE);
}

/// `--log-format json`: every line the agent writes to standard output is
/// one JSON object with its time, level and message (no table), from the
/// attach to the detach; `--log-format text` keeps the `selector: ` lines.
#[test]
fn a_json_log_is_json_lines_only() {
    let tb = Testbed::new("selj", 3).unwrap();
    let out = tb
        .client
        .command(selector_binary().to_str().unwrap())
        .args(["--log-format", "json", "run", "--iface", CLIENT_IFACE])
        .args(["--group", GROUP, "--duration", "1.5", "--interval", "200"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let messages: Vec<&str> = lines
        .iter()
        .map(|l| {
            assert!(l["time"].as_str().is_some_and(|t| t.ends_with('Z')), "{l}");
            assert!(l["level"].is_string(), "{l}");
            l["message"]
                .as_str()
                .unwrap_or_else(|| panic!("no message: {l}"))
        })
        .collect();
    assert!(messages[0].starts_with("attached to eth0"), "{messages:?}");
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("detaching from eth0")),
        "{messages:?}"
    );
    assert_nothing_attached(&tb, CLIENT_IFACE);
    // The same run in text: its lines and the tables.
    let out = tb
        .client
        .command(selector_binary().to_str().unwrap())
        .args(["run", "--iface", CLIENT_IFACE, "--group", GROUP])
        .args(["--duration", "0.5"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("selector: attached to eth0"), "{text}");
    assert!(
        text.contains("selector: detaching from eth0; totals:"),
        "{text}"
    );
    assert!(serde_json::from_str::<serde_json::Value>(text.lines().next().unwrap()).is_err());
}

/// Index of the first of `lines` that `wanted` accepts; fails the test,
/// showing every line, if none does.
fn line_index(lines: &[String], wanted: impl Fn(&str) -> bool) -> usize {
    lines
        .iter()
        .position(|l| wanted(l))
        .unwrap_or_else(|| panic!("no such line in {lines:#?}"))
}

/// The control socket lives in a directory only root may enter, one per
/// network namespace: an unprivileged user can neither reach the agent
/// nor take its name, a killed agent's socket file does not block the next
/// one, and a client does not trust a socket held by another user (here
/// planted by making the directory that user's, which the agent then
/// refuses to start in).
#[test]
fn the_control_socket_is_private_and_an_impostor_is_not_trusted() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let tb = Testbed::new("selsk", 3).unwrap();
    let inode = std::fs::metadata(format!("/run/netns/{}", tb.client.name))
        .unwrap()
        .ino();
    let dir = std::path::PathBuf::from(format!("/run/selector/net-{inode}"));
    struct RemoveDir(std::path::PathBuf);
    impl Drop for RemoveDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = RemoveDir(dir.clone());
    let socket = dir.join(format!("{CLIENT_IFACE}.sock"));

    let (mut agent, _lines) = spawn_agent(&tb, &["--quiet"]);
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{}", dir.display());
    assert!(socket.exists());
    let nobody = |args: &[&str]| {
        tb.client
            .command("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .args(args)
            .output()
            .unwrap()
    };
    let out = nobody(&[
        selector_binary().to_str().unwrap(),
        "status",
        "--iface",
        CLIENT_IFACE,
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("permission denied"));
    // Killed: the file stays, and does not stop the next agent.
    agent.kill().unwrap();
    agent.wait().unwrap();
    assert!(socket.exists());
    let (mut agent, _lines) = spawn_agent(&tb, &["--quiet"]);
    let (code, out) = run_ctl(&tb, &["status", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 0, "{out}");
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    assert!(!socket.exists(), "the socket goes with the agent");
    assert!(!dir.exists(), "and the directory with the last agent in it");

    // An impostor: the directory made another user's, and a socket there
    // that user listens on (bound by root, who may pass through
    // /run/selector, then listened on as uid 65534: SO_PEERCRED reports
    // who called listen).
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
    let mut impostor = tb
        .client
        .command("perl")
        .args([
            "-MSocket",
            "-MPOSIX",
            "-e",
            r#"socket(S, PF_UNIX, SOCK_STREAM, 0) or die "$!"; bind(S, pack_sockaddr_un($ARGV[0])) or die "$!"; POSIX::setgid(65534); POSIX::setuid(65534) or die "$!"; listen(S, 5) or die "$!"; $| = 1; print "ready\n"; while (accept(C, S)) { print C "{\"reply\":\"done\",\"message\":\"impostor\"}\n"; close C }"#,
            socket.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ready = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(impostor.stdout.take().unwrap()),
        &mut ready,
    )
    .unwrap();
    assert_eq!(ready.trim(), "ready");
    let (code, out) = run_ctl(&tb, &["set", "--iface", CLIENT_IFACE, "--threshold", "9"]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("held by uid 65534") && out.contains("not trusting it"),
        "{out}"
    );
    let (code, out) = agent::run_selector(
        &tb.client,
        &["run", "--iface", CLIENT_IFACE, "--group", GROUP, "--quiet"],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("must be a directory of the agent's user"),
        "{out}"
    );
    impostor.kill().unwrap();
    impostor.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without `--iface`, the control commands talk to the only agent in the
/// namespace (found by the lock it holds beside its socket); with none,
/// or with two, they fail in one line saying what to do. Each test's
/// agents run in a namespace of its own, so what runs elsewhere never
/// counts.
#[test]
fn control_commands_without_iface_find_the_only_agent() {
    let tb = Testbed::new("selcf", 3).unwrap();
    let (code, out) = run_ctl(&tb, &["status"]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(out.trim_end().lines().count(), 1, "{out}");
    assert!(
        out.starts_with("error: no selector agent is running in this network namespace"),
        "{out}"
    );

    let (mut agent, _lines) = spawn_agent(&tb, &["--quiet"]);
    let (code, out) = run_ctl(&tb, &["status", "--json"]);
    assert_eq!(code, 0, "{out}");
    let status: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(status["iface"], CLIENT_IFACE, "{status}");
    let (code, out) = run_ctl(&tb, &["set", "--threshold", "7"]);
    assert_eq!(code, 0, "{out}");
    let (code, out) = run_ctl(&tb, &["drain", "10.77.0.11:11211"]);
    assert_eq!(code, 0, "{out}");
    let status: serde_json::Value = agent::status_json(&tb.client, CLIENT_IFACE);
    assert_eq!(status["settings"]["threshold"], 7, "{status}");
    assert_eq!(status["drained"][0], "10.77.0.11:11211", "{status}");
    let (code, out) = run_ctl(&tb, &["undrain", "10.77.0.11:11211"]);
    assert_eq!(code, 0, "{out}");
    // Reload reaches the agent (which was started without --config).
    let (code, out) = run_ctl(&tb, &["reload"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("nothing to reload"), "{out}");

    // A second agent, on another interface of the namespace.
    tb.client
        .ip(&[
            "link", "add", "ctl0", "type", "veth", "peer", "name", "ctl1",
        ])
        .unwrap();
    tb.client
        .ip(&["addr", "add", "10.88.0.1/24", "dev", "ctl0"])
        .unwrap();
    for dev in ["ctl0", "ctl1"] {
        tb.client.ip(&["link", "set", dev, "up"]).unwrap();
    }
    let (mut second, _second_lines) = agent::spawn_agent(
        &tb.client,
        &["--iface", "ctl0", "--group", "10.88.0.2:11211", "--quiet"],
    );
    for args in [&["status"][..], &["set", "--threshold", "3"][..]] {
        let (code, out) = run_ctl(&tb, args);
        assert_eq!(code, 1, "{args:?}: {out}");
        assert_eq!(
            out.trim_end(),
            format!(
                "error: 2 selector agents run in this network namespace (on ctl0, {CLIENT_IFACE}): name one with --iface"
            ),
            "{args:?}"
        );
    }
    // Named, each is reached.
    let (code, out) = run_ctl(&tb, &["status", "--iface", "ctl0", "--json"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("\"iface\":\"ctl0\""), "{out}");

    for child in [&mut agent, &mut second] {
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        assert!(child.wait().unwrap().success());
    }
}
