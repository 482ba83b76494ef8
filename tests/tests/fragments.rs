//! IP-fragmented replies to moved reads, over IPv4 and IPv6, through both
//! reply programs (XDP and TC ingress) with BPF_PROG_TEST_RUN: the first
//! fragment carries the UDP header and decides; the later ones are known
//! only by (source, destination, IP id, protocol) and get the same source
//! address. Covered: first, middle and last in order (the series ends with
//! the last); the last overtaking the first, or a middle one; an id reused
//! by another datagram from the same host; an entry past its age; another
//! protocol with the same id; a series evicted from the full map; requests
//! that are fragments. Reassembled by hand and checked with etherparse.
//! Programs are loaded, not attached.

use std::{
    net::{IpAddr, Ipv6Addr, SocketAddr},
    time::Duration,
};

use aya::maps::HashMap;
use etherparse::{NetHeaders, PacketHeaders, TransportHeader};
use selector_common::{
    Descriptor, Direction, InflightKey, PassReason,
    fragments::{FRAGMENT_TTL_NS, FRAGMENTS_MAX, FragmentEntry, FragmentKey},
    names, programs,
};
use selector_testbed::frames::{
    CLIENT_MAC, GET, PRIMARY_MAC, TC_ACT_PIPE, XDP_PASS, assert_only_changed, egress, passed,
    replica, run_tc, run_xdp, set_issued, settings_for, stats, udp, udp6, verified_endpoints,
};
use selector_user::{Selector, Settings, host::sys};

const CLIENT_PORT: u16 = 40_000;
/// The read the fragmented reply answers (memcached request id).
const READ_ID: u64 = 0x1234;
/// The age past which a fragment series is forgotten.
const FRAGMENT_TTL: Duration = Duration::from_nanos(FRAGMENT_TTL_NS);
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    V4,
    V6,
}
use Family::{V4, V6};

impl Family {
    fn client(self) -> IpAddr {
        match self {
            V4 => IpAddr::from([10, 77, 0, 1]),
            V6 => IpAddr::from(Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 1)),
        }
    }

    /// Member i: 10.77.0.(10+i) or fd77::(0x10+i), port 11211+i.
    fn member(self, i: usize) -> (IpAddr, u16) {
        let addr = match self {
            V4 => IpAddr::from(replica(i).0),
            V6 => IpAddr::from(Ipv6Addr::new(0xfd77, 0, 0, 0, 0, 0, 0, 0x10 + i as u16)),
        };
        (addr, 11211 + i as u16)
    }

    /// Ethernet + IP header of a fragment (for IPv6 with its fragment
    /// header): where a fragment's data starts.
    fn data_offset(self) -> usize {
        match self {
            V4 => 14 + 20,
            V6 => 14 + 40 + 8,
        }
    }

    fn src_range(self) -> std::ops::Range<usize> {
        match self {
            V4 => 26..30,
            V6 => 22..38,
        }
    }

    /// What a rewrite of a later fragment may change: the source address
    /// and, over IPv4, the header checksum.
    fn later_changes(self) -> Vec<std::ops::Range<usize>> {
        match self {
            V4 => vec![24..26, self.src_range()],
            V6 => vec![self.src_range()],
        }
    }

    /// The same for the first fragment: also its UDP source port and
    /// checksum.
    fn first_changes(self) -> Vec<std::ops::Range<usize>> {
        let d = self.data_offset();
        let mut c = self.later_changes();
        c.extend([d..d + 2, d + 6..d + 8]);
        c
    }

    /// A large id, so the IPv6 one uses all 32 bits.
    fn id(self) -> u32 {
        match self {
            V4 => 0x4242,
            V6 => 0x8042_4242,
        }
    }
}

fn octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The address as the in-flight key holds it (IPv4-mapped for IPv4).
fn mapped(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    }
}

fn selector(f: Family) -> Selector {
    let settings = Settings {
        groups: vec![
            (0..3)
                .map(|i| SocketAddr::from(f.member(i)))
                .collect::<Vec<_>>(),
        ],
        ..settings_for(Descriptor::memcached(), replica)
    };
    Selector::load(&settings).expect("load")
}

/// A selector with a read moved from member 0 to member 1, in flight.
fn moved_read(f: Family) -> Selector {
    let mut sel = selector(f);
    set_issued(&mut sel, 1, 1);
    let key = InflightKey::new(mapped(f.client()), CLIENT_PORT, 0, READ_ID);
    let sent = sys::monotonic_ns() - Duration::from_millis(1).as_nanos() as u64;
    assert!(sel.plant_inflight(&key, 0, 1, sent));
    sel
}

/// A memcached reply of one datagram to the read, 140 bytes with its UDP
/// header, so it splits into fragments of 48, 48 and 44 bytes.
fn reply_value() -> Vec<u8> {
    let mut v = b"\x12\x34\0\0\0\x01\0\0VALUE foo 0 100\r\n".to_vec();
    v.extend_from_slice(&[b'v'; 100]);
    v.extend_from_slice(b"\r\nEND\r\n");
    v
}

/// The UDP datagram (header with a correct checksum, and payload) from
/// `from` to the client.
fn datagram(f: Family, from: (IpAddr, u16), payload: &[u8]) -> Vec<u8> {
    udp_datagram(from, (f.client(), CLIENT_PORT), payload)
}

fn udp_datagram(from: (IpAddr, u16), to: (IpAddr, u16), payload: &[u8]) -> Vec<u8> {
    match (from.0, to.0) {
        (IpAddr::V4(s), IpAddr::V4(t)) => {
            udp((s.octets(), from.1), (t.octets(), to.1), payload)[34..].to_vec()
        }
        (IpAddr::V6(s), IpAddr::V6(t)) => {
            udp6((s.octets(), from.1), (t.octets(), to.1), payload)[54..].to_vec()
        }
        _ => unreachable!(),
    }
}

/// One fragment from `src` to the client: IP id `id`, `protocol` (the IPv4
/// header's, or the IPv6 fragment header's next header), data at byte
/// `offset` of the datagram, more fragments after it if `more`. Valid
/// headers (the IPv4 checksum set).
fn fragment(
    f: Family,
    src: IpAddr,
    id: u32,
    protocol: u8,
    offset: usize,
    more: bool,
    data: &[u8],
) -> Vec<u8> {
    assert_eq!(offset % 8, 0);
    let mut out = Vec::new();
    out.extend_from_slice(&CLIENT_MAC);
    out.extend_from_slice(&PRIMARY_MAC);
    match f {
        V4 => {
            out.extend_from_slice(&[0x08, 0x00]);
            let total = (20 + data.len()) as u16;
            let field = (offset / 8) as u16 | if more { 0x2000 } else { 0 };
            out.extend_from_slice(&[0x45, 0]);
            out.extend_from_slice(&total.to_be_bytes());
            out.extend_from_slice(&(id as u16).to_be_bytes());
            out.extend_from_slice(&field.to_be_bytes());
            out.extend_from_slice(&[64, protocol, 0, 0]);
            out.extend_from_slice(&octets(src));
            out.extend_from_slice(&octets(f.client()));
            fix_ip_checksum(&mut out);
        }
        V6 => {
            out.extend_from_slice(&[0x86, 0xdd]);
            let payload_len = (8 + data.len()) as u16;
            out.extend_from_slice(&[0x60, 0, 0, 0]);
            out.extend_from_slice(&payload_len.to_be_bytes());
            out.extend_from_slice(&[44, 64]);
            out.extend_from_slice(&octets(src));
            out.extend_from_slice(&octets(f.client()));
            let field = offset as u16 | u16::from(more);
            out.extend_from_slice(&[protocol, 0]);
            out.extend_from_slice(&field.to_be_bytes());
            out.extend_from_slice(&id.to_be_bytes());
        }
    }
    out.extend_from_slice(data);
    out
}

fn fix_ip_checksum(frame: &mut [u8]) {
    frame[24..26].fill(0);
    let h = etherparse::Ipv4HeaderSlice::from_slice(&frame[14..34])
        .unwrap()
        .to_header();
    frame[24..26].copy_from_slice(&h.calc_header_checksum().to_be_bytes());
}

/// The reply's three fragments from member 1: first (UDP header and 40
/// bytes), middle, last.
fn reply_fragments(f: Family) -> [Vec<u8>; 3] {
    let d = datagram(f, f.member(1), &reply_value());
    let src = f.member(1).0;
    [
        fragment(f, src, f.id(), IPPROTO_UDP, 0, true, &d[..48]),
        fragment(f, src, f.id(), IPPROTO_UDP, 48, true, &d[48..96]),
        fragment(f, src, f.id(), IPPROTO_UDP, 96, false, &d[96..]),
    ]
}

/// Runs a reply program once: the frame must pass (rewritten or not).
fn reply(sel: &mut Selector, tc: bool, frame: &[u8]) -> Vec<u8> {
    let (verdict, out) = if tc {
        run_tc(sel, programs::INGRESS_TC, frame)
    } else {
        run_xdp(sel, frame)
    };
    assert_eq!(verdict, if tc { TC_ACT_PIPE } else { XDP_PASS });
    out
}

fn source(f: Family, frame: &[u8]) -> IpAddr {
    let b = &frame[f.src_range()];
    match f {
        V4 => IpAddr::from(<[u8; 4]>::try_from(b).unwrap()),
        V6 => IpAddr::from(<[u8; 16]>::try_from(b).unwrap()),
    }
}

/// The datagram the client reassembles from `fragments` (in offset
/// order), as one frame, its checksums verified with etherparse: (source,
/// destination) as parsed.
fn reassembled(f: Family, fragments: &[&[u8]]) -> ((IpAddr, u16), (IpAddr, u16)) {
    let d = f.data_offset();
    let data: Vec<u8> = fragments.iter().flat_map(|x| x[d..].to_vec()).collect();
    let first = fragments[0];
    match f {
        V4 => {
            let mut whole = first[..34].to_vec();
            whole.extend_from_slice(&data);
            whole[16..18].copy_from_slice(&((20 + data.len()) as u16).to_be_bytes());
            whole[20..22].fill(0);
            fix_ip_checksum(&mut whole);
            let ((s, sp), (t, tp)) = verified_endpoints(&whole);
            ((IpAddr::from(s), sp), (IpAddr::from(t), tp))
        }
        V6 => {
            let mut whole = first[..54].to_vec();
            whole[20] = first[54];
            whole[18..20].copy_from_slice(&(data.len() as u16).to_be_bytes());
            whole.extend_from_slice(&data);
            let h = PacketHeaders::from_ethernet_slice(&whole).unwrap();
            let Some(NetHeaders::Ipv6(ip, _)) = h.net.clone() else {
                panic!("not IPv6")
            };
            let Some(TransportHeader::Udp(u)) = h.transport else {
                panic!("not UDP")
            };
            let expected = u.calc_checksum_ipv6(&ip, h.payload.slice()).unwrap();
            assert_eq!(u.checksum, expected, "UDP checksum");
            (
                (IpAddr::from(ip.source), u.source_port),
                (IpAddr::from(ip.destination), u.destination_port),
            )
        }
    }
}

/// Every family through every reply program, each on a fresh selector.
fn each(test: impl Fn(Family, bool, &str)) {
    for f in [V4, V6] {
        for tc in [false, true] {
            test(f, tc, &format!("{f:?}, tc ingress {tc}"));
        }
    }
}

#[test]
fn fragments_in_order_are_all_rewritten_and_the_series_ends_with_the_last() {
    each(|f, tc, case| {
        let mut sel = moved_read(f);
        let [first, middle, last] = reply_fragments(f);
        let primary = f.member(0);

        let out1 = reply(&mut sel, tc, &first);
        assert_only_changed(&first, &out1, &f.first_changes());
        assert_eq!(source(f, &out1), primary.0, "{case}: first fragment");
        let d = f.data_offset();
        assert_eq!(&out1[d..d + 2], &primary.1.to_be_bytes(), "{case}");
        // The first fragment completes the read.
        assert!(sel.inflight().unwrap().is_empty(), "{case}");
        assert_eq!(stats(&sel)[1].responses, 1, "{case}");
        assert_eq!(sel.pending().unwrap(), vec![0, 0, 0], "{case}");

        let out2 = reply(&mut sel, tc, &middle);
        assert_only_changed(&middle, &out2, &f.later_changes());
        assert_eq!(source(f, &out2), primary.0, "{case}: middle fragment");
        let out3 = reply(&mut sel, tc, &last);
        assert_only_changed(&last, &out3, &f.later_changes());
        assert_eq!(source(f, &out3), primary.0, "{case}: last fragment");
        if f == V4 {
            selector_testbed::frames::verified_ipv4(&out2);
            selector_testbed::frames::verified_ipv4(&out3);
        }
        assert_eq!(
            reassembled(f, &[&out1, &out2, &out3]),
            (primary, (f.client(), CLIENT_PORT)),
            "{case}"
        );
        assert_eq!(passed(&sel, Direction::Ingress, PassReason::Fragment), 0);

        // The last fragment ended the series: a later fragment with the
        // same id is another datagram's and passes untouched.
        let stray = fragment(f, f.member(1).0, f.id(), IPPROTO_UDP, 48, false, &[7; 16]);
        assert_eq!(reply(&mut sel, tc, &stray), stray, "{case}: stray");
        assert_eq!(
            passed(&sel, Direction::Ingress, PassReason::Fragment),
            1,
            "{case}"
        );
    });
}

/// The first fragment decides (only it has the UDP header): a later one
/// that overtakes it cannot be matched and passes untouched, counted; the
/// rest of the series is still rewritten. The client then holds fragments
/// from two sources and the datagram does not reassemble, as if a fragment
/// were lost: the read has completed, and the application retries.
#[test]
fn a_later_fragment_that_overtakes_the_first_passes_untouched() {
    each(|f, tc, case| {
        let mut sel = moved_read(f);
        let [first, middle, last] = reply_fragments(f);
        assert_eq!(reply(&mut sel, tc, &last), last, "{case}: last, seen first");
        assert_eq!(
            passed(&sel, Direction::Ingress, PassReason::Fragment),
            1,
            "{case}"
        );
        let out1 = reply(&mut sel, tc, &first);
        assert_eq!(source(f, &out1), f.member(0).0, "{case}: first");
        assert!(sel.inflight().unwrap().is_empty(), "{case}");
        let out2 = reply(&mut sel, tc, &middle);
        assert_eq!(source(f, &out2), f.member(0).0, "{case}: middle");
        assert_eq!(
            passed(&sel, Direction::Ingress, PassReason::Fragment),
            1,
            "{case}"
        );
    });
}

/// The last fragment ends its series: a middle one that it overtook comes
/// too late and passes untouched, counted (the datagram is lost, as if
/// that fragment were).
#[test]
fn a_middle_fragment_overtaken_by_the_last_passes_untouched() {
    each(|f, tc, case| {
        let mut sel = moved_read(f);
        let [first, middle, last] = reply_fragments(f);
        for frame in [&first, &last] {
            let out = reply(&mut sel, tc, frame);
            assert_eq!(source(f, &out), f.member(0).0, "{case}");
        }
        assert_eq!(reply(&mut sel, tc, &middle), middle, "{case}: middle");
        assert_eq!(
            passed(&sel, Direction::Ingress, PassReason::Fragment),
            1,
            "{case}"
        );
    });
}

/// The id of a series whose later fragments were lost is reused by another
/// datagram from the same host (here from a port that is no member, so
/// not a reply to a read): its first fragment passes untouched and so must
/// its later ones.
#[test]
fn an_id_reused_by_another_datagram_is_not_rewritten() {
    each(|f, tc, case| {
        let mut sel = moved_read(f);
        let [first, _, _] = reply_fragments(f);
        let out1 = reply(&mut sel, tc, &first);
        assert_eq!(source(f, &out1), f.member(0).0, "{case}: first");

        let host = f.member(1).0;
        let other = datagram(f, (host, 9999), &reply_value());
        let other_first = fragment(f, host, f.id(), IPPROTO_UDP, 0, true, &other[..48]);
        let other_last = fragment(f, host, f.id(), IPPROTO_UDP, 48, false, &other[48..]);
        assert_eq!(reply(&mut sel, tc, &other_first), other_first, "{case}");
        assert_eq!(
            passed(&sel, Direction::Ingress, PassReason::NotBackend),
            1,
            "{case}"
        );
        assert_eq!(
            reply(&mut sel, tc, &other_last),
            other_last,
            "{case}: the other datagram's last fragment"
        );
        assert_eq!(
            passed(&sel, Direction::Ingress, PassReason::Fragment),
            1,
            "{case}"
        );
    });
}

/// A series whose later fragments never came is forgotten once older than
/// the bound: a later fragment with its id after that passes untouched.
#[test]
fn a_series_past_its_age_is_forgotten() {
    for f in [V4, V6] {
        let mut sels = [false, true].map(|tc| {
            let mut sel = moved_read(f);
            let [first, _, _] = reply_fragments(f);
            let out1 = reply(&mut sel, tc, &first);
            assert_eq!(source(f, &out1), f.member(0).0, "{f:?} tc {tc}: first");
            (sel, tc)
        });
        std::thread::sleep(FRAGMENT_TTL + Duration::from_millis(100));
        for (sel, tc) in &mut sels {
            let [_, _, last] = reply_fragments(f);
            assert_eq!(
                reply(sel, *tc, &last),
                last,
                "{f:?} tc {tc}: a late fragment"
            );
            assert_eq!(
                passed(sel, Direction::Ingress, PassReason::Fragment),
                1,
                "{f:?} tc {tc}"
            );
        }
    }
}

/// A fragment of another protocol with the series' addresses and id is
/// another datagram's: untouched, and the series goes on.
#[test]
fn another_protocol_with_the_same_id_is_not_rewritten() {
    each(|f, tc, case| {
        let mut sel = moved_read(f);
        let [first, middle, last] = reply_fragments(f);
        reply(&mut sel, tc, &first);
        let tcp = fragment(
            f,
            f.member(1).0,
            f.id(),
            IPPROTO_TCP,
            48,
            true,
            &middle[f.data_offset()..],
        );
        assert_eq!(reply(&mut sel, tc, &tcp), tcp, "{case}: TCP fragment");
        // IPv4's parser takes only UDP; IPv6's reaches the fragment header.
        let reason = match f {
            V4 => PassReason::NotIpUdp,
            V6 => PassReason::Fragment,
        };
        assert_eq!(passed(&sel, Direction::Ingress, reason), 1, "{case}");
        for later in [middle, last] {
            let out = reply(&mut sel, tc, &later);
            assert_eq!(source(f, &out), f.member(0).0, "{case}");
        }
    });
}

/// Requests are not fragmented in practice: a fragment to a member passes
/// egress untouched, counted, and is not tracked.
#[test]
fn a_fragmented_request_passes_egress_untouched() {
    for f in [V4, V6] {
        let mut sel = selector(f);
        set_issued(&mut sel, 0, 5);
        let primary = f.member(0);
        let request = udp_datagram((f.client(), CLIENT_PORT), primary, GET);
        let mut first = fragment(f, f.client(), f.id(), IPPROTO_UDP, 0, true, &request[..16]);
        // From the client to the primary.
        let (src, dst) = match f {
            V4 => (26..30, 30..34),
            V6 => (22..38, 38..54),
        };
        first[src].copy_from_slice(&octets(f.client()));
        first[dst].copy_from_slice(&octets(primary.0));
        if f == V4 {
            fix_ip_checksum(&mut first);
        }
        assert_eq!(
            egress(&mut sel, &first),
            (TC_ACT_PIPE, first.clone()),
            "{f:?}"
        );
        assert_eq!(passed(&sel, Direction::Egress, PassReason::Fragment), 1);
        assert!(sel.inflight().unwrap().is_empty());
    }
}

/// Fills `FRAGMENTS` from user space with series of its own until the
/// entry under `key` has been evicted (an LRU map forgets the least
/// recently used); returns how many it inserted.
fn evict(sel: &mut Selector, key: &FragmentKey) -> u32 {
    let map = sel.ebpf_mut().map_mut(names::FRAGMENTS).unwrap();
    let mut map: HashMap<_, FragmentKey, FragmentEntry> = HashMap::try_from(map).unwrap();
    assert!(map.get(key, 0).is_ok(), "the series must be known first");
    let mut n = 0u32;
    while map.get(key, 0).is_ok() {
        assert!(n < 16 * FRAGMENTS_MAX, "never evicted");
        let mut other = FragmentKey {
            id: n,
            protocol: IPPROTO_UDP,
            ..Default::default()
        };
        other.src[..4].copy_from_slice(&n.to_be_bytes());
        map.insert(other, FragmentEntry::default(), 0).unwrap();
        n += 1;
    }
    n
}

/// A series evicted from the full map: its later fragments pass untouched,
/// counted, as if they had been lost. A full map still takes a new series
/// (evicting another).
#[test]
fn an_evicted_series_passes_untouched_and_a_full_map_takes_new_ones() {
    each(|f, tc, case| {
        let mut sel = moved_read(f);
        let [first, middle, last] = reply_fragments(f);
        let out1 = reply(&mut sel, tc, &first);
        assert_eq!(source(f, &out1), f.member(0).0, "{case}: first");
        let key = FragmentKey {
            src: mapped(f.member(1).0),
            dst: mapped(f.client()),
            id: f.id(),
            protocol: IPPROTO_UDP,
            _pad: [0; 3],
        };
        let inserted = evict(&mut sel, &key);
        assert!(
            inserted >= FRAGMENTS_MAX / 2,
            "{case}: evicted after {inserted}"
        );
        assert_eq!(reply(&mut sel, tc, &middle), middle, "{case}: middle");
        assert_eq!(reply(&mut sel, tc, &last), last, "{case}: last");
        assert_eq!(
            passed(&sel, Direction::Ingress, PassReason::Fragment),
            2,
            "{case}"
        );

        // Another moved read, its reply fragmented under another IP id,
        // with the map full.
        let next_read = READ_ID + 1;
        let k = InflightKey::new(mapped(f.client()), CLIENT_PORT, 0, next_read);
        let sent = sys::monotonic_ns() - Duration::from_millis(1).as_nanos() as u64;
        assert!(sel.plant_inflight(&k, 0, 1, sent));
        let mut value = reply_value();
        value[..2].copy_from_slice(&(next_read as u16).to_be_bytes());
        let d = datagram(f, f.member(1), &value);
        let src = f.member(1).0;
        let id = f.id() + 1;
        let second = [
            fragment(f, src, id, IPPROTO_UDP, 0, true, &d[..96]),
            fragment(f, src, id, IPPROTO_UDP, 96, false, &d[96..]),
        ];
        let outs = second.map(|x| reply(&mut sel, tc, &x));
        assert_eq!(
            reassembled(f, &[&outs[0], &outs[1]]),
            (f.member(0), (f.client(), CLIENT_PORT)),
            "{case}"
        );
        assert!(sel.inflight().unwrap().is_empty(), "{case}");
    });
}
