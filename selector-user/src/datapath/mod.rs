//! The kernel programs and their maps, from user space: the only layer that
//! names aya maps, programs and links. [`Selector`] is the handle.

pub mod attachment;
pub mod batch;
#[cfg(feature = "testing")]
pub mod bench;
pub mod detach;
pub mod ejection;
pub mod hedges;
pub mod loader;
mod marks;
pub mod next_hops;
pub mod pinning;
#[cfg(feature = "testing")]
pub mod plant;
#[cfg(feature = "testing")]
pub mod recycle;
pub mod regroup;
pub mod slowness;
pub mod snapshot;
pub mod sweep;

pub use loader::Selector;

/// The compiled kernel programs.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/selector"));

/// The per-packet cost benchmark's kernel programs (see `bench`), for the
/// tests only.
#[cfg(any(test, feature = "testing"))]
pub static BENCH_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/selector-bench"));

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use selector_common::{bench, hedge, names, programs};

    use super::{BENCH_OBJECT, EBPF_OBJECT};

    /// The (maps, programs) an object declares; of the maps not aya-log's
    /// nor the compiler's sections (`.rodata`, ...). Its license lets the
    /// programs call GPL-only helpers.
    fn declared(object: &[u8]) -> (BTreeSet<String>, BTreeSet<String>) {
        let object = aya_obj::Object::parse(object).expect("a BPF object");
        assert_eq!(object.license.to_str(), Ok("Dual MIT/GPL"));
        let maps = object
            .maps
            .keys()
            .filter(|name| !name.starts_with('.') && !name.starts_with("AYA_"))
            .cloned()
            .collect();
        (maps, object.programs.keys().cloned().collect())
    }

    fn set(names: &[&str]) -> BTreeSet<String> {
        names.iter().map(|n| n.to_string()).collect()
    }

    #[test]
    fn the_agents_object_declares_the_names_of_selector_common_and_no_benchmark() {
        let (maps, progs) = declared(EBPF_OBJECT);
        let mut want = set(&names::ALL);
        want.extend(set(&hedge::names::ALL));
        assert_eq!(maps, want);
        assert_eq!(progs, set(&programs::ALL));
        for name in maps.iter().chain(&progs) {
            let name = name.to_lowercase();
            assert!(
                !name.contains("reference") && !name.contains("baseline"),
                "{name} in the agent's object"
            );
        }
    }

    #[test]
    fn the_benchmarks_object_declares_its_names() {
        let (maps, progs) = declared(BENCH_OBJECT);
        assert_eq!(maps, set(&bench::MAPS));
        assert_eq!(progs, set(&bench::PROGRAMS));
    }
}
