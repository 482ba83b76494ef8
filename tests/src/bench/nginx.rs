//! nginx (Debian `nginx` with `libnginx-mod-stream`) as a UDP proxy on the
//! client host, `least_conn`: the userspace alternative, configured at its
//! best for this job:
//! - a shared `zone`, so every worker sees the same connection counts;
//! - `proxy_responses 1`: a session ends with its reply;
//! - `proxy_requests 1`: one datagram per session. Without it nginx keeps
//!   every datagram of one client socket in one session, pinned to one
//!   backend, and least_conn never moves them away from a stalled replica;
//! - one worker per core, each with its own `reuseport` socket.

use std::{
    fmt::Write as _,
    net::SocketAddrV4,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{memcached::MemcachedClient, netns::Namespace};

/// Where Debian's libnginx-mod-stream puts the module.
pub const STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

/// The configuration file's text.
pub fn config(
    dir: &Path,
    listen: SocketAddrV4,
    backends: &[SocketAddrV4],
    workers: usize,
) -> String {
    let mut servers = String::new();
    for b in backends {
        let _ = writeln!(servers, "        server {b};");
    }
    format!(
        r#"load_module {STREAM_MODULE};
user root;
daemon off;
worker_processes {workers};
worker_rlimit_nofile 65536;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{
    worker_connections 16384;
}}
stream {{
    upstream replicas {{
        zone replicas 64k;
        least_conn;
{servers}    }}
    server {{
        listen {listen} udp reuseport;
        proxy_pass replicas;
        proxy_responses 1;
        proxy_requests 1;
        proxy_timeout 1s;
    }}
}}
"#,
        dir = dir.display(),
    )
}

/// A running nginx; stopped (and its workers with it) on drop.
pub struct Nginx {
    child: Child,
    pub listen: SocketAddrV4,
    pub dir: PathBuf,
}

impl Nginx {
    /// Starts nginx inside `ns` and waits until it proxies a request.
    pub fn start(
        ns: &Namespace,
        dir: &Path,
        listen: SocketAddrV4,
        backends: &[SocketAddrV4],
    ) -> Result<Self> {
        if !Path::new(STREAM_MODULE).exists() {
            bail!(
                "{STREAM_MODULE} missing: install nginx and libnginx-mod-stream (`cargo xtask setup`)"
            );
        }
        std::fs::create_dir_all(dir)?;
        // nginx takes a relative `-c` and `-e` from its `-p` prefix: with a
        // relative `--out` they would name the directory twice.
        let dir = &std::path::absolute(dir)?;
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        let conf = dir.join("nginx.conf");
        std::fs::write(&conf, config(dir, listen, backends, workers))?;
        let error_log = dir.join("error.log");
        // What nginx says before its error log is open (a bad config, a
        // port in use) goes to stderr.
        let stderr_log = dir.join("stderr.log");
        let child = ns
            .command("nginx")
            .arg("-c")
            .arg(&conf)
            .arg("-p")
            .arg(dir)
            .arg("-e")
            .arg(&error_log)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr_log)?)
            .spawn()
            .context("starting nginx")?;
        let mut nginx = Self {
            child,
            listen,
            dir: dir.to_path_buf(),
        };
        nginx.wait_ready(ns).with_context(|| {
            let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
            format!(
                "nginx did not come up; its log:\n{}{}",
                read(&error_log),
                read(&stderr_log)
            )
        })?;
        Ok(nginx)
    }

    fn wait_ready(&mut self, ns: &Namespace) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!("nginx exited: {status}");
            }
            let listen = self.listen;
            let ok = ns.run(move || {
                MemcachedClient::connect(listen)
                    .and_then(|c| c.request(b"version\r\n", Duration::from_millis(100)))
                    .is_ok_and(|r| r.starts_with(b"VERSION"))
            })?;
            if ok {
                return Ok(());
            }
        }
        bail!("nginx at {} did not proxy a request", self.listen)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM to the master stops its workers too (a SIGKILL would
        // leave them running).
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_has_what_least_conn_needs_for_udp() {
        let backends: Vec<SocketAddrV4> = ["10.77.0.10:11211", "10.77.0.11:11211"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let c = config(
            Path::new("/tmp/x"),
            "127.0.0.1:11311".parse().unwrap(),
            &backends,
            2,
        );
        for needle in [
            "least_conn;",
            "zone replicas",
            "proxy_responses 1;",
            "proxy_requests 1;",
            "listen 127.0.0.1:11311 udp reuseport;",
            "server 10.77.0.11:11211;",
            "worker_processes 2;",
        ] {
            assert!(c.contains(needle), "missing {needle}:\n{c}");
        }
    }
}
