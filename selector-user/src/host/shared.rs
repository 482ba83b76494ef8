//! Array maps the kernel shares with the agent through mmap
//! (`BPF_F_MMAPABLE`). The agent reads them without a system call per
//! element and updates them with the same atomic instructions the kernel
//! programs use, so a claim and its count happen together with nothing in
//! between that could fail.

use std::{
    io,
    os::fd::{AsRawFd as _, BorrowedFd},
    ptr::NonNull,
    sync::atomic::{AtomicU64, Ordering},
};

/// A mapped BPF array of `len` elements of `T` (8-byte aligned, as the
/// kernel lays them out).
pub struct SharedArray<T> {
    base: NonNull<T>,
    len: usize,
    bytes: usize,
}

// SAFETY: the memory is shared with the kernel anyway; all mutation goes
// through atomics or volatile accesses.
unsafe impl<T> Send for SharedArray<T> {}

impl<T> SharedArray<T> {
    /// Maps the array behind `fd`, which has `len` elements.
    pub fn map(fd: BorrowedFd<'_>, len: usize) -> io::Result<Self> {
        assert!(
            size_of::<T>().is_multiple_of(8),
            "array elements are 8-byte multiples"
        );
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let bytes = (len * size_of::<T>()).div_ceil(page) * page;
        // SAFETY: a fresh shared mapping of the map's fd, checked below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            base: NonNull::new(addr.cast()).expect("mmap never returns null on success"),
            len,
            bytes,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element `i`.
    pub fn ptr(&self, i: usize) -> *mut T {
        assert!(i < self.len, "index {i} out of {}", self.len);
        // SAFETY: in bounds of the mapping.
        unsafe { self.base.as_ptr().add(i) }
    }

    /// A copy of element `i` (fields may be torn by concurrent writers;
    /// callers that need consistency validate with a state word).
    pub fn read(&self, i: usize) -> T {
        // SAFETY: in bounds; the memory stays mapped while self lives.
        unsafe { std::ptr::read_volatile(self.ptr(i)) }
    }
}

impl<T> Drop for SharedArray<T> {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.bytes) };
    }
}

/// The `u64` at `p` as an atomic.
///
/// # Safety
/// `p` must point into a live mapping, 8-byte aligned.
pub unsafe fn atomic<'a>(p: *mut u64) -> &'a AtomicU64 {
    // SAFETY: per the caller; AtomicU64 has u64's layout.
    unsafe { AtomicU64::from_ptr(p) }
}

/// Loads the `u64` at `p`.
///
/// # Safety
/// As for [`atomic`].
pub unsafe fn load(p: *mut u64) -> u64 {
    unsafe { atomic(p) }.load(Ordering::Acquire)
}
