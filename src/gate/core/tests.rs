//! The gate's decisions over real RocksDB, without Kafka.
use super::timers::Purged;
use super::*;
use crate::contract::headers::SIGNATURE;
use crate::contract::sign::{Signed, sign};
use crate::contract::{
    Action, Command, ErrorBody, Outcome, Progress, ProgressEvent, RejectionReason, Status, codec,
};
use crate::state::Batch;
use serde_json::json;

const CONFIG: &str = r#"
[state]
retention = "1h"
[gate]
in_doubt_grace = "1s"
max_intent_bytes = 4096
[tools.send_email]
category = "keyed"
url = "http://127.0.0.1:1/x"
timeout = "2s"
retries = 0
[tools.wire]
category = "unkeyed"
url = "http://127.0.0.1:1/x"
timeout = "2s"
retries = 0
[tools.search]
category = "read_only"
url = "http://127.0.0.1:1/x"
[tools.mail]
category = "keyed"
url = "http://127.0.0.1:1/x"
timeout = "2s"
identity = ["to"]
[tools.gpu_keyed]
category = "keyed"
pool = "gpu"
timeout = "2s"
retries = 0
[tools.gpu_wire]
category = "unkeyed"
pool = "gpu"
timeout = "2s"
retries = 0
[pools.gpu]
key = "the-gpu-pool-key-of-thirty-two-bytes"
"#;

/// `[pools.gpu] key` above: what the pool's workers sign with.
const GPU_KEY: &[u8] = b"the-gpu-pool-key-of-thirty-two-bytes";

struct Fixture {
    _dir: tempfile::TempDir,
    store: StateStore,
    core: GateCore,
    offset: i64,
    /// Partition 0's applied mark, as the session's `Ownership` keeps it.
    applied: i64,
}

impl Fixture {
    fn new() -> Self {
        Self::with_config(CONFIG)
    }

    /// Keyed steps recorded `started` before their call (as an intent over
    /// 4 KiB is), as the tests of outcomes handed over on `progress` by a
    /// process that ran them need (a deferred step takes those as evidence
    /// only).
    fn started_first() -> Self {
        let mut f = Self::new();
        f.core.settings.start_record = true;
        f
    }

    fn with_config(toml: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = StateStore::open(dir.path()).unwrap();
        let config = Config::from_toml_str(toml, Vec::new()).unwrap();
        Fixture {
            core: GateCore::new(&config, Arc::new(Metrics::new())),
            store,
            _dir: dir,
            offset: 0,
            applied: 0,
        }
    }

    /// What the gate does once a batch's transaction committed. Its calls
    /// leave the core's hands (to an invoker, or to one that is gone: a test
    /// that keeps a call running here says so with `finished`/`invoked`).
    fn commit(&mut self, batch: Batch) {
        self.store
            .apply(&batch, &crate::state::Landing::default())
            .unwrap();
        self.core.awaiting_commit.clear();
    }

    /// The decisions since the last call (calls started at once included).
    fn outs(&mut self) -> Vec<Out> {
        self.core.take_outs()
    }

    /// A step's record as the gate sees it (a deferred one's, in memory).
    fn record(&self, step: &StepKey) -> StepRecord {
        self.core
            .step_view(&self.store, &Batch::default(), 0, step)
            .unwrap()
            .expect("a record")
    }

    fn input(&mut self, topic: &str, payload: Vec<u8>) -> Input {
        self.offset += 1;
        Input {
            topic: topic.into(),
            partition: 0,
            offset: self.offset,
            key: Some(b"wf".to_vec()),
            payload: Some(payload),
            headers: vec![],
            timestamp_ms: None,
        }
    }

    fn intent(&mut self, v: serde_json::Value, now: i64) -> Vec<Out> {
        let input = self.input("intents", v.to_string().into_bytes());
        let mut b = Batch::default();
        self.core
            .on_intent(&self.store, &mut b, &input, self.applied, now)
            .unwrap();
        self.commit(b);
        self.outs()
    }

    /// A record of `progress` as its writer sends it: a pool tool's as its
    /// worker (JSON, signed with the pool's key), another's as a gate's
    /// hand-over.
    fn progress(&mut self, p: Progress, now: i64) -> Vec<Out> {
        if p.step.tool.starts_with("gpu_") {
            let json = serde_json::to_vec(&p).unwrap();
            let signature = sign(GPU_KEY, Signed::Outcome, &json);
            self.progress_raw(json, vec![(SIGNATURE.into(), Some(signature.into()))], now)
        } else {
            self.progress_raw(codec::encode(&p), vec![], now)
        }
    }

    /// A record of `progress` exactly as given.
    fn progress_raw(
        &mut self,
        payload: Vec<u8>,
        headers: Vec<(String, Option<Vec<u8>>)>,
        now: i64,
    ) -> Vec<Out> {
        let mut input = self.input("progress", payload);
        input.headers = headers;
        let mut b = Batch::default();
        self.core
            .on_progress(&self.store, &mut b, &input, now)
            .unwrap();
        self.commit(b);
        self.outs()
    }

    /// An outcome of a call this process ran.
    fn outcome(&mut self, call: &Call, outcome: Outcome, now: i64) -> Vec<Out> {
        self.core.finished(0, &call.step, call.dispatch);
        let mut b = Batch::default();
        self.core
            .on_outcome(&self.store, &mut b, 0, finished(call, outcome), now)
            .unwrap();
        self.commit(b);
        self.outs()
    }

    fn tick(&mut self, now: i64) -> Vec<Out> {
        let mut b = Batch::default();
        self.core.on_deadlines(&self.store, &mut b, now).unwrap();
        self.commit(b);
        self.outs()
    }
}

fn email(call_id: &str, subject: &str) -> serde_json::Value {
    json!({"workflow_id": "wf", "step_index": 1, "tool": "send_email",
        "arguments": {"subject": subject}, "call_id": call_id})
}

fn call_of(outs: &[Out]) -> Call {
    outs.iter()
        .find_map(|o| match o {
            Out::Invoke { call, .. } => Some(call.clone()),
            _ => None,
        })
        .expect("a call was started")
}

/// The calls started at once, not after a commit.
fn calls_now(outs: &[Out]) -> Vec<(i32, Call)> {
    outs.iter()
        .filter_map(|o| match o {
            Out::Invoke {
                partition,
                call,
                when: When::Now,
            } => Some((*partition, call.clone())),
            _ => None,
        })
        .collect()
}

fn results(outs: &[Out]) -> Vec<ToolResult> {
    outs.iter()
        .filter_map(|o| match o {
            Out::Result { result, .. } => Some(result.clone()),
            _ => None,
        })
        .collect()
}

fn finished(call: &Call, outcome: Outcome) -> Progress {
    Progress {
        step: call.step.clone(),
        dispatch: call.dispatch,
        fast_ref: call.fast_ref,
        at_ms: 0,
        token: call.token.clone(),
        event: ProgressEvent::Finished { outcome },
    }
}

#[test]
fn a_rephrased_repeat_in_flight_waits_and_gets_the_same_answer() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(email("c1", "Order confirmed"), 1000));
    // A keyed step is recorded once settled: while it runs, its record is in
    // memory and its intent's offset is held back.
    assert!(f.store.step(0, &call.step).unwrap().is_none());
    assert_eq!(f.record(&call.step).phase, Phase::Started);
    assert_eq!(f.core.first_unanswered(0), Some(1));
    let outs = f.intent(email("c2", "Your order is confirmed"), 1100);
    assert!(outs.is_empty(), "a repeat is never run: {outs:?}");
    // The repeat waits on it durably: the record is written with it.
    let rec = f.store.step(0, &call.step).unwrap().unwrap();
    assert_eq!(rec.phase, Phase::Started);
    assert_eq!(rec.waiters.len(), 1);
    assert_eq!(f.core.first_unanswered(0), None, "the record holds it now");
    let outs = f.outcome(
        &call,
        Outcome::Ok {
            output: json!({"message_id": "m-1"}),
        },
        1300,
    );
    let rs = results(&outs);
    assert_eq!(rs.len(), 2);
    assert_eq!(
        (rs[0].call_id.as_deref(), rs[0].deduplicated),
        (Some("c1"), false)
    );
    assert_eq!(
        (rs[1].call_id.as_deref(), rs[1].deduplicated),
        (Some("c2"), true)
    );
    assert_eq!(rs[1], rs[0].for_repeat(Some("c2".into())));
    let rec = f.store.step(0, &call.step).unwrap().unwrap();
    assert_eq!((rec.repeats, rec.rephrased_count), (1, 1));
    assert_eq!(
        rec.rephrased[0].arguments.to_map()["subject"],
        "Your order is confirmed"
    );
}

#[test]
fn a_repeat_after_completion_is_answered_from_the_record() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(email("c1", "a"), 1000));
    let first = results(&f.outcome(&call, Outcome::Ok { output: json!(1) }, 1200)).remove(0);
    let before = f.store.step(0, &call.step).unwrap();
    let outs = f.intent(email("c3", "a"), 5000);
    assert!(!outs.iter().any(|o| matches!(o, Out::Invoke { .. })));
    assert_eq!(results(&outs), vec![first.for_repeat(Some("c3".into()))]);
    assert_eq!(
        f.store.step(0, &call.step).unwrap(),
        before,
        "a verbatim repeat of a settled step writes nothing"
    );
    // A rephrased one is kept for the audit.
    f.intent(email("c4", "b"), 5100);
    let rec = f.store.step(0, &call.step).unwrap().unwrap();
    assert_eq!(rec.rephrased_count, 1);
}

/// An intent applied to `batch` (not
/// committed), and what it decided — the answers it may send at once, then
/// the rest.
fn at_once_and_rest(
    f: &mut Fixture,
    batch: &mut Batch,
    v: serde_json::Value,
) -> (Vec<Out>, Vec<Out>) {
    let input = f.input("intents", v.to_string().into_bytes());
    f.core
        .on_intent(&f.store, batch, &input, f.applied, 5000)
        .unwrap();
    f.outs().into_iter().partition(|o| o.when() == When::Now)
}

#[test]
fn only_a_repeat_of_a_committed_final_outcome_is_answered_at_once() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(email("c1", "a"), 1000));
    // Its outcome is decided in a batch that has not committed yet: a repeat
    // read meanwhile is answered with that batch, never before it.
    let mut b = Batch::default();
    f.core.finished(0, &call.step, call.dispatch);
    f.core
        .on_outcome(
            &f.store,
            &mut b,
            0,
            finished(&call, Outcome::Ok { output: json!(1) }),
            1200,
        )
        .unwrap();
    let first = results(&f.outs()).remove(0);
    let (now, rest) = at_once_and_rest(&mut f, &mut b, email("c2", "a"));
    assert!(
        now.is_empty(),
        "an uncommitted outcome waits for its commit: {now:?}"
    );
    assert_eq!(results(&rest), vec![first.for_repeat(Some("c2".into()))]);
    f.commit(b);
    // Committed: a repeat, verbatim or rephrased, is sent at once, the same answer.
    for (id, subject) in [("c3", "a"), ("c4", "rephrased")] {
        let mut b = Batch::default();
        let (now, rest) = at_once_and_rest(&mut f, &mut b, email(id, subject));
        assert_eq!(results(&now), vec![first.for_repeat(Some(id.into()))]);
        assert!(results(&rest).is_empty(), "answered once: {rest:?}");
        f.commit(b);
    }
    // An in-doubt outcome (an operator may still resolve it) goes with its batch.
    let wire = json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": "w1"});
    f.intent(wire.clone(), 0);
    assert_eq!(results(&f.tick(3001))[0].status, Status::InDoubt);
    let mut again = wire;
    again["call_id"] = json!("w2");
    let (now, rest) = at_once_and_rest(&mut f, &mut Batch::default(), again);
    assert!(now.is_empty(), "{now:?}");
    assert_eq!(results(&rest)[0].status, Status::InDoubt);
}

#[test]
fn identical_arguments_at_two_steps_are_two_calls() {
    let mut f = Fixture::new();
    let a = call_of(&f.intent(email("c1", "same"), 1000));
    let mut second = email("c2", "same");
    second["step_index"] = json!(2);
    let b = call_of(&f.intent(second, 1000));
    assert_ne!(a.step, b.step);
    assert_ne!(a.step.idempotency_key(), b.step.idempotency_key());
}

#[test]
fn an_unkeyed_step_past_its_deadline_is_in_doubt_not_rerun() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": "c1"}), 0));
    // The process that ran it is gone: no outcome will come from here.
    assert!(f.tick(2000).is_empty(), "not before timeout + grace");
    let outs = f.tick(3001);
    assert!(!outs.iter().any(|o| matches!(o, Out::Invoke { .. })));
    let r = results(&outs).remove(0);
    assert_eq!(r.status, Status::InDoubt);
    assert_eq!(r.error.as_ref().unwrap().kind, "executor_lost");
    // A late outcome is kept for the operator, the answer stays in doubt.
    assert!(
        results(&f.progress(finished(&call, Outcome::Ok { output: json!(1) }), 9000)).is_empty()
    );
    let rec = f.store.step(0, &call.step).unwrap().unwrap();
    assert_eq!(rec.phase, Phase::InDoubt);
    assert!(rec.late_outcome.is_some());
    let again = f.intent(json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": "c9"}), 9500);
    assert_eq!(results(&again)[0].status, Status::InDoubt);
    assert!(results(&again)[0].deduplicated);
}

#[test]
fn a_keyed_step_past_its_deadline_is_forwarded_again_with_the_same_key() {
    let mut f = Fixture::started_first();
    let call = call_of(&f.intent(email("c1", "x"), 0));
    let again = call_of(&f.tick(3001));
    assert_eq!(again.step, call.step);
    assert_eq!(again.dispatch, 2);
    // The current dispatch's outcome settles the step.
    let rs = results(&f.progress(finished(&again, Outcome::Ok { output: json!(1) }), 4000));
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].call_id.as_deref(), Some("c1"));
}

fn refused() -> Outcome {
    Outcome::Error {
        error: ErrorBody {
            kind: "tool_refused".into(),
            message: "refused".into(),
        },
    }
}

fn unreachable() -> Outcome {
    Outcome::Error {
        error: ErrorBody {
            kind: "tool_unreachable".into(),
            message: "connection refused".into(),
        },
    }
}

#[test]
fn a_stale_dispatch_never_settles_a_re_run_step_and_is_kept_as_evidence() {
    let mut f = Fixture::started_first();
    let first = call_of(&f.intent(email("c1", "x"), 0));
    let second = call_of(&f.tick(3001));
    assert_eq!(second.dispatch, 2);
    // Dispatch 1's "not performed" arrives first, while dispatch 2 may charge.
    let outs = f.progress(finished(&first, refused()), 3500);
    assert!(
        results(&outs).is_empty(),
        "a stale dispatch answers nothing: {outs:?}"
    );
    let rec = f.record(&first.step);
    assert_eq!(rec.phase, Phase::Started);
    assert_eq!(rec.evidence.len(), 1);
    assert_eq!(
        (rec.evidence[0].dispatch, rec.evidence[0].why.as_str()),
        (1, "stale_dispatch")
    );
    assert!(rec.late_outcome.is_some(), "kept whole for the operator");
    let rs = results(&f.progress(
        finished(
            &second,
            Outcome::Ok {
                output: json!("charged"),
            },
        ),
        3600,
    ));
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].status, Status::Ok, "the current dispatch's answer");
    // The current dispatch reporting again after settling: evidence, no answer.
    let outs = f.progress(finished(&second, Outcome::Ok { output: json!(1) }), 3700);
    assert!(results(&outs).is_empty());
    let rec = f.store.step(0, &first.step).unwrap().unwrap();
    let whys: Vec<&str> = rec.evidence.iter().map(|e| e.why.as_str()).collect();
    assert_eq!(whys, ["stale_dispatch", "after_settled"], "{rec:?}");
}

#[test]
fn not_performed_from_a_re_run_while_an_earlier_run_is_unaccounted_for_is_in_doubt() {
    let mut f = Fixture::started_first();
    call_of(&f.intent(email("c1", "x"), 0));
    let second = call_of(&f.tick(3001));
    // Dispatch 1 never reports (its process is gone); dispatch 2 is refused.
    let r = results(&f.progress(finished(&second, refused()), 3500)).remove(0);
    assert_eq!(r.status, Status::InDoubt, "{r:?}");
    assert_eq!(r.error.as_ref().unwrap().kind, "outcome_unknown");
    assert!(!r.error.unwrap().message.contains("did not perform"));
}

#[test]
fn not_performed_after_an_earlier_run_reported_it_ran_is_in_doubt() {
    // Found by the simulation (seed 0x5eed002a): run 1 reported `ok` late,
    // as evidence; run 2 of the same key found the tool unreachable.
    let mut f = Fixture::started_first();
    let first = call_of(&f.intent(email("c1", "x"), 0));
    let second = call_of(&f.tick(3001));
    assert!(
        results(&f.progress(finished(&first, Outcome::Ok { output: json!(1) }), 3100)).is_empty()
    );
    let r = results(&f.progress(finished(&second, unreachable()), 3500)).remove(0);
    assert_eq!(r.status, Status::InDoubt, "{r:?}");
}

#[test]
fn not_performed_of_the_only_run_is_told_as_such() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(email("c1", "x"), 0));
    let r = results(&f.outcome(&call, refused(), 500)).remove(0);
    assert_eq!(r.status, Status::Error);
    assert_eq!(r.error.unwrap().kind, "tool_refused");
}

fn not_invoked(call: &Call) -> Progress {
    Progress {
        event: ProgressEvent::NotInvoked,
        ..finished(
            call,
            Outcome::Ok {
                output: json!(null),
            },
        )
    }
}

#[test]
fn a_call_handed_back_not_invoked_runs_at_once_even_unkeyed() {
    let mut f = Fixture::new();
    let wire = json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": "c1"});
    let call = call_of(&f.intent(wire, 0));
    // The partition moved while the call waited for a slot in the old owner.
    let again = call_of(&f.progress(not_invoked(&call), 500));
    assert_eq!((again.step.clone(), again.dispatch), (call.step.clone(), 2));
    let rec = f.store.step(0, &call.step).unwrap().unwrap();
    assert_eq!(rec.open_dispatches, vec![2], "run 1 is accounted for");
    let r = results(&f.progress(finished(&again, Outcome::Ok { output: json!(1) }), 900));
    assert_eq!(r[0].status, Status::Ok);
    // A hand-back of a run that is no longer current is evidence only.
    let outs = f.progress(not_invoked(&call), 1000);
    assert!(outs.is_empty(), "{outs:?}");
    let rec = f.store.step(0, &call.step).unwrap().unwrap();
    assert_eq!(rec.evidence.last().unwrap().status, "not_invoked");
}

#[test]
fn while_stopping_a_call_not_invoked_is_left_due_at_once_for_the_next_owner() {
    let mut f = Fixture::new();
    let wire = json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": "c1"});
    let call = call_of(&f.intent(wire, 0));
    f.core.set_stopping();
    assert!(f.progress(not_invoked(&call), 500).is_empty());
    let rec = f.store.step(0, &call.step).unwrap().unwrap();
    assert_eq!((rec.phase, rec.not_invoked), (Phase::Started, Some(1)));
    // The next owner (a new core over the same state) runs it, never in doubt.
    let config = Config::from_toml_str(CONFIG, Vec::new()).unwrap();
    f.core = GateCore::new(&config, Arc::new(Metrics::new()));
    f.core.load_partition(&f.store, 0, 600).unwrap();
    f.core.progress_read(0);
    assert!(f.tick(1000).is_empty(), "held for the grace period");
    let outs = f.tick(1700);
    assert!(
        results(&outs).is_empty(),
        "no answer, in particular no in_doubt"
    );
    let again = call_of(&outs);
    assert_eq!(again.dispatch, 2);
}

#[test]
fn deadlines_of_a_partition_taken_over_wait_until_progress_is_read() {
    let mut f = Fixture::new();
    call_of(&f.intent(
        json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}}),
        0,
    ));
    f.core.reset();
    f.core.load_partition(&f.store, 0, 10_000).unwrap();
    assert!(
        f.tick(60_000).is_empty(),
        "progress not read yet: long past the grace, still held"
    );
    f.core.progress_read(0);
    assert_eq!(results(&f.tick(60_100))[0].status, Status::InDoubt);
}

#[test]
fn deadlines_survive_a_restart() {
    let mut f = Fixture::new();
    call_of(&f.intent(
        json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}}),
        0,
    ));
    f.core.reset();
    assert!(f.tick(10_000).is_empty(), "nothing loaded yet");
    f.core.load_partition(&f.store, 0, 10_000).unwrap();
    f.core.progress_read(0);
    assert!(
        f.tick(10_999).is_empty(),
        "a partition taken over waits in_doubt_grace (1 s) for handed-over outcomes"
    );
    assert_eq!(results(&f.tick(11_001))[0].status, Status::InDoubt);
}

#[test]
fn after_a_long_restore_an_outcome_waiting_on_progress_settles_its_step() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(
        json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": "c1"}),
        0,
    ));
    // Taken over long after its deadline (a long restore): its deadline is
    // past, but the old owner's outcome waits on `progress`.
    f.core.reset();
    f.core.load_partition(&f.store, 0, 60_000).unwrap();
    assert!(f.tick(60_100).is_empty(), "held while progress is read");
    let r = results(&f.progress(finished(&call, Outcome::Ok { output: json!(1) }), 60_200));
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].status, Status::Ok, "the known outcome, not in_doubt");
    assert!(
        f.tick(70_000).is_empty(),
        "settled: nothing left to declare"
    );
}

#[test]
fn fast_path_calls_are_rerun_on_repeat_and_answered_once_each() {
    let mut f = Fixture::new();
    let q = json!({"workflow_id": "wf", "step_index": 0, "tool": "search", "arguments": {"q": "x"}, "call_id": "s1"});
    let a = call_of(&f.intent(q.clone(), 0));
    let b = call_of(&f.intent(q, 10));
    assert!(a.fast_ref.is_some() && a.fast_ref != b.fast_ref);
    assert!(
        f.store.step(0, &a.step).unwrap().is_none(),
        "a read records nothing"
    );
    assert_eq!(
        f.core.first_unanswered(0),
        a.fast_ref,
        "the committed offset waits for the first unanswered read"
    );
    let r = results(&f.outcome(&a, Outcome::Ok { output: json!([]) }, 20));
    assert_eq!(r.len(), 1);
    assert!(!r[0].deduplicated);
    assert!(
        results(&f.outcome(&a, Outcome::Ok { output: json!([]) }, 30)).is_empty(),
        "a duplicate answer is dropped"
    );
    assert_eq!(f.core.first_unanswered(0), b.fast_ref);
    results(&f.outcome(&b, Outcome::Ok { output: json!([]) }, 40));
    assert_eq!(f.core.first_unanswered(0), None);
}

#[test]
fn intents_re_read_below_the_applied_mark_only_rerun_reads() {
    let mut f = Fixture::new();
    let q = json!({"workflow_id": "wf", "step_index": 0, "tool": "search", "arguments": {}, "call_id": "s1"});
    let read = call_of(&f.intent(q.clone(), 0));
    let write = call_of(&f.intent(email("c1", "x"), 0));
    f.outcome(&write, Outcome::Ok { output: json!(1) }, 10);
    // A restart: the committed offset stayed at the unanswered read, the
    // applied mark is past both intents.
    f.core.reset();
    f.core.load_partition(&f.store, 0, 0).unwrap();
    f.applied = f.offset + 1;
    f.offset = read.fast_ref.unwrap() - 1;
    let outs = f.intent(q, 20);
    assert_eq!(
        call_of(&outs).fast_ref,
        read.fast_ref,
        "the read runs again"
    );
    let outs = f.intent(email("c1", "x"), 20);
    assert!(
        outs.is_empty(),
        "an applied intent is not answered twice: {outs:?}"
    );
}

#[test]
fn a_call_still_running_here_is_given_time_not_declared_in_doubt() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": "c1"}), 0));
    f.core.invoked(0, &call);
    assert!(results(&f.tick(3001)).is_empty(), "its outcome will come");
    let r = results(&f.outcome(&call, Outcome::Ok { output: json!(7) }, 4000));
    assert_eq!(r[0].status, Status::Ok);
}

#[test]
fn bad_input_goes_to_the_dlq_and_addressable_input_gets_rejected() {
    let mut f = Fixture::new();
    let input = f.input("intents", b"{oops".to_vec());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 0)
        .unwrap();
    let outs = f.core.take_outs();
    assert_eq!(outs.len(), 1);
    assert!(matches!(&outs[0], Out::Dlq { record, .. } if record.payload == "{oops"));
    let outs = f.intent(json!({"workflow_id": "wf", "step_index": 1, "tool": "nope", "arguments": {}, "call_id": "c"}), 0);
    assert_eq!(outs.len(), 2);
    let r = &results(&outs)[0];
    assert_eq!(r.status, Status::Rejected);
    assert_eq!(r.error.as_ref().unwrap().kind, "unknown_tool");
}

#[test]
fn expired_records_are_purged_then_a_repeat_runs_again() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(email("c1", "x"), 0));
    f.outcome(&call, Outcome::Ok { output: json!(1) }, 10);
    let mut b = Batch::default();
    assert_eq!(
        f.core
            .purge(&f.store, &mut b, [0], 10 + 3_600_000 - 1, 100)
            .unwrap(),
        Purged::default()
    );
    assert_eq!(
        f.core
            .purge(&f.store, &mut b, [0], 10 + 3_600_000, 100)
            .unwrap(),
        Purged {
            removed: 1,
            kept: 0,
            more: false
        }
    );
    f.commit(b);
    assert!(f.store.step(0, &call.step).unwrap().is_none());
    assert!(
        f.intent(email("c2", "x"), 4_000_000)
            .iter()
            .any(|o| matches!(o, Out::Invoke { .. }))
    );
}

#[test]
fn a_purge_backlog_is_taken_in_chunks_each_past_the_last() {
    let mut f = Fixture::new();
    let mut steps = Vec::new();
    for i in 0..25 {
        let intent = json!({"workflow_id": "wf", "step_index": i, "tool": "send_email",
            "arguments": {"subject": "s"}, "call_id": format!("c{i}")});
        let call = call_of(&f.intent(intent, 0));
        f.outcome(&call, Outcome::Ok { output: json!(i) }, 10);
        steps.push(call.step);
    }
    let later = 10 + 3_600_000;
    // The second chunk is decided while the first still commits (stacked
    // batches): it must take the next ten records, not find the same ten.
    let mut first = Batch::default();
    let r = f.core.purge(&f.store, &mut first, [0], later, 10).unwrap();
    assert_eq!(
        r,
        Purged {
            removed: 10,
            kept: 0,
            more: true
        }
    );
    let first = Arc::new(first);
    let mut second = Batch::on_top_of(Some(first.clone()));
    let r = f.core.purge(&f.store, &mut second, [0], later, 10).unwrap();
    assert_eq!(
        r,
        Purged {
            removed: 10,
            kept: 0,
            more: true
        }
    );
    f.store
        .apply(&first, &crate::state::Landing::default())
        .unwrap();
    second.detach();
    f.commit(second);
    let mut third = Batch::default();
    let r = f.core.purge(&f.store, &mut third, [0], later, 10).unwrap();
    assert_eq!(
        r,
        Purged {
            removed: 5,
            kept: 0,
            more: false
        }
    );
    f.commit(third);
    for s in &steps {
        assert!(f.store.step(0, s).unwrap().is_none(), "{s} was not purged");
    }
}

#[test]
fn an_intent_older_than_the_retention_without_a_record_is_not_run() {
    let mut f = Fixture::new();
    let hour = 3_600_000;
    let now = 10 * hour;
    // A settled step, then an old copy of another step re-read (as after lost
    // group offsets, its record long purged): dead-lettered, not run, not answered.
    let call = call_of(&f.intent(email("c1", "x"), now - 100));
    f.outcome(&call, Outcome::Ok { output: json!(1) }, now - 50);
    let mut input = f.input(
        "intents",
        json!({"workflow_id": "wf", "step_index": 2, "tool": "send_email",
            "arguments": {"subject": "old"}, "call_id": "c-old"})
        .to_string()
        .into_bytes(),
    );
    input.timestamp_ms = Some(now - hour - 1);
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, now)
        .unwrap();
    f.commit(b);
    let outs = f.outs();
    assert_eq!(outs.len(), 1, "{outs:?}");
    assert!(
        matches!(&outs[0], Out::Dlq { record, .. } if record.reason == RejectionReason::Expired),
        "{outs:?}"
    );
    // An old copy of a step that still has its record is answered from it, and
    // a call one millisecond inside the retention runs.
    let mut old_repeat = f.input("intents", email("c1-again", "x").to_string().into_bytes());
    old_repeat.timestamp_ms = Some(now - hour - 1);
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &old_repeat, f.applied, now)
        .unwrap();
    f.commit(b);
    let r = results(&f.outs());
    assert!(r.len() == 1 && r[0].deduplicated, "{r:?}");
    let mut fresh = f.input(
        "intents",
        json!({"workflow_id": "wf", "step_index": 3, "tool": "send_email",
            "arguments": {}, "call_id": "c3"})
        .to_string()
        .into_bytes(),
    );
    fresh.timestamp_ms = Some(now - hour);
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &fresh, f.applied, now)
        .unwrap();
    f.commit(b);
    assert!(f.outs().iter().any(|o| matches!(o, Out::Invoke { .. })));
}

#[test]
fn a_call_whose_commit_was_reported_failed_runs_when_its_record_says_committed() {
    let mut f = Fixture::new();
    // The batch that started it committed (the fixture applies it) but was
    // reported failed: the call was never handed to the invoker.
    let call = call_of(&f.intent(
        json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": "c1"}),
        0,
    ));
    let other = Call {
        step: StepKey {
            step_index: 9,
            ..call.step.clone()
        },
        ..call.clone()
    };
    f.core.commit_unknown([(0, call.clone()), (0, other)]);
    f.core.reset();
    f.core.load_partition(&f.store, 0, 100).unwrap();
    let started = calls_now(&f.outs());
    assert_eq!(
        started,
        vec![(0, call.clone())],
        "only the step whose record committed"
    );
    assert!(f.core.unsure.is_empty());
    // Running now: its deadline gives it time instead of declaring doubt.
    assert!(results(&f.tick(60_000)).is_empty());
    let r = results(&f.outcome(&call, Outcome::Ok { output: json!(1) }, 60_100));
    assert_eq!(r[0].status, Status::Ok);
}

#[test]
fn calls_kept_for_a_later_look_are_bounded() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(email("c1", "x"), 0));
    f.core
        .commit_unknown((0..MAX_UNSURE + 5).map(|_| (0, call.clone())));
    assert_eq!(f.core.unsure.len(), MAX_UNSURE);
}

fn mail(call_id: &str, to: &str, subject: &str) -> serde_json::Value {
    json!({"workflow_id": "wf", "step_index": 3, "tool": "mail",
        "arguments": {"to": to, "subject": subject}, "call_id": call_id})
}

#[test]
fn a_repeat_naming_another_call_by_its_identity_is_a_conflict_not_a_retry() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(mail("a1", "alice@example.com", "Hi"), 0));
    // The model replaced the lost call with another one: to bob.
    let outs = f.intent(mail("b1", "bob@example.com", "Hi"), 100);
    assert!(
        !outs.iter().any(|o| matches!(o, Out::Invoke { .. })),
        "not run"
    );
    let r = results(&outs).remove(0);
    assert_eq!(r.status, Status::Rejected);
    let e = r.error.unwrap();
    assert_eq!(e.kind, "identity_conflict");
    assert!(
        e.message.contains("alice@example.com") && e.message.contains("bob@example.com"),
        "names both calls' identity values: {}",
        e.message
    );
    assert!(
        outs.iter().any(|o| matches!(o, Out::Dlq { .. })),
        "every refusal is dead-lettered"
    );
    // A rephrased retry of alice's call is still a retry: it waits, runs nothing.
    assert!(
        f.intent(mail("a2", "alice@example.com", "Hello"), 200)
            .is_empty()
    );
    let rs = results(&f.outcome(
        &call,
        Outcome::Ok {
            output: json!("sent"),
        },
        300,
    ));
    assert_eq!(rs.len(), 2, "alice's first call and her retry: {rs:?}");
    assert!(rs.iter().all(|r| r.status == Status::Ok));
    // After settling too, bob's call never gets alice's answer.
    let r = results(&f.intent(mail("b2", "bob@example.com", "Hi"), 400)).remove(0);
    assert_eq!(r.error.unwrap().kind, "identity_conflict");
}

#[test]
fn a_commit_slower_than_the_deadline_never_turns_its_call_into_doubt() {
    // Found by the simulation with STEPGATE_SIM_SLOW_COMMITS=1 (seed
    // 0x5eed001d): the deadline passed while the batch carrying `started`
    // was still committing; the step was answered in doubt and then invoked.
    let mut f = Fixture::new();
    let wire = json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": "c1"});
    let input = f.input("intents", wire.to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 0)
        .unwrap();
    let call = call_of(&f.core.take_outs());
    // The batch is still committing at the deadline: more time, no answer.
    let mut later = Batch::default();
    f.core.on_deadlines(&f.store, &mut later, 3001).unwrap();
    assert!(results(&f.core.take_outs()).is_empty());
    // It lands; the call starts here and reports.
    f.store
        .apply(&b, &crate::state::Landing::default())
        .unwrap();
    f.core.invoked(0, &call);
    let r = results(&f.outcome(&call, Outcome::Ok { output: json!(1) }, 9000));
    assert_eq!(r[0].status, Status::Ok);
}

/// An input at partition `p`, with headers.
fn input_at(
    f: &mut Fixture,
    p: i32,
    v: &serde_json::Value,
    headers: Vec<(String, Option<Vec<u8>>)>,
) -> Input {
    let mut input = f.input("intents", v.to_string().into_bytes());
    input.partition = p;
    input.headers = headers;
    input.timestamp_ms = Some(777);
    input
}

fn feed(f: &mut Fixture, input: &Input, now: i64) -> Vec<Out> {
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, input, f.applied, now)
        .unwrap();
    f.commit(b);
    f.outs()
}

/// An outcome of a call this process ran, for partition `p`.
fn outcome_at(f: &mut Fixture, p: i32, call: &Call, outcome: Outcome, now: i64) -> Vec<Out> {
    f.core.finished(p, &call.step, call.dispatch);
    let mut b = Batch::default();
    f.core
        .on_outcome(&f.store, &mut b, p, finished(call, outcome), now)
        .unwrap();
    f.commit(b);
    f.outs()
}

fn answered_in(outs: &[Out]) -> Vec<(i32, ToolResult)> {
    outs.iter()
        .filter_map(|o| match o {
            Out::Result {
                partition, result, ..
            } => Some((*partition, result.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn an_intent_outside_its_partition_is_rerouted_and_answered_where_it_was_published() {
    let mut f = Fixture::new();
    f.core.set_intent_partitions(4);
    let owner = crate::contract::partition_for("wf", 4);
    let elsewhere = (owner + 1) % 4;
    let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    // A client on another partitioner: the first call lands elsewhere.
    let first = input_at(
        &mut f,
        elsewhere,
        &email("c1", "Order confirmed"),
        vec![("traceparent".into(), Some(tp.as_bytes().to_vec()))],
    );
    let outs = feed(&mut f, &first, 1000);
    let [
        Out::Forward {
            partition,
            key,
            payload,
            headers,
            timestamp_ms,
        },
    ] = outs.as_slice()
    else {
        panic!("one re-routed copy, nothing run or answered: {outs:?}");
    };
    assert_eq!(*partition, owner);
    assert_eq!((key, payload), (&first.key, &first.payload));
    assert_eq!(*timestamp_ms, Some(777), "the agent's publish time is kept");
    let copy = Input {
        partition: owner,
        offset: 50,
        headers: headers.clone(),
        ..first.clone()
    };
    assert!(copy.forwarded());
    assert_eq!(copy.reply_partition(Some(4)), elsewhere);
    assert_eq!(copy.traceparent().as_deref(), Some(tp));
    // In its partition it is a new step: run once, answered where it was published.
    let call = call_of(&feed(&mut f, &copy, 1001));
    assert_eq!(call.traceparent.as_deref(), Some(tp));
    // A rephrased retry published to the owner partition waits for it.
    let retry = input_at(
        &mut f,
        owner,
        &email("c2", "Your order is confirmed"),
        vec![],
    );
    assert!(feed(&mut f, &retry, 1002).is_empty());
    let outs = outcome_at(
        &mut f,
        owner,
        &call,
        Outcome::Ok {
            output: json!({"id": 1}),
        },
        1100,
    );
    let mut got = answered_in(&outs);
    got.sort_by_key(|(p, _)| *p);
    let mut want = vec![(elsewhere, "c1", false), (owner, "c2", true)];
    want.sort_by_key(|(p, _, _)| *p);
    assert_eq!(
        got.iter()
            .map(|(p, r)| (*p, r.call_id.as_deref().unwrap(), r.deduplicated))
            .collect::<Vec<_>>(),
        want
    );
    // A repeat re-routed from a third partition: answered from the record, there.
    let third = (owner + 2) % 4;
    let late = input_at(
        &mut f,
        owner,
        &email("c3", "Order confirmed!"),
        vec![
            (
                crate::contract::headers::REPLY_PARTITION.into(),
                Some(third.to_string().into_bytes()),
            ),
            (
                crate::contract::headers::FORWARDED_FROM.into(),
                Some(format!("{third}:9").into_bytes()),
            ),
        ],
    );
    let got = answered_in(&feed(&mut f, &late, 1200));
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, third);
    assert!(got[0].1.deduplicated && got[0].1.status == Status::Ok);
    // A re-routed copy found outside its partition again (the partition count
    // changed in between) is refused, never re-routed twice.
    let mut astray = late.clone();
    astray.partition = elsewhere;
    let outs = feed(&mut f, &astray, 1300);
    assert!(!outs.iter().any(|o| matches!(o, Out::Forward { .. })));
    let got = answered_in(&outs);
    assert_eq!(got[0].0, third, "refused where the agent waits");
    assert_eq!(got[0].1.error.as_ref().unwrap().kind, "wrong_partition");
}

#[test]
fn with_forwarding_off_an_intent_outside_its_partition_is_refused() {
    let mut f = Fixture::new();
    f.core.settings.wrong_partition = super::WrongPartition::Refuse;
    f.core.set_intent_partitions(4);
    let elsewhere = (crate::contract::partition_for("wf", 4) + 1) % 4;
    let input = input_at(&mut f, elsewhere, &email("c1", "Hi"), vec![]);
    let outs = feed(&mut f, &input, 1000);
    let got = answered_in(&outs);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, elsewhere);
    assert_eq!(got[0].1.error.as_ref().unwrap().kind, "wrong_partition");
    assert!(outs.iter().any(|o| matches!(o, Out::Dlq { .. })));
}

#[test]
fn a_read_rerouted_to_its_partition_is_answered_where_it_was_published() {
    let mut f = Fixture::new();
    f.core.set_intent_partitions(4);
    let owner = crate::contract::partition_for("wf", 4);
    let elsewhere = (owner + 3) % 4;
    let search = json!({"workflow_id": "wf", "step_index": 2, "tool": "search",
        "arguments": {"q": "x"}, "call_id": "s1"});
    let copy = input_at(
        &mut f,
        owner,
        &search,
        vec![
            (
                crate::contract::headers::REPLY_PARTITION.into(),
                Some(elsewhere.to_string().into_bytes()),
            ),
            (
                crate::contract::headers::FORWARDED_FROM.into(),
                Some(format!("{elsewhere}:3").into_bytes()),
            ),
        ],
    );
    let call = call_of(&feed(&mut f, &copy, 1000));
    let got = answered_in(&outcome_at(
        &mut f,
        owner,
        &call,
        Outcome::Ok { output: json!(1) },
        1001,
    ));
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, elsewhere);
}

#[test]
fn unresolved_steps_outlive_the_retention_and_expire_once_settled() {
    let mut f = Fixture::new();
    let hour = 3_600_000;
    // An unkeyed call whose outcome never came: in doubt at its deadline.
    let wire = json!({"workflow_id": "wf", "step_index": 1, "tool": "wire",
        "arguments": {"amount": 5}, "call_id": "w1"});
    let call = call_of(&f.intent(wire.clone(), 0));
    let outs = f.tick(60_000);
    assert_eq!(results(&outs)[0].status, Status::InDoubt);
    // Long past the retention: kept, not purged.
    let mut b = Batch::default();
    let r = f.core.purge(&f.store, &mut b, [0], 10 * hour, 100).unwrap();
    assert_eq!((r.removed, r.kept), (0, 1));
    f.commit(b);
    let kept = f.store.step(0, &call.step).unwrap().expect("kept");
    assert_eq!(kept.phase, Phase::InDoubt);
    assert_eq!(kept.expires_at_ms, KEPT_UNTIL_RESOLVED);
    // Nothing more to do for it in later rounds.
    let mut b = Batch::default();
    let r = f
        .core
        .purge(&f.store, &mut b, [0], 100 * hour, 100)
        .unwrap();
    assert_eq!(r, Purged::default());
    // Its retry, days later, is answered in doubt, not run again.
    let mut retry = wire.clone();
    retry["call_id"] = json!("w2");
    let outs = f.intent(retry, 100 * hour);
    assert!(
        !outs.iter().any(|o| matches!(o, Out::Invoke { .. })),
        "{outs:?}"
    );
    assert_eq!(results(&outs)[0].status, Status::InDoubt);
    // Settled by an operator: expires a retention later, like any settled step.
    let resolve = Command {
        id: "op-1".into(),
        step: call.step.clone(),
        action: Action::ResolveExecuted {
            output: json!({"ok": true}),
        },
        by: "ops".into(),
        at: "2026-12-02T00:00:00Z".into(),
        reason: None,
        run: None,
        arguments_sha256: None,
        policy_version: None,
        evidence: None,
    };
    let input = f.input("commands", serde_json::to_vec(&resolve).unwrap());
    let mut b = Batch::default();
    f.core
        .on_command(&f.store, &mut b, &input, 101 * hour)
        .unwrap();
    f.commit(b);
    f.outs();
    let settled = f.store.step(0, &call.step).unwrap().unwrap();
    assert_eq!(settled.phase, Phase::Completed);
    assert_eq!(settled.expires_at_ms, 102 * hour);
    let mut b = Batch::default();
    let r = f
        .core
        .purge(&f.store, &mut b, [0], 102 * hour, 100)
        .unwrap();
    assert_eq!((r.removed, r.kept), (1, 0));
}

/// The dedup rate's counters (#30): a repeat of a recorded step counts as a
/// repeat of its tool and as one of its effectful calls; a fast-path read —
/// run again, never deduplicated — counts as neither, and neither does a
/// refused intent. The rate (repeats ÷ effectful calls) is per tool.
#[test]
fn a_repeat_counts_toward_its_tools_dedup_rate_and_a_fast_path_read_does_not() {
    let mut f = Fixture::new();
    let config = Config::from_toml_str(CONFIG, Vec::new()).unwrap();
    let metrics = Arc::new(Metrics::with_tools(config.tool_names()));
    f.core = GateCore::new(&config, metrics.clone());
    let call = call_of(&f.intent(email("c1", "hi"), 0));
    // A repeat while the step is in flight, and one once it is settled.
    assert!(f.intent(email("c2", "hi"), 10).is_empty());
    f.outcome(&call, Outcome::Ok { output: json!(1) }, 20);
    f.intent(email("c3", "hi, rephrased"), 30);
    // The same read twice: two fast-path calls, no step, no repeat.
    let q = json!({"workflow_id": "wf", "step_index": 5, "tool": "search", "arguments": {"q": "x"}, "call_id": "s1"});
    f.intent(q.clone(), 40);
    f.intent(q, 50);
    // Refused: no tool of that name; unreadable.
    f.intent(
        json!({"workflow_id": "wf", "step_index": 6, "tool": "nope", "arguments": {}}),
        60,
    );
    let input = f.input("intents", b"{broken".to_vec());
    f.core
        .on_intent(&f.store, &mut Batch::default(), &input, f.applied, 70)
        .unwrap();
    let out = metrics.render();
    for line in [
        r#"stepgate_effectful_calls_total{tool="send_email"} 3"#,
        r#"stepgate_repeats_total{state="in_flight",tool="send_email"} 1"#,
        r#"stepgate_repeats_total{state="completed",tool="send_email"} 1"#,
        r#"stepgate_effectful_calls_total{tool="search"} 0"#,
        r#"stepgate_repeats_total{state="completed",tool="search"} 0"#,
        r#"stepgate_fast_path_calls_total{tool="search"} 2"#,
        // A configured tool with no call yet reads 0, not nothing.
        r#"stepgate_effectful_calls_total{tool="wire"} 0"#,
        r#"stepgate_intents_received_total{tool="send_email"} 3"#,
        r#"stepgate_intents_received_total{tool="search"} 2"#,
        r#"stepgate_intents_received_total{tool="unknown"} 2"#,
    ] {
        assert!(out.contains(line), "{line} in\n{out}");
    }
    assert!(!out.contains(r#"stepgate_effectful_calls_total{tool="unknown"}"#));
}

fn pool_call(tool: &str, step: u64, call_id: &str) -> serde_json::Value {
    json!({"workflow_id": "wf", "step_index": step, "tool": tool,
        "arguments": {}, "call_id": call_id})
}

/// Outcome v1 `started`: a pool's worker took the call.
fn taken(call: &Call) -> Progress {
    Progress {
        event: ProgressEvent::Started,
        ..finished(
            call,
            Outcome::Ok {
                output: json!(null),
            },
        )
    }
}

/// A pool's call (docs/design.md "Worker pools") that no worker took is
/// answered `no_worker` at its deadline (2 s + 1 s grace): never invoked. One
/// a worker took is a call that may have run: its deadline counts from when
/// it was taken, and an `unkeyed` one is then `in_doubt`.
#[test]
fn a_pool_call_never_taken_is_no_worker_and_one_taken_and_silent_is_in_doubt() {
    let mut f = Fixture::new();
    let lonely = call_of(&f.intent(pool_call("gpu_wire", 1, "p1"), 1000));
    assert!(f.tick(3999).is_empty());
    let r = results(&f.tick(4001)).remove(0);
    assert_eq!(r.status, Status::Error);
    assert_eq!(r.error.as_ref().unwrap().kind, "no_worker");
    assert!(r.error.unwrap().message.contains("`gpu`"));
    assert_eq!(
        f.store.step(0, &lonely.step).unwrap().unwrap().phase,
        Phase::Completed
    );

    let held = call_of(&f.intent(pool_call("gpu_wire", 2, "p2"), 10_000));
    assert!(f.progress(taken(&held), 12_000).is_empty());
    assert!(f.tick(13_001).is_empty(), "taken at 12 s: due at 15 s");
    let r = results(&f.tick(15_001)).remove(0);
    assert_eq!(r.status, Status::InDoubt);
    assert_eq!(r.error.unwrap().kind, "executor_lost");
}

/// A `keyed` pool call taken and never answered is dispatched again (a new
/// Call v1, the same key); if no worker takes that one, the earlier run may
/// still have acted: `in_doubt`, not "not performed". Its late `ok` is kept
/// as evidence.
#[test]
fn a_keyed_pool_call_taken_then_lost_is_dispatched_again_and_never_told_not_performed() {
    let mut f = Fixture::new();
    let first = call_of(&f.intent(pool_call("gpu_keyed", 1, "k1"), 1000));
    f.progress(taken(&first), 1100);
    let again = call_of(&f.tick(4101));
    assert_eq!((again.dispatch, &again.step), (2, &first.step));
    let r = results(&f.tick(7102)).remove(0);
    assert_eq!(r.status, Status::InDoubt, "{r:?}");
    assert_eq!(r.error.unwrap().kind, "outcome_unknown");
    let late = f.progress(finished(&first, Outcome::Ok { output: json!(1) }), 8000);
    assert!(results(&late).is_empty());
    let rec = f.store.step(0, &first.step).unwrap().unwrap();
    assert_eq!(rec.phase, Phase::InDoubt);
    assert!(
        rec.evidence
            .iter()
            .any(|e| e.dispatch == 1 && e.status == "ok")
    );
}

/// A keyed step's intent re-read below the applied mark (a crash, a session
/// restart, the partition moving) with `input`'s offset.
fn reread(f: &mut Fixture, input: &Input, now: i64) -> Vec<Out> {
    reread_from(f, input, input.offset + 1, now)
}

/// The session starts over: memory dropped, partition 0 loaded again with
/// its applied mark at `applied`, its progress read.
fn restart_session(f: &mut Fixture, applied: i64, now: i64) {
    f.core.reset();
    f.core.load_partition(&f.store, 0, now).unwrap();
    f.applied = applied;
    f.core.progress_read(0);
}

/// `input` read again after the memory was dropped, with the partition's
/// applied mark at `applied` (at the intent: its deciding batch never
/// committed, and it is read as new).
fn reread_from(f: &mut Fixture, input: &Input, applied: i64, now: i64) -> Vec<Out> {
    restart_session(f, applied, now);
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, input, f.applied, now)
        .unwrap();
    f.commit(b);
    f.outs()
}

#[test]
fn a_keyed_step_writes_one_record_settled_and_holds_its_offset_until_then() {
    let mut f = Fixture::new();
    let input = f.input("intents", email("c1", "x").to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 0)
        .unwrap();
    assert!(
        b.changelog().is_empty(),
        "nothing is written before the call: {:?}",
        b.changelog()
    );
    f.commit(b);
    let call = call_of(&f.outs());
    assert_eq!(f.core.first_unanswered(0), Some(input.offset));
    assert_eq!(f.core.deferred_steps(), 1);

    f.core.finished(0, &call.step, call.dispatch);
    let mut b = Batch::default();
    let ok = Outcome::Ok {
        output: json!("sent"),
    };
    f.core
        .on_outcome(&f.store, &mut b, 0, finished(&call, ok), 50)
        .unwrap();
    assert_eq!(b.changelog().len(), 1, "one record: the settled step");
    f.commit(b);
    let rs = results(&f.outs());
    assert_eq!((rs.len(), rs[0].status), (1, Status::Ok));
    assert_eq!(f.core.first_unanswered(0), None, "the offset may move on");
    assert_eq!(f.core.deferred_steps(), 0);
    assert_eq!(
        f.store.step(0, &call.step).unwrap().unwrap().phase,
        Phase::Completed
    );
}

/// A keyed step read for the first time is sent at once, and when its outcome is in before its batch
/// closes, the decision, the settled record, the answer and the offset are
/// one transaction — one commit a new step.
#[test]
fn a_first_read_keyed_call_is_sent_before_its_batch_commits_and_settles_in_it() {
    let mut f = Fixture::new();
    let input = f.input("intents", email("c1", "x").to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 0)
        .unwrap();
    let outs = f.outs();
    let now: Vec<Call> = calls_now(&outs).into_iter().map(|(_, c)| c).collect();
    assert_eq!(now.len(), 1, "sent at once");
    assert!(
        !outs.iter().any(|o| matches!(
            o,
            Out::Invoke {
                when: When::WithBatch,
                ..
            }
        )),
        "nothing waits for the commit"
    );
    let call = &now[0];
    assert_eq!(f.core.first_unanswered(0), Some(input.offset));
    f.core.finished(0, &call.step, call.dispatch);
    let ok = Outcome::Ok {
        output: json!("sent"),
    };
    f.core
        .on_outcome(&f.store, &mut b, 0, finished(call, ok), 5)
        .unwrap();
    assert_eq!(b.changelog().len(), 1, "one record: the settled step");
    let rs = results(&f.core.take_outs());
    assert_eq!((rs.len(), rs[0].status), (1, Status::Ok));
    assert_eq!(f.core.first_unanswered(0), None, "the offset may move on");
    f.commit(b);
    assert_eq!(
        f.store.step(0, &call.step).unwrap().unwrap().phase,
        Phase::Completed
    );
}

/// A keyed call sent before any commit may follow one that a gate which
/// read the same intent before (and stopped before its commit) sent with
/// the same key. The tool's own answer under the key covers that run — a
/// 4xx is told as it is — but a try that never reached the tool does not:
/// never in doubt for that (asking again with the key is safe), the step is
/// answered so and its next call asks the tool again, under the same key,
/// and gets what the tool says. Recorded `started` first, nothing can have
/// run before, and "unreachable" is told as such.
#[test]
fn a_keyed_call_that_never_reached_its_tool_is_asked_again_by_its_next_call() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(email("c1", "x"), 0));
    assert!(f.record(&call.step).unseen_reader);
    let r = results(&f.outcome(&call, unreachable(), 500)).remove(0);
    assert_eq!(r.status, Status::Error, "{r:?}");
    let e = r.error.as_ref().unwrap();
    assert_eq!(e.kind, "tool_unreachable_unconfirmed");
    assert!(e.message.contains("could not be reached"), "{}", e.message);
    assert!(!e.message.contains("person"), "{}", e.message);
    assert_eq!(f.record(&call.step).phase, Phase::Unreached);
    // Its next call (a repeat, rephrased or not) asks the tool again, under
    // the same key, as a run of its own; the tool's answer is the step's.
    let again = call_of(&f.intent(email("c1-again", "x, again"), 600));
    assert_eq!(again.dispatch, call.dispatch + 1);
    assert_eq!(again.step.idempotency_key(), call.step.idempotency_key());
    let rs = results(&f.outcome(
        &again,
        Outcome::Ok {
            output: json!("sent"),
        },
        700,
    ));
    assert_eq!(rs.len(), 1, "{rs:?}");
    assert_eq!(rs[0].status, Status::Ok);
    assert_eq!(rs[0].call_id.as_deref(), Some("c1-again"));
    assert_eq!(f.record(&call.step).phase, Phase::Completed);

    let call = call_of(&f.intent(
        json!({"workflow_id": "wf", "step_index": 2, "tool": "send_email",
            "arguments": {"subject": "y"}, "call_id": "c2"}),
        800,
    ));
    let r = results(&f.outcome(&call, refused(), 900)).remove(0);
    assert_eq!(r.status, Status::Error, "the tool's own answer: {r:?}");
    assert_eq!(r.error.as_ref().unwrap().kind, "tool_refused");

    let mut f = Fixture::started_first();
    let outs = f.intent(email("c1", "x"), 0);
    assert!(calls_now(&outs).is_empty());
    let call = call_of(&outs);
    assert!(!f.record(&call.step).unseen_reader);
    let r = results(&f.outcome(&call, unreachable(), 500)).remove(0);
    assert_eq!(r.status, Status::Error, "{r:?}");
    assert_eq!(r.error.as_ref().unwrap().kind, "tool_unreachable");
}

/// A session restarted before the batch that decided a keyed step committed
/// (its call, sent at once, still running here) reads the intent again as
/// new: the new run is numbered above the running one, whose late outcome
/// is then evidence, never the answer.
#[test]
fn a_keyed_step_read_again_while_its_early_call_runs_is_numbered_above_it() {
    let mut f = Fixture::new();
    let input = f.input("intents", email("c1", "x").to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 0)
        .unwrap();
    let first = call_of(&f.outs());
    // The batch never committed; the session starts over.
    let again = call_of(&reread_from(&mut f, &input, input.offset, 20));
    assert_eq!(again.dispatch, first.dispatch + 1);
    assert_eq!(again.step.idempotency_key(), first.step.idempotency_key());
    // The first run's "unreachable" arrives first: evidence, no answer.
    assert!(results(&f.outcome(&first, unreachable(), 30)).is_empty());
    let rs = results(&f.outcome(
        &again,
        Outcome::Ok {
            output: json!("sent once"),
        },
        40,
    ));
    assert_eq!((rs.len(), rs[0].status), (1, Status::Ok));
}

/// Each read of a keyed intent above the applied mark numbers its run 1. A first run 1 took effect (its batch
/// never committed, and its `ok` came when no record was there to settle);
/// a second run 1, whose batch did commit, was handed back not invoked. The
/// step read again below the mark assumes a run before its own; the
/// hand-back of "run 1" must not cancel that, and its own try that never
/// reached the tool is then not "not performed": the step's next call asks
/// the tool again under the key (found by the simulation, seed 0x1e84a7 of
/// a long run).
#[test]
fn a_hand_back_of_a_reused_run_number_never_turns_unreachable_into_not_performed() {
    let mut f = Fixture::new();
    let input = f.input("intents", email("c1", "x").to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 0)
        .unwrap();
    let first = call_of(&f.outs());
    assert_eq!(first.dispatch, 1);
    // The session starts over before that batch commits; the call's `ok`
    // finds no record to settle.
    restart_session(&mut f, input.offset, 10);
    let ok = Outcome::Ok {
        output: json!("sent"),
    };
    assert!(results(&f.outcome(&first, ok, 20)).is_empty());
    // Read again as new: run 1 again, sent at once; this batch commits.
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 30)
        .unwrap();
    f.commit(b);
    let second = call_of(&f.outs());
    assert_eq!(second.dispatch, 1, "numbered as the first run");
    // The partition moves before that call starts; read again below the mark.
    let third = call_of(&reread(&mut f, &input, 40));
    assert_eq!(third.dispatch, 2);
    // A repeat waits on it: its record is written, no longer deferred, and
    // the hand-back of the second run 1 now reaches it as a run's end.
    assert!(results(&f.intent(email("c2", "x, again"), 45)).is_empty());
    assert!(!f.core.deferred.contains(0, &third.step), "written");
    assert!(results(&f.progress(not_invoked(&second), 50)).is_empty());
    let rs = results(&f.outcome(&third, unreachable(), 60));
    assert_eq!(rs.len(), 2, "the first call and the repeat: {rs:?}");
    for r in rs {
        assert_eq!(r.status, Status::Error, "{r:?}");
        assert_eq!(
            r.error.as_ref().unwrap().kind,
            "tool_unreachable_unconfirmed"
        );
    }
    assert_eq!(f.record(&third.step).phase, Phase::Unreached);
}

#[test]
fn a_re_read_keyed_intent_runs_again_with_its_key_and_never_says_not_performed() {
    let mut f = Fixture::new();
    let input = f.input("intents", email("c1", "x").to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 0)
        .unwrap();
    f.commit(b);
    let first = call_of(&f.outs());
    // The process crashes while the call runs: nothing was written. Its
    // intent is re-read (the offset was held at it) and run again, with the
    // same step key (so the same Idempotency-Key) and a higher dispatch.
    let again = call_of(&reread(&mut f, &input, 100));
    assert_eq!(again.step, first.step);
    assert_eq!(again.step.idempotency_key(), first.step.idempotency_key());
    assert_eq!(again.dispatch, 2);
    // The run before the crash may have acted: this run's "not performed"
    // alone is not the whole truth.
    let rs = results(&f.outcome(&again, refused(), 200));
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].status, Status::InDoubt, "{:?}", rs[0]);
    // Re-read once more after it settled: answered already, nothing to do.
    let outs = reread(&mut f, &input, 300);
    assert!(outs.is_empty(), "{outs:?}");
}

#[test]
fn a_re_read_keyed_step_settles_with_its_ok_and_a_fresh_one_says_not_performed() {
    let mut f = Fixture::new();
    let input = f.input("intents", email("c1", "x").to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 0)
        .unwrap();
    f.commit(b);
    let again = call_of(&reread(&mut f, &input, 100));
    let rs = results(&f.outcome(
        &again,
        Outcome::Ok {
            output: json!("sent once"),
        },
        200,
    ));
    assert_eq!((rs.len(), rs[0].status), (1, Status::Ok));
    // A step read for the first time was run by nobody before: its "not
    // performed" is told as it is.
    let call = call_of(&f.intent(
        json!({"workflow_id": "wf", "step_index": 2, "tool": "send_email",
            "arguments": {"subject": "y"}, "call_id": "c2"}),
        300,
    ));
    let rs = results(&f.outcome(&call, refused(), 400));
    assert_eq!(rs[0].status, Status::Error);
    assert_eq!(rs[0].error.as_ref().unwrap().kind, "tool_refused");
}

#[test]
fn a_repeat_re_read_after_its_step_settled_is_not_answered_twice() {
    let mut f = Fixture::new();
    let first = f.input("intents", email("c1", "x").to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &first, f.applied, 0)
        .unwrap();
    f.commit(b);
    let call = call_of(&f.outs());
    let repeat = f.input("intents", email("c2", "x again").to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &repeat, f.applied, 10)
        .unwrap();
    f.commit(b);
    let rs = results(&f.outcome(&call, Outcome::Ok { output: json!(1) }, 20));
    assert_eq!(rs.len(), 2, "the caller and the waiting repeat");
    // Both re-read (the committed offset lagged): both were answered.
    f.core.reset();
    f.core.load_partition(&f.store, 0, 30).unwrap();
    f.applied = repeat.offset + 1;
    let mut b = Batch::default();
    for input in [&first, &repeat] {
        f.core
            .on_intent(&f.store, &mut b, input, f.applied, 30)
            .unwrap();
    }
    assert!(b.changelog().is_empty());
    let outs = f.outs();
    assert!(outs.is_empty(), "{outs:?}");
}

#[test]
fn start_record_keeps_the_started_record_before_the_call() {
    let mut f = Fixture::started_first();
    let call = call_of(&f.intent(email("c1", "x"), 0));
    assert_eq!(
        f.store.step(0, &call.step).unwrap().unwrap().phase,
        Phase::Started,
        "`started` is in the batch whose commit precedes the call"
    );
    assert_eq!(f.core.first_unanswered(0), None);
}

#[test]
fn a_report_handed_over_to_a_deferred_step_is_evidence_only() {
    // Its runs are numbered afresh at each reading: a "not invoked" of run 2
    // of an earlier reading must not be taken for this reading's run 2.
    let mut f = Fixture::new();
    let input = f.input("intents", email("c1", "x").to_string().into_bytes());
    let mut b = Batch::default();
    f.core
        .on_intent(&f.store, &mut b, &input, f.applied, 0)
        .unwrap();
    f.commit(b);
    let mine = call_of(&reread(&mut f, &input, 100));
    assert_eq!(mine.dispatch, 2);
    // An earlier reading's run 2 had a token of its own, which this
    // reading's record never kept: refused, not even evidence.
    let earlier = Call {
        token: Some("0".repeat(32)),
        ..mine.clone()
    };
    let outs = f.progress(finished(&earlier, refused()), 150);
    assert!(
        results(&outs).is_empty() && refused_progress(&outs) == 1,
        "{outs:?}"
    );
    assert!(f.record(&mine.step).evidence.is_empty());
    let outs = f.progress(not_invoked(&mine), 200);
    assert!(outs.is_empty(), "not re-run, not answered: {outs:?}");
    let outs = f.progress(finished(&mine, refused()), 300);
    assert!(results(&outs).is_empty(), "{outs:?}");
    let rec = f.record(&mine.step);
    assert_eq!(rec.dispatch, 2);
    assert_eq!(rec.evidence.len(), 1, "{rec:?}");
    assert_eq!(rec.evidence[0].why, "earlier_reading");
    // This reading's own run settles it.
    let rs = results(&f.outcome(&mine, Outcome::Ok { output: json!(1) }, 400));
    assert_eq!((rs.len(), rs[0].status), (1, Status::Ok));
}

/// How many records of `progress` the decisions dead-lettered as refused.
fn refused_progress(outs: &[Out]) -> usize {
    outs.iter()
        .filter(|o| {
            matches!(o, Out::Dlq { record, .. } if record.reason == RejectionReason::RefusedProgress)
        })
        .count()
}

fn refused_count(f: &Fixture, reason: &str) -> String {
    let line = format!(r#"stepgate_progress_refused_total{{reason="{reason}"}} "#);
    let out = f.core.metrics.render();
    out.lines()
        .find(|l| l.starts_with(&line))
        .map_or("0".into(), |l| l[line.len()..].to_owned())
}

fn wire_call(call_id: &str) -> serde_json::Value {
    json!({"workflow_id": "wf", "step_index": 2, "tool": "wire", "arguments": {}, "call_id": call_id})
}

/// Security review, finding 1: whoever may write `progress` (every pool's
/// workers) sent a "not invoked" for the current run of a running unkeyed
/// step, and the gate ran it a second time, answering one clean `ok`. Only
/// a gate's hand-over with the run's token may say so now.
#[test]
fn a_forged_not_invoked_never_runs_an_unkeyed_step_again() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(wire_call("c1"), 0));
    let before = f.record(&call.step);
    // As a gate's hand-over, without the run's token, or with another's.
    for token in [None, Some("f".repeat(32))] {
        let forged = Progress {
            token,
            ..not_invoked(&call)
        };
        let outs = f.progress(forged, 500);
        assert!(
            !outs.iter().any(|o| matches!(o, Out::Invoke { .. })),
            "never run again: {outs:?}"
        );
        assert_eq!(refused_progress(&outs), 1, "{outs:?}");
    }
    // As a worker's JSON (unsigned, or signed with a pool's key): a wire is
    // no pool tool, and no worker says "not invoked".
    let json = serde_json::to_vec(&not_invoked(&call)).unwrap();
    let signature = sign(GPU_KEY, Signed::Outcome, &json);
    for headers in [
        vec![],
        vec![(SIGNATURE.to_owned(), Some(signature.into_bytes()))],
    ] {
        let outs = f.progress_raw(json.clone(), headers, 600);
        assert_eq!(refused_progress(&outs), 1, "{outs:?}");
        assert!(!outs.iter().any(|o| matches!(o, Out::Invoke { .. })));
    }
    assert_eq!(f.record(&call.step), before, "the record is untouched");
    assert_eq!(refused_count(&f, "token"), "2");
    assert_eq!(refused_count(&f, "not_pool_tool"), "2");
    // The run's own outcome is the one answer.
    let rs = results(&f.outcome(
        &call,
        Outcome::Ok {
            output: json!("paid"),
        },
        900,
    ));
    assert_eq!((rs.len(), rs[0].status), (1, Status::Ok));
}

/// A forged "not performed" of an older run must not close that run: while
/// it is open, a later run's "not performed" is in doubt.
#[test]
fn a_forged_report_of_an_older_run_neither_closes_it_nor_counts_as_evidence() {
    let mut f = Fixture::started_first();
    let first = call_of(&f.intent(email("c1", "x"), 0));
    let second = call_of(&f.tick(3001));
    assert_eq!(second.dispatch, 2);
    for forged in [not_invoked(&first), finished(&first, refused())] {
        let forged = Progress {
            token: Some("1".repeat(32)),
            ..forged
        };
        assert_eq!(refused_progress(&f.progress(forged, 3100)), 1);
    }
    let rec = f.record(&first.step);
    assert_eq!(
        rec.open_dispatches,
        vec![1, 2],
        "run 1 is still unaccounted for"
    );
    assert!(rec.evidence.is_empty(), "{rec:?}");
    let r = results(&f.progress(finished(&second, refused()), 3500)).remove(0);
    assert_eq!(r.status, Status::InDoubt, "{r:?}");
}

/// A worker's report counts only signed with its tool's pool's key and with
/// its run's token; a gate's hand-over never counts for a pool tool.
#[test]
fn a_pool_step_takes_only_its_worker_s_signed_report_with_the_run_s_token() {
    let mut f = Fixture::new();
    let call = call_of(&f.intent(pool_call("gpu_wire", 1, "p1"), 1000));
    assert!(call.token.is_some(), "the call carries its run's token");
    let fake = Outcome::Ok {
        output: json!({"paid": true, "ref": "FAKE"}),
    };
    let json = serde_json::to_vec(&finished(&call, fake.clone())).unwrap();
    let sig = |key: &[u8], v: &[u8]| {
        vec![(
            SIGNATURE.to_owned(),
            Some(sign(key, Signed::Outcome, v).into_bytes()),
        )]
    };
    // Unsigned; signed with another key; signed as a call, not an outcome.
    let as_call = sign(GPU_KEY, Signed::Call, &json).into_bytes();
    for headers in [
        vec![],
        sig(b"another-pool-s-key-of-thirty-two-bytes", &json),
        vec![(SIGNATURE.to_owned(), Some(as_call))],
    ] {
        let outs = f.progress_raw(json.clone(), headers, 1100);
        assert!(results(&outs).is_empty(), "{outs:?}");
        assert_eq!(refused_progress(&outs), 1);
    }
    // Signed, without the run's token (a worker that never read this call).
    let tokenless = serde_json::to_vec(&Progress {
        token: None,
        ..finished(&call, fake.clone())
    })
    .unwrap();
    let outs = f.progress_raw(tokenless.clone(), sig(GPU_KEY, &tokenless), 1200);
    assert!(results(&outs).is_empty() && refused_progress(&outs) == 1);
    // A gate's hand-over for a pool tool, even with the token.
    let outs = f.progress_raw(codec::encode(&finished(&call, fake)), vec![], 1300);
    assert!(results(&outs).is_empty() && refused_progress(&outs) == 1);
    // `started` with another's token claims nothing: no worker took it.
    let outs = f.progress(
        Progress {
            token: Some("2".repeat(32)),
            ..taken(&call)
        },
        1400,
    );
    assert_eq!(refused_progress(&outs), 1);
    assert_eq!(f.record(&call.step).taken, None);
    for (reason, n) in [("signature", "3"), ("token", "2"), ("pool_handover", "1")] {
        assert_eq!(refused_count(&f, reason), n, "{reason}");
    }
    // The worker's own report settles it.
    let real = Outcome::Ok {
        output: json!({"paid": true, "ref": "r-1"}),
    };
    assert!(f.progress(taken(&call), 1500).is_empty());
    let rs = results(&f.progress(finished(&call, real), 1600));
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0].output, Some(json!({"paid": true, "ref": "r-1"})));
}

#[test]
fn a_dispatch_s_token_is_kept_as_a_digest_across_reruns() {
    let mut f = Fixture::started_first();
    let first = call_of(&f.intent(email("c1", "x"), 0));
    let second = call_of(&f.tick(3001));
    let rec = f.record(&first.step);
    let (t1, t2) = (first.token.clone().unwrap(), second.token.clone().unwrap());
    assert_ne!(t1, t2, "a token per run");
    assert!(rec.token_matches(1, Some(&t1)) && rec.token_matches(2, Some(&t2)));
    assert!(!rec.token_matches(2, Some(&t1)), "a run's token is its own");
    let stored = serde_json::to_string(&rec).unwrap();
    assert!(
        !stored.contains(&t1) && !stored.contains(&t2),
        "never the token itself"
    );
}

mod lifecycle;
