//! The crash matrix: a workload of new steps, in-flight repeats, rephrased
//! retries and deliberate attempts, run through three gates (separate
//! processes, one group; each invokes the tools of the steps it owns) while a killer `kill -9`s one of them at
//! random moments and restarts it. Checked from the tools' own invocation
//! records and the results topic:
//! - no duplicate invocation of an `unkeyed` tool (a doubtful one is `in_doubt`);
//! - no duplicate effect of a `keyed` tool (one provider key = one effect);
//! - no lost intent: every call_id is answered, always with the same answer
//!   (a repeat answered at once may be answered again, identically, after a kill);
//! - every repeat's answer identical to the first but for call_id/deduplicated.
//!
//! Effects are grouped by the step each invocation names (the tool's
//! `stepgate-*` headers), so a step re-run under a new key, or two steps sharing
//! one, fails the check. The last kill (every fifth in the long run) keeps its
//! gate down until another gate was assigned partitions: restore runs under load.
//!
//! Short by default (runs in CI); `STEPGATE_CRASH_MATRIX=long` for the long run.
//! `STEPGATE_CRASH_SEED=n` replays a schedule.

use crate::common;

use common::*;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};
use stepgate::contract::{Status, ToolResult};

/// A small deterministic generator (the schedule is reproducible from the seed).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// How long a killed gate stays down.
enum Down {
    For(Duration),
    /// Until another gate took partitions over (its "partitions assigned"
    /// count went past these, one per gate).
    UntilMoved(Vec<usize>),
}

/// Each gate's "partitions assigned" log lines so far.
fn assignments(s: &Stack, procs: &[Proc]) -> Vec<usize> {
    procs
        .iter()
        .map(|p| s.other_log(p.name).matches("partitions assigned").count())
        .collect()
}

/// Whether a gate other than `victim` was assigned partitions since `before`.
fn taken_over(s: &Stack, procs: &[Proc], victim: usize, before: &[usize]) -> bool {
    assignments(s, procs)
        .iter()
        .zip(before)
        .enumerate()
        .any(|(i, (now, then))| i != victim && now > then)
}

struct Proc {
    name: &'static str,
    args: Vec<&'static str>,
    http: String,
    child: Option<Killed>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_matrix() {
    let long = std::env::var("STEPGATE_CRASH_MATRIX").as_deref() == Ok("long");
    let (workflows, steps_per_wf, kills) = if long { (100, 50, 30) } else { (40, 10, 5) };
    let seed = std::env::var("STEPGATE_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    println!(
        "crash matrix: seed {seed} ({})",
        if long { "long" } else { "short" }
    );
    let mut rng = Rng(seed);

    let s = Stack::new(StackOptions {
        tools: vec![("ticket", "unkeyed", "2s"), ("charge", "keyed", "2s")],
        session_timeout: "6s",
        ..StackOptions::default()
    })
    .await;
    s.tools
        .script("ticket", vec![Reply::Delay(Duration::from_millis(150))]);
    s.tools
        .script("charge", vec![Reply::Delay(Duration::from_millis(150))]);
    let mut procs = vec![
        Proc {
            name: "gate-a",
            args: vec![],
            http: String::new(),
            child: None,
        },
        Proc {
            name: "gate-b",
            args: vec![],
            http: String::new(),
            child: None,
        },
        Proc {
            name: "gate-c",
            args: vec![],
            http: String::new(),
            child: None,
        },
    ];
    for p in &mut procs {
        p.http = format!("127.0.0.1:{}", free_port());
        p.child = Some(s.spawn_other(p.name, &p.http, &p.args));
    }
    for p in &procs {
        wait_ready(&p.http).await;
    }
    let agent = s.agent();

    // The workload, interleaved with the kills.
    let total_steps = workflows * steps_per_wf;
    let mut calls: Vec<(String, u64, &str, u64, String)> = Vec::new(); // wf, step, tool, attempt, call_id
    // Kills spread over the run, each at a random point of its own slot.
    let slot = total_steps / kills;
    let kill_at: Vec<usize> = (0..kills)
        .map(|k| k * slot + slot / 4 + rng.below((slot / 2).max(1) as u64) as usize)
        .collect();
    let mut kills_done = 0;
    let mut moved = 0;
    let mut down: Option<(usize, Instant, Down)> = None;
    let start = Instant::now();
    for n in 0..total_steps {
        let wf = format!("wf{}", n % workflows);
        let step = (n / workflows) as u64;
        let tool = if rng.below(2) == 0 {
            "ticket"
        } else {
            "charge"
        };
        let id = format!("c{n}");
        agent
            .send(&intent(&wf, step, tool, json!({"n": n}), &id))
            .await;
        calls.push((wf.clone(), step, tool, 0, id.clone()));
        if rng.below(10) == 0 {
            // An in-flight repeat, rephrased.
            let id2 = format!("c{n}-f");
            agent
                .send(&intent(
                    &wf,
                    step,
                    tool,
                    json!({"n": n, "rephrased": true}),
                    &id2,
                ))
                .await;
            calls.push((wf.clone(), step, tool, 0, id2));
        }
        if rng.below(20) == 0 {
            let id3 = format!("c{n}-a1");
            let mut i = intent(&wf, step, tool, json!({"n": n}), &id3);
            i["attempt"] = json!(1);
            agent.send(&i).await;
            calls.push((wf.clone(), step, tool, 1, id3));
        }
        if let Some((victim, at, how)) = &down {
            let back = match how {
                Down::For(d) => at.elapsed() > *d || kill_at.get(kills_done) == Some(&n),
                Down::UntilMoved(before) => taken_over(&s, &procs, *victim, before),
            };
            if back {
                if matches!(how, Down::UntilMoved(_)) {
                    moved += 1;
                }
                let p = &mut procs[*victim];
                still_free(&mut p.http);
                p.child = Some(s.spawn_other(p.name, &p.http, &p.args));
                down = None;
            }
        }
        // A kill whose moment came while a gate is kept down waits for it.
        if down.is_none() && kill_at.get(kills_done).is_some_and(|k| n >= *k) {
            let victim = rng.below(procs.len() as u64) as usize;
            // The last kill (and every fifth in the long run) keeps the gate
            // down until its partitions moved: the others restore them and
            // serve them under load, and it restores them again when it is back.
            let how = if kills_done + 1 == kills || (long && kills_done % 5 == 4) {
                Down::UntilMoved(assignments(&s, &procs))
            } else {
                Down::For(Duration::from_millis(500 + rng.below(1500)))
            };
            let mut c = procs[victim].child.take().unwrap();
            c.kill().unwrap();
            c.wait().unwrap();
            kills_done += 1;
            down = Some((victim, Instant::now(), how));
        }
        // A steady pace, so that kills land among calls in flight.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    for n in (0..total_steps).step_by(3) {
        let (wf, step, tool, _, _) = calls
            .iter()
            .find(|c| c.4 == format!("c{n}"))
            .unwrap()
            .clone();
        let id = format!("c{n}-late");
        agent
            .send(&intent(
                &wf,
                step,
                tool,
                json!({"n": n, "later": true}),
                &id,
            ))
            .await;
        calls.push((wf, step, tool, 0, id));
    }
    if let Some((victim, _, how)) = down {
        if let Down::UntilMoved(before) = how {
            eventually(
                Duration::from_secs(90),
                "the killed gate's partitions moved",
                || taken_over(&s, &procs, victim, &before),
            )
            .await;
            moved += 1;
        }
        let p = &mut procs[victim];
        still_free(&mut p.http);
        p.child = Some(s.spawn_other(p.name, &p.http, &p.args));
    }
    let limit = Duration::from_secs(if long { 600 } else { 180 });
    eventually(limit, "every call answered", || {
        let answered: std::collections::HashSet<String> = agent
            .results
            .all()
            .into_iter()
            .filter_map(|r| r.value["call_id"].as_str().map(str::to_owned))
            .collect();
        calls.iter().all(|c| answered.contains(&c.4))
    })
    .await;
    // A window for late duplicate answers to show; passing never depends on it.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // Exactly one answer per call; repeats identical to the first answer.
    let mut by_call: HashMap<String, Vec<ToolResult>> = HashMap::new();
    for r in agent.results.all() {
        let t: ToolResult = serde_json::from_value(r.value).unwrap();
        by_call
            .entry(t.call_id.clone().unwrap_or_default())
            .or_default()
            .push(t);
    }
    let mut by_step: BTreeMap<(String, u64, &str, u64), Vec<ToolResult>> = BTreeMap::new();
    for (wf, step, tool, attempt, id) in &calls {
        let answer = the_one_answer(id, &by_call[id]);
        by_step
            .entry((wf.clone(), *step, *tool, *attempt))
            .or_default()
            .push(answer.clone());
    }
    let mut in_doubt = 0;
    let mut in_doubt_steps = Vec::new();
    for (key, answers) in &by_step {
        let firsts: Vec<&ToolResult> = answers.iter().filter(|a| !a.deduplicated).collect();
        assert_eq!(
            firsts.len(),
            1,
            "{key:?}: one caller caused the invocation: {answers:?}"
        );
        for a in answers {
            same_but_call_id(firsts[0], a);
        }
        if firsts[0].status == Status::InDoubt {
            in_doubt += 1;
            in_doubt_steps.push(key.clone());
        } else {
            assert_eq!(firsts[0].status, Status::Ok, "{key:?}: {:?}", firsts[0]);
        }
    }
    // Effects, from the tools' own records, grouped by the step each
    // invocation names (stepgate's headers), never by its key: a re-run under
    // a second key, or two steps under one key, shows here.
    let asked: std::collections::HashSet<(String, String, String, String)> = by_step
        .keys()
        .map(|(wf, step, tool, attempt)| {
            (
                tool.to_string(),
                wf.clone(),
                step.to_string(),
                attempt.to_string(),
            )
        })
        .collect();
    let mut runs: HashMap<(String, String, String, String), Vec<String>> = HashMap::new();
    for tool in ["ticket", "charge"] {
        for c in s.tools.calls(tool) {
            let h = |k: &str| c.headers.get(k).cloned().unwrap_or_default();
            runs.entry((
                tool.to_owned(),
                h("stepgate-workflow-id"),
                h("stepgate-step-index"),
                h("stepgate-attempt"),
            ))
            .or_default()
            .push(c.idempotency_key);
        }
    }
    let unasked: Vec<_> = runs.keys().filter(|k| !asked.contains(*k)).collect();
    assert!(
        unasked.is_empty(),
        "invocations of steps nobody asked for: {unasked:?}"
    );
    let unkeyed_dupes = runs
        .iter()
        .filter(|(k, v)| k.0 == "ticket" && v.len() > 1)
        .count();
    let charged: Vec<_> = runs.iter().filter(|(k, _)| k.0 == "charge").collect();
    let keyed_reruns: usize = charged.iter().map(|(_, v)| v.len() - 1).sum();
    // What a provider that deduplicates by key performs: one effect per
    // distinct key. One per step invoked, unless a step changed keys.
    let keyed_effects = s.tools.effects("charge");
    let split_steps: Vec<_> = charged
        .iter()
        .filter(|(_, v)| v.iter().collect::<std::collections::HashSet<_>>().len() > 1)
        .collect();
    let distinct_keys: std::collections::HashSet<&String> =
        charged.iter().flat_map(|(_, v)| v.iter()).collect();
    let invocations: usize = runs.values().map(Vec::len).sum();
    // In doubt is honest when the call may have run; one never sent to the
    // tool was doubt that a record could have avoided (printed, not failed:
    // a kill between the `started` commit and the call is such a case).
    let never_invoked = in_doubt_steps
        .iter()
        .filter(|(wf, step, tool, attempt)| {
            !runs.contains_key(&(
                tool.to_string(),
                wf.clone(),
                step.to_string(),
                attempt.to_string(),
            ))
        })
        .count();
    println!(
        "crash matrix: {} steps, {} calls, {kills_done} kills ({moved} kept down until their partitions moved), \
         {invocations} invocations, {in_doubt} in doubt ({never_invoked} of them never invoked), {keyed_reruns} keyed re-runs (same key), \
         duplicate unkeyed invocations: {unkeyed_dupes}, duplicate keyed effects: {}, lost intents: 0, in {:.1} s",
        by_step.len(),
        calls.len(),
        keyed_effects - charged.len().min(keyed_effects),
        start.elapsed().as_secs_f64()
    );
    assert_eq!(unkeyed_dupes, 0, "an unkeyed tool ran twice for one step");
    assert!(
        split_steps.is_empty(),
        "keyed steps invoked under two keys (two effects): {split_steps:?}"
    );
    assert_eq!(
        distinct_keys.len(),
        charged.len(),
        "two keyed steps shared one key (one of their effects was lost)"
    );
    assert_eq!(
        keyed_effects,
        charged.len(),
        "one effect per keyed step invoked"
    );
    assert!(
        moved >= 1,
        "no kill kept a gate down until its partitions moved"
    );
    assert_eq!(kills_done, kills);
    for p in &mut procs {
        if let Some(mut c) = p.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
