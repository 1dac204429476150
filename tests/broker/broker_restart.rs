//! The broker goes away mid-run and comes back: stepgate waits and resumes, and
//! nothing is lost or run twice. Runs its own single-node broker (via
//! `deploy/local/kafka.sh`, on ports 19092/19093) so the shared one is undisturbed.

use crate::common;

use common::*;
use serde_json::json;
use std::process::Command;
use std::time::Duration;
use stepgate::contract::Status;

struct Broker {
    dir: tempfile::TempDir,
}

impl Broker {
    fn script(&self, action: &str) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/local/kafka.sh");
        let out = Command::new("bash")
            .arg(script)
            .arg(action)
            .env("KAFKA_PORT", "19092")
            .env("KAFKA_CONTROLLER_PORT", "19093")
            .env("KAFKA_DATA_DIR", self.dir.path())
            // Beside a three-node cluster on 2 shared cores a start can take
            // longer than kafka.sh's own 60 s default.
            .env("KAFKA_START_TIMEOUT", "180")
            .output()
            .expect("kafka.sh runs");
        assert!(
            out.status.success(),
            "kafka.sh {action}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/local/kafka.sh");
        let _ = Command::new("bash")
            .args([script, "stop"])
            .env("KAFKA_PORT", "19092")
            .env("KAFKA_CONTROLLER_PORT", "19093")
            .env("KAFKA_DATA_DIR", self.dir.path())
            .output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stepgate_rides_out_a_broker_restart() {
    let broker = Broker {
        dir: tempfile::tempdir().unwrap(),
    };
    broker.script("start");
    let mut s = Stack::new(StackOptions {
        brokers: Some("127.0.0.1:19092".into()),
        // The grace must cover the outage for outcomes queued behind it.
        grace: "10s",
        ..StackOptions::default()
    })
    .await;
    s.tools.script(
        "create_ticket",
        vec![Reply::Delay(Duration::from_millis(50))],
    );
    s.start().await;
    let agent = s.agent();
    let mut ids = Vec::new();
    for n in 0..30u64 {
        let id = format!("b{n}");
        agent
            .send(&intent(
                &format!("wf-br-{}", n % 5),
                n,
                "create_ticket",
                json!({"n": n}),
                &id,
            ))
            .await;
        ids.push(id);
    }
    for id in &ids {
        agent.answer(id, Duration::from_secs(30)).await;
    }

    // New steps whose tool calls are in flight when the broker goes down.
    s.tools.script(
        "create_ticket",
        vec![Reply::Delay(Duration::from_millis(1500))],
    );
    for n in 30..60u64 {
        let id = format!("b{n}");
        agent
            .send(&intent(
                &format!("wf-br-{}", n % 5),
                n,
                "create_ticket",
                json!({"n": n}),
                &id,
            ))
            .await;
        ids.push(id);
    }
    let tools = s.tools.clone();
    eventually(Duration::from_secs(30), "calls in flight", || {
        tools.count("create_ticket") > 30
    })
    .await;
    broker.script("stop");
    // The outage itself (not a wait for anything).
    tokio::time::sleep(Duration::from_secs(3)).await;
    broker.script("start");

    // After the outage: repeats of the earlier steps.
    let agent = s.agent();
    for n in 0..30u64 {
        let id = format!("b{n}-again");
        agent
            .send(&intent(
                &format!("wf-br-{}", n % 5),
                n,
                "create_ticket",
                json!({"n": n, "again": 1}),
                &id,
            ))
            .await;
        ids.push(id);
    }
    for id in &ids {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        while agent.answers(id).is_empty() {
            if std::time::Instant::now() >= deadline {
                let missing: Vec<&String> =
                    ids.iter().filter(|i| agent.answers(i).is_empty()).collect();
                panic!(
                    "no answer for {id} within 90 s of the broker's return; {} of {} unanswered: {missing:?}\n{}",
                    missing.len(),
                    ids.len(),
                    s.log_tail(80)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let r = agent.answer(id, Duration::from_secs(1)).await;
        assert_eq!(r.status, Status::Ok, "{id}: {r:?}\n{}", s.log_tail(80));
        assert_eq!(
            agent.answers(id).len(),
            1,
            "{id} answered once\n{}",
            s.log_tail(80)
        );
    }
    for n in 0..30u64 {
        let again = &agent.answers(&format!("b{n}-again"))[0].1;
        assert!(
            again.deduplicated,
            "b{n}-again, a repeat of a step answered before the outage, was not answered from its record: {again:?}\n{}",
            s.log_tail(80)
        );
    }
    assert_eq!(
        s.tools.count("create_ticket"),
        60,
        "each step ran once\n{}",
        s.log_tail(80)
    );
    assert!(
        s.child.as_mut().unwrap().try_wait().unwrap().is_none(),
        "stepgate is still running\n{}",
        s.log_tail(80)
    );
}
