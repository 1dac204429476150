//! The console's only state: an in-memory view of the topics, rebuilt from
//! their beginning at start and followed from then on (read_committed).
//!
//! - `changelog`: every step's latest record, kept compact ([`StepEntry`]:
//!   its phase, answer status, timings and where the record sits); the whole
//!   record only for the steps waiting for a person (held for approval, in
//!   doubt). A workflow's timeline reads its records back by offset.
//! - `approvals`: when each held call was requested, and who decided it.
//! - `commands`: every operator's decision, with the output they recorded.
//! - `intents`, `results`: calls and answers counted per tool.
//!
//! Lag per partition is the gate group's committed offset on `intents`
//! against the partition's end, read every few seconds; who owns each
//! partition and its restore state, the listed gates' `/metrics` (written
//! here by [`super::gates::follow`]).

use super::Shared;
use crate::audit::Decision;
use crate::config::KafkaConfig;
use crate::contract::{ApprovalEvent, ApprovalKind, Command, Status, StepKey};
use crate::kafka;
use crate::state::{Phase, StepRecord, changelog_step};
use rdkafka::Message as _;
use rdkafka::consumer::Consumer as _;
use rdkafka::error::KafkaError;
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Where a step sits in the cache's index: its workflow's steps are one range.
pub type EntryKey = (Box<str>, u64, u16, u64);

/// What the console keeps of every step.
#[derive(Debug, Clone)]
pub struct StepEntry {
    pub partition: i32,
    /// The changelog offset of the record: where its whole record is read back.
    pub offset: i64,
    pub phase: Phase,
    /// The first answer's status, once there is one.
    pub status: Option<Status>,
    pub intended_at_ms: i64,
    /// From the first call's publication to its answer.
    pub latency_ms: Option<u32>,
    pub repeats: u64,
    pub dispatch: u32,
}

/// Per tool, what the overview shows.
#[derive(Debug, Clone, Default)]
pub struct ToolFigures {
    /// Intents published (fast-path and refused ones too).
    pub calls: u64,
    /// Recorded steps.
    pub steps: u64,
    /// Calls of recorded steps after their first.
    pub repeats: u64,
    pub in_flight: u64,
    pub awaiting_approval: u64,
    pub in_doubt: u64,
    /// Answers on `results`, by status.
    pub answers: BTreeMap<&'static str, u64>,
    pub p50_ms: Option<u32>,
    pub p99_ms: Option<u32>,
}

impl ToolFigures {
    /// Repeats ÷ effectful calls (each recorded step's first call and its repeats).
    pub fn dedup_rate(&self) -> Option<f64> {
        let effectful = self.steps + self.repeats;
        (effectful > 0).then(|| self.repeats as f64 / effectful as f64)
    }
}

/// One intents partition of the gate's group.
#[derive(Debug, Clone)]
pub struct PartitionLag {
    pub partition: i32,
    pub end: i64,
    /// The gate group's committed offset (`None`: nothing committed yet).
    pub committed: Option<i64>,
}

impl PartitionLag {
    pub fn lag(&self) -> i64 {
        self.end - self.committed.unwrap_or(0).max(0)
    }
}

/// The requested/decided events of a held call, from `approvals`.
#[derive(Debug, Clone, Default)]
pub struct ApprovalTrail {
    pub requested_at: Option<String>,
    /// (approved or denied, by, at, reason)
    pub decided: Option<(&'static str, String, String, Option<String>)>,
}

/// The row of the overview that counts calls and answers naming a tool that
/// is not configured: an agent may send any name, and each must not cost a row.
pub const OTHER_TOOLS: &str = "(not configured)";

/// The view of the topics.
#[derive(Default)]
pub struct Cache {
    /// The configured tools: calls and answers are counted by these names,
    /// every other name under [`OTHER_TOOLS`].
    configured: std::collections::BTreeSet<String>,
    tools: Vec<Box<str>>,
    steps: BTreeMap<EntryKey, StepEntry>,
    /// Whole records of the steps waiting for a person.
    attention: BTreeMap<EntryKey, StepRecord>,
    approvals: HashMap<StepKey, ApprovalTrail>,
    decisions: HashMap<StepKey, Vec<Decision>>,
    calls: HashMap<Box<str>, u64>,
    answers: HashMap<(Box<str>, &'static str), u64>,
    pub lag: Vec<PartitionLag>,
    /// The listed gates' last scrapes (`console.gates`; see [`super::gates`]).
    pub gates: Vec<super::gates::GateView>,
    /// Bumped whenever the set of steps waiting for a person changes: the
    /// live fragments are re-sent only then.
    pub attention_version: u64,
    /// Every partition has been read to its end once since start.
    pub caught_up: bool,
    pub caught_up_after: Option<Duration>,
    pub records_read: u64,
    pub error: Option<String>,
}

impl Cache {
    /// An empty cache counting calls for the `configured` tools.
    pub fn new(configured: impl IntoIterator<Item = String>) -> Cache {
        Cache {
            configured: configured.into_iter().collect(),
            ..Cache::default()
        }
    }

    /// The name a call or answer is counted under.
    fn counted_as(&self, tool: &str) -> Box<str> {
        if self.configured.contains(tool) {
            tool.into()
        } else {
            OTHER_TOOLS.into()
        }
    }

    fn tool_id(&mut self, tool: &str) -> u16 {
        if let Some(i) = self.tools.iter().position(|t| &**t == tool) {
            return i as u16;
        }
        self.tools.push(tool.into());
        (self.tools.len() - 1) as u16
    }

    fn tool_of(&self, id: u16) -> &str {
        self.tools.get(id as usize).map(|t| &**t).unwrap_or("?")
    }

    fn key_of(&mut self, step: &StepKey) -> EntryKey {
        (
            step.workflow_id.as_str().into(),
            step.step_index,
            self.tool_id(&step.tool),
            step.attempt,
        )
    }

    pub fn step_key(&self, k: &EntryKey) -> StepKey {
        StepKey {
            workflow_id: k.0.to_string(),
            step_index: k.1,
            tool: self.tool_of(k.2).to_owned(),
            attempt: k.3,
        }
    }

    /// A changelog record (or its tombstone) at `offset`.
    pub fn apply_changelog(&mut self, key: &[u8], value: Option<&[u8]>, offset: i64) {
        let Some((partition, step, record)) = changelog_step(key, value) else {
            return;
        };
        let k = self.key_of(&step);
        let Some(record) = record else {
            self.steps.remove(&k);
            if self.attention.remove(&k).is_some() {
                self.attention_version += 1;
            }
            return;
        };
        let latency_ms = match (&record.result, record.intent_ts_ms) {
            (Some(r), Some(t0)) => chrono::DateTime::parse_from_rfc3339(&r.completed_at)
                .ok()
                .map(|t| (t.timestamp_millis() - t0).clamp(0, u32::MAX as i64) as u32),
            _ => None,
        };
        self.steps.insert(
            k.clone(),
            StepEntry {
                partition,
                offset,
                phase: record.phase,
                status: record.result.as_ref().map(|r| r.status),
                intended_at_ms: record.intended_at_ms,
                latency_ms,
                repeats: record.repeats,
                dispatch: record.dispatch,
            },
        );
        let phase = record.phase;
        let waits = matches!(phase, Phase::InDoubt | Phase::AwaitingApproval);
        let before = if waits {
            self.attention.insert(k, record)
        } else {
            self.attention.remove(&k)
        };
        // A repeat joining a held call rewrites its record: not a change a
        // person must see.
        if before.map(|b| b.phase) != waits.then_some(phase) {
            self.attention_version += 1;
        }
    }

    pub fn apply_approval(&mut self, value: &[u8]) {
        let Ok(e) = serde_json::from_slice::<ApprovalEvent>(value) else {
            return;
        };
        let trail = self.approvals.entry(e.step).or_default();
        match e.event {
            ApprovalKind::Requested { .. } => {
                *trail = ApprovalTrail {
                    requested_at: Some(e.at),
                    decided: None,
                }
            }
            ApprovalKind::Approved { by, reason } => {
                trail.decided = Some(("approved", by, e.at, reason))
            }
            ApprovalKind::Denied { by, reason } => {
                trail.decided = Some(("denied", by, e.at, reason))
            }
            ApprovalKind::Expired { ttl } => {
                trail.decided = Some((
                    "expired",
                    "stepgate".into(),
                    e.at,
                    Some(format!("nobody decided within {ttl}: nothing ran")),
                ))
            }
            ApprovalKind::Escalated { .. } | ApprovalKind::Expiring { .. } => {}
        }
    }

    pub fn apply_command(&mut self, value: &[u8]) {
        let Ok(cmd) = serde_json::from_slice::<Command>(value) else {
            return;
        };
        let list = self.decisions.entry(cmd.step.clone()).or_default();
        // A command re-sent by its author has the same id: one decision.
        if !list.iter().any(|d| d.id == cmd.id) {
            list.push(Decision::from(cmd));
        }
    }

    pub fn apply_intent(&mut self, value: &[u8]) {
        #[derive(serde::Deserialize)]
        struct ToolOnly<'a> {
            #[serde(borrow)]
            tool: std::borrow::Cow<'a, str>,
        }
        if let Ok(t) = serde_json::from_slice::<ToolOnly>(value) {
            let name = self.counted_as(&t.tool);
            *self.calls.entry(name).or_default() += 1;
        }
    }

    pub fn apply_result(&mut self, value: &[u8]) {
        #[derive(serde::Deserialize)]
        struct Brief<'a> {
            #[serde(borrow)]
            tool: std::borrow::Cow<'a, str>,
            status: Status,
        }
        if let Ok(b) = serde_json::from_slice::<Brief>(value) {
            let name = self.counted_as(&b.tool);
            *self.answers.entry((name, b.status.as_str())).or_default() += 1;
        }
    }

    /// The whole records of the steps waiting for a person in `phase`,
    /// oldest first.
    pub fn waiting(&self, phase: Phase) -> Vec<StepRecord> {
        self.waiting_page(phase, 0, usize::MAX).0
    }

    /// How many steps wait for a person in `phase` (nothing cloned).
    pub fn count_waiting(&self, phase: Phase) -> usize {
        self.attention.values().filter(|r| r.phase == phase).count()
    }

    /// One page of [`Cache::waiting`]: `limit` records from the `skip`th
    /// (only those cloned), and how many wait in all.
    pub fn waiting_page(
        &self,
        phase: Phase,
        skip: usize,
        limit: usize,
    ) -> (Vec<StepRecord>, usize) {
        let mut all: Vec<&StepRecord> = self
            .attention
            .values()
            .filter(|r| r.phase == phase)
            .collect();
        all.sort_by_key(|r| r.intended_at_ms);
        let total = all.len();
        let page = all.into_iter().skip(skip).take(limit).cloned().collect();
        (page, total)
    }

    /// A record waiting for a person, as if read from the changelog (tests).
    #[cfg(test)]
    pub(crate) fn insert_waiting(&mut self, record: StepRecord) {
        let k = self.key_of(&record.step);
        self.steps.insert(
            k.clone(),
            StepEntry {
                partition: record.partition,
                offset: 0,
                phase: record.phase,
                status: None,
                intended_at_ms: record.intended_at_ms,
                latency_ms: None,
                repeats: record.repeats,
                dispatch: record.dispatch,
            },
        );
        self.attention.insert(k, record);
        self.attention_version += 1;
    }

    /// The step's whole record, when it waits for a person.
    pub fn waiting_record(&self, step: &StepKey) -> Option<StepRecord> {
        let tool = self.tools.iter().position(|t| **t == *step.tool)? as u16;
        self.attention
            .get(&(
                step.workflow_id.as_str().into(),
                step.step_index,
                tool,
                step.attempt,
            ))
            .cloned()
    }

    /// A workflow's steps in order.
    pub fn workflow(&self, workflow_id: &str) -> Vec<(StepKey, StepEntry)> {
        let from: EntryKey = (workflow_id.into(), 0, 0, 0);
        let to: EntryKey = (workflow_id.into(), u64::MAX, u16::MAX, u64::MAX);
        self.steps
            .range((Bound::Included(from), Bound::Included(to)))
            .map(|(k, e)| (self.step_key(k), e.clone()))
            .collect()
    }

    /// Workflow ids starting with `prefix` (at most `limit`), for the search.
    pub fn workflows_starting(&self, prefix: &str, limit: usize) -> Vec<String> {
        let from: EntryKey = (prefix.into(), 0, 0, 0);
        let mut out: Vec<String> = Vec::new();
        for (k, _) in self.steps.range(from..) {
            if !k.0.starts_with(prefix) || out.len() >= limit {
                break;
            }
            if out.last().is_none_or(|l| **l != *k.0) {
                out.push(k.0.to_string());
            }
        }
        out
    }

    pub fn approval(&self, step: &StepKey) -> Option<&ApprovalTrail> {
        self.approvals.get(step)
    }

    pub fn decisions(&self, step: &StepKey) -> &[Decision] {
        self.decisions.get(step).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn step_count(&self) -> usize {
        self.steps.len()
    }

    /// The overview's figures, per tool.
    pub fn tool_figures(&self) -> BTreeMap<String, ToolFigures> {
        let mut out: BTreeMap<String, ToolFigures> = BTreeMap::new();
        let mut latencies: HashMap<u16, Vec<u32>> = HashMap::new();
        for (k, e) in &self.steps {
            let f = out.entry(self.tool_of(k.2).to_owned()).or_default();
            f.steps += 1;
            f.repeats += e.repeats;
            match e.phase {
                Phase::Started => f.in_flight += 1,
                Phase::AwaitingApproval => f.awaiting_approval += 1,
                Phase::InDoubt => f.in_doubt += 1,
                _ => {}
            }
            if let Some(l) = e.latency_ms {
                latencies.entry(k.2).or_default().push(l);
            }
        }
        for (tool, n) in &self.calls {
            out.entry(tool.to_string()).or_default().calls = *n;
        }
        for ((tool, status), n) in &self.answers {
            out.entry(tool.to_string())
                .or_default()
                .answers
                .insert(status, *n);
        }
        for (id, mut l) in latencies {
            l.sort_unstable();
            let at = |q: f64| l[((l.len() - 1) as f64 * q).round() as usize];
            let f = out.entry(self.tool_of(id).to_owned()).or_default();
            f.p50_ms = Some(at(0.5));
            f.p99_ms = Some(at(0.99));
        }
        out
    }
}

/// Read the topics into `cache` until `shutdown`: from their beginning, then
/// as records arrive. Blocking: run it on a thread of its own.
pub fn follow(
    cfg: &KafkaConfig,
    gate_group: &str,
    cache: Shared,
    shutdown: CancellationToken,
) -> Result<(), KafkaError> {
    let started = Instant::now();
    let t = &cfg.topics;
    let topics = [
        t.changelog.as_str(),
        t.approvals.as_str(),
        t.commands.as_str(),
        t.intents.as_str(),
        t.results.as_str(),
    ];
    let counts = loop {
        match kafka::partition_counts(cfg, &topics) {
            Ok(c) => break c,
            Err(e) => {
                let msg = format!("cannot read the topics' layout: {e}");
                tracing::warn!("{msg}; trying again");
                cache.write().expect("cache lock").error = Some(msg);
                if shutdown.is_cancelled() {
                    return Ok(());
                }
                std::thread::sleep(Duration::from_secs(2));
            }
        }
    };
    // A group of its own that never commits: every console reads everything.
    let group = format!(
        "stepgate-console-{}-{}",
        std::process::id(),
        chrono::Utc::now().timestamp_nanos_opt().unwrap_or_default()
    );
    // A consumer per topic: librdkafka's end-of-partition event names the
    // partition only, so each topic's ends are counted on its own consumer.
    let mut readers = Vec::new();
    for (topic, n) in topics.iter().zip(&counts) {
        let consumer = kafka::read_to_end_consumer(cfg, &group)?;
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in 0..*n as i32 {
            tpl.add_partition_offset(topic, p, rdkafka::Offset::Beginning)?;
        }
        consumer.assign(&tpl)?;
        drop(tpl);
        let open: std::collections::HashSet<i32> = (0..*n as i32).collect();
        readers.push((consumer, open));
    }
    let lag_reader = kafka::read_to_end_consumer(cfg, gate_group)?;
    let intents_partitions = counts[3] as i32;
    let mut next_lag = Instant::now();
    while !shutdown.is_cancelled() {
        if Instant::now() >= next_lag {
            next_lag = Instant::now() + Duration::from_secs(3);
            match read_lag(&lag_reader, &t.intents, intents_partitions) {
                Ok(lag) => cache.write().expect("cache lock").lag = lag,
                Err(e) => tracing::debug!(error = %e, "reading the gate group's offsets"),
            }
        }
        let mut idle = true;
        for (i, (consumer, open)) in readers.iter_mut().enumerate() {
            let mut c = cache.write().expect("cache lock");
            // A burst per topic, then the next: none waits behind another's backlog.
            for _ in 0..2000 {
                let Some(m) = consumer.poll(Duration::ZERO) else {
                    break;
                };
                idle = false;
                match m {
                    Ok(m) => {
                        c.records_read += 1;
                        match (i, m.payload()) {
                            (0, value) => {
                                if let Some(key) = m.key() {
                                    c.apply_changelog(key, value, m.offset());
                                }
                            }
                            (1, Some(v)) => c.apply_approval(v),
                            (2, Some(v)) => c.apply_command(v),
                            (3, Some(v)) => c.apply_intent(v),
                            (4, Some(v)) => c.apply_result(v),
                            _ => {}
                        }
                    }
                    Err(KafkaError::PartitionEOF(p)) => {
                        open.remove(&p);
                    }
                    Err(e) => tracing::debug!(error = %e, "console reader"),
                }
            }
        }
        if !caught_up(&cache) && readers.iter().all(|(_, open)| open.is_empty()) {
            let mut c = cache.write().expect("cache lock");
            c.caught_up = true;
            c.caught_up_after = Some(started.elapsed());
            tracing::info!(
                steps = c.step_count(),
                records = c.records_read,
                seconds = started.elapsed().as_secs_f64(),
                "console: the topics are read to their end"
            );
        }
        if idle {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    for (consumer, _) in &readers {
        let _ = consumer.unassign();
    }
    Ok(())
}

fn caught_up(cache: &Shared) -> bool {
    cache.read().expect("cache lock").caught_up
}

/// The gate group's committed offsets on `intents` against the ends.
fn read_lag(
    reader: &kafka::ReadToEndConsumer,
    intents: &str,
    partitions: i32,
) -> Result<Vec<PartitionLag>, KafkaError> {
    let limit = Duration::from_secs(5);
    let mut tpl = rdkafka::TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(intents, p);
    }
    let committed = reader.committed_offsets(tpl, limit)?;
    let mut out = Vec::new();
    for p in 0..partitions {
        let (_, end) = reader.fetch_watermarks(intents, p, limit)?;
        let committed = committed
            .find_partition(intents, p)
            .and_then(|e| e.offset().to_raw())
            .filter(|o| *o >= 0);
        out.push(PartitionLag {
            partition: p,
            end,
            committed,
        });
    }
    drop(committed);
    Ok(out)
}

/// The whole records at `offsets` of one changelog partition (a workflow's
/// steps, whose latest records the cache points at). Blocking.
pub fn read_records(
    cfg: &KafkaConfig,
    partition: i32,
    offsets: &[i64],
) -> Result<Vec<StepRecord>, KafkaError> {
    let (Some(&first), Some(&last)) = (offsets.iter().min(), offsets.iter().max()) else {
        return Ok(Vec::new());
    };
    let group = format!("stepgate-console-{}", std::process::id());
    let consumer = kafka::read_to_end_consumer(cfg, &group)?;
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(
        &cfg.topics.changelog,
        partition,
        rdkafka::Offset::Offset(first),
    )?;
    consumer.assign(&tpl)?;
    drop(tpl);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut out = Vec::new();
    while Instant::now() < deadline {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                if offsets.contains(&m.offset())
                    && let Some(key) = m.key()
                    && let Some((_, _, Some(r))) = changelog_step(key, m.payload())
                {
                    out.push(r);
                }
                if m.offset() >= last {
                    break;
                }
            }
            Some(Err(KafkaError::PartitionEOF(_))) => break,
            _ => {}
        }
    }
    let _ = consumer.unassign();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::{Outcome, ToolResult};
    use crate::state::{Batch, StateStore};
    use crate::tools::Category;

    fn key(wf: &str, i: u64, tool: &str) -> StepKey {
        StepKey {
            workflow_id: wf.into(),
            step_index: i,
            tool: tool.into(),
            attempt: 0,
        }
    }

    /// The changelog records a gate writes for `records` (None: a tombstone).
    fn changelog(
        store: &StateStore,
        records: &[(StepKey, Option<StepRecord>)],
    ) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
        let mut batch = Batch::on_top_of(None);
        for (k, r) in records {
            match r {
                Some(r) => batch.put_step(store, 0, r).unwrap(),
                None => batch.delete_step(store, 0, k).unwrap(),
            }
        }
        batch
            .changelog()
            .into_iter()
            .filter(|e| changelog_step(&e.key, e.value.as_deref()).is_some())
            .map(|e| (e.key, e.value))
            .collect()
    }

    fn record(k: &StepKey, phase: Phase, at: i64, repeats: u64) -> StepRecord {
        let mut r = StepRecord::new(
            k.clone(),
            Category::Keyed,
            phase,
            serde_json::Map::new().into(),
            0,
            at,
            at + 1_000_000,
        );
        r.repeats = repeats;
        if phase == Phase::Completed {
            r.intent_ts_ms = Some(at);
            r.result = Some(ToolResult::from_outcome(
                k,
                None,
                Outcome::Ok {
                    output: serde_json::json!({}),
                },
                chrono::DateTime::from_timestamp_millis(at + 40).unwrap(),
            ));
        }
        r
    }

    #[test]
    fn the_cache_follows_the_changelog() {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(&dir.path().join("s")).unwrap();
        let mut c = Cache::default();
        let (a, b, d) = (
            key("wf-1", 0, "send_email"),
            key("wf-1", 1, "wire"),
            key("wf-2", 0, "wire"),
        );
        let mut offset = 0;
        let mut apply = |c: &mut Cache, records: &[(StepKey, Option<StepRecord>)]| {
            for (k, v) in changelog(&store, records) {
                c.apply_changelog(&k, v.as_deref(), offset);
                offset += 1;
            }
        };
        apply(
            &mut c,
            &[
                (a.clone(), Some(record(&a, Phase::Completed, 1_000, 3))),
                (
                    b.clone(),
                    Some(record(&b, Phase::AwaitingApproval, 2_000, 0)),
                ),
                (d.clone(), Some(record(&d, Phase::InDoubt, 1_500, 0))),
            ],
        );
        let v0 = c.attention_version;
        assert_eq!(c.waiting(Phase::AwaitingApproval)[0].step, b);
        assert_eq!(c.waiting(Phase::InDoubt)[0].step, d);
        assert_eq!(
            c.workflow("wf-1")
                .iter()
                .map(|(k, _)| k.clone())
                .collect::<Vec<_>>(),
            vec![a.clone(), b.clone()]
        );
        assert_eq!(c.workflows_starting("wf-", 10), vec!["wf-1", "wf-2"]);
        // A repeat joining the held call rewrites its record: nothing a
        // person must see changed.
        apply(
            &mut c,
            &[(
                b.clone(),
                Some(record(&b, Phase::AwaitingApproval, 2_000, 1)),
            )],
        );
        assert_eq!(c.attention_version, v0);
        // Approved and run: out of the Inbox.
        apply(
            &mut c,
            &[(b.clone(), Some(record(&b, Phase::Completed, 2_000, 1)))],
        );
        assert!(c.attention_version > v0);
        assert!(c.waiting(Phase::AwaitingApproval).is_empty());
        let figures = c.tool_figures();
        // send_email: 1 step and 3 repeats → 3 of 4 effectful calls repeated.
        assert_eq!(figures["send_email"].dedup_rate(), Some(0.75));
        assert_eq!(figures["send_email"].p50_ms, Some(40));
        assert_eq!(figures["wire"].in_doubt, 1);
        // A tombstone (retention) removes the step.
        apply(&mut c, &[(d.clone(), None)]);
        assert!(c.waiting(Phase::InDoubt).is_empty());
        assert!(c.workflow("wf-2").is_empty());
    }
}
