//! The agent's log: what it says while it runs (attached, reloaded,
//! warnings, stopping), one record per line on one stream, through `log`
//! and env_logger. `selector run` writes it to standard output beside its
//! live table; the other commands keep standard output for their answer
//! and log to standard error. `RUST_LOG` picks the levels (default: the
//! selector's own info and up, others' warnings and up).
//!
//! Two formats (`--log-format`, or `SELECTOR_LOG_FORMAT`): `text`, a line
//! as people and journald read it (`selector: attached to eth0 ...`,
//! `selector: warning: ...`; journald adds the time), and `json`, one
//! object per line with the time, the level and the message, for log
//! collectors.

use std::io::Write as _;

/// How log records are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `selector: MESSAGE`, with `warning: ` or `error: ` before a message
    /// of that level.
    #[default]
    Text,
    /// `{"time":"...","level":"info","target":"...","message":"..."}`.
    Json,
}

/// The filter when `RUST_LOG` is not set.
const DEFAULT_FILTER: &str = "warn,selector_user=info";

/// Sets the process's logger; `agent`: records go to standard output.
pub fn init(format: LogFormat, agent: bool) {
    let mut builder =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or(DEFAULT_FILTER));
    builder.target(if agent {
        env_logger::Target::Stdout
    } else {
        env_logger::Target::Stderr
    });
    match format {
        LogFormat::Text => builder.format(|buf, record| {
            writeln!(
                buf,
                "{}",
                text_line(
                    record.level(),
                    attachment().as_deref(),
                    &record.args().to_string()
                )
            )
        }),
        LogFormat::Json => builder.format(|buf, record| {
            let time = buf.timestamp_millis().to_string();
            writeln!(
                buf,
                "{}",
                json_line(
                    &time,
                    record.level(),
                    record.target(),
                    attachment().as_deref(),
                    &record.args().to_string()
                )
            )
        }),
    };
    // A second init (tests) keeps the first logger.
    let _ = builder.try_init();
}

/// The attachment the logging thread runs, with several.
fn attachment() -> Option<String> {
    crate::agent::attachments::current()
}

/// A record in the text format, `[ATTACHMENT]` first with several.
fn text_line(level: log::Level, attachment: Option<&str>, message: &str) -> String {
    let label = match level {
        log::Level::Error => "error: ",
        log::Level::Warn => "warning: ",
        log::Level::Info => "",
        log::Level::Debug => "debug: ",
        log::Level::Trace => "trace: ",
    };
    match attachment {
        Some(name) => format!("selector: [{name}] {label}{message}"),
        None => format!("selector: {label}{message}"),
    }
}

/// A record in the JSON format.
fn json_line(
    time: &str,
    level: log::Level,
    target: &str,
    attachment: Option<&str>,
    message: &str,
) -> String {
    let mut line = serde_json::json!({
        "time": time,
        "level": level.as_str().to_ascii_lowercase(),
        "target": target,
        "message": message,
    });
    if let Some(name) = attachment {
        line["attachment"] = name.into();
    }
    line.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lines_keep_the_agents_prefix_and_name_the_level() {
        assert_eq!(
            text_line(log::Level::Info, None, "attached to eth0"),
            "selector: attached to eth0"
        );
        assert_eq!(
            text_line(
                log::Level::Info,
                Some("eth0@/run/netns/a"),
                "attached to eth0"
            ),
            "selector: [eth0@/run/netns/a] attached to eth0"
        );
        assert_eq!(
            text_line(
                log::Level::Warn,
                None,
                "the route to 10.0.0.2:11211 leaves by eth1"
            ),
            "selector: warning: the route to 10.0.0.2:11211 leaves by eth1"
        );
        assert_eq!(
            text_line(log::Level::Error, None, "x"),
            "selector: error: x"
        );
    }

    #[test]
    fn json_lines_are_one_object_with_time_level_and_message() {
        let line = json_line(
            "2026-12-03T20:53:00.123Z",
            log::Level::Warn,
            "selector_user::agent::run",
            None,
            "a \"quoted\"\nword",
        );
        assert!(!line.contains('\n'), "{line}");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["level"], "warn");
        assert_eq!(v["time"], "2026-12-03T20:53:00.123Z");
        assert_eq!(v["target"], "selector_user::agent::run");
        assert_eq!(v["message"], "a \"quoted\"\nword");
        assert!(v.get("attachment").is_none(), "{line}");
        let line = json_line("t", log::Level::Info, "x", Some("eth1"), "m");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["attachment"], "eth1");
    }
}
