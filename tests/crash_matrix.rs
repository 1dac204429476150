//! The crash matrix: a workload of new steps, in-flight repeats, rephrased
//! retries and deliberate attempts, run through three gates (separate
//! processes, one group; each invokes the tools of the steps it owns) while a killer `kill -9`s one of them at
//! random moments and restarts it. Checked from the tools' own invocation
//! records and the results topic:
//! - no duplicate invocation of an `unkeyed` tool (a doubtful one is `in_doubt`);
//! - no duplicate effect of a `keyed` tool (one provider key = one effect);
//! - no lost intent: every call_id gets exactly one answer;
//! - every repeat's answer identical to the first but for call_id/deduplicated.
//!
//! Short by default (runs in CI); `STEPGATE_CRASH_MATRIX=long` for the long run.
//! `STEPGATE_CRASH_SEED=n` replays a schedule.

mod common;

use common::*;
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::process::Child;
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

struct Proc {
    name: &'static str,
    args: Vec<&'static str>,
    http: String,
    child: Option<Child>,
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
    let mut down: Option<(usize, Instant)> = None;
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
        if let Some((victim, at)) = down
            && (at.elapsed() > Duration::from_millis(500 + rng.below(1500))
                || kill_at.get(kills_done) == Some(&n))
        {
            let p = &mut procs[victim];
            p.child = Some(s.spawn_other(p.name, &p.http, &p.args));
            down = None;
        }
        if kill_at.get(kills_done) == Some(&n) {
            let victim = rng.below(procs.len() as u64) as usize;
            let mut c = procs[victim].child.take().unwrap();
            c.kill().unwrap();
            c.wait().unwrap();
            kills_done += 1;
            down = Some((victim, Instant::now()));
        }
        // A steady pace, so that kills land among calls in flight.
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    if let Some((victim, _)) = down {
        let p = &mut procs[victim];
        p.child = Some(s.spawn_other(p.name, &p.http, &p.args));
    }
    // Rephrased repeats of a third of the steps, after everything.
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
        let answers = &by_call[id];
        assert_eq!(
            answers.len(),
            1,
            "{id} must be answered exactly once: {answers:?}"
        );
        by_step
            .entry((wf.clone(), *step, *tool, *attempt))
            .or_default()
            .push(answers[0].clone());
    }
    let mut in_doubt = 0;
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
        } else {
            assert_eq!(firsts[0].status, Status::Ok, "{key:?}: {:?}", firsts[0]);
        }
    }
    // Effects, from the tools' own records.
    let mut per_key: HashMap<(String, String), usize> = HashMap::new();
    for tool in ["ticket", "charge"] {
        for c in s.tools.calls(tool) {
            *per_key
                .entry((tool.to_owned(), c.idempotency_key))
                .or_default() += 1;
        }
    }
    let unkeyed_dupes = per_key
        .iter()
        .filter(|((t, _), n)| t == "ticket" && **n > 1)
        .count();
    let keyed_reruns: usize = per_key
        .iter()
        .filter(|((t, _), _)| t == "charge")
        .map(|(_, n)| n - 1)
        .sum();
    let invocations: usize = per_key.values().sum();
    let keyed_effects = per_key.keys().filter(|(t, _)| t == "charge").count();
    let keyed_steps = by_step.keys().filter(|k| k.2 == "charge").count();
    println!(
        "crash matrix: {} steps, {} calls, {kills_done} kills, {invocations} invocations, {in_doubt} in doubt, \
         {keyed_reruns} keyed re-runs (same key), duplicate unkeyed invocations: {unkeyed_dupes}, \
         duplicate keyed effects: {}, lost intents: 0, in {:.1} s",
        by_step.len(),
        calls.len(),
        keyed_effects.saturating_sub(keyed_steps),
        start.elapsed().as_secs_f64()
    );
    assert_eq!(unkeyed_dupes, 0, "an unkeyed tool ran twice for one step");
    assert!(
        keyed_effects <= keyed_steps,
        "a keyed step had two provider keys"
    );
    assert_eq!(kills_done, kills);
    for p in &mut procs {
        if let Some(mut c) = p.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
