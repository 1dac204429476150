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

/// A crate's top-level modules (`<src>/<name>.rs` or `<src>/<name>/`) and the
/// others each one names (`crate::<name>`, in code, not in comments or its
/// unit tests).
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
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).expect("under src");
        let first = rel.components().next().expect("a path").as_os_str();
        let module = first.to_string_lossy().trim_end_matches(".rs").to_owned();
        if module == "lib" || module == "main" || rel.ends_with("tests.rs") {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("a source file");
        // Unit tests may reach anywhere: cut at the test module.
        let code = text.split("#[cfg(test)]\nmod tests").next().unwrap_or("");
        let code: String = code
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let deps = graph.entry(module.clone()).or_default();
        let mut named = |name: &str| {
            let name: String = name
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() && name != module {
                deps.insert(name);
            }
        };
        for part in code.split("crate::").skip(1) {
            if let Some(group) = part.strip_prefix('{') {
                // `use crate::{a::X, b}`: the names at the group's top level.
                let mut depth = 0;
                let mut item = String::new();
                for c in group.chars() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => break,
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            named(item.trim());
                            item.clear();
                            continue;
                        }
                        _ => {}
                    }
                    item.push(c);
                }
                named(item.trim());
            } else {
                named(part);
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
    for m in module_imports("src").keys() {
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
