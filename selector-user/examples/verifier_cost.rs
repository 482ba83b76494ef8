//! Loads the embedded kernel programs (the agent's, and the benchmark's
//! reference programs) and prints, for each, how many instructions the
//! verifier checked and how long its load took (run as root: `cargo run
//! -p selector-user --example verifier_cost`).

use std::time::Instant;

use anyhow::{Context as _, Result, bail};
use aya::{EbpfLoader, VerifierLogLevel, programs::Program};
use selector_common::{bench, programs};
use selector_user::EBPF_OBJECT;

/// The per-packet cost benchmark's object, built beside the agent's: the
/// library embeds it only for the tests (`testing`), this example always.
static BENCH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/selector-bench"));

fn main() -> Result<()> {
    let start = Instant::now();
    // VERIFIER_LOG=1: the verbose verifier log of every program, on stderr.
    let verbose = std::env::var_os("VERIFIER_LOG").is_some();
    let mut loader = EbpfLoader::new();
    // Without it, a rejected load reports the verifier's error and
    // statistics only: the whole trace takes minutes in an emulated VM.
    // VERIFIER_LOG=debug: the instructions of the path that failed and the
    // states at branches only (much shorter: old kernels keep only the
    // head of a log that overflows).
    loader.verifier_log_level(if !verbose {
        VerifierLogLevel::STATS
    } else if std::env::var("VERIFIER_LOG").is_ok_and(|v| v == "debug") {
        VerifierLogLevel::DEBUG | VerifierLogLevel::STATS
    } else {
        VerifierLogLevel::VERBOSE | VerifierLogLevel::STATS
    });
    let mut agent = loader.load(EBPF_OBJECT).context("loading the object")?;
    let mut benchmark = loader
        .load(BENCH_OBJECT)
        .context("loading the benchmark's object")?;
    println!("objects and maps: {:?}", start.elapsed());
    let mut total = 0;
    for name in [
        programs::EGRESS,
        programs::INGRESS_TC,
        programs::INGRESS_XDP,
        bench::REFERENCE_REQUEST,
        bench::REFERENCE_REPLY,
    ] {
        let ebpf = if bench::PROGRAMS.contains(&name) {
            &mut benchmark
        } else {
            &mut agent
        };
        let began = Instant::now();
        match ebpf.program_mut(name).context(name)? {
            Program::Xdp(p) => p.load()?,
            Program::SchedClassifier(p) => p.load()?,
            _ => bail!("{name}: neither TC nor XDP"),
        }
        let took = began.elapsed();
        let info = ebpf.program(name).context(name)?.info()?;
        let insns = info.verified_instruction_count().unwrap_or(0);
        total += insns;
        println!(
            "{name}: {insns} verified instructions, {} instructions, {} bytes jitted, loaded in {took:?}",
            info.size_translated().unwrap_or(0) / 8,
            info.size_jitted()
        );
    }
    println!(
        "total: {total} verified instructions, {:?}",
        start.elapsed()
    );
    Ok(())
}
