//! `cargo xtask`: setup, build, run (demo or agent), test, bench and docs.
//!
//! xtask depends on nothing that needs the BPF toolchain, so it compiles on a
//! fresh machine and installs that toolchain before anything else builds.

mod kernels;
mod packages;
mod setup;

use std::process::Command;

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Build, run, test and benchmark the selector"
)]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what is missing: nightly rust-src, bpf-linker (LLVM 22), Debian packages.
    Setup,
    /// Build the agent (and the kernel programs it embeds), and
    /// `selector-load`, the load generator of docs/getting-started.md.
    Build {
        #[arg(long)]
        release: bool,
    },
    /// With no arguments: the demo (3 memcached replicas in namespaces, a
    /// stalling primary, the live table). With arguments: `selector` itself,
    /// e.g. `cargo xtask run -- run --iface eth0 --group ...`.
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Formatting and lint checks, host unit tests, packet-fixture and
    /// namespace integration tests (needs root), then the kernel matrix
    /// (`test-kernels`).
    Test {
        /// Skip fmt and clippy.
        #[arg(long)]
        no_lint: bool,
        /// Skip the kernel matrix.
        #[arg(long)]
        no_kernels: bool,
    },
    /// The kernel matrix: boots Debian's 6.1 and 6.12 kernels under QEMU
    /// (virtme-ng) and runs the verifier cost, the packet fixtures and
    /// namespace smoke tests in each; one PASS/FAIL line per kernel.
    TestKernels {
        /// Only kernels whose release starts with one of these (e.g. 6.1).
        kernels: Vec<String>,
    },
    /// The replica-stall benchmark and per-packet costs (see docs/bench/).
    Bench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Regenerate docs/reference/cli.md, the tunables of deploy/selector.toml
    /// and of the status example from the agent's clap definitions and
    /// defaults (`tests/tests/docs.rs` fails while a committed file is stale).
    Docs,
}

/// Runs a command, echoing it, failing on a non-zero exit.
pub fn run(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {}", describe(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("starting {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(cmd));
    }
    Ok(())
}

fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program().to_string_lossy().into_owned())
        .chain(cmd.get_args().map(|a| a.to_string_lossy().into_owned()))
        .collect::<Vec<_>>()
        .join(" ")
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.env("PATH", setup::path_with_cargo_bin());
    c
}

/// `cargo run --release` of one binary, with its arguments.
fn release_binary(package: &str, bin: &str, args: &[String]) -> Command {
    let mut c = cargo();
    c.args(["run", "--release", "--package", package, "--bin", bin, "--"]);
    c.args(args);
    c
}

fn require_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc_geteuid() } != 0 {
        bail!("{what} needs root (BPF programs and network namespaces)");
    }
    Ok(())
}

unsafe extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Task::Setup => setup::setup(),
        Task::Build { release } => {
            setup::setup()?;
            let mut c = cargo();
            c.args(["build", "--package", "selector-user", "--package"]);
            c.args([
                "selector-tests",
                "--bin",
                "selector",
                "--bin",
                "selector-load",
            ]);
            if release {
                c.arg("--release");
            }
            run(&mut c)
        }
        Task::Run { args } => {
            setup::setup()?;
            require_root("running the selector")?;
            if args.is_empty() {
                // The demo runs the real agent binary: build it first.
                run(cargo().args(["build", "--release", "--package", "selector-user"]))?;
                run(&mut release_binary("selector-tests", "selector-demo", &[]))
            } else {
                run(&mut release_binary("selector-user", "selector", &args))
            }
        }
        Task::Test {
            no_lint,
            no_kernels,
        } => {
            let mut times = Times::default();
            times.part("setup", setup::setup)?;
            require_root("the integration tests")?;
            if !no_lint {
                times.part("fmt and clippy", lint)?;
            }
            let suite = times.part("host tests", run_tests);
            let matrix = if no_kernels {
                Ok(())
            } else {
                times.part("kernel matrix", || kernels::test_kernels(&[]))
            };
            // The totals and times lines close the output, whatever failed.
            let totals = suite?;
            println!("{totals}");
            println!("{times}");
            totals.check()?;
            matrix
        }
        Task::TestKernels { kernels } => {
            setup::setup()?;
            require_root("the kernel matrix")?;
            kernels::test_kernels(&kernels)
        }
        Task::Docs => {
            setup::setup()?;
            // The generator is the freshness test itself, told to write.
            run(cargo()
                .env("SELECTOR_WRITE_DOCS", "1")
                .args(["test", "--package", "selector-tests", "--test", "docs"])
                .args(["--", "generated_"]))
        }
        Task::Bench { args } => {
            setup::setup()?;
            require_root("the benchmark")?;
            // The agent itself, for the rows that run it as a process.
            run(cargo().args([
                "build",
                "--release",
                "--package",
                "selector-user",
                "--bin",
                "selector",
            ]))?;
            run(&mut release_binary(
                "selector-tests",
                "selector-bench",
                &args,
            ))
        }
    }
}

/// Wall time per part of `cargo xtask test`, printed at its end.
#[derive(Default)]
struct Times(Vec<(&'static str, std::time::Duration)>);

impl Times {
    fn part<T>(&mut self, name: &'static str, f: impl FnOnce() -> T) -> T {
        let began = std::time::Instant::now();
        let out = f();
        self.0.push((name, began.elapsed()));
        out
    }
}

impl std::fmt::Display for Times {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|(name, took)| format!("{name} {} s", took.as_secs()))
            .collect();
        let total: u64 = self.0.iter().map(|(_, t)| t.as_secs()).sum();
        write!(f, "times: {} (total {total} s)", parts.join(", "))
    }
}

/// The totals over every test binary of `cargo test`.
struct Totals {
    passed: u64,
    failed: u64,
    ignored: u64,
    status: std::process::ExitStatus,
}

impl std::fmt::Display for Totals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tests: {} passed, {} failed, {} skipped",
            self.passed, self.failed, self.ignored
        )
    }
}

impl Totals {
    fn check(&self) -> Result<()> {
        if !self.status.success() {
            bail!("cargo test failed ({})", self.status);
        }
        Ok(())
    }
}

/// `cargo test` on the default members, echoing its output; the totals
/// over every test binary.
fn run_tests() -> Result<Totals> {
    use std::io::{BufRead as _, BufReader};
    let mut c = cargo();
    c.args(["test", "--no-fail-fast", "--", "--test-threads=2"]);
    eprintln!("+ {}", describe(&c));
    let mut child = c.stdout(std::process::Stdio::piped()).spawn()?;
    let (mut passed, mut failed, mut ignored) = (0u64, 0u64, 0u64);
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        println!("{line}");
        if let Some(rest) = line.strip_prefix("test result: ") {
            for part in rest.split(';') {
                let mut words = part.split_whitespace().rev();
                let (Some(what), Some(n)) = (words.next(), words.next()) else {
                    continue;
                };
                let n: u64 = n.parse().unwrap_or(0);
                match what {
                    "passed" => passed += n,
                    "failed" => failed += n,
                    "ignored" => ignored += n,
                    _ => {}
                }
            }
        }
    }
    let status = child.wait()?;
    Ok(Totals {
        passed,
        failed,
        ignored,
        status,
    })
}

/// fmt and clippy, for the host crates and for the kernel crate on its target.
fn lint() -> Result<()> {
    run(cargo().args(["fmt", "--all", "--check"]))?;
    // Default members: every crate but the kernel one, which is linted next.
    run(cargo().args(["clippy", "--all-targets", "--", "-D", "warnings"]))?;
    let root = setup::workspace_root();
    run(Command::new("cargo")
        .env("PATH", setup::path_with_cargo_bin())
        .current_dir(root.join("selector-ebpf"))
        .args([
            "+nightly",
            "clippy",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--",
            "-D",
            "warnings",
        ]))
}
