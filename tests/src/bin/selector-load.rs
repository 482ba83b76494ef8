//! `selector-load`: a memcached UDP read load for trying the selector by
//! hand (docs/getting-started.md). Stores `--keys` keys on every replica
//! named, then sends `--rate` gets per second of them to `--target` (the
//! primary) for `--seconds`, open loop, on one connected socket as an
//! application would, and prints what it saw: replies, wrong values and
//! latency percentiles measured from each get's intended send time (a
//! stalled replica cannot hide behind a stalled sender).
//!
//! Run it where the application would run (in a client namespace: `ip
//! netns exec NS selector-load ...`).

use std::{net::SocketAddr, time::Duration};

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use selector_testbed::{
    LoadSpec, MemcachedClient,
    memcached::{key_for, value_for},
    run_load,
};

#[derive(Parser)]
#[command(about = "A memcached UDP read load to one replica, with latency percentiles")]
struct Args {
    /// The replica to read from (the primary), ADDR:PORT.
    #[arg(long)]
    target: SocketAddr,
    /// The replicas to store the keys on first, comma-separated (every
    /// member of the group, so that a read moved elsewhere finds its
    /// value) [default: the target]
    #[arg(long, value_delimiter = ',')]
    store_on: Vec<SocketAddr>,
    /// Gets per second.
    #[arg(long, default_value_t = 2000)]
    rate: u32,
    /// How long to send.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Distinct keys read (and stored).
    #[arg(long, default_value_t = 500)]
    keys: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.rate == 0 || !(args.seconds > 0.0 && args.seconds <= 86_400.0) {
        bail!("--rate must be at least 1 and --seconds more than 0 (at most a day)");
    }
    let store_on = if args.store_on.is_empty() {
        vec![args.target]
    } else {
        args.store_on.clone()
    };
    for &replica in &store_on {
        let client = MemcachedClient::connect(replica)
            .with_context(|| format!("connecting to {replica}"))?;
        for i in 0..args.keys {
            client.set(&key_for(i), &value_for(i)).with_context(|| {
                format!("storing keys on {replica} (is memcached running there with -U PORT?)")
            })?;
        }
    }
    println!(
        "selector-load: {} keys stored on {}; sending {} gets/s to {} for {} s",
        args.keys,
        store_on
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        args.rate,
        args.target,
        args.seconds
    );
    let report = run_load(&LoadSpec {
        target: args.target,
        rate: args.rate,
        duration: Duration::from_secs_f64(args.seconds),
        keys: args.keys,
        drain: Duration::from_millis(500),
    })?;
    println!("selector-load: {}", report.describe());
    if report.received == 0 {
        bail!("no reply came back from {}", args.target);
    }
    Ok(())
}
