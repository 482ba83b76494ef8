//! The stub resolver recipe: `selector run --resolv-conf` makes the
//! nameservers of resolv.conf a group whose primary is the first, the one
//! glibc asks. With real NSD replicas and glibc's own getaddrinfo (through
//! `getent ahosts`, which sends A and AAAA queries in parallel on one
//! connected socket), lookups during a stall of the first nameserver are
//! steered to the second, every answer is right, and glibc never falls back
//! to its own retry on another nameserver (which a dropped reply would
//! cause: glibc only accepts a reply from the address it asked). With IPv4
//! and with IPv6 nameservers.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    thread,
    time::Duration,
};

use selector_testbed::{
    Testbed,
    agent::{spawn_agent, status_json},
    dns::{APEX_A, DNS_PORT, Nsd, ZONE},
    topology::{CLIENT_IFACE, replica_addr, replica_addr6},
};
use selector_user::control::Status;

/// /etc/netns/NS/resolv.conf: what `ip netns exec NS` shows processes as
/// /etc/resolv.conf. Removed on drop.
struct NetnsResolvConf {
    dir: PathBuf,
}

impl NetnsResolvConf {
    fn write(ns: &str, text: &str) -> Self {
        let dir = PathBuf::from("/etc/netns").join(ns);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("resolv.conf"), text).unwrap();
        Self { dir }
    }
}

impl Drop for NetnsResolvConf {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

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
    let _resolv = NetnsResolvConf::write(
        &tb.client.name,
        &format!(
            "nameserver {}\nnameserver {}\nnameserver {}\noptions timeout:1 attempts:2\n",
            nameserver(family, 0),
            nameserver(family, 1),
            nameserver(family, 2)
        ),
    );
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
    let status: Status = status_json(&tb.client, CLIENT_IFACE);
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
    assert_eq!(redirected_to, b[0].stats.redirected_away);
    // glibc asked only the first nameserver: no reply was dropped (which
    // would have sent it to the others after its timeout).
    assert_eq!((b[1].stats.requests, b[2].stats.requests), (0, 0), "{b:#?}");
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success());
}
