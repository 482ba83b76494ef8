//! Overload and fragments end to end, in network namespaces with real
//! servers and real clients (issue 6):
//! - `--on-overload reject` with every memcached replica stopped: reads
//!   over the cap get `SERVER_ERROR overloaded` at once, from the primary's
//!   address, on a connected socket; the reads under the cap are answered
//!   once the replicas resume, and every count settles;
//! - the same with NSD replicas and `dig`: `status: SERVFAIL`, accepted;
//! - a redirected query whose NSD answer is IP-fragmented reaches `dig`
//!   whole (every fragment's source rewritten), with XDP and TC ingress,
//!   over IPv4 and IPv6.
//!
//! Each test prints one figure line (`--nocapture` shows them).

use std::{
    collections::BTreeMap,
    io::ErrorKind,
    net::{SocketAddr, SocketAddrV4, UdpSocket},
    thread,
    time::{Duration, Instant},
};

use selector_common::{Descriptor, OnOverload, Policy, TieBreak};
use selector_testbed::{
    Testbed,
    agent::{Settled, SweptSelector},
    dns::{self, DNS_PORT, Nsd, ZONE},
    memcached::{frame, key_for, parse_get_response, value_for},
    netns::{thread_states, wait_stopped},
    preload,
    topology::{CLIENT_IFACE, replica_addr, replica_addr6},
};
use selector_user::{IngressMode, Settings};

const KEYS: usize = 40;
/// A reject must come back while every replica is still stopped: far
/// sooner than any timeout (not a measure of speed).
const REJECT_WITHIN: Duration = Duration::from_millis(250);

/// Every backend's requests completed or expired exactly once, nothing
/// pending.
fn assert_settled(settled: &Settled) {
    assert!(
        settled.pending.iter().all(|p| *p == 0),
        "pending must drain to zero: {settled:?}"
    );
    for (i, (issued, completed, expired)) in settled.accounting.iter().enumerate() {
        assert_eq!(
            *issued,
            completed + expired,
            "backend {i}: issued = completed + expired: {settled:?}"
        );
    }
}

fn pending(running: &SweptSelector) -> Vec<u64> {
    running.selector.lock().unwrap().pending().unwrap()
}

/// Waits up to `within` for the pending counts to be `want`.
fn wait_for_pending(running: &SweptSelector, want: &[u64], within: Duration) -> Vec<u64> {
    let deadline = Instant::now() + within;
    loop {
        let p = pending(running);
        if p == want || Instant::now() >= deadline {
            return p;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until `total` requests are pending over all replicas, or
/// `within` has passed.
fn wait_for_total_pending(running: &SweptSelector, total: u64, within: Duration) {
    let deadline = Instant::now() + within;
    while pending(running).iter().sum::<u64>() < total && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
}

// ---------------------------------------------------------------- memcached

/// Gets under the cap (4 per replica, 3 replicas).
const UNDER_CAP: u16 = 12;
/// Gets over the cap, each rejected.
const OVER_CAP: u16 = 8;

fn get(id: u16) -> Vec<u8> {
    frame(id, format!("get {}\r\n", key_for(id as usize)).as_bytes())
}

/// What the client saw of the gets over the cap.
struct Rejected {
    /// (request id, reply payload, time to the reply), in send order.
    replies: Vec<(u16, Vec<u8>, Duration)>,
    /// Datagrams that arrived for the gets under the cap while stopped.
    early: usize,
}

#[test]
fn reject_answers_memcached_gets_over_the_cap_while_every_replica_is_stopped() {
    let mut tb = Testbed::new("ovm", 3).expect("testbed");
    tb.start_memcached().expect("memcached");
    let endpoints = tb.replica_endpoints();
    preload(&tb.client, &endpoints, KEYS).expect("preload");
    let timeout = Duration::from_secs(1);
    let running = SweptSelector::start(
        &tb,
        Settings {
            timeout,
            ..Settings::new(
                CLIENT_IFACE,
                vec![endpoints.iter().map(|&e| e.into()).collect()],
            )
        }
        .tuned(|t| {
            t.max_pending = 4;
            t.on_overload = OnOverload::Reject;
        }),
    );
    let primary = endpoints[0];
    let socket = tb
        .client
        .run(move || -> std::io::Result<UdpSocket> {
            let s = UdpSocket::bind("0.0.0.0:0")?;
            s.connect(primary)?;
            Ok(s)
        })
        .unwrap()
        .unwrap();

    for r in &tb.replicas {
        r.stop();
    }
    for r in &tb.replicas {
        assert!(
            wait_stopped(r.pid()),
            "memcached {} did not stop: {:?}",
            r.addr,
            thread_states(r.pid())
        );
    }
    let mut buf = [0u8; 2048];
    // Under the cap: the gets go out and, while stopped, nothing answers.
    for id in 1..=UNDER_CAP {
        socket.send(&get(id)).unwrap();
    }
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut rejected = Rejected {
        replies: Vec::new(),
        early: 0,
    };
    while socket.recv(&mut buf).is_ok() {
        rejected.early += 1;
    }
    let pending_full = pending(&running);
    // Over the cap: each get is answered at once by the kernel.
    socket
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    for id in UNDER_CAP + 1..=UNDER_CAP + OVER_CAP {
        let sent = Instant::now();
        socket.send(&get(id)).unwrap();
        match socket.recv(&mut buf) {
            Ok(n) => rejected
                .replies
                .push((id, buf[..n].to_vec(), sent.elapsed())),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                rejected.replies.push((id, Vec::new(), sent.elapsed()))
            }
            Err(e) => panic!("recv: {e}"),
        }
    }
    let stats_stopped = running.selector.lock().unwrap().stats().unwrap();

    for r in &tb.replicas {
        r.resume();
    }
    // The gets under the cap are answered now, each with its value, from
    // the primary's address (the socket is connected); no rejected get
    // ever reached a replica.
    let mut answered: BTreeMap<u16, Vec<u8>> = BTreeMap::new();
    let mut other = Vec::new();
    socket
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        match socket.recv(&mut buf) {
            Ok(n) if n >= 8 => {
                let id = u16::from_be_bytes([buf[0], buf[1]]);
                if (1..=UNDER_CAP).contains(&id) {
                    answered.insert(id, buf[8..n].to_vec());
                } else {
                    other.push(buf[..n].to_vec());
                }
            }
            Ok(_) => other.push(Vec::new()),
            // Quiet for 300 ms once everything came in: done.
            Err(_) if answered.len() == UNDER_CAP as usize => break,
            Err(_) => {}
        }
    }
    let settled = running.settle(timeout);
    let stats = running.selector.lock().unwrap().stats().unwrap();
    let latencies: Vec<u128> = rejected
        .replies
        .iter()
        .map(|(_, _, t)| t.as_micros())
        .collect();
    println!(
        "memcached reject: pending while stopped {pending_full:?}; {} rejects, reply latency us \
         {latencies:?}; {} of {UNDER_CAP} answered after resume; settled {settled:?}",
        rejected.replies.len(),
        answered.len()
    );

    assert_eq!(
        (pending_full, rejected.early),
        (vec![4, 4, 4], 0),
        "the cap fills every replica and stopped replicas answer nothing: {stats_stopped:?}"
    );
    for (id, payload, took) in &rejected.replies {
        assert_eq!(
            payload,
            &frame(*id, b"SERVER_ERROR overloaded\r\n"),
            "get {id}: the reject is the frame header with the request id and the error line \
             (got {:?})",
            String::from_utf8_lossy(payload)
        );
        assert!(
            *took < REJECT_WITHIN,
            "get {id}: rejected while the replicas are stopped, after {took:?}"
        );
    }
    assert_eq!(
        stats_stopped[0].overload_rejected,
        u64::from(OVER_CAP),
        "{stats_stopped:?}"
    );
    assert_eq!(
        stats_stopped[1].overload_rejected + stats_stopped[2].overload_rejected,
        0
    );
    assert_eq!(
        stats[0].requests,
        u64::from(UNDER_CAP + OVER_CAP),
        "{stats:?}"
    );
    assert_eq!(
        answered.keys().copied().collect::<Vec<_>>(),
        (1..=UNDER_CAP).collect::<Vec<_>>(),
        "every get under the cap is answered after the resume"
    );
    for (id, body) in &answered {
        assert_eq!(
            parse_get_response(body),
            Some(value_for(*id as usize).as_bytes()),
            "get {id}: {:?}",
            String::from_utf8_lossy(body)
        );
    }
    assert!(
        other.is_empty(),
        "no reply to a rejected get: {} more datagrams",
        other.len()
    );
    assert_settled(&settled);
    let issued: Vec<u64> = settled.accounting.iter().map(|a| a.0).collect();
    assert_eq!(issued, vec![4, 4, 4], "{settled:?}");
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);
}

// ---------------------------------------------------------------- DNS

fn dns_endpoints(n: usize) -> Vec<SocketAddrV4> {
    (0..n)
        .map(|i| SocketAddrV4::new(replica_addr(i), DNS_PORT))
        .collect()
}

/// A testbed with NSD on every replica, answering.
fn dns_testbed(prefix: &str) -> (Testbed, Vec<Nsd>) {
    let tb = Testbed::new(prefix, 3).expect("testbed");
    let servers: Vec<Nsd> = dns_endpoints(3)
        .into_iter()
        .zip(&tb.replica_ns)
        .map(|(addr, ns)| Nsd::start(ns, addr).expect("nsd"))
        .collect();
    for s in &servers {
        s.wait_ready(&tb.client).expect("nsd ready");
    }
    (tb, servers)
}

fn dns_settings(ingress: IngressMode, timeout: Duration) -> Settings {
    Settings {
        descriptor: Descriptor::dns(),
        timeout,
        ingress,
        ..Settings::new(
            CLIENT_IFACE,
            vec![dns_endpoints(3).into_iter().map(Into::into).collect()],
        )
    }
    .tuned(|t| {
        // A query leaving the primary goes to the first replica.
        t.tie_break = TieBreak::First;
    })
}

#[test]
fn reject_answers_dig_with_servfail_while_every_nsd_is_stopped() {
    // Declared after the testbed, so the servers go first.
    let (tb, servers) = dns_testbed("ovd");
    let timeout = Duration::from_secs(5);
    let running = SweptSelector::start(
        &tb,
        dns_settings(IngressMode::Xdp, timeout).tuned(|t| {
            t.max_pending = 1;
            t.on_overload = OnOverload::Reject;
        }),
    );
    let at = format!("@{}", replica_addr(0));
    let args = [at.as_str(), ZONE, "A", "+tries=1", "+time=2"];
    for s in &servers {
        s.stop();
    }
    // Under the cap: one query per replica, unanswered while stopped. One
    // at a time: two digs admitted at once on two CPUs may both see the
    // primary under its cap (the cap is read, then the count raised).
    let waiting: Vec<_> = (1..=3u64)
        .map(|sent| {
            let dig = dns::spawn_dig(&tb.client, &args).expect("dig");
            wait_for_total_pending(&running, sent, Duration::from_secs(1));
            dig
        })
        .collect();
    let pending_full = wait_for_pending(&running, &[1, 1, 1], Duration::from_secs(1));
    // Over the cap: SERVFAIL at once, built by the kernel.
    let rejected: Vec<dns::Dig> = (0..4)
        .map(|_| dns::dig(&tb.client, &args).expect("dig"))
        .collect();
    let stats_stopped = running.selector.lock().unwrap().stats().unwrap();
    let timed_out: Vec<dns::Dig> = waiting
        .into_iter()
        .map(|d| dns::wait_dig(d).expect("dig"))
        .collect();
    for s in &servers {
        s.resume();
    }
    let settled = running.settle(timeout);
    let took: Vec<u128> = rejected.iter().map(|d| d.elapsed.as_millis()).collect();
    println!(
        "dig reject: pending while stopped {pending_full:?}; {} SERVFAIL answers, dig run times \
         ms {took:?}; under the cap: {:?}; settled {settled:?}",
        rejected
            .iter()
            .filter(|d| d.status() == Some("SERVFAIL"))
            .count(),
        timed_out
            .iter()
            .map(|d| d.status().unwrap_or("no answer"))
            .collect::<Vec<_>>()
    );

    assert_eq!(pending_full, vec![1, 1, 1], "the cap fills every replica");
    for d in &timed_out {
        assert_eq!(
            d.status(),
            None,
            "a query under the cap waits on its stopped replica:\n{}",
            d.output
        );
    }
    for d in &rejected {
        assert_eq!(d.status(), Some("SERVFAIL"), "{}", d.output);
        assert!(
            d.complaints().is_empty(),
            "dig accepts the reject as the answer to its query:\n{}",
            d.output
        );
        assert!(
            d.success,
            "dig exits 0 on an answer (SERVFAIL included):\n{}",
            d.output
        );
        // Far below dig's 2 s timeout: answered while NSD is stopped.
        assert!(d.elapsed < Duration::from_secs(1), "{:?}", d.elapsed);
    }
    assert_eq!(stats_stopped[0].overload_rejected, 4, "{stats_stopped:?}");
    assert_settled(&settled);
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);
}

/// NSD on every replica over IPv6 (a dual-stack testbed), answering.
fn dns6_testbed(prefix: &str) -> (Testbed, Vec<Nsd>) {
    let tb = Testbed::dual_stack(prefix, 3).expect("testbed");
    let servers: Vec<Nsd> = dns6_endpoints()
        .into_iter()
        .zip(&tb.replica_ns)
        .map(|(addr, ns)| Nsd::start(ns, addr).expect("nsd"))
        .collect();
    for s in &servers {
        s.wait_ready(&tb.client).expect("nsd ready over IPv6");
    }
    (tb, servers)
}

fn dns6_endpoints() -> Vec<SocketAddr> {
    (0..3)
        .map(|i| SocketAddr::from((replica_addr6(i), DNS_PORT)))
        .collect()
}

/// The client's reassembly counters (OKs, fails) of one family.
fn reassembly(tb: &Testbed, v6: bool) -> (u64, u64) {
    if v6 {
        (
            tb.client.snmp6("Ip6ReasmOKs").unwrap(),
            tb.client.snmp6("Ip6ReasmFails").unwrap(),
        )
    } else {
        (
            tb.client.snmp("Ip", "ReasmOKs").unwrap(),
            tb.client.snmp("Ip", "ReasmFails").unwrap(),
        )
    }
}

/// A query redirected away from the stalled primary whose answer (about
/// 3 kB) is IP-fragmented at MTU 1500, over IPv4 or IPv6 (where NSD's
/// host fragments it, with a fragment header): dig gets all of it, from
/// the primary's address.
fn fragmented_answer_of_a_redirected_query_reaches_dig(
    ingress: IngressMode,
    v6: bool,
    prefix: &str,
) {
    let (tb, servers) = if v6 {
        dns6_testbed(prefix)
    } else {
        dns_testbed(prefix)
    };
    let endpoints: Vec<SocketAddr> = if v6 {
        dns6_endpoints()
    } else {
        dns_endpoints(3).into_iter().map(Into::into).collect()
    };
    let timeout = Duration::from_secs(5);
    let running = SweptSelector::start(
        &tb,
        Settings {
            groups: vec![endpoints.clone()],
            ..dns_settings(ingress, timeout)
        }
        .tuned(|t| {
            t.policy = Policy::Absolute;
            t.threshold = 1;
        }),
    );
    let primary = endpoints[0];
    servers[0].stop();
    // One query stuck on the stalled primary: from now on the policy
    // (pending[primary] >= 1) sends reads to the least-pending replica.
    let stuck = tb
        .client
        .run(move || -> std::io::Result<UdpSocket> {
            let s = UdpSocket::bind(if v6 { "[::]:0" } else { "0.0.0.0:0" })?;
            s.send_to(&dns::query(0x5eed, ZONE, dns::QTYPE_A), primary)?;
            Ok(s)
        })
        .unwrap()
        .unwrap();
    let pending_before = wait_for_pending(&running, &[1, 0, 0], Duration::from_secs(1));
    let (reassembled_before, reasm_fails_before) = reassembly(&tb, v6);
    let at = format!("@{}", primary.ip());
    let d = dns::dig(
        &tb.client,
        &[
            at.as_str(),
            dns::BIG_NAME,
            "TXT",
            "+bufsize=4096",
            "+ignore",
            "+tries=1",
            "+time=3",
        ],
    )
    .expect("dig");
    let (reassembled, reasm_fails) = reassembly(&tb, v6);
    let (reassembled, reasm_fails) = (
        reassembled - reassembled_before,
        reasm_fails - reasm_fails_before,
    );
    let stats = running.selector.lock().unwrap().stats().unwrap();
    servers[0].resume();
    let settled = running.settle(timeout);
    drop(stuck);
    let size = d
        .output
        .lines()
        .find(|l| l.contains("MSG SIZE"))
        .unwrap_or("no MSG SIZE line")
        .to_string();
    println!(
        "fragmented answer ({}, IPv{}): status {:?}, ANSWER {:?}, {size}, reassembled \
         {reassembled}, dig {} ms; pending before {pending_before:?}; settled {settled:?}",
        ingress.name(),
        if v6 { 6 } else { 4 },
        d.status(),
        d.answer_count(),
        d.elapsed.as_millis()
    );

    assert_eq!(
        pending_before,
        vec![1, 0, 0],
        "one query stuck on the primary"
    );
    assert_eq!(d.status(), Some("NOERROR"), "{}", d.output);
    assert_eq!(
        d.answer_count(),
        Some(dns::BIG_TXT_RECORDS as u32),
        "{}",
        d.output
    );
    for i in 0..dns::BIG_TXT_RECORDS {
        assert!(
            d.output.contains(&dns::big_txt(i)),
            "TXT record {i} missing:\n{}",
            d.output
        );
    }
    assert!(d.complaints().is_empty(), "{}", d.output);
    assert!(
        reassembled >= 1,
        "the answer must have been IP-fragmented (ReasmOKs +{reassembled})"
    );
    assert_eq!(reasm_fails, 0);
    assert_eq!(
        (stats[0].redirected_away, stats[1].redirected_to),
        (1, 1),
        "the query was redirected to the first replica: {stats:?}"
    );
    assert_eq!(stats[1].responses, 1, "{stats:?}");
    assert_settled(&settled);
    assert_eq!(tb.udp_checksum_errors().unwrap(), 0);
}

#[test]
fn fragmented_nsd_answer_to_a_redirected_query_reaches_dig_xdp() {
    fragmented_answer_of_a_redirected_query_reaches_dig(IngressMode::Xdp, false, "ovfx");
}

#[test]
fn fragmented_nsd_answer_to_a_redirected_query_reaches_dig_tc_ingress() {
    fragmented_answer_of_a_redirected_query_reaches_dig(IngressMode::Tc, false, "ovft");
}

#[test]
fn fragmented_ipv6_nsd_answer_to_a_redirected_query_reaches_dig_xdp() {
    fragmented_answer_of_a_redirected_query_reaches_dig(IngressMode::Xdp, true, "ovf6x");
}

#[test]
fn fragmented_ipv6_nsd_answer_to_a_redirected_query_reaches_dig_tc_ingress() {
    fragmented_answer_of_a_redirected_query_reaches_dig(IngressMode::Tc, true, "ovf6t");
}
