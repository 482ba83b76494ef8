use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// Builds the kernel crate for the BPF target (nightly, bpf-linker) and puts
/// the object in OUT_DIR, where `selector_user::EBPF_OBJECT` includes it.
fn main() -> anyhow::Result<()> {
    let cargo_metadata::Metadata { packages, .. } = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("MetadataCommand::exec")?;
    let ebpf = packages
        .into_iter()
        .find(|p| p.name.as_str() == "selector-ebpf")
        .ok_or_else(|| anyhow!("selector-ebpf package not found"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("no parent for {}", ebpf.manifest_path))?
        .as_str();
    aya_build::build_ebpf(
        [Package {
            name: ebpf.name.as_str(),
            root_dir,
            ..Default::default()
        }],
        Toolchain::default(),
    )
}
