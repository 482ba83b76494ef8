//! Seeded fuzzing of the three programs through BPF_PROG_TEST_RUN.
//!
//! 100,000 frames (request and reply templates, mutated copies of them, and
//! fully random frames) go through TC egress, XDP ingress and TC ingress of
//! a loaded selector whose group has real requests in flight. An oracle
//! written here, independent of the kernel code, says whether the selector
//! owns a frame. A frame it does not own must pass byte-identical with the
//! pass verdict and change no counter but the "passed untouched" ones; an
//! owned frame must only get a sane verdict. Failures are collected and
//! summarised at the end instead of stopping at the first.
//!
//! `FUZZ_SEED=<u64>` reproduces a run; the seed is printed at the start.

use std::{
    collections::{BTreeMap, VecDeque},
    fmt,
    time::{Duration, Instant},
};

use aya::{maps::PerCpuArray, programs::ProgramError};
use etherparse::PacketBuilder;
use selector_common::{BackendStats, DEFAULT_INFLIGHT_MAX, Descriptor, programs};
use selector_testbed::frames::{
    CLIENT, CLIENT_MAC, CLIENT_PORT, GET, PRIMARY_MAC, REPLICAS, TC_ACT_PIPE, TC_ACT_REDIRECT,
    TC_ACT_SHOT, VALUE, XDP_DROP, XDP_PASS, XDP_REDIRECT, fits_skb_test_run, replica, settings_for,
    try_run_tc, try_run_xdp, udp,
};
use selector_user::{Selector, Settings};

const FRAMES: usize = 100_000;
/// Frames generated together; owned ones run first, then the rest as one
/// batch between two reads of the counters too slow to read per frame.
const ROUND_FRAMES: usize = 1_000;
/// Well-formed gets sent through egress before each round, so replies find
/// requests in flight.
const PRIMED_PER_ROUND: usize = 32;
const DEFAULT_SEED: u64 = 0x5e1e_c70f_0220_2024;
/// The memcached descriptor's request id: 2 bytes at payload offset 0.
const MEMCACHED_ID_SPAN: usize = 2;
/// Failing frames shown in the summary, each as its first bytes in hex.
const SHOWN_FAILURES: usize = 6;
const SHOWN_HEX_BYTES: usize = 72;

const ETH_LEN: usize = 14;
const VLAN_TAG_LEN: usize = 4;
const IPV4_HEADER_LEN: usize = 20;
const UDP_HEADER_LEN: usize = 8;
const ETH_P_IPV4: [u8; 2] = [0x08, 0x00];
const ETH_P_8021Q: [u8; 2] = [0x81, 0x00];
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

// ---------------------------------------------------------------------------
// The seams the kernel changes in flight will move: kept here, and small.

/// Per-CPU array of "passed untouched" counts, indexed by
/// `direction * PASS_REASONS + reason` (direction 0 egress, 1 ingress).
/// Absent from kernels that do not count passes yet.
const PASSED_MAP: &str = "PASSED";
const PASS_REASONS: usize = selector_common::PASS_REASONS as usize;

/// The "passed untouched" counters summed over CPUs, if the kernel has them.
fn passed_counters(sel: &Selector) -> Option<Vec<u64>> {
    let map = sel.ebpf().map(PASSED_MAP)?;
    let passed: PerCpuArray<_, u64> =
        PerCpuArray::try_from(map).expect("PASSED is a per-CPU array of u64");
    let counts = (0..passed.len())
        .map(|i| passed.get(&i, 0).expect("read PASSED").iter().sum())
        .collect();
    Some(counts)
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

/// Why the selector must leave a frame alone (the first rule it breaks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum NotOwned {
    ShorterThanEthernet,
    NotIpv4Ethertype,
    TruncatedIpv4Header,
    NotIpv4Version,
    IpOptions,
    BadIpChecksum,
    IpTotalBeyondFrame,
    Fragment,
    SourceNotUnicast,
    DestinationNotUnicast,
    NotUdp,
    IpTooShortForUdp,
    UdpLengthBelowHeader,
    UdpLengthBeyondIp,
    NotABackend,
    NoRequestId,
}

impl fmt::Display for NotOwned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = match self {
            NotOwned::ShorterThanEthernet => "shorter than an Ethernet header",
            NotOwned::NotIpv4Ethertype => "not IPv4 (ethertype, after at most one 802.1Q tag)",
            NotOwned::TruncatedIpv4Header => "truncated in the IPv4 header",
            NotOwned::NotIpv4Version => "IP version is not 4",
            NotOwned::IpOptions => "IHL is not 5 (options or a bogus length)",
            NotOwned::BadIpChecksum => "bad IPv4 header checksum",
            NotOwned::IpTotalBeyondFrame => "IP total length beyond the frame",
            NotOwned::Fragment => "a fragment (MF or offset)",
            NotOwned::SourceNotUnicast => "source not unicast (0, broadcast, multicast, loopback)",
            NotOwned::DestinationNotUnicast => {
                "destination not unicast (0, broadcast, multicast, loopback)"
            }
            NotOwned::NotUdp => "protocol is not UDP",
            NotOwned::IpTooShortForUdp => "IP total length leaves no room for a UDP header",
            NotOwned::UdpLengthBelowHeader => "UDP length below 8",
            NotOwned::UdpLengthBeyondIp => "UDP length beyond the IP payload",
            NotOwned::NotABackend => "not to (egress) / from (ingress) a configured backend",
            NotOwned::NoRequestId => "payload too short for the request id",
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

fn is_unicast(addr: [u8; 4]) -> bool {
    let multicast = (224..=239).contains(&addr[0]);
    addr != [0; 4] && addr != [255; 4] && !multicast && addr[0] != 127
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

fn is_backend(addr: [u8; 4], port: u16) -> bool {
    (0..REPLICAS).any(|i| replica(i) == (addr, port))
}

/// Ok if the selector owns `frame` in `direction`: a well-formed request to
/// (egress) or reply from (ingress) a configured backend.
fn ownership(frame: &[u8], direction: Direction) -> Result<(), NotOwned> {
    if frame.len() < ETH_LEN {
        return Err(NotOwned::ShorterThanEthernet);
    }
    let mut l3 = ETH_LEN;
    if frame[12..14] == ETH_P_8021Q {
        if frame.len() < ETH_LEN + VLAN_TAG_LEN {
            return Err(NotOwned::NotIpv4Ethertype);
        }
        l3 += VLAN_TAG_LEN;
    }
    if frame[l3 - 2..l3] != ETH_P_IPV4 {
        return Err(NotOwned::NotIpv4Ethertype);
    }
    let ip = &frame[l3..];
    if ip.len() < IPV4_HEADER_LEN {
        return Err(NotOwned::TruncatedIpv4Header);
    }
    if ip[0] >> 4 != 4 {
        return Err(NotOwned::NotIpv4Version);
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
    let fragment = be16(ip, IP_FRAGMENT) & 0x3fff;
    if fragment != 0 && direction == Direction::Egress {
        return Err(NotOwned::Fragment);
    }
    let (src, dst) = (ipv4(ip, IP_SRC), ipv4(ip, IP_DST));
    if !is_unicast(src) {
        return Err(NotOwned::SourceNotUnicast);
    }
    if !is_unicast(dst) {
        return Err(NotOwned::DestinationNotUnicast);
    }
    if ip[IP_PROTOCOL] != IPPROTO_UDP {
        return Err(NotOwned::NotUdp);
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
    if total < IPV4_HEADER_LEN + UDP_HEADER_LEN {
        return Err(NotOwned::IpTooShortForUdp);
    }
    let udp = &ip[IPV4_HEADER_LEN..];
    let udp_len = usize::from(be16(udp, UDP_LEN));
    if udp_len < UDP_HEADER_LEN {
        return Err(NotOwned::UdpLengthBelowHeader);
    }
    // A first fragment's UDP length covers the whole datagram.
    if udp_len > total - IPV4_HEADER_LEN && !first_fragment {
        return Err(NotOwned::UdpLengthBeyondIp);
    }
    let (src_port, dst_port) = (be16(udp, UDP_SRC_PORT), be16(udp, UDP_DST_PORT));
    let to_or_from_backend = match direction {
        Direction::Egress => is_backend(dst, dst_port),
        Direction::Ingress => is_backend(src, src_port),
    };
    if !to_or_from_backend {
        return Err(NotOwned::NotABackend);
    }
    if udp_len - UDP_HEADER_LEN < MEMCACHED_ID_SPAN {
        return Err(NotOwned::NoRequestId);
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Frame surgery for the mutations: offsets found the way a parser would,
// every write bounds-checked (a mutation that does not fit does nothing).

fn l3_offset(frame: &[u8]) -> usize {
    if frame.len() >= ETH_LEN + VLAN_TAG_LEN && frame[12..14] == ETH_P_8021Q {
        ETH_LEN + VLAN_TAG_LEN
    } else {
        ETH_LEN
    }
}

/// Where UDP starts per the IHL (at least 20 bytes in).
fn l4_offset(frame: &[u8]) -> usize {
    let l3 = l3_offset(frame);
    let ihl = frame.get(l3).map_or(5, |b| usize::from(b & 0xf)).max(5);
    l3 + ihl * 4
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
}

const MUTATIONS: [Mutation; 26] = [
    Mutation::FlipByte,
    Mutation::FlipBit,
    Mutation::Truncate,
    Mutation::ExtendJunk,
    Mutation::IpTotalBeyondFrame,
    Mutation::IpTotalShorter,
    Mutation::BadIpChecksum,
    Mutation::IpOptions,
    Mutation::IhlOnly,
    Mutation::IpVersion,
    Mutation::MoreFragments,
    Mutation::FragmentOffset,
    Mutation::SourceSpecial,
    Mutation::DestinationSpecial,
    Mutation::Protocol,
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

// ---------------------------------------------------------------------------
// The generator: templates, mutations, random frames, and which program a
// frame goes through.

struct Case {
    program: Program,
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
    /// Recent primed requests, so replies (and retransmits) carry ids that
    /// are really in flight.
    primed: VecDeque<PrimedRequest>,
}

const RECENT_PRIMED: usize = 256;

impl Generator {
    fn new(seed: u64) -> Self {
        Self {
            rng: Rng::new(seed),
            next_request_id: 0,
            primed: VecDeque::new(),
        }
    }

    fn fresh_request_id(&mut self) -> u16 {
        let id = self.next_request_id;
        self.next_request_id = id.wrapping_add(1);
        id
    }

    fn recent_primed(&mut self) -> Option<PrimedRequest> {
        let i = self.rng.below(self.primed.len().max(1));
        self.primed.get(i).copied()
    }

    /// A well-formed get with a new id to a random member, as the
    /// application would send it.
    fn primed_get(&mut self) -> Vec<u8> {
        let request = PrimedRequest {
            id: self.fresh_request_id(),
            backend: self.rng.below(REPLICAS),
        };
        if self.primed.len() == RECENT_PRIMED {
            self.primed.pop_front();
        }
        self.primed.push_back(request);
        let payload = self.memcached_request(request.id, "get");
        udp((CLIENT, CLIENT_PORT), replica(request.backend), &payload)
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

    fn client(&mut self) -> ([u8; 4], u16) {
        // Mostly the one client port the primed requests use.
        let port = if self.rng.percent(90) {
            CLIENT_PORT
        } else {
            CLIENT_PORT + 1 + self.rng.below(3) as u16
        };
        (CLIENT, port)
    }

    /// A new id, the id of a primed request (a retransmit, or the
    /// application's own failover), or any id.
    fn request_id_for_request(&mut self) -> u16 {
        match (self.rng.below(10), self.recent_primed()) {
            (0..=3, Some(primed)) => primed.id,
            (4..=7, _) => self.fresh_request_id(),
            _ => self.rng.u16(),
        }
    }

    /// (request id, backend) of a reply: mostly a primed request's id, from
    /// the backend it was addressed to (where it went unless redirected) or
    /// from any member; sometimes any id.
    fn reply_to(&mut self) -> (u16, usize) {
        let any_backend = self.rng.below(REPLICAS);
        match self.recent_primed() {
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

    /// A valid frame of some kind, its label, and the program it belongs to.
    fn template(&mut self) -> (Vec<u8>, String, Program) {
        let backend = self.rng.below(REPLICAS);
        let ingress = if self.rng.percent(50) {
            Program::IngressXdp
        } else {
            Program::IngressTc
        };
        match self.rng.below(100) {
            0..=37 => {
                let id = self.request_id_for_request();
                // Reads (which may be redirected) and writes (never).
                let command = self.rng.pick(&["get", "gets", "set", "delete"]);
                let payload = self.memcached_request(id, command);
                let client = self.client();
                let frame = udp(client, replica(backend), &payload);
                (
                    frame,
                    format!("memcached request to backend {backend}"),
                    Program::Egress,
                )
            }
            38..=75 => {
                let (id, backend) = self.reply_to();
                let payload = self.memcached_value(id);
                let client = self.client();
                let frame = udp(replica(backend), client, &payload);
                (
                    frame,
                    format!("memcached VALUE from backend {backend}"),
                    ingress,
                )
            }
            76..=83 => {
                let id = self.request_id_for_request();
                let payload = self.dns_message(id, false);
                // To the backend's memcached port (owned) or to port 53 (not).
                let mut dst = replica(backend);
                if self.rng.percent(30) {
                    dst.1 = 53;
                }
                let frame = udp(self.client(), dst, &payload);
                (
                    frame,
                    format!("DNS query to {}", endpoint(dst)),
                    Program::Egress,
                )
            }
            84..=91 => {
                let (id, backend) = self.reply_to();
                let payload = self.dns_message(id, true);
                let mut src = replica(backend);
                if self.rng.percent(30) {
                    src.1 = 53;
                }
                let frame = udp(src, self.client(), &payload);
                (frame, format!("DNS answer from {}", endpoint(src)), ingress)
            }
            92..=94 => {
                let mut frame = Vec::new();
                let payload = self.memcached_request(0x1234, "get");
                PacketBuilder::ethernet2(CLIENT_MAC, PRIMARY_MAC)
                    .ipv6([0xfd; 16], [0xfe; 16], 64)
                    .udp(CLIENT_PORT, replica(backend).1)
                    .write(&mut frame, &payload)
                    .unwrap();
                (frame, "IPv6 UDP to a backend port".into(), Program::Egress)
            }
            _ => {
                let mut frame = Vec::new();
                let payload = self.memcached_request(0x1234, "get");
                PacketBuilder::ethernet2(CLIENT_MAC, PRIMARY_MAC)
                    .ipv4(CLIENT, replica(backend).0, 64)
                    .tcp(CLIENT_PORT, replica(backend).1, 1, 1000)
                    .write(&mut frame, &payload)
                    .unwrap();
                (frame, "TCP to a backend".into(), Program::Egress)
            }
        }
    }

    /// A special (not unicast) IPv4 address.
    fn special_address(&mut self) -> [u8; 4] {
        match self.rng.below(4) {
            0 => [0; 4],
            1 => [255; 4],
            2 => [
                224 + self.rng.below(16) as u8,
                self.rng.byte(),
                self.rng.byte(),
                self.rng.byte(),
            ],
            _ => [127, self.rng.byte(), self.rng.byte(), self.rng.byte()],
        }
    }

    /// A byte offset, mostly inside the headers where a flip matters most.
    fn interesting_offset(&mut self, len: usize) -> usize {
        if self.rng.percent(70) {
            self.rng
                .below(len.min(ETH_LEN + VLAN_TAG_LEN + IPV4_HEADER_LEN + 12))
        } else {
            self.rng.below(len)
        }
    }

    /// Applies `mutation` to `frame`; returns a short description.
    fn mutate(&mut self, frame: &mut Vec<u8>, mutation: Mutation) -> String {
        let l3 = l3_offset(frame);
        let l4 = l4_offset(frame);
        let rng = &mut self.rng;
        match mutation {
            Mutation::FlipByte if !frame.is_empty() => {
                let at = self.interesting_offset(frame.len());
                let flip = 1 + self.rng.below(255) as u8;
                frame[at] ^= flip;
                format!("byte {at} ^= {flip:#04x}")
            }
            Mutation::FlipBit if !frame.is_empty() => {
                let at = self.interesting_offset(frame.len());
                let bit = self.rng.below(8);
                frame[at] ^= 1 << bit;
                format!("bit {bit} of byte {at}")
            }
            Mutation::Truncate if !frame.is_empty() => {
                let len = rng.below(frame.len());
                frame.truncate(len);
                format!("truncated to {len}")
            }
            Mutation::ExtendJunk => {
                let junk = rng.within(1..=200);
                let bytes = rng.bytes(junk);
                frame.extend_from_slice(&bytes);
                format!("{junk} junk bytes appended")
            }
            Mutation::IpTotalBeyondFrame => {
                let total = (frame.len().saturating_sub(l3) + rng.within(1..=64)).min(0xffff);
                write16(frame, l3 + IP_TOTAL_LEN, total as u16);
                format!("IP total length {total} beyond the frame")
            }
            Mutation::IpTotalShorter => {
                let current = read16(frame, l3 + IP_TOTAL_LEN).unwrap_or(0);
                let total = rng.below(usize::from(current) + 1) as u16;
                write16(frame, l3 + IP_TOTAL_LEN, total);
                format!("IP total length {total}")
            }
            // Applied last, after any checksum repair (see `case`).
            Mutation::BadIpChecksum => "bad IP checksum".into(),
            Mutation::IpOptions if frame.len() >= l3 + IPV4_HEADER_LEN => {
                let words = rng.within(1..=10);
                let options: Vec<u8> = (0..words * 4)
                    .map(|_| {
                        let random = rng.byte();
                        rng.pick(&[1, 1, 1, 0, random])
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
                let ihl = rng.pick(&[0u8, 1, 4, 6, 7, 15]);
                frame[l3] = (frame[l3] & 0xf0) | ihl;
                format!("IHL {ihl}")
            }
            Mutation::IpVersion if frame.len() > l3 => {
                let version = rng.pick(&[0u8, 5, 6, 15]);
                frame[l3] = (frame[l3] & 0x0f) | version << 4;
                format!("IP version {version}")
            }
            Mutation::MoreFragments => {
                let flags = read16(frame, l3 + IP_FRAGMENT).unwrap_or(0) | 0x2000;
                write16(frame, l3 + IP_FRAGMENT, flags);
                "more fragments".into()
            }
            Mutation::FragmentOffset => {
                let offset = rng.within(1..=0x1fff) as u16;
                let flags = read16(frame, l3 + IP_FRAGMENT).unwrap_or(0) & 0xe000;
                write16(frame, l3 + IP_FRAGMENT, flags | offset);
                format!("fragment offset {offset}")
            }
            Mutation::SourceSpecial | Mutation::DestinationSpecial => {
                let address = self.special_address();
                let (field, name) = match mutation {
                    Mutation::SourceSpecial => (IP_SRC, "source"),
                    _ => (IP_DST, "destination"),
                };
                write_bytes(frame, l3 + field, &address);
                format!("{name} {}", std::net::Ipv4Addr::from(address))
            }
            Mutation::Protocol if frame.len() > l3 + IP_PROTOCOL => {
                let protocol = rng.pick(&[0u8, 1, 6, 132, 136, 255, 16, 18]);
                frame[l3 + IP_PROTOCOL] = protocol;
                format!("IP protocol {protocol}")
            }
            Mutation::Ethertype => {
                let random = rng.u16();
                let ethertype = rng.pick(&[0x86dd, 0x0806, 0x88a8, 0x8100, 0x0801, random]);
                // The outer type, or the inner one of a tagged frame.
                write16(frame, l3 - 2, ethertype);
                format!("ethertype {ethertype:#06x} at {}", l3 - 2)
            }
            Mutation::UdpLengthBelowHeader => {
                let len = rng.below(UDP_HEADER_LEN) as u16;
                write16(frame, l4 + UDP_LEN, len);
                format!("UDP length {len}")
            }
            Mutation::UdpLengthBeyondIp => {
                let total = usize::from(read16(frame, l3 + IP_TOTAL_LEN).unwrap_or(0));
                let len = (total.saturating_sub(IPV4_HEADER_LEN) + rng.within(1..=64)) as u16;
                write16(frame, l4 + UDP_LEN, len);
                format!("UDP length {len} beyond the IP payload")
            }
            Mutation::UdpLengthShorter => {
                let current = usize::from(read16(frame, l4 + UDP_LEN).unwrap_or(8)).max(8);
                let len = rng.within(UDP_HEADER_LEN..=current) as u16;
                write16(frame, l4 + UDP_LEN, len);
                format!("UDP length {len}")
            }
            Mutation::PayloadCut if frame.len() >= l4 + UDP_HEADER_LEN => {
                // A consistent datagram with 0-3 payload bytes.
                let payload = rng.below(4).min(frame.len() - l4 - UDP_HEADER_LEN);
                frame.truncate(l4 + UDP_HEADER_LEN + payload);
                write16(frame, l4 + UDP_LEN, (UDP_HEADER_LEN + payload) as u16);
                let total = l4 - l3 + UDP_HEADER_LEN + payload;
                write16(frame, l3 + IP_TOTAL_LEN, total as u16);
                format!("payload cut to {payload} bytes")
            }
            Mutation::PortChange => {
                let field = rng.pick(&[UDP_SRC_PORT, UDP_DST_PORT]);
                let current = read16(frame, l4 + field).unwrap_or(0);
                let port = if rng.percent(50) {
                    current.wrapping_add(rng.pick(&[1u16, 2, 0xffff, 0xfffe]))
                } else {
                    rng.u16()
                };
                write16(frame, l4 + field, port);
                format!("UDP port at +{field} = {port}")
            }
            Mutation::AddressChange => {
                let field = rng.pick(&[IP_SRC, IP_DST]);
                let random = rng.byte();
                let last = rng.pick(&[1, 9, 10, 11, 12, 13, random]);
                if frame.len() >= l3 + field + 4 {
                    frame[l3 + field + 3] = last;
                }
                format!("IP address at +{field} ends in .{last}")
            }
            Mutation::RequestId => {
                let id = rng.u16();
                write16(frame, l4 + UDP_HEADER_LEN, id);
                format!("request id {id:#06x}")
            }
            Mutation::AddVlan | Mutation::DoubleVlan if frame.len() >= ETH_LEN => {
                let already_tagged = frame[12..14] == ETH_P_8021Q;
                if matches!(mutation, Mutation::AddVlan) && already_tagged {
                    return "already tagged".into();
                }
                let vlan = rng.within(1..=4094) as u16;
                let tag = [0x81, 0x00, (vlan >> 8) as u8, vlan as u8];
                frame.splice(12..12, tag);
                format!("802.1Q tag, VLAN {vlan}")
            }
            Mutation::RemoveVlan if frame.len() >= ETH_LEN + VLAN_TAG_LEN => {
                if frame[12..14] == ETH_P_8021Q {
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
        let (mut frame, mut label, natural) = self.template();
        if self.rng.percent(20) {
            label += &format!(", {}", self.mutate(&mut frame, Mutation::AddVlan));
        }
        let mutations = match self.rng.below(100) {
            0..=24 => 0,
            25..=59 => 1,
            60..=84 => 2,
            _ => 3,
        };
        let mut break_checksum = false;
        for _ in 0..mutations {
            let mutation = self.rng.pick(&MUTATIONS);
            break_checksum |= matches!(mutation, Mutation::BadIpChecksum);
            label += &format!(", {}", self.mutate(&mut frame, mutation));
        }
        // Most mutated headers keep a valid checksum, so the other rules
        // are tested on their own and not all shadowed by this one.
        if mutations > 0 && self.rng.percent(85) {
            fix_ip_checksum(&mut frame);
        }
        if break_checksum {
            let at = l3_offset(&frame) + IP_CHECKSUM;
            let current = read16(&frame, at).unwrap_or(0);
            write16(&mut frame, at, current ^ self.rng.within(1..=0xffff) as u16);
        }
        // Mostly through the program the frame was made for, sometimes
        // through another one (requests at ingress, replies at egress).
        let program = if self.rng.percent(80) {
            natural
        } else {
            self.rng.pick(&Program::ALL)
        };
        Self::case_for(program, frame, label)
    }

    fn random_case(&mut self) -> Case {
        let len = self.rng.below(1601);
        let mut frame = self.rng.bytes(len);
        let mut label = format!("{len} random bytes");
        // Half of them claim IPv4, so they reach the IP header checks.
        if len >= ETH_LEN && self.rng.percent(50) {
            frame[12..14].copy_from_slice(&ETH_P_IPV4);
            if len > ETH_LEN {
                frame[ETH_LEN] = 0x45;
            }
            label += " with IPv4 ethertype";
        }
        let program = self.rng.pick(&Program::ALL);
        Self::case_for(program, frame, label)
    }

    /// TC frames the skb harness would refuse go through XDP instead.
    fn case_for(program: Program, frame: Vec<u8>, label: String) -> Case {
        let program = if program != Program::IngressXdp && !fits_skb_test_run(&frame) {
            Program::IngressXdp
        } else {
            program
        };
        Case {
            program,
            frame,
            label,
        }
    }
}

// ---------------------------------------------------------------------------
// Counters.

/// Counters read after every frame the selector does not own.
#[derive(Clone)]
struct FrameCounters {
    stats: Vec<BackendStats>,
    accounting: Vec<(u64, u64, u64)>,
    passed: Option<Vec<u64>>,
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
    if let (Some(b), Some(a)) = (&before.passed, &after.passed) {
        changes.extend(pass_count_errors(b, a, direction));
    }
    changes
}

/// Each frame passed untouched is counted exactly once, in its direction.
fn pass_count_errors(before: &[u64], after: &[u64], direction: Direction) -> Vec<String> {
    let mut errors = Vec::new();
    let grown: i128 = before.iter().zip(after).map(|(b, a)| delta(*b, *a)).sum();
    if grown != 1 {
        errors.push(format!("PASSED total {grown:+} (expected +1)"));
    }
    let own = direction.index() * PASS_REASONS..(direction.index() + 1) * PASS_REASONS;
    for (i, (b, a)) in before.iter().zip(after).enumerate() {
        if a != b && !own.contains(&i) {
            errors.push(format!(
                "PASSED[{i}] {:+} in the wrong direction",
                delta(*b, *a)
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
    /// (program, None for owned or the reason) -> frames.
    frames: BTreeMap<(Program, Option<NotOwned>), usize>,
    /// (program, oracle reason or None for owned) -> failing frames.
    failing: BTreeMap<(Program, Option<NotOwned>), FailingFrames>,
    failures: usize,
    shown: Vec<Failure>,
    /// Counter changes over a batch of unowned frames no frame of the
    /// batch was caught at.
    batch_failures: Vec<String>,
    refused_by_harness: usize,
    primed: usize,
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
            let owned = self.frames.get(&(program, None)).copied().unwrap_or(0);
            let not_owned: Vec<String> = self
                .frames
                .iter()
                .filter(|((p, _), _)| *p == program)
                .filter_map(|((_, reason), n)| reason.map(|r| format!("{r:?} {n}")))
                .collect();
            let _ = writeln!(
                out,
                "  {program:?}: {owned} owned; not owned: {}",
                not_owned.join(", ")
            );
        }
        let totals = total_stats(sel);
        let _ = writeln!(
            out,
            "  state reached: {} requests tracked, {} redirected, {} replies completed a request, {} unmatched, {} in flight at the end",
            totals.requests,
            totals.redirected_to,
            totals.responses,
            totals.unmatched_responses,
            inflight_count(sel)
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

/// Per-backend statistics summed over the group.
fn total_stats(sel: &Selector) -> BackendStats {
    let mut total = BackendStats::default();
    for s in sel.stats().expect("read STATS") {
        total.add(&s);
    }
    total
}

fn endpoint((addr, port): ([u8; 4], u16)) -> String {
    std::net::SocketAddrV4::new(addr.into(), port).to_string()
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

/// An owned frame: the program must not fail; anything else it may do.
fn run_owned(sel: &mut Selector, case: Case, tally: &mut Tally) {
    *tally.frames.entry((case.program, None)).or_default() += 1;
    let problem = match case.program.run(sel, &case.frame) {
        Err(e) => Some(("test run failed", format!("BPF_PROG_TEST_RUN: {e}"))),
        Ok((verdict, _)) if !case.program.sane_verdicts().contains(&verdict) => {
            Some(("unexpected verdict", format!("verdict {verdict}")))
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
            .entry((case.program, Some(reason)))
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
        let changes = forbidden_changes(&before, &after, case.program.direction());
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

fn seed() -> u64 {
    match std::env::var("FUZZ_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("FUZZ_SEED must be a u64, not {s:?}")),
        Err(_) => DEFAULT_SEED,
    }
}

#[test]
fn frames_the_selector_does_not_own_pass_untouched_and_uncounted() {
    let seed = seed();
    println!("fuzz: seed {seed} (FUZZ_SEED={seed} reproduces this run)");
    let started = Instant::now();
    let settings = Settings {
        // The agent's default: the run never fills it (fewer than 65,536 ids).
        inflight_max: DEFAULT_INFLIGHT_MAX,
        ..settings_for(Descriptor::memcached(), replica)
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
    let totals = total_stats(&sel);
    for program in Program::ALL {
        let owned = tally.frames.get(&(program, None)).copied().unwrap_or(0);
        assert!(
            owned > 1_000,
            "only {owned} owned frames through {program:?}"
        );
    }
    assert!(
        totals.responses > 100 && totals.redirected_to > 100,
        "too few replies completed requests or requests redirected:\n{summary}"
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
    let mut tagged = request.clone();
    tagged.splice(12..12, [0x81, 0x00, 0x00, 0x07]);
    assert_eq!(ownership(&tagged, Direction::Egress), Ok(()));
    let mut double_tagged = tagged.clone();
    double_tagged.splice(12..12, [0x81, 0x00, 0x00, 0x08]);
    assert_eq!(
        ownership(&double_tagged, Direction::Egress),
        Err(NotOwned::NotIpv4Ethertype)
    );
    let short = udp((CLIENT, CLIENT_PORT), replica(1), b"\x12");
    assert_eq!(
        ownership(&short, Direction::Egress),
        Err(NotOwned::NoRequestId)
    );

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
}

#[test]
fn a_pass_is_counted_exactly_once_in_its_own_direction() {
    let before = vec![0; 2 * PASS_REASONS];
    let mut counted_at_egress = before.clone();
    counted_at_egress[3] = 1;
    assert!(pass_count_errors(&before, &counted_at_egress, Direction::Egress).is_empty());
    assert_eq!(
        pass_count_errors(&before, &counted_at_egress, Direction::Ingress).len(),
        1
    );
    assert_eq!(
        pass_count_errors(&before, &before, Direction::Egress).len(),
        1
    );
    let mut counted_twice = counted_at_egress.clone();
    counted_twice[4] = 1;
    assert_eq!(
        pass_count_errors(&before, &counted_twice, Direction::Egress).len(),
        1
    );
}
