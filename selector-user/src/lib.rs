//! The selector agent as a library: the `selector` binary, the integration
//! tests and the demo/benchmark drive the same code.
//!
//! Layers, top to bottom; a module imports only from its own layer or the
//! ones below it (`layering` checks every `use crate::` edge):
//!
//! - [`cli`]: the command line, its flags and the text it prints;
//! - [`agent`]: the running agent: its owner loop, the control server,
//!   reloads, the metrics and probe endpoint, systemd notifications;
//! - [`datapath`]: the only code that names aya maps, programs and links:
//!   loading, attaching, adopting and detaching, pins, the in-flight sweep,
//!   the hedge hand-over in the shared slots, counters read from the maps;
//! - [`hedging`]: the hedge thread (timer queue, budget, raw-socket sends);
//! - [`host`]: the host around the programs: interfaces, neighbours and
//!   routes over netlink, network namespaces, kernel features, syscalls;
//! - [`api`]: the control protocol's types (also `status --json`);
//! - [`telemetry`]: the read model of the counters (no I/O, no text);
//! - [`config`]: settings, their defaults, validation and the config file.

pub mod agent;
pub mod api;
pub mod cli;
pub mod config;
pub mod datapath;
pub mod hedging;
pub mod host;
pub mod telemetry;

#[cfg(test)]
mod layering;

pub use config::settings::{IngressMode, Settings};
pub use datapath::{EBPF_OBJECT, Selector};
