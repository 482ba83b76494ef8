//! Where the control socket lives and who may be behind it.
//!
//! Each agent listens on `/run/selector/net-INODE/IFACE.sock`, INODE being
//! its network namespace's (so each namespace's `eth0` has its own agent,
//! as with pods), in directories only root (the agent's user) may enter:
//! no other user can bind the name first, nor reach the agent. While it
//! runs it holds an exclusive lock on `IFACE.lock` beside the socket: the
//! lock, not the socket file (a killed agent leaves it behind), says an
//! agent is running. A client checks that whoever accepted its connection
//! is root or its own user before it believes the reply, and reads at most
//! [`MAX_REPLY_BYTES`] of it.
//!
//! An agent of several attachments (`selector run --attachment`) also
//! listens on `/run/selector/net-INODE/attachments/agent.sock`, in its own
//! namespace, with its lock beside it: one endpoint for all its
//! attachments, requests naming one by label ([`super::Routed`]). A
//! directory of its own, so its names never pass for an interface's.
//!
//! An agent that stops removes its socket, its lock file and its
//! namespace's directory when no other agent is in it; one that starts
//! removes the directories no agent holds a lock in (those of namespaces
//! long gone, left by agents that were killed). Removing a lock file is
//! safe against an agent taking it at that moment: a lock counts only on
//! the file still at the lock's name, checked after locking.

use std::{
    fs::{self, DirBuilder, File, OpenOptions},
    io::{self, Read as _, Write as _},
    os::{
        fd::AsRawFd as _,
        unix::{
            fs::{DirBuilderExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _},
            net::UnixStream,
        },
    },
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};

use super::{Reply, Routed};

/// The root of the agents' socket directories.
pub const RUN_DIR: &str = "/run/selector";

/// Longest reply a client reads (a status of 512 backends with their
/// latency buckets is a few MB).
pub const MAX_REPLY_BYTES: u64 = 64 << 20;

/// How long a client waits for the agent's reply.
const REPLY_WAIT: Duration = Duration::from_secs(5);

/// The directory of this thread's network namespace's agents.
pub fn namespace_dir() -> Result<PathBuf> {
    let inode = fs::metadata("/proc/thread-self/ns/net")
        .context("reading this thread's network namespace")?
        .ino();
    Ok(Path::new(RUN_DIR).join(format!("net-{inode}")))
}

/// Which agent's socket, in this network namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// The agent (or the attachment of an agent of several) on an interface.
    Interface(String),
    /// The one endpoint of the agent of several attachments.
    Attachments,
}

impl Endpoint {
    fn dir(&self) -> Result<PathBuf> {
        let dir = namespace_dir()?;
        Ok(match self {
            Self::Interface(_) => dir,
            Self::Attachments => dir.join("attachments"),
        })
    }

    fn file(&self, suffix: &str) -> Result<PathBuf> {
        let name = match self {
            Self::Interface(iface) => {
                crate::config::settings::check_iface_name(iface)?;
                iface.as_str()
            }
            Self::Attachments => "agent",
        };
        Ok(self.dir()?.join(format!("{name}.{suffix}")))
    }

    /// Its control socket.
    pub fn socket(&self) -> Result<PathBuf> {
        self.file("sock")
    }

    fn lock(&self) -> Result<PathBuf> {
        self.file("lock")
    }

    /// An agent of it, running, for messages: "a selector is running on
    /// eth0 in this network namespace" with `a` "a" and `is` "is".
    fn running(&self, a: &str, is: &str) -> String {
        match self {
            Self::Interface(iface) => {
                format!("{a} selector {is} running on {iface} in this network namespace")
            }
            Self::Attachments => format!(
                "{a} selector of several attachments {is} running in this network namespace"
            ),
        }
    }
}

/// Creates the endpoint's directory (and those above it, from
/// [`RUN_DIR`]) private to the agent's user, or makes them so when they
/// are its own: a directory another user owns or could write in would let
/// it bind the name first.
fn private_dir(endpoint: &Endpoint) -> Result<PathBuf> {
    let dir = endpoint.dir()?;
    let namespace = namespace_dir()?;
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    let mut dirs = vec![Path::new(RUN_DIR), namespace.as_path()];
    if dir != namespace {
        dirs.push(dir.as_path());
    }
    for d in dirs {
        match DirBuilder::new().mode(0o700).create(d) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e).with_context(|| format!("creating {}", d.display())),
        }
        let mut meta =
            fs::symlink_metadata(d).with_context(|| format!("checking {}", d.display()))?;
        // Ours but open to others (a pod's emptyDir is 0777): closed.
        if meta.is_dir() && meta.uid() == uid && meta.mode() & 0o077 != 0 {
            fs::set_permissions(d, fs::Permissions::from_mode(0o700))
                .with_context(|| format!("closing {} to other users", d.display()))?;
            meta = fs::symlink_metadata(d)?;
        }
        if !meta.is_dir() || meta.uid() != uid || meta.mode() & 0o022 != 0 {
            bail!(
                "{} must be a directory of the agent's user (uid {uid}) that no one else may write to (it is {}, uid {}, mode {:o}): remove it",
                d.display(),
                if meta.is_dir() {
                    "a directory"
                } else {
                    "no directory"
                },
                meta.uid(),
                meta.mode() & 0o7777
            );
        }
    }
    Ok(dir)
}

/// The lock a running agent holds on its endpoint in this network namespace.
pub struct RunningLock {
    _file: File,
    socket: PathBuf,
    lock: PathBuf,
}

/// Why a lock was not taken this time.
#[derive(Debug, PartialEq)]
enum Taken {
    /// Removed under us by an agent stopping or a sweep.
    Removed,
    /// Held: by an agent, or for an instant by a sweep.
    Held,
}

impl std::fmt::Display for Taken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Removed => "the lock file was removed while taking it",
            Self::Held => "the lock is held",
        })
    }
}

impl std::error::Error for Taken {}

impl RunningLock {
    /// Takes the lock, or fails when another agent holds it. The socket
    /// file an earlier agent left is removed: the caller binds it anew.
    pub fn take(endpoint: &Endpoint) -> Result<Self> {
        static SWEPT: std::sync::Once = std::sync::Once::new();
        SWEPT.call_once(|| {
            let removed = remove_stale_dirs(Path::new(RUN_DIR), &live_namespaces());
            if removed > 0 {
                log::debug!("removed {removed} directories of agents gone from {RUN_DIR}");
            }
        });
        // A stopping agent may remove the file (or the directory) between
        // our open and our lock: then lock the new one. A sweep holds an
        // idle lock for an instant: try again shortly.
        let mut attempts = 0;
        loop {
            attempts += 1;
            match Self::take_once(endpoint) {
                Err(e) if attempts < 5 && e.is::<Taken>() => {
                    if e.downcast_ref::<Taken>() == Some(&Taken::Held) {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                    }
                }
                Err(e) if e.downcast_ref::<Taken>() == Some(&Taken::Held) => {
                    bail!("{}", endpoint.running("a", "is already"))
                }
                other => return other,
            }
        }
    }

    fn take_once(endpoint: &Endpoint) -> Result<Self> {
        private_dir(endpoint)?;
        let path = endpoint.lock()?;
        // Not through a link, and ours: one planted while the directory
        // was open to others is refused.
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(|e| match e.kind() {
                io::ErrorKind::NotFound => anyhow::Error::new(Taken::Removed),
                _ => anyhow::Error::new(e).context(format!("opening {}", path.display())),
            })?;
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() };
        let owner = file.metadata()?.uid();
        if owner != uid {
            bail!(
                "{} belongs to uid {owner}, not the agent's user (uid {uid}): remove it",
                path.display()
            );
        }
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(Taken::Held.into());
            }
            return Err(e).with_context(|| format!("locking {}", path.display()));
        }
        if fs::symlink_metadata(&path).map(|m| m.ino()).ok() != Some(file.metadata()?.ino()) {
            return Err(Taken::Removed.into());
        }
        let socket = endpoint.socket()?;
        match fs::remove_file(&socket) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", socket.display()));
            }
            _ => {}
        }
        Ok(Self {
            _file: file,
            socket,
            lock: path,
        })
    }

    /// Where to bind the control socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for RunningLock {
    fn drop(&mut self) {
        // The names go with the agent (the lock, still held, with them),
        // then its directories if no other agent is in them (a directory
        // with anything in it is not removed).
        let _ = fs::remove_file(&self.socket);
        let _ = fs::remove_file(&self.lock);
        let mut dir = self.lock.parent();
        while let Some(d) = dir.filter(|d| *d != Path::new(RUN_DIR)) {
            if fs::remove_dir(d).is_err() {
                break;
            }
            dir = d.parent();
        }
    }
}

/// Removes the directories under `root` of network namespaces that no
/// longer exist (`net-INODE`, INODE in none of `live`), in which no agent
/// holds a lock: left by agents that were killed. Returns how many it
/// removed.
pub fn remove_stale_dirs(root: &Path, live: &std::collections::HashSet<u64>) -> usize {
    let Ok(entries) = fs::read_dir(root) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let gone = entry
            .file_name()
            .to_str()
            .and_then(|n| n.strip_prefix("net-")?.parse::<u64>().ok())
            .is_some_and(|inode| !live.contains(&inode));
        if gone && entry.file_type().is_ok_and(|t| t.is_dir()) && remove_if_unheld(&entry.path()) {
            removed += 1;
        }
    }
    removed
}

/// The network namespaces that exist, as far as can be seen: those of
/// every task, and those mounted (`ip netns add` binds one under
/// /run/netns). One held only by an open descriptor is missed, and its
/// directory, with no agent in it, removed: the next agent there makes it
/// again.
pub fn live_namespaces() -> std::collections::HashSet<u64> {
    let mut live = std::collections::HashSet::new();
    for process in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let tasks = process.path().join("task");
        for task in fs::read_dir(tasks).into_iter().flatten().flatten() {
            if let Ok(meta) = fs::metadata(task.path().join("ns/net")) {
                live.insert(meta.ino());
            }
        }
    }
    // mountinfo: "ID PARENT MAJ:MIN ROOT MOUNTPOINT ...", ROOT "net:[INODE]".
    let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for line in mounts.lines() {
        let root = line.split_whitespace().nth(3).unwrap_or_default();
        if let Some(inode) = root
            .strip_prefix("net:[")
            .and_then(|r| r.strip_suffix(']')?.parse().ok())
        {
            live.insert(inode);
        }
    }
    live
}

/// Removes `dir` (and its `attachments` directory) when no lock in it is
/// held: its lock files first (each only while we hold it, so never one
/// an agent holds), then its sockets, then the directories.
fn remove_if_unheld(dir: &Path) -> bool {
    for d in [dir.join("attachments"), dir.to_path_buf()] {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "lock") {
                let Ok(file) = OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_NOFOLLOW)
                    .open(&path)
                else {
                    return false;
                };
                // SAFETY: flock on a descriptor we own.
                if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
                    return false; // an agent runs here
                }
                let _ = fs::remove_file(&path);
            }
        }
        for entry in fs::read_dir(&d).into_iter().flatten().flatten() {
            if entry.path().extension().is_some_and(|e| e == "sock") {
                let _ = fs::remove_file(entry.path());
            }
        }
        let _ = fs::remove_dir(&d);
    }
    !dir.exists()
}

/// Whether an agent holds the lock of `endpoint` in this network namespace.
pub fn agent_running(endpoint: &Endpoint) -> Result<bool> {
    let path = endpoint.lock()?;
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e).with_context(|| format!("opening {}", path.display())),
    };
    // SAFETY: flock on a descriptor we own; a lock taken is released when
    // `file` closes.
    let taken = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0;
    Ok(!taken)
}

/// The interfaces of the agents running in this network namespace, sorted.
pub fn running_agents() -> Result<Vec<String>> {
    let dir = namespace_dir()?;
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("listing {}", dir.display())),
    };
    let mut found = Vec::new();
    for entry in entries {
        let name = entry?.file_name();
        let Some(iface) = name.to_str().and_then(|n| n.strip_suffix(".lock")) else {
            continue;
        };
        if agent_running(&Endpoint::Interface(iface.into()))? {
            found.push(iface.to_string());
        }
    }
    found.sort();
    Ok(found)
}

/// The uid of the process at the other end of `stream`.
fn peer_uid(stream: &UnixStream) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of the size given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Sends one request to the agent of `endpoint` in this network namespace
/// and returns its reply. Only [`Endpoint::Attachments`] takes one that
/// names an attachment; naming none, it is a plain [`super::Request`].
pub fn send(endpoint: &Endpoint, request: &Routed) -> Result<Reply> {
    let path = endpoint.socket()?;
    let mut stream = match UnixStream::connect(&path) {
        Ok(stream) => stream,
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => bail!(
            "permission denied: only root or the agent's user may control it ({})",
            path.display()
        ),
        Err(e) => {
            return Err(e)
                .with_context(|| format!("{} ({})", endpoint.running("no", "is"), path.display()));
        }
    };
    // SAFETY: geteuid has no preconditions.
    let own = unsafe { libc::geteuid() };
    let server = peer_uid(&stream).context("asking who holds the control socket")?;
    if server != 0 && server != own {
        bail!(
            "{} is held by uid {server}, neither root nor this user: not trusting it",
            path.display()
        );
    }
    stream.set_read_timeout(Some(REPLY_WAIT))?;
    stream.set_write_timeout(Some(REPLY_WAIT))?;
    let mut line = serde_json::to_string(request)?;
    line.push('\n');
    stream.write_all(line.as_bytes())?;
    let mut text = String::new();
    (&mut stream)
        .take(MAX_REPLY_BYTES)
        .read_to_string(&mut text)
        .context("reading the agent's reply")?;
    serde_json::from_str(text.trim_end()).context("the agent's reply is not valid")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory under the temporary one, removed on drop.
    struct Root(PathBuf);

    impl Root {
        fn new(name: &str) -> Self {
            let p = std::env::temp_dir().join(format!("selector-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).unwrap();
            Self(p)
        }
    }

    impl Drop for Root {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn directories_of_gone_namespaces_without_a_held_lock_are_removed() {
        let root = Root::new("stale");
        let live = live_namespaces();
        let own = fs::metadata("/proc/self/ns/net").unwrap().ino();
        assert!(live.contains(&own));
        // Inodes no namespace has: 1 to 3.
        let gone = root.0.join("net-1");
        fs::create_dir_all(gone.join("attachments")).unwrap();
        fs::write(gone.join("eth0.lock"), "").unwrap();
        fs::write(gone.join("eth0.sock"), "").unwrap();
        fs::write(gone.join("attachments/agent.lock"), "").unwrap();
        let empty = root.0.join("net-2");
        fs::create_dir_all(&empty).unwrap();
        let running = root.0.join("net-3");
        fs::create_dir_all(&running).unwrap();
        let held = File::create(running.join("eth0.lock")).unwrap();
        // SAFETY: flock on a descriptor we own.
        assert_eq!(
            unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
            0
        );
        // A live namespace's directory stays, agent or not.
        let alive = root.0.join(format!("net-{own}"));
        fs::create_dir_all(&alive).unwrap();
        let other = root.0.join("not-ours");
        fs::create_dir_all(&other).unwrap();
        assert_eq!(remove_stale_dirs(&root.0, &live), 2);
        assert!(!gone.exists() && !empty.exists());
        assert!(running.join("eth0.lock").exists() && alive.exists() && other.exists());
        drop(held);
        assert_eq!(remove_stale_dirs(&root.0, &live), 1);
        assert!(!running.exists() && alive.exists());
    }

    #[test]
    fn a_stopping_agent_takes_its_lock_file_and_socket_name_with_it() {
        let endpoint = Endpoint::Interface(format!("selt{}", std::process::id() % 100_000));
        let lock = RunningLock::take(&endpoint).unwrap();
        let (lock_path, socket) = (endpoint.lock().unwrap(), lock.socket().to_path_buf());
        fs::write(&socket, "").unwrap();
        assert!(lock_path.exists());
        // A second agent on the same endpoint is refused while it runs.
        let second = RunningLock::take(&endpoint).err().unwrap().to_string();
        assert!(second.contains("is already running"), "{second}");
        drop(lock);
        assert!(!lock_path.exists() && !socket.exists());
        // And the next one starts.
        let again = RunningLock::take(&endpoint).unwrap();
        drop(again);
    }
}
