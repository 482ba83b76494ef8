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
mod prologue;
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
    if prologue::plainly_not_udp::<prologue::Reply>(&ctx) {
        return xdp_action::XDP_PASS;
    }
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
    if prologue::plainly_not_udp::<prologue::Reply>(&ctx) {
        return TC_CONTINUE;
    }
    // Classified from the linear part: only a member's reply is pulled.
    packet::pull_short_headers(&ctx, selector_common::Direction::Ingress);
    match ingress::try_ingress(&ctx) {
        Ok(ingress::Verdict::Drop) => TC_DROP,
        _ => TC_CONTINUE,
    }
}
