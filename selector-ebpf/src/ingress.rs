//! Response path (XDP, or TC ingress): complete the in-flight request and
//! make a redirected reply look like it came from the primary.

use aya_ebpf::helpers::bpf_ktime_get_ns;
use selector_common::{
    BACKEND_RETIRING, Direction, Endpoint, PassReason, backend_id,
    fragments::{FragmentEntry, FragmentKey},
    hedge::{WON_CHOSEN, WON_HEDGE, is_sent, target},
    inflight::{PHASE_LIVE, phase},
    split_backend_id,
};

use crate::{
    accounting,
    hedge::{self, Answer},
    inflight::{self, Seen},
    maps::{FRAGMENTS, SCRATCH, backend_target, config, count_pass, reply_scratch},
    packet::{self, Ip, Packet},
    prologue::{self, Path, Reply},
    rewrite::{Rewrite, Side},
};

/// What becomes of a reply datagram.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// On to the application (rewritten or untouched).
    Pass,
    /// The later reply of a hedged read: dropped, counted.
    Drop,
}

/// Inlined into each entry point, as `egress::try_egress` is: a frame of
/// its own would be rounded up on Linux 6.1 and, with the entry's and the
/// descriptor's small one, come to its 512-byte limit.
#[inline(always)]
pub fn try_ingress<C: Packet + Rewrite>(ctx: &C) -> Result<Verdict, ()> {
    let ip = prologue::ip::<Reply>(ctx)?;
    if ip.fragment && !ip.first_fragment {
        return later_fragment(ctx, &ip);
    }
    let dgram = prologue::udp::<Reply>(ctx, ip)?;
    let l = dgram.ip.layout;
    let src = Endpoint::new(Reply::member_address(ctx, l)?, Reply::member_port(&dgram));
    // The reply is addressed to the client that asked.
    let client = Reply::client_address(ctx, l)?;
    if dgram.ip.fragment {
        // A first fragment starts a datagram: a series its key still names
        // is another datagram's, whose later fragments were lost.
        let scratch = reply_scratch().ok_or(())?;
        scratch.series = series_key(&dgram.ip, src.addr, client);
        // By reference: the key stays in map memory, off the stack.
        #[allow(clippy::needless_borrows_for_generic_args)]
        let _ = FRAGMENTS.remove(&scratch.series);
    }
    // A member being removed still completes the requests it was sent.
    let backend = prologue::member_id::<Reply>(src)? & !BACKEND_RETIRING;
    // A reply from a member: the one packet whose payload is read.
    packet::pull_payload(ctx, &dgram, Direction::Ingress);
    let config = config().ok_or(())?;
    let request_id = prologue::request_id::<Reply>(config, |i| dgram.payload_byte(ctx, i))?;
    let (group, _) = split_backend_id(backend);
    // In map memory, not on the stack (see `ReplyScratch`).
    let scratch = reply_scratch().ok_or(())?;
    scratch.key = prologue::key::<Reply>(client, &dgram, group, request_id);
    let key = &scratch.key;
    let hashes = prologue::hashes::<Reply>(key, config);
    // Only the backend the request went to, or its hedge was sent to, can
    // complete it; of several instances of the key (an id reused), the
    // reply goes to the one it belongs to (`selector_common::inflight::rank`).
    let Some((seen, stale)) =
        inflight::match_reply(key, hashes.home, config.inflight_mask, group, backend)
    else {
        accounting::count(backend, |s| &mut s.unmatched_responses);
        return Ok(Verdict::Pass);
    };
    // `stale`: an older instance's reply while the application waits on a
    // newer one with the same id. Its counts end as always, but it is not
    // the newer one's answer, so it is dropped.
    let (seq, total) = config
        .descriptor
        .reply_datagram(|i| dgram.payload_byte(ctx, i));
    // An error reply is a failure of the replica, as a lost request is; it
    // is classified before anything is decided, since with a hedge out it
    // does not win while the other copy may still answer.
    let error = forget_flag(
        config
            .descriptor
            .is_error_reply(|i| dgram.payload_word(ctx, i), total <= 1),
    );
    let datagram = ReplyDatagram { seq, total, error };
    let verdict = if seen.chosen == backend {
        chosen_reply(hashes.client_slot, &seen, stale, backend, &datagram)
    } else {
        hedge_reply(&seen, stale, backend, &datagram)
    };
    if verdict == Verdict::Drop {
        return Ok(Verdict::Drop);
    }
    let primary = seen.primary;
    if primary != backend {
        let target = backend_target(primary).ok_or(())?;
        if dgram.ip.fragment && dgram.ip.more_fragments {
            remember_series(&dgram.ip, src.addr, client, target.addr)?;
        }
        ctx.rewrite(dgram.ip.layout, Side::Source, target)?;
    }
    Ok(Verdict::Pass)
}

#[inline(always)]
fn pass(reason: PassReason) -> Result<Verdict, ()> {
    count_pass(Direction::Ingress, reason);
    Ok(Verdict::Pass)
}

/// What the reply path needs of a reply datagram: its place in a
/// multi-datagram reply, and whether it is an error (1) or not (0).
struct ReplyDatagram {
    seq: u16,
    total: u16,
    error: u64,
}

/// A reply from the member the read went to. On a hedgeable read it first
/// decides, on the hedge word, whether it is the first reply; then it
/// completes the request as any reply does (a loser too: its own pending
/// count must end); a loser is dropped, an error held while the hedge's
/// copy may still answer too, and so is a `stale` reply (an older
/// instance's, which decides nothing).
#[inline(always)]
fn chosen_reply(
    client_slot: u32,
    seen: &Seen,
    stale: bool,
    backend: u32,
    datagram: &ReplyDatagram,
) -> Verdict {
    let answer = if seen.hedge == 0 {
        Answer::Gone
    } else if stale {
        hedge::peek(seen.index, seen.state, WON_CHOSEN)
    } else {
        hedge::answer(
            seen.index,
            seen.state,
            WON_CHOSEN,
            datagram.error != 0,
            true,
        )
    };
    let hedged = match answer {
        Answer::Mine { first, word } => {
            if first && is_sent(word) {
                let (group, _) = split_backend_id(backend);
                hedge::count(backend_id(group, target(word)), |s| &mut s.lost);
            }
            is_sent(word)
        }
        // Held: only with a hedge sent.
        Answer::Theirs | Answer::Held => true,
        // A stale instance that is still live was answered, so its SENT
        // bit as read is final.
        Answer::Gone => stale && is_sent(seen.hedge),
    };
    if phase(seen.state) == PHASE_LIVE {
        complete(client_slot, seen, backend, hedged, datagram);
    } else {
        // Completed or expired, within the grace period: rewrite only.
        accounting::count(backend, |s| &mut s.late_responses);
    }
    match answer {
        Answer::Theirs => {
            hedge::count(backend, |s| &mut s.replies_dropped);
            Verdict::Drop
        }
        Answer::Held => {
            hedge::count(backend, |s| &mut s.errors_held);
            Verdict::Drop
        }
        _ if stale => {
            accounting::count(backend, |s| &mut s.stale_replies);
            Verdict::Drop
        }
        _ => Verdict::Pass,
    }
}

/// A reply from the hedge target: decides on the hedge word whether it is
/// the first reply (an error is held while the chosen member's copy may
/// still answer), then settles the target's own count (once), classified
/// as any reply's (an error is the target's failure); passes if it won,
/// drops it if not (or if `stale`).
#[inline(always)]
fn hedge_reply(seen: &Seen, stale: bool, backend: u32, datagram: &ReplyDatagram) -> Verdict {
    // Decided before the count is settled: the chosen member's error
    // reply takes a settled target count with no HELD_HEDGE for an
    // expired copy, and would pass before this reply could win.
    let answer = if stale {
        hedge::peek(seen.index, seen.state, WON_HEDGE)
    } else {
        hedge::answer(
            seen.index,
            seen.state,
            WON_HEDGE,
            datagram.error != 0,
            phase(seen.state) == PHASE_LIVE,
        )
    };
    if hedge::settle_target(seen.index, seen.state) {
        accounting::add_completed(backend);
        count_reply(seen, backend, datagram.error);
    }
    if stale && answer != Answer::Theirs {
        accounting::count(backend, |s| &mut s.stale_replies);
        return Verdict::Drop;
    }
    match answer {
        Answer::Mine { first, .. } => {
            if first {
                hedge::count(backend, |s| &mut s.won);
            }
            Verdict::Pass
        }
        Answer::Theirs => {
            hedge::count(backend, |s| &mut s.replies_dropped);
            Verdict::Drop
        }
        Answer::Held => {
            hedge::count(backend, |s| &mut s.errors_held);
            Verdict::Drop
        }
        Answer::Gone => Verdict::Pass,
    }
}

/// A reply that ended `backend`'s count of the request in `seen`: one more
/// response, an error (`error` 1) counted as its failure, a good reply
/// ending its run of failures (outlier ejection).
#[inline(always)]
fn count_reply(seen: &Seen, backend: u32, error: u64) {
    let moved = u64::from(seen.primary != backend);
    accounting::count_response(backend, error, error & moved);
    crate::health::replied(backend, error);
}

/// A reply datagram for a live request: completes it once every datagram
/// of the reply has arrived. Whoever moves the slot out of `LIVE` (this
/// path or the agent's sweep) accounts for it, exactly once.
#[inline(always)]
fn complete(client_slot: u32, live: &Seen, backend: u32, hedged: bool, datagram: &ReplyDatagram) {
    if !inflight::datagram_arrived(live.index, live.state, datagram.seq, datagram.total) {
        // More datagrams to come: the request stays pending.
        return;
    }
    if inflight::claim(
        live.index,
        live.state,
        inflight::claimed_state(live, hedged),
    ) {
        accounting::add_completed(backend);
        accounting::client_add(client_slot, false);
        let now = unsafe { bpf_ktime_get_ns() };
        accounting::record_latency(backend, now.saturating_sub(live.sent_ns));
        accounting::record_service(backend, now);
        count_reply(live, backend, datagram.error);
    } else if phase(live.state) == PHASE_LIVE {
        // The sweep expired it a moment ago: a late reply, still rewritten.
        accounting::count(backend, |s| &mut s.late_responses);
    }
}

/// `flag` as 0 or 1, through per-CPU map memory the verifier does not
/// track: the classification's many ways out (each byte read may fail)
/// continue as one state.
#[inline(always)]
fn forget_flag(flag: bool) -> u64 {
    let Some(slot) = SCRATCH.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: a per-CPU slot of this map, not shared while the program runs.
    unsafe {
        core::ptr::write_volatile(slot, [u64::from(flag), 0]);
        core::ptr::read_volatile(slot)[0] & 1
    }
}

/// The later fragments of a rewritten reply carry no UDP header: they are
/// known by (source, destination, IP id, protocol) and get the address its
/// first fragment got (see `selector_common::fragments`). Remembers the
/// series of `ip` from `src` to `dst`, rewritten to `primary_addr`.
#[inline(always)]
fn remember_series(
    ip: &Ip,
    src: [u8; 16],
    dst: [u8; 16],
    primary_addr: [u8; 16],
) -> Result<(), ()> {
    let scratch = reply_scratch().ok_or(())?;
    scratch.series = series_key(ip, src, dst);
    scratch.entry = FragmentEntry {
        addr: primary_addr,
        first_ns: unsafe { bpf_ktime_get_ns() },
    };
    // Full: the LRU map forgets its least recently used series.
    // By reference: key and entry stay in map memory, off the stack.
    #[allow(clippy::needless_borrows_for_generic_args)]
    let _ = FRAGMENTS.insert(&scratch.series, &scratch.entry, 0);
    Ok(())
}

/// The series a fragment from `src` to `dst` belongs to (addresses as
/// read before any rewrite).
#[inline(always)]
fn series_key(ip: &Ip, src: [u8; 16], dst: [u8; 16]) -> FragmentKey {
    FragmentKey {
        src,
        dst,
        id: ip.id,
        protocol: ip.protocol,
        _pad: [0; 3],
    }
}

/// A fragment after the first: rewritten if its series is known and
/// current, and the last one ends the series. An unknown series (its first
/// fragment not rewritten, not seen yet, or forgotten) passes untouched.
#[inline(always)]
fn later_fragment<C: Packet + Rewrite>(ctx: &C, ip: &Ip) -> Result<Verdict, ()> {
    let scratch = reply_scratch().ok_or(())?;
    scratch.series = series_key(
        ip,
        packet::src_address(ctx, ip.layout)?,
        packet::dst_address(ctx, ip.layout)?,
    );
    let key = &scratch.series;
    let Some(entry) = (unsafe { FRAGMENTS.get(key) }).copied() else {
        return pass(PassReason::Fragment);
    };
    let current = entry.is_current(unsafe { bpf_ktime_get_ns() });
    if !current || !ip.more_fragments {
        let _ = FRAGMENTS.remove(key);
    }
    if !current {
        return pass(PassReason::Fragment);
    }
    ctx.rewrite_fragment_source(ip.layout, entry.addr)?;
    Ok(Verdict::Pass)
}
