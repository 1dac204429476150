//! The workspace's promises about its crates: the agent-side client crate stays
//! light (an agent process links librdkafka and serde, not the server).

use std::process::Command;

#[test]
fn the_client_crate_pulls_in_no_server_dependency() {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "--locked",
            "-p",
            "stepgate-client",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(crates.contains(&"rdkafka"), "{tree}");
    for server_only in [
        "rocksdb",
        "librocksdb-sys",
        "rusqlite",
        "axum",
        "hyper",
        "reqwest",
        "rmcp",
        "prometheus",
        "tikv-jemallocator",
        "stepgate",
    ] {
        assert!(
            !crates.contains(&server_only),
            "stepgate-client depends on {server_only}:\n{tree}"
        );
    }
}

/// A crate's modules (`<src>/a/b.rs` or `<src>/a/b/mod.rs` is `a::b`) and,
/// for each, the sibling modules it names, in code (not in comments or its
/// unit tests): `crate::x` from a file under `a/` is an edge `a → x`;
/// `super::y` (or `crate::a::y`, `self::` from a parent) from `a::b` is an
/// edge `a::b → a::y`. A parent naming its own child, or a child its parent,
/// is no edge: that is how a module holds its files.
fn module_imports(
    src: &str,
) -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    use std::collections::{BTreeMap, BTreeSet};
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(src);
    let mut files = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("src is readable") {
            let p = e.expect("a directory entry").path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    // `gate/core/intent.rs` → ["gate", "core", "intent"]; a root is [].
    let module_of = |f: &std::path::Path| -> Vec<String> {
        let rel = f.strip_prefix(&src).expect("under src").with_extension("");
        let mut parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if matches!(
            parts.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            parts.pop();
        }
        parts
    };
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(f)).collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in &files {
        let module = module_of(f);
        if module.is_empty() || f.ends_with("tests.rs") {
            continue;
        }
        graph.entry(module[0].clone()).or_default();
        let text = std::fs::read_to_string(f).expect("a source file");
        // Unit tests may reach anywhere: cut at the test module.
        let code = text.split("#[cfg(test)]\nmod ").next().unwrap_or("");
        let code: String = code
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        // Every path that starts at `crate::`, `super::` or `self::`, as the
        // module path it names (and the item after it, which no module is).
        let mut named: Vec<Vec<String>> = Vec::new();
        let ident = |s: &str| -> String {
            s.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        };
        for (at, _) in code.match_indices("::") {
            let before = &code[..at];
            let word: String = before
                .chars()
                .rev()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            // Only where a path starts: not the `super` of `super::super::`'s second.
            let start = before.len() - word.len();
            if before[..start].ends_with("::") {
                continue;
            }
            let mut base = match word.as_str() {
                "crate" => Vec::new(),
                "self" => module.clone(),
                "super" => module[..module.len() - 1].to_vec(),
                _ => continue,
            };
            let mut rest = &code[at + 2..];
            while let Some(r) = rest.strip_prefix("super::") {
                base.pop();
                rest = r;
            }
            let mut chains = Vec::new();
            if let Some(group) = rest.strip_prefix('{') {
                // `use crate::{a::X, b}`: each item of the group's top level.
                let mut depth = 0;
                let mut item = String::new();
                for c in group.chars() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            chains.push(std::mem::take(&mut item));
                            continue;
                        }
                        _ => {}
                    }
                    item.push(c);
                }
                chains.push(item);
            } else {
                chains.push(rest.to_owned());
            }
            for chain in chains {
                let mut path = base.clone();
                let mut rest = chain.trim();
                loop {
                    let name = ident(rest);
                    if name.is_empty() {
                        break;
                    }
                    path.push(name.clone());
                    match rest[name.len()..].strip_prefix("::") {
                        Some(r) => rest = r,
                        None => break,
                    }
                }
                named.push(path);
            }
        }
        for target in named {
            // The siblings under the deepest module both paths share.
            let k = module
                .iter()
                .zip(&target)
                .take_while(|(a, b)| a == b)
                .count();
            if k < module.len() && k < target.len() && modules.contains(&target[..=k]) {
                graph
                    .entry(module[..=k].join("::"))
                    .or_default()
                    .insert(target[..=k].join("::"));
            }
        }
    }
    graph
}

/// The modules of `graph` that import each other in a cycle, as `a → b → a`.
fn cycles(
    graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
) -> Vec<String> {
    // Depth-first from each module: a path back to a module on the path is a cycle.
    fn visit(
        graph: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>,
        m: &str,
        path: &mut Vec<String>,
        cycles: &mut Vec<String>,
    ) {
        if let Some(i) = path.iter().position(|p| p == m) {
            let mut cycle = path[i..].to_vec();
            cycle.push(m.to_owned());
            cycles.push(cycle.join(" → "));
            return;
        }
        path.push(m.to_owned());
        for d in graph.get(m).into_iter().flatten() {
            visit(graph, d, path, cycles);
        }
        path.pop();
    }
    let mut cycles = Vec::new();
    for m in graph.keys() {
        visit(graph, m, &mut Vec::new(), &mut cycles);
    }
    cycles.sort();
    cycles.dedup();
    cycles
}

#[test]
fn no_module_imports_in_a_cycle() {
    let graph = module_imports("src");
    assert!(
        graph.contains_key("gate") && graph["gate"].contains("state"),
        "{graph:?}"
    );
    // Between sibling files too: `config::load` names `config::env`, the
    // gate's session its commits.
    for (from, to) in [
        ("config::load", "config::env"),
        ("gate::session", "gate::commit"),
    ] {
        assert!(
            graph.get(from).is_some_and(|d| d.contains(to)),
            "{from} → {to} not seen: {graph:?}"
        );
    }
    let mut found = cycles(&graph);
    // The workspace's other crates too (their roots, lib.rs or main.rs, excepted).
    for src in ["crates/stepgate-client/src", "crates/stepgate-bench/src"] {
        let graph = module_imports(src);
        assert!(graph.len() > 2, "{src}: {graph:?}");
        found.extend(cycles(&graph).into_iter().map(|c| format!("{src}: {c}")));
    }
    assert!(
        found.is_empty(),
        "modules importing in a cycle:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_library_map_names_every_module() {
    let lib = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/src/lib.rs"))
        .expect("src/lib.rs");
    for m in module_imports("src").keys().filter(|m| !m.contains("::")) {
        assert!(
            lib.contains(&format!("//! - [`{m}`]")),
            "lib.rs's layout does not describe `{m}`"
        );
        assert!(
            lib.contains(&format!("pub mod {m};")),
            "lib.rs does not declare `{m}`"
        );
    }
}
