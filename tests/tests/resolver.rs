//! The stub resolver recipe: `selector run --resolv-conf` makes the
//! nameservers of resolv.conf a group whose primary is the first, the one
//! glibc asks. With real NSD replicas and glibc's own getaddrinfo (through
//! `getent ahosts`, which sends A and AAAA queries in parallel on one
//! connected socket), lookups during a stall of the first nameserver are
//! steered to the second, every answer is right, and glibc never falls back
//! to its own retry on another nameserver (which a dropped reply would
//! cause: glibc only accepts a reply from the address it asked). With IPv4
//! and with IPv6 nameservers. And an unprivileged local user's junk
//! datagrams to the first nameserver move no lookup off it (issue 21).

use std::{
    net::{IpAddr, SocketAddr, UdpSocket},
    process::{Child, Stdio},
    thread,
    time::{Duration, Instant},
};

use selector_testbed::{
    Testbed,
    agent::{spawn_agent, status_json},
    dns::{APEX_A, DNS_PORT, NetnsResolvConf, Nsd, QTYPE_A, ZONE, query},
    topology::{CLIENT_IFACE, replica_addr, replica_addr6},
};
use selector_user::api::Status;

#[test]
fn lookups_leave_a_stalled_first_nameserver_and_every_answer_is_right() {
    lookups_leave_a_stalled_first_nameserver(Family::V4, "selrv");
}

/// IPv6 nameservers (glibc sends A and AAAA over one connected IPv6
/// socket).
#[test]
fn lookups_leave_a_stalled_first_ipv6_nameserver_and_every_answer_is_right() {
    lookups_leave_a_stalled_first_nameserver(Family::V6, "selrv6");
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}

/// Nameserver i's address.
fn nameserver(family: Family, i: usize) -> IpAddr {
    match family {
        Family::V4 => replica_addr(i).into(),
        Family::V6 => replica_addr6(i).into(),
    }
}

fn lookups_leave_a_stalled_first_nameserver(family: Family, prefix: &str) {
    const LOOKERS: usize = 8;
    const LOOKUPS: usize = 12;
    let tb = match family {
        Family::V4 => Testbed::new(prefix, 3),
        Family::V6 => Testbed::dual_stack(prefix, 3),
    }
    .unwrap();
    let servers: Vec<Nsd> = (0..3)
        .map(|i| {
            let addr = SocketAddr::new(nameserver(family, i), DNS_PORT);
            let nsd = Nsd::start(&tb.replica_ns[i], addr).unwrap();
            nsd.wait_ready(&tb.replica_ns[i]).unwrap();
            nsd
        })
        .collect();
    // glibc's timeout of 2 s, not 1: under a full CI run a reply once took
    // longer than a second, and glibc then asked the next nameserver.
    let _resolv = NetnsResolvConf::write(
        &tb.client.name,
        &format!(
            "nameserver {}\nnameserver {}\nnameserver {}\noptions timeout:2 attempts:2\n",
            nameserver(family, 0),
            nameserver(family, 1),
            nameserver(family, 2)
        ),
    )
    .unwrap();
    let (mut agent, _lines) = spawn_agent(
        &tb.client,
        &[
            "--iface",
            CLIENT_IFACE,
            "--resolv-conf",
            "--threshold",
            "1",
            "--quiet",
        ],
    );

    let lookers: Vec<_> = (0..LOOKERS)
        .map(|_| {
            let mut getent = tb.client.command("getent");
            getent.args(["ahosts", ZONE]);
            thread::spawn(move || {
                (0..LOOKUPS)
                    .map(|_| String::from_utf8_lossy(&getent.output().unwrap().stdout).into_owned())
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    // The first nameserver stalls, again and again, while the lookups run.
    while !lookers.iter().all(|l| l.is_finished()) {
        servers[0].stop();
        thread::sleep(Duration::from_millis(150));
        servers[0].resume();
        thread::sleep(Duration::from_millis(100));
    }
    let answers: Vec<String> = lookers
        .into_iter()
        .flat_map(|l| l.join().unwrap())
        .collect();

    assert_eq!(answers.len(), LOOKERS * LOOKUPS);
    for answer in &answers {
        assert!(
            answer.contains(&APEX_A.to_string()),
            "a wrong or failed lookup: {answer:?}"
        );
    }
    let status = settled_status(&tb);
    let b = &status.backends;
    assert_eq!(status.settings.proto, "dns");
    let group: Vec<SocketAddr> = b.iter().map(|b| b.backend).collect();
    let expected: Vec<SocketAddr> = (0..3)
        .map(|i| SocketAddr::new(nameserver(family, i), DNS_PORT))
        .collect();
    assert_eq!(group, expected, "the group is resolv.conf's nameservers");
    assert!(
        b[0].stats.redirected_away > 0,
        "lookups left the stalled nameserver: {b:#?}"
    );
    let redirected_to: u64 = b[1..].iter().map(|b| b.stats.redirected_to).sum();
    assert_eq!(redirected_to, b[0].stats.redirected_away, "{b:#?}");
    // glibc asked only the first nameserver: no reply was dropped (which
    // would have sent it to the others after its timeout).
    assert_eq!((b[1].stats.requests, b[2].stats.requests), (0, 0), "{b:#?}");
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
}

/// The status once the counters stop moving: a reply or a hedge still on
/// its way when the last lookup returned may be counted between the reads
/// of two backends' counters, which would make their sums disagree.
fn settled_status(tb: &Testbed) -> Status {
    let counters = |s: &Status| -> Vec<(u64, u64, u64)> {
        s.backends
            .iter()
            .map(|b| {
                (
                    b.stats.requests,
                    b.stats.redirected_away,
                    b.stats.redirected_to,
                )
            })
            .collect()
    };
    let mut last: Status = status_json(&tb.client, CLIENT_IFACE);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        thread::sleep(Duration::from_millis(300));
        let now: Status = status_json(&tb.client, CLIENT_IFACE);
        if counters(&now) == counters(&last) {
            return now;
        }
        last = now;
    }
    last
}

/// Issue 21: an unprivileged local user sending datagrams that are no
/// query (2 bytes, or a response's header) to the first nameserver must
/// not make it look loaded. Before, each counted pending for the whole
/// timeout, and with the agent at its defaults nearly every lookup on the
/// host moved off a healthy first nameserver.
#[test]
fn an_unprivileged_users_junk_datagrams_move_no_lookup_off_the_first_nameserver() {
    const LOOKUPS: u16 = 500;
    let tb = Testbed::new("selrj", 3).unwrap();
    let servers: Vec<Nsd> = (0..3)
        .map(|i| {
            let addr = SocketAddr::new(nameserver(Family::V4, i), DNS_PORT);
            let nsd = Nsd::start(&tb.replica_ns[i], addr).unwrap();
            nsd.wait_ready(&tb.replica_ns[i]).unwrap();
            nsd
        })
        .collect();
    let _resolv = NetnsResolvConf::write(
        &tb.client.name,
        &format!(
            "nameserver {}\nnameserver {}\nnameserver {}\n",
            nameserver(Family::V4, 0),
            nameserver(Family::V4, 1),
            nameserver(Family::V4, 2)
        ),
    )
    .unwrap();
    // Defaults: threshold policy, threshold 4, timeout 1 s.
    let (mut agent, _lines) = spawn_agent(
        &tb.client,
        &["--iface", CLIENT_IFACE, "--resolv-conf", "--quiet"],
    );

    let mut junk = JunkSender::start(&tb, nameserver(Family::V4, 0));
    // Lookups start once the junk flows: 100 datagrams seen by egress,
    // tracked (before the fix) or passed as not_request (after).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status: Status = status_json(&tb.client, CLIENT_IFACE);
        let seen = status.backends[0].stats.requests + not_request(&status);
        if seen >= 100 {
            break;
        }
        assert!(Instant::now() < deadline, "only {seen} junk datagrams seen");
        thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(junk.uid(), Some(65534), "the sender is unprivileged");

    let primary = servers[0].addr;
    let answered = tb
        .client
        .run(move || -> std::io::Result<u16> {
            let socket = UdpSocket::bind("0.0.0.0:0")?;
            socket.connect(primary)?;
            socket.set_read_timeout(Some(Duration::from_secs(1)))?;
            let mut buf = [0u8; 1500];
            let mut answered = 0;
            for id in 0..LOOKUPS {
                socket.send(&query(id, ZONE, QTYPE_A))?;
                let deadline = Instant::now() + Duration::from_secs(2);
                while Instant::now() < deadline {
                    let Ok(n) = socket.recv(&mut buf) else { break };
                    // This query's answer, NOERROR with one answer record.
                    if n >= 12 && buf[..2] == id.to_be_bytes() {
                        if buf[3] & 0x0f == 0 && buf[6..8] == [0, 1] {
                            answered += 1;
                        }
                        break;
                    }
                }
            }
            Ok(answered)
        })
        .unwrap()
        .unwrap();
    let still_sending = junk.is_running();
    drop(junk);

    let status: Status = status_json(&tb.client, CLIENT_IFACE);
    let b = &status.backends;
    let not_request = not_request(&status);
    let (tracked, moved) = (b[0].stats.requests, b[0].stats.redirected_away);
    // Junk that was tracked may have been moved too; the rest are lookups.
    let junk_tracked = tracked.saturating_sub(u64::from(LOOKUPS));
    let lookups_moved = moved.saturating_sub(junk_tracked);
    println!(
        "{answered} lookups answered; first nameserver: {tracked} tracked, {moved} redirected \
         away (at least {lookups_moved} lookups); {not_request} passed as not_request"
    );
    assert!(still_sending, "the junk sender ran throughout");
    assert_eq!(answered, LOOKUPS, "every lookup answered: {b:#?}");
    // A healthy first nameserver with one lookup at a time is never over
    // the threshold: nothing moves.
    assert_eq!(
        moved, 0,
        "at least {lookups_moved} lookups moved off a healthy first nameserver: {b:#?}"
    );
    assert_eq!(tracked, u64::from(LOOKUPS), "only the lookups are tracked");
    assert!(
        not_request >= 100,
        "the junk reached egress and passed as not_request: {not_request}"
    );
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
}

/// Datagrams egress passed as no request of the protocol.
fn not_request(status: &Status) -> u64 {
    status
        .passed
        .iter()
        .filter(|p| p.direction == "egress" && p.reason == "not_request")
        .map(|p| p.count)
        .sum()
}

/// bash as uid and gid 65534 (nobody) with no supplementary groups in the
/// client namespace, sending a 2-byte datagram and a response-shaped one
/// (QR=1, a whole header) from a fresh socket (so a fresh source port, a
/// fresh key) to `to`:53, about every millisecond. Killed on drop.
struct JunkSender(Child);

impl JunkSender {
    fn start(tb: &Testbed, to: IpAddr) -> Self {
        let script = format!(
            "exec 3<>/dev/udp/{to}/{DNS_PORT}; \
             while :; do \
               printf '\\xbe\\xef' >/dev/udp/{to}/{DNS_PORT}; \
               printf '\\xbe\\xef\\x81\\x80\\x00\\x01\\x00\\x01\\x00\\x00\\x00\\x00' >/dev/udp/{to}/{DNS_PORT}; \
               read -t 0.001 -u 3; \
             done"
        );
        // `read -t` on a socket nothing answers is the pause: no process
        // per datagram, so the sender runs as fast as bash on a busy host.
        let child = tb
            .client
            .command("setpriv")
            .args([
                "--reuid",
                "65534",
                "--regid",
                "65534",
                "--clear-groups",
                "bash",
                "-c",
                &script,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("setpriv");
        Self(child)
    }

    /// The real uid of the process (bash, after the execs of `ip netns
    /// exec` and setpriv).
    fn uid(&self) -> Option<u32> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.0.id())).ok()?;
        let line = status.lines().find(|l| l.starts_with("Uid:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    fn is_running(&mut self) -> bool {
        matches!(self.0.try_wait(), Ok(None))
    }
}

impl Drop for JunkSender {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
