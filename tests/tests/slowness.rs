//! The memory of slowness (issue 37), against real NSD replicas and
//! glibc's resolver: a Service address that kube-proxy's iptables rules
//! spread over three nameservers at random per lookup, one of them
//! throttled at 30% of a CPU (a CFS quota with a busy process beside it,
//! as a DNS pod at its CPU limit). At the agent's defaults for a DNS group
//! the throttled replica is found slow: the lookups whose primary it is
//! leave it, no other lookup is moved to it but the probes that ask
//! whether it is well, and every answer is right. Once it is well its
//! probe finds it fast and it keeps its own lookups again, within 10 s.
//! And memcached replicas behind relays that hold every reply, the
//! primary's twice as long as the others': its reads leave it, and come
//! back once it is as fast as they are.

use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4},
    thread,
    time::{Duration, Instant},
};

use selector_testbed::{
    Replica, Testbed,
    agent::{spawn_agent, status_json},
    bench::{
        resolver::{LookupLoad, run_lookups},
        slowdowns::paced_reads,
        steady::Protocol,
    },
    dns::{DNS_PORT, NetnsResolvConf, Nsd},
    faults::DelayingRelay,
    memcached::{preload, wait_until_serving},
    slowdowns::{CpuThrottle, install_kube_proxy},
    topology::{CLIENT_IFACE, MEMCACHED_PORT, replica_addr},
    wait_for,
};
use selector_user::{api::Status, telemetry::BackendTotals};

/// The Service's address (inside the test's namespaces only).
const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const THROTTLED: usize = 1;
const RATE: u32 = 200;

/// What one member did over a window: its own reads, those that left it,
/// reads moved to it and the probes among them, and its totals after.
struct Window {
    own: u64,
    left: u64,
    moved_to: u64,
    probes: u64,
    after: BackendTotals,
}

/// Reads `member`'s totals, waits `window`, and reads them again.
fn over(window: Duration, member: impl Fn() -> BackendTotals) -> Window {
    let before = member();
    thread::sleep(window);
    let after = member();
    Window {
        own: after.stats.requests - before.stats.requests,
        left: after.stats.redirected_away - before.stats.redirected_away,
        moved_to: after.stats.redirected_to - before.stats.redirected_to,
        probes: after.ejection.slow_probes - before.ejection.slow_probes,
        after,
    }
}

#[test]
fn a_throttled_replica_gets_no_moved_lookup_and_loses_its_own_until_it_is_well() {
    let tb = Testbed::new("slow", 3).unwrap();
    let servers: Vec<Nsd> = (0..3)
        .map(|i| {
            let nsd = Nsd::start(&tb.replica_ns[i], (replica_addr(i), DNS_PORT)).unwrap();
            nsd.wait_ready(&tb.replica_ns[i]).unwrap();
            nsd
        })
        .collect();
    let endpoints: Vec<Ipv4Addr> = (0..3).map(replica_addr).collect();
    install_kube_proxy(&tb.client, CLIENT_IFACE, VIP, DNS_PORT, &endpoints).unwrap();
    let conf = NetnsResolvConf::write(
        &tb.client.name,
        &format!("nameserver {VIP}\noptions timeout:2\n"),
    )
    .unwrap();
    let group: Vec<String> = endpoints
        .iter()
        .map(|a| SocketAddr::from((*a, DNS_PORT)).to_string())
        .collect();
    let (mut agent, _lines) = spawn_agent(
        &tb.client,
        &[
            "--iface",
            CLIENT_IFACE,
            "--group",
            &group.join(","),
            "--proto",
            "dns",
            "--quiet",
        ],
    );
    let backend = |i: usize| -> BackendTotals {
        let status: Status = status_json(&tb.client, CLIENT_IFACE);
        status.backends[i].clone()
    };
    let lookups = |seconds: u64| {
        let spec = LookupLoad {
            resolv_conf: conf.path(),
            rate: RATE,
            duration: Duration::from_secs(seconds),
        };
        tb.client.spawn(move || run_lookups(&spec)).unwrap()
    };

    // Throttled while lookups run: found slow.
    let mut throttle = CpuThrottle::start(&tb.replica_ns[THROTTLED], 30).unwrap();
    let load = lookups(8);
    assert!(
        wait_for(Duration::from_secs(5), || backend(THROTTLED).ejection.slow),
        "the throttled replica was never found slow: {:#?}",
        backend(THROTTLED)
    );
    // From then on, over 3 s: its own lookups leave it, and none is moved
    // to it but the reads that took its probes.
    let Window {
        own,
        left,
        moved_to,
        probes,
        after,
    } = over(Duration::from_secs(3), || backend(THROTTLED));
    assert!(
        moved_to <= probes,
        "{moved_to} reads moved to the slow replica, {probes} of them probes: {after:#?}"
    );
    assert!(own > 100, "too few lookups went to it to judge: {after:#?}");
    assert!(
        left * 10 >= own * 9,
        "only {left} of its {own} reads left the slow replica: {after:#?}"
    );
    assert!(
        throttle.throttled_periods().unwrap() > 10,
        "the quota never throttled it"
    );
    let report = load.join().unwrap().unwrap();
    assert_eq!(report.failed, 0, "a lookup failed or answered wrong");

    // Well again: a probe finds it fast within 10 s, and it keeps its own
    // lookups (at least 90% of them) from then on.
    throttle.release().unwrap();
    let load = lookups(14);
    let well_at = Instant::now();
    assert!(
        wait_for(Duration::from_secs(10), || !backend(THROTTLED)
            .ejection
            .slow),
        "still slow 10 s after it was well: {:#?}",
        backend(THROTTLED)
    );
    eprintln!("fast again after {:?}", well_at.elapsed());
    let Window {
        own, left, after, ..
    } = over(Duration::from_secs(2), || backend(THROTTLED));
    assert!(own > 50, "too few lookups went to it to judge: {after:#?}");
    assert!(
        left * 10 <= own,
        "{left} of its {own} reads still left it once it was well: {after:#?}"
    );
    let report = load.join().unwrap().unwrap();
    assert_eq!(report.failed, 0, "a lookup failed or answered wrong");
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    agent.wait().unwrap();
    drop(servers);
}

/// What a failed check shows of each member: slow, its memory (ns), its
/// completions and latency histogram (lower edge in us, replies).
type Memory = (bool, u64, u64, Vec<(u64, u64)>);

/// The relays' holds: the others', and the slow primary's (twice as long;
/// the relays add up to a few milliseconds of their own).
const FAST: Duration = Duration::from_millis(20);
const SLOW: Duration = Duration::from_millis(40);
/// Gets per second: under one pending at the fast replicas' 20 ms, so the
/// count rule (threshold 4) itself moves none once the primary is fast.
const GETS_RATE: u32 = 50;

#[test]
fn reads_leave_a_replica_twice_as_slow_and_come_back_when_it_is_not() {
    let mut tb = Testbed::new("slow2x", 3).unwrap();
    let front = |i: usize| SocketAddrV4::new(replica_addr(i), MEMCACHED_PORT);
    let local = SocketAddrV4::new(Ipv4Addr::LOCALHOST, MEMCACHED_PORT);
    let mut relays = Vec::new();
    for i in 0..3 {
        tb.replicas
            .push(Replica::start(&tb.replica_ns[i], local).unwrap());
        let hold = if i == 0 { SLOW } else { FAST };
        relays.push(DelayingRelay::start_fixed(&tb.replica_ns[i], front(i), local, hold).unwrap());
    }
    for i in 0..3 {
        wait_until_serving(&tb.client, front(i)).unwrap();
    }
    preload(&tb.client, &tb.replica_endpoints(), 1).unwrap();
    let group = (0..3)
        .map(|i| front(i).to_string())
        .collect::<Vec<_>>()
        .join(",");
    let (mut agent, _lines) = spawn_agent(
        &tb.client,
        &["--iface", CLIENT_IFACE, "--group", &group, "--quiet"],
    );
    let primary = || -> BackendTotals {
        let status: Status = status_json(&tb.client, CLIENT_IFACE);
        status.backends[0].clone()
    };
    let gets = |seconds: u64| {
        let target = SocketAddr::V4(front(0));
        let duration = Duration::from_secs(seconds);
        tb.client
            .spawn(move || paced_reads(Protocol::Memcached, target, GETS_RATE, duration))
            .unwrap()
    };

    let load = gets(8);
    let memory = || -> Vec<Memory> {
        let status: Status = status_json(&tb.client, CLIENT_IFACE);
        status
            .backends
            .iter()
            .map(|b| {
                let buckets: Vec<(u64, u64)> = b
                    .latency_buckets
                    .iter()
                    .map(|l| (l.lower_ns / 1000, l.count))
                    .collect();
                (
                    b.ejection.slow,
                    b.ejection.slowness_ns,
                    b.completed,
                    buckets,
                )
            })
            .collect()
    };
    assert!(
        wait_for(Duration::from_secs(5), || primary().ejection.slow),
        "a primary twice as slow was never found slow: (slow, slowness_ns, completed, [(us, replies)]) {:?}",
        memory()
    );
    let Window {
        own, left, after, ..
    } = over(Duration::from_secs(2), primary);
    assert!(own > 60, "too few reads to judge: {after:#?}");
    assert!(
        left * 10 >= own * 9,
        "only {left} of its {own} reads left the slow primary: {:?}",
        memory()
    );
    let (_, failed, _) = load.join().unwrap().unwrap();
    assert_eq!(failed, 0, "a get failed or answered wrong");

    // As fast as the others from now on.
    relays[0].stop().unwrap();
    relays[0] = DelayingRelay::start_fixed(&tb.replica_ns[0], front(0), local, FAST).unwrap();
    let load = gets(14);
    let well_at = Instant::now();
    assert!(
        wait_for(Duration::from_secs(10), || !primary().ejection.slow),
        "still slow 10 s after it was as fast as the others: {:#?}",
        primary()
    );
    eprintln!("fast again after {:?}", well_at.elapsed());
    let Window {
        own, left, after, ..
    } = over(Duration::from_secs(2), primary);
    assert!(own > 60, "too few reads to judge: {after:#?}");
    assert!(
        left * 10 <= own,
        "{left} of its {own} reads still left it once it was fast: {after:#?}"
    );
    load.join().unwrap().unwrap();
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    agent.wait().unwrap();
    drop(relays);
}
