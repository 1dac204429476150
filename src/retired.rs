//! Config keys stepgate no longer takes: each chose between protocols, and
//! stepgate speaks one. A config (file or `STEPGATE_*` variable) that still
//! sets one is refused with what stepgate does now, rather than as an unknown
//! key. A leaf of [`crate::config`].

/// `(section, key, what stepgate does now)`.
const REMOVED: &[(&str, &str, &str)] = &[
    (
        "gate",
        "invoke_before_commit",
        "a `keyed` step's call is always sent as soon as it is decided, and its outcome settles in the same commit (docs/design.md \"One commit for a keyed step\")",
    ),
    (
        "gate",
        "answer_repeats_at_once",
        "a repeat of a settled step is always answered at once, before its batch commits (docs/design.md \"Repeats answered at once\")",
    ),
    (
        "gate",
        "start_record",
        "a `keyed` step is always recorded once, settled, unless its intent is over 4 KiB (docs/design.md \"One record for a re-runnable step\")",
    ),
    (
        "state",
        "compact_changelog",
        "the changelog's records are always written compact, their field names as numbers",
    ),
];

/// The refusal of a removed key: what it was, what stepgate does now.
fn refusal(section: &str, key: &str, now: &str) -> String {
    format!("`{section}.{key}` is gone: {now}. Remove it from the config")
}

/// The first removed key `root` (the file over the defaults) sets.
pub(crate) fn in_table(root: &toml::Table) -> Option<(String, String)> {
    REMOVED.iter().find_map(|(section, key, now)| {
        root.get(*section)
            .and_then(toml::Value::as_table)
            .and_then(|t| t.get(*key))
            .map(|_| (format!("{section}.{key}"), refusal(section, key, now)))
    })
}

/// The refusal of a `STEPGATE_*` variable that named a removed key.
pub(crate) fn env_var(var: &str) -> Option<String> {
    REMOVED.iter().find_map(|(section, key, now)| {
        let name = format!("STEPGATE_{}_{}", section, key).to_ascii_uppercase();
        (var == name).then(|| refusal(section, key, now))
    })
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn a_removed_protocol_key_is_refused_with_what_stepgate_does_now() {
        for (section, key, now) in super::REMOVED {
            let text = format!("[{section}]\n{key} = true\n");
            let e = Config::from_toml_str(&text, std::iter::empty())
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{section}.{key}` is gone")), "{e}");
            assert!(e.contains(now), "{e}");
            let var = format!("STEPGATE_{section}_{key}").to_ascii_uppercase();
            let e = Config::from_toml_str("", [(var.clone(), "true".to_owned())])
                .unwrap_err()
                .to_string();
            assert!(e.contains(&var) && e.contains("is gone"), "{e}");
        }
    }
}
