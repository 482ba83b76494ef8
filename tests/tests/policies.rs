//! The kernel honours the tie-break and the latency policy: packet runs
//! through BPF_PROG_TEST_RUN on a loaded (not attached) selector, with the
//! counts and service times planted.

use std::time::Duration;

use selector_common::{Descriptor, Policy, TieBreak};
use selector_testbed::frames::{
    CLIENT, CLIENT_PORT, GET, TC_ACT_PIPE, TC_ACT_REDIRECT, VALUE, XDP_PASS, egress, replica,
    request, run_xdp, set_issued, settings_for, udp, verified_endpoints,
};
use selector_user::{Selector, Settings};

const MS: u64 = 1_000_000;

/// A group of `members` laid out as `replica(i)`, with `tweak` applied.
fn selector(members: usize, tweak: impl FnOnce(Settings) -> Settings) -> Selector {
    let base = settings_for(Descriptor::memcached(), replica);
    let group = (0..members)
        .map(|i| {
            let (a, p) = replica(i);
            std::net::SocketAddr::from((a, p))
        })
        .collect();
    Selector::load(&tweak(Settings {
        groups: vec![group],
        ..base
    }))
    .expect("load")
}

fn with_id(payload: &[u8], id: u16) -> Vec<u8> {
    let mut p = payload.to_vec();
    p[..2].copy_from_slice(&id.to_be_bytes());
    p
}

/// Sends read `id` to the primary and returns the member it went to.
fn send_read(sel: &mut Selector, id: u16) -> usize {
    let (verdict, out) = egress(sel, &request(&with_id(GET, id)));
    if verdict == TC_ACT_PIPE {
        return 0;
    }
    assert_eq!(verdict, TC_ACT_REDIRECT);
    let dst = verified_endpoints(&out).1;
    (0..8).find(|i| replica(*i) == dst).expect("a member")
}

/// The reply to read `id` from `member`, completing it.
fn reply(sel: &mut Selector, id: u16, member: usize) {
    let frame = udp(replica(member), (CLIENT, CLIENT_PORT), &with_id(VALUE, id));
    assert_eq!(run_xdp(sel, &frame).0, XDP_PASS);
}

/// Where 2000 reads go with the primary far over its threshold and four
/// replicas equally idle (each read answered before the next). A completed
/// redirected read keeps its slot for the grace period (to rewrite a late
/// reply), so the table is sized for all 2000 to stay below a few percent
/// full: none passes untracked.
fn shares(tie_break: TieBreak) -> Vec<u32> {
    let mut sel = selector(5, |s| {
        Settings {
            inflight_max: 16_384,
            ..s
        }
        .tuned(|t| {
            t.tie_break = tie_break;
        })
    });
    set_issued(&mut sel, 0, 1_000_000);
    let mut counts = vec![0u32; 5];
    for id in 0..2000u16 {
        let to = send_read(&mut sel, id);
        counts[to] += 1;
        reply(&mut sel, id, to);
    }
    assert_eq!(sel.pending().unwrap()[1..], [0, 0, 0, 0]);
    assert_eq!(sel.stats().unwrap()[0].untracked, 0);
    counts
}

#[test]
fn random_tie_break_gives_every_equally_loaded_replica_a_fair_share() {
    let random = shares(TieBreak::Random);
    assert_eq!(random[0], 0, "{random:?}");
    // 500 each expected; a binomial standard deviation is about 19.
    for (member, n) in random.iter().enumerate().skip(1) {
        assert!((400..=600).contains(n), "member {member}: {random:?}");
    }
    // `first`: BookKeeper's first strict minimum, every time.
    assert_eq!(shares(TieBreak::First), vec![0, 2000, 0, 0, 0]);
}

#[test]
fn random_tie_break_leaves_drained_members_out() {
    let mut sel = selector(4, |s| {
        s.tuned(|t| {
            t.tie_break = TieBreak::Random;
        })
    });
    set_issued(&mut sel, 0, 1_000_000);
    sel.set_drained(2, true).unwrap();
    let mut counts = [0u32; 4];
    for id in 0..300u16 {
        let to = send_read(&mut sel, id);
        counts[to] += 1;
        reply(&mut sel, id, to);
    }
    assert_eq!((counts[0], counts[2]), (0, 0), "{counts:?}");
    assert!(counts[1] > 90 && counts[3] > 90, "{counts:?}");
}

/// A latency-policy selector with 2 ms budget, pending counts `pending`
/// and service times `service` planted.
fn latency_case(pending: [u64; 3], service: [u64; 3]) -> usize {
    let mut sel = selector(3, |s| {
        s.tuned(|t| {
            t.policy = Policy::Latency;
            t.budget = Duration::from_millis(2);
        })
    });
    for (pos, (p, s)) in pending.iter().zip(service).enumerate() {
        set_issued(&mut sel, pos, *p);
        sel.plant_service_time(pos as u32, s);
    }
    send_read(&mut sel, 7)
}

#[test]
fn latency_policy_moves_reads_by_expected_wait() {
    // 3 ms against 1 ms (replica 1) and 0 (replica 2): over the budget.
    assert_eq!(latency_case([3, 1, 0], [MS, MS, MS]), 2);
    // The same counts at 0.1 ms per request: 0.3 ms, within the budget.
    assert_eq!(latency_case([3, 1, 0], [MS / 10; 3]), 0);
    // 1.9 ms over the best: stays; 2 ms: moves.
    assert_eq!(latency_case([19, 0, 0], [MS / 10; 3]), 0);
    assert_eq!(latency_case([20, 0, 0], [MS / 10; 3]), 1);
    // Replica 2 has more pending than replica 1 but serves 8x faster.
    assert_eq!(latency_case([8, 4, 5], [MS, MS, MS / 8]), 2);
    // A rarely used replica's long time per completion is bounded by the
    // primary's: one pending read there weighs 1 ms, not 50.
    assert_eq!(latency_case([4, 1, 1], [MS, 50 * MS, 50 * MS]), 1);
    // Count policies ignore service times: threshold 1 moves on [1, 0, 0].
    let mut sel = selector(3, |s| s);
    set_issued(&mut sel, 0, 1);
    sel.plant_service_time(0, 1);
    assert_eq!(send_read(&mut sel, 7), 1);
}

#[test]
fn the_reply_path_measures_each_backends_time_per_completion() {
    let mut sel = selector(3, |s| s);
    assert_eq!(sel.service_times(), vec![0, 0, 0]);
    for id in 0..3u16 {
        assert_eq!(send_read(&mut sel, id), 0);
        std::thread::sleep(Duration::from_millis(2));
        reply(&mut sel, id, 0);
    }
    let service = sel.service_times();
    // Two gaps of at least 2 ms between three completions.
    assert!(service[0] >= 2 * MS && service[0] < 100 * MS, "{service:?}");
    assert_eq!(service[1..], [0, 0]);
}
