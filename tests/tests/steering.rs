//! End to end, in network namespaces with real memcached replicas and a
//! client on a connected UDP socket: the selector steers reads away from a
//! stalled primary, replies still come from the primary's address with the
//! right values, observe mode never rewrites, the latency policy moves
//! reads by expected wait, `--tie-break random` spreads the reads leaving a
//! stalled primary over equally loaded replicas (and `first` does not), and
//! pending counts drain to exactly zero.

use std::{thread, time::Duration};

use selector_common::{Policy, TieBreak};
use selector_testbed::{
    LoadSpec, MemcachedClient, Testbed,
    agent::SweptSelector,
    memcached::{frame, key_for, value_for},
    preload, run_load,
    topology::CLIENT_IFACE,
};
use selector_user::{IngressMode, Settings};

const KEYS: usize = 200;

fn testbed(prefix: &str) -> Testbed {
    testbed_with_ports(prefix, 0)
}

/// `port_step` > 0 puts the replicas on different ports, so redirects
/// rewrite the port too.
fn testbed_with_ports(prefix: &str, port_step: u16) -> Testbed {
    let mut tb = Testbed::new(prefix, 3).expect("testbed");
    tb.port_step = port_step;
    tb.start_memcached().expect("memcached");
    preload(&tb.client, &tb.replica_endpoints(), KEYS).expect("preload");
    tb
}

fn settings(tb: &Testbed, policy: Policy, ingress: IngressMode, timeout: Duration) -> Settings {
    Settings {
        timeout,
        ingress,
        ..Settings::new(CLIENT_IFACE, vec![tb.replica_group()])
    }
    .tuned(|t| {
        t.policy = policy;
        t.threshold = 2;
    })
}

/// Load at `rate` for `secs`; stops the primary for `stall` halfway.
fn load_with_stall(
    tb: &Testbed,
    rate: u32,
    secs: f64,
    stall: Duration,
) -> selector_testbed::LoadReport {
    let spec = LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate,
        duration: Duration::from_secs_f64(secs),
        keys: KEYS,
        drain: Duration::from_secs(1),
    };
    let load = tb.client.spawn(move || run_load(&spec)).unwrap();
    thread::sleep(Duration::from_secs_f64(secs / 2.0));
    tb.replicas[0].stop();
    thread::sleep(stall);
    tb.replicas[0].resume();
    load.join().unwrap().expect("load")
}

/// Waits for every pending count to reach zero, then checks the raw
/// counters: each backend's issued requests were completed or expired
/// exactly once (a drift would show here even where `pending` saturates).
fn wait_for_zero_pending(running: &SweptSelector, timeout: Duration) -> Vec<u64> {
    let settled = running.settle(timeout);
    for (i, (issued, completed, expired)) in settled.accounting.into_iter().enumerate() {
        assert_eq!(issued, completed + expired, "backend {i} drifted");
    }
    settled.pending
}

fn stall_redirects_and_every_reply_arrives(ingress: IngressMode, prefix: &str, port_step: u16) {
    let tb = testbed_with_ports(prefix, port_step);
    let timeout = Duration::from_millis(500);
    let running = SweptSelector::start(&tb, settings(&tb, Policy::Threshold, ingress, timeout));
    let report = load_with_stall(&tb, 2000, 1.5, Duration::from_millis(50));

    let sel = running.selector.lock().unwrap();
    let stats = sel.stats().unwrap();
    drop(sel);
    assert_eq!(
        report.lost(),
        0,
        "every response must arrive: {} of {}",
        report.received,
        report.sent
    );
    assert_eq!(
        report.wrong_values, 0,
        "every response must carry the key's value"
    );
    assert!(
        stats[0].redirected_away > 0,
        "reads must leave the stalled primary: {stats:?}"
    );
    let redirected_to: u64 = stats[1..].iter().map(|s| s.redirected_to).sum();
    assert_eq!(redirected_to, stats[0].redirected_away);
    let replica_responses: u64 = stats[1..].iter().map(|s| s.responses).sum();
    assert!(
        replica_responses > 0,
        "replicas must have answered: {stats:?}"
    );
    // Counted by the replicas themselves: every read the selector says it
    // moved reached one of them.
    assert_eq!(
        tb.reads_moved().unwrap(),
        stats[0].redirected_away,
        "reads the other replicas served vs. the selector's count: {stats:?}"
    );
    assert_eq!(
        tb.udp_checksum_errors().unwrap(),
        0,
        "rewritten datagrams must verify"
    );
    let pending = wait_for_zero_pending(&running, timeout);
    assert_eq!(pending, vec![0, 0, 0]);
    let total_responses: u64 = stats.iter().map(|s| s.responses).sum();
    assert_eq!(total_responses, report.sent);
}

#[test]
fn stall_redirects_reads_and_replies_come_from_the_primary_xdp() {
    // Replicas on different ports: the port is rewritten both ways too.
    stall_redirects_and_every_reply_arrives(IngressMode::Xdp, "selx", 1);
}

#[test]
fn stall_redirects_reads_and_replies_come_from_the_primary_tc_ingress() {
    stall_redirects_and_every_reply_arrives(IngressMode::Tc, "selt", 0);
}

#[test]
fn observe_mode_counts_but_never_rewrites() {
    let tb = testbed("selo");
    let timeout = Duration::from_millis(500);
    let running = SweptSelector::start(
        &tb,
        settings(&tb, Policy::Observe, IngressMode::Xdp, timeout),
    );
    let report = load_with_stall(&tb, 2000, 1.0, Duration::from_millis(50));
    let stats = running.selector.lock().unwrap().stats().unwrap();
    assert_eq!(report.lost(), 0);
    assert_eq!(report.wrong_values, 0);
    assert_eq!(
        stats[0].requests, report.sent,
        "observe still counts: {stats:?}"
    );
    assert_eq!(stats[0].responses, report.sent);
    for s in &stats {
        assert_eq!((s.redirected_away, s.redirected_to), (0, 0), "{stats:?}");
    }
    assert_eq!(stats[1].responses + stats[2].responses, 0);
    assert_eq!(tb.reads_moved().unwrap(), 0, "observe moved reads");
    assert_eq!(wait_for_zero_pending(&running, timeout), vec![0, 0, 0]);
}

#[test]
fn lost_requests_expire_and_pending_returns_to_exactly_zero() {
    let mut tb = testbed("sell");
    let timeout = Duration::from_millis(200);
    let running = SweptSelector::start(
        &tb,
        settings(&tb, Policy::Threshold, IngressMode::Xdp, timeout),
    );
    let spec = LoadSpec {
        target: tb.replica_endpoints()[0].into(),
        rate: 3000,
        duration: Duration::from_secs(1),
        keys: KEYS,
        drain: Duration::from_millis(300),
    };
    let load = tb.client.spawn(move || run_load(&spec)).unwrap();
    // The primary crashes mid-load: what it had queued and every request
    // still sent to it are lost, so only the sweep can settle them.
    thread::sleep(Duration::from_millis(400));
    tb.replicas[0].crash();
    let report = load.join().unwrap().unwrap();
    assert!(report.lost() > 0, "the crash must lose some requests");
    assert!(
        report.received > report.sent / 2,
        "reads must move to the live replicas: {} of {}",
        report.received,
        report.sent
    );
    let pending = wait_for_zero_pending(&running, timeout);
    assert_eq!(pending, vec![0, 0, 0], "pending must drain exactly");
    let sel = running.selector.lock().unwrap();
    let stats = sel.stats().unwrap();
    let expired: u64 = sel.expired().iter().sum();
    let responses: u64 = stats.iter().map(|s| s.responses).sum();
    let requests: u64 = stats.iter().map(|s| s.requests).sum();
    assert!(expired > 0);
    assert_eq!(requests, report.sent);
    assert_eq!(
        responses + expired,
        requests,
        "every request completes exactly once"
    );
    assert!(sel.inflight().unwrap().is_empty());
}

/// The memcached `get` reply the paged replica sends for every request.
const PAGED_VALUE: &[u8] = b"VALUE k 0 5\r\nhello\r\nEND\r\n";

/// A replica whose every reply is a paged skb: with UDP_SEGMENT the kernel
/// puts the whole payload in page fragments (only the headers are linear),
/// so the memcached frame header the reply path reads is not in the linear
/// part. UDP_SEGMENT needs checksum offload (the send fails with EIO
/// without it), and paged data needs scatter-gather on the device, so both
/// are turned on for this replica's interface; a successful send therefore
/// means a paged datagram. Returns how many replies it sent.
fn serve_paged_replies(
    ns: &selector_testbed::netns::Namespace,
    addr: std::net::SocketAddrV4,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> thread::JoinHandle<std::io::Result<u64>> {
    use std::sync::atomic::Ordering;
    ns.exec("ethtool", &["-K", CLIENT_IFACE, "tx", "on", "sg", "on"])
        .expect("offloads on");
    let socket = ns
        .run(move || std::net::UdpSocket::bind(addr))
        .unwrap()
        .expect("bind");
    selector_testbed::paged::set_gso_size(&socket, 1400).expect("UDP_SEGMENT");
    socket
        .set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    thread::spawn(move || {
        let (mut buf, mut sent) = ([0u8; 2048], 0);
        while !stop.load(Ordering::Relaxed) {
            let (n, from) = match socket.recv_from(&mut buf) {
                Ok(got) => got,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            };
            if n < 8 {
                continue;
            }
            let mut reply = buf[..8].to_vec();
            reply.extend_from_slice(PAGED_VALUE);
            socket.send_to(&reply, from)?;
            sent += 1;
        }
        Ok(sent)
    })
}

#[test]
fn a_paged_reply_is_pulled_and_rewritten_on_tc_ingress() {
    use std::sync::{Arc, atomic::AtomicBool};
    const READS: usize = 200;
    let tb = Testbed::new("selpg", 2).expect("testbed");
    let [primary, replica] = tb.replica_endpoints()[..] else {
        unreachable!()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let server = serve_paged_replies(&tb.replica_ns[1], replica, stop.clone());
    let timeout = Duration::from_millis(500);
    let running = SweptSelector::start(
        &tb,
        Settings {
            ingress: IngressMode::Tc,
            ..Settings::new(CLIENT_IFACE, vec![vec![primary.into(), replica.into()]])
        },
    );
    {
        let mut sel = running.selector.lock().unwrap();
        let id = sel.backend_index(primary.into()).unwrap();
        // Every read now leaves the primary (nothing listens there).
        sel.set_drained(id, true).unwrap();
    }
    let answered = tb
        .client
        .run(move || {
            let client = selector_testbed::MemcachedClient::connect(primary).unwrap();
            (0..READS)
                .filter(|_| {
                    // A connected socket: only a reply rewritten to come
                    // from the primary is received.
                    client
                        .request(b"get k\r\n", Duration::from_millis(300))
                        .is_ok_and(|body| body == PAGED_VALUE)
                })
                .count()
        })
        .unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = server.join().unwrap().expect("paged replica");
    assert_eq!(sent, READS as u64, "the replica answers every read");
    assert_eq!(answered, READS, "every paged reply reaches the application");
    let stats = running.selector.lock().unwrap().stats().unwrap();
    assert_eq!(stats[0].redirected_away, READS as u64, "{stats:?}");
    assert_eq!(stats[1].responses, READS as u64, "{stats:?}");
    assert_eq!(wait_for_zero_pending(&running, timeout), vec![0, 0]);
}

#[test]
fn latency_policy_steers_away_from_a_stalled_primary_and_every_reply_arrives() {
    let tb = testbed("sell");
    let timeout = Duration::from_millis(500);
    let settings = settings(&tb, Policy::Latency, IngressMode::Xdp, timeout).tuned(|t| {
        t.budget = Duration::from_millis(2);
    });
    let running = SweptSelector::start(&tb, settings);
    let report = load_with_stall(&tb, 2000, 1.5, Duration::from_millis(50));
    let sel = running.selector.lock().unwrap();
    let stats = sel.stats().unwrap();
    let service = sel.service_times();
    drop(sel);
    assert_eq!(report.lost(), 0, "{} of {}", report.received, report.sent);
    assert_eq!(report.wrong_values, 0);
    // The primary's time per completion, measured in the kernel: about
    // 0.5 ms at 2000 reads/s once it serves again.
    assert!(
        (100_000..5_000_000).contains(&service[0]),
        "primary service time {service:?}"
    );
    // A 50 ms stall at 0.5 ms per read reaches the 2 ms budget after a few
    // reads; the rest of the stall's reads leave (about 100 in all).
    assert!(
        stats[0].redirected_away >= 20,
        "reads must leave the stalled primary: {stats:?}"
    );
    let redirected_to: u64 = stats[1..].iter().map(|s| s.redirected_to).sum();
    assert_eq!(redirected_to, stats[0].redirected_away);
    assert_eq!(
        tb.reads_moved().unwrap(),
        stats[0].redirected_away,
        "reads the other replicas served vs. the selector's count: {stats:?}"
    );
    assert_eq!(
        tb.udp_checksum_errors().unwrap(),
        0,
        "rewritten datagrams must verify"
    );
    assert_eq!(wait_for_zero_pending(&running, timeout), vec![0, 0, 0]);
    let total_responses: u64 = stats.iter().map(|s| s.responses).sum();
    assert_eq!(total_responses, report.sent);
}

/// Where the reads leaving a stopped primary go, with four idle replicas.
/// One read is sent to the stopped primary and left pending, so every
/// later read leaves it. Then 400 gets, one at a time on a connected
/// socket to the primary, each sent after the previous reply: whenever a
/// read moves, every replica has nothing pending (a four-way tie), however
/// this machine schedules the client. Returns, per replica, the kernel's
/// `redirected_to`, checked against the UDP datagrams its host received.
fn redirects_with_primary_stopped(prefix: &str, tie_break: TieBreak) -> Vec<u64> {
    const READS: u64 = 400;
    let tb = Testbed::with_memcached(prefix, 5, KEYS).expect("testbed");
    // Longer than the test: the stuck read stays pending until resumed.
    let timeout = Duration::from_secs(10);
    let running = SweptSelector::start(
        &tb,
        Settings {
            timeout,
            ..Settings::new(CLIENT_IFACE, vec![tb.replica_group()])
        }
        .tuned(|t| {
            t.policy = Policy::Threshold;
            t.threshold = 1;
            t.tie_break = tie_break;
        }),
    );
    let received = |tb: &Testbed| -> Vec<u64> {
        tb.replica_ns[1..]
            .iter()
            .map(|ns| ns.snmp("Udp", "InDatagrams").unwrap())
            .collect()
    };
    let before = received(&tb);
    tb.replicas[0].stop();
    let primary = tb.replica_endpoints()[0];
    // The stuck read's socket stays open until its reply has come.
    let (_stuck, answered) = tb
        .client
        .run(move || {
            let stuck = MemcachedClient::connect(primary).unwrap();
            stuck
                .socket
                .send(&frame(0x5555, format!("get {}\r\n", key_for(1)).as_bytes()))
                .unwrap();
            let client = MemcachedClient::connect(primary).unwrap();
            let answered = (0..READS as usize)
                .filter(|i| {
                    let key = i % KEYS;
                    client
                        .get(&key_for(key))
                        .is_ok_and(|v| v == Some(value_for(key).into_bytes()))
                })
                .count();
            (stuck, answered)
        })
        .unwrap();
    tb.replicas[0].resume();
    let redirected_to = {
        let sel = running.selector.lock().unwrap();
        let stats = sel.stats().unwrap();
        assert_eq!(stats[0].redirected_away, READS, "{stats:?}");
        stats[1..]
            .iter()
            .map(|s| s.redirected_to)
            .collect::<Vec<u64>>()
    };
    assert_eq!(
        answered, READS as usize,
        "every get answered with its value"
    );
    assert_eq!(redirected_to.iter().sum::<u64>(), READS);
    // The selector's counts are what happened on the wire.
    let after = received(&tb);
    let datagrams: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(
        datagrams, redirected_to,
        "datagrams each replica's host received"
    );
    assert_eq!(wait_for_zero_pending(&running, timeout), vec![0; 5]);
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);
    redirected_to
}

#[test]
fn random_tie_break_spreads_reads_leaving_a_stopped_primary_over_idle_replicas() {
    let random = redirects_with_primary_stopped("seltr", TieBreak::Random);
    // About 100 each; 60 (15%) is more than 4 binomial standard
    // deviations (8.7) below that.
    for (replica, n) in random.iter().enumerate() {
        assert!(*n >= 60, "replica {}: {random:?}", replica + 1);
    }
    // `first`: BookKeeper's first strict minimum, every time.
    let first = redirects_with_primary_stopped("seltf", TieBreak::First);
    assert_eq!(first, vec![400, 0, 0, 0]);
}
