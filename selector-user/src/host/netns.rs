//! `--netns PATH`: attach inside another network namespace (a pod's) from
//! an agent started in the host's.
//!
//! Interface names and indexes, TC and XDP attachment, the netlink sockets
//! (routes, neighbours, the TCX probe), the hedging raw socket and the
//! control socket all belong to the network namespace of the thread that
//! opens or names them. So the agent enters the namespace once, at start,
//! while it is still one thread: every thread it starts afterwards (the
//! hedge thread) and every socket it opens are then the pod's. Only what was
//! opened before stays in the namespace it was opened in: `run` binds the
//! metrics listener first, so `/metrics` and the probes are served where
//! the agent was started (the host's namespace, for a node agent). BPF maps
//! and programs are not namespaced. The control socket is the pod
//! namespace's: `selector status --netns PATH` (or `ip netns exec`,
//! `nsenter --net=PATH`) reaches it.

use std::{
    fs::File,
    io,
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result, bail};

/// `NS_GET_NSTYPE` (linux/nsfs.h): `_IO(0xb7, 0x3)`.
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
/// `NSFS_MAGIC` (linux/magic.h): the file system of /proc/PID/ns/* and of
/// their bind mounts under /run/netns.
const NSFS_MAGIC: i64 = 0x6e73_6673;

/// A network namespace named by `--netns`, opened and checked.
#[derive(Debug)]
pub struct NetNs {
    path: PathBuf,
    file: File,
}

impl NetNs {
    /// Opens `path` and checks it is a network namespace; an error names
    /// the flag and says what the path is instead.
    pub fn open(path: &Path) -> Result<Self> {
        let shown = path.display();
        let file = File::open(path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => anyhow::anyhow!(
                "--netns {shown}: no such file (a network namespace is /proc/PID/ns/net of a process in it, or /run/netns/NAME from `ip netns add`)"
            ),
            _ => anyhow::anyhow!("--netns {shown}: cannot open it: {e}"),
        })?;
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: an open descriptor and a statfs to fill.
        if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) } != 0 {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("--netns {shown}: fstatfs"));
        }
        if fs.f_type as i64 != NSFS_MAGIC {
            bail!(
                "--netns {shown}: not a namespace file (expected /proc/PID/ns/net or /run/netns/NAME)"
            );
        }
        // SAFETY: an ioctl without argument on an nsfs descriptor.
        let kind = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE as _) };
        if kind < 0 {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("--netns {shown}: asking its namespace type"));
        }
        if kind != libc::CLONE_NEWNET {
            bail!(
                "--netns {shown}: a namespace of another kind ({}), not a network namespace",
                kind_name(kind)
            );
        }
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    /// The path as given.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves this process into the namespace. Only while it has one thread:
    /// the other threads would stay behind, and sockets opened on them
    /// would be the old namespace's.
    pub fn enter(&self) -> Result<()> {
        let threads = std::fs::read_dir("/proc/self/task")
            .context("counting this process's threads")?
            .count();
        if threads != 1 {
            bail!(
                "--netns {}: the agent must enter the namespace while it is one thread, and it has {threads}",
                self.path.display()
            );
        }
        // The only thread: the whole process moves.
        self.setns("--netns")
    }

    /// Moves the calling thread only into the namespace: an agent serving
    /// several attachments runs each on a thread of its own, which enters
    /// its attachment's namespace before it opens or names anything (the
    /// threads it starts afterwards are born in it). Sockets the thread
    /// opened before stay where they were.
    pub fn enter_this_thread(&self) -> Result<()> {
        self.setns("netns")
    }

    /// setns of the calling thread; errors start with `what` and the path.
    fn setns(&self, what: &str) -> Result<()> {
        // SAFETY: setns of the calling thread, with an open nsfs descriptor.
        if unsafe { libc::setns(self.file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            let e = io::Error::last_os_error();
            let path = self.path.display();
            if e.raw_os_error() == Some(libc::EPERM) {
                bail!("{what} {path}: entering the network namespace needs CAP_SYS_ADMIN ({e})");
            }
            return Err(e).with_context(|| format!("{what} {path}: setns"));
        }
        Ok(())
    }

    /// The namespace's identity, `net:[INODE]`, as /proc/PID/ns/net links
    /// name it (the same for every path to the same namespace).
    pub fn id(&self) -> Result<String> {
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: an open descriptor and a stat to fill.
        if unsafe { libc::fstat(self.file.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error()).context("fstat of the namespace");
        }
        Ok(format!("net:[{}]", st.st_ino))
    }
}

fn kind_name(kind: i32) -> &'static str {
    match kind {
        libc::CLONE_NEWNS => "mount",
        libc::CLONE_NEWUTS => "uts",
        libc::CLONE_NEWIPC => "ipc",
        libc::CLONE_NEWUSER => "user",
        libc::CLONE_NEWPID => "pid",
        libc::CLONE_NEWCGROUP => "cgroup",
        libc::CLONE_NEWTIME => "time",
        _ => "unknown",
    }
}

/// Enters `--netns PATH` if given: for the short-lived commands (`status`,
/// `detach`, ...), before they name an interface or open a socket.
pub fn enter_if_given(path: Option<&Path>) -> Result<()> {
    match path {
        Some(path) => NetNs::open(path)?.enter(),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_network_namespace_is_taken_and_anything_else_is_refused_naming_the_flag() {
        let own = NetNs::open(Path::new("/proc/self/ns/net")).unwrap();
        assert!(own.id().unwrap().starts_with("net:["));
        let missing = NetNs::open(Path::new("/run/netns/no-such-selector-ns"))
            .unwrap_err()
            .to_string();
        assert!(
            missing.starts_with("--netns /run/netns/no-such-selector-ns: no such file"),
            "{missing}"
        );
        let plain = NetNs::open(Path::new("/proc/self/status"))
            .unwrap_err()
            .to_string();
        assert!(plain.contains("not a namespace file"), "{plain}");
        let uts = NetNs::open(Path::new("/proc/self/ns/uts"))
            .unwrap_err()
            .to_string();
        assert!(uts.contains("(uts), not a network namespace"), "{uts}");
    }
}
