//! `cargo xtask test-kernels`: the kernel matrix. Boots Debian's packaged
//! LTS kernels under QEMU (TCG: this machine's /dev/kvm hangs stock
//! kernels) with virtme-ng on the host's root filesystem, and runs in each
//! the verifier cost of every program, the packet-fixture suites and
//! namespace smoke tests with real memcached replicas. One PASS/FAIL line
//! per kernel; non-zero exit on any failure.
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
    },
    Kernel {
        package: "linux-image-6.12.117+deb12-amd64",
        prefix: "linux-image-6.12.",
        suffix: "+deb12-amd64",
    },
];

/// Tested with this release; pinned so a new one cannot change the boot.
const VIRTME_NG: &str = "virtme-ng==1.42";
const VM_PACKAGES: &[&str] = &["qemu-system-x86", "busybox-static", "kmod"];
/// A guest that has not finished by then has hung.
const GUEST_TIMEOUT: Duration = Duration::from_secs(25 * 60);

/// Test binaries run in each guest, with the tests of each to run (empty:
/// all). The namespace tests are the smoke test: a stalled primary's reads
/// moved and every reply rewritten back, nothing lost, through TC and XDP
/// ingress, and the agent on legacy tc filters.
const SUITES: &[(&str, &[&str])] = &[
    ("fixtures", &[]),
    ("fixtures_ipv6", &[]),
    ("hedging_fixtures", &[]),
    ("ejection_fixtures", &[]),
    (
        "steering",
        &[
            "stall_redirects_reads_and_replies_come_from_the_primary_tc_ingress",
            "stall_redirects_reads_and_replies_come_from_the_primary_xdp",
        ],
    ),
    ("legacy_tc", &[]),
    // Ignored on the host, whose kernel has no 802.1Q.
    ("vlan", &[]),
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
        .map(|k| unpack(&dir, k))
        .collect::<Result<Vec<Image>>>()?;
    let built = build(&root)?;
    let mut failed = 0;
    for k in &kernels {
        let began = Instant::now();
        let outcome = run_guest(&dir, k, &built);
        let took = began.elapsed().as_secs();
        match outcome {
            Ok(report) if report.failures.is_empty() => {
                println!(
                    "test-kernels: PASS {} ({} s): {}; {}",
                    k.release, took, report.counts, report.passed
                );
            }
            Ok(report) => {
                failed += 1;
                println!(
                    "test-kernels: FAIL {} ({} s): {}; failed: {}",
                    k.release,
                    took,
                    report.counts,
                    report.failures.join("; ")
                );
            }
            Err(e) => {
                failed += 1;
                println!("test-kernels: FAIL {} ({took} s): {e:#}", k.release);
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
/// example and the test binaries.
struct Built {
    selector: PathBuf,
    verifier_cost: PathBuf,
    suites: Vec<(PathBuf, &'static [&'static str])>,
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
    let mut c = cargo();
    c.args(["test", "--no-run", "--package", "selector-tests"]);
    for (name, _) in SUITES {
        c.args(["--test", name]);
    }
    eprintln!("+ cargo test --no-run (the suites of the matrix)");
    let out = c.stderr(Stdio::piped()).output()?;
    let text = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("building the test binaries failed:\n{text}");
    }
    let mut suites = Vec::new();
    for (name, tests) in SUITES {
        // "Executable tests/NAME.rs (target/debug/deps/NAME-HASH)"
        let path = text
            .lines()
            .find(|l| l.contains(&format!("tests/{name}.rs (")))
            .and_then(|l| l.rsplit_once('(')?.1.strip_suffix(')'))
            .with_context(|| format!("no executable for {name} in cargo's output"))?;
        suites.push((root.join(path), *tests));
    }
    let debug = root.join("target/debug");
    Ok(Built {
        selector: debug.join("selector"),
        verifier_cost: debug.join("examples/verifier_cost"),
        suites,
    })
}

/// A guest's outcome.
struct Report {
    /// Verified instructions per program.
    counts: String,
    passed: String,
    failures: Vec<String>,
}

/// Boots kernel `k` and runs everything; the outcome read from the files
/// the guest wrote.
fn run_guest(dir: &Path, k: &Image, built: &Built) -> Result<Report> {
    let out = dir.join(format!("out-{}", k.release));
    if out.exists() {
        fs::remove_dir_all(&out)?;
    }
    fs::create_dir_all(&out)?;
    let script = out.join("guest.sh");
    fs::write(&script, guest_script(dir, k, built, &out))?;
    let log = fs::File::create(out.join("console.log"))?;
    eprintln!(
        "test-kernels: booting {} under QEMU (TCG); output in {}",
        k.release,
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
        .arg(vmlinuz(dir, k))
        .arg("-e")
        .arg(format!("sh {}", script.display()))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting vng")?;
    let began = Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if began.elapsed() > GUEST_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the guest did not finish in {} s", GUEST_TIMEOUT.as_secs());
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    read_report(&out)
}

/// The guest's script: modules, bpffs, then each step's output and exit
/// code to files in the shared directory.
fn guest_script(dir: &Path, k: &Image, built: &Built, out: &Path) -> String {
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
    s += &format!(
        "{} > {o}/cost.txt 2>&1; echo $? > {o}/cost.rc\n",
        built.verifier_cost.display(),
        o = out.display()
    );
    for (binary, tests) in &built.suites {
        let name = suite_name(binary);
        let filter = if tests.is_empty() {
            String::new()
        } else {
            format!("{} --exact", tests.join(" "))
        };
        s += &format!(
            "{} --test-threads=1 --include-ignored {filter} > {o}/{name}.txt 2>&1; echo $? > {o}/{name}.rc\n",
            binary.display(),
            o = out.display()
        );
    }
    s += &format!("echo done > {}/done\n", out.display());
    s
}

/// `fixtures` of `target/debug/deps/fixtures-0123abcd`.
fn suite_name(binary: &Path) -> String {
    let file = binary.file_name().unwrap_or_default().to_string_lossy();
    file.rsplit_once('-')
        .map_or(file.to_string(), |(n, _)| n.to_string())
}

fn read_report(out: &Path) -> Result<Report> {
    if !out.join("done").exists() {
        bail!(
            "the guest stopped before the end (see {})",
            out.join("console.log").display()
        );
    }
    let read = |name: &str| fs::read_to_string(out.join(name)).unwrap_or_default();
    let mut failures = Vec::new();
    let cost = read("cost.txt");
    let counts: Vec<String> = cost
        .lines()
        .filter_map(|l| {
            let (program, rest) = l.split_once(": ")?;
            let (n, _) = rest.split_once(" verified instructions")?;
            program
                .starts_with("selector_")
                .then(|| format!("{program} {n}"))
        })
        .collect();
    if read("cost.rc").trim() != "0" {
        failures.push(format!(
            "verifier: {}",
            cost.lines()
                .find(|l| l.starts_with("Error"))
                .unwrap_or("no output")
                .chars()
                .take(300)
                .collect::<String>()
        ));
    }
    let mut passed = Vec::new();
    for (name, _) in SUITES {
        let text = read(&format!("{name}.txt"));
        let result = text
            .lines()
            .rev()
            .find(|l| l.starts_with("test result:"))
            .unwrap_or("no result")
            .to_string();
        if read(&format!("{name}.rc")).trim() == "0" {
            passed.push(format!("{name}: {}", summary(&result)));
        } else {
            let failed: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("test ")?.strip_suffix(" ... FAILED"))
                .collect();
            failures.push(format!(
                "{name}: {} [{}]",
                summary(&result),
                failed.join(", ")
            ));
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
}
