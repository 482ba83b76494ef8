//! The shipped systemd unit: it verifies, and the agent works with exactly
//! the capabilities it grants and the user it names (under setpriv),
//! pinning, leaving its programs pinned at exit, adopting them when
//! restarted, and detaching them, while
//! any one capability missing is named in one line with nothing attached;
//! it is `Type=notify` with a watchdog, and the agent speaks that protocol.
//! The DaemonSet agrees with the unit, its config and the agent's probes,
//! and its memory holds the maps its `--inflight-max` makes (a formula
//! checked against what the agent really creates).

use std::{
    os::unix::net::UnixDatagram,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use selector_testbed::{
    Namespace, Testbed,
    agent::{Attached, attached, selector_binary, totals_rows},
    bpffs::Bpffs,
    foreign::{FOREIGN_NAME, ForeignTcx, tcx_program_names},
    netns::unique_tag,
    prometheus::http_get,
    topology::CLIENT_IFACE,
};

const UNIT: &str = include_str!("../../deploy/selector.service");
/// The agent's metrics endpoint, on the client namespace's loopback.
const METRICS_ADDR: &str = "127.0.0.1:9464";
const GROUP: &str = "10.77.0.10:11211,10.77.0.11:11211,10.77.0.12:11211";

/// A `[Service]` setting of the unit, split on spaces.
fn unit_setting(key: &str) -> Option<Vec<String>> {
    let prefix = format!("{key}=");
    let line = UNIT.lines().find_map(|l| l.strip_prefix(&prefix))?;
    Some(line.split_whitespace().map(str::to_owned).collect())
}

/// The uid the unit runs the agent as (root's when it names no `User=`).
fn unit_uid() -> String {
    match unit_setting("User") {
        None => "0".into(),
        Some(user) => {
            let out = Command::new("id").args(["-u", &user[0]]).output().unwrap();
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        }
    }
}

/// The unit's capabilities as setpriv names them (`CAP_BPF` -> `bpf`).
fn unit_capabilities() -> Vec<String> {
    let bounding = unit_setting("CapabilityBoundingSet").expect("a capability bound");
    assert_eq!(
        Some(&bounding),
        unit_setting("AmbientCapabilities").as_ref()
    );
    bounding
        .iter()
        .map(|c| c.strip_prefix("CAP_").unwrap().to_lowercase())
        .collect()
}

/// A copy of the agent binary that an unprivileged user can run (the
/// checkout may sit in a directory only root can enter).
struct PublicBinary {
    dir: PathBuf,
}

impl PublicBinary {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("selector-deploy-{}", unique_tag()));
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        std::fs::copy(selector_binary(), dir.join("selector")).unwrap();
        Self { dir }
    }

    fn path(&self) -> PathBuf {
        self.dir.join("selector")
    }
}

impl Drop for PublicBinary {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `selector ARGS` in `ns` as the unit's user with only `caps` (setpriv
/// names).
fn as_the_unit(ns: &Namespace, binary: &Path, caps: &[String], args: &[&str]) -> Command {
    let uid = unit_uid();
    let set = std::iter::once("-all".to_owned())
        .chain(caps.iter().map(|c| format!("+{c}")))
        .collect::<Vec<_>>()
        .join(",");
    let mut c = ns.command("setpriv");
    c.args([
        &format!("--reuid={uid}"),
        &format!("--regid={uid}"),
        "--clear-groups",
        &format!("--inh-caps={set}"),
        &format!("--ambient-caps={set}"),
        &format!("--bounding-set={set}"),
        "--",
    ]);
    c.arg(binary).args(args);
    c
}

/// `selector run` on the testbed's group, pinning under `pin`.
fn pinned_run(pin: &str) -> [&str; 10] {
    [
        "run",
        "--iface",
        CLIENT_IFACE,
        "--group",
        GROUP,
        "--threshold",
        "1",
        "--quiet",
        "--pin",
        pin,
    ]
}

/// `selector run ARGS` as the unit would start it: the agent, the rest of
/// its output, and its first line (the start line), or a panic with what
/// it said on stderr when it printed none.
fn start_as_the_unit(
    ns: &Namespace,
    binary: &Path,
    caps: &[String],
    args: &[&str],
) -> (
    std::process::Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
    String,
) {
    let mut agent = as_the_unit(ns, binary, caps, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(agent.stdout.take().unwrap()));
    let first = lines.next().map(Result::unwrap).unwrap_or_else(|| {
        let mut stderr = String::new();
        std::io::Read::read_to_string(&mut agent.stderr.take().unwrap(), &mut stderr).unwrap();
        panic!("the agent did not start: {stderr}")
    });
    (agent, lines, first)
}

#[test]
fn the_unit_file_verifies() {
    let binary = PublicBinary::new();
    let unit = binary.dir.join("selector.service");
    std::fs::write(
        &unit,
        UNIT.replace("/usr/local/bin/selector", binary.path().to_str().unwrap()),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", unit.to_str().unwrap()])
        .output()
        .expect("systemd-analyze (Debian's systemd package)");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.trim().is_empty(), "{text}");
    // With the hedging drop-in's lines, merged as systemd merges them
    // (`verify` of a bare file reads no drop-in directory).
    let mut merged = std::fs::read_to_string(&unit).unwrap();
    merged.push('\n');
    merged.push_str(HEDGING_DROP_IN);
    std::fs::write(&unit, merged).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", unit.to_str().unwrap()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.trim().is_empty(), "{text}");
}

/// `systemd-analyze security` rates the unit's exposure 2.5 (4.9 before
/// `PrivateDevices=`, `ProtectKernelTunables=`, `SystemCallFilter=` and
/// the rest): a change that loosens it fails here.
#[test]
fn the_units_exposure_stays_low() {
    let dir = std::env::temp_dir().join(format!("selector-security-{}", unique_tag()));
    std::fs::create_dir(&dir).unwrap();
    let unit = dir.join("selector.service");
    std::fs::write(&unit, UNIT).unwrap();
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", unit.to_str().unwrap()])
        .output()
        .expect("systemd-analyze 252 or later");
    let _ = std::fs::remove_dir_all(&dir);
    let text = text_of(&out);
    let exposure: f64 = text
        .lines()
        .find_map(|l| {
            l.split("Overall exposure level for selector.service:")
                .nth(1)
        })
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no exposure level: {text}"));
    assert!(exposure <= 2.5, "exposure {exposure}:\n{text}");
}

#[test]
fn the_agent_steers_pins_and_detaches_with_only_the_units_capabilities() {
    let mut tb = Testbed::new("seldp", 3).unwrap();
    tb.start_memcached().unwrap();
    let binary = PublicBinary::new();
    let caps = unit_capabilities();
    let bpffs = Bpffs::mount();
    let pin = bpffs.arg();
    let run = pinned_run(&pin);
    let (mut agent, _lines, first) = start_as_the_unit(&tb.client, &binary.path(), &caps, &run);
    assert!(first.starts_with("selector: attached to"), "{first}");
    assert_eq!(
        attached(&tb.client, CLIENT_IFACE),
        Attached {
            tcx_egress: 1,
            tcx_ingress: 1,
            xdp: false
        },
        "`--ingress auto` on a veth: TC"
    );

    let report = selector_testbed::pods::load_with_stall(&tb, 100);
    assert_eq!(report.lost(), 0, "every reply arrives");

    // The operator's status command (full root) talks to the agent.
    let out = tb
        .client
        .command(selector_binary().to_str().unwrap())
        .args(["status", "--iface", CLIENT_IFACE])
        .output()
        .unwrap();
    let rows = totals_rows(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(rows.len(), 3, "{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(rows.iter().map(|r| r.requests).sum::<u64>(), report.sent);
    assert!(rows[0].away > 0, "the stall moved reads: {rows:?}");

    // Pinned: a stop (or a restart) leaves the programs steering.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    assert_eq!(attached(&tb.client, CLIENT_IFACE).tcx_egress, 1);

    // A restart (an upgrade) adopts the pins with the same capabilities.
    let (mut agent, _lines, first) = start_as_the_unit(&tb.client, &binary.path(), &caps, &run);
    assert!(
        first.starts_with("selector: attached to") && first.contains("adopted the pins"),
        "{first}"
    );
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    assert_eq!(attached(&tb.client, CLIENT_IFACE).tcx_egress, 1);
    let out = as_the_unit(
        &tb.client,
        &binary.path(),
        &caps,
        &["detach", "--iface", CLIENT_IFACE, "--pin", &pin],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(attached(&tb.client, CLIENT_IFACE), Attached::NOTHING);
}

/// Another component's TCX programs on the interface (a CNI's on 6.6+, an
/// observability agent's): the agent, with only the unit's capabilities,
/// cannot name them (that takes CAP_SYS_ADMIN), yet it attaches by TCX
/// (as the shipped `pin` needs), steers, and stops and detaches without
/// touching them.
#[test]
fn beside_another_components_tcx_programs_the_unit_attaches_by_tcx_and_leaves_them() {
    let mut tb = Testbed::new("seldf", 3).unwrap();
    tb.start_memcached().unwrap();
    selector_testbed::preload(&tb.client, &tb.replica_endpoints(), 100).unwrap();
    let foreign = ForeignTcx::attach(&tb.client, CLIENT_IFACE).unwrap();
    let binary = PublicBinary::new();
    let caps = unit_capabilities();
    let bpffs = Bpffs::mount();
    let pin = bpffs.arg();
    let run = pinned_run(&pin);
    let (mut agent, _lines, first) = start_as_the_unit(&tb.client, &binary.path(), &caps, &run);
    assert!(
        first.starts_with("selector: attached to") && first.contains("tc by tcx"),
        "{first}"
    );
    let mut names = tcx_program_names(&tb.client, CLIENT_IFACE);
    names.sort();
    assert_eq!(
        names,
        [
            FOREIGN_NAME,
            FOREIGN_NAME,
            "selector_egress",
            "selector_ingres"
        ],
        "both components in both chains"
    );

    let report = selector_testbed::pods::load_with_stall(&tb, 100);
    assert_eq!(report.lost(), 0, "every reply arrives");
    assert_eq!(report.wrong_values, 0);
    let status: selector_user::api::Status =
        selector_testbed::agent::status_json(&tb.client, CLIENT_IFACE);
    assert!(
        status.backends[0].stats.redirected_away > 0,
        "the stall moved reads"
    );

    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    let out = as_the_unit(
        &tb.client,
        &binary.path(),
        &caps,
        &["detach", "--iface", CLIENT_IFACE, "--pin", &pin],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        tcx_program_names(&tb.client, CLIENT_IFACE),
        [FOREIGN_NAME, FOREIGN_NAME],
        "the other component's programs stay"
    );
    drop(foreign);
}

/// The next notification on `socket` other than `WATCHDOG=1`, and how
/// many `WATCHDOG=1` came before it.
fn next_notification(socket: &UnixDatagram) -> (String, usize) {
    let mut pings = 0;
    loop {
        let mut buf = [0u8; 1024];
        let n = socket
            .recv(&mut buf)
            .expect("a notification within the read timeout");
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        if text == "WATCHDOG=1" {
            pings += 1;
        } else {
            return (text, pings);
        }
    }
}

/// `Type=notify` with `WatchdogSec=`: the agent (with the unit's
/// capabilities) says READY=1 once attached, with a STATUS= line; sends
/// WATCHDOG=1 from its loop every half `WATCHDOG_USEC` (small here, to see
/// several); RELOADING=1 then READY=1 around a SIGHUP reload; STOPPING=1
/// on SIGTERM. Without a watchdog asked for, it sends none.
#[test]
fn the_agent_speaks_the_units_notify_protocol() {
    assert_eq!(unit_setting("Type"), Some(vec!["notify".to_string()]));
    let watchdog = unit_setting("WatchdogSec").expect("WatchdogSec=");
    assert!(
        watchdog[0].parse::<u64>().is_ok_and(|s| s > 0),
        "{watchdog:?}"
    );

    let tb = Testbed::new("seldn", 3).unwrap();
    let binary = PublicBinary::new();
    let notify = binary.dir.join("notify");
    let socket = UnixDatagram::bind(&notify).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let start = |watchdog_usec: Option<&str>| {
        let mut command = as_the_unit(
            &tb.client,
            &binary.path(),
            &unit_capabilities(),
            &[
                "run",
                "--iface",
                CLIENT_IFACE,
                "--group",
                GROUP,
                "--quiet",
                "--metrics-addr",
                METRICS_ADDR,
            ],
        );
        command
            .env("NOTIFY_SOCKET", &notify)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        match watchdog_usec {
            Some(usec) => command.env("WATCHDOG_USEC", usec),
            None => command.env_remove("WATCHDOG_USEC"),
        };
        selector_testbed::agent::AgentProcess(command.spawn().unwrap())
    };

    let mut agent = start(Some("200000"));
    let (ready, _) = next_notification(&socket);
    // Sent after attaching: the programs are there when it arrives.
    assert_eq!(attached(&tb.client, CLIENT_IFACE).tcx_egress, 1);
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(agent.stdout.take().unwrap()));
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("selector: attached to"), "{first}");
    assert!(
        ready.starts_with(&format!(
            "READY=1\nSTATUS=steering {CLIENT_IFACE}: 3 backends in 1 group, policy threshold"
        )),
        "{ready:?}"
    );
    assert_eq!(ready.lines().count(), 2, "{ready:?}");

    // Every 100 ms: about 15 in 1.5 s (past the agent's first attachment
    // check, at 1 s); at least 7 on a busy machine.
    let until = Instant::now() + Duration::from_millis(1500);
    let mut pings = 0;
    while Instant::now() < until {
        let mut buf = [0u8; 64];
        let n = socket.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"WATCHDOG=1");
        pings += 1;
    }
    assert!(pings >= 7, "{pings} WATCHDOG=1 in 1.5 s");
    // Past its first attachment check (every second), ready, with no more
    // than the unit's capabilities.
    let metrics: std::net::SocketAddr = METRICS_ADDR.parse().unwrap();
    let ready = tb
        .client
        .run(move || http_get(metrics, "/readyz", None))
        .unwrap()
        .unwrap();
    assert_eq!(ready.status, 200, "{}", ready.body);

    // SIGHUP: the agent was started without a config file, so the reload
    // is refused, and systemd still hears it begin and end.
    unsafe { libc::kill(agent.id() as i32, libc::SIGHUP) };
    let (reloading, _) = next_notification(&socket);
    assert!(
        reloading.starts_with("RELOADING=1\nMONOTONIC_USEC="),
        "{reloading:?}"
    );
    let (ready, _) = next_notification(&socket);
    assert!(ready.starts_with("READY=1\nSTATUS=steering"), "{ready:?}");

    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let (stopping, _) = next_notification(&socket);
    assert!(
        stopping.starts_with("STOPPING=1\nSTATUS=stopping"),
        "{stopping:?}"
    );
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut agent.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(agent.wait().unwrap().success());
    assert_eq!(stderr, "", "a clean run under the unit warns of nothing");

    // No WATCHDOG_USEC: READY=1 and STOPPING=1, and no ping between.
    let mut agent = start(None);
    let (ready, _) = next_notification(&socket);
    assert!(ready.starts_with("READY=1\n"), "{ready:?}");
    std::thread::sleep(Duration::from_millis(500));
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let (stopping, pings) = next_notification(&socket);
    assert!(stopping.starts_with("STOPPING=1\n"), "{stopping:?}");
    assert_eq!(pings, 0);
    assert!(agent.wait().unwrap().success());
}

#[test]
fn each_missing_capability_is_named_in_one_line() {
    let tb = Testbed::new("seldq", 3).unwrap();
    let binary = PublicBinary::new();
    let caps = unit_capabilities();
    for missing in &caps {
        let fewer: Vec<String> = caps.iter().filter(|c| *c != missing).cloned().collect();
        let out = as_the_unit(
            &tb.client,
            &binary.path(),
            &fewer,
            &["run", "--iface", CLIENT_IFACE, "--group", GROUP],
        )
        .output()
        .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let wanted = format!("missing capability CAP_{}", missing.to_uppercase());
        assert!(stderr.contains(&wanted), "{stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert_eq!(attached(&tb.client, CLIENT_IFACE), Attached::NOTHING);
    }
}

const MANIFEST: &str = include_str!("../../deploy/kubernetes/selector.yaml");

/// The manifest's documents by kind.
fn manifest(kind: &str) -> yaml_rust2::Yaml {
    yaml_rust2::YamlLoader::load_from_str(MANIFEST)
        .expect("the manifest is YAML")
        .into_iter()
        .find(|d| d["kind"].as_str() == Some(kind))
        .unwrap_or_else(|| panic!("no {kind} in the manifest"))
}

fn strings(list: &yaml_rust2::Yaml) -> Vec<String> {
    list.as_vec()
        .map(|v| {
            v.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The DaemonSet cannot run here; what can be checked is that its parts
/// agree with each other and with the unit: the ConfigMap is a config the
/// agent accepts, the container gets the unit's capabilities and nothing
/// else on the host network, it reads the ConfigMap where `--config` says,
/// the scrape annotations name the metrics port, the liveness and
/// readiness probes ask that port for the agent's `/healthz` and `/readyz`,
/// and the pins land on the host's bpffs.
#[test]
fn the_daemonset_agrees_with_the_unit_and_its_config() {
    use selector_user::config::file::{ConfigFile, Options};
    let config_map = manifest("ConfigMap");
    let text = config_map["data"]["selector.toml"].as_str().unwrap();
    let config = ConfigFile::parse(Path::new("selector.toml"), text.to_owned())
        .and_then(|f| f.resolve_with(&Options::default()))
        .expect("the ConfigMap's config is valid");

    let daemonset = manifest("DaemonSet");
    let pod = &daemonset["spec"]["template"];
    let spec = &pod["spec"];
    assert_eq!(spec["hostNetwork"].as_bool(), Some(true));
    let container = &spec["containers"][0];
    let security = &container["securityContext"];
    let mut added = strings(&security["capabilities"]["add"]);
    let mut unit: Vec<String> = unit_capabilities()
        .iter()
        .map(|c| c.to_uppercase())
        .collect();
    added.sort();
    unit.sort();
    assert_eq!(added, unit, "the unit's capabilities");
    assert_eq!(strings(&security["capabilities"]["drop"]), vec!["ALL"]);
    assert_eq!(security["allowPrivilegeEscalation"].as_bool(), Some(false));

    let args = strings(&container["args"]);
    let config_path = &args[args.iter().position(|a| a == "--config").unwrap() + 1];
    let mount_of = |volume: &str| {
        container["volumeMounts"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|m| m["name"].as_str() == Some(volume))
            .and_then(|m| m["mountPath"].as_str())
            .unwrap_or_else(|| panic!("no mount of {volume}"))
            .to_owned()
    };
    assert_eq!(
        Path::new(config_path).parent().unwrap(),
        Path::new(&mount_of("config"))
    );
    let port = config
        .metrics_addr
        .expect("metrics-addr")
        .port()
        .to_string();
    assert_eq!(
        pod["metadata"]["annotations"]["prometheus.io/port"].as_str(),
        Some(port.as_str())
    );
    assert_eq!(
        container["ports"][0]["containerPort"]
            .as_i64()
            .map(|p| p.to_string()),
        Some(port)
    );
    // The probes ask the metrics port for the agent's own health paths.
    for (probe, path) in [
        (
            "livenessProbe",
            selector_user::agent::metrics::LIVENESS_PATH,
        ),
        (
            "readinessProbe",
            selector_user::agent::metrics::READINESS_PATH,
        ),
    ] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"].as_str(), Some(path), "{probe}");
        assert_eq!(
            get["port"].as_str(),
            container["ports"][0]["name"].as_str(),
            "{probe}"
        );
    }
    // The pin directory is the mount of the selector's own directory of
    // the host's bpffs, and the pod sees nothing else of that bpffs.
    let bpffs = mount_of("bpffs");
    assert_eq!(config.pin.expect("pin"), Path::new(&bpffs));
    assert!(!bpffs.starts_with("/sys/"), "no mount point under sysfs");
    let host_bpffs = &spec["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|v| v["name"].as_str() == Some("bpffs"))
        .expect("a bpffs volume")["hostPath"];
    assert_eq!(host_bpffs["path"].as_str(), Some("/sys/fs/bpf/selector"));
    assert_eq!(host_bpffs["type"].as_str(), Some("DirectoryOrCreate"));
    assert_least_privilege(spec);
}

/// What every pod of the manifests asks for beyond its capabilities: no
/// service account token (nothing talks to the API server), the runtime's
/// default seccomp profile, no privilege escalation, a read-only root.
fn assert_least_privilege(spec: &yaml_rust2::Yaml) {
    assert_eq!(
        spec["automountServiceAccountToken"].as_bool(),
        Some(false),
        "{spec:?}"
    );
    assert_eq!(
        spec["securityContext"]["seccompProfile"]["type"].as_str(),
        Some("RuntimeDefault"),
        "{spec:?}"
    );
    let containers = spec["containers"].as_vec().unwrap().iter();
    for c in containers.chain(spec["initContainers"].as_vec().into_iter().flatten()) {
        let security = &c["securityContext"];
        assert_eq!(security["allowPrivilegeEscalation"].as_bool(), Some(false));
        assert_eq!(security["readOnlyRootFilesystem"].as_bool(), Some(true));
        assert_eq!(strings(&security["capabilities"]["drop"]), vec!["ALL"]);
        // A container-level profile would override the pod's.
        assert!(security["seccompProfile"].is_badvalue(), "{c:?}");
    }
}

/// Host network and added capabilities are refused by the `baseline` and
/// `restricted` Pod Security levels: the namespace the DaemonSet runs in
/// must enforce `privileged`, or its pods are never admitted.
#[test]
fn the_daemonsets_namespace_admits_its_privileges() {
    let namespace = manifest("Namespace");
    let name = namespace["metadata"]["name"].as_str().expect("a name");
    for kind in ["DaemonSet", "ConfigMap"] {
        assert_eq!(
            manifest(kind)["metadata"]["namespace"].as_str(),
            Some(name),
            "the {kind} is in the labelled namespace"
        );
    }
    let labels = &namespace["metadata"]["labels"];
    assert_eq!(
        labels["pod-security.kubernetes.io/enforce"].as_str(),
        Some("privileged"),
        "{labels:?}"
    );
    // What needs it: the pod asks for what `baseline` refuses.
    let spec = &manifest("DaemonSet")["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"].as_bool(), Some(true));
    let added = strings(&spec["containers"][0]["securityContext"]["capabilities"]["add"]);
    assert!(added.iter().any(|c| c == "BPF"), "{added:?}");
}

/// The sizing formula of the DaemonSet's memory (its YAML comment and
/// deploy/kubernetes/README.md say the same): what the agent's BPF maps and
/// the agent itself take, charged to the pod's memory cgroup.
mod sizing {
    use selector_common::inflight::{InflightSlot, mark_words, slots_for};

    /// The CPUs the manifest is sized for (possible CPUs of a node).
    pub const SIZED_FOR_CPUS: u64 = 128;
    /// Every map but the in-flight table and the per-CPU ones (2.3 MiB
    /// measured: the hedge ring buffers, FRAGMENTS, CLIENT_PENDING, ...).
    pub const OTHER_MAPS: u64 = 4 << 20;
    /// The per-CPU maps, per possible CPU (456 KiB measured, LATENCY most).
    pub const PER_CPU_MAPS: u64 = 512 << 10;
    /// The agent process: heap, binary, the verifier's memory at load.
    pub const AGENT: u64 = 64 << 20;

    /// `INFLIGHT` and `INFLIGHT_MARKS` for `inflight_max`.
    pub fn inflight_table(inflight_max: u32) -> u64 {
        let slots = slots_for(inflight_max);
        u64::from(slots) * size_of::<InflightSlot>() as u64 + u64::from(mark_words(slots)) * 8
    }

    /// Every map, on a node with `cpus` possible CPUs.
    pub fn maps(inflight_max: u32, cpus: u64) -> u64 {
        inflight_table(inflight_max) + OTHER_MAPS + cpus * PER_CPU_MAPS
    }

    /// The memory the pod needs.
    pub fn memory(inflight_max: u32, cpus: u64) -> u64 {
        maps(inflight_max, cpus) + AGENT
    }

    /// A Kubernetes quantity in bytes (or in millicores, with `cpu`).
    pub fn quantity(text: &str, cpu: bool) -> Option<u64> {
        let (number, unit): (String, String) = text.chars().partition(char::is_ascii_digit);
        let number: u64 = number.parse().ok()?;
        let scale = match (unit.as_str(), cpu) {
            ("m", true) => 1,
            ("", true) => 1000,
            ("", false) => 1,
            ("Ki", false) => 1 << 10,
            ("Mi", false) => 1 << 20,
            ("Gi", false) => 1 << 30,
            ("k", false) => 1000,
            ("M", false) => 1_000_000,
            ("G", false) => 1_000_000_000,
            _ => return None,
        };
        text.starts_with(|c: char| c.is_ascii_digit())
            .then_some(number * scale)
    }

    /// Possible CPUs (`0-3,8-11`), as the kernel sizes per-CPU maps.
    pub fn possible_cpus() -> u64 {
        let text = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap();
        text.trim()
            .split(',')
            .map(|range| match range.split_once('-') {
                Some((a, b)) => b.parse::<u64>().unwrap() - a.parse::<u64>().unwrap() + 1,
                None => 1,
            })
            .sum()
    }
}

/// `--inflight-max` of the DaemonSet's agent: its args, else its
/// ConfigMap, else the default.
fn manifest_inflight_max() -> u32 {
    use selector_user::config::file::{ConfigFile, Options};
    let container = &manifest("DaemonSet")["spec"]["template"]["spec"]["containers"][0];
    let args = strings(&container["args"]);
    if let Some(i) = args.iter().position(|a| a == "--inflight-max") {
        return args[i + 1].parse().expect("--inflight-max N");
    }
    let text = manifest("ConfigMap")["data"]["selector.toml"]
        .as_str()
        .unwrap()
        .to_owned();
    ConfigFile::parse(Path::new("selector.toml"), text)
        .and_then(|f| f.resolve_with(&Options::default()))
        .expect("the ConfigMap's config is valid")
        .settings
        .inflight_max
}

/// The container's resources: memory requested and limited, each at least
/// what the formula gives for its `--inflight-max` on nodes of up to
/// `SIZED_FOR_CPUS` CPUs; CPU requested and limited, the limit no lower.
#[test]
fn the_daemonsets_resources_hold_its_maps() {
    use sizing::{SIZED_FOR_CPUS, memory, quantity};
    let inflight_max = manifest_inflight_max();
    let needed = memory(inflight_max, SIZED_FOR_CPUS);
    let resources =
        &manifest("DaemonSet")["spec"]["template"]["spec"]["containers"][0]["resources"];
    assert!(!resources.is_badvalue(), "the container has no resources");
    for side in ["requests", "limits"] {
        let memory = resources[side]["memory"]
            .as_str()
            .unwrap_or_else(|| panic!("no {side}.memory"));
        let bytes = quantity(memory, false).unwrap_or_else(|| panic!("{side}.memory {memory}"));
        assert!(
            bytes >= needed,
            "{side}.memory {memory} is less than the {} MiB the maps and the agent take \
             with --inflight-max {inflight_max} on {SIZED_FOR_CPUS} CPUs",
            needed.div_ceil(1 << 20)
        );
    }
    let cpu = |side: &str| {
        let value = &resources[side]["cpu"];
        let text = value
            .as_str()
            .map(str::to_owned)
            .or_else(|| value.as_i64().map(|n| n.to_string()))
            .unwrap_or_else(|| panic!("no {side}.cpu"));
        quantity(&text, true).unwrap_or_else(|| panic!("{side}.cpu {text}"))
    };
    assert!(cpu("requests") > 0);
    assert!(cpu("limits") >= cpu("requests"));
    // The comment gives the same sizing.
    assert!(
        MANIFEST.contains(&format!("on nodes of up to {SIZED_FOR_CPUS} CPUs")),
        "the manifest's comment names the CPUs it is sized for"
    );
}

/// The formula holds what the agent really creates: started with the
/// manifest's `--inflight-max` (and four times it), the memory of its maps
/// (their `memlock` in /proc/PID/fdinfo) is at least the in-flight table
/// and at most the formula's maps for this machine's possible CPUs; with
/// its own anonymous memory, within the formula's total.
#[test]
fn the_sizing_formula_holds_the_agents_maps() {
    use sizing::{inflight_table, maps, memory, possible_cpus};
    let tb = Testbed::new("seldz", 1).unwrap();
    let cpus = possible_cpus();
    let base = manifest_inflight_max();
    for inflight_max in [base, base * 4] {
        let n = inflight_max.to_string();
        let (agent, _lines) = selector_testbed::agent::spawn_agent(
            &tb.client,
            &[
                "--iface",
                CLIENT_IFACE,
                "--group",
                &tb.group_arg(),
                "--inflight-max",
                &n,
                "--quiet",
            ],
        );
        let pid = agent.id();
        let mut map_bytes = 0u64;
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
            let fd = fd.unwrap();
            let is_map = std::fs::read_link(fd.path())
                .is_ok_and(|target| target.to_str() == Some("anon_inode:bpf-map"));
            if !is_map {
                continue;
            }
            let info = std::fs::read_to_string(format!(
                "/proc/{pid}/fdinfo/{}",
                fd.file_name().to_str().unwrap()
            ))
            .unwrap();
            map_bytes += info
                .lines()
                .find_map(|l| l.strip_prefix("memlock:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .expect("memlock in fdinfo");
        }
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let anon_kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap();
        drop(agent);
        eprintln!(
            "--inflight-max {n}, {cpus} CPUs: maps {map_bytes} B (formula {}), agent anon {anon_kb} KiB",
            maps(inflight_max, cpus)
        );
        assert!(
            map_bytes >= inflight_table(inflight_max),
            "{map_bytes} B of maps cannot hold the in-flight table"
        );
        assert!(
            map_bytes <= maps(inflight_max, cpus),
            "the agent's maps take {map_bytes} B, more than the formula's {} B \
             (--inflight-max {n}, {cpus} CPUs): update the formula",
            maps(inflight_max, cpus)
        );
        assert!(map_bytes + anon_kb * 1024 <= memory(inflight_max, cpus));
    }
}

const UNINSTALL: &str = include_str!("../../deploy/kubernetes/uninstall.yaml");

/// The uninstall DaemonSet (deploy/kubernetes/uninstall.yaml): it runs,
/// where the agents ran, with their image, capabilities, network and bpffs,
/// a detach of the ConfigMap's interface and pin directory; and that
/// script, run here (the binary and the pin directory substituted), refuses
/// while an agent runs, detaches and unpins what a stopped pinned agent
/// left, and counts a node with nothing pinned as done.
#[test]
fn the_uninstall_daemonset_detaches_what_the_agents_pinned() {
    use selector_user::config::file::{ConfigFile, Options};
    let uninstall = yaml_rust2::YamlLoader::load_from_str(UNINSTALL)
        .expect("the uninstall manifest is YAML")
        .remove(0);
    assert_eq!(uninstall["kind"].as_str(), Some("DaemonSet"));
    let daemonset = manifest("DaemonSet");
    assert_eq!(
        uninstall["metadata"]["namespace"],
        daemonset["metadata"]["namespace"]
    );
    let spec = &uninstall["spec"]["template"]["spec"];
    let agents = &daemonset["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"].as_bool(), Some(true));
    assert_eq!(spec["tolerations"], agents["tolerations"], "every node");
    let detach = &spec["initContainers"][0];
    let agent = &agents["containers"][0];
    assert_eq!(detach["image"], agent["image"]);
    assert_eq!(
        detach["securityContext"]["capabilities"],
        agent["securityContext"]["capabilities"]
    );
    let host_bpffs = |spec: &yaml_rust2::Yaml, container: &yaml_rust2::Yaml| {
        let mount = container["volumeMounts"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|m| m["name"].as_str() == Some("bpffs"))
            .and_then(|m| m["mountPath"].as_str())
            .map(str::to_owned);
        let host = spec["volumes"]
            .as_vec()
            .unwrap()
            .iter()
            .find(|v| v["name"].as_str() == Some("bpffs"))
            .and_then(|v| v["hostPath"]["path"].as_str())
            .map(str::to_owned);
        (mount, host)
    };
    assert_eq!(host_bpffs(spec, detach), host_bpffs(agents, agent));
    assert_least_privilege(spec);

    let text = manifest("ConfigMap")["data"]["selector.toml"]
        .as_str()
        .unwrap()
        .to_owned();
    let config = ConfigFile::parse(Path::new("selector.toml"), text)
        .and_then(|f| f.resolve_with(&Options::default()))
        .unwrap();
    let iface = config.settings.iface.clone();
    let pin = config.pin.clone().expect("the DaemonSet pins");
    let pin = pin.to_str().unwrap();
    assert_eq!(strings(&detach["command"]), vec!["/bin/sh", "-c"]);
    let script = strings(&detach["args"]).concat();
    let wanted = format!(
        "/usr/local/bin/selector detach --iface {iface} --pin {pin} --wait {}",
        config.settings.timeout.as_millis()
    );
    assert!(script.contains(&wanted), "{script}\nlacks {wanted}");

    // The script on a "node" (the testbed's client namespace).
    let tb = Testbed::new("seldu", 1).unwrap();
    let bpffs = Bpffs::mount();
    let here = script
        .replace(
            "/usr/local/bin/selector",
            selector_binary().to_str().unwrap(),
        )
        .replace(pin, &bpffs.arg());
    let uninstall = || {
        let out = tb
            .client
            .command("sh")
            .args(["-c", &here])
            .output()
            .unwrap();
        (out.status.success(), text_of(&out))
    };
    let (agent, _lines) = selector_testbed::agent::spawn_agent(
        &tb.client,
        &[
            "--iface",
            &iface,
            "--group",
            &tb.group_arg(),
            "--pin",
            &bpffs.arg(),
            "--quiet",
        ],
    );
    let (ok, said) = uninstall();
    assert!(!ok, "refused while the agent runs: {said}");
    assert!(said.contains("a selector agent is running"), "{said}");
    assert_eq!(attached(&tb.client, &iface).tcx_egress, 1);
    // The DaemonSet deleted: its agent exits, the pins stay, steering.
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    let mut agent = agent;
    assert!(agent.wait().unwrap().success());
    assert_eq!(attached(&tb.client, &iface).tcx_egress, 1);
    let (ok, said) = uninstall();
    assert!(ok, "{said}");
    assert!(
        said.contains(&format!("selector: detached from {iface}")),
        "{said}"
    );
    assert_eq!(attached(&tb.client, &iface), Attached::NOTHING);
    assert!(!bpffs.dir().join(&iface).exists(), "the pins are removed");
    // Run again (a restarted init container, a node never installed): done.
    let (ok, said) = uninstall();
    assert!(ok, "{said}");
    assert!(said.contains("nothing pinned"), "{said}");
}

fn text_of(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `sh -c SCRIPT` in `ns`, in a mount and a PID namespace of its own whose
/// PID 1 (the shell) shares the agent's mount namespace, as in a
/// container; `$SELECTOR` is the agent. (success, stdout and stderr)
fn in_a_mount_namespace(ns: &Namespace, script: &str) -> (bool, String) {
    let out = ns
        .command("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "--pid",
            "--fork",
            "--mount-proc",
            "sh",
            "-c",
            script,
        ])
        .env("SELECTOR", selector_binary())
        .output()
        .unwrap();
    (out.status.success(), text_of(&out))
}

/// With nothing mounted at /sys/fs/bpf, `--pin /sys/fs/bpf/selector`
/// mounts a bpffs there itself: root's alone (mode 0700, as systemd mounts
/// it), not the kernel's default 1777 that lets any user add pins.
#[test]
fn a_bpffs_the_agent_mounts_is_root_only() {
    let tb = Testbed::new("seldm", 1).unwrap();
    let script = format!(
        r#"set -e
"$SELECTOR" run --iface {CLIENT_IFACE} --group {group} --quiet --pin /sys/fs/bpf/selector --duration 1
echo "mode=$(stat -c %a /sys/fs/bpf)"
grep ' /sys/fs/bpf ' /proc/self/mountinfo
"$SELECTOR" detach --iface {CLIENT_IFACE} --pin /sys/fs/bpf/selector
"#,
        group = tb.group_arg()
    );
    let (ok, said) = in_a_mount_namespace(&tb.client, &script);
    assert!(ok, "{said}");
    assert!(
        said.contains("selector: mounted a bpf filesystem at /sys/fs/bpf"),
        "{said}"
    );
    let mode = said
        .lines()
        .find_map(|l| l.strip_prefix("mode="))
        .and_then(|m| u32::from_str_radix(m.trim(), 8).ok())
        .unwrap_or_else(|| panic!("no mode: {said}"));
    assert_eq!(mode & 0o777, 0o700, "{mode:o}: {said}");
    assert_eq!(attached(&tb.client, CLIENT_IFACE), Attached::NOTHING);
}

/// The DaemonSet mounts only the selector's directory of the host's bpffs
/// (hostPath /sys/fs/bpf/selector) at the ConfigMap's `pin`: the pin
/// directory is itself the mount point and nothing is mounted at the
/// container's /sys/fs/bpf. The agent pins there, on the host's bpffs,
/// without mounting one of its own; the same with the directory mounted
/// at /sys/fs/bpf/selector.
#[test]
fn the_agent_pins_into_a_bpffs_directory_mounted_as_its_pin_directory() {
    use selector_user::config::file::{ConfigFile, Options};
    let text = manifest("ConfigMap")["data"]["selector.toml"]
        .as_str()
        .unwrap()
        .to_owned();
    let config = ConfigFile::parse(Path::new("selector.toml"), text)
        .and_then(|f| f.resolve_with(&Options::default()))
        .unwrap();
    let manifest_pin = config.pin.expect("the DaemonSet pins");
    let tb = Testbed::new("seldb", 1).unwrap();
    for pin in [manifest_pin.as_path(), Path::new("/sys/fs/bpf/selector")] {
        let pin = pin.to_str().unwrap();
        // A tmpfs stands in for the container's own files (the runtime
        // makes the mount point); another at /sys/fs/bpf holds the
        // stand-in for the host's bpffs, whose selector directory is
        // bind-mounted at the pin directory, as the hostPath volume is.
        let top = Path::new(pin).iter().nth(1).unwrap().to_str().unwrap();
        let script = format!(
            r#"set -e
mount -t tmpfs none /sys/fs/bpf
mkdir /sys/fs/bpf/host
mount -t bpf bpf /sys/fs/bpf/host
mkdir /sys/fs/bpf/host/selector
case {pin} in /sys/fs/bpf/*) ;; *) mount -t tmpfs none /{top} ;; esac
mkdir -p {pin}
mount --bind /sys/fs/bpf/host/selector {pin}
"$SELECTOR" run --iface {CLIENT_IFACE} --group {group} --quiet --pin {pin} --duration 1
ls /sys/fs/bpf/host/selector/{CLIENT_IFACE}/maps/CONFIG
"$SELECTOR" detach --iface {CLIENT_IFACE} --pin {pin}
"#,
            group = tb.group_arg()
        );
        let (ok, said) = in_a_mount_namespace(&tb.client, &script);
        assert!(ok, "--pin {pin}: {said}");
        assert!(!said.contains("mounted a bpf filesystem"), "{said}");
        assert!(
            said.contains(&format!("selector: detached from {CLIENT_IFACE}")),
            "{said}"
        );
        assert_eq!(attached(&tb.client, CLIENT_IFACE), Attached::NOTHING);
    }
}

const HEDGING_DROP_IN: &str = include_str!("../../deploy/selector-hedging.conf");

/// The capabilities (setpriv names) of the unit with the hedging drop-in:
/// systemd merges the drop-in's lines into the unit's.
fn hedging_unit_capabilities() -> Vec<String> {
    let setting = |key: &str| -> Vec<String> {
        let prefix = format!("{key}=");
        HEDGING_DROP_IN
            .lines()
            .filter_map(|l| l.strip_prefix(&prefix))
            .flat_map(str::split_whitespace)
            .map(|c| c.strip_prefix("CAP_").unwrap().to_lowercase())
            .collect()
    };
    let added = setting("AmbientCapabilities");
    assert_eq!(added, setting("CapabilityBoundingSet"));
    assert_eq!(added, vec!["net_raw"], "the drop-in grants CAP_NET_RAW");
    let mut caps = unit_capabilities();
    caps.extend(added);
    caps
}

/// A capability set (`CapEff:` ...) of /proc/PID/task/TID/status.
fn capability_set(status: &str, set: &str) -> u64 {
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{set}:")))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or_else(|| panic!("no {set} in {status}"))
}

/// With the hedging drop-in, the agent (hedging off) opens its raw sockets
/// at start and then holds CAP_NET_RAW in none of its threads' effective,
/// permitted or ambient sets; `selector set --hedge-after` turns hedging
/// on later, and a read whose primary stalls is hedged and answered
/// through the sockets of the start.
#[test]
fn the_agent_drops_cap_net_raw_after_start_and_still_hedges() {
    const CAP_NET_RAW: u64 = 1 << 13;
    let mut tb = Testbed::new("seldh", 3).unwrap();
    tb.start_memcached().unwrap();
    let r = tb.replica_endpoints();
    selector_testbed::preload(&tb.client, &r, 10).unwrap();
    let binary = PublicBinary::new();
    let caps = hedging_unit_capabilities();
    let mut agent = selector_testbed::agent::AgentProcess(
        as_the_unit(
            &tb.client,
            &binary.path(),
            &caps,
            &["run", "--iface", CLIENT_IFACE, "--group", &tb.group_arg()],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(agent.stdout.take().unwrap()));
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("selector: attached to"), "{first}");
    let tasks = std::fs::read_dir(format!("/proc/{}/task", agent.id())).unwrap();
    for task in tasks {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        for set in ["CapEff", "CapPrm", "CapAmb"] {
            assert_eq!(
                capability_set(&status, set) & CAP_NET_RAW,
                0,
                "{set} holds CAP_NET_RAW:\n{status}"
            );
        }
        assert_ne!(capability_set(&status, "CapEff"), 0, "{status}");
    }

    let (code, out) = selector_testbed::agent::run_selector(
        &tb.client,
        &["set", "--iface", CLIENT_IFACE, "--hedge-after", "2"],
    );
    assert_eq!(code, 0, "hedging turned on after the drop: {out}");
    tb.replicas[0].stop();
    let to = r[0];
    let answered = tb
        .client
        .spawn(move || {
            use selector_testbed::memcached::{key_for, parse_get_response, value_for};
            let client = selector_testbed::MemcachedClient::connect(to).unwrap();
            let reply = client.request(
                format!("get {}\r\n", key_for(1)).as_bytes(),
                Duration::from_secs(5),
            );
            reply.is_ok_and(|body| parse_get_response(&body) == Some(value_for(1).as_bytes()))
        })
        .unwrap()
        .join()
        .unwrap();
    tb.replicas[0].resume();
    let status: serde_json::Value = selector_testbed::agent::status_json(&tb.client, CLIENT_IFACE);
    let sent: u64 = status["backends"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|b| b["hedges_sent"].as_u64())
        .sum();
    assert!(answered && sent >= 1, "{status}");

    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
    tb.replicas.clear();
}

/// The system calls one `systemd-analyze syscall-filter` item names: a
/// call, or a group expanded (its nested groups too).
fn syscall_set(item: &str, into: &mut std::collections::BTreeSet<String>) {
    if !item.starts_with('@') {
        into.insert(item.to_owned());
        return;
    }
    let out = Command::new("systemd-analyze")
        .args(["syscall-filter", item])
        .output()
        .expect("systemd-analyze");
    assert!(out.status.success(), "{item}: {}", text_of(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    for member in text.lines().skip(1).map(str::trim) {
        if !member.is_empty() && !member.starts_with('#') {
            syscall_set(member, into);
        }
    }
}

/// What the unit's `SystemCallFilter=` lines allow: their allow lists
/// (with `@default`, which systemd adds to any) less their `~` lists.
fn unit_syscall_filter() -> std::collections::BTreeSet<String> {
    let lines: Vec<&str> = UNIT
        .lines()
        .filter_map(|l| l.strip_prefix("SystemCallFilter="))
        .collect();
    assert!(!lines.is_empty(), "the unit filters system calls");
    assert!(!lines[0].starts_with('~'), "an allow list first");
    let mut allowed = std::collections::BTreeSet::new();
    syscall_set("@default", &mut allowed);
    let mut denied = std::collections::BTreeSet::new();
    for line in lines {
        let (set, items) = match line.strip_prefix('~') {
            Some(items) => (&mut denied, items),
            None => (&mut allowed, line),
        };
        for item in items.split_whitespace() {
            syscall_set(item, set);
        }
    }
    allowed.difference(&denied).cloned().collect()
}

/// The unit's `SystemCallFilter=` holds every system call the agent makes:
/// the agent, with the unit's capabilities and the hedging drop-in's, runs
/// under `strace -f -c` with what the unit gives it (a config file, a pin
/// directory, the notify socket and a watchdog) through its start,
/// `selector status`, scrapes of /metrics and /readyz, a reload, hedging
/// turned on and a hedged read, and its stop; every call strace counted
/// must be in the filter as `systemd-analyze syscall-filter` expands it
/// (systemd cannot run the unit here: PID 1 is not systemd).
#[test]
fn every_system_call_of_the_agent_is_in_the_units_filter() {
    let allowed = unit_syscall_filter();
    let mut tb = Testbed::new("seldc", 3).unwrap();
    tb.start_memcached().unwrap();
    let r = tb.replica_endpoints();
    selector_testbed::preload(&tb.client, &r, 10).unwrap();
    let binary = PublicBinary::new();
    let bpffs = Bpffs::mount();
    let members: Vec<String> = r.iter().map(|a| format!("\"{a}\"")).collect();
    let config = binary.dir.join("selector.toml");
    std::fs::write(
        &config,
        format!(
            "iface = \"{CLIENT_IFACE}\"\nthreshold = 1\nquiet = true\npin = \"{}\"\n\
             metrics-addr = \"{METRICS_ADDR}\"\n\n[[group]]\nname = \"cache\"\nmembers = [{}]\n",
            bpffs.arg(),
            members.join(", ")
        ),
    )
    .unwrap();
    let notify = binary.dir.join("notify");
    let socket = UnixDatagram::bind(&notify).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let counts = binary.dir.join("strace.txt");
    let mut agent = selector_testbed::agent::AgentProcess(
        as_the_unit(
            &tb.client,
            Path::new("strace"),
            &hedging_unit_capabilities(),
            &[
                "-f",
                "-c",
                "-o",
                counts.to_str().unwrap(),
                binary.path().to_str().unwrap(),
                "run",
                "--config",
                config.to_str().unwrap(),
            ],
        )
        .env("NOTIFY_SOCKET", &notify)
        .env("WATCHDOG_USEC", "200000")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let (ready, _) = next_notification(&socket);
    assert!(ready.starts_with("READY=1"), "{ready}");
    // Read on, as systemd does: a full socket would block the agent.
    std::thread::spawn(move || {
        let mut buf = [0u8; 1024];
        while socket.recv(&mut buf).is_ok() {}
    });

    let ctl = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--iface", CLIENT_IFACE]);
        let (code, out) = selector_testbed::agent::run_selector(&tb.client, &all);
        assert_eq!(code, 0, "{args:?}: {out}");
    };
    ctl(&["status"]);
    let metrics: std::net::SocketAddr = METRICS_ADDR.parse().unwrap();
    for path in ["/metrics", "/readyz"] {
        let got = tb
            .client
            .run(move || http_get(metrics, path, None))
            .unwrap()
            .unwrap();
        assert!(
            got.status == 200 || path == "/readyz",
            "{path}: {}",
            got.body
        );
    }
    ctl(&["reload"]);
    ctl(&["set", "--hedge-after", "2"]);
    tb.replicas[0].stop();
    let to = r[0];
    let answered = tb
        .client
        .spawn(move || {
            use selector_testbed::memcached::{key_for, parse_get_response, value_for};
            let client = selector_testbed::MemcachedClient::connect(to).unwrap();
            let reply = client.request(
                format!("get {}\r\n", key_for(2)).as_bytes(),
                Duration::from_secs(5),
            );
            reply.is_ok_and(|body| parse_get_response(&body) == Some(value_for(2).as_bytes()))
        })
        .unwrap()
        .join()
        .unwrap();
    tb.replicas[0].resume();
    assert!(answered, "the hedged read was answered");
    // Past a sweep or two and several watchdog pings.
    std::thread::sleep(Duration::from_millis(1500));
    // The agent is strace's child; strace ends with it, with its status.
    let children = format!("/proc/{0}/task/{0}/children", agent.id());
    let child: i32 = std::fs::read_to_string(&children)
        .unwrap()
        .trim()
        .parse()
        .expect("strace's one child, the agent");
    unsafe { libc::kill(child, libc::SIGTERM) };
    let status = agent.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut agent.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.success(), "{stderr}");

    let table = std::fs::read_to_string(&counts).unwrap();
    let used: Vec<&str> = table
        .lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            let name = *fields.last()?;
            let counted = fields.len() >= 5 && fields[0].parse::<f64>().is_ok();
            (counted && name != "total").then_some(name)
        })
        .collect();
    assert!(used.contains(&"bpf"), "{table}");
    let outside: Vec<&&str> = used
        .iter()
        .filter(|name| !allowed.contains(**name))
        .collect();
    assert!(
        outside.is_empty(),
        "system calls outside the unit's SystemCallFilter=: {outside:?}\n{table}"
    );
    let out = tb
        .client
        .command(selector_binary().to_str().unwrap())
        .args(["detach", "--iface", CLIENT_IFACE, "--pin", &bpffs.arg()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text_of(&out));
    tb.replicas.clear();
}

/// `--resolv-conf` implies `--hedge-after auto`: under the bare unit (no
/// CAP_NET_RAW) the agent still starts, says in one warning that it runs
/// the resolver's group without hedges, and shows hedging off; with the
/// hedging drop-in it hedges (`auto` in force, no warning).
#[test]
fn the_resolver_recipe_hedges_with_the_drop_in_and_runs_without_it() {
    let tb = Testbed::new("seldr", 2).unwrap();
    let binary = PublicBinary::new();
    // Beside the binary: a directory the unit's user may read.
    let conf = binary.dir.join("resolv.conf");
    std::fs::write(&conf, "nameserver 10.77.0.10\nnameserver 10.77.0.11\n").unwrap();
    std::fs::set_permissions(&conf, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let conf = conf.to_str().unwrap().to_owned();
    for (caps, hedges) in [
        (unit_capabilities(), false),
        (hedging_unit_capabilities(), true),
    ] {
        let mut agent = selector_testbed::agent::AgentProcess(
            as_the_unit(
                &tb.client,
                &binary.path(),
                &caps,
                &[
                    "run",
                    "--quiet",
                    "--iface",
                    CLIENT_IFACE,
                    "--resolv-conf",
                    &conf,
                ],
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
        );
        let mut lines =
            std::io::BufRead::lines(std::io::BufReader::new(agent.stdout.take().unwrap()));
        let before: Vec<String> = lines
            .by_ref()
            .map(Result::unwrap)
            .take_while(|l| !l.starts_with("selector: attached to"))
            .collect();
        let warned: Vec<&String> = before
            .iter()
            .filter(|l| l.contains("hedging off") && l.contains("CAP_NET_RAW"))
            .collect();
        assert_eq!(warned.len(), usize::from(!hedges), "{before:#?}");
        let status: serde_json::Value =
            selector_testbed::agent::status_json(&tb.client, CLIENT_IFACE);
        let in_force = &status["settings"]["hedge_after"];
        assert_eq!(in_force, if hedges { "auto" } else { "off" }, "{status}");
        unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
        assert!(agent.wait().unwrap().success());
        drop(lines);
    }
}
