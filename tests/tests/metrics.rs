//! The agent's telemetry from the outside: a real Prometheus server scrapes
//! `--metrics-addr` in the namespace testbed and counts exactly the reads
//! the client sent, `promtool check metrics` accepts the exposition, and the
//! tail blame in `selector status --json` falls on a stalled primary when
//! nothing steers and leaves it when the selector steers. A metrics address
//! that cannot listen fails the start before anything is attached. Idle
//! connections by the thousand and a reader that never reads leave the
//! agent sweeping and answering.

use std::{
    net::SocketAddr,
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use selector_testbed::{
    LoadSpec, Testbed,
    agent::{self, Agent},
    prometheus::{HttpResponse, PrometheusServer, http_get, promtool_check},
    run_load,
    topology::CLIENT_IFACE,
    wait_for,
};

const KEYS: usize = 200;
/// The agent's endpoint and Prometheus, both on the client namespace's loopback.
const METRICS_ADDR: &str = "127.0.0.1:9464";
const PROMETHEUS_ADDR: &str = "127.0.0.1:9090";

fn testbed(prefix: &str) -> Testbed {
    Testbed::with_memcached(prefix, 3, KEYS).expect("testbed")
}

fn group(tb: &Testbed) -> String {
    tb.group_arg()
}

fn spawn_agent(tb: &Testbed, extra: &[&str]) -> Agent {
    let group = group(tb);
    let mut args = vec!["--iface", CLIENT_IFACE, "--group", &group, "--quiet"];
    args.extend_from_slice(extra);
    agent::spawn_agent(&tb.client, &args)
}

fn stop_agent(agent: Agent) {
    let (mut child, _lines) = agent;
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}

fn status_json(tb: &Testbed) -> serde_json::Value {
    agent::status_json(&tb.client, CLIENT_IFACE)
}

/// `GET path` from the agent's metrics endpoint in the client namespace.
fn get(tb: &Testbed, path: &'static str, accept: Option<&'static str>) -> HttpResponse {
    let metrics: SocketAddr = METRICS_ADDR.parse().unwrap();
    tb.client
        .run(move || http_get(metrics, path, accept))
        .unwrap()
        .unwrap_or_else(|e| panic!("GET {path}: {e:#}"))
}

#[test]
fn a_real_prometheus_counts_the_reads_the_client_sent() {
    let tb = testbed("selm");
    let agent = spawn_agent(&tb, &["--metrics-addr", METRICS_ADDR, "--interval", "200"]);
    let metrics: SocketAddr = METRICS_ADDR.parse().unwrap();
    let prometheus = PrometheusServer::start(
        &tb.client,
        PROMETHEUS_ADDR.parse().unwrap(),
        metrics,
        Duration::from_millis(500),
    )
    .expect("prometheus");

    let spec = LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: 1000,
        duration: Duration::from_millis(1500),
        keys: KEYS,
        drain: Duration::from_secs(1),
    };
    let report = tb.client.run(move || run_load(&spec)).unwrap().unwrap();
    assert_eq!(report.lost(), 0);
    let sent = report.sent as f64;

    // The reads the client sent, through a real scrape and PromQL.
    let query = "sum(selector_requests_total)";
    let value = prometheus
        .wait_for(&tb.client, query, sent, Duration::from_secs(30))
        .unwrap();
    eprintln!("{query} = {value:?}; the client sent {sent}");
    assert_eq!(value, Some(sent), "prometheus log:\n{}", prometheus.log());
    let answered = "sum(selector_response_latency_seconds_count)";
    let value = prometheus
        .wait_for(&tb.client, answered, sent, Duration::from_secs(10))
        .unwrap();
    assert_eq!(value, Some(sent), "{answered}");
    let up = prometheus
        .query(&tb.client, "up{job=\"selector\"}")
        .unwrap();
    assert_eq!(up, Some(1.0));
    let p50 = "histogram_quantile(0.5, sum by (le) (selector_response_latency_seconds_bucket))";
    let p50 = prometheus.query(&tb.client, p50).unwrap().unwrap();
    assert!(p50 > 0.0 && p50 < 0.1, "p50 {p50} s");

    // What a scraper or curl gets, and promtool's lint of it.
    let text = get(&tb, "/metrics", None);
    assert_eq!(text.status, 200);
    assert_eq!(
        text.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let (ok, said) = promtool_check(&text.body);
    assert!(ok, "promtool check metrics: {said}\n{}", text.body);
    // Which build answers: the version and commit `status --json` gives.
    let build = &status_json(&tb)["build"];
    let build_info = format!(
        "selector_build_info{{version={},commit={}}} 1\n",
        build["version"], build["commit"]
    );
    assert!(
        text.body.contains(&build_info),
        "{build_info}\n{}",
        text.body
    );
    let scraped = prometheus.query(&tb.client, "selector_build_info").unwrap();
    assert_eq!(scraped, Some(1.0), "scraped by Prometheus");
    let openmetrics = get(
        &tb,
        "/metrics",
        Some("application/openmetrics-text;version=1.0.0"),
    );
    assert_eq!(
        openmetrics.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    assert!(openmetrics.body.ends_with("# EOF\n"));
    let missing = get(&tb, "/", None);
    assert_eq!(missing.status, 404);
    // The probes: a running agent is live and ready.
    let live = get(&tb, "/healthz", None);
    assert_eq!(
        (live.status, live.body.as_str()),
        (200, "ok: the agent's loop is turning\n")
    );
    let ready = get(&tb, "/readyz", None);
    assert_eq!(
        (ready.status, ready.body.as_str()),
        (
            200,
            "ready: attached, swept recently, configuration applied\n"
        )
    );

    drop(prometheus);
    stop_agent(agent);
}

#[test]
fn a_metrics_address_that_cannot_listen_fails_the_start_with_nothing_attached() {
    let tb = Testbed::new("selma", 3).unwrap();
    let group = group(&tb);
    // No interface in the client namespace has this address.
    let args = [
        "run",
        "--iface",
        CLIENT_IFACE,
        "--group",
        &group,
        "--metrics-addr",
        "10.99.0.1:9464",
    ];
    let (code, out) = agent::run_selector(&tb.client, &args);
    assert_eq!(code, 1, "{out}");
    assert_eq!(out.trim_end().lines().count(), 1, "{out}");
    assert!(
        out.starts_with("error: --metrics-addr 10.99.0.1:9464: cannot listen"),
        "{out}"
    );
    assert_eq!(
        agent::attached(&tb.client, CLIENT_IFACE),
        agent::Attached::NOTHING
    );
}

/// Each replica is the primary of a third of the reads (as when clients
/// spread their keys); replica 0 stalls for 100 ms every 500 ms while the
/// agent runs with `policy`. Returns replica 0's share of the requests in
/// the interval tails, and the reads redirected away from it, from
/// `selector status --json`.
fn stalled_primary_tail_share(tb: &Testbed, policy: &[&str]) -> (f64, u64) {
    let mut args = vec!["--interval", "500"];
    args.extend_from_slice(policy);
    let agent = spawn_agent(tb, &args);
    let load_time = Duration::from_secs(4);
    let loads: Vec<_> = tb
        .replica_endpoints()
        .into_iter()
        .map(|target| {
            let spec = LoadSpec {
                target: target.into(),
                rate: 700,
                duration: load_time,
                keys: KEYS,
                drain: Duration::from_secs(1),
            };
            tb.client.spawn(move || run_load(&spec)).unwrap()
        })
        .collect();
    let end = Instant::now() + load_time;
    while Instant::now() + Duration::from_millis(500) < end {
        thread::sleep(Duration::from_millis(400));
        tb.replicas[0].stop();
        thread::sleep(Duration::from_millis(100));
        tb.replicas[0].resume();
    }
    for load in loads {
        let report = load.join().unwrap().unwrap();
        assert_eq!(report.lost(), 0);
    }
    // Two more intervals: the last one with replies has ended.
    let number = |status: &serde_json::Value| status["last_interval"]["number"].as_u64();
    let at_end = number(&status_json(tb)).unwrap_or(0);
    let mut status = status_json(tb);
    let ended = wait_for(Duration::from_secs(5), || {
        status = status_json(tb);
        number(&status).is_some_and(|n| n >= at_end + 2)
    });
    assert!(ended, "no two more intervals ended: {status}");
    stop_agent(agent);

    let interval = &status["last_interval"];
    assert!(interval["number"].as_u64().unwrap() >= 8, "{status}");
    // About --interval; the ticks and snapshots jitter on a busy machine.
    assert!(interval["length_ms"].as_u64().unwrap() >= 100, "{status}");
    let backends = status["backends"].as_array().unwrap();
    let tails: Vec<u64> = backends
        .iter()
        .map(|b| b["tail_requests_total"].as_u64().unwrap())
        .collect();
    let total: u64 = tails.iter().sum();
    assert!(total > 0, "{status}");
    for b in backends {
        // Blame of the last interval: a share, or null when it had no reply.
        let blame = &b["tail_blame"];
        assert!(
            blame.is_null() || (0.0..=1.0).contains(&blame.as_f64().unwrap()),
            "{b}"
        );
    }
    let share = tails[0] as f64 / total as f64;
    let away = backends[0]["redirected_away"].as_u64().unwrap();
    eprintln!(
        "policy {policy:?}: tail requests per backend {tails:?}, replica 0's share {share:.3}, {away} reads redirected away from it"
    );
    (share, away)
}

#[test]
fn tail_blame_falls_on_a_stalled_primary_and_leaves_it_when_steering() {
    let tb = testbed("selb");
    let (observed, unsteered_away) = stalled_primary_tail_share(&tb, &["--policy", "observe"]);
    let (steered, steered_away) =
        stalled_primary_tail_share(&tb, &["--policy", "threshold", "--threshold", "1"]);
    assert_eq!(unsteered_away, 0);
    assert!(steered_away > 0, "the stalls must be steered around");
    // Measured on a busy 2-core machine (five runs): 0.85 to 1.0 unsteered,
    // 0.29 to 0.44 steered (about a third: the tail spreads over the group; the
    // primary keeps the few reads sent before each redirect); under a full
    // CI run beside another test once 0.65 against 0.90. The margins leave
    // room for that noise; without steering the shares are equal.
    assert!(
        observed > 0.75,
        "unsteered, the stalled primary must hold most of the tail: {observed:.3}"
    );
    assert!(
        steered < observed - 0.15,
        "steering must move the tail off the stalled primary: {steered:.3} vs {observed:.3}"
    );
}

/// The value of the sample `name` (no labels) in an exposition.
fn sample(exposition: &str, name: &str) -> f64 {
    exposition
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no {name} in\n{exposition}"))
        .parse()
        .unwrap()
}

/// A reload's outcome, like Prometheus' own: in `selector status --json`
/// (`config_reload_success`, `config_reload_timestamp_seconds`), in the
/// metrics of the same names, and in `/readyz`. The start counts as a
/// successful load; a good reload moves the time on; a refused one sets
/// success to 0, keeps the time, and makes the agent unready (still live)
/// until a good one applies.
#[test]
fn reload_outcomes_show_in_status_metrics_and_readiness() {
    let tb = Testbed::new("selmr", 3).unwrap();
    let dir = std::env::temp_dir().join(format!(
        "selector-metrics-reload-{}",
        selector_testbed::netns::unique_tag()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("selector.toml");
    let members: Vec<String> = tb
        .replica_endpoints()
        .iter()
        .map(|m| format!("\"{m}\""))
        .collect();
    let config = |threshold: u32| {
        format!(
            "iface = \"{CLIENT_IFACE}\"\nquiet = true\nmetrics-addr = \"{METRICS_ADDR}\"\n\
             threshold = {threshold}\n[[group]]\nmembers = [{}]\n",
            members.join(", ")
        )
    };
    std::fs::write(&path, config(2)).unwrap();
    let before_start = unix_now();
    let agent = agent::spawn_agent(&tb.client, &["--config", path.to_str().unwrap()]);
    let reload = || agent::run_selector(&tb.client, &["reload", "--iface", CLIENT_IFACE]);
    // (success, timestamp) from the JSON status and from the metrics, which
    // must agree once the status a scrape reuses (200 ms) is renewed.
    let outcome = || {
        let status = status_json(&tb);
        let success = status["config_reload_success"].as_bool().unwrap();
        let at = status["config_reload_timestamp_seconds"].as_f64().unwrap();
        let mut last = String::new();
        let agree = wait_for(Duration::from_secs(2), || {
            last = get(&tb, "/metrics", None).body;
            sample(&last, "selector_config_reload_success") == f64::from(u8::from(success))
                && (sample(&last, "selector_config_reload_timestamp_seconds") - at).abs() < 1e-3
        });
        assert!(
            agree,
            "the metrics never agreed with {success} at {at}:\n{last}"
        );
        (success, at)
    };

    let (success, started) = outcome();
    assert!(success);
    assert!(
        started >= before_start - 1.0 && started <= unix_now(),
        "{started} vs {before_start}"
    );
    assert_eq!(get(&tb, "/readyz", None).status, 200);

    // The clock moves past the start, so a reload can be told from it.
    assert!(wait_for(Duration::from_secs(1), || unix_now() > started));
    std::fs::write(&path, config(3)).unwrap();
    let (code, out) = reload();
    assert_eq!(code, 0, "{out}");
    let (success, reloaded) = outcome();
    assert!(success && reloaded > started, "{reloaded} vs {started}");
    assert_eq!(status_json(&tb)["settings"]["threshold"], 3);

    std::fs::write(&path, config(0)).unwrap();
    let (code, out) = reload();
    assert_eq!(code, 1, "{out}");
    let (success, kept) = outcome();
    assert!(!success);
    assert_eq!(
        kept, reloaded,
        "a refused reload keeps the last success time"
    );
    let ready = get(&tb, "/readyz", None);
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert!(
        ready
            .body
            .starts_with("not ready: configuration not applied: the last reload was refused (")
            && ready.body.contains("threshold: must be at least 1"),
        "{}",
        ready.body
    );
    assert_eq!(get(&tb, "/healthz", None).status, 200, "unready, not dead");

    std::fs::write(&path, config(4)).unwrap();
    let (code, out) = reload();
    assert_eq!(code, 0, "{out}");
    let (success, again) = outcome();
    assert!(success && again > reloaded, "{again} vs {reloaded}");
    assert_eq!(get(&tb, "/readyz", None).status, 200);

    stop_agent(agent);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// `GET path` until its status is `status` (the agent checks its
/// attachment every second), or panics after 5 s with the last answer.
fn wait_for_status(tb: &Testbed, path: &'static str, status: u16) -> HttpResponse {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let response = get(tb, path, None);
        if response.status == status {
            return response;
        }
        assert!(
            Instant::now() < deadline,
            "{path} never answered {status}: {} {}",
            response.status,
            response.body
        );
        thread::sleep(Duration::from_millis(100));
    }
}

/// Links taken from under a running agent (as a forced `selector detach`
/// would, or the interface's deletion) leave it running but steering
/// nothing: `/readyz` names both paths within a few seconds, `/healthz`
/// stays 200. With the reply path on TC ingress and on XDP.
#[test]
fn readyz_fails_when_the_programs_are_detached_under_the_agent() {
    let tb = Testbed::new("selmd", 3).unwrap();
    for ingress in ["tc", "xdp"] {
        let agent = spawn_agent(&tb, &["--metrics-addr", METRICS_ADDR, "--ingress", ingress]);
        wait_for_status(&tb, "/readyz", 200);
        let detached = tb
            .client
            .run(|| selector_user::datapath::detach::detach_attached(CLIENT_IFACE))
            .unwrap()
            .unwrap();
        assert_eq!(detached.len(), 2, "{detached:?}");
        let ready = wait_for_status(&tb, "/readyz", 503);
        assert_eq!(
            ready.body,
            format!(
                "not ready: the request path (TC egress) is not attached to {CLIENT_IFACE}; \
                 the reply path ({ingress} ingress) is not attached to {CLIENT_IFACE}\n"
            )
        );
        assert_eq!(get(&tb, "/healthz", None).status, 200);
        stop_agent(agent);
    }
}

/// Thousands of idle connections to both endpoints, past the agent's
/// descriptor limit, and a scrape whose reader never reads: the agent keeps
/// sweeping (its heartbeat stays fresh), `selector status` and `set` are
/// answered, and scrapes are served, while they are all still open.
#[test]
fn endpoints_keep_working_under_idle_connections_and_a_slow_reader() {
    use std::os::unix::net::UnixStream;
    const IDLE: usize = 1500;
    let tb = testbed("selab");
    // The test holds 3000 and more descriptors.
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    limit.rlim_cur = limit.rlim_max;
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    assert!(
        limit.rlim_cur as usize > 2 * IDLE + 100,
        "{}",
        limit.rlim_cur
    );

    // The agent with fewer descriptors than the connections (as a unit's
    // LimitNOFILE would give it).
    let group = group(&tb);
    let mut child = tb
        .client
        .command("prlimit")
        .args([
            "--nofile=512:512",
            agent::selector_binary().to_str().unwrap(),
        ])
        .args(["run", "--iface", CLIENT_IFACE, "--group", &group, "--quiet"])
        .args(["--metrics-addr", METRICS_ADDR, "--interval", "100"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("selector: attached to"), "{first}");

    let inode = std::os::unix::fs::MetadataExt::ino(
        &std::fs::metadata(format!("/run/netns/{}", tb.client.name)).unwrap(),
    );
    let socket = format!("/run/selector/net-{inode}/{CLIENT_IFACE}.sock");
    let metrics: SocketAddr = METRICS_ADDR.parse().unwrap();
    let (idle_tcp, slow) = tb
        .client
        .run(move || {
            let idle: Vec<std::net::TcpStream> = (0..IDLE)
                .filter_map(|_| std::net::TcpStream::connect(metrics).ok())
                .collect();
            // A scrape whose reader never reads.
            let mut slow = std::net::TcpStream::connect(metrics).unwrap();
            std::io::Write::write_all(&mut slow, b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
            (idle, slow)
        })
        .unwrap();
    let idle_unix: Vec<UnixStream> = (0..IDLE)
        .filter_map(|_| UnixStream::connect(&socket).ok())
        .collect();
    println!(
        "held {} idle TCP and {} idle control connections, one slow reader",
        idle_tcp.len(),
        idle_unix.len()
    );
    assert!(
        idle_tcp.len() + idle_unix.len() > 512,
        "past the agent's descriptors"
    );

    // While they are all open: control, scrapes and sweeps go on.
    assert!(
        wait_for(Duration::from_secs(10), || {
            agent::run_selector(&tb.client, &["status", "--iface", CLIENT_IFACE, "--json"]).0 == 0
        }),
        "no status while flooded"
    );
    assert!(
        wait_for(Duration::from_secs(10), || {
            agent::run_selector(
                &tb.client,
                &["set", "--iface", CLIENT_IFACE, "--threshold", "3"],
            )
            .0 == 0
        }),
        "no set while flooded"
    );
    assert!(
        wait_for(Duration::from_secs(10), || {
            tb.client
                .run(move || http_get(metrics, "/metrics", None))
                .unwrap()
                .is_ok_and(|r| r.status == 200 && r.body.contains("selector_requests_total"))
        }),
        "no scrape while flooded"
    );
    let status = status_json(&tb);
    assert_eq!(status["settings"]["threshold"], 3, "{status}");
    assert_eq!(
        status["heartbeat"]["fresh"], true,
        "the agent sweeps: {status}"
    );
    drop((idle_tcp, idle_unix, slow));
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}
