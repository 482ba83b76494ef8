//! Packet fixtures for hedged reads (BPF_PROG_TEST_RUN, programs loaded,
//! not attached): the first reply of a hedged read passes, rewritten to
//! come from the primary; the later one is dropped in the kernel and
//! counted; both members' counts end exactly once, also when the hedge
//! target never answers (the sweep expires it).

use etherparse::PacketBuilder;
use selector_common::{Descriptor, InflightKey, programs};
use selector_testbed::frames::{
    CLIENT, CLIENT_MAC, CLIENT_PORT, GET, PRIMARY_MAC, SET, TC_ACT_PIPE, TC_ACT_SHOT, XDP_PASS,
    egress, replica, request, run_tc, run_xdp, settings_for, stats, verified_endpoints,
};
use selector_testbed::loaded::{self, Loaded};
use selector_user::{Selector, Settings, host::sys};

const XDP_DROP: u32 = 1;

fn key() -> InflightKey {
    InflightKey::ipv4(CLIENT, CLIENT_PORT, 0, 0x1234)
}

/// `from`'s answer to GET (request id 0x1234).
fn reply(from: ([u8; 4], u16)) -> Vec<u8> {
    memcached_reply(from, b"VALUE foo 0 3\r\nbar\r\nEND\r\n")
}

/// `from`'s reply to GET (request id 0x1234, one datagram) with `body`.
fn memcached_reply(from: ([u8; 4], u16), body: &[u8]) -> Vec<u8> {
    let mut payload = b"\x12\x34\0\0\0\x01\0\0".to_vec();
    payload.extend_from_slice(body);
    let mut out = Vec::new();
    PacketBuilder::ethernet2(PRIMARY_MAC, CLIENT_MAC)
        .ipv4(from.0, CLIENT, 64)
        .udp(from.1, CLIENT_PORT)
        .write(&mut out, &payload)
        .unwrap();
    out
}

/// A loaded selector with GET in flight to the primary and a hedge to
/// member 1 claimed.
fn hedged() -> Loaded {
    let mut sel = loaded::load(&Settings {
        ..settings_for(Descriptor::memcached(), replica)
    })
    .expect("load");
    let (verdict, _) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_PIPE);
    assert!(sel.plant_hedge(&key(), 1), "hedge claimed");
    assert!(!sel.plant_hedge(&key(), 2), "one hedge per read");
    sel
}

/// `hedged`, with reads kept at the primary whatever is pending
/// (threshold 100): a read whose id is reused goes where the first went.
fn hedged_at_the_primary() -> Loaded {
    let mut sel = loaded::load(&settings_for(Descriptor::memcached(), replica).tuned(|t| {
        t.threshold = 100;
    }))
    .expect("load");
    assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_PIPE);
    assert!(sel.plant_hedge(&key(), 1), "hedge claimed");
    sel
}

/// The application's id reused once the hedge target's reply answered the
/// read, while the primary's copy is still pending: a new request, not a
/// retransmit of the answered one, and the primary's replies are matched in
/// the order the two were sent, so the new read's answer is not dropped as
/// the older one's loser. Played:
/// 1. GET to the primary, a hedge to member 1;
/// 2. GET again before any reply: a retransmit (not counted);
/// 3. member 1's reply: wins, passes;
/// 4. GET again (the same id): a new read, counted, kept at the primary;
/// 5. the primary's reply: the first read's, dropped as its loser;
/// 6. the primary's reply again: the new read's answer, passes.
#[test]
fn an_id_reused_after_the_hedge_answered_is_a_new_read_and_gets_its_own_reply() {
    let mut sel = hedged_at_the_primary();
    assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_PIPE);
    assert_eq!(
        sel.accounting().unwrap()[0].0,
        1,
        "a retransmit is not counted"
    );
    assert_eq!(run_xdp(&mut sel, &reply(replica(1))).0, XDP_PASS);
    assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_PIPE);
    assert_eq!(
        sel.accounting().unwrap()[0].0,
        2,
        "the reused id is a new read"
    );
    assert_eq!(
        run_xdp(&mut sel, &reply(replica(0))).0,
        XDP_DROP,
        "the first read's loser"
    );
    let (verdict, out) = run_xdp(&mut sel, &reply(replica(0)));
    assert_eq!(verdict, XDP_PASS, "the new read's answer");
    assert_eq!(verified_endpoints(&out).0, replica(0));
    assert_eq!(
        sel.accounting().unwrap(),
        vec![(2, 2, 0), (1, 1, 0), (0, 0, 0)]
    );
    let h = sel.hedge_counts().unwrap();
    assert_eq!((h[1].hedges_won, h[0].hedge_replies_dropped), (1, 1));
    balanced(&sel);
}

/// Neither copy of a hedged read answered within the timeout; the
/// application reuses the id for a new read, kept at the primary; the hedge
/// target's late reply to the first read is not the new read's answer.
/// Played: GET to the primary, a hedge to member 1; a sweep past the
/// timeout (both expire); GET again (the same id: a new read); member 1's
/// reply (dropped: the first read's); the primary's reply (passes).
#[test]
fn a_hedge_targets_late_reply_is_not_the_answer_of_a_new_read_with_its_id() {
    let mut sel = hedged_at_the_primary();
    let report = sel.sweep(sys::monotonic_ns() + 1_200_000_000).unwrap();
    assert_eq!((report.expired, report.hedges_expired), (1, 1));
    assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_PIPE);
    assert_eq!(
        run_xdp(&mut sel, &reply(replica(1))).0,
        XDP_DROP,
        "the first read's late reply"
    );
    assert_eq!(stats(&sel)[1].stale_replies, 1);
    let (verdict, out) = run_xdp(&mut sel, &reply(replica(0)));
    assert_eq!(verdict, XDP_PASS, "the new read's answer");
    assert_eq!(verified_endpoints(&out).0, replica(0));
    assert_eq!(
        sel.accounting().unwrap(),
        vec![(2, 1, 1), (1, 0, 1), (0, 0, 0)]
    );
    balanced(&sel);
}

/// A loaded selector whose egress program offers reads for hedging (the
/// kernel side only: no agent thread takes the offers).
fn offering() -> Loaded {
    offering_with(settings_for(Descriptor::memcached(), replica))
}

fn offering_with(settings: Settings) -> Loaded {
    use selector_common::hedge::{self, HedgeConfig};
    let mut sel = loaded::load(&settings).expect("load");
    let mut config: aya::maps::Array<_, HedgeConfig> =
        aya::maps::Array::try_from(sel.ebpf_mut().map_mut(hedge::names::CONFIG).unwrap()).unwrap();
    let on = HedgeConfig {
        enabled: 1,
        _pad: 0,
    };
    config.set(0, on, 0).unwrap();
    sel
}

fn balanced(sel: &Selector) {
    for (i, (issued, completed, expired)) in sel.accounting().unwrap().into_iter().enumerate() {
        assert_eq!(issued, completed + expired, "member {i}");
    }
}

#[test]
fn hedge_target_first_wins_and_the_primarys_late_reply_is_dropped() {
    let mut sel = hedged();
    let (verdict, out) = run_xdp(&mut sel, &reply(replica(1)));
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(
        verified_endpoints(&out).0,
        replica(0),
        "looks like the primary's"
    );
    // A duplicate datagram of the winner still passes.
    let (verdict, _) = run_xdp(&mut sel, &reply(replica(1)));
    assert_eq!(verdict, XDP_PASS);
    let (verdict, _) = run_xdp(&mut sel, &reply(replica(0)));
    assert_eq!(verdict, XDP_DROP, "the loser is dropped");
    let h = sel.hedge_counts().unwrap();
    assert_eq!((h[1].hedges_won, h[1].hedges_lost), (1, 0));
    assert_eq!(
        (h[0].hedge_replies_dropped, h[1].hedge_replies_dropped),
        (1, 0)
    );
    assert_eq!(
        sel.accounting().unwrap(),
        vec![(1, 1, 0), (1, 1, 0), (0, 0, 0)]
    );
    balanced(&sel);
    assert!(sel.inflight().unwrap().is_empty());
}

#[test]
fn primary_first_wins_and_the_hedge_targets_reply_is_dropped_on_tc_too() {
    let mut sel = hedged();
    let (verdict, out) = run_tc(&mut sel, programs::INGRESS_TC, &reply(replica(0)));
    assert_eq!(verdict, TC_ACT_PIPE);
    assert_eq!(verified_endpoints(&out).0, replica(0));
    let (verdict, _) = run_tc(&mut sel, programs::INGRESS_TC, &reply(replica(1)));
    assert_eq!(verdict, TC_ACT_SHOT, "the loser is dropped");
    let h = sel.hedge_counts().unwrap();
    assert_eq!((h[1].hedges_won, h[1].hedges_lost), (0, 1));
    assert_eq!(h[1].hedge_replies_dropped, 1);
    assert_eq!(
        sel.accounting().unwrap(),
        vec![(1, 1, 0), (1, 1, 0), (0, 0, 0)]
    );
    // The slot lingered for the hedge target's reply.
    assert_eq!(sel.hedges_in_flight(), 0);
}

#[test]
fn a_hedge_target_that_never_answers_expires_exactly_once() {
    let mut sel = hedged();
    let (verdict, _) = run_xdp(&mut sel, &reply(replica(0)));
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(sel.hedges_in_flight(), 1, "the target's count is open");
    // Past the timeout: the sweep ends the target's count.
    let later = sys::monotonic_ns() + 1_500_000_000;
    let report = sel.sweep(later).unwrap();
    assert_eq!(report.hedges_expired, 1);
    assert_eq!(sel.sweep(later).unwrap().hedges_expired, 0, "only once");
    assert_eq!(
        sel.accounting().unwrap(),
        vec![(1, 1, 0), (1, 0, 1), (0, 0, 0)]
    );
    // Its reply, after all: dropped (the primary's answered), not counted again.
    let (verdict, _) = run_xdp(&mut sel, &reply(replica(1)));
    assert_eq!(verdict, XDP_DROP);
    balanced(&sel);
    // After timeout + grace the slot is free.
    sel.sweep(sys::monotonic_ns() + 3_000_000_000).unwrap();
    assert_eq!(sel.hedges_in_flight(), 0);
}

#[test]
fn neither_answers_both_expire_and_the_first_late_reply_passes() {
    let mut sel = hedged();
    let later = sys::monotonic_ns() + 1_500_000_000;
    let report = sel.sweep(later).unwrap();
    assert_eq!((report.expired, report.hedges_expired), (1, 1));
    assert_eq!(
        sel.accounting().unwrap(),
        vec![(1, 0, 1), (1, 0, 1), (0, 0, 0)]
    );
    let (verdict, out) = run_xdp(&mut sel, &reply(replica(1)));
    assert_eq!(
        verdict, XDP_PASS,
        "nobody answered yet: the late reply passes"
    );
    assert_eq!(verified_endpoints(&out).0, replica(0));
    let (verdict, _) = run_xdp(&mut sel, &reply(replica(0)));
    assert_eq!(verdict, XDP_DROP);
    balanced(&sel);
}

#[test]
fn an_unhedged_read_is_answered_as_before() {
    let mut sel = loaded::load(&settings_for(Descriptor::memcached(), replica)).expect("load");
    let (verdict, _) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_PIPE);
    let (verdict, _) = run_xdp(&mut sel, &reply(replica(0)));
    assert_eq!(verdict, XDP_PASS);
    // Answered: no hedge can be claimed any more.
    assert!(!sel.plant_hedge(&key(), 1));
    let (verdict, _) = run_xdp(&mut sel, &reply(replica(0)));
    assert_eq!(
        verdict, XDP_PASS,
        "a duplicate is not dropped without a hedge"
    );
    assert_eq!(sel.hedge_counts().unwrap()[0].hedge_replies_dropped, 0);
    balanced(&sel);
}

/// With hedging on in the kernel (set here directly: no hedge thread), a
/// tracked read is handed over whole; a read longer than the event holds is
/// not, and is counted.
#[test]
fn a_read_is_offered_with_its_bytes_and_a_long_one_is_counted_instead() {
    use aya::maps::RingBuf;
    use selector_common::hedge::{self, HedgeEvent, PAYLOAD_MAX, open_word};

    let mut sel = offering();
    let (verdict, _) = egress(&mut sel, &request(GET));
    assert_eq!(verdict, TC_ACT_PIPE);
    let mut long = b"\x12\x35\0\0\0\x01\0\0get ".to_vec();
    long.resize(PAYLOAD_MAX + 1 - 2, b'k');
    long.extend_from_slice(b"\r\n");
    // (Steered elsewhere, maybe: the first read is pending at the primary.)
    egress(&mut sel, &request(&long));
    // Exactly the longest that fits is offered.
    let mut longest = long.clone();
    longest[1] = 0x36;
    longest.remove(20);
    assert_eq!(longest.len(), PAYLOAD_MAX);
    egress(&mut sel, &request(&longest));

    let slots = sel.inflight().unwrap();
    assert_eq!(slots.len(), 3, "all three tracked");
    let slot_of = |id: u64| *slots.iter().find(|s| s.request_id == id).unwrap();
    let mut events = Vec::new();
    {
        let mut ring =
            RingBuf::try_from(sel.ebpf_mut().map_mut(hedge::names::EVENTS).unwrap()).unwrap();
        while let Some(item) = ring.next() {
            assert_eq!(item.len(), size_of::<HedgeEvent>());
            // SAFETY: the kernel wrote a HedgeEvent.
            events.push(unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<HedgeEvent>()) });
        }
    }
    assert_eq!(events.len(), 2, "the short and the longest read");
    for (event, payload, id) in [
        (&events[0], GET, 0x1234),
        (&events[1], &longest[..], 0x1236),
    ] {
        let slot = slot_of(id);
        assert_eq!(event.state, slot.state);
        assert_eq!(event.sent_ns, slot.sent_ns);
        assert_eq!((event.primary, event.chosen), (slot.primary, slot.chosen));
        assert_eq!(&event.payload[..event.len as usize], payload);
        assert_eq!(slot.hedge, open_word(slot.state), "hedgeable");
    }
    assert_eq!(slot_of(0x1235).hedge, 0, "never hedgeable");
    let h = sel.hedge_counts().unwrap();
    assert_eq!((h[0].hedge_too_large, h[0].hedge_ring_full), (1, 0));
}

/// Only reads are hedged: a write with hedging on is tracked but never
/// offered, and its slot never hedgeable.
#[test]
fn a_write_is_never_offered_for_hedging() {
    use aya::maps::RingBuf;
    use selector_common::hedge;

    let mut sel = offering();
    assert_eq!(egress(&mut sel, &request(SET)).0, TC_ACT_PIPE);
    let slots = sel.inflight().unwrap();
    assert_eq!(slots.len(), 1, "the write is tracked");
    assert_eq!(slots[0].hedge, 0, "never hedgeable");
    let mut ring =
        RingBuf::try_from(sel.ebpf_mut().map_mut(hedge::names::EVENTS).unwrap()).unwrap();
    assert!(ring.next().is_none(), "no hedge event for a write");
}

/// With the agent gone (its heartbeat past the bound) no read is offered:
/// nothing would send the copy, and the ring would only fill up.
#[test]
fn no_read_is_offered_with_a_stale_heartbeat() {
    use aya::maps::RingBuf;
    use selector_common::hedge;

    let mut sel = offering_with(Settings {
        heartbeat_bound: std::time::Duration::from_secs(1),
        ..settings_for(Descriptor::memcached(), replica)
    });
    sel.plant_heartbeat(sys::monotonic_ns() - 2_000_000_000);
    assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_PIPE);
    let slots = sel.inflight().unwrap();
    assert_eq!(slots.len(), 1, "the read is tracked");
    assert_eq!(slots[0].hedge, 0, "not offered");
    {
        let mut ring =
            RingBuf::try_from(sel.ebpf_mut().map_mut(hedge::names::EVENTS).unwrap()).unwrap();
        assert!(ring.next().is_none(), "no hedge event");
    }
    // The agent back: the next read is offered.
    sel.plant_heartbeat(sys::monotonic_ns());
    let mut next = GET.to_vec();
    next[1] = 0x35;
    egress(&mut sel, &request(&next));
    let mut ring =
        RingBuf::try_from(sel.ebpf_mut().map_mut(hedge::names::EVENTS).unwrap()).unwrap();
    assert!(ring.next().is_some(), "offered once the heartbeat is fresh");
}

/// A member removed by a reload and retired frees its position; the member
/// a later reload puts there starts with no service time and no hedge
/// counts of the old one's (they would skew the latency policy and read
/// as the new member's hedges).
#[test]
fn a_reused_position_starts_without_the_old_members_service_time_and_hedges() {
    use std::{
        net::SocketAddr,
        time::{Duration, Instant},
    };

    use selector_user::datapath::regroup::{GroupTable, plan_groups};

    let mut sel = hedged();
    // The hedge to member 1 wins; the primary's late reply is dropped and
    // frees the slot.
    assert_eq!(run_xdp(&mut sel, &reply(replica(1))).0, XDP_PASS);
    assert_eq!(run_xdp(&mut sel, &reply(replica(0))).0, XDP_DROP);
    sel.plant_service_time(1, 5_000_000);
    let old = sel.hedge_counts().unwrap()[1];
    assert_eq!(old.hedges_won, 1);
    assert_eq!(sel.service_times()[1], 5_000_000);

    let addr = |(a, p): ([u8; 4], u16)| SocketAddr::from((a, p));
    let mut table = GroupTable::from_start(&sel.settings.groups, &[None]);
    let reload = |sel: &mut Selector, table: &mut GroupTable, members: Vec<SocketAddr>| {
        let changes = plan_groups(table, &[members], &[None], Instant::now()).unwrap();
        sel.apply_groups(&changes).unwrap();
        *table = changes.table.clone();
        sel.backends = table.backends();
        changes
    };
    // Member 1 removed, and retired once nothing names it.
    reload(
        &mut sel,
        &mut table,
        vec![addr(replica(0)), addr(replica(2))],
    );
    let retired = sel
        .retire_finished(&mut table, Duration::ZERO, Instant::now())
        .unwrap();
    assert_eq!(retired, vec![addr(replica(1))]);
    // A new member takes position 1.
    let new = addr(([10, 77, 0, 99], 11299));
    let changes = reload(
        &mut sel,
        &mut table,
        vec![addr(replica(0)), addr(replica(2)), new],
    );
    assert_eq!(changes.added.len(), 1);
    assert_eq!((changes.added[0].addr, changes.added[0].index), (new, 1));
    let at = sel.backends.iter().position(|b| b.addr == new).unwrap();
    assert_eq!(sel.service_times()[at], 0, "service time of the old member");
    let counts = sel.hedge_counts().unwrap()[at];
    assert_eq!(
        counts,
        selector_user::telemetry::hedges::HedgeCounts {
            hedge_delay_ns: counts.hedge_delay_ns,
            ..Default::default()
        },
        "hedge counts of the old member"
    );
}

/// `from`'s memcached `SERVER_ERROR` to GET (request id 0x1234): a failure
/// of the replica.
fn error_reply(from: ([u8; 4], u16)) -> Vec<u8> {
    memcached_reply(from, b"SERVER_ERROR out of memory\r\n")
}

fn failures(sel: &Selector) -> Vec<u64> {
    sel.ejection_states(sys::monotonic_ns())
        .iter()
        .map(|e| e.failures_in_a_row)
        .collect()
}

/// The hedge target's reply completes its copy like any reply: an error
/// is counted as the target's failure, and a good one ends its run.
/// Played: GET to the primary, a hedge to member 1; the primary's good
/// reply (passes); member 1's `SERVER_ERROR` (dropped, the loser). Then a
/// second hedged read (id 0x1235) answered by member 1 with a good reply.
#[test]
fn a_hedge_targets_error_reply_is_a_failure_of_the_target() {
    let mut sel = hedged();
    assert_eq!(run_xdp(&mut sel, &reply(replica(0))).0, XDP_PASS);
    assert_eq!(run_xdp(&mut sel, &error_reply(replica(1))).0, XDP_DROP);
    let s = stats(&sel);
    assert_eq!(
        (s[1].responses, s[1].error_replies, s[1].error_replies_moved),
        (1, 1, 1),
        "the copy was the selector's"
    );
    assert_eq!(failures(&sel), [0, 1, 0]);
    balanced(&sel);
}

/// With a hedge out, an error reply does not reach the application while
/// the other copy may still answer: the first good reply does. Played,
/// through XDP and TC ingress, with the error from either member: GET to
/// the primary, a hedge to member 1; the one member's `SERVER_ERROR`
/// (dropped, held); the other member's good reply (passes, from the
/// primary as far as the application sees).
#[test]
fn an_error_reply_does_not_win_while_the_other_copy_is_pending() {
    for tc in [false, true] {
        for erring in [0, 1] {
            let case = format!("tc {tc}, error from member {erring}");
            let mut sel = hedged();
            let (pass, drop) = if tc {
                (TC_ACT_PIPE, TC_ACT_SHOT)
            } else {
                (XDP_PASS, XDP_DROP)
            };
            let run = |sel: &mut Selector, frame: &[u8]| {
                if tc {
                    run_tc(sel, programs::INGRESS_TC, frame)
                } else {
                    run_xdp(sel, frame)
                }
            };
            let good = 1 - erring;
            assert_eq!(
                run(&mut sel, &error_reply(replica(erring))).0,
                drop,
                "{case}"
            );
            let (verdict, out) = run(&mut sel, &reply(replica(good)));
            assert_eq!(verdict, pass, "{case}: the good reply");
            assert_eq!(verified_endpoints(&out).0, replica(0), "{case}");
            let s = stats(&sel);
            assert_eq!(s[erring].error_replies, 1, "{case}");
            assert_eq!(s[good].error_replies, 0, "{case}");
            let h = sel.hedge_counts().unwrap();
            assert_eq!(h[erring].hedge_errors_held, 1, "{case}");
            assert_eq!(h[1].hedges_won, u64::from(good == 1), "{case}");
            assert_eq!(
                sel.accounting().unwrap(),
                vec![(1, 1, 0), (1, 1, 0), (0, 0, 0)],
                "{case}"
            );
            // A duplicate of the held error is dropped too.
            assert_eq!(
                run(&mut sel, &error_reply(replica(erring))).0,
                drop,
                "{case}"
            );
        }
    }
}

/// Both copies fail with an error: the second error reaches the
/// application (an error only when both fail). Played, with either member
/// first: GET to the primary, a hedge to member 1; one member's
/// `SERVER_ERROR` (dropped, held); the other's `SERVER_ERROR` (passes).
#[test]
fn an_error_reaches_the_application_when_both_copies_fail() {
    for first in [0, 1] {
        let mut sel = hedged();
        assert_eq!(run_xdp(&mut sel, &error_reply(replica(first))).0, XDP_DROP);
        let (verdict, out) = run_xdp(&mut sel, &error_reply(replica(1 - first)));
        assert_eq!(verdict, XDP_PASS, "first {first}");
        assert_eq!(verified_endpoints(&out).0, replica(0));
        let s = stats(&sel);
        assert_eq!((s[0].error_replies, s[1].error_replies), (1, 1));
        assert_eq!(failures(&sel), [1, 1, 0]);
        balanced(&sel);
    }
}

/// An error held while the other copy was pending, and the other copy
/// never answers in time: nothing reaches the application by the timeout
/// (the held error was dropped; the kernel keeps no packet), and the
/// counts end. Played: GET to the primary, a hedge to member 1; the
/// primary's `SERVER_ERROR` (dropped); a sweep past the timeout (member
/// 1's copy expires); member 1's late good reply (passes: nothing had
/// reached the application).
#[test]
fn a_held_error_whose_other_copy_expires_leaves_the_read_to_the_application() {
    let mut sel = hedged();
    assert_eq!(run_xdp(&mut sel, &error_reply(replica(0))).0, XDP_DROP);
    let report = sel.sweep(sys::monotonic_ns() + 1_200_000_000).unwrap();
    assert_eq!((report.expired, report.hedges_expired), (0, 1));
    assert_eq!(
        sel.accounting().unwrap(),
        vec![(1, 1, 0), (1, 0, 1), (0, 0, 0)]
    );
    let (verdict, out) = run_xdp(&mut sel, &reply(replica(1)));
    assert_eq!(verdict, XDP_PASS);
    assert_eq!(verified_endpoints(&out).0, replica(0));
    balanced(&sel);
}

/// No hedge sent yet: the error is the only reply that can come, so it
/// passes, and no hedge can start any more.
#[test]
fn an_error_reply_to_an_unhedged_read_passes() {
    let mut sel = offering();
    assert_eq!(egress(&mut sel, &request(GET)).0, TC_ACT_PIPE);
    assert_eq!(run_xdp(&mut sel, &error_reply(replica(0))).0, XDP_PASS);
    assert!(!sel.plant_hedge(&key(), 1), "answered: no hedge");
    assert_eq!(stats(&sel)[0].error_replies, 1);
    balanced(&sel);
}
