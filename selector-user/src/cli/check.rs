//! `selector check`: the config file and flags checked exactly as `run`
//! checks them ([`RunArgs::run_config`]), and nothing loaded or attached.

use anyhow::Result;
use clap::Args;

use super::RunArgs;
use crate::{api::SettingsInForce, config::file::RunConfig};

#[derive(Debug, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub run: RunArgs,
    /// Also check this host as `run` would before it attaches: the kernel
    /// version, the capabilities, and that the interface exists with an
    /// address of each family the groups use.
    #[arg(long)]
    pub host: bool,
}

/// Checks, and prints one line saying what `run` would run with; warnings
/// and what was not checked go to stderr.
pub fn check(args: &CheckArgs) -> Result<()> {
    let config = args.run.run_config()?;
    // The namespace file is checked as `run` checks it; with --host the
    // interface is looked for in it.
    let netns = match &config.netns {
        Some(path) => Some(crate::host::netns::NetNs::open(path)?),
        None => None,
    };
    if args.host {
        crate::host::preflight::check_host()?;
        if let Some(ns) = &netns {
            ns.enter()?;
        }
    }
    // Looking at the interface needs no privilege, entering another
    // namespace does.
    let ingress = if netns.is_none() || args.host {
        crate::host::interface::check(&config.settings)?;
        Some(ingress_here(&config)?)
    } else {
        None
    };
    let what = match &args.run.config {
        Some(path) => path.display().to_string(),
        None => "the flags".into(),
    };
    let host = if args.host { " (and this host)" } else { "" };
    crate::host::stdout::write(format!(
        "{what}: valid{host}: {}{}, {}\n",
        summary(&config),
        ingress.map_or(String::new(), |i| format!(" ({i})")),
        pinning(&config)
    ))?;
    for warning in config.settings.warnings() {
        eprintln!("warning: {warning}");
    }
    let unchecked = unchecked(args.host, netns.is_some());
    if !unchecked.is_empty() {
        eprintln!("not checked: {}", unchecked.join("; "));
    }
    Ok(())
}

/// What `--ingress` comes to on this interface: as given, or what `auto`
/// picks for its kind of device.
fn ingress_here(config: &RunConfig) -> Result<String> {
    let (path, why) = crate::datapath::loader::resolve_ingress(&config.settings)?;
    Ok(match why {
        Some(why) => format!("{} here; {why}", path.name()),
        None => format!("{} here", path.name()),
    })
}

/// Whether the programs stay after the agent exits.
fn pinning(config: &RunConfig) -> String {
    match &config.pin {
        Some(dir) => format!(
            "pinned under {} (the programs keep steering after the agent exits)",
            dir.display()
        ),
        None => "not pinned (the programs go with the agent)".into(),
    }
}

/// What `check` did not look at, given `--host` and `--netns`.
fn unchecked(host: bool, netns: bool) -> Vec<&'static str> {
    let mut out = Vec::new();
    if !host {
        out.push("the kernel version and the capabilities (--host checks them)");
        if netns {
            out.push("the interface in the namespace (--host enters it)");
        }
    }
    out.push("the routes to the members and their next hops (run resolves them)");
    out
}

/// `iface eth0, 2 groups, 5 backends, policy threshold, threshold 4, ...`.
fn summary(config: &RunConfig) -> String {
    let s = &config.settings;
    let backends: usize = s.groups.iter().map(Vec::len).sum();
    let in_force = SettingsInForce::from(s);
    format!(
        "iface {}{}, {}, {backends} backends, {}, proto {}, timeout {} ms, {} ingress",
        s.iface,
        config
            .netns
            .as_ref()
            .map_or(String::new(), |p| format!(" in netns {}", p.display())),
        s.groups_phrase(),
        in_force.tunables.describe(),
        in_force.proto,
        in_force.timeout_ms,
        in_force.ingress,
    )
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use clap::Parser as _;

    use super::*;
    use crate::cli::{Cli, Command};

    /// A file in a fresh temporary directory, removed on drop.
    struct TempFile(PathBuf);

    impl TempFile {
        fn new(name: &str, text: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("selector-check-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            Self(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn check_args(args: &[&str]) -> CheckArgs {
        let mut argv = vec!["selector", "check"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Check(args) => *args,
            other => panic!("{other:?}"),
        }
    }

    const GOOD: &str = "iface = \"eth9\"\npolicy = \"absolute\"\nthreshold = 3\n\n\
        [[group]]\nmembers = [\"10.0.0.1:11211\", \"10.0.0.2:11211\"]\n\n\
        [[group]]\nmembers = [\"[fd00::1]:53\", \"[fd00::2]:53\", \"[fd00::3]:53\"]\n";

    #[test]
    fn a_good_file_is_summed_up_and_bad_ones_name_their_line() {
        let good = TempFile::new("good.toml", GOOD);
        let args = check_args(&["--config", good.0.to_str().unwrap()]);
        let config = args.run.run_config().unwrap();
        let line = summary(&config);
        assert!(
            line.starts_with("iface eth9, 2 groups, 5 backends, policy absolute, threshold 3, "),
            "{line}"
        );
        assert!(
            line.ends_with(", proto memcached, timeout 1000 ms, auto ingress"),
            "{line}"
        );
        // The interface is looked for, as run looks for it.
        assert_eq!(
            check(&args).unwrap_err().to_string(),
            "interface 'eth9' not found"
        );
        let file = good.0.to_str().unwrap();
        check(&check_args(&["--config", file, "--iface", "lo"])).unwrap();
        assert_eq!(
            ingress_here(
                &check_args(&["--config", file, "--iface", "lo"])
                    .run
                    .run_config()
                    .unwrap()
            )
            .unwrap(),
            "xdp here; auto: a driver's device, native XDP"
        );
        // --netns is checked to be a network namespace, and summed up; the
        // interface in it is looked for only with --host, which enters it.
        let args = check_args(&["--config", file, "--netns", "/proc/self/ns/net"]);
        check(&args).unwrap();
        assert_eq!(
            unchecked(false, true)[1],
            "the interface in the namespace (--host enters it)"
        );
        assert!(
            summary(&args.run.run_config().unwrap())
                .starts_with("iface eth9 in netns /proc/self/ns/net, 2 groups"),
        );
        let err = check(&check_args(&[
            "--config",
            file,
            "--netns",
            "/proc/self/ns/uts",
        ]))
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("--netns /proc/self/ns/uts: "), "{err}");
        // A flag over the file, as with run.
        let args = check_args(&[
            "--config",
            good.0.to_str().unwrap(),
            "--iface",
            "lo",
            "--threshold",
            "0",
        ]);
        assert!(
            check(&args)
                .unwrap_err()
                .to_string()
                .contains("--threshold")
        );

        let bad_value = TempFile::new(
            "bad-value.toml",
            &GOOD.replace("threshold = 3", "threshold = 0"),
        );
        let err = check(&check_args(&["--config", bad_value.0.to_str().unwrap()]))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!("{}:3: threshold", bad_value.0.display())),
            "{err}"
        );
        let unknown = TempFile::new(
            "unknown.toml",
            &GOOD.replace("threshold = 3", "threshold = 3\ncolour = \"blue\""),
        );
        let err = check(&check_args(&["--config", unknown.0.to_str().unwrap()]))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with(&format!(
                "{}:4:1: colour: unknown field",
                unknown.0.display()
            )),
            "{err}"
        );
    }
}
