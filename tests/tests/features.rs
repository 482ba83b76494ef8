//! Packet fixtures for the kernel features: overload handling (reject,
//! drop, pass, per-client bound), memcached noreply, multi-datagram replies,
//! VLAN tags, IPv4 fragments and header validation. Exact inputs, exact
//! expected outputs and verdicts through BPF_PROG_TEST_RUN; checksums
//! checked with etherparse. Programs are loaded, not attached.

use etherparse::{Ipv4HeaderSlice, PacketBuilder};
use selector_common::{
    BackendStats, Descriptor, Direction, MARK_REDIRECTED, OnOverload, PassReason, programs,
    reject::{dns_servfail_flags, memcached_reject},
};
use selector_testbed::frames::{
    CLIENT, CLIENT_MAC, CLIENT_PORT, GET, IP_CHECK, IP_DST, IP_SRC, PRIMARY_MAC, TC_ACT_PIPE,
    TC_ACT_REDIRECT, TC_ACT_SHOT, UDP_CHECK, UDP_DST, UDP_SRC, XDP_PASS, assert_only_changed,
    counters, dns_server, egress, egress_marked, passed, replica, request, run_tc, run_tc_marked,
    run_xdp, set_issued, settings_for, stats, udp, verified_endpoints, verified_ipv4,
};
use selector_user::Selector;

fn overload_selector(
    descriptor: Descriptor,
    member: fn(usize) -> ([u8; 4], u16),
    max_pending: u32,
    on_overload: OnOverload,
) -> Selector {
    Selector::load(&settings_for(descriptor, member).tuned(|t| {
        t.max_pending = max_pending;
        t.on_overload = on_overload;
    }))
    .expect("load")
}

/// Every member at 2 pending, the cap.
fn all_full(sel: &mut Selector) {
    for pos in 0..3 {
        set_issued(sel, pos, 2);
    }
}

/// A memcached get with request id `id`.
fn get(id: u16) -> Vec<u8> {
    let mut g = GET.to_vec();
    g[..2].copy_from_slice(&id.to_be_bytes());
    g
}

/// The reply the client would get: `from` to the client, addresses of the
/// request's frame swapped, UDP checksum 0.
fn reply_frame(from: ([u8; 4], u16), payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    PacketBuilder::ethernet2(PRIMARY_MAC, CLIENT_MAC)
        .ipv4(from.0, CLIENT, 64)
        .udp(from.1, CLIENT_PORT)
        .write(&mut out, payload)
        .unwrap();
    out[UDP_CHECK].fill(0);
    out
}

fn sum_passed(sel: &Selector) -> u64 {
    sel.passed().unwrap().iter().map(|(_, _, n)| n).sum()
}

#[test]
fn reject_answers_an_overloaded_memcached_get_with_server_error() {
    let mut sel = overload_selector(Descriptor::memcached(), replica, 2, OnOverload::Reject);
    all_full(&mut sel);
    let input = request(&get(0x1234));
    let (verdict, out, mark) = egress_marked(&mut sel, &input, 0x42);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(mark, 0x42 | MARK_REDIRECTED);
    let (_, ip) = verified_ipv4(&out);
    assert_eq!(ip.total_len, 20 + 8 + 33);
    assert_eq!(u16::from_be_bytes([out[38], out[39]]), 8 + 33);
    assert_eq!(&out[UDP_CHECK], &[0, 0]);
    let s = stats(&sel);
    assert_eq!((s[0].requests, s[0].overload_rejected), (1, 1));
    assert_eq!(counters(&sel).issued, [2, 2, 2]);
    assert!(sel.inflight().unwrap().is_empty());

    // TC ingress sees the reply with the bit set: untouched, bit cleared,
    // nothing counted.
    let before = (stats(&sel), sum_passed(&sel));
    let (verdict, again, mark) =
        run_tc_marked(&mut sel, programs::INGRESS_TC, &out, 0x42 | MARK_REDIRECTED);
    assert_eq!((verdict, &again, mark), (TC_ACT_PIPE, &out, 0x42));
    assert_eq!((stats(&sel), sum_passed(&sel)), before);
    assert_eq!(counters(&sel).issued, [2, 2, 2]);

    // The frame itself, last, so the checks above run whatever it holds.
    assert_eq!(
        &out[42..],
        b"\x12\x34\0\0\0\x01\0\0SERVER_ERROR overloaded\r\n"
    );
    assert_eq!(out, reply_frame(replica(0), &memcached_reject(0x1234)));
}

#[test]
fn reject_answers_an_overloaded_dns_query_with_servfail() {
    let mut sel = overload_selector(Descriptor::dns(), dns_server, 2, OnOverload::Reject);
    all_full(&mut sel);
    let query: &[u8] =
        b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03org\x00\x00\x01\x00\x01";
    let input = udp((CLIENT, CLIENT_PORT), dns_server(0), query);
    let (verdict, out, mark) = egress_marked(&mut sel, &input, 0);
    assert_eq!((verdict, mark), (TC_ACT_REDIRECT, MARK_REDIRECTED));
    let mut answer = query.to_vec();
    answer[2..4].copy_from_slice(&dns_servfail_flags(0x0100).to_be_bytes());
    assert_eq!(&answer[2..4], &[0x81, 0x82]);
    verified_ipv4(&out);
    assert_eq!(&out[UDP_CHECK], &[0, 0]);
    assert_eq!(stats(&sel)[0].overload_rejected, 1);
    assert_eq!(counters(&sel).issued, [2, 2, 2]);
    assert!(sel.inflight().unwrap().is_empty());
    // The frame itself, last.
    assert_eq!(out, reply_frame(dns_server(0), &answer));
}

#[test]
fn drop_sheds_an_overloaded_get() {
    let mut sel = overload_selector(Descriptor::memcached(), replica, 2, OnOverload::Drop);
    all_full(&mut sel);
    let (verdict, _) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_SHOT);
    let s = stats(&sel);
    assert_eq!(
        (s[0].requests, s[0].overload_dropped, s[0].overload_passed),
        (1, 1, 0)
    );
    assert_eq!(counters(&sel).issued, [2, 2, 2]);
    assert!(sel.inflight().unwrap().is_empty());
}

#[test]
fn pass_sends_an_overloaded_get_to_its_primary() {
    let mut sel = overload_selector(Descriptor::memcached(), replica, 2, OnOverload::Pass);
    all_full(&mut sel);
    let input = request(GET);
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    assert_eq!(stats(&sel)[0].overload_passed, 1);
    assert_eq!(counters(&sel).issued, [3, 2, 2]);
    let inflight = sel.inflight().unwrap();
    assert_eq!(inflight.len(), 1);
    assert_eq!((inflight[0].primary, inflight[0].chosen), (0, 0));
}

#[test]
fn max_pending_moves_a_read_to_a_member_under_the_cap() {
    let mut sel = Selector::load(&settings_for(Descriptor::memcached(), replica).tuned(|t| {
        t.max_pending = 2;
        t.on_overload = OnOverload::Drop;
        // The policy alone would stay: 2 < 1 + 10.
        t.threshold = 10;
    }))
    .unwrap();
    set_issued(&mut sel, 0, 2);
    set_issued(&mut sel, 1, 2);
    set_issued(&mut sel, 2, 1);
    let input = request(GET);
    let (verdict, out) = egress(&mut sel, &input);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_only_changed(&input, &out, &[IP_CHECK, IP_DST, UDP_DST, UDP_CHECK]);
    assert_eq!(verified_endpoints(&out).1, replica(2));
    assert_eq!(counters(&sel).issued, [2, 2, 2]);
    let s = stats(&sel);
    assert_eq!((s[0].redirected_away, s[2].redirected_to), (1, 1));
    assert_eq!(
        (
            s[0].overload_dropped,
            s[0].overload_passed,
            s[0].overload_rejected
        ),
        (0, 0, 0)
    );
}

#[test]
fn max_pending_client_bounds_one_client_socket() {
    let mut sel = Selector::load(&settings_for(Descriptor::memcached(), replica).tuned(|t| {
        t.max_pending_client = 1;
        t.on_overload = OnOverload::Drop;
    }))
    .unwrap();
    let first = request(&get(0x1234));
    assert_eq!(egress(&mut sel, &first), (TC_ACT_PIPE, first));
    assert_eq!(sel.inflight().unwrap().len(), 1);
    assert_eq!(counters(&sel).issued, [1, 0, 0]);
    // Another id from the same socket while the first is pending.
    let (verdict, _) = egress(&mut sel, &request(&get(0x1235)));
    assert_eq!(verdict, TC_ACT_SHOT);
    let s = stats(&sel);
    assert_eq!((s[0].requests, s[0].overload_dropped), (2, 1));
    assert_eq!(counters(&sel).issued, [1, 0, 0]);
    assert_eq!(sel.inflight().unwrap().len(), 1);
}

#[test]
fn memcached_noreply_is_not_tracked_but_a_plain_delete_is() {
    let mut sel = Selector::load(&settings_for(Descriptor::memcached(), replica)).unwrap();
    let input = request(b"\x12\x36\0\0\0\x01\0\0set foo 0 0 1 noreply\r\nx\r\n");
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    let s = stats(&sel);
    assert_eq!((s[0].requests, s[0].no_reply), (1, 1));
    assert_eq!(counters(&sel).issued, [0, 0, 0]);
    assert!(sel.inflight().unwrap().is_empty());

    let input = request(b"\x12\x37\0\0\0\x01\0\0delete foo\r\n");
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    let s = stats(&sel);
    assert_eq!((s[0].requests, s[0].no_reply), (2, 1));
    assert_eq!(counters(&sel).issued, [1, 0, 0]);
    let inflight = sel.inflight().unwrap();
    assert_eq!(inflight.len(), 1);
    assert_eq!(inflight[0].request_id, 0x1237);
}

#[test]
fn a_custom_descriptor_names_the_requests_that_expect_no_reply() {
    // A 4-byte id at 0, reads start with "R" at 4, "N" at 5 means no reply.
    let descriptor = Descriptor::custom(0, 4, 4, b"R")
        .unwrap()
        .with_no_reply_prefix(5, b"N")
        .unwrap();
    let mut sel = Selector::load(&settings_for(descriptor, replica)).unwrap();
    let input = request(b"\0\0\0\x01WN payload");
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    let s = stats(&sel);
    assert_eq!((s[0].requests, s[0].no_reply), (1, 1));
    assert!(sel.inflight().unwrap().is_empty());
    // A write without the marker is tracked.
    let input = request(b"\0\0\0\x02WY payload");
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    assert_eq!(stats(&sel)[0].no_reply, 1);
    assert_eq!(counters(&sel).issued, [1, 0, 0]);
}

/// Reply datagram `seq` of 3 for request 0x1234.
fn reply_part(seq: u16) -> Vec<u8> {
    let mut p = vec![0x12, 0x34];
    p.extend_from_slice(&seq.to_be_bytes());
    p.extend_from_slice(&[0, 3, 0, 0]);
    p.extend_from_slice(format!("part {seq} of the value\r\n").as_bytes());
    p
}

#[test]
fn a_three_datagram_reply_completes_on_its_last_datagram() {
    let mut sel = Selector::load(&settings_for(Descriptor::memcached(), replica)).unwrap();
    set_issued(&mut sel, 0, 5);
    let (verdict, _) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(sel.pending().unwrap(), vec![5, 1, 0]);
    let mut outs = Vec::new();
    for (n, seq) in [2u16, 0, 1].into_iter().enumerate() {
        let input = udp(replica(1), (CLIENT, CLIENT_PORT), &reply_part(seq));
        let (verdict, out) = run_xdp(&mut sel, &input);
        assert_eq!(verdict, XDP_PASS, "datagram {seq}");
        assert_only_changed(&input, &out, &[IP_CHECK, IP_SRC, UDP_SRC, UDP_CHECK]);
        assert_eq!(
            verified_endpoints(&out),
            (replica(0), (CLIENT, CLIENT_PORT)),
            "datagram {seq}"
        );
        outs.push((input, out));
        let s = stats(&sel);
        if n < 2 {
            assert_eq!(sel.inflight().unwrap().len(), 1, "after datagram {seq}");
            assert_eq!(s[1].responses, 0, "after datagram {seq}");
            assert_eq!(sel.pending().unwrap(), vec![5, 1, 0]);
        } else {
            assert_eq!(s[1].responses, 1);
            assert_eq!(sel.pending().unwrap(), vec![5, 0, 0]);
        }
    }
    // Datagram 1 again.
    let (input, out) = &outs[2];
    assert_eq!(run_xdp(&mut sel, input), (XDP_PASS, out.clone()));
    let s = stats(&sel);
    assert_eq!((s[1].responses, s[1].late_responses), (1, 1));
    assert_eq!(sel.pending().unwrap(), vec![5, 0, 0]);
}

/// `frame` with an 802.1Q tag for VLAN 5 after the MAC addresses.
fn tagged(frame: &[u8]) -> Vec<u8> {
    let mut t = frame[..12].to_vec();
    t.extend_from_slice(&[0x81, 0x00, 0x00, 0x05]);
    t.extend_from_slice(&frame[12..]);
    t
}

fn untagged(frame: &[u8]) -> Vec<u8> {
    let mut u = frame[..12].to_vec();
    u.extend_from_slice(&frame[16..]);
    u
}

fn shifted(ranges: &[std::ops::Range<usize>]) -> Vec<std::ops::Range<usize>> {
    ranges.iter().map(|r| r.start + 4..r.end + 4).collect()
}

/// A tagged request comes from a VLAN device above the attached one: its
/// replicas' next hops are on that VLAN, so it passes untouched, counted,
/// and nothing is tracked (the namespace test `vlan` shows the loss this
/// prevents, with the tag in the frame and in the skb's metadata).
#[test]
fn a_vlan_tagged_get_passes_untouched_and_counted() {
    let mut sel = Selector::load(&settings_for(Descriptor::memcached(), replica)).unwrap();
    set_issued(&mut sel, 0, 5);
    let input = tagged(&request(GET));
    let (verdict, out) = egress(&mut sel, &input);
    assert_eq!((verdict, &out), (TC_ACT_PIPE, &input));
    assert_eq!(
        passed(&sel, Direction::Egress, PassReason::VlanTagged),
        1,
        "counted as tagged"
    );
    assert_eq!(stats(&sel)[0].requests, 0, "not tracked");
    assert_eq!(sel.pending().unwrap(), vec![5, 0, 0]);
}

/// The reply path reads past one tag: a reply that arrives tagged to a
/// moved read (a trunk the replicas answer on) is rewritten, tag kept.
#[test]
fn a_vlan_tagged_reply_to_a_moved_read_is_rewritten_with_the_tag_kept() {
    for tc in [false, true] {
        let mut sel = Selector::load(&settings_for(Descriptor::memcached(), replica)).unwrap();
        set_issued(&mut sel, 0, 5);
        let (verdict, _) = egress(&mut sel, &request(GET));
        assert_eq!(verdict, TC_ACT_REDIRECT, "tc: {tc}");

        let mut value = selector_testbed::frames::VALUE.to_vec();
        value[..2].copy_from_slice(&0x1234u16.to_be_bytes());
        let reply = tagged(&udp(replica(1), (CLIENT, CLIENT_PORT), &value));
        let (verdict, out) = if tc {
            run_tc(&mut sel, programs::INGRESS_TC, &reply)
        } else {
            run_xdp(&mut sel, &reply)
        };
        assert_eq!(verdict, if tc { TC_ACT_PIPE } else { XDP_PASS });
        assert_eq!(&out[12..16], &[0x81, 0x00, 0x00, 0x05]);
        assert_only_changed(
            &reply,
            &out,
            &shifted(&[IP_CHECK, IP_SRC, UDP_SRC, UDP_CHECK]),
        );
        assert_eq!(
            verified_endpoints(&untagged(&out)),
            (replica(0), (CLIENT, CLIENT_PORT)),
            "tc: {tc}"
        );
        assert_eq!(stats(&sel)[1].responses, 1, "tc: {tc}");
        assert_eq!(sel.pending().unwrap(), vec![5, 0, 0]);
    }
}

/// An Ethernet + IPv4 fragment from `src` to the client: IP id `id`,
/// fragment offset `offset` (in 8-byte units), MF if `more`, carrying
/// `ip_payload`; a valid header checksum.
fn fragment(src: [u8; 4], id: u16, offset: u16, more: bool, ip_payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&CLIENT_MAC);
    f.extend_from_slice(&PRIMARY_MAC);
    f.extend_from_slice(&[0x08, 0x00]);
    let total = (20 + ip_payload.len()) as u16;
    let frag = offset | if more { 0x2000 } else { 0 };
    f.extend_from_slice(&[0x45, 0]);
    f.extend_from_slice(&total.to_be_bytes());
    f.extend_from_slice(&id.to_be_bytes());
    f.extend_from_slice(&frag.to_be_bytes());
    f.extend_from_slice(&[64, 17, 0, 0]);
    f.extend_from_slice(&src);
    f.extend_from_slice(&CLIENT);
    fix_ip_checksum(&mut f);
    f.extend_from_slice(ip_payload);
    f
}

/// Sets the IPv4 header checksum of an Ethernet frame with etherparse.
fn fix_ip_checksum(f: &mut [u8]) {
    f[IP_CHECK].fill(0);
    let h = Ipv4HeaderSlice::from_slice(&f[14..34]).unwrap().to_header();
    let c = h.calc_header_checksum();
    f[IP_CHECK].copy_from_slice(&c.to_be_bytes());
}

#[test]
fn a_fragmented_reply_is_rewritten_fragment_by_fragment() {
    let mut sel = Selector::load(&settings_for(Descriptor::memcached(), replica)).unwrap();
    set_issued(&mut sel, 0, 5);
    let (verdict, _) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_REDIRECT);

    let mut value = b"\x12\x34\0\0\0\x01\0\0VALUE foo 0 40\r\n".to_vec();
    value.extend_from_slice(&[b'v'; 40]);
    value.extend_from_slice(b"\r\nEND\r\n");
    let whole = udp(replica(1), (CLIENT, CLIENT_PORT), &value);
    let datagram = &whole[34..]; // UDP header + payload
    let (head, tail) = datagram.split_at(48);
    let id = 0x4242;
    let first = fragment(replica(1).0, id, 0, true, head);
    let second = fragment(replica(1).0, id, 6, false, tail);

    let (verdict, out1) = run_xdp(&mut sel, &first);
    assert_eq!(verdict, XDP_PASS);
    assert_only_changed(&first, &out1, &[IP_CHECK, IP_SRC, UDP_SRC, UDP_CHECK]);
    // etherparse leaves a fragment's payload unparsed: the port by hand.
    assert_eq!(verified_ipv4(&out1).1.source, replica(0).0);
    assert_eq!(&out1[UDP_SRC], &replica(0).1.to_be_bytes());
    assert_eq!(stats(&sel)[1].responses, 1);

    let (verdict, out2) = run_xdp(&mut sel, &second);
    assert_eq!(verdict, XDP_PASS);
    assert_only_changed(&second, &out2, &[IP_CHECK, IP_SRC]);
    assert_eq!(verified_ipv4(&out2).1.source, replica(0).0);

    // Reassembled: the rewritten header, the UDP header and data of the
    // first fragment, the data of the second; both checksums hold.
    let mut reassembled = out1[..34].to_vec();
    reassembled.extend_from_slice(&out1[34..]);
    reassembled.extend_from_slice(&out2[34..]);
    let total = (reassembled.len() - 14) as u16;
    reassembled[16..18].copy_from_slice(&total.to_be_bytes());
    reassembled[20..22].fill(0);
    fix_ip_checksum(&mut reassembled);
    assert_eq!(
        verified_endpoints(&reassembled),
        (replica(0), (CLIENT, CLIENT_PORT))
    );
    assert_eq!(&reassembled[42..], &value[..]);

    // A later fragment of another datagram: not ours.
    let stray = fragment(replica(1).0, 0x9999, 6, false, tail);
    assert_eq!(run_xdp(&mut sel, &stray), (XDP_PASS, stray));
    assert_eq!(passed(&sel, Direction::Ingress, PassReason::Fragment), 1);
}

#[test]
fn malformed_ipv4_headers_pass_egress_untouched_as_bad_headers() {
    let mut sel = Selector::load(&settings_for(Descriptor::memcached(), replica)).unwrap();
    set_issued(&mut sel, 0, 5);
    let mut bad_checksum = request(GET);
    bad_checksum[IP_CHECK.start] ^= 0x01;
    let multicast = udp(([224, 0, 0, 5], CLIENT_PORT), replica(0), GET);
    let mut too_long = request(GET);
    let total = u16::from_be_bytes([too_long[16], too_long[17]]) + 10;
    too_long[16..18].copy_from_slice(&total.to_be_bytes());
    fix_ip_checksum(&mut too_long);
    for (n, (what, input)) in [
        ("bad IP header checksum", bad_checksum),
        ("multicast source", multicast),
        ("total length beyond the frame", too_long),
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input), "{what}");
        assert_eq!(
            passed(&sel, Direction::Egress, PassReason::BadHeader),
            n as u64 + 1,
            "{what}"
        );
    }
    assert_eq!(sum_passed(&sel), 3);
    assert!(sel.inflight().unwrap().is_empty());
    assert_eq!(counters(&sel).issued, [5, 0, 0]);
    assert!(stats(&sel).iter().all(|s| *s == BackendStats::default()));
}
