//! Map layouts, constants and the pure logic shared by the selector's kernel
//! programs and its agent. Everything here is `no_std` so the same code runs in
//! the kernel and in host unit tests.
#![no_std]
// The kernel build's register barrier (`opaque`).
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

// clap's derive names `std`; the agent's build (feature `user`) has it.
#[cfg(feature = "user")]
extern crate std;

pub mod blame;
pub mod checksum;
pub mod descriptor;
pub mod ejection;
pub mod fragments;
pub mod hedge;
pub mod inflight;
pub mod latency;
pub mod maps;
pub mod opaque;
pub mod policy;
pub mod reject;
pub mod service;
pub mod slowness;

pub use descriptor::Descriptor;
pub use maps::*;
pub use policy::{Policy, TieBreak};
