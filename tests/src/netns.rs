//! Network namespaces: create, run commands and threads inside, remove.

use std::{
    fs::File,
    os::fd::AsRawFd as _,
    process::{Command, Output},
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

/// Runs a command, failing with its stderr if it exits non-zero.
pub fn sh(program: &str, args: &[&str]) -> Result<Output> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// A unique short tag for namespace names: pid plus a counter.
pub fn unique_tag() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "{}{}",
        std::process::id(),
        char::from(b'a' + (NEXT.fetch_add(1, Ordering::Relaxed) % 26) as u8)
    )
}

/// A named network namespace, deleted on drop.
#[derive(Debug)]
pub struct Namespace {
    pub name: String,
}

impl Namespace {
    pub fn create(name: &str) -> Result<Self> {
        // A leftover from a killed run would make `add` fail.
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        sh("ip", &["netns", "add", name])?;
        let ns = Self {
            name: name.to_string(),
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// `ip -n NAME ...`
    pub fn ip(&self, args: &[&str]) -> Result<Output> {
        let mut a = vec!["-n", &self.name];
        a.extend_from_slice(args);
        sh("ip", &a)
    }

    /// A command to run inside the namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name, program]);
        c
    }

    /// Runs a command inside, failing on a non-zero exit.
    pub fn exec(&self, program: &str, args: &[&str]) -> Result<Output> {
        let mut a = vec!["netns", "exec", &self.name, program];
        a.extend_from_slice(args);
        sh("ip", &a)
    }

    /// Runs `f` on a new thread that has entered this namespace: sockets it
    /// creates and interfaces it names are the namespace's.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<std::thread::JoinHandle<T>> {
        let file = File::open(format!("/run/netns/{}", self.name))
            .with_context(|| format!("opening namespace {}", self.name))?;
        let (tx, rx) = std::sync::mpsc::channel();
        let handle = std::thread::spawn(move || {
            // SAFETY: setns on this thread only, with an open netns fd.
            let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
            let _ = tx.send(rc);
            if rc != 0 {
                panic!("setns failed: {}", std::io::Error::last_os_error());
            }
            f()
        });
        match rx.recv() {
            Ok(0) => Ok(handle),
            _ => bail!("could not enter namespace {}", self.name),
        }
    }

    /// Runs `f` inside the namespace and waits for it.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
        self.spawn(f)?
            .join()
            .map_err(|_| anyhow::anyhow!("thread in {} panicked", self.name))
    }

    /// A counter from /proc/net/snmp6 inside the namespace, e.g.
    /// "Udp6InCsumErrors".
    pub fn snmp6(&self, field: &str) -> Result<u64> {
        let out = self.exec("cat", &["/proc/net/snmp6"])?;
        let text = String::from_utf8_lossy(&out.stdout);
        let value = text
            .lines()
            .find_map(|l| {
                let mut words = l.split_whitespace();
                (words.next() == Some(field))
                    .then(|| words.next())
                    .flatten()
            })
            .with_context(|| format!("no {field} in /proc/net/snmp6"))?;
        Ok(value.parse()?)
    }

    /// A counter from /proc/net/snmp inside the namespace, e.g. ("Udp", "InCsumErrors").
    pub fn snmp(&self, proto: &str, field: &str) -> Result<u64> {
        let out = self.exec("cat", &["/proc/net/snmp"])?;
        let text = String::from_utf8_lossy(&out.stdout);
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with(&format!("{proto}:")))
            .collect();
        if rows.len() < 2 {
            bail!("no {proto} rows in /proc/net/snmp");
        }
        let names: Vec<&str> = rows[0].split_whitespace().collect();
        let values: Vec<&str> = rows[1].split_whitespace().collect();
        let i = names
            .iter()
            .position(|n| *n == field)
            .with_context(|| format!("no {proto} {field}"))?;
        Ok(values[i].parse()?)
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "pids", &self.name])
            .output()
            .map(|out| {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-CONT", pid]).output();
                    let _ = Command::new("kill").args(["-KILL", pid]).output();
                }
            });
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

/// The state letter of every thread of `pid` (`T`: stopped).
pub fn thread_states(pid: i32) -> Vec<char> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
        .filter_map(|stat| stat.rsplit_once(") ")?.1.chars().next())
        .collect()
}

/// Waits up to a second until every thread of `pid` has stopped: SIGSTOP
/// takes effect when each thread next runs, which a loaded machine delays.
pub fn wait_stopped(pid: i32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        let states = thread_states(pid);
        if !states.is_empty() && states.iter().all(|s| *s == 'T') {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}
