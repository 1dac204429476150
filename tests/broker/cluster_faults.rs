//! The faults of a replicated cluster, under load (issue #32): a three-node
//! KRaft cluster of the test's own (`deploy/local/cluster.sh`, combined
//! broker+controller nodes, replication factor 3, `min.insync.replicas` 2,
//! ports 28092/28102/28112, a temporary data directory, stopped at the end),
//! one stepgate on it, and the load of `tests/broker/faults.rs` (`common::load`: an
//! agent publishing `keyed` and `unkeyed` steps every 25 ms, rephrased repeats
//! in flight, effects counted at a tool that records raw invocations and
//! deduplicates by `Idempotency-Key`). One test per fault:
//! - the node leading the most `intents`, `results` and changelog partitions
//!   SIGKILLed, restarted after the outage;
//! - the transaction coordinator of the gate's transactional id SIGKILLed;
//! - the active controller SIGKILLed;
//! - one node SIGSTOPped past the broker session timeout (9 s), then resumed;
//! - two nodes SIGKILLed at once (the quorum and the in-sync replicas gone:
//!   writes refused), then restarted.
//!
//! Each prints one `FAULTS |` line: in flight at the fault, answered,
//! duplicate effects (unkeyed/keyed), lost, whether `gate::lost`'s read-back
//! ran and what it did (from the gate's log), and the recovery times; and
//! asserts every `call_id` answered exactly once, 0 duplicate effects and 0
//! lost (`Summary::print_and_assert`, as in `tests/broker/faults.rs`).
//!
//! Each takes ~80 s on 2 cores (three JVMs start in ~20 s, the load warms up,
//! the outage, the restart, the catch-up and the settling). The partition
//! leader's kill runs in every `cargo test` (CI included: ~80 s on a ~17 min
//! suite; every role a partition leader plays is lost in it); the other four
//! (~5.5 min more) run only with `STEPGATE_CLUSTER_FAULTS=1` and are skipped
//! with a printed reason otherwise: `STEPGATE_CLUSTER_FAULTS=1 cargo test
//! --features test-hooks --test broker cluster_faults:: -- --nocapture`. Outages last
//! 10 s; `STEPGATE_LONG_FAULTS=1` makes them 30 s. Which node to aim at, and
//! the cluster itself, come from `cluster.sh` (`coordinator`, `controller`,
//! `kill`, `pause`, `resume`, `restart`).

use crate::common;

use common::load::*;
use common::*;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use std::collections::BTreeMap;
use std::process::Command;
use std::time::{Duration, Instant};

/// Node 1's plaintext port; node N's is this + 10 (N - 1), +1 its controller,
/// +2 its SASL_SSL listener. Below Linux's ephemeral range (32768–60999: a
/// first run on 49092 lost 49094 to a client's outgoing connection), clear of
/// `kafka.sh`'s 9092–9094 and `tests/broker/faults.rs`'s broker on 29092/29093.
const BASE_PORT: u16 = 28092;
const NODES: [u8; 3] = [1, 2, 3];

/// Whether a slow scenario runs (`STEPGATE_CLUSTER_FAULTS=1`); says why not.
fn enabled(test: &str) -> bool {
    if std::env::var("STEPGATE_CLUSTER_FAULTS").as_deref() == Ok("1") {
        return true;
    }
    println!(
        "SKIPPED {test}: set STEPGATE_CLUSTER_FAULTS=1 to run it (it starts a three-node Kafka cluster with deploy/local/cluster.sh and takes ~80 s)"
    );
    false
}

fn outage() -> Duration {
    let long = std::env::var("STEPGATE_LONG_FAULTS").as_deref() == Ok("1");
    Duration::from_secs(if long { 30 } else { 10 })
}

// ---------------------------------------------------------------- the cluster

/// The test's cluster: started on creation, stopped (and its data removed)
/// on drop; with `STEPGATE_TEST_KEEP_LOGS=<dir>` a failed run's nodes' logs
/// and data are kept there.
struct Cluster {
    dir: tempfile::TempDir,
}

impl Cluster {
    fn start() -> Cluster {
        let c = Cluster {
            dir: tempfile::tempdir().unwrap(),
        };
        c.run(&["start"]);
        c
    }

    fn brokers(&self) -> String {
        NODES
            .iter()
            .map(|n| format!("127.0.0.1:{}", BASE_PORT + 10 * (*n as u16 - 1)))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn script(&self, args: &[&str]) -> std::process::Output {
        Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/deploy/local/cluster.sh"
            ))
            .args(args)
            .env("CLUSTER_BASE_PORT", BASE_PORT.to_string())
            .env("CLUSTER_DATA_DIR", self.dir.path())
            .output()
            .expect("cluster.sh runs")
    }

    fn run(&self, args: &[&str]) {
        let out = self.script(args);
        assert!(
            out.status.success(),
            "cluster.sh {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn kill(&self, n: u8) {
        self.run(&["kill", &n.to_string()]);
    }

    /// Start the nodes again, one after the other, each waited for until it is
    /// registered (`cluster.sh restart`), on a blocking thread.
    fn restart(&self, nodes: &[u8]) -> tokio::task::JoinHandle<()> {
        let (dir, nodes) = (self.dir.path().to_owned(), nodes.to_vec());
        tokio::task::spawn_blocking(move || {
            for n in nodes {
                let out = Command::new("bash")
                    .arg(concat!(
                        env!("CARGO_MANIFEST_DIR"),
                        "/deploy/local/cluster.sh"
                    ))
                    .args(["restart", &n.to_string()])
                    .env("CLUSTER_BASE_PORT", BASE_PORT.to_string())
                    .env("CLUSTER_DATA_DIR", &dir)
                    .output()
                    .expect("cluster.sh runs");
                assert!(
                    out.status.success(),
                    "cluster.sh restart {n}: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        })
    }

    /// A node id `cluster.sh` answers (`controller`, `coordinator ID`), or
    /// None when it knows none.
    fn ask(&self, args: &[&str]) -> Option<u8> {
        let out = self.script(args);
        if !out.status.success() {
            return None;
        }
        String::from_utf8_lossy(&out.stdout).trim().parse().ok()
    }

    /// The active controller (the leader in the running nodes' quorum state).
    fn controller(&self) -> Option<u8> {
        self.ask(&["controller"])
    }

    /// The transaction coordinator of a transactional id (the leader of its
    /// `__transaction_state` partition).
    fn coordinator(&self, transactional_id: &str) -> u8 {
        self.ask(&["coordinator", transactional_id])
            .unwrap_or_else(|| panic!("the coordinator of {transactional_id}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        keep_dir_on_failure(self.dir.path(), "cluster");
        let _ = self.script(&["stop"]);
    }
}

/// The leader of each partition of `topic`, by the cluster's metadata.
fn leaders(brokers: &str, topic: &str) -> BTreeMap<i32, u8> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("metadata of {topic}: {e}"));
    md.topics()[0]
        .partitions()
        .iter()
        .filter(|p| p.leader() > 0)
        .map(|p| (p.id(), p.leader() as u8))
        .collect()
}

// ---------------------------------------------------------------- one scenario

/// The stack on the cluster under load, up to the fault.
struct Run {
    cluster: Cluster,
    s: Stack,
    load: Load,
    results: TopicReader,
    in_flight_at_fault: usize,
    fault_at: Instant,
    sent_at_fault: usize,
    /// When every call sent before the fault was answered.
    cleared_at: Option<Instant>,
    /// Calls sent after the fault answered before the restart.
    answered_while_down: usize,
}

async fn under_load(tag: &str) -> Run {
    let cluster = Cluster::start();
    let brokers = cluster.brokers();
    let mut s = Stack::new(StackOptions {
        brokers: Some(brokers.clone()),
        tools: vec![(UNKEYED, "unkeyed", "3s"), (KEYED, "keyed", "3s")],
        session_timeout: "6s",
        grace: "10s",
        configure: |c| c.kafka.replication_factor = 3,
        ..StackOptions::default()
    })
    .await;
    tool_delay(&s);
    s.start().await;
    let results = s.agent().results;
    let load = Load::start(&brokers, &s.topic("intents"), tag);
    warm_up(&load, &results).await;
    let in_flight_at_fault = in_flight(&load, &results);
    Run {
        cluster,
        s,
        in_flight_at_fault,
        fault_at: Instant::now(),
        sent_at_fault: load.sent().len(),
        load,
        results,
        cleared_at: None,
        answered_while_down: 0,
    }
}

impl Run {
    fn mark_fault(&mut self) {
        self.in_flight_at_fault = in_flight(&self.load, &self.results);
        self.fault_at = Instant::now();
        self.sent_at_fault = self.load.sent().len();
    }

    fn watch(&mut self) {
        if self.cleared_at.is_none() {
            let a = answers(&self.results);
            let sent = self.load.sent();
            if sent[..self.sent_at_fault]
                .iter()
                .all(|c| self.load.settled(&c.id, &a))
            {
                self.cleared_at = Some(Instant::now());
            }
        }
    }

    /// The outage itself (not a wait for a condition), watching meanwhile
    /// when the calls in flight at the fault are all answered.
    async fn hold(&mut self, d: Duration) {
        let until = Instant::now() + d;
        while Instant::now() < until {
            self.watch();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Restart `nodes` (watching meanwhile); returns when they are registered.
    /// Count the calls sent since the fault and answered already (before the
    /// cluster is made whole again).
    fn count_answered_while_down(&mut self) {
        let a = answers(&self.results);
        self.answered_while_down = self
            .load
            .sent()
            .iter()
            .filter(|c| c.sent >= self.fault_at && a.contains_key(&c.id))
            .count();
    }

    async fn restart(&mut self, nodes: &[u8]) -> Instant {
        self.count_answered_while_down();
        let mut h = self.cluster.restart(nodes);
        loop {
            self.watch();
            tokio::select! {
                r = &mut h => {
                    r.expect("the restart");
                    return Instant::now();
                }
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    /// What the calls among the first `n` sent that the test saw no answer to
    /// left behind: whether a fresh reader of `results` finds their answers
    /// (then the test's own reader stalled, not stepgate), whether their
    /// intents are on `intents`, and the agent's failed deliveries.
    async fn why_unanswered(&self, n: usize) -> String {
        let seen = answers(&self.results);
        let calls: Vec<Call> = self.load.sent().into_iter().take(n).collect();
        let missing: Vec<&Call> = calls
            .iter()
            .filter(|c| !self.load.settled(&c.id, &seen))
            .collect();
        let fresh = TopicReader::new(&self.s.config.kafka.brokers, &self.s.topic("results"));
        let total = seen.values().map(Vec::len).sum::<usize>();
        wait_until(Duration::from_secs(30), || fresh.all().len() >= total).await;
        let again = answers(&fresh);
        let found = missing.iter().filter(|c| again.contains_key(&c.id)).count();
        let failed = self.load.delivery_errors.lock().unwrap().clone();
        format!(
            "{} of {n} calls without an answer seen by the test; a fresh reader of `results` finds {found} of them; the agent's failed deliveries: {failed:?}; {}",
            missing.len(),
            on_the_intents_topic(&self.s, &calls, &again).await
        )
    }

    /// After the cluster is whole again: wait until everything sent so far is
    /// answered and 60 more calls are, settle, and print the summary.
    async fn finish(mut self, scenario: &str, what: String, back_at: Instant) {
        let sent_until_back = self.load.sent().len();
        let caught_up = answered_after(
            &self.load,
            &self.results,
            self.load.started,
            sent_until_back,
            |_| true,
        )
        .await;
        let recovery = back_at.elapsed();
        // The count above can be reached while a call from before the fault
        // is still unanswered: watch until those are answered too.
        let limit = Instant::now() + WAIT;
        while self.cleared_at.is_none() && Instant::now() < limit {
            self.watch();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if !caught_up {
            let why = self.why_unanswered(sent_until_back).await;
            // The whole log and the gate's metrics, kept for whoever looks.
            let keep = std::env::temp_dir().join(format!("stepgate-faults-{}", self.s.prefix));
            let _ = std::fs::create_dir_all(&keep);
            let _ = std::fs::write(keep.join("gate.log"), self.s.log());
            let _ = std::fs::write(keep.join("metrics.txt"), self.s.metrics().await);
            panic!(
                "{scenario}: stepgate answers everything sent until the cluster was whole again\n{why}\n(the gate's log and metrics kept in {})\nlog (tail):\n{}",
                keep.display(),
                self.s.log_tail(120)
            );
        }
        assert!(
            answered_after(&self.load, &self.results, Instant::now(), 60, |_| true).await,
            "{scenario}: new calls answered after the recovery"
        );
        let mut sum = settle(
            scenario,
            &self.s,
            &mut self.load,
            &self.results,
            self.in_flight_at_fault,
            self.fault_at,
        )
        .await;
        sum.running = self.s.child.as_mut().unwrap().try_wait().unwrap().is_none();
        let log = self.s.log();
        // STEPGATE_TEST_KEEP_LOGS=<dir>: the gate's log kept, passed or not.
        if let Ok(keep) = std::env::var("STEPGATE_TEST_KEEP_LOGS") {
            let to = std::path::Path::new(&keep).join(format!("{}.log", self.s.prefix));
            let _ = std::fs::create_dir_all(&keep);
            let _ = std::fs::write(&to, &log);
            println!("{scenario}: the gate's log is kept in {}", to.display());
        }
        let count = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
        let mend = format!(
            "gate::lost read-back: {} whole, {} rewrote lost records, {} could not check, {} overtaken",
            count("this gate's last commits read back whole"),
            count("lost its commit marker: writing its records again"),
            count("not checked for what a broker may have lost"),
            count("other records were written after them: not written again"),
        );
        sum.extra = format!(
            "{}; {what}; {} intents published from the fault until the restart or resume, {} of those sent before it answered before it; calls in flight at the fault all answered {}; everything sent until the node(s) were back answered {:.1} s after; gate sessions failed {}; {mend}",
            sum.extra,
            sent_until_back - self.sent_at_fault,
            self.answered_while_down,
            match self.cleared_at {
                Some(t) => format!("{:.1} s after the fault", (t - self.fault_at).as_secs_f64()),
                None => "never".into(),
            },
            recovery.as_secs_f64(),
            count("gate session failed"),
        );
        sum.print_and_assert();
    }
}

/// The node leading the most partitions of the gate's topics, and what it leads.
fn busiest_leader(s: &Stack, brokers: &str) -> (u8, String) {
    let k = &s.config.kafka.topics;
    let topics = [
        ("intents", &k.intents),
        ("results", &k.results),
        ("changelog", &k.changelog),
    ];
    let mut led: BTreeMap<u8, Vec<String>> = BTreeMap::new();
    for (name, topic) in topics {
        for (p, n) in leaders(brokers, topic) {
            led.entry(n).or_default().push(format!("{name}-{p}"));
        }
    }
    let (n, parts) = led
        .into_iter()
        .max_by_key(|(_, v)| v.len())
        .expect("partitions have leaders");
    (n, parts.join(" "))
}

// ---------------------------------------------------------------- the faults

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_leader_killed_under_load() {
    // Runs in every `cargo test`, CI included (see the module doc).
    let _serial = common::FAULTS.lock().await;
    let mut r = under_load("ld").await;
    let brokers = r.cluster.brokers();
    let (victim, led) = busiest_leader(&r.s, &brokers);
    let d = outage();
    r.mark_fault();
    r.cluster.kill(victim);
    r.hold(d).await;
    let moved = busiest_leader(&r.s, &brokers);
    let back_at = r.restart(&[victim]).await;
    let what = format!(
        "node {victim} (leading {led}) SIGKILLed, restarted after {} s (registered again {:.1} s after the kill; meanwhile node {} led the most: {})",
        d.as_secs(),
        (back_at - r.fault_at).as_secs_f64(),
        moved.0,
        moved.1
    );
    r.finish(
        "cluster: the leader of intents/results/changelog partitions SIGKILLed",
        what,
        back_at,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transaction_coordinator_killed_under_load() {
    if !enabled("the_transaction_coordinator_killed_under_load") {
        return;
    }
    let _serial = common::FAULTS.lock().await;
    let mut r = under_load("tc").await;
    let k = &r.s.config.kafka;
    // The gate's two transactional ids (`gate::Producers`), used in turn.
    let id = format!("{}-gate-{}", k.gate_group, k.instance_id);
    let id_b = format!("{id}-b");
    let victim = r.cluster.coordinator(&id);
    let other = r.cluster.coordinator(&id_b);
    let d = outage();
    // Commits run back to back under this load: the kill lands in one (its
    // first phase, its markers or between batches; not chosen).
    r.mark_fault();
    r.cluster.kill(victim);
    r.hold(d).await;
    let live: Vec<u8> = NODES.iter().copied().filter(|n| *n != victim).collect();
    let moved_to = r.cluster.coordinator(&id);
    let back_at = r.restart(&[victim]).await;
    assert!(
        live.contains(&moved_to),
        "the coordinator moved to a live node"
    );
    let what = format!(
        "node {victim}, the coordinator of {id} ({id_b}'s: node {other}), SIGKILLed, restarted after {} s; the coordinator moved to node {moved_to}",
        d.as_secs()
    );
    r.finish(
        "cluster: the gate's transaction coordinator SIGKILLed",
        what,
        back_at,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_active_controller_killed_under_load() {
    if !enabled("the_active_controller_killed_under_load") {
        return;
    }
    let _serial = common::FAULTS.lock().await;
    let mut r = under_load("ct").await;
    let victim = r.cluster.controller().expect("an active controller");
    let d = outage();
    r.mark_fault();
    r.cluster.kill(victim);
    let mut elected = None;
    while elected.is_none() && r.fault_at.elapsed() < Duration::from_secs(60) {
        r.watch();
        elected = r.cluster.controller().filter(|n| *n != victim);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let elected_after = r.fault_at.elapsed();
    let rest = d.saturating_sub(elected_after);
    r.hold(rest).await;
    let back_at = r.restart(&[victim]).await;
    let elected = elected.expect("a new active controller elected");
    let what = format!(
        "node {victim}, the active controller, SIGKILLed, restarted after {} s; node {elected} elected within {:.1} s",
        d.as_secs(),
        elected_after.as_secs_f64()
    );
    r.finish("cluster: the active controller SIGKILLed", what, back_at)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_paused_past_its_session_under_load() {
    if !enabled("a_broker_paused_past_its_session_under_load") {
        return;
    }
    let _serial = common::FAULTS.lock().await;
    let mut r = under_load("ps").await;
    let brokers = r.cluster.brokers();
    let (victim, led) = busiest_leader(&r.s, &brokers);
    // Past broker.session.timeout.ms (9 s): the controller fences it and moves
    // its leaderships while it still holds its sockets.
    let d = Duration::from_secs(15).max(outage());
    r.mark_fault();
    r.cluster.run(&["pause", &victim.to_string()]);
    r.hold(d).await;
    let moved = busiest_leader(&r.s, &brokers);
    r.count_answered_while_down();
    r.cluster.run(&["resume", &victim.to_string()]);
    let back_at = Instant::now();
    let what = format!(
        "node {victim} (leading {led}) SIGSTOPped for {} s, then SIGCONT (meanwhile node {} led the most: {})",
        d.as_secs(),
        moved.0,
        moved.1
    );
    r.finish(
        "cluster: a broker SIGSTOPped past its session timeout",
        what,
        back_at,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_brokers_down_under_load() {
    if !enabled("two_brokers_down_under_load") {
        return;
    }
    let _serial = common::FAULTS.lock().await;
    let mut r = under_load("tw").await;
    let brokers = r.cluster.brokers();
    let (first, led) = busiest_leader(&r.s, &brokers);
    let second = NODES.iter().copied().find(|n| *n != first).unwrap();
    let d = outage();
    r.mark_fault();
    r.cluster.kill(first);
    r.cluster.kill(second);
    r.hold(d).await;
    let back_at = r.restart(&[first, second]).await;
    let what = format!(
        "nodes {first} (leading {led}) and {second} SIGKILLed together (one node left: no controller quorum, under min.insync.replicas), restarted after {} s ({:.1} s after the kill both registered)",
        d.as_secs(),
        (back_at - r.fault_at).as_secs_f64(),
    );
    r.finish(
        "cluster: two brokers of three SIGKILLed at once",
        what,
        back_at,
    )
    .await;
}
