//! Several `stepgate run` on one host, as the docs show them: a second process
//! that would share the first's instance id, state directory or HTTP address
//! is refused at start, naming each clash and the flag that ends it; given its
//! own, the two split the partitions.

use crate::common::{self, *};
use serde_json::json;
use std::process::Stdio;
use std::time::{Duration, Instant};
use stepgate::contract::Status;

async fn owned(http: &str) -> f64 {
    common::processes::metric_sum(http, "stepgate_partition_owned")
        .await
        .expect("the gate answers /metrics")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_gate_on_one_host_is_told_what_clashes_or_splits_the_partitions() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;

    // The same command again: refused before it reaches Kafka, with all
    // three clashes and their flags in one message.
    let out = tokio::time::timeout(Duration::from_secs(60), s.cli(&["run"]))
        .await
        .expect("a refused start ends at once");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second start was refused: {err}");
    for needle in [
        "--instance-id",
        "--state",
        "--http-listen",
        "is held by process",
    ] {
        assert!(err.contains(needle), "`{needle}` missing from:\n{err}");
    }

    // With its own instance id, state and address: both run and split the
    // partitions, and every workflow is answered.
    let http_b = format!("127.0.0.1:{}", free_port());
    let state_b = s.dir.path().join("state-b");
    let log_b = std::fs::File::create(s.dir.path().join("b.log")).unwrap();
    let mut b = std::process::Command::new(stepgate_bin())
        .args(["run", "--config"])
        .arg(&s.config_path)
        .args([
            "--instance-id",
            &format!("{}-b", s.prefix),
            "--http-listen",
            &http_b,
        ])
        .arg("--state")
        .arg(&state_b)
        .stdout(Stdio::null())
        .stderr(log_b)
        .spawn()
        .unwrap();
    wait_ready(&http_b).await;
    let partitions = f64::from(s.config.kafka.partitions);
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (a, bb) = (owned(&s.http).await, owned(&http_b).await);
        if a > 0.0 && bb > 0.0 && a + bb == partitions {
            break;
        }
        assert!(
            Instant::now() < until,
            "the partitions were not split: {a} + {bb} of {partitions}\n{}",
            s.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let agent = s.agent();
    for i in 0..8 {
        let answer = agent
            .call(intent(
                &format!("host-wf-{i}"),
                0,
                "search",
                json!({"q": i}),
                &format!("h{i}"),
            ))
            .await;
        assert_eq!(answer.status, Status::Ok, "{}", s.log_tail(40));
    }
    let _ = b.kill();
    let _ = b.wait();
}
