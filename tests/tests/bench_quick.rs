//! The benchmark's machinery (`cargo xtask bench --quick`) on a tiny load,
//! so the benchmark cannot rot: every row (the overload scenario's and the
//! herding rows' from several client hosts too),
//! the per-packet cost, the report and the plots are produced, and nothing
//! is left behind. It asserts that everything appears, never timings.
//! The rows of traffic the selector does not steer (`--only untouched`)
//! run on their own, one short segment each, as do the latency rows with
//! nothing stalling (`--only steady`).

use std::process::{Command, Stdio};

use selector_testbed::bench::{Row, untouched::Measure};

/// Runs the benchmark to its end; fails the test unless it succeeded.
/// Returns its process id (its namespaces' names carry it).
fn run_to_success(mut bench: Command) -> u32 {
    let child = bench
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start selector-bench");
    let pid = child.id();
    let run = child.wait_with_output().expect("wait for selector-bench");
    assert!(
        run.status.success(),
        "selector-bench failed ({}):\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    pid
}

#[test]
fn quick_bench_produces_every_row_and_cleans_up() {
    let out = std::env::temp_dir().join(format!("selector-bench-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut child = Command::new(env!("CARGO_BIN_EXE_selector-bench"));
    child
        .args([
            "--quick",
            "--duration",
            "0.6",
            "--rate",
            "400",
            "--clients",
            "2",
        ])
        .args(["--keys", "100", "--drain-ms", "300"])
        .args(["--packet-repeat", "1000", "--packet-fresh", "200"])
        .args(["--inflight-small", "100", "--inflight-large", "5000"])
        .args(["--overload-duration", "1", "--overload-stop-ms", "200"])
        .args(["--overload-rate", "400"])
        // A relative `--out`, as users type it.
        .current_dir(std::env::temp_dir())
        .arg("--out")
        .arg(out.file_name().unwrap());
    let pid = run_to_success(child);

    let read = |name: &str| {
        std::fs::read_to_string(out.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let csv = read("results.csv");
    let md = read("results.md");
    for row in Row::all(&[1, 10, 100], 10) {
        assert!(
            csv.lines()
                .any(|l| l.starts_with(&format!("{},", row.id()))),
            "row {} missing from results.csv:\n{csv}",
            row.id()
        );
        assert!(
            md.contains(&format!("| {} |", row.label())),
            "row {} missing",
            row.label()
        );
    }
    assert!(md.contains("## Targets"), "{md}");
    assert!(md.contains("## Several client hosts: herding"), "{md}");
    // Each herding row over all hosts, then each of the 4 hosts.
    let herding = read("herding.csv");
    for row in Row::herding() {
        let lines = herding
            .lines()
            .filter(|l| l.starts_with(&format!("{},", row.id())))
            .count();
        assert_eq!(lines, 1 + 4, "{herding}");
    }
    let overload = read("overload.csv");
    for row in Row::overload(32) {
        assert!(
            overload
                .lines()
                .any(|l| l.starts_with(&format!("{},", row.id()))),
            "row {} missing from overload.csv:\n{overload}",
            row.id()
        );
        assert!(
            md.contains(&format!("| {} |", row.label())),
            "row {} missing",
            row.label()
        );
    }
    let costs = read("packet_cost.csv");
    assert_eq!(costs.lines().count(), 1 + 13, "{costs}");
    // The plots need a font, which `cargo xtask setup` installs
    // (fonts-dejavu-core): without one they would go unchecked.
    let fonts = selector_testbed::bench::plots::FONT_FILES;
    assert!(
        fonts.iter().any(|f| std::path::Path::new(f).exists()),
        "no font for the plots among {fonts:?}: run `cargo xtask setup` (fonts-dejavu-core)"
    );
    let plots = [
        "replica_rates.png",
        "replica_rates_full.png",
        "latency_cdf.png",
    ];
    for plot in plots {
        let bytes = std::fs::read(out.join(plot)).unwrap_or_else(|e| panic!("{plot}: {e}"));
        assert!(
            bytes.starts_with(b"\x89PNG\r\n\x1a\n"),
            "{plot} is not a PNG"
        );
        // The IHDR chunk's width and height.
        let size = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
        assert!(size(16) > 0 && size(20) > 0, "{plot} is empty");
    }

    assert_no_namespaces_left(&format!("bench-{pid}-"));
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn untouched_rows_are_produced_and_the_agent_pulls_none_of_their_packets() {
    // `selector-bench` runs the agent beside it.
    selector_testbed::agent::selector_binary();
    let out = std::env::temp_dir().join(format!("selector-untouched-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut child = Command::new(env!("CARGO_BIN_EXE_selector-bench"));
    child
        .args(["--only", "untouched", "--untouched-rounds", "1"])
        .args(["--untouched-segment", "1", "--out"])
        .arg(&out);
    let pid = run_to_success(child);
    let read = |name: &str| {
        std::fs::read_to_string(out.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let (md, csv) = (read("untouched.md"), read("untouched.csv"));
    for m in Measure::ALL {
        assert!(md.contains(&format!("| {} |", m.label())), "{md}");
        for attached in ["no", "yes", "empty"] {
            assert!(
                csv.lines()
                    .any(|l| l.starts_with(&format!("{},{attached},1,", m.id()))),
                "{} {attached}:\n{csv}",
                m.id()
            );
        }
    }
    assert!(
        md.contains("pulled over all its segments: 0 egress, 0 ingress"),
        "{md}"
    );
    assert_no_namespaces_left(&format!("untch-{pid}-"));
    let _ = std::fs::remove_dir_all(&out);
}

/// The benchmark with the debug agent, writing to an empty directory of
/// its own named after `rows`: that directory and the command.
fn bench_with_the_debug_agent(rows: &str) -> (std::path::PathBuf, Command) {
    let out =
        std::env::temp_dir().join(format!("selector-bench-{rows}-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut bench = Command::new(env!("CARGO_BIN_EXE_selector-bench"));
    bench
        .arg("--agent")
        .arg(selector_testbed::agent::selector_binary())
        .arg("--out")
        .arg(&out);
    (out, bench)
}

fn assert_no_namespaces_left(prefix: &str) {
    let namespaces = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let left: Vec<String> = String::from_utf8_lossy(&namespaces.stdout)
        .lines()
        .filter(|l| l.starts_with(prefix))
        .map(str::to_string)
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}

/// The failure rows (`--only failures`, issue 20's dead primary and broken
/// replica) on a short run with the debug agent: every row appears in
/// failures.md and failures.csv with counts that add up, and nothing is
/// left behind. It asserts no timing and no target.
#[test]
fn quick_failure_rows_produce_every_row_and_clean_up() {
    use selector_testbed::bench::failures::FailureRow;

    let (out, mut bench) = bench_with_the_debug_agent("failures");
    bench
        .args(["--quick", "--only", "failures", "--keys", "100"])
        .args(["--drain-ms", "300", "--dead-outage-ms", "1000"]);
    let pid = run_to_success(bench);
    let read = |name: &str| {
        std::fs::read_to_string(out.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let md = read("failures.md");
    let csv = read("failures.csv");
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    let column = |line: &str, name: &str| -> String {
        let at = header.iter().position(|h| *h == name).expect(name);
        line.split(',').nth(at).unwrap_or_default().to_string()
    };
    let count = |line: &str, name: &str| -> u64 {
        column(line, name)
            .parse()
            .unwrap_or_else(|e| panic!("{name} in {line}: {e}"))
    };
    for row in FailureRow::ALL {
        let line = csv
            .lines()
            .find(|l| l.starts_with(&format!("{},", row.id())))
            .unwrap_or_else(|| panic!("row {} missing from failures.csv:\n{csv}", row.id()));
        assert!(md.contains(&format!("| {} |", row.label())), "{md}");
        let sent = count(line, "sent");
        assert!(sent > 0, "{line}");
        assert_eq!(
            count(line, "good") + count(line, "errors") + count(line, "lost"),
            sent,
            "{line}"
        );
        // The agent's counts are there exactly when the row runs it.
        assert_eq!(
            column(line, "ejections_r0").is_empty(),
            row.agent_flags().is_none(),
            "{line}"
        );
        if row.is_dead() {
            // The switch dropped reads to the primary, and with no agent
            // every one of them is lost.
            assert!(count(line, "dropped_to") > 0, "{line}");
        } else {
            assert!(count(line, "stalls") > 0, "{line}");
        }
    }
    let dead_alone = csv
        .lines()
        .find(|l| l.starts_with("failures_dead_primary_only,"))
        .unwrap();
    assert!(count(dead_alone, "lost") >= count(dead_alone, "dropped_to"));
    let broken_alone = csv
        .lines()
        .find(|l| l.starts_with("failures_broken_primary_only,"))
        .unwrap();
    assert_eq!(count(broken_alone, "errors"), 0, "{broken_alone}");
    for part in ["### A dead primary", "### A broken replica", "### Targets"] {
        assert!(md.contains(part), "{part} missing:\n{md}");
    }

    let namespaces = Command::new("ip").args(["netns", "list"]).output().unwrap();
    let left: Vec<String> = String::from_utf8_lossy(&namespaces.stdout)
        .lines()
        .filter(|l| {
            l.starts_with(&format!("fdead-{pid}-")) || l.starts_with(&format!("fdns-{pid}-"))
        })
        .map(str::to_string)
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
    let _ = std::fs::remove_dir_all(&out);
}

/// The closed-loop throughput rows (`--only throughput`) on one short
/// round with the debug agent: every row appears with gets answered, and
/// the reference programs' row passed its own check (its programs inserted
/// and deleted on the real gets; the run fails otherwise); nothing is left
/// behind. No ratio is asserted.
#[test]
fn quick_throughput_rows_produce_every_row_and_clean_up() {
    use selector_testbed::bench::throughput::CONFIGS;

    let (out, mut bench) = bench_with_the_debug_agent("throughput");
    bench
        .args(["--quick", "--only", "throughput", "--keys", "100"])
        .args(["--throughput-rounds", "1"]);
    let pid = run_to_success(bench);
    let md = std::fs::read_to_string(out.join("throughput.md")).expect("throughput.md");
    for config in &CONFIGS {
        let line = md
            .lines()
            .find(|l| l.starts_with(&format!("| {} |", config.label)))
            .unwrap_or_else(|| panic!("row {} missing:\n{md}", config.label));
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let ops: f64 = cells[2].parse().unwrap_or_else(|e| panic!("{line}: {e}"));
        assert!(ops > 0.0, "no get answered: {line}");
    }
    assert_no_namespaces_left(&format!("tput-{pid}-"));
    let _ = std::fs::remove_dir_all(&out);
}

/// The resolver rows (`--only resolver`: glibc's getaddrinfo through a
/// resolv.conf of two NSD nameservers, the first stalling) on one short
/// round with the debug agent: every row appears with all its lookups
/// made and none failed (a stall of 25 ms is far below glibc's timeout),
/// and nothing is left behind. No timing is asserted; that glibc gets
/// every reply from the nameserver it asked is `resolver.rs`'s to show.
#[test]
fn quick_resolver_rows_look_up_through_glibc_and_clean_up() {
    use selector_testbed::bench::resolver::ResolverRow;

    let (out, mut bench) = bench_with_the_debug_agent("resolver");
    bench.args(["--quick", "--only", "resolver", "--resolver-segment", "1.5"]);
    let pid = run_to_success(bench);
    let md = std::fs::read_to_string(out.join("resolver.md")).expect("resolver.md");
    for row in ResolverRow::ALL {
        let line = md
            .lines()
            .find(|l| l.starts_with(&format!("| {} |", row.label())))
            .unwrap_or_else(|| panic!("row {} missing:\n{md}", row.label()));
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        // 300 lookups/s for 1.5 s, one round.
        assert_eq!(cells[2], "450", "{line}");
        assert_eq!(cells[3], "0", "failed lookups: {line}");
    }
    assert_no_namespaces_left(&format!("rslv-{pid}-"));
    let left = std::fs::read_dir("/etc/netns")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(&format!("rslv-{pid}-"))
                })
                .count()
        })
        .unwrap_or(0);
    assert_eq!(left, 0, "resolv.conf files left in /etc/netns");
    let _ = std::fs::remove_dir_all(&out);
}

/// The latency with nothing stalling (`--only steady`) on one short round
/// with the debug agent: every row of both protocols appears with all its
/// reads answered (one at a time against real NSD and memcached, nothing
/// stalling), the agent's rows having counted them (`steady.rs` fails the
/// run otherwise), and nothing is left behind. No timing is asserted.
#[test]
fn quick_steady_rows_answer_every_read_and_clean_up() {
    use selector_testbed::bench::steady::{Attached, Protocol};

    let (out, mut bench) = bench_with_the_debug_agent("steady");
    bench.args(["--quick", "--only", "steady"]).args([
        "--steady-segment",
        "0.5",
        "--steady-rounds",
        "1",
        "--steady-rate",
        "400",
    ]);
    let pid = run_to_success(bench);
    let md = std::fs::read_to_string(out.join("steady.md")).expect("steady.md");
    for protocol in Protocol::ALL {
        for attached in Attached::ALL {
            let start = format!("| {} | {} |", protocol.label(), attached.label());
            let line = md
                .lines()
                .find(|l| l.starts_with(&start))
                .unwrap_or_else(|| panic!("row {start} missing:\n{md}"));
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            // 400 reads/s for 0.5 s, one round.
            assert_eq!(cells[3], "200", "{line}");
            assert_eq!(cells[4], "0", "unanswered reads: {line}");
        }
    }
    let csv = std::fs::read_to_string(out.join("steady.csv")).expect("steady.csv");
    assert_eq!(
        csv.lines().count(),
        1 + 8,
        "a median per row and segment:\n{csv}"
    );
    assert_no_namespaces_left(&format!("stdy-{pid}-"));
    let _ = std::fs::remove_dir_all(&out);
}
