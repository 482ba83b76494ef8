//! `selector completions SHELL` and `selector man [COMMAND]`: shell
//! completion scripts and roff man pages generated from the clap types, so
//! they always say what the binary takes.

use std::io::Write;

use anyhow::{Context as _, Result, bail};
use clap::{Args, CommandFactory as _};
use clap_complete::Shell;

use super::Cli;

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for; e.g. for bash:
    /// `selector completions bash > /etc/bash_completion.d/selector`.
    #[arg(value_enum)]
    pub shell: Shell,
}

#[derive(Debug, Args)]
pub struct ManArgs {
    /// A subcommand, for its own page (selector-run(1), ...); none: selector(1).
    pub command: Option<String>,
}

/// Writes the completion script for `shell`.
pub fn completions(args: &CompletionsArgs, out: &mut impl Write) -> Result<()> {
    clap_complete::generate(args.shell, &mut Cli::command(), "selector", out);
    Ok(())
}

/// Writes the man page of `selector`, or of one of its subcommands.
pub fn man(args: &ManArgs, out: &mut impl Write) -> Result<()> {
    let mut selector = Cli::command();
    selector.build();
    let page = match &args.command {
        None => selector,
        Some(name) => {
            let Some(sub) = selector
                .get_subcommands()
                .find(|c| c.get_name() == name && !c.is_hide_set())
            else {
                let names: Vec<&str> = selector
                    .get_subcommands()
                    .filter(|c| !c.is_hide_set())
                    .map(|c| c.get_name())
                    .collect();
                bail!("no subcommand '{name}'; one of {}", names.join(", "));
            };
            // Built: its display name is `selector-NAME`, its bin name `selector NAME`.
            sub.clone().version(crate::api::build_info::LONG_VERSION)
        }
    };
    clap_mangen::Man::new(page)
        .render(out)
        .context("writing the man page")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completion(shell: Shell) -> String {
        let mut out = Vec::new();
        completions(&CompletionsArgs { shell }, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    fn page(command: Option<&str>) -> Result<String> {
        let mut out = Vec::new();
        man(
            &ManArgs {
                command: command.map(str::to_owned),
            },
            &mut out,
        )?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn completions_know_the_subcommands_and_flags() {
        let bash = completion(Shell::Bash);
        for word in [
            "run",
            "status",
            "set",
            "drain",
            "check",
            "--tie-break",
            "--config",
        ] {
            assert!(bash.contains(word), "bash completion lacks {word}");
        }
        // Value lists come from the enums.
        assert!(
            bash.contains("threshold absolute observe latency"),
            "{bash}"
        );
        assert!(completion(Shell::Zsh).starts_with("#compdef selector"));
        assert!(completion(Shell::Fish).contains("complete -c selector"));
    }

    #[test]
    fn man_pages_for_selector_and_each_subcommand() {
        let selector = page(None).unwrap();
        assert!(selector.contains(".TH selector 1"), "{selector}");
        assert!(selector.contains("selector\\-run(1)"), "{selector}");
        let run = page(Some("run")).unwrap();
        assert!(run.contains(".TH selector-run 1"), "{run}");
        assert!(run.contains(crate::api::build_info::LONG_VERSION), "{run}");
        assert!(run.contains("\\-\\-tie\\-break"), "{run}");
        let err = page(Some("nosuch")).unwrap_err().to_string();
        assert!(
            err.contains("no subcommand 'nosuch'; one of run, set"),
            "{err}"
        );
    }
}
