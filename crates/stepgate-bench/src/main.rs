//! `stepgate-bench`: stepgate against the limit (an rdkafka passthrough) and a peer
//! (Kafka Streams dedup) on one broker and one workload, and stepgate with
//! millions of step records in its state. `benches/bench.sh` runs it end to end.
//!
//! Each system runs as a child process, so its CPU time and peak RSS come from
//! /proc. Per system: a flood (every intent published at once; throughput) then a
//! paced phase (a fixed rate below capacity; latency), then the answers are
//! checked intent by intent. Then the sequential mode: one agent, one call at a
//! time on a fresh deployment (new steps, then repeats of them).
//!
//! `flood`: a flood of new steps behind a slow unkeyed tool, once with the
//! invoker's bounds and once without them (issue #29): stepgate's RSS over
//! time, and every intent answered once, `ok`, each call made once.
//!
//! stepgate runs at its shipped defaults: its config names only topics, group,
//! tool, state directory and HTTP port (`systems::StepgateSetup`). A run records
//! the machine, its command and any `STEPGATE_` overrides (`machine`), and
//! `render-docs` makes docs/performance.md's generated part and the README's
//! performance table from a run's files (`render`).

mod flood;
mod machine;
mod passthrough;
mod render;
mod report;
mod scale;
mod sequential;
mod systems;
mod workload;

#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use anyhow::{Context as _, bail};
use clap::{Args, Parser, Subcommand};
use report::{GateFigures, Row};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use systems::{GroupWatch, Proc, StepgateSetup};
use workload::{Agent, Expect, Shape, Spec, ToolServer};

#[derive(Parser)]
#[command(
    name = "stepgate-bench",
    about = "Throughput, latency and memory of stepgate, side by side with a passthrough and Kafka Streams"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// `compare`, then `scale`.
    All {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        compare: CompareOpts,
        #[command(flatten)]
        scale: ScaleOpts,
    },
    /// stepgate, the passthrough (1 and 2 hops) and Kafka Streams on one workload,
    /// then the sequential mode.
    Compare {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        compare: CompareOpts,
    },
    /// The sequential mode only: one agent, one call at a time, publish → answer
    /// (stepgate with a `keyed` tool, and the Kafka Streams peers in EOS).
    Sequential {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        compare: CompareOpts,
    },
    /// The same stepgate runs (flood, paced, sequential) on one node with
    /// replication factor 1, then on a three-node cluster with replication
    /// (`deploy/local/cluster.sh`: `min.insync.replicas=2`, `acks=all`): each
    /// report, then the cluster's figures as ratios to one node's.
    Cluster {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        compare: CompareOpts,
        /// The cluster's bootstrap servers.
        #[arg(long)]
        cluster_brokers: String,
        /// Replication factor of the topics on the cluster.
        #[arg(long, default_value_t = 3)]
        cluster_replication: i32,
    },
    /// stepgate restoring and serving millions of step records.
    Scale {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        scale: ScaleOpts,
    },
    /// A flood of new steps behind a slow `unkeyed` tool: stepgate's RSS while
    /// it drains, with the invoker's bounds (`executor.max_queued_*` defaults)
    /// and with them lifted; every intent answered once, none `in_doubt`.
    Flood {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        flood: flood::FloodOpts,
    },
    /// docs/performance.md's generated part and README.md's performance table,
    /// from a run's files (bench.sh runs it after a full run).
    RenderDocs(RenderDocsArgs),
    /// The passthrough itself (started by the bench as a child process).
    #[command(hide = true)]
    Passthrough(passthrough::Args),
}

#[derive(Args)]
struct RenderDocsArgs {
    /// The run's results, as `--json` wrote them (kept as
    /// `benches/results-<id>.json`). Default: the run the page names.
    results: Option<PathBuf>,
    /// The durable engines' figures of the same run (run.py's `--json`).
    /// Default: `durable-<id>.json` beside `results-<id>.json`, if it is there.
    #[arg(long)]
    durable: Option<PathBuf>,
    /// The page whose generated part is rewritten.
    #[arg(long, default_value = "docs/performance.md")]
    docs: PathBuf,
    /// The README whose performance table is rewritten.
    #[arg(long, default_value = "README.md")]
    readme: PathBuf,
    /// Write nothing; fail if either file differs from what the run renders.
    #[arg(long)]
    check: bool,
}

#[derive(Args, Clone)]
pub struct Common {
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Partitions of every topic (intents, results, internal, peers').
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Replication factor of every topic the bench or stepgate creates.
    #[arg(long, default_value_t = 1)]
    replication_factor: i32,
    /// The passthrough's and Kafka Streams' commit interval. Also stepgate's
    /// `gate.commit_interval` on builds that still have that key (before issue
    /// #12); a stepgate without it pipelines its commits and ignores this.
    #[arg(long, default_value = "100ms")]
    commit_interval: humantime::Duration,
    #[arg(long, default_value_t = 10_000)]
    workflows: usize,
    /// Share of intents that repeat an earlier step; half of them rephrased.
    #[arg(long, default_value_t = 0.2)]
    repeat_share: f64,
    /// A repeat follows its first call after about this many other new steps.
    #[arg(long, default_value_t = 1000)]
    repeat_lag: usize,
    /// The stepgate binary (default: next to this one).
    #[arg(long)]
    stepgate_bin: Option<PathBuf>,
    /// Scratch directory for configs, state and logs (default: a new one in /tmp).
    #[arg(long)]
    work_dir: Option<PathBuf>,
    /// Also write every figure as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Keep the topics and the scratch directory.
    #[arg(long)]
    keep: bool,
    /// stepgate's `gate.max_batch` (default: stepgate's own, left out of its
    /// config), and the passthrough's (default: the same number).
    #[arg(long)]
    max_batch: Option<usize>,
    /// stepgate's `executor.concurrency` (tool calls in flight); one stepgate run
    /// per value. The last one is also used by the fast-path and scale runs and is
    /// the one the other systems are compared with. Default: 1024, then
    /// stepgate's shipped default (left out of its config).
    #[arg(long, value_delimiter = ',')]
    executor_concurrency: Vec<usize>,
    /// A run with no new answer for this long has failed.
    #[arg(long, default_value = "120s")]
    stall: humantime::Duration,
}

#[derive(Args, Clone)]
pub struct CompareOpts {
    /// Intents of the flood (throughput).
    #[arg(long, default_value_t = 200_000)]
    intents: usize,
    /// Intents per second of the paced phase (latency).
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Length of the paced phase.
    #[arg(long, default_value = "10s")]
    paced: humantime::Duration,
    /// Before the measured floods, a flood of this many intents through each
    /// system, not measured, so that the broker's JIT has compiled every
    /// system's paths first: on a freshly started broker its JIT compiler was
    /// 25–55% of the broker's CPU in the first floods, and stepgate's come
    /// first. 0 skips it.
    #[arg(long, default_value_t = 50_000)]
    broker_warmup: usize,
    /// Also run stepgate with a `read_only` tool (fast path, no step log).
    #[arg(long)]
    fast_path: bool,
    /// The Kafka Streams peer's jar (default: benches/peers/kstreams-dedup/target/kstreams-dedup.jar).
    #[arg(long)]
    kstreams_jar: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    ks_threads: u32,
    /// JVM options for the peer, space-separated (default: the JVM's own).
    #[arg(long, default_value = "")]
    java_opts: String,
    /// Record a CPU profile of stepgate's flood with `perf record` into this file.
    #[arg(long)]
    perf: Option<PathBuf>,
    /// Only these systems (stepgate, passthrough, passthrough-http: one hop
    /// calling the bench's HTTP tool once per new step key, kstreams,
    /// kstreams-http: the Kafka Streams peer whose processor calls that tool).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "stepgate,passthrough,passthrough-http,kstreams,kstreams-http"
    )]
    only: Vec<String>,
    /// Steps of the sequential mode, per system: one agent, one call at a time,
    /// this many new steps then as many repeats of them (settled), publish →
    /// answer; on a fresh deployment of stepgate (keyed tool) and of the Kafka
    /// Streams peers (EOS). 0 skips it.
    #[arg(long, default_value_t = 200)]
    sequential: usize,
}

#[derive(Args, Clone)]
pub struct ScaleOpts {
    /// Step records loaded into the changelog before stepgate starts, one run each.
    #[arg(long, value_delimiter = ',', default_value = "1000000,10000000")]
    scale_sizes: Vec<usize>,
    /// Intents of the workload run on each loaded state (half repeat loaded steps).
    #[arg(long, default_value_t = 50_000)]
    scale_intents: usize,
}

impl Common {
    /// `--executor-concurrency`, or 1024 then stepgate's shipped default.
    fn concurrencies(&self) -> Vec<usize> {
        if self.executor_concurrency.is_empty() {
            vec![1024, systems::default_concurrency()]
        } else {
            self.executor_concurrency.clone()
        }
    }

    /// The batch size the passthrough uses: `--max-batch`, or stepgate's default.
    fn batch(&self) -> usize {
        self.max_batch.unwrap_or_else(systems::default_max_batch)
    }
}

/// What every run shares.
pub struct Bench {
    pub common: Common,
    pub run_id: String,
    pub work: PathBuf,
    pub stepgate: PathBuf,
    pub tool: ToolServer,
    /// The local broker's processes (one node, or the three of a cluster).
    pub broker: Vec<String>,
}

impl Bench {
    fn shape(&self, intents: usize) -> Shape {
        Shape {
            intents,
            workflows: self.common.workflows,
            repeat_share: self.common.repeat_share,
            repeat_lag: self.common.repeat_lag,
        }
    }

    fn commit_ms(&self) -> u128 {
        Duration::from(self.common.commit_interval).as_millis()
    }

    fn concurrency(&self) -> usize {
        self.common
            .concurrencies()
            .last()
            .copied()
            .unwrap_or_else(systems::default_concurrency)
    }

    fn stall(&self) -> Duration {
        self.common.stall.into()
    }

    /// A stepgate deployment in `dir` with the run's common settings.
    fn stepgate_setup(
        &self,
        dir: &std::path::Path,
        prefix: &str,
        category: &str,
        concurrency: usize,
    ) -> anyhow::Result<StepgateSetup> {
        let c = &self.common;
        let setup = StepgateSetup::write(
            dir,
            &c.brokers,
            prefix,
            c.partitions,
            &c.commit_interval.to_string(),
            &self.tool.url,
            category,
            concurrency,
            c.max_batch,
        )?;
        setup.replicate(c.replication_factor)?;
        Ok(setup)
    }
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async move {
        match cli.cmd {
            Cmd::Passthrough(a) => passthrough::run(a).await,
            Cmd::All {
                common,
                compare,
                scale,
            } => bench(common, Some(compare), Some(scale), true).await,
            Cmd::Compare { common, compare } => bench(common, Some(compare), None, true).await,
            Cmd::Sequential { common, compare } => {
                anyhow::ensure!(compare.sequential > 0, "--sequential must be > 0 here");
                bench(common, Some(compare), None, false).await
            }
            Cmd::Scale { common, scale } => bench(common, None, Some(scale), true).await,
            Cmd::Cluster {
                common,
                compare,
                cluster_brokers,
                cluster_replication,
            } => cluster(common, compare, cluster_brokers, cluster_replication).await,
            Cmd::Flood { common, flood } => flood::run(common, flood).await,
            Cmd::RenderDocs(a) => render_docs(&a),
        }
    })
}

/// Rewrite the generated parts of the page and the README from a run's files.
fn render_docs(a: &RenderDocsArgs) -> anyhow::Result<()> {
    let read =
        |p: &Path| std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()));
    let page_text = read(&a.docs)?;
    let readme_text = read(&a.readme)?;
    let mut sources = match &a.results {
        Some(r) => {
            let results = repo_path(r);
            let durable =
                render::Sources::durable_beside(&results).filter(|d| Path::new(d).exists());
            render::Sources { results, durable }
        }
        None => render::Sources::of_page(&page_text).with_context(|| {
            format!(
                "{} names no run it was made from: pass the results file",
                a.docs.display()
            )
        })?,
    };
    if let Some(d) = &a.durable {
        sources.durable = Some(repo_path(d));
    }
    let results = read(Path::new(&sources.results))?;
    let durable = match &sources.durable {
        Some(d) => Some(read(Path::new(d))?),
        None => None,
    };
    let out = render::render(&results, durable.as_deref(), &sources)?;
    let docs_name = a.docs.display().to_string();
    let readme_name = a.readme.display().to_string();
    let page = render::splice(&page_text, &out.page, &render::PAGE_MARKS, &docs_name)?;
    let readme = render::splice(
        &readme_text,
        &out.table,
        &render::README_MARKS,
        &readme_name,
    )?;
    let stale: Vec<&str> = [
        (page != page_text).then_some(docs_name.as_str()),
        (readme != readme_text).then_some(readme_name.as_str()),
    ]
    .into_iter()
    .flatten()
    .collect();
    if a.check {
        anyhow::ensure!(
            stale.is_empty(),
            "{} not what {} renders to: run `stepgate-bench render-docs {}`",
            stale.join(" and "),
            sources.results,
            sources.results
        );
        return Ok(());
    }
    std::fs::write(&a.docs, page).with_context(|| format!("writing {docs_name}"))?;
    std::fs::write(&a.readme, readme).with_context(|| format!("writing {readme_name}"))?;
    eprintln!(
        "render-docs: {docs_name} and {readme_name} from {}{}",
        sources.results,
        sources
            .durable
            .as_ref()
            .map_or_else(String::new, |d| format!(" and {d}"))
    );
    Ok(())
}

/// `p` as the page names it: relative to the working directory (the
/// repository's root, where bench.sh runs) when it lies under it.
fn repo_path(p: &Path) -> String {
    std::env::current_dir()
        .ok()
        .and_then(|cwd| p.strip_prefix(cwd).ok().map(Path::to_path_buf))
        .unwrap_or_else(|| p.to_path_buf())
        .display()
        .to_string()
}

/// `floods`: the flood and paced runs of `compare` (without: its sequential mode only).
async fn bench(
    common: Common,
    compare: Option<CompareOpts>,
    scale: Option<ScaleOpts>,
    floods: bool,
) -> anyhow::Result<()> {
    let json = common.json.clone();
    let out = run(common, compare, scale, floods, "").await?;
    println!("{}", out.render());
    if let Some(path) = &json {
        std::fs::write(path, serde_json::to_string_pretty(&out)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("figures written to {}", path.display());
    }
    check(&[&out])
}

/// `bench`'s runs on one node, then on the cluster, in one process.
async fn cluster(
    single: Common,
    compare: CompareOpts,
    cluster_brokers: String,
    replication: i32,
) -> anyhow::Result<()> {
    let json = single.json.clone();
    let mut replicated = single.clone();
    replicated.brokers = cluster_brokers;
    replicated.replication_factor = replication;
    let one = run(single, Some(compare.clone()), None, true, "").await?;
    println!("{}", one.render());
    let three = run(replicated, Some(compare), None, true, "-c").await?;
    println!("{}", three.render());
    println!("{}", report::render_replication(&one, &three));
    if let Some(path) = &json {
        let both = serde_json::json!({ "single": one, "cluster": three });
        std::fs::write(path, serde_json::to_string_pretty(&both)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("figures written to {}", path.display());
    }
    check(&[&one, &three])
}

fn check(reports: &[&report::Report]) -> anyhow::Result<()> {
    let failed: Vec<String> = reports.iter().flat_map(|r| r.failures()).collect();
    if !failed.is_empty() {
        bail!("correctness checks failed: {}", failed.join("; "));
    }
    Ok(())
}

async fn run(
    common: Common,
    compare: Option<CompareOpts>,
    scale: Option<ScaleOpts>,
    floods: bool,
    run_suffix: &str,
) -> anyhow::Result<report::Report> {
    let stepgate = stepgate_bin(&common)?;
    let run_id = format!("{}{run_suffix}", run_id()?);
    let work = work_dir(&common, &run_id)?;
    let bench = Bench {
        tool: ToolServer::start().await?,
        broker: systems::broker_pids(&common.brokers),
        common,
        run_id,
        work,
        stepgate,
    };
    eprintln!(
        "stepgate-bench {}: broker {} ({} process(es) found), {} partitions, replication factor {}, commit interval {}, scratch {}",
        bench.run_id,
        bench.common.brokers,
        bench.broker.len(),
        bench.common.partitions,
        bench.common.replication_factor,
        bench.common.commit_interval,
        bench.work.display()
    );
    let mut out = report::Report::new(&bench);
    if let Some((topics, partitions)) = out.broker_load
        && partitions > report::BUSY_BROKER_PARTITIONS
    {
        eprintln!(
            "warning: the broker already holds {topics} topics ({partitions} partitions); its figures will not be a fresh broker's (wipe it: bash deploy/local/kafka.sh stop --wipe)"
        );
    }
    if let Some(c) = &compare {
        if floods {
            out.workload = Some(report::WorkloadInfo::new(&bench, c));
            out.rows = compare_all(&bench, c).await?;
        }
        if c.sequential > 0 {
            out.sequential = sequential::run(&bench, c, &sequential_systems(&bench, c)).await?;
        }
    }
    if let Some(s) = &scale {
        out.scale = scale::run(&bench, s).await?;
    }
    if !bench.common.keep {
        let _ = std::fs::remove_dir_all(&bench.work);
    }
    Ok(out)
}

/// The stepgate binary: `--stepgate-bin`, or the one next to this binary.
fn stepgate_bin(common: &Common) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let stepgate = common
        .stepgate_bin
        .clone()
        .unwrap_or_else(|| exe.with_file_name("stepgate"));
    anyhow::ensure!(
        stepgate.exists(),
        "no stepgate binary at {} (cargo build --release, or --stepgate-bin)",
        stepgate.display()
    );
    Ok(stepgate)
}

/// The run's id: `STEPGATE_BENCH_RUN_ID` (bench.sh names the run, so that the
/// durable peers' figures carry its id), or one from the clock.
fn run_id() -> anyhow::Result<String> {
    Ok(match std::env::var("STEPGATE_BENCH_RUN_ID") {
        Ok(id) if !id.is_empty() => id,
        _ => format!(
            "sgb{:x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs()
                & 0xff_ffff
        ),
    })
}

/// The scratch directory, created.
fn work_dir(common: &Common, run_id: &str) -> anyhow::Result<PathBuf> {
    let work = common
        .work_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(run_id));
    std::fs::create_dir_all(&work)?;
    Ok(work)
}

/// The systems of `compare`.
#[derive(Debug, Clone)]
enum System {
    Stepgate {
        category: &'static str,
        concurrency: usize,
    },
    Passthrough {
        hops: usize,
        eos: bool,
        /// One hop that calls the bench's HTTP tool once per new step key
        /// (`passthrough --tool-url`): the floor of any system calling it.
        http: bool,
    },
    KStreams {
        eos: bool,
        jar: PathBuf,
        /// The processor calls the bench's HTTP tool for each new step.
        http: bool,
    },
}

impl System {
    fn slug(&self) -> String {
        match self {
            System::Stepgate {
                category,
                concurrency,
            } => format!("sg-{}-c{concurrency}", category.replace('_', "")),
            System::Passthrough { hops, eos, http } => format!(
                "pt{hops}-{}{}",
                mode(*eos),
                if *http { "-http" } else { "" }
            ),
            System::KStreams { eos, http, .. } => {
                format!("ks-{}{}", mode(*eos), if *http { "-http" } else { "" })
            }
        }
    }

    fn name(&self) -> String {
        match self {
            System::Stepgate { .. } => "stepgate".into(),
            System::Passthrough { hops, http, .. } => format!(
                "passthrough, {hops} hop{}{}",
                if *hops > 1 { "s" } else { "" },
                if *http { ", HTTP tool" } else { "" }
            ),
            System::KStreams { http: false, .. } => "Kafka Streams dedup".into(),
            System::KStreams { http: true, .. } => "Kafka Streams dedup, HTTP tool".into(),
        }
    }

    fn mode(&self) -> String {
        match self {
            System::Stepgate {
                category,
                concurrency,
            } => format!("EOS, {category} tool, executor.concurrency {concurrency}"),
            System::Passthrough { eos, .. } | System::KStreams { eos, .. } => {
                if *eos {
                    "EOS".into()
                } else {
                    "ALOS".into()
                }
            }
        }
    }

    /// What its answers should say about deduplication.
    fn expect(&self) -> Expect {
        match self {
            System::Stepgate {
                category: "keyed", ..
            }
            | System::KStreams { .. } => Expect::StepLog,
            System::Stepgate { .. } => Expect::FastPath,
            System::Passthrough { .. } => Expect::Echo,
        }
    }
}

/// The Kafka Streams peer's jar, if built.
fn kstreams_jar(opts: &CompareOpts) -> Result<PathBuf, String> {
    let jar = opts
        .kstreams_jar
        .clone()
        .unwrap_or_else(|| PathBuf::from("benches/peers/kstreams-dedup/target/kstreams-dedup.jar"));
    if jar.exists() {
        Ok(jar)
    } else {
        Err(format!(
            "Kafka Streams peer skipped: no jar at {} (bash benches/peers/build.sh)",
            jar.display()
        ))
    }
}

/// The systems of the sequential mode: stepgate with a keyed tool, and the Kafka
/// Streams peers (inline and HTTP tool) in EOS.
fn sequential_systems(bench: &Bench, opts: &CompareOpts) -> Vec<System> {
    let want = |s: &str| opts.only.iter().any(|o| o == s);
    let mut out = Vec::new();
    if want("stepgate") {
        out.push(System::Stepgate {
            category: "keyed",
            concurrency: bench.concurrency(),
        });
    }
    match kstreams_jar(opts) {
        Ok(jar) => {
            for http in [false, true] {
                if want(if http { "kstreams-http" } else { "kstreams" }) {
                    out.push(System::KStreams {
                        eos: true,
                        jar: jar.clone(),
                        http,
                    });
                }
            }
        }
        Err(note) if want("kstreams") || want("kstreams-http") => eprintln!("note: {note}"),
        Err(_) => {}
    }
    out
}

fn mode(eos: bool) -> &'static str {
    if eos { "eos" } else { "alos" }
}

async fn compare_all(bench: &Bench, opts: &CompareOpts) -> anyhow::Result<Vec<Row>> {
    let flood = Arc::new(workload::build("f", &bench.shape(opts.intents), 7));
    let paced_n = (opts.rate * Duration::from(opts.paced).as_secs_f64()).round() as usize;
    let paced = Arc::new(workload::build("p", &bench.shape(paced_n), 11));
    let want = |s: &str| opts.only.iter().any(|o| o == s);
    let mut systems = Vec::new();
    if want("stepgate") {
        for concurrency in bench.common.concurrencies() {
            systems.push(System::Stepgate {
                category: "keyed",
                concurrency,
            });
        }
        if opts.fast_path {
            systems.push(System::Stepgate {
                category: "read_only",
                concurrency: bench.concurrency(),
            });
        }
    }
    if want("passthrough") {
        for hops in [1, 2] {
            for eos in [true, false] {
                systems.push(System::Passthrough {
                    hops,
                    eos,
                    http: false,
                });
            }
        }
    }
    if want("passthrough-http") {
        // EOS only, as the Kafka Streams HTTP variant: the floor of a system
        // that calls the tool for each new step, beside stepgate's rows.
        systems.push(System::Passthrough {
            hops: 1,
            eos: true,
            http: true,
        });
    }
    let mut notes = Vec::new();
    if want("kstreams") || want("kstreams-http") {
        match kstreams_jar(opts) {
            Ok(jar) => {
                if want("kstreams") {
                    for eos in [true, false] {
                        systems.push(System::KStreams {
                            eos,
                            jar: jar.clone(),
                            http: false,
                        });
                    }
                }
                // EOS only: the variant is there to show what calling the tool
                // from the processor costs the peer.
                if want("kstreams-http") {
                    systems.push(System::KStreams {
                        eos: true,
                        jar,
                        http: true,
                    });
                }
            }
            Err(note) => notes.push(note),
        }
    }
    if opts.broker_warmup > 0 {
        // Same shape, other seeds; no profile; each system's own topics.
        let flood = Arc::new(workload::build("wf", &bench.shape(opts.broker_warmup), 5));
        let paced = Arc::new(workload::build("wp", &bench.shape(100), 13));
        let quiet = CompareOpts {
            perf: None,
            ..opts.clone()
        };
        for system in &systems {
            eprintln!("== broker warm-up, not measured: {system:?}");
            let row = measure(bench, &quiet, system, &flood, &paced, "warm-").await?;
            eprintln!("   {}", row.summary());
            if !row.problems.is_empty() {
                anyhow::bail!(
                    "the warm-up flood of {} {} failed its checks: {}",
                    row.system,
                    row.mode,
                    row.problems.join("; ")
                );
            }
        }
    }
    let mut rows = Vec::new();
    for system in systems {
        eprintln!("== {system:?}");
        let row = measure(bench, opts, &system, &flood, &paced, "").await?;
        eprintln!("   {}", row.summary());
        rows.push(row);
    }
    for n in notes {
        eprintln!("note: {n}");
    }
    Ok(rows)
}

/// A system started and ready, with where to talk to it.
struct Deployed {
    proc: Proc,
    input: String,
    output: String,
    /// The consumer group reading `input` (its commits show what went through).
    group: String,
    topics: Vec<String>,
    stepgate: Option<StepgateSetup>,
    ready_s: f64,
}

/// Start `system` on fresh topics named after `slug`.
async fn deploy(
    bench: &Bench,
    opts: &CompareOpts,
    system: &System,
    slug: &str,
) -> anyhow::Result<Deployed> {
    let c = &bench.common;
    let prefix = format!("{}-{slug}", bench.run_id);
    let dir = bench.work.join(slug);
    std::fs::create_dir_all(&dir)?;
    let log = dir.join("process.log");
    let limit = Duration::from_secs(120);
    match system {
        System::Stepgate {
            category,
            concurrency,
        } => {
            let setup = bench.stepgate_setup(&dir, &prefix, category, *concurrency)?;
            setup.create_topics(&bench.stepgate).await?;
            let mut proc = setup.spawn(&bench.stepgate, &log)?;
            let ready = proc.wait_http_ready(&setup.ready_url(), limit).await?;
            Ok(Deployed {
                proc,
                input: format!("{prefix}.intents"),
                output: format!("{prefix}.results"),
                group: format!("{prefix}-gate"),
                topics: setup.topics(),
                stepgate: Some(setup),
                ready_s: ready.as_secs_f64(),
            })
        }
        System::Passthrough { hops, eos, http } => {
            let topics: Vec<String> = (0..=*hops).map(|h| format!("{prefix}.t{h}")).collect();
            systems::create_topics(&c.brokers, &topics, c.partitions, c.replication_factor).await?;
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(["passthrough", "--brokers", &c.brokers, "--group"])
                .arg(format!("{prefix}-pt"))
                .args(["--mode", mode(*eos), "--commit-interval"])
                .arg(c.commit_interval.to_string())
                .args(["--partitions", &c.partitions.to_string()])
                .args(["--max-batch", &c.batch().to_string()]);
            for w in topics.windows(2) {
                cmd.arg("--hop").arg(format!("{}:{}", w[0], w[1]));
            }
            if *http {
                cmd.args(["--tool-url", &bench.tool.url, "--concurrency"])
                    .arg(bench.concurrency().to_string());
            }
            let mut proc = Proc::spawn("passthrough", cmd, &log, true)?;
            let ready = proc.wait_ready_line(limit).await?;
            Ok(Deployed {
                proc,
                input: topics[0].clone(),
                output: topics[*hops].clone(),
                group: format!("{prefix}-pt-0"),
                topics,
                stepgate: None,
                ready_s: ready.as_secs_f64(),
            })
        }
        System::KStreams { eos, jar, http } => {
            let (input, output) = (format!("{prefix}.in"), format!("{prefix}.out"));
            systems::create_topics(
                &c.brokers,
                &[input.clone(), output.clone()],
                c.partitions,
                c.replication_factor,
            )
            .await?;
            let app = format!("{prefix}-app");
            let mut cmd = Command::new("java");
            cmd.args(opts.java_opts.split_whitespace())
                .arg("-jar")
                .arg(jar)
                .args([
                    "--bootstrap",
                    &c.brokers,
                    "--input",
                    &input,
                    "--output",
                    &output,
                ])
                .args(["--app-id", &app, "--state-dir"])
                .arg(dir.join("ks-state"))
                .args([
                    "--mode",
                    mode(*eos),
                    "--threads",
                    &opts.ks_threads.to_string(),
                ])
                .args(["--commit-ms", &bench.commit_ms().to_string()]);
            if *http {
                cmd.args(["--tool-url", &bench.tool.url]);
            }
            let mut proc = Proc::spawn("kstreams-dedup", cmd, &log, true)?;
            let ready = proc.wait_ready_line(limit).await?;
            Ok(Deployed {
                proc,
                topics: vec![
                    input.clone(),
                    output.clone(),
                    format!("{app}-steps-changelog"),
                ],
                input,
                output,
                group: app,
                stepgate: None,
                ready_s: ready.as_secs_f64(),
            })
        }
    }
}

async fn measure(
    bench: &Bench,
    opts: &CompareOpts,
    system: &System,
    flood: &Arc<Vec<Spec>>,
    paced: &Arc<Vec<Spec>>,
    slug_prefix: &str,
) -> anyhow::Result<Row> {
    let c = &bench.common;
    bench.tool.take();
    let slug = format!("{slug_prefix}{}", system.slug());
    let mut d = deploy(bench, opts, system, &slug).await?;
    let expect = system.expect();
    let kinds = flood.iter().chain(paced.iter()).map(|s| s.kind).collect();
    let agent = Arc::new(Agent::start(
        &c.brokers,
        &d.input,
        &d.output,
        c.partitions,
        expect,
        kinds,
        "1",
    )?);
    let watch = GroupWatch::new(&c.brokers, &d.group, &d.input, c.partitions)?;
    let (nf, np) = (flood.len(), paced.len());

    // Flood: throughput.
    let profile = match (&opts.perf, system) {
        (
            Some(path),
            System::Stepgate {
                category: "keyed",
                concurrency,
            },
        ) if *concurrency == bench.concurrency() => Some(start_perf(path, d.proc.pid)?),
        _ => None,
    };
    let others = |pids: &[String]| {
        let broker = match pids {
            [] => f64::NAN,
            _ => pids.iter().map(|p| systems::cpu_secs(p)).sum(),
        };
        (systems::cpu_secs("self"), broker)
    };
    let (bench0, broker0) = others(&bench.broker);
    let split0 = systems::jvm_cpu_split(&bench.broker);
    let counters0 = systems::broker_counters(&bench.broker).await;
    let cpu0 = d.proc.cpu_secs();
    let (a, f) = (agent.clone(), flood.clone());
    let publish = tokio::task::spawn_blocking(move || a.publish(&f, 0, None));
    let flood_end = wait_answers(&agent, &watch, 0..nf, &mut d.proc, bench.stall()).await;
    publish.await??;
    let cpu_flood = d.proc.cpu_secs() - cpu0;
    let (bench1, broker1) = others(&bench.broker);
    let split1 = systems::jvm_cpu_split(&bench.broker);
    let counters1 = systems::broker_counters(&bench.broker).await;
    if let Some(p) = profile {
        p.stop().await?;
    }
    let gate = match &d.stepgate {
        Some(s) => s.metrics().await.map(|m| GateFigures::from_metrics(&m)),
        None => None,
    };
    let (through, last) = flood_end?;
    let (brokers, topics) = (c.brokers.clone(), d.topics.clone());
    let prefix = format!("{}-{}", bench.run_id, system.slug());
    let short = |t: &str| {
        t.strip_prefix(&prefix)
            .unwrap_or(t)
            .trim_start_matches(['.', '-'])
            .to_owned()
    };
    let records = tokio::task::spawn_blocking(move || systems::topic_records(&brokers, &topics))
        .await?
        .into_iter()
        .map(|(t, n)| (short(&t), n as f64 / nf as f64))
        .collect();
    // The per-topic byte counters, under the topics' short names too.
    let broker_per_intent = systems::per_intent(counters0, counters1, nf)
        .into_iter()
        .map(|(k, v)| match k.split_once(".topic.") {
            Some((what, t)) => (format!("{what}.topic.{}", short(t)), v),
            None => (k, v),
        })
        .collect();
    let t0 = agent.first_sent(0..nf).context("nothing was sent")?;
    let flood_s = last.duration_since(t0).as_secs_f64();

    // Paced: latency.
    let (a, p) = (agent.clone(), paced.clone());
    let rate = opts.rate;
    let publish = tokio::task::spawn_blocking(move || a.publish(&p, nf, Some(rate)));
    let paced_t0 = Instant::now();
    let paced_end = wait_answers(&agent, &watch, nf..nf + np, &mut d.proc, bench.stall()).await;
    publish.await??;
    paced_end?;
    let gate_paced = match (&d.stepgate, &gate) {
        (Some(s), Some(before)) => s.metrics().await.map(|m| {
            GateFigures::from_metrics(&m)
                .since(before)
                .with_wall(paced_t0.elapsed().as_secs_f64())
        }),
        _ => None,
    };
    // Late duplicates (at-least-once redeliveries) still arrive briefly.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss, rss_peak) = d.proc.rss_mib();
    let cpu_total = d.proc.cpu_secs();
    d.proc.stop(Duration::from_secs(60)).await?;

    let verdict = agent.verdict(0..nf + np);
    let tool = bench.tool.take();
    let distinct = flood
        .iter()
        .chain(paced.iter())
        .filter(|s| s.kind == workload::Kind::First)
        .count();
    let mut row = Row {
        system: system.name(),
        mode: system.mode(),
        slug: system.slug(),
        eos: !matches!(
            system,
            System::Passthrough { eos: false, .. } | System::KStreams { eos: false, .. }
        ),
        flood_intents: nf,
        intents_per_s: through.map(|t| nf as f64 / t.duration_since(t0).as_secs_f64()),
        results_per_s: nf as f64 / flood_s,
        flood_latency: agent.latency(0..nf),
        paced_intents: np,
        paced_rate: opts.rate,
        latency: agent.latency(nf..nf + np),
        cpu_flood_s: cpu_flood,
        bench_cpu_flood_s: bench1 - bench0,
        broker_cpu_flood_s: broker1 - broker0,
        broker_jit_cpu_flood_s: split1.0 - split0.0,
        broker_gc_cpu_flood_s: split1.1 - split0.1,
        flood_s,
        cpu_total_s: cpu_total,
        rss_mib: rss,
        rss_peak_mib: rss_peak,
        ready_s: d.ready_s,
        tool_invocations: tool.clone(),
        records_per_intent: records,
        broker_per_intent,
        gate: gate.map(|g| g.with_wall(flood_s)),
        gate_paced,
        problems: Vec::new(),
        verdict,
    };
    row.check(expect, distinct, &tool);
    // Stop reading answers before their topic goes.
    drop(agent);
    if !c.keep {
        systems::delete_topics(&c.brokers, &d.topics).await;
    }
    Ok(row)
}

/// Wait until every intent of `range` is answered. Returns when the group had
/// committed past all of them (None if never seen) and the last answer's arrival.
async fn wait_answers(
    agent: &Agent,
    watch: &GroupWatch,
    range: std::ops::Range<usize>,
    proc: &mut Proc,
    stall: Duration,
) -> anyhow::Result<(Option<Instant>, Instant)> {
    let mut through = None;
    let mut seen = 0;
    let mut moved = Instant::now();
    let mut all_answered: Option<Instant> = None;
    loop {
        let (answered, last) = agent.progress(range.clone());
        if through.is_none()
            && tokio::task::block_in_place(|| watch.committed())
                .is_some_and(|n| n >= range.end as i64)
        {
            through = Some(Instant::now());
        }
        if answered == range.len() {
            let done = *all_answered.get_or_insert_with(Instant::now);
            // The group's commit can trail its last answer by a poll or two.
            if through.is_some() || done.elapsed() > Duration::from_secs(10) {
                return Ok((through, last.context("answers without arrival times")?));
            }
        }
        if answered != seen {
            seen = answered;
            moved = Instant::now();
        }
        if moved.elapsed() > stall {
            bail!(
                "{}: {answered} of {} intents answered, nothing new for {stall:?}; log {}:\n{}",
                proc.name,
                range.len(),
                proc.log.display(),
                systems::tail(&proc.log, 20)
            );
        }
        proc.check_alive()?;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

struct Perf(std::process::Child);

fn start_perf(path: &Path, pid: u32) -> anyhow::Result<Perf> {
    // PERF_CALL_GRAPH=1: with call stacks (DWARF unwinding: large files, more overhead).
    let mut cmd = Command::new("perf");
    cmd.args(["record", "-F", "499"]);
    if std::env::var("PERF_CALL_GRAPH").is_ok_and(|v| v == "1") {
        cmd.args(["--call-graph", "dwarf,32768"]);
    }
    let child = cmd
        .arg("-o")
        .arg(path)
        .args(["-p", &pid.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .context("starting perf record (is perf installed?)")?;
    Ok(Perf(child))
}

impl Perf {
    async fn stop(mut self) -> anyhow::Result<()> {
        systems::signal(self.0.id(), "INT");
        for _ in 0..200 {
            if self.0.try_wait()?.is_some() {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = self.0.kill();
        Ok(())
    }
}
