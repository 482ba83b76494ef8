//! The shipped configuration files start as they are, on every kernel of
//! the matrix (`cargo xtask test-kernels` runs this file on each): the
//! systemd unit's `deploy/selector.toml` and the DaemonSet's ConfigMap.
//! Both pin; a kernel without TCX (6.1 to 6.5) attaches by legacy tc
//! filters, unpinned, and says so. Only the pin directory is moved (to a
//! bpffs of the test's own); the members' networks are routed through the
//! client's uplink, as a node's would be.

use std::io::{BufRead as _, BufReader};
use std::process::Stdio;

use selector_testbed::{
    Testbed,
    agent::{AgentProcess, run_selector, selector_binary},
    bpffs::Bpffs,
    netns::unique_tag,
    topology::CLIENT_IFACE,
};

const UNIT_CONFIG: &str = include_str!("../../deploy/selector.toml");
const MANIFEST: &str = include_str!("../../deploy/kubernetes/selector.yaml");

/// The ConfigMap's `selector.toml`, unindented.
fn daemonset_config() -> String {
    let mut lines = MANIFEST
        .lines()
        .skip_while(|l| !l.contains("selector.toml: |"));
    lines.next().expect("the ConfigMap holds selector.toml");
    lines
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| format!("{}\n", l.strip_prefix("    ").unwrap_or(l)))
        .collect()
}

/// `text` with its `pin = "..."` line pointing at `dir`.
fn pinned_at(text: &str, dir: &str) -> String {
    let pin = text
        .lines()
        .find(|l| l.starts_with("pin = "))
        .expect("a shipped config pins");
    text.replace(pin, &format!("pin = \"{dir}\""))
}

fn starts(name: &str, text: &str) {
    let tb = Testbed::new(&format!("ship{}", &name[..1]), 1).unwrap();
    // The shipped members' networks, reached through the node's uplink
    // (here, by way of the one replica).
    let via = tb.replica_endpoints()[0].ip().to_string();
    tb.client
        .ip(&[
            "route",
            "add",
            "10.0.0.0/8",
            "via",
            &via,
            "dev",
            CLIENT_IFACE,
        ])
        .unwrap();
    let bpffs = Bpffs::mount();
    let path = std::env::temp_dir().join(format!("selector-{name}-{}.toml", unique_tag()));
    std::fs::write(&path, pinned_at(text, &bpffs.arg())).unwrap();
    let mut child = tb
        .client
        .command(selector_binary().to_str().unwrap())
        .args(["run", "--config", path.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Warnings first (on legacy tc: not pinned), then the start line.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut warnings = Vec::new();
    let first = lines.by_ref().map_while(Result::ok).find(|l| {
        let attached = l.starts_with("selector: attached to");
        if !attached {
            warnings.push(l.clone());
        }
        attached
    });
    let mut agent = AgentProcess(child);
    let Some(first) = first else {
        agent.kill().unwrap();
        let mut err = String::new();
        std::io::Read::read_to_string(&mut agent.stderr.take().unwrap(), &mut err).unwrap();
        let _ = std::fs::remove_file(&path);
        panic!("{name} did not start: {warnings:?} {err}");
    };
    if first.contains("tc by netlink") {
        assert!(
            warnings.iter().any(|w| w.contains("not pinned under")),
            "{warnings:?}"
        );
    } else {
        assert!(first.contains("pinned under"), "{first}");
    }
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success(), "{name}: {first}");
    let _ = std::fs::remove_file(&path);
    // Pinned (TCX) programs stay after a stop; the pin dir's detach takes
    // them. Unpinned ones went with the agent.
    if first.contains("pinned") {
        let (code, out) = run_selector(
            &tb.client,
            &["detach", "--iface", CLIENT_IFACE, "--pin", &bpffs.arg()],
        );
        assert_eq!(code, 0, "{out}");
    }
}

#[test]
fn the_units_config_starts_as_shipped() {
    starts("unit", UNIT_CONFIG);
}

#[test]
fn the_daemonsets_config_starts_as_shipped() {
    starts("daemonset", &daemonset_config());
}
