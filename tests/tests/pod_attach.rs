//! deploy/kubernetes/attach-pods.sh, with plain network namespaces standing
//! in for pods: the script, run in a "node" namespace (with an `eth0` of its
//! own), starts one agent per pod attached inside the pod's namespace
//! (`--netns /proc/PID/ns/net`, the PID of a process in it, given directly
//! or found through a stand-in `crictl`); the agent steers the pod's reads
//! away from a stalled primary with real memcached replicas; `stop` stops
//! the agents and `selector detach`es what a killed one left. Bad input is
//! one clear error and starts nothing.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::Path,
    process::{Child, Command, Output},
    time::Duration,
};

use selector_testbed::{
    Namespace, Testbed,
    agent::{self, Attached, selector_binary},
    pods::{ScratchDir, load_with_stall, moved_off_the_primary, node_namespace},
    preload,
    topology::CLIENT_IFACE,
};
use selector_user::host::tc_attach::{FILTER_PRIORITY, OVERRIDE_VAR};

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/kubernetes/attach-pods.sh"
);
const KEYS: usize = 200;

/// A process in the pod's namespace, as a pod's sandbox (pause) process.
struct Sandbox(Child);

impl Sandbox {
    fn start(pod: &Namespace) -> Self {
        Self(pod.command("sleep").arg("600").spawn().unwrap())
    }

    /// `ip netns exec` execs the command: this is the sleeping process.
    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The script's state directory; on drop (a failed test too) its `stop`
/// runs, so no agent outlives the test.
struct Attachments<'a> {
    node: &'a Namespace,
    state: ScratchDir,
}

impl<'a> Attachments<'a> {
    fn new(node: &'a Namespace) -> Self {
        Self {
            node,
            state: ScratchDir::new("pods-state"),
        }
    }

    /// `attach-pods.sh MODE ARGS` in the node's namespace, with this state
    /// directory and the test's selector binary.
    fn script(&self, mode: &str, args: &[&str]) -> Command {
        let mut c = self.node.command("bash");
        c.args([SCRIPT, mode, "--state-dir", self.state.arg(), "--selector"])
            .arg(selector_binary())
            .args(args)
            .env_remove(OVERRIDE_VAR);
        c
    }

    /// The agent PID the script recorded for attachment `name`.
    fn agent_pid(&self, name: &str) -> i32 {
        let env = std::fs::read_to_string(self.state.path().join(format!("{name}.env"))).unwrap();
        env.lines()
            .find_map(|l| l.strip_prefix("AGENT_PID="))
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no AGENT_PID in {env}"))
    }

    /// Attachments the state directory still lists.
    fn left(&self) -> Vec<String> {
        std::fs::read_dir(self.state.path())
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".env"))
            .collect()
    }
}

impl Drop for Attachments<'_> {
    fn drop(&mut self) {
        let _ = self.script("stop", &[]).output();
    }
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Whether process `pid` is gone (or a zombie waiting for its reaper).
fn gone(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
        .unwrap_or(true)
}

#[test]
fn an_agent_started_for_a_pods_pid_steers_it_and_stop_detaches() {
    let mut tb = Testbed::new("selpa", 3).expect("testbed");
    tb.start_memcached().expect("memcached");
    preload(&tb.client, &tb.replica_endpoints(), KEYS).expect("preload");
    let node = node_namespace("selpa");
    let sandbox = Sandbox::start(&tb.client);
    let pid = sandbox.pid().to_string();
    let netns = format!("/proc/{pid}/ns/net");
    let group = tb.group_arg();
    let pods = Attachments::new(&node);

    let out = pods
        .script(
            "start",
            &[
                "--pid",
                &pid,
                "--",
                "--group",
                &group,
                "--threshold",
                "2",
                "--ingress",
                "tc",
                "--timeout",
                "500",
                "--quiet",
            ],
        )
        .output()
        .unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    let attached = agent::attached(&tb.client, CLIENT_IFACE);
    assert_eq!(
        (attached.tcx_egress, attached.tcx_ingress),
        (1, 1),
        "the programs must be on the pod's {CLIENT_IFACE}"
    );
    assert_eq!(
        agent::attached(&node, CLIENT_IFACE),
        Attached::NOTHING,
        "nothing may be attached to the node's own {CLIENT_IFACE}"
    );
    assert!(
        said.contains(&format!(
            "attach-pods.sh: pid {pid}: attached to eth0 in netns {netns} ("
        )),
        "{said}"
    );
    let name = format!("pid-{pid}");
    let agent_pid = pods.agent_pid(&name);
    let listed = text(&pods.script("list", &[]).output().unwrap());
    assert!(
        listed.starts_with(&format!(
            "{name}\tpid {pid}\teth0\tagent {agent_pid} running\t{netns}"
        )),
        "{listed}"
    );

    let report = load_with_stall(&tb, KEYS);
    assert_eq!(
        report.lost(),
        0,
        "every reply must reach the connected socket (rewritten back to the primary's address): {} of {}",
        report.received,
        report.sent
    );
    assert_eq!(report.wrong_values, 0);
    assert_eq!(report.wrong_source, 0);
    let (code, out) = agent::run_selector(
        &node,
        &[
            "status",
            "--netns",
            &netns,
            "--iface",
            CLIENT_IFACE,
            "--json",
        ],
    );
    assert_eq!(code, 0, "{out}");
    let status: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    moved_off_the_primary(&status);
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);

    // A second start for the same pod is refused while its agent runs.
    let again = pods
        .script("start", &["--pid", &pid, "--", "--group", &group])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(1), "{}", text(&again));
    assert!(
        text(&again).contains(&format!("pid {pid} is already attached ({name})")),
        "{}",
        text(&again)
    );

    let out = pods.script("stop", &[]).output().unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains(&format!("pid {pid}: agent stopped")),
        "{said}"
    );
    // The agent detached as it exited; the detach after it finds nothing.
    assert!(
        said.contains(&format!("pid {pid}: nothing left attached to eth0")),
        "{said}"
    );
    assert!(gone(agent_pid), "the agent must have exited");
    assert_eq!(agent::attached(&tb.client, CLIENT_IFACE), Attached::NOTHING);
    assert_eq!(pods.left(), Vec::<String>::new());
    drop(sandbox);
}

/// A stand-in `crictl` that knows one ready pod, `shop/web-0`, whose
/// sandbox is `pid`, and answers the two calls the script makes.
fn fake_crictl(dir: &Path, pid: u32) {
    let script = format!(
        "#!/bin/sh\n\
         case \"$*\" in\n\
         'pods --name ^web-0$ --namespace ^shop$ --state ready -q') echo 5a4db0c ;;\n\
         'pods '*) ;;\n\
         'inspectp -o go-template --template {{{{.info.pid}}}} 5a4db0c') echo {pid} ;;\n\
         *) echo \"crictl: unexpected: $*\" >&2; exit 1 ;;\n\
         esac\n"
    );
    let path = dir.join("crictl");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// On legacy tc (kernels without TCX, forced here) an agent's filters
/// outlive it: a pod's agent killed (OOM, SIGKILL) leaves them steering
/// with nothing sweeping. `stop` notices the agent gone and its
/// `selector detach` in the pod's namespace removes them. The pod is found
/// by name through `crictl`.
#[test]
fn stop_detaches_what_a_killed_agent_left_in_a_pod_found_by_name() {
    let tb = Testbed::new("selpk", 3).expect("testbed");
    let node = node_namespace("selpk");
    let sandbox = Sandbox::start(&tb.client);
    let bin = ScratchDir::new("pods-bin");
    fake_crictl(bin.path(), sandbox.pid());
    let path = format!("{}:{}", bin.arg(), std::env::var("PATH").unwrap());
    let group = tb.group_arg();
    let pods = Attachments::new(&node);
    let filters = || {
        let out = tb
            .client
            .exec("tc", &["filter", "show", "dev", CLIENT_IFACE, "egress"])
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let ours = |listing: &str| {
        listing.contains("selector_egress") && listing.contains(&format!("pref {FILTER_PRIORITY} "))
    };

    let out = pods
        .script(
            "start",
            &[
                "-n",
                "shop",
                "web-0",
                "--",
                "--group",
                &group,
                "--ingress",
                "tc",
                "--quiet",
            ],
        )
        .env("PATH", &path)
        .env(OVERRIDE_VAR, "netlink")
        .output()
        .unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("attach-pods.sh: pod shop/web-0: attached to eth0 in netns")
            && said.contains("tc by netlink"),
        "{said}"
    );
    assert!(ours(&filters()), "{}", filters());

    let agent_pid = pods.agent_pid("shop_web-0");
    unsafe { libc::kill(agent_pid, libc::SIGKILL) };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !gone(agent_pid) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(gone(agent_pid));
    assert!(
        ours(&filters()),
        "filters outlive their agent: {}",
        filters()
    );

    let out = pods.script("stop", &["shop_web-0"]).output().unwrap();
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("pod shop/web-0: the agent had already exited"),
        "{said}"
    );
    assert!(
        said.contains("pod shop/web-0: detached from eth0: tc filter selector_egress"),
        "{said}"
    );
    assert!(!filters().contains("selector_"), "{}", filters());
    assert_eq!(pods.left(), Vec::<String>::new());
}

/// Bad input: one line saying what is wrong, a non-zero exit, and nothing
/// started.
#[test]
fn bad_input_is_one_clear_error_and_starts_nothing() {
    let state = ScratchDir::new("pods-bad");
    let empty = ScratchDir::new("pods-empty-path");
    let no_pods = ScratchDir::new("pods-no-pods");
    fake_crictl(no_pods.path(), 1);
    let selector = selector_binary();
    let selector = selector.to_str().unwrap();
    let run = |args: &[&str], path: Option<&str>| {
        // By path: PATH may be an empty directory here.
        let mut c = Command::new("/bin/bash");
        c.arg(SCRIPT).args(args).env_remove("SELECTOR_BIN");
        if let Some(path) = path {
            c.env("PATH", path);
        }
        let out = c.output().unwrap();
        (out.status.code().unwrap_or(-1), text(&out))
    };
    let with_state = |mode: &str, rest: &[&str]| {
        let mut args = vec![mode, "--state-dir", state.arg()];
        args.extend_from_slice(rest);
        args.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };

    let (code, out) = run(&["--help"], None);
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("Usage:\n  attach-pods.sh start"), "{out}");
    assert!(out.contains("--pid PID"), "{out}");

    let cases: Vec<(Vec<String>, Option<String>, i32, String)> = vec![
        (
            vec![],
            None,
            2,
            "attach-pods.sh: error: no mode given (start, stop or list)".into(),
        ),
        (
            with_state("start", &["--selector", selector]),
            None,
            2,
            "attach-pods.sh: error: start: name pods, or give --pid PID".into(),
        ),
        (
            with_state("start", &["--selector", selector, "--pid", "12ab"]),
            None,
            2,
            "attach-pods.sh: error: --pid takes a process id, not '12ab'".into(),
        ),
        (
            with_state("start", &["--selector", selector, "--pid", "999999999"]),
            None,
            1,
            "attach-pods.sh: error: pid 999999999: no process 999999999 (no /proc/999999999/ns/net)"
                .into(),
        ),
        (
            with_state("start", &["--selector", "/no/such/selector", "--pid", "1"]),
            None,
            1,
            "attach-pods.sh: error: no selector binary at '/no/such/selector' (not an executable file)"
                .into(),
        ),
        // No selector on PATH, none named (PATH: an empty directory; the
        // script fails on builtins alone).
        (
            with_state("start", &["--pid", "1"]),
            Some(empty.arg().to_owned()),
            1,
            "attach-pods.sh: error: no selector binary: none on PATH; give --selector PATH or set SELECTOR_BIN"
                .into(),
        ),
        (
            with_state("start", &["--selector", selector, "web-0"]),
            Some(empty.arg().to_owned()),
            1,
            "attach-pods.sh: error: crictl not found: it is needed to find pods by name (or give --pid PID)"
                .into(),
        ),
        (
            with_state("start", &["--selector", selector, "-n", "shop", "web-1"]),
            Some(format!("{}:{}", no_pods.arg(), std::env::var("PATH").unwrap())),
            1,
            "attach-pods.sh: error: no ready pod 'web-1' in namespace 'shop' on this node (crictl pods)"
                .into(),
        ),
        (
            with_state("stop", &["--selector", selector, "shop_web-0"]),
            None,
            1,
            format!(
                "attach-pods.sh: error: no attachment named 'shop_web-0' (see: attach-pods.sh list --state-dir {})",
                state.arg()
            ),
        ),
        (
            with_state("start", &["--bogus"]),
            None,
            2,
            "attach-pods.sh: error: unknown option '--bogus'".into(),
        ),
    ];
    for (args, path, want_code, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out) = run(&args, path.as_deref());
        assert_eq!(code, want_code, "{args:?}: {out}");
        assert_eq!(out.lines().next(), Some(want.as_str()), "{args:?}: {out}");
        if want_code == 2 {
            assert_eq!(out.lines().nth(1), Some("Try 'attach-pods.sh --help'."));
        }
        assert!(out.lines().count() <= 2, "{args:?}: {out}");
    }
    let started = std::fs::read_dir(state.path())
        .map(|d| d.filter_map(Result::ok).count())
        .unwrap_or(0);
    assert_eq!(started, 0, "nothing may have been started");
}
