//! Frames and program runs for the BPF_PROG_TEST_RUN tests (`fixtures`,
//! `fuzz`): the test group's addresses, memcached payloads, a UDP frame
//! builder, settings for a loaded (not attached) selector, and runners for
//! the three programs.

use std::time::Duration;

use aya::programs::{ProgramError, SchedClassifier, TestRun, TestRunOptions, TestRunResult, Xdp};
use etherparse::{
    NetHeaders, PacketBuilder, PacketBuilderStep, PacketHeaders, TransportHeader, UdpHeader,
};
use selector_common::{BackendStats, Descriptor, Direction, PassReason, Policy, programs};
use selector_user::{IngressMode, Selector, Settings, config::tunables::Tunables};

pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_PIPE: u32 = 3;
pub const TC_ACT_REDIRECT: u32 = 7;
pub const XDP_DROP: u32 = 1;
pub const XDP_PASS: u32 = 2;
pub const XDP_REDIRECT: u32 = 4;

pub const CLIENT: [u8; 4] = [10, 77, 0, 1];
pub const CLIENT_PORT: u16 = 40_000;
pub const CLIENT_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const PRIMARY_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x10];

/// Members of the test group.
pub const REPLICAS: usize = 3;

/// Replica i: 10.77.0.(10+i), port 11211+i (ports differ so port rewrites show).
pub fn replica(i: usize) -> ([u8; 4], u16) {
    ([10, 77, 0, 10 + i as u8], 11211 + i as u16)
}

/// memcached UDP frame header (request id 0x1234) + a command.
pub const GET: &[u8] = b"\x12\x34\x00\x00\x00\x01\x00\x00get foo\r\n";
pub const SET: &[u8] = b"\x12\x35\x00\x00\x00\x01\x00\x00set foo 0 0 1\r\nx\r\n";
pub const VALUE: &[u8] = b"\x12\x34\x00\x00\x00\x01\x00\x00VALUE foo 0 3\r\nbar\r\nEND\r\n";

/// One group of `REPLICAS` members placed by `member`, threshold policy with
/// threshold 1, for a selector that is loaded, not attached.
pub fn settings_for(descriptor: Descriptor, member: fn(usize) -> ([u8; 4], u16)) -> Settings {
    Settings {
        iface: "lo".into(),
        groups: vec![
            (0..REPLICAS)
                .map(|i| {
                    let (a, p) = member(i);
                    std::net::SocketAddr::from((a, p))
                })
                .collect(),
        ],
        tunables: Tunables {
            policy: Policy::Threshold,
            threshold: 1,
            budget: Duration::from_millis(2),
            tie_break: selector_common::TieBreak::First,
            ..Tunables::default()
        },
        descriptor,
        timeout: Duration::from_secs(1),
        inflight_max: 1024,
        ingress: IngressMode::Xdp,
        mark: selector_common::MARK_REDIRECTED,
        grace: Duration::from_secs(1),
        // Off: fixtures are not swept on a schedule; the heartbeat
        // fixtures set it.
        heartbeat_bound: Duration::ZERO,
        ejection: Default::default(),
    }
}

/// Ethernet + IPv4 (no options, TTL 64) + UDP with correct checksums.
pub fn udp(src: ([u8; 4], u16), dst: ([u8; 4], u16), payload: &[u8]) -> Vec<u8> {
    written(
        PacketBuilder::ethernet2(CLIENT_MAC, PRIMARY_MAC)
            .ipv4(src.0, dst.0, 64)
            .udp(src.1, dst.1),
        payload,
    )
}

/// Ethernet + IPv6 (no extension headers, hop limit 64) + UDP with a
/// correct checksum.
pub fn udp6(src: ([u8; 16], u16), dst: ([u8; 16], u16), payload: &[u8]) -> Vec<u8> {
    written(
        PacketBuilder::ethernet2(CLIENT_MAC, PRIMARY_MAC)
            .ipv6(src.0, dst.0, 64)
            .udp(src.1, dst.1),
        payload,
    )
}

fn written(frame: PacketBuilderStep<UdpHeader>, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    frame.write(&mut out, payload).unwrap();
    out
}

/// Runs `prog` once on `input`: (verdict, output packet), or the harness's
/// refusal.
fn try_run_once<P>(prog: &P, input: &[u8]) -> Result<(u32, Vec<u8>), ProgramError>
where
    P: for<'a> TestRun<Opts<'a> = TestRunOptions<'a>, Result = TestRunResult>,
{
    let mut out = vec![0u8; input.len() + 256];
    let r = prog.test_run(TestRunOptions {
        data_in: Some(input),
        data_out: Some(&mut out),
        ..Default::default()
    })?;
    out.truncate(r.data_size_out as usize);
    Ok((r.return_value, out))
}

/// Runs the TC program `name` once on `input`.
pub fn try_run_tc(
    sel: &mut Selector,
    name: &str,
    input: &[u8],
) -> Result<(u32, Vec<u8>), ProgramError> {
    let prog = classifier(sel, name);
    try_run_once(prog, input)
}

/// Runs the XDP ingress program once on `input`.
pub fn try_run_xdp(sel: &mut Selector, input: &[u8]) -> Result<(u32, Vec<u8>), ProgramError> {
    let prog = sel.ebpf_mut().program_mut(programs::INGRESS_XDP).unwrap();
    let prog: &mut Xdp = prog.try_into().unwrap();
    try_run_once(prog, input)
}

pub fn run_tc(sel: &mut Selector, name: &str, input: &[u8]) -> (u32, Vec<u8>) {
    try_run_tc(sel, name, input).unwrap()
}

pub fn run_xdp(sel: &mut Selector, input: &[u8]) -> (u32, Vec<u8>) {
    try_run_xdp(sel, input).unwrap()
}

pub fn egress(sel: &mut Selector, input: &[u8]) -> (u32, Vec<u8>) {
    run_tc(sel, programs::EGRESS, input)
}

/// The kernel's skb test harness refuses IPv4 and IPv6 frames without a
/// whole network header (EINVAL); the stack never hands TC such an skb
/// either. XDP sees raw frames, so it takes every frame of at least an
/// Ethernet header.
pub fn fits_skb_test_run(frame: &[u8]) -> bool {
    const ETH_LEN: usize = 14;
    if frame.len() < ETH_LEN {
        return false;
    }
    let network_header = match [frame[12], frame[13]] {
        [0x08, 0x00] => 20,
        [0x86, 0xdd] => 40,
        _ => 0,
    };
    frame.len() >= ETH_LEN + network_header
}

/// A request from the client socket to the primary, replica 0.
pub fn request(payload: &[u8]) -> Vec<u8> {
    udp((CLIENT, CLIENT_PORT), replica(0), payload)
}

/// DNS server i: replica i's address, port 53.
pub fn dns_server(i: usize) -> ([u8; 4], u16) {
    (replica(i).0, 53)
}

/// A standard DNS query for example.org A, id 0xbeef, RD set.
pub const DNS_QUERY: &[u8] =
    b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03org\x00\x00\x01\x00\x01";

/// Datagrams to a DNS member that are no standard query with one question,
/// each named: too short for the header, a response, other opcodes, other
/// question counts.
pub const DNS_NOT_QUERIES: [(&str, &[u8]); 7] = [
    ("2 bytes", b"\xbe\xef"),
    ("11 bytes", b"\xbe\xef\x01\x00\x00\x01\x00\x00\x00\x00\x00"),
    (
        "QR=1",
        b"\xbe\xef\x81\x80\x00\x01\x00\x01\x00\x00\x00\x00\x07example\x03org\x00\x00\x01\x00\x01",
    ),
    (
        "opcode NOTIFY",
        b"\xbe\xef\x20\x00\x00\x01\x00\x00\x00\x00\x00\x00",
    ),
    (
        "opcode UPDATE",
        b"\xbe\xef\x28\x00\x00\x01\x00\x00\x00\x00\x00\x00",
    ),
    (
        "QDCOUNT 0",
        b"\xbe\xef\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00",
    ),
    (
        "QDCOUNT 2",
        b"\xbe\xef\x01\x00\x00\x02\x00\x00\x00\x00\x00\x00",
    ),
];

/// `struct __sk_buff` is 192 bytes; `mark` is at offset 8, `gso_segs` at
/// 164 and `gso_size` at 176.
const SKB_CTX_LEN: usize = 192;
const SKB_MARK: std::ops::Range<usize> = 8..12;
const SKB_GSO_SEGS: std::ops::Range<usize> = 164..168;
const SKB_GSO_SIZE: std::ops::Range<usize> = 176..180;

/// Runs the TC program `name` with an skb mark: (verdict, output, mark after).
pub fn run_tc_marked(
    sel: &mut Selector,
    name: &str,
    input: &[u8],
    mark: u32,
) -> (u32, Vec<u8>, u32) {
    let mut ctx = [0u8; SKB_CTX_LEN];
    ctx[SKB_MARK].copy_from_slice(&mark.to_ne_bytes());
    let (verdict, out, ctx_out) = run_tc_ctx(sel, name, input, &ctx);
    let mark_out = u32::from_ne_bytes(ctx_out[SKB_MARK].try_into().unwrap());
    (verdict, out, mark_out)
}

/// Runs the egress program on `input` as a GSO skb of `segments` datagrams
/// of `gso_size` payload bytes (the test harness keeps the skb linear and
/// whole; only its GSO fields say it would be cut apart).
pub fn egress_gso(
    sel: &mut Selector,
    input: &[u8],
    gso_size: u32,
    segments: u32,
) -> (u32, Vec<u8>) {
    let mut ctx = [0u8; SKB_CTX_LEN];
    ctx[SKB_GSO_SIZE].copy_from_slice(&gso_size.to_ne_bytes());
    ctx[SKB_GSO_SEGS].copy_from_slice(&segments.to_ne_bytes());
    let (verdict, out, _) = run_tc_ctx(sel, programs::EGRESS, input, &ctx);
    (verdict, out)
}

/// Runs the TC program `name` once with `ctx` as its `__sk_buff`:
/// (verdict, output, `__sk_buff` after).
fn run_tc_ctx(
    sel: &mut Selector,
    name: &str,
    input: &[u8],
    ctx: &[u8; SKB_CTX_LEN],
) -> (u32, Vec<u8>, [u8; SKB_CTX_LEN]) {
    let prog = classifier(sel, name);
    let mut ctx_out = [0u8; SKB_CTX_LEN];
    let mut out = vec![0u8; input.len() + 256];
    let r = prog
        .test_run(TestRunOptions {
            data_in: Some(input),
            data_out: Some(&mut out),
            ctx_in: Some(ctx),
            ctx_out: Some(&mut ctx_out),
            ..Default::default()
        })
        .unwrap();
    out.truncate(r.data_size_out as usize);
    (r.return_value, out, ctx_out)
}

/// Runs the egress program with an skb mark: (verdict, output, mark after).
pub fn egress_marked(sel: &mut Selector, input: &[u8], mark: u32) -> (u32, Vec<u8>, u32) {
    run_tc_marked(sel, programs::EGRESS, input, mark)
}

/// Sets group 0's member `position`'s issued count to `issued`.
pub fn set_issued(sel: &mut Selector, position: usize, issued: u64) {
    let now = counters(sel).issued[position];
    sel.add_to_issued(position as u32, issued as i64 - now as i64);
}

/// Group 0's raw counters, by member position.
pub struct Counters {
    pub issued: Vec<u64>,
}

pub fn counters(sel: &Selector) -> Counters {
    let raw = sel.accounting().unwrap();
    Counters {
        issued: raw.iter().map(|a| a.0).collect(),
    }
}

/// How many packets passed untouched in `direction` for `reason`.
pub fn passed(sel: &Selector, direction: Direction, reason: PassReason) -> u64 {
    sel.passed()
        .unwrap()
        .into_iter()
        .find(|(d, r, _)| (*d, *r) == (direction, reason))
        .map(|(_, _, n)| n)
        .unwrap()
}

pub fn stats(sel: &Selector) -> Vec<BackendStats> {
    sel.stats().unwrap()
}

/// Byte offsets in an Ethernet + 20-byte IPv4 + UDP frame.
/// Destination and source MAC.
pub const ETH_ADDRS: std::ops::Range<usize> = 0..12;
pub const IP_CHECK: std::ops::Range<usize> = 24..26;
pub const IP_SRC: std::ops::Range<usize> = 26..30;
pub const IP_DST: std::ops::Range<usize> = 30..34;
pub const UDP_SRC: std::ops::Range<usize> = 34..36;
pub const UDP_DST: std::ops::Range<usize> = 36..38;
pub const UDP_CHECK: std::ops::Range<usize> = 40..42;

/// Asserts `out` equals `input` except in `changed` ranges.
pub fn assert_only_changed(input: &[u8], out: &[u8], changed: &[std::ops::Range<usize>]) {
    assert_eq!(input.len(), out.len(), "length changed");
    for (i, (a, b)) in input.iter().zip(out).enumerate() {
        if !changed.iter().any(|r| r.contains(&i)) {
            assert_eq!(a, b, "byte {i} changed but should not have");
        }
    }
}

/// The parsed frame, its IPv4 header checksum checked with etherparse's
/// own arithmetic.
pub fn verified_ipv4(frame: &[u8]) -> (PacketHeaders<'_>, etherparse::Ipv4Header) {
    let h = PacketHeaders::from_ethernet_slice(frame).unwrap();
    let Some(NetHeaders::Ipv4(ip, _)) = h.net.clone() else {
        panic!("not IPv4")
    };
    assert_eq!(
        ip.header_checksum,
        ip.calc_header_checksum(),
        "IPv4 checksum"
    );
    (h, ip)
}

/// Checks both checksums of `frame` with etherparse's own arithmetic and
/// returns (src, dst) as parsed.
pub fn verified_endpoints(frame: &[u8]) -> (([u8; 4], u16), ([u8; 4], u16)) {
    let (h, ip) = verified_ipv4(frame);
    let Some(TransportHeader::Udp(u)) = h.transport else {
        panic!("not UDP")
    };
    let expected = u.calc_checksum_ipv4(&ip, h.payload.slice()).unwrap();
    assert_eq!(u.checksum, expected, "UDP checksum");
    (
        (ip.source, u.source_port),
        (ip.destination, u.destination_port),
    )
}

/// `BPF_F_TEST_SKB_CHECKSUM_COMPLETE` (Linux 6.11): the harness gives the
/// skb CHECKSUM_COMPLETE with the packet's sum, and fails the run with
/// EBADMSG if the program leaves `skb->csum` disagreeing with the packet
/// (what a receiver reports as "hw csum failure").
const BPF_F_TEST_SKB_CHECKSUM_COMPLETE: u32 = 1 << 2;
const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// The `test` member of `union bpf_attr`, as BPF_PROG_TEST_RUN reads it.
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

/// Runs the TC program `name` once on `input` as a CHECKSUM_COMPLETE skb,
/// as a NIC that sums received packets hands it over: (verdict, output),
/// or the harness's error (EBADMSG: the program left `skb->csum` stale;
/// EINVAL: a kernel before 6.11, without the flag). aya's test run has no
/// way to pass the flag, hence the system call.
pub fn try_run_tc_checksum_complete(
    sel: &mut Selector,
    name: &str,
    input: &[u8],
) -> std::io::Result<(u32, Vec<u8>)> {
    use std::os::fd::AsFd as _;
    let prog = classifier(sel, name);
    let fd = prog.fd().map_err(std::io::Error::other)?.as_fd();
    test_run_fd(fd, input, BPF_F_TEST_SKB_CHECKSUM_COMPLETE)
}

/// BPF_PROG_TEST_RUN once on the program behind `prog` with `flags`:
/// (verdict, output frame). A descriptor, unlike aya's programs, can be
/// shared between threads (the race tests run one program on several).
pub fn test_run_fd(
    prog: std::os::fd::BorrowedFd<'_>,
    input: &[u8],
    flags: u32,
) -> std::io::Result<(u32, Vec<u8>)> {
    use std::os::fd::AsRawFd as _;
    let mut out = vec![0u8; input.len() + 256];
    let mut attr = TestRunAttr {
        prog_fd: prog.as_raw_fd() as u32,
        data_size_in: input.len() as u32,
        data_size_out: out.len() as u32,
        data_in: input.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat: 1,
        flags,
        ..Default::default()
    };
    // SAFETY: a valid attr for BPF_PROG_TEST_RUN whose buffers outlive the
    // call; the kernel writes only `out` and the attr.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            &raw mut attr,
            std::mem::size_of::<TestRunAttr>(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    out.truncate(attr.data_size_out as usize);
    Ok((attr.retval, out))
}

fn classifier<'a>(sel: &'a mut Selector, name: &str) -> &'a mut SchedClassifier {
    sel.ebpf_mut()
        .program_mut(name)
        .unwrap()
        .try_into()
        .unwrap()
}
