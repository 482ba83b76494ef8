use which::which;

/// Rebuild when bpf-linker changes: it is the linker for the bpfel target
/// but cargo does not track it. The objects are generated for BPF ISA v3:
/// the in-flight table claims slots with compare-and-swap and reads the old
/// value of an atomic OR and an atomic add, which v3's atomic instructions
/// provide (kernel 5.12+); a fetching add must be sequentially consistent
/// to be emitted as one.
fn main() {
    let bpf_linker = which("bpf-linker").expect("bpf-linker not found; run `cargo xtask setup`");
    println!("cargo:rerun-if-changed={}", bpf_linker.to_str().unwrap());
    println!("cargo:rustc-link-arg=--cpu-features=+alu32");
}
