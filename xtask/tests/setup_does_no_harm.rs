//! `cargo xtask setup` on a host that already runs memcached and nginx of
//! its own leaves them running. The two stand in for an operator's
//! services: started outside any namespace, but on loopback, on a free
//! port, with nginx's config, pid file and logs in a directory of the
//! test's own, so that the test itself touches nothing of the host's.
//! (With everything installed setup takes its no-install path; the install
//! path's commands and its policy-rc.d are unit-tested in `packages.rs`.)

use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

/// A free TCP port on loopback (free when asked; nothing else here binds).
fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A child process killed (by its own pid) and reaped on drop.
struct Service {
    name: &'static str,
    child: Child,
    addr: SocketAddr,
}

impl Service {
    /// Alive: not exited, and answers `ask` on its port with `expect`.
    fn answers(&mut self, ask: &[u8], expect: &str) -> Result<(), String> {
        if let Some(status) = self.child.try_wait().unwrap() {
            return Err(format!("{} exited: {status}", self.name));
        }
        let mut stream = TcpStream::connect_timeout(&self.addr, Duration::from_secs(2))
            .map_err(|e| format!("{} on {}: {e}", self.name, self.addr))?;
        stream
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        stream.write_all(ask).map_err(|e| e.to_string())?;
        let mut reply = [0u8; 256];
        let n = stream.read(&mut reply).map_err(|e| e.to_string())?;
        let reply = String::from_utf8_lossy(&reply[..n]);
        if reply.contains(expect) {
            Ok(())
        } else {
            Err(format!("{} answered {reply:?}", self.name))
        }
    }

    fn wait_until_it_answers(&mut self, ask: &[u8], expect: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.answers(ask, expect) {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => panic!("did not come up: {e}"),
                Err(_) => thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

impl Drop for Service {
    /// SIGTERM first: nginx's master then stops its workers (a SIGKILLed
    /// master would leave them running).
    fn drop(&mut self) {
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_memcached() -> Service {
    let port = free_port();
    let child = Command::new("memcached")
        .args(["-U", "0", "-l", "127.0.0.1", "-u", "root", "-p"])
        .arg(port.to_string())
        .stdout(Stdio::null())
        .spawn()
        .expect("memcached (is it installed? `cargo xtask setup`)");
    let mut service = Service {
        name: "memcached",
        child,
        addr: (Ipv4Addr::LOCALHOST, port).into(),
    };
    service.wait_until_it_answers(b"version\r\n", "VERSION");
    service
}

/// A directory of the test's own, removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

fn start_nginx(dir: &Path) -> Service {
    let port = free_port();
    let conf = dir.join("nginx.conf");
    std::fs::write(
        &conf,
        format!(
            "load_module {STREAM_MODULE};\n\
             daemon off;\n\
             worker_processes 1;\n\
             pid {dir}/nginx.pid;\n\
             error_log {dir}/error.log warn;\n\
             events {{ worker_connections 16; }}\n\
             stream {{ server {{ listen 127.0.0.1:{port}; return \"operator's nginx\\n\"; }} }}\n",
            dir = dir.display()
        ),
    )
    .unwrap();
    let child = Command::new("nginx")
        .arg("-c")
        .arg(&conf)
        .arg("-p")
        .arg(dir)
        .arg("-e")
        .arg(dir.join("error.log"))
        .stdout(Stdio::null())
        .spawn()
        .expect("nginx (is it installed? `cargo xtask setup`)");
    let mut service = Service {
        name: "nginx",
        child,
        addr: (Ipv4Addr::LOCALHOST, port).into(),
    };
    service.wait_until_it_answers(b"", "operator's nginx");
    service
}

#[test]
fn setup_leaves_a_hosts_own_memcached_and_nginx_running() {
    let dir = TempDir(std::env::temp_dir().join(format!("xtask-no-harm-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let mut memcached = start_memcached();
    let mut nginx = start_nginx(&dir.0);

    let out = Command::new(env!("CARGO_BIN_EXE_xtask"))
        .arg("setup")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "setup failed:\n{said}");
    assert!(said.contains("setup: ready"), "{said}");

    memcached
        .answers(b"version\r\n", "VERSION")
        .unwrap_or_else(|e| panic!("{e}; setup said:\n{said}"));
    nginx
        .answers(b"", "operator's nginx")
        .unwrap_or_else(|e| panic!("{e}; setup said:\n{said}"));
}
