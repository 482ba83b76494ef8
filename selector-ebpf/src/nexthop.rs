//! Sending a redirected request on to its replica. The replica may have
//! another MAC, or sit behind a router.
//!
//! When the agent knows the replica's next hop on this device (`NEXT_HOPS`,
//! kept from the kernel's neighbour table), the Ethernet addresses are
//! written in place and the packet simply continues: no second pass.
//! Otherwise it is handed to `bpf_redirect_neigh` on the same device: the
//! kernel routes the new destination and fills in the Ethernet addresses
//! from its neighbour table, resolving it if needed. (A FIB lookup would
//! need IP forwarding enabled on a client host, which it should not have
//! to.) That packet passes this device's egress hook again, carrying the
//! configured mark bit (`--mark`) in its skb mark, so that pass lets it go
//! untouched and clears the bit, whatever happened to its in-flight entry
//! meanwhile.

use aya_ebpf::{helpers::generated::bpf_redirect_neigh, programs::TcContext};

use crate::{TC_CONTINUE, accounting, maps::NEXT_HOPS};

/// Returns the TC verdict that sends the rewritten packet to backend `chosen`.
#[inline(always)]
pub fn send(ctx: &TcContext, mark_bit: u32, chosen: u32) -> i32 {
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    if let Some(hop) = NEXT_HOPS.get(chosen)
        && hop.ifindex == ifindex
        && ifindex != 0
    {
        let mut addresses = [0u8; 12];
        addresses[..6].copy_from_slice(&hop.dst);
        addresses[6..].copy_from_slice(&hop.src);
        if ctx.store(0, &addresses, 0).is_ok() {
            accounting::count(chosen, |s| &mut s.redirected_direct);
            return TC_CONTINUE;
        }
    }
    redirect(ctx, mark_bit)
}

/// Hands the packet to the neighbour subsystem, marked for its second pass.
#[inline(always)]
fn redirect(ctx: &TcContext, mark_bit: u32) -> i32 {
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(mark | mark_bit);
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}
