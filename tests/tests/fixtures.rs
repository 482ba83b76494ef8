//! Packet fixtures through BPF_PROG_TEST_RUN: exact input packets, exact
//! expected output packets and verdicts, checksums checked by an independent
//! implementation (etherparse). Programs are loaded, not attached.

use std::time::Duration;

use aya::maps::{Array, PerCpuArray};
use etherparse::PacketBuilder;
use selector_common::{
    BackendStats, Descriptor, Direction, InflightKey, MARK_REDIRECTED, PassReason, Policy,
    inflight::{MARK_BITS, PROBE_WINDOW, key_hashes, probe, slots_for},
    latency, names, programs,
};
use selector_testbed::frames::{
    CLIENT, CLIENT_MAC, CLIENT_PORT, DNS_NOT_QUERIES, DNS_QUERY, ETH_ADDRS, GET, IP_CHECK, IP_DST,
    IP_SRC, PRIMARY_MAC, SET, TC_ACT_PIPE, TC_ACT_REDIRECT, TC_ACT_SHOT, UDP_CHECK, UDP_DST,
    UDP_SRC, VALUE, XDP_DROP, XDP_PASS, assert_only_changed, counters, dns_server, egress,
    egress_gso, egress_marked, fits_skb_test_run, passed, replica, request, run_tc, run_xdp,
    set_issued, settings_for, stats, udp, verified_endpoints, verified_ipv4,
};
use selector_testbed::loaded::{self, Loaded};
use selector_user::{Selector, Settings, host::sys};

fn selector() -> Loaded {
    selector_for(Descriptor::memcached(), replica)
}

fn selector_for(descriptor: Descriptor, member: fn(usize) -> ([u8; 4], u16)) -> Loaded {
    loaded::load(&settings_for(descriptor, member)).expect("load")
}

fn response_from(i: usize) -> Vec<u8> {
    udp(replica(i), (CLIENT, CLIENT_PORT), VALUE)
}

fn key(id: u64) -> InflightKey {
    InflightKey::ipv4(CLIENT, CLIENT_PORT, 0, id)
}

/// A request in flight as egress would leave it (counted as issued),
/// sent `age` ago.
fn insert_inflight_aged(sel: &mut Selector, id: u64, primary: u32, chosen: u32, age: Duration) {
    let sent = sys::monotonic_ns() - age.as_nanos() as u64;
    assert!(sel.plant_inflight(&key(id), primary, chosen, sent));
}

fn insert_inflight(sel: &mut Selector, id: u64, primary: u32, chosen: u32) {
    insert_inflight_aged(sel, id, primary, chosen, Duration::from_millis(1));
}

#[test]
fn redirected_request_changes_only_destination_and_checksums() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 5); // primary 5 pending, replica 1 has 0: over threshold 1
    let input = request(GET);
    let (verdict, out) = egress(&mut sel, &input);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_only_changed(&input, &out, &[IP_CHECK, IP_DST, UDP_DST, UDP_CHECK]);
    let (src, dst) = verified_endpoints(&out);
    assert_eq!(src, (CLIENT, CLIENT_PORT));
    assert_eq!(dst, replica(1));
    assert_ne!(out[UDP_CHECK], input[UDP_CHECK]);

    let c = counters(&sel);
    assert_eq!((c.issued[0], c.issued[1]), (5, 1));
    let s = stats(&sel);
    assert_eq!(
        (s[0].requests, s[0].redirected_away, s[1].redirected_to),
        (1, 1, 1)
    );
    let inflight = sel.inflight().unwrap();
    assert_eq!(inflight.len(), 1);
    assert_eq!(inflight[0].key(), key(0x1234));
    assert_eq!((inflight[0].primary, inflight[0].chosen), (0, 1));

    // A retransmit follows the first copy and is not counted again.
    let (verdict, again) = egress(&mut sel, &input);
    assert_eq!((verdict, &again), (TC_ACT_REDIRECT, &out));
    assert_eq!(counters(&sel).issued[1], 1);
    assert_eq!(stats(&sel)[0].requests, 1);
    assert_eq!(stats(&sel)[1].requests, 0);
}

#[test]
fn redirected_copy_is_marked_and_passes_its_second_egress_untouched() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    let other_bits = 0x42;
    let (verdict, out, mark) = egress_marked(&mut sel, &request(GET), other_bits);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(mark, other_bits | MARK_REDIRECTED);
    // bpf_redirect_neigh sends it through egress again: passed as is, the
    // bit cleared, nothing counted, even once its entry is gone.
    for entry_gone in [false, true] {
        if entry_gone {
            // Its reply completes it.
            let mut reply = response_from(1);
            reply[42..44].copy_from_slice(&0x1234u16.to_be_bytes());
            run_xdp(&mut sel, &reply);
            assert!(sel.inflight().unwrap().is_empty());
        }
        let (verdict, again, mark) = egress_marked(&mut sel, &out, other_bits | MARK_REDIRECTED);
        assert_eq!((verdict, &again, mark), (TC_ACT_PIPE, &out, other_bits));
        assert_eq!(counters(&sel).issued[..3], [5, 1, 0]);
        assert_eq!(stats(&sel)[1].requests, 0);
    }
}

#[test]
fn a_gso_batch_of_requests_passes_untouched_and_counted_as_segmented() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 5); // a lone read would move
    // Two reads with their own ids, as UDP_SEGMENT sends them in one skb.
    let mut second = GET.to_vec();
    second[..2].copy_from_slice(&0x5678u16.to_be_bytes());
    let input = request(&[GET, &second].concat());
    let (verdict, out) = egress_gso(&mut sel, &input, GET.len() as u32, 2);
    assert_eq!((verdict, &out), (TC_ACT_PIPE, &input));
    assert_eq!(passed(&sel, Direction::Egress, PassReason::Segmented), 1);
    assert_eq!(stats(&sel)[0].requests, 0);
    assert_eq!(counters(&sel).issued[..3], [5, 0, 0]);
    assert!(sel.inflight().unwrap().is_empty());
    // The same bytes as one datagram are one read, and it moves.
    let (verdict, _) = egress(&mut sel, &input);
    assert_eq!(verdict, TC_ACT_REDIRECT);
}

#[test]
fn a_redirect_to_a_known_next_hop_writes_its_ethernet_addresses_and_continues() {
    use aya::maps::Array;
    use selector_common::NextHopMac;
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    // The test run's skb belongs to the loopback device (ifindex 1).
    let hop = NextHopMac {
        dst: [0x02, 0, 0, 0, 0, 0x11],
        src: [0x02, 0, 0, 0, 0, 0x22],
        ifindex: 1,
    };
    let set_next_hop = |sel: &mut Selector, id: u32, hop: NextHopMac| {
        let mut next_hops: Array<_, NextHopMac> =
            Array::try_from(sel.ebpf_mut().map_mut(names::NEXT_HOPS).unwrap()).unwrap();
        next_hops.set(id, hop, 0).unwrap();
    };
    set_next_hop(&mut sel, 1, hop);
    let input = request(GET);
    let (verdict, out, mark) = egress_marked(&mut sel, &input, 0);
    assert_eq!(verdict, TC_ACT_PIPE, "continues: no second pass");
    assert_eq!(mark, 0, "not marked for a second pass");
    assert_eq!(out[..6], hop.dst);
    assert_eq!(out[6..12], hop.src);
    assert_only_changed(
        &input,
        &out,
        &[ETH_ADDRS, IP_CHECK, IP_DST, UDP_DST, UDP_CHECK],
    );
    assert_eq!(verified_endpoints(&out).1, replica(1));
    let s = stats(&sel);
    assert_eq!((s[1].redirected_to, s[1].redirected_direct), (1, 1));

    // A next hop on another device is not ours to use: the neighbour path.
    for id in [1, 2] {
        set_next_hop(&mut sel, id, NextHopMac { ifindex: 99, ..hop });
    }
    let mut other = request(GET);
    other[42..44].copy_from_slice(&0x4321u16.to_be_bytes());
    let (verdict, out, _) = egress_marked(&mut sel, &other, 0);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(out[..12], other[..12]);
    let s = stats(&sel);
    let replicas = |f: fn(&BackendStats) -> u64| s[1..3].iter().map(f).sum::<u64>();
    assert_eq!(
        (
            replicas(|b| b.redirected_to),
            replicas(|b| b.redirected_direct)
        ),
        (2, 1)
    );
}

#[test]
fn the_applications_own_failover_with_the_same_id_is_left_alone() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    let (verdict, _) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    // The application gives up on the primary and asks replica 2 itself.
    let failover = udp((CLIENT, CLIENT_PORT), replica(2), GET);
    assert_eq!(egress(&mut sel, &failover), (TC_ACT_PIPE, failover));
    assert_eq!(stats(&sel)[2].id_collisions, 1);
    assert_eq!(counters(&sel).issued[..3], [5, 1, 0]);
    // Its reply, from replica 2, is not the in-flight request's: untouched.
    let reply = response_from(2);
    assert_eq!(run_xdp(&mut sel, &reply), (XDP_PASS, reply));
}

#[test]
fn full_in_flight_table_passes_requests_untracked_and_untouched() {
    let settings = Settings {
        inflight_max: 1,
        ..settings_for(Descriptor::memcached(), replica)
    };
    let mut sel = loaded::load(&settings).unwrap();
    set_issued(&mut sel, 0, 5);
    // Sized for one request, the table has four slots (headroom for the
    // probe windows): four reads fill it.
    let read = |id: u8| {
        let mut get = GET.to_vec();
        get[1] = id;
        request(&get)
    };
    for id in [1, 2, 3, 4] {
        let (verdict, _) = egress(&mut sel, &read(id));
        assert_eq!(verdict, TC_ACT_REDIRECT);
    }
    // A fifth read finds no free slot: it goes where the application sent
    // it, untouched and uncounted.
    let input = read(5);
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    let s = stats(&sel);
    assert_eq!(
        (s[0].requests, s[0].untracked, s[0].redirected_away),
        (5, 1, 4)
    );
    assert_eq!(sel.inflight().unwrap().len(), 4);
    let issued: u64 = counters(&sel).issued.iter().sum();
    assert_eq!(issued, 5 + 4);
}

#[test]
fn custom_descriptor_reads_a_wide_id_and_a_prefix_deep_in_the_payload() {
    // An 8-byte id at offset 100 and reads marked by "RD" at offset 240.
    let descriptor = Descriptor::custom(100, 8, 240, b"RD").unwrap();
    let mut sel = loaded::load(&settings_for(descriptor, replica)).unwrap();
    set_issued(&mut sel, 0, 5);
    let mut payload = vec![b'.'; 300];
    payload[100..108].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    payload[240..242].copy_from_slice(b"RD");
    let (verdict, out) = egress(&mut sel, &request(&payload));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(verified_endpoints(&out).1, replica(1));
    assert_eq!(sel.inflight().unwrap()[0].request_id, 0x0102_0304_0506_0708);
    // A write (no prefix) with another id is tracked but stays.
    payload[107] = 9;
    payload[240..242].copy_from_slice(b"WR");
    let input = request(&payload);
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    // Too short to hold the id: passed and counted as such.
    let input = request(&payload[..104]);
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    assert_eq!(passed(&sel, Direction::Egress, PassReason::NoRequestId), 1);
}

#[test]
fn request_under_threshold_is_tracked_and_untouched() {
    let mut sel = selector();
    let input = request(GET);
    let (verdict, out) = egress(&mut sel, &input);
    assert_eq!((verdict, &out), (TC_ACT_PIPE, &input));
    assert_eq!(counters(&sel).issued[0], 1);
    assert_eq!(sel.pending().unwrap(), vec![1, 0, 0]);
    assert_eq!(sel.inflight().unwrap()[0].chosen, 0);
}

#[test]
fn writes_are_tracked_but_never_redirected() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 50);
    let input = request(SET);
    let (verdict, out) = egress(&mut sel, &input);
    assert_eq!((verdict, &out), (TC_ACT_PIPE, &input));
    assert_eq!(counters(&sel).issued[0], 51);
    assert_eq!(stats(&sel)[0].redirected_away, 0);
}

#[test]
fn observe_policy_never_redirects() {
    let mut sel = selector();
    sel.set_policy(Policy::Observe, 1).unwrap();
    set_issued(&mut sel, 0, 50);
    let input = request(GET);
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    assert_eq!(counters(&sel).issued[0], 51);
}

#[test]
fn drained_replica_is_never_chosen() {
    let mut sel = selector();
    sel.set_drained(1, true).unwrap();
    set_issued(&mut sel, 0, 5);
    let (verdict, out) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(verified_endpoints(&out).1, replica(2));
}

/// Packets the selector does not understand or does not own.
fn pass_through_cases() -> Vec<(&'static str, Vec<u8>)> {
    let mut cases = Vec::new();
    cases.push((
        "not a backend port",
        udp((CLIENT, CLIENT_PORT), (replica(0).0, 11299), GET),
    ));
    cases.push((
        "not a backend address",
        udp((CLIENT, CLIENT_PORT), ([10, 77, 0, 99], 11211), GET),
    ));
    let mut tcp = Vec::new();
    PacketBuilder::ethernet2(CLIENT_MAC, PRIMARY_MAC)
        .ipv4(CLIENT, replica(0).0, 64)
        .tcp(CLIENT_PORT, replica(0).1, 1, 1000)
        .write(&mut tcp, GET)
        .unwrap();
    cases.push(("TCP to a backend", tcp));
    let full = request(GET);
    cases.push(("truncated in the UDP header", full[..14 + 20 + 4].to_vec()));
    cases.push(("truncated in the IPv4 header", full[..14 + 12].to_vec()));
    cases.push(("Ethernet header only", full[..14].to_vec()));
    // Same datagram with 4 bytes of IP options (NOPs): IHL 6.
    let mut opts = full[..34].to_vec();
    opts.extend_from_slice(&[1, 1, 1, 1]);
    opts.extend_from_slice(&full[34..]);
    opts[14] = 0x46;
    let tot = u16::from_be_bytes([opts[16], opts[17]]) + 4;
    opts[16..18].copy_from_slice(&tot.to_be_bytes());
    cases.push(("IPv4 options", opts));
    let mut frag = full.clone();
    frag[20] |= 0x20; // more fragments
    cases.push(("first fragment", frag));
    let mut v6 = Vec::new();
    PacketBuilder::ethernet2(CLIENT_MAC, PRIMARY_MAC)
        .ipv6([0xfd; 16], [0xfe; 16], 64)
        .udp(CLIENT_PORT, replica(0).1)
        .write(&mut v6, GET)
        .unwrap();
    cases.push(("IPv6", v6));
    let mut short_udp = full.clone();
    // UDP length claims more than the IP packet holds.
    short_udp[38..40].copy_from_slice(&500u16.to_be_bytes());
    cases.push(("UDP length beyond IP length", short_udp));
    cases
}

#[test]
fn egress_passes_what_it_does_not_own_byte_identical() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    for (what, input) in pass_through_cases()
        .into_iter()
        .filter(|(_, frame)| fits_skb_test_run(frame))
    {
        let (verdict, out) = egress(&mut sel, &input);
        assert_eq!(verdict, TC_ACT_PIPE, "{what}");
        assert_eq!(out, input, "{what} must pass untouched");
    }
    assert!(sel.inflight().unwrap().is_empty());
    assert_eq!(counters(&sel).issued, [5, 0, 0]);
    assert!(stats(&sel).iter().all(|s| *s == BackendStats::default()));
}

/// An IGMPv3 membership report as hosts on the client's link send it:
/// IPv4 with a Router Alert option (IHL 6), from 0.0.0.0 to 224.0.0.22.
fn igmp_report() -> Vec<u8> {
    let mut ip = vec![
        0x46, 0xc0, 0, 40, 0, 0, 0x40, 0, 1, 2, 0, 0, 0, 0, 0, 0, 224, 0, 0, 22, // header
        0x94, 4, 0, 0, // Router Alert
        0x22, 0, 0, 0, 0, 0, 0, 1, // report, one group record
        4, 0, 0, 0, 224, 0, 0, 251, // change to exclude, no sources
    ];
    let checksum = |bytes: &[u8]| {
        let mut sum: u32 = bytes
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
            .sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        !(sum as u16)
    };
    let igmp = checksum(&ip[24..]);
    ip[26..28].copy_from_slice(&igmp.to_be_bytes());
    let header = checksum(&ip[..24]);
    ip[10..12].copy_from_slice(&header.to_be_bytes());
    let mut frame = vec![0x01, 0x00, 0x5e, 0, 0, 0x16];
    frame.extend_from_slice(&PRIMARY_MAC);
    frame.extend_from_slice(&[0x08, 0x00]);
    frame.extend_from_slice(&ip);
    frame
}

/// IGMP reports carry an IP option, but are not UDP: not ours, counted as
/// `not_ip_udp` both ways, not as a bad header (the demo counted one per
/// run). A UDP datagram with options still is a bad header.
#[test]
fn igmp_with_its_router_alert_option_passes_as_not_udp() {
    let report = igmp_report();
    let mut sel = selector();
    assert_eq!(run_xdp(&mut sel, &report), (XDP_PASS, report.clone()));
    assert_eq!(egress(&mut sel, &report), (TC_ACT_PIPE, report.clone()));
    for direction in [Direction::Ingress, Direction::Egress] {
        assert_eq!(passed(&sel, direction, PassReason::NotIpUdp), 1);
        assert_eq!(passed(&sel, direction, PassReason::BadHeader), 0);
    }
    let (_, udp_with_options) = pass_through_cases()
        .into_iter()
        .find(|(what, _)| *what == "IPv4 options")
        .unwrap();
    assert_eq!(egress(&mut sel, &udp_with_options).0, TC_ACT_PIPE);
    assert_eq!(passed(&sel, Direction::Egress, PassReason::BadHeader), 1);
}

#[test]
fn ingress_passes_what_it_does_not_own_byte_identical() {
    let mut sel = selector();
    insert_inflight(&mut sel, 0x1234, 0, 1);
    for (what, input) in pass_through_cases() {
        assert_eq!(
            run_xdp(&mut sel, &input),
            (XDP_PASS, input.clone()),
            "XDP: {what}"
        );
        if fits_skb_test_run(&input) {
            let tc = run_tc(&mut sel, programs::INGRESS_TC, &input);
            assert_eq!(tc, (TC_ACT_PIPE, input), "TC: {what}");
        }
    }
    assert_eq!(sel.inflight().unwrap().len(), 1);
}

fn check_response_rewrite(mut run: impl FnMut(&mut Selector, &[u8]) -> (u32, Vec<u8>), pass: u32) {
    let mut sel = selector();
    set_issued(&mut sel, 1, 1);
    insert_inflight(&mut sel, 0x1234, 0, 1);
    let input = response_from(1);
    let (verdict, out) = run(&mut sel, &input);
    assert_eq!(verdict, pass);
    assert_only_changed(&input, &out, &[IP_CHECK, IP_SRC, UDP_SRC, UDP_CHECK]);
    let (src, dst) = verified_endpoints(&out);
    assert_eq!(src, replica(0), "the reply must come from the primary");
    assert_eq!(dst, (CLIENT, CLIENT_PORT));
    assert!(
        sel.inflight().unwrap().is_empty(),
        "the response completes the request"
    );
    assert_eq!(sel.pending().unwrap(), vec![0, 0, 0]);
    let s = stats(&sel);
    assert_eq!((s[1].responses, s[1].unmatched_responses), (1, 0));
    let histograms = sel.latency().unwrap();
    let hist = &histograms[1];
    assert_eq!(hist.iter().sum::<u64>(), 1);
    // Read in batches: each backend gets its own buckets only.
    assert_eq!(histograms[0].iter().sum::<u64>(), 0);
    assert_eq!(histograms[2].iter().sum::<u64>(), 0);
    // Sent 1 ms before: the recorded latency is at least that.
    let bucket = hist.iter().position(|c| *c == 1).unwrap() as u32;
    assert!(latency::bucket_upper_ns(bucket) >= 1_000_000);

    // The same response again (a duplicate) is rewritten too, so a
    // connected socket never sees the replica's address, but not counted.
    let (verdict, dup) = run(&mut sel, &input);
    assert_eq!((verdict, &dup), (pass, &out));
    let s = stats(&sel);
    assert_eq!((s[1].responses, s[1].late_responses), (1, 1));
    assert_eq!(sel.pending().unwrap(), vec![0, 0, 0]);
}

#[test]
fn xdp_rewrites_a_redirected_reply_to_come_from_the_primary() {
    check_response_rewrite(run_xdp, XDP_PASS);
}

#[test]
fn tc_ingress_rewrites_a_redirected_reply_to_come_from_the_primary() {
    check_response_rewrite(
        |sel, input| run_tc(sel, programs::INGRESS_TC, input),
        TC_ACT_PIPE,
    );
}

#[test]
fn a_zero_udp_checksum_stays_zero_through_either_ingress() {
    for tc in [false, true] {
        let mut sel = selector();
        insert_inflight(&mut sel, 0x1234, 0, 1);
        let mut input = response_from(1);
        input[UDP_CHECK].fill(0);
        let (verdict, out) = if tc {
            run_tc(&mut sel, programs::INGRESS_TC, &input)
        } else {
            run_xdp(&mut sel, &input)
        };
        assert_eq!(verdict, if tc { TC_ACT_PIPE } else { XDP_PASS });
        assert_eq!(&out[UDP_CHECK], &[0, 0], "tc: {tc}");
        assert_eq!(&out[IP_SRC], &replica(0).0);
        assert_eq!(verified_endpoints_ip_only(&out), replica(0).0);
        assert!(sel.inflight().unwrap().is_empty());
    }
}

/// The IPv4 header checksum verifies; returns the source address.
fn verified_endpoints_ip_only(frame: &[u8]) -> [u8; 4] {
    verified_ipv4(frame).1.source
}

#[test]
fn only_the_replica_the_request_went_to_completes_it() {
    let mut sel = selector();
    insert_inflight(&mut sel, 0x1234, 0, 1);
    let input = response_from(2);
    assert_eq!(run_xdp(&mut sel, &input), (XDP_PASS, input));
    assert_eq!(sel.inflight().unwrap().len(), 1);
    assert_eq!(stats(&sel)[2].unmatched_responses, 1);
    assert_eq!(stats(&sel)[2].responses, 0);
}

#[test]
fn reply_from_the_primary_completes_without_rewrite() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 1);
    insert_inflight(&mut sel, 0x1234, 0, 0);
    let input = response_from(0);
    assert_eq!(run_xdp(&mut sel, &input), (XDP_PASS, input));
    assert!(sel.inflight().unwrap().is_empty());
    assert_eq!(sel.pending().unwrap(), vec![0, 0, 0]);
}

#[test]
fn sweep_expires_only_old_entries_and_settles_pending() {
    let mut sel = selector();
    set_issued(&mut sel, 1, 2);
    set_issued(&mut sel, 1, 2);
    insert_inflight(&mut sel, 1, 0, 1); // sent 1 ms ago
    // A redirected read sent 1.5 s ago: past the 1 s timeout, within the
    // 1 s grace after it.
    insert_inflight_aged(&mut sel, 2, 0, 1, Duration::from_millis(1500));
    let report = sel.sweep(sys::monotonic_ns()).unwrap();
    assert_eq!(report.expired, 1);
    assert_eq!(sel.inflight().unwrap().len(), 1);
    assert_eq!(sel.pending().unwrap(), vec![0, 1, 0]);
    assert_eq!(sel.expired(), vec![0, 1, 0]);
    // Its reply arrives late, within the grace period: rewritten to come
    // from the primary, so the application still gets it, but not
    // subtracted again.
    let mut value = VALUE.to_vec();
    value[..2].copy_from_slice(&2u16.to_be_bytes());
    let late = udp(replica(1), (CLIENT, CLIENT_PORT), &value);
    let (verdict, out) = run_xdp(&mut sel, &late);
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(verified_endpoints(&out).0, replica(0));
    assert_eq!(sel.pending().unwrap(), vec![0, 1, 0]);
    assert_eq!(stats(&sel)[1].late_responses, 1);
    // After the grace period the slot is freed: the next late copy is
    // unmatched and left as it is.
    let report = sel.sweep(sys::monotonic_ns() + 700_000_000).unwrap();
    assert_eq!((report.freed, report.expired), (1, 0));
    let (verdict, out) = run_xdp(&mut sel, &late);
    assert_eq!((verdict, &out), (XDP_PASS, &late));
    assert_eq!(sel.pending().unwrap(), vec![0, 1, 0]);
    let stats: PerCpuArray<_, BackendStats> =
        PerCpuArray::try_from(sel.ebpf().map(names::STATS).unwrap()).unwrap();
    let unmatched: u64 = stats
        .get(&1, 0)
        .unwrap()
        .iter()
        .map(|s| s.unmatched_responses)
        .sum();
    assert_eq!(unmatched, 1);
}

/// An id reused for a new request while an older instance of its key
/// lingers at the replica it was moved to: a reply from that replica
/// belongs to the older instance, so it is not delivered as the new
/// request's answer (before, it was rewritten to come from the primary, and
/// the application took it for the answer to its new request). Played,
/// through XDP and TC ingress, with the older read answered or expired:
/// 1. GET, primary loaded (5 pending): moved to replica 1;
/// 2. replica 1's reply (answered: passes, rewritten) or a sweep past the
///    timeout (expired);
/// 3. the primary unloaded, GET again with the same id: a new request, kept
///    at the primary;
/// 4. replica 1's reply again (a duplicate, or the late answer to step 1):
///    dropped;
/// 5. the primary's reply: the new request's answer, passes.
#[test]
fn a_reply_from_where_an_older_instance_went_is_not_a_new_requests_answer() {
    for tc in [false, true] {
        for answered in [true, false] {
            let case = format!("tc {tc}, answered {answered}");
            let mut sel = selector();
            let (pass, drop) = if tc {
                (TC_ACT_PIPE, TC_ACT_SHOT)
            } else {
                (XDP_PASS, XDP_DROP)
            };
            let reply = |sel: &mut Selector, from: usize| {
                let input = response_from(from);
                if tc {
                    run_tc(sel, programs::INGRESS_TC, &input)
                } else {
                    run_xdp(sel, &input)
                }
            };
            set_issued(&mut sel, 0, 5);
            assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_REDIRECT);
            if answered {
                let (verdict, out) = reply(&mut sel, 1);
                assert_eq!(verdict, pass, "{case}");
                assert_eq!(verified_endpoints(&out).0, replica(0), "{case}");
            } else {
                let report = sel.sweep(sys::monotonic_ns() + 1_200_000_000).unwrap();
                assert_eq!(report.expired, 1, "{case}");
            }
            set_issued(&mut sel, 0, 0);
            assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_PIPE, "{case}");
            assert_eq!(
                counters(&sel).issued[..3],
                [1, 1, 0],
                "{case}: a new request"
            );
            let (verdict, _) = reply(&mut sel, 1);
            assert_eq!(verdict, drop, "{case}: the older instance's reply");
            assert_eq!(stats(&sel)[1].stale_replies, 1, "{case}");
            let input = response_from(0);
            assert_eq!(reply(&mut sel, 0), (pass, input), "{case}: the new answer");
            assert_eq!(sel.pending().unwrap(), vec![0, 0, 0], "{case}");
            for (b, (issued, completed, expired)) in
                sel.accounting().unwrap().into_iter().enumerate()
            {
                assert_eq!(issued, completed + expired, "{case}: backend {b}");
            }
        }
    }
}

/// A client that reuses one id for reads the selector moves leaves an
/// instance lingering (`timeout + grace`) after each answer, all in the
/// key's one probe window. Once the window is full of them, the next read
/// takes the slot of one it supersedes instead of passing untracked (its
/// reply then taken for a lingering instance's). Played 12 times: GET with
/// the primary loaded (moved to replica 1), replica 1's reply (rewritten).
#[test]
fn a_reused_id_takes_the_slot_of_a_lingering_instance_when_its_window_is_full() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    for n in 0..12 {
        assert_eq!(
            egress(&mut sel, &request(GET)).0,
            TC_ACT_REDIRECT,
            "read {n}"
        );
        let (verdict, out) = run_xdp(&mut sel, &response_from(1));
        assert_eq!(verdict, XDP_PASS, "read {n}");
        assert_eq!(verified_endpoints(&out).0, replica(0), "read {n}");
    }
    let s = stats(&sel);
    assert_eq!((s[0].requests, s[0].untracked), (12, 0));
    assert_eq!((s[1].responses, s[1].late_responses), (12, 0));
    assert_eq!(sel.accounting().unwrap()[1], (12, 12, 0));
}

/// An observing selector (nothing moves), the request id of `GET`, and
/// another id whose home slot shares GET's mark word but lies outside its
/// probe window.
fn neighbours_in_a_mark_word() -> (Loaded, Settings, u64, u64) {
    let settings = settings_for(Descriptor::memcached(), replica).tuned(|t| {
        t.policy = Policy::Observe;
    });
    let mask = slots_for(settings.inflight_max) - 1;
    let home = |id| probe(key_hashes(&key(id)).home, 0, mask);
    let a = 0x1234;
    let b = (1..100_000)
        .find(|&id| {
            home(id) / MARK_BITS == home(a) / MARK_BITS
                && home(id).abs_diff(home(a)) >= 2 * PROBE_WINDOW
        })
        .expect("a neighbour");
    let mut sel = loaded::load(&settings).unwrap();
    set_issued(&mut sel, 0, 1);
    // b: a request sent long ago, expired by the next sweep.
    insert_inflight_aged(&mut sel, b, 0, 0, Duration::from_secs(10));
    (sel, settings, a, b)
}

#[test]
fn a_retransmit_is_known_after_the_sweep_clears_a_mark_beside_it() {
    let (mut sel, settings, a, b) = neighbours_in_a_mark_word();
    let mask = slots_for(settings.inflight_max) - 1;
    let home = |id| probe(key_hashes(&key(id)).home, 0, mask);
    assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_PIPE);
    assert_eq!(stats(&sel)[0].requests, 1);
    // The first sweep expires and frees b's slot, which stays marked; the
    // second finds it free and clears its mark.
    assert_eq!(sel.sweep(sys::monotonic_ns()).unwrap().expired, 1);
    sel.sweep(sys::monotonic_ns()).unwrap();
    let marks: Array<_, u64> =
        Array::try_from(sel.ebpf().map(names::INFLIGHT_MARKS).unwrap()).unwrap();
    let word = marks.get(&(home(a) / MARK_BITS), 0).unwrap();
    assert_eq!(
        word & (1 << (home(b) % MARK_BITS)),
        0,
        "b's stale mark is left"
    );
    assert_ne!(word & (1 << (home(a) % MARK_BITS)), 0, "a's mark is gone");
    // a is still in flight: its copy is a retransmit, not a new request.
    let (verdict, _) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_PIPE);
    assert_eq!(stats(&sel)[0].requests, 1);
    assert_eq!(counters(&sel).issued[0], 2);
    assert_eq!(sel.pending().unwrap(), vec![1, 0, 0]);
}

#[test]
fn a_request_sent_after_the_sweep_passed_its_mark_word_expires_on_time() {
    let (mut sel, settings, _, _) = neighbours_in_a_mark_word();
    // Expire and free b, then clear its mark: the word, now empty, is next
    // visited no later than a timeout after that sweep.
    assert_eq!(sel.sweep(sys::monotonic_ns()).unwrap().expired, 1);
    let cleared = sys::monotonic_ns();
    sel.sweep(cleared).unwrap();
    // a, sent after, lands in that word: a sweep before its timeout leaves
    // it (the word is skipped), the first after it expires it.
    assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_PIPE);
    let timeout = settings.timeout.as_nanos() as u64;
    let early = sel.sweep(cleared + timeout / 2).unwrap();
    assert_eq!((early.expired, early.visited), (0, 0));
    assert_eq!(sel.pending().unwrap(), vec![1, 0, 0]);
    let after = sys::monotonic_ns() + timeout + 1_000_000;
    assert_eq!(sel.sweep(after).unwrap().expired, 1);
    assert_eq!(sel.pending().unwrap(), vec![0, 0, 0]);
}

#[test]
fn dns_queries_are_redirected_and_answers_rewritten_back() {
    let mut sel = selector_for(Descriptor::dns(), dns_server);
    set_issued(&mut sel, 0, 3);
    // A query for example.org A, id 0xbeef.
    let query = DNS_QUERY;
    let input = udp((CLIENT, CLIENT_PORT), dns_server(0), query);
    let (verdict, out) = egress(&mut sel, &input);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_only_changed(&input, &out, &[IP_CHECK, IP_DST, UDP_CHECK]);
    assert_eq!(verified_endpoints(&out).1, dns_server(1));
    assert_eq!(sel.inflight().unwrap()[0].request_id, 0xbeef);

    let mut answer = query.to_vec();
    answer[2] = 0x81; // QR: a response
    let reply = udp(dns_server(1), (CLIENT, CLIENT_PORT), &answer);
    let (verdict, out) = run_xdp(&mut sel, &reply);
    assert_eq!(verdict, XDP_PASS);
    assert_only_changed(&reply, &out, &[IP_CHECK, IP_SRC, UDP_CHECK]);
    assert_eq!(verified_endpoints(&out).0, dns_server(0));
    assert_eq!(sel.pending().unwrap(), vec![3, 0, 0]);
}

/// Issue 21: a datagram to a DNS member that is no standard query (a local
/// user's junk) would otherwise count as pending for a whole timeout and
/// push real lookups off a healthy primary.
#[test]
fn dns_datagrams_that_are_no_query_pass_untouched_and_are_not_pending() {
    let mut sel = selector_for(Descriptor::dns(), dns_server);
    // Over the threshold: a tracked read would be steered to member 1.
    set_issued(&mut sel, 0, 3);
    for (n, (what, payload)) in DNS_NOT_QUERIES.iter().enumerate() {
        let input = udp((CLIENT, CLIENT_PORT), dns_server(0), payload);
        assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input), "{what}");
        assert_eq!(counters(&sel).issued[..3], [3, 0, 0], "{what}");
        assert!(sel.inflight().unwrap().is_empty(), "{what}");
        assert_eq!(stats(&sel)[0].requests, 0, "{what}");
        assert_eq!(
            passed(&sel, Direction::Egress, PassReason::NotRequest),
            n as u64 + 1,
            "{what}"
        );
    }
    // A real query is tracked (and steered).
    let input = udp((CLIENT, CLIENT_PORT), dns_server(0), DNS_QUERY);
    let (verdict, out) = egress(&mut sel, &input);
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(verified_endpoints(&out).1, dns_server(1));
    assert_eq!(counters(&sel).issued[..3], [3, 1, 0]);
    assert_eq!(sel.inflight().unwrap()[0].request_id, 0xbeef);
    // A response-shaped datagram with its id is no retransmit of it.
    let (_, qr1) = DNS_NOT_QUERIES[2];
    let input = udp((CLIENT, CLIENT_PORT), dns_server(0), qr1);
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    assert_eq!(counters(&sel).issued[..3], [3, 1, 0]);
    assert_eq!(
        passed(&sel, Direction::Egress, PassReason::NotRequest),
        DNS_NOT_QUERIES.len() as u64 + 1
    );
}

/// memcached: only a frame header a request carries (sequence 0, one
/// datagram, reserved 0) makes a datagram a request.
#[test]
fn memcached_frames_that_are_no_request_pass_untouched_and_are_not_pending() {
    let mut sel = selector();
    set_issued(&mut sel, 0, 5);
    let frames: [(&str, &[u8]); 5] = [
        ("7 bytes", b"\x12\x34\x00\x00\x00\x01\x00"),
        ("sequence 1", b"\x12\x34\x00\x01\x00\x01\x00\x00get foo\r\n"),
        ("total 0", b"\x12\x34\x00\x00\x00\x00\x00\x00get foo\r\n"),
        ("total 2", b"\x12\x34\x00\x00\x00\x02\x00\x00get foo\r\n"),
        ("reserved 1", b"\x12\x34\x00\x00\x00\x01\x00\x01get foo\r\n"),
    ];
    for (n, (what, payload)) in frames.iter().enumerate() {
        let input = request(payload);
        assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input), "{what}");
        assert_eq!(counters(&sel).issued[..3], [5, 0, 0], "{what}");
        assert!(sel.inflight().unwrap().is_empty(), "{what}");
        assert_eq!(
            passed(&sel, Direction::Egress, PassReason::NotRequest),
            n as u64 + 1,
            "{what}"
        );
    }
    let (verdict, out) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(verified_endpoints(&out).1, replica(1));
    assert_eq!(counters(&sel).issued[..3], [5, 1, 0]);
}

#[test]
fn sweep_walks_a_large_table_to_the_end() {
    let settings = Settings {
        // A table a quarter full: a probe window practically never fills.
        inflight_max: 8192,
        ..settings_for(Descriptor::memcached(), replica)
    };
    let mut sel = loaded::load(&settings).unwrap();
    set_issued(&mut sel, 2, 5000);
    for id in 0..5000u64 {
        insert_inflight_aged(&mut sel, id, 2, 2, Duration::from_secs(5));
    }
    let listed = sel.inflight().unwrap();
    let mut ids: Vec<u64> = listed.iter().map(|s| s.request_id).collect();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!((listed.len(), ids.len()), (5000, 5000));
    assert_eq!(sel.sweep(sys::monotonic_ns()).unwrap().expired, 5000);
    assert!(sel.inflight().unwrap().is_empty());
    assert_eq!(sel.pending().unwrap(), vec![0, 0, 0]);
    assert_eq!(sel.expired(), vec![0, 0, 5000]);
}

/// A selector whose programs take the agent for gone once its heartbeat is
/// older than 1 s.
fn selector_with_heartbeat() -> Loaded {
    let settings = Settings {
        heartbeat_bound: Duration::from_secs(1),
        ..settings_for(Descriptor::memcached(), replica)
    };
    loaded::load(&settings).expect("load")
}

/// A memcached get with request id `id`.
fn get_with_id(id: u16) -> Vec<u8> {
    let mut payload = GET.to_vec();
    payload[..2].copy_from_slice(&id.to_be_bytes());
    request(&payload)
}

/// Issue 20, item 3: with the agent gone (its heartbeat older than the
/// bound) no read moves, however loaded its primary looks: it goes where
/// it was sent, tracked and counted; a retransmit of a read moved before
/// still follows it, and its reply is still rewritten back. A sweep (an
/// agent back) resumes steering at once.
#[test]
fn a_stale_heartbeat_moves_no_read_but_tracks_it_and_rewrites_earlier_moves() {
    let mut sel = selector_with_heartbeat();
    set_issued(&mut sel, 0, 5); // over threshold 1
    sel.plant_heartbeat(sys::monotonic_ns());
    let moved_input = get_with_id(0x1234);
    let (verdict, moved) = egress(&mut sel, &moved_input);
    assert_eq!(verdict, TC_ACT_REDIRECT, "fresh heartbeat: the read moves");
    assert_eq!(verified_endpoints(&moved).1, replica(1));

    let stale_ns = sys::monotonic_ns() - 2_000_000_000;
    sel.plant_heartbeat(stale_ns);
    let input = get_with_id(0x1235);
    assert_eq!(
        egress(&mut sel, &input),
        (TC_ACT_PIPE, input.clone()),
        "stale heartbeat: the read goes where it was sent"
    );
    assert_eq!(counters(&sel).issued[..3], [6, 1, 0], "and is counted");
    let s = stats(&sel);
    assert_eq!((s[0].requests, s[0].redirected_away), (2, 1));
    let tracked = sel.inflight().unwrap();
    let entry = tracked.iter().find(|e| e.key() == key(0x1235)).unwrap();
    assert_eq!((entry.primary, entry.chosen), (0, 0));
    // A retransmit of the read moved before follows its first copy.
    assert_eq!(egress(&mut sel, &moved_input), (TC_ACT_REDIRECT, moved));
    // Its reply comes back from the primary's address.
    let mut reply = response_from(1);
    reply[42..44].copy_from_slice(&0x1234u16.to_be_bytes());
    let (verdict, out) = run_tc(&mut sel, programs::INGRESS_TC, &reply);
    assert_eq!(verdict, TC_ACT_PIPE);
    assert_eq!(verified_endpoints(&out).0, replica(0));
    assert_eq!(sel.pending().unwrap(), vec![6, 0, 0]);
    assert_eq!(stats(&sel)[0].redirected_away, 1, "no new move");

    // A sweep writes the heartbeat: the next read over the threshold moves.
    sel.sweep(sys::monotonic_ns()).unwrap();
    let (verdict, out) = egress(&mut sel, &get_with_id(0x1236));
    assert_eq!(verdict, TC_ACT_REDIRECT, "steering resumes at once");
    assert_eq!(verified_endpoints(&out).1, replica(1));
    // Bound 0: never stale, whatever the heartbeat says.
    sel.settings.heartbeat_bound = Duration::ZERO;
    sel.write_config().unwrap();
    sel.plant_heartbeat(stale_ns);
    assert_eq!(egress(&mut sel, &get_with_id(0x1237)).0, TC_ACT_REDIRECT);
}

/// Nor does a stale heartbeat let the overload bounds act on counts no
/// sweep keeps: a read to a member at --max-pending is sent, not dropped.
#[test]
fn a_stale_heartbeat_applies_no_overload_bound() {
    let mut sel = selector_with_heartbeat();
    sel.settings.tunables.max_pending = 1;
    sel.settings.tunables.on_overload = selector_common::OnOverload::Drop;
    sel.write_config().unwrap();
    for member in 0..3 {
        set_issued(&mut sel, member, 5);
    }
    assert_eq!(
        egress(&mut sel, &get_with_id(1)).0,
        TC_ACT_SHOT,
        "fresh: dropped"
    );
    sel.plant_heartbeat(sys::monotonic_ns() - 2_000_000_000);
    let input = get_with_id(2);
    assert_eq!(egress(&mut sel, &input), (TC_ACT_PIPE, input));
    assert_eq!(counters(&sel).issued[..3], [6, 5, 5]);
}

/// A slot left in the agent's hold state (an agent killed between taking
/// the hold and releasing it, its pinned maps adopted by the next) held
/// back every retirement for good: the reply path and the sweep cannot
/// tell which member a slot being written names. Unchanged for a second
/// and three sweeps, it is freed, and the removed member retires.
/// A datagram to a port no member has passes before the endpoint lookup
/// (`MEMBER_PORTS`); a reload that adds a member on a new port sets its
/// port's bit before the member's `BACKENDS` entry, so its requests are
/// tracked from then on.
#[test]
fn a_member_on_a_new_port_is_tracked_once_a_reload_adds_it() {
    use std::{net::SocketAddr, time::Instant};

    use selector_user::datapath::regroup::{GroupTable, plan_groups};

    let mut sel = selector();
    let addr = |(a, p): ([u8; 4], u16)| SocketAddr::from((a, p));
    let newcomer = ([10, 77, 0, 20], 11_300);
    let get = udp((CLIENT, CLIENT_PORT), newcomer, GET);
    let (verdict, out) = egress(&mut sel, &get);
    assert_eq!((verdict, &out), (TC_ACT_PIPE, &get));
    assert_eq!(passed(&sel, Direction::Egress, PassReason::NotBackend), 1);

    let table = GroupTable::from_start(&sel.settings.groups, &[None]);
    let members: Vec<SocketAddr> = (0..3)
        .map(|i| addr(replica(i)))
        .chain([addr(newcomer)])
        .collect();
    let changes = plan_groups(&table, &[members], &[None], Instant::now()).unwrap();
    sel.apply_groups(&changes).unwrap();
    sel.backends = changes.table.backends();
    let (verdict, out) = egress(&mut sel, &get);
    assert_eq!((verdict, &out), (TC_ACT_PIPE, &get));
    assert_eq!(
        passed(&sel, Direction::Egress, PassReason::NotBackend),
        1,
        "the newcomer's request passed as no member's"
    );
    assert_eq!(stats(&sel)[3].requests, 1, "tracked as the newcomer's");
}

#[test]
fn a_slot_stuck_in_the_hold_state_is_freed_and_retirement_goes_on() {
    use std::{net::SocketAddr, time::Instant};

    use selector_user::datapath::regroup::{GroupTable, plan_groups};

    let mut sel = selector();
    assert!(sel.plant_hold(5));
    let addr = |(a, p): ([u8; 4], u16)| SocketAddr::from((a, p));
    let mut table = GroupTable::from_start(&sel.settings.groups, &[None]);
    let changes = plan_groups(
        &table,
        &[vec![addr(replica(0)), addr(replica(2))]],
        &[None],
        Instant::now(),
    )
    .unwrap();
    sel.apply_groups(&changes).unwrap();
    table = changes.table;
    sel.backends = table.backends();
    let mut retire = |sel: &mut Selector| {
        sel.retire_finished(&mut table, Duration::ZERO, Instant::now())
            .unwrap()
    };
    let start = sys::monotonic_ns();
    let mut reclaimed = 0;
    // A writer may hold a slot for a moment: not freed within the second.
    for ms in [0, 400, 800] {
        reclaimed += sel.sweep(start + ms * 1_000_000).unwrap().reclaimed;
        assert!(retire(&mut sel).is_empty(), "held at {ms} ms");
    }
    assert_eq!(reclaimed, 0);
    for ms in [1200, 1600, 2000, 5000, 10_000] {
        reclaimed += sel.sweep(start + ms * 1_000_000).unwrap().reclaimed;
    }
    assert_eq!(reclaimed, 1, "freed once");
    assert_eq!(retire(&mut sel), vec![addr(replica(1))]);
    // Free again: a request may take it.
    assert!(sel.plant_hold(5));
}

/// The fixture suites reuse loaded programs (`selector_testbed::loaded`):
/// a recycled selector must hold exactly what a new load holds, whatever
/// the test before it left in the maps.
#[test]
fn a_recycled_selector_holds_what_a_new_load_holds() {
    use selector_user::datapath::recycle::dump_maps;
    // Recycled for other members: none of the first ones' may stay.
    let next = settings_for(Descriptor::dns(), dns_server);
    let expected = dump_maps(&Selector::load(&next).expect("load")).unwrap();
    let mut sel = loaded::load(&settings_for(Descriptor::memcached(), replica))
        .expect("load")
        .into_inner();
    let id = |sel: &Selector| {
        sel.ebpf()
            .program(programs::EGRESS)
            .unwrap()
            .info()
            .unwrap()
            .id()
    };
    let programs_before = id(&sel);
    // Everything a test leaves: counts, a moved read and its reply's
    // latency and stats, a request in flight, a drained member, a pass
    // reason, a fragment.
    set_issued(&mut sel, 0, 5);
    assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_REDIRECT);
    run_xdp(&mut sel, &response_from(1));
    insert_inflight(&mut sel, 0x4321, 0, 2);
    sel.set_drained(2, true).unwrap();
    run_xdp(&mut sel, &udp(replica(2), (CLIENT, CLIENT_PORT), b"junk"));
    assert_ne!(
        dump_maps(&sel).unwrap(),
        expected,
        "nothing was left to clear"
    );
    assert!(sel.recyclable());
    let again = sel.recycle(&next).expect("recycle");
    assert_eq!(
        id(&again),
        programs_before,
        "the programs were loaded again"
    );
    let left: Vec<String> = dump_maps(&again)
        .unwrap()
        .into_iter()
        .zip(&expected)
        .filter(|(got, want)| got != *want)
        .map(|(got, _)| got.0)
        .collect();
    assert!(left.is_empty(), "maps not as a new load's: {left:?}");
}
