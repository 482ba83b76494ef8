//! Paged and segmented skbs, in network namespaces with the agent binary on
//! TC ingress and a connected client socket (which drops any reply whose
//! source is not the address it asked):
//! - replies of 1 KB and 1400 bytes that arrive as paged skbs (UDP_SEGMENT
//!   or corked sends; only the headers, or the headers and the frame
//!   header, in the linear part): the primary stalls so reads move, and
//!   every read is answered, every moved read's reply rewritten to come
//!   from the primary, every primary reply completing its read;
//! - reads batched into one GSO send (one skb, several datagrams) pass
//!   untouched, so each is answered by the primary it was sent to;
//! - traffic the selector does not steer (bulk TCP both ways with TSO and
//!   GRO, paged UDP to and from a port no member listens on) is classified
//!   from its linear headers and never pulled, while each paged reply of a
//!   member is pulled exactly once;
//! - a read whose very headers are not in the linear part (an AF_PACKET
//!   frame with only its Ethernet header linear) is pulled once, then
//!   parsed and tracked.

use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, SocketAddrV4, TcpListener, TcpStream, UdpSocket},
    thread,
    time::Duration,
};

use selector_testbed::{
    Testbed,
    agent::{self, Agent},
    memcached::frame,
    netns::Namespace,
    paged::{PagedReplica, ReadReport, read_paged, reply_body, set_gso_size},
    topology::{CLIENT_ADDR, CLIENT_IFACE, offloads_on, replica_addr, switch_port},
};
use selector_user::{api::Status, telemetry::HeadersPulled};

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

/// Stops the replicas: the replies they sent, all together.
fn finish_all(replicas: Vec<PagedReplica>) -> u64 {
    replicas
        .into_iter()
        .map(|r| r.finish().expect("paged replica"))
        .sum()
}

/// `READS` reads from the client to the primary (replica 0) while it stalls
/// once; then the replicas are stopped. (What the reader saw, replies the
/// replicas sent.)
fn reads_with_a_stall(tb: &Testbed, replicas: Vec<PagedReplica>) -> (ReadReport, u64) {
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
    let sent = finish_all(replicas);
    (report, sent)
}

#[test]
fn paged_replies_of_moved_reads_are_rewritten_and_none_is_lost() {
    moved_reads_are_answered_and_completed("pg", |_| {});
}

/// With `rx-gro-list` on the client's interface, a burst of replies of one
/// flow (the primary's queue when its stall ends) reaches TC ingress as one
/// GRO skb, the later replies in its fragment list: each must still
/// complete its own read.
#[test]
fn replies_coalesced_by_gro_fraglist_each_complete_their_read() {
    moved_reads_are_answered_and_completed("pgl", |tb| {
        tb.client
            .exec(
                "ethtool",
                &["-K", CLIENT_IFACE, "gro", "on", "rx-gro-list", "on"],
            )
            .expect("rx-gro-list on");
        // veth hands a forwarded skb to the peer's GRO only when the
        // sending side has no TSO (`veth_skb_is_eligible_for_gro`).
        tb.switch
            .exec("ethtool", &["-K", &switch_port(0), "tso", "off"])
            .expect("tso off on the switch port");
    });
}

/// Reads through a stall (`reads_with_a_stall`) with `tune` applied to the
/// testbed first: every read answered, every moved read's reply rewritten,
/// every read completed by its reply (none expired).
fn moved_reads_are_answered_and_completed(prefix: &str, tune: impl Fn(&Testbed)) {
    let (tb, replicas, agent) = testbed(prefix);
    tune(&tb);
    let (report, sent) = reads_with_a_stall(&tb, replicas);

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
    let sent = finish_all(replicas);
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

/// Bytes of the bulk TCP transfer, each way.
const BULK: usize = 32 << 20;
/// A port on replica 0 that is no member's.
const OTHER_PORT: u16 = 11300;

/// One TCP connection from the client to `server` (in `server_ns`):
/// `BULK` bytes up, then `BULK` bytes down. (bytes received up, down).
fn bulk_tcp(client: &Namespace, server_ns: &Namespace, server: SocketAddrV4) -> (usize, usize) {
    let listener = server_ns
        .run(move || TcpListener::bind(server))
        .unwrap()
        .expect("listen");
    let serving = thread::spawn(move || -> std::io::Result<usize> {
        let (mut conn, _) = listener.accept()?;
        let mut got = 0;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            match conn.read(&mut buf)? {
                0 => break,
                n => got += n,
            }
        }
        conn.write_all(&vec![7u8; BULK])?;
        conn.shutdown(Shutdown::Write)?;
        Ok(got)
    });
    let down = client
        .run(move || -> std::io::Result<usize> {
            let mut conn = TcpStream::connect(server)?;
            conn.write_all(&vec![7u8; BULK])?;
            conn.shutdown(Shutdown::Write)?;
            let mut got = Vec::new();
            conn.read_to_end(&mut got)?;
            Ok(got.len())
        })
        .unwrap()
        .expect("bulk TCP");
    let up = serving.join().unwrap().expect("bulk TCP server");
    (up, down)
}

/// Paged datagrams from the client to a port nothing listens on: UDP_SEGMENT
/// batches (one GSO skb of several datagrams) and single segments, their
/// payload in page fragments.
fn paged_udp_out(client: &Namespace, to: SocketAddrV4) {
    client
        .run(move || -> std::io::Result<()> {
            // Not connected: the port unreachable errors that come back
            // are not reported to it.
            let socket = UdpSocket::bind("0.0.0.0:0")?;
            set_gso_size(&socket, 1400)?;
            for i in 0..200u32 {
                let len = if i % 2 == 0 { 4 * 1400 } else { 1000 };
                socket.send_to(&vec![i as u8; len], to)?;
            }
            Ok(())
        })
        .unwrap()
        .expect("paged UDP out");
}

/// The agent's count of pulls now.
fn pulled(tb: &Testbed) -> HeadersPulled {
    agent::status_json::<Status>(&tb.client, CLIENT_IFACE).headers_pulled
}

#[test]
fn only_datagrams_of_members_are_pulled() {
    let (tb, replicas, agent) = testbed("pgu");
    offloads_on(&tb.client).expect("offloads on");
    offloads_on(&tb.replica_ns[0]).expect("offloads on");

    // Traffic the selector does not steer, however paged.
    let tcp_server = SocketAddrV4::new(replica_addr(0), 5001);
    let (up, down) = bulk_tcp(&tb.client, &tb.replica_ns[0], tcp_server);
    assert_eq!((up, down), (BULK, BULK), "bulk TCP both ways");
    paged_udp_out(
        &tb.client,
        SocketAddrV4::new(replica_addr(0), OTHER_PORT + 1),
    );
    let other = PagedReplica::start(
        &tb.replica_ns[0],
        SocketAddrV4::new(replica_addr(0), OTHER_PORT),
    )
    .expect("paged server on another port");
    let other_addr = other.addr;
    let report = tb
        .client
        .spawn(move || read_paged(other_addr, RATE, 500, TIMEOUT))
        .unwrap()
        .join()
        .unwrap()
        .expect("reads from another port");
    let other_sent = other.finish().expect("paged server on another port");
    let untouched = agent::status_json::<Status>(&tb.client, CLIENT_IFACE);
    let summary = format!(
        "after bulk TCP ({BULK} bytes each way), paged UDP out, {} paged replies from port \
         {OTHER_PORT} ({} answered): pulled {:?}; passed not_ip_udp {}, not_backend {}",
        other_sent,
        report.answered,
        untouched.headers_pulled,
        passed(&untouched, "not_ip_udp"),
        passed(&untouched, "not_backend"),
    );
    println!("{summary}");
    assert_eq!(report.answered, 500, "{summary}");
    assert!(passed(&untouched, "not_ip_udp") > 0, "{summary}");
    assert!(passed(&untouched, "not_backend") > 0, "{summary}");
    assert_eq!(
        untouched.headers_pulled,
        HeadersPulled::default(),
        "nothing the selector does not steer is pulled: {summary}"
    );

    // Paged replies of members, some to moved reads: each pulled once.
    let (report, sent) = reads_with_a_stall(&tb, replicas);
    let after = pulled(&tb);
    let status = settled_status(&tb, agent);
    let summary = format!(
        "{} reads, {} answered, {} wrong bodies, {sent} replies sent by members; pulled {after:?}; \
         moved {}",
        report.sent, report.answered, report.wrong_bodies, status.backends[0].stats.redirected_away,
    );
    println!("{summary}");
    assert_eq!(
        report.answered, report.sent,
        "every read answered: {summary}"
    );
    assert_eq!(report.wrong_bodies, 0, "{summary}");
    assert!(
        status.backends[0].stats.redirected_away > 0,
        "reads must leave the stalled primary: {summary}"
    );
    assert_eq!(
        after,
        HeadersPulled {
            egress: 0,
            ingress: sent,
        },
        "each member's paged reply pulled once, no request: {summary}"
    );
}

/// A virtio_net_hdr (what PACKET_VNET_HDR puts before a frame) saying how
/// many of the frame's bytes go in the skb's linear part: no offload.
fn vnet_header(linear: u16) -> [u8; 10] {
    let mut h = [0u8; 10];
    h[2..4].copy_from_slice(&linear.to_le_bytes());
    h
}

/// An Ethernet + IPv4 + UDP frame from the client to `to` carrying
/// `payload` (UDP checksum 0: none, valid over IPv4).
fn udp_frame(to: SocketAddrV4, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 1]);
    f.extend_from_slice(&0x0800u16.to_be_bytes());
    let total = (20 + 8 + payload.len()) as u16;
    let mut ip = [0u8; 20];
    ip[0] = 0x45;
    ip[2..4].copy_from_slice(&total.to_be_bytes());
    ip[8] = 64;
    ip[9] = 17;
    ip[12..16].copy_from_slice(&CLIENT_ADDR.octets());
    ip[16..20].copy_from_slice(&to.ip().octets());
    let mut sum: u32 = ip
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    ip[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f.extend_from_slice(&ip);
    f.extend_from_slice(&40000u16.to_be_bytes());
    f.extend_from_slice(&to.port().to_be_bytes());
    f.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(payload);
    f
}

/// Sends `frame` out of the client's interface from an AF_PACKET socket
/// with PACKET_VNET_HDR, only its first `linear` bytes in the skb's linear
/// part (the kernel lays out so a frame of a page or more).
fn send_with_linear(client: &Namespace, frame: Vec<u8>, linear: u16) {
    client
        .run(move || -> std::io::Result<()> {
            let last_error = || Err(std::io::Error::last_os_error());
            // SAFETY: plain socket calls on a socket of our own, with
            // valid buffers and lengths.
            unsafe {
                let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0);
                if fd < 0 {
                    return last_error();
                }
                let on: libc::c_int = 1;
                let rc = libc::setsockopt(
                    fd,
                    libc::SOL_PACKET,
                    libc::PACKET_VNET_HDR,
                    (&on as *const libc::c_int).cast(),
                    size_of::<libc::c_int>() as libc::socklen_t,
                );
                let name = std::ffi::CString::new(CLIENT_IFACE).unwrap();
                let mut to: libc::sockaddr_ll = std::mem::zeroed();
                to.sll_family = libc::AF_PACKET as u16;
                to.sll_ifindex = libc::if_nametoindex(name.as_ptr()) as i32;
                to.sll_halen = 6;
                to.sll_addr[..6].copy_from_slice(&frame[..6]);
                let packet = [&vnet_header(linear)[..], &frame].concat();
                let sent = if rc == 0 && to.sll_ifindex != 0 {
                    libc::sendto(
                        fd,
                        packet.as_ptr().cast(),
                        packet.len(),
                        0,
                        (&to as *const libc::sockaddr_ll).cast(),
                        size_of::<libc::sockaddr_ll>() as libc::socklen_t,
                    )
                } else {
                    -1
                };
                let result = if sent < 0 { last_error() } else { Ok(()) };
                libc::close(fd);
                result
            }
        })
        .unwrap()
        .expect("AF_PACKET send");
}

/// The rare skb whose headers are not all in its linear part: parsed from
/// the linear part it is short, so it is pulled (once) and parsed again,
/// and then it is what it is: a read to a member, tracked.
#[test]
fn a_read_whose_headers_are_not_linear_is_pulled_once_and_tracked() {
    let (tb, replicas, agent) = testbed("pgh");
    // A frame above a page, so the kernel puts all but its first bytes in
    // page fragments; the links take it whole up to the switch (whether
    // it reaches the replica, and is answered, does not matter: only the
    // client's programs do).
    tb.client
        .ip(&["link", "set", CLIENT_IFACE, "mtu", "9000"])
        .expect("mtu");
    tb.switch
        .ip(&["link", "set", &switch_port(0), "mtu", "9000"])
        .expect("switch port mtu");
    let primary = replicas[0].addr;
    let mut read = b"get k\r\n".to_vec();
    read.resize(5000, b'x');
    send_with_linear(&tb.client, udp_frame(primary, &frame(7, &read)), 14);
    thread::sleep(Duration::from_millis(200));
    // An answer, if any, is a paged reply: pulled on the reply path.
    let answered = finish_all(replicas);
    let status = settled_status(&tb, agent);
    let b = &status.backends;
    let summary = format!(
        "pulled {:?}; primary requests {}, issued {}, completed {}, expired {}; answered {answered}",
        status.headers_pulled, b[0].stats.requests, b[0].issued, b[0].completed, b[0].expired,
    );
    println!("{summary}");
    assert_eq!(
        status.headers_pulled,
        HeadersPulled {
            egress: 1,
            ingress: answered
        },
        "{summary}"
    );
    assert_eq!(
        (
            b[0].stats.requests,
            b[0].issued,
            b[0].completed + b[0].expired
        ),
        (1, 1, 1),
        "the read is tracked at its primary, and ends: {summary}"
    );
}
