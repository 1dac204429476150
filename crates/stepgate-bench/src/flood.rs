//! The flood behind a slow tool (issue #29). Every intent is published at once,
//! each a new step of one `unkeyed` tool that answers after a fixed delay, with
//! a small `executor.concurrency`: the gate reads intents far faster than the
//! tool takes calls. Run with the invoker's bounds (`executor.max_queued_calls`
//! and `executor.max_queued_bytes` at their defaults: the gate pauses its
//! `intents` partitions and the flood waits in Kafka) and with them lifted (the
//! behaviour before the bounds: every call waits in the process). stepgate's RSS
//! is sampled from /proc all along, with the invoker's queue from /metrics; then
//! every intent's answers are checked (one each, `ok`, none `in_doubt`) against
//! the tool's own count of the calls it got (each step once).

use crate::Common;
use crate::systems::{self, Metrics, Proc, StepgateSetup};
use crate::workload::{Agent, Expect, Kind, Spec, TOOL, Verdict};
use anyhow::{Context as _, bail};
use axum::http::{HeaderMap, StatusCode, header};
use clap::Args;
use serde::Serialize;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args, Clone)]
pub struct FloodOpts {
    /// Intents published at once, each a new step. The tool takes about
    /// `--concurrency` / `--tool-delay` calls a second (320 with the defaults).
    #[arg(long, default_value_t = 50_000)]
    intents: usize,
    /// Bytes of each intent's arguments (filler added to reach about this).
    #[arg(long, default_value_t = 1024)]
    arg_bytes: usize,
    /// The tool answers each call after this long.
    #[arg(long, default_value = "50ms")]
    tool_delay: humantime::Duration,
    /// stepgate's `executor.concurrency` in this mode (`--executor-concurrency`
    /// is not used here).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// The runs, in order: `bounded` (the defaults of `executor.max_queued_calls`
    /// and `max_queued_bytes`), `unbounded` (both lifted: the behaviour before
    /// the bounds).
    #[arg(long, value_delimiter = ',', default_value = "bounded,unbounded")]
    runs: Vec<String>,
    /// stepgate's RSS and /metrics are sampled this often.
    #[arg(long, default_value = "250ms")]
    sample: humantime::Duration,
}

/// The bounds of the `unbounded` run: more than any flood here.
const LIFTED_CALLS: u64 = 1_000_000_000;
const LIFTED_BYTES: u64 = 1 << 40;

/// One sample during the drain.
#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    /// Since the first intent was published.
    pub t_s: f64,
    pub rss_mib: f64,
    pub answered: usize,
    /// `stepgate_invoker_queued_calls`, `_bytes`, `stepgate_intents_paused`
    /// (None: no scrape, or a build without them).
    pub queued_calls: Option<f64>,
    pub queued_bytes: Option<f64>,
    pub paused: Option<f64>,
}

/// What the tool saw.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ToolSeen {
    /// Requests received.
    pub invocations: u64,
    /// Distinct `Idempotency-Key`s, and those received more than once.
    pub keys: usize,
    pub keys_repeated: usize,
    /// Distinct steps (`Stepgate-Workflow-Id`, `Stepgate-Step-Index`), and
    /// those received more than once.
    pub steps: usize,
    pub steps_repeated: usize,
    /// Most requests the tool held at once.
    pub max_in_flight: usize,
    /// Argument bytes per request, on average.
    pub mean_body_bytes: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct FloodRow {
    pub run: String,
    /// The bounds the gate ran with (None: this build has none).
    pub max_queued_calls: Option<u64>,
    pub max_queued_bytes: Option<u64>,
    pub intents: usize,
    pub intent_bytes: usize,
    pub tool_delay_ms: f64,
    pub concurrency: usize,
    pub max_batch: usize,
    pub ready_s: f64,
    /// RSS once ready, before the flood.
    pub rss_ready_mib: f64,
    /// The kernel's high-water mark (VmHWM) at the end: the true peak.
    pub rss_peak_mib: f64,
    pub rss_peak_sampled_mib: f64,
    /// After the last answer.
    pub rss_end_mib: f64,
    /// Publishing every intent (the broker has the flood after this).
    pub publish_s: f64,
    /// First intent published → last answer received.
    pub drain_s: f64,
    pub answers_per_s: f64,
    pub cpu_s: f64,
    /// `stepgate_intents_pauses_total` at the end.
    pub pauses: Option<f64>,
    /// The most calls and argument bytes seen queued in the invoker.
    pub max_queued_calls_seen: Option<f64>,
    pub max_queued_bytes_seen: Option<f64>,
    /// `stepgate_invoker_wait_seconds`: hand-over → pool slot, mean and count.
    pub invoker_wait_mean_s: Option<f64>,
    pub verdict: Verdict,
    /// Intents answered `in_doubt`, and those of them whose step the tool never got.
    pub in_doubt: usize,
    pub in_doubt_never_ran: usize,
    pub tool: ToolSeen,
    pub samples: Vec<Sample>,
    pub problems: Vec<String>,
}

/// The slow tool: answers `{}` after `delay`, counting each request as it arrives.
struct SlowTool {
    url: String,
    seen: Arc<Mutex<Seen>>,
    max_in_flight: Arc<AtomicUsize>,
}

#[derive(Default)]
struct Seen {
    invocations: u64,
    body_bytes: u64,
    keys: HashMap<String, u32>,
    steps: HashMap<(String, u64), u32>,
}

impl SlowTool {
    async fn start(delay: Duration) -> anyhow::Result<SlowTool> {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let max_in_flight = Arc::new(AtomicUsize::new(0));
        let (s, now, max) = (seen.clone(), in_flight, max_in_flight.clone());
        let app = axum::Router::new().route(
            &format!("/{TOOL}"),
            axum::routing::post(move |headers: HeaderMap, body: axum::body::Bytes| {
                let (s, now, max) = (s.clone(), now.clone(), max.clone());
                async move {
                    let h = |name: &str| {
                        headers
                            .get(name)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or("")
                            .to_owned()
                    };
                    let step = (
                        h("stepgate-workflow-id"),
                        h("stepgate-step-index").parse().unwrap_or(u64::MAX),
                    );
                    {
                        let mut s = s.lock().expect("tool lock");
                        s.invocations += 1;
                        s.body_bytes += body.len() as u64;
                        *s.keys.entry(h("idempotency-key")).or_insert(0) += 1;
                        *s.steps.entry(step).or_insert(0) += 1;
                    }
                    let n = now.fetch_add(1, Ordering::AcqRel) + 1;
                    max.fetch_max(n, Ordering::AcqRel);
                    tokio::time::sleep(delay).await;
                    now.fetch_sub(1, Ordering::AcqRel);
                    (
                        StatusCode::OK,
                        [(header::CONTENT_TYPE, "application/json")],
                        "{}",
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                eprintln!("slow tool: {e}");
            }
        });
        Ok(SlowTool {
            url: format!("http://{addr}/{TOOL}"),
            seen,
            max_in_flight,
        })
    }

    /// What it saw since the last call, and the steps it got.
    fn take(&self) -> (ToolSeen, HashMap<(String, u64), u32>) {
        let s = std::mem::take(&mut *self.seen.lock().expect("tool lock"));
        let seen = ToolSeen {
            invocations: s.invocations,
            keys: s.keys.len(),
            keys_repeated: s.keys.values().filter(|n| **n > 1).count(),
            steps: s.steps.len(),
            steps_repeated: s.steps.values().filter(|n| **n > 1).count(),
            max_in_flight: self.max_in_flight.swap(0, Ordering::AcqRel),
            mean_body_bytes: s.body_bytes as f64 / s.invocations.max(1) as f64,
        };
        (seen, s.steps)
    }
}

struct Ctx {
    common: Common,
    opts: FloodOpts,
    run_id: String,
    work: std::path::PathBuf,
    stepgate: std::path::PathBuf,
    tool: SlowTool,
}

pub async fn run(common: Common, opts: FloodOpts) -> anyhow::Result<()> {
    for r in &opts.runs {
        anyhow::ensure!(
            r == "bounded" || r == "unbounded",
            "--runs: `bounded` or `unbounded`, not {r:?}"
        );
    }
    anyhow::ensure!(opts.intents > 0, "--intents must be > 0");
    let run_id = crate::run_id()?;
    let ctx = Ctx {
        stepgate: crate::stepgate_bin(&common)?,
        work: crate::work_dir(&common, &run_id)?,
        tool: SlowTool::start(opts.tool_delay.into()).await?,
        run_id,
        common,
        opts,
    };
    eprintln!(
        "stepgate-bench flood {}: broker {}, {} partitions, {} intents, tool delay {}, executor.concurrency {}, stepgate {}, scratch {}",
        ctx.run_id,
        ctx.common.brokers,
        ctx.common.partitions,
        ctx.opts.intents,
        ctx.opts.tool_delay,
        ctx.opts.concurrency,
        ctx.stepgate.display(),
        ctx.work.display()
    );
    let mut rows = Vec::new();
    for r in &ctx.opts.runs {
        eprintln!("== flood: {r}");
        let row = one(&ctx, r == "unbounded").await?;
        eprintln!(
            "   peak RSS {:.0} MiB (ready {:.0}, end {:.0}), drained in {:.1} s, {} pauses, {}",
            row.rss_peak_mib,
            row.rss_ready_mib,
            row.rss_end_mib,
            row.drain_s,
            opt(row.pauses, 0),
            if row.problems.is_empty() {
                "checks passed".to_owned()
            } else {
                row.problems.join("; ")
            }
        );
        rows.push(row);
    }
    println!("{}", render(&ctx, &rows));
    if let Some(path) = &ctx.common.json {
        std::fs::write(path, serde_json::to_string_pretty(&rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("figures written to {}", path.display());
    }
    if !ctx.common.keep {
        let _ = std::fs::remove_dir_all(&ctx.work);
    }
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| !r.problems.is_empty())
        .map(|r| format!("{}: {}", r.run, r.problems.join(", ")))
        .collect();
    if !failed.is_empty() {
        bail!("correctness checks failed: {}", failed.join("; "));
    }
    Ok(())
}

async fn one(ctx: &Ctx, lifted: bool) -> anyhow::Result<FloodRow> {
    let c = &ctx.common;
    let o = &ctx.opts;
    let n = o.intents;
    let run = if lifted { "unbounded" } else { "bounded" };
    let slug = format!("flood-{run}");
    let prefix = format!("{}-{slug}", ctx.run_id);
    let dir = ctx.work.join(&slug);
    let setup = StepgateSetup::write(
        &dir,
        &c.brokers,
        &prefix,
        c.partitions,
        &c.commit_interval.to_string(),
        &ctx.tool.url,
        "unkeyed",
        o.concurrency,
        c.max_batch,
    )?;
    setup.replicate(c.replication_factor)?;
    let keys = systems::ConfigKeys::of_this_build();
    let bounded_build = keys.has(&["executor", "max_queued_calls"]);
    if lifted && bounded_build {
        setup.add_keys(
            "executor",
            &[
                format!("max_queued_calls = {LIFTED_CALLS}"),
                format!("max_queued_bytes = {LIFTED_BYTES}"),
            ],
        )?;
    }
    // The bounds in effect, as stepgate reads its config.
    let (max_queued_calls, max_queued_bytes) =
        match stepgate::config::Config::load(Some(&setup.config), Vec::new()) {
            Ok(cfg) => {
                let v = serde_json::to_value(&cfg).unwrap_or_default();
                let get = |k: &str| {
                    v.pointer(&format!("/executor/{k}"))
                        .and_then(|x| x.as_u64())
                };
                (get("max_queued_calls"), get("max_queued_bytes"))
            }
            Err(e) => bail!("reading {}: {e}", setup.config.display()),
        };
    setup.create_topics(&ctx.stepgate).await?;
    let topics = setup.topics();
    let mut proc = setup.spawn(&ctx.stepgate, &dir.join("process.log"))?;
    let ready_s = proc
        .wait_http_ready(&setup.ready_url(), Duration::from_secs(120))
        .await?
        .as_secs_f64();
    // Let the group settle and the first transactions begin before the flood.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_ready_mib = proc.rss_mib().0;
    ctx.tool.take();

    let specs: Arc<Vec<Spec>> = Arc::new(
        (0..n)
            .map(|i| Spec {
                workflow: format!("fl-w{}", i % c.workflows.max(1)),
                step: (i / c.workflows.max(1)) as u64,
                kind: Kind::First,
            })
            .collect(),
    );
    let intent_bytes = crate::workload::payload(&specs[0], 0, o.arg_bytes).len();
    let agent = Arc::new(
        Agent::start(
            &c.brokers,
            &format!("{prefix}.intents"),
            &format!("{prefix}.results"),
            c.partitions,
            Expect::StepLog,
            vec![Kind::First; n],
            "1",
        )?
        .with_padding(o.arg_bytes),
    );
    let cpu0 = proc.cpu_secs();
    let (a, s) = (agent.clone(), specs.clone());
    let published = tokio::task::spawn_blocking(move || {
        let r = a.publish(&s, 0, None);
        (r, Instant::now())
    });
    let t0 = Instant::now();
    let scraper = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()?;
    let metrics_url = format!("http://{}/metrics", setup.http);
    let scrape = || scrape(&scraper, &metrics_url);
    let every: Duration = o.sample.into();
    let stall: Duration = c.stall.into();
    let mut samples = Vec::new();
    let mut next = Instant::now();
    let (mut seen, mut moved) = (0, Instant::now());
    loop {
        let (answered, _) = agent.progress(0..n);
        if Instant::now() >= next {
            samples.push(sample(&proc, t0, answered, scrape().await.as_ref()));
            next += every;
        }
        if answered == n {
            break;
        }
        if answered != seen {
            (seen, moved) = (answered, Instant::now());
        }
        if moved.elapsed() > stall {
            bail!(
                "{run}: {answered} of {n} intents answered, nothing new for {stall:?}; log {}:\n{}",
                proc.log.display(),
                systems::tail(&proc.log, 20)
            );
        }
        proc.check_alive()?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (publish, published_at) = published.await?;
    publish?;
    let first = agent.first_sent(0..n).context("nothing was sent")?;
    let last = agent.progress(0..n).1.context("no answer arrival times")?;
    let publish_s = published_at.duration_since(first).as_secs_f64();
    let drain_s = last.duration_since(first).as_secs_f64();
    // Late duplicates, if any, arrive within a commit or two.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let end = scrape().await;
    samples.push(sample(&proc, t0, n, end.as_ref()));
    let cpu_s = proc.cpu_secs() - cpu0;
    let (rss_end_mib, rss_peak_mib) = proc.rss_mib();
    proc.stop(Duration::from_secs(60)).await?;
    let verdict = agent.verdict(0..n);
    let in_doubt_ids = agent.in_doubt();
    drop(agent);
    let (tool, steps) = ctx.tool.take();
    let in_doubt_never_ran = in_doubt_ids
        .iter()
        .filter(|i| {
            let s = &specs[**i];
            !steps.contains_key(&(s.workflow.clone(), s.step))
        })
        .count();

    let max_of = |f: fn(&Sample) -> Option<f64>| {
        samples
            .iter()
            .filter_map(f)
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v))))
    };
    let wait = end.as_ref().and_then(|m| {
        let count = m.value("stepgate_invoker_wait_seconds_count")?;
        Some(m.value("stepgate_invoker_wait_seconds_sum")? / count.max(1.0))
    });
    let mut row = FloodRow {
        run: run.to_owned(),
        max_queued_calls: max_queued_calls.filter(|_| bounded_build),
        max_queued_bytes: max_queued_bytes.filter(|_| bounded_build),
        intents: n,
        intent_bytes,
        tool_delay_ms: Duration::from(o.tool_delay).as_secs_f64() * 1000.0,
        concurrency: o.concurrency,
        max_batch: c.batch(),
        ready_s,
        rss_ready_mib,
        rss_peak_mib,
        rss_peak_sampled_mib: samples.iter().map(|s| s.rss_mib).fold(0.0, f64::max),
        rss_end_mib,
        publish_s,
        drain_s,
        answers_per_s: n as f64 / drain_s,
        cpu_s,
        pauses: end
            .as_ref()
            .and_then(|m| m.value("stepgate_intents_pauses_total")),
        max_queued_calls_seen: max_of(|s| s.queued_calls),
        max_queued_bytes_seen: max_of(|s| s.queued_bytes),
        invoker_wait_mean_s: wait,
        in_doubt: in_doubt_ids.len(),
        in_doubt_never_ran,
        verdict,
        tool,
        samples,
        problems: Vec::new(),
    };
    row.problems = problems(&row);
    if !c.keep {
        systems::delete_topics(&c.brokers, &topics).await;
    }
    Ok(row)
}

/// stepgate's /metrics, if it answers within the client's timeout.
async fn scrape(client: &reqwest::Client, url: &str) -> Option<Metrics> {
    let r = client.get(url).send().await.ok()?;
    Some(Metrics(r.text().await.ok()?))
}

fn sample(proc: &Proc, t0: Instant, answered: usize, m: Option<&Metrics>) -> Sample {
    Sample {
        t_s: t0.elapsed().as_secs_f64(),
        rss_mib: proc.rss_mib().0,
        answered,
        queued_calls: m.and_then(|m| m.value("stepgate_invoker_queued_calls")),
        queued_bytes: m.and_then(|m| m.value("stepgate_invoker_queued_bytes")),
        paused: m.and_then(|m| m.value("stepgate_intents_paused")),
    }
}

/// What the checks found wrong (empty: every intent answered once, `ok`, and
/// every step called once).
fn problems(r: &FloodRow) -> Vec<String> {
    let v = &r.verdict;
    let n = r.intents;
    let mut p = Vec::new();
    if v.missing > 0 {
        p.push(format!("{} intents never answered", v.missing));
    }
    if v.answered_twice > 0 {
        p.push(format!(
            "{} intents answered more than once ({} extra answers)",
            v.answered_twice, v.extra_answers
        ));
    }
    if v.not_ok > 0 {
        p.push(format!(
            "{} answers not ok (statuses {:?}; e.g. {})",
            v.not_ok,
            v.statuses,
            v.sample_wrong.as_deref().unwrap_or("-")
        ));
    }
    if r.in_doubt > 0 {
        p.push(format!(
            "{} answered in_doubt, {} of them never ran",
            r.in_doubt, r.in_doubt_never_ran
        ));
    }
    if v.wrong_dedup > 0 {
        p.push(format!("`deduplicated` true in {} answers", v.wrong_dedup));
    }
    if v.unknown > 0 {
        p.push(format!("{} answers not matched to an intent", v.unknown));
    }
    let t = &r.tool;
    if t.invocations != n as u64 || t.steps != n || t.keys != n {
        p.push(format!(
            "the tool got {} calls for {} steps ({} keys), not {n}",
            t.invocations, t.steps, t.keys
        ));
    }
    if t.steps_repeated > 0 || t.keys_repeated > 0 {
        p.push(format!(
            "the tool got {} steps ({} keys) more than once",
            t.steps_repeated, t.keys_repeated
        ));
    }
    if t.max_in_flight > r.concurrency {
        p.push(format!(
            "the tool held {} calls at once, above executor.concurrency {}",
            t.max_in_flight, r.concurrency
        ));
    }
    p
}

fn opt(v: Option<f64>, decimals: usize) -> String {
    v.map_or("n/a".into(), |v| format!("{v:.decimals$}"))
}

fn mib(bytes: f64) -> String {
    format!("{:.0} MiB", bytes / (1024.0 * 1024.0))
}

fn bounds(r: &FloodRow) -> String {
    match (r.max_queued_calls, r.max_queued_bytes) {
        (Some(c), Some(b)) if c >= LIFTED_CALLS => format!("lifted ({c} / {})", mib(b as f64)),
        (Some(c), Some(b)) => format!("{c} / {}", mib(b as f64)),
        _ => "none in this build".into(),
    }
}

/// The figures as Markdown, ready for the README.
fn render(ctx: &Ctx, rows: &[FloodRow]) -> String {
    let (c, o) = (&ctx.common, &ctx.opts);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "## Flood behind a slow tool\n\n{} intents published at once, each a new step of one `unkeyed` tool that answers after {} ({} bytes per intent, {:.0} bytes of arguments); `executor.concurrency` {}, so the tool takes at most {:.0} calls/s; {} partitions, `gate.max_batch` {}. stepgate: `{}`.\n",
        o.intents,
        o.tool_delay,
        rows.first().map_or(0, |r| r.intent_bytes),
        rows.first().map_or(0.0, |r| r.tool.mean_body_bytes),
        o.concurrency,
        o.concurrency as f64 / Duration::from(o.tool_delay).as_secs_f64(),
        c.partitions,
        c.batch(),
        ctx.stepgate.display()
    );
    let _ = writeln!(
        s,
        "| run | max_queued_calls / bytes | RSS ready | peak RSS | RSS at end | most queued calls (bytes) | pauses | publish | drain | answers/s | answered once / `ok` | `in_doubt` | tool calls (distinct steps) |"
    );
    let _ = writeln!(s, "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    for r in rows {
        let once = r.verdict.answered - r.verdict.answered_twice;
        let ok = r.verdict.statuses.get("ok").copied().unwrap_or(0);
        let _ = writeln!(
            s,
            "| {} | {} | {:.0} MiB | **{:.0} MiB** | {:.0} MiB | {} ({}) | {} | {:.1} s | {:.1} s | {:.0} | {} / {} of {} | {} | {} ({}) |",
            r.run,
            bounds(r),
            r.rss_ready_mib,
            r.rss_peak_mib,
            r.rss_end_mib,
            opt(r.max_queued_calls_seen, 0),
            r.max_queued_bytes_seen.map_or("n/a".into(), mib),
            opt(r.pauses, 0),
            r.publish_s,
            r.drain_s,
            r.answers_per_s,
            once,
            ok,
            r.intents,
            r.in_doubt,
            r.tool.invocations,
            r.tool.steps
        );
    }
    let _ = writeln!(
        s,
        "\nOver the drain (seconds since the first intent: RSS, calls queued in the invoker, `p` while intents are paused):\n"
    );
    for r in rows {
        let _ = write!(s, "- {}:", r.run);
        for x in spread(&r.samples, 12) {
            let _ = write!(
                s,
                " {:.0} s {:.0} MiB {}{};",
                x.t_s,
                x.rss_mib,
                opt(x.queued_calls, 0),
                if x.paused == Some(1.0) { " p" } else { "" }
            );
        }
        let _ = writeln!(
            s,
            " invoker wait mean {}; stepgate CPU {:.0} s; tool: most in flight {}.",
            r.invoker_wait_mean_s
                .map_or("n/a".into(), |w| format!("{w:.1} s")),
            r.cpu_s,
            r.tool.max_in_flight
        );
    }
    for r in rows.iter().filter(|r| !r.problems.is_empty()) {
        let _ = writeln!(s, "\n**{}: {}**", r.run, r.problems.join("; "));
    }
    s
}

/// About `k` samples spread evenly over the run, the first and the last included.
fn spread(samples: &[Sample], k: usize) -> Vec<&Sample> {
    if samples.len() <= k {
        return samples.iter().collect();
    }
    let last = samples.len() - 1;
    let mut idx: Vec<usize> = (0..k).map(|j| j * last / (k - 1)).collect();
    idx.dedup();
    idx.into_iter().map(|i| &samples[i]).collect()
}
