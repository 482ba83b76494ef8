//! The agent keeps the backends' next hops resolved through rtnetlink
//! (managed neighbour entries), sends no traffic of its own to do it,
//! leaves static entries alone, and deletes what it marked when it exits.
//! Redirected reads go straight to the known next hop (no second pass) and
//! follow a neighbour that changes its address.

use std::time::{Duration, Instant};

use selector_testbed::{
    LoadSpec, Testbed,
    agent::{run_selector, spawn_agent, status_json},
    bpffs::Bpffs,
    preload, run_load,
    topology::{CLIENT_IFACE, replica_addr},
    wait_for,
};
use selector_user::api::Status;

/// The destination Ethernet address the attached egress program has for
/// backend `backend` in its `NEXT_HOPS` map (what the agent published),
/// read through the program's own map ids.
fn published_mac(tb: &Testbed, backend: u32) -> Option<[u8; 6]> {
    use aya::{
        maps::{Array, Map, MapData, MapInfo},
        programs::{SchedClassifier, TcAttachType},
    };
    use selector_common::{NextHopMac, names};
    tb.client
        .run(move || {
            let (_, programs) =
                SchedClassifier::query_tcx(CLIENT_IFACE, TcAttachType::Egress).ok()?;
            let ids = programs
                .iter()
                .filter_map(|p| p.map_ids().ok().flatten())
                .flatten();
            for id in ids {
                if MapInfo::from_id(id).ok()?.name_as_str() != Some(names::NEXT_HOPS) {
                    continue;
                }
                let map: Array<_, NextHopMac> =
                    Array::try_from(Map::Array(MapData::from_id(id).ok()?)).ok()?;
                return map.get(&backend, 0).ok().map(|hop| hop.dst);
            }
            None
        })
        .unwrap()
}

/// `ip neigh show` in the client namespace, one line per entry.
fn neighbours(tb: &Testbed) -> Vec<String> {
    let out = tb
        .client
        .ip(&["neigh", "show", "dev", CLIENT_IFACE])
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

fn entry(entries: &[String], addr: std::net::Ipv4Addr) -> Option<String> {
    let prefix = format!("{addr} ");
    entries.iter().find(|l| l.starts_with(&prefix)).cloned()
}

fn mac_of(tb: &Testbed, replica: usize) -> String {
    let out = tb.replica_ns[replica]
        .exec("cat", &[&format!("/sys/class/net/{CLIENT_IFACE}/address")])
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[test]
fn next_hops_are_kept_resolved_without_traffic_of_our_own() {
    let tb = Testbed::new("seln", 3).unwrap();
    // A backend behind a router: its next hop is replica 2's address.
    let routed = "10.78.0.5:11211";
    tb.client
        .ip(&[
            "route",
            "add",
            "10.78.0.0/24",
            "via",
            &replica_addr(2).to_string(),
        ])
        .unwrap();
    // The administrator pinned replica 1's address: not ours to touch.
    let pinned = mac_of(&tb, 1);
    tb.client
        .ip(&[
            "neigh",
            "add",
            &replica_addr(1).to_string(),
            "lladdr",
            &pinned,
            "nud",
            "permanent",
            "dev",
            CLIENT_IFACE,
        ])
        .unwrap();
    let udp_sent = tb.client.snmp("Udp", "OutDatagrams").unwrap();
    let group = format!("{}:11211,{}:11211", replica_addr(0), replica_addr(1));
    let (mut child, _lines) = spawn_agent(
        &tb.client,
        &[
            "--iface",
            CLIENT_IFACE,
            "--group",
            &group,
            "--group",
            routed,
            "--quiet",
        ],
    );

    let entries = neighbours(&tb);
    for (addr, replica) in [(replica_addr(0), 0), (replica_addr(2), 2)] {
        let line =
            entry(&entries, addr).unwrap_or_else(|| panic!("no entry for {addr}: {entries:?}"));
        assert!(line.contains("managed"), "{line}");
        assert!(line.contains(&mac_of(&tb, replica)), "resolved: {line}");
    }
    let static_line = entry(&entries, replica_addr(1)).unwrap();
    assert!(
        static_line.contains("PERMANENT") && !static_line.contains("managed"),
        "{static_line}"
    );
    assert_eq!(
        tb.client.snmp("Udp", "OutDatagrams").unwrap(),
        udp_sent,
        "the agent sends no datagrams of its own"
    );

    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    let entries = neighbours(&tb);
    assert!(
        entries.iter().all(|l| !l.contains("managed")),
        "managed entries are deleted at exit: {entries:?}"
    );
    assert!(
        entry(&entries, replica_addr(1)).is_some_and(|l| l.contains("PERMANENT")),
        "the static entry stays: {entries:?}"
    );
}

/// `selector detach` deletes the managed entries an agent left for its
/// members' next hops: a pinned agent's (its exit keeps them for the
/// programs that steer on), by `detach --pin` after a SIGTERM and by
/// `detach` without --pin, which cuts the links, after a SIGKILL; and an
/// unpinned agent's killed outright. Other entries stay.
#[test]
fn detach_deletes_the_managed_entries_an_agent_left() {
    let tb = Testbed::new("selnd", 3).unwrap();
    let group = format!("{}:11211,{}:11211", replica_addr(0), replica_addr(1));
    // Not a member: an entry the kernel learnt as usual, to stay as it is.
    let other = replica_addr(2);
    tb.client
        .run(move || {
            let socket = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
            socket.send_to(b"x", (other, 9)).unwrap();
        })
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !entry(&neighbours(&tb), other).is_some_and(|l| l.contains("lladdr")) {
        assert!(Instant::now() < deadline, "{:?}", neighbours(&tb));
        std::thread::sleep(Duration::from_millis(20));
    }
    let managed = |tb: &Testbed| -> Vec<String> {
        let entries = neighbours(tb);
        [replica_addr(0), replica_addr(1)]
            .into_iter()
            .filter_map(|a| entry(&entries, a))
            .filter(|l| l.contains("managed"))
            .collect()
    };
    let bpffs = Bpffs::mount();
    let pin = bpffs.arg();
    for signal in [libc::SIGTERM, libc::SIGKILL] {
        let args = [
            "--iface",
            CLIENT_IFACE,
            "--group",
            &group,
            "--quiet",
            "--pin",
            &pin,
        ];
        let (mut child, lines) = spawn_agent(&tb.client, &args);
        assert_eq!(managed(&tb).len(), 2, "{:?}", neighbours(&tb));
        unsafe { libc::kill(child.id() as i32, signal) };
        child.wait().unwrap();
        drop(lines);
        assert_eq!(managed(&tb).len(), 2, "left behind: {:?}", neighbours(&tb));
        let mut detach = vec!["detach", "--iface", CLIENT_IFACE];
        if signal == libc::SIGTERM {
            detach.extend(["--pin", &pin]);
        }
        let (code, out) = run_selector(&tb.client, &detach);
        assert_eq!(code, 0, "{out}");
        assert!(
            managed(&tb).is_empty(),
            "signal {signal}: detach deletes them: {:?}",
            neighbours(&tb)
        );
        assert!(
            entry(&neighbours(&tb), other).is_some_and(|l| !l.contains("managed")),
            "signal {signal}: {:?}",
            neighbours(&tb)
        );
        if signal == libc::SIGKILL {
            // The pins of the killed agent.
            let (code, out) = run_selector(
                &tb.client,
                &["detach", "--iface", CLIENT_IFACE, "--pin", &pin],
            );
            assert_eq!(code, 0, "{out}");
        }
    }
    // An unpinned agent killed outright: its links went with it, its
    // entries stayed; they carry the agent's protocol tag, which `detach`
    // finds without any map.
    let args = ["--iface", CLIENT_IFACE, "--group", &group, "--quiet"];
    let (mut child, lines) = spawn_agent(&tb.client, &args);
    assert_eq!(managed(&tb).len(), 2, "{:?}", neighbours(&tb));
    child.kill().unwrap();
    child.wait().unwrap();
    drop(lines);
    assert_eq!(managed(&tb).len(), 2, "left behind: {:?}", neighbours(&tb));
    let (code, out) = run_selector(&tb.client, &["detach", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 0, "{out}");
    assert!(managed(&tb).is_empty(), "{:?}", neighbours(&tb));
    assert!(
        entry(&neighbours(&tb), other).is_some_and(|l| !l.contains("managed")),
        "{:?}",
        neighbours(&tb)
    );
    // Nothing left at all: said so, as before.
    let (code, out) = run_selector(&tb.client, &["detach", "--iface", CLIENT_IFACE]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("nothing of the selector"), "{out}");
}

/// Reads at 2000/s from the primary for `secs`, which stalls for 60 ms in
/// the middle; returns the reads lost.
fn stalled_load(tb: &Testbed, secs: f64) -> u64 {
    let spec = LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: 2000,
        duration: Duration::from_secs_f64(secs),
        keys: 100,
        drain: Duration::from_millis(500),
    };
    let load = tb.client.spawn(move || run_load(&spec)).unwrap();
    std::thread::sleep(Duration::from_secs_f64(secs / 2.0));
    tb.replicas[0].stop();
    std::thread::sleep(Duration::from_millis(60));
    tb.replicas[0].resume();
    load.join().unwrap().unwrap().lost()
}

/// (redirected to, of those sent straight to the next hop), over the replicas.
fn redirects(tb: &Testbed) -> (u64, u64) {
    let status: Status = status_json(&tb.client, CLIENT_IFACE);
    status.backends[1..].iter().fold((0, 0), |(to, direct), b| {
        (
            to + b.stats.redirected_to,
            direct + b.stats.redirected_direct,
        )
    })
}

#[test]
fn redirects_go_straight_to_the_next_hop_and_follow_its_change() {
    let mut tb = Testbed::new("selm", 3).unwrap();
    tb.start_memcached().unwrap();
    preload(&tb.client, &tb.replica_endpoints(), 100).unwrap();
    let group = tb.group_arg();
    let (mut child, _lines) = spawn_agent(
        &tb.client,
        &[
            "--iface",
            CLIENT_IFACE,
            "--group",
            &group,
            "--threshold",
            "1",
            // Every redirect to replica 1, whose address changes below.
            "--tie-break",
            "first",
            "--quiet",
        ],
    );
    assert_eq!(stalled_load(&tb, 1.0), 0);
    let (to, direct) = redirects(&tb);
    assert!(to > 0, "the stall moved reads");
    assert_eq!(direct, to, "every redirect went straight to its next hop");

    // Replica 1 takes a new Ethernet address and announces it (arp_notify:
    // a gratuitous ARP); the client's neighbour entry follows, and so must
    // the selector, or its redirects would go to the old address and be
    // lost.
    let replica = &tb.replica_ns[1];
    replica
        .exec(
            "sysctl",
            &["-qw", &format!("net.ipv4.conf.{CLIENT_IFACE}.arp_notify=1")],
        )
        .unwrap();
    let new_mac = "02:77:00:00:01:01";
    replica
        .ip(&["link", "set", CLIENT_IFACE, "address", new_mac])
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !entry(&neighbours(&tb), replica_addr(1)).is_some_and(|l| l.contains(new_mac)) {
        assert!(
            Instant::now() < deadline,
            "the client never learnt {new_mac}: {:?}",
            neighbours(&tb)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Until the agent has published the new address: on the kernel's
    // announcement of the change (its backstop re-read is 5 s away, after
    // this wait gives up).
    let mac: [u8; 6] = [0x02, 0x77, 0x00, 0x00, 0x01, 0x01];
    let published = wait_for(Duration::from_secs(3), || {
        published_mac(&tb, 1) == Some(mac)
    });
    assert!(
        published,
        "the agent never published {new_mac}: {:02x?}",
        published_mac(&tb, 1)
    );
    assert_eq!(
        stalled_load(&tb, 1.0),
        0,
        "redirects follow the new address"
    );
    let (to_after, direct_after) = redirects(&tb);
    assert!(to_after > to, "the second stall moved reads too");
    assert_eq!(direct_after, to_after);

    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
}
