//! The README and `docs/` link to each other: every relative link names a file
//! that exists and, with a `#fragment`, a heading that file has.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// GitHub's anchors: a heading lower-cased, punctuation dropped, spaces as `-`.
fn anchors(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| {
            l.trim_start_matches('#')
                .strip_prefix(' ')
                .filter(|_| l.starts_with('#'))
        })
        .map(|h| {
            h.trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect()
}

/// The targets of the Markdown links `](target)` in `text`.
fn links(text: &str) -> Vec<String> {
    text.split("](")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .filter(|t| !t.contains(char::is_whitespace))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_link_between_the_readme_and_docs_resolves() {
    let mut files = vec![root().join("README.md")];
    for e in std::fs::read_dir(root().join("docs")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    let mut broken = Vec::new();
    let mut to_docs = 0;
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let base = f.parent().unwrap();
        for t in links(&text) {
            if t.starts_with("http://") || t.starts_with("https://") || t.starts_with("mailto:") {
                continue;
            }
            let (path, frag) = t.split_once('#').unwrap_or((&t, ""));
            let target: PathBuf = if path.is_empty() {
                f.clone()
            } else {
                base.join(path)
            };
            if f.ends_with("README.md") && path.starts_with("docs/") {
                to_docs += 1;
            }
            if !Path::new(&target).exists() {
                broken.push(format!("{}: {t} (no such file)", f.display()));
                continue;
            }
            if !frag.is_empty() && target.extension().is_some_and(|x| x == "md") {
                let text = std::fs::read_to_string(&target).unwrap();
                if !anchors(&text).contains(frag) {
                    broken.push(format!("{}: {t} (no such heading)", f.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
    assert!(to_docs >= 5, "the README links docs/ ({to_docs} links)");
}

/// The README is a newcomer's ten minutes: at most 300 lines, and the present
/// tense of what stepgate does — no run ids, commit hashes or dates (history
/// lives in `benches/` and the issues' notes).
#[test]
fn the_readme_keeps_to_its_budget() {
    let text = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = text.lines().count();
    assert!(
        lines <= 300,
        "README.md has {lines} lines: the budget is 300"
    );
    let words: Vec<&str> = text
        .split(|c: char| !c.is_ascii_alphanumeric() && c != '-')
        .filter(|w| !w.is_empty())
        .collect();
    let hex = |w: &str| w.len() >= 7 && w.len() <= 40 && w.chars().all(|c| c.is_ascii_hexdigit());
    for w in &words {
        let run_id = ["sgb", "sgc", "sgs"].iter().any(|p| {
            w.strip_prefix(p)
                .is_some_and(|rest| rest.len() >= 5 && hex(&format!("{rest}00")))
        });
        assert!(!run_id, "README.md names a run id: {w}");
        let commit = hex(w)
            && w.chars().any(|c| c.is_ascii_digit())
            && w.chars().any(|c| c.is_ascii_alphabetic());
        assert!(!commit, "README.md names a commit hash: {w}");
        let date = w.len() == 10
            && w.as_bytes()[4] == b'-'
            && w.as_bytes()[7] == b'-'
            && w[..4].chars().all(|c| c.is_ascii_digit())
            && w.starts_with("20");
        assert!(!date, "README.md names a date: {w}");
    }
}
