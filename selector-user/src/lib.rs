//! The selector agent as a library: the `selector` binary, the integration
//! tests and the demo/benchmark drive the same code.

pub mod attachment;
pub mod build_info;
pub mod cli;
pub mod config;
pub mod control;
pub mod health;
pub mod hedge_auto;
pub mod hedge_wire;
pub mod hedging;
pub mod interface;
pub mod loader;
mod marks;
pub mod metrics;
pub mod neighbours;
pub mod netns;
pub mod next_hops;
pub mod percpu_batch;
pub mod pinning;
pub mod plant;
pub mod preflight;
pub mod reload;
pub mod resolv_conf;
pub mod sd_notify;
pub mod settings;
pub mod shared;
pub mod sweep;
pub mod sys;
pub mod tc_attach;
pub mod telemetry;

pub use loader::Selector;
pub use settings::{IngressMode, Settings};

/// The compiled kernel programs.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/selector"));
