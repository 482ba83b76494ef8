use which::which;

/// Rebuild when bpf-linker changes: it is the linker for the bpfel target
/// but cargo does not track it.
fn main() {
    let bpf_linker = which("bpf-linker").expect("bpf-linker not found; run `cargo xtask setup`");
    println!("cargo:rerun-if-changed={}", bpf_linker.to_str().unwrap());
}
