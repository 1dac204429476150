//! The HTTP tool protocol against a real local HTTP server.
use super::*;
use crate::contract::StepKey;
use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// A server whose `/r` answers each request with the next status of `script`
/// (the last one repeats), counting requests and keeping the last headers.
async fn server(
    script: Vec<u16>,
    delay: Duration,
) -> (
    String,
    Arc<AtomicU32>,
    Arc<std::sync::Mutex<Option<HeaderMap>>>,
) {
    let hits = Arc::new(AtomicU32::new(0));
    let seen = Arc::new(std::sync::Mutex::new(None));
    let (h, s) = (hits.clone(), seen.clone());
    let app = Router::new().route(
        "/r",
        post(move |headers: HeaderMap, body: String| {
            let (h, s, script) = (h.clone(), s.clone(), script.clone());
            async move {
                let n = h.fetch_add(1, Ordering::SeqCst) as usize;
                *s.lock().unwrap() = Some(headers);
                tokio::time::sleep(delay).await;
                let code = script[n.min(script.len() - 1)];
                (
                    StatusCode::from_u16(code).unwrap(),
                    format!("{{\"echo\":{body}}}"),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}/r"), hits, seen)
}

fn registry(category: &str, url: &str, timeout: &str) -> ToolRegistry {
    let cfg = Config::from_toml_str(
        &format!(
            "[tools.t]\ncategory = \"{category}\"\nurl = \"{url}\"\ntimeout = \"{timeout}\"\nretries = 2\nbackoff = \"10ms\"\n"
        ),
        Vec::new(),
    )
    .unwrap();
    ToolRegistry::new(&cfg)
}

fn call() -> Call {
    Call {
        step: StepKey {
            workflow_id: "wf-1".into(),
            step_index: 4,
            tool: "t".into(),
            attempt: 2,
        },
        arguments: serde_json::from_str(r#"{"a":1}"#).unwrap(),
        dispatch: 1,
        fast_ref: None,
        traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
    }
}

fn kind(o: &Outcome) -> (&'static str, String) {
    match o {
        Outcome::Ok { .. } => ("ok", String::new()),
        Outcome::Error { error } => ("error", error.kind.clone()),
        Outcome::InDoubt { error } => ("in_doubt", error.kind.clone()),
    }
}

#[tokio::test]
async fn success_sends_the_protocol_headers_and_returns_the_body() {
    let (url, hits, seen) = server(vec![200], Duration::ZERO).await;
    let o = registry("keyed", &url, "5s").invoke(&call()).await;
    assert_eq!(
        o,
        Outcome::Ok {
            output: serde_json::json!({"echo": {"a": 1}})
        }
    );
    assert_eq!(hits.load(Ordering::SeqCst), 1);
    let h = seen.lock().unwrap().clone().unwrap();
    assert_eq!(h["idempotency-key"], call().step.idempotency_key().as_str());
    assert_eq!(h["stepgate-workflow-id"], "wf-1");
    assert_eq!(h["stepgate-step-index"], "4");
    assert_eq!(h["stepgate-attempt"], "2");
    assert_eq!(h["traceparent"], call().traceparent.unwrap().as_str());
}

#[tokio::test]
async fn a_4xx_is_a_definite_error_never_retried() {
    let (url, hits, _) = server(vec![422], Duration::ZERO).await;
    let o = registry("keyed", &url, "5s").invoke(&call()).await;
    assert_eq!(kind(&o), ("error", "tool_refused".into()));
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_5xx_is_retried_with_the_same_key_for_keyed_tools() {
    let (url, hits, _) = server(vec![503, 503, 200], Duration::ZERO).await;
    let o = registry("keyed", &url, "5s").invoke(&call()).await;
    assert_eq!(kind(&o).0, "ok");
    assert_eq!(hits.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_5xx_of_an_unkeyed_tool_is_in_doubt_at_once() {
    let (url, hits, _) = server(vec![503, 200], Duration::ZERO).await;
    let o = registry("unkeyed", &url, "5s").invoke(&call()).await;
    assert_eq!(kind(&o), ("in_doubt", "outcome_unknown".into()));
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_timeout_of_an_unkeyed_tool_is_in_doubt() {
    let (url, hits, _) = server(vec![200], Duration::from_millis(800)).await;
    let o = registry("unkeyed", &url, "100ms").invoke(&call()).await;
    assert_eq!(kind(&o).0, "in_doubt");
    if let Outcome::InDoubt { error } = o {
        assert!(error.message.contains("timed out"), "{}", error.message);
    }
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn exhausted_retries_of_safe_tools_say_it_is_safe_to_try_again() {
    let (url, hits, _) = server(vec![500], Duration::ZERO).await;
    let o = registry("read_only", &url, "5s").invoke(&call()).await;
    assert_eq!(kind(&o), ("error", "tool_failed".into()));
    assert_eq!(hits.load(Ordering::SeqCst), 3);
    let (url, _, _) = server(vec![500], Duration::ZERO).await;
    let o = registry("keyed", &url, "5s").invoke(&call()).await;
    assert_eq!(
        kind(&o).0,
        "in_doubt",
        "a keyed tool that may have run is in doubt"
    );
}

#[tokio::test]
async fn a_refused_connection_is_retried_for_every_category_then_not_performed() {
    // Bind then drop: nothing listens on this port.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let o = registry("unkeyed", &format!("http://127.0.0.1:{port}/r"), "1s")
        .invoke(&call())
        .await;
    assert_eq!(kind(&o), ("error", "tool_unreachable".into()));
    if let Outcome::Error { error } = o {
        assert!(error.message.contains("after 3 tries"), "{}", error.message);
    }
}

#[tokio::test]
async fn the_provider_key_goes_where_the_provider_reads_it() {
    let (url, _, seen) = server(vec![200], Duration::ZERO).await;
    let cfg = Config::from_toml_str(
        &format!(
            "[tools.t]\ncategory = \"keyed\"\nurl = \"{url}\"\nidempotency_header = \"X-Request-Id\"\nidempotency_field = \"metadata.idempotency_key\"\n"
        ),
        Vec::new(),
    )
    .unwrap();
    let o = ToolRegistry::new(&cfg).invoke(&call()).await;
    let key = call().step.idempotency_key();
    let Outcome::Ok { output } = o else {
        panic!("{o:?}")
    };
    // The echo server returns the body it received.
    assert_eq!(output["echo"]["metadata"]["idempotency_key"], key.as_str());
    assert_eq!(output["echo"]["a"], 1, "the arguments are kept");
    let h = seen.lock().unwrap().clone().unwrap();
    assert_eq!(h["x-request-id"], key.as_str());
    assert!(h.get("idempotency-key").is_none());
}
