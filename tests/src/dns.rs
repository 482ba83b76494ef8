//! Real DNS replicas: NSD serving a small zone over UDP in a replica
//! namespace, `dig` as the client, and a minimal query builder.
//!
//! The zone `example.test` holds an A record at the apex and, at
//! `big.example.test`, a TXT record set whose answer is far above the
//! MTU, so that NSD's UDP reply (EDNS buffer 4096) is IP-fragmented.

use std::{
    net::{Ipv4Addr, SocketAddr, UdpSocket},
    path::PathBuf,
    process::{Child, Output, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::netns::Namespace;

pub const DNS_PORT: u16 = 53;

/// /etc/netns/NS/resolv.conf: what `ip netns exec NS` shows processes as
/// /etc/resolv.conf. Removed on drop.
pub struct NetnsResolvConf {
    dir: PathBuf,
}

impl NetnsResolvConf {
    pub fn write(ns: &str, text: &str) -> Result<Self> {
        let dir = PathBuf::from("/etc/netns").join(ns);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let conf = Self { dir };
        std::fs::write(conf.path(), text)
            .with_context(|| format!("writing {}", conf.path().display()))?;
        Ok(conf)
    }

    /// The file.
    pub fn path(&self) -> PathBuf {
        self.dir.join("resolv.conf")
    }
}

impl Drop for NetnsResolvConf {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
pub const ZONE: &str = "example.test";
/// The apex A record's address.
pub const APEX_A: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// The name whose TXT answer is IP-fragmented.
pub const BIG_NAME: &str = "big.example.test";
/// TXT records at `BIG_NAME`, each one string of `BIG_TXT_LEN` bytes.
pub const BIG_TXT_RECORDS: usize = 12;
pub const BIG_TXT_LEN: usize = 240;

/// The TXT string of record `i` at `BIG_NAME`.
pub fn big_txt(i: usize) -> String {
    let head = format!("txt{i:02}-");
    format!("{head}{}", "y".repeat(BIG_TXT_LEN - head.len()))
}

/// The zone file: SOA, NS, the apex A and the big TXT set.
pub fn zone_file() -> String {
    let mut z = format!(
        "$ORIGIN {ZONE}.\n$TTL 300\n\
         @ IN SOA ns.{ZONE}. admin.{ZONE}. 1 3600 600 86400 300\n\
         @ IN NS ns.{ZONE}.\n\
         ns IN A {APEX_A}\n\
         @ IN A {APEX_A}\n"
    );
    for i in 0..BIG_TXT_RECORDS {
        z.push_str(&format!("big IN TXT \"{}\"\n", big_txt(i)));
    }
    z
}

/// An NSD process serving `ZONE` over UDP (IPv4) in a replica namespace,
/// with response rate limiting off (Debian's default limits a source to
/// 200 answers per second) and a 4096-byte EDNS buffer.
pub struct Nsd {
    pub addr: SocketAddr,
    ns_name: String,
    dir: PathBuf,
    child: Child,
}

impl Nsd {
    /// NSD serving the test zone at `addr`, IPv4 or IPv6.
    pub fn start(ns: &Namespace, addr: impl Into<SocketAddr>) -> Result<Self> {
        let addr: SocketAddr = addr.into();
        let dir = std::env::temp_dir().join(format!("selector-nsd-{}", ns.name));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join(format!("{ZONE}.zone")), zone_file())?;
        let d = dir.display();
        let conf = format!(
            "server:\n\
             \x20 ip-address: {ip}\n\
             \x20 port: {port}\n\
             \x20 do-ip4: {ip4}\n\
             \x20 do-ip6: {ip6}\n\
             \x20 username: \"\"\n\
             \x20 chroot: \"\"\n\
             \x20 zonesdir: \"{d}\"\n\
             \x20 database: \"\"\n\
             \x20 zonelistfile: \"{d}/zone.list\"\n\
             \x20 xfrdfile: \"{d}/xfrd.state\"\n\
             \x20 xfrdir: \"{d}\"\n\
             \x20 pidfile: \"{d}/nsd.pid\"\n\
             \x20 logfile: \"{d}/nsd.log\"\n\
             \x20 server-count: 1\n\
             \x20 rrl-ratelimit: 0\n\
             \x20 ipv4-edns-size: 4096\n\
             \x20 ipv6-edns-size: 4096\n\
             \x20 verbosity: 1\n\
             remote-control:\n\
             \x20 control-enable: no\n\
             zone:\n\
             \x20 name: {ZONE}\n\
             \x20 zonefile: \"{ZONE}.zone\"\n",
            ip = addr.ip(),
            port = addr.port(),
            ip4 = if addr.is_ipv4() { "yes" } else { "no" },
            ip6 = if addr.is_ipv6() { "yes" } else { "no" },
        );
        let conf_path = dir.join("nsd.conf");
        std::fs::write(&conf_path, conf)?;
        let child = ns
            .command("nsd")
            .args(["-d", "-c", conf_path.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nsd (is it installed? run `cargo xtask setup`)")?;
        Ok(Self {
            addr,
            ns_name: ns.name.clone(),
            dir,
            child,
        })
    }

    /// Waits until NSD answers the apex A query, asking from `from`.
    pub fn wait_ready(&self, from: &Namespace) -> Result<()> {
        let addr = self.addr;
        let ready = from.run(move || -> Result<()> {
            let any = if addr.is_ipv6() {
                "[::]:0"
            } else {
                "0.0.0.0:0"
            };
            let socket = UdpSocket::bind(any)?;
            socket.connect(addr)?;
            socket.set_read_timeout(Some(Duration::from_millis(50)))?;
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut id = 0x4000u16;
            let mut buf = [0u8; 4096];
            while Instant::now() < deadline {
                id += 1;
                socket.send(&query(id, ZONE, QTYPE_A))?;
                // Read until this query's answer or a quiet 50 ms: a late
                // answer to an earlier query must not shift the next.
                while let Ok(n) = socket.recv(&mut buf) {
                    if n >= 12 && u16::from_be_bytes([buf[0], buf[1]]) == id {
                        return Ok(());
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            bail!("nsd at {addr} did not answer")
        })?;
        ready.with_context(|| self.log())
    }

    /// NSD's log so far (for failure messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("nsd.log")).unwrap_or_default()
    }

    /// Every process in the replica's namespace: NSD forks a server child
    /// (which answers) and a transfer daemon next to its main process.
    fn pids(&self) -> Vec<i32> {
        let mut pids = crate::netns::pids_in(&self.ns_name);
        let main = self.child.id() as i32;
        if !pids.contains(&main) {
            pids.push(main);
        }
        pids
    }

    fn signal_all(&self, signal: libc::c_int) {
        for pid in self.pids() {
            // SAFETY: plain kill(2) on processes of this replica's namespace.
            unsafe { libc::kill(pid, signal) };
        }
    }

    /// SIGSTOP to every NSD process: the replica stalls; queries queue in
    /// its socket and are answered after `resume`.
    /// Returns once every thread of them has stopped.
    pub fn stop(&self) {
        self.signal_all(libc::SIGSTOP);
        for pid in self.pids() {
            assert!(
                crate::netns::wait_stopped(pid),
                "nsd process {pid} did not stop: {:?}",
                crate::netns::thread_states(pid)
            );
        }
    }

    pub fn resume(&self) {
        self.signal_all(libc::SIGCONT);
    }
}

impl Drop for Nsd {
    fn drop(&mut self) {
        self.resume();
        self.signal_all(libc::SIGKILL);
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub const QTYPE_A: u16 = 1;
pub const QTYPE_TXT: u16 = 16;

/// A DNS query (RD set, class IN, no EDNS) for `name`, type `qtype`.
pub fn query(id: u16, name: &str, qtype: u16) -> Vec<u8> {
    let mut q = Vec::with_capacity(12 + name.len() + 6);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.').filter(|l| !l.is_empty()) {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&1u16.to_be_bytes());
    q
}

/// `dig ARGS` run in `ns`, with its output and how long it took.
pub struct Dig {
    pub output: String,
    pub elapsed: Duration,
    pub success: bool,
}

impl Dig {
    /// The `status:` of the answer's header line, if one was printed.
    pub fn status(&self) -> Option<&str> {
        let at = self.output.find("status: ")? + "status: ".len();
        self.output[at..].split([',', '\n']).next()
    }

    /// The count after `ANSWER: ` in the header line.
    pub fn answer_count(&self) -> Option<u32> {
        let at = self.output.find("ANSWER: ")? + "ANSWER: ".len();
        self.output[at..]
            .split([',', '\n'])
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// Anything dig says when it sees a reply it does not accept: from
    /// another address than it asked, or with another id.
    pub fn complaints(&self) -> Vec<&str> {
        self.output
            .lines()
            .filter(|l| l.contains("unexpected source") || l.contains("ID mismatch"))
            .collect()
    }
}

/// Runs `dig` in `ns` and waits for it.
pub fn dig(ns: &Namespace, args: &[&str]) -> Result<Dig> {
    let start = Instant::now();
    let out = ns
        .command("dig")
        .args(args)
        .output()
        .context("running dig")?;
    Ok(dig_result(out, start.elapsed()))
}

/// Starts `dig` in `ns` without waiting; finish with `wait_dig`.
pub fn spawn_dig(ns: &Namespace, args: &[&str]) -> Result<(Child, Instant)> {
    let child = ns
        .command("dig")
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running dig")?;
    Ok((child, Instant::now()))
}

pub fn wait_dig((child, start): (Child, Instant)) -> Result<Dig> {
    let out = child.wait_with_output()?;
    Ok(dig_result(out, start.elapsed()))
}

fn dig_result(out: Output, elapsed: Duration) -> Dig {
    Dig {
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        elapsed,
        success: out.status.success(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_a_query() {
        let q = query(0xbeef, "a.bc", QTYPE_TXT);
        assert_eq!(
            q,
            b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x01a\x02bc\x00\x00\x10\x00\x01"
        );
    }

    #[test]
    fn the_big_answer_is_above_the_mtu() {
        // Each TXT record: name pointer 2, type/class/ttl/rdlength 10,
        // length byte and string.
        let answer = BIG_TXT_RECORDS * (2 + 10 + 1 + BIG_TXT_LEN);
        assert!(answer > 2 * 1500, "{answer}");
        assert!(answer < 4000, "{answer}");
        assert!(big_txt(3).starts_with("txt03-"));
        assert_eq!(big_txt(3).len(), BIG_TXT_LEN);
    }
}
