//! The tool-side ledger's worked example (`examples/ticket_tool.rs`): killed
//! between committing a ticket and answering, its retry gets the stored ticket,
//! never a second one — called directly, and through stepgate on the real broker.

#![cfg(feature = "sqlite")]

use crate::common;

use common::*;
use serde_json::json;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use stepgate::contract::Status;

fn example() -> PathBuf {
    // Examples are built next to the test binaries (target/<profile>/examples).
    let exe = std::env::current_exe().unwrap();
    exe.parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join("ticket_tool")
}

/// Start the ticket tool on `addr`; returns once it listens.
fn start_tool(db: &Path, addr: &str, die_before_answer: bool) -> Child {
    let mut cmd = Command::new(example());
    cmd.arg(db)
        .arg(addr)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if die_before_answer {
        cmd.env("TICKET_TOOL_DIE_BEFORE_ANSWER", "1");
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| {
        panic!(
            "{}: {e} (built as a program by `cargo test`, as deploy/local/test.sh runs it)",
            example().display()
        )
    });
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("listening on"), "{line}");
    child
}

fn tickets(db: &Path) -> Vec<(i64, String)> {
    let conn = rusqlite::Connection::open(db).unwrap();
    let mut st = conn
        .prepare("SELECT id, title FROM tickets ORDER BY id")
        .unwrap();
    st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect()
}

async fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    for _ in 0..200 {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the tool did not die");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_effect_and_answer_the_retry_gets_the_stored_ticket() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tickets.db");
    let addr = format!("127.0.0.1:{}", free_port());
    let url = format!("http://{addr}/create_ticket");
    let http = reqwest::Client::new();
    let post = |key: &str, title: &str| {
        http.post(&url)
            .header("Idempotency-Key", key)
            .json(&json!({"title": title}))
            .send()
    };

    let mut tool = start_tool(&db, &addr, true);
    let lost = post("sg1-k1", "Printer on fire").await;
    assert!(lost.is_err(), "the answer was lost: {lost:?}");
    assert!(!wait_exit(&mut tool).await.success());
    assert_eq!(tickets(&db).len(), 1, "the effect committed");

    let mut tool = start_tool(&db, &addr, false);
    // The retry, rephrased by the model: same key, same stored ticket.
    let r = post("sg1-k1", "The printer is on fire").await.unwrap();
    assert_eq!(r.status(), 201);
    assert_eq!(r.headers()["Stepgate-Replayed"], "true");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body, json!({"ticket_id": 1, "title": "Printer on fire"}));
    assert_eq!(tickets(&db), vec![(1, "Printer on fire".to_owned())]);
    // Another step with an identical title is another ticket.
    let r = post("sg1-k2", "Printer on fire").await.unwrap();
    assert_eq!(r.headers()["Stepgate-Replayed"], "false");
    assert_eq!(tickets(&db).len(), 2);
    // No key: refused (4xx, nothing done).
    let r = http
        .post(&url)
        .json(&json!({"title": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(tickets(&db).len(), 2);
    tool.kill().unwrap();
    tool.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_stepgate_a_crashed_keyed_tool_creates_one_ticket() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tickets.db");
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let tool_tables = format!(
        "[tools.open_ticket]\ncategory = \"keyed\"\nurl = \"http://{addr}/create_ticket\"\n\
             timeout = \"2s\"\nretries = 20\nbackoff = \"100ms\"\n"
    );
    let mut s = Stack::new(StackOptions {
        tool_tables,
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let mut tool = start_tool(&db, &addr, true);
    let agent = s.agent();
    agent
        .send(&intent(
            "support-9",
            0,
            "open_ticket",
            json!({"title": "Refund order 7781"}),
            "t0",
        ))
        .await;
    // The tool commits the ticket and dies before answering; the executor
    // retries with the same key until it is back.
    assert!(!wait_exit(&mut tool).await.success());
    assert_eq!(tickets(&db).len(), 1);
    let mut tool = start_tool(&db, &addr, false);
    let r = agent.answer("t0", Duration::from_secs(30)).await;
    assert_eq!(r.status, Status::Ok, "{r:?}");
    assert_eq!(
        r.output,
        Some(json!({"ticket_id": 1, "title": "Refund order 7781"}))
    );
    assert_eq!(tickets(&db), vec![(1, "Refund order 7781".to_owned())]);
    tool.kill().unwrap();
    tool.wait().unwrap();
}
