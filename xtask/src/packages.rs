//! Installing Debian packages without harm to the host: no package's
//! service starts during the install (a temporary `/usr/sbin/policy-rc.d`
//! that forbids every start, the operator's own put back afterwards), and
//! nothing already running is stopped or killed.

use std::{
    fs,
    io::ErrorKind,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::Command,
    sync::atomic::{AtomicBool, Ordering},
};

use anyhow::{Context as _, Result, bail};

/// Where invoke-rc.d and deb-systemd-invoke look for the local policy.
pub const POLICY_RC_D: &str = "usr/sbin/policy-rc.d";

/// Marks the policy as ours, so a leftover from a killed setup is recognised.
const MARKER: &str = "# Written by `cargo xtask setup` for the duration of an apt-get install.";

/// Exit status 101: "action forbidden by policy": maintainer scripts then
/// leave every service stopped.
fn policy_script() -> String {
    format!(
        "#!/bin/sh\n{MARKER}\n# Removed (and any earlier policy put back) when the install ends.\nexit 101\n"
    )
}

/// The commands that install `missing`, in order. Nothing else runs: no
/// service is stopped or killed, whether it came with a package or not.
pub fn install_commands(missing: &[&str]) -> Vec<Command> {
    let mut update = Command::new("apt-get");
    update.args(["update", "-qq"]);
    let mut install = Command::new("apt-get");
    install
        .env("DEBIAN_FRONTEND", "noninteractive")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(missing);
    vec![update, install]
}

/// Runs [`install_commands`] through `run` with the services kept from
/// starting ([`PolicyGuard`] under `root`, `/` on a real host), and stops
/// early, the policy put back, if xtask is interrupted in between.
pub fn install(
    root: &Path,
    missing: &[&str],
    mut run: impl FnMut(&mut Command) -> Result<()>,
) -> Result<()> {
    let guard = PolicyGuard::install(root)?;
    let shield = InterruptShield::new();
    let mut result = Ok(());
    for mut command in install_commands(missing) {
        if shield.interrupted() {
            result = Err(anyhow::anyhow!("interrupted"));
            break;
        }
        result = run(&mut command);
        if result.is_err() {
            break;
        }
    }
    let restored = guard.restore();
    drop(shield);
    result?;
    restored
}

/// A `policy-rc.d` that forbids every service start, in place while it
/// lives; an earlier policy is moved aside and put back on
/// [`PolicyGuard::restore`], or on drop (an error, a panic).
#[derive(Debug)]
pub struct PolicyGuard {
    path: PathBuf,
    saved: PathBuf,
    had_one: bool,
    done: bool,
}

impl PolicyGuard {
    pub fn install(root: &Path) -> Result<Self> {
        let path = root.join(POLICY_RC_D);
        let saved = path.with_extension("d.xtask-saved");
        recover_leftover(&path, &saved)?;
        let had_one = match fs::symlink_metadata(&path) {
            Ok(_) => true,
            Err(e) if e.kind() == ErrorKind::NotFound => false,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        if had_one {
            fs::rename(&path, &saved).with_context(|| {
                format!("moving {} aside to {}", path.display(), saved.display())
            })?;
        }
        let guard = Self {
            path,
            saved,
            had_one,
            done: false,
        };
        if let Some(dir) = guard.path.parent() {
            fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        fs::write(&guard.path, policy_script())
            .and_then(|()| fs::set_permissions(&guard.path, fs::Permissions::from_mode(0o755)))
            .with_context(|| format!("writing {}", guard.path.display()))?;
        Ok(guard)
    }

    /// Removes the temporary policy and puts back the one it replaced.
    pub fn restore(mut self) -> Result<()> {
        self.done = true;
        self.put_back()
    }

    fn put_back(&self) -> Result<()> {
        remove_if_ours(&self.path)?;
        if self.had_one {
            fs::rename(&self.saved, &self.path).with_context(|| {
                format!(
                    "putting {} back from {}",
                    self.path.display(),
                    self.saved.display()
                )
            })?;
        }
        Ok(())
    }
}

impl Drop for PolicyGuard {
    fn drop(&mut self) {
        if !self.done
            && let Err(e) = self.put_back()
        {
            eprintln!("setup: {e:#}");
        }
    }
}

fn is_ours(path: &Path) -> bool {
    fs::read_to_string(path).is_ok_and(|text| text.contains(MARKER))
}

fn remove_if_ours(path: &Path) -> Result<()> {
    if is_ours(path) {
        fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
    }
    Ok(())
}

/// A setup killed mid-install (SIGKILL, a power cut) left its policy in
/// place, and maybe the operator's one aside: undo that first.
fn recover_leftover(path: &Path, saved: &Path) -> Result<()> {
    if !is_ours(path) {
        if saved.exists() && !path.exists() {
            // Killed between moving the operator's aside and writing ours.
            return fs::rename(saved, path)
                .with_context(|| format!("putting {} back", path.display()));
        }
        if saved.exists() {
            bail!(
                "{} exists beside a policy-rc.d that is not setup's: put the right one in place and remove the other",
                saved.display()
            );
        }
        return Ok(());
    }
    eprintln!(
        "setup: removing the {} an interrupted setup left",
        path.display()
    );
    remove_if_ours(path)?;
    if saved.exists() {
        fs::rename(saved, path).with_context(|| format!("putting {} back", path.display()))?;
    }
    Ok(())
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn note_interrupt(_signal: i32) {
    INTERRUPTED.store(true, Ordering::Relaxed);
}

const SIGHUP: i32 = 1;
const SIGINT: i32 = 2;
const SIGTERM: i32 = 15;

unsafe extern "C" {
    fn signal(signum: i32, handler: usize) -> usize;
}

/// Sets a signal's disposition; returns the one it replaces.
fn set_handler(s: i32, handler: usize) -> usize {
    // SAFETY: every handler set here either was in place before or only
    // stores to an atomic, which is async-signal-safe.
    unsafe { signal(s, handler) }
}

/// While it lives, SIGINT, SIGTERM and SIGHUP only take note, so that a
/// Ctrl-C during apt-get (which the child gets too, and dies of) still
/// lets xtask put the policy back. Children start with the default
/// handlers (a handler does not survive exec).
struct InterruptShield {
    previous: Vec<(i32, usize)>,
}

impl InterruptShield {
    fn new() -> Self {
        INTERRUPTED.store(false, Ordering::Relaxed);
        let previous = [SIGINT, SIGTERM, SIGHUP]
            .into_iter()
            .map(|s| (s, set_handler(s, note_interrupt as *const () as usize)))
            .collect();
        Self { previous }
    }

    fn interrupted(&self) -> bool {
        INTERRUPTED.load(Ordering::Relaxed)
    }
}

impl Drop for InterruptShield {
    fn drop(&mut self) {
        for &(s, handler) in &self.previous {
            set_handler(s, handler);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{os::unix::fs::PermissionsExt as _, process::Command};

    use super::*;

    /// A fresh directory standing in for `/`, removed on drop.
    struct TempRoot(PathBuf);

    impl TempRoot {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("xtask-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(dir.join("usr/sbin")).unwrap();
            Self(dir)
        }

        fn policy(&self) -> PathBuf {
            self.0.join(POLICY_RC_D)
        }

        fn entries(&self) -> Vec<String> {
            let mut names: Vec<String> = fs::read_dir(self.0.join("usr/sbin"))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }
    }

    impl Drop for TempRoot {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// The signal dispositions are the process's: tests that install
    /// take turns.
    fn one_install_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        static INSTALLS: std::sync::Mutex<()> = std::sync::Mutex::new(());
        INSTALLS.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn command_line(cmd: &Command) -> Vec<String> {
        std::iter::once(cmd.get_program())
            .chain(cmd.get_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    /// What the policy in force says about starting memcached.
    fn policy_exit(path: &Path) -> Option<i32> {
        Command::new(path)
            .args(["memcached", "start"])
            .status()
            .ok()?
            .code()
    }

    #[test]
    fn only_apt_get_runs_and_nothing_is_stopped_or_killed() {
        let commands: Vec<Vec<String>> = install_commands(&["memcached", "nginx"])
            .iter()
            .map(command_line)
            .collect();
        assert_eq!(commands[0], ["apt-get", "update", "-qq"]);
        assert_eq!(commands[1][..2], ["apt-get", "install"]);
        assert!(commands[1].ends_with(&["memcached".into(), "nginx".into()]));
        for line in &commands {
            assert_eq!(line[0], "apt-get", "{line:?}");
            for word in ["pkill", "killall", "kill", "systemctl", "service", "stop"] {
                assert!(!line.iter().any(|a| a == word), "{line:?}");
            }
        }
    }

    #[test]
    fn services_are_forbidden_during_the_install_and_allowed_after() {
        let _one = one_install_at_a_time();
        let root = TempRoot::new("no-policy");
        let mut seen = Vec::new();
        install(&root.0, &["memcached"], |cmd| {
            seen.push((command_line(cmd), policy_exit(&root.policy())));
            Ok(())
        })
        .unwrap();
        assert_eq!(seen.len(), 2, "{seen:?}");
        for (line, exit) in &seen {
            assert_eq!(line[0], "apt-get");
            assert_eq!(*exit, Some(101), "{line:?} ran without the policy");
        }
        assert!(
            root.entries().is_empty(),
            "left behind: {:?}",
            root.entries()
        );
    }

    #[test]
    fn an_existing_policy_is_put_back_even_when_apt_get_fails() {
        let _one = one_install_at_a_time();
        let root = TempRoot::new("own-policy");
        let own = "#!/bin/sh\n# the operator's\nexit 0\n";
        fs::write(root.policy(), own).unwrap();
        fs::set_permissions(root.policy(), fs::Permissions::from_mode(0o700)).unwrap();
        let mut during = None;
        let err = install(&root.0, &["nginx"], |cmd| {
            during = policy_exit(&root.policy());
            match command_line(cmd)[1].as_str() {
                "install" => bail!("apt-get install failed (exit status: 100)"),
                _ => Ok(()),
            }
        })
        .unwrap_err();
        assert!(err.to_string().contains("apt-get install failed"), "{err}");
        assert_eq!(during, Some(101));
        assert_eq!(fs::read_to_string(root.policy()).unwrap(), own);
        let mode = fs::metadata(root.policy()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        assert_eq!(root.entries(), ["policy-rc.d"]);
        assert_eq!(policy_exit(&root.policy()), Some(0));
    }

    #[test]
    fn ctrl_c_during_apt_get_stops_the_install_and_puts_the_policy_back() {
        let _one = one_install_at_a_time();
        let root = TempRoot::new("interrupt");
        fs::write(root.policy(), "exit 0\n").unwrap();
        let mut ran = Vec::new();
        let err = install(&root.0, &["memcached"], |cmd| {
            ran.push(command_line(cmd)[1].clone());
            // What Ctrl-C sends xtask while apt-get runs (apt-get, which
            // gets it too, would fail).
            let pid = std::process::id().to_string();
            assert!(
                Command::new("kill")
                    .args(["-INT", &pid])
                    .status()
                    .unwrap()
                    .success()
            );
            // Delivered to some thread of this process: wait for it.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            while !INTERRUPTED.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Ok(())
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "interrupted");
        assert_eq!(ran, ["update"], "install must not start after Ctrl-C");
        assert_eq!(fs::read_to_string(root.policy()).unwrap(), "exit 0\n");
        assert_eq!(root.entries(), ["policy-rc.d"]);
    }

    #[test]
    fn a_panic_during_the_install_still_puts_the_policy_back() {
        let root = TempRoot::new("panic");
        fs::write(root.policy(), "#!/bin/sh\nexit 0\n").unwrap();
        let result = std::panic::catch_unwind(|| {
            let _guard = PolicyGuard::install(&root.0).unwrap();
            panic!("apt-get runner panicked");
        });
        assert!(result.is_err());
        assert_eq!(
            fs::read_to_string(root.policy()).unwrap(),
            "#!/bin/sh\nexit 0\n"
        );
        assert_eq!(root.entries(), ["policy-rc.d"]);
    }

    #[test]
    fn a_killed_setups_leftover_is_undone_first() {
        let _one = one_install_at_a_time();
        let root = TempRoot::new("leftover");
        // What a SIGKILLed setup leaves: its policy, and the operator's aside.
        fs::write(root.policy(), policy_script()).unwrap();
        fs::write(root.policy().with_extension("d.xtask-saved"), "exit 0\n").unwrap();
        install(&root.0, &["nsd"], |_| Ok(())).unwrap();
        assert_eq!(fs::read_to_string(root.policy()).unwrap(), "exit 0\n");
        assert_eq!(root.entries(), ["policy-rc.d"]);
        // Killed between moving the operator's aside and writing its own.
        fs::rename(root.policy(), root.policy().with_extension("d.xtask-saved")).unwrap();
        install(&root.0, &["nsd"], |_| Ok(())).unwrap();
        assert_eq!(fs::read_to_string(root.policy()).unwrap(), "exit 0\n");
        assert_eq!(root.entries(), ["policy-rc.d"]);
    }
}
