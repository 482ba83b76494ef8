use std::{path::Path, process::Command};

use anyhow::{Context as _, anyhow};
use aya_build::{Package, Toolchain};

/// Builds the kernel crate for the BPF target (nightly, bpf-linker) and puts
/// the object in OUT_DIR, where `selector_user::EBPF_OBJECT` includes it;
/// and sets SELECTOR_GIT_COMMIT for `selector --version` (see [`git_commit`]).
fn main() -> anyhow::Result<()> {
    let commit = git_commit();
    println!("cargo:rustc-env=SELECTOR_GIT_COMMIT={commit}");
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

/// What goes into the binary, relative to the workspace root: a change to
/// any of it makes the build `-dirty`, and reruns this script.
const SOURCES: [&str; 5] = [
    "selector-user",
    "selector-common",
    "selector-ebpf",
    "Cargo.toml",
    "Cargo.lock",
];

/// The commit the binary is built from: git's short hash, `-dirty` if
/// the sources differ from it; SELECTOR_GIT_COMMIT from the environment
/// when set (a packager building from a tarball); else `unknown` (no git,
/// not a checkout).
fn git_commit() -> String {
    println!("cargo:rerun-if-env-changed=SELECTOR_GIT_COMMIT");
    if let Ok(commit) = std::env::var("SELECTOR_GIT_COMMIT") {
        return commit;
    }
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
    let root = Path::new(&manifest_dir).parent().unwrap_or(Path::new("."));
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    // Sources unpacked inside some other checkout are not that checkout's.
    let toplevel = git(&["rev-parse", "--show-toplevel"]).map(|t| Path::new(&t).canonicalize());
    let ours = matches!((toplevel, root.canonicalize()), (Some(Ok(t)), Ok(r)) if t == r);
    let hash = git(&["rev-parse", "--short", "HEAD"]);
    let (true, Some(hash)) = (ours, hash) else {
        return "unknown".into();
    };
    // A commit, a checkout or `git add` moves HEAD, its branch (a loose
    // ref, or packed) or the index. Only files that exist: cargo reruns a
    // script on every build while one it watches is missing.
    let mut watched: Vec<String> = ["HEAD", "index", "packed-refs"].map(String::from).to_vec();
    watched.extend(git(&["symbolic-ref", "-q", "HEAD"]));
    let watched = watched
        .iter()
        .filter_map(|path| git(&["rev-parse", "--git-path", path]))
        .map(|file| root.join(file))
        .chain(SOURCES.iter().map(|source| root.join(source)));
    for file in watched.filter(|file| file.exists()) {
        println!("cargo:rerun-if-changed={}", file.display());
    }
    let mut status = vec!["status", "--porcelain", "--untracked-files=no", "--"];
    status.extend(SOURCES);
    match git(&status) {
        Some(changes) if changes.is_empty() => hash,
        Some(_) => format!("{hash}-dirty"),
        None => "unknown".into(),
    }
}
