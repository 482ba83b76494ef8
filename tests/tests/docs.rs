//! The documentation against the code: the generated CLI reference is
//! fresh, the config, status and metrics references name exactly what the
//! types have, every relative link resolves, and the README stays short.
//! Needs no privileges. `cargo xtask docs` (`SELECTOR_WRITE_DOCS=1`)
//! rewrites the generated files instead of comparing them.

use std::{
    collections::BTreeSet,
    fs,
    path::{Path, PathBuf},
};

use clap::CommandFactory as _;
use selector_user::cli::Cli;
use serde_json::Value;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_owned()
}

fn read(path: &str) -> String {
    fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// Compares `generated` with the committed `path`, or writes it there
/// under `SELECTOR_WRITE_DOCS=1`.
fn fresh(path: &str, generated: &str) {
    if std::env::var_os("SELECTOR_WRITE_DOCS").is_some() {
        fs::write(root().join(path), generated).unwrap_or_else(|e| panic!("writing {path}: {e}"));
        return;
    }
    let committed = fs::read_to_string(root().join(path)).unwrap_or_default();
    if committed != generated {
        let line = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map_or(
                committed.lines().count().min(generated.lines().count()),
                |i| i,
            );
        panic!(
            "{path} is stale (first difference at line {}): run `cargo xtask docs` and commit it",
            line + 1
        );
    }
}

/// The `--help` of `selector` and of each subcommand, as markdown.
fn cli_reference() -> String {
    let mut selector = Cli::command().term_width(100).max_term_width(100);
    selector.build();
    let mut out = String::from(
        "# CLI reference\n\n\
         Generated from the `selector` binary's clap definitions by `cargo xtask docs`;\n\
         `tests/tests/docs.rs` fails when this file differs from what it would generate,\n\
         so do not edit it by hand. Each section is what `--help` prints.\n",
    );
    let mut section = |title: &str, note: &str, help: String| {
        let help: Vec<&str> = help.lines().map(str::trim_end).collect();
        out += &format!(
            "\n## `{title}`\n\n{note}```text\n{}\n```\n",
            help.join("\n")
        );
    };
    section("selector", "", selector.render_long_help().to_string());
    for sub in selector
        .get_subcommands()
        .filter(|c| c.get_name() != "help")
    {
        let note = if sub.is_hide_set() {
            "Not listed by `selector --help`.\n\n"
        } else {
            ""
        };
        let name = format!("selector {}", sub.get_name());
        section(&name, note, sub.clone().render_long_help().to_string());
    }
    out
}

#[test]
fn generated_cli_reference_is_fresh() {
    fresh("docs/reference/cli.md", &cli_reference());
}

/// Where the sample config's generated part starts and ends.
const SAMPLE_TUNABLES_BEGIN: &str =
    "# --- tunables: generated from their flags by `cargo xtask docs` ---\n";
const SAMPLE_TUNABLES_END: &str = "# --- end of tunables ---\n";

/// `text` as comment lines of at most 76 characters, the first indented
/// by `first`, the others by `rest`.
fn comment(text: &str, first: &str, rest: &str) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split_whitespace() {
        let indent = if out.is_empty() { first } else { rest };
        if !line.is_empty() && indent.len() + line.len() + 1 + word.len() > 76 {
            out += &format!("#{indent}{line}\n");
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line += word;
    }
    if !line.is_empty() {
        let indent = if out.is_empty() { first } else { rest };
        out += &format!("#{indent}{line}\n");
    }
    out
}

/// The sample config's tunables, each from its flag (the one declaration in
/// `config::tunables`): its help as comments, its values, and its key at
/// the default. Adding a tunable needs no line here.
fn sample_tunables() -> String {
    use clap::Args as _;
    use selector_user::config::tunables::{Tunables, TunablesPatch};
    let defaults = Tunables::default().shown();
    let flags = TunablesPatch::augment_args(clap::Command::new("set"));
    let mut out = String::from(
        "# What `selector set --iface IF` changes while attached (a reload too),\n\
         # at their defaults; edit their flags in\n\
         # selector-user/src/config/tunables.rs, not here.\n",
    );
    for arg in flags.get_arguments() {
        let key = arg.get_long().expect("every tunable has a flag");
        let default = defaults
            .iter()
            .find(|(flag, _)| *flag == key)
            .map(|(_, value)| value)
            .unwrap_or_else(|| panic!("--{key} has no default in Tunables::shown"));
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string());
        let help = help.unwrap_or_default();
        let help = help.split(" [default: ").next().unwrap_or_default();
        let help = help.strip_prefix("[default: ").map_or(help, |_| "");
        out += "\n";
        out += &comment(help, " ", " ");
        let values = arg.get_possible_values();
        for value in &values {
            let text = value.get_help().map(|h| h.to_string()).unwrap_or_default();
            let value = format!("\"{}\": {text}", value.get_name());
            out += &comment(&value, "   ", "     ");
        }
        let number = values.is_empty() && default.parse::<f64>().is_ok();
        let value = if number {
            default.clone()
        } else {
            format!("\"{default}\"")
        };
        // Commented out: a key set in the file counts as given, and would
        // override what another key implies (`resolv-conf` hedges).
        out += &format!("# {key} = {value}\n");
    }
    out
}

/// The sample config with its tunables part generated.
fn sample_config() -> String {
    let text = read("deploy/selector.toml");
    let start = text
        .find(SAMPLE_TUNABLES_BEGIN)
        .expect("deploy/selector.toml has the tunables' first marker")
        + SAMPLE_TUNABLES_BEGIN.len();
    let end = start
        + text[start..]
            .find(SAMPLE_TUNABLES_END)
            .expect("deploy/selector.toml has the tunables' last marker");
    format!("{}{}{}", &text[..start], sample_tunables(), &text[end..])
}

#[test]
fn generated_tunables_of_the_sample_config_are_fresh() {
    fresh("deploy/selector.toml", &sample_config());
}

/// The status reference with every tunable in its example's settings:
/// those it shows keep their example values, a missing one is added at
/// its default. Adding a tunable needs no line there.
fn status_reference() -> String {
    use selector_user::config::tunables::Tunables;
    let text = read("docs/reference/status.md");
    let open = "  \"settings\": {\n";
    let start = text.find(open).expect("the example has settings") + open.len();
    let end = start + text[start..].find("\n  },").expect("its settings end");
    let mut lines: Vec<(String, String)> = text[start..end]
        .lines()
        .map(|line| {
            let (key, value) = line.trim().split_once(": ").expect("\"key\": value");
            (
                key.trim_matches('"').to_owned(),
                value.trim_end_matches(',').to_owned(),
            )
        })
        .collect();
    // Keys the settings no longer have go (the example must still read as
    // a status: unknown keys are ignored there).
    let example: Value = serde_json::from_str(fenced(&text, "json")).expect("the example is JSON");
    if let Ok(status) = serde_json::from_value::<selector_user::api::Status>(example) {
        let settings = serde_json::to_value(&status.settings).unwrap();
        let known = settings.as_object().expect("the settings are an object");
        lines.retain(|(key, _)| known.contains_key(key));
    }
    let defaults = serde_json::to_value(Tunables::default()).unwrap();
    for (key, value) in defaults.as_object().expect("the tunables are an object") {
        if !lines.iter().any(|(k, _)| k == key) {
            lines.push((key.clone(), value.to_string()));
        }
    }
    let settings: Vec<String> = lines
        .iter()
        .map(|(key, value)| format!("    \"{key}\": {value}"))
        .collect();
    format!("{}{}{}", &text[..start], settings.join(",\n"), &text[end..])
}

#[test]
fn generated_tunables_of_the_status_example_are_fresh() {
    fresh("docs/reference/status.md", &status_reference());
}

/// Rows of the markdown tables in `text` whose first cell is one
/// backticked name: those names.
fn table_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`'))
        .filter(|(_, rest)| rest.trim_start().starts_with('|'))
        .map(|(name, _)| name.to_owned())
        .collect()
}

/// The first fenced block of `lang` in `text`.
fn fenced<'a>(text: &'a str, lang: &str) -> &'a str {
    let start = text
        .find(&format!("```{lang}\n"))
        .unwrap_or_else(|| panic!("no ```{lang} block"))
        + lang.len()
        + 4;
    let len = text[start..].find("\n```").expect("an unclosed block");
    &text[start..start + len + 1]
}

fn differences(doc: &BTreeSet<String>, code: &BTreeSet<String>) -> String {
    let missing: Vec<_> = code.difference(doc).collect();
    let extra: Vec<_> = doc.difference(code).collect();
    format!("missing from the doc: {missing:?}; in the doc but not in the code: {extra:?}")
}

/// The config reference's "reload" column says "restart" for exactly the
/// keys a reload refuses to change (`agent::reload::RESTART_KEYS`), and
/// "yes" for every tunable (what `selector set` changes too).
#[test]
fn the_config_reference_marks_the_restart_keys_the_reload_refuses() {
    use selector_user::{agent::reload::RESTART_KEYS, config::tunables::TunablesPatch};
    let doc_text = read("docs/reference/config.md");
    let reload_column: Vec<(String, String)> = doc_text
        .lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| {
            let (name, rest) = l.split_once('`')?;
            let columns: Vec<&str> = rest.split('|').map(str::trim).collect();
            Some((name.to_owned(), columns.get(3)?.to_string()))
        })
        .collect();
    let restart: BTreeSet<String> = reload_column
        .iter()
        .filter(|(_, reload)| reload == "restart")
        .map(|(name, _)| name.clone())
        .collect();
    let code: BTreeSet<String> = RESTART_KEYS.iter().map(|k| k.to_string()).collect();
    assert_eq!(restart, code, "{}", differences(&restart, &code));
    for flag in TunablesPatch::flags() {
        let key = flag.trim_start_matches('-');
        let row = reload_column.iter().find(|(name, _)| name == key);
        assert_eq!(
            row.map(|(_, reload)| reload.as_str()),
            Some("yes"),
            "tunable {key}"
        );
    }
}

/// Every key of the config file (`selector_user::config::file::Options` and
/// its groups) has a row in docs/reference/config.md and no row names
/// another; its full example parses with the agent's own parser (unknown
/// keys refused) and sets every key.
#[test]
fn the_config_reference_names_every_key() {
    use selector_user::config::file::{ConfigFile, GroupSpec, Options};
    let keys = |v: Value| -> Vec<String> { v.as_object().unwrap().keys().cloned().collect() };
    let mut code: BTreeSet<String> = Options::keys()
        .into_iter()
        .filter(|k| k != "group")
        .collect();
    code.extend(
        keys(serde_json::to_value(GroupSpec::default()).unwrap())
            .into_iter()
            .map(|k| format!("group.{k}")),
    );
    let doc_text = read("docs/reference/config.md");
    let doc = table_names(&doc_text);
    assert_eq!(doc, code, "{}", differences(&doc, &code));

    let example = fenced(&doc_text, "toml");
    let file = ConfigFile::parse(Path::new("config.md"), example.to_owned())
        .unwrap_or_else(|e| panic!("the example does not parse: {e:#}"));
    let unset: Vec<&String> = code
        .iter()
        .filter(|k| !k.starts_with("group."))
        .filter(|k| !file.options.gives(k))
        .collect();
    assert!(unset.is_empty(), "the example does not set {unset:?}");
    let groups = file.options.groups.expect("the example has a group");
    assert!(groups.iter().all(|g| g.name.is_some()), "{groups:?}");
}

/// Every path of object keys in `v` (arrays look at their elements).
fn key_paths(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                let path = format!("{prefix}{k}");
                key_paths(v, &format!("{path}."), out);
                out.insert(path);
            }
        }
        Value::Array(items) => {
            for item in items {
                key_paths(item, prefix, out);
            }
        }
        _ => {}
    }
}

fn status_example() -> (Value, selector_user::api::Status) {
    let text = read("docs/reference/status.md");
    let json: Value = serde_json::from_str(fenced(&text, "json"))
        .unwrap_or_else(|e| panic!("the status example is no JSON: {e}"));
    let status = serde_json::from_value(json.clone())
        .unwrap_or_else(|e| panic!("the status example does not fit the type: {e}"));
    (json, status)
}

/// The example of docs/reference/status.md is a `Status` that, written
/// back, has exactly its keys: every field is shown (with a value, so its
/// own fields are too) and none that the type does not have.
#[test]
fn the_status_reference_shows_every_field() {
    let (json, status) = status_example();
    let again = serde_json::to_value(&status).unwrap();
    let (mut doc, mut code) = (BTreeSet::new(), BTreeSet::new());
    key_paths(&json, "", &mut doc);
    key_paths(&again, "", &mut code);
    assert_eq!(doc, code, "{}", differences(&doc, &code));
    let nulls: Vec<_> = doc.iter().filter(|p| is_null_at(&json, p)).collect();
    assert!(nulls.is_empty(), "give these a value: {nulls:?}");
}

fn is_null_at(v: &Value, path: &str) -> bool {
    let mut values = vec![v];
    for key in path.split('.') {
        values = values
            .into_iter()
            .flat_map(|v| match v {
                Value::Array(items) => items.iter().collect(),
                v => vec![v],
            })
            .filter_map(|v| v.get(key))
            .collect();
    }
    values.iter().any(|v| v.is_null())
}

/// The metric families the agent serves for the status example (as an
/// agent of several attachments, which adds `selector_attachment_up`) are
/// exactly the rows of docs/reference/metrics.md.
#[test]
fn the_metrics_reference_names_every_metric() {
    use selector_user::agent::metrics::{openmetrics_labelled, prometheus_text};
    let (_, status) = status_example();
    let text = prometheus_text(&openmetrics_labelled(&[("eth0".into(), Some(status))]));
    let code: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    assert!(code.len() > 10, "{text}");
    let doc = table_names(&read("docs/reference/metrics.md"));
    assert_eq!(doc, code, "{}", differences(&doc, &code));
}
/// README.md and docs/ (but the archive, kept verbatim): markdown files.
fn pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() && path.file_name().is_some_and(|n| n != "archive") {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut out = vec![root().join("README.md")];
    walk(&root().join("docs"), &mut out);
    out
}

/// GitHub's anchor of a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == ' ' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut in_code = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
        } else if !in_code && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// The targets of the inline links `[text](target)` in `text`, outside
/// fenced blocks.
fn links(text: &str) -> Vec<String> {
    let mut in_code = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            if let Some(end) = rest.find(')') {
                out.push(rest[..end].to_owned());
                rest = &rest[end..];
            }
        }
    }
    out
}

#[test]
fn every_link_resolves() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = fs::read_to_string(&page).unwrap();
        for link in links(&text) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            let ok = target.exists()
                && (anchor.is_empty()
                    || target.is_dir()
                    || anchors(&fs::read_to_string(&target).unwrap_or_default()).contains(anchor));
            if !ok {
                let page = page.strip_prefix(root()).unwrap().display().to_string();
                broken.push(format!("{page}: {link}"));
            }
        }
    }
    assert!(broken.is_empty(), "broken links: {broken:#?}");
}

/// Our own tracker's numbers mean nothing to a reader of the docs: no
/// "issue 8" or "#18" outside the archive.
#[test]
fn no_tracker_numbers() {
    let mut found = Vec::new();
    for page in pages() {
        let text = fs::read_to_string(&page).unwrap();
        for (n, line) in text.lines().enumerate() {
            let lower = line.to_lowercase();
            let numbered = |word: &str| {
                lower.match_indices(word).any(|(i, _)| {
                    lower[i + word.len()..]
                        .chars()
                        .next()
                        .is_some_and(|c| c.is_ascii_digit())
                })
            };
            if numbered("issue ") || numbered("issues ") || numbered(" #") || numbered("(#") {
                let page = page.strip_prefix(root()).unwrap().display().to_string();
                found.push(format!("{page}:{}: {line}", n + 1));
            }
        }
    }
    assert!(found.is_empty(), "{found:#?}");
}

#[test]
fn the_readme_is_at_most_250_lines() {
    let lines = read("README.md").lines().count();
    assert!(lines <= 250, "README.md has {lines} lines");
}

/// deploy/selector.toml sets every key at its default but the three a
/// service wants, each marked in the file as not the default (README says
/// so): parsed, it is the defaults' config with the same interface and
/// groups, but for those three.
#[test]
fn the_sample_config_is_at_its_defaults_but_for_the_keys_it_marks() {
    use selector_user::config::file::{ConfigFile, Options, RunConfig};
    let sample = read("deploy/selector.toml");
    let parse = |text: String| -> RunConfig {
        ConfigFile::parse(Path::new("selector.toml"), text)
            .and_then(|f| f.resolve_with(&Options::default()))
            .expect("valid")
    };
    let groups = &sample[sample.find("[[group]]").expect("groups")..];
    let defaults = parse(format!("iface = \"eth0\"\n{groups}"));
    let mut config = parse(sample.clone());
    let marked = ["quiet", "pin", "metrics-addr"];
    for key in marked {
        let at = sample
            .find(&format!("\n{key} = "))
            .unwrap_or_else(|| panic!("{key} is set"));
        let before: Vec<&str> = sample[..at].lines().rev().take(3).collect();
        assert!(
            before.iter().any(|l| l.starts_with("# Not the default")),
            "{key} is not marked as not the default"
        );
    }
    assert!(config.quiet && config.pin.is_some() && config.metrics_addr.is_some());
    (config.quiet, config.pin, config.metrics_addr) =
        (defaults.quiet, defaults.pin.clone(), defaults.metrics_addr);
    assert_eq!(format!("{config:?}"), format!("{defaults:?}"));
}
