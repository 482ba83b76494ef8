//! Request path (TC egress): count, choose a replica, steer.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns, programs::TcContext};
use aya_log_ebpf::debug;
use selector_common::{
    Config, Endpoint, InflightEntry, InflightKey, MARK_REDIRECTED, Policy, backend_id, policy,
    split_backend_id,
};

use crate::{
    TC_CONTINUE, accounting,
    maps::{BACKENDS, CONFIG, INFLIGHT, backend_target},
    nexthop,
    packet::{self, PARSE_SPAN},
    rewrite::{Rewrite, Side},
};

/// Returns the TC verdict: continue, or redirect after a rewrite.
pub fn try_egress(ctx: &TcContext) -> Result<i32, ()> {
    // Our own redirected copy, crossing egress a second time: already
    // counted and steered. Clear the bit so the mark leaves as it came.
    let mark = unsafe { (*ctx.skb.skb).mark };
    if mark & MARK_REDIRECTED != 0 {
        ctx.set_mark(mark & !MARK_REDIRECTED);
        return Ok(TC_CONTINUE);
    }
    // Make the headers and descriptor span readable if the skb is paged.
    let linear = ctx.data_end() - ctx.data();
    if linear < PARSE_SPAN && (ctx.len() as usize) > linear {
        let want = if (ctx.len() as usize) < PARSE_SPAN {
            ctx.len()
        } else {
            PARSE_SPAN as u32
        };
        ctx.pull_data(want).map_err(|_| ())?;
    }
    let dgram = packet::parse_ipv4_udp(ctx)?;
    let dst = Endpoint::ipv4(dgram.dst_addr, dgram.dst_port);
    let primary = *unsafe { BACKENDS.get(dst) }.ok_or(())?;
    let (group, primary_pos) = split_backend_id(primary);
    let config = *CONFIG.get(0).ok_or(())?;

    let Some(request_id) = config.descriptor.request_id(|i| dgram.payload_byte(ctx, i)) else {
        accounting::count(primary, |s| &mut s.no_request_id);
        return Ok(TC_CONTINUE);
    };
    let key = InflightKey::ipv4(dgram.src_addr, dgram.src_port, group, request_id);

    let mut chosen = primary;
    if config.descriptor.is_read(|i| dgram.payload_byte(ctx, i)) {
        chosen = backend_id(group, choose_position(&config, group, primary_pos));
    }
    let entry = InflightEntry {
        primary,
        chosen,
        sent_ns: unsafe { bpf_ktime_get_ns() },
    };
    // Insert first: a new request (the common case) costs one hash
    // operation; only a key already in flight needs a lookup.
    let inserted = INFLIGHT.insert(key, entry, u64::from(BPF_NOEXIST));
    if inserted == Err(EEXIST) {
        return in_flight_already(ctx, &key, primary);
    }
    accounting::count(primary, |s| &mut s.requests);
    if inserted.is_err() {
        // Table full: never block traffic.
        accounting::count(primary, |s| &mut s.untracked);
        debug!(
            ctx,
            "in-flight table full: request to backend {} untracked", primary
        );
        return Ok(TC_CONTINUE);
    }
    accounting::add_issued(chosen);
    if chosen == primary {
        return Ok(TC_CONTINUE);
    }
    accounting::count(primary, |s| &mut s.redirected_away);
    accounting::count(chosen, |s| &mut s.redirected_to);
    steer(ctx, chosen)
}

/// The map insert's error for a key that is already there.
const EEXIST: i32 = -17;

/// A request whose key is already in flight.
#[inline(always)]
fn in_flight_already(ctx: &TcContext, key: &InflightKey, primary: u32) -> Result<i32, ()> {
    // Completed in the meantime: nothing to follow.
    let Some(first) = (unsafe { INFLIGHT.get(key) }).copied() else {
        return Ok(TC_CONTINUE);
    };
    if first.primary != primary {
        // The same id sent to another member while the first request is in
        // flight: the application's own failover. Leave it alone.
        accounting::count(primary, |s| &mut s.id_collisions);
        return Ok(TC_CONTINUE);
    }
    // A retransmit follows the first copy and is not counted again.
    if first.chosen != primary {
        return steer(ctx, first.chosen);
    }
    Ok(TC_CONTINUE)
}

/// Rewrites the destination to backend `chosen` and sends the packet on
/// through the neighbour subsystem.
#[inline(always)]
fn steer(ctx: &TcContext, chosen: u32) -> Result<i32, ()> {
    ctx.rewrite(Side::Destination, backend_target(chosen).ok_or(())?)?;
    Ok(nexthop::redirect(ctx))
}

/// Applies the configured policy to the primary's group.
#[inline(always)]
fn choose_position(config: &Config, group: u32, primary_pos: usize) -> usize {
    let Some(policy) = Policy::from_u32(config.policy) else {
        return primary_pos;
    };
    let Some(load) = accounting::group_load(group) else {
        return primary_pos;
    };
    let chosen = policy::choose(policy, config.threshold, primary_pos, &load);
    if chosen < load.len {
        chosen
    } else {
        primary_pos
    }
}
