//! The replica-stall benchmark behind `cargo xtask bench`: the BookKeeper
//! experiment (three replicas, short stalls of the primary, client read
//! latency) with the selector and the alternatives users would pick
//! instead, side by side in one run, plus the kernel programs' per-packet
//! cost. See docs/bench/README.md for the current report and
//! docs/bench/method.md for the method.

pub mod agent_process;
pub mod client;
pub mod failures;
pub mod nginx;
pub mod open_loop;
pub mod packet_cost;
pub mod plots;
pub mod report;
pub mod resolver;
pub mod rows;
pub mod scale;
pub mod scenario;
pub mod slowdowns;
pub mod steady;
pub mod throughput;
pub mod untouched;

pub use report::Report;
pub use rows::Row;
pub use scenario::{Options, run, stop_on_signals};

/// The middle value (the upper one of an even count); `values` not empty.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
