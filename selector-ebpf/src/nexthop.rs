//! Next hop for a redirected request: a FIB lookup for the new destination
//! from the egress device. A replica reached through another device, or
//! whose neighbour is not resolved yet, is not a target (the agent resolves
//! every backend's neighbour at start).

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_FIB_LKUP_RET_SUCCESS, BPF_FIB_LOOKUP_OUTPUT, bpf_fib_lookup},
    helpers::generated::bpf_fib_lookup as fib_lookup,
    programs::TcContext,
};

use crate::packet::Datagram;

const AF_INET: u8 = 2;
const IPPROTO_UDP: u8 = 17;

pub struct NextHop {
    pub src_mac: [u8; 6],
    pub dst_mac: [u8; 6],
}

/// The MACs to use for `dst_addr`, if it leaves by this same device.
#[inline(always)]
pub fn lookup(
    ctx: &TcContext,
    dgram: &Datagram,
    dst_addr: [u8; 4],
    dst_port: u16,
) -> Option<NextHop> {
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let mut params: bpf_fib_lookup = unsafe { core::mem::zeroed() };
    params.family = AF_INET;
    params.l4_protocol = IPPROTO_UDP;
    params.sport = dgram.src_port.to_be();
    params.dport = dst_port.to_be();
    params.__bindgen_anon_1.tot_len = ((dgram.payload_len + 28) as u16).to_be();
    params.__bindgen_anon_3.ipv4_src = u32::from_ne_bytes(dgram.src_addr);
    params.__bindgen_anon_4.ipv4_dst = u32::from_ne_bytes(dst_addr);
    params.ifindex = ifindex;
    let rc = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            &mut params,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            BPF_FIB_LOOKUP_OUTPUT,
        )
    };
    if rc != BPF_FIB_LKUP_RET_SUCCESS as i64 || params.ifindex != ifindex {
        return None;
    }
    Some(NextHop {
        src_mac: params.smac,
        dst_mac: params.dmac,
    })
}
