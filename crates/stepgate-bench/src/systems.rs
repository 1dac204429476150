//! The systems under test as child processes (so their CPU time and peak RSS come
//! from /proc), their topics, and what can be read from outside them.

use anyhow::{Context as _, bail};
use rdkafka::ClientConfig;
use rdkafka::TopicPartitionList;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A system under test, running.
pub struct Proc {
    pub name: String,
    child: Child,
    pub pid: u32,
    ready: Option<mpsc::Receiver<()>>,
    pub log: PathBuf,
    pub spawned: Instant,
}

impl Proc {
    /// Start `cmd`, its stderr to `log`. With `ready_line`, its stdout is watched
    /// for a line `READY`.
    pub fn spawn(
        name: &str,
        mut cmd: Command,
        log: &Path,
        ready_line: bool,
    ) -> anyhow::Result<Proc> {
        let err = std::fs::File::create(log)?;
        cmd.stderr(err).stdin(Stdio::null()).stdout(if ready_line {
            Stdio::piped()
        } else {
            Stdio::null()
        });
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {name}: {cmd:?}"))?;
        let ready = match child.stdout.take() {
            Some(out) => {
                let (tx, rx) = mpsc::channel();
                std::thread::spawn(move || {
                    for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                        if line.trim() == "READY" {
                            let _ = tx.send(());
                        }
                    }
                });
                Some(rx)
            }
            None => None,
        };
        Ok(Proc {
            name: name.to_owned(),
            pid: child.id(),
            child,
            ready,
            log: log.to_owned(),
            spawned: Instant::now(),
        })
    }

    /// An error with the log's tail if the process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited early ({status}); its log {}:\n{}",
                self.name,
                self.log.display(),
                tail(&self.log, 30)
            );
        }
        Ok(())
    }

    /// Wait for the `READY` line.
    pub async fn wait_ready_line(&mut self, limit: Duration) -> anyhow::Result<Duration> {
        self.wait_until(limit, async |p: &mut Self| {
            p.ready.as_ref().is_some_and(|rx| rx.try_recv().is_ok())
        })
        .await
    }

    /// Wait until `GET url` answers 2xx.
    pub async fn wait_http_ready(
        &mut self,
        url: &str,
        limit: Duration,
    ) -> anyhow::Result<Duration> {
        let http = reqwest::Client::new();
        self.wait_until(limit, async |_: &mut Self| {
            let r = http.get(url).timeout(Duration::from_secs(2)).send().await;
            r.is_ok_and(|r| r.status().is_success())
        })
        .await
    }

    /// Poll `ready` every 20 ms until it holds (→ time since spawn), the process
    /// dies, or `limit` passes.
    async fn wait_until(
        &mut self,
        limit: Duration,
        mut ready: impl AsyncFnMut(&mut Self) -> bool,
    ) -> anyhow::Result<Duration> {
        let start = Instant::now();
        loop {
            if ready(self).await {
                return Ok(self.spawned.elapsed());
            }
            self.check_alive()?;
            if start.elapsed() > limit {
                bail!(
                    "{} not ready after {limit:?}; log {}",
                    self.name,
                    self.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// User + system CPU seconds of the process (all its threads) so far.
    pub fn cpu_secs(&self) -> f64 {
        cpu_secs(&self.pid.to_string())
    }

    /// (current RSS, peak RSS) in MiB, from /proc/<pid>/status.
    pub fn rss_mib(&self) -> (f64, f64) {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap_or_default();
        let kb = |field: &str| {
            status
                .lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
                .map_or(f64::NAN, |kb| kb / 1024.0)
        };
        (kb("VmRSS:"), kb("VmHWM:"))
    }

    /// SIGKILL (no clean-up: a crash), and wait until it is gone.
    pub async fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, then wait; SIGKILL after `limit`.
    pub async fn stop(mut self, limit: Duration) -> anyhow::Result<()> {
        signal(self.pid, "TERM");
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                // 143: a JVM ends on SIGTERM with 128 + 15.
                if !status.success() && status.code() != Some(143) {
                    eprintln!("note: {} exited with {status} after SIGTERM", self.name);
                }
                return Ok(());
            }
            if start.elapsed() > limit {
                eprintln!(
                    "note: {} still running {limit:?} after SIGTERM: killed",
                    self.name
                );
                let _ = self.child.kill();
                let _ = self.child.wait();
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// User + system CPU seconds of `/proc/<pid>` (all its threads); NaN if gone.
pub fn cpu_secs(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    // Fields after the command name, which is in parentheses and may hold spaces.
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        f.get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    // utime and stime are fields 14 and 15 of stat(5); `after` starts at field 3.
    (ticks(11) + ticks(12)) / clock_ticks()
}

/// CPU seconds of the JVMs `pids` spent in their JIT compiler threads and in
/// their garbage collector's threads, summed: (JIT, GC). A broker's JIT
/// compiles its code as it meets new work, most in the floods after it
/// starts, so it is a cost of the broker's age rather than of the system
/// under test (issue #34 found it 25–55% of the broker's CPU in stepgate's
/// floods on a fresh broker, which come first).
pub fn jvm_cpu_split(pids: &[String]) -> (f64, f64) {
    let (mut jit, mut gc) = (0.0, 0.0);
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let Ok(comm) = std::fs::read_to_string(t.path().join("comm")) else {
                continue;
            };
            // Thread names are cut to 15 bytes: "C2 CompilerThre", "GC Thread#0",
            // "G1 Conc#0", "G1 Refine#0", "G1 Main Marker", "G1 Service".
            let slot = if comm.starts_with("C1 Compiler") || comm.starts_with("C2 Compiler") {
                &mut jit
            } else if comm.starts_with("GC Thread") || comm.starts_with("G1 ") {
                &mut gc
            } else {
                continue;
            };
            let tid = t.file_name().to_string_lossy().into_owned();
            let secs = cpu_secs(&format!("{pid}/task/{tid}"));
            if secs.is_finite() {
                *slot += secs;
            }
        }
    }
    (jit, gc)
}

/// The local broker deploy/local/kafka.sh runs for the port of `brokers`, if any
/// (its CPU time is reported next to the systems').
/// The local broker's processes: the node `deploy/local/kafka.sh` runs for
/// `brokers`, or every node of the `deploy/local/cluster.sh` cluster whose
/// first port it names (their CPU is summed).
pub fn broker_pids(brokers: &str) -> Vec<String> {
    let Some(port) = brokers.split(',').next().and_then(|b| b.rsplit(':').next()) else {
        return Vec::new();
    };
    let needles = [
        format!("kafka-run-{port}/"),
        format!("kafka-cluster-{port}/"),
    ];
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let pid = e.file_name().into_string().ok()?;
            pid.parse::<u32>().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd);
            (cmd.contains("kafka.Kafka") && needles.iter().any(|n| cmd.contains(n.as_str())))
                .then_some(pid)
        })
        .collect()
}

/// The brokers' request and byte counters (`benches/jmx/BrokerMetrics.java`,
/// compiled into `$BENCH_JMX_CLASSES` by bench.sh), summed over `pids`; None
/// when they cannot be read.
pub async fn broker_counters(pids: &[String]) -> Option<BTreeMap<String, f64>> {
    let classes = std::env::var_os("BENCH_JMX_CLASSES")?;
    if pids.is_empty() {
        return None;
    }
    let out = tokio::process::Command::new("java")
        .arg("-cp")
        .arg(classes)
        .arg("BrokerMetrics")
        .args(pids)
        .output()
        .await
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "note: reading the broker's JMX counters: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(' ')?;
                Some((k.to_owned(), v.trim().parse().ok()?))
            })
            .collect(),
    )
}

/// What changed between two readings of the counters, per intent (counters
/// that did not move are left out).
pub fn per_intent(
    before: Option<BTreeMap<String, f64>>,
    after: Option<BTreeMap<String, f64>>,
    intents: usize,
) -> BTreeMap<String, f64> {
    let (Some(before), Some(after)) = (before, after) else {
        return BTreeMap::new();
    };
    after
        .iter()
        .filter_map(|(k, v)| {
            let d = v - before.get(k).copied().unwrap_or(0.0);
            (d > 0.0 && intents > 0).then(|| (k.clone(), d / intents as f64))
        })
        .collect()
}

pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status();
}

fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

pub async fn create_topics(
    brokers: &str,
    names: &[String],
    partitions: i32,
    replication: i32,
) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let topics: Vec<NewTopic> = names
        .iter()
        .map(|n| NewTopic::new(n, partitions, TopicReplication::Fixed(replication)))
        .collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for r in admin.create_topics(topics.iter(), &opts).await? {
        if let Err((name, code)) = r {
            bail!("creating topic {name}: {code}");
        }
    }
    Ok(())
}

/// Delete what a run created (errors only noted: a leftover topic is harmless).
pub async fn delete_topics(brokers: &str, names: &[String]) {
    let Ok(admin) = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create::<AdminClient<DefaultClientContext>>()
    else {
        return;
    };
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    if let Err(e) = admin.delete_topics(&refs, &opts).await {
        eprintln!("note: deleting topics {refs:?}: {e}");
    }
}

/// The topics and partitions the broker holds, its internal `__` topics
/// aside; None if its metadata cannot be read. A broker that already holds
/// thousands of partitions (the broker test suite leaves its topics) does
/// more work for every request, so the report says what it began with.
pub fn broker_load(brokers: &str) -> Option<(usize, usize)> {
    let c = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create::<BaseConsumer>()
        .ok()?;
    let md = c.fetch_metadata(None, Duration::from_secs(10)).ok()?;
    let topics: Vec<_> = md
        .topics()
        .iter()
        .filter(|t| !t.name().starts_with("__"))
        .collect();
    Some((
        topics.len(),
        topics.iter().map(|t| t.partitions().len()).sum(),
    ))
}

/// The `-XX:` options on the command lines of the JVMs `pids`, deduplicated.
pub fn jvm_flags(pids: &[String]) -> Vec<String> {
    let mut flags: Vec<String> = pids
        .iter()
        .filter_map(|p| std::fs::read(format!("/proc/{p}/cmdline")).ok())
        .flat_map(|cmd| {
            cmd.split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .filter(|a| a.starts_with("-XX:"))
                .collect::<Vec<_>>()
        })
        .collect();
    flags.sort();
    flags.dedup();
    flags
}

/// Records in each of `topics` (the sum of its partitions' end offsets; topics
/// are fresh), transaction markers included.
pub fn topic_records(brokers: &str, topics: &[String]) -> BTreeMap<String, i64> {
    let Ok(c) = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create::<BaseConsumer>()
    else {
        return BTreeMap::new();
    };
    let Ok(md) = c.fetch_metadata(None, Duration::from_secs(10)) else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for t in md
        .topics()
        .iter()
        .filter(|t| topics.iter().any(|n| n == t.name()))
    {
        let n = t
            .partitions()
            .iter()
            .filter_map(|p| {
                c.fetch_watermarks(t.name(), p.id(), Duration::from_secs(10))
                    .ok()
            })
            .map(|(_, high)| high)
            .sum();
        out.insert(t.name().to_owned(), n);
    }
    drop(md);
    out
}

/// How far a consumer group has committed on a topic: the sum over partitions of
/// its committed offsets, i.e. records consumed and committed (topics are fresh).
pub struct GroupWatch {
    consumer: BaseConsumer,
    topic: String,
    partitions: i32,
}

impl GroupWatch {
    pub fn new(brokers: &str, group: &str, topic: &str, partitions: i32) -> anyhow::Result<Self> {
        // Not a member: offset fetches only. read_uncommitted, so fetches are not
        // held back by the group's open transactions.
        let consumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "false")
            .create()?;
        Ok(GroupWatch {
            consumer,
            topic: topic.to_owned(),
            partitions,
        })
    }

    pub fn committed(&self) -> Option<i64> {
        let mut tpl = TopicPartitionList::new();
        for p in 0..self.partitions {
            tpl.add_partition(&self.topic, p);
        }
        let got = self
            .consumer
            .committed_offsets(tpl, Duration::from_secs(5))
            .ok()?;
        let sum = got
            .elements()
            .iter()
            .map(|e| e.offset().to_raw().filter(|o| *o > 0).unwrap_or(0))
            .sum();
        drop(got);
        Some(sum)
    }
}

/// The config of a stepgate deployment of the bench.
pub struct StepgateSetup {
    pub config: PathBuf,
    pub http: String,
    pub state: PathBuf,
    /// Whether this build has a separate executor (`kafka.executor_group`; before
    /// issue #12): its own transactions then add to the gate's.
    pub remote_executor: bool,
    /// The `gate.commit_interval` written, when this build still has that key.
    pub commit_interval: Option<String>,
}

/// Which config keys the stepgate library this bench was built with knows, read
/// from its own `Config` (bench.sh builds both binaries from one tree). The bench
/// writes only keys that exist, so one harness drives stepgate before and after
/// keys are removed (`gate.commit_interval`, `kafka.executor_group`,
/// `topics.calls`: issue #12), and every topic the build has gets the run's prefix.
pub struct ConfigKeys(serde_json::Value);

impl ConfigKeys {
    pub fn of_this_build() -> ConfigKeys {
        ConfigKeys(
            serde_json::to_value(stepgate::config::Config::default())
                .unwrap_or(serde_json::Value::Null),
        )
    }

    pub fn has(&self, path: &[&str]) -> bool {
        path.iter().try_fold(&self.0, |v, k| v.get(*k)).is_some()
    }

    /// The build's default for a numeric key (`["executor", "concurrency"]`).
    pub fn default_number(&self, path: &[&str]) -> Option<u64> {
        path.iter()
            .try_fold(&self.0, |v, k| v.get(*k))
            .and_then(|v| v.as_u64())
    }

    /// The names of `kafka.topics`' keys (intents, results, …).
    pub fn topics(&self) -> Vec<String> {
        self.0
            .pointer("/kafka/topics")
            .and_then(|t| t.as_object())
            .map(|o| o.keys().cloned().collect())
            .unwrap_or_default()
    }
}

/// stepgate's shipped `executor.concurrency`.
pub fn default_concurrency() -> usize {
    ConfigKeys::of_this_build()
        .default_number(&["executor", "concurrency"])
        .map_or(64, |n| n as usize)
}

/// stepgate's shipped `gate.max_batch`.
pub fn default_max_batch() -> usize {
    ConfigKeys::of_this_build()
        .default_number(&["gate", "max_batch"])
        .map_or(2000, |n| n as usize)
}

impl StepgateSetup {
    /// A config at stepgate's shipped defaults: it names the topics, group,
    /// tool, state directory and HTTP port, logs at `warn`, and sets
    /// `executor.concurrency` and `gate.max_batch` only where the run asks for
    /// other values than the defaults.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        dir: &Path,
        brokers: &str,
        prefix: &str,
        partitions: i32,
        commit_interval: &str,
        tool_url: &str,
        category: &str,
        concurrency: usize,
        max_batch: Option<usize>,
    ) -> anyhow::Result<StepgateSetup> {
        use std::fmt::Write as _;
        std::fs::create_dir_all(dir)?;
        let keys = ConfigKeys::of_this_build();
        let http = format!("127.0.0.1:{}", free_port()?);
        let state = dir.join("state");
        let remote_executor = keys.has(&["kafka", "executor_group"]);
        let commit_interval = keys
            .has(&["gate", "commit_interval"])
            .then(|| commit_interval.to_owned());
        let mut t = String::new();
        let _ = writeln!(t, "[kafka]");
        let _ = writeln!(t, r#"brokers = "{brokers}""#);
        let _ = writeln!(t, r#"instance_id = "{prefix}-0""#);
        let _ = writeln!(t, r#"gate_group = "{prefix}-gate""#);
        if remote_executor {
            let _ = writeln!(t, r#"executor_group = "{prefix}-exec""#);
        }
        if keys.default_number(&["kafka", "partitions"]) != Some(partitions as u64) {
            let _ = writeln!(t, "partitions = {partitions}");
        }
        let _ = writeln!(t, "[kafka.topics]");
        for topic in keys.topics() {
            let _ = writeln!(t, r#"{topic} = "{prefix}.{topic}""#);
        }
        let _ = writeln!(t, "[state]");
        let _ = writeln!(t, r#"path = "{}""#, state.display());
        let _ = writeln!(t, "[gate]");
        if let Some(ci) = &commit_interval {
            let _ = writeln!(t, r#"commit_interval = "{ci}""#);
        }
        if let Some(n) = max_batch.filter(|n| *n != default_max_batch()) {
            let _ = writeln!(t, "max_batch = {n}");
        }
        let _ = writeln!(t, "[executor]");
        if concurrency != default_concurrency() {
            let _ = writeln!(t, "concurrency = {concurrency}");
        }
        let _ = writeln!(t, "[http]");
        let _ = writeln!(t, r#"listen = "{http}""#);
        let _ = writeln!(t, "[log]");
        let _ = writeln!(t, r#"level = "warn""#);
        let _ = writeln!(t, "[tools.noop]");
        let _ = writeln!(t, r#"category = "{category}""#);
        let _ = writeln!(t, r#"url = "{tool_url}""#);
        let config = dir.join("stepgate.toml");
        std::fs::write(&config, t)?;
        Ok(StepgateSetup {
            config,
            http,
            state,
            remote_executor,
            commit_interval,
        })
    }

    /// Add `lines` (`key = value`) to the config's `[table]`, which `write`
    /// wrote.
    /// Topics created with `factor` replicas (the key is written only when it
    /// is not 1, so builds that predate it still read the config).
    pub fn replicate(&self, factor: i32) -> anyhow::Result<()> {
        if factor == 1 {
            return Ok(());
        }
        self.add_keys("kafka", &[format!("replication_factor = {factor}")])
    }

    pub fn add_keys(&self, table: &str, lines: &[String]) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(&self.config)?;
        let header = format!("[{table}]\n");
        let at = text
            .find(&header)
            .with_context(|| format!("no [{table}] in {}", self.config.display()))?
            + header.len();
        let mut added = String::new();
        for l in lines {
            added.push_str(l);
            added.push('\n');
        }
        std::fs::write(
            &self.config,
            format!("{}{added}{}", &text[..at], &text[at..]),
        )?;
        Ok(())
    }

    /// Every topic of the deployment, as stepgate itself names them.
    pub fn topics(&self) -> Vec<String> {
        match stepgate::config::Config::load(Some(&self.config), Vec::new()) {
            Ok(c) => c.kafka.topics.all().iter().map(|t| t.to_string()).collect(),
            Err(e) => {
                eprintln!("note: reading {}: {e}", self.config.display());
                Vec::new()
            }
        }
    }

    pub async fn create_topics(&self, bin: &Path) -> anyhow::Result<()> {
        let out = tokio::process::Command::new(bin)
            .args(["topics", "create", "--config"])
            .arg(&self.config)
            .output()
            .await
            .with_context(|| format!("running {} topics create", bin.display()))?;
        if !out.status.success() {
            bail!(
                "stepgate topics create failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(())
    }

    pub fn spawn(&self, bin: &Path, log: &Path) -> anyhow::Result<Proc> {
        let mut cmd = Command::new(bin);
        cmd.args(["run", "--config"]).arg(&self.config);
        Proc::spawn("stepgate", cmd, log, false)
    }

    pub fn ready_url(&self) -> String {
        format!("http://{}/readyz", self.http)
    }

    pub async fn metrics(&self) -> Option<Metrics> {
        let text = reqwest::get(format!("http://{}/metrics", self.http))
            .await
            .ok()?
            .text()
            .await
            .ok()?;
        Some(Metrics(text))
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// A scrape of stepgate's /metrics.
pub struct Metrics(pub String);

impl Metrics {
    /// The sum of every sample of `name` (all label sets).
    pub fn sum(&self, name: &str) -> f64 {
        self.0
            .lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// One series' value, named as exposed: `name{label="value"}`.
    pub fn value(&self, series: &str) -> Option<f64> {
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }
}
