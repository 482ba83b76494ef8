//! Idempotent setup: each step checks first and says what it does.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Result, bail};

use crate::{packages, run};

/// bpf-linker must be built against the LLVM that nightly rustc uses.
const BPF_LINKER_VERSION: &str = "0.13";
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";

/// Debian packages: the LLVM 22 development files bpf-linker builds against,
/// and the programs the tests, demo and benchmark run.
const PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "memcached",
    "iproute2",
    "ethtool",
    // The fault tests drop and duplicate datagrams at the switch with nft.
    "nftables",
    // kube-proxy's iptables rules for a Service (random endpoint per flow).
    "iptables",
    "nginx",
    "libnginx-mod-stream",
    // setpriv (the capability test) and systemd-analyze (the unit check).
    "util-linux",
    "systemd",
    // DNS replicas and a real DNS client for the overload and fragment tests.
    "nsd",
    "bind9-dnsutils",
    // The benchmark's plots draw text with a TrueType font.
    "fonts-dejavu-core",
    // A real Prometheus server and promtool for the metrics test.
    "prometheus",
    // The benchmark's rows of traffic the selector does not steer: TCP
    // bulk and UDP (iperf3), TCP request/response (sockperf ping-pong;
    // netperf is not in Debian's main archive).
    "iperf3",
    "sockperf",
];

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

fn cargo_bin() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"))
        .join("bin")
}

/// PATH with ~/.cargo/bin first, so the bpf-linker just installed is found.
pub fn path_with_cargo_bin() -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    format!("{}:{path}", cargo_bin().display())
}

fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn output(cmd: &mut Command) -> String {
    cmd.output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

pub fn setup() -> Result<()> {
    debian_packages()?;
    rust_src()?;
    bpf_linker()?;
    eprintln!("setup: ready");
    Ok(())
}

fn debian_packages() -> Result<()> {
    install_missing(PACKAGES, "the tests, demo and benchmark")
}

/// Installs those of `packages` that are missing, saying what and why.
pub fn install_missing(packages: &[&str], why: &str) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| {
            !output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .contains("install ok installed")
        })
        .collect();
    if missing.is_empty() {
        eprintln!("setup: Debian packages for {why} present");
        return Ok(());
    }
    eprintln!(
        "setup: will install {} Debian packages for {why}, their services kept from starting: {}",
        missing.len(),
        missing.join(" ")
    );
    packages::install(Path::new("/"), &missing, run)
}

fn rust_src() -> Result<()> {
    let installed = output(Command::new("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]));
    if installed.lines().any(|l| l.trim() == "rust-src") {
        eprintln!("setup: nightly rust-src present");
        return Ok(());
    }
    if !succeeds(Command::new("rustup").args(["run", "nightly", "rustc", "--version"])) {
        eprintln!("setup: installing the nightly toolchain");
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
        ]))?;
    }
    eprintln!("setup: adding rust-src to nightly (the kernel crate builds core)");
    run(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", "nightly"]))
}

fn bpf_linker() -> Result<()> {
    let linker = cargo_bin().join("bpf-linker");
    let version = output(Command::new(&linker).arg("--version"));
    if version.contains(&format!("bpf-linker {BPF_LINKER_VERSION}")) {
        eprintln!("setup: {} present", version.trim());
        return Ok(());
    }
    if !PathBuf::from(LLVM_PREFIX).join("bin/llvm-config").exists() {
        bail!("{LLVM_PREFIX} is missing; install llvm-22-dev");
    }
    eprintln!("setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (about 2 minutes)");
    let path = format!("{LLVM_PREFIX}/bin:{}", path_with_cargo_bin());
    run(Command::new("cargo")
        .env("PATH", path)
        .env("LLVM_SYS_221_PREFIX", LLVM_PREFIX)
        .args([
            "install",
            "bpf-linker",
            "--version",
            &format!("~{BPF_LINKER_VERSION}"),
            "--no-default-features",
            "--features",
            "llvm-22",
        ]))
}
