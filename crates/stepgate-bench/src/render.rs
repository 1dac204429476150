//! docs/performance.md's generated part and README.md's performance table, made
//! from one run's files: the results `stepgate-bench` writes (`--json`) and the
//! durable engines' figures `benches/peers/durable/run.py` writes beside them.
//!
//! The output is a function of those two files and nothing else, so any run kept
//! in `benches/` renders the same page again. The files are read through lenient
//! views of only the fields shown here: a field an older run lacks is shown as
//! not recorded. This file uses std, serde and serde_json only, because
//! tests/offline/performance.rs compiles it into its test as well.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The part of docs/performance.md the bench rewrites.
pub const PAGE_MARKS: Marks = Marks {
    start: "<!-- bench:page:start -->",
    end: "<!-- bench:page:end -->",
};

/// The part of README.md the bench rewrites: its performance table.
pub const README_MARKS: Marks = Marks {
    start: "<!-- bench:table:start -->",
    end: "<!-- bench:table:end -->",
};

/// The two lines between which a generated part sits.
pub struct Marks {
    pub start: &'static str,
    pub end: &'static str,
}

/// Why a page could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RenderError {
    #[error("{file} is not a results file of stepgate-bench or run.py: {source}")]
    Json {
        file: String,
        source: serde_json::Error,
    },
    #[error(
        "{file} holds a cluster run (`single` and `cluster`); the page is made from a full run of `bash benches/bench.sh`"
    )]
    ClusterRun { file: String },
    #[error(
        "{file} has no `{start}` line followed by an `{end}` line: add the two around the part render-docs rewrites"
    )]
    Markers {
        file: String,
        start: &'static str,
        end: &'static str,
    },
}

/// The machine a run ran on, as `stepgate-bench` reads it (`machine::read`).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Machine {
    /// `model name` in /proc/cpuinfo.
    pub cpu_model: Option<String>,
    /// `MemTotal` in /proc/meminfo.
    pub memory_mib: Option<u64>,
    /// `Linux` and /proc/sys/kernel/osrelease.
    pub kernel: Option<String>,
    /// The local broker's processes found (0: the broker is elsewhere).
    pub broker_nodes: usize,
    /// Kafka's version, from the jars on the broker's class path.
    pub broker_version: Option<String>,
    /// The broker JVM's name and version (`openjdk 17.0.17`).
    pub broker_jvm: Option<String>,
    /// The broker JVM's `-X…` options (heap, `-XX:` flags).
    #[serde(default)]
    pub broker_jvm_options: Vec<String>,
}

/// The files a page is made from, as paths from the repository's root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sources {
    pub results: String,
    pub durable: Option<String>,
}

impl Sources {
    /// The durable engines' file kept beside a results file: `durable-<id>.json`
    /// next to `results-<id>.json` (the caller checks that it exists).
    pub fn durable_beside(results: &str) -> Option<String> {
        let (dir, name) = results.rsplit_once('/').unwrap_or(("", results));
        let id = name.strip_prefix("results-")?;
        Some(if dir.is_empty() {
            format!("durable-{id}")
        } else {
            format!("{dir}/durable-{id}")
        })
    }

    /// The line after the page's start mark, naming the command that made it.
    fn comment(&self) -> String {
        match &self.durable {
            Some(d) => format!(
                "<!-- generated: stepgate-bench render-docs {} --durable {d} -->",
                self.results
            ),
            None => format!(
                "<!-- generated: stepgate-bench render-docs {} -->",
                self.results
            ),
        }
    }

    /// The files a page names in its `<!-- generated: … -->` line.
    pub fn of_page(page: &str) -> Option<Sources> {
        let line = page.lines().find_map(|l| {
            l.trim()
                .strip_prefix("<!-- generated: stepgate-bench render-docs ")?
                .strip_suffix("-->")
        })?;
        let mut words = line.split_whitespace();
        let results = words.next()?.to_owned();
        let durable = match (words.next(), words.next()) {
            (Some("--durable"), Some(d)) => Some(d.to_owned()),
            _ => None,
        };
        Some(Sources { results, durable })
    }
}

/// The two generated parts, each with its marks.
pub struct Rendered {
    pub page: String,
    pub table: String,
}

/// The page's part and the README's table from a run's results (and its durable
/// engines' figures, when that part of the run ran).
pub fn render(
    results: &str,
    durable: Option<&str>,
    sources: &Sources,
) -> Result<Rendered, RenderError> {
    let value: serde_json::Value =
        serde_json::from_str(results).map_err(|source| RenderError::Json {
            file: sources.results.clone(),
            source,
        })?;
    if value.get("single").is_some() && value.get("cluster").is_some() {
        return Err(RenderError::ClusterRun {
            file: sources.results.clone(),
        });
    }
    let results: Results = serde_json::from_value(value).map_err(|source| RenderError::Json {
        file: sources.results.clone(),
        source,
    })?;
    let durable = match (durable, &sources.durable) {
        (Some(text), file) => Some(serde_json::from_str::<Durable>(text).map_err(|source| {
            RenderError::Json {
                file: file
                    .clone()
                    .unwrap_or_else(|| "the durable engines' file".into()),
                source,
            }
        })?),
        (None, _) => None,
    };
    let run = Run {
        r: &results,
        d: durable.as_ref(),
    };
    Ok(Rendered {
        page: run.page(sources),
        table: run.readme_table(),
    })
}

/// `text` with what lies between `marks` replaced by `block` (which carries the
/// marks itself); everything outside them is kept as it is.
pub fn splice(text: &str, block: &str, marks: &Marks, file: &str) -> Result<String, RenderError> {
    let missing = || RenderError::Markers {
        file: file.to_owned(),
        start: marks.start,
        end: marks.end,
    };
    let start = text.find(marks.start).ok_or_else(missing)?;
    let end = start + text[start..].find(marks.end).ok_or_else(missing)? + marks.end.len();
    Ok(format!(
        "{}{}{}",
        &text[..start],
        block.trim_end(),
        &text[end..]
    ))
}

// ---- the views of the two files -------------------------------------------

#[derive(Deserialize)]
struct Results {
    at: String,
    cores: usize,
    #[serde(default)]
    partitions: Option<i32>,
    #[serde(default)]
    replication_factor: Option<i32>,
    /// Older runs: the broker JVM's `-XX:` options only.
    #[serde(default)]
    broker_jvm_flags: Vec<String>,
    #[serde(default)]
    broker_load: Option<(usize, usize)>,
    #[serde(default)]
    machine: Option<Machine>,
    #[serde(default)]
    command: Option<String>,
    #[serde(default)]
    stepgate_env: Option<BTreeMap<String, String>>,
    /// The stepgate binary's build profile (`release`).
    #[serde(default)]
    stepgate_profile: Option<String>,
    /// The build's default `executor.concurrency`: the row shown.
    #[serde(default)]
    shipped_concurrency: Option<usize>,
    #[serde(default)]
    workload: Option<Workload>,
    #[serde(default)]
    rows: Vec<Row>,
    #[serde(default)]
    sequential: Vec<SeqRow>,
    #[serde(default)]
    scale: Vec<ScaleLine>,
}

/// A scale row (`report::ScaleRow`), as far as the page shows it.
#[derive(Deserialize)]
struct ScaleLine {
    steps: usize,
    ready_s: f64,
    restore_records_per_s: f64,
    #[serde(default)]
    problems: Vec<String>,
    #[serde(default)]
    failover: Option<ScaleFailover>,
}

#[derive(Deserialize)]
struct ScaleFailover {
    session_timeout_s: f64,
    restart_ready_s: f64,
    restart_full_restores: f64,
    standby_resumed_s: Option<f64>,
    cold_resumed_s: Option<f64>,
}

#[derive(Deserialize)]
struct Workload {
    intents: usize,
    workflows: usize,
    repeat_share: f64,
    #[serde(default)]
    broker_warmup: usize,
}

#[derive(Deserialize)]
struct Row {
    system: String,
    mode: String,
    slug: String,
    flood_intents: usize,
    results_per_s: f64,
    cpu_flood_s: f64,
    #[serde(default)]
    records_per_intent: BTreeMap<String, f64>,
    #[serde(default)]
    problems: Vec<String>,
}

impl Row {
    fn cpu_us(&self) -> f64 {
        self.cpu_flood_s * 1e6 / self.flood_intents as f64
    }

    fn records(&self) -> Option<f64> {
        (!self.records_per_intent.is_empty()).then(|| self.records_per_intent.values().sum())
    }
}

#[derive(Deserialize)]
struct Latency {
    p50: f64,
    p99: f64,
}

#[derive(Deserialize)]
struct SeqRow {
    system: String,
    mode: String,
    slug: String,
    steps: usize,
    new: Latency,
    repeat: Latency,
    #[serde(default)]
    commits_per_new: Option<f64>,
    #[serde(default)]
    problems: Vec<String>,
}

#[derive(Deserialize)]
struct Durable {
    sizes: DurableSizes,
    systems: BTreeMap<String, Engine>,
    /// "ok", or the checks that failed.
    checks: serde_json::Value,
}

#[derive(Deserialize)]
struct DurableSizes {
    sequential: usize,
    flood: usize,
    inflight: usize,
}

#[derive(Deserialize)]
struct Engine {
    #[serde(default)]
    sequential: Option<EngineSeq>,
    #[serde(default)]
    flood: Option<EngineFlood>,
}

#[derive(Deserialize)]
struct EngineSeq {
    new_p50: f64,
    new_p99: f64,
    repeat_p50: f64,
}

#[derive(Deserialize)]
struct EngineFlood {
    per_s: f64,
    cpu_us_per_call: f64,
}

// ---- the page ---------------------------------------------------------------

/// The engines of run.py, in the table's order: (key in its file, label).
const ENGINES: [(&str, &str); 3] = [
    ("restate", "Restate, Python SDK"),
    ("restate-ts", "Restate, TypeScript SDK"),
    ("dbos", "DBOS on PostgreSQL"),
];

/// One line of the results table; None is shown as "—" (not measured for it).
#[derive(Default)]
struct Line {
    name: String,
    new: Option<(f64, f64)>,
    repeat: Option<f64>,
    flood: Option<f64>,
    cpu: Option<f64>,
    records: Option<f64>,
    commits: Option<f64>,
}

struct Target {
    what: &'static str,
    figure: Option<String>,
    met: Option<bool>,
}

struct Run<'a> {
    r: &'a Results,
    d: Option<&'a Durable>,
}

impl Run<'_> {
    fn row(&self, slug: &str) -> Option<&Row> {
        self.r.rows.iter().find(|r| r.slug == slug)
    }

    fn seq(&self, slug: &str) -> Option<&SeqRow> {
        self.r.sequential.iter().find(|r| r.slug == slug)
    }

    /// stepgate with a `keyed` tool at the build's default `executor.concurrency`
    /// (older runs: the last keyed row, which the bench compares the others with).
    fn stepgate(&self) -> Option<&Row> {
        let keyed = || {
            self.r
                .rows
                .iter()
                .filter(|r| r.slug.starts_with("sg-keyed-c"))
        };
        match self.r.shipped_concurrency {
            Some(n) => keyed().find(|r| r.slug == format!("sg-keyed-c{n}")),
            None => keyed().next_back(),
        }
    }

    fn stepgate_seq(&self) -> Option<&SeqRow> {
        self.r
            .sequential
            .iter()
            .find(|r| r.slug.starts_with("sg-keyed"))
    }

    fn engine(&self, key: &str) -> Option<&Engine> {
        self.d?.systems.get(key)
    }

    fn engine_seq(&self, key: &str) -> Option<&EngineSeq> {
        self.engine(key)?.sequential.as_ref()
    }

    fn lines(&self) -> Vec<Line> {
        let mut out = Vec::new();
        let sg = self.stepgate();
        let sg_seq = self.stepgate_seq();
        if sg.is_some() || sg_seq.is_some() {
            out.push(Line {
                name: "**stepgate**, `keyed` tool".into(),
                new: sg_seq.map(|s| (s.new.p50, s.new.p99)),
                repeat: sg_seq.map(|s| s.repeat.p50),
                flood: sg.map(|r| r.results_per_s),
                cpu: sg.map(Row::cpu_us),
                records: sg.and_then(Row::records),
                commits: sg_seq.and_then(|s| s.commits_per_new),
            });
        }
        for (key, name) in [
            ("stepgate", "stepgate through its Python client"),
            ("stepgate-ts", "stepgate through its TypeScript client"),
        ] {
            if let Some(s) = self.engine_seq(key) {
                out.push(Line {
                    name: name.into(),
                    new: Some((s.new_p50, s.new_p99)),
                    repeat: Some(s.repeat_p50),
                    ..Line::default()
                });
            }
        }
        for (key, name) in ENGINES {
            let Some(e) = self.engine(key) else { continue };
            out.push(Line {
                name: name.into(),
                new: e.sequential.as_ref().map(|s| (s.new_p50, s.new_p99)),
                repeat: e.sequential.as_ref().map(|s| s.repeat_p50),
                flood: e.flood.as_ref().map(|f| f.per_s),
                cpu: e.flood.as_ref().map(|f| f.cpu_us_per_call),
                ..Line::default()
            });
        }
        for (slug, name) in [
            ("ks-eos", "Kafka Streams dedup, no-op inline"),
            ("ks-eos-http", "Kafka Streams dedup, calling the tool"),
            (
                "pt1-eos-http",
                "passthrough calling the tool, nothing durable",
            ),
        ] {
            let (row, seq) = (self.row(slug), self.seq(&format!("{slug}-seq")));
            if row.is_none() && seq.is_none() {
                continue;
            }
            out.push(Line {
                name: name.into(),
                new: seq.map(|s| (s.new.p50, s.new.p99)),
                repeat: seq.map(|s| s.repeat.p50),
                flood: row.map(|r| r.results_per_s),
                cpu: row.map(Row::cpu_us),
                records: row.and_then(Row::records),
                commits: None,
            });
        }
        out
    }

    fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "| system | new step one at a time, p50 / p99 ms | a repeat, p50 ms | flood, answers/s | CPU µs per intent | Kafka records per intent | commits per new step |"
        );
        let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|");
        let dash = || "—".to_owned();
        for l in self.lines() {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} |",
                l.name,
                l.new
                    .map_or_else(dash, |(p50, p99)| format!("{p50:.1} / {p99:.1}")),
                l.repeat.map_or_else(dash, |p| format!("{p:.1}")),
                l.flood.map_or_else(dash, grouped),
                l.cpu.map_or_else(dash, grouped),
                l.records.map_or_else(dash, |r| format!("{r:.2}")),
                l.commits.map_or_else(dash, |c| format!("{c:.2}")),
            );
        }
        o
    }

    fn targets(&self) -> Vec<Target> {
        let sg = self.stepgate();
        let ks = self.row("ks-eos");
        let (sg_py, ts) = (self.engine_seq("stepgate"), self.engine_seq("restate-ts"));
        let vs = |a: f64, b: f64, unit: &str, limit: f64, at_most: bool| {
            let r = round2(a / b);
            let figure = format!("{} vs {}{unit}: {r:.2}×", figure(a, unit), figure(b, unit));
            (
                Some(figure),
                Some(if at_most { r <= limit } else { r >= limit }),
            )
        };
        let none = (None, None);
        let mut out = Vec::new();
        let (figure, met) = match sg.and_then(Row::records) {
            Some(n) => (Some(format!("{n:.2}")), Some(round2(n) <= 3.0)),
            None => none.clone(),
        };
        out.push(Target {
            what: "Kafka records per flood intent ≤ 3.0",
            figure,
            met,
        });
        let (figure, met) = match self.stepgate_seq().and_then(|s| s.commits_per_new) {
            Some(c) => (Some(format!("{c:.2}")), Some(round2(c) <= 1.0)),
            None => none.clone(),
        };
        out.push(Target {
            what: "one commit per new `keyed` step",
            figure,
            met,
        });
        let (figure, met) = match (sg, ks) {
            (Some(s), Some(k)) => vs(s.cpu_us(), k.cpu_us(), " µs", 1.0, true),
            _ => none.clone(),
        };
        out.push(Target {
            what: "stepgate's CPU per intent ≤ 1.0× the inline Kafka Streams app's",
            figure,
            met,
        });
        let (figure, met) = match (sg, ks) {
            (Some(s), Some(k)) => vs(s.results_per_s, k.results_per_s, " answers/s", 0.8, false),
            _ => none.clone(),
        };
        out.push(Target {
            what: "flood ≥ 0.8× the inline Kafka Streams app's",
            figure,
            met,
        });
        let (figure, met) = match (sg_py, ts) {
            (Some(s), Some(t)) => vs(s.repeat_p50, t.repeat_p50, " ms", 1.5, true),
            _ => none.clone(),
        };
        out.push(Target {
            what: "a repeat's p50 ≤ 1.5× Restate TypeScript's",
            figure,
            met,
        });
        let (figure, met) = match (sg_py, ts) {
            (Some(s), Some(t)) => vs(s.new_p50, t.new_p50, " ms", 1.0, true),
            _ => none,
        };
        out.push(Target {
            what: "a new `keyed` step's p50 ≤ 1.0× Restate TypeScript's",
            figure,
            met,
        });
        out
    }

    /// Every check that failed, system by system.
    fn failures(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .r
            .rows
            .iter()
            .flat_map(|r| {
                (r.problems.iter()).map(move |p| format!("{} ({}), flood: {p}", r.system, r.mode))
            })
            .chain(self.r.sequential.iter().flat_map(|r| {
                (r.problems.iter())
                    .map(move |p| format!("{} ({}), one at a time: {p}", r.system, r.mode))
            }))
            .collect();
        if let Some(d) = self.d
            && d.checks != serde_json::Value::String("ok".into())
        {
            out.push(format!("the durable engines' run: {}", d.checks));
        }
        out
    }

    fn page(&self, sources: &Sources) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "{}\n{}\n", PAGE_MARKS.start, sources.comment());
        let _ = writeln!(o, "## Results\n");
        o.push_str(&self.table());
        o.push('\n');
        let failures = self.failures();
        let checks = "each intent answered exactly once, a repeat with its first answer and `deduplicated: true`, stepgate's tool invoked once per step key (counted at the tool)";
        if failures.is_empty() {
            para(
                &mut o,
                &format!("Every answer passed the checks: {checks}. A dash: not measured."),
            );
        } else {
            para(
                &mut o,
                &format!(
                    "**Checks failed in this run**, so its figures do not stand: {}. The checks: {checks}.",
                    failures.join("; ")
                ),
            );
        }
        self.render_targets(&mut o);
        self.render_scale(&mut o);
        self.render_machine(&mut o);
        self.render_method(&mut o);
        self.render_peers(&mut o);
        // The page lives in docs/; a file outside the repository is named, not linked.
        let file = |f: &str| {
            if f.starts_with('/') {
                format!("`{f}`")
            } else {
                format!("[`{f}`](../{f})")
            }
        };
        para(
            &mut o,
            &format!(
                "Generated by `stepgate-bench render-docs` from {}, a run of {}.",
                match &sources.durable {
                    Some(d) => format!("{} and {}", file(&sources.results), file(d)),
                    None => file(&sources.results),
                },
                self.r.at
            ),
        );
        // The end mark right after the last paragraph.
        o.pop();
        let _ = writeln!(o, "{}", PAGE_MARKS.end);
        o
    }

    fn render_targets(&self, o: &mut String) {
        let targets = self.targets();
        let met = targets.iter().filter(|t| t.met == Some(true)).count();
        let _ = writeln!(o, "## Targets\n");
        para(
            o,
            &format!(
                "Each is a figure or a ratio within this one run. The two against Restate compare stepgate through its Python client (the table's second row) with Restate called by the same Python caller. This run met {met} of {}.",
                targets.len()
            ),
        );
        let _ = writeln!(o, "| target | this run | met |\n|---|---:|---|");
        for t in &targets {
            let _ = writeln!(
                o,
                "| {} | {} | {} |",
                t.what,
                t.figure.as_deref().unwrap_or("not measured"),
                match t.met {
                    Some(true) => "yes",
                    Some(false) => "**no**",
                    None => "—",
                }
            );
        }
        o.push('\n');
    }

    /// The scale run: how long each way back to answers takes with this much
    /// state (nothing when the run had none).
    fn render_scale(&self, o: &mut String) {
        let rows = &self.r.scale;
        let Some(timeout) = rows
            .iter()
            .find_map(|r| r.failover.as_ref().map(|f| f.session_timeout_s))
        else {
            return;
        };
        let _ = writeln!(o, "## State at scale, restarts and takeovers\n");
        para(
            o,
            &format!(
                "Step records loaded into the changelog, then: start → ready on an empty disk (a full restore); `kill -9` and a restart on the same disk (design.md, \"Restart after a crash\"); and a second gate taking over the killed one's partitions, from the kill to the first answer there, with a standby copy (`gate.standby_replicas = 1`, the default) and without. A killed gate's partitions move when its session times out ({timeout:.0} s here)."
            ),
        );
        let _ = writeln!(
            o,
            "| steps in state | empty disk → ready s (records/s) | `kill -9` → ready, same disk s | takeover with a standby s | without s |\n|---:|---:|---:|---:|---:|"
        );
        let secs = |s: Option<f64>| s.map_or("did not resume".to_owned(), |s| format!("{s:.1}"));
        for r in rows {
            let Some(f) = &r.failover else { continue };
            let full = if f.restart_full_restores > 0.0 {
                format!(" ({:.0} full restores)", f.restart_full_restores)
            } else {
                String::new()
            };
            let checks = if r.problems.is_empty() {
                String::new()
            } else {
                format!(" (checks failed: {})", r.problems.join("; "))
            };
            let _ = writeln!(
                o,
                "| {}{checks} | {:.1} ({}) | {:.1}{full} | {} | {} |",
                grouped(r.steps as f64),
                r.ready_s,
                grouped(r.restore_records_per_s),
                f.restart_ready_s,
                secs(f.standby_resumed_s),
                secs(f.cold_resumed_s),
            );
        }
        o.push('\n');
    }

    fn render_machine(&self, o: &mut String) {
        let r = self.r;
        let m = r.machine.as_ref();
        let unknown = "not recorded in this run's file";
        let _ = writeln!(o, "## The machine and the command\n");
        let cpu = m.and_then(|m| m.cpu_model.clone());
        let _ = writeln!(
            o,
            "- **CPU:** {} cores{}, shared by the broker, the system measured and the bench",
            r.cores,
            cpu.map_or_else(String::new, |c| format!(", {c}"))
        );
        let _ = writeln!(
            o,
            "- **Memory:** {}",
            m.and_then(|m| m.memory_mib).map_or_else(
                || unknown.to_owned(),
                |mib| format!("{:.1} GiB", mib as f64 / 1024.0)
            )
        );
        let _ = writeln!(
            o,
            "- **Kernel:** {}",
            m.and_then(|m| m.kernel.clone())
                .unwrap_or_else(|| unknown.to_owned())
        );
        let _ = writeln!(o, "- **Broker:** {}", self.broker());
        let _ = writeln!(o, "- **stepgate:** {}", self.stepgate_config());
        let _ = writeln!(
            o,
            "\n```sh\n{}\n```\n",
            r.command
                .as_deref()
                .unwrap_or("# the command is not recorded in this run's file")
        );
    }

    fn broker(&self) -> String {
        let r = self.r;
        let topics = match (r.partitions, r.replication_factor) {
            (Some(p), Some(f)) => format!("; {p} partitions per topic, replication factor {f}"),
            _ => String::new(),
        };
        let fresh = match r.broker_load {
            Some((0, _)) => "; it held no other topics when the run began".to_owned(),
            Some((t, p)) => {
                format!("; it held {t} other topics ({p} partitions) when the run began")
            }
            None => String::new(),
        };
        let Some(m) = &r.machine else {
            let flags = if r.broker_jvm_flags.is_empty() {
                String::new()
            } else {
                format!(
                    ", its JVM's `-XX` options `{}`",
                    r.broker_jvm_flags.join(" ")
                )
            };
            return format!(
                "on this machine{flags} (its version is not recorded in this run's file){topics}{fresh}"
            );
        };
        if m.broker_nodes == 0 {
            return format!(
                "not a process on this machine, so its version and JVM are unknown{topics}{fresh}"
            );
        }
        let nodes = match m.broker_nodes {
            1 => "one node".to_owned(),
            n => format!("{n} nodes"),
        };
        let jvm = m
            .broker_jvm
            .as_deref()
            .unwrap_or("a JVM of unknown version");
        let opts = if m.broker_jvm_options.is_empty() {
            "its default options".to_owned()
        } else {
            format!("`{}`", m.broker_jvm_options.join(" "))
        };
        format!(
            "Apache Kafka {}, {nodes} on this machine, on {jvm} with {opts}{topics}{fresh}",
            m.broker_version.as_deref().unwrap_or("(version unknown)")
        )
    }

    fn stepgate_config(&self) -> String {
        let build = self
            .r
            .stepgate_profile
            .as_deref()
            .map_or_else(String::new, |p| format!("a `{p}` build, "));
        match &self.r.stepgate_env {
            None => format!(
                "{build}its environment (any `STEPGATE_` overrides) is not recorded in this run's file; the run's report in `benches/` names its command"
            ),
            Some(env) if env.is_empty() => format!(
                "{build}at its shipped defaults: no `STEPGATE_` variable set, and the bench's config file names only its topics, group, tool, state directory and HTTP port, and logs at `warn`"
            ),
            Some(env) => format!(
                "{build}**not at its shipped defaults**: these `STEPGATE_` variables were set: {}",
                env.iter()
                    .map(|(k, v)| format!("`{k}={v}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    fn render_method(&self, o: &mut String) {
        let _ = writeln!(o, "## What the bench measures\n");
        if let Some(w) = &self.r.workload {
            let concurrency = self
                .stepgate()
                .and_then(|r| r.slug.strip_prefix("sg-keyed-c"))
                .map_or_else(String::new, |c| {
                    format!(" ({c} calls in flight for stepgate)")
                });
            let warmup = if w.broker_warmup > 0 {
                format!(
                    " An unmeasured flood of {} intents through each system first lets the broker compile every system's paths.",
                    grouped(w.broker_warmup as f64)
                )
            } else {
                String::new()
            };
            para(
                o,
                &format!(
                    "**The flood.** {} intents over {} workflows, {:.0} % of them repeats of an earlier step (half rephrased), published at once; answers/s is the answers received per second until the last. Every system but the inline app calls one no-op HTTP tool per new step{concurrency}.{warmup}",
                    grouped(w.intents as f64),
                    grouped(w.workflows as f64),
                    w.repeat_share * 100.0,
                ),
            );
        }
        let steps = self.r.sequential.first().map(|s| s.steps);
        let engines = self.d.map(|d| &d.sizes);
        let mut one = String::from(
            "**One at a time.** One caller, one call at a time, nothing else running, a fresh deployment per system: ",
        );
        match (steps, engines) {
            (Some(n), Some(e)) if n == e.sequential => {
                let _ = write!(one, "{n} new steps, then a repeat of each");
            }
            (Some(n), Some(e)) => {
                let _ = write!(
                    one,
                    "{n} new steps (the engines: {}), then a repeat of each",
                    e.sequential
                );
            }
            (Some(n), None) => {
                let _ = write!(one, "{n} new steps, then a repeat of each");
            }
            (None, Some(e)) => {
                let _ = write!(one, "{} new steps, then a repeat of each", e.sequential);
            }
            (None, None) => one.push_str("new steps, then a repeat of each"),
        }
        one.push_str(
            "; p50 and p99 from publish to answer. The bench's agent (Rust, over Kafka) calls stepgate's first row and Kafka Streams; one Python caller calls the engines over HTTP and stepgate's second row through its Python client.",
        );
        if self.engine_seq("stepgate-ts").is_some() {
            one.push_str(
                " One Node caller calls stepgate's TypeScript-client row through that client, over Kafka, and times each call there.",
            );
        }
        if let Some(e) = engines {
            let _ = write!(
                one,
                " The engines' flood: {} calls, {} in flight.",
                grouped(e.flood as f64),
                e.inflight
            );
        }
        para(o, &one);
        para(
            o,
            "**CPU, records, commits.** CPU is the user and system time of the system's own processes during its flood, per intent (`/proc`); for an engine, all its processes (server, SDK service, database, its log included). The broker's CPU is counted for none. Kafka records: those written to all the system's topics per flood intent, transaction markers included. Commits: stepgate's transactions between a new step's publish and its answer.",
        );
    }

    fn render_peers(&self, o: &mut String) {
        let _ = writeln!(o, "## The peers\n");
        para(
            o,
            "**Kafka Streams dedup** ([`benches/peers`](../benches/peers/README.md)): the textbook dedup app (a RocksDB store keyed by step key, with its changelog, `exactly_once_v2`) running a no-op inline: deduplication on Kafka without a call. The flood and CPU targets compare stepgate with it.",
        );
        para(
            o,
            "**Kafka Streams dedup, calling the tool:** the same app's processor POSTs each new step to the bench's HTTP tool, synchronously, with stepgate's `Idempotency-Key`, before it answers. After an aborted transaction Streams may call again; such calls are counted, not failed.",
        );
        para(
            o,
            "**The passthrough calling the tool:** a consume → produce hop with stepgate's Kafka settings and HTTP client that calls the tool once per step key it has seen and keeps nothing durable: the floor for any system that calls the tool once per step.",
        );
        para(
            o,
            "**Restate** (Python SDK; TypeScript SDK on Node), each with its own `restate-server`: a service journals the call with `ctx.run` and is invoked with the step key as its idempotency key. **DBOS Transact** on PostgreSQL: a workflow per call, the step key as its workflow id.",
        );
    }

    fn readme_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "{}", README_MARKS.start);
        o.push_str(&self.table());
        o.push('\n');
        let cpu = self
            .r
            .machine
            .as_ref()
            .and_then(|m| m.cpu_model.as_deref())
            .map_or_else(String::new, |c| format!(" ({c})"));
        let run = self.r.command.as_deref().map_or_else(
            || "One run of the bench".to_owned(),
            |c| format!("One run of `{c}`"),
        );
        let stepgate = match &self.r.stepgate_env {
            Some(env) if env.is_empty() => ", stepgate at its shipped defaults".to_owned(),
            Some(env) => format!(
                ", stepgate **not at its shipped defaults** ({})",
                env.keys()
                    .map(|k| format!("`{k}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => String::new(),
        };
        let checked = if self.failures().is_empty() {
            "every answer checked"
        } else {
            "**with failed checks**"
        };
        para(
            &mut o,
            &format!(
                "{run} on {} cores{cpu} shared with the broker{stepgate}, {checked}. What each column measures, the machine, and the targets: [docs/performance.md](docs/performance.md).",
                self.r.cores
            ),
        );
        // The end mark right after the last paragraph.
        o.pop();
        let _ = writeln!(o, "{}", README_MARKS.end);
        o
    }
}

/// `a` with its unit, for a target's figures.
fn figure(a: f64, unit: &str) -> String {
    match unit {
        " ms" => format!("{a:.2}"),
        _ => grouped(a),
    }
}

/// Rounded to two decimals, as shown: a target is judged on the figure the
/// page prints, so "1.00×" is never marked as missing a limit of 1.0.
fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// A whole number with its thousands apart: `28 397`.
fn grouped(x: f64) -> String {
    if !x.is_finite() {
        return "—".into();
    }
    let digits = format!("{:.0}", x.abs());
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 && digits.len() > 4 {
            out.push(' ');
        }
        out.push(c);
    }
    if x < -0.5 {
        out.insert(0, '-');
    }
    out
}

/// `text` as a paragraph wrapped at 80 columns, and a blank line.
fn para(o: &mut String, text: &str) {
    let mut width = 0;
    for word in text.split_whitespace() {
        if width > 0 && width + 1 + word.chars().count() > 80 {
            o.push('\n');
            width = 0;
        } else if width > 0 {
            o.push(' ');
            width += 1;
        }
        o.push_str(word);
        width += word.chars().count();
    }
    o.push_str("\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_group_their_thousands_from_five_digits() {
        assert_eq!(grouped(9681.4), "9681");
        assert_eq!(grouped(28396.6), "28 397");
        assert_eq!(grouped(1_234_567.0), "1 234 567");
        assert_eq!(grouped(41.0), "41");
    }

    #[test]
    fn the_durable_file_beside_a_results_file() {
        assert_eq!(
            Sources::durable_beside("benches/results-sgb1.json").as_deref(),
            Some("benches/durable-sgb1.json")
        );
        assert_eq!(Sources::durable_beside("/tmp/stepgate-bench.json"), None);
        let s = Sources {
            results: "benches/results-x.json".into(),
            durable: Some("benches/durable-x.json".into()),
        };
        assert_eq!(Sources::of_page(&s.comment()), Some(s));
    }

    /// The sample run's page after `edit` changed its results file.
    fn page_with(edit: impl FnOnce(&mut serde_json::Value), durable: bool) -> String {
        let mut v: serde_json::Value =
            serde_json::from_str(include_str!("../testdata/results-sample.json")).unwrap();
        edit(&mut v);
        let sources = Sources {
            results: "benches/results-x.json".into(),
            durable: durable.then(|| "benches/durable-x.json".into()),
        };
        let d = durable.then_some(include_str!("../testdata/durable-sample.json"));
        render(&v.to_string(), d, &sources).unwrap().page
    }

    #[test]
    fn a_missed_target_is_marked_and_counted() {
        let page = page_with(|_| {}, true);
        assert!(page.contains("This run met 6 of 6."), "{page}");
        let page = page_with(
            |v| {
                let ks = v["rows"]
                    .as_array_mut()
                    .unwrap()
                    .iter_mut()
                    .find(|r| r["slug"] == "ks-eos")
                    .unwrap();
                ks["results_per_s"] = 40_000.0.into();
            },
            true,
        );
        assert!(page.contains("This run met 5 of 6."), "{page}");
        assert!(
            page.contains("| flood ≥ 0.8× the inline Kafka Streams app's | 28 397 vs 40 000 answers/s: 0.71× | **no** |"),
            "{page}"
        );
    }

    #[test]
    fn without_the_engines_their_targets_are_not_measured() {
        let page = page_with(|_| {}, false);
        assert!(page.contains("This run met 4 of 6."), "{page}");
        assert!(
            page.contains("| a repeat's p50 ≤ 1.5× Restate TypeScript's | not measured | — |"),
            "{page}"
        );
        assert!(!page.contains("Restate, TypeScript SDK |"), "{page}");
        assert!(!page.contains("its TypeScript client |"), "{page}");
        assert!(!page.contains("One Node caller"), "{page}");
    }

    #[test]
    fn overrides_and_failed_checks_are_said_not_hidden() {
        let page = page_with(
            |v| {
                v["stepgate_env"] = serde_json::json!({"STEPGATE_GATE_MAX_BATCH": "10"});
                v["rows"][0]["problems"] = serde_json::json!(["3 intents never answered"]);
            },
            true,
        );
        let text = page.replace('\n', " ");
        assert!(
            text.contains("**not at its shipped defaults**: these `STEPGATE_` variables were set: `STEPGATE_GATE_MAX_BATCH=10`"),
            "{page}"
        );
        assert!(
            text.contains("**Checks failed in this run**, so its figures do not stand: stepgate (EOS, keyed tool, executor.concurrency 1024), flood: 3 intents never answered."),
            "{page}"
        );
    }

    #[test]
    fn a_cluster_run_or_another_file_is_refused_with_its_name() {
        let sources = Sources {
            results: "benches/results-cluster.json".into(),
            durable: None,
        };
        let e = render(r#"{"single": {}, "cluster": {}}"#, None, &sources)
            .err()
            .unwrap();
        assert!(e.to_string().contains("holds a cluster run"), "{e}");
        let e = render(r#"{"rows": 3}"#, None, &sources).err().unwrap();
        assert!(
            e.to_string()
                .starts_with("benches/results-cluster.json is not a results file"),
            "{e}"
        );
    }

    #[test]
    fn splice_replaces_only_what_lies_between_the_marks() {
        let text = "a\n<!-- bench:table:start -->\nold\n<!-- bench:table:end -->\nb\n";
        let block = "<!-- bench:table:start -->\nnew\n<!-- bench:table:end -->\n";
        assert_eq!(
            splice(text, block, &README_MARKS, "README.md").unwrap(),
            "a\n<!-- bench:table:start -->\nnew\n<!-- bench:table:end -->\nb\n"
        );
        let e = splice("a\n", block, &README_MARKS, "README.md").unwrap_err();
        assert!(e.to_string().contains("README.md has no"), "{e}");
    }
}
