//! Seeded fuzzing of the three programs through BPF_PROG_TEST_RUN.
//!
//! 100,000 frames (request and reply templates over IPv4 and IPv6, the IPv6
//! ones with 0-3 walked extension headers, mutated copies of them, and
//! fully random frames) go through TC egress, XDP ingress and TC ingress of
//! a loaded dual-stack selector (an IPv4 group and an IPv6 group) with real
//! requests in flight in both. An oracle written here, independent of the
//! kernel code, says whether the selector owns a frame and if not, why. A
//! frame it does not own must pass byte-identical with the pass verdict and
//! change no counter but the "passed untouched" one of its reason; an owned
//! frame must only get a sane verdict, an owned IPv6 datagram the
//! selector rewrites must leave with a UDP checksum that verifies and is
//! not zero, and an owned IPv4 datagram it rewrites (read back with
//! etherparse) with checksums that verify, only the moved endpoint changed
//! and that to a member of the group. Every frame the oracle owns is read
//! by etherparse too, which must find the same IP and UDP headers (the
//! selector's own limits, such as which extension headers it walks, are
//! the oracle's alone). Failures are collected and
//! summarised at the end instead of stopping at the first.
//!
//! Each run draws a fresh seed and prints it at the start;
//! `SELECTOR_FUZZ_SEED=<u64>` replays a run.

use std::{
    collections::{BTreeMap, VecDeque},
    fmt,
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use aya::{maps::PerCpuArray, programs::ProgramError};
use etherparse::PacketBuilder;
use selector_common::{BackendStats, DEFAULT_INFLIGHT_MAX, Descriptor, PassReason, programs};
use selector_testbed::frames::{
    CLIENT, CLIENT_MAC, CLIENT_PORT, GET, PRIMARY_MAC, REPLICAS, TC_ACT_PIPE, TC_ACT_REDIRECT,
    TC_ACT_SHOT, VALUE, XDP_DROP, XDP_PASS, XDP_REDIRECT, fits_skb_test_run, replica, settings_for,
    try_run_tc, try_run_xdp, udp, udp6,
};
use selector_user::{Selector, Settings};

const FRAMES: usize = 100_000;
/// Frames generated together; owned ones run first, then the rest as one
/// batch between two reads of the counters too slow to read per frame.
const ROUND_FRAMES: usize = 1_000;
/// Well-formed gets sent through egress before each round, so replies find
/// requests in flight.
const PRIMED_PER_ROUND: usize = 32;
/// The environment variable that replays a run's seed.
const SEED_VARIABLE: &str = "SELECTOR_FUZZ_SEED";
/// The memcached descriptor's request id: 2 bytes at payload offset 0.
const MEMCACHED_ID_SPAN: usize = 2;
/// Its UDP frame header: id, sequence, datagram count, reserved.
const MEMCACHED_HEADER_LEN: usize = 8;
/// Failing frames shown in the summary, each as its first bytes in hex.
const SHOWN_FAILURES: usize = 6;
const SHOWN_HEX_BYTES: usize = 72;

const ETH_LEN: usize = 14;
const VLAN_TAG_LEN: usize = 4;
const IPV4_HEADER_LEN: usize = 20;
const UDP_HEADER_LEN: usize = 8;
const ETH_P_IPV4: [u8; 2] = [0x08, 0x00];
const ETH_P_8021Q: [u8; 2] = [0x81, 0x00];
const ETH_P_8021AD: [u8; 2] = [0x88, 0xa8];
const IPPROTO_UDP: u8 = 17;
// Offsets inside the IPv4 header.
const IP_TOTAL_LEN: usize = 2;
const IP_FRAGMENT: usize = 6;
const IP_PROTOCOL: usize = 9;
const IP_CHECKSUM: usize = 10;
const IP_SRC: usize = 12;
const IP_DST: usize = 16;
// Offsets inside the UDP header.
const UDP_SRC_PORT: usize = 0;
const UDP_DST_PORT: usize = 2;
const UDP_LEN: usize = 4;
const UDP_CHECKSUM: usize = 6;

const ETH_P_IPV6: [u8; 2] = [0x86, 0xdd];
const IPV6_HEADER_LEN: usize = 40;
// Offsets inside the IPv6 header.
const IP6_PAYLOAD_LEN: usize = 4;
const IP6_NEXT_HEADER: usize = 6;
const IP6_SRC: usize = 8;
const IP6_DST: usize = 24;
// IPv6 next-header values.
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_ESP: u8 = 50;
const IPPROTO_AH: u8 = 51;
const IPPROTO_ICMPV6: u8 = 58;
const IPPROTO_NONE: u8 = 59;
const IPPROTO_DSTOPTS: u8 = 60;
const IPPROTO_MOBILITY: u8 = 135;
/// The selector walks at most this many hop-by-hop, routing and
/// destination options headers, of at most this many bytes together.
const WALKED_HEADERS: usize = 3;
const WALKED_SPAN: usize = 128;

/// The dual-stack test groups: group 0 is `replica(i)` (IPv4), group 1
/// `replica6(i)`, on the same ports, so an address of the wrong family on
/// a member's port is a near miss.
const CLIENT6: [u8; 16] = [0xfd, 0x77, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];

fn replica6(i: usize) -> ([u8; 16], u16) {
    let mut addr = CLIENT6;
    addr[15] = 0x10 + i as u8;
    (addr, replica(i).1)
}

// ---------------------------------------------------------------------------
// The seams the kernel changes in flight will move: kept here, and small.

/// Per-CPU array of "passed untouched" counts, indexed by
/// `direction * PASS_REASONS + reason` (direction 0 egress, 1 ingress).
const PASSED_MAP: &str = "PASSED";
const PASS_REASONS: usize = selector_common::PASS_REASONS as usize;

/// The "passed untouched" counters summed over CPUs. A program object
/// without them fails the test: its pass counts would go unchecked.
fn passed_counters(sel: &Selector) -> Vec<u64> {
    let map = sel
        .ebpf()
        .map(PASSED_MAP)
        .expect("the programs have no PASSED map: pass counts cannot be checked");
    let passed: PerCpuArray<_, u64> =
        PerCpuArray::try_from(map).expect("PASSED is a per-CPU array of u64");
    (0..passed.len())
        .map(|i| passed.get(&i, 0).expect("read PASSED").iter().sum())
        .collect()
}

/// Requests in flight now, however the table is laid out.
fn inflight_count(sel: &Selector) -> usize {
    sel.inflight().expect("list the in-flight table").len()
}

// ---------------------------------------------------------------------------
// A small seeded PRNG: xorshift64*, seeded through splitmix64 so that small
// seeds spread.

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        Self(z.max(1))
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `range` (inclusive).
    fn within(&mut self, range: std::ops::RangeInclusive<usize>) -> usize {
        range.start() + self.below(range.end() - range.start() + 1)
    }

    fn percent(&mut self, p: usize) -> bool {
        self.below(100) < p
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }

    fn u16(&mut self) -> u16 {
        self.next() as u16
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.byte()).collect()
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

// ---------------------------------------------------------------------------
// Programs.

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Program {
    Egress,
    IngressXdp,
    IngressTc,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    Egress,
    Ingress,
}

impl Program {
    const ALL: [Program; 3] = [Program::Egress, Program::IngressXdp, Program::IngressTc];

    fn direction(self) -> Direction {
        match self {
            Program::Egress => Direction::Egress,
            Program::IngressXdp | Program::IngressTc => Direction::Ingress,
        }
    }

    fn pass_verdict(self) -> u32 {
        match self {
            Program::IngressXdp => XDP_PASS,
            Program::Egress | Program::IngressTc => TC_ACT_PIPE,
        }
    }

    /// Verdicts an owned frame may get: pass, redirect or drop.
    fn sane_verdicts(self) -> [u32; 3] {
        match self {
            Program::IngressXdp => [XDP_PASS, XDP_REDIRECT, XDP_DROP],
            Program::Egress | Program::IngressTc => [TC_ACT_PIPE, TC_ACT_REDIRECT, TC_ACT_SHOT],
        }
    }

    fn run(self, sel: &mut Selector, frame: &[u8]) -> Result<(u32, Vec<u8>), ProgramError> {
        match self {
            Program::Egress => try_run_tc(sel, programs::EGRESS, frame),
            Program::IngressTc => try_run_tc(sel, programs::INGRESS_TC, frame),
            Program::IngressXdp => try_run_xdp(sel, frame),
        }
    }
}

impl Direction {
    fn index(self) -> usize {
        match self {
            Direction::Egress => 0,
            Direction::Ingress => 1,
        }
    }
}

// ---------------------------------------------------------------------------
// The oracle: independent of the kernel code, from the header rules alone.

/// Why the selector must leave a frame alone (the first rule it breaks, in
/// the order a receiver checks them: link, IP header, transport).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum NotOwned {
    ShorterThanEthernet,
    NotIpEthertype,
    TruncatedIpv4Header,
    NotIpv4Version,
    NotUdp,
    IpOptions,
    BadIpChecksum,
    IpTotalBeyondFrame,
    IpTotalBelowHeader,
    SourceNotUnicast,
    DestinationNotUnicast,
    Fragment,
    IpTooShortForUdp,
    UdpLengthBelowHeader,
    UdpLengthBeyondIp,
    TruncatedIpv6Header,
    NotIpv6Version,
    Ipv6PayloadLengthZero,
    Ipv6PayloadBeyondFrame,
    Ipv4MappedAddress,
    Ipv6Fragment,
    UnwalkedExtensionHeader,
    RoutingSegmentsLeft,
    ExtensionHeadersBeyondPayload,
    ZeroUdpChecksumOverIpv6,
    NotABackend,
    NoRequestId,
    /// Egress: a memcached frame header no request carries.
    NotARequest,
    /// Egress: a request to a member with a VLAN tag (from a VLAN device
    /// above the attached one).
    VlanTagged,
}

impl NotOwned {
    /// The "passed untouched" counter a frame broken this way belongs to.
    fn pass_reason(self) -> PassReason {
        match self {
            NotOwned::ShorterThanEthernet | NotOwned::NotIpEthertype | NotOwned::NotUdp => {
                PassReason::NotIpUdp
            }
            NotOwned::Fragment | NotOwned::Ipv6Fragment => PassReason::Fragment,
            NotOwned::UnwalkedExtensionHeader | NotOwned::RoutingSegmentsLeft => {
                PassReason::ExtensionHeader
            }
            NotOwned::ZeroUdpChecksumOverIpv6 => PassReason::ZeroChecksum,
            NotOwned::NotABackend => PassReason::NotBackend,
            NotOwned::NoRequestId => PassReason::NoRequestId,
            NotOwned::NotARequest => PassReason::NotRequest,
            NotOwned::VlanTagged => PassReason::VlanTagged,
            NotOwned::TruncatedIpv4Header
            | NotOwned::NotIpv4Version
            | NotOwned::IpOptions
            | NotOwned::BadIpChecksum
            | NotOwned::IpTotalBeyondFrame
            | NotOwned::IpTotalBelowHeader
            | NotOwned::SourceNotUnicast
            | NotOwned::DestinationNotUnicast
            | NotOwned::IpTooShortForUdp
            | NotOwned::UdpLengthBelowHeader
            | NotOwned::UdpLengthBeyondIp
            | NotOwned::TruncatedIpv6Header
            | NotOwned::NotIpv6Version
            | NotOwned::Ipv6PayloadLengthZero
            | NotOwned::Ipv6PayloadBeyondFrame
            | NotOwned::Ipv4MappedAddress
            | NotOwned::ExtensionHeadersBeyondPayload => PassReason::BadHeader,
        }
    }
}

impl fmt::Display for NotOwned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            NotOwned::ShorterThanEthernet => "shorter than an Ethernet header",
            NotOwned::NotIpEthertype => {
                "not IPv4 or IPv6 (ethertype, after at most one 802.1Q or 802.1ad tag)"
            }
            NotOwned::TruncatedIpv4Header => "truncated in the IPv4 header",
            NotOwned::NotIpv4Version => "IP version is not 4",
            NotOwned::IpOptions => "IHL is not 5 (options or a bogus length)",
            NotOwned::BadIpChecksum => "bad IPv4 header checksum",
            NotOwned::IpTotalBeyondFrame => "IP total length beyond the frame",
            NotOwned::IpTotalBelowHeader => "IP total length shorter than the header",
            NotOwned::Fragment => "a fragment (MF or offset)",
            NotOwned::SourceNotUnicast => {
                "source not unicast (0/8, 127/8, 224/4, 240/4; ::, ::1, ff00::/8)"
            }
            NotOwned::DestinationNotUnicast => {
                "destination not unicast (0/8, 127/8, 224/4, 240/4; ::, ::1, ff00::/8)"
            }
            NotOwned::NotUdp => "protocol is not UDP",
            NotOwned::IpTooShortForUdp => "IP length leaves no room for a UDP header",
            NotOwned::UdpLengthBelowHeader => "UDP length below 8",
            NotOwned::UdpLengthBeyondIp => "UDP length beyond the IP payload",
            NotOwned::TruncatedIpv6Header => "truncated in the IPv6 header",
            NotOwned::NotIpv6Version => "IPv6 ethertype, version is not 6",
            NotOwned::Ipv6PayloadLengthZero => "IPv6 payload length 0 (a jumbogram)",
            NotOwned::Ipv6PayloadBeyondFrame => "IPv6 payload length beyond the frame",
            NotOwned::Ipv4MappedAddress => {
                "IPv6 with an IPv4-mapped address (never on the wire, RFC 4291 2.5.5.2)"
            }
            NotOwned::Ipv6Fragment => {
                "an IPv6 fragment (egress), a later one not from a member, or a \
                 fragment header not walked (a second, a 4th header)"
            }
            NotOwned::UnwalkedExtensionHeader => {
                "IPv6 extension headers not walked (other type, a 4th, over 128 bytes, truncated)"
            }
            NotOwned::RoutingSegmentsLeft => {
                "an IPv6 routing header with segments left (the destination is a waypoint)"
            }
            NotOwned::ExtensionHeadersBeyondPayload => {
                "IPv6 extension headers beyond the payload length"
            }
            NotOwned::ZeroUdpChecksumOverIpv6 => "UDP checksum 0 over IPv6",
            NotOwned::NotABackend => "not to (egress) / from (ingress) a configured backend",
            NotOwned::NoRequestId => "payload too short for the request id",
            NotOwned::NotARequest => {
                "egress: no memcached request frame header (sequence 0, 1 datagram, reserved 0)"
            }
            NotOwned::VlanTagged => "egress: a request to a member with a VLAN tag",
        };
        f.write_str(text)
    }
}

fn be16(bytes: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([bytes[at], bytes[at + 1]])
}

fn ipv4(bytes: &[u8], at: usize) -> [u8; 4] {
    bytes[at..at + 4].try_into().unwrap()
}

fn ipv6(bytes: &[u8], at: usize) -> [u8; 16] {
    bytes[at..at + 16].try_into().unwrap()
}

/// An address a unicast sender or receiver may have: not "this network"
/// (0/8), loopback (127/8), multicast (224/4) or reserved and the limited
/// broadcast (240/4).
fn is_unicast(addr: [u8; 4]) -> bool {
    !matches!(addr[0], 0 | 127 | 224..=255)
}

/// Not multicast (ff00::/8), the unspecified address or the loopback.
fn is_unicast6(addr: [u8; 16]) -> bool {
    let loopback = std::net::Ipv6Addr::LOCALHOST.octets();
    addr[0] != 0xff && addr != [0; 16] && addr != loopback
}

fn is_ipv4_mapped(addr: [u8; 16]) -> bool {
    std::net::Ipv6Addr::from(addr).to_ipv4_mapped().is_some()
}

/// RFC 1071 sum of 16-bit words, carries folded.
fn ones_complement_sum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|w| u32::from(w[0]) << 8 | u32::from(*w.get(1).unwrap_or(&0)))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// A member of the group of the frame's family.
fn is_backend(addr: IpAddr, port: u16) -> bool {
    (0..REPLICAS).any(|i| match addr {
        IpAddr::V4(a) => replica(i) == (a.octets(), port),
        IpAddr::V6(a) => replica6(i) == (a.octets(), port),
    })
}

/// Ok if the selector owns `frame` in `direction`: a well-formed request to
/// (egress) or reply from (ingress) a configured backend.
fn ownership(frame: &[u8], direction: Direction) -> Result<(), NotOwned> {
    if frame.len() < ETH_LEN {
        return Err(NotOwned::ShorterThanEthernet);
    }
    let mut l3 = ETH_LEN;
    if is_tagged(frame) {
        if frame.len() < ETH_LEN + VLAN_TAG_LEN {
            return Err(NotOwned::NotIpEthertype);
        }
        l3 += VLAN_TAG_LEN;
    }
    let owned = match [frame[l3 - 2], frame[l3 - 1]] {
        ETH_P_IPV4 => ipv4_ownership(&frame[l3..], direction),
        ETH_P_IPV6 => ipv6_ownership(&frame[l3..], direction),
        _ => Err(NotOwned::NotIpEthertype),
    };
    // A tagged request passes once it is known to go to a member, before
    // its payload is read.
    let to_member = matches!(
        owned,
        Ok(()) | Err(NotOwned::NoRequestId | NotOwned::NotARequest)
    );
    if direction == Direction::Egress && l3 != ETH_LEN && to_member {
        return Err(NotOwned::VlanTagged);
    }
    owned
}

fn unicast_rules(src_unicast: bool, dst_unicast: bool) -> Result<(), NotOwned> {
    match (src_unicast, dst_unicast) {
        (false, _) => Err(NotOwned::SourceNotUnicast),
        (_, false) => Err(NotOwned::DestinationNotUnicast),
        _ => Ok(()),
    }
}

/// `ip`: the frame from the IPv4 header on.
fn ipv4_ownership(ip: &[u8], direction: Direction) -> Result<(), NotOwned> {
    if ip.len() < IPV4_HEADER_LEN {
        return Err(NotOwned::TruncatedIpv4Header);
    }
    if ip[0] >> 4 != 4 {
        return Err(NotOwned::NotIpv4Version);
    }
    // Another protocol is not ours, whatever else its header holds (IGMP
    // reports carry an option).
    if ip[IP_PROTOCOL] != IPPROTO_UDP {
        return Err(NotOwned::NotUdp);
    }
    if ip[0] & 0xf != 5 {
        return Err(NotOwned::IpOptions);
    }
    if ones_complement_sum(&ip[..IPV4_HEADER_LEN]) != 0xffff {
        return Err(NotOwned::BadIpChecksum);
    }
    let total = usize::from(be16(ip, IP_TOTAL_LEN));
    if total > ip.len() {
        return Err(NotOwned::IpTotalBeyondFrame);
    }
    if total < IPV4_HEADER_LEN {
        return Err(NotOwned::IpTotalBelowHeader);
    }
    let (src, dst) = (ipv4(ip, IP_SRC), ipv4(ip, IP_DST));
    unicast_rules(is_unicast(src), is_unicast(dst))?;
    let fragment = be16(ip, IP_FRAGMENT) & 0x3fff;
    if fragment != 0 && direction == Direction::Egress {
        return Err(NotOwned::Fragment);
    }
    // Replies may be fragmented: the first fragment is a reply like any
    // other, and a later one from a backend's address is rewritten when
    // its first fragment was.
    let first_fragment = fragment != 0 && fragment & 0x1fff == 0;
    if fragment != 0 && !first_fragment {
        let from_backend = (0..REPLICAS).any(|i| replica(i).0 == src);
        return if from_backend {
            Ok(())
        } else {
            Err(NotOwned::Fragment)
        };
    }
    let datagram = Datagram {
        bytes: &ip[IPV4_HEADER_LEN..total],
        src: IpAddr::from(src),
        dst: IpAddr::from(dst),
        first_fragment,
    };
    datagram.ownership(direction)
}

/// `ip`: the frame from the IPv6 header on.
fn ipv6_ownership(ip: &[u8], direction: Direction) -> Result<(), NotOwned> {
    if ip.len() < IPV6_HEADER_LEN {
        return Err(NotOwned::TruncatedIpv6Header);
    }
    if ip[0] >> 4 != 6 {
        return Err(NotOwned::NotIpv6Version);
    }
    let payload_len = usize::from(be16(ip, IP6_PAYLOAD_LEN));
    if payload_len == 0 {
        return Err(NotOwned::Ipv6PayloadLengthZero);
    }
    if IPV6_HEADER_LEN + payload_len > ip.len() {
        return Err(NotOwned::Ipv6PayloadBeyondFrame);
    }
    let (src, dst) = (ipv6(ip, IP6_SRC), ipv6(ip, IP6_DST));
    // The extension headers before UDP: up to three hop-by-hop, routing,
    // destination options or fragment headers (one), 128 bytes together,
    // each read from the frame. After a fragment header with an offset
    // comes data: a later fragment.
    let mut next = ip[IP6_NEXT_HEADER];
    let mut l4 = IPV6_HEADER_LEN;
    let mut walked = 0;
    // (fragment header seen, its offset)
    let mut fragment = (false, 0);
    while next != IPPROTO_UDP && fragment.1 == 0 {
        match next {
            IPPROTO_FRAGMENT if walked < WALKED_HEADERS && !fragment.0 => {}
            IPPROTO_FRAGMENT => return Err(NotOwned::Ipv6Fragment),
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS if walked < WALKED_HEADERS => {}
            // IANA's IPv6 extension header numbers; any other next header
            // is an upper-layer protocol: not UDP.
            0 | 43 | 50 | 51 | 60 | 135 | 139 | 140 | 253 | 254 => {
                return Err(NotOwned::UnwalkedExtensionHeader);
            }
            _ => return Err(NotOwned::NotUdp),
        }
        // Next header, length, and a routing header's type and segments
        // left; a fragment header's offset and flags, and its id.
        let read = if next == IPPROTO_FRAGMENT { 8 } else { 4 };
        if l4 + read > ip.len() {
            return Err(NotOwned::UnwalkedExtensionHeader);
        }
        if next == IPPROTO_ROUTING && ip[l4 + 3] != 0 {
            return Err(NotOwned::RoutingSegmentsLeft);
        }
        let len = if next == IPPROTO_FRAGMENT {
            fragment = (true, be16(ip, l4 + 2) >> 3);
            8
        } else {
            (usize::from(ip[l4 + 1]) + 1) * 8
        };
        next = ip[l4];
        l4 += len;
        walked += 1;
        if l4 - IPV6_HEADER_LEN > WALKED_SPAN {
            return Err(NotOwned::UnwalkedExtensionHeader);
        }
    }
    // Unicast only matters once it is UDP (or a fragment).
    unicast_rules(is_unicast6(src), is_unicast6(dst))?;
    if is_ipv4_mapped(src) || is_ipv4_mapped(dst) {
        return Err(NotOwned::Ipv4MappedAddress);
    }
    let end = IPV6_HEADER_LEN + payload_len;
    if l4 > end {
        return Err(NotOwned::ExtensionHeadersBeyondPayload);
    }
    // Requests are not fragmented in practice: every fragment passes
    // egress. A reply's first fragment is a reply like any other; a later
    // one from a member's address is rewritten when its first was.
    if fragment.0 && direction == Direction::Egress {
        return Err(NotOwned::Ipv6Fragment);
    }
    if fragment.1 != 0 {
        let from_backend = (0..REPLICAS).any(|i| replica6(i).0 == src);
        return if from_backend {
            Ok(())
        } else {
            Err(NotOwned::Ipv6Fragment)
        };
    }
    let datagram = Datagram {
        bytes: &ip[l4..end],
        src: IpAddr::from(src),
        dst: IpAddr::from(dst),
        first_fragment: fragment.0,
    };
    datagram.ownership(direction)
}

/// The UDP part of a packet, for the rules both families share.
struct Datagram<'a> {
    /// From the UDP header to the end of the IP packet.
    bytes: &'a [u8],
    src: IpAddr,
    dst: IpAddr,
    /// A first fragment (IPv4, or IPv6 with a fragment header, atomic or
    /// not): its UDP length may cover more than it carries.
    first_fragment: bool,
}

impl Datagram<'_> {
    fn ownership(&self, direction: Direction) -> Result<(), NotOwned> {
        let udp = self.bytes;
        if udp.len() < UDP_HEADER_LEN {
            return Err(NotOwned::IpTooShortForUdp);
        }
        let udp_len = usize::from(be16(udp, UDP_LEN));
        if udp_len < UDP_HEADER_LEN {
            return Err(NotOwned::UdpLengthBelowHeader);
        }
        if udp_len > udp.len() && !self.first_fragment {
            return Err(NotOwned::UdpLengthBeyondIp);
        }
        // Optional over IPv4, mandatory over IPv6 (RFC 8200 8.1).
        if self.dst.is_ipv6() && be16(udp, UDP_CHECKSUM) == 0 {
            return Err(NotOwned::ZeroUdpChecksumOverIpv6);
        }
        let (src_port, dst_port) = (be16(udp, UDP_SRC_PORT), be16(udp, UDP_DST_PORT));
        let to_or_from_backend = match direction {
            Direction::Egress => is_backend(self.dst, dst_port),
            Direction::Ingress => is_backend(self.src, src_port),
        };
        if !to_or_from_backend {
            return Err(NotOwned::NotABackend);
        }
        let payload = &udp[UDP_HEADER_LEN..udp_len.min(udp.len())];
        if payload.len() < MEMCACHED_ID_SPAN {
            return Err(NotOwned::NoRequestId);
        }
        // Only requests are tracked; replies are matched by their id alone.
        if direction == Direction::Egress
            && payload.get(MEMCACHED_ID_SPAN..MEMCACHED_HEADER_LEN) != Some(&[0, 0, 0, 1, 0, 0])
        {
            return Err(NotOwned::NotARequest);
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Frame surgery for the mutations: offsets found the way a parser would,
// every write bounds-checked (a mutation that does not fit does nothing).

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Family {
    V4,
    V6,
}

impl Family {
    const ALL: [Family; 2] = [Family::V4, Family::V6];

    /// The group of this family in the fuzzed settings.
    fn group(self) -> usize {
        match self {
            Family::V4 => 0,
            Family::V6 => 1,
        }
    }
}

/// Member `i` of the group of `family`.
fn member(family: Family, i: usize) -> SocketAddr {
    match family {
        Family::V4 => replica(i).into(),
        Family::V6 => replica6(i).into(),
    }
}

/// One 802.1Q or 802.1ad tag: the selector looks behind one, not two.
fn is_tagged(frame: &[u8]) -> bool {
    [ETH_P_8021Q, ETH_P_8021AD].contains(&[frame[12], frame[13]])
}

fn l3_offset(frame: &[u8]) -> usize {
    if frame.len() >= ETH_LEN + VLAN_TAG_LEN && is_tagged(frame) {
        ETH_LEN + VLAN_TAG_LEN
    } else {
        ETH_LEN
    }
}

/// The family the (innermost) ethertype claims.
fn family_of(frame: &[u8]) -> Option<Family> {
    let l3 = l3_offset(frame);
    match frame.get(l3 - 2..l3)? {
        [0x08, 0x00] => Some(Family::V4),
        [0x86, 0xdd] => Some(Family::V6),
        _ => None,
    }
}

/// An IPv6 frame's extension headers as laid out, whatever their type or
/// number: (offset, length) of each, the offset after them and the next
/// header value found there.
struct Chain {
    headers: Vec<(usize, usize)>,
    end: usize,
    next: u8,
}

fn ipv6_chain(frame: &[u8]) -> Chain {
    let l3 = l3_offset(frame);
    let mut chain = Chain {
        headers: Vec::new(),
        end: l3 + IPV6_HEADER_LEN,
        next: frame
            .get(l3 + IP6_NEXT_HEADER)
            .copied()
            .unwrap_or(IPPROTO_UDP),
    };
    while chain.headers.len() < 8 && chain.end + 2 <= frame.len() {
        let len_field = usize::from(frame[chain.end + 1]);
        let len = match chain.next {
            IPPROTO_FRAGMENT => 8,
            IPPROTO_AH => (len_field + 2) * 4,
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_MOBILITY => {
                (len_field + 1) * 8
            }
            _ => break,
        };
        chain.headers.push((chain.end, len));
        chain.next = frame[chain.end];
        chain.end += len;
    }
    chain
}

/// Where UDP starts: per the IHL (at least 20 bytes in), or after the
/// IPv6 extension headers.
fn l4_offset(frame: &[u8]) -> usize {
    if family_of(frame) == Some(Family::V6) {
        return ipv6_chain(frame).end;
    }
    let l3 = l3_offset(frame);
    let ihl = frame.get(l3).map_or(5, |b| usize::from(b & 0xf)).max(5);
    l3 + ihl * 4
}

/// The IP length field's offset and the header bytes its value does not
/// count: IPv4's total length counts the header, IPv6's payload length
/// does not.
fn ip_length_field(frame: &[u8]) -> (usize, usize) {
    let l3 = l3_offset(frame);
    match family_of(frame) {
        Some(Family::V6) => (l3 + IP6_PAYLOAD_LEN, IPV6_HEADER_LEN),
        _ => (l3 + IP_TOTAL_LEN, 0),
    }
}

fn read16(frame: &[u8], at: usize) -> Option<u16> {
    (at + 2 <= frame.len()).then(|| be16(frame, at))
}

fn write16(frame: &mut [u8], at: usize, value: u16) {
    if at + 2 <= frame.len() {
        frame[at..at + 2].copy_from_slice(&value.to_be_bytes());
    }
}

fn write_bytes(frame: &mut [u8], at: usize, bytes: &[u8]) {
    if at + bytes.len() <= frame.len() {
        frame[at..at + bytes.len()].copy_from_slice(bytes);
    }
}

/// Recomputes the IPv4 header checksum, if the whole header is there.
fn fix_ip_checksum(frame: &mut [u8]) {
    let l3 = l3_offset(frame);
    let header_end = l4_offset(frame);
    if header_end > frame.len() {
        return;
    }
    write16(frame, l3 + IP_CHECKSUM, 0);
    let sum = ones_complement_sum(&frame[l3..header_end]);
    write16(frame, l3 + IP_CHECKSUM, !sum);
}

/// The ones' complement sum over an IPv6 UDP datagram and its
/// pseudo-header (the IPv6 header's addresses, the UDP length, next header
/// 17): 0xffff when its checksum verifies. With the UDP offset, or None if
/// the frame has no IPv6 UDP header.
fn udp6_sum(frame: &[u8]) -> Option<(u16, usize)> {
    let l3 = l3_offset(frame);
    let chain = ipv6_chain(frame);
    let l4 = chain.end;
    if family_of(frame) != Some(Family::V6) || chain.next != IPPROTO_UDP {
        return None;
    }
    let udp_len = read16(frame, l4 + UDP_LEN)?;
    let end = (l4 + usize::from(udp_len)).min(frame.len());
    let mut summed = frame.get(l3 + IP6_SRC..l3 + IP6_DST + 16)?.to_vec();
    summed.extend_from_slice(&u32::from(udp_len).to_be_bytes());
    summed.extend_from_slice(&[0, 0, 0, IPPROTO_UDP]);
    summed.extend_from_slice(frame.get(l4..end)?);
    Some((ones_complement_sum(&summed), l4))
}

/// Recomputes an IPv6 UDP checksum (0 is sent as 0xffff).
fn fix_udp6_checksum(frame: &mut [u8]) {
    let Some((_, l4)) = udp6_sum(frame) else {
        return;
    };
    write16(frame, l4 + UDP_CHECKSUM, 0);
    if let Some((sum, _)) = udp6_sum(frame) {
        let checksum = match !sum {
            0 => 0xffff,
            c => c,
        };
        write16(frame, l4 + UDP_CHECKSUM, checksum);
    }
}

/// Inserts `header` (its first byte, the next header, is filled in) as
/// extension header number `position` of an IPv6 frame, of type `kind`,
/// and grows the payload length.
fn insert_extension(frame: &mut Vec<u8>, position: usize, kind: u8, mut header: Vec<u8>) {
    let l3 = l3_offset(frame);
    let chain = ipv6_chain(frame);
    let position = position.min(chain.headers.len());
    let (pointer, at) = match position {
        0 => (l3 + IP6_NEXT_HEADER, l3 + IPV6_HEADER_LEN),
        p => (
            chain.headers[p - 1].0,
            chain.headers[p - 1].0 + chain.headers[p - 1].1,
        ),
    };
    if at > frame.len() {
        return;
    }
    header[0] = frame[pointer];
    frame[pointer] = kind;
    let grown = header.len();
    frame.splice(at..at, header);
    let payload_len = read16(frame, l3 + IP6_PAYLOAD_LEN).unwrap_or(0);
    write16(
        frame,
        l3 + IP6_PAYLOAD_LEN,
        payload_len.wrapping_add(grown as u16),
    );
}

/// An extension header of `len` bytes (a multiple of 8) with its length
/// field set and Pad1 options (zeros) after it; a routing header of type 0
/// with no segments left.
fn extension_header(kind: u8, len: usize) -> Vec<u8> {
    let mut header = vec![0; len];
    header[1] = match kind {
        IPPROTO_AH => (len / 4 - 2) as u8,
        _ => (len / 8 - 1) as u8,
    };
    header
}

#[derive(Clone, Copy, Debug)]
enum Mutation {
    FlipByte,
    FlipBit,
    Truncate,
    ExtendJunk,
    IpTotalBeyondFrame,
    IpTotalShorter,
    BadIpChecksum,
    IpOptions,
    IhlOnly,
    IpVersion,
    MoreFragments,
    FragmentOffset,
    SourceSpecial,
    DestinationSpecial,
    Protocol,
    Ethertype,
    UdpLengthBelowHeader,
    UdpLengthBeyondIp,
    UdpLengthShorter,
    PayloadCut,
    PortChange,
    AddressChange,
    RequestId,
    AddVlan,
    DoubleVlan,
    RemoveVlan,
    // IPv6 only.
    NextHeader,
    InsertExtension,
    ExtensionLengthField,
    RoutingSegmentsLeft,
    PayloadLengthZero,
    ZeroUdpChecksum,
    Ipv4MappedAddress,
}

/// Mutations for frames of either family; the length ones act on IPv4's
/// total length or IPv6's payload length.
const MUTATIONS_ANY: [Mutation; 20] = [
    Mutation::FlipByte,
    Mutation::FlipBit,
    Mutation::Truncate,
    Mutation::ExtendJunk,
    Mutation::IpTotalBeyondFrame,
    Mutation::IpTotalShorter,
    Mutation::IpVersion,
    Mutation::SourceSpecial,
    Mutation::DestinationSpecial,
    Mutation::Ethertype,
    Mutation::UdpLengthBelowHeader,
    Mutation::UdpLengthBeyondIp,
    Mutation::UdpLengthShorter,
    Mutation::PayloadCut,
    Mutation::PortChange,
    Mutation::AddressChange,
    Mutation::RequestId,
    Mutation::AddVlan,
    Mutation::DoubleVlan,
    Mutation::RemoveVlan,
];

/// The IPv4 header's own: options, IHL, fragment flags, protocol, header
/// checksum.
const MUTATIONS_V4: [Mutation; 6] = [
    Mutation::BadIpChecksum,
    Mutation::IpOptions,
    Mutation::IhlOnly,
    Mutation::MoreFragments,
    Mutation::FragmentOffset,
    Mutation::Protocol,
];

/// IPv6's own: next header values, extension headers, payload length 0, a
/// zero UDP checksum, IPv4-mapped addresses.
const MUTATIONS_V6: [Mutation; 7] = [
    Mutation::NextHeader,
    Mutation::InsertExtension,
    Mutation::ExtensionLengthField,
    Mutation::RoutingSegmentsLeft,
    Mutation::PayloadLengthZero,
    Mutation::ZeroUdpChecksum,
    Mutation::Ipv4MappedAddress,
];

// ---------------------------------------------------------------------------
// The generator: templates, mutations, random frames, and which program a
// frame goes through.

struct Case {
    program: Program,
    /// The family of the template it was made from; None: random bytes.
    family: Option<Family>,
    frame: Vec<u8>,
    /// What the frame was made from and what was done to it.
    label: String,
}

/// A well-formed get the generator primed the selector with.
#[derive(Clone, Copy)]
struct PrimedRequest {
    id: u16,
    backend: usize,
}

struct Generator {
    rng: Rng,
    next_request_id: u16,
    /// Recent primed requests of each family, so replies (and
    /// retransmits) carry ids that are really in flight.
    primed: [VecDeque<PrimedRequest>; 2],
}

const RECENT_PRIMED: usize = 256;

impl Generator {
    fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed),
            next_request_id: 0,
            primed: Default::default(),
        }
    }

    fn fresh_request_id(&mut self) -> u16 {
        let id = self.next_request_id;
        self.next_request_id = id.wrapping_add(1);
        id
    }

    fn recent_primed(&mut self, family: Family) -> Option<PrimedRequest> {
        let primed = &self.primed[family.group()];
        let i = self.rng.below(primed.len().max(1));
        primed.get(i).copied()
    }

    fn family(&mut self) -> Family {
        self.rng.pick(&Family::ALL)
    }

    /// A well-formed get with a new id to a random member of either group,
    /// as the application would send it (over IPv6 without extension
    /// headers).
    fn primed_get(&mut self) -> Vec<u8> {
        let family = self.family();
        let request = PrimedRequest {
            id: self.fresh_request_id(),
            backend: self.rng.below(REPLICAS),
        };
        let primed = &mut self.primed[family.group()];
        if primed.len() == RECENT_PRIMED {
            primed.pop_front();
        }
        primed.push_back(request);
        let payload = self.memcached_request(request.id, "get");
        let client = Self::client_at(family, CLIENT_PORT);
        datagram(client, member(family, request.backend), &payload, &[])
    }

    fn memcached_header(id: u16) -> Vec<u8> {
        let mut header = id.to_be_bytes().to_vec();
        // Sequence 0, one datagram, reserved 0.
        header.extend_from_slice(&[0, 0, 0, 1, 0, 0]);
        header
    }

    fn memcached_request(&mut self, id: u16, command: &str) -> Vec<u8> {
        let mut payload = Self::memcached_header(id);
        payload.extend_from_slice(format!("{command} key{}\r\n", self.rng.below(1000)).as_bytes());
        payload
    }

    fn memcached_value(&mut self, id: u16) -> Vec<u8> {
        let mut payload = Self::memcached_header(id);
        let len = self.rng.within(0..=64);
        let value = self.rng.bytes(len);
        payload.extend_from_slice(format!("VALUE key 0 {}\r\n", value.len()).as_bytes());
        payload.extend_from_slice(&value);
        payload.extend_from_slice(b"\r\nEND\r\n");
        payload
    }

    /// A DNS message (header and one question) with message id `id`.
    fn dns_message(&mut self, id: u16, answer: bool) -> Vec<u8> {
        let mut message = id.to_be_bytes().to_vec();
        message.extend_from_slice(if answer { &[0x81, 0x80] } else { &[0x01, 0x00] });
        message.extend_from_slice(&[0, 1, 0, u8::from(answer), 0, 0, 0, 0]);
        message.extend_from_slice(b"\x07example\x03org\x00\x00\x01\x00\x01");
        if answer {
            message.extend_from_slice(b"\xc0\x0c\x00\x01\x00\x01\x00\x00\x00\x3c\x00\x04");
            message.extend_from_slice(&self.rng.bytes(4));
        }
        message
    }

    fn client_at(family: Family, port: u16) -> SocketAddr {
        match family {
            Family::V4 => (CLIENT, port).into(),
            Family::V6 => (CLIENT6, port).into(),
        }
    }

    fn client(&mut self, family: Family) -> SocketAddr {
        // Mostly the one client port the primed requests use.
        let port = if self.rng.percent(90) {
            CLIENT_PORT
        } else {
            CLIENT_PORT + 1 + self.rng.below(3) as u16
        };
        Self::client_at(family, port)
    }

    /// A new id, the id of a primed request (a retransmit, or the
    /// application's own failover), or any id.
    fn request_id_for_request(&mut self, family: Family) -> u16 {
        match (self.rng.below(10), self.recent_primed(family)) {
            (0..=3, Some(primed)) => primed.id,
            (4..=7, _) => self.fresh_request_id(),
            _ => self.rng.u16(),
        }
    }

    /// (request id, backend) of a reply: mostly a primed request's id, from
    /// the backend it was addressed to (where it went unless redirected) or
    /// from any member; sometimes any id.
    fn reply_to(&mut self, family: Family) -> (u16, usize) {
        let any_backend = self.rng.below(REPLICAS);
        match self.recent_primed(family) {
            Some(primed) if self.rng.percent(75) => {
                let backend = if self.rng.percent(50) {
                    primed.backend
                } else {
                    any_backend
                };
                (primed.id, backend)
            }
            _ => (self.rng.u16(), any_backend),
        }
    }

    /// IPv6 extension headers for a template: mostly none, else 1-3
    /// walked ones (hop-by-hop, routing, destination options), mostly
    /// within the 128 bytes the selector walks, sometimes over them.
    fn extensions(&mut self, family: Family) -> Vec<(u8, usize)> {
        if family == Family::V4 || self.rng.percent(50) {
            return Vec::new();
        }
        let count = self.rng.within(1..=WALKED_HEADERS);
        let over = self.rng.percent(15);
        let mut used = 0;
        (0..count)
            .map(|i| {
                let kind = self
                    .rng
                    .pick(&[IPPROTO_HOPOPTS, IPPROTO_ROUTING, IPPROTO_DSTOPTS]);
                let units = if over {
                    self.rng.within(1..=WALKED_SPAN / 8)
                } else if i + 1 == count && self.rng.percent(30) {
                    // All that is left: exactly the span.
                    (WALKED_SPAN - used) / 8
                } else {
                    self.rng.within(1..=4)
                };
                used += units * 8;
                (kind, units * 8)
            })
            .collect()
    }

    /// A valid frame of some kind, its label, and the program it belongs to.
    fn template(&mut self) -> (Vec<u8>, String, Program, Family) {
        let family = self.family();
        let backend = self.rng.below(REPLICAS);
        let extensions = self.extensions(family);
        let via = match extensions.len() {
            0 => format!(" over {family:?}"),
            _ => format!(" over {family:?} via {}", describe_chain(&extensions)),
        };
        let ingress = if self.rng.percent(50) {
            Program::IngressXdp
        } else {
            Program::IngressTc
        };
        let (frame, label, program) = match self.rng.below(100) {
            0..=37 => {
                let id = self.request_id_for_request(family);
                // Reads (which may be redirected) and writes (never).
                let command = self.rng.pick(&["get", "gets", "set", "delete"]);
                let payload = self.memcached_request(id, command);
                let client = self.client(family);
                let frame = datagram(client, member(family, backend), &payload, &extensions);
                (
                    frame,
                    format!("memcached request to backend {backend}"),
                    Program::Egress,
                )
            }
            38..=75 => {
                let (id, backend) = self.reply_to(family);
                let payload = self.memcached_value(id);
                let client = self.client(family);
                let frame = datagram(member(family, backend), client, &payload, &extensions);
                (
                    frame,
                    format!("memcached VALUE from backend {backend}"),
                    ingress,
                )
            }
            76..=84 => {
                let id = self.request_id_for_request(family);
                let payload = self.dns_message(id, false);
                // To the backend's memcached port (owned) or to port 53 (not).
                let mut dst = member(family, backend);
                if self.rng.percent(30) {
                    dst.set_port(53);
                }
                let frame = datagram(self.client(family), dst, &payload, &extensions);
                (frame, format!("DNS query to {dst}"), Program::Egress)
            }
            85..=93 => {
                let (id, backend) = self.reply_to(family);
                let payload = self.dns_message(id, true);
                let mut src = member(family, backend);
                if self.rng.percent(30) {
                    src.set_port(53);
                }
                let frame = datagram(src, self.client(family), &payload, &extensions);
                (frame, format!("DNS answer from {src}"), ingress)
            }
            _ => {
                let mut frame = Vec::new();
                let payload = self.memcached_request(0x1234, "get");
                let to = member(family, backend);
                let builder = PacketBuilder::ethernet2(CLIENT_MAC, PRIMARY_MAC);
                let builder = match to.ip() {
                    IpAddr::V4(a) => builder.ipv4(CLIENT, a.octets(), 64),
                    IpAddr::V6(a) => builder.ipv6(CLIENT6, a.octets(), 64),
                };
                builder
                    .tcp(CLIENT_PORT, to.port(), 1, 1000)
                    .write(&mut frame, &payload)
                    .unwrap();
                (frame, "TCP to a backend".into(), Program::Egress)
            }
        };
        (frame, label + &via, program, family)
    }

    /// A special (not unicast) IPv4 address.
    fn special_address(&mut self) -> [u8; 4] {
        match self.rng.below(5) {
            0 => [0; 4],
            1 => [255; 4],
            2 => [
                224 + self.rng.below(32) as u8,
                self.rng.byte(),
                self.rng.byte(),
                self.rng.byte(),
            ],
            3 => [0, self.rng.byte(), self.rng.byte(), self.rng.byte()],
            _ => [127, self.rng.byte(), self.rng.byte(), self.rng.byte()],
        }
    }

    /// An IPv6 address the selector must not take for a member: multicast,
    /// unspecified, loopback; or one it is not (link-local, the IPv4-
    /// compatible form of a member, a member's address off by one bit).
    fn special_address6(&mut self) -> [u8; 16] {
        let mut addr = [0u8; 16];
        match self.rng.below(6) {
            0 => {
                addr[0] = 0xff;
                let random = self.rng.byte();
                addr[1] = self.rng.pick(&[0x01, 0x02, 0x05, 0x0e, random]);
                addr[15] = self.rng.byte();
            }
            1 => {}
            2 => addr[15] = 1,
            3 => {
                addr[..2].copy_from_slice(&[0xfe, 0x80]);
                addr[15] = 0x10 + self.rng.below(REPLICAS) as u8;
            }
            4 => addr[12..].copy_from_slice(&replica(self.rng.below(REPLICAS)).0),
            _ => {
                addr = replica6(self.rng.below(REPLICAS)).0;
                addr[self.rng.below(16)] ^= 1 << self.rng.below(8);
            }
        }
        addr
    }

    /// A byte offset, mostly inside the headers where a flip matters most.
    fn interesting_offset(&mut self, frame: &[u8]) -> usize {
        if self.rng.percent(70) {
            let headers = l4_offset(frame) + UDP_HEADER_LEN + 4;
            self.rng.below(frame.len().min(headers))
        } else {
            self.rng.below(frame.len())
        }
    }

    /// Applies `mutation` to `frame`; returns a short description.
    fn mutate(&mut self, frame: &mut Vec<u8>, mutation: Mutation) -> String {
        let l3 = l3_offset(frame);
        let l4 = l4_offset(frame);
        let v6 = family_of(frame) == Some(Family::V6);
        let (length_field, uncounted) = ip_length_field(frame);
        let (src_field, dst_field, address_len) = if v6 {
            (IP6_SRC, IP6_DST, 16)
        } else {
            (IP_SRC, IP_DST, 4)
        };
        match mutation {
            Mutation::FlipByte if !frame.is_empty() => {
                let at = self.interesting_offset(frame);
                let flip = 1 + self.rng.below(255) as u8;
                frame[at] ^= flip;
                format!("byte {at} ^= {flip:#04x}")
            }
            Mutation::FlipBit if !frame.is_empty() => {
                let at = self.interesting_offset(frame);
                let bit = self.rng.below(8);
                frame[at] ^= 1 << bit;
                format!("bit {bit} of byte {at}")
            }
            Mutation::Truncate if !frame.is_empty() => {
                let len = self.rng.below(frame.len());
                frame.truncate(len);
                format!("truncated to {len}")
            }
            Mutation::ExtendJunk => {
                let junk = self.rng.within(1..=200);
                let bytes = self.rng.bytes(junk);
                frame.extend_from_slice(&bytes);
                format!("{junk} junk bytes appended")
            }
            Mutation::IpTotalBeyondFrame => {
                let beyond = frame.len().saturating_sub(l3) + self.rng.within(1..=64);
                let value = beyond.saturating_sub(uncounted).min(0xffff);
                write16(frame, length_field, value as u16);
                format!("IP length field {value} beyond the frame")
            }
            Mutation::IpTotalShorter => {
                let current = read16(frame, length_field).unwrap_or(0);
                let value = self.rng.below(usize::from(current) + 1) as u16;
                write16(frame, length_field, value);
                format!("IP length field {value}")
            }
            // Applied last, after any checksum repair (see `case`).
            Mutation::BadIpChecksum => "bad IP checksum".into(),
            Mutation::ZeroUdpChecksum => "UDP checksum 0".into(),
            Mutation::IpOptions if frame.len() >= l3 + IPV4_HEADER_LEN => {
                let words = self.rng.within(1..=10);
                let options: Vec<u8> = (0..words * 4)
                    .map(|_| {
                        let random = self.rng.byte();
                        self.rng.pick(&[1, 1, 1, 0, random])
                    })
                    .collect();
                let at = l3 + IPV4_HEADER_LEN;
                frame.splice(at..at, options);
                frame[l3] = (frame[l3] & 0xf0) | (5 + words as u8);
                let total = read16(frame, l3 + IP_TOTAL_LEN).unwrap_or(0);
                write16(
                    frame,
                    l3 + IP_TOTAL_LEN,
                    total.wrapping_add(words as u16 * 4),
                );
                format!("{} bytes of IP options", words * 4)
            }
            Mutation::IhlOnly if frame.len() > l3 => {
                let ihl = self.rng.pick(&[0u8, 1, 4, 6, 7, 15]);
                frame[l3] = (frame[l3] & 0xf0) | ihl;
                format!("IHL {ihl}")
            }
            Mutation::IpVersion if frame.len() > l3 => {
                let version = if v6 {
                    self.rng.pick(&[0u8, 4, 5, 7, 15])
                } else {
                    self.rng.pick(&[0u8, 5, 6, 15])
                };
                frame[l3] = (frame[l3] & 0x0f) | version << 4;
                format!("IP version {version}")
            }
            Mutation::MoreFragments => {
                let flags = read16(frame, l3 + IP_FRAGMENT).unwrap_or(0) | 0x2000;
                write16(frame, l3 + IP_FRAGMENT, flags);
                "more fragments".into()
            }
            Mutation::FragmentOffset => {
                let offset = self.rng.within(1..=0x1fff) as u16;
                let flags = read16(frame, l3 + IP_FRAGMENT).unwrap_or(0) & 0xe000;
                write16(frame, l3 + IP_FRAGMENT, flags | offset);
                format!("fragment offset {offset}")
            }
            Mutation::SourceSpecial | Mutation::DestinationSpecial => {
                let (field, name) = match mutation {
                    Mutation::SourceSpecial => (src_field, "source"),
                    _ => (dst_field, "destination"),
                };
                let address = if v6 {
                    IpAddr::from(self.special_address6())
                } else {
                    IpAddr::from(self.special_address())
                };
                let bytes = match address {
                    IpAddr::V4(a) => a.octets().to_vec(),
                    IpAddr::V6(a) => a.octets().to_vec(),
                };
                write_bytes(frame, l3 + field, &bytes);
                format!("{name} {address}")
            }
            Mutation::Ipv4MappedAddress => {
                // A member's IPv4 address, mapped: on a member's port it
                // names the IPv4 member, which an IPv6 datagram never
                // reaches.
                let (field, name) = self
                    .rng
                    .pick(&[(src_field, "source"), (dst_field, "destination")]);
                let v4 = if self.rng.percent(80) {
                    replica(self.rng.below(REPLICAS)).0
                } else {
                    CLIENT
                };
                let mapped = std::net::Ipv4Addr::from(v4).to_ipv6_mapped();
                write_bytes(frame, l3 + field, &mapped.octets());
                format!("{name} {mapped}")
            }
            Mutation::Protocol if frame.len() > l3 + IP_PROTOCOL => {
                let protocol = self.rng.pick(&[0u8, 1, 6, 132, 136, 255, 16, 18]);
                frame[l3 + IP_PROTOCOL] = protocol;
                format!("IP protocol {protocol}")
            }
            Mutation::NextHeader => {
                // In the IPv6 header or in one of the extension headers.
                let chain = ipv6_chain(frame);
                let pointer = match self.rng.below(chain.headers.len() + 1) {
                    0 => l3 + IP6_NEXT_HEADER,
                    i => chain.headers[i - 1].0,
                };
                let random = self.rng.byte();
                let next = self.rng.pick(&[
                    IPPROTO_HOPOPTS,
                    IPPROTO_ROUTING,
                    IPPROTO_DSTOPTS,
                    IPPROTO_FRAGMENT,
                    IPPROTO_TCP,
                    IPPROTO_ICMPV6,
                    IPPROTO_NONE,
                    IPPROTO_ESP,
                    IPPROTO_AH,
                    IPPROTO_MOBILITY,
                    IPPROTO_UDP,
                    random,
                ]);
                write_bytes(frame, pointer, &[next]);
                format!("next header {next} at {pointer}")
            }
            Mutation::InsertExtension => {
                // A walked header (sometimes past the span, or a 4th), a
                // fragment header, or one the selector does not walk.
                let kind = match self.rng.below(10) {
                    0..=5 => self
                        .rng
                        .pick(&[IPPROTO_HOPOPTS, IPPROTO_ROUTING, IPPROTO_DSTOPTS]),
                    6..=7 => IPPROTO_FRAGMENT,
                    _ => self.rng.pick(&[IPPROTO_AH, IPPROTO_MOBILITY, 139, 253]),
                };
                let header = if kind == IPPROTO_FRAGMENT {
                    // Offset and M flag, from an atomic fragment (0, 0) on.
                    let random = self.rng.u16();
                    let offset_flags = self.rng.pick(&[0u16, 1, 0x0008, 0x0009, random]);
                    let mut header = vec![0, 0];
                    header.extend_from_slice(&offset_flags.to_be_bytes());
                    header.extend_from_slice(&self.rng.bytes(4));
                    header
                } else {
                    let units = if self.rng.percent(70) {
                        self.rng.within(1..=3)
                    } else {
                        self.rng.within(4..=17)
                    };
                    extension_header(kind, units * 8)
                };
                let len = header.len();
                let position = self.rng.below(ipv6_chain(frame).headers.len() + 1);
                insert_extension(frame, position, kind, header);
                format!("extension header {kind} ({len} bytes) inserted at {position}")
            }
            Mutation::ExtensionLengthField => {
                let chain = ipv6_chain(frame);
                if chain.headers.is_empty() {
                    return "no extension header to resize".into();
                }
                let (at, _) = chain.headers[self.rng.below(chain.headers.len())];
                let random = self.rng.byte();
                let len = self.rng.pick(&[0u8, 1, 2, 7, 14, 15, 16, 31, 255, random]);
                write_bytes(frame, at + 1, &[len]);
                format!("extension header at {at} length field {len}")
            }
            Mutation::RoutingSegmentsLeft => {
                // A header's type is the next header field before it.
                let chain = ipv6_chain(frame);
                let mut kind_at = l3 + IP6_NEXT_HEADER;
                let mut routing = Vec::new();
                for &(at, _) in &chain.headers {
                    if frame[kind_at] == IPPROTO_ROUTING && at + 4 <= frame.len() {
                        routing.push(at);
                    }
                    kind_at = at;
                }
                if routing.is_empty() {
                    return "no routing header".into();
                }
                let at = routing[self.rng.below(routing.len())];
                let random = self.rng.byte();
                let left = self.rng.pick(&[1u8, 2, 255, random]);
                write_bytes(frame, at + 3, &[left]);
                format!("routing header at {at} with {left} segments left")
            }
            Mutation::PayloadLengthZero => {
                write16(frame, l3 + IP6_PAYLOAD_LEN, 0);
                "IPv6 payload length 0".into()
            }
            Mutation::Ethertype => {
                let random = self.rng.u16();
                let ethertype = self
                    .rng
                    .pick(&[0x86dd, 0x0800, 0x0806, 0x88a8, 0x8100, 0x0801, random]);
                // The outer type, or the inner one of a tagged frame.
                write16(frame, l3 - 2, ethertype);
                format!("ethertype {ethertype:#06x} at {}", l3 - 2)
            }
            Mutation::UdpLengthBelowHeader => {
                let len = self.rng.below(UDP_HEADER_LEN) as u16;
                write16(frame, l4 + UDP_LEN, len);
                format!("UDP length {len}")
            }
            Mutation::UdpLengthBeyondIp => {
                let ip_len = usize::from(read16(frame, length_field).unwrap_or(0)) + uncounted;
                let ip_end = l3 + ip_len;
                let len = (ip_end.saturating_sub(l4) + self.rng.within(1..=64)) as u16;
                write16(frame, l4 + UDP_LEN, len);
                format!("UDP length {len} beyond the IP payload")
            }
            Mutation::UdpLengthShorter => {
                let current = usize::from(read16(frame, l4 + UDP_LEN).unwrap_or(8)).max(8);
                let len = self.rng.within(UDP_HEADER_LEN..=current) as u16;
                write16(frame, l4 + UDP_LEN, len);
                format!("UDP length {len}")
            }
            Mutation::PayloadCut if frame.len() >= l4 + UDP_HEADER_LEN => {
                // A consistent datagram with 0-3 payload bytes.
                let payload = self.rng.below(4).min(frame.len() - l4 - UDP_HEADER_LEN);
                frame.truncate(l4 + UDP_HEADER_LEN + payload);
                write16(frame, l4 + UDP_LEN, (UDP_HEADER_LEN + payload) as u16);
                let ip_len = l4 - l3 + UDP_HEADER_LEN + payload - uncounted;
                write16(frame, length_field, ip_len as u16);
                format!("payload cut to {payload} bytes")
            }
            Mutation::PortChange => {
                let field = self.rng.pick(&[UDP_SRC_PORT, UDP_DST_PORT]);
                let current = read16(frame, l4 + field).unwrap_or(0);
                let port = if self.rng.percent(50) {
                    current.wrapping_add(self.rng.pick(&[1u16, 2, 0xffff, 0xfffe]))
                } else {
                    self.rng.u16()
                };
                write16(frame, l4 + field, port);
                format!("UDP port at +{field} = {port}")
            }
            Mutation::AddressChange => {
                let field = self.rng.pick(&[src_field, dst_field]);
                let random = self.rng.byte();
                let last = if v6 {
                    self.rng.pick(&[1, 0x0f, 0x10, 0x11, 0x12, 0x13, random])
                } else {
                    self.rng.pick(&[1, 9, 10, 11, 12, 13, random])
                };
                write_bytes(frame, l3 + field + address_len - 1, &[last]);
                format!("IP address at +{field} ends in {last:#04x}")
            }
            Mutation::RequestId => {
                let id = self.rng.u16();
                write16(frame, l4 + UDP_HEADER_LEN, id);
                format!("request id {id:#06x}")
            }
            Mutation::AddVlan | Mutation::DoubleVlan if frame.len() >= ETH_LEN => {
                if matches!(mutation, Mutation::AddVlan) && is_tagged(frame) {
                    return "already tagged".into();
                }
                let vlan = self.rng.within(1..=4094) as u16;
                let (tpid, name) = if self.rng.percent(80) {
                    (ETH_P_8021Q, "802.1Q")
                } else {
                    (ETH_P_8021AD, "802.1ad")
                };
                let tag = [tpid[0], tpid[1], (vlan >> 8) as u8, vlan as u8];
                frame.splice(12..12, tag);
                format!("{name} tag, VLAN {vlan}")
            }
            Mutation::RemoveVlan if frame.len() >= ETH_LEN + VLAN_TAG_LEN => {
                if is_tagged(frame) {
                    frame.drain(12..16);
                    "tag removed".into()
                } else {
                    "no tag to remove".into()
                }
            }
            _ => format!("{mutation:?} (does not fit)"),
        }
    }

    /// The next frame to fuzz with.
    fn case(&mut self) -> Case {
        if self.rng.percent(10) {
            return self.random_case();
        }
        let (mut frame, mut label, natural, family) = self.template();
        if self.rng.percent(20) {
            label += &format!(", {}", self.mutate(&mut frame, Mutation::AddVlan));
        }
        let mutations = match self.rng.below(100) {
            0..=24 => 0,
            25..=59 => 1,
            60..=84 => 2,
            _ => 3,
        };
        let own: &[Mutation] = match family {
            Family::V4 => &MUTATIONS_V4,
            Family::V6 => &MUTATIONS_V6,
        };
        let (mut break_checksum, mut zero_checksum) = (false, false);
        for _ in 0..mutations {
            let i = self.rng.below(MUTATIONS_ANY.len() + own.len());
            let mutation = match MUTATIONS_ANY.get(i) {
                Some(&any) => any,
                None => own[i - MUTATIONS_ANY.len()],
            };
            break_checksum |= matches!(mutation, Mutation::BadIpChecksum);
            zero_checksum |= matches!(mutation, Mutation::ZeroUdpChecksum);
            label += &format!(", {}", self.mutate(&mut frame, mutation));
        }
        // Most mutated headers keep a valid checksum, so the other rules
        // are tested on their own and not all shadowed by this one (over
        // IPv6, so rewritten outputs can be checked).
        if mutations > 0 && self.rng.percent(85) {
            match family {
                Family::V4 => fix_ip_checksum(&mut frame),
                Family::V6 => fix_udp6_checksum(&mut frame),
            }
        }
        if break_checksum {
            let at = l3_offset(&frame) + IP_CHECKSUM;
            let current = read16(&frame, at).unwrap_or(0);
            write16(&mut frame, at, current ^ self.rng.within(1..=0xffff) as u16);
        }
        if zero_checksum {
            let at = l4_offset(&frame) + UDP_CHECKSUM;
            write16(&mut frame, at, 0);
        }
        // Mostly through the program the frame was made for, sometimes
        // through another one (requests at ingress, replies at egress).
        let program = if self.rng.percent(80) {
            natural
        } else {
            self.rng.pick(&Program::ALL)
        };
        Self::case_for(program, Some(family), frame, label)
    }

    fn random_case(&mut self) -> Case {
        let len = self.rng.below(1601);
        let mut frame = self.rng.bytes(len);
        let mut label = format!("{len} random bytes");
        // Two in three claim IPv4 or IPv6, so they reach the IP header
        // checks.
        if len >= ETH_LEN {
            let (ethertype, first, name) = match self.rng.below(3) {
                0 => (ETH_P_IPV4, 0x45, "IPv4"),
                1 => (ETH_P_IPV6, 0x60, "IPv6"),
                _ => (
                    [frame[12], frame[13]],
                    frame.get(ETH_LEN).copied().unwrap_or(0),
                    "any",
                ),
            };
            frame[12..14].copy_from_slice(&ethertype);
            if len > ETH_LEN {
                frame[ETH_LEN] = first;
            }
            label += &format!(" with {name} ethertype");
        }
        let program = self.rng.pick(&Program::ALL);
        Self::case_for(program, None, frame, label)
    }

    /// TC frames the skb harness would refuse go through XDP instead.
    fn case_for(program: Program, family: Option<Family>, frame: Vec<u8>, label: String) -> Case {
        let program = if program != Program::IngressXdp && !fits_skb_test_run(&frame) {
            Program::IngressXdp
        } else {
            program
        };
        Case {
            program,
            family,
            frame,
            label,
        }
    }
}

/// Ethernet + IP + UDP from `src` to `dst` (one family) with a correct
/// checksum; over IPv6 with the extension headers `(type, bytes)` in that
/// order.
fn datagram(
    src: SocketAddr,
    dst: SocketAddr,
    payload: &[u8],
    extensions: &[(u8, usize)],
) -> Vec<u8> {
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            udp((s.octets(), src.port()), (d.octets(), dst.port()), payload)
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut frame = udp6((s.octets(), src.port()), (d.octets(), dst.port()), payload);
            for (position, &(kind, len)) in extensions.iter().enumerate() {
                insert_extension(&mut frame, position, kind, extension_header(kind, len));
            }
            fix_udp6_checksum(&mut frame);
            frame
        }
        _ => panic!("{src} and {dst} are of different families"),
    }
}

fn describe_chain(extensions: &[(u8, usize)]) -> String {
    let names: Vec<String> = extensions
        .iter()
        .map(|&(kind, len)| {
            let name = match kind {
                IPPROTO_HOPOPTS => "hop-by-hop",
                IPPROTO_ROUTING => "routing",
                IPPROTO_DSTOPTS => "destination options",
                _ => "other",
            };
            format!("{name} {len}")
        })
        .collect();
    names.join(", ")
}

// ---------------------------------------------------------------------------
// Counters.

/// Counters read after every frame the selector does not own.
#[derive(Clone)]
struct FrameCounters {
    stats: Vec<BackendStats>,
    accounting: Vec<(u64, u64, u64)>,
    passed: Vec<u64>,
}

impl FrameCounters {
    fn read(sel: &Selector) -> Self {
        Self {
            stats: sel.stats().expect("read STATS"),
            accounting: sel.accounting().expect("read the accounting counters"),
            passed: passed_counters(sel),
        }
    }
}

/// Counters too slow to read per frame, compared across a batch.
#[derive(Clone, PartialEq)]
struct BatchCounters {
    latency: Vec<Vec<u64>>,
    inflight: usize,
}

impl BatchCounters {
    fn read(sel: &Selector) -> Self {
        Self {
            latency: sel.latency().expect("read LATENCY"),
            inflight: inflight_count(sel),
        }
    }
}

fn stat_fields(s: &BackendStats) -> [(&'static str, u64); 12] {
    [
        ("requests", s.requests),
        ("responses", s.responses),
        ("redirected_away", s.redirected_away),
        ("redirected_to", s.redirected_to),
        ("untracked", s.untracked),
        ("no_reply", s.no_reply),
        ("id_collisions", s.id_collisions),
        ("unmatched_responses", s.unmatched_responses),
        ("late_responses", s.late_responses),
        ("overload_passed", s.overload_passed),
        ("overload_dropped", s.overload_dropped),
        ("overload_rejected", s.overload_rejected),
    ]
}

fn delta(before: u64, after: u64) -> i128 {
    i128::from(after) - i128::from(before)
}

/// Counter changes a frame the oracle rejected must not cause.
fn forbidden_changes(
    before: &FrameCounters,
    after: &FrameCounters,
    direction: Direction,
    reason: PassReason,
) -> Vec<String> {
    let mut changes = Vec::new();
    for (backend, (b, a)) in before.stats.iter().zip(&after.stats).enumerate() {
        for ((name, was), (_, now)) in stat_fields(b).into_iter().zip(stat_fields(a)) {
            if now != was {
                changes.push(format!("backend {backend} {name} {:+}", delta(was, now)));
            }
        }
    }
    for (backend, (b, a)) in before.accounting.iter().zip(&after.accounting).enumerate() {
        for (name, was, now) in [
            ("issued", b.0, a.0),
            ("completed", b.1, a.1),
            ("expired", b.2, a.2),
        ] {
            if now != was {
                changes.push(format!("backend {backend} {name} {:+}", delta(was, now)));
            }
        }
    }
    changes.extend(pass_count_errors(
        &before.passed,
        &after.passed,
        direction,
        reason,
    ));
    changes
}

/// Each frame passed untouched is counted exactly once, in its direction,
/// under `reason`.
fn pass_count_errors(
    before: &[u64],
    after: &[u64],
    direction: Direction,
    reason: PassReason,
) -> Vec<String> {
    let mut errors = Vec::new();
    let grown: i128 = before.iter().zip(after).map(|(b, a)| delta(*b, *a)).sum();
    if grown != 1 {
        errors.push(format!("PASSED total {grown:+} (expected +1)"));
    }
    let own = direction.index() * PASS_REASONS..(direction.index() + 1) * PASS_REASONS;
    let expected = own.start + reason as usize;
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        if a == b {
            continue;
        }
        if !own.contains(&i) {
            errors.push(format!(
                "PASSED[{i}] {:+} in the wrong direction",
                delta(*b, *a)
            ));
        } else if i != expected {
            errors.push(format!(
                "passed as {} {:+}, expected as {}",
                PassReason::ALL[i - own.start].name(),
                delta(*b, *a),
                reason.name()
            ));
        }
    }
    errors
}

// ---------------------------------------------------------------------------
// Running and reporting.

#[derive(Default)]
struct FailingFrames {
    frames: usize,
    /// Failing frames by problem (a frame may have several).
    by_problem: BTreeMap<&'static str, usize>,
}

struct Failure {
    program: Program,
    /// None: the oracle says the frame is owned.
    reason: Option<NotOwned>,
    label: String,
    problems: Vec<String>,
    frame: Vec<u8>,
}

#[derive(Default)]
struct Tally {
    /// (program, template family or None for random bytes, None for owned
    /// or the reason) -> frames.
    frames: BTreeMap<(Program, Option<Family>, Option<NotOwned>), usize>,
    /// (program, oracle reason or None for owned) -> failing frames.
    failing: BTreeMap<(Program, Option<NotOwned>), FailingFrames>,
    failures: usize,
    shown: Vec<Failure>,
    /// Counter changes over a batch of unowned frames no frame of the
    /// batch was caught at.
    batch_failures: Vec<String>,
    refused_by_harness: usize,
    primed: usize,
    /// Owned IPv6 datagrams rewritten whose output checksum was checked.
    ipv6_rewrites_checked: usize,
    /// Owned IPv4 datagrams rewritten whose checksums and endpoints were
    /// checked.
    ipv4_rewrites_checked: usize,
}

impl Tally {
    fn record(&mut self, failure: Failure, kinds: &[&'static str]) {
        self.failures += 1;
        let failing = self
            .failing
            .entry((failure.program, failure.reason))
            .or_default();
        failing.frames += 1;
        for kind in kinds {
            *failing.by_problem.entry(kind).or_default() += 1;
        }
        if self.shown.len() < SHOWN_FAILURES {
            self.shown.push(failure);
        }
    }

    fn owned(&self, program: Program, family: Option<Family>) -> usize {
        self.frames
            .get(&(program, family, None))
            .copied()
            .unwrap_or(0)
    }

    fn summary(&self, seed: u64, elapsed: Duration, sel: &Selector) -> String {
        use fmt::Write as _;
        let mut out = String::new();
        let frames: usize = self.frames.values().sum();
        let _ = writeln!(
            out,
            "fuzz: seed {seed}, {frames} frames (+{} primed gets, {} refused by the test harness) in {:.1?}",
            self.primed, self.refused_by_harness, elapsed
        );
        for program in Program::ALL {
            for family in [Some(Family::V4), Some(Family::V6), None] {
                let not_owned: Vec<String> = self
                    .frames
                    .iter()
                    .filter(|((p, f, _), _)| *p == program && *f == family)
                    .filter_map(|((_, _, reason), n)| reason.map(|r| format!("{r:?} {n}")))
                    .collect();
                let made_from = family.map_or("random".to_string(), |f| format!("{f:?}"));
                let _ = writeln!(
                    out,
                    "  {program:?} {made_from}: {} owned; not owned: {}",
                    self.owned(program, family),
                    not_owned.join(", ")
                );
            }
        }
        for family in Family::ALL {
            let totals = group_stats(sel, family);
            let _ = writeln!(
                out,
                "  {family:?} group state reached: {} requests tracked, {} redirected, {} replies completed a request, {} unmatched",
                totals.requests, totals.redirected_to, totals.responses, totals.unmatched_responses,
            );
        }
        let _ = writeln!(
            out,
            "  {} in flight at the end; {} rewritten IPv6 datagrams' checksums checked, {} rewritten IPv4 datagrams' checksums and endpoints",
            inflight_count(sel),
            self.ipv6_rewrites_checked,
            self.ipv4_rewrites_checked
        );
        if self.failures == 0 && self.batch_failures.is_empty() {
            let _ = writeln!(out, "  no failures");
            return out;
        }
        let _ = writeln!(
            out,
            "FAILURES: {} frames ({} batch-level counter changes)",
            self.failures,
            self.batch_failures.len()
        );
        let _ = writeln!(out, "  frames by program and oracle reason (by problem):");
        for ((program, reason), failing) in &self.failing {
            let reason = reason.map_or("owned".to_string(), |r| r.to_string());
            let problems: Vec<String> = failing
                .by_problem
                .iter()
                .map(|(problem, n)| format!("{problem} {n}"))
                .collect();
            let _ = writeln!(
                out,
                "    {:>6}  {program:?}: {reason} ({})",
                failing.frames,
                problems.join(", ")
            );
        }
        for line in self.batch_failures.iter().take(SHOWN_FAILURES) {
            let _ = writeln!(out, "  batch: {line}");
        }
        let _ = writeln!(out, "  first failing frames:");
        for f in &self.shown {
            let reason = f.reason.map_or("owned".to_string(), |r| r.to_string());
            let _ = writeln!(out, "  - {:?}, oracle: {reason}", f.program);
            let _ = writeln!(out, "    made from: {}", f.label);
            let _ = writeln!(out, "    observed: {}", f.problems.join("; "));
            let _ = writeln!(out, "    frame: {}", hex(&f.frame));
        }
        out
    }
}

/// Per-backend statistics summed over the group of `family` (the agent
/// lists backends group by group).
fn group_stats(sel: &Selector, family: Family) -> BackendStats {
    let mut total = BackendStats::default();
    let stats = sel.stats().expect("read STATS");
    for s in stats
        .chunks(REPLICAS)
        .nth(family.group())
        .expect("two groups")
    {
        total.add(s);
    }
    total
}

fn hex(frame: &[u8]) -> String {
    let shown: String = frame
        .iter()
        .take(SHOWN_HEX_BYTES)
        .map(|b| format!("{b:02x}"))
        .collect();
    if frame.len() > SHOWN_HEX_BYTES {
        format!("{shown}... ({} bytes)", frame.len())
    } else {
        format!("{shown} ({} bytes)", frame.len())
    }
}

/// Sends a well-formed get through egress, as the application would.
fn prime(sel: &mut Selector, generator: &mut Generator, tally: &mut Tally) {
    let frame = generator.primed_get();
    assert_eq!(ownership(&frame, Direction::Egress), Ok(()), "a primed get");
    let (verdict, _) = Program::Egress.run(sel, &frame).expect("run egress");
    assert!(
        [TC_ACT_PIPE, TC_ACT_REDIRECT].contains(&verdict),
        "a well-formed get got verdict {verdict}"
    );
    tally.primed += 1;
}

/// An owned frame: the program must not fail, and an IPv6 datagram it
/// rewrites must leave with a nonzero checksum that verifies if it came in
/// with one that did; anything else it may do.
fn run_owned(sel: &mut Selector, case: Case, tally: &mut Tally) {
    *tally
        .frames
        .entry((case.program, case.family, None))
        .or_default() += 1;
    if let Some(problem) = etherparse_disagrees(&case.frame) {
        let failure = Failure {
            program: case.program,
            reason: None,
            label: case.label.clone(),
            problems: vec![format!("the oracle owns it, but {problem}")],
            frame: case.frame.clone(),
        };
        tally.record(failure, &["oracle against etherparse"]);
    }
    let problem = match case.program.run(sel, &case.frame) {
        Err(e) => Some(("test run failed", format!("BPF_PROG_TEST_RUN: {e}"))),
        Ok((verdict, _)) if !case.program.sane_verdicts().contains(&verdict) => {
            Some(("unexpected verdict", format!("verdict {verdict}")))
        }
        Ok((_, out)) if out != case.frame && is_later_fragment6(&case.frame) => {
            tally.ipv6_rewrites_checked += 1;
            rewritten_fragment6_problem(&case.frame, &out)
        }
        Ok((_, out)) if out != case.frame && family_of(&case.frame) == Some(Family::V6) => {
            tally.ipv6_rewrites_checked += 1;
            rewritten_udp6_problem(&case.frame, &out)
        }
        Ok((_, out)) if out != case.frame && family_of(&case.frame) == Some(Family::V4) => {
            tally.ipv4_rewrites_checked += 1;
            rewritten_udp4_problem(case.program.direction(), &case.frame, &out)
        }
        Ok(_) => None,
    };
    if let Some((kind, problem)) = problem {
        let failure = Failure {
            program: case.program,
            reason: None,
            label: case.label,
            problems: vec![problem],
            frame: case.frame,
        };
        tally.record(failure, &[kind]);
    }
}

/// What etherparse, a parser written elsewhere, reads differently in a
/// frame the oracle owns: it must find Ethernet (with at most one VLAN
/// tag), IPv4 with a header checksum that verifies or IPv6, and (unless
/// the IP payload is a fragment) a UDP header whose length fits the IP
/// payload. The oracle's own limits (which extension headers, how many)
/// are the selector's policy, not a parser's: they are not cross-checked.
/// Nor is a hop-by-hop header after another extension header (RFC 8200
/// forbids it and etherparse refuses it, while the selector, and so the
/// oracle, walks it like any other), nor an IPv6 fragment (etherparse
/// reads on past a fragment header as if the datagram were whole).
fn etherparse_disagrees(frame: &[u8]) -> Option<String> {
    use etherparse::{
        NetSlice, SlicedPacket, TransportSlice,
        err::{ipv6_exts::HeaderError::HopByHopNotAtStart, packet::SliceError},
    };
    if is_fragment6(frame) {
        return None;
    }
    let parsed = match SlicedPacket::from_ethernet(frame) {
        Ok(parsed) => parsed,
        Err(SliceError::Ipv6Exts(HopByHopNotAtStart)) => return None,
        Err(e) => return Some(format!("etherparse refuses it: {e}")),
    };
    let payload = match &parsed.net {
        Some(NetSlice::Ipv4(ip)) => {
            let sum = raw_header_sum(ip.header().slice());
            if sum != 0xffff {
                return Some(format!(
                    "the IPv4 header etherparse finds sums to {sum:#06x}, not 0xffff"
                ));
            }
            ip.payload()
        }
        Some(NetSlice::Ipv6(ip)) => ip.payload(),
        _ => return Some("etherparse finds no IP header".into()),
    };
    if payload.fragmented {
        return None;
    }
    match &parsed.transport {
        Some(TransportSlice::Udp(udp)) if usize::from(udp.length()) <= payload.payload.len() => {
            None
        }
        Some(TransportSlice::Udp(udp)) => Some(format!(
            "etherparse finds UDP length {} beyond the IP payload ({})",
            udp.length(),
            payload.payload.len()
        )),
        _ => Some("etherparse finds no UDP header".into()),
    }
}

/// The ones' complement sum of an IPv4 header as it is (0xffff: its
/// checksum verifies), over the raw bytes: etherparse's header type drops
/// the reserved flag bit, so its own checksum would differ.
fn raw_header_sum(header: &[u8]) -> u32 {
    let mut sum: u32 = header
        .chunks(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum
}

/// An IPv6 frame with a fragment header among its extension headers.
fn is_fragment6(frame: &[u8]) -> bool {
    if family_of(frame) != Some(Family::V6) {
        return false;
    }
    let mut next = frame[l3_offset(frame) + IP6_NEXT_HEADER];
    for (at, _) in ipv6_chain(frame).headers {
        if next == IPPROTO_FRAGMENT {
            return true;
        }
        next = frame[at];
    }
    false
}

/// An IPv6 frame whose fragment header has an offset: a later fragment,
/// with no UDP header.
fn is_later_fragment6(frame: &[u8]) -> bool {
    if family_of(frame) != Some(Family::V6) {
        return false;
    }
    let mut next = frame[l3_offset(frame) + IP6_NEXT_HEADER];
    for (at, _) in ipv6_chain(frame).headers {
        if next == IPPROTO_FRAGMENT {
            return read16(frame, at + 2).is_some_and(|field| field >> 3 != 0);
        }
        next = frame[at];
    }
    false
}

/// What is wrong with `out`, a later IPv6 fragment the selector rewrote
/// from `input`: only its source may change, to a member's address (its
/// first fragment's checksum covers the change).
fn rewritten_fragment6_problem(input: &[u8], out: &[u8]) -> Option<(&'static str, String)> {
    let src = l3_offset(input) + IP6_SRC..l3_offset(input) + IP6_SRC + 16;
    if input.len() != out.len()
        || input[..src.start] != out[..src.start]
        || input[src.end..] != out[src.end..]
    {
        return Some((
            "rewritten badly",
            "a later fragment changed outside its source address".into(),
        ));
    }
    if !(0..REPLICAS).any(|i| out[src.clone()] == replica6(i).0) {
        return Some((
            "rewritten badly",
            "a later fragment's new source is no member".into(),
        ));
    }
    None
}

/// What is wrong with `out`, an IPv4 datagram the selector rewrote from
/// `input`, read with etherparse: the same length and payload; the IPv4
/// header unchanged but for the addresses and a checksum that verifies; on
/// egress the same source and a member of the group as the destination, on
/// ingress the same destination and a member as the source (a later
/// fragment has no ports); a UDP checksum that verifies unless it was 0
/// and stayed 0 (a fragment's covers the whole datagram: not checked).
fn rewritten_udp4_problem(
    direction: Direction,
    input: &[u8],
    out: &[u8],
) -> Option<(&'static str, String)> {
    use etherparse::{Ipv4HeaderSlice, UdpHeaderSlice};
    let bad = |what: String| Some(("rewritten badly", what));
    if input.len() != out.len() {
        return bad(format!("length {} became {}", input.len(), out.len()));
    }
    let l3 = l3_offset(input);
    let (Ok(ip_in), Ok(ip_out)) = (
        Ipv4HeaderSlice::from_slice(&input[l3..]),
        Ipv4HeaderSlice::from_slice(&out[l3..]),
    ) else {
        return bad("no IPv4 header left".into());
    };
    let ip_sum = raw_header_sum(ip_out.slice());
    if ip_sum != 0xffff {
        return Some((
            "bad checksum",
            format!(
                "IPv4 header checksum {:#06x} does not verify (sum {ip_sum:#06x})",
                ip_out.header_checksum()
            ),
        ));
    }
    let ip_len = ip_in.slice().len();
    // Bytes 10..20: checksum, source, destination.
    if ip_in.slice()[..10] != ip_out.slice()[..10] || ip_in.slice()[20..] != ip_out.slice()[20..] {
        return bad("the IPv4 header changed beyond its addresses".into());
    }
    let later_fragment = ip_in.fragments_offset().value() != 0;
    let l4 = l3 + ip_len;
    let ports = |frame: &[u8]| -> Option<(u16, u16)> {
        let udp = UdpHeaderSlice::from_slice(frame.get(l4..)?).ok()?;
        Some((udp.source_port(), udp.destination_port()))
    };
    let (moved, kept, moved_port, kept_port) = match direction {
        Direction::Egress => (
            (ip_out.destination(), ip_in.destination()),
            (ip_out.source(), ip_in.source()),
            1,
            0,
        ),
        Direction::Ingress => (
            (ip_out.source(), ip_in.source()),
            (ip_out.destination(), ip_in.destination()),
            0,
            1,
        ),
    };
    if kept.0 != kept.1 {
        return bad(format!("{direction:?} changed the other address"));
    }
    let payload_from = if later_fragment {
        l4
    } else {
        l4 + UDP_HEADER_LEN
    };
    if input.get(payload_from..) != out.get(payload_from..) {
        return bad("the payload changed".into());
    }
    let members: Vec<([u8; 4], u16)> = (0..REPLICAS).map(replica).collect();
    if later_fragment {
        if !members.iter().any(|(addr, _)| *addr == moved.0) {
            return bad(format!(
                "a later fragment's new address {:?} is no member",
                moved.0
            ));
        }
        return None;
    }
    let (Some(ports_in), Some(ports_out)) = (ports(input), ports(out)) else {
        return bad("no UDP header".into());
    };
    let pick = |p: (u16, u16), which: usize| if which == 0 { p.0 } else { p.1 };
    if pick(ports_in, kept_port) != pick(ports_out, kept_port) {
        return bad(format!("{direction:?} changed the other port"));
    }
    let endpoint = (moved.0, pick(ports_out, moved_port));
    if !members.contains(&endpoint) {
        return bad(format!("the new endpoint {endpoint:?} is no member"));
    }
    if ip_in.more_fragments() {
        return None;
    }
    let udp_sum = |frame: &[u8], ip: &Ipv4HeaderSlice| -> Option<(u16, u16)> {
        let udp = UdpHeaderSlice::from_slice(frame.get(l4..)?).ok()?;
        let end = (l4 + usize::from(udp.length())).min(frame.len());
        let payload = frame.get(l4 + UDP_HEADER_LEN..end)?;
        let should = udp
            .to_header()
            .calc_checksum_ipv4_raw(ip.source(), ip.destination(), payload)
            .ok()?;
        Some((udp.checksum(), should))
    };
    let (Some((sum_in, should_in)), Some((sum_out, should_out))) =
        (udp_sum(input, &ip_in), udp_sum(out, &ip_out))
    else {
        return bad("no UDP datagram to sum".into());
    };
    let input_verified = sum_in != 0 && sum_in == should_in;
    if sum_out == 0 && sum_in != 0 {
        return Some(("zero checksum", "rewritten with UDP checksum 0".into()));
    }
    if input_verified && sum_out != should_out {
        return Some((
            "bad checksum",
            format!("rewritten UDP checksum {sum_out:#06x}, should be {should_out:#06x}"),
        ));
    }
    None
}

/// What is wrong with the UDP checksum of `out`, an IPv6 datagram the
/// selector rewrote from `input`.
fn rewritten_udp6_problem(input: &[u8], out: &[u8]) -> Option<(&'static str, String)> {
    let Some((sum, l4)) = udp6_sum(out) else {
        return Some(("rewritten badly", "no IPv6 UDP header left".into()));
    };
    let checksum = be16(out, l4 + UDP_CHECKSUM);
    let input_verified = udp6_sum(input).is_some_and(|(sum, _)| sum == 0xffff);
    if checksum == 0 {
        Some(("zero checksum", "rewritten with UDP checksum 0".into()))
    } else if input_verified && sum != 0xffff {
        Some((
            "bad checksum",
            format!("rewritten UDP checksum {checksum:#06x} does not verify (sum {sum:#06x})"),
        ))
    } else {
        None
    }
}

/// Frames the selector does not own: each must pass untouched and
/// uncounted. Per-CPU counters are read after every frame (to name the
/// frame that changed them); latency and in-flight count once per batch.
fn run_unowned_batch(
    sel: &mut Selector,
    round: usize,
    batch: Vec<(Case, NotOwned)>,
    tally: &mut Tally,
) {
    let batch_before = BatchCounters::read(sel);
    let mut before = FrameCounters::read(sel);
    let frames = batch.len();
    let failures_before = tally.failures;
    for (case, reason) in batch {
        *tally
            .frames
            .entry((case.program, case.family, Some(reason)))
            .or_default() += 1;
        let mut problems = Vec::new();
        let mut kinds = Vec::new();
        match case.program.run(sel, &case.frame) {
            // Both harnesses refuse frames shorter than an Ethernet header;
            // no program ever sees one.
            Err(_) if reason == NotOwned::ShorterThanEthernet => {
                tally.refused_by_harness += 1;
                continue;
            }
            Err(e) => {
                problems.push(format!("BPF_PROG_TEST_RUN: {e}"));
                kinds.push("test run failed");
            }
            Ok((verdict, out)) => {
                if verdict != case.program.pass_verdict() {
                    problems.push(format!("verdict {verdict}"));
                    kinds.push("not passed");
                }
                if out != case.frame {
                    let first = out.iter().zip(&case.frame).position(|(a, b)| a != b);
                    problems.push(format!(
                        "frame changed (first differing byte {first:?}, length {} -> {})",
                        case.frame.len(),
                        out.len()
                    ));
                    kinds.push("modified");
                }
            }
        }
        let after = FrameCounters::read(sel);
        let changes = forbidden_changes(
            &before,
            &after,
            case.program.direction(),
            reason.pass_reason(),
        );
        if !changes.is_empty() {
            problems.push(format!("counters: {}", changes.join(", ")));
            kinds.push("counted");
        }
        before = after;
        if !problems.is_empty() {
            let failure = Failure {
                program: case.program,
                reason: Some(reason),
                label: case.label,
                problems,
                frame: case.frame,
            };
            tally.record(failure, &kinds);
        }
    }
    let batch_after = BatchCounters::read(sel);
    // A batch with a failing frame already fails, and its in-flight and
    // latency changes are most likely that frame's: report only the others.
    if batch_after != batch_before && tally.failures == failures_before {
        let mut what = Vec::new();
        if batch_after.inflight != batch_before.inflight {
            what.push(format!(
                "in flight {} -> {}",
                batch_before.inflight, batch_after.inflight
            ));
        }
        for (backend, (b, a)) in batch_before
            .latency
            .iter()
            .zip(&batch_after.latency)
            .enumerate()
        {
            let (b, a): (u64, u64) = (b.iter().sum(), a.iter().sum());
            if a != b {
                what.push(format!(
                    "backend {backend} latency samples {:+}",
                    delta(b, a)
                ));
            }
        }
        tally.batch_failures.push(format!(
            "round {round} ({frames} unowned frames): {}",
            what.join(", ")
        ));
    }
}

/// `SELECTOR_FUZZ_SEED`, or a fresh seed: each run tries other frames.
fn seed() -> u64 {
    match std::env::var(SEED_VARIABLE) {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{SEED_VARIABLE} must be a u64, not {s:?}")),
        Err(_) => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            nanos ^ (u64::from(std::process::id()) << 32)
        }
    }
}

#[test]
fn frames_the_selector_does_not_own_pass_untouched_and_uncounted() {
    let seed = seed();
    println!("fuzz: seed {seed} ({SEED_VARIABLE}={seed} replays this run)");
    let started = Instant::now();
    let ipv4 = settings_for(Descriptor::memcached(), replica);
    let ipv6_group = (0..REPLICAS).map(|i| member(Family::V6, i)).collect();
    let settings = Settings {
        // The agent's default: the run never fills it (fewer than 65,536 ids).
        inflight_max: DEFAULT_INFLIGHT_MAX,
        // One dual-stack agent: group 0 over IPv4, group 1 over IPv6.
        groups: vec![ipv4.groups[0].clone(), ipv6_group],
        ..ipv4
    };
    let mut sel = Selector::load(&settings).expect("load the selector");
    let mut generator = Generator::new(seed);
    let mut tally = Tally::default();
    for round in 0..FRAMES / ROUND_FRAMES {
        for _ in 0..PRIMED_PER_ROUND {
            prime(&mut sel, &mut generator, &mut tally);
        }
        let mut unowned = Vec::new();
        // Owned frames first: they change state (complete and add requests)
        // between, never inside, the batches whose counters are compared.
        for _ in 0..ROUND_FRAMES {
            let case = generator.case();
            match ownership(&case.frame, case.program.direction()) {
                Ok(()) => run_owned(&mut sel, case, &mut tally),
                Err(reason) => unowned.push((case, reason)),
            }
        }
        run_unowned_batch(&mut sel, round, unowned, &mut tally);
    }
    let summary = tally.summary(seed, started.elapsed(), &sel);
    // The summary once: as the failure message, or as the run's record.
    if tally.failures > 0 || !tally.batch_failures.is_empty() {
        panic!("{summary}");
    }
    println!("{summary}");
    // Guard against a generator that stopped reaching the interesting paths.
    for program in Program::ALL {
        for family in Family::ALL {
            let owned = tally.owned(program, Some(family));
            assert!(
                owned > 1_000,
                "only {owned} owned {family:?} frames through {program:?}"
            );
        }
    }
    for family in Family::ALL {
        let totals = group_stats(&sel, family);
        assert!(
            totals.responses > 100 && totals.redirected_to > 100,
            "too few {family:?} replies completed requests or requests redirected:\n{summary}"
        );
    }
    assert!(
        tally.ipv6_rewrites_checked > 100,
        "too few rewritten IPv6 datagrams checked:\n{summary}"
    );
    assert!(
        tally.ipv4_rewrites_checked > 100,
        "too few rewritten IPv4 datagrams checked:\n{summary}"
    );
}

/// The oracle on frames whose answer is known, one rule broken at a time;
/// its checksum repair cross-checked with etherparse's arithmetic.
#[test]
fn the_oracle_owns_exactly_well_formed_requests_and_replies_of_the_group() {
    let request = udp((CLIENT, CLIENT_PORT), replica(1), GET);
    let reply = udp(replica(1), (CLIENT, CLIENT_PORT), VALUE);
    assert_eq!(ownership(&request, Direction::Egress), Ok(()));
    assert_eq!(ownership(&reply, Direction::Ingress), Ok(()));
    assert_eq!(
        ownership(&request, Direction::Ingress),
        Err(NotOwned::NotABackend)
    );
    assert_eq!(
        ownership(&reply, Direction::Egress),
        Err(NotOwned::NotABackend)
    );
    // A tagged request passes (from a VLAN device above the attached
    // one); a tagged reply is still the selector's.
    let mut tagged = request.clone();
    tagged.splice(12..12, [0x81, 0x00, 0x00, 0x07]);
    assert_eq!(
        ownership(&tagged, Direction::Egress),
        Err(NotOwned::VlanTagged)
    );
    let mut tagged_reply = reply.clone();
    tagged_reply.splice(12..12, [0x81, 0x00, 0x00, 0x07]);
    assert_eq!(ownership(&tagged_reply, Direction::Ingress), Ok(()));
    let mut service_tagged = request.clone();
    service_tagged.splice(12..12, [0x88, 0xa8, 0x00, 0x07]);
    assert_eq!(
        ownership(&service_tagged, Direction::Egress),
        Err(NotOwned::VlanTagged)
    );
    let mut double_tagged = service_tagged.clone();
    double_tagged.splice(12..12, [0x81, 0x00, 0x00, 0x08]);
    assert_eq!(
        ownership(&double_tagged, Direction::Egress),
        Err(NotOwned::NotIpEthertype)
    );
    let short = udp((CLIENT, CLIENT_PORT), replica(1), b"\x12");
    assert_eq!(
        ownership(&short, Direction::Egress),
        Err(NotOwned::NoRequestId)
    );
    // A request's frame header: sequence 0, one datagram, reserved 0;
    // a reply's may be any of a multi-datagram answer.
    let second = b"\x12\x34\x00\x01\x00\x02\x00\x00END\r\n";
    let header_only = udp((CLIENT, CLIENT_PORT), replica(1), &GET[..8]);
    assert_eq!(ownership(&header_only, Direction::Egress), Ok(()));
    for payload in [&GET[..7], &second[..]] {
        let frame = udp((CLIENT, CLIENT_PORT), replica(1), payload);
        assert_eq!(
            ownership(&frame, Direction::Egress),
            Err(NotOwned::NotARequest)
        );
    }
    let second_reply = udp(replica(1), (CLIENT, CLIENT_PORT), second);
    assert_eq!(ownership(&second_reply, Direction::Ingress), Ok(()));

    // One rule broken, the header checksum repaired after.
    let broken = |edit: fn(&mut Vec<u8>)| {
        let mut frame = request.clone();
        edit(&mut frame);
        fix_ip_checksum(&mut frame);
        ownership(&frame, Direction::Egress)
    };
    let ip = ETH_LEN;
    assert_eq!(
        broken(|f| f[ETH_LEN + IP_SRC] = 224),
        Err(NotOwned::SourceNotUnicast)
    );
    assert_eq!(
        broken(|f| f[ETH_LEN + IP_DST] = 127),
        Err(NotOwned::DestinationNotUnicast)
    );
    assert_eq!(
        broken(|f| f[ETH_LEN + IP_FRAGMENT] |= 0x20),
        Err(NotOwned::Fragment)
    );
    assert_eq!(
        broken(|f| f[ETH_LEN + IP_PROTOCOL] = 6),
        Err(NotOwned::NotUdp)
    );
    assert_eq!(
        broken(|f| {
            let beyond = (f.len() - ETH_LEN + 1) as u16;
            write16(f, ETH_LEN + IP_TOTAL_LEN, beyond)
        }),
        Err(NotOwned::IpTotalBeyondFrame)
    );
    assert_eq!(
        broken(|f| write16(f, ETH_LEN + IPV4_HEADER_LEN + UDP_LEN, 500)),
        Err(NotOwned::UdpLengthBeyondIp)
    );

    let mut frame = request.clone();
    frame[ip + 8] = 3; // TTL
    fix_ip_checksum(&mut frame);
    let header = etherparse::Ipv4HeaderSlice::from_slice(&frame[ip..])
        .unwrap()
        .to_header();
    assert_eq!(header.header_checksum, header.calc_header_checksum());
    assert_eq!(ownership(&frame, Direction::Egress), Ok(()));
    frame[ip + IP_CHECKSUM] ^= 1;
    assert_eq!(
        ownership(&frame, Direction::Egress),
        Err(NotOwned::BadIpChecksum)
    );

    ipv6_rules();
}

/// A change to a frame that breaks one rule.
type Edit<'a> = dyn Fn(&mut Vec<u8>) + 'a;

/// The IPv6 half of the oracle's rules, and its frame builder and checksum
/// repair cross-checked with etherparse.
fn ipv6_rules() {
    let client = Generator::client_at(Family::V6, CLIENT_PORT);
    let backend = member(Family::V6, 1);
    let request = |extensions: &[(u8, usize)]| datagram(client, backend, GET, extensions);
    let plain = request(&[]);
    assert_eq!(
        plain,
        udp6((CLIENT6, CLIENT_PORT), replica6(1), GET),
        "the builder without extension headers is etherparse's"
    );
    assert_eq!(ownership(&plain, Direction::Egress), Ok(()));
    let reply = datagram(backend, client, VALUE, &[]);
    assert_eq!(ownership(&reply, Direction::Ingress), Ok(()));
    assert_eq!(
        ownership(&reply, Direction::Egress),
        Err(NotOwned::NotABackend)
    );
    let mut tagged = plain.clone();
    tagged.splice(12..12, [0x81, 0x00, 0x00, 0x07]);
    assert_eq!(
        ownership(&tagged, Direction::Egress),
        Err(NotOwned::VlanTagged)
    );
    // A member's address with another member's port is no member.
    let mut crossed = backend;
    crossed.set_port(replica6(2).1);
    assert_eq!(
        ownership(&datagram(client, crossed, GET, &[]), Direction::Egress),
        Err(NotOwned::NotABackend)
    );

    use NotOwned::*;
    let (hop, routing, options) = (IPPROTO_HOPOPTS, IPPROTO_ROUTING, IPPROTO_DSTOPTS);
    let walked = [
        request(&[(hop, 8), (options, 16), (routing, 24)]),
        request(&[(hop, 8), (routing, 8), (options, 112)]),
        request(&[(routing, 128)]),
    ];
    for frame in &walked {
        assert_eq!(ownership(frame, Direction::Egress), Ok(()));
        // etherparse walks the same chain to the same UDP header, and the
        // repaired checksum is its own.
        let parsed = etherparse::SlicedPacket::from_ethernet(frame).unwrap();
        let Some(etherparse::TransportSlice::Udp(udp)) = parsed.transport else {
            panic!("etherparse finds no UDP header");
        };
        let etherparse::NetSlice::Ipv6(ip) = parsed.net.unwrap() else {
            panic!("not IPv6");
        };
        let expected = udp
            .to_header()
            .calc_checksum_ipv6(&ip.header().to_header(), udp.payload())
            .unwrap();
        assert_eq!(udp.checksum(), expected);
        assert_eq!(udp6_sum(frame).map(|(sum, _)| sum), Some(0xffff));
    }
    let not_walked = [
        request(&[(hop, 8), (options, 8), (routing, 8), (options, 8)]),
        request(&[(hop, 64), (routing, 72)]),
        request(&[(IPPROTO_AH, 16)]),
        request(&[(hop, 8), (IPPROTO_MOBILITY, 8)]),
    ];
    for frame in &not_walked {
        assert_eq!(
            ownership(frame, Direction::Egress),
            Err(UnwalkedExtensionHeader)
        );
    }
    let mut fragment = plain.clone();
    insert_extension(&mut fragment, 0, IPPROTO_FRAGMENT, vec![0; 8]);
    assert_eq!(ownership(&fragment, Direction::Egress), Err(Ipv6Fragment));
    let mut fourth_fragment = walked[0].clone();
    insert_extension(&mut fourth_fragment, 3, IPPROTO_FRAGMENT, vec![0; 8]);
    assert_eq!(
        ownership(&fourth_fragment, Direction::Ingress),
        Err(Ipv6Fragment)
    );
    // A reply's fragments: the first (offset 0, M) is a reply; a later
    // one is owned from a member's address only; a second fragment header
    // is not walked. Fragment header: next header, reserved, offset and
    // flags, id.
    let fragment_of = |frame: &[u8], offset_flags: u16| {
        let mut f = frame.to_vec();
        let mut header = vec![0, 0];
        header.extend_from_slice(&offset_flags.to_be_bytes());
        header.extend_from_slice(&[0x80, 0, 0, 1]);
        insert_extension(&mut f, 0, IPPROTO_FRAGMENT, header);
        f
    };
    let first = fragment_of(&reply, 1);
    assert_eq!(ownership(&first, Direction::Ingress), Ok(()));
    assert_eq!(ownership(&first, Direction::Egress), Err(Ipv6Fragment));
    let later = fragment_of(&reply, 0x0010);
    assert!(is_later_fragment6(&later) && !is_later_fragment6(&first));
    assert_eq!(ownership(&later, Direction::Ingress), Ok(()));
    let not_member = fragment_of(&datagram(client, client, VALUE, &[]), 0x0010);
    assert_eq!(
        ownership(&not_member, Direction::Ingress),
        Err(Ipv6Fragment)
    );
    assert_eq!(
        ownership(&fragment_of(&first, 1), Direction::Ingress),
        Err(Ipv6Fragment)
    );

    // One rule broken, the UDP checksum repaired after.
    let broken = |edit: &Edit<'_>| {
        let mut frame = walked[0].clone();
        edit(&mut frame);
        fix_udp6_checksum(&mut frame);
        ownership(&frame, Direction::Egress)
    };
    let ip = ETH_LEN;
    let chain_end = ip + IPV6_HEADER_LEN + 48;
    let mapped = std::net::Ipv4Addr::from(replica(1).0).to_ipv6_mapped();
    let set_address = |at: usize, addr: [u8; 16]| {
        move |f: &mut Vec<u8>| f[ip + at..ip + at + 16].copy_from_slice(&addr)
    };
    let mut multicast = [0; 16];
    multicast[..2].copy_from_slice(&[0xff, 0x02]);
    multicast[15] = 1;
    let cases: [(&Edit<'_>, NotOwned); 12] = [
        (&|f| f[ip] = 0x40, NotIpv6Version),
        (
            &|f| write16(f, ip + IP6_PAYLOAD_LEN, 0),
            Ipv6PayloadLengthZero,
        ),
        (
            &|f| {
                let beyond = (f.len() - ip - IPV6_HEADER_LEN + 1) as u16;
                write16(f, ip + IP6_PAYLOAD_LEN, beyond)
            },
            Ipv6PayloadBeyondFrame,
        ),
        (&set_address(IP6_SRC, multicast), SourceNotUnicast),
        (&set_address(IP6_DST, [0; 16]), DestinationNotUnicast),
        (
            &set_address(IP6_DST, std::net::Ipv6Addr::LOCALHOST.octets()),
            DestinationNotUnicast,
        ),
        (&set_address(IP6_DST, mapped.octets()), Ipv4MappedAddress),
        // TCP after a walked header: an upper-layer protocol, not UDP.
        (&|f| f[ip + IPV6_HEADER_LEN] = IPPROTO_TCP, NotUdp),
        (
            &|f| f[ip + IPV6_HEADER_LEN + 1] = 16,
            UnwalkedExtensionHeader,
        ),
        (
            &|f| write16(f, ip + IP6_PAYLOAD_LEN, 40),
            ExtensionHeadersBeyondPayload,
        ),
        (
            &|f| write16(f, ip + IP6_PAYLOAD_LEN, 48 + 4),
            IpTooShortForUdp,
        ),
        (&|f| write16(f, chain_end + UDP_LEN, 500), UdpLengthBeyondIp),
    ];
    for (edit, reason) in cases {
        assert_eq!(broken(edit), Err(reason), "{reason}");
    }
    let mut zero = walked[0].clone();
    write16(&mut zero, chain_end + UDP_CHECKSUM, 0);
    assert_eq!(
        ownership(&zero, Direction::Egress),
        Err(ZeroUdpChecksumOverIpv6)
    );
    // Padding after the payload length is not part of the datagram.
    let mut padded = walked[0].clone();
    padded.extend_from_slice(&[0; 20]);
    assert_eq!(ownership(&padded, Direction::Egress), Ok(()));
}

#[test]
fn a_pass_is_counted_exactly_once_in_its_own_direction() {
    let before = vec![0; 2 * PASS_REASONS];
    // Reasons of both families: any, and ones only IPv6 frames have.
    for reason in [
        PassReason::NotBackend,
        PassReason::ExtensionHeader,
        PassReason::ZeroChecksum,
    ] {
        let mut counted_at_egress = before.clone();
        counted_at_egress[reason as usize] = 1;
        let errors = |after: &[u64], direction, reason| {
            pass_count_errors(&before, after, direction, reason).len()
        };
        assert_eq!(errors(&counted_at_egress, Direction::Egress, reason), 0);
        assert_eq!(errors(&counted_at_egress, Direction::Ingress, reason), 1);
        assert_eq!(errors(&before, Direction::Egress, reason), 1);
        let other = PassReason::ALL[(reason as usize + 1) % PASS_REASONS];
        assert_eq!(errors(&counted_at_egress, Direction::Egress, other), 1);
        let mut counted_twice = counted_at_egress.clone();
        counted_twice[other as usize] = 1;
        // Once too many, and under another reason.
        assert_eq!(errors(&counted_twice, Direction::Egress, reason), 2);
    }
}
