//! The two races the in-flight table closes, provoked for real: requests
//! (TC egress), replies (XDP ingress) and the agent's sweep run at the same
//! time on one loaded selector, with a 1 ms timeout and a handful of request
//! ids reused as soon as they are gone, replies timed around the timeout.
//!
//! - Reply / sweep / id reuse: a reply reads a live entry, the sweep expires
//!   it (or the reply completes it under the sweep), the client reuses the
//!   id; whoever loses the compare-and-swap must not count, and must not
//!   touch the new instance.
//! - Entry reuse: a slot read on the reply path is handed to another key (or
//!   another instance of the same key) while it is read.
//!
//! Afterwards every request is accounted for exactly once (issued ==
//! completed + expired, per backend; the sweep's own tally of what it
//! expired equals the expired counters; the reply path's outcomes add up to
//! the replies sent), nothing is left pending, and every reply the ingress
//! program rewrote names the primary, with valid checksums.

use std::{
    os::fd::{AsFd as _, BorrowedFd, OwnedFd},
    sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use aya::maps::Array;
use selector_common::{
    Descriptor, InflightKey,
    inflight::{InflightSlot, client_slot},
    names, programs,
};
use selector_testbed::frames::{
    CLIENT, IP_CHECK, IP_DST, IP_SRC, REPLICAS, TC_ACT_PIPE, TC_ACT_REDIRECT, UDP_CHECK, UDP_DST,
    UDP_SRC, XDP_DROP, XDP_PASS, assert_only_changed, replica, settings_for, stats, udp,
    verified_endpoints,
};
use selector_user::{Selector, datapath::sweep::SweepReport, host::sys};

/// Client sockets, and request ids per socket: `PORTS * IDS` keys, each
/// reissued as soon as it is gone.
const PORTS: usize = 8;
const IDS: usize = 4;
const KEYS: usize = PORTS * IDS;
const FIRST_PORT: u16 = 40_000;
const FIRST_ID: u16 = 0x0100;

const TIMEOUT: Duration = Duration::from_millis(1);
const GRACE: Duration = Duration::from_millis(1);
const TIMEOUT_NS: u64 = 1_000_000;
/// The run lasts `RUN`, longer (up to `RUN_MAX`) until `RACES_WANTED` races
/// between the reply path and the sweep were seen: on a busy machine the
/// threads share few moments on two cores at once.
const RUN: Duration = Duration::from_millis(2500);
const RUN_MAX: Duration = Duration::from_secs(10);
const RACES_WANTED: u64 = 5;

/// BPF_PROG_TEST_RUN on a program descriptor: aya's programs are not
/// shared between threads, a descriptor is. (verdict, output frame).
fn test_run(prog: BorrowedFd<'_>, input: &[u8]) -> (u32, Vec<u8>) {
    selector_testbed::frames::test_run_fd(prog, input, 0)
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN: {e}"))
}

fn program_fd(sel: &Selector, name: &str) -> OwnedFd {
    sel.ebpf()
        .program(name)
        .unwrap()
        .fd()
        .unwrap()
        .as_fd()
        .try_clone_to_owned()
        .unwrap()
}

/// xorshift64*: reproducible enough, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// Uniform in `[lo, hi)`.
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo)
    }
}

fn port(key: usize) -> u16 {
    FIRST_PORT + (key / IDS) as u16
}

fn id(key: usize) -> u16 {
    FIRST_ID + (key % IDS) as u16
}

/// memcached UDP frame header: request id, datagram 0 of 1.
fn frame_header(key: usize) -> Vec<u8> {
    let [hi, lo] = id(key).to_be_bytes();
    vec![hi, lo, 0, 0, 0, 1, 0, 0]
}

fn request(key: usize) -> Vec<u8> {
    let mut payload = frame_header(key);
    payload.extend_from_slice(b"get foo\r\n");
    udp((CLIENT, port(key)), replica(0), &payload)
}

fn reply(key: usize, from: usize) -> Vec<u8> {
    let mut payload = frame_header(key);
    payload.extend_from_slice(b"VALUE foo 0 3\r\nbar\r\nEND\r\n");
    udp(replica(from), (CLIENT, port(key)), &payload)
}

/// What the request and reply threads tell each other, per key.
struct Shared {
    stop: AtomicBool,
    /// CLOCK_MONOTONIC just before the requester's latest send (0: never).
    sent_at: Vec<AtomicU64>,
    /// The replica that send went to.
    chosen: Vec<AtomicUsize>,
    /// The `sent_at` the replier last answered.
    replied: Vec<AtomicU64>,
}

#[derive(Debug, Default)]
struct RequestTally {
    sent: u64,
    /// Sends that left for replica i (0: not redirected).
    went_to: [u64; REPLICAS],
}

/// Sends requests, and answers half of them itself right away (from the
/// replica each went to). A key is sent again right after its reply, or
/// around the timeout (a reuse racing the sweep), or early (a retransmit of
/// a live request).
fn requester(
    prog: OwnedFd,
    ingress: OwnedFd,
    shared: &Shared,
    seed: u64,
) -> (RequestTally, ReplyTally) {
    let mut rng = Rng(seed);
    let mut tally = RequestTally::default();
    let mut answers = ReplyTally::default();
    let mut due = vec![0u64; KEYS];
    let mut last = vec![0u64; KEYS];
    let frames: Vec<Vec<u8>> = (0..KEYS).map(request).collect();
    while !shared.stop.load(Ordering::Relaxed) {
        let mut idle = true;
        for key in 0..KEYS {
            let now = sys::monotonic_ns();
            if last[key] != 0 && shared.replied[key].load(Ordering::Acquire) == last[key] {
                // Answered: reuse the id at once.
                due[key] = due[key].min(now + rng.below(20_000));
            }
            if now < due[key] {
                continue;
            }
            idle = false;
            let t = sys::monotonic_ns();
            shared.sent_at[key].store(t, Ordering::Release);
            let input = &frames[key];
            let (verdict, out) = test_run(prog.as_fd(), input);
            let to = match verdict {
                TC_ACT_PIPE => {
                    assert_eq!(&out, input, "a request passed changed");
                    0
                }
                TC_ACT_REDIRECT => {
                    assert_only_changed(input, &out, &[IP_CHECK, IP_DST, UDP_DST, UDP_CHECK]);
                    let (src, dst) = verified_endpoints(&out);
                    assert_eq!(src, (CLIENT, port(key)));
                    (1..REPLICAS)
                        .find(|&i| replica(i) == dst)
                        .unwrap_or_else(|| panic!("request redirected to {dst:?}"))
                }
                v => panic!("egress verdict {v}"),
            };
            shared.chosen[key].store(to, Ordering::Release);
            tally.sent += 1;
            tally.went_to[to] += 1;
            last[key] = t;
            if rng.below(2) == 0 {
                // Answered a moment after it was sent: races a sweep that
                // finds every request due, then the id is reused at once.
                send_reply(ingress.as_fd(), key, to, &mut answers);
                due[key] = t + rng.below(20_000);
                continue;
            }
            due[key] = if rng.below(4) == 0 {
                t + rng.between(300_000, 900_000)
            } else {
                t + rng.between(TIMEOUT_NS, TIMEOUT_NS + 100_000)
            };
        }
        if idle {
            std::thread::yield_now();
        }
    }
    (tally, answers)
}

#[derive(Debug, Default)]
struct ReplyTally {
    /// Replies sent from replica i.
    sent: [u64; REPLICAS],
    /// Of them, rewritten by the ingress program.
    rewritten: [u64; REPLICAS],
    /// Of them, dropped: an older instance's reply while a newer request
    /// with its id waited (the id is reused as soon as it is answered).
    dropped: [u64; REPLICAS],
}

/// Runs one reply from replica `from` through XDP and checks the result: a
/// reply is passed, and if rewritten, only its source changed, to the
/// primary, with valid checksums; or dropped as stale.
fn send_reply(prog: BorrowedFd<'_>, key: usize, from: usize, tally: &mut ReplyTally) {
    let input = reply(key, from);
    let (verdict, out) = test_run(prog, &input);
    tally.sent[from] += 1;
    if verdict == XDP_DROP {
        tally.dropped[from] += 1;
        return;
    }
    assert_eq!(verdict, XDP_PASS);
    if out == input {
        return;
    }
    assert_ne!(from, 0, "a reply from the primary was rewritten");
    assert_only_changed(&input, &out, &[IP_CHECK, IP_SRC, UDP_SRC, UDP_CHECK]);
    let (src, dst) = verified_endpoints(&out);
    assert_eq!(src, replica(0), "reply rewritten to a wrong source");
    assert_eq!(dst, (CLIENT, port(key)));
    tally.rewritten[from] += 1;
}

/// Answers each send once: a third at once, a third early, a third within
/// 30 µs of the timeout (racing the sweep); from the replica it went to, sometimes twice, and
/// sometimes from another replica as well.
fn replier(prog: OwnedFd, shared: &Shared, seed: u64) -> ReplyTally {
    let mut rng = Rng(seed);
    let mut tally = ReplyTally::default();
    let mut seen = vec![0u64; KEYS];
    let mut due = vec![u64::MAX; KEYS];
    while !shared.stop.load(Ordering::Relaxed) {
        let mut idle = true;
        for key in 0..KEYS {
            let sent = shared.sent_at[key].load(Ordering::Acquire);
            if sent == 0 {
                continue;
            }
            if sent != seen[key] {
                seen[key] = sent;
                due[key] = match rng.below(3) {
                    0 => sent,
                    1 => sent + rng.between(50_000, 900_000),
                    _ => sent + rng.between(TIMEOUT_NS - 30_000, TIMEOUT_NS + 30_000),
                };
            }
            if sys::monotonic_ns() < due[key] {
                continue;
            }
            idle = false;
            due[key] = u64::MAX;
            let to = shared.chosen[key].load(Ordering::Acquire);
            send_reply(prog.as_fd(), key, to, &mut tally);
            if rng.below(4) == 0 {
                let other = (to + 1 + rng.below(REPLICAS as u64 - 1) as usize) % REPLICAS;
                send_reply(prog.as_fd(), key, other, &mut tally);
            }
            if rng.below(8) == 0 {
                send_reply(prog.as_fd(), key, to, &mut tally);
            }
            shared.replied[key].store(sent, Ordering::Release);
        }
        if idle {
            std::thread::yield_now();
        }
    }
    tally
}

fn add(total: &mut SweepReport, r: SweepReport) {
    total.expired += r.expired;
    total.lost_race += r.lost_race;
    total.freed += r.freed;
}

/// No backend's completions and expiries ever exceed its issues: completed
/// and expired are read before issued is read again.
fn assert_no_overcount(sel: &Selector) {
    let before = sel.accounting().unwrap();
    let after = sel.accounting().unwrap();
    for (b, ((_, completed, expired), (issued, _, _))) in before.iter().zip(&after).enumerate() {
        assert!(
            completed + expired <= *issued,
            "backend {b}: completed {completed} + expired {expired} > issued {issued}"
        );
    }
}

#[test]
fn replies_sweeps_and_id_reuse_race_without_drift() {
    let mut settings = settings_for(Descriptor::memcached(), replica);
    settings.timeout = TIMEOUT;
    settings.grace = GRACE;
    settings.inflight_max = 64;
    let mut sel = Selector::load(&settings).expect("load");
    let egress = program_fd(&sel, programs::EGRESS);
    let ingress = program_fd(&sel, programs::INGRESS_XDP);
    let shared = Shared {
        stop: AtomicBool::new(false),
        sent_at: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
        chosen: (0..KEYS).map(|_| AtomicUsize::new(0)).collect(),
        replied: (0..KEYS).map(|_| AtomicU64::new(0)).collect(),
    };

    let started = Instant::now();
    let mut swept = SweepReport::default();
    let mut sweeps = 0u64;
    let answering = program_fd(&sel, programs::INGRESS_XDP);
    let (requests, replies) = std::thread::scope(|s| {
        let a = s.spawn(|| requester(egress, answering, &shared, 0x9e37_79b9_7f4a_7c15));
        let b = s.spawn(|| replier(ingress, &shared, 0xd1b5_4a32_d192_ed03));
        while started.elapsed() < RUN_MAX && !a.is_finished() && !b.is_finished() {
            // One millisecond in two the sweep runs a timeout ahead, as a
            // late agent would: every live request is due at once, so
            // replies sent right after their request race it for the slot.
            let now = sys::monotonic_ns();
            let ahead = if (now / TIMEOUT_NS).is_multiple_of(2) {
                TIMEOUT_NS
            } else {
                0
            };
            add(&mut swept, sel.sweep(now + ahead).unwrap());
            sweeps += 1;
            if sweeps.is_multiple_of(256) {
                assert_no_overcount(&sel);
                if started.elapsed() >= RUN
                    && swept.lost_race + stats(&sel)[0].late_responses >= RACES_WANTED
                {
                    break;
                }
            }
        }
        shared.stop.store(true, Ordering::Relaxed);
        let ((requests, answers), mut replies) = (a.join().unwrap(), b.join().unwrap());
        for i in 0..REPLICAS {
            replies.sent[i] += answers.sent[i];
            replies.rewritten[i] += answers.rewritten[i];
            replies.dropped[i] += answers.dropped[i];
        }
        (requests, replies)
    });
    let ran = started.elapsed();

    // Everything still in flight expires, then every lingering slot frees.
    let later = sys::monotonic_ns() + 10_000_000_000;
    let last = sel.sweep(later).unwrap();
    add(&mut swept, last);
    let again = sel.sweep(later).unwrap();
    assert_eq!((again.expired, again.lost_race), (0, 0));
    add(&mut swept, again);

    let accounting = sel.accounting().unwrap();
    let st = stats(&sel);
    let latency = sel.latency().unwrap();
    let completed: u64 = accounting.iter().map(|a| a.1).sum();
    let expired: u64 = accounting.iter().map(|a| a.2).sum();
    let late: Vec<u64> = st.iter().map(|s| s.late_responses).collect();
    let unmatched: Vec<u64> = st.iter().map(|s| s.unmatched_responses).collect();
    println!("ran {ran:?}: {sweeps} sweeps");
    println!("requests: {requests:?}");
    println!("replies: {replies:?}");
    println!("(issued, completed, expired) per backend: {accounting:?}");
    println!(
        "primary: requests {} (new instances), untracked {}, redirected away {}, id collisions {}",
        st[0].requests, st[0].untracked, st[0].redirected_away, st[0].id_collisions
    );
    println!(
        "responses (completed by a reply): {:?}",
        st.iter().map(|s| s.responses).collect::<Vec<_>>()
    );
    println!("late responses: {late:?}, unmatched: {unmatched:?}");
    println!(
        "stale (older instances' replies dropped): {:?}",
        st.iter().map(|s| s.stale_replies).collect::<Vec<_>>()
    );
    println!(
        "sweep: expired {}, lost race {}, freed {} (the final sweeps expired {})",
        swept.expired, swept.lost_race, swept.freed, last.expired
    );
    println!(
        "races seen: sweep lost to a reply {} times, a reply lost to the sweep {} times",
        swept.lost_race, late[0]
    );

    // Exact accounting: nothing counted twice, nothing leaked.
    for (b, &(issued, completed, expired)) in accounting.iter().enumerate() {
        assert_eq!(issued, completed + expired, "backend {b} drifted");
    }
    assert_eq!(sel.pending().unwrap(), vec![0; REPLICAS]);
    assert!(sel.inflight().unwrap().is_empty());
    assert_eq!(swept.expired, expired, "the sweep's tally vs the counters");
    let slots: Array<_, InflightSlot> =
        Array::try_from(sel.ebpf().map(names::INFLIGHT).unwrap()).unwrap();
    for (i, slot) in slots.iter().enumerate() {
        assert_eq!(slot.unwrap().state, 0, "slot {i} not free");
    }
    let clients: Array<_, u64> =
        Array::try_from(sel.ebpf().map(names::CLIENT_PENDING).unwrap()).unwrap();
    for key in 0..KEYS {
        let k = InflightKey::ipv4(CLIENT, port(key), 0, 0);
        let slot = client_slot(&k.client_addr, k.client_port);
        assert_eq!(
            clients.get(&slot, 0).unwrap(),
            0,
            "client {} pending",
            port(key)
        );
    }

    // Egress: every new instance is issued once, at the replica it went to.
    let issued: Vec<u64> = accounting.iter().map(|a| a.0).collect();
    assert_eq!(issued.iter().sum::<u64>(), st[0].requests - st[0].untracked);
    assert_eq!(st[0].redirected_away, issued[1] + issued[2]);
    for i in 1..REPLICAS {
        assert_eq!(st[i].redirected_to, issued[i], "redirected to {i}");
    }
    assert_eq!(st[0].id_collisions, 0);

    // Ingress: each reply completed, was late or matched nothing; only the
    // winner of a claim counted and timed it; a redirected read's reply is
    // rewritten exactly when it matched and was not stale (an older
    // instance's while a newer one waited: dropped), a reply from the
    // primary never. No hedging here, so nothing else is dropped.
    for i in 0..REPLICAS {
        let (_, completed, _) = accounting[i];
        assert_eq!(st[i].responses, completed, "backend {i}");
        assert_eq!(latency[i].iter().sum::<u64>(), completed, "backend {i}");
        assert_eq!(
            st[i].responses + late[i] + unmatched[i],
            replies.sent[i],
            "backend {i}: replies"
        );
        assert_eq!(
            replies.dropped[i], st[i].stale_replies,
            "backend {i}: dropped"
        );
        let matched = if i == 0 {
            0
        } else {
            completed + late[i] - st[i].stale_replies
        };
        assert_eq!(replies.rewritten[i], matched, "backend {i}: rewritten");
    }

    // The contention was real.
    assert!(
        completed > 0 && expired > 0,
        "no mix of completions and expiries"
    );
    assert!(
        issued[0] > 0 && issued[1] + issued[2] > 0,
        "no mix of redirects"
    );
    assert!(
        swept.lost_race + late[0] > 0,
        "the reply path and the sweep never raced for a slot"
    );
}

/// A client that reuses one request id for every read, the moment it has
/// its answer, through hedged reads and a primary that stalls again and
/// again, in network namespaces with real memcached replicas: the hedge
/// target answers a stalled read, the client's next read (the same id)
/// goes to the still stalled primary (threshold 100 keeps it there) while
/// the first read's copy waits there too; when the primary resumes it
/// answers both, in order. Every read must get its own key's value and none
/// may be lost. Before, the next read was taken for a retransmit of the
/// answered one (not tracked, not hedged) and the primary's answer to it
/// was dropped as the first read's loser: the client lost it.
#[test]
fn a_client_reusing_one_id_gets_every_answer_while_hedges_race_a_stalling_primary() {
    use selector_common::Policy;
    use selector_testbed::{
        Testbed,
        agent::SweptSelector,
        memcached::{frame, key_for, parse_get_response, value_for},
    };
    use selector_user::{
        Settings,
        config::hedge::{HedgeAfter, HedgeSettings},
    };

    const KEYS: usize = 50;
    /// Stalls of the primary the client reads through.
    const STALLS: u64 = 25;
    const TIMEOUT: Duration = Duration::from_millis(500);
    const STALL: Duration = Duration::from_millis(12);
    let tb = Testbed::with_memcached("rid", 3, KEYS).expect("testbed");
    let group = tb.replica_group();
    let running = SweptSelector::start(
        &tb,
        Settings {
            timeout: TIMEOUT,
            ..Settings::new(
                selector_testbed::topology::CLIENT_IFACE,
                vec![group.clone()],
            )
        }
        .tuned(|t| {
            t.policy = Policy::Threshold;
            t.threshold = 100;
            t.hedging = HedgeSettings {
                after: HedgeAfter::Fixed(Duration::from_millis(2)),
                budget_percent: 100,
            };
        }),
    );
    // The client reads until the primary has stalled `STALLS` times, 12 ms
    // in every 24.
    let done = std::sync::Arc::new(AtomicBool::new(false));
    let primary = group[0];
    let reader = {
        let done = done.clone();
        tb.client
            .spawn(move || {
                let socket = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
                socket.connect(primary).unwrap();
                let mut buf = [0u8; 2048];
                let (mut reads, mut right, mut wrong, mut lost) = (0u64, 0u64, 0u64, 0u64);
                while !done.load(Ordering::Relaxed) {
                    let i = reads as usize % KEYS;
                    reads += 1;
                    socket
                        .send(&frame(0x0707, format!("get {}\r\n", key_for(i)).as_bytes()))
                        .unwrap();
                    // Waits well past a stall for the answer; anything else
                    // with the id (a late reply to an earlier read) is a
                    // wrong answer.
                    socket
                        .set_read_timeout(Some(Duration::from_millis(300)))
                        .unwrap();
                    match socket.recv(&mut buf) {
                        Ok(len) if len >= 8 && buf[..2] == [0x07, 0x07] => {
                            if parse_get_response(&buf[8..len]) == Some(value_for(i).as_bytes()) {
                                right += 1;
                            } else {
                                wrong += 1;
                            }
                        }
                        Ok(_) => wrong += 1,
                        Err(_) => lost += 1,
                    }
                }
                (reads, right, wrong, lost)
            })
            .unwrap()
    };
    let pid = tb.replicas[0].pid();
    for _ in 0..STALLS {
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(STALL);
        unsafe { libc::kill(pid, libc::SIGCONT) };
        std::thread::sleep(STALL);
    }
    done.store(true, Ordering::Relaxed);
    let (reads, right, wrong, lost) = reader.join().unwrap();
    tb.replicas[0].resume();
    let sel = running.selector.lock().unwrap();
    let hedges = sel.hedge_counts().unwrap();
    let stats = sel.stats().unwrap();
    println!(
        "{reads} reads, {STALLS} stalls: right {right}, wrong {wrong}, lost {lost}; \
         hedges won {:?}, the primary's replies dropped {}; requests {}, untracked {}",
        hedges.iter().map(|h| h.hedges_won).collect::<Vec<_>>(),
        hedges[0].hedge_replies_dropped,
        stats[0].requests,
        stats[0].untracked,
    );
    drop(sel);
    // The race happened: reads were answered by hedges while the primary
    // still held their copies.
    assert!(
        hedges.iter().map(|h| h.hedges_won).sum::<u64>() > 0,
        "no hedge won: the stalls did not race the reads"
    );
    assert_eq!((right, wrong, lost), (reads, 0, 0));
    let settled = running.settle(TIMEOUT);
    for (b, (issued, completed, expired)) in settled.accounting.iter().enumerate() {
        assert_eq!(*issued, completed + expired, "backend {b} drifted");
    }
    assert_eq!(settled.pending, vec![0, 0, 0]);
}
