//! The per-packet cost benchmark's kernel object (`selector-bench`): two
//! empty programs, the baselines, and the reference request and reply
//! programs with their hash map. The tests and the benchmark load it
//! beside the agent's object; the agent's holds none of it, and the agent
//! embeds it only with the `testing` feature.

use anyhow::{Context as _, Result, bail};
use aya::{Ebpf, EbpfLoader, programs::Program};
use selector_common::bench;

use crate::datapath::BENCH_OBJECT;

/// The benchmark's programs, loaded into the kernel, not attached.
pub struct BenchPrograms {
    ebpf: Ebpf,
}

impl BenchPrograms {
    /// Loads the object, with room for `reference_entries` (at least one)
    /// in the reference programs' map, and every program of it.
    pub fn load(reference_entries: u32) -> Result<Self> {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(bench::REFERENCE, reference_entries.max(1))
            .load(BENCH_OBJECT)
            .context("loading the benchmark's object")?;
        for (name, program) in ebpf.programs_mut() {
            match program {
                Program::SchedClassifier(p) => p.load(),
                Program::Xdp(p) => p.load(),
                _ => bail!("{name}: neither TC nor XDP"),
            }
            .with_context(|| format!("loading {name}"))?;
        }
        Ok(Self { ebpf })
    }

    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }
}
