//! Next hop for a redirected request. The replica may have another MAC (or
//! sit behind a router), so after the rewrite the packet is handed to
//! `bpf_redirect_neigh` on the same device: the kernel routes the new
//! destination and fills in the Ethernet addresses from its neighbour
//! table, resolving it if needed. (A FIB lookup would need IP forwarding
//! enabled on a client host, which it should not have to.)
//!
//! The redirected packet passes this device's egress hook again. It carries
//! the configured mark bit (`--mark`) in its skb mark, so that pass lets it go untouched and
//! clears the bit, whatever happened to its in-flight entry meanwhile.

use aya_ebpf::{helpers::generated::bpf_redirect_neigh, programs::TcContext};

/// Returns the TC verdict that sends the rewritten packet out again.
#[inline(always)]
pub fn redirect(ctx: &TcContext, mark_bit: u32) -> i32 {
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(mark | mark_bit);
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    unsafe { bpf_redirect_neigh(ifindex, core::ptr::null_mut(), 0, 0) as i32 }
}
