//! Driving the selector from tests: the library attached in the client
//! namespace with a sweeper thread, and the `selector` binary (the agent and
//! its control commands).

use std::{
    io::{BufRead as _, BufReader, Lines},
    path::PathBuf,
    process::{Child, ChildStdout, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use selector_user::{Selector, Settings, host::sys};

use crate::{netns::Namespace, topology::Testbed};

/// A selector attached in the client namespace, swept every 10 ms.
pub struct SweptSelector {
    pub selector: Arc<Mutex<Selector>>,
    stop: Arc<AtomicBool>,
    sweeper: Option<thread::JoinHandle<()>>,
}

/// Every backend's raw counters once traffic has settled.
#[derive(Clone, Debug)]
pub struct Settled {
    /// (issued, completed, expired) per backend.
    pub accounting: Vec<(u64, u64, u64)>,
    pub pending: Vec<u64>,
}

impl SweptSelector {
    /// Attaches with `settings`, resolves the replicas' next hops and
    /// publishes their addresses, as the agent does at start.
    pub fn start(tb: &Testbed, settings: Settings) -> Self {
        let selector = tb
            .client
            .run(move || {
                let mut selector = Selector::attach(&settings)?;
                selector_user::datapath::next_hops::publish_once(
                    &mut selector,
                    Duration::from_secs(1),
                );
                anyhow::Ok(selector)
            })
            .unwrap()
            .expect("attach");
        let selector = Arc::new(Mutex::new(selector));
        let stop = Arc::new(AtomicBool::new(false));
        let sweeper = {
            let (selector, stop) = (selector.clone(), stop.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let mut s = selector.lock().unwrap_or_else(|e| e.into_inner());
                    s.sweep(sys::monotonic_ns()).expect("sweep");
                    // As the agent does between sweeps (a no-op unless
                    // `--hedge-after auto`, and until its next due time).
                    s.refresh_hedge_delays().expect("auto hedge delays");
                    drop(s);
                    thread::sleep(Duration::from_millis(10));
                }
            })
        };
        Self {
            selector,
            stop,
            sweeper: Some(sweeper),
        }
    }

    /// Waits (after traffic stopped) until every pending count is zero, or
    /// three timeouts and a second have passed, then reads the counters.
    pub fn settle(&self, timeout: Duration) -> Settled {
        let deadline = Instant::now() + timeout * 3 + Duration::from_secs(1);
        loop {
            let sel = self.selector.lock().unwrap();
            let pending = sel.pending().unwrap();
            if pending.iter().all(|p| *p == 0) || Instant::now() > deadline {
                return Settled {
                    accounting: sel.accounting().unwrap(),
                    pending,
                };
            }
            drop(sel);
            thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stop_sweeper(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(s) = self.sweeper.take() {
            // A failed sweep already failed the test; do not panic twice.
            let _ = s.join();
        }
    }
}

impl Drop for SweptSelector {
    fn drop(&mut self) {
        self.stop_sweeper();
    }
}

/// target/debug/selector, brought up to date once per test process.
/// `SELECTOR_BINARY`, when set, names a binary built beforehand (the
/// kernel matrix runs the tests in VMs whose view of target/ is read-only).
pub fn selector_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("SELECTOR_BINARY") {
        return PathBuf::from(path);
    }
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        let status = Command::new(env!("CARGO"))
            .args([
                "build",
                "--quiet",
                "--package",
                "selector-user",
                "--bin",
                "selector",
            ])
            .status()
            .unwrap();
        assert!(status.success(), "building selector");
    });
    // Test binaries live in target/debug/deps.
    let deps = std::env::current_exe().unwrap();
    deps.parent().unwrap().parent().unwrap().join("selector")
}

/// A running `selector run` and the lines it prints after "attached".
pub type Agent = (AgentProcess, Lines<BufReader<ChildStdout>>);

/// The agent's process, killed on drop if it still runs: a test that fails
/// half-way must not leave an agent that keeps the test binary waiting.
pub struct AgentProcess(pub Child);

impl std::ops::Deref for AgentProcess {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for AgentProcess {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Starts `selector run ARGS` in `ns` and waits for its "attached" line.
pub fn spawn_agent(ns: &Namespace, args: &[&str]) -> Agent {
    let mut child = ns
        .command(selector_binary().to_str().unwrap())
        .arg("run")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("selector: attached to"), "{first}");
    (AgentProcess(child), lines)
}

/// Runs a `selector` command in `ns`; (exit code, stdout + stderr).
pub fn run_selector(ns: &Namespace, args: &[&str]) -> (i32, String) {
    let out = ns
        .command(selector_binary().to_str().unwrap())
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// One backend's totals as `selector status` and the exit summary print
/// them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TotalsRow {
    pub backend: String,
    /// Requests addressed to it (as primary).
    pub requests: u64,
    /// Requests it completed.
    pub responses: u64,
    pub away: u64,
    pub to: u64,
    /// Requests to it the agent expired.
    pub timeouts: u64,
    pub pending: u64,
}

impl TotalsRow {
    /// Parses `backend requests responses away to timeouts p50 p99 pending`.
    fn parse(line: &str) -> Option<Self> {
        let cols: Vec<&str> = line.split_whitespace().collect();
        let [
            backend,
            requests,
            responses,
            away,
            to,
            timeouts,
            _p50,
            _p99,
            pending,
        ] = cols.as_slice()
        else {
            return None;
        };
        backend.parse::<std::net::SocketAddr>().ok()?;
        Some(Self {
            backend: backend.to_string(),
            requests: requests.parse().ok()?,
            responses: responses.parse().ok()?,
            away: away.parse().ok()?,
            to: to.parse().ok()?,
            timeouts: timeouts.parse().ok()?,
            pending: pending.parse().ok()?,
        })
    }

    /// Requests the kernel sent to this backend (redirects in, minus
    /// redirects out), assuming none passed untracked.
    pub fn issued(&self) -> u64 {
        self.requests - self.away + self.to
    }
}

/// Every backend row of a totals table, in order.
pub fn totals_rows(text: &str) -> Vec<TotalsRow> {
    text.lines().filter_map(TotalsRow::parse).collect()
}

/// `selector status` of the agent on `iface` in `ns`.
pub fn status(ns: &Namespace, iface: &str) -> Vec<TotalsRow> {
    let (code, out) = run_selector(ns, &["status", "--iface", iface]);
    assert_eq!(code, 0, "{out}");
    totals_rows(&out)
}

/// What is attached to an interface: TCX programs on each side, and XDP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attached {
    pub tcx_egress: usize,
    pub tcx_ingress: usize,
    pub xdp: bool,
}

impl Attached {
    pub const NOTHING: Self = Self {
        tcx_egress: 0,
        tcx_ingress: 0,
        xdp: false,
    };
}

/// Programs attached to `iface` in `ns`.
pub fn attached(ns: &Namespace, iface: &str) -> Attached {
    use aya::programs::{SchedClassifier, TcAttachType};
    let name = iface.to_owned();
    let (tcx_egress, tcx_ingress) = ns
        .run(move || {
            let count = |side| SchedClassifier::query_tcx(&name, side).map(|(_, p)| p.len());
            (
                count(TcAttachType::Egress).unwrap(),
                count(TcAttachType::Ingress).unwrap(),
            )
        })
        .unwrap();
    let link = ns.ip(&["-d", "link", "show", iface]).unwrap();
    Attached {
        tcx_egress,
        tcx_ingress,
        xdp: String::from_utf8_lossy(&link.stdout).contains("prog/xdp"),
    }
}

/// `selector status --json` of the agent on `iface` in `ns`, as `T`
/// (`selector_user::api::Status`, or a `serde_json::Value`).
pub fn status_json<T: serde::de::DeserializeOwned>(ns: &Namespace, iface: &str) -> T {
    let (code, out) = run_selector(ns, &["status", "--iface", iface, "--json"]);
    assert_eq!(code, 0, "{out}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}
