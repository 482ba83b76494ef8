//! The release agent (`selector run`) as a child process of the benchmark,
//! for the measurements that need the real agent: its CPU, its cost when
//! attached.

use std::{
    io::BufRead as _,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail, ensure};

use selector_user::api::Status;

use crate::{netns::Namespace, topology::CLIENT_IFACE};

/// The release `selector` beside this binary (`cargo xtask bench` builds it).
pub fn agent_beside(exe: &Path) -> PathBuf {
    exe.parent()
        .map_or_else(|| PathBuf::from("selector"), |d| d.join("selector"))
}

pub fn check_agent(agent: &Path) -> Result<()> {
    if !agent.exists() {
        bail!(
            "{} not found: build it with `cargo build --release -p selector-user --bin selector` \
             (`cargo xtask bench` does)",
            agent.display()
        );
    }
    Ok(())
}

/// The agent process, stopped (SIGTERM, then SIGKILL) on drop.
pub struct AgentChild(pub Child);

impl Drop for AgentChild {
    fn drop(&mut self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if matches!(self.0.try_wait(), Ok(Some(_))) {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `selector run --quiet ARGS` in `ns` and waits until it attached.
pub fn start_agent(ns: &Namespace, agent: &std::path::Path, args: &[String]) -> Result<AgentChild> {
    let mut c = ns.command(agent.to_str().context("agent path")?);
    c.args(["run", "--quiet"]).args(args);
    let mut child = AgentChild(
        c.stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the agent")?,
    );
    let stdout = child.0.stdout.take().context("agent stdout")?;
    let mut lines = std::io::BufReader::new(stdout).lines();
    let first = lines.next().context("the agent printed nothing")??;
    ensure!(first.starts_with("selector: attached to"), "agent: {first}");
    // Keep reading what it prints later (events such as an ejection): with
    // the pipe closed, its next line would end the agent.
    thread::spawn(move || lines.for_each(drop));
    Ok(child)
}

/// `selector status --json` of the agent on the client's interface in `ns`.
pub fn agent_status(ns: &Namespace, agent: &Path) -> Result<Status> {
    let out = ns
        .command(agent.to_str().context("agent path")?)
        .args(["status", "--iface", CLIENT_IFACE, "--json"])
        .output()?;
    ensure!(
        out.status.success(),
        "selector status: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).context("selector status --json")
}
