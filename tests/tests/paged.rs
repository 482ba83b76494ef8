//! Replies of 1 KB and 1400 bytes that arrive as paged skbs (UDP_SEGMENT or
//! corked sends; only the headers, or the headers and the frame header, in
//! the linear part), in network namespaces with the agent binary on TC
//! ingress: the primary stalls so reads move, and every read is answered on
//! a connected socket, every moved read's reply rewritten to come from the
//! primary, every primary reply completing its read.

use std::{thread, time::Duration};

use selector_testbed::{
    Testbed, agent,
    paged::{PagedReplica, read_paged},
    topology::CLIENT_IFACE,
};
use selector_user::control::Status;

/// Reads per second, and how many.
const RATE: u32 = 2000;
const READS: usize = 3000;
const TIMEOUT: Duration = Duration::from_millis(1000);
/// Long enough to queue more than the threshold at the primary many times
/// over.
const STALL: Duration = Duration::from_millis(200);

#[test]
fn paged_replies_of_moved_reads_are_rewritten_and_none_is_lost() {
    let tb = Testbed::new("pg", 2).expect("testbed");
    let replicas: Vec<PagedReplica> = tb
        .replica_ns
        .iter()
        .zip(tb.replica_endpoints())
        .map(|(ns, addr)| PagedReplica::start(ns, addr).expect("paged replica"))
        .collect();
    let (group, timeout) = (tb.group_arg(), TIMEOUT.as_millis().to_string());
    let (mut agent, _output) = agent::spawn_agent(
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

    // Once every read completed (or, if the fix is missing, expired).
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
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    assert!(agent.wait().unwrap().success(), "agent's exit");

    let bad_headers: u64 = status
        .passed
        .iter()
        .filter(|p| p.reason == "bad_header")
        .map(|p| p.count)
        .sum();
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
