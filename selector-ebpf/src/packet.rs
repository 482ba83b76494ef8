//! Packet access: one bounds-checked accessor and the IPv4/UDP parser.
//! Anything that is not plain Ethernet + IPv4 without options + UDP, or is a
//! fragment, is reported as not understood so the caller passes it untouched.

use aya_ebpf::programs::{TcContext, XdpContext};
use core::mem::size_of;
use network_types::{eth::EthHdr, ip::Ipv4Hdr, udp::UdpHdr};
use selector_common::descriptor::MAX_DESCRIPTOR_SPAN;

pub const ETH_LEN: usize = EthHdr::LEN;
pub const IP_OFF: usize = ETH_LEN;
pub const IP_CHECK_OFF: usize = IP_OFF + 10;
pub const IP_SRC_OFF: usize = IP_OFF + 12;
pub const IP_DST_OFF: usize = IP_OFF + 16;
pub const UDP_OFF: usize = IP_OFF + Ipv4Hdr::LEN;
pub const UDP_SRC_OFF: usize = UDP_OFF;
pub const UDP_DST_OFF: usize = UDP_OFF + 2;
pub const UDP_CHECK_OFF: usize = UDP_OFF + 6;
pub const PAYLOAD_OFF: usize = UDP_OFF + UdpHdr::LEN;
/// Bytes the parser and descriptors may need in the linear part.
pub const PARSE_SPAN: usize = PAYLOAD_OFF + MAX_DESCRIPTOR_SPAN as usize;

const ETH_P_IPV4: u16 = 0x0800;
const IPPROTO_UDP: u8 = 17;

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
    let start = pkt.data();
    let end = pkt.data_end();
    if start + offset + size_of::<T>() > end {
        return Err(());
    }
    Ok((start + offset) as *mut T)
}

/// Copies `N` bytes at `offset`.
#[inline(always)]
pub fn read_bytes<const N: usize>(pkt: &impl Packet, offset: usize) -> Result<[u8; N], ()> {
    let p: *const [u8; N] = ptr_at(pkt, offset)?;
    Ok(unsafe { p.read_unaligned() })
}

/// An IPv4 UDP datagram's addressing, as found in the packet.
#[derive(Clone, Copy)]
pub struct Datagram {
    pub src_addr: [u8; 4],
    pub dst_addr: [u8; 4],
    /// Host order.
    pub src_port: u16,
    pub dst_port: u16,
    /// UDP payload length per the UDP header, clamped to what the IP header allows.
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
        let p: *const u8 = ptr_at(pkt, PAYLOAD_OFF + i).ok()?;
        Some(unsafe { *p })
    }
}

/// Parses Ethernet / IPv4 (no options, not fragmented) / UDP.
#[inline(always)]
pub fn parse_ipv4_udp(pkt: &impl Packet) -> Result<Datagram, ()> {
    let eth: *const EthHdr = ptr_at(pkt, 0)?;
    if u16::from_be(unsafe { (*eth).ether_type }) != ETH_P_IPV4 {
        return Err(());
    }
    let ip: *const Ipv4Hdr = ptr_at(pkt, IP_OFF)?;
    let ip = unsafe { &*ip };
    // Version 4, 20-byte header: options are not understood.
    if ip.vihl != 0x45 || ip.proto != IPPROTO_UDP {
        return Err(());
    }
    // More-fragments or a fragment offset: only the first fragment has the
    // UDP header and the response could not be matched; leave them alone.
    if u16::from_be_bytes(ip.frags) & 0x3fff != 0 {
        return Err(());
    }
    let ip_total = u16::from_be_bytes(ip.tot_len) as usize;
    let src_addr = ip.src_addr;
    let dst_addr = ip.dst_addr;
    let udp: *const UdpHdr = ptr_at(pkt, UDP_OFF)?;
    let udp = unsafe { &*udp };
    let udp_len = u16::from_be_bytes(udp.len) as usize;
    if udp_len < UdpHdr::LEN || udp_len + Ipv4Hdr::LEN > ip_total {
        return Err(());
    }
    Ok(Datagram {
        src_addr,
        dst_addr,
        src_port: u16::from_be_bytes(udp.src),
        dst_port: u16::from_be_bytes(udp.dst),
        payload_len: udp_len - UdpHdr::LEN,
    })
}
