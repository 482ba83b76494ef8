//! A value the compiler cannot see through, for the kernel programs: masks
//! that must not become branches (each branch splits the verifier's walk),
//! packet offsets whose comparison must keep the form the verifier learns
//! a range from.
//!
//! `core::hint::black_box` does this by storing the value to the stack and
//! loading it back: a store and a load on the dependency chain of every
//! comparison, a dozen per group member in the policy's pass and two per
//! packet read. In the kernel build it is a move of the register to
//! itself in an assembly block instead; the verifier follows a move as it
//! follows a spill. (An empty block leaves two line records at one
//! instruction, which the loader refuses.)

/// `x`, opaque to the optimiser.
#[inline(always)]
pub fn opaque(x: u64) -> u64 {
    #[cfg(target_arch = "bpf")]
    {
        let mut x = x;
        // SAFETY: one register move, no memory.
        unsafe {
            core::arch::asm!("{0} = {0}", inout(reg) x, options(pure, nomem, nostack, preserves_flags))
        };
        x
    }
    #[cfg(not(target_arch = "bpf"))]
    core::hint::black_box(x)
}

/// `opaque` for a `usize` (an offset, or a pointer's address).
#[inline(always)]
pub fn opaque_usize(x: usize) -> usize {
    opaque(x as u64) as usize
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_value_comes_back_unchanged() {
        for x in [0, 1, u64::MAX, 1 << 63, 0x1234_5678_9abc_def0] {
            assert_eq!(super::opaque(x), x);
            assert_eq!(super::opaque_usize(x as usize), x as usize);
        }
    }
}
