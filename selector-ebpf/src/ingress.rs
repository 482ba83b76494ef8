//! Response path (XDP, or TC ingress): complete the in-flight request and
//! make a redirected reply look like it came from the primary.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use selector_common::{Endpoint, InflightKey, split_backend_id};

use crate::{
    accounting,
    maps::{BACKENDS, CONFIG, INFLIGHT, backend_target},
    packet::{self, Packet},
    rewrite::{Rewrite, Side},
};

pub fn try_ingress<C: Packet + Rewrite>(ctx: &C) -> Result<(), ()> {
    let dgram = packet::parse_ipv4_udp(ctx)?;
    let src = Endpoint::ipv4(dgram.src_addr, dgram.src_port);
    let backend = *unsafe { BACKENDS.get(src) }.ok_or(())?;
    let (group, _) = split_backend_id(backend);
    let config = CONFIG.get(0).ok_or(())?;
    let request_id = config
        .descriptor
        .request_id(|i| dgram.payload_byte(ctx, i))
        .ok_or(())?;
    // The reply is addressed to the client that asked.
    let key = InflightKey::ipv4(dgram.dst_addr, dgram.dst_port, group, request_id);
    let Some(entry) = (unsafe { INFLIGHT.get(key) }).copied() else {
        accounting::count(backend, |s| &mut s.unmatched_responses);
        return Ok(());
    };
    // Only the backend the request went to can complete it.
    if entry.chosen != backend {
        accounting::count(backend, |s| &mut s.unmatched_responses);
        return Ok(());
    }
    // The response path and the agent's expiry sweep race to delete; only
    // the side whose delete succeeds subtracts.
    if INFLIGHT.remove(key).is_ok() {
        accounting::add_completed(backend);
        accounting::count(backend, |s| &mut s.responses);
        let now = unsafe { bpf_ktime_get_ns() };
        accounting::record_latency(backend, now.saturating_sub(entry.sent_ns));
    } else {
        accounting::count(backend, |s| &mut s.unmatched_responses);
    }
    if entry.primary != backend {
        // Even if the sweep won, the application may still be waiting.
        ctx.rewrite(Side::Source, backend_target(entry.primary).ok_or(())?)?;
    }
    Ok(())
}
