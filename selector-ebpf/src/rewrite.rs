//! Address rewrites with checksum fixes. TC uses the kernel's checksum
//! helpers (which also handle CHECKSUM_PARTIAL skbs); XDP has no skb
//! checksum state, so it writes full checksums from the shared pure
//! arithmetic in `selector_common::checksum`.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::{TcContext, XdpContext},
};
use selector_common::checksum;

use crate::packet::{
    IP_CHECK_OFF, IP_DST_OFF, IP_SRC_OFF, UDP_CHECK_OFF, UDP_DST_OFF, UDP_SRC_OFF, ptr_at,
    read_bytes,
};

#[derive(Clone, Copy)]
pub enum Side {
    Source,
    Destination,
}

impl Side {
    #[inline(always)]
    fn offsets(self) -> (usize, usize) {
        match self {
            Side::Source => (IP_SRC_OFF, UDP_SRC_OFF),
            Side::Destination => (IP_DST_OFF, UDP_DST_OFF),
        }
    }
}

/// An IPv4 address and host-order port to write.
#[derive(Clone, Copy)]
pub struct Target {
    pub addr: [u8; 4],
    pub port: u16,
}

pub trait Rewrite {
    /// Replaces one side's address and port, keeping IP and UDP checksums right.
    fn rewrite(&self, side: Side, new: Target) -> Result<(), ()>;
}

impl Rewrite for TcContext {
    #[inline(always)]
    fn rewrite(&self, side: Side, new: Target) -> Result<(), ()> {
        let (addr_off, port_off) = side.offsets();
        let old_addr: [u8; 4] = read_bytes(self, addr_off)?;
        let old_port: [u8; 2] = read_bytes(self, port_off)?;
        let new_port = new.port.to_be_bytes();
        // The helpers take the raw (network-order) bytes as integers.
        let (from_a, to_a) = (
            u32::from_ne_bytes(old_addr) as u64,
            u32::from_ne_bytes(new.addr) as u64,
        );
        let (from_p, to_p) = (
            u16::from_ne_bytes(old_port) as u64,
            u16::from_ne_bytes(new_port) as u64,
        );
        let l4_flags = u64::from(BPF_F_MARK_MANGLED_0);
        self.store(addr_off, &new.addr, 0).map_err(|_| ())?;
        self.l3_csum_replace(IP_CHECK_OFF, from_a, to_a, 4)
            .map_err(|_| ())?;
        self.l4_csum_replace(
            UDP_CHECK_OFF,
            from_a,
            to_a,
            l4_flags | u64::from(BPF_F_PSEUDO_HDR) | 4,
        )
        .map_err(|_| ())?;
        self.store(port_off, &new_port, 0).map_err(|_| ())?;
        self.l4_csum_replace(UDP_CHECK_OFF, from_p, to_p, l4_flags | 2)
            .map_err(|_| ())
    }
}

impl Rewrite for XdpContext {
    #[inline(always)]
    fn rewrite(&self, side: Side, new: Target) -> Result<(), ()> {
        let (addr_off, port_off) = side.offsets();
        let addr: *mut [u8; 4] = ptr_at(self, addr_off)?;
        let port: *mut [u8; 2] = ptr_at(self, port_off)?;
        let ip_check: *mut [u8; 2] = ptr_at(self, IP_CHECK_OFF)?;
        let udp_check: *mut [u8; 2] = ptr_at(self, UDP_CHECK_OFF)?;
        unsafe {
            let old_a = u32::from_be_bytes(*addr);
            let new_a = u32::from_be_bytes(new.addr);
            let old_p = u16::from_be_bytes(*port);
            let ip_c = checksum::replace_u32(u16::from_be_bytes(*ip_check), old_a, new_a);
            let mut udp_c = u16::from_be_bytes(*udp_check);
            udp_c = checksum::udp_replace_u32(udp_c, old_a, new_a);
            udp_c = checksum::udp_replace_u16(udp_c, old_p, new.port);
            *addr = new.addr;
            *port = new.port.to_be_bytes();
            *ip_check = ip_c.to_be_bytes();
            *udp_check = udp_c.to_be_bytes();
        }
        Ok(())
    }
}
