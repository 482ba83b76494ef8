//! The one bounds-checked packet accessor: every read of or write to a
//! frame goes through `ptr_at`. Shared by the agent's object and the
//! benchmark's.

use aya_ebpf::programs::{TcContext, XdpContext};
use core::mem::size_of;

use selector_common::opaque::opaque_usize;

pub const ETH_LEN: usize = 14;
pub const IPV4_LEN: usize = 20;
pub const IPV6_LEN: usize = 40;
pub const UDP_LEN: usize = 8;

/// A frame whose directly readable bytes live between `data` and
/// `data_end`; on TC that is only the skb's linear part, and the rest of
/// the frame may be in page fragments.
pub trait Packet {
    fn data(&self) -> usize;
    fn data_end(&self) -> usize;
    /// The whole frame's length: what IP and UDP lengths are bounded by.
    fn frame_len(&self) -> usize;
    /// Makes the frame's first `len` bytes (at most `frame_len`) directly
    /// readable; false if it could not.
    fn pull(&self, len: usize) -> bool;

    /// The bytes directly readable.
    #[inline(always)]
    fn readable_len(&self) -> usize {
        self.data_end() - self.data()
    }
}

/// The `__sk_buff` behind `ctx`, opaque to the compiler: each field read
/// then takes its own `ctx + offset` load. Left alone, LLVM may keep
/// `ctx + 80` (`data_end`) in a register across calls, and the verifier
/// refuses any access through a modified context pointer.
#[inline(always)]
pub fn skb(ctx: &TcContext) -> *const aya_ebpf::bindings::__sk_buff {
    opaque_usize(ctx.skb.skb as usize) as *const aya_ebpf::bindings::__sk_buff
}

impl Packet for TcContext {
    #[inline(always)]
    fn data(&self) -> usize {
        unsafe { (*skb(self)).data as usize }
    }
    #[inline(always)]
    fn data_end(&self) -> usize {
        unsafe { (*skb(self)).data_end as usize }
    }
    #[inline(always)]
    fn frame_len(&self) -> usize {
        self.len() as usize
    }
    /// `bpf_skb_pull_data`: the head copied first if it is shared (a clone
    /// TCP keeps for retransmission), then the bytes moved out of the page
    /// fragments.
    #[inline(always)]
    fn pull(&self, len: usize) -> bool {
        self.pull_data(len as u32).is_ok()
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
    /// Programs loaded without XDP frags support only ever see a frame
    /// whole (generic XDP linearizes the skb first).
    #[inline(always)]
    fn frame_len(&self) -> usize {
        XdpContext::data_end(self) - XdpContext::data(self)
    }
    /// The whole frame is readable already.
    #[inline(always)]
    fn pull(&self, _len: usize) -> bool {
        false
    }
}

/// The one bounds-checked packet accessor.
#[inline(always)]
pub fn ptr_at<T>(pkt: &impl Packet, offset: usize) -> Result<*mut T, ()> {
    // The verifier learns a range only from comparing a pointer that
    // carries the access size as its constant part. Left alone, the
    // compiler may fold `at + 1 > end` into `at >= end`, which proves
    // nothing at a variable offset; opaque values keep the form.
    let at = opaque_usize(pkt.data() + offset);
    let last = opaque_usize(at + size_of::<T>());
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
