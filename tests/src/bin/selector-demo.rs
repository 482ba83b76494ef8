//! `cargo xtask run` with no arguments: the selector on built-in defaults.
//!
//! Three memcached UDP replicas and a client in network namespaces; a load
//! client sends gets to the primary; the primary stalls (SIGSTOP) for 25 ms
//! every 500 ms; the real `selector` agent prints its live table, where reads
//! leave the primary during each stall and return after it. Then the same
//! load and stalls without the agent, and what the client saw each time.
//! Everything it creates is removed at the end, also on Ctrl-C.

use std::{
    path::PathBuf,
    process::Child,
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use selector_testbed::{LoadReport, LoadSpec, Testbed, preload, run_load, topology::CLIENT_IFACE};

#[derive(Parser)]
#[command(about = "Demo: the selector steering reads around a stalling memcached replica")]
struct Args {
    /// How long the demo runs.
    #[arg(long, default_value_t = 8.0)]
    seconds: f64,
    /// Reads per second from the client.
    #[arg(long, default_value_t = 2000)]
    rate: u32,
    /// Primary stall length and period, in milliseconds.
    #[arg(long, default_value_t = 25)]
    stall_ms: u64,
    #[arg(long, default_value_t = 500)]
    stall_every_ms: u64,
    /// Threshold passed to the agent.
    #[arg(long, default_value_t = 4)]
    threshold: u32,
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

fn selector_binary() -> Result<PathBuf> {
    let bin = std::env::current_exe()?.with_file_name("selector");
    if !bin.exists() {
        bail!(
            "{} not found: build it with `cargo build --release -p selector-user`",
            bin.display()
        );
    }
    Ok(bin)
}

/// The client's gets to `target` for `args.seconds`, the primary stopped
/// `stall_ms` every `stall_every_ms`; `None` when interrupted.
fn stalled_load(
    tb: &Testbed,
    args: &Args,
    target: std::net::SocketAddr,
) -> Result<Option<LoadReport>> {
    let spec = LoadSpec {
        target,
        rate: args.rate,
        duration: Duration::from_secs_f64(args.seconds),
        keys: 500,
        drain: Duration::from_millis(500),
    };
    let load = tb.client.spawn(move || run_load(&spec))?;
    let start = Instant::now();
    let mut next_stall = start + Duration::from_millis(args.stall_every_ms);
    while start.elapsed().as_secs_f64() < args.seconds && !INTERRUPTED.load(Ordering::Relaxed) {
        if Instant::now() >= next_stall {
            tb.replicas[0].stop();
            thread::sleep(Duration::from_millis(args.stall_ms));
            tb.replicas[0].resume();
            next_stall += Duration::from_millis(args.stall_every_ms);
        }
        thread::sleep(Duration::from_millis(1));
    }
    if INTERRUPTED.load(Ordering::Relaxed) {
        return Ok(None);
    }
    let report = load
        .join()
        .map_err(|_| anyhow::anyhow!("load panicked"))??;
    Ok(Some(report))
}

fn main() -> Result<()> {
    let args = Args::parse();
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let selector = selector_binary()?;
    println!("demo: creating namespaces (client, switch, 3 replicas) and starting memcached -U");
    let mut tb = Testbed::new("demo", 3)?;
    tb.start_memcached()?;
    let replicas = tb.replica_endpoints();
    preload(&tb.client, &replicas, 500)?;
    let group = replicas
        .iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join(",");
    println!(
        "demo: primary {} stalls {} ms every {} ms; client sends {} gets/s to it for {} s",
        replicas[0], args.stall_ms, args.stall_every_ms, args.rate, args.seconds
    );
    println!("demo: watch away/s on the primary and to/s on the replicas during stalls\n");

    let mut agent: Child = tb
        .client
        .command(selector.to_str().context("path")?)
        .args(["run", "--iface", CLIENT_IFACE, "--group", &group])
        .args([
            "--threshold",
            &args.threshold.to_string(),
            "--interval",
            "250",
            "--timeout",
            "500",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the agent")?;
    // The load starts once the agent says it is attached (a read sent
    // earlier would go uncounted); its output is passed through.
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(
        agent.stdout.take().context("agent stdout")?,
    ));
    loop {
        let Some(line) = lines.next().transpose()? else {
            let status = agent.wait()?;
            bail!("the agent exited early: {status}");
        };
        println!("{line}");
        if line.starts_with("selector: attached to") {
            break;
        }
    }
    thread::spawn(move || {
        for line in lines.map_while(Result::ok) {
            println!("{line}");
        }
    });

    let with = stalled_load(&tb, &args, replicas[0].into())?;
    unsafe { libc::kill(agent.id() as i32, libc::SIGTERM) };
    agent.wait()?;
    if let Some(with) = with {
        // The same load and stalls without the agent: what it changed.
        println!("\ndemo: the same load and stalls again, without the selector");
        if let Some(without) = stalled_load(&tb, &args, replicas[0].into())? {
            println!("\ndemo: the client saw");
            println!("  with the selector:    {}", with.describe());
            println!("  without the selector: {}", without.describe());
            println!(
                "demo: a read sent just as a stall begins still waits it out (the p99.9); `--hedge-after auto` covers those"
            );
        }
    }
    drop(tb);
    println!("demo: removed every namespace and process it created");
    Ok(())
}
