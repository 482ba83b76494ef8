//! The selector's kernel programs. Entry points are thin: each calls a
//! `try_*` function and passes the packet untouched on any error.
#![no_std]
#![no_main]
#![feature(core_intrinsics)]
#![allow(internal_features)]

mod accounting;
mod egress;
mod health;
mod hedge;
mod inflight;
mod ingress;
mod maps;
mod nexthop;
mod packet;
mod reference;
mod reject;
mod rewrite;

use aya_ebpf::{
    bindings::{TC_ACT_PIPE, TC_ACT_SHOT, xdp_action},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

/// TC verdict for "carry on": the packet continues, rewritten or not.
pub const TC_CONTINUE: i32 = TC_ACT_PIPE;
/// TC verdict for a read dropped under `--on-overload drop`.
pub const TC_DROP: i32 = TC_ACT_SHOT;

#[classifier]
pub fn selector_egress(ctx: TcContext) -> i32 {
    egress::try_egress(&ctx).unwrap_or(TC_CONTINUE)
}

#[xdp]
pub fn selector_ingress(ctx: XdpContext) -> u32 {
    match ingress::try_ingress(&ctx) {
        Ok(ingress::Verdict::Drop) => xdp_action::XDP_DROP,
        _ => xdp_action::XDP_PASS,
    }
}

#[classifier]
pub fn selector_ingress_tc(ctx: TcContext) -> i32 {
    // A reject reply the egress program turned back to ingress: ours, not a
    // backend's; clear the bit and let it through.
    if let Some(config) = maps::config() {
        let mark = unsafe { (*ctx.skb.skb).mark };
        if mark & config.mark != 0 {
            ctx.set_mark(mark & !config.mark);
            return TC_CONTINUE;
        }
    }
    // Classified from the linear part: only a member's reply is pulled.
    packet::pull_short_headers(&ctx, selector_common::Direction::Ingress);
    match ingress::try_ingress(&ctx) {
        Ok(ingress::Verdict::Drop) => TC_DROP,
        _ => TC_CONTINUE,
    }
}

/// Does nothing: the baseline that per-packet costs are measured against.
#[classifier]
pub fn selector_baseline_tc(_ctx: TcContext) -> i32 {
    TC_CONTINUE
}

/// Does nothing: the XDP baseline for per-packet costs.
#[xdp]
pub fn selector_baseline_xdp(_ctx: XdpContext) -> u32 {
    xdp_action::XDP_PASS
}

/// The per-packet cost benchmark's reference request path (`reference`).
#[classifier]
pub fn selector_reference_request(ctx: TcContext) -> i32 {
    reference::request(&ctx);
    TC_CONTINUE
}

/// The per-packet cost benchmark's reference reply path (`reference`).
#[xdp]
pub fn selector_reference_reply(ctx: XdpContext) -> u32 {
    reference::reply(&ctx);
    xdp_action::XDP_PASS
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
