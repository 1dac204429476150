//! The TOML-table plumbing that loading and the environment overlay share. A
//! leaf among `config`'s files: it imports none of them.

/// Merge `over` into `base`: tables key by key, any other value replaced.
pub(super) fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// Set `path` in `root` to `value`, making the tables on the way.
pub(super) fn set_at(root: &mut toml::Table, path: &[String], value: toml::Value) {
    let (last, parents) = path.split_last().expect("a key path is not empty");
    let mut table = root;
    for p in parents {
        let entry = table
            .entry(p.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if !entry.is_table() {
            *entry = toml::Value::Table(toml::Table::new());
        }
        table = entry.as_table_mut().expect("made a table above");
    }
    table.insert(last.clone(), value);
}

/// The value at `path` in `table`, if any.
pub(super) fn lookup<'a>(table: &'a toml::Table, path: &[String]) -> Option<&'a toml::Value> {
    let (first, rest) = path.split_first()?;
    let v = table.get(first)?;
    if rest.is_empty() {
        Some(v)
    } else {
        lookup(v.as_table()?, rest)
    }
}
