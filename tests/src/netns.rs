//! Network namespaces: create, run commands and threads inside, remove.

use std::{
    fs::File,
    os::fd::AsRawFd as _,
    process::{Command, Output},
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
    },
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

/// A tag for namespace names and temporary paths, unique on this machine
/// until it reboots: this process's id and start time (a later process
/// given the same id starts later) and a counter that does not wrap.
pub fn unique_tag() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}-{}",
        std::process::id(),
        process_start_ticks(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// When this process started, in clock ticks since boot (/proc/self/stat
/// field 22).
fn process_start_ticks() -> u64 {
    static TICKS: OnceLock<u64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
        // Fields after the command (which may hold spaces) start at field 3.
        stat.rsplit_once(") ")
            .and_then(|(_, rest)| rest.split_whitespace().nth(22 - 3))
            .and_then(|t| t.parse().ok())
            .expect("the start time in /proc/self/stat")
    })
}

/// A named network namespace, deleted on drop.
#[derive(Debug)]
pub struct Namespace {
    pub name: String,
}

impl Namespace {
    /// Creates the namespace `name`, refusing one that exists already: it
    /// belongs to someone else (names carry `unique_tag`), and is left as
    /// it is.
    pub fn create(name: &str) -> Result<Self> {
        if std::path::Path::new(&format!("/run/netns/{name}")).exists() {
            bail!("network namespace {name} exists already; not ours, left alone");
        }
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

/// The processes in the namespace named `name` (`ip netns pids`); none if
/// it cannot be asked.
pub fn pids_in(name: &str) -> Vec<i32> {
    Command::new("ip")
        .args(["netns", "pids", name])
        .output()
        .map(|out| {
            String::from_utf8_lossy(&out.stdout)
                .split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_do_not_repeat() {
        let tags: std::collections::HashSet<String> = (0..1000).map(|_| unique_tag()).collect();
        assert_eq!(tags.len(), 1000);
    }

    #[test]
    fn an_existing_namespace_is_refused_and_kept() {
        let first = Namespace::create(&format!("ut-{}", unique_tag())).unwrap();
        // A mark in it, to see it is the same namespace afterwards.
        first
            .ip(&[
                "link", "add", "mark0", "type", "veth", "peer", "name", "mark1",
            ])
            .unwrap();
        let second = Namespace::create(&first.name);
        assert!(second.is_err(), "created {} twice", first.name);
        first
            .ip(&["link", "show", "mark0"])
            .expect("the first one kept");
    }
}
