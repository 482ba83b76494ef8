//! Outlier ejection and error replies through BPF_PROG_TEST_RUN (issue 20):
//! the reply path classifies replies by protocol and counts failures in a
//! row; egress never moves a read to an ejected member, moves reads off an
//! ejected primary at once, and sends one read, not two, to a half-open
//! member. Programs are loaded, not attached; the agent's step
//! (`check_ejection`) is called by hand.

use std::time::Duration;

use selector_common::InflightKey;
use selector_common::{Descriptor, programs};
use selector_testbed::frames::{
    CLIENT, CLIENT_PORT, DNS_QUERY, TC_ACT_PIPE, TC_ACT_REDIRECT, XDP_PASS, dns_server, egress,
    replica, request, run_tc, run_xdp, set_issued, settings_for, stats, udp, verified_endpoints,
};
use selector_testbed::loaded::{self, Loaded};
use selector_user::{Selector, host::sys};

fn memcached() -> Loaded {
    loaded::load(&settings_for(Descriptor::memcached(), replica)).expect("load")
}

/// A memcached selector whose ejections last `base`, doubling up to `max`.
fn ejecting_for(base: Duration, max: Duration) -> Loaded {
    let mut settings = settings_for(Descriptor::memcached(), replica);
    settings.ejection.base = base;
    settings.ejection.max = max;
    loaded::load(&settings).expect("load")
}

/// A memcached reply with request id `id` and `body` after the frame header.
fn mc_reply(id: u16, body: &[u8]) -> Vec<u8> {
    let mut p = id.to_be_bytes().to_vec();
    p.extend_from_slice(b"\x00\x00\x00\x01\x00\x00");
    p.extend_from_slice(body);
    p
}

fn mc_get(id: u16) -> Vec<u8> {
    mc_reply(id, b"get foo\r\n")
}

/// Plants request `id` from the client, addressed to member `primary`, sent
/// to `chosen`, and answers it from `chosen` with `payload` through XDP or
/// TC ingress.
fn answer(sel: &mut Selector, tc: bool, id: u16, primary: u32, chosen: u32, payload: &[u8]) {
    let key = InflightKey::ipv4(CLIENT, CLIENT_PORT, 0, u64::from(id));
    assert!(sel.plant_inflight(&key, primary, chosen, sys::monotonic_ns() - 1_000_000));
    let from = if sel.settings.descriptor == Descriptor::dns() {
        dns_server(chosen as usize)
    } else {
        replica(chosen as usize)
    };
    let frame = udp(from, (CLIENT, CLIENT_PORT), payload);
    let verdict = if tc {
        run_tc(sel, programs::INGRESS_TC, &frame).0
    } else {
        run_xdp(sel, &frame).0
    };
    assert_eq!(verdict, if tc { TC_ACT_PIPE } else { XDP_PASS });
}

fn failures(sel: &Selector) -> Vec<u64> {
    sel.ejection_states(sys::monotonic_ns())
        .iter()
        .map(|e| e.failures_in_a_row)
        .collect()
}

fn states(sel: &Selector) -> Vec<String> {
    sel.ejection_states(sys::monotonic_ns())
        .into_iter()
        .map(|e| e.ejection_state)
        .collect()
}

#[test]
fn memcached_server_error_is_a_failure_and_a_good_reply_ends_the_run() {
    for tc in [false, true] {
        let mut sel = memcached();
        // Moved to replica 1: an error the selector caused.
        answer(
            &mut sel,
            tc,
            1,
            0,
            1,
            &mc_reply(1, b"SERVER_ERROR out of memory\r\n"),
        );
        answer(
            &mut sel,
            tc,
            2,
            1,
            1,
            &mc_reply(2, b"SERVER_ERROR busy\r\n"),
        );
        // The client's own fault: not the replica's.
        answer(
            &mut sel,
            tc,
            3,
            1,
            1,
            &mc_reply(3, b"CLIENT_ERROR bad data chunk\r\n"),
        );
        answer(&mut sel, tc, 4, 1, 1, &mc_reply(4, b"ERROR\r\n"));
        let s = stats(&sel);
        assert_eq!(
            (s[1].responses, s[1].error_replies, s[1].error_replies_moved),
            (4, 2, 1),
            "tc {tc}"
        );
        // The two errors made a run of two; the client errors, good
        // replies, ended it.
        assert_eq!(failures(&sel), [0, 0, 0], "tc {tc}");
        answer(&mut sel, tc, 5, 1, 1, &mc_reply(5, b"SERVER_ERROR x\r\n"));
        answer(&mut sel, tc, 6, 1, 1, &mc_reply(6, b"SERVER_ERROR x\r\n"));
        answer(&mut sel, tc, 7, 1, 1, &mc_reply(7, b"SERVER_ERROR x\r\n"));
        assert_eq!(failures(&sel), [0, 3, 0], "tc {tc}");
        answer(
            &mut sel,
            tc,
            8,
            1,
            1,
            &mc_reply(8, b"VALUE foo 0 1\r\nx\r\nEND\r\n"),
        );
        assert_eq!(failures(&sel), [0, 0, 0], "tc {tc}");
        assert_eq!(sel.pending().unwrap(), [0, 0, 0]);
    }
}

#[test]
fn dns_refused_servfail_notimp_formerr_are_failures_and_nxdomain_is_not() {
    for tc in [false, true] {
        let mut sel = loaded::load(&settings_for(Descriptor::dns(), dns_server)).expect("load");
        let reply = |id: u16, rcode: u8| {
            let mut r = DNS_QUERY.to_vec();
            r[..2].copy_from_slice(&id.to_be_bytes());
            r[2] |= 0x80;
            r[3] = 0x80 | rcode;
            r
        };
        for (id, rcode) in [(1u16, 5u8), (2, 2), (3, 4), (4, 1)] {
            answer(&mut sel, tc, id, 0, 2, &reply(id, rcode));
        }
        assert_eq!(failures(&sel), [0, 0, 4], "tc {tc}");
        let s = stats(&sel);
        assert_eq!((s[2].error_replies, s[2].error_replies_moved), (4, 4));
        // NXDOMAIN is an answer.
        answer(&mut sel, tc, 5, 2, 2, &reply(5, 3));
        assert_eq!(failures(&sel), [0, 0, 0], "tc {tc}");
        assert_eq!(stats(&sel)[2].error_replies, 4);
    }
}

#[test]
fn a_custom_error_marker_marks_error_replies() {
    let d = Descriptor::custom(0, 2, 0, b"")
        .unwrap()
        .with_error_marker(2, b"ERR")
        .unwrap();
    let mut sel = loaded::load(&settings_for(d, replica)).expect("load");
    answer(&mut sel, false, 1, 0, 1, b"\x00\x01ERR: disk gone");
    answer(&mut sel, false, 2, 0, 1, b"\x00\x02OK. all good...");
    let s = stats(&sel);
    assert_eq!((s[1].responses, s[1].error_replies), (2, 1));
}

/// Five error replies from `member`, then the agent's step.
fn fail(sel: &mut Selector, member: u32, first_id: u16) {
    for id in first_id..first_id + 5 {
        answer(
            sel,
            false,
            id,
            member,
            member,
            &mc_reply(id, b"SERVER_ERROR x\r\n"),
        );
    }
    sel.check_ejection(sys::monotonic_ns());
}

#[test]
fn the_check_reads_each_groups_own_drained_members() {
    let mut settings = settings_for(Descriptor::memcached(), replica);
    // A second group, whose member 1 is drained: group 0's member 1 is
    // not, and only a check that reads group 0's own word sees that.
    settings.groups.push(
        (3..6)
            .map(|i| std::net::SocketAddr::from(replica(i)))
            .collect(),
    );
    let mut sel = loaded::load(&settings).expect("load");
    let other = sel
        .backend_index(std::net::SocketAddr::from(replica(4)))
        .unwrap();
    sel.set_drained(other, true).unwrap();
    fail(&mut sel, 1, 100);
    assert_eq!(states(&sel)[..3], ["healthy", "ejected", "healthy"]);
    // Drained while ejected: the operator's choice wins, it is restored.
    sel.set_drained(1, true).unwrap();
    sel.check_ejection(sys::monotonic_ns());
    assert_eq!(states(&sel)[..3], ["healthy", "healthy", "healthy"]);
}

#[test]
fn a_member_a_reload_added_is_checked_too() {
    use std::{net::SocketAddr, time::Instant};

    use selector_user::datapath::regroup::{GroupTable, plan_groups};

    let mut sel = memcached();
    // The check keeps the members by group between checks: one before
    // the reload, so a check that kept them past it would not see the
    // added member.
    sel.check_ejection(sys::monotonic_ns());
    let addr = |(a, p): ([u8; 4], u16)| SocketAddr::from((a, p));
    let mut members = sel.settings.groups[0].clone();
    members.push(addr(replica(3)));
    let table = GroupTable::from_start(&sel.settings.groups, &[None]);
    let changes = plan_groups(&table, &[members], &[None], Instant::now()).unwrap();
    sel.apply_groups(&changes).unwrap();
    sel.backends = changes.table.backends();
    let added = sel.backend_index(addr(replica(3))).unwrap();
    fail(&mut sel, added, 100);
    assert_eq!(states(&sel), ["healthy", "healthy", "healthy", "ejected"]);
}

#[test]
fn an_ejected_replica_is_never_chosen_and_an_ejected_primary_is_left_at_once() {
    let mut sel = memcached();
    fail(&mut sel, 1, 100);
    assert_eq!(states(&sel), ["healthy", "ejected", "healthy"]);
    // The primary over the threshold: the read goes to replica 2, not to
    // the ejected (and least loaded) replica 1.
    set_issued(&mut sel, 0, 5);
    set_issued(&mut sel, 2, 1);
    let (verdict, out) = egress(&mut sel, &request(&mc_get(0x10)));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(verified_endpoints(&out).1, replica(2));

    // An ejected primary: its reads leave at once, below any threshold.
    let mut sel = memcached();
    fail(&mut sel, 0, 100);
    assert_eq!(states(&sel), ["ejected", "healthy", "healthy"]);
    let (verdict, out) = egress(&mut sel, &request(&mc_get(0x11)));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(verified_endpoints(&out).1, replica(1));
    assert_eq!(sel.ejection_states(sys::monotonic_ns())[0].ejections, 1);
}

/// The error that makes a run of `--eject-after` holds its member out of
/// the choice at once, before the agent's next check: a broken replica
/// answers in microseconds, and every read moved to it until the check
/// (10 ms) would come back an error. The check then ejects it. A group
/// with no room under the cap has no member held out that way.
#[test]
fn the_error_that_completes_a_run_stops_moved_reads_before_the_agents_check() {
    for tc in [false, true] {
        let mut sel = memcached();
        // The agent's first check, as within 10 ms of its start: it says
        // which members the reply path may mark.
        sel.check_ejection(sys::monotonic_ns());
        let server_error = |id: u16| mc_reply(id, b"SERVER_ERROR x\r\n");
        for id in 100..104 {
            answer(&mut sel, tc, id, 0, 1, &server_error(id));
        }
        // The primary far over the threshold, replica 1 the least loaded.
        set_issued(&mut sel, 0, 20);
        set_issued(&mut sel, 2, 3);
        let (verdict, out) = egress(&mut sel, &request(&mc_get(0x10)));
        assert_eq!(verdict, TC_ACT_REDIRECT);
        assert_eq!(
            verified_endpoints(&out).1,
            replica(1),
            "four errors: chosen"
        );
        answer(&mut sel, tc, 104, 0, 1, &server_error(104));
        assert_eq!(states(&sel), ["healthy"; 3], "no check yet, tc {tc}");
        let (_, out) = egress(&mut sel, &request(&mc_get(0x11)));
        assert_eq!(
            verified_endpoints(&out).1,
            replica(2),
            "the fifth error holds replica 1 out (1 pending against 3), tc {tc}"
        );
        sel.check_ejection(sys::monotonic_ns());
        assert_eq!(states(&sel), ["healthy", "ejected", "healthy"]);

        // No room: member 0 ejected, the one of three the cap allows. A
        // run of member 1 marks nothing; the check finds the group over
        // the cap and steers it by counts alone.
        let mut sel = memcached();
        fail(&mut sel, 0, 200);
        for id in 300..305 {
            answer(&mut sel, tc, id, 1, 1, &server_error(id));
        }
        set_issued(&mut sel, 2, 3);
        let (_, out) = egress(&mut sel, &request(&mc_get(0x20)));
        assert_eq!(
            verified_endpoints(&out).1,
            replica(1),
            "never more out than the cap, tc {tc}"
        );
        sel.check_ejection(sys::monotonic_ns());
        assert_eq!(sel.groups_over_cap(), [1], "tc {tc}");
        answer(&mut sel, tc, 305, 1, 1, &server_error(305));
        set_issued(&mut sel, 0, 20);
        let (_, out) = egress(&mut sel, &request(&mc_get(0x21)));
        assert_eq!(verified_endpoints(&out).1, replica(1), "tc {tc}");
    }
}

#[test]
fn a_half_open_member_gets_one_probe_and_a_good_reply_restores_it() {
    let mut sel = ejecting_for(Duration::from_millis(1), Duration::from_millis(1));
    fail(&mut sel, 0, 100);
    assert_eq!(states(&sel)[0], "ejected");
    std::thread::sleep(Duration::from_millis(2));
    sel.check_ejection(sys::monotonic_ns());
    assert_eq!(states(&sel)[0], "half_open");
    // The first read to the primary probes it; the next ones leave.
    let (verdict, _) = egress(&mut sel, &request(&mc_get(0x20)));
    assert_eq!(verdict, TC_ACT_PIPE, "the probe goes to the primary");
    for id in 0x21..0x24 {
        let (verdict, out) = egress(&mut sel, &request(&mc_get(id)));
        assert_eq!(verdict, TC_ACT_REDIRECT, "one probe only");
        assert_ne!(verified_endpoints(&out).1, replica(0));
    }
    sel.check_ejection(sys::monotonic_ns());
    assert_eq!(states(&sel)[0], "half_open", "no result yet");
    // The probe's good reply restores it.
    let reply = udp(
        replica(0),
        (CLIENT, CLIENT_PORT),
        &mc_reply(0x20, b"END\r\n"),
    );
    assert_eq!(run_xdp(&mut sel, &reply).0, XDP_PASS);
    sel.check_ejection(sys::monotonic_ns());
    assert_eq!(states(&sel)[0], "healthy");
    let (verdict, _) = egress(&mut sel, &request(&mc_get(0x30)));
    assert_eq!(verdict, TC_ACT_PIPE);
}

/// Sends read `id` to half-open member 0 (its probe: to the primary, not
/// moved), answers it with `body` from member 0, then the agent's step.
fn answer_probe(sel: &mut Selector, id: u16, body: &[u8]) {
    let (verdict, _) = egress(sel, &request(&mc_get(id)));
    assert_eq!(verdict, TC_ACT_PIPE, "the probe goes to the primary");
    let reply = udp(replica(0), (CLIENT, CLIENT_PORT), &mc_reply(id, body));
    assert_eq!(run_xdp(sel, &reply).0, XDP_PASS);
    sel.check_ejection(sys::monotonic_ns());
}

#[test]
fn a_failed_probe_ejects_again_for_longer() {
    let mut sel = ejecting_for(Duration::from_millis(1), Duration::from_secs(60));
    fail(&mut sel, 0, 100);
    std::thread::sleep(Duration::from_millis(2));
    sel.check_ejection(sys::monotonic_ns());
    answer_probe(&mut sel, 0x40, b"SERVER_ERROR x\r\n");
    let e = &sel.ejection_states(sys::monotonic_ns())[0];
    assert_eq!((e.ejection_state.as_str(), e.ejections), ("ejected", 2));
}

#[test]
fn with_ejection_off_nothing_is_ejected() {
    let mut settings = settings_for(Descriptor::memcached(), replica);
    settings.ejection.eject_after = 0;
    let mut sel = loaded::load(&settings).expect("load");
    fail(&mut sel, 1, 100);
    assert_eq!(states(&sel), ["healthy"; 3]);
}

/// Issue 20: a flapping replica must not be ejected and restored on every
/// other read. Through the real reply path and the agent's step after
/// every reply: errors and good replies alternating never make five in a
/// row, so nothing is ejected.
#[test]
fn a_replica_failing_every_other_read_is_never_ejected() {
    for tc in [false, true] {
        let mut sel = memcached();
        for id in 0..60u16 {
            let body: &[u8] = if id % 2 == 0 {
                b"SERVER_ERROR busy\r\n"
            } else {
                b"VALUE foo 0 1\r\nx\r\nEND\r\n"
            };
            answer(&mut sel, tc, id, 1, 1, &mc_reply(id, body));
            let lines = sel.check_ejection(sys::monotonic_ns());
            assert!(lines.is_empty(), "tc {tc}, reply {id}: {lines:?}");
        }
        assert_eq!(stats(&sel)[1].error_replies, 30, "tc {tc}");
        assert_eq!(states(&sel), ["healthy"; 3], "tc {tc}");
        assert_eq!(sel.ejection_states(sys::monotonic_ns())[1].ejections, 0);
    }
}

/// "ejected for X s" of a step's log line.
fn ejected_for(lines: &[String]) -> f64 {
    let line = lines
        .iter()
        .find(|l| l.contains(" ejected for "))
        .unwrap_or_else(|| panic!("no ejection in {lines:?}"));
    line.split(" ejected for ")
        .nth(1)
        .and_then(|rest| rest.split(" s ").next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{line}"))
}

/// A replica that fails in bursts and recovers in between (down, back for
/// a probe, down again): each ejection in a row lasts twice the last, so
/// it is not put back for every other read. The agent's clock is passed
/// in, so no time passes in the test.
#[test]
fn a_replica_that_keeps_coming_back_and_failing_is_ejected_for_longer_each_time() {
    let mut sel = memcached(); // the defaults: 5 s base, 5 min max
    let start = sys::monotonic_ns();
    let mut now = start;
    let mut lengths = Vec::new();
    let mut id = 0x100u16;
    for _ in 0..4 {
        for _ in 0..5 {
            answer(
                &mut sel,
                false,
                id,
                1,
                1,
                &mc_reply(id, b"SERVER_ERROR x\r\n"),
            );
            id += 1;
        }
        let lines = sel.check_ejection(now);
        let secs = ejected_for(&lines);
        lengths.push(secs);
        assert_eq!(states(&sel)[1], "ejected");
        // Until the ejection is up, still ejected.
        now += (secs * 0.9 * 1e9) as u64;
        assert!(sel.check_ejection(now).is_empty());
        assert_eq!(states(&sel)[1], "ejected");
        now += (secs * 0.2 * 1e9) as u64;
        sel.check_ejection(now);
        assert_eq!(states(&sel)[1], "half_open");
        // One good reply (the probe's) restores it.
        answer(&mut sel, false, id, 1, 1, &mc_reply(id, b"END\r\n"));
        id += 1;
        sel.check_ejection(now);
        assert_eq!(states(&sel)[1], "healthy");
    }
    println!("ejection lengths: {lengths:?} s");
    assert_eq!(sel.ejection_states(now)[1].ejections, 4);
    // 5 s, 10 s, 20 s, 40 s, each less up to a quarter of jitter.
    for (k, secs) in lengths.iter().enumerate() {
        let full = 5.0 * f64::from(1 << k);
        assert!(
            *secs >= full * 0.75 - 0.05 && *secs <= full + 0.05,
            "ejection {}: {secs} s",
            k + 1
        );
    }
}

/// Every member failing: the cap (half of three: one) is never exceeded,
/// the group is steered by counts alone and says so, and every read still
/// goes out to a member of the group: none is dropped for want of one.
#[test]
fn every_member_failing_ejects_none_beyond_the_cap_and_drops_no_read() {
    let mut sel = memcached();
    fail(&mut sel, 0, 100);
    assert_eq!(states(&sel), ["ejected", "healthy", "healthy"]);
    assert!(sel.groups_over_cap().is_empty());
    fail(&mut sel, 1, 200);
    // Two failing out of three, one allowed: over the cap, the ejected
    // one released.
    assert_eq!(states(&sel), ["healthy"; 3]);
    assert_eq!(sel.groups_over_cap(), [1]);
    fail(&mut sel, 2, 300);
    assert_eq!(states(&sel), ["healthy"; 3]);
    assert_eq!(sel.groups_over_cap(), [1]);
    for id in 0x400..0x440u16 {
        let (verdict, out) = egress(&mut sel, &request(&mc_get(id)));
        assert!(
            verdict == TC_ACT_PIPE || verdict == TC_ACT_REDIRECT,
            "read {id:#x}: verdict {verdict}"
        );
        let to = verified_endpoints(&out).1;
        assert!((0..3).any(|i| replica(i) == to), "{to:?}");
        sel.check_ejection(sys::monotonic_ns());
        let ejected = states(&sel).iter().filter(|s| *s != "healthy").count();
        assert_eq!(ejected, 0);
    }
    assert_eq!(sel.groups_over_cap(), [1]);
}

/// The sweep finds expiries a timeout after their send, in a batch; a
/// member that answered well since they were sent (back after an outage,
/// or losing one read in two) is not failing in a row, and the batch must
/// not eject it.
#[test]
fn expiries_sent_before_a_later_good_reply_are_no_failures_in_a_row() {
    let mut sel = memcached();
    let now = sys::monotonic_ns();
    for id in 0..8u16 {
        let key = InflightKey::ipv4(CLIENT, CLIENT_PORT, 0, u64::from(0x500 + id));
        assert!(sel.plant_inflight(&key, 1, 1, now - 3_000_000_000));
    }
    sel.check_ejection(sys::monotonic_ns());
    // A read sent later is answered well.
    answer(&mut sel, false, 0x600, 1, 1, &mc_reply(0x600, b"END\r\n"));
    sel.check_ejection(sys::monotonic_ns());
    let report = sel.sweep(sys::monotonic_ns()).unwrap();
    assert_eq!(report.expired, 8);
    assert_eq!(failures(&sel), [0, 0, 0]);
    assert!(sel.check_ejection(sys::monotonic_ns()).is_empty());
    assert_eq!(states(&sel), ["healthy"; 3]);

    // No good reply since: the same batch is eight failures in a row.
    let mut sel = memcached();
    for id in 0..8u16 {
        let key = InflightKey::ipv4(CLIENT, CLIENT_PORT, 0, u64::from(0x500 + id));
        assert!(sel.plant_inflight(&key, 1, 1, now - 3_000_000_000));
    }
    sel.check_ejection(sys::monotonic_ns());
    sel.sweep(sys::monotonic_ns()).unwrap();
    assert_eq!(failures(&sel), [0, 8, 0]);
    sel.check_ejection(sys::monotonic_ns());
    assert_eq!(states(&sel), ["healthy", "ejected", "healthy"]);
}

/// The agent checks ejection often only while something is in motion
/// (`Selector::ejection_settled`): not before a first check, settled once
/// a check finds every member healthy and no failure counted, in motion
/// from a check that finds one error reply counted (the reply path marks
/// a member failing by itself, but the run must be followed), through the
/// ejection and the half-open probe, and settled again once the probe's
/// good reply restored the member.
#[test]
fn ejection_is_settled_only_while_nothing_is_in_motion() {
    let mut sel = ejecting_for(Duration::from_millis(1), Duration::from_millis(1));
    assert!(!sel.ejection_settled(), "nothing checked yet");
    sel.check_ejection(sys::monotonic_ns());
    assert!(sel.ejection_settled(), "healthy, no failure");
    answer(
        &mut sel,
        false,
        90,
        0,
        0,
        &mc_reply(90, b"SERVER_ERROR x\r\n"),
    );
    sel.check_ejection(sys::monotonic_ns());
    assert!(!sel.ejection_settled(), "one failure counted");
    fail(&mut sel, 0, 100);
    assert_eq!(states(&sel)[0], "ejected");
    assert!(!sel.ejection_settled(), "ejected");
    std::thread::sleep(Duration::from_millis(2));
    sel.check_ejection(sys::monotonic_ns());
    assert_eq!(states(&sel)[0], "half_open");
    assert!(!sel.ejection_settled(), "half-open");
    answer_probe(&mut sel, 0x20, b"END\r\n");
    assert_eq!(states(&sel)[0], "healthy");
    assert!(sel.ejection_settled(), "restored by its probe");
}

/// A member a reload puts at the position of one that retired while
/// ejected starts healthy: it inherits none of the other's failures in a
/// row, good replies, last completion or ejection record.
#[test]
fn a_member_added_where_an_ejected_one_retired_starts_healthy() {
    use std::{net::SocketAddr, time::Instant};

    use selector_common::split_backend_id;
    use selector_user::datapath::regroup::{GroupTable, plan_groups};

    let addr = |(a, p): ([u8; 4], u16)| SocketAddr::from((a, p));
    let mut sel = memcached();
    fail(&mut sel, 1, 100);
    assert_eq!(states(&sel), ["healthy", "ejected", "healthy"]);
    // Reloaded away, then retired once nothing names it.
    let table = GroupTable::from_start(&sel.settings.groups, &[None]);
    let without = vec![addr(replica(0)), addr(replica(2))];
    let changes = plan_groups(
        &table,
        std::slice::from_ref(&without),
        &[None],
        Instant::now(),
    )
    .unwrap();
    sel.apply_groups(&changes).unwrap();
    sel.backends = changes.table.backends();
    let mut table = changes.table;
    let retired = sel
        .retire_finished(&mut table, Duration::ZERO, Instant::now())
        .unwrap();
    assert_eq!(retired, [addr(replica(1))]);
    sel.check_ejection(sys::monotonic_ns());
    // A newcomer takes its position.
    let with = vec![without[0], without[1], addr(replica(3))];
    let changes = plan_groups(&table, &[with], &[None], Instant::now()).unwrap();
    sel.apply_groups(&changes).unwrap();
    sel.backends = changes.table.backends();
    let newcomer = sel.backend_index(addr(replica(3))).unwrap();
    assert_eq!(
        split_backend_id(newcomer).1,
        1,
        "the retired one's position"
    );
    for _ in 0..3 {
        sel.check_ejection(sys::monotonic_ns());
    }
    let states = sel.ejection_states(sys::monotonic_ns());
    let position = sel
        .backends
        .iter()
        .position(|b| b.addr == addr(replica(3)))
        .unwrap();
    let newcomer_state = &states[position];
    assert_eq!(
        (
            newcomer_state.ejection_state.as_str(),
            newcomer_state.failures_in_a_row,
            newcomer_state.ejections
        ),
        ("healthy", 0, 0),
        "{states:?}"
    );
    // It is chosen: the primary over the threshold moves a read to it.
    set_issued(&mut sel, 0, 5);
    set_issued(&mut sel, 2, 3);
    let (verdict, out) = egress(&mut sel, &request(&mc_get(0x20)));
    assert_eq!(verdict, TC_ACT_REDIRECT);
    assert_eq!(verified_endpoints(&out).1, replica(3));
}

/// A half-open member's one probe is taken by a tracked new read only: a
/// write, junk to its port and a retransmit of a read already in flight
/// leave it for the next read.
#[test]
fn only_a_new_read_takes_a_half_open_members_probe() {
    let set = mc_reply(0x51, b"set foo 0 0 1\r\nx\r\n");
    let noreply = mc_reply(0x52, b"set foo 0 0 1 noreply\r\nx\r\n");
    for (what, payload) in [
        ("a write", &set[..]),
        ("a write that expects no reply", &noreply[..]),
        ("junk", &b"\x00\x01"[..]),
        ("a retransmit", &mc_get(0x50)[..]),
    ] {
        let mut sel = ejecting_for(Duration::from_millis(1), Duration::from_millis(1));
        // A read in flight to the primary from before it failed.
        let (verdict, _) = egress(&mut sel, &request(&mc_get(0x50)));
        assert_eq!(verdict, TC_ACT_PIPE);
        fail(&mut sel, 0, 100);
        std::thread::sleep(Duration::from_millis(2));
        sel.check_ejection(sys::monotonic_ns());
        assert_eq!(states(&sel)[0], "half_open");
        let (verdict, _) = egress(&mut sel, &request(payload));
        assert_eq!(verdict, TC_ACT_PIPE, "{what} goes where it was sent");
        // The next new read is the probe, to the primary.
        let (verdict, _) = egress(&mut sel, &request(&mc_get(0x60)));
        assert_eq!(
            verdict, TC_ACT_PIPE,
            "after {what}, the probe was still there"
        );
        // And only it.
        let (verdict, _) = egress(&mut sel, &request(&mc_get(0x61)));
        assert_eq!(verdict, TC_ACT_REDIRECT, "one probe, after {what}");
    }
}
