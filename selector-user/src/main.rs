use clap::{CommandFactory as _, Parser as _};
use selector_user::cli::{Cli, Command};

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() => {
            // One clear line; `--help` has the rest.
            let msg = e.to_string();
            let head = msg
                .split("\n\n")
                .next()
                .unwrap_or("error: invalid arguments");
            let line: Vec<&str> = head.split_whitespace().collect();
            eprintln!("{} (see '{} --help')", line.join(" "), help_command());
            std::process::exit(2);
        }
        Err(e) => e.exit(),
    };
    selector_user::cli::logging::init(cli.log_format, matches!(cli.command, Command::Run(_)));
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let result = match cli.command {
        Command::Run(args) => runtime.block_on(selector_user::cli::run(*args, cli.log_format)),
        other => selector_user::cli::control(other),
    };
    if let Err(e) = result {
        // Its reader gone (`selector man | head`): nothing to say, to no one.
        if selector_user::host::stdout::is_stdout_closed(&e) {
            std::process::exit(0);
        }
        // One line: the error and its causes.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// `selector SUBCOMMAND` when the arguments name one, else `selector`: where
/// the help for a mistyped flag is.
fn help_command() -> String {
    let subcommand = std::env::args()
        .nth(1)
        .filter(|name| Cli::command().find_subcommand(name).is_some());
    match subcommand {
        Some(name) => format!("selector {name}"),
        None => "selector".into(),
    }
}
