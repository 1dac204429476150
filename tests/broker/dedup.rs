//! Deduplication by step key against a real Kafka broker (`KAFKA_BROKERS`,
//! default 127.0.0.1:9092): rephrased retries, identical arguments at two steps,
//! concurrent repeats, attempts, the partition a step lives in, reads.

use crate::common;

use common::*;
use serde_json::json;
use std::time::Duration;
use stepgate::contract::Status;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rephrased_retry_runs_once_and_gets_the_original_answer() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let first = agent
        .call(intent(
            "order-1",
            1,
            "send_email",
            json!({"to": "a@example.com", "subject": "Order confirmed"}),
            "c1",
        ))
        .await;
    let retry = agent
        .call(intent(
            "order-1",
            1,
            "send_email",
            json!({"to": "a@example.com", "subject": "Your order is confirmed"}),
            "c2",
        ))
        .await;
    assert_eq!(first.status, Status::Ok);
    assert!(!first.deduplicated && retry.deduplicated);
    assert_eq!(retry.call_id.as_deref(), Some("c2"));
    same_but_call_id(&first, &retry);
    assert_eq!(s.tools.count("send_email"), 1, "the tool ran once");
    assert_eq!(
        s.tools.calls("send_email")[0].body["subject"],
        "Order confirmed",
        "the first call's arguments ran"
    );
    let m = s.metrics().await;
    assert!(
        m.contains(r#"stepgate_rephrased_retries_total{tool="send_email"} 1"#),
        "{m}"
    );
    assert!(
        m.contains(r#"stepgate_repeats_total{state="completed",tool="send_email"} 1"#),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_arguments_at_two_steps_run_twice() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let a = agent
        .call(intent(
            "wf-t",
            1,
            "create_ticket",
            json!({"title": "Printer broken"}),
            "t1",
        ))
        .await;
    let b = agent
        .call(intent(
            "wf-t",
            2,
            "create_ticket",
            json!({"title": "Printer broken"}),
            "t2",
        ))
        .await;
    assert_eq!((a.status, b.status), (Status::Ok, Status::Ok));
    assert!(!a.deduplicated && !b.deduplicated);
    let calls = s.tools.calls("create_ticket");
    assert_eq!(calls.len(), 2);
    assert_ne!(calls[0].idempotency_key, calls[1].idempotency_key);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_concurrent_repeats_of_a_slow_step_run_once_and_all_are_answered() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.tools.script(
        "send_email",
        vec![Reply::Delay(Duration::from_millis(1500))],
    );
    s.start().await;
    let agent = s.agent();
    for n in 0..5 {
        agent
            .send(&intent(
                "wf-slow",
                7,
                "send_email",
                json!({"subject": format!("try {n}")}),
                &format!("r{n}"),
            ))
            .await;
    }
    let mut answers = Vec::new();
    for n in 0..5 {
        answers.push(agent.answer(&format!("r{n}"), WAIT).await);
    }
    assert_eq!(s.tools.count("send_email"), 1);
    assert_eq!(
        answers.iter().filter(|a| !a.deduplicated).count(),
        1,
        "exactly one caller caused the invocation"
    );
    for a in &answers[1..] {
        same_but_call_id(&answers[0], a);
    }
    for n in 0..5 {
        assert_eq!(
            agent.answers(&format!("r{n}")).len(),
            1,
            "one answer per call"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempt_one_runs_again_with_its_own_key() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    agent
        .call(intent(
            "wf-a",
            1,
            "send_email",
            json!({"subject": "x"}),
            "a0",
        ))
        .await;
    let mut again = intent("wf-a", 1, "send_email", json!({"subject": "x"}), "a1");
    again["attempt"] = json!(1);
    let r = agent.call(again).await;
    assert!(!r.deduplicated);
    assert_eq!(r.attempt, 1);
    let calls = s.tools.calls("send_email");
    assert_eq!(calls.len(), 2);
    assert_ne!(calls[0].idempotency_key, calls[1].idempotency_key);
    assert_eq!(calls[1].headers["stepgate-attempt"], "1");
    assert_eq!(calls[1].headers["stepgate-workflow-id"], "wf-a");
    assert_eq!(calls[1].headers["stepgate-step-index"], "1");
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// One call of workflow `same-key` published to each of the 4 partitions (call
/// id `p<partition>`), as clients with different partitioners would.
async fn to_every_partition(
    agent: &Agent,
    tool: &str,
    step: fn(i32) -> u64,
    headers: &[(&str, &str)],
) {
    for p in 0..4 {
        let i = intent("same-key", step(p), tool, json!({"q": p}), &format!("p{p}"));
        agent
            .send_raw("same-key", i.to_string().as_bytes(), Some(p), headers)
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intent_outside_its_workflows_partition_is_rerouted_and_answered_in_the_partition_it_reached()
 {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    // One step published to every partition, as four clients with different
    // partitioners would: it runs once, in its workflow's partition, and each
    // call is answered in the partition it was published to.
    to_every_partition(
        &agent,
        "send_email",
        |_| 100,
        &[("traceparent", TRACEPARENT)],
    )
    .await;
    let mut first = Vec::new();
    for p in 0..4 {
        agent.answer(&format!("p{p}"), WAIT).await;
        let (partition, r) = agent.answers(&format!("p{p}")).remove(0);
        assert_eq!(partition, p, "answered in the partition the intent reached");
        assert_eq!(r.status, Status::Ok, "{r:?}");
        if !r.deduplicated {
            first.push(p);
        }
    }
    assert_eq!(first.len(), 1, "one first answer, three repeats: {first:?}");
    assert_eq!(s.tools.count("send_email"), 1, "run once, in its partition");
    let calls = s.tools.calls("send_email");
    assert!(
        calls
            .iter()
            .all(|c| c.headers.get("traceparent").map(String::as_str) == Some(TRACEPARENT))
    );
    let results = agent.results.all();
    assert!(
        results
            .iter()
            .all(|r| r.headers.iter().any(|(k, _)| k == "traceparent")),
        "traceparent reaches the result"
    );
    let m = s
        .metrics_until(
            "stepgate_intents_forwarded_total{tool=\"send_email\"} 3",
            WAIT,
        )
        .await;
    assert!(
        m.contains(r#"stepgate_intents_received_total{tool="send_email"} 4"#),
        "counted once each"
    );
}

/// `gate.forward_wrong_partition = false`: an intent outside its workflow's
/// partition is refused where it reached, not run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_forwarding_an_intent_outside_its_workflows_partition_is_refused_where_it_reached()
{
    let mut s = Stack::new(StackOptions {
        configure: |c| c.gate.forward_wrong_partition = false,
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    let owner = stepgate::contract::partition_for("same-key", 4);
    to_every_partition(&agent, "send_email", |_| 100, &[]).await;
    for p in 0..4 {
        agent.answer(&format!("p{p}"), WAIT).await;
        let (partition, r) = agent.answers(&format!("p{p}")).remove(0);
        assert_eq!(partition, p, "answered in the partition the intent reached");
        if p == owner {
            assert_eq!(r.status, Status::Ok);
        } else {
            assert_eq!(r.status, Status::Rejected);
            let e = r.error.unwrap();
            assert_eq!(e.kind, "wrong_partition");
            assert!(
                e.message.contains("Nothing was performed")
                    && e.message.contains(&format!("belong to partition {owner}")),
                "{}",
                e.message
            );
        }
    }
    assert_eq!(s.tools.count("send_email"), 1, "run once, in its partition");
    let dlq = s.reader("dlq").wait_for(3, WAIT).await;
    assert!(dlq.iter().all(|r| r.value["reason"] == "wrong_partition"));
}

/// A step's first call from a client on Java's partitioner (murmur2), its
/// rephrased retry from one on librdkafka's default (`consistent_random`,
/// CRC32) that puts it in another partition: one invocation, and the retry
/// gets the first answer in the partition it was sent to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_from_a_client_on_the_default_partitioner_gets_the_first_answer_where_it_was_sent()
{
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let default_partitioner: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &s.config.kafka.brokers)
        .set("linger.ms", "0")
        .create()
        .unwrap();
    let intents = s.config.kafka.topics.intents.clone();
    // A workflow whose CRC32 partition is not its murmur2 one (found by
    // publishing: the client's partitioner is what the test is about).
    let mut found = None;
    for n in 0..64 {
        let wf = format!("wf-default-{n}");
        let owner = stepgate::contract::partition_for(&wf, 4);
        let (m, d) = (format!("m-{n}"), format!("d-{n}"));
        let first = intent(
            &wf,
            1,
            "send_email",
            json!({"subject": "Order confirmed"}),
            &m,
        );
        agent
            .send_raw(&wf, first.to_string().as_bytes(), None, &[])
            .await;
        let first = agent.answer(&m, WAIT).await;
        assert_eq!(agent.answers(&m)[0].0, owner);
        let retry = intent(
            &wf,
            1,
            "send_email",
            json!({"subject": "Your order is confirmed"}),
            &d,
        )
        .to_string();
        let partition = default_partitioner
            .send(
                FutureRecord::to(&intents).key(&wf).payload(&retry),
                Duration::from_secs(10),
            )
            .await
            .map_err(|(e, _)| e)
            .unwrap()
            .partition;
        let r = agent.answer(&d, WAIT).await;
        let (answered_in, _) = agent.answers(&d).remove(0);
        assert_eq!(answered_in, partition, "answered where it was sent");
        assert_eq!(r.status, first.status);
        assert_eq!(r.output, first.output, "the first answer");
        assert!(r.deduplicated);
        if partition != owner {
            found = Some(wf);
            break;
        }
    }
    let wf = found.expect("a workflow the two partitioners place apart, in 64 tries");
    let calls = s.tools.calls("send_email");
    assert_eq!(
        calls
            .iter()
            .filter(|c| c.headers.get("stepgate-workflow-id") == Some(&wf))
            .count(),
        1,
        "one invocation of the step"
    );
}

/// `gate.check_partition = false`: any partition is accepted (for producers
/// with a stable partitioner of their own); answers go to the intent's partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_partition_check_answers_go_to_the_intents_partition_whatever_the_partitioner()
{
    let mut s = Stack::new(StackOptions {
        configure: |c| c.gate.check_partition = false,
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let agent = s.agent();
    to_every_partition(&agent, "search", |p| 100 + p as u64, &[]).await;
    for p in 0..4 {
        agent.answer(&format!("p{p}"), WAIT).await;
        let (partition, r) = agent.answers(&format!("p{p}")).remove(0);
        assert_eq!(partition, p, "answered in the intent's partition");
        assert_eq!(r.status, Status::Ok);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_repeats_are_rerun_not_recorded() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let a = agent
        .call(intent("wf-s", 1, "search", json!({"q": "x"}), "s1"))
        .await;
    let b = agent
        .call(intent("wf-s", 1, "search", json!({"q": "x"}), "s2"))
        .await;
    assert!(!a.deduplicated && !b.deduplicated);
    assert_eq!(s.tools.count("search"), 2);
}
