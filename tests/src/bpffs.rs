//! A bpf filesystem of a test's own. `ip netns exec` gives the agent a
//! mount namespace with a fresh /sys, so /sys/fs/bpf would not reach it; a
//! mount made by the test process does, and dropping it drops every pin
//! left in it.

use std::{ffi::CString, path::PathBuf};

use crate::netns::unique_tag;

/// A bpf filesystem mounted on a fresh temporary directory; unmounted and
/// removed on drop.
pub struct Bpffs {
    path: PathBuf,
}

impl Bpffs {
    pub fn mount() -> Self {
        let path = std::env::temp_dir().join(format!("selector-pin-{}", unique_tag()));
        std::fs::create_dir_all(&path).unwrap();
        let target = CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: valid NUL-terminated strings; no data.
        let rc = unsafe {
            libc::mount(
                c"bpf".as_ptr(),
                target.as_ptr(),
                c"bpf".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "mount bpffs: {}", std::io::Error::last_os_error());
        Self { path }
    }

    /// The directory given to `--pin`.
    pub fn dir(&self) -> PathBuf {
        self.path.join("selector")
    }

    pub fn arg(&self) -> String {
        self.dir().to_str().unwrap().to_string()
    }
}

impl Drop for Bpffs {
    fn drop(&mut self) {
        let target = CString::new(self.path.to_str().unwrap()).unwrap();
        // SAFETY: valid path; a lazy unmount of our own mount.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        let _ = std::fs::remove_dir(&self.path);
    }
}
