//! Packet fixtures over IPv6 through BPF_PROG_TEST_RUN: the same request
//! and reply rewrites as over IPv4, with extension headers walked or passed,
//! and UDP checksums that are mandatory (never produced as zero, never
//! accepted as zero). Checksums are checked with etherparse's own
//! arithmetic. Programs are loaded, not attached.

use std::{net::SocketAddr, time::Duration};

use etherparse::{NetHeaders, PacketHeaders, TransportHeader};
use selector_common::{
    Descriptor, Direction, InflightKey, OnOverload, PassReason, checksum, programs,
};
use selector_testbed::frames::{
    CLIENT, CLIENT_MAC, GET, TC_ACT_PIPE, TC_ACT_REDIRECT, VALUE, XDP_PASS, assert_only_changed,
    counters, egress, egress_marked, passed, replica, run_tc, run_xdp, set_issued, settings_for,
    stats, try_run_tc_checksum_complete, udp6,
};
use selector_testbed::loaded::{self, Loaded};
use selector_user::{Selector, Settings, host::sys};

const CLIENT6: [u8; 16] = [0xfd, 0x77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const CLIENT_PORT: u16 = 40_000;

/// Replica i: fd77::(0x10+i), port 11211+i.
fn replica6(i: usize) -> ([u8; 16], u16) {
    let mut a = CLIENT6;
    a[15] = 0x10 + i as u8;
    (a, 11211 + i as u16)
}

// Offsets in an Ethernet + IPv6 (no extension headers) + UDP frame.
const IP6_SRC: std::ops::Range<usize> = 22..38;
const IP6_DST: std::ops::Range<usize> = 38..54;
const UDP_SRC: std::ops::Range<usize> = 54..56;
const UDP_DST: std::ops::Range<usize> = 56..58;
const UDP_CHECK: std::ops::Range<usize> = 60..62;
const PAYLOAD: usize = 62;

/// DNS server i: replica i's address, port 53.
fn dns_server6(i: usize) -> ([u8; 16], u16) {
    (replica6(i).0, 53)
}

fn settings(
    descriptor: Descriptor,
    member: fn(usize) -> ([u8; 16], u16),
    on_overload: OnOverload,
    max_pending: u32,
) -> Settings {
    Settings {
        groups: vec![
            (0..3)
                .map(|i| {
                    let (a, p) = member(i);
                    SocketAddr::from((a, p))
                })
                .collect(),
        ],
        ..settings_for(descriptor, replica)
    }
    .tuned(|t| {
        t.on_overload = on_overload;
        t.max_pending = max_pending;
    })
}

fn selector() -> Loaded {
    loaded::load(&settings(
        Descriptor::memcached(),
        replica6,
        OnOverload::Pass,
        0,
    ))
    .expect("load")
}

/// A selector whose every member is at the cap of 2, rejecting over it.
fn rejecting(descriptor: Descriptor, member: fn(usize) -> ([u8; 16], u16)) -> Loaded {
    let mut sel = loaded::load(&settings(descriptor, member, OnOverload::Reject, 2)).expect("load");
    for pos in 0..3 {
        set_issued(&mut sel, pos, 2);
    }
    sel
}

fn request6(payload: &[u8]) -> Vec<u8> {
    udp6((CLIENT6, CLIENT_PORT), replica6(0), payload)
}

fn reply6(from: usize, payload: &[u8]) -> Vec<u8> {
    udp6(replica6(from), (CLIENT6, CLIENT_PORT), payload)
}

const IPPROTO_ROUTING: u8 = 43;

/// `frame` with an extension header of type `kind` (8 bytes: its next
/// header, length 0, a PadN option or an exhausted routing header) inserted
/// first after the IPv6 header.
/// The UDP checksum stays right: its pseudo header has the same addresses
/// and UDP length.
fn with_extension(frame: &[u8], kind: u8) -> Vec<u8> {
    with_long_extension(frame, kind, 0)
}

/// The same with a header of `(units + 1) * 8` bytes.
fn with_long_extension(frame: &[u8], kind: u8, units: u8) -> Vec<u8> {
    let bytes = (usize::from(units) + 1) * 8;
    let mut out = frame[..54].to_vec();
    let next = out[20];
    out[20] = kind;
    let len = u16::from_be_bytes([out[18], out[19]]) + bytes as u16;
    out[18..20].copy_from_slice(&len.to_be_bytes());
    // Options: one PadN over the rest. Routing: type 4 (segment routing),
    // no segments left.
    let mut header = match kind {
        IPPROTO_ROUTING => vec![next, units, 4, 0],
        _ => vec![next, units, 1, (bytes - 4) as u8],
    };
    header.resize(bytes, 0);
    out.extend_from_slice(&header);
    out.extend_from_slice(&frame[54..]);
    out
}

/// An IPv6 address and port.
type Endpoint6 = ([u8; 16], u16);

/// Checks the UDP checksum with etherparse (which also walks extension
/// headers) and returns (src, dst) and the checksum as sent.
fn verified6(frame: &[u8]) -> (Endpoint6, Endpoint6, u16) {
    let h = PacketHeaders::from_ethernet_slice(frame).unwrap();
    let Some(NetHeaders::Ipv6(ip, _)) = h.net.clone() else {
        panic!("not IPv6")
    };
    let Some(TransportHeader::Udp(u)) = h.transport else {
        panic!("not UDP")
    };
    let expected = u.calc_checksum_ipv6(&ip, h.payload.slice()).unwrap();
    assert_eq!(u.checksum, expected, "UDP checksum");
    assert_ne!(u.checksum, 0, "a zero UDP checksum is invalid over IPv6");
    (
        (ip.source, u.source_port),
        (ip.destination, u.destination_port),
        u.checksum,
    )
}

fn key6(id: u64) -> InflightKey {
    InflightKey::new(CLIENT6, CLIENT_PORT, 0, id)
}

fn insert_inflight(sel: &mut Selector, id: u64, primary: u32, chosen: u32) {
    let sent = sys::monotonic_ns() - Duration::from_millis(1).as_nanos() as u64;
    assert!(sel.plant_inflight(&key6(id), primary, chosen, sent));
}

#[test]
fn an_ipv6_read_is_redirected_with_a_verified_checksum_and_its_retransmit_follows() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    let input = request6(GET);
    let (verdict, out) = egress(&mut sel, &input);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_only_changed(&input, &out, &[IP6_DST, UDP_DST, UDP_CHECK]);
    let (src, dst, _) = verified6(&out);
    assert_eq!((src, dst), ((CLIENT6, CLIENT_PORT), replica6(1)));
    assert_eq!(counters(&sel).issued[..3], [5, 1, 0]);
    let inflight = sel.inflight().unwrap();
    assert_eq!(inflight.len(), 1);
    assert_eq!(inflight[0].key(), key6(0x1234));
    assert_eq!((inflight[0].primary, inflight[0].chosen), (0, 1));
    let (verdict, again) = egress(&mut sel, &input);
    assert_eq!((verdict, &again), (TC_ACT_REDIRECT, &out));
    assert_eq!(counters(&sel).issued[..3], [5, 1, 0]);
}

#[test]
fn an_ipv6_reply_is_rewritten_back_to_the_primary_by_either_ingress() {
    for tc in [false, true] {
        let mut sel = selector();
        set_issued(&mut sel, 1, 1);
        insert_inflight(&mut sel, 0x1234, 0, 1);
        let input = reply6(1, VALUE);
        let (verdict, out) = if tc {
            run_tc(&mut sel, programs::INGRESS_TC, &input)
        } else {
            run_xdp(&mut sel, &input)
        };
        assert_eq!(verdict, if tc { TC_ACT_PIPE } else { XDP_PASS });
        assert_only_changed(&input, &out, &[IP6_SRC, UDP_SRC, UDP_CHECK]);
        let (src, dst, _) = verified6(&out);
        assert_eq!(
            src,
            replica6(0),
            "tc {tc}: the reply must come from the primary"
        );
        assert_eq!(dst, (CLIENT6, CLIENT_PORT));
        assert!(sel.inflight().unwrap().is_empty(), "tc {tc}");
        assert_eq!(sel.pending().unwrap(), vec![0, 0, 0]);
        assert_eq!(stats(&sel)[1].responses, 1);
    }
}

/// A reply rewritten on TC ingress leaves a CHECKSUM_COMPLETE skb's sum
/// (a NIC's receive checksum) right. IPv6 has no header checksum: the
/// address's change and the UDP checksum's cancel out, so the sum must not
/// move. Kernels before 6.16 refuse `l4_csum_replace`'s BPF_F_IPV6 and
/// then adjust the sum as for IPv4; the fallback must undo that, or the
/// receiver reports "hw csum failure" and sums every such reply again.
/// The harness checks the sum after the run (EBADMSG if it is stale);
/// kernels before 6.11 have no such check (EINVAL) and nothing is run.
#[test]
fn a_reply_rewritten_on_tc_ingress_keeps_a_checksum_complete_sum() {
    let mut sel = selector();
    set_issued(&mut sel, 1, 1);
    insert_inflight(&mut sel, 0x1234, 0, 1);
    let input = reply6(1, VALUE);
    let (verdict, out) = match try_run_tc_checksum_complete(&mut sel, programs::INGRESS_TC, &input)
    {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && !has_checksum_complete_runs() => {
            println!("Linux {}: no CHECKSUM_COMPLETE test runs", release());
            return;
        }
        other => other.expect("the skb's sum left stale (EBADMSG) or another refusal"),
    };
    assert_eq!(verdict, TC_ACT_PIPE);
    assert_only_changed(&input, &out, &[IP6_SRC, UDP_SRC, UDP_CHECK]);
    let (src, dst, _) = verified6(&out);
    assert_eq!((src, dst), (replica6(0), (CLIENT6, CLIENT_PORT)));
    assert_eq!(stats(&sel)[1].responses, 1);
}

fn release() -> String {
    selector_user::host::preflight::kernel_release()
}

/// Whether this kernel's test runs take BPF_F_TEST_SKB_CHECKSUM_COMPLETE
/// (Linux 6.11 and later).
fn has_checksum_complete_runs() -> bool {
    let release = release();
    let mut parts = release.split(['.', '-', '+']);
    let mut next = || parts.next().and_then(|p| p.parse::<u32>().ok());
    let (major, minor) = (next().unwrap_or(0), next().unwrap_or(0));
    (major, minor) >= (6, 11)
}

#[test]
fn known_extension_headers_are_walked_to_udp() {
    // Hop-by-hop, routing and destination options: each walked.
    for kind in [0u8, 43, 60] {
        let mut sel = selector();
        set_issued(&mut sel, 0, 5);
        let input = with_extension(&request6(GET), kind);
        let (verdict, out) = egress(&mut sel, &input);
        assert_eq!(verdict, TC_ACT_REDIRECT, "next header {kind}");
        let shifted = |r: std::ops::Range<usize>| r.start + 8..r.end + 8;
        assert_only_changed(
            &input,
            &out,
            &[IP6_DST, shifted(UDP_DST), shifted(UDP_CHECK)],
        );
        let (_, dst, _) = verified6(&out);
        assert_eq!(dst, replica6(1), "next header {kind}");

        // Its reply, with the same header, is rewritten back.
        let reply = with_extension(&reply6(1, VALUE), kind);
        let (verdict, back) = run_xdp(&mut sel, &reply);
        assert_eq!(verdict, XDP_PASS);
        let (src, _, _) = verified6(&back);
        assert_eq!(src, replica6(0), "next header {kind}");
        assert!(sel.inflight().unwrap().is_empty());
    }
}

#[test]
fn at_most_three_extension_headers_of_at_most_128_bytes_are_walked() {
    // Inserted innermost first: hop-by-hop, destination options, routing,
    // then UDP (an order etherparse walks too).
    let chain = |kinds: &[u8]| {
        kinds
            .iter()
            .fold(request6(GET), |f, &kind| with_extension(&f, kind))
    };
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    let (verdict, out) = egress(&mut sel, &chain(&[43, 60, 0]));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(verified6(&out).1, replica6(1));
    let (longest, too_long) = (
        with_long_extension(&request6(GET), 0, 15),
        with_long_extension(&request6(GET), 0, 16),
    );
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    let (verdict, out) = egress(&mut sel, &longest);
    assert_eq!(verdict, TC_ACT_REDIRECT, "128 bytes");
    assert_eq!(verified6(&out).1, replica6(1));
    for input in [chain(&[60, 43, 60, 0]), too_long] {
        let mut sel = selector();
        set_issued(&mut sel, 0, 5);
        assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input.clone()));
        assert_eq!(
            passed(&sel, Direction::Egress, PassReason::ExtensionHeader),
            1
        );
        assert!(sel.inflight().unwrap().is_empty());
    }
}

#[test]
fn unknown_extension_headers_and_fragments_pass_untouched_and_counted() {
    for (kind, reason) in [
        (44u8, PassReason::Fragment),
        (51, PassReason::ExtensionHeader),
        (253, PassReason::ExtensionHeader),
    ] {
        let mut sel = selector();
        set_issued(&mut sel, 0, 5);
        let input = with_extension(&request6(GET), kind);
        assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input.clone()));
        assert_eq!(passed(&sel, Direction::Egress, reason), 1, "kind {kind}");
        insert_inflight(&mut sel, 0x1234, 0, 1);
        let reply = with_extension(&reply6(1, VALUE), kind);
        assert_eq!(run_xdp(&mut sel, &reply), (XDP_PASS, reply.clone()));
        assert_eq!(passed(&sel, Direction::Ingress, reason), 1, "kind {kind}");
        assert_eq!(sel.inflight().unwrap().len(), 1, "kind {kind}");
    }
}

/// Multicast that is not UDP (neighbour discovery, MLD) is simply not
/// ours; multicast UDP is a datagram no unicast member sends or receives:
/// a bad header.
#[test]
fn multicast_passes_as_not_udp_unless_it_is_udp() {
    const ICMPV6: u8 = 58;
    let all_nodes = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    for (next_header, reason) in [(ICMPV6, PassReason::NotIpUdp), (17, PassReason::BadHeader)] {
        let mut sel = selector();
        let mut input = request6(GET);
        // The next header (Ethernet 14 + 6) and the destination (14 + 24).
        input[20] = next_header;
        input[38..54].copy_from_slice(&all_nodes);
        assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input.clone()));
        assert_eq!(
            passed(&sel, Direction::Egress, reason),
            1,
            "next header {next_header}"
        );
    }
}

/// A routing header with segments left names a waypoint as the IPv6
/// destination: the datagram is not (yet) to a member, and its UDP
/// checksum is over the final destination. It passes untouched.
#[test]
fn a_routing_header_with_segments_left_passes_untouched_and_counted() {
    let mut sel = selector();
    let mut input = with_extension(&request6(GET), IPPROTO_ROUTING);
    // Segments left: the routing header's fourth byte (after Ethernet and
    // the 40-byte IPv6 header).
    input[54 + 3] = 1;
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input.clone()));
    assert_eq!(
        passed(&sel, Direction::Egress, PassReason::ExtensionHeader),
        1
    );
    assert_eq!(sel.inflight().unwrap().len(), 0);
    // With none left it is walked, and the read is tracked.
    let walked = with_extension(&request6(GET), IPPROTO_ROUTING);
    egress(&mut sel, &walked);
    assert_eq!(sel.inflight().unwrap().len(), 1);
}

/// Found by the fuzzer: the parser reads IPv4 addresses IPv4-mapped, so an
/// IPv6 datagram with an IPv4-mapped address (never on the wire, RFC 4291
/// 2.5.5.2) was taken for one to an IPv4 member (and its IPv6 destination
/// rewritten to another member's mapped address) or from an IPv4 client.
/// Such a datagram has a bad header: it passes untouched.
#[test]
fn an_ipv4_mapped_address_over_ipv6_is_no_member_or_client() {
    let ipv4_group = settings_for(Descriptor::memcached(), replica).groups;
    let dual_stack = Settings {
        groups: vec![
            ipv4_group[0].clone(),
            settings(Descriptor::memcached(), replica6, OnOverload::Pass, 0).groups[0].clone(),
        ],
        ..settings_for(Descriptor::memcached(), replica)
    };
    let mut sel = loaded::load(&dual_stack).expect("load");
    // The IPv4 primary is loaded: a read to it would be redirected.
    set_issued(&mut sel, 0, 5);
    let mapped = |addr: [u8; 4]| std::net::Ipv4Addr::from(addr).to_ipv6_mapped().octets();
    let (primary_v4, port) = replica(0);
    let to_mapped_member = udp6((CLIENT6, CLIENT_PORT), (mapped(primary_v4), port), GET);
    let from_mapped_client = udp6((mapped(CLIENT), CLIENT_PORT), replica6(0), GET);
    for input in [&to_mapped_member, &from_mapped_client] {
        assert_eq!(egress(&mut sel, input), (TC_ACT_PIPE, input.clone()));
    }
    assert_eq!(passed(&sel, Direction::Egress, PassReason::BadHeader), 2);
    let from_mapped_member = udp6(
        (mapped(replica(1).0), replica(1).1),
        (CLIENT6, CLIENT_PORT),
        VALUE,
    );
    assert_eq!(
        run_xdp(&mut sel, &from_mapped_member),
        (XDP_PASS, from_mapped_member.clone())
    );
    let (verdict, out) = run_tc(&mut sel, programs::INGRESS_TC, &from_mapped_member);
    assert_eq!((verdict, out), (TC_ACT_PIPE, from_mapped_member.clone()));
    assert_eq!(passed(&sel, Direction::Ingress, PassReason::BadHeader), 2);
    assert!(sel.inflight().unwrap().is_empty());
    assert!(
        stats(&sel)
            .iter()
            .all(|s| s.requests == 0 && s.unmatched_responses == 0)
    );
}

#[test]
fn a_zero_udp_checksum_over_ipv6_is_never_trusted() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    let mut input = request6(GET);
    input[UDP_CHECK].fill(0);
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input.clone()));
    assert_eq!(passed(&sel, Direction::Egress, PassReason::ZeroChecksum), 1);
    assert!(sel.inflight().unwrap().is_empty());

    insert_inflight(&mut sel, 0x1234, 0, 1);
    let mut reply = reply6(1, VALUE);
    reply[UDP_CHECK].fill(0);
    for tc in [false, true] {
        let (verdict, out) = if tc {
            run_tc(&mut sel, programs::INGRESS_TC, &reply)
        } else {
            run_xdp(&mut sel, &reply)
        };
        assert_eq!(verdict, if tc { TC_ACT_PIPE } else { XDP_PASS });
        assert_eq!(out, reply, "tc {tc}: untouched");
    }
    assert_eq!(
        passed(&sel, Direction::Ingress, PassReason::ZeroChecksum),
        2
    );
    assert_eq!(sel.inflight().unwrap().len(), 1);
}

/// `payload` plus (after at most one pad byte) two bytes chosen so that the datagram from `src` to
/// `dst` sums to 0xffff: its computed checksum is zero, sent as 0xffff.
fn summing_to_zero(src: ([u8; 16], u16), dst: ([u8; 16], u16), payload: &[u8]) -> Vec<u8> {
    let mut p = payload.to_vec();
    // The filler must be one 16-bit word of the sum.
    if p.len() % 2 == 1 {
        p.push(b' ');
    }
    p.extend_from_slice(&[0, 0]);
    let frame = udp6(src, dst, &p);
    let mut segment = frame[54..].to_vec();
    segment[6..8].fill(0);
    let mut acc = checksum::sum_words(0, &src.0);
    acc = checksum::sum_words(acc, &dst.0);
    acc += segment.len() as u32 + 17;
    let sum = checksum::fold(checksum::sum_words(acc, &segment));
    let filler = 0xffff - sum;
    let at = p.len() - 2;
    p[at..].copy_from_slice(&filler.to_be_bytes());
    p
}

#[test]
fn a_rewrite_whose_checksum_comes_out_zero_sends_all_ones() {
    // The reply as it will leave the rewrite (from the primary) sums to
    // zero; as it arrives (from replica 1) it does not.
    let payload = summing_to_zero(replica6(0), (CLIENT6, CLIENT_PORT), VALUE);
    for tc in [false, true] {
        let mut sel = selector();
        insert_inflight(&mut sel, 0x1234, 0, 1);
        let input = reply6(1, &payload);
        assert_ne!(&input[UDP_CHECK], &[0xff, 0xff]);
        let (_, out) = if tc {
            run_tc(&mut sel, programs::INGRESS_TC, &input)
        } else {
            run_xdp(&mut sel, &input)
        };
        let (src, _, check) = verified6(&out);
        assert_eq!(src, replica6(0), "tc {tc}");
        assert_eq!(check, 0xffff, "tc {tc}");
    }
    // And a request rewritten to replica 1 whose result is zero.
    let payload = summing_to_zero((CLIENT6, CLIENT_PORT), replica6(1), GET);
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    let (verdict, out) = egress(&mut sel, &request6(&payload));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let (_, dst, check) = verified6(&out);
    assert_eq!((dst, check), (replica6(1), 0xffff));
}

#[test]
fn reject_answers_an_overloaded_ipv6_get_with_a_checksummed_reply() {
    let mut sel = rejecting(Descriptor::memcached(), replica6);
    let input = request6(GET);
    let (verdict, out, _) = egress_marked(&mut sel, &input, 0);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let (src, dst, _) = verified6(&out);
    assert_eq!((src, dst), (replica6(0), (CLIENT6, CLIENT_PORT)));
    assert_eq!(&out[..6], &CLIENT_MAC);
    // Written out here, not taken from the code the kernel runs: the
    // request's id 0x1234, datagram 0 of 1, and the error line.
    assert_eq!(
        &out[PAYLOAD..],
        b"\x12\x34\x00\x00\x00\x01\x00\x00SERVER_ERROR overloaded\r\n"
    );
    assert_eq!(stats(&sel)[0].overload_rejected, 1);
    assert!(sel.inflight().unwrap().is_empty());
}

#[test]
fn reject_answers_an_overloaded_ipv6_dns_query_with_a_checksummed_servfail() {
    let mut sel = rejecting(Descriptor::dns(), dns_server6);
    let query: &[u8] =
        b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03org\x00\x00\x01\x00\x01";
    let input = udp6((CLIENT6, CLIENT_PORT), dns_server6(0), query);
    let (verdict, out, _) = egress_marked(&mut sel, &input, 0);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let (src, dst, _) = verified6(&out);
    assert_eq!((src, dst), (dns_server6(0), (CLIENT6, CLIENT_PORT)));
    // The query itself with flags QR, RD, RA and RCODE 2 (SERVFAIL):
    // written out, not taken from the code the kernel runs.
    let answer: &[u8] =
        b"\xbe\xef\x81\x82\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03org\x00\x00\x01\x00\x01";
    assert_eq!(&out[PAYLOAD..], answer);
    assert_eq!(stats(&sel)[0].overload_rejected, 1);
}
