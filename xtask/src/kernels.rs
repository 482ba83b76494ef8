//! `cargo xtask test-kernels`: the kernel matrix. Boots Debian's packaged
//! LTS kernels under QEMU (TCG: this machine's /dev/kvm hangs stock
//! kernels) with virtme-ng on the host's root filesystem. Every kernel
//! loads every program (the verifier's verdict and cost) and a canary the
//! oldest must refuse (proof that a refusal fails the run); the oldest
//! also runs the packet-fixture suites and the namespace tests with real
//! memcached replicas, the others what differs by kernel and a steering
//! smoke test. Sized for the
//! slowest machine of the project's kind, where emulation runs three to
//! four times slower than on the fastest. One PASS/FAIL line per kernel
//! with its steps' times; non-zero exit on any failure.
//!
//! Nothing is installed into the host's /boot or /lib/modules: the kernel
//! packages are downloaded and unpacked under target/kernels.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::{cargo, run, setup};

/// A kernel of the matrix: the Debian package tested, and its series (the
/// package names `PREFIX<number>SUFFIX`, whose newest stands in when the
/// archive no longer has this one: Debian keeps only the latest ABI).
struct Kernel {
    package: &'static str,
    prefix: &'static str,
    suffix: &'static str,
    /// What runs in its guest.
    plan: Plan,
    /// The words its verifier refuses the canary with (ISA v4's movsx,
    /// before Linux 6.6); `None`: it accepts it.
    canary_refusal: Option<&'static str>,
}

/// How much of the matrix a kernel runs.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Plan {
    /// The oldest kernel: every fixture suite and namespace test of
    /// [`STEPS`].
    Full,
    /// The others: what differs by kernel (every program loaded, the
    /// canary, the checksum fallback's fixture, one steering test).
    Smoke,
}

/// A kernel package as unpacked under target/kernels.
struct Image {
    package: String,
    /// `uname -r` of the kernel: the package name without `linux-image-`.
    release: String,
}

impl Image {
    fn of(package: &str) -> Self {
        Self {
            package: package.to_string(),
            release: package.trim_start_matches("linux-image-").to_string(),
        }
    }
}

/// Debian 12's kernel (6.1, no TCX) and the 6.12 LTS of its backports
/// (Debian 13's series); the generic flavour has the 9p modules virtme-ng
/// boots with.
const KERNELS: &[Kernel] = &[
    Kernel {
        package: "linux-image-6.1.0-57-amd64",
        prefix: "linux-image-6.1.0-",
        suffix: "-amd64",
        plan: Plan::Full,
        canary_refusal: Some("BPF_MOV uses reserved fields"),
    },
    Kernel {
        package: "linux-image-6.12.117+deb12-amd64",
        prefix: "linux-image-6.12.",
        suffix: "+deb12-amd64",
        plan: Plan::Smoke,
        canary_refusal: None,
    },
];

/// Tested with this release; pinned so a new one cannot change the boot.
const VIRTME_NG: &str = "virtme-ng==1.42";
const VM_PACKAGES: &[&str] = &["qemu-system-x86", "busybox-static", "kmod"];
/// A guest that has not begun its first step by then did not boot.
const BOOT_LIMIT: Duration = Duration::from_secs(300);
/// After a step ends, the next begins (or, after the last, the guest
/// exits) within this.
const GAP_LIMIT: Duration = Duration::from_secs(120);

/// A step of a guest: a test binary of `selector-tests` with the tests of
/// it to run (empty: all), or the verifier cost example.
struct Step {
    name: &'static str,
    /// The test binary (`tests/NAME.rs`), or `None`: the verifier example.
    suite: Option<&'static str>,
    tests: &'static [&'static str],
    /// The kernels that run it.
    plans: &'static [Plan],
    /// Tests run at once: 2 for the packet fixtures, CPU-bound in the
    /// guest's two emulated CPUs; 1 for the namespace tests, whose loads
    /// and stalls are timed.
    threads: u32,
    /// Over this, the guest has hung in this step: about four times the
    /// step's time on the slowest machine of this kind measured so far.
    limit: Duration,
}

const BOTH: &[Plan] = &[Plan::Full, Plan::Smoke];
const FULL: &[Plan] = &[Plan::Full];

const fn minutes(m: u64) -> Duration {
    Duration::from_secs(m * 60)
}

/// The guests' steps, in order. The namespace tests are the smoke tests: a
/// stalled primary's reads moved and every reply rewritten back, nothing
/// lost, through TC and XDP ingress; the agent on legacy tc filters beside
/// another component's filter, and killed there; beside another
/// component's TCX programs; and the shipped configuration files.
const STEPS: &[Step] = &[
    Step {
        name: "verifier",
        suite: None,
        tests: &[],
        plans: BOTH,
        threads: 1,
        limit: minutes(5),
    },
    Step {
        name: "canary",
        suite: None,
        tests: &[],
        plans: BOTH,
        threads: 1,
        limit: minutes(2),
    },
    Step {
        name: "fixtures",
        suite: Some("fixtures"),
        tests: &[],
        plans: FULL,
        threads: 2,
        limit: minutes(10),
    },
    Step {
        name: "fixtures_ipv6",
        suite: Some("fixtures_ipv6"),
        tests: &[],
        plans: FULL,
        threads: 2,
        limit: minutes(10),
    },
    Step {
        name: "hedging_fixtures",
        suite: Some("hedging_fixtures"),
        tests: &[],
        plans: FULL,
        threads: 2,
        limit: minutes(10),
    },
    Step {
        name: "ejection_fixtures",
        suite: Some("ejection_fixtures"),
        tests: &[],
        plans: FULL,
        threads: 2,
        limit: minutes(10),
    },
    Step {
        name: "steering",
        suite: Some("steering"),
        tests: &[
            "stall_redirects_reads_and_replies_come_from_the_primary_tc_ingress",
            "stall_redirects_reads_and_replies_come_from_the_primary_xdp",
        ],
        plans: FULL,
        threads: 1,
        limit: minutes(10),
    },
    // 6.11 to 6.15 rewrite a checksum-complete IPv6 reply by a fallback
    // (the host's kernel has BPF_F_IPV6, 6.1 cannot run the fixture).
    Step {
        name: "checksum_complete_ipv6",
        suite: Some("fixtures_ipv6"),
        tests: &["a_reply_rewritten_on_tc_ingress_keeps_a_checksum_complete_sum"],
        plans: &[Plan::Smoke],
        threads: 1,
        limit: minutes(5),
    },
    Step {
        name: "steering_smoke",
        suite: Some("steering"),
        tests: &["stall_redirects_reads_and_replies_come_from_the_primary_tc_ingress"],
        plans: &[Plan::Smoke],
        threads: 1,
        limit: minutes(8),
    },
    Step {
        name: "legacy_tc",
        suite: Some("legacy_tc"),
        tests: &[],
        plans: FULL,
        threads: 1,
        limit: minutes(8),
    },
    // Beside another component's TCX programs, with the unit's
    // capabilities (6.1's coexistence with a foreign filter is legacy_tc).
    Step {
        name: "coexistence_tcx",
        suite: Some("deploy"),
        tests: &["beside_another_components_tcx_programs_the_unit_attaches_by_tcx_and_leaves_them"],
        plans: &[Plan::Smoke],
        threads: 1,
        limit: minutes(8),
    },
    Step {
        name: "shipped",
        suite: Some("shipped"),
        tests: &[],
        plans: BOTH,
        threads: 1,
        limit: minutes(5),
    },
    // Ignored on the host, whose kernel has no 802.1Q.
    Step {
        name: "vlan",
        suite: Some("vlan"),
        tests: &[],
        plans: FULL,
        threads: 1,
        limit: minutes(10),
    },
];

/// Modules the suites need that Debian builds as modules (loaded by hand:
/// the guest's modprobe has no /lib/modules of its own to find them in).
const MODULES: &[&str] = &["veth", "sch_ingress", "cls_bpf", "cls_u32", "8021q"];

pub fn test_kernels(only: &[String]) -> Result<()> {
    let root = setup::workspace_root();
    let dir = root.join("target/kernels");
    fs::create_dir_all(&dir)?;
    vm_tools(&dir)?;
    let wanted: Vec<&Kernel> = KERNELS
        .iter()
        .filter(|k| {
            only.is_empty()
                || only
                    .iter()
                    .any(|o| Image::of(k.package).release.starts_with(o.as_str()))
        })
        .collect();
    if wanted.is_empty() {
        bail!("no kernel of the matrix matches {only:?}");
    }
    let kernels = wanted
        .into_iter()
        .map(|k| Ok((k, unpack(&dir, k)?)))
        .collect::<Result<Vec<(&Kernel, Image)>>>()?;
    let built = build(&root)?;
    let mut failed = 0;
    for (k, image) in &kernels {
        let began = Instant::now();
        let outcome = run_guest(&dir, k, image, &built);
        let took = began.elapsed().as_secs();
        match outcome {
            Ok(report) if report.failures.is_empty() => {
                println!(
                    "test-kernels: PASS {} ({} s; {}): {}; {}",
                    image.release, took, report.times, report.counts, report.passed
                );
            }
            Ok(report) => {
                failed += 1;
                println!(
                    "test-kernels: FAIL {} ({} s; {}): {}; failed: {}",
                    image.release,
                    took,
                    report.times,
                    report.counts,
                    report.failures.join("; ")
                );
            }
            Err(e) => {
                failed += 1;
                println!("test-kernels: FAIL {} ({took} s): {e:#}", image.release);
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} kernels failed", kernels.len());
    }
    Ok(())
}

/// QEMU and friends from Debian, virtme-ng from PyPI in a venv of ours.
fn vm_tools(dir: &Path) -> Result<()> {
    setup::install_missing(VM_PACKAGES, "the kernel matrix's VMs")?;
    let venv = dir.join("venv");
    if !venv.join("bin/vng").exists() {
        eprintln!(
            "test-kernels: installing {VIRTME_NG} into {}",
            venv.display()
        );
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
        run(Command::new(venv.join("bin/pip")).args(["install", "-q", VIRTME_NG]))?;
    }
    Ok(())
}

/// Downloads and unpacks the kernel package (not installed: no bootloader
/// or initramfs hooks run on this host); the newest of its series when the
/// archive has dropped it.
fn unpack(dir: &Path, k: &Kernel) -> Result<Image> {
    let image = Image::of(k.package);
    if vmlinuz(dir, &image).exists() {
        return Ok(image);
    }
    let image = if download(dir, k.package)? {
        image
    } else {
        // The package lists may be stale on a fresh machine.
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        if download(dir, k.package)? {
            image
        } else {
            let names = Command::new("apt-cache")
                .args(["pkgnames", k.prefix])
                .output()?;
            let names = String::from_utf8_lossy(&names.stdout);
            let newest = newest_in_series(k.prefix, k.suffix, names.lines())
                .with_context(|| format!("no package of {}N{} to download", k.prefix, k.suffix))?;
            eprintln!(
                "test-kernels: {} is no longer in the archive; testing {newest}, the newest of its series",
                k.package
            );
            if !download(dir, &newest)? {
                bail!("apt-get download {newest} failed");
            }
            Image::of(&newest)
        }
    };
    let deb = fs::read_dir(dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                n.starts_with(&format!("{}_", image.package)) && n.ends_with(".deb")
            })
        })
        .with_context(|| format!("{} was not downloaded", image.package))?;
    run(Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(dir.join(&image.package)))?;
    fs::remove_file(deb)?;
    Ok(image)
}

/// `apt-get download PACKAGE` into `dir`; whether it succeeded.
fn download(dir: &Path, package: &str) -> Result<bool> {
    eprintln!("test-kernels: downloading {package}");
    Ok(Command::new("apt-get")
        .args(["download", "-q", package])
        .current_dir(dir)
        .status()?
        .success())
}

/// The name `PREFIX<number>SUFFIX` with the highest number.
fn newest_in_series<'a>(
    prefix: &str,
    suffix: &str,
    names: impl Iterator<Item = &'a str>,
) -> Option<String> {
    names
        .filter_map(|n| {
            let number = n.strip_prefix(prefix)?.strip_suffix(suffix)?;
            let number: u64 = number.parse().ok()?;
            Some((number, n))
        })
        .max_by_key(|(number, _)| *number)
        .map(|(_, n)| n.to_string())
}

fn vmlinuz(dir: &Path, k: &Image) -> PathBuf {
    dir.join(&k.package)
        .join(format!("boot/vmlinuz-{}", k.release))
}

/// What the guests run, built on the host: the agent, the verifier cost
/// example and the test binaries by suite name.
struct Built {
    selector: PathBuf,
    verifier_cost: PathBuf,
    suites: Vec<(&'static str, PathBuf)>,
}

impl Built {
    fn suite(&self, name: &str) -> &Path {
        self.suites
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, p)| p.as_path())
            .expect("every step's suite is built")
    }
}

fn build(root: &Path) -> Result<Built> {
    run(cargo().args([
        "build",
        "--package",
        "selector-user",
        "--bin",
        "selector",
        "--example",
        "verifier_cost",
    ]))?;
    let mut names: Vec<&'static str> = STEPS.iter().filter_map(|s| s.suite).collect();
    names.sort_unstable();
    names.dedup();
    let mut c = cargo();
    c.args(["test", "--no-run", "--package", "selector-tests"]);
    for name in &names {
        c.args(["--test", name]);
    }
    eprintln!("+ cargo test --no-run (the suites of the matrix)");
    let out = c.stderr(Stdio::piped()).output()?;
    let text = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("building the test binaries failed:\n{text}");
    }
    let mut suites = Vec::new();
    for name in names {
        // "Executable tests/NAME.rs (target/debug/deps/NAME-HASH)"
        let path = text
            .lines()
            .find(|l| l.contains(&format!("tests/{name}.rs (")))
            .and_then(|l| l.rsplit_once('(')?.1.strip_suffix(')'))
            .with_context(|| format!("no executable for {name} in cargo's output"))?;
        suites.push((name, root.join(path)));
    }
    // Where cargo put them: CARGO_TARGET_DIR when set, as for the suites.
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or(root.join("target"), |d| root.join(d));
    let debug = target.join("debug");
    Ok(Built {
        selector: debug.join("selector"),
        verifier_cost: debug.join("examples/verifier_cost"),
        suites,
    })
}

/// The steps kernel `k` runs, in order.
fn steps_of(k: &Kernel) -> impl Iterator<Item = &'static Step> {
    STEPS.iter().filter(move |s| s.plans.contains(&k.plan))
}

/// A guest's outcome.
struct Report {
    /// Verified instructions per program.
    counts: String,
    passed: String,
    failures: Vec<String>,
    /// Each step's wall time.
    times: String,
}

/// Boots kernel `k` and runs its steps, watching that each begins and ends
/// in its time; the outcome read from the files the guest wrote.
fn run_guest(dir: &Path, k: &Kernel, image: &Image, built: &Built) -> Result<Report> {
    let out = dir.join(format!("out-{}", image.release));
    if out.exists() {
        fs::remove_dir_all(&out)?;
    }
    fs::create_dir_all(&out)?;
    let script = out.join("guest.sh");
    let steps: Vec<&Step> = steps_of(k).collect();
    fs::write(&script, guest_script(dir, image, &steps, built, &out))?;
    let log = fs::File::create(out.join("console.log"))?;
    eprintln!(
        "test-kernels: booting {} under QEMU (TCG) for {} steps ({:?} plan); output in {}",
        image.release,
        steps.len(),
        k.plan,
        out.display()
    );
    let venv_bin = dir.join("venv/bin");
    let path = format!(
        "{}:{}",
        venv_bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new(venv_bin.join("vng"))
        .env("PATH", path)
        .args(["--disable-kvm", "--cpus", "2", "--memory", "2G", "--rwdir"])
        .arg(&out)
        .arg("-r")
        .arg(vmlinuz(dir, image))
        .arg("-e")
        .arg(format!("sh {}", script.display()))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting vng")?;
    let mut progress = Progress::new(Instant::now());
    let verdict = loop {
        if child.try_wait()?.is_some() {
            progress.observe(&out, &steps, Instant::now());
            break Ok(());
        }
        let now = Instant::now();
        progress.observe(&out, &steps, now);
        if let Some(late) = progress.overdue(&steps, now) {
            let _ = child.kill();
            let _ = child.wait();
            break Err(late);
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    let times = progress.times(&steps);
    eprintln!("test-kernels: {} steps: {times}", image.release);
    if let Err(late) = verdict {
        bail!("{late} (steps: {times}; see {})", out.display());
    }
    let mut report = read_report(&out, k, &steps)?;
    report.times = times;
    Ok(report)
}

/// What the host has seen of a guest's steps: when each began and ended,
/// by the host's clock (the guest writes `NAME.began` and `NAME.rc`).
struct Progress {
    booted: Instant,
    began: Vec<Option<Instant>>,
    ended: Vec<Option<Instant>>,
}

impl Progress {
    fn new(booted: Instant) -> Self {
        Self {
            booted,
            began: vec![None; STEPS.len()],
            ended: vec![None; STEPS.len()],
        }
    }

    fn observe(&mut self, out: &Path, steps: &[&Step], now: Instant) {
        for (i, step) in steps.iter().enumerate() {
            if self.began[i].is_none() && out.join(format!("{}.began", step.name)).exists() {
                self.began[i] = Some(now);
            }
            if self.ended[i].is_none() && out.join(format!("{}.rc", step.name)).exists() {
                self.ended[i] = Some(now);
                self.began[i].get_or_insert(now);
            }
        }
    }

    /// Why the guest counts as hung at `now`, if it does: no step begun
    /// within the boot limit, or a step running past its own limit.
    fn overdue(&self, steps: &[&Step], now: Instant) -> Option<String> {
        if self.began.iter().all(Option::is_none) {
            return (now - self.booted > BOOT_LIMIT).then(|| {
                format!(
                    "the guest did not begin its first step within {} s of starting",
                    BOOT_LIMIT.as_secs()
                )
            });
        }
        let running = steps.iter().enumerate().find_map(|(i, step)| {
            let began = self.began[i]?;
            (self.ended[i].is_none() && now - began > step.limit).then(|| {
                format!(
                    "step {} did not finish within its limit of {} s",
                    step.name,
                    step.limit.as_secs()
                )
            })
        });
        if running.is_some() {
            return running;
        }
        // Between steps: the last one ended, the next not begun.
        let last = (0..steps.len()).rev().find(|&i| self.began[i].is_some())?;
        let ended = self.ended[last]?;
        (now - ended > GAP_LIMIT).then(|| match steps.get(last + 1) {
            Some(next) => format!(
                "step {} did not begin within {} s of {} ending",
                next.name,
                GAP_LIMIT.as_secs(),
                steps[last].name
            ),
            None => format!(
                "the guest did not exit within {} s of its last step",
                GAP_LIMIT.as_secs()
            ),
        })
    }

    /// "verifier 12 s, canary 1 s, fixtures 80 s, ..." (a step begun and
    /// not ended: "running N s"; not begun: left out).
    fn times(&self, steps: &[&Step]) -> String {
        let boot = self
            .began
            .iter()
            .flatten()
            .min()
            .map(|first| format!("boot {} s", (*first - self.booted).as_secs()));
        boot.into_iter()
            .chain(steps.iter().enumerate().filter_map(|(i, step)| {
                let began = self.began[i]?;
                Some(match self.ended[i] {
                    Some(ended) => format!("{} {} s", step.name, (ended - began).as_secs()),
                    None => format!("{} running {} s", step.name, began.elapsed().as_secs()),
                })
            }))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The guest's script: modules, bpffs, then each step's output and exit
/// code to files in the shared directory, its start marked by a file.
fn guest_script(dir: &Path, k: &Image, steps: &[&Step], built: &Built, out: &Path) -> String {
    let mut s = String::from("#!/bin/sh\n");
    s += &format!("cd {}\n", setup::workspace_root().display());
    s += &format!(
        "modprobe -d {} -a {} 2>{}/modprobe.log\n",
        dir.join(&k.package).display(),
        MODULES.join(" "),
        out.display()
    );
    s += "mount -t bpf bpf /sys/fs/bpf 2>/dev/null\nip link set lo up\n";
    s += &format!("export SELECTOR_BINARY={}\n", built.selector.display());
    for step in steps {
        let command = match (step.suite, step.name) {
            (None, "canary") => format!("{} --canary", built.verifier_cost.display()),
            (None, _) => built.verifier_cost.display().to_string(),
            (Some(suite), _) => {
                let filter = if step.tests.is_empty() {
                    String::new()
                } else {
                    format!(" {} --exact", step.tests.join(" "))
                };
                format!(
                    "{} --test-threads={} --include-ignored{filter}",
                    built.suite(suite).display(),
                    step.threads
                )
            }
        };
        s += &format!(
            "touch {o}/{n}.began; {command} > {o}/{n}.txt 2>&1; echo $? > {o}/{n}.rc\n",
            o = out.display(),
            n = step.name
        );
    }
    s += &format!("echo done > {}/done\n", out.display());
    s
}

/// The verifier's refusal in a verifier step's output and exit code, if
/// it refused anything: the line that says what.
fn refusal(output: &str, rc: &str) -> Option<String> {
    (rc.trim() != "0").then(|| {
        output
            .lines()
            .find(|l| l.starts_with("Error"))
            .unwrap_or("no output")
            .chars()
            .take(300)
            .collect()
    })
}

fn read_report(out: &Path, k: &Kernel, steps: &[&Step]) -> Result<Report> {
    if !out.join("done").exists() {
        bail!(
            "the guest stopped before the end (see {})",
            out.join("console.log").display()
        );
    }
    let read = |name: &str| fs::read_to_string(out.join(name)).unwrap_or_default();
    let mut failures = Vec::new();
    let mut passed = Vec::new();
    let mut counts = Vec::new();
    for step in steps {
        let text = read(&format!("{}.txt", step.name));
        let rc = read(&format!("{}.rc", step.name));
        match (step.suite, step.name) {
            (None, "canary") => {
                // The same judgement as the programs': a kernel that must
                // refuse it and is not seen refusing means the matrix
                // cannot see refusals.
                match (refusal(&text, &rc), k.canary_refusal) {
                    (Some(_), Some(words)) if text.contains(words) => {
                        passed.push("canary: refused, as it must be".into())
                    }
                    (None, None) => passed.push("canary: accepted".into()),
                    (None, Some(_)) => failures.push(
                        "canary: a program this kernel must refuse was not reported refused (the matrix would miss a verifier refusal)".into(),
                    ),
                    (Some(why), Some(words)) => failures.push(format!(
                        "canary: failed, but not with the verifier's \"{words}\": {why}"
                    )),
                    (Some(why), None) => failures.push(format!("canary: refused: {why}")),
                }
            }
            (None, _) => {
                counts.extend(text.lines().filter_map(|l| {
                    let (program, rest) = l.split_once(": ")?;
                    let (n, _) = rest.split_once(" verified instructions")?;
                    program
                        .starts_with("selector_")
                        .then(|| format!("{program} {n}"))
                }));
                if let Some(why) = refusal(&text, &rc) {
                    failures.push(format!("verifier: {why}"));
                }
            }
            (Some(_), _) => {
                let result = text
                    .lines()
                    .rev()
                    .find(|l| l.starts_with("test result:"))
                    .unwrap_or("no result")
                    .to_string();
                if rc.trim() == "0" {
                    passed.push(format!("{}: {}", step.name, summary(&result)));
                } else {
                    let failed: Vec<&str> = text
                        .lines()
                        .filter_map(|l| l.strip_prefix("test ")?.strip_suffix(" ... FAILED"))
                        .collect();
                    failures.push(format!(
                        "{}: {} [{}]",
                        step.name,
                        summary(&result),
                        failed.join(", ")
                    ));
                }
            }
        }
    }
    Ok(Report {
        counts: if counts.is_empty() {
            "no verifier counts".into()
        } else {
            format!("verified instructions {}", counts.join(", "))
        },
        passed: passed.join(", "),
        failures,
        times: String::new(),
    })
}

/// "3 passed; 0 failed" of a libtest result line.
fn summary(result: &str) -> String {
    let rest = result.trim_start_matches("test result: ");
    let parts: Vec<&str> = rest.split(';').map(str::trim).take(2).collect();
    parts
        .join(" ")
        .trim_start_matches("ok. ")
        .trim_start_matches("FAILED. ")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_of_a_series_stands_in_for_a_dropped_package() {
        let names = [
            "linux-image-6.1.0-58-amd64",
            "linux-image-6.1.0-61-amd64",
            "linux-image-6.1.0-61-cloud-amd64",
            "linux-image-6.1.0-9-amd64",
            "linux-image-6.1.0-61-amd64-dbg",
            "linux-image-6.12.118+deb12-amd64",
        ];
        assert_eq!(
            newest_in_series("linux-image-6.1.0-", "-amd64", names.into_iter()).as_deref(),
            Some("linux-image-6.1.0-61-amd64")
        );
        assert_eq!(
            newest_in_series("linux-image-6.12.", "+deb12-amd64", names.into_iter()).as_deref(),
            Some("linux-image-6.12.118+deb12-amd64")
        );
        assert_eq!(
            newest_in_series("linux-image-5.10.0-", "-amd64", names.into_iter()),
            None
        );
        assert_eq!(
            Image::of("linux-image-6.1.0-57-amd64").release,
            "6.1.0-57-amd64"
        );
    }

    /// A guest's output directory with every step of `k` written: passed,
    /// but for `(step, output, rc)` given.
    fn guest_output(k: &Kernel, overrides: &[(&str, &str, &str)]) -> tempdir::Dir {
        let dir = tempdir::Dir::new();
        for step in steps_of(k) {
            let (text, rc) = match (step.suite, step.name) {
                (None, "canary") if k.canary_refusal.is_some() => (
                    "Error: loading selector_canary: Invalid argument (os error 22). Verifier output: 1: (bf) r0 = r0\nBPF_MOV uses reserved fields",
                    "1",
                ),
                (None, "canary") => ("selector_canary: accepted (3 instructions)", "0"),
                (None, _) => ("selector_egress: 117315 verified instructions, ...", "0"),
                (Some(_), _) => ("test result: ok. 2 passed; 0 failed; 0 ignored", "0"),
            };
            let (text, rc) = overrides
                .iter()
                .find(|(n, _, _)| *n == step.name)
                .map_or((text, rc), |(_, t, r)| (*t, *r));
            fs::write(dir.0.join(format!("{}.txt", step.name)), text).unwrap();
            fs::write(dir.0.join(format!("{}.rc", step.name)), format!("{rc}\n")).unwrap();
        }
        fs::write(dir.0.join("done"), "done").unwrap();
        dir
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let p = std::env::temp_dir().join(format!(
                    "xtask-kernels-{}-{}",
                    std::process::id(),
                    N.fetch_add(1, Ordering::SeqCst)
                ));
                std::fs::create_dir_all(&p).unwrap();
                Self(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    fn report(k: &Kernel, overrides: &[(&str, &str, &str)]) -> Report {
        let dir = guest_output(k, overrides);
        let steps: Vec<&Step> = steps_of(k).collect();
        read_report(&dir.0, k, &steps).unwrap()
    }

    #[test]
    fn a_refused_program_or_a_canary_not_refused_fails_the_kernel() {
        let (oldest, newer) = (&KERNELS[0], &KERNELS[1]);
        assert!(oldest.canary_refusal.is_some() && newer.canary_refusal.is_none());
        for k in [oldest, newer] {
            let ok = report(k, &[]);
            assert!(ok.failures.is_empty(), "{:?}", ok.failures);
            assert!(ok.counts.contains("selector_egress 117315"));
            let refused = report(
                k,
                &[(
                    "verifier",
                    "selector_egress: 117315 verified instructions\nError: loading selector_ingress_tc on Linux 6.1: BPF_PROG_LOAD ... Permission denied",
                    "1",
                )],
            );
            assert_eq!(refused.failures.len(), 1);
            assert!(
                refused.failures[0].starts_with("verifier: Error: loading selector_ingress_tc")
            );
        }
        // The oldest kernel accepting the canary: refusals would go unseen.
        let blind = report(oldest, &[("canary", "selector_canary: accepted", "0")]);
        assert!(blind.failures[0].contains("was not reported refused"));
        // Failing for another reason (no binary, no permission) is no
        // proof that refusals are seen.
        let other = report(oldest, &[("canary", "sh: verifier_cost: not found", "127")]);
        assert!(other.failures[0].contains("not with the verifier's"));
        let refused = report(
            newer,
            &[("canary", "Error: loading selector_canary: EINVAL", "1")],
        );
        assert!(refused.failures[0].starts_with("canary: refused"));
        let failed = report(
            oldest,
            &[(
                "fixtures",
                "test a ... ok\ntest b ... FAILED\ntest result: FAILED. 1 passed; 1 failed;",
                "101",
            )],
        );
        assert_eq!(failed.failures, ["fixtures: 1 passed 1 failed [b]"]);
    }

    #[test]
    fn the_oldest_kernel_runs_every_suite_and_the_others_only_what_differs_by_kernel() {
        let full: Vec<&str> = steps_of(&KERNELS[0]).map(|s| s.name).collect();
        let smoke: Vec<&str> = steps_of(&KERNELS[1]).map(|s| s.name).collect();
        for suite in [
            "fixtures",
            "fixtures_ipv6",
            "hedging_fixtures",
            "ejection_fixtures",
        ] {
            assert!(full.contains(&suite) && !smoke.contains(&suite));
        }
        for step in ["verifier", "canary"] {
            assert!(full.contains(&step) && smoke.contains(&step));
        }
        assert!(smoke.contains(&"steering_smoke"));
    }

    #[test]
    fn a_step_past_its_limit_is_named_and_a_guest_that_never_begins_is_caught() {
        let steps: Vec<&Step> = steps_of(&KERNELS[0]).collect();
        let t0 = Instant::now();
        let mut p = Progress::new(t0);
        assert_eq!(p.overdue(&steps, t0 + BOOT_LIMIT / 2), None);
        assert!(
            p.overdue(&steps, t0 + BOOT_LIMIT + Duration::from_secs(1))
                .unwrap()
                .contains("did not begin its first step")
        );
        let dir = tempdir::Dir::new();
        fs::write(dir.0.join("verifier.began"), "").unwrap();
        p.observe(&dir.0, &steps, t0 + Duration::from_secs(20));
        fs::write(dir.0.join("verifier.rc"), "0").unwrap();
        fs::write(dir.0.join("canary.began"), "").unwrap();
        p.observe(&dir.0, &steps, t0 + Duration::from_secs(30));
        fs::write(dir.0.join("canary.rc"), "0").unwrap();
        fs::write(dir.0.join("fixtures.began"), "").unwrap();
        p.observe(&dir.0, &steps, t0 + Duration::from_secs(31));
        let fixtures = steps.iter().find(|s| s.name == "fixtures").unwrap();
        let late = t0 + Duration::from_secs(32) + fixtures.limit;
        assert_eq!(
            p.overdue(&steps, late).as_deref(),
            Some("step fixtures did not finish within its limit of 600 s")
        );
        assert!(
            p.times(&steps)
                .starts_with("boot 20 s, verifier 10 s, canary 1 s, fixtures running")
        );
    }
}
