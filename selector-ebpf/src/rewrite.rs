//! Address rewrites with checksum fixes. TC uses the kernel's checksum
//! helpers (which also handle CHECKSUM_PARTIAL skbs); XDP has no skb
//! checksum state, so it writes full checksums from the shared pure
//! arithmetic in `selector_common::checksum`.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    programs::{TcContext, XdpContext},
};
use selector_common::checksum;

use crate::packet::{Layout, ptr_at, read_bytes};

#[derive(Clone, Copy)]
pub enum Side {
    Source,
    Destination,
}

impl Side {
    /// (address offset, port offset).
    #[inline(always)]
    fn offsets(self, l: Layout) -> (usize, usize) {
        match self {
            Side::Source => (l.ip_src(), l.udp()),
            Side::Destination => (l.ip_dst(), l.udp() + 2),
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
    fn rewrite(&self, l: Layout, side: Side, new: Target) -> Result<(), ()>;
    /// Replaces the source address of a later IP fragment (no UDP header;
    /// the UDP checksum, in the first fragment, already covers the change).
    fn rewrite_fragment_source(&self, l: Layout, addr: [u8; 4]) -> Result<(), ()>;
}

impl Rewrite for TcContext {
    #[inline(always)]
    fn rewrite(&self, l: Layout, side: Side, new: Target) -> Result<(), ()> {
        let (addr_off, port_off) = side.offsets(l);
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
        self.l3_csum_replace(l.ip_check(), from_a, to_a, 4)
            .map_err(|_| ())?;
        self.l4_csum_replace(
            l.udp_check(),
            from_a,
            to_a,
            l4_flags | u64::from(BPF_F_PSEUDO_HDR) | 4,
        )
        .map_err(|_| ())?;
        self.store(port_off, &new_port, 0).map_err(|_| ())?;
        self.l4_csum_replace(l.udp_check(), from_p, to_p, l4_flags | 2)
            .map_err(|_| ())
    }

    #[inline(always)]
    fn rewrite_fragment_source(&self, l: Layout, addr: [u8; 4]) -> Result<(), ()> {
        let old: [u8; 4] = read_bytes(self, l.ip_src())?;
        self.store(l.ip_src(), &addr, 0).map_err(|_| ())?;
        self.l3_csum_replace(
            l.ip_check(),
            u32::from_ne_bytes(old) as u64,
            u32::from_ne_bytes(addr) as u64,
            4,
        )
        .map_err(|_| ())
    }
}

impl Rewrite for XdpContext {
    #[inline(always)]
    fn rewrite(&self, l: Layout, side: Side, new: Target) -> Result<(), ()> {
        let (addr_off, port_off) = side.offsets(l);
        let addr: *mut [u8; 4] = ptr_at(self, addr_off)?;
        let port: *mut [u8; 2] = ptr_at(self, port_off)?;
        let ip_check: *mut [u8; 2] = ptr_at(self, l.ip_check())?;
        let udp_check: *mut [u8; 2] = ptr_at(self, l.udp_check())?;
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

    #[inline(always)]
    fn rewrite_fragment_source(&self, l: Layout, new: [u8; 4]) -> Result<(), ()> {
        let addr: *mut [u8; 4] = ptr_at(self, l.ip_src())?;
        let ip_check: *mut [u8; 2] = ptr_at(self, l.ip_check())?;
        unsafe {
            let old_a = u32::from_be_bytes(*addr);
            let c = checksum::replace_u32(
                u16::from_be_bytes(*ip_check),
                old_a,
                u32::from_be_bytes(new),
            );
            *addr = new;
            *ip_check = c.to_be_bytes();
        }
        Ok(())
    }
}
