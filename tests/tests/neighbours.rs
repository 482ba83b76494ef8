//! The agent keeps the backends' next hops resolved through rtnetlink
//! (managed neighbour entries), sends no traffic of its own to do it,
//! leaves static entries alone, and deletes what it marked when it exits.

use selector_testbed::{
    Testbed,
    agent::spawn_agent,
    topology::{CLIENT_IFACE, replica_addr},
};

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
