//! Packet access: one bounds-checked accessor and the parser. Anything that
//! is not Ethernet (with at most one VLAN tag) + IPv4 + UDP, or that a
//! receiver would drop, is reported with the reason it is passed untouched.

use aya_ebpf::programs::{TcContext, XdpContext};
use core::mem::size_of;
use selector_common::{PassReason, descriptor::MAX_DESCRIPTOR_SPAN};

pub const ETH_LEN: usize = 14;
const VLAN_LEN: usize = 4;
const IPV4_LEN: usize = 20;
pub const UDP_LEN: usize = 8;
/// Bytes the parser and descriptors may need in the linear part.
pub const PARSE_SPAN: usize =
    ETH_LEN + VLAN_LEN + IPV4_LEN + UDP_LEN + MAX_DESCRIPTOR_SPAN as usize;

const ETH_P_IPV4: u16 = 0x0800;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const IPPROTO_UDP: u8 = 17;
const IP_MF: u16 = 0x2000;
const IP_OFFSET: u16 = 0x1fff;

/// Something whose bytes live between `data` and `data_end`.
pub trait Packet {
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
}

impl Packet for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        TcContext::data(self)
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        TcContext::data_end(self)
    }
}

impl Packet for XdpContext {
    #[inline(always)]
    fn data(&self) -> usize {
        XdpContext::data(self)
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        XdpContext::data_end(self)
    }
}

/// The one bounds-checked packet accessor.
#[inline(always)]
pub fn ptr_at<T>(pkt: &impl Packet, offset: usize) -> Result<*mut T, ()> {
    // The verifier learns a range only from comparing a pointer that
    // carries the access size as its constant part. Left alone, the
    // compiler may fold `at + 1 > end` into `at >= end`, which proves
    // nothing at a variable offset; opaque values keep the form.
    let at = core::hint::black_box(pkt.data() + offset);
    let last = core::hint::black_box(at + size_of::<T>());
    if last > pkt.data_end() {
        return Err(());
    }
    Ok(at as *mut T)
}

/// Copies `N` bytes at `offset`.
#[inline(always)]
pub fn read_bytes<const N: usize>(pkt: &impl Packet, offset: usize) -> Result<[u8; N], ()> {
    let p: *const [u8; N] = ptr_at(pkt, offset)?;
    Ok(unsafe { p.read_unaligned() })
}

/// Makes the headers and descriptor span readable when the skb is paged.
#[inline(always)]
pub fn pull_headers(ctx: &TcContext) {
    let linear = ctx.data_end() - ctx.data();
    let len = ctx.len() as usize;
    if linear < PARSE_SPAN && len > linear {
        let want = if len < PARSE_SPAN { len } else { PARSE_SPAN };
        // On failure the parser sees the short linear part and passes.
        let _ = ctx.pull_data(want as u32);
    }
}

/// Where the IPv4 header starts and its fields live.
#[derive(Clone, Copy)]
pub struct Layout {
    /// Offset of the IPv4 header (after Ethernet and any VLAN tag).
    pub l3: usize,
}

impl Layout {
    #[inline(always)]
    pub fn ip_check(self) -> usize {
        self.l3 + 10
    }
    #[inline(always)]
    pub fn ip_src(self) -> usize {
        self.l3 + 12
    }
    #[inline(always)]
    pub fn ip_dst(self) -> usize {
        self.l3 + 16
    }
    #[inline(always)]
    pub fn udp(self) -> usize {
        self.l3 + IPV4_LEN
    }
    #[inline(always)]
    pub fn udp_check(self) -> usize {
        self.udp() + 6
    }
    #[inline(always)]
    pub fn payload(self) -> usize {
        self.udp() + UDP_LEN
    }
}

/// A valid IPv4 header: addresses, id and fragment state.
#[derive(Clone, Copy)]
pub struct Ipv4 {
    pub layout: Layout,
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub id: u16,
    pub total_len: usize,
    /// More fragments follow, or this is not the first: a fragment.
    pub fragment: bool,
    /// Fragment offset 0: the fragment that carries the UDP header.
    pub first_fragment: bool,
}

/// An IPv4 UDP datagram's addressing, as found in the packet.
#[derive(Clone, Copy)]
pub struct Datagram {
    pub ip: Ipv4,
    /// Host order.
    pub src_port: u16,
    pub dst_port: u16,
    /// UDP payload bytes in this packet (per the UDP header, and for a first
    /// fragment only what it carries).
    pub payload_len: usize,
}

impl Datagram {
    /// Payload byte `i`, if it is inside both the packet and the datagram
    /// (never Ethernet padding).
    #[inline(always)]
    pub fn payload_byte(&self, pkt: &impl Packet, i: usize) -> Option<u8> {
        if i >= self.payload_len {
            return None;
        }
        let i = i % MAX_DESCRIPTOR_SPAN as usize;
        let p: *const u8 = ptr_at(pkt, self.ip.layout.payload() + i).ok()?;
        Some(unsafe { *p })
    }
}

/// An address a unicast sender or receiver may have: not 0/8 ("this
/// network"), 127/8 (loopback never leaves a host), 224/4 (multicast) or
/// 240/4 (reserved and the limited broadcast).
#[inline(always)]
fn is_unicast(addr: [u8; 4]) -> bool {
    addr[0] != 0 && addr[0] != 127 && addr[0] < 224
}

/// Parses Ethernet (one optional 802.1Q/802.1ad tag) and a valid IPv4 header.
#[inline(always)]
pub fn parse_ipv4(pkt: &impl Packet) -> Result<Ipv4, PassReason> {
    let ethertype: [u8; 2] = read_bytes(pkt, 12).map_err(|_| PassReason::NotIpv4Udp)?;
    let mut ethertype = u16::from_be_bytes(ethertype);
    let mut l3 = ETH_LEN;
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        let inner: [u8; 2] = read_bytes(pkt, 16).map_err(|_| PassReason::NotIpv4Udp)?;
        ethertype = u16::from_be_bytes(inner);
        l3 += VLAN_LEN;
    }
    if ethertype != ETH_P_IPV4 {
        return Err(PassReason::NotIpv4Udp);
    }
    let h: [u8; IPV4_LEN] = read_bytes(pkt, l3).map_err(|_| PassReason::BadHeader)?;
    // Version 4 without options: options are not understood.
    if h[0] != 0x45 {
        return Err(PassReason::BadHeader);
    }
    // A receiver drops a header whose checksum does not verify.
    let mut sum = 0u32;
    let mut word = 0;
    while word < IPV4_LEN / 2 {
        sum += u32::from(u16::from_be_bytes([h[2 * word], h[2 * word + 1]]));
        word += 1;
    }
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    if sum != 0xffff {
        return Err(PassReason::BadHeader);
    }
    let total_len = usize::from(u16::from_be_bytes([h[2], h[3]]));
    let frame_after_l2 = pkt.data_end() - pkt.data() - l3;
    if total_len < IPV4_LEN || total_len > frame_after_l2 {
        return Err(PassReason::BadHeader);
    }
    let src = [h[12], h[13], h[14], h[15]];
    let dst = [h[16], h[17], h[18], h[19]];
    if !is_unicast(src) || !is_unicast(dst) {
        return Err(PassReason::BadHeader);
    }
    if h[9] != IPPROTO_UDP {
        return Err(PassReason::NotIpv4Udp);
    }
    let frag = u16::from_be_bytes([h[6], h[7]]);
    Ok(Ipv4 {
        layout: Layout { l3 },
        src,
        dst,
        id: u16::from_be_bytes([h[4], h[5]]),
        total_len,
        fragment: frag & (IP_MF | IP_OFFSET) != 0,
        first_fragment: frag & IP_OFFSET == 0,
    })
}

/// The UDP header of a whole datagram, or of a first fragment when
/// `allow_first_fragment` (its UDP length covers the whole datagram).
#[inline(always)]
pub fn parse_udp(
    pkt: &impl Packet,
    ip: Ipv4,
    allow_first_fragment: bool,
) -> Result<Datagram, PassReason> {
    if ip.fragment && !(allow_first_fragment && ip.first_fragment) {
        return Err(PassReason::Fragment);
    }
    if ip.total_len < IPV4_LEN + UDP_LEN {
        return Err(PassReason::BadHeader);
    }
    let udp: [u8; UDP_LEN] = read_bytes(pkt, ip.layout.udp()).map_err(|_| PassReason::BadHeader)?;
    let udp_len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    let in_packet = ip.total_len - IPV4_LEN;
    if udp_len < UDP_LEN || (!ip.fragment && udp_len > in_packet) {
        return Err(PassReason::BadHeader);
    }
    Ok(Datagram {
        ip,
        src_port: u16::from_be_bytes([udp[0], udp[1]]),
        dst_port: u16::from_be_bytes([udp[2], udp[3]]),
        // A first fragment holds only part of the datagram; never read
        // past the IP packet into padding.
        payload_len: if udp_len < in_packet {
            udp_len
        } else {
            in_packet
        } - UDP_LEN,
    })
}
