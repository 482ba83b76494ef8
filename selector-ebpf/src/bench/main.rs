//! The per-packet cost benchmark's programs, an object of their own
//! (`selector-bench`) so that the agent's object holds only what it
//! attaches: two empty programs, the baselines costs are measured against,
//! and the reference request and reply paths (`reference`). The per-packet
//! cost runs them with BPF_PROG_TEST_RUN; the closed-loop throughput
//! attaches the empty ones, and the reference request with the reply's TC
//! variant, as floors.
#![no_std]
#![no_main]

mod reference;

use aya_ebpf::{
    bindings::{TC_ACT_PIPE, xdp_action},
    macros::{classifier, xdp},
    programs::{TcContext, XdpContext},
};

/// Does nothing: the baseline that per-packet costs are measured against.
#[classifier]
pub fn selector_baseline_tc(_ctx: TcContext) -> i32 {
    TC_ACT_PIPE
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
    TC_ACT_PIPE
}

/// The per-packet cost benchmark's reference reply path (`reference`).
#[xdp]
pub fn selector_reference_reply(ctx: XdpContext) -> u32 {
    reference::reply(&ctx);
    xdp_action::XDP_PASS
}

/// The reference reply path on TC ingress: attached with the reference
/// request by the closed-loop benchmark, the least a request tracker costs
/// on the hooks the agent uses by default.
#[classifier]
pub fn selector_reference_reply_tc(ctx: TcContext) -> i32 {
    reference::reply(&ctx);
    TC_ACT_PIPE
}
