//! The layering rule of `lib.rs`, checked on the sources: every `crate::`
//! path outside comments and unit tests points to the module's own layer or
//! a lower one, and the modules' imports form no cycle.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
};

/// Top to bottom.
const LAYERS: [&str; 8] = [
    "cli",
    "agent",
    "datapath",
    "hedging",
    "host",
    "api",
    "telemetry",
    "config",
];

/// Module path (`datapath::loader`) -> its source without comments and
/// unit tests.
fn sources() -> BTreeMap<String, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut out = BTreeMap::new();
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(&root).unwrap().with_extension("");
            let mut parts: Vec<String> = relative
                .iter()
                .map(|p| p.to_string_lossy().into_owned())
                .collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            let module = parts.join("::");
            if matches!(module.as_str(), "lib" | "main" | "layering") {
                continue;
            }
            out.insert(module, code_of(&fs::read_to_string(&path).unwrap()));
        }
    }
    out
}

/// `text` without comment lines and without its unit-test module (which
/// may reach across layers to build fixtures).
fn code_of(text: &str) -> String {
    let text = match text
        .find("#[cfg(test)]\nmod tests")
        .or_else(|| text.find("#[cfg(test)]\npub(crate) mod tests"))
    {
        Some(i) => &text[..i],
        None => text,
    };
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The crate's modules that `code` (of `module`) names: `crate::a::b`
/// paths, `use crate::{a::b, c}` groups and `super::` paths, each
/// resolved to the longest known module.
fn references(module: &str, code: &str, known: &BTreeSet<String>) -> BTreeSet<String> {
    let mut paths = Vec::new();
    let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
    for (prefix, base) in [("crate::", String::new()), ("super::", parent.to_string())] {
        let mut rest = code;
        while let Some(i) = rest.find(prefix) {
            let before = rest[..i].chars().last();
            rest = &rest[i + prefix.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let join = |p: &str| {
                if base.is_empty() {
                    p.to_string()
                } else {
                    format!("{base}::{p}")
                }
            };
            if let Some(group) = rest.strip_prefix('{') {
                let end = group.find("};").unwrap_or(group.len());
                paths.extend(group_paths(&group[..end]).iter().map(|p| join(p)));
            } else {
                let path: String = rest
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                paths.push(join(path.trim_end_matches(':')));
            }
        }
    }
    paths
        .iter()
        .filter_map(|p| longest_module(p, known))
        .filter(|m| m != module)
        .collect()
}

/// The paths of a `use` group's body: `a::{b, c::d}, e` -> `a::b`,
/// `a::c::d`, `e`.
fn group_paths(body: &str) -> Vec<String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0, 0);
    let bytes = body.as_bytes();
    let mut items = Vec::new();
    for (i, b) in bytes.iter().enumerate() {
        match b {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            b',' if depth == 0 => {
                items.push(&body[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&body[start..]);
    for item in items {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        match item.split_once("::{") {
            Some((head, inner)) => {
                let inner = inner.strip_suffix('}').unwrap_or(inner);
                out.extend(group_paths(inner).iter().map(|p| format!("{head}::{p}")));
            }
            None => out.push(item.split_whitespace().next().unwrap_or("").to_string()),
        }
    }
    out
}

fn longest_module(path: &str, known: &BTreeSet<String>) -> Option<String> {
    let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
    (1..=parts.len())
        .rev()
        .map(|n| parts[..n].join("::"))
        .find(|m| known.contains(m))
}

fn layer(module: &str) -> usize {
    let top = module.split("::").next().unwrap();
    LAYERS
        .iter()
        .position(|l| *l == top)
        .unwrap_or_else(|| panic!("module {module} is in no layer of LAYERS"))
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let sources = sources();
    let known: BTreeSet<String> = sources.keys().cloned().collect();
    sources
        .iter()
        .map(|(m, code)| (m.clone(), references(m, code, &known)))
        .collect()
}

#[test]
fn imports_only_go_down_the_layers() {
    let mut upward = Vec::new();
    for (module, uses) in graph() {
        for used in uses {
            if layer(&used) < layer(&module) {
                upward.push(format!("{module} -> {used}"));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports against the layer order:\n{}",
        upward.join("\n")
    );
}

#[test]
fn module_imports_form_no_cycle() {
    let graph = graph();
    // Depth-first search; a module met again while on the stack closes a
    // cycle.
    fn visit(
        m: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        stack: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        cycles: &mut Vec<String>,
    ) {
        if let Some(at) = stack.iter().position(|s| s == m) {
            cycles.push(format!("{} -> {m}", stack[at..].join(" -> ")));
            return;
        }
        if done.contains(m) {
            return;
        }
        stack.push(m.to_string());
        for next in graph.get(m).into_iter().flatten() {
            visit(next, graph, stack, done, cycles);
        }
        stack.pop();
        done.insert(m.to_string());
    }
    let (mut done, mut cycles) = (BTreeSet::new(), Vec::new());
    for m in graph.keys() {
        visit(m, &graph, &mut Vec::new(), &mut done, &mut cycles);
    }
    assert!(cycles.is_empty(), "import cycles:\n{}", cycles.join("\n"));
}

/// The checks themselves: an upward path and a cycle are found.
#[test]
fn the_checks_find_an_upward_import_and_a_cycle() {
    let known: BTreeSet<String> = ["config::settings", "agent::run", "host::sys", "host"]
        .map(String::from)
        .into();
    let code = "use crate::{\n    agent::run::{self, X},\n    host::sys,\n};\nfn f() { crate::config::settings::f(); }";
    let uses = references("host::interface", code, &known);
    assert_eq!(
        uses,
        ["agent::run", "config::settings", "host::sys"]
            .map(String::from)
            .into()
    );
    assert!(layer("agent::run") < layer("host::interface"));
    let commented =
        code_of("// crate::agent::run\nfn f() {}\n#[cfg(test)]\nmod tests { crate::cli::x }");
    assert!(
        references(
            "host::x",
            &commented,
            &["agent::run".to_string(), "cli".into()].into()
        )
        .is_empty()
    );
}
