//! What the two objects of this crate share: the one bounds-checked packet
//! accessor (`access`), the panic handler and the license. The agent's programs (`selector`, `main.rs`) and
//! the per-packet cost benchmark's (`selector-bench`, `bench/main.rs`) are
//! its two binaries, each an object of its own. Also a library target so
//! that selector-user can name this crate as a build-dependency, and cargo
//! rebuilds the objects when it changes.
#![no_std]
// As in the programs: an error is only ever "pass the packet untouched".
#![allow(clippy::result_unit_err)]

pub mod access;

// The objects' panic handler and license, here once for both (the host
// build of this library, selector-user's build-dependency, has std's).
#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
#[used]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";
