//! The kernel programs and their maps, from user space: the only layer that
//! names aya maps, programs and links. [`Selector`] is the handle.

pub mod attachment;
pub mod detach;
pub mod ejection;
pub mod endpoint;
pub mod hedges;
pub mod loader;
mod marks;
pub mod next_hops;
pub mod percpu_batch;
pub mod pinning;
#[cfg(feature = "testing")]
pub mod plant;
pub mod regroup;
pub mod snapshot;
pub mod sweep;

pub use loader::Selector;

/// The compiled kernel programs.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/selector"));
