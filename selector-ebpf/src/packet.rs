//! The parser, over the one bounds-checked accessor (`selector_ebpf::access`,
//! the library's, which the benchmark's object shares). Anything that
//! is not Ethernet (with at most one VLAN tag) + IPv4 or IPv6 + UDP, or that
//! a receiver would drop, is reported with the reason it is passed
//! untouched. Both families come out as one `Ip` (header offsets and a
//! family flag; addresses read as 16 bytes, IPv4-mapped for IPv4), so the
//! code after the parser is shared.
//!
//! Classify first, pull after: the parser reads only the bytes directly
//! readable (on TC the skb's linear part, where the stack builds, and GRO
//! merges, the headers of nearly every skb), and a pull, which may copy a
//! shared skb head and moves payload out of its page fragments, is paid
//! only by a datagram to or from a member whose protocol bytes are not
//! linear (`pull_payload`), or by the rare packet whose very headers are
//! not (`pull_short_headers`). TCP, and UDP to other ports, is never
//! pulled.

use aya_ebpf::programs::TcContext;
use selector_common::{
    Direction, Endpoint, PassReason,
    descriptor::MAX_DESCRIPTOR_SPAN,
    opaque::{opaque, opaque_usize},
};
use selector_ebpf::access::skb;
pub use selector_ebpf::access::{ETH_LEN, IPV4_LEN, IPV6_LEN, Packet, UDP_LEN, ptr_at, read_bytes};

use crate::maps::{SCRATCH, count_pull};

const VLAN_LEN: usize = 4;
/// Extension headers the parser walks before UDP, at most.
const MAX_EXTENSION_HEADERS: usize = 3;
/// Their bytes, at most (a hop-by-hop header with a router alert, a
/// routing header with a few segments): longer chains pass untouched.
pub const MAX_EXTENSION_SPAN: usize = 128;
/// Header bytes the parser may read, at most.
const HEADER_SPAN: usize = ETH_LEN + VLAN_LEN + IPV6_LEN + MAX_EXTENSION_SPAN + UDP_LEN;
/// Payload bytes the descriptors may read, at most: the span, and the rest
/// of an 8-byte word that starts in it (`Datagram::payload_word`).
const DESCRIPTOR_READS: usize = MAX_DESCRIPTOR_SPAN as usize + 8;
/// Bound on the UDP header's offset (a power of two above any a parsed
/// packet can have), so the verifier can bound offsets read back as
/// unknowns.
const L4_OFFSET_BOUND: usize = 256;

const ETH_P_IPV4: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_DSTOPTS: u8 = 60;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const IPPROTO_UDP: u8 = 17;
const IP_MF: u16 = 0x2000;
const IP_OFFSET: u16 = 0x1fff;
/// IPv6 fragment header: offset (8-byte units, in the high 13 bits) and M.
const IP6_OFFSET: u16 = 0xfff8;
const IP6_MF: u16 = 0x0001;

/// Makes the frame's first `len` bytes directly readable, counted.
#[inline(always)]
fn pull(pkt: &impl Packet, len: usize, direction: Direction) {
    count_pull(direction);
    // On failure the parser and the descriptor's reads see the short
    // linear part.
    let _ = pkt.pull(len);
}

/// The header bytes `parse_ip` and `parse_udp` will read from this packet,
/// at most, as far as its Ethernet type and IP protocol (or IPv6 next
/// header) tell: the IP header, and the UDP header if the protocol is UDP;
/// for IPv6 with extension headers, or a packet too short to tell, every
/// header byte the parser may read.
#[inline(always)]
fn header_bytes(pkt: &impl Packet) -> usize {
    let Ok(ethertype) = read_bytes::<2>(pkt, 12) else {
        return HEADER_SPAN;
    };
    let mut ethertype = u16::from_be_bytes(ethertype);
    let mut l3 = ETH_LEN;
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        let Ok(inner) = read_bytes::<2>(pkt, 16) else {
            return HEADER_SPAN;
        };
        ethertype = u16::from_be_bytes(inner);
        l3 += VLAN_LEN;
    }
    match ethertype {
        ETH_P_IPV4 => match read_bytes::<1>(pkt, l3 + 9) {
            Ok([IPPROTO_UDP]) => l3 + IPV4_LEN + UDP_LEN,
            Ok(_) => l3 + IPV4_LEN,
            Err(()) => HEADER_SPAN,
        },
        ETH_P_IPV6 => match read_bytes::<1>(pkt, l3 + 6) {
            Ok([IPPROTO_UDP]) => l3 + IPV6_LEN + UDP_LEN,
            Ok([next]) if is_extension_header(next) => HEADER_SPAN,
            Ok(_) => l3 + IPV6_LEN,
            Err(()) => HEADER_SPAN,
        },
        _ => l3,
    }
}

/// Pulls the headers in, with the descriptor's bytes, when the parser
/// would not find them all directly readable in a longer frame: rare (the
/// stack builds, and GRO merges, an skb's headers in its linear part). Any
/// other packet is parsed as it is, and only a member's datagram is pulled
/// (`pull_payload`).
#[inline(always)]
pub fn pull_short_headers(pkt: &impl Packet, direction: Direction) {
    let len = pkt.frame_len();
    let need = header_bytes(pkt);
    if pkt.readable_len() < if len < need { len } else { need } {
        let want = HEADER_SPAN + DESCRIPTOR_READS;
        pull(pkt, if len < want { len } else { want }, direction);
    }
}

/// Makes the payload bytes a descriptor may read directly readable, if
/// they are not: called only for a datagram to (request path) or from
/// (reply path) a member, the one kind of packet whose payload is read.
/// The rest of the payload may stay in page fragments.
#[inline(always)]
pub fn pull_payload(pkt: &impl Packet, dgram: &Datagram, direction: Direction) {
    let len = pkt.frame_len();
    let want = dgram.ip.layout.payload() + DESCRIPTOR_READS;
    let want = if len < want { len } else { want };
    if pkt.readable_len() < want {
        pull(pkt, want, direction);
    }
}

/// A GSO skb: one header for several datagrams, cut apart only after TC.
#[inline(always)]
pub fn segmented(ctx: &TcContext) -> bool {
    unsafe { (*ctx.skb.skb).gso_size != 0 }
}

/// A VLAN tag on the frame: in it (after the MAC addresses, where the
/// parser skipped it), or in the skb's metadata (tag insertion by the
/// device, veth's included), where the parser does not see it.
#[inline(always)]
pub fn vlan_tagged(ctx: &TcContext, l: Layout) -> bool {
    l.l3 != ETH_LEN || unsafe { (*skb(ctx)).vlan_present } != 0
}

/// Where the IP and UDP headers start, and which family.
#[derive(Clone, Copy)]
pub struct Layout {
    /// Offset of the IP header (after Ethernet and any VLAN tag).
    pub l3: usize,
    /// Offset of the UDP header (after IPv6 extension headers).
    pub l4: usize,
    pub v6: bool,
}

impl Layout {
    /// IPv4 only: IPv6 has no header checksum.
    #[inline(always)]
    pub fn ip_check(self) -> usize {
        self.l3 + 10
    }
    #[inline(always)]
    pub fn ip_src(self) -> usize {
        if self.v6 { self.l3 + 8 } else { self.l3 + 12 }
    }
    #[inline(always)]
    pub fn ip_dst(self) -> usize {
        if self.v6 { self.l3 + 24 } else { self.l3 + 16 }
    }
    #[inline(always)]
    pub fn udp(self) -> usize {
        self.l4
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

/// A valid IPv4 or IPv6 header carrying UDP (or a later fragment of a
/// datagram), and its fragment state. The addresses stay in the packet
/// (`src_address`, `dst_address`): copies of two 16-byte addresses would
/// not fit the egress program's stack.
#[derive(Clone, Copy)]
pub struct Ip {
    pub layout: Layout,
    /// Offset of the end of the IP packet (never Ethernet padding). On TC
    /// it may lie past the linear part: a bound, not a readable range.
    pub end: usize,
    /// A fragment: over IPv4 more fragments follow or the offset is not 0;
    /// over IPv6 a fragment header was walked. The fields below matter
    /// only for a fragment.
    pub fragment: bool,
    /// Fragment offset 0: the fragment that carries the UDP header (and
    /// whose layout is a UDP datagram's). A later fragment's `l4` is where
    /// its data starts.
    pub first_fragment: bool,
    /// More fragments follow (IPv4's MF, IPv6's M).
    pub more_fragments: bool,
    /// Identification: IPv4's 16 bits or IPv6's 32.
    pub id: u32,
    /// IPv4's protocol (always UDP here), or the next header of IPv6's
    /// fragment header.
    pub protocol: u8,
}

/// The source address as 16 bytes: IPv6, or IPv4-mapped.
#[inline(always)]
pub fn src_address(pkt: &impl Packet, l: Layout) -> Result<[u8; 16], ()> {
    // The 16 bytes that end with the address: the whole IPv6 address, or
    // the IPv4 one and the 12 header bytes before it.
    let v6 = opaque_usize(usize::from(l.v6));
    address_ending_at(pkt, l.l3 + 8 * v6, v6)
}

#[inline(always)]
pub fn dst_address(pkt: &impl Packet, l: Layout) -> Result<[u8; 16], ()> {
    let v6 = opaque_usize(usize::from(l.v6));
    address_ending_at(pkt, l.l3 + 4 + 20 * v6, v6)
}

/// Reads 16 bytes at `at` and, for IPv4 (`v6` 0), puts the IPv4-mapped
/// prefix in place of the first 12, with masks instead of a branch: both
/// families then leave here in one verifier state. On two 64-bit words,
/// not byte by byte: twelve byte masks took a stack slot each in the
/// reply path's frame, which is near Linux 6.1's 512-byte limit.
#[inline(always)]
fn address_ending_at(pkt: &impl Packet, at: usize, v6: usize) -> Result<[u8; 16], ()> {
    let bytes: [u8; 16] = read_bytes(pkt, at)?;
    let [hi, lo] = mapped_words(bytes, opaque(0u64.wrapping_sub(v6 as u64)));
    let mut addr = [0u8; 16];
    addr[..8].copy_from_slice(&hi.to_ne_bytes());
    addr[8..].copy_from_slice(&lo.to_ne_bytes());
    Ok(addr)
}

/// The two words of `bytes` with the first 12 bytes replaced by the
/// IPv4-mapped prefix where `keep` is 0, kept where it is all ones.
#[inline(always)]
fn mapped_words(bytes: [u8; 16], keep: u64) -> [u64; 2] {
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[i..i + 8]);
        u64::from_ne_bytes(w)
    };
    let mapped = Endpoint::ipv4([0; 4], 0).addr;
    let prefix = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&mapped[i..i + 8]);
        u64::from_ne_bytes(w)
    };
    // Of the second word, bytes 12..16 (the IPv4 address) are always kept.
    let mut tail = [0u8; 8];
    tail[4..].fill(0xff);
    let always = u64::from_ne_bytes(tail);
    let keep_lo = keep | always;
    [
        (word(0) & keep) | (prefix(0) & !keep),
        (word(8) & keep_lo) | (prefix(8) & !keep_lo),
    ]
}

/// A UDP datagram's addressing, as found in the packet.
#[derive(Clone, Copy)]
pub struct Datagram {
    pub ip: Ip,
    /// Host order.
    pub src_port: u16,
    pub dst_port: u16,
    /// UDP payload bytes in this packet (per the UDP header, and for a first
    /// fragment only what it carries). Only the descriptor's bytes of them
    /// are sure to be linear, after `pull_payload`; `bpf_skb_load_bytes`
    /// reads the rest.
    pub payload_len: usize,
}

impl Datagram {
    /// Payload byte `i`, if it is inside both the packet and the datagram
    /// (never Ethernet padding) and in the linear part.
    #[inline(always)]
    pub fn payload_byte(&self, pkt: &impl Packet, i: usize) -> Option<u8> {
        if i >= self.payload_len {
            return None;
        }
        let i = i % MAX_DESCRIPTOR_SPAN as usize;
        let p: *const u8 = ptr_at(pkt, self.ip.layout.payload() + i).ok()?;
        Some(unsafe { *p })
    }

    /// Payload bytes `i..i + 8`, if all are inside both the packet and the
    /// datagram.
    #[inline(always)]
    pub fn payload_word(&self, pkt: &impl Packet, i: usize) -> Option<[u8; 8]> {
        if i + 8 > self.payload_len {
            return None;
        }
        let i = i % MAX_DESCRIPTOR_SPAN as usize;
        read_bytes(pkt, self.ip.layout.payload() + i).ok()
    }
}

/// An address a unicast sender or receiver may have: not 0/8 ("this
/// network"), 127/8 (loopback never leaves a host), 224/4 (multicast) or
/// 240/4 (reserved and the limited broadcast).
#[inline(always)]
fn is_unicast_v4(addr: [u8; 4]) -> bool {
    addr[0] != 0 && addr[0] != 127 && addr[0] < 224
}

/// IPv6: not multicast (ff00::/8), not the unspecified address or the
/// loopback (::1, which never leaves a host), not IPv4-mapped
/// (::ffff:0:0/96, never on the wire, RFC 4291 2.5.5.2): the parser's
/// addresses are IPv4-mapped for IPv4, so such a datagram would be taken
/// for one to or from an IPv4 member or client.
#[inline(always)]
fn is_unicast_v6(addr: &[u8; 16]) -> bool {
    if addr[0] == 0xff {
        return false;
    }
    let mut high = 0u8;
    let mut i = 0;
    while i < 10 {
        high |= addr[i];
        i += 1;
    }
    let mapped = high == 0 && addr[10] == 0xff && addr[11] == 0xff;
    high |= addr[10] | addr[11] | addr[12] | addr[13] | addr[14];
    !mapped && (high != 0 || addr[15] > 1)
}

/// IPv6 extension headers (RFC 8200, IANA's list): any other next header
/// is an upper-layer protocol (TCP, ICMPv6, ...), which is simply not UDP.
#[inline(always)]
fn is_extension_header(next: u8) -> bool {
    matches!(
        next,
        0 | 43 | 44 | 50 | 51 | 60 | 135 | 139 | 140 | 253 | 254
    )
}

/// Whether the frame is, from its first bytes alone, an untagged IPv4 or
/// IPv6 packet of another protocol than UDP (TCP above all), or no IP at
/// all: what `parse_ip` would pass as `NotIpUdp`, found with one bounds
/// check and no other state, so that the traffic the selector never touches runs a
/// few instructions of it (each run's code and data lines are cold in a
/// busy stack). False for anything that needs the parser to tell: a VLAN
/// tag, IPv6 extension headers, UDP, a header not valid or not directly
/// readable (`parse_ip` then decides, as before).
#[inline(always)]
pub fn plainly_not_udp(pkt: &impl Packet) -> bool {
    // Ethernet and a whole IPv6 header (an IPv4 one is shorter, and a
    // frame that holds one but not 54 bytes goes to the parser).
    let Ok(h) = read_bytes::<{ ETH_LEN + IPV6_LEN }>(pkt, 0) else {
        return false;
    };
    let ip = &h[ETH_LEN..];
    match u16::from_be_bytes([h[12], h[13]]) {
        ETH_P_IPV4 => ip[0] >> 4 == 4 && ip[9] != IPPROTO_UDP,
        ETH_P_IPV6 => {
            let payload_len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
            ip[0] >> 4 == 6
                && payload_len != 0
                && IPV6_LEN + payload_len <= pkt.frame_len() - ETH_LEN
                && ip[6] != IPPROTO_UDP
                && !is_extension_header(ip[6])
        }
        ETH_P_8021Q | ETH_P_8021AD => false,
        _ => true,
    }
}

/// Parses Ethernet (one optional 802.1Q/802.1ad tag) and a valid IPv4 or
/// IPv6 header whose payload is UDP.
#[inline(always)]
pub fn parse_ip(pkt: &impl Packet) -> Result<Ip, PassReason> {
    let ethertype: [u8; 2] = read_bytes(pkt, 12).map_err(|_| PassReason::NotIpUdp)?;
    let mut ethertype = u16::from_be_bytes(ethertype);
    let mut l3 = ETH_LEN;
    if ethertype == ETH_P_8021Q || ethertype == ETH_P_8021AD {
        let inner: [u8; 2] = read_bytes(pkt, 16).map_err(|_| PassReason::NotIpUdp)?;
        ethertype = u16::from_be_bytes(inner);
        l3 += VLAN_LEN;
    }
    match ethertype {
        ETH_P_IPV4 => parse_ipv4(pkt, l3),
        ETH_P_IPV6 => parse_ipv6(pkt, l3),
        _ => Err(PassReason::NotIpUdp),
    }
}

#[inline(always)]
fn parse_ipv4(pkt: &impl Packet, l3: usize) -> Result<Ip, PassReason> {
    let h: [u8; IPV4_LEN] = read_bytes(pkt, l3).map_err(|_| PassReason::BadHeader)?;
    if h[0] >> 4 != 4 {
        return Err(PassReason::BadHeader);
    }
    // Not UDP first: IGMP (its reports carry a Router Alert option) and the
    // like are not ours, not bad, whatever else their header holds.
    if h[9] != IPPROTO_UDP {
        return Err(PassReason::NotIpUdp);
    }
    // UDP without options: options are not understood.
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
    let frame_after_l2 = pkt.frame_len() - l3;
    if total_len < IPV4_LEN || total_len > frame_after_l2 {
        return Err(PassReason::BadHeader);
    }
    let src = [h[12], h[13], h[14], h[15]];
    let dst = [h[16], h[17], h[18], h[19]];
    if !is_unicast_v4(src) || !is_unicast_v4(dst) {
        return Err(PassReason::BadHeader);
    }
    let frag = u16::from_be_bytes([h[6], h[7]]);
    Ok(Ip {
        layout: Layout {
            l3,
            l4: l3 + IPV4_LEN,
            v6: false,
        },
        end: l3 + total_len,
        fragment: frag & (IP_MF | IP_OFFSET) != 0,
        first_fragment: frag & IP_OFFSET == 0,
        more_fragments: frag & IP_MF != 0,
        id: u32::from(u16::from_be_bytes([h[4], h[5]])),
        protocol: IPPROTO_UDP,
    })
}

/// IPv6, walking at most `MAX_EXTENSION_HEADERS` hop-by-hop, routing,
/// destination options and fragment headers to UDP. One fragment header
/// is walked: with offset 0 the walk goes on to UDP (a first fragment, or
/// an atomic one); with another offset the rest is data and the packet is
/// a later fragment. A second fragment header, or one past the walk,
/// passes as a fragment; any other next header as not understood.
#[inline(always)]
fn parse_ipv6(pkt: &impl Packet, l3: usize) -> Result<Ip, PassReason> {
    let h: [u8; 8] = read_bytes(pkt, l3).map_err(|_| PassReason::BadHeader)?;
    if h[0] >> 4 != 6 {
        return Err(PassReason::BadHeader);
    }
    let payload_len = usize::from(u16::from_be_bytes([h[4], h[5]]));
    let frame_after_l2 = pkt.frame_len() - l3;
    // Payload length 0 is a jumbogram (a hop-by-hop option): not parsed.
    if payload_len == 0 || IPV6_LEN + payload_len > frame_after_l2 {
        return Err(PassReason::BadHeader);
    }
    let src: [u8; 16] = read_bytes(pkt, l3 + 8).map_err(|_| PassReason::BadHeader)?;
    let dst: [u8; 16] = read_bytes(pkt, l3 + 24).map_err(|_| PassReason::BadHeader)?;
    let mut next = h[6];
    let mut extensions = 0usize;
    let mut walked = 0;
    // (fragment header walked, offset 0, M, identification, next header)
    let mut frag = (false, true, false, 0u32, 0u8);
    while walked < MAX_EXTENSION_HEADERS && next != IPPROTO_UDP {
        match next {
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS => {}
            IPPROTO_FRAGMENT if !frag.0 => {}
            IPPROTO_FRAGMENT => return Err(PassReason::Fragment),
            n if is_extension_header(n) => return Err(PassReason::ExtensionHeader),
            _ => return Err(PassReason::NotIpUdp),
        }
        // Every extension header is at least 8 bytes long.
        let at = l3 + IPV6_LEN + extensions;
        let e: [u8; 4] = read_bytes(pkt, at).map_err(|_| PassReason::ExtensionHeader)?;
        // A routing header with segments left: the header's destination is
        // a waypoint, not the final one the UDP checksum and the member
        // match are about.
        if next == IPPROTO_ROUTING && e[3] != 0 {
            return Err(PassReason::ExtensionHeader);
        }
        let mut len = (usize::from(e[1]) + 1) * 8;
        if next == IPPROTO_FRAGMENT {
            // 8 bytes, the second reserved: offset and M, then the id.
            let id: [u8; 4] = read_bytes(pkt, at + 4).map_err(|_| PassReason::ExtensionHeader)?;
            let field = u16::from_be_bytes([e[2], e[3]]);
            frag = (
                true,
                field & IP6_OFFSET == 0,
                field & IP6_MF != 0,
                u32::from_be_bytes(id),
                e[0],
            );
            len = 8;
        }
        next = e[0];
        extensions += len;
        if extensions > MAX_EXTENSION_SPAN {
            return Err(PassReason::ExtensionHeader);
        }
        walked += 1;
        // A later fragment: what follows is data, not headers.
        if !frag.1 {
            break;
        }
    }
    if frag.1 {
        match next {
            IPPROTO_UDP => {}
            IPPROTO_FRAGMENT => return Err(PassReason::Fragment),
            n if is_extension_header(n) => return Err(PassReason::ExtensionHeader),
            _ => return Err(PassReason::NotIpUdp),
        }
    }
    // Only UDP is checked for unicast: neighbour discovery and MLD to
    // multicast groups are not ours, not bad.
    if !is_unicast_v6(&src) || !is_unicast_v6(&dst) {
        return Err(PassReason::BadHeader);
    }
    if extensions > payload_len {
        return Err(PassReason::BadHeader);
    }
    Ok(Ip {
        layout: Layout {
            l3,
            l4: l3 + IPV6_LEN + extensions,
            v6: true,
        },
        end: l3 + IPV6_LEN + payload_len,
        fragment: frag.0,
        first_fragment: frag.1,
        more_fragments: frag.2,
        id: frag.3,
        protocol: frag.4,
    })
}

/// Writes the layout to per-CPU map memory and reads it back bounded: the
/// verifier does not track map contents, so the paths of both families
/// (and with or without a VLAN tag, and each extension header count)
/// continue as one state into the shared code after the parser instead
/// of each walking it again.
#[inline(always)]
pub fn forget_layout(ip: Ip) -> Option<Ip> {
    let slot = SCRATCH.get_ptr_mut(0)?;
    let l = ip.layout;
    // The fragment fields too: constants on one path would keep its state
    // apart.
    let flags = u64::from(l.v6)
        | u64::from(ip.fragment) << 1
        | u64::from(ip.first_fragment) << 2
        | u64::from(ip.more_fragments) << 3
        | u64::from(ip.protocol) << 8
        | u64::from(ip.id) << 32;
    let offsets = l.l3 as u64 | (l.l4 as u64) << 32;
    // SAFETY: a per-CPU slot of this map, not shared while the program runs.
    let [offsets, flags] = unsafe {
        core::ptr::write_volatile(slot, [offsets, flags]);
        core::ptr::read_volatile(slot)
    };
    Some(Ip {
        layout: Layout {
            // Both below the bound: the masks change nothing but what the
            // verifier knows.
            l3: (offsets as u32) as usize % L4_OFFSET_BOUND,
            l4: (offsets >> 32) as usize % L4_OFFSET_BOUND,
            v6: flags & 1 != 0,
        },
        fragment: flags & 2 != 0,
        first_fragment: flags & 4 != 0,
        more_fragments: flags & 8 != 0,
        protocol: (flags >> 8) as u8,
        id: (flags >> 32) as u32,
        end: ip.end,
    })
}

/// The UDP header of a whole datagram, or of a first fragment when
/// `allow_first_fragment` (when more fragments follow, its UDP length
/// covers the whole datagram).
/// Over IPv6 a zero checksum is invalid: such a datagram passes.
#[inline(always)]
pub fn parse_udp(
    pkt: &impl Packet,
    ip: Ip,
    allow_first_fragment: bool,
) -> Result<Datagram, PassReason> {
    if ip.fragment && !(allow_first_fragment && ip.first_fragment) {
        return Err(PassReason::Fragment);
    }
    let l4 = ip.layout.l4;
    if ip.end < l4 + UDP_LEN {
        return Err(PassReason::BadHeader);
    }
    let udp: [u8; UDP_LEN] = read_bytes(pkt, l4).map_err(|_| PassReason::BadHeader)?;
    let udp_len = usize::from(u16::from_be_bytes([udp[4], udp[5]]));
    let in_packet = ip.end - l4;
    if udp_len < UDP_LEN || (!ip.fragment && udp_len > in_packet) {
        return Err(PassReason::BadHeader);
    }
    if ip.layout.v6 && udp[6] == 0 && udp[7] == 0 {
        return Err(PassReason::ZeroChecksum);
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
