//! Plain network namespaces standing in for a Kubernetes node and its pods:
//! the node's namespace, where agents that attach inside pods are started,
//! and the load the pod tests steer.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use crate::{
    LoadReport, LoadSpec, Namespace, Testbed, netns::unique_tag, run_load, topology::CLIENT_IFACE,
};

/// A namespace standing in for the node's, with an `eth0` of its own (one
/// end of a veth pair, both ends inside, up, with an address) and a route
/// to the replicas' subnet: an agent that attached in it instead of the
/// pod's would start, attach there and see none of the pod's traffic.
pub fn node_namespace(prefix: &str) -> Namespace {
    let node = Namespace::create(&format!("{prefix}-{}-node", unique_tag())).unwrap();
    node.ip(&[
        "link",
        "add",
        CLIENT_IFACE,
        "type",
        "veth",
        "peer",
        "name",
        "peer0",
    ])
    .unwrap();
    node.ip(&["addr", "add", "10.99.0.1/24", "dev", CLIENT_IFACE])
        .unwrap();
    node.ip(&["link", "set", CLIENT_IFACE, "up"]).unwrap();
    node.ip(&["link", "set", "peer0", "up"]).unwrap();
    node.ip(&["route", "add", "10.77.0.0/24", "dev", CLIENT_IFACE])
        .unwrap();
    node
}

/// Gets at 2000/s for 1.5 s of `keys` keys on a connected socket in the
/// pod (the testbed's client) to its first replica, that primary stopped
/// for 50 ms halfway.
pub fn load_with_stall(tb: &Testbed, keys: usize) -> LoadReport {
    let spec = LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: 2000,
        duration: Duration::from_millis(1500),
        keys,
        drain: Duration::from_secs(1),
    };
    let load = tb.client.spawn(move || run_load(&spec)).unwrap();
    std::thread::sleep(Duration::from_millis(750));
    tb.replicas[0].stop();
    std::thread::sleep(Duration::from_millis(50));
    tb.replicas[0].resume();
    load.join().unwrap().expect("load")
}

/// A scratch directory of the test's (files it writes for the agent or a
/// script), removed on drop, also when the test fails.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("selector-{what}-{}", unique_tag()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    pub fn arg(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Checks in a `status --json` of a group whose first member stalled that
/// reads left it and every one of them reached another member; returns how
/// many.
pub fn moved_off_the_primary(status: &serde_json::Value) -> u64 {
    let backends = status["backends"].as_array().unwrap();
    let away = backends[0]["redirected_away"].as_u64().unwrap();
    let to: u64 = backends[1..]
        .iter()
        .map(|b| b["redirected_to"].as_u64().unwrap())
        .sum();
    assert!(away > 0, "reads must leave the stalled primary: {status}");
    assert_eq!(to, away, "{status}");
    away
}
