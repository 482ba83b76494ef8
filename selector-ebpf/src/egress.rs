//! Request path (TC egress): count, choose a replica, apply the pending
//! bounds, steer.

use aya_ebpf::{
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_ns},
    programs::TcContext,
};
use aya_log_ebpf::debug;
use selector_common::{
    BACKEND_RETIRING, Config, Direction, Endpoint, MAX_GROUP_MEMBERS, OnOverload, PassReason,
    Policy, TieBreak, backend_id, ejection,
    inflight::{PHASE_LIVE, is_current},
    policy::{self, Admission, GroupLoad},
    split_backend_id,
};

use crate::{
    TC_CONTINUE, TC_DROP, accounting, hedge,
    inflight::{self, NewRequest},
    maps::{SCRATCH, backend_target, config, count_pass},
    nexthop,
    packet::{self, Datagram},
    prologue::{self, Path, Request},
    reject,
    rewrite::{Rewrite, Side},
};

/// Returns the TC verdict: continue, drop, or redirect after a rewrite.
/// Inlined into the entry point: as a call of its own its frame and the
/// entry's, each rounded up to 32 bytes, exceed Linux 6.1's 512-byte
/// combined stack limit.
#[inline(always)]
pub fn try_egress(ctx: &TcContext) -> Result<i32, ()> {
    // First: TCP and the like pay a few loads, no map read (the mark
    // below is only ever set on a datagram).
    if prologue::plainly_not_udp::<Request>(ctx) {
        return Ok(TC_CONTINUE);
    }
    let config = config().ok_or(())?;
    // Our own packet crossing egress a second time (a redirected request):
    // already counted and steered. Clear the bit so it leaves as it came.
    let mark = unsafe { (*ctx.skb.skb).mark };
    if mark & config.mark != 0 {
        ctx.set_mark(mark & !config.mark);
        return Ok(TC_CONTINUE);
    }
    // Classified from the linear part: only a member's datagram is pulled.
    packet::pull_short_headers(ctx, Direction::Egress);
    let ip = prologue::ip::<Request>(ctx)?;
    let dgram = prologue::udp::<Request>(ctx, ip)?;
    let l = dgram.ip.layout;
    let dst = Endpoint::new(
        Request::member_address(ctx, l)?,
        Request::member_port(&dgram),
    );
    let primary = prologue::member_id::<Request>(dst)?;
    if primary & BACKEND_RETIRING != 0 {
        // Removed by a reload: only its requests in flight are still served.
        return pass(PassReason::NotBackend);
    }
    if packet::segmented(ctx) {
        // Requests batched by UDP_SEGMENT: only the first id is readable,
        // and steering it would take the others along untracked.
        return pass(PassReason::Segmented);
    }
    if packet::vlan_tagged(ctx, l) {
        // From a VLAN device above this one: a moved read would have to be
        // sent on that VLAN, whose next hops this attachment does not know.
        return pass(PassReason::VlanTagged);
    }
    // A request to a member: the one packet whose payload is read.
    packet::pull_payload(ctx, &dgram, Direction::Egress);
    let (group, primary_pos) = split_backend_id(primary);
    // Chosen before the payload is parsed, where the verifier has few
    // paths to walk it on; used only if this is a new read.
    let proposal = forget(propose(config, group, primary_pos).ok_or(())?).ok_or(())?;
    let byte = |i| dgram.payload_byte(ctx, i);
    let request_id = prologue::request_id::<Request>(config, byte)?;
    // Junk to a member (a DNS response, 2 bytes) is not tracked: nothing
    // answers it, so it would only hold a pending count for a timeout.
    if !config.descriptor.is_request(byte) {
        return pass(PassReason::NotRequest);
    }
    let is_read = config.descriptor.is_read(byte);
    let client = Request::client_address(ctx, l)?;
    let key = prologue::key::<Request>(client, &dgram, group, request_id);
    let hashes = prologue::hashes::<Request>(&key, config);
    // Most requests are new: the window's marks say which slots may hold
    // it, and a new request usually reads none. A retransmit is a request
    // whose key a current instance holds: live, and not answered yet. Once
    // a reply reached the application (a hedged read's first, while the
    // other member's copy is still out) the application may reuse the id:
    // that is a new request, tracked on its own.
    let marked = inflight::window_marks(hashes.home, config.inflight_mask);
    if let Some(first) = inflight::find(
        &key,
        hashes.home,
        config.inflight_mask,
        marked,
        PHASE_LIVE,
        |s| is_current(s.state, s.hedge),
    ) {
        return in_flight_already(ctx, config, &dgram, &first, primary);
    }
    accounting::count(primary, |s| &mut s.requests);
    let word = |i| dgram.payload_word(ctx, i);
    if !is_read && config.descriptor.expects_no_reply(byte, word, merge) {
        // Nothing will ever complete it: not pending, not steered.
        accounting::count(primary, |s| &mut s.no_reply);
        return Ok(TC_CONTINUE);
    }
    let mut chosen_pos = primary_pos;
    // Only reads are steered or bounded, and only while the agent is there
    // to expire lost ones (`Config::agent_alive`): a write, or any read
    // once the agent is gone, goes where it was sent.
    // The one clock read of a new request (about 30 ns here, a retpolined
    // call and a fenced TSC read): the agent's heartbeat is checked with
    // it, and it is the time the request was sent.
    let now_ns = unsafe { bpf_ktime_get_ns() };
    let steerable = is_read && config.agent_alive(now_ns);
    if steerable {
        let load = accounting::group_load(group).ok_or(())?;
        let may_move = config.steering_off == 0;
        if may_move {
            chosen_pos = proposal.chosen;
        }
        match admit(
            config,
            chosen_pos,
            proposal.best,
            may_move,
            &load,
            hashes.client_slot,
        ) {
            Admission::Send(pos) => chosen_pos = pos,
            Admission::Overloaded => {
                match OnOverload::from_u32(config.on_overload).unwrap_or(OnOverload::Pass) {
                    OnOverload::Pass => accounting::count(primary, |s| &mut s.overload_passed),
                    OnOverload::Drop => {
                        accounting::count(primary, |s| &mut s.overload_dropped);
                        return Ok(TC_DROP);
                    }
                    OnOverload::Reject => {
                        accounting::count(primary, |s| &mut s.overload_rejected);
                        return reject::answer(ctx, config, &dgram, request_id);
                    }
                }
            }
        }
    }
    let chosen = backend_id(group, chosen_pos);
    let Some(slot) = inflight::reserve(&key, hashes.home, config.inflight_mask) else {
        // No free slot: never block traffic.
        accounting::count(primary, |s| &mut s.untracked);
        debug!(
            ctx,
            "in-flight table full: request to {} untracked", primary
        );
        return Ok(TC_CONTINUE);
    };
    // Counted before it is published, so a completion can never precede
    // its issue.
    accounting::add_issued(chosen);
    accounting::client_add(hashes.client_slot, true);
    let sent_ns = now_ns;
    // Only a read may be hedged, and not with the agent gone (nothing
    // would send the copy). Asked again rather than kept from above: a
    // bool live across the insert cost the verifier 15,000 more
    // instructions. The event goes out before the slot is live, and the
    // agent acts on it only after the hedge delay.
    let hedge = if is_read && config.agent_alive(sent_ns) {
        // A half-open member is usable until one read goes to it: this
        // one, a tracked new read, if its compare-and-swap takes the probe
        // (which ejects the member again until the agent sees the result);
        // so is a slow member's probe, and an explore bit. A write, junk or
        // a retransmit never takes them.
        crate::health::take_probe(group, chosen_pos);
        hedge::offer(ctx, &dgram, &slot, primary, chosen, sent_ns)
    } else {
        0
    };
    slot.publish(&NewRequest {
        key,
        primary,
        chosen,
        sent_ns,
        hedge,
    });
    if chosen == primary {
        return Ok(TC_CONTINUE);
    }
    accounting::count(primary, |s| &mut s.redirected_away);
    accounting::count(chosen, |s| &mut s.redirected_to);
    steer(ctx, config, &dgram, chosen)
}

#[inline(always)]
fn pass(reason: PassReason) -> Result<i32, ()> {
    count_pass(Direction::Egress, reason);
    Ok(TC_CONTINUE)
}

/// A request whose key is already in flight.
#[inline(always)]
fn in_flight_already(
    ctx: &TcContext,
    config: &Config,
    dgram: &Datagram,
    first: &inflight::Seen,
    primary: u32,
) -> Result<i32, ()> {
    if first.primary != primary {
        // The same id sent to another member while the first request is in
        // flight: the application's own failover. Leave it alone.
        accounting::count(primary, |s| &mut s.id_collisions);
        return Ok(TC_CONTINUE);
    }
    // A retransmit follows the first copy and is not counted again.
    if first.chosen != primary {
        return steer(ctx, config, dgram, first.chosen);
    }
    Ok(TC_CONTINUE)
}

/// Rewrites the destination to backend `chosen` and sends the packet on
/// through the neighbour subsystem.
#[inline(always)]
fn steer(ctx: &TcContext, config: &Config, dgram: &Datagram, chosen: u32) -> Result<i32, ()> {
    ctx.rewrite(
        dgram.ip.layout,
        Side::Destination,
        backend_target(chosen).ok_or(())?,
    )?;
    Ok(nexthop::send(ctx, config.mark, chosen))
}

/// What the policy would do with a read for `primary_pos` of `group`.
struct Proposal {
    /// Where the policy sends it.
    chosen: usize,
    /// The best member, where a read leaves a full one for.
    best: Option<usize>,
}

/// Applies the configured policy and tie-break to the group's counts and
/// service times.
#[inline(always)]
fn propose(config: &Config, group: u32, primary_pos: usize) -> Option<Proposal> {
    let policy = Policy::from_u32(config.policy).unwrap_or(Policy::Observe);
    if policy == Policy::Observe {
        // Never moves a read, and `admit` reads no best member under it:
        // no counts or service times to read on every packet.
        return Some(Proposal {
            chosen: primary_pos,
            best: None,
        });
    }
    let (mut load, health) = accounting::group_load_and_health(group)?;
    if config.tie_break == TieBreak::Random as u32 {
        load.tie_break = TieBreak::Random;
        load.random = unsafe { bpf_get_prandom_u32() };
    }
    let service = accounting::group_service(group)?;
    let budget_ns = u64::from(config.budget_us) * 1000;
    let best = policy::best_member(policy, primary_pos, &load, service, budget_ns);
    let chosen = policy::choose_given(
        policy,
        config.threshold,
        budget_ns,
        primary_pos,
        &load,
        service,
        best,
    );
    let chosen = if chosen < load.len {
        chosen
    } else {
        primary_pos
    };
    // A member the agent wants measured gets this read (one: egress takes
    // its explore bit with the probe, after the slot is reserved).
    let chosen = ejection::explored(chosen, load.usable, health);
    Some(Proposal {
        chosen,
        best: best.map(|(pos, _)| pos),
    })
}

/// `value`, through memory the verifier does not track: every path that
/// reaches here continues as one state (0 if the map is missing, which it
/// never is).
#[inline(always)]
fn merge(value: usize) -> usize {
    let Some(slot) = SCRATCH.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: a per-CPU slot of this map, not shared while the program runs.
    unsafe {
        core::ptr::write_volatile(slot, [value as u64, 0]);
        core::ptr::read_volatile(slot)[0] as usize
    }
}

/// Writes `proposal` to per-CPU map memory and reads it back. The kernel
/// verifier does not track what map memory holds, so the values come back
/// as unknowns within their bounds: the paths through the selection (by
/// policy, by which member won, by the random draw) all continue in one
/// state instead of each walking the rest of the program again. Without
/// this the egress program's check went past the verifier's 1M-instruction
/// limit.
#[inline(always)]
fn forget(proposal: Proposal) -> Option<Proposal> {
    let slot = SCRATCH.get_ptr_mut(0)?;
    let best = proposal.best.map_or(MAX_GROUP_MEMBERS as u64, |b| b as u64);
    // SAFETY: a per-CPU slot of this map, not shared while the program runs.
    let [chosen, best] = unsafe {
        core::ptr::write_volatile(slot, [proposal.chosen as u64, best]);
        core::ptr::read_volatile(slot)
    };
    Some(Proposal {
        chosen: chosen as usize % MAX_GROUP_MEMBERS,
        best: (best < MAX_GROUP_MEMBERS as u64).then_some(best as usize % MAX_GROUP_MEMBERS),
    })
}

/// The per-client bound first (moving elsewhere does not help it), then the
/// per-backend bound.
#[inline(always)]
fn admit(
    config: &Config,
    chosen_pos: usize,
    best: Option<usize>,
    may_move: bool,
    load: &GroupLoad,
    client: u32,
) -> Admission {
    let client_cap = u64::from(config.max_pending_client);
    if client_cap != 0 && accounting::client_pending(client) >= client_cap {
        return Admission::Overloaded;
    }
    let may_move = may_move && config.policy != Policy::Observe as u32;
    match policy::admit(chosen_pos, best, config.max_pending, may_move, load) {
        Admission::Send(pos) if pos < load.len => Admission::Send(pos),
        Admission::Send(_) => Admission::Send(chosen_pos),
        Admission::Overloaded => Admission::Overloaded,
    }
}
