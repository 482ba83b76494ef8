//! `selector run --config FILE` and `selector reload`/SIGHUP with real
//! memcached replicas: the file's settings and a flag over them, tunables
//! and members changed in place, a member removed while reads to it (one
//! redirected there, one sent there) are stalled in flight still answered
//! and counted, bad files refused with their line and key while the
//! running configuration stays.

use std::{
    fs,
    io::BufRead as _,
    net::SocketAddrV4,
    path::PathBuf,
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use selector_testbed::{
    MemcachedClient, Testbed,
    agent::{self, selector_binary},
    memcached::{key_for, parse_get_response, value_for},
    netns::Namespace,
    topology::CLIENT_IFACE,
};
use serde_json::Value;

/// Files in /etc/netns/NS/ that `ip netns exec NS` mounts over /etc/:
/// host names for the agent's resolver, and a name server on the
/// namespace's own loopback (nothing listens: other names fail at once).
struct NetnsEtc(PathBuf);

impl NetnsEtc {
    fn new(ns: &Namespace, hosts: &str) -> Self {
        let dir = PathBuf::from(format!("/etc/netns/{}", ns.name));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("hosts"), format!("127.0.0.1 localhost\n{hosts}")).unwrap();
        fs::write(
            dir.join("resolv.conf"),
            "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n",
        )
        .unwrap();
        Self(dir)
    }
}

impl Drop for NetnsEtc {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A config file in a directory of its own, removed at the end.
struct ConfigFile {
    dir: PathBuf,
    path: PathBuf,
}

impl ConfigFile {
    fn new(tag: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("selector-config-{tag}-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("selector.toml");
        Self { dir, path }
    }

    fn write(&self, text: &str) {
        fs::write(&self.path, text).unwrap();
    }

    fn arg(&self) -> &str {
        self.path.to_str().unwrap()
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The config file's text: `top` lines, then one group "users".
fn config(top: &str, members: &[&str]) -> String {
    let members: Vec<String> = members.iter().map(|m| format!("\"{m}\"")).collect();
    format!(
        "iface = \"{CLIENT_IFACE}\"\nquiet = true\ntimeout = 1000\n{top}\n[[group]]\nname = \"users\"\nmembers = [{}]\n",
        members.join(", ")
    )
}

/// The agent's stdout lines, read on a thread of their own.
struct Output(mpsc::Receiver<String>);

impl Output {
    fn of(lines: agent::Agent) -> (agent::AgentProcess, Self) {
        let (child, lines) = lines;
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        (child, Self(rx))
    }

    /// The first line (from now) that starts with `prefix`.
    fn expect(&self, prefix: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.0.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => {}
                Err(_) => panic!("no line starting with '{prefix}'"),
            }
        }
    }
}

fn status(tb: &Testbed) -> Value {
    agent::status_json(&tb.client, CLIENT_IFACE)
}

fn backend(status: &Value, addr: SocketAddrV4) -> Option<Value> {
    status["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["backend"] == addr.to_string())
        .cloned()
}

fn backends(status: &Value) -> Vec<String> {
    status["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["backend"].as_str().unwrap().to_string())
        .collect()
}

fn reload(tb: &Testbed) -> (i32, String) {
    agent::run_selector(&tb.client, &["reload", "--iface", CLIENT_IFACE])
}

/// Waits until backend `addr` has `pending` requests pending.
fn wait_pending(tb: &Testbed, addr: SocketAddrV4, pending: u64) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let s = status(tb);
        if backend(&s, addr).is_some_and(|b| b["pending"] == pending) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{addr} never had {pending} pending: {s}"
        );
        thread::sleep(Duration::from_millis(10));
    }
}

/// Sends one get of key `i` to `to` on its own connected socket and waits
/// up to 5 s for the value: true if the right value came back.
fn read(tb: &Testbed, to: SocketAddrV4, i: usize) -> thread::JoinHandle<bool> {
    tb.client
        .spawn(move || {
            let client = MemcachedClient::connect(to).unwrap();
            let reply = client.request(
                format!("get {}\r\n", key_for(i)).as_bytes(),
                Duration::from_secs(5),
            );
            reply.is_ok_and(|body| parse_get_response(&body) == Some(value_for(i).as_bytes()))
        })
        .unwrap()
}

#[test]
fn config_file_reload_and_removal_with_requests_in_flight() {
    let mut tb = Testbed::new("selcf", 4).unwrap();
    tb.start_memcached().unwrap();
    let r = tb.replica_endpoints();
    selector_testbed::preload(&tb.client, &r, 10).unwrap();
    let _etc = NetnsEtc::new(&tb.client, &format!("{} replica-c.test\n", r[2].ip()));
    let file = ConfigFile::new("main");
    let (r0, r1, r3) = (r[0].to_string(), r[1].to_string(), r[3].to_string());
    let named = "replica-c.test:11211";
    file.write(&config(
        "policy = \"observe\"\nthreshold = 3\nmax-pending = 50\ngrace = 300\n",
        &[&r0, &r1, named],
    ));

    // The file's settings, a host-name member resolved, a flag over the
    // file. `first`: a read leaving r0 below goes to r1.
    let (mut child, out) = Output::of(agent::spawn_agent(
        &tb.client,
        &[
            "--config",
            file.arg(),
            "--timeout",
            "2000",
            "--tie-break",
            "first",
        ],
    ));
    let s = status(&tb);
    assert_eq!(s["settings"]["policy"], "observe", "{s}");
    assert_eq!(s["settings"]["threshold"], 3, "{s}");
    assert_eq!(s["settings"]["max_pending"], 50, "{s}");
    assert_eq!(s["settings"]["timeout_ms"], 2000, "the flag wins: {s}");
    assert_eq!(s["settings"]["grace_ms"], 300, "{s}");
    assert_eq!(backends(&s), vec![r0.clone(), r1.clone(), r[2].to_string()]);

    // Tunables change in place; the flag still wins over the file.
    file.write(&config(
        "policy = \"absolute\"\nthreshold = 2\ngrace = 300\n",
        &[&r0, &r1, named],
    ));
    let (code, msg) = reload(&tb);
    assert_eq!(code, 0, "{msg}");
    assert!(msg.contains("policy absolute, threshold 2,"), "{msg}");
    assert!(msg.contains("groups unchanged"), "{msg}");
    let s = status(&tb);
    assert_eq!(s["settings"]["policy"], "absolute", "{s}");
    assert_eq!(s["settings"]["max_pending"], 0, "{s}");
    assert_eq!(s["settings"]["timeout_ms"], 2000, "{s}");

    // A member added: it takes the next position and its reads are tracked.
    file.write(&config(
        "policy = \"absolute\"\nthreshold = 2\ngrace = 300\n",
        &[&r0, &r1, named, &r3],
    ));
    let (code, msg) = reload(&tb);
    assert_eq!(
        (code, msg.contains(&format!("added {r3}"))),
        (0, true),
        "{msg}"
    );
    assert!(read(&tb, r[3], 1).join().unwrap());
    let s = status(&tb);
    let added = backend(&s, r[3]).unwrap();
    assert_eq!(added["position"], 3, "{s}");
    assert_eq!(
        (added["requests"].as_u64(), added["completed"].as_u64()),
        (Some(1), Some(1)),
        "{s}"
    );

    // r0 and r1 stall. Reads to r0: the first two wait there, the third
    // is redirected to r1 (absolute, threshold 2); one more is sent to r1
    // itself. Then r1 is removed while both wait on it.
    tb.replicas[0].stop();
    tb.replicas[1].stop();
    let mut reads = Vec::new();
    for (i, (to, pending_at, pending)) in [
        (r[0], r[0], 1),
        (r[0], r[0], 2),
        (r[0], r[1], 1),
        (r[1], r[1], 2),
    ]
    .into_iter()
    .enumerate()
    {
        reads.push(read(&tb, to, i));
        wait_pending(&tb, pending_at, pending);
    }
    file.write(&config(
        "policy = \"absolute\"\nthreshold = 2\ngrace = 300\n",
        &[&r0, named, &r3],
    ));
    let (code, msg) = reload(&tb);
    assert_eq!(code, 0, "{msg}");
    assert!(
        msg.contains(&format!("removing (until their requests finish) {r1}")),
        "{msg}"
    );
    let s = status(&tb);
    let removed = backend(&s, r[1]).expect("listed until its requests finish");
    assert_eq!(removed["pending"], 2, "{s}");
    assert!(
        s["drained"]
            .as_array()
            .unwrap()
            .contains(&Value::from(r1.clone())),
        "{s}"
    );
    // A read to the removed address is no longer the selector's.
    let requests_before = removed["requests"].as_u64().unwrap();
    tb.replicas[1].resume();
    assert!(read(&tb, r[1], 5).join().unwrap());
    tb.replicas[0].resume();
    for (i, r) in reads.into_iter().enumerate() {
        assert!(r.join().unwrap(), "read {i} got its value");
    }
    let s = status(&tb);
    let removed = backend(&s, r[1]).expect("retires only after timeout + grace");
    assert_eq!(removed["requests"].as_u64(), Some(requests_before), "{s}");
    assert_eq!(
        removed["completed"].as_u64(),
        Some(2),
        "completed, not expired: {s}"
    );
    assert_eq!(removed["expired"].as_u64(), Some(0), "{s}");
    assert_eq!(removed["redirected_to"].as_u64(), Some(1), "{s}");
    for b in s["backends"].as_array().unwrap() {
        assert_eq!(b["pending"], 0, "{s}");
    }
    // Then it is forgotten, and the others keep their positions.
    let line = out.expect("selector: removed");
    assert!(line.contains(&r1), "{line}");
    let s = status(&tb);
    assert_eq!(backends(&s), vec![r0.clone(), r[2].to_string(), r3.clone()]);
    assert_eq!(backend(&s, r[3]).unwrap()["position"], 3, "{s}");
    assert_eq!(
        backend(&s, r[0]).unwrap()["completed"].as_u64(),
        Some(2),
        "{s}"
    );

    // SIGHUP applies a change too.
    file.write(&config(
        "policy = \"threshold\"\nthreshold = 6\ngrace = 300\n",
        &[&r0, named, &r3],
    ));
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    let line = out.expect("selector: reload");
    assert!(line.contains("policy threshold, threshold 6,"), "{line}");
    assert_eq!(status(&tb)["settings"]["threshold"], 6);

    // Bad files are refused, by `reload` and by SIGHUP, with the line and
    // the key; what runs stays.
    for (text, expect) in [
        (
            config("policy = \"absolute\"\nthreshold = 0\n", &[&r0]),
            format!("{}:5: threshold: must be at least 1", file.arg()),
        ),
        (
            config("colour = \"blue\"\n", &[&r0]),
            format!("{}:4:1: colour: unknown field", file.arg()),
        ),
        (
            config("", &[&r0, "nosuch.test:11211"]),
            format!(
                "{}:7: group 1 members: 'nosuch.test:11211' does not resolve",
                file.arg()
            ),
        ),
        (
            config("ingress = \"xdp\"\n", &[&r0]),
            "ingress auto -> xdp cannot change while the agent runs".to_string(),
        ),
    ] {
        file.write(&text);
        let (code, msg) = reload(&tb);
        assert_eq!(code, 1, "{msg}");
        assert_eq!(msg.trim_end().lines().count(), 1, "{msg}");
        assert!(
            msg.starts_with("error: reload refused, running configuration kept: "),
            "{msg}"
        );
        assert!(msg.contains(&expect), "expected '{expect}' in: {msg}");
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGHUP) };
    let line = out.expect("selector: reload");
    assert!(
        line.starts_with("selector: reload refused, running configuration kept:"),
        "{line}"
    );
    let s = status(&tb);
    assert_eq!(s["settings"]["policy"], "threshold", "{s}");
    assert_eq!(s["settings"]["threshold"], 6, "{s}");
    // `auto` on a veth: TC ingress, in force whatever the file says.
    assert_eq!(s["settings"]["ingress"], "tc", "{s}");
    assert_eq!(backends(&s), vec![r0.clone(), r[2].to_string(), r3.clone()]);
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);

    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    tb.replicas.clear();
}

/// A member added by a reload gets the hedge delay in force, like the
/// others (it was 0, hedging its reads at once, until the next change).
#[test]
fn a_reload_gives_an_added_member_the_hedge_delay() {
    let mut tb = Testbed::new("selch", 3).unwrap();
    tb.start_memcached().unwrap();
    let r = tb.replica_endpoints();
    let _etc = NetnsEtc::new(&tb.client, "");
    let file = ConfigFile::new("hedge");
    let (r0, r1, r2) = (r[0].to_string(), r[1].to_string(), r[2].to_string());
    file.write(&config("hedge-after = \"2\"\n", &[&r0, &r1]));
    let (mut child, _out) = Output::of(agent::spawn_agent(&tb.client, &["--config", file.arg()]));
    let delay = |s: &Value, addr| backend(s, addr).unwrap()["hedge_delay_ns"].as_u64();
    let s = status(&tb);
    assert_eq!(delay(&s, r[1]), Some(2_000_000), "{s}");

    file.write(&config("hedge-after = \"2\"\n", &[&r0, &r1, &r2]));
    let (code, msg) = reload(&tb);
    assert_eq!(
        (code, msg.contains(&format!("added {r2}"))),
        (0, true),
        "{msg}"
    );
    let s = status(&tb);
    assert_eq!(delay(&s, r[2]), Some(2_000_000), "{s}");
    assert_eq!(delay(&s, r[0]), Some(2_000_000), "{s}");

    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    tb.replicas.clear();
}

/// A member given a retired member's position by a reload gets the hedge
/// copies sent to that position: to its own address, not the old one's
/// (the hedge thread knew only the addresses of the start).
#[test]
fn hedges_to_a_reused_position_go_to_the_new_member() {
    let mut tb = Testbed::new("selcr", 3).unwrap();
    tb.start_memcached().unwrap();
    let r = tb.replica_endpoints();
    selector_testbed::preload(&tb.client, &r, 10).unwrap();
    let _etc = NetnsEtc::new(&tb.client, "");
    let file = ConfigFile::new("reuse");
    let (r0, r1, r2) = (r[0].to_string(), r[1].to_string(), r[2].to_string());
    let top = "hedge-after = \"2\"\ngrace = 100\n";
    file.write(&config(top, &[&r0, &r1]));
    let (mut child, out) = Output::of(agent::spawn_agent(&tb.client, &["--config", file.arg()]));
    file.write(&config(top, &[&r0]));
    let (code, msg) = reload(&tb);
    assert_eq!(code, 0, "{msg}");
    let line = out.expect("selector: removed");
    assert!(line.contains(&r1), "{line}");
    file.write(&config(top, &[&r0, &r2]));
    let (code, msg) = reload(&tb);
    assert_eq!(code, 0, "{msg}");
    assert_eq!(backend(&status(&tb), r[2]).unwrap()["position"], 1);

    // The primary stalls: the read's hedge goes to position 1, and only
    // r2's reply can answer it (r1's is no member's).
    tb.replicas[0].stop();
    let answered = read(&tb, r[0], 1).join().unwrap();
    tb.replicas[0].resume();
    let s = status(&tb);
    assert!(answered, "the hedge was answered: {s}");
    let new = backend(&s, r[2]).unwrap();
    assert_eq!(
        (new["hedges_sent"].as_u64(), new["hedges_won"].as_u64()),
        (Some(1), Some(1)),
        "{s}"
    );

    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    tb.replicas.clear();
}

/// Members added by a reload, of a family the agent did not start with:
/// an agent started with an IPv4 group only is reloaded with an IPv6
/// group as well; a read to the stalled primary of the new group gets its
/// hedge copy sent to the added member over IPv6, and that copy answers
/// (the hedge thread once knew only the start's addresses and families).
#[test]
fn hedges_go_to_members_a_reload_added_in_a_new_family() {
    let mut tb = Testbed::dual_stack("selc6", 3).unwrap();
    tb.start_memcached().unwrap();
    let r = tb.replica_endpoints();
    let r6 = tb.replica_endpoints6();
    selector_testbed::preload(&tb.client, &r, 10).unwrap();
    selector_testbed::preload(&tb.client, &r6, 10).unwrap();
    let _etc = NetnsEtc::new(&tb.client, "");
    let file = ConfigFile::new("family");
    let top = "hedge-after = \"2\"\ngrace = 100\n";
    file.write(&config(top, &[&r[0].to_string(), &r[1].to_string()]));
    let (mut child, _out) = Output::of(agent::spawn_agent(&tb.client, &["--config", file.arg()]));
    let v6_group = format!(
        "\n[[group]]\nname = \"users6\"\nmembers = [\"{}\", \"{}\"]\n",
        r6[0], r6[2]
    );
    file.write(&(config(top, &[&r[0].to_string(), &r[1].to_string()]) + &v6_group));
    let (code, msg) = reload(&tb);
    assert_eq!(code, 0, "{msg}");
    let s = status(&tb);
    assert!(
        backends(&s).contains(&r6[2].to_string()),
        "the added member: {s}"
    );

    // The primary (both families: one memcached) stalls: the IPv6 read's
    // hedge goes to the added member, whose reply answers it.
    tb.replicas[0].stop();
    let to = r6[0];
    let answered = tb
        .client
        .spawn(move || {
            let client = MemcachedClient::connect(to).unwrap();
            let reply = client.request(
                format!("get {}\r\n", key_for(1)).as_bytes(),
                Duration::from_secs(5),
            );
            reply.is_ok_and(|body| parse_get_response(&body) == Some(value_for(1).as_bytes()))
        })
        .unwrap()
        .join()
        .unwrap();
    tb.replicas[0].resume();
    let s = status(&tb);
    assert!(answered, "the hedge was answered: {s}");
    let added = s["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["backend"] == r6[2].to_string())
        .cloned()
        .unwrap();
    assert_eq!(
        (added["hedges_sent"].as_u64(), added["hedges_won"].as_u64()),
        (Some(1), Some(1)),
        "{s}"
    );

    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    tb.replicas.clear();
}

#[test]
fn a_bad_file_at_start_names_its_line_and_key_and_nothing_runs() {
    let tb = Testbed::new("selcb", 0).unwrap();
    let _etc = NetnsEtc::new(&tb.client, "");
    let file = ConfigFile::new("start");
    for (text, expect) in [
        (
            config("threshold = \"two\"\n", &["10.77.0.10:11211"]),
            ":4:13: threshold: invalid type: string \"two\", expected u32".to_string(),
        ),
        (
            config("mark = 3\n", &["10.77.0.10:11211"]),
            ":4: mark: must have exactly one bit set".to_string(),
        ),
        (
            config("", &["10.77.0.10:11211", "nosuch.test:11211"]),
            ":7: group 1 members: 'nosuch.test:11211' does not resolve".to_string(),
        ),
        (
            config("", &["10.77.0.10:11211", "10.77.0.10:11211"]),
            ":7: group 1 members: backend 10.77.0.10:11211 appears twice in group 1".to_string(),
        ),
    ] {
        file.write(&text);
        let (code, msg) = agent::run_selector(&tb.client, &["run", "--config", file.arg()]);
        assert_eq!(code, 1, "{msg}");
        assert_eq!(msg.trim_end().lines().count(), 1, "{msg}");
        assert!(msg.starts_with(&format!("error: {}", file.arg())), "{msg}");
        assert!(msg.contains(&expect), "expected '{expect}' in: {msg}");
    }
    // A flag over a bad value makes the file good.
    file.write(&config("mark = 3\n", &["10.77.0.10:11211"]));
    let mut child = tb
        .client
        .command(selector_binary().to_str().unwrap())
        .args([
            "run",
            "--config",
            file.arg(),
            "--mark",
            "0x10",
            "--duration",
            "0.2",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    // Read on to the end: a closed pipe would fail the agent's next print.
    lines.for_each(drop);
    assert!(first.contains("mark 0x00000010"), "{first}");
    assert!(child.wait().unwrap().success());
    // Without --config there is nothing to reload.
    let (mut child, _lines) = agent::spawn_agent(
        &tb.client,
        &[
            "--iface",
            CLIENT_IFACE,
            "--group",
            "10.77.0.10:11211",
            "--quiet",
        ],
    );
    let (code, msg) = agent::run_selector(&tb.client, &["reload", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 1, "{msg}");
    assert!(
        msg.contains("started without --config: nothing to reload"),
        "{msg}"
    );
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}

/// `selector check` as `nobody` (no capability at all): the file is
/// checked as `run` checks it, bad values and unknown keys are refused
/// naming the file and line, and nothing is attached. With `--host` it
/// also checks the kernel, the capabilities and the interface.
#[test]
fn check_validates_a_file_as_run_does_unprivileged_and_attaches_nothing() {
    let tb = Testbed::new("selck", 0).unwrap();
    let _etc = NetnsEtc::new(&tb.client, "");
    let file = ConfigFile::new("check");
    let selector = selector_binary();
    let run = |nobody: bool, args: &[&str]| {
        let mut command = if nobody {
            let mut c = tb.client.command("setpriv");
            c.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
                .arg(&selector);
            c
        } else {
            tb.client.command(selector.to_str().unwrap())
        };
        let out = command.args(args).output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let members = ["10.77.0.10:11211", "10.77.0.11:11211"];

    file.write(&config("threshold = 2\n", &members));
    let (code, out, err) = run(true, &["check", "--config", file.arg()]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        format!(
            "{}: valid: iface {CLIENT_IFACE}, 1 group, 2 backends, policy threshold, threshold 2, max-pending 0, max-pending-client 0, on-overload pass, budget 1 ms, tie-break random, avoid-slow on, proto memcached, timeout 1000 ms, auto ingress (tc here; auto: a veth device, no native XDP worth its cost), not pinned (the programs go with the agent)\n",
            file.arg()
        )
    );
    assert_eq!(
        err,
        "not checked: the kernel version and the capabilities (--host checks them); the routes to the members and their next hops (run resolves them)\n"
    );
    // A group of one member is valid, and warned of.
    file.write(&config("", &members[..1]));
    let (code, _, err) = run(true, &["check", "--config", file.arg()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.starts_with("warning: group 1 has one member (10.77.0.10:11211): its reads are counted but can never be moved\n"),
        "{err}"
    );
    // An interface that is not there is refused, as run refuses it.
    file.write(&config("", &members));
    let (code, _, err) = run(true, &["check", "--config", file.arg(), "--iface", "eth9"]);
    assert_eq!(
        (code, err.as_str()),
        (1, "error: interface 'eth9' not found\n")
    );

    // `config` puts the lines given on line 4.
    for (top, expect) in [
        ("threshold = 0\n", ":4: threshold: must be at least 1"),
        (
            "policy = \"fastest\"\n",
            ":4:10: policy: unknown variant `fastest`, expected one of `threshold`",
        ),
        (
            "colour = \"blue\"\n",
            ":4:1: colour: unknown field `colour`",
        ),
    ] {
        file.write(&config(top, &members));
        let (code, out, err) = run(true, &["check", "--config", file.arg()]);
        assert_eq!((code, out.as_str()), (1, ""), "{top}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        let prefix = format!("error: {}{expect}", file.arg());
        assert!(err.starts_with(&prefix), "expected '{prefix}' in: {err}");
    }
    // A flag is checked with the file, as with run.
    file.write(&config("", &members));
    let (code, _, err) = run(true, &["check", "--config", file.arg(), "--mark", "3"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("--mark must have exactly one bit set"),
        "{err}"
    );

    // --host: what run checks on the host before it attaches.
    let (code, _, err) = run(true, &["check", "--config", file.arg(), "--host"]);
    assert_eq!(code, 1);
    assert!(err.contains("missing capability"), "{err}");
    let (code, out, err) = run(false, &["check", "--config", file.arg(), "--host"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(": valid (and this host): "), "{out}");
    let (code, _, err) = run(
        false,
        &[
            "check",
            "--config",
            file.arg(),
            "--host",
            "--iface",
            "nosuch0",
        ],
    );
    assert_eq!(code, 1);
    assert!(err.contains("interface 'nosuch0' not found"), "{err}");

    assert_eq!(
        agent::attached(&tb.client, CLIENT_IFACE),
        agent::Attached::NOTHING
    );
}
