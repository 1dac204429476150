//! Clients nobody here wrote: Python's confluent-kafka (the schema examples and
//! the example agent loop) and kcat (a raw intent line), against the binary.

use crate::common;

use common::*;
use std::process::Command;
use std::time::Duration;
use stepgate::contract::Status;

fn python(s: &Stack, script: &str, args: &[&str]) -> String {
    let out = Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/").to_owned() + script)
        .args(args)
        .output()
        .expect("python3 runs (deploy/local/test.sh installs confluent-kafka)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed:\n{stdout}\n{}\n--- stepgate log ---\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log_tail(80)
    );
    stdout
}

/// Publish one line to the intents topic with kcat, keyed by `key`, with
/// `extra` kcat arguments (partitioner, partition, compression).
fn kcat_publish(s: &Stack, key: &str, extra: &[&str], line: &str) {
    use std::io::Write;
    let mut child = Command::new("kcat")
        .args([
            "-P",
            "-b",
            &s.config.kafka.brokers,
            "-t",
            &s.config.kafka.topics.intents,
            "-k",
            key,
        ])
        .args(extra)
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("kcat runs (deploy/local/test.sh installs it)");
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{line}").unwrap();
    drop(stdin);
    assert!(child.wait().unwrap().success(), "kcat {extra:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_confluent_kafka_publishes_the_schema_examples_and_reads_answers() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let t = &s.config.kafka.topics;
    let out = python(
        &s,
        "tests/interop/python_agent.py",
        &[
            &s.config.kafka.brokers,
            &t.intents,
            &t.results,
            concat!(env!("CARGO_MANIFEST_DIR"), "/schemas"),
            "send_email",
        ],
    );
    assert!(out.contains("python interop:"), "{out}");
    assert_eq!(
        s.tools.count("send_email"),
        1,
        "one schema example, its rephrased repeat never ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_example_agent_loop_runs() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let t = &s.config.kafka.topics;
    let out = python(
        &s,
        "examples/agent_loop.py",
        &[
            "--brokers",
            &s.config.kafka.brokers,
            "--intents",
            &t.intents,
            "--results",
            &t.results,
        ],
    );
    assert!(
        out.contains("=> same answer, the email was sent once."),
        "{out}"
    );
    assert_eq!(s.tools.count("send_email"), 1);
    assert_eq!(s.tools.count("search"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kcat_publishes_a_raw_intent_line_and_gets_its_answer_in_that_partition() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let owner = stepgate::contract::partition_for("wf-kcat", 4);
    let elsewhere = (owner + 1) % 4;
    let line = r#"{"workflow_id":"wf-kcat","step_index":1,"tool":"create_ticket","arguments":{"title":"from kcat"},"call_id":"kcat-1"}"#;
    // With the README's `-X partitioner=murmur2_random`, then the same step
    // forced into another partition (a client with another partitioner): it
    // is re-routed to its workflow's partition and answered where it was sent.
    let elsewhere_arg = elsewhere.to_string();
    let runs = [
        ("kcat-ok", vec!["-X", "partitioner=murmur2_random"]),
        ("kcat-elsewhere", vec!["-p", elsewhere_arg.as_str()]),
    ];
    for (id, extra) in &runs {
        kcat_publish(&s, "wf-kcat", extra, &line.replace("kcat-1", id));
    }
    let ok = agent.answer("kcat-ok", Duration::from_secs(30)).await;
    assert_eq!(ok.status, Status::Ok);
    assert_eq!(
        agent.answers("kcat-ok")[0].0,
        owner,
        "answered in the workflow's partition"
    );
    let other = agent
        .answer("kcat-elsewhere", Duration::from_secs(30))
        .await;
    assert_eq!(other.status, Status::Ok, "{other:?}");
    assert_eq!(other.output, ok.output, "the step's one answer");
    assert!(
        ok.deduplicated != other.deduplicated,
        "one first answer, one repeat"
    );
    assert_eq!(
        agent.answers("kcat-elsewhere")[0].0,
        elsewhere,
        "answered in the partition it reached"
    );
    assert_eq!(s.tools.count("create_ticket"), 1, "the step ran once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_example_agent_runs() {
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    // Examples are built next to the test binaries (target/<profile>/examples).
    let exe = std::env::current_exe().unwrap();
    let example = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("agent");
    let t = &s.config.kafka.topics;
    let out = Command::new(&example)
        .args([
            &s.config.kafka.brokers,
            "wf-example",
            &t.intents,
            &t.results,
        ])
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (built by `cargo test --all-targets`)",
                example.display()
            )
        });
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("step 0 again: deduplicated=true"),
        "{stdout}"
    );
    assert!(stdout.contains("step 0, attempt 1: Ok"), "{stdout}");
    assert_eq!(
        s.tools.count("send_email"),
        2,
        "the original and the deliberate retry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intents_compressed_with_each_codec_a_client_may_use_are_answered() {
    // Java clients are often configured with `compression.type=zstd`: a gate
    // whose librdkafka lacked a codec could not read such a batch at all.
    let mut s = Stack::new(StackOptions::default()).await;
    s.start().await;
    let agent = s.agent();
    let codecs = ["zstd", "lz4", "snappy", "gzip"];
    for (i, codec) in codecs.iter().enumerate() {
        let line = format!(
            r#"{{"workflow_id":"wf-z-{codec}","step_index":{i},"tool":"create_ticket","arguments":{{"title":"{codec}"}},"call_id":"z-{codec}"}}"#
        );
        kcat_publish(
            &s,
            &format!("wf-z-{codec}"),
            &["-X", "partitioner=murmur2_random", "-z", codec],
            &line,
        );
    }
    for codec in codecs {
        let r = agent
            .answer(&format!("z-{codec}"), Duration::from_secs(30))
            .await;
        assert_eq!(r.status, Status::Ok, "{codec}");
    }
    assert_eq!(s.tools.count("create_ticket"), codecs.len());
}
