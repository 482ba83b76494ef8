//! Address rewrites with checksum fixes. TC uses the kernel's checksum
//! helpers (which also handle CHECKSUM_PARTIAL skbs); XDP has no skb
//! checksum state, so it writes full checksums from the shared pure
//! arithmetic in `selector_common::checksum`. IPv6 has no header checksum;
//! its UDP checksum takes one diff for the 16-byte address and port, and
//! never comes out zero.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM},
    helpers::generated::bpf_csum_update,
    programs::{TcContext, XdpContext},
};
use selector_common::checksum;

use crate::packet::{Layout, ptr_at, read_bytes};

/// `l4_csum_replace` flag for IPv6: do not adjust a CHECKSUM_COMPLETE
/// skb's sum for a pseudo-header change (IPv6 has no header checksum to
/// cancel it). Kernels before 6.16 refuse it; the rewrite then retries
/// without.
const BPF_F_IPV6: u64 = 1 << 7;

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

/// An address (IPv6, or IPv4-mapped) and host-order port to write.
#[derive(Clone, Copy)]
pub struct Target {
    pub addr: [u8; 16],
    pub port: u16,
}

impl Target {
    #[inline(always)]
    pub fn v4(&self) -> [u8; 4] {
        [self.addr[12], self.addr[13], self.addr[14], self.addr[15]]
    }
}

pub trait Rewrite {
    /// Replaces one side's address and port, keeping IP and UDP checksums right.
    fn rewrite(&self, l: Layout, side: Side, new: Target) -> Result<(), ()>;
    /// Replaces the source address (IPv6, or IPv4-mapped) of a later
    /// fragment: no UDP header, and the UDP checksum, in the first
    /// fragment, already covers the change. IPv4 fixes its header checksum.
    fn rewrite_fragment_source(&self, l: Layout, addr: [u8; 16]) -> Result<(), ()>;
}

impl Rewrite for TcContext {
    #[inline(always)]
    fn rewrite(&self, l: Layout, side: Side, new: Target) -> Result<(), ()> {
        if l.v6 {
            return tc_rewrite_v6(self, l, side, new);
        }
        let (addr_off, port_off) = side.offsets(l);
        let new_addr = new.v4();
        let old_addr: [u8; 4] = read_bytes(self, addr_off)?;
        let old_port: [u8; 2] = read_bytes(self, port_off)?;
        let new_port = new.port.to_be_bytes();
        // The helpers take the raw (network-order) bytes as integers.
        let (from_a, to_a) = (
            u32::from_ne_bytes(old_addr) as u64,
            u32::from_ne_bytes(new_addr) as u64,
        );
        let (from_p, to_p) = (
            u16::from_ne_bytes(old_port) as u64,
            u16::from_ne_bytes(new_port) as u64,
        );
        let l4_flags = u64::from(BPF_F_MARK_MANGLED_0);
        self.store(addr_off, &new_addr, 0).map_err(|_| ())?;
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

    /// IPv6: the store also updates a CHECKSUM_COMPLETE skb's sum, which
    /// no checksum field in this fragment compensates (the receiver sums
    /// the fragments' data into the reassembled datagram's).
    #[inline(always)]
    fn rewrite_fragment_source(&self, l: Layout, addr: [u8; 16]) -> Result<(), ()> {
        if l.v6 {
            return self
                .store(l.ip_src(), &addr, u64::from(BPF_F_RECOMPUTE_CSUM))
                .map_err(|_| ());
        }
        let addr = [addr[12], addr[13], addr[14], addr[15]];
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

/// The address is a pseudo-header field and the port is payload, so they
/// take separate helper calls, as over IPv4: on a CHECKSUM_PARTIAL skb the
/// checksum field holds only the pseudo-header sum (the payload, ports
/// included, is summed after this program), so the port's change must stay
/// out of it. The address goes in as one diff (the helper's size-0 form);
/// BPF_F_MARK_MANGLED_0 turns a zero result into 0xffff.
#[inline(always)]
fn tc_rewrite_v6(ctx: &TcContext, l: Layout, side: Side, new: Target) -> Result<(), ()> {
    let (addr_off, port_off) = side.offsets(l);
    let mut diff = 0;
    // Four bytes at a time: whole 16-byte copies would not fit the egress
    // program's stack.
    let mut i = 0;
    while i < 16 {
        let old: [u8; 4] = read_bytes(ctx, addr_off + i)?;
        let word = [
            new.addr[i],
            new.addr[i + 1],
            new.addr[i + 2],
            new.addr[i + 3],
        ];
        diff = checksum::add_diffs(diff, checksum::diff(&old, &word));
        ctx.store(addr_off + i, &word, 0).map_err(|_| ())?;
        i += 4;
    }
    // The helper adds the diff to the raw (network-order) field.
    let diff = u64::from(u16::from_ne_bytes(diff.to_be_bytes()));
    let mangled = u64::from(BPF_F_MARK_MANGLED_0);
    let flags = mangled | u64::from(BPF_F_PSEUDO_HDR);
    if ctx
        .l4_csum_replace(l.udp_check(), 0, diff, flags | BPF_F_IPV6)
        .is_err()
    {
        ctx.l4_csum_replace(l.udp_check(), 0, diff, flags)
            .map_err(|_| ())?;
        // That helper also took `diff` off a CHECKSUM_COMPLETE skb's sum,
        // as IPv4 needs; over IPv6 the address and the checksum field
        // cancel, so it goes back (a no-op on other skbs).
        unsafe { bpf_csum_update(ctx.skb.skb, diff as u32) };
    }
    let old_port: [u8; 2] = read_bytes(ctx, port_off)?;
    let new_port = new.port.to_be_bytes();
    ctx.store(port_off, &new_port, 0).map_err(|_| ())?;
    ctx.l4_csum_replace(
        l.udp_check(),
        u64::from(u16::from_ne_bytes(old_port)),
        u64::from(u16::from_ne_bytes(new_port)),
        mangled | 2,
    )
    .map_err(|_| ())
}

impl Rewrite for XdpContext {
    #[inline(always)]
    fn rewrite(&self, l: Layout, side: Side, new: Target) -> Result<(), ()> {
        if l.v6 {
            return xdp_rewrite_v6(self, l, side, new);
        }
        let (addr_off, port_off) = side.offsets(l);
        let addr: *mut [u8; 4] = ptr_at(self, addr_off)?;
        let port: *mut [u8; 2] = ptr_at(self, port_off)?;
        let ip_check: *mut [u8; 2] = ptr_at(self, l.ip_check())?;
        let udp_check: *mut [u8; 2] = ptr_at(self, l.udp_check())?;
        let new_addr = new.v4();
        unsafe {
            let old_a = u32::from_be_bytes(*addr);
            let new_a = u32::from_be_bytes(new_addr);
            let old_p = u16::from_be_bytes(*port);
            let ip_c = checksum::replace_u32(u16::from_be_bytes(*ip_check), old_a, new_a);
            let mut udp_c = u16::from_be_bytes(*udp_check);
            udp_c = checksum::udp_replace_u32(udp_c, old_a, new_a);
            udp_c = checksum::udp_replace_u16(udp_c, old_p, new.port);
            *addr = new_addr;
            *port = new.port.to_be_bytes();
            *ip_check = ip_c.to_be_bytes();
            *udp_check = udp_c.to_be_bytes();
        }
        Ok(())
    }

    #[inline(always)]
    fn rewrite_fragment_source(&self, l: Layout, new: [u8; 16]) -> Result<(), ()> {
        if l.v6 {
            let addr: *mut [u8; 16] = ptr_at(self, l.ip_src())?;
            unsafe { *addr = new };
            return Ok(());
        }
        let new = [new[12], new[13], new[14], new[15]];
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

#[inline(always)]
fn xdp_rewrite_v6(ctx: &XdpContext, l: Layout, side: Side, new: Target) -> Result<(), ()> {
    let (addr_off, port_off) = side.offsets(l);
    let addr: *mut [u8; 16] = ptr_at(ctx, addr_off)?;
    let port: *mut [u8; 2] = ptr_at(ctx, port_off)?;
    let udp_check: *mut [u8; 2] = ptr_at(ctx, l.udp_check())?;
    let new_port = new.port.to_be_bytes();
    unsafe {
        let diff = checksum::add_diffs(
            checksum::diff(&*addr, &new.addr),
            checksum::diff(&*port, &new_port),
        );
        let c = checksum::udp6_apply_diff(u16::from_be_bytes(*udp_check), diff);
        *addr = new.addr;
        *port = new_port;
        *udp_check = c.to_be_bytes();
    }
    Ok(())
}
