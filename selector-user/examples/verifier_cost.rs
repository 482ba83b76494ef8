//! Loads the embedded kernel programs (the agent's, and the benchmark's
//! reference programs) and prints, for each, how many instructions the
//! verifier checked and how long its load took (run as root: `cargo run
//! -p selector-user --example verifier_cost`).
//!
//! With `--canary`, loads only a three-instruction program that uses a
//! sign-extending move (BPF ISA v4, Linux 6.6): kernels before 6.6 refuse
//! it, later ones accept it. The kernel matrix runs it to prove, on every
//! run, that a refusal on one of its kernels fails the matrix.

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
    if std::env::args().nth(1).as_deref() == Some("--canary") {
        return canary();
    }
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

/// `union bpf_attr` for BPF_PROG_LOAD, as far as this load needs it.
#[repr(C)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
}

/// A `struct bpf_insn`: opcode, registers, offset, immediate.
const fn insn(code: u8, regs: u8, off: i16, imm: i32) -> u64 {
    code as u64 | (regs as u64) << 8 | (off as u16 as u64) << 16 | (imm as u32 as u64) << 32
}

/// Loads the canary (see the module's comment) as a TC program and reports
/// it as the agent's programs are reported: its verified instructions, or
/// an error with the verifier's words.
fn canary() -> Result<()> {
    const BPF_PROG_LOAD: libc::c_long = 5;
    const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
    let program = [
        insn(0xb7, 0, 0, 0), // r0 = 0
        insn(0xbf, 0, 8, 0), // r0 = (s8) r0: ISA v4's movsx
        insn(0x95, 0, 0, 0), // exit
    ];
    let license = c"GPL";
    let mut log = vec![0u8; 4096];
    let mut name = [0u8; 16];
    name[..15].copy_from_slice(b"selector_canary");
    let attr = ProgLoadAttr {
        prog_type: BPF_PROG_TYPE_SCHED_CLS,
        insn_cnt: program.len() as u32,
        insns: program.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 1,
        log_size: log.len() as u32,
        log_buf: log.as_mut_ptr() as u64,
        kern_version: 0,
        prog_flags: 0,
        prog_name: name,
        prog_ifindex: 0,
        expected_attach_type: 0,
    };
    // SAFETY: the attribute and every buffer it points to outlive the call.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_LOAD,
            &attr as *const ProgLoadAttr,
            size_of::<ProgLoadAttr>() as u32,
        )
    };
    if fd < 0 {
        let error = std::io::Error::last_os_error();
        let words = String::from_utf8_lossy(&log);
        let words = words.trim_end_matches('\0').trim();
        bail!("loading selector_canary: {error}. Verifier output: {words}");
    }
    // SAFETY: a descriptor the kernel just gave this process.
    unsafe { libc::close(fd as i32) };
    println!("selector_canary: accepted ({} instructions)", program.len());
    Ok(())
}
