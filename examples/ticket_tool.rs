//! A worked example of a tool written with [`stepgate::provider`]: an HTTP tool that
//! creates support tickets in SQLite, where the ticket row and the step's key row
//! commit in one transaction. A retry of the same step — even after a crash
//! between the commit and the answer — gets the stored ticket, never a second one.
//!
//! ```text
//! cargo run --example ticket_tool -- tickets.db 127.0.0.1:8090
//! ```
//! and in stepgate's config:
//! ```toml
//! [tools.create_ticket]
//! category = "keyed"        # the ledger makes this tool keyed
//! url = "http://127.0.0.1:8090/create_ticket"
//! ```
//!
//! Fault injection for the test of that crash: with
//! `TICKET_TOOL_DIE_BEFORE_ANSWER=1` the process aborts right after committing a
//! new ticket, before answering.

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use rusqlite::Connection;
use serde::Deserialize;
use std::sync::{Arc, Mutex};
use stepgate::provider::sqlite::{Ledger, LedgerError};
use stepgate::provider::{Answer, StepHeaders};

#[derive(Deserialize)]
struct NewTicket {
    title: String,
    #[serde(default)]
    body: String,
}

type Db = Arc<Mutex<Connection>>;

async fn create_ticket(
    State(db): State<Db>,
    call: StepHeaders,
    Json(t): Json<NewTicket>,
) -> Result<Answer, (axum::http::StatusCode, String)> {
    let answer = tokio::task::spawn_blocking(move || {
        let mut conn = db.lock().unwrap_or_else(|p| p.into_inner());
        Ledger::once(&mut conn, &call.idempotency_key, |tx| {
            tx.execute(
                "INSERT INTO tickets (title, body, step_key) VALUES (?1, ?2, ?3)",
                [&t.title, &t.body, &call.idempotency_key],
            )?;
            let id = tx.last_insert_rowid();
            Ok::<_, rusqlite::Error>((
                201,
                serde_json::json!({ "ticket_id": id, "title": t.title }),
            ))
        })
    })
    .await
    .map_err(|e| (axum::http::StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    .map_err(|e| {
        let detail = match e {
            LedgerError::Db(e) | LedgerError::Effect(e) => e.to_string(),
        };
        // A 5xx: stepgate retries with the same key, and the ledger keeps it once.
        (axum::http::StatusCode::SERVICE_UNAVAILABLE, detail)
    })?;
    if !answer.replayed && std::env::var_os("TICKET_TOOL_DIE_BEFORE_ANSWER").is_some() {
        eprintln!("TICKET_TOOL_DIE_BEFORE_ANSWER: ticket committed, dying before the answer");
        std::process::abort();
    }
    Ok(answer)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().unwrap_or_else(|| "tickets.db".into());
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:8090".into());
    let conn = Connection::open(&path)?;
    conn.execute_batch(
        "PRAGMA journal_mode = WAL;
         CREATE TABLE IF NOT EXISTS tickets (
             id INTEGER PRIMARY KEY, title TEXT NOT NULL, body TEXT NOT NULL, step_key TEXT NOT NULL
         );",
    )?;
    Ledger::install(&conn)?;
    let app = Router::new()
        .route("/create_ticket", post(create_ticket))
        .with_state(Arc::new(Mutex::new(conn)));
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
