//! Figures, their checks, and the side-by-side tables.

use crate::systems::Metrics;
use crate::workload::{Expect, Latency, Verdict};
use crate::{Bench, CompareOpts};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One system's figures in `compare`.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    pub system: String,
    pub mode: String,
    pub slug: String,
    pub eos: bool,
    pub flood_intents: usize,
    /// Intents committed by the system's first consumer group, per second of the flood.
    pub intents_per_s: Option<f64>,
    /// Answers received by the agent, per second of the flood.
    pub results_per_s: f64,
    /// Publish → answer during the flood (mostly queueing: every intent is published at once).
    pub flood_latency: Latency,
    pub paced_intents: usize,
    pub paced_rate: f64,
    /// Publish → answer at `paced_rate`.
    pub latency: Latency,
    pub cpu_flood_s: f64,
    /// CPU seconds of the bench itself (agent, no-op tool) and of the broker during the flood.
    pub bench_cpu_flood_s: f64,
    pub broker_cpu_flood_s: f64,
    /// Of `broker_cpu_flood_s`: the broker JVM's JIT compiler threads, and its
    /// garbage collector's (`systems::jvm_cpu_split`).
    pub broker_jit_cpu_flood_s: f64,
    pub broker_gc_cpu_flood_s: f64,
    /// Wall time of the flood: first intent published → last answer received.
    pub flood_s: f64,
    /// Since the process started: startup, flood and paced phase.
    pub cpu_total_s: f64,
    pub rss_mib: f64,
    pub rss_peak_mib: f64,
    /// Process start → ready (stepgate /readyz, the others' READY line).
    pub ready_s: f64,
    /// Tool invocations per Idempotency-Key: times invoked → keys.
    pub tool_invocations: BTreeMap<u32, usize>,
    /// Kafka records written per flood intent, by topic (transaction markers included).
    pub records_per_intent: BTreeMap<String, f64>,
    /// The broker's work per flood intent, from its JMX counters (requests by
    /// API, bytes in and out; summed over a cluster's nodes); empty when they
    /// could not be read (`BENCH_JMX_CLASSES` unset, no JDK).
    pub broker_per_intent: BTreeMap<String, f64>,
    pub gate: Option<GateFigures>,
    /// The same for the paced phase.
    pub gate_paced: Option<GateFigures>,
    pub verdict: Verdict,
    pub problems: Vec<String>,
}

impl Row {
    pub fn cpu_us_per_intent(&self) -> f64 {
        self.cpu_flood_s * 1e6 / self.flood_intents as f64
    }

    /// The system's and the broker's CPU per intent.
    pub fn cpu_with_broker_us_per_intent(&self) -> f64 {
        (self.cpu_flood_s + self.broker_cpu_flood_s) * 1e6 / self.flood_intents as f64
    }

    /// The broker's CPU per intent, all of it and without its JIT compiler.
    pub fn broker_us_per_intent(&self) -> (f64, f64) {
        let per = |s: f64| s * 1e6 / self.flood_intents as f64;
        (
            per(self.broker_cpu_flood_s),
            per(self.broker_cpu_flood_s - self.broker_jit_cpu_flood_s),
        )
    }

    /// What the checks found, in a sentence.
    pub fn checks_line(&self) -> String {
        let v = &self.verdict;
        let mut s = format!(
            "{} of {} intents answered{}",
            v.answered,
            v.intents,
            if v.answered_twice == 0 {
                ", each exactly once".to_owned()
            } else {
                format!(
                    ", {} of them more than once ({} extra answers)",
                    v.answered_twice, v.extra_answers
                )
            }
        );
        if !self.slug.starts_with("pt") {
            s.push_str(&format!(
                "; `deduplicated` wrong in {} answers, status not ok in {}",
                v.wrong_dedup, v.not_ok
            ));
        }
        s.push_str(&tool_line(&self.slug, &self.tool_invocations));
        s
    }

    pub fn summary(&self) -> String {
        format!(
            "{} {}: {} in/s, {:.0} answers/s, paced p50 {:.1} ms p99 {:.1} ms, CPU {:.1} s, peak RSS {:.0} MiB, {}",
            self.system,
            self.mode,
            fmt_rate(self.intents_per_s),
            self.results_per_s,
            self.latency.p50,
            self.latency.p99,
            self.cpu_flood_s,
            self.rss_peak_mib,
            self.check_text()
        )
    }

    /// Record every way the answers (and, for stepgate, the tool calls) differ
    /// from what the system promises.
    pub fn check(&mut self, expect: Expect, distinct: usize, tool: &BTreeMap<u32, usize>) {
        self.problems = problems(&self.verdict, self.eos, &self.slug, expect, distinct, tool);
    }

    pub fn check_text(&self) -> String {
        check_text(
            &self.problems,
            &self.verdict,
            &self.slug,
            &self.tool_invocations,
        )
    }
}

/// Whether a system's runs call the bench's HTTP tool (stepgate, and the Kafka
/// Streams peer's HTTP variant), so its calls are counted and checked.
pub fn calls_tool(slug: &str) -> bool {
    slug.starts_with("sg-") || slug.contains("-http")
}

/// "; tool invoked …" for systems that call the tool, else "".
pub fn tool_line(slug: &str, tool: &BTreeMap<u32, usize>) -> String {
    if !calls_tool(slug) {
        return String::new();
    }
    let invoked: usize = tool.iter().map(|(n, k)| *n as usize * k).sum();
    let keys: usize = tool.values().sum();
    let once = tool.get(&1).copied().unwrap_or(0);
    format!("; tool invoked {invoked} times for {keys} Idempotency-Keys ({once} keys exactly once)")
}

/// Every way the answers (and the tool calls) differ from what the system
/// promises. stepgate promises one invocation per step key (keyed) or per intent
/// (fast path); the Kafka Streams HTTP variant promises nothing about its calls
/// (Streams re-processes after an abort): each step must have called the tool,
/// and calls beyond one per key are shown, not failed.
pub fn problems(
    v: &Verdict,
    eos: bool,
    slug: &str,
    expect: Expect,
    distinct: usize,
    tool: &BTreeMap<u32, usize>,
) -> Vec<String> {
    let mut p = Vec::new();
    if v.missing > 0 {
        p.push(format!("{} intents never answered", v.missing));
    }
    if eos && v.answered_twice > 0 {
        p.push(format!(
            "{} intents answered more than once ({} extra answers)",
            v.answered_twice, v.extra_answers
        ));
    }
    if v.wrong_dedup > 0 {
        p.push(format!(
            "{} answers with the wrong `deduplicated`",
            v.wrong_dedup
        ));
    }
    if v.not_ok > 0 {
        p.push(format!("{} answers not `ok`", v.not_ok));
    }
    if v.unknown > 0 {
        p.push(format!("{} answers match no intent", v.unknown));
    }
    if let Some(s) = &v.sample_wrong
        && (v.wrong_dedup > 0 || v.not_ok > 0)
    {
        p.push(format!("e.g. {s}"));
    }
    let invoked: usize = tool.iter().map(|(n, k)| *n as usize * k).sum();
    let keys: usize = tool.values().sum();
    if slug.starts_with("pt") && slug.contains("-http") && (keys != distinct || invoked != distinct)
    {
        p.push(format!(
            "tool invoked {invoked} times for {keys} keys; want once for each of {distinct} steps (times → keys: {tool:?})"
        ));
    } else if slug.contains("-http") && keys != distinct {
        p.push(format!(
            "the tool was called for {keys} step keys; want each of {distinct} steps (times → keys: {tool:?})"
        ));
    } else if slug.starts_with("sg-") {
        match expect {
            Expect::StepLog if keys != distinct || invoked != distinct => p.push(format!(
                "tool invoked {invoked} times for {keys} keys; want exactly once for each of {distinct} steps (times → keys: {tool:?})"
            )),
            Expect::FastPath if invoked != v.intents => p.push(format!(
                "read_only tool invoked {invoked} times; want once per intent ({})",
                v.intents
            )),
            _ => {}
        }
    }
    p
}

/// The checks column: FAIL, or ok with what was checked.
pub fn check_text(
    problems: &[String],
    v: &Verdict,
    slug: &str,
    tool: &BTreeMap<u32, usize>,
) -> String {
    let extra_calls: usize = tool
        .iter()
        .map(|(n, k)| (*n as usize).saturating_sub(1) * k)
        .sum();
    if !problems.is_empty() {
        "FAIL".into()
    } else if v.answered_twice > 0 {
        format!("ok ({} dup)", v.extra_answers)
    } else if slug.starts_with("sg-keyed") {
        "ok, tool once/key".into()
    } else if slug.starts_with("sg-") {
        "ok, tool once/intent".into()
    } else if slug.contains("-http") && extra_calls == 0 {
        "ok, tool once/key".into()
    } else if slug.contains("-http") {
        format!("ok, tool ≥ once/key ({extra_calls} repeated calls)")
    } else {
        "ok".into()
    }
}

/// One system in the sequential mode: one call at a time, publish → answer.
#[derive(Debug, Clone, Serialize)]
pub struct SeqRow {
    pub system: String,
    pub mode: String,
    pub slug: String,
    /// New steps timed, and as many repeats of them.
    pub steps: usize,
    /// Untimed calls first (group joins, first transactions).
    pub warmup: usize,
    /// Publish → answer of a new step.
    pub new: Latency,
    /// Publish → answer of a repeat of a settled step.
    pub repeat: Latency,
    /// stepgate: commits (`stepgate_commit_latency_seconds_count`) between a
    /// call's publish and its answer, per call.
    pub commits_per_new: Option<f64>,
    pub commits_per_repeat: Option<f64>,
    /// stepgate: which commits that metric counts on this build.
    pub commits_counted: Option<String>,
    /// stepgate: the `gate.commit_interval` written, or "none (pipelined)".
    pub commit_interval: Option<String>,
    /// Kafka records written per call by topic (transaction markers included).
    pub records_per_new: BTreeMap<String, f64>,
    pub records_per_repeat: BTreeMap<String, f64>,
    pub tool_invocations: BTreeMap<u32, usize>,
    pub verdict: Verdict,
    pub problems: Vec<String>,
}

impl SeqRow {
    pub fn check_text(&self) -> String {
        check_text(
            &self.problems,
            &self.verdict,
            &self.slug,
            &self.tool_invocations,
        )
    }
}

/// stepgate's own account of the flood, from /metrics.
#[derive(Debug, Clone, Serialize)]
pub struct GateFigures {
    pub batches: f64,
    pub commit_s: f64,
    pub invocations: f64,
    pub tool_s: f64,
    pub intents_received: f64,
    pub repeats: f64,
    pub rephrased: f64,
    pub answer_latency_mean_ms: f64,
    answers: f64,
    answer_s: f64,
    /// Share of the flood's wall time the gate spent committing batches.
    pub commit_share: f64,
}

impl GateFigures {
    pub fn from_metrics(m: &Metrics) -> GateFigures {
        let answers = m.sum("stepgate_answer_latency_seconds_count");
        GateFigures {
            batches: m.sum("stepgate_commit_latency_seconds_count"),
            commit_s: m.sum("stepgate_commit_latency_seconds_sum"),
            invocations: m.sum("stepgate_invocations_total"),
            tool_s: m.sum("stepgate_tool_latency_seconds_sum"),
            intents_received: m.sum("stepgate_intents_received_total"),
            repeats: m.sum("stepgate_repeats_total"),
            rephrased: m.sum("stepgate_rephrased_retries_total"),
            answer_latency_mean_ms: m.sum("stepgate_answer_latency_seconds_sum") * 1000.0
                / answers.max(1.0),
            answers,
            answer_s: m.sum("stepgate_answer_latency_seconds_sum"),
            commit_share: 0.0,
        }
    }

    /// One line: what stepgate's /metrics say about `phase`.
    pub fn summary(&self, phase: &str) -> String {
        format!(
            "stepgate's /metrics for {phase}: {} intents received, {} repeats ({} rephrased), {} tool invocations (mean {:.2} ms), {} gate batches, mean commit (`stepgate_commit_latency_seconds`) {:.1} ms = {:.0}% of its wall time; mean answer latency {:.0} ms.",
            self.intents_received,
            self.repeats,
            self.rephrased,
            self.invocations,
            self.tool_s * 1000.0 / self.invocations.max(1.0),
            self.batches,
            self.commit_s * 1000.0 / self.batches.max(1.0),
            self.commit_share * 100.0,
            self.answer_latency_mean_ms
        )
    }

    /// What happened between an earlier scrape and this one.
    pub fn since(&self, earlier: &GateFigures) -> GateFigures {
        let answers = self.answers - earlier.answers;
        let answer_s = self.answer_s - earlier.answer_s;
        GateFigures {
            batches: self.batches - earlier.batches,
            commit_s: self.commit_s - earlier.commit_s,
            invocations: self.invocations - earlier.invocations,
            tool_s: self.tool_s - earlier.tool_s,
            intents_received: self.intents_received - earlier.intents_received,
            repeats: self.repeats - earlier.repeats,
            rephrased: self.rephrased - earlier.rephrased,
            answer_latency_mean_ms: answer_s * 1000.0 / answers.max(1.0),
            answers,
            answer_s,
            commit_share: 0.0,
        }
    }

    pub fn with_wall(mut self, wall_s: f64) -> GateFigures {
        self.commit_share = self.commit_s / wall_s;
        self
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct WorkloadInfo {
    pub intents: usize,
    pub workflows: usize,
    pub repeat_share: f64,
    pub repeat_lag: usize,
    pub paced_rate: f64,
    pub paced: String,
    /// Intents of the unmeasured warm-up flood through each system first.
    pub broker_warmup: usize,
}

impl WorkloadInfo {
    pub fn new(b: &Bench, c: &CompareOpts) -> WorkloadInfo {
        WorkloadInfo {
            intents: c.intents,
            workflows: b.common.workflows,
            repeat_share: b.common.repeat_share,
            repeat_lag: b.common.repeat_lag,
            paced_rate: c.rate,
            paced: c.paced.to_string(),
            broker_warmup: c.broker_warmup,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub run_id: String,
    pub at: String,
    pub cores: usize,
    pub brokers: String,
    pub partitions: i32,
    pub replication_factor: i32,
    pub commit_interval: String,
    /// stepgate's `gate.commit_interval` on builds that have the key; None: it
    /// pipelines its commits (a batch closes when the previous commit returns).
    pub stepgate_commit_interval: Option<String>,
    pub max_batch: usize,
    /// The topics and partitions the broker held when the run began, its own
    /// `__` topics aside (`systems::broker_load`).
    pub broker_load: Option<(usize, usize)>,
    /// The broker JVMs' `-XX:` options (e.g. `-XX:-UseCodeCacheFlushing`).
    pub broker_jvm_flags: Vec<String>,
    /// The CPU, memory, kernel and broker the run ran on.
    pub machine: crate::render::Machine,
    /// The command that started the run (bench.sh's, or this process's).
    pub command: String,
    /// The `STEPGATE_` variables every stepgate of the run inherited (empty:
    /// stepgate ran at its shipped defaults).
    pub stepgate_env: BTreeMap<String, String>,
    /// The stepgate binary's build profile, when its directory names one
    /// (`target/release/stepgate`).
    pub stepgate_profile: Option<String>,
    /// The build's default `executor.concurrency`: the row docs/performance.md shows.
    pub shipped_concurrency: usize,
    pub workload: Option<WorkloadInfo>,
    pub rows: Vec<Row>,
    pub sequential: Vec<SeqRow>,
    pub scale: Vec<ScaleRow>,
}

/// More partitions than this before a run, and the report calls the broker
/// not fresh (a run itself creates a few dozen at a time).
pub const BUSY_BROKER_PARTITIONS: usize = 200;

fn fmt_rate(r: Option<f64>) -> String {
    r.map_or("n/a".into(), |r| format!("{r:.0}"))
}

fn ratio(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b > 0.0 {
        format!("{:.2}×", a / b)
    } else {
        "n/a".into()
    }
}

impl Report {
    pub fn new(b: &Bench) -> Report {
        Report {
            run_id: b.run_id.clone(),
            at: chrono::Utc::now().format("%Y-%m-%d %H:%M UTC").to_string(),
            cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
            brokers: b.common.brokers.clone(),
            partitions: b.common.partitions,
            replication_factor: b.common.replication_factor,
            commit_interval: b.common.commit_interval.to_string(),
            stepgate_commit_interval: crate::systems::ConfigKeys::of_this_build()
                .has(&["gate", "commit_interval"])
                .then(|| b.common.commit_interval.to_string()),
            max_batch: b.common.batch(),
            broker_load: crate::systems::broker_load(&b.common.brokers),
            broker_jvm_flags: crate::systems::jvm_flags(&b.broker),
            machine: crate::machine::read(&b.broker),
            command: crate::machine::command(),
            stepgate_env: crate::machine::stepgate_env(),
            stepgate_profile: b
                .stepgate
                .parent()
                .and_then(|d| d.file_name())
                .map(|d| d.to_string_lossy().into_owned())
                .filter(|d| d == "release" || d == "debug"),
            shipped_concurrency: crate::systems::default_concurrency(),
            workload: None,
            rows: Vec::new(),
            sequential: Vec::new(),
            scale: Vec::new(),
        }
    }

    pub fn failures(&self) -> Vec<String> {
        let rows = self.rows.iter().flat_map(|r| {
            r.problems
                .iter()
                .map(move |p| format!("{} {}: {p}", r.system, r.mode))
        });
        let sequential = self.sequential.iter().flat_map(|r| {
            r.problems
                .iter()
                .map(move |p| format!("sequential, {} {}: {p}", r.system, r.mode))
        });
        let scale = self.scale.iter().flat_map(|s| {
            s.problems
                .iter()
                .map(move |p| format!("scale {}: {p}", s.steps))
        });
        rows.chain(sequential).chain(scale).collect()
    }

    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\n# stepgate-bench {} ({}, {} cores shared with the broker at {}; {} partitions, replication factor {}; commit interval {}{}, max batch {})\n",
            self.run_id,
            self.at,
            self.cores,
            self.brokers,
            self.partitions,
            self.replication_factor,
            self.commit_interval,
            if self.stepgate_commit_interval.is_some() {
                " (stepgate's too)"
            } else {
                " for the passthrough and Kafka Streams; stepgate pipelines its commits"
            },
            self.max_batch
        );
        let _ = writeln!(
            o,
            "Command: `{}`; stepgate's `STEPGATE_` variables: {}.\n",
            self.command,
            if self.stepgate_env.is_empty() {
                "none (its shipped defaults)".to_owned()
            } else {
                self.stepgate_env
                    .iter()
                    .map(|(k, v)| format!("`{k}={v}`"))
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        );
        match self.broker_load {
            Some((topics, partitions)) => {
                let _ = writeln!(
                    o,
                    "The broker held {topics} topics ({partitions} partitions) besides its own when the run began{}. Its JVM's -XX options: {}.\n",
                    if partitions > BUSY_BROKER_PARTITIONS {
                        ": **not a fresh broker**, and a broker with many partitions does more for every request (wipe it: `bash deploy/local/kafka.sh stop --wipe`)"
                    } else {
                        ""
                    },
                    if self.broker_jvm_flags.is_empty() {
                        "none".to_string()
                    } else {
                        format!("`{}`", self.broker_jvm_flags.join(" "))
                    }
                );
            }
            None => {
                let _ = writeln!(o, "The broker's topics could not be read before the run.\n");
            }
        }
        if let Some(w) = &self.workload {
            self.render_compare(&mut o, w);
        }
        if !self.sequential.is_empty() {
            self.render_sequential(&mut o);
        }
        if !self.scale.is_empty() {
            self.render_scale(&mut o);
        }
        o
    }

    fn render_compare(&self, o: &mut String, w: &WorkloadInfo) {
        let _ = writeln!(
            o,
            "Workload: {} intents over {} workflows, {:.0}% repeats of earlier steps (half rephrased: same step key, other arguments), one no-op HTTP tool (stepgate calls it; the Kafka Streams peer runs its no-op inline, and its HTTP variant calls the same tool synchronously from the processor for each new step, with stepgate's Idempotency-Key). \
             Throughput: all intents published at once; **in/s** = intents committed by the system's consuming group per second, **answers/s** = answers received by the agent per second. \
             Latency: a paced phase at {:.0} intents/s for {}, publish → answer received. CPU: seconds used during the flood by the system's process, the broker and the bench (agent + no-op tool), out of {} × the flood's wall time. {}\n",
            w.intents,
            w.workflows,
            w.repeat_share * 100.0,
            w.paced_rate,
            w.paced,
            self.cores,
            if w.broker_warmup > 0 {
                format!(
                    "Before them, a flood of {} intents through each system, not measured, so the broker's JIT had compiled every system's paths.",
                    w.broker_warmup
                )
            } else {
                "No warm-up: the broker's JIT compiles as the first systems run (see the broker's CPU by its threads).".to_string()
            }
        );
        let _ = writeln!(
            o,
            "| system | mode | in/s | answers/s | p50 ms | p90 ms | p99 ms | max ms | CPU µs/intent | CPU s: system / broker / bench, flood s | peak RSS MiB | ready s | checks |"
        );
        let _ = writeln!(
            o,
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for r in &self.rows {
            let _ = writeln!(
                o,
                "| {} | {} | {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.1} / {:.1} / {:.1}, {:.1} | {:.0} | {:.1} | {} |",
                r.system,
                r.mode,
                fmt_rate(r.intents_per_s),
                r.results_per_s,
                r.latency.p50,
                r.latency.p90,
                r.latency.p99,
                r.latency.max,
                r.cpu_us_per_intent(),
                r.cpu_flood_s,
                r.broker_cpu_flood_s,
                r.bench_cpu_flood_s,
                r.flood_s,
                r.rss_peak_mib,
                r.ready_s,
                r.check_text()
            );
        }
        // The base: the last stepgate run with a keyed tool (the last --executor-concurrency).
        if let Some(sg) = self
            .rows
            .iter()
            .rev()
            .find(|r| r.slug.starts_with("sg-keyed"))
        {
            let _ = writeln!(
                o,
                "\nstepgate ({}) ÷ each other system (throughput: >1 means stepgate is faster; latency, CPU and RSS: <1 means stepgate uses less):\n",
                sg.mode
            );
            let _ = writeln!(
                o,
                "| stepgate ÷ | in/s | answers/s | p50 | p99 | CPU/intent | CPU/intent incl. broker | peak RSS |"
            );
            let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|");
            for r in self.rows.iter().filter(|r| r.slug != sg.slug) {
                let _ = writeln!(
                    o,
                    "| {} {} | {} | {} | {} | {} | {} | {} | {} |",
                    r.system,
                    r.mode,
                    ratio(
                        sg.intents_per_s.unwrap_or(f64::NAN),
                        r.intents_per_s.unwrap_or(f64::NAN)
                    ),
                    ratio(sg.results_per_s, r.results_per_s),
                    ratio(sg.latency.p50, r.latency.p50),
                    ratio(sg.latency.p99, r.latency.p99),
                    ratio(sg.cpu_us_per_intent(), r.cpu_us_per_intent()),
                    ratio(
                        sg.cpu_with_broker_us_per_intent(),
                        r.cpu_with_broker_us_per_intent()
                    ),
                    ratio(sg.rss_peak_mib, r.rss_peak_mib),
                );
            }
            let _ = writeln!(
                o,
                "\nstepgate has no at-least-once mode: every gate batch commits in a Kafka transaction (src/config/ has no processing-guarantee setting), so the ALOS rows are compared with stepgate's EOS figures."
            );
            for (phase, g) in [("the flood", &sg.gate), ("the paced phase", &sg.gate_paced)] {
                if let Some(g) = g {
                    let _ = writeln!(o, "\n{}", g.summary(phase));
                }
            }
        }
        let _ = writeln!(o, "\nChecks (flood and paced phase):\n");
        for r in &self.rows {
            let _ = writeln!(
                o,
                "- {} {}: {}: **{}**",
                r.system,
                r.mode,
                r.checks_line(),
                r.check_text()
            );
        }
        let _ = writeln!(
            o,
            "\nKafka records written per flood intent (transaction markers included), which is much of what the broker's CPU goes to:\n"
        );
        for r in &self.rows {
            let total: f64 = r.records_per_intent.values().sum();
            let parts: Vec<String> = r
                .records_per_intent
                .iter()
                .map(|(t, n)| format!("{t} {n:.2}"))
                .collect();
            // Durable writes per new step: the flood's changelog records over
            // its new steps (intents received less repeats, from /metrics).
            let new_steps = r
                .gate
                .as_ref()
                .map_or(0.0, |g| g.intents_received - g.repeats);
            let per_step = match r.records_per_intent.get("changelog") {
                Some(c) if new_steps > 0.0 && *c > 0.0 => format!(
                    "; changelog records per new step: **{:.2}**",
                    c * r.flood_intents as f64 / new_steps
                ),
                _ => String::new(),
            };
            let _ = writeln!(
                o,
                "- {} {}: **{total:.2}** ({}){per_step}",
                r.system,
                r.mode,
                parts.join(", ")
            );
        }
        if self.rows.iter().any(|r| !r.broker_per_intent.is_empty()) {
            let _ = writeln!(
                o,
                "\nThe broker's work per flood intent (its JMX counters before and after the flood, summed over its nodes): requests by kind, transactions (EndTxn), bytes in and out:\n"
            );
            let _ = writeln!(
                o,
                "| system | Produce | Fetch (consumers) | Fetch (followers) | EndTxn | AddPartitionsToTxn | TxnOffsetCommit | WriteTxnMarkers | all requests | bytes in | bytes out | transactions/s |"
            );
            let _ = writeln!(
                o,
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            );
            for r in self.rows.iter().filter(|r| !r.broker_per_intent.is_empty()) {
                let b = &r.broker_per_intent;
                let get = |k: &str| b.get(k).copied().unwrap_or(0.0);
                let all: f64 = b
                    .iter()
                    .filter(|(k, _)| k.starts_with("requests."))
                    .map(|(_, v)| v)
                    .sum();
                let _ = writeln!(
                    o,
                    "| {} {} | {:.3} | {:.3} | {:.3} | {:.4} | {:.4} | {:.4} | {:.4} | {:.3} | {:.0} | {:.0} | {:.1} |",
                    r.system,
                    r.mode,
                    get("requests.Produce"),
                    get("requests.FetchConsumer"),
                    get("requests.FetchFollower"),
                    get("requests.EndTxn"),
                    get("requests.AddPartitionsToTxn"),
                    get("requests.TxnOffsetCommit"),
                    get("requests.WriteTxnMarkers"),
                    all,
                    get("bytes_in"),
                    get("bytes_out"),
                    get("requests.EndTxn") * r.flood_intents as f64 / r.flood_s,
                );
            }
        }
        if self.rows.iter().any(|r| r.broker_cpu_flood_s > 0.0) {
            let base = self
                .rows
                .iter()
                .rev()
                .find(|r| r.slug.starts_with("sg-keyed"));
            let _ = writeln!(
                o,
                "\nThe broker's CPU per flood intent, by its threads (/proc): its JIT compiler compiles the broker's code as it meets new work, most in the first floods after the broker starts (stepgate's come first; the warm-up floods, when run, take most of it), and its code cache sweeper (JDK 17) throws away code gone cold, to be compiled again; so the broker's own work is compared without it too. GC is the garbage collector's threads; requests, all the rest (network, request handlers, coordinators).\n"
            );
            let _ = writeln!(
                o,
                "| system | all µs | JIT µs | GC µs | requests µs | without JIT µs | stepgate ÷, all | stepgate ÷, without JIT |"
            );
            let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|");
            for r in self.rows.iter().filter(|r| r.broker_cpu_flood_s > 0.0) {
                let per = |s: f64| s * 1e6 / r.flood_intents as f64;
                let (all, no_jit) = r.broker_us_per_intent();
                let (vs_all, vs_no_jit) = match base {
                    Some(sg) if sg.slug != r.slug => {
                        let (sa, sn) = sg.broker_us_per_intent();
                        (ratio(sa, all), ratio(sn, no_jit))
                    }
                    _ => ("".to_string(), "".to_string()),
                };
                let _ = writeln!(
                    o,
                    "| {} {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {} |",
                    r.system,
                    r.mode,
                    all,
                    per(r.broker_jit_cpu_flood_s),
                    per(r.broker_gc_cpu_flood_s),
                    per(r.broker_cpu_flood_s - r.broker_jit_cpu_flood_s - r.broker_gc_cpu_flood_s),
                    no_jit,
                    vs_all,
                    vs_no_jit,
                );
            }
        }
        if self
            .rows
            .iter()
            .any(|r| r.broker_per_intent.keys().any(|k| k.contains(".topic.")))
        {
            let _ = writeln!(
                o,
                "\nBytes the broker sent per flood intent, by topic (each topic read once per reader comes to about its bytes in):\n"
            );
            for r in &self.rows {
                let by_topic = |what: &str| -> Vec<String> {
                    r.broker_per_intent
                        .iter()
                        .filter_map(|(k, v)| {
                            let t = k.strip_prefix(what)?.strip_prefix(".topic.")?;
                            (!t.starts_with("__")).then(|| format!("{t} {v:.0}"))
                        })
                        .collect()
                };
                let (sent, received) = (by_topic("bytes_out"), by_topic("bytes_in"));
                if !sent.is_empty() || !received.is_empty() {
                    let _ = writeln!(
                        o,
                        "- {} {}: out {}; in {}",
                        r.system,
                        r.mode,
                        sent.join(", "),
                        received.join(", ")
                    );
                }
            }
        }
        let failed: Vec<&Row> = self
            .rows
            .iter()
            .filter(|r| !r.problems.is_empty())
            .collect();
        for r in failed {
            let _ = writeln!(
                o,
                "\n**{} {} FAILED:** {}",
                r.system,
                r.mode,
                r.problems.join("; ")
            );
        }
        let _ = writeln!(o);
    }

    fn render_sequential(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "Sequential: one agent, one call at a time, nothing else running, on a fresh deployment per system: {} untimed warm-up calls, then {} new steps one after the other, then {} repeats of them (settled), each publish → answer (the agent's read_committed consume). \
             Commits: stepgate's `stepgate_commit_latency_seconds_count` read just before each publish and just after its answer. Records: Kafka records written per call, transaction markers included.\n",
            self.sequential[0].warmup, self.sequential[0].steps, self.sequential[0].steps,
        );
        let _ = writeln!(
            o,
            "| system | mode | new step p50 / p90 / p99 / max ms | repeat p50 / p90 / p99 / max ms | commits before a new step's answer | before a repeat's | Kafka records per new step | per repeat | checks |"
        );
        let _ = writeln!(o, "|---|---|---:|---:|---:|---:|---:|---:|---|");
        let total = |m: &BTreeMap<String, f64>| m.values().sum::<f64>();
        let fmt_commits = |c: Option<f64>| c.map_or("n/a".into(), |c| format!("{c:.2}"));
        for r in &self.sequential {
            let _ = writeln!(
                o,
                "| {} | {}{} | {:.1} / {:.1} / {:.1} / {:.1} | {:.1} / {:.1} / {:.1} / {:.1} | {} | {} | {:.2} | {:.2} | {} |",
                r.system,
                r.mode,
                r.commit_interval
                    .as_ref()
                    .map_or(String::new(), |ci| format!(", gate.commit_interval {ci}")),
                r.new.p50,
                r.new.p90,
                r.new.p99,
                r.new.max,
                r.repeat.p50,
                r.repeat.p90,
                r.repeat.p99,
                r.repeat.max,
                fmt_commits(r.commits_per_new),
                fmt_commits(r.commits_per_repeat),
                total(&r.records_per_new),
                total(&r.records_per_repeat),
                r.check_text()
            );
        }
        if let Some(sg) = self
            .sequential
            .iter()
            .find(|r| r.slug.starts_with("sg-keyed"))
        {
            let others: Vec<&SeqRow> = self
                .sequential
                .iter()
                .filter(|r| r.slug != sg.slug)
                .collect();
            if !others.is_empty() {
                let _ = writeln!(
                    o,
                    "\nstepgate ÷ each other system, sequential (<1 means stepgate answers sooner):\n"
                );
                let _ = writeln!(
                    o,
                    "| stepgate ÷ | new p50 | new p99 | repeat p50 | repeat p99 |"
                );
                let _ = writeln!(o, "|---|---:|---:|---:|---:|");
                for r in others {
                    let _ = writeln!(
                        o,
                        "| {} {} | {} | {} | {} | {} |",
                        r.system,
                        r.mode,
                        ratio(sg.new.p50, r.new.p50),
                        ratio(sg.new.p99, r.new.p99),
                        ratio(sg.repeat.p50, r.repeat.p50),
                        ratio(sg.repeat.p99, r.repeat.p99),
                    );
                }
            }
            if let Some(what) = &sg.commits_counted {
                let _ = writeln!(o, "\nstepgate's commits counted: {what}.");
            }
        }
        let _ = writeln!(
            o,
            "\nRecords per call by topic, sequential (new step; repeat):\n"
        );
        for r in &self.sequential {
            let parts = |m: &BTreeMap<String, f64>| {
                m.iter()
                    .filter(|(_, n)| **n > 0.0)
                    .map(|(t, n)| format!("{t} {n:.2}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let _ = writeln!(
                o,
                "- {} {}: {}; {}",
                r.system,
                r.mode,
                parts(&r.records_per_new),
                parts(&r.records_per_repeat)
            );
        }
        let _ = writeln!(o, "\nChecks (sequential):\n");
        for r in &self.sequential {
            let v = &r.verdict;
            let _ = writeln!(
                o,
                "- {} {}: {} of {} calls answered, {} more than once; `deduplicated` wrong in {}, status not ok in {}{}: **{}**{}",
                r.system,
                r.mode,
                v.answered,
                v.intents,
                v.answered_twice,
                v.wrong_dedup,
                v.not_ok,
                tool_line(&r.slug, &r.tool_invocations),
                r.check_text(),
                if r.problems.is_empty() {
                    String::new()
                } else {
                    format!(" — {}", r.problems.join("; "))
                }
            );
        }
        let _ = writeln!(o);
    }

    fn render_scale(&self, o: &mut String) {
        let _ = writeln!(
            o,
            "Scale of state: completed step records written into the changelog, stepgate started on an empty state directory (restores them before it is ready), then a flood of intents, half of them repeats of random loaded steps (answered from RocksDB), half new steps.\n"
        );
        let _ = writeln!(
            o,
            "| steps in state | changelog records | load s | start → ready s | restore records/s | RSS after restore MiB | intents | in/s | answers/s | CPU µs/intent | RSS MiB | peak RSS MiB | RocksDB MiB (memtables + index/filter + cache) | state on disk MiB | checks |"
        );
        let _ = writeln!(
            o,
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
        );
        for s in &self.scale {
            let _ = writeln!(
                o,
                "| {} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} + {:.0} + {:.0} | {:.0} | {} |",
                s.steps,
                s.changelog_records,
                s.load_s,
                s.ready_s,
                s.restore_records_per_s,
                s.rss_after_restore_mib,
                s.intents,
                fmt_rate(s.intents_per_s),
                s.results_per_s,
                s.cpu_us_per_intent,
                s.rss_mib,
                s.rss_peak_mib,
                s.state_memory.memtables_mib,
                s.state_memory.table_readers_mib,
                s.state_memory.block_cache_mib,
                s.state_disk_mib,
                if s.problems.is_empty() {
                    "ok".to_owned()
                } else {
                    format!("FAIL: {}", s.problems.join("; "))
                }
            );
        }
        let _ = writeln!(o);
    }
}

/// The cost of replication: the same runs on one node (`one`) and on the
/// cluster (`three`), the cluster's figures as ratios to one node's.
pub fn render_replication(one: &Report, three: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "\n# Replication: {} (replication factor {}) ÷ {} (replication factor {}), same run\n\nRatios are the cluster's figure ÷ one node's: throughput <1 and latency or CPU >1 is what replication costs. Broker CPU is summed over the cluster's nodes.\n",
        three.brokers, three.replication_factor, one.brokers, one.replication_factor
    );
    let _ = writeln!(
        o,
        "| run | answers/s (1 → 3) | ratio | paced p50 ms (1 → 3) | ratio | paced p99 ms (1 → 3) | ratio | CPU µs/intent incl. broker (1 → 3) | ratio |"
    );
    let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for a in &one.rows {
        let Some(b) = three.rows.iter().find(|b| b.slug == a.slug) else {
            continue;
        };
        let (ca, cb) = (
            a.cpu_with_broker_us_per_intent(),
            b.cpu_with_broker_us_per_intent(),
        );
        let _ = writeln!(
            o,
            "| {} {} | {:.0} → {:.0} | {} | {:.1} → {:.1} | {} | {:.1} → {:.1} | {} | {:.0} → {:.0} | {} |",
            a.system,
            a.mode,
            a.results_per_s,
            b.results_per_s,
            ratio(b.results_per_s, a.results_per_s),
            a.latency.p50,
            b.latency.p50,
            ratio(b.latency.p50, a.latency.p50),
            a.latency.p99,
            b.latency.p99,
            ratio(b.latency.p99, a.latency.p99),
            ca,
            cb,
            ratio(cb, ca),
        );
    }
    if !one.sequential.is_empty() {
        let _ = writeln!(
            o,
            "\n| sequential, one call at a time | new p50 ms (1 → 3) | ratio | new p99 ms (1 → 3) | ratio | repeat p50 ms (1 → 3) | ratio |"
        );
        let _ = writeln!(o, "|---|---:|---:|---:|---:|---:|---:|");
        for a in &one.sequential {
            let Some(b) = three.sequential.iter().find(|b| b.slug == a.slug) else {
                continue;
            };
            let _ = writeln!(
                o,
                "| {} {} | {:.1} → {:.1} | {} | {:.1} → {:.1} | {} | {:.1} → {:.1} | {} |",
                a.system,
                a.mode,
                a.new.p50,
                b.new.p50,
                ratio(b.new.p50, a.new.p50),
                a.new.p99,
                b.new.p99,
                ratio(b.new.p99, a.new.p99),
                a.repeat.p50,
                b.repeat.p50,
                ratio(b.repeat.p50, a.repeat.p50),
            );
        }
    }
    o
}

/// `stepgate_state_memory_bytes`, in MiB.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StateMemory {
    pub memtables_mib: f64,
    pub table_readers_mib: f64,
    pub block_cache_mib: f64,
}

impl StateMemory {
    pub fn read(m: Option<&Metrics>) -> StateMemory {
        let part = |p: &str| {
            m.and_then(|m| m.value(&format!("stepgate_state_memory_bytes{{part=\"{p}\"}}")))
                .map_or(f64::NAN, |b| b / (1024.0 * 1024.0))
        };
        StateMemory {
            memtables_mib: part("memtables"),
            table_readers_mib: part("table_readers"),
            block_cache_mib: part("block_cache"),
        }
    }

    pub fn total_mib(&self) -> f64 {
        self.memtables_mib + self.table_readers_mib + self.block_cache_mib
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleRow {
    pub steps: usize,
    pub changelog_records: usize,
    pub load_s: f64,
    /// Process start → /readyz (every partition restored).
    pub ready_s: f64,
    /// `stepgate_state_restored_records_total`.
    pub restored_records: f64,
    /// Restored records per second of start → ready (startup included).
    pub restore_records_per_s: f64,
    pub rss_after_restore_mib: f64,
    pub peak_rss_after_restore_mib: f64,
    /// RocksDB's share of the RSS after the restore, by its own estimates.
    pub state_memory_after_restore: StateMemory,
    pub intents: usize,
    pub intents_per_s: Option<f64>,
    pub results_per_s: f64,
    pub cpu_us_per_intent: f64,
    pub flood_latency: Latency,
    pub rss_mib: f64,
    pub rss_peak_mib: f64,
    pub state_memory: StateMemory,
    pub state_disk_mib: f64,
    pub problems: Vec<String>,
    /// Failover at this size, when it ran.
    pub failover: Option<Failover>,
}

/// Failover at a scale run's size (`scale`'s module text): restart on the
/// same disk, and takeovers with and without a standby copy.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Failover {
    /// `kafka.session_timeout`: how long a killed gate's partitions stay
    /// assigned to it.
    pub session_timeout_s: f64,
    /// `kill -9`, then start → /readyz on the same disk.
    pub restart_ready_s: f64,
    /// Partitions that restart restored from the changelog's start.
    pub restart_full_restores: f64,
    /// kill -9 of one of two gates → the first answer on its partitions to a
    /// step published after the kill, the other gate holding standby copies.
    pub standby_resumed_s: Option<f64>,
    /// The same without standby replicas.
    pub cold_resumed_s: Option<f64>,
    /// Records the heir restored when it took over, with and without.
    pub standby_restored_records: f64,
    pub cold_restored_records: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_answered(intents: usize) -> Verdict {
        Verdict {
            intents,
            answered: intents,
            ..Verdict::default()
        }
    }

    #[test]
    fn the_http_passthrough_fails_unless_each_step_called_the_tool_once() {
        let v = all_answered(12);
        // 10 steps (2 repeats), each key once.
        let once = BTreeMap::from([(1u32, 10usize)]);
        let p = problems(&v, true, "pt1-eos-http", Expect::Echo, 10, &once);
        assert!(p.is_empty(), "{p:?}");
        assert_eq!(
            check_text(&p, &v, "pt1-eos-http", &once),
            "ok, tool once/key"
        );
        // A repeat that called the tool again: FAIL, not "≥ once".
        let twice = BTreeMap::from([(1u32, 9usize), (2, 1)]);
        let p = problems(&v, true, "pt1-eos-http", Expect::Echo, 10, &twice);
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(check_text(&p, &v, "pt1-eos-http", &twice), "FAIL");
        // A step whose tool was never called.
        let short = BTreeMap::from([(1u32, 9usize)]);
        assert!(!problems(&v, true, "pt1-eos-http", Expect::Echo, 10, &short).is_empty());
        // The Kafka Streams HTTP variant may call again (after an abort): shown.
        let p = problems(&v, true, "ks-eos-http", Expect::StepLog, 10, &twice);
        assert!(p.is_empty(), "{p:?}");
    }
}
