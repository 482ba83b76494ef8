//! End to end over IPv6, in network namespaces (fd77::/64, duplicate
//! address detection off) with real memcached and real NSD: reads leave a
//! stalled IPv6 primary and every reply reaches the client's connected
//! socket from the primary's address with the right value, through either
//! ingress, straight to the next hop the agent resolved over AF_INET6 or,
//! without it, through `bpf_redirect_neigh`; one agent serves an IPv4 and
//! an IPv6 group at once; DNS over
//! IPv6 with dig; the `selector` binary taking `[addr]:port` groups and
//! refusing a mixed one. Checksum offloads are off on every veth, and the UDP
//! checksum-error counters (IPv4 and IPv6) must stay at zero.

use std::{net::SocketAddr, thread, time::Duration};

use aya::maps::Array;
use selector_common::{BackendStats, Descriptor, NextHopMac, Policy};
use selector_testbed::{
    LoadReport, LoadSpec, Testbed,
    agent::{self, SweptSelector},
    dns::{self, APEX_A, DNS_PORT, Nsd, ZONE},
    preload, run_load,
    topology::{CLIENT_IFACE, replica_addr6, switch_port},
    wait_for,
};
use selector_user::{IngressMode, Settings};

const KEYS: usize = 200;
const TIMEOUT: Duration = Duration::from_millis(500);

/// Three dual-stack hosts with memcached listening on both families.
fn memcached_testbed(prefix: &str) -> Testbed {
    memcached_testbed_on_ports(prefix, 0)
}

/// [`memcached_testbed`] with replica i on port `11211 + i * port_step`.
fn memcached_testbed_on_ports(prefix: &str, port_step: u16) -> Testbed {
    let mut tb = Testbed::dual_stack(prefix, 3).expect("testbed");
    tb.port_step = port_step;
    tb.start_memcached().expect("memcached");
    preload(&tb.client, &tb.replica_endpoints6(), KEYS).expect("preload over IPv6");
    tb
}

fn settings(groups: Vec<Vec<SocketAddr>>, ingress: IngressMode) -> Settings {
    Settings {
        timeout: TIMEOUT,
        ingress,
        ..Settings::new(CLIENT_IFACE, groups)
    }
    .tuned(|t| {
        t.policy = Policy::Threshold;
        t.threshold = 2;
    })
}

/// Loads each target at `rate` for 1.5 s on a connected socket; stops
/// replica 0 (every group's primary) for 50 ms halfway.
fn loads_with_stall(tb: &Testbed, targets: &[SocketAddr], rate: u32) -> Vec<LoadReport> {
    let secs = 1.5;
    let loads: Vec<_> = targets
        .iter()
        .map(|&target| {
            let spec = LoadSpec {
                target,
                rate,
                duration: Duration::from_secs_f64(secs),
                keys: KEYS,
                drain: Duration::from_secs(1),
            };
            tb.client.spawn(move || run_load(&spec)).unwrap()
        })
        .collect();
    thread::sleep(Duration::from_secs_f64(secs / 2.0));
    tb.replicas[0].stop();
    thread::sleep(Duration::from_millis(50));
    tb.replicas[0].resume();
    loads
        .into_iter()
        .map(|l| l.join().unwrap().expect("load"))
        .collect()
}

fn assert_every_reply_arrived(report: &LoadReport, what: &str) {
    assert_eq!(
        report.lost(),
        0,
        "{what}: every reply must reach the connected socket: {} of {}",
        report.received,
        report.sent
    );
    assert_eq!(
        report.wrong_values, 0,
        "{what}: every reply carries the key's value"
    );
}

/// The group of `members` starting at `first` in `stats` left its stalled
/// primary, and the replicas answered what it sent them.
fn assert_left_the_primary(stats: &[BackendStats], first: usize, what: &str) {
    let group = &stats[first..first + 3];
    assert!(
        group[0].redirected_away > 0,
        "{what}: reads must leave the stalled primary: {group:?}"
    );
    let to: u64 = group[1..].iter().map(|s| s.redirected_to).sum();
    assert_eq!(to, group[0].redirected_away, "{what}");
    let answered: u64 = group[1..].iter().map(|s| s.responses).sum();
    assert!(
        answered > 0,
        "{what}: replicas must have answered: {group:?}"
    );
}

fn assert_settled(tb: &Testbed, running: &SweptSelector, backends: usize) {
    assert_eq!(
        tb.udp_checksum_errors().unwrap(),
        0,
        "rewritten datagrams must verify"
    );
    let settled = running.settle(TIMEOUT);
    for (i, (issued, completed, expired)) in settled.accounting.iter().enumerate() {
        assert_eq!(*issued, completed + expired, "backend {i} drifted");
    }
    assert_eq!(settled.pending, vec![0; backends]);
}

/// How a redirected read reaches its replica.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum NextHop {
    /// Its Ethernet addresses from `NEXT_HOPS`, as the agent resolved
    /// them over rtnetlink (AF_INET6 here).
    Direct,
    /// `NEXT_HOPS` cleared: through `bpf_redirect_neigh`, which routes and
    /// resolves the IPv6 next hop itself.
    RedirectNeigh,
}

/// Zeroes every backend's `NEXT_HOPS` entry.
fn forget_next_hops(running: &SweptSelector) {
    let mut sel = running.selector.lock().unwrap();
    let ids: Vec<u32> = sel.backends.iter().map(|b| b.index).collect();
    let map = sel
        .ebpf_mut()
        .map_mut(selector_common::names::NEXT_HOPS)
        .unwrap();
    let mut hops: Array<_, NextHopMac> = Array::try_from(map).unwrap();
    for id in ids {
        hops.set(id, NextHopMac::default(), 0).unwrap();
    }
}

fn stalled_ipv6_primary(ingress: IngressMode, next_hop: NextHop, prefix: &str) {
    let tb = memcached_testbed(prefix);
    let group = tb.replica_endpoints6();
    let running = SweptSelector::start(&tb, settings(vec![group.clone()], ingress));
    if next_hop == NextHop::RedirectNeigh {
        forget_next_hops(&running);
    }
    let reports = loads_with_stall(&tb, &group[..1], 2000);
    let stats = running.selector.lock().unwrap().stats().unwrap();
    assert_every_reply_arrived(&reports[0], "IPv6");
    assert_left_the_primary(&stats, 0, "IPv6");
    assert_eq!(
        tb.reads_moved().unwrap(),
        stats[0].redirected_away,
        "reads the other replicas served vs. the selector's count: {stats:?}"
    );
    let direct: u64 = stats[1..].iter().map(|s| s.redirected_direct).sum();
    let redirected: u64 = stats[1..].iter().map(|s| s.redirected_to).sum();
    let expected = match next_hop {
        NextHop::Direct => redirected,
        NextHop::RedirectNeigh => 0,
    };
    assert_eq!(direct, expected, "{next_hop:?}: {stats:?}");
    let responses: u64 = stats.iter().map(|s| s.responses).sum();
    assert_eq!(responses, reports[0].sent);
    assert_settled(&tb, &running, 3);
}

#[test]
fn reads_leave_a_stalled_ipv6_primary_and_every_reply_arrives_xdp() {
    stalled_ipv6_primary(IngressMode::Xdp, NextHop::Direct, "sel6x");
}

#[test]
fn reads_leave_a_stalled_ipv6_primary_and_every_reply_arrives_tc_ingress() {
    stalled_ipv6_primary(IngressMode::Tc, NextHop::Direct, "sel6t");
}

#[test]
fn without_known_next_hops_ipv6_reads_go_through_redirect_neigh() {
    stalled_ipv6_primary(IngressMode::Tc, NextHop::RedirectNeigh, "sel6n");
}

/// One agent with an IPv4 and an IPv6 group of the same replicas; both
/// primaries stall: each group's reads leave it, every reply arrives, and
/// each group's replies completed its own requests.
fn both_families_leave_a_stalled_primary(tb: &Testbed) {
    let v4: Vec<SocketAddr> = tb.replica_group();
    let v6 = tb.replica_endpoints6();
    let running = SweptSelector::start(tb, settings(vec![v4.clone(), v6.clone()], IngressMode::Tc));
    let reports = loads_with_stall(tb, &[v4[0], v6[0]], 1500);
    let stats = running.selector.lock().unwrap().stats().unwrap();
    assert_every_reply_arrived(&reports[0], "IPv4 group");
    assert_every_reply_arrived(&reports[1], "IPv6 group");
    assert_left_the_primary(&stats, 0, "IPv4 group");
    assert_left_the_primary(&stats, 3, "IPv6 group");
    // The replicas serve both groups from one process each.
    assert_eq!(
        tb.reads_moved().unwrap(),
        stats[0].redirected_away + stats[3].redirected_away,
        "reads the other replicas served vs. the selector's count: {stats:?}"
    );
    let responses = |g: &[BackendStats]| g.iter().map(|s| s.responses).sum::<u64>();
    assert_eq!(responses(&stats[..3]), reports[0].sent);
    assert_eq!(responses(&stats[3..]), reports[1].sent);
    assert_settled(tb, &running, 6);
}

#[test]
fn one_agent_steers_an_ipv4_and_an_ipv6_group_at_once() {
    both_families_leave_a_stalled_primary(&memcached_testbed("sel46"));
}

/// With transmit checksum offload on, the client's datagrams leave as
/// CHECKSUM_PARTIAL: the UDP checksum field holds only the pseudo-header
/// sum, and the sum over the payload (ports included) is made after the
/// egress program. A rewrite must then fold the address change into that
/// field and leave the port change out. The switch sums the datagrams on
/// its way to the replicas, which are on different ports and verify
/// checksums: they drop any redirected read that got it wrong.
#[test]
fn partial_checksums_stay_right_when_a_redirect_changes_the_port() {
    let tb = memcached_testbed_on_ports("sel6p", 1);
    tb.client
        .exec("ethtool", &["-K", CLIENT_IFACE, "tx", "on"])
        .expect("tx checksum offload on");
    // The switch's ports to the replicas compute the checksums in
    // software (a veth would hand CHECKSUM_PARTIAL on, never summed).
    for replica in 1..=3 {
        tb.switch
            .exec("ethtool", &["-K", &switch_port(replica), "tx", "off"])
            .expect("switch port tx checksum offload off");
    }
    both_families_leave_a_stalled_primary(&tb);
}

#[test]
fn dns_over_ipv6_leaves_a_stalled_nsd_and_dig_accepts_every_answer() {
    const QUERIES: usize = 6;
    let tb = Testbed::dual_stack("sel6d", 3).expect("testbed");
    let endpoints: Vec<SocketAddr> = (0..3)
        .map(|i| SocketAddr::from((replica_addr6(i), DNS_PORT)))
        .collect();
    let servers: Vec<Nsd> = endpoints
        .iter()
        .zip(&tb.replica_ns)
        .map(|(&addr, ns)| Nsd::start(ns, addr).expect("nsd"))
        .collect();
    for s in &servers {
        s.wait_ready(&tb.client).expect("nsd ready over IPv6");
    }
    let running = SweptSelector::start(
        &tb,
        Settings {
            descriptor: Descriptor::dns(),
            ..settings(vec![endpoints], IngressMode::Xdp)
        }
        .tuned(|t| {
            t.threshold = 1;
        }),
    );
    let at = format!("@{}", replica_addr6(0));
    let args = [at.as_str(), ZONE, "A", "+tries=1", "+time=3"];
    servers[0].stop();
    let queries_seen = || running.selector.lock().unwrap().stats().unwrap()[0].requests;
    let digs: Vec<_> = (1..=QUERIES as u64)
        .map(|n| {
            let d = dns::spawn_dig(&tb.client, &args).expect("dig");
            // One at a time, so each sees the counts the last one left.
            wait_for(Duration::from_secs(3), || queries_seen() >= n);
            d
        })
        .collect();
    assert_eq!(
        queries_seen(),
        QUERIES as u64,
        "every query left the client"
    );
    servers[0].resume();
    let answers: Vec<dns::Dig> = digs
        .into_iter()
        .map(|d| dns::wait_dig(d).expect("dig"))
        .collect();
    let stats = running.selector.lock().unwrap().stats().unwrap();
    for (i, a) in answers.iter().enumerate() {
        assert!(a.success, "query {i}: {}", a.output);
        assert_eq!(a.status(), Some("NOERROR"), "query {i}: {}", a.output);
        assert!(
            a.output.contains(&APEX_A.to_string()),
            "query {i}: {}",
            a.output
        );
        assert!(a.complaints().is_empty(), "query {i}: {}", a.output);
    }
    assert_left_the_primary(&stats, 0, "DNS over IPv6");
    assert_settled(&tb, &running, 3);
}

#[test]
fn the_binary_takes_ipv6_groups_next_to_ipv4_ones_and_refuses_a_mixed_one() {
    let tb = memcached_testbed("sel6c");
    let join = |members: Vec<SocketAddr>| {
        members
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let v4: Vec<SocketAddr> = tb.replica_group();
    let v6 = tb.replica_endpoints6();
    let mixed = format!("{},{}", v4[0], v6[1]);
    let (code, out) = agent::run_selector(
        &tb.client,
        &["run", "--iface", CLIENT_IFACE, "--group", &mixed],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        out.trim_end().starts_with("error: ") && out.contains("mixes IPv4 and IPv6"),
        "{out}"
    );
    assert_eq!(out.trim_end().lines().count(), 1, "{out}");

    let (v4_group, v6_group) = (join(v4.clone()), join(v6.clone()));
    let args = [
        "--iface",
        CLIENT_IFACE,
        "--group",
        &v4_group,
        "--group",
        &v6_group,
        "--threshold",
        "2",
        "--quiet",
    ];
    let (mut child, _lines) = agent::spawn_agent(&tb.client, &args);
    let reports = loads_with_stall(&tb, &[v6[0]], 2000);
    assert_every_reply_arrived(&reports[0], "IPv6 through the binary");
    let rows = agent::status(&tb.client, CLIENT_IFACE);
    let backends: Vec<&str> = rows.iter().map(|r| r.backend.as_str()).collect();
    let expected: Vec<String> = v4.iter().chain(&v6).map(ToString::to_string).collect();
    assert_eq!(backends, expected);
    let primary6 = &rows[3];
    assert!(primary6.away > 0, "{rows:?}");
    assert_eq!(primary6.requests, reports[0].sent);
    assert_eq!(rows[..3].iter().map(|r| r.requests).sum::<u64>(), 0);
    unsafe { libc::kill(child.0.id() as i32, libc::SIGTERM) };
    assert!(child.0.wait().unwrap().success());
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);
}
