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

use super::{Reply, Request};

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

/// The control socket of the agent on `iface` in this network namespace.
pub fn socket_path(iface: &str) -> Result<PathBuf> {
    Ok(namespace_dir()?.join(format!("{iface}.sock")))
}

fn lock_path(iface: &str) -> Result<PathBuf> {
    Ok(namespace_dir()?.join(format!("{iface}.lock")))
}

/// Creates this namespace's directory (and [`RUN_DIR`]) private to the
/// agent's user, or makes them so when they are its own: a directory
/// another user owns or could write in would let it bind the name first.
pub fn private_namespace_dir() -> Result<PathBuf> {
    let dir = namespace_dir()?;
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    for d in [Path::new(RUN_DIR), dir.as_path()] {
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

/// The lock a running agent holds on `iface` in this network namespace.
pub struct RunningLock {
    _file: File,
    socket: PathBuf,
}

impl RunningLock {
    /// Takes the lock, or fails when another agent holds it. The socket
    /// file an earlier agent left is removed: the caller binds it anew.
    pub fn take(iface: &str) -> Result<Self> {
        private_namespace_dir()?;
        let path = lock_path(iface)?;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                bail!("a selector is already running on {iface} in this network namespace");
            }
            return Err(e).with_context(|| format!("locking {}", path.display()));
        }
        let socket = socket_path(iface)?;
        match fs::remove_file(&socket) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing {}", socket.display()));
            }
            _ => {}
        }
        Ok(Self {
            _file: file,
            socket,
        })
    }

    /// Where to bind the control socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for RunningLock {
    fn drop(&mut self) {
        // The lock goes with the descriptor; the name with the agent.
        let _ = fs::remove_file(&self.socket);
    }
}

/// Whether an agent holds the lock of `iface` in this network namespace.
pub fn agent_running(iface: &str) -> Result<bool> {
    let path = lock_path(iface)?;
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
        if agent_running(iface)? {
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

/// Sends one request to the agent on `iface` (in this network namespace)
/// and returns its reply.
pub fn send(iface: &str, request: &Request) -> Result<Reply> {
    let path = socket_path(iface)?;
    let mut stream = match UnixStream::connect(&path) {
        Ok(stream) => stream,
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => bail!(
            "permission denied: only root or the agent's user may control it ({})",
            path.display()
        ),
        Err(e) => {
            return Err(e).with_context(|| {
                format!(
                    "no selector is running on {iface} in this network namespace ({})",
                    path.display()
                )
            });
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
