//! Paged and segmented skbs, in network namespaces with the agent binary on
//! TC ingress and a connected client socket (which drops any reply whose
//! source is not the address it asked):
//! - replies of 1 KB and 1400 bytes that arrive as paged skbs (UDP_SEGMENT
//!   or corked sends; only the headers, or the headers and the frame
//!   header, in the linear part): the primary stalls so reads move, and
//!   every read is answered, every moved read's reply rewritten to come
//!   from the primary, every primary reply completing its read;
//! - reads batched into one GSO send (one skb, several datagrams) pass
//!   untouched, so each is answered by the primary it was sent to.

use std::{net::UdpSocket, thread, time::Duration};

use selector_testbed::{
    Testbed,
    agent::{self, Agent},
    memcached::frame,
    paged::{PagedReplica, read_paged, reply_body, set_gso_size},
    topology::CLIENT_IFACE,
};
use selector_user::api::Status;

/// Reads per second, and how many.
const RATE: u32 = 2000;
const READS: usize = 3000;
const TIMEOUT: Duration = Duration::from_millis(1000);
/// Long enough to queue more than the threshold at the primary many times
/// over.
const STALL: Duration = Duration::from_millis(200);

/// Two paged replicas, and the agent on the client's TC ingress.
fn testbed(prefix: &str) -> (Testbed, Vec<PagedReplica>, Agent) {
    let tb = Testbed::new(prefix, 2).expect("testbed");
    let replicas: Vec<PagedReplica> = tb
        .replica_ns
        .iter()
        .zip(tb.replica_endpoints())
        .map(|(ns, addr)| PagedReplica::start(ns, addr).expect("paged replica"))
        .collect();
    let (group, timeout) = (tb.group_arg(), TIMEOUT.as_millis().to_string());
    let agent = agent::spawn_agent(
        &tb.client,
        &[
            "--iface",
            CLIENT_IFACE,
            "--group",
            &group,
            "--threshold",
            "2",
            "--timeout",
            &timeout,
            "--ingress",
            "tc",
            "--quiet",
        ],
    );
    (tb, replicas, agent)
}

/// The agent's status once nothing is pending (or three timeouts passed),
/// after which the agent is stopped.
fn settled_status(tb: &Testbed, mut agent: Agent) -> Status {
    let deadline = std::time::Instant::now() + TIMEOUT * 3;
    let status: Status = loop {
        let status: Status = agent::status_json(&tb.client, CLIENT_IFACE);
        let pending: u64 = status.backends.iter().map(|b| b.pending).sum();
        if pending == 0 || std::time::Instant::now() > deadline {
            break status;
        }
        thread::sleep(Duration::from_millis(50));
    };
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    assert!(agent.0.wait().unwrap().success(), "agent's exit");
    status
}

/// Passes counted for `reason`, both directions.
fn passed(status: &Status, reason: &str) -> u64 {
    status
        .passed
        .iter()
        .filter(|p| p.reason == reason)
        .map(|p| p.count)
        .sum()
}

#[test]
fn paged_replies_of_moved_reads_are_rewritten_and_none_is_lost() {
    let (tb, replicas, agent) = testbed("pg");
    let primary = replicas[0].addr;
    let load = tb
        .client
        .spawn(move || read_paged(primary, RATE, READS, TIMEOUT))
        .unwrap();
    // The stall starts a quarter of the way in, when the primary has
    // answered paged replies of its own.
    let duration = Duration::from_secs_f64(READS as f64 / f64::from(RATE));
    thread::sleep(duration / 4);
    replicas[0].pause();
    thread::sleep(STALL);
    replicas[0].resume();
    let report = load.join().unwrap().expect("reads");
    let sent: u64 = replicas
        .into_iter()
        .map(|r| r.finish().expect("paged replica"))
        .sum();

    // Once every read completed (or, if any reply was missed, expired).
    let status = settled_status(&tb, agent);
    let bad_headers = passed(&status, "bad_header");
    let b = &status.backends;
    let summary = format!(
        "{} reads, {} answered, {} wrong bodies, {sent} replies sent; bad_header passes {bad_headers}; \
         per backend (issued, completed, expired, away, to): {:?}",
        report.sent,
        report.answered,
        report.wrong_bodies,
        b.iter()
            .map(|b| (
                b.issued,
                b.completed,
                b.expired,
                b.stats.redirected_away,
                b.stats.redirected_to
            ))
            .collect::<Vec<_>>(),
    );
    println!("{summary}");
    assert_eq!(report.sent, READS as u64, "{summary}");
    assert_eq!(sent, report.sent, "every read reached a replica: {summary}");
    assert_eq!(bad_headers, 0, "a paged reply is not a bad one: {summary}");
    assert!(
        b[0].stats.redirected_away > 0,
        "reads must leave the stalled primary: {summary}"
    );
    let moved_to: u64 = b[1..].iter().map(|b| b.stats.redirected_to).sum();
    assert_eq!(moved_to, b[0].stats.redirected_away, "{summary}");
    for (i, b) in b.iter().enumerate() {
        assert!(b.completed > 0, "backend {i} must have answered: {summary}");
        assert_eq!(
            (b.completed, b.expired, b.pending),
            (b.issued, 0, 0),
            "backend {i}: every read it was sent completes by its reply: {summary}"
        );
    }
    // A moved read's reply reaches the connected socket only rewritten.
    assert_eq!(
        report.answered, report.sent,
        "every read answered: {summary}"
    );
    assert_eq!(report.wrong_bodies, 0, "{summary}");
    assert_eq!(
        tb.udp_checksum_errors().unwrap(),
        0,
        "rewritten replies must verify"
    );
}

/// Reads batched by UDP_SEGMENT into one skb reach egress as one GSO
/// packet of several datagrams, each a request with its own id. The
/// selector can read only the first id and a rewrite would move them all,
/// so the batch passes untouched (`segmented`) and goes to its primary,
/// even drained; a single read still moves.
#[test]
fn reads_batched_in_one_gso_send_pass_untouched_and_are_answered() {
    const BATCHES: u16 = 50;
    let (tb, replicas, agent) = testbed("pgb");
    let primary = replicas[0].addr;
    let (code, out) = agent::run_selector(
        &tb.client,
        &["drain", "--iface", CLIENT_IFACE, &primary.to_string()],
    );
    assert_eq!(code, 0, "{out}");
    // UDP_SEGMENT needs checksum offload on the sender's device.
    tb.client
        .exec("ethtool", &["-K", CLIENT_IFACE, "tx", "on", "sg", "on"])
        .expect("offloads on");
    let (batched, single) = tb
        .client
        .run(move || {
            let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
            socket.connect(primary).unwrap();
            socket
                .set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            // Every request one segment: 8-byte frame header and "get k\r\n".
            let request = |id: u16| frame(id, b"get k\r\n");
            let answered = |ids: &[u16]| {
                let mut left: Vec<u16> = ids.to_vec();
                let mut buf = [0u8; 2048];
                while let Ok(n) = socket.recv(&mut buf) {
                    let id = u16::from_be_bytes([buf[0], buf[1]]);
                    if buf[8..n] == reply_body(id)[..] {
                        left.retain(|l| *l != id);
                    }
                    if left.is_empty() {
                        break;
                    }
                }
                ids.len() - left.len()
            };
            let mut batched = 0;
            for b in 0..BATCHES {
                let ids = [2 * b, 2 * b + 1];
                let batch = [request(ids[0]), request(ids[1])].concat();
                set_gso_size(&socket, request(0).len() as libc::c_int).unwrap();
                socket.send(&batch).unwrap();
                batched += answered(&ids);
            }
            set_gso_size(&socket, 0).unwrap();
            socket.send(&request(2 * BATCHES)).unwrap();
            (batched, answered(&[2 * BATCHES]))
        })
        .unwrap();
    let sent: u64 = replicas
        .into_iter()
        .map(|r| r.finish().expect("paged replica"))
        .sum();
    let status = settled_status(&tb, agent);
    let b = &status.backends;
    let summary = format!(
        "{batched} of {} batched reads answered, single read answered {single}; {sent} replies sent; \
         segmented passes {}; per backend (requests, away, to, unmatched): {:?}",
        2 * BATCHES,
        passed(&status, "segmented"),
        b.iter()
            .map(|b| (
                b.stats.requests,
                b.stats.redirected_away,
                b.stats.redirected_to,
                b.stats.unmatched_responses
            ))
            .collect::<Vec<_>>(),
    );
    println!("{summary}");
    assert_eq!(sent, 2 * u64::from(BATCHES) + 1, "{summary}");
    assert_eq!(batched, 2 * usize::from(BATCHES), "{summary}");
    assert_eq!(
        passed(&status, "segmented"),
        u64::from(BATCHES),
        "{summary}"
    );
    // The single read, and only it, was tracked and moved.
    assert_eq!(single, 1, "{summary}");
    assert_eq!(
        (b[0].stats.requests, b[0].stats.redirected_away),
        (1, 1),
        "{summary}"
    );
    assert_eq!(b[1].stats.redirected_to, 1, "{summary}");
    assert_eq!(
        tb.udp_checksum_errors().unwrap(),
        0,
        "rewritten replies must verify"
    );
}
