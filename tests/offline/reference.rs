//! `docs/configuration-reference.md`, generated from the config's own types:
//! the keys and their nesting from the structs in `src/config/*.rs` and
//! `src/tools/tool.rs` (a field's `///` comment is its description), the
//! defaults from `Config` as loaded from an empty file, the variables from
//! `config::key_variables` (the overlay's own schema). The test fails when the
//! file differs from what the code makes; `STEPGATE_WRITE_REFERENCE=1` writes it.

use std::collections::BTreeMap;
use std::path::PathBuf;

const REGENERATE: &str = "STEPGATE_WRITE_REFERENCE=1 cargo test --test offline reference";

/// A named section (`[tools.<name>]`) needs an entry to show its defaults:
/// the least each takes, under the name `x`.
const NAMED_SAMPLES: &[(&str, &str)] = &[
    ("tools", "category = \"keyed\"\nurl = \"http://h/x\"\n"),
    ("pools", "key = \"env:STEPGATE_REFERENCE_POOL_KEY\"\n"),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A struct field or an enum variant, as written in the source.
#[derive(Debug, Default, Clone)]
struct Field {
    name: String,
    ty: String,
    doc: Vec<String>,
    serde: String,
}

/// A struct or enum of the config's source files.
#[derive(Debug, Default)]
struct Item {
    doc: Vec<String>,
    serde: String,
    is_enum: bool,
    fields: Vec<Field>,
}

impl Item {
    fn field(&self, name: &str) -> Option<&Field> {
        self.fields.iter().find(|f| f.name == name)
    }
}

/// The value of `key = "…"` in a `#[serde(…)]` attribute.
fn serde_arg(attrs: &str, key: &str) -> Option<String> {
    let at = attrs.find(&format!("{key} = \""))? + key.len() + 4;
    Some(attrs[at..].split('"').next()?.to_owned())
}

/// Whether a `#[serde(…)]` attribute has the bare word `word` (`default`).
fn serde_flag(attrs: &str, word: &str) -> bool {
    attrs
        .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '='))
        .any(|w| w == word)
}

/// Every top-level struct and enum of `files`, with its doc comments and
/// serde attributes: a line-based reading of rustfmt'd code.
fn items(files: &[PathBuf]) -> BTreeMap<String, Item> {
    let mut out = BTreeMap::new();
    for f in files {
        let text = std::fs::read_to_string(f).expect("a source file");
        let (mut doc, mut attrs, mut attr_open) = (Vec::new(), String::new(), 0i32);
        let mut current: Option<(String, Item)> = None;
        for line in text.lines() {
            let t = line.trim();
            if attr_open > 0 || t.starts_with("#[") {
                attrs.push_str(t);
                attr_open += t.matches('[').count() as i32 - t.matches(']').count() as i32;
                continue;
            }
            if let Some(d) = t.strip_prefix("///") {
                doc.push(d.strip_prefix(' ').unwrap_or(d).to_owned());
                continue;
            }
            if let Some((_, item)) = &mut current {
                if line == "}" {
                    let (name, item) = current.take().expect("an open item");
                    out.insert(name, item);
                } else if !t.is_empty() && !t.starts_with("//") {
                    let decl = t.trim_start_matches("pub ").trim_end_matches(',');
                    let (name, ty) = decl.split_once(": ").unwrap_or((decl, ""));
                    let key = serde_arg(&attrs, "rename").unwrap_or_else(|| {
                        if item.is_enum && serde_arg(&item.serde, "rename_all").is_some() {
                            snake_case(name)
                        } else {
                            name.to_owned()
                        }
                    });
                    item.fields.push(Field {
                        name: key,
                        ty: ty.to_owned(),
                        doc: std::mem::take(&mut doc),
                        serde: std::mem::take(&mut attrs),
                    });
                }
                doc.clear();
                attrs.clear();
                continue;
            }
            let decl = line
                .strip_prefix("pub ")
                .or_else(|| line.strip_prefix("pub(crate) "))
                .unwrap_or(line);
            let kind = decl
                .strip_prefix("struct ")
                .map(|r| (r, false))
                .or_else(|| decl.strip_prefix("enum ").map(|r| (r, true)));
            if let Some((rest, is_enum)) = kind.filter(|_| line.ends_with('{')) {
                let name = rest.trim_end_matches('{').trim().to_owned();
                let item = Item {
                    doc: std::mem::take(&mut doc),
                    serde: std::mem::take(&mut attrs),
                    is_enum,
                    fields: Vec::new(),
                };
                current = Some((name, item));
            }
            doc.clear();
            attrs.clear();
        }
    }
    out
}

fn snake_case(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

/// `Option<T>` → `T`.
fn unoption(ty: &str) -> &str {
    ty.strip_prefix("Option<")
        .and_then(|t| t.strip_suffix('>'))
        .unwrap_or(ty)
}

/// `Wrapper<T>` → `T`, for one wrapper.
fn inner<'a>(ty: &'a str, wrapper: &str) -> Option<&'a str> {
    ty.strip_prefix(wrapper)?.strip_suffix('>')
}

/// The type as a person writes a value of it.
fn user_type(ty: &str, items: &BTreeMap<String, Item>) -> String {
    let ty = unoption(ty);
    if let Some(t) = inner(ty, "Vec<") {
        let t = user_type(t, items);
        return format!("list of {t}s");
    }
    if let Some(item) = items.get(ty).filter(|i| i.is_enum) {
        let values: Vec<String> = item
            .fields
            .iter()
            .map(|v| format!("`\"{}\"`", v.name))
            .collect();
        let (last, rest) = values.split_last().expect("an enum has variants");
        return format!("{} or {last}", rest.join(", "));
    }
    match ty {
        "String" => "string",
        "PathBuf" => "path",
        "Dur" => "duration",
        "bool" => "boolean",
        "usize" | "u16" | "u32" | "u64" | "i32" | "i64" => "integer",
        "f64" => "number",
        "HeaderSpec" => "secret",
        "serde_json::Map<String, serde_json::Value>" => "table",
        other => panic!(
            "the reference has no name for the type `{other}`: add one to `user_type` (or, for a table of the config, its file to `Sources::load`)"
        ),
    }
    .to_owned()
}

/// One key of a section's table.
struct Row {
    key: String,
    ty: String,
    default: String,
    variable: Option<String>,
    doc: Vec<String>,
}

/// A section: a table of the file (`[kafka]`), a named one (`[tools.<name>]`)
/// or an array of tables (`[[mcp.auth.tokens]]`).
struct Section {
    path: String,
    heading: String,
    intro: Vec<String>,
    rows: Vec<Row>,
}

/// What the walk reads from: the source's items, the defaults, the variables.
struct Sources {
    items: BTreeMap<String, Item>,
    defaults: toml::Table,
    variables: BTreeMap<String, String>,
    host_default: String,
}

impl Sources {
    fn load() -> Sources {
        let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("src/config"))
            .expect("src/config")
            .map(|e| e.expect("an entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "rs") && !p.ends_with("tests.rs"))
            .collect();
        files.sort();
        files.push(root().join("src/tools/tool.rs"));
        let text: String = NAMED_SAMPLES
            .iter()
            .map(|(section, entry)| format!("[{section}.x]\n{entry}"))
            .collect();
        let config = stepgate::config::Config::from_toml_str(&text, Vec::new())
            .unwrap_or_else(|e| panic!("NAMED_SAMPLES do not load: {e}"));
        Sources {
            items: items(&files),
            defaults: toml::Table::try_from(&config).expect("the config serialises"),
            variables: stepgate::config::key_variables().into_iter().collect(),
            host_default: stepgate::config::default_instance_id(),
        }
    }

    /// The default of the key at `path` (`<name>` read as the sample `x`).
    fn default(&self, path: &str, field: &Field, derived: bool, container: &str) -> String {
        let is_option = field.ty.starts_with("Option<");
        let mut v = Some(&self.defaults);
        let parts: Vec<&str> = path.split('.').collect();
        let (last, parents) = parts.split_last().expect("a path");
        for p in parents {
            let p = if *p == "<name>" { "x" } else { p };
            v = v.and_then(|t| t.get(p)).and_then(toml::Value::as_table);
        }
        let value = v.and_then(|t| t.get(*last));
        let required =
            !is_option && !serde_flag(&field.serde, "default") && !serde_flag(container, "default");
        // A required key of a named section: the sample's value is no default.
        if required && !derived && path.contains("<name>") {
            return "required".into();
        }
        match value {
            // Under `try_from`, an optional key's value is derived (from the
            // sample, or from other keys): not a default.
            Some(_) if derived && is_option => "unset".into(),
            Some(toml::Value::String(s)) if path == "kafka.instance_id" => {
                assert_eq!(*s, self.host_default);
                "the host's name".into()
            }
            Some(toml::Value::Table(t)) if t.is_empty() => "none".into(),
            Some(v) => format!("`{v}`"),
            None if required => "required".into(),
            None if is_option => "unset".into(),
            None if field.ty.starts_with("Vec<") => "`[]`".into(),
            None if field.ty.starts_with("BTreeMap<") => "none".into(),
            None => panic!(
                "`{path}` has no default, and is neither optional nor required: a key of a named section takes its default from NAMED_SAMPLES"
            ),
        }
    }

    /// The sections under struct `name` at `path`, depth first, in field order.
    fn walk(
        &self,
        name: &str,
        path: &str,
        heading: &str,
        in_array: bool,
        parent_doc: &[String],
        out: &mut Vec<Section>,
    ) {
        let item = self.items.get(name).unwrap_or_else(|| {
            panic!("`{name}` is not in the files `Sources::load` reads: add its file")
        });
        // `#[serde(try_from = "Raw")]`: the keys are Raw's; a key's doc is its
        // own there, else the type's field's.
        let raw = serde_arg(&item.serde, "try_from");
        let keys = raw.as_deref().map_or(item, |r| &self.items[r]);
        let intro = if item.doc.is_empty() {
            parent_doc
        } else {
            &item.doc
        };
        let mut section = Section {
            path: path.to_owned(),
            heading: heading.to_owned(),
            intro: intro.to_vec(),
            rows: Vec::new(),
        };
        let mut nested = Vec::new();
        for f in &keys.fields {
            let doc = if f.doc.is_empty() {
                item.field(&f.name)
                    .map(|f| f.doc.clone())
                    .unwrap_or_default()
            } else {
                f.doc.clone()
            };
            let ty = unoption(&f.ty);
            let at = if path.is_empty() {
                f.name.clone()
            } else {
                format!("{path}.{}", f.name)
            };
            // A struct serde reads field by field is a table of its own.
            let child = |t: &str| {
                let i = self.items.get(t)?;
                (!i.is_enum && i.serde.contains("Deserialize")).then(|| t.to_owned())
            };
            if let Some(s) = child(ty) {
                nested.push((s, at.clone(), format!("[{at}]"), in_array, doc));
                continue;
            }
            if let Some(s) = inner(ty, "BTreeMap<String, ").and_then(child) {
                let at = format!("{at}.<name>");
                nested.push((s, at.clone(), format!("[{at}]"), false, doc));
                continue;
            }
            let array_of = inner(ty, "Vec<").and_then(child);
            let (key, ty, variable) = if let Some(entry) = inner(ty, "BTreeMap<String, ") {
                // A table keyed by names: one row for its entries.
                let (entry_path, var) = self
                    .variables
                    .iter()
                    .find(|(k, _)| k.starts_with(&format!("{at}.<")))
                    .unwrap_or_else(|| panic!("`{at}`: no variable sets its entries"));
                let entry_name = &entry_path[at.len() + 1..];
                (
                    format!("{}.{entry_name}", f.name),
                    user_type(entry, &self.items),
                    Some(var.clone()),
                )
            } else {
                let ty = match &array_of {
                    Some(_) => format!(
                        "list of tables: [`[[{at}]]`](#{})",
                        anchor(&format!("[[{at}]]"))
                    ),
                    None => user_type(ty, &self.items),
                };
                // A key of a table set whole from one variable, as JSON
                // (`STEPGATE_POOLS_<NAME>='{"key": …}'`): that variable.
                let variable = self.variables.get(&at).cloned().or_else(|| {
                    let (table, _) = at.rsplit_once('.')?;
                    let var = self.variables.get(table)?;
                    Some(format!("{var} (the whole table, as JSON)"))
                });
                (f.name.clone(), ty, variable)
            };
            assert!(
                in_array || variable.is_some(),
                "`{at}` has no variable: config::key_variables does not list it"
            );
            assert!(
                !doc.is_empty(),
                "`{at}` has no doc comment: give its field one"
            );
            section.rows.push(Row {
                key,
                ty,
                default: self.default(&at, f, raw.is_some(), &keys.serde),
                variable,
                doc,
            });
            if let Some(s) = array_of {
                let mut intro = vec![format!(
                    "Each `[[{at}]]` table is one entry of the list `{at}`; the environment sets the whole list, as JSON, in `{}`.",
                    self.variables[&at]
                )];
                intro.push(String::new());
                nested.push((s, at.clone(), format!("[[{at}]]"), true, intro));
            }
        }
        if !section.rows.is_empty() {
            out.push(section);
        }
        for (s, at, heading, array, doc) in nested {
            self.walk(&s, &at, &heading, array, &doc, out);
        }
    }
}

/// GitHub's anchor of a heading.
fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == '_' || *c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// A doc comment as Markdown in a table cell: paragraphs kept apart, rustdoc
/// links made plain, `|` escaped. `None` for an `Advanced:` paragraph's flag.
fn cell(doc: &[String]) -> (String, bool) {
    let mut paragraphs: Vec<String> = doc
        .split(|l| l.trim().is_empty())
        .filter(|p| !p.is_empty())
        .map(|p| p.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" "))
        .collect();
    let mut advanced = false;
    for p in &mut paragraphs {
        if let Some(rest) = p.strip_prefix("Advanced:") {
            advanced = true;
            *p = format!("*Advanced:*{rest}");
        }
    }
    let text = paragraphs
        .iter()
        .map(|p| plain_links(p))
        .collect::<Vec<_>>()
        .join("<br><br>");
    (text.replace('|', "\\|"), advanced)
}

/// Rustdoc's links (`` [`X`] ``, `[text](path::to)`) as their text; web
/// links stay. Code spans are copied as they are.
fn plain_links(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find(['`', '[', '<']) {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        if rest.starts_with('`') {
            let end = rest[1..].find('`').map_or(rest.len(), |e| e + 2);
            out.push_str(&rest[..end]);
            rest = &rest[end..];
        } else if rest.starts_with('<') {
            out.push_str("&lt;");
            rest = &rest[1..];
        } else {
            let close = rest.find(']').unwrap_or(0);
            let (label, after) = (&rest[1..close.max(1)], &rest[close + 1..]);
            let target = after.strip_prefix('(').and_then(|a| a.split_once(')'));
            match target {
                Some((to, next)) if close > 0 && !to.starts_with("http") => {
                    out.push_str(label);
                    rest = next;
                }
                None if close > 0 && label.starts_with('`') && label.ends_with('`') => {
                    out.push_str(label);
                    rest = after;
                }
                _ => {
                    out.push('[');
                    rest = &rest[1..];
                }
            }
        }
    }
    out.push_str(rest);
    out
}

/// The whole reference.
fn render(sections: &[Section]) -> String {
    let mut out = format!(
        "<!-- Generated from the config's types (src/config, src/tools/tool.rs) by `{REGENERATE}`: edit their doc comments, not this file. -->\n"
    );
    out.push_str(
        "# Configuration reference

Every key of stepgate's configuration: its type, its default, the environment
variable that sets it, and what it does. [The configuration
guide](configuration.md) tells how to run stepgate and how the file and the
environment combine; `deploy/stepgate.example.toml` is a short example of the
common keys; `stepgate check-config` prints the value each key takes.

- **Variables.** Every key is also set by its `STEPGATE_*` variable, whether or
  not the file has the key; the variable wins. The value is read as the key's
  type: a number, `true`/`false`, a string or a duration, a list as `a,b` or a
  JSON array, a table as JSON. `<NAME>` is a tool's name in variable form
  (`send-email` → `SEND_EMAIL`); in a table keyed by names, the entry's name
  (`STEPGATE_KAFKA_CLIENT_SASL_PASSWORD` sets `sasl.password`). See [the
  environment](configuration.md#the-environment).
- **Durations** are written `\"250ms\"`, `\"10s\"`, `\"7d\"`.
- **Defaults**: what a config without the key takes. *unset*: no value unless
  one is given (the description says what that means); *required*: a table
  of its kind must give it.
- Keys marked *advanced* rarely need changing: change one only for the
  reason its description gives.

",
    );
    let links: Vec<String> = sections
        .iter()
        .map(|s| format!("[`{}`](#{})", s.heading, anchor(&s.heading)))
        .collect();
    out.push_str(&format!("Sections: {}.\n", links.join(" · ")));
    for s in sections {
        out.push_str(&format!("\n## `{}`\n\n", s.heading));
        let intro = s
            .intro
            .split(|l| l.trim().is_empty())
            .filter(|p| !p.is_empty())
            .map(|p| plain_links(&p.iter().map(|l| l.trim()).collect::<Vec<_>>().join(" ")));
        for p in intro {
            // "`[kafka]`: the brokers, …" under the heading `[kafka]`: "The brokers, …".
            let p = match p.strip_prefix(&format!("`{}`: ", s.heading)) {
                Some(rest) => rest[..1].to_uppercase() + &rest[1..],
                None => p,
            };
            out.push_str(&format!("{p}\n\n"));
        }
        out.push_str("| Key | Type | Default | Variable | Description |\n|---|---|---|---|---|\n");
        for r in &s.rows {
            let (text, advanced) = cell(&r.doc);
            let key = format!(
                "`{}`{}",
                r.key,
                if advanced { "<br>*advanced*" } else { "" }
            );
            let variable = r
                .variable
                .as_deref()
                .map_or("—".to_owned(), |v| format!("`{v}`"));
            out.push_str(&format!(
                "| {key} | {} | {} | {variable} | {text} |\n",
                r.ty.replace('|', "\\|"),
                r.default.replace('|', "\\|"),
            ));
        }
        if s.path == "kafka" {
            out.push_str(
                "\n### `[kafka.client]` properties stepgate sets itself\n\n\
                 `client.<property>` passes any librdkafka property to every client, except \
                 these: the guarantee rests on them, or a key of stepgate's own sets them. \
                 Each is refused at start, with why and what to do instead.\n\n\
                 | Property | Why it is refused |\n|---|---|\n",
            );
            for (name, why) in stepgate::config::REFUSED_CLIENT_PROPERTIES {
                out.push_str(&format!("| `{name}` | {} |\n", why.replace('|', "\\|")));
            }
        }
    }
    out
}

fn generate() -> (String, Vec<Section>) {
    let sources = Sources::load();
    let mut sections = Vec::new();
    sources.walk("Config", "", "", false, &[], &mut sections);
    // Every variable the overlay knows is a row's.
    let shown: Vec<&str> = sections
        .iter()
        .flat_map(|s| s.rows.iter().filter_map(|r| r.variable.as_deref()))
        .collect();
    for (key, var) in &sources.variables {
        assert!(
            shown
                .iter()
                .any(|v| *v == var || v.starts_with(&format!("{var} "))),
            "`{key}` ({var}) is settable but not in the reference"
        );
    }
    (render(&sections), sections)
}

#[test]
fn the_configuration_reference_is_generated_from_the_config() {
    let (text, sections) = generate();
    for heading in [
        "[kafka]",
        "[kafka.topics]",
        "[state]",
        "[gate]",
        "[executor]",
        "[http]",
        "[log]",
        "[mcp]",
        "[mcp.auth]",
        "[[mcp.auth.tokens]]",
        "[console]",
        "[[console.tokens]]",
        "[traces]",
        "[tools.<name>]",
        "[tools.<name>.annotations]",
    ] {
        assert!(
            sections.iter().any(|s| s.heading == heading),
            "no section {heading}"
        );
    }
    let path = root().join("docs/configuration-reference.md");
    if std::env::var("STEPGATE_WRITE_REFERENCE").is_ok_and(|v| v == "1") {
        std::fs::write(&path, &text).expect("docs/ is writable");
        return;
    }
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    if current != text {
        let line = current
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .map_or(current.lines().count().min(text.lines().count()), |i| i)
            + 1;
        panic!(
            "docs/configuration-reference.md is not what the config's types make (first difference at line {line}): regenerate it with `{REGENERATE}`, and commit it"
        );
    }
}

/// Every key `deploy/stepgate.example.toml` names, set or commented out, is
/// one of the reference.
#[test]
fn the_example_config_names_only_keys_of_the_reference() {
    let (_, sections) = generate();
    let known = |path: &str| {
        sections.iter().any(|s| {
            s.rows.iter().any(|r| {
                let full = format!("{}.{}", s.path, r.key).replace("tools.<name>.", "tools.x.");
                match full.split_once(".<") {
                    Some((map, _)) => path == map || path.starts_with(&format!("{map}.")),
                    None => full == path,
                }
            })
        })
    };
    let text = std::fs::read_to_string(root().join("deploy/stepgate.example.toml")).unwrap();
    let mut table = String::new();
    let mut named = 0;
    for line in text.lines() {
        let l = line.trim_start_matches('#').trim();
        if let Some(h) = l.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            // `[tools.send_email]`: the tool's name read as the sample's.
            let mut parts: Vec<&str> = h.split('.').collect();
            if parts.first() == Some(&"tools") && parts.len() > 1 {
                parts[1] = "x";
            }
            table = parts.join(".");
            continue;
        }
        let Some((key, _)) = l.split_once(" = ") else {
            continue;
        };
        let key = key.trim().trim_matches('"');
        if key.contains(' ') || key.is_empty() {
            continue;
        }
        let path = if table.is_empty() {
            key.to_owned()
        } else {
            format!("{table}.{key}")
        };
        assert!(
            known(&path),
            "deploy/stepgate.example.toml names `{path}`, which the reference does not have"
        );
        named += 1;
    }
    assert!(named > 20, "{named} keys read from the example");
}
