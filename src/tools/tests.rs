//! The HTTP tool protocol against a real local HTTP server.
use super::*;
use crate::config::Config;
use crate::contract::StepKey;
use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

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
    ToolRegistry::new(&cfg.tools, cfg.executor.concurrency)
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
        call_id: Some("call-1".into()),
        token: None,
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
async fn a_keyed_tool_still_processing_the_key_is_asked_again_until_it_answers() {
    // A provider that answers 409 while an earlier try with the key runs:
    // the answer it finally gives is the outcome, never "not performed".
    let (url, hits, _) = server(vec![409, 409, 409, 409, 200], Duration::ZERO).await;
    let o = registry("keyed", &url, "5s").invoke(&call()).await;
    assert_eq!(kind(&o).0, "ok", "{o:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 5, "busy answers spend no try");
}

#[tokio::test]
async fn a_keyed_tool_busy_past_busy_wait_is_in_doubt_never_not_performed() {
    let (url, _, _) = server(vec![409], Duration::ZERO).await;
    let reg = registry_with("keyed", &url, "busy_wait = \"300ms\"\n");
    let o = reg.invoke(&call()).await;
    assert_eq!(kind(&o), ("in_doubt", "outcome_unknown".into()), "{o:?}");
    let Outcome::InDoubt { error } = o else {
        unreachable!()
    };
    assert!(
        error.message.contains("still being processed"),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn a_busy_status_of_an_unkeyed_tool_is_in_doubt_at_once() {
    for code in [409, 423, 425] {
        let (url, hits, _) = server(vec![code, 200], Duration::ZERO).await;
        let o = registry("unkeyed", &url, "5s").invoke(&call()).await;
        assert_eq!(kind(&o), ("in_doubt", "outcome_unknown".into()), "{code}");
        assert_eq!(hits.load(Ordering::SeqCst), 1);
    }
}

#[tokio::test]
async fn a_tool_names_its_own_busy_statuses() {
    // 409 here means a real conflict (not "in progress"): a definite refusal.
    let (url, hits, _) = server(vec![409], Duration::ZERO).await;
    let reg = registry_with("keyed", &url, "busy_statuses = [423]\n");
    assert_eq!(
        kind(&reg.invoke(&call()).await),
        ("error", "tool_refused".into())
    );
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
    let o = ToolRegistry::new(&cfg.tools, cfg.executor.concurrency)
        .invoke(&call())
        .await;
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

/// A step recorded before intents with numbers beyond a double were refused
/// may carry one (`1e400`). Where the body is rebuilt to set the key inside,
/// it is not sent as `{}` with the key — another call under the step's key —
/// but not sent at all, and the model is told it was not performed.
#[tokio::test]
async fn arguments_no_reader_holds_are_not_sent_as_others() {
    let (url, hits, _) = server(vec![200], Duration::ZERO).await;
    let r = registry_with(
        "keyed",
        &url,
        "idempotency_field = \"idempotency_key\"\nretries = 1\nbackoff = \"1ms\"\n",
    );
    let text = crate::contract::codec::encode(&"{\"amount\":1e400}");
    let mut c = call();
    c.arguments = crate::contract::codec::decode(&text).expect("read as a record's arguments");
    let o = r.invoke(&c).await;
    assert_eq!(hits.load(Ordering::SeqCst), 0, "nothing sent");
    let Outcome::Error { error } = o else {
        panic!("{o:?}")
    };
    assert!(
        error.message.contains("could not be read"),
        "{}",
        error.message
    );
    assert!(error.message.contains("not performed"), "{}", error.message);
    // Without a key inside the body the text goes as it is, byte for byte
    // (what the tool makes of it is the tool's).
    registry_with("keyed", &url, "retries = 0\n")
        .invoke(&c)
        .await;
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

/// A registry of one tool `t` at `url` with extra config lines.
fn registry_with(category: &str, url: &str, extra: &str) -> ToolRegistry {
    let cfg = Config::from_toml_str(
        &format!("[tools.t]\ncategory = \"{category}\"\nurl = \"{url}\"\n{extra}"),
        Vec::new(),
    )
    .unwrap();
    ToolRegistry::new(&cfg.tools, cfg.executor.concurrency)
}

/// Serve `app` on 127.0.0.1, port 0; the app is built knowing its own address.
async fn serve(app: impl FnOnce(std::net::SocketAddr) -> Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = app(addr);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A tool at `/r` that answers `code` with a `Location` pointing at
/// `/elsewhere`, which counts every request of any method.
async fn redirecting(code: u16) -> (String, Arc<AtomicU32>, Arc<AtomicU32>) {
    let (hits, followed) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (h, f) = (hits.clone(), followed.clone());
    let addr = serve(move |addr| {
        Router::new()
            .route(
                "/r",
                post(move || async move {
                    h.fetch_add(1, Ordering::SeqCst);
                    (
                        StatusCode::from_u16(code).unwrap(),
                        [(
                            axum::http::header::LOCATION,
                            format!("http://{addr}/elsewhere"),
                        )],
                    )
                }),
            )
            .route(
                "/elsewhere",
                axum::routing::any(move || async move {
                    f.fetch_add(1, Ordering::SeqCst);
                    axum::Json(serde_json::json!({"followed": true}))
                }),
            )
    })
    .await;
    (format!("http://{addr}/r"), hits, followed)
}

#[tokio::test]
async fn a_307_or_308_is_not_followed_and_not_performed() {
    for code in [307, 308, 301] {
        for category in ["keyed", "unkeyed", "read_only"] {
            let (url, hits, followed) = redirecting(code).await;
            let o = registry(category, &url, "5s").invoke(&call()).await;
            assert_eq!(
                kind(&o),
                ("error", "tool_redirected".into()),
                "{code} {category}"
            );
            let Outcome::Error { error } = o else {
                unreachable!()
            };
            assert!(
                error.message.contains(&format!("redirect (HTTP {code})")),
                "{}",
                error.message
            );
            assert!(
                error.message.contains("did not perform"),
                "{}",
                error.message
            );
            assert!(
                !error.message.contains("127.0.0.1"),
                "the address is never echoed"
            );
            assert_eq!(
                followed.load(Ordering::SeqCst),
                0,
                "{code}: the target saw nothing"
            );
            assert_eq!(
                hits.load(Ordering::SeqCst),
                1,
                "{code}: a redirect is not retried"
            );
        }
    }
}

#[tokio::test]
async fn a_302_or_303_is_never_turned_into_a_get() {
    for code in [302, 303] {
        // A tool that is not safe to re-run may have acted before redirecting.
        for category in ["keyed", "unkeyed"] {
            let (url, hits, followed) = redirecting(code).await;
            let o = registry(category, &url, "5s").invoke(&call()).await;
            assert_eq!(
                kind(&o),
                ("in_doubt", "tool_redirected".into()),
                "{code} {category}"
            );
            assert_eq!(
                followed.load(Ordering::SeqCst),
                0,
                "{code}: no GET elsewhere"
            );
            assert_eq!(hits.load(Ordering::SeqCst), 1);
        }
        for category in ["read_only", "idempotent"] {
            let (url, hits, followed) = redirecting(code).await;
            let o = registry(category, &url, "5s").invoke(&call()).await;
            assert_eq!(
                kind(&o),
                ("error", "tool_redirected".into()),
                "{code} {category}"
            );
            assert_eq!(
                followed.load(Ordering::SeqCst),
                0,
                "{code}: no GET elsewhere"
            );
            assert_eq!(hits.load(Ordering::SeqCst), 1);
        }
    }
}

/// A tool at `/r` answering 200 with `body`.
async fn answering(body: impl Fn() -> axum::body::Body + Clone + Send + Sync + 'static) -> String {
    let addr = serve(move |_| {
        Router::new().route(
            "/r",
            post(move || {
                let body = body.clone();
                async move { body() }
            }),
        )
    })
    .await;
    format!("http://{addr}/r")
}

#[tokio::test]
async fn an_endless_2xx_body_ends_at_the_cap_as_output_too_large() {
    // Chunked, no length, never ending: reading it to the end would hang
    // until the timeout and end in doubt instead.
    let url = answering(|| {
        let chunk = axum::body::Bytes::from(vec![b'x'; 64 * 1024]);
        axum::body::Body::from_stream(futures::stream::repeat_with(move || {
            Ok::<_, std::io::Error>(chunk.clone())
        }))
    })
    .await;
    let reg = registry_with(
        "unkeyed",
        &url,
        "timeout = \"30s\"\nmax_output_bytes = 100000\n",
    );
    let o = tokio::time::timeout(Duration::from_secs(20), reg.invoke(&call()))
        .await
        .expect("the body is not read to its end");
    assert_eq!(kind(&o), ("error", "output_too_large".into()));
    let Outcome::Error { error } = o else {
        unreachable!()
    };
    assert!(
        error.message.contains("ran and succeeded"),
        "{}",
        error.message
    );
    assert!(
        error
            .message
            .contains("more than the limit of 100000 bytes"),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn a_declared_length_over_the_cap_is_refused_before_reading() {
    let url = answering(|| axum::body::Body::from(vec![b'1'; 10 * 1024 * 1024])).await;
    let o = registry_with("keyed", &url, "max_output_bytes = 4096\n")
        .invoke(&call())
        .await;
    assert_eq!(kind(&o), ("error", "output_too_large".into()));
    let Outcome::Error { error } = o else {
        unreachable!()
    };
    assert!(
        error
            .message
            .contains("10485760 bytes, over the limit of 4096 bytes"),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn a_body_of_exactly_the_cap_is_the_output() {
    // 4096 bytes: exactly what the cap allows.
    let url = answering(|| axum::body::Body::from(vec![b'7'; 4096])).await;
    let o = registry_with("keyed", &url, "max_output_bytes = 4096\n")
        .invoke(&call())
        .await;
    assert_eq!(kind(&o).0, "ok", "{o:?}");
    // Chunked, one byte over: the cap counts the bytes that arrive.
    let url = answering(|| {
        axum::body::Body::from_stream(futures::stream::iter(
            [vec![b'7'; 4000], vec![b'7'; 97]].map(Ok::<_, std::io::Error>),
        ))
    })
    .await;
    let o = registry_with("keyed", &url, "max_output_bytes = 4096\n")
        .invoke(&call())
        .await;
    assert_eq!(kind(&o), ("error", "output_too_large".into()));
}

#[tokio::test]
async fn a_4xx_body_is_read_only_as_far_as_the_message_needs() {
    // An endless refusal still ends at once, with an excerpt.
    let addr = serve(|_| {
        Router::new().route(
            "/r",
            post(|| async {
                let chunk = axum::body::Bytes::from_static(b"no no ");
                (
                    StatusCode::UNPROCESSABLE_ENTITY,
                    axum::body::Body::from_stream(futures::stream::repeat_with(move || {
                        Ok::<_, std::io::Error>(chunk.clone())
                    })),
                )
            }),
        )
    })
    .await;
    let reg = registry_with("keyed", &format!("http://{addr}/r"), "timeout = \"30s\"\n");
    let o = tokio::time::timeout(Duration::from_secs(20), reg.invoke(&call()))
        .await
        .expect("the refusal is not read to its end");
    assert_eq!(kind(&o), ("error", "tool_refused".into()));
    let Outcome::Error { error } = o else {
        unreachable!()
    };
    assert!(
        error.message.contains("Its answer: no no no"),
        "{}",
        error.message
    );
}

/// A tool at `/r` that holds each request until the test lets one go
/// (`release.add_permits`), tracking how many are in the handler at once and
/// how many it has answered: `(in_flight, answered)`.
struct Holding {
    url: String,
    in_flight: tokio::sync::watch::Receiver<(u32, u32)>,
    peak: Arc<AtomicU32>,
    release: Arc<tokio::sync::Semaphore>,
}

async fn holding() -> Holding {
    let (tx, in_flight) = tokio::sync::watch::channel((0u32, 0u32));
    let tx = Arc::new(tx);
    let peak = Arc::new(AtomicU32::new(0));
    let release = Arc::new(tokio::sync::Semaphore::new(0));
    let (p, r) = (peak.clone(), release.clone());
    let addr = serve(move |_| {
        Router::new().route(
            "/r",
            post(move || {
                let (tx, p, r) = (tx.clone(), p.clone(), r.clone());
                async move {
                    tx.send_modify(|(n, _)| {
                        *n += 1;
                        p.fetch_max(*n, Ordering::SeqCst);
                    });
                    r.acquire().await.unwrap().forget();
                    tx.send_modify(|(n, answered)| {
                        *n -= 1;
                        *answered += 1;
                    });
                    axum::Json(serde_json::json!({"done": true}))
                }
            }),
        )
    })
    .await;
    Holding {
        url: format!("http://{addr}/r"),
        in_flight,
        peak,
        release,
    }
}

async fn until_in_flight(h: &mut Holding, want: impl Fn(u32, u32) -> bool) {
    tokio::time::timeout(
        Duration::from_secs(10),
        h.in_flight.wait_for(|&(n, answered)| want(n, answered)),
    )
    .await
    .expect("the tool saw the expected calls in time")
    .unwrap();
}

#[tokio::test]
async fn max_concurrency_bounds_the_calls_in_flight_at_the_tool() {
    let mut tool = holding().await;
    let reg = Arc::new(registry_with(
        "keyed",
        &tool.url,
        "timeout = \"30s\"\nmax_concurrency = 2\n",
    ));
    let calls: Vec<_> = (0..6)
        .map(|i| {
            let reg = reg.clone();
            tokio::spawn(async move {
                let mut c = call();
                c.step.step_index = i;
                reg.invoke(&c).await
            })
        })
        .collect();
    // Let the calls go one at a time: each time, the next waiting one takes
    // the free slot, and no third one ever reaches the tool.
    for answered in 0..6u32 {
        let want = (6 - answered).min(2);
        until_in_flight(&mut tool, |n, a| a == answered && n == want).await;
        tool.release.add_permits(1);
    }
    for c in calls {
        let o = tokio::time::timeout(Duration::from_secs(10), c)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(kind(&o).0, "ok", "{o:?}");
    }
    assert_eq!(
        tool.peak.load(Ordering::SeqCst),
        2,
        "two at once, never more"
    );
}

#[tokio::test]
async fn a_call_that_gets_no_slot_in_time_was_not_sent() {
    let mut tool = holding().await;
    let reg = Arc::new(registry_with(
        "unkeyed",
        &tool.url,
        "timeout = \"30s\"\nretries = 1\nbackoff = \"10ms\"\nmax_concurrency = 1\nqueue_timeout = \"200ms\"\n",
    ));
    let first = {
        let reg = reg.clone();
        tokio::spawn(async move { reg.invoke(&call()).await })
    };
    until_in_flight(&mut tool, |n, _| n == 1).await;
    let o = reg.invoke(&call()).await;
    assert_eq!(kind(&o), ("error", "tool_unreachable".into()));
    let Outcome::Error { error } = o else {
        unreachable!()
    };
    assert!(
        error
            .message
            .contains("after 2 tries (all 1 of its concurrent call slots stayed busy for 200ms)"),
        "{}",
        error.message
    );
    assert_eq!(
        *tool.in_flight.borrow(),
        (1, 0),
        "the second call never reached the tool"
    );
    tool.release.add_permits(1);
    let o = tokio::time::timeout(Duration::from_secs(10), first)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kind(&o).0, "ok");
    assert_eq!(tool.peak.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_timeout_counts_from_the_slot_and_still_applies_after_it() {
    // One slot, a 2 s timeout. The tool takes 1.2 s for the first two
    // requests and never answers the third.
    let hits = Arc::new(AtomicU32::new(0));
    let h = hits.clone();
    let addr = serve(move |_| {
        Router::new().route(
            "/r",
            post(move || {
                let h = h.clone();
                async move {
                    let n = h.fetch_add(1, Ordering::SeqCst) + 1;
                    let hold = if n <= 2 { 1200 } else { 600_000 };
                    tokio::time::sleep(Duration::from_millis(hold)).await;
                    axum::Json(serde_json::json!({"n": n}))
                }
            }),
        )
    })
    .await;
    let reg = Arc::new(registry_with(
        "unkeyed",
        &format!("http://{addr}/r"),
        "timeout = \"2s\"\nmax_concurrency = 1\nqueue_timeout = \"30s\"\n",
    ));
    let started = std::time::Instant::now();
    let calls: Vec<_> = (0..3)
        .map(|i| {
            let reg = reg.clone();
            tokio::spawn(async move {
                let mut c = call();
                c.step.step_index = i;
                let o = reg.invoke(&c).await;
                (o, started.elapsed())
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for c in calls {
        outcomes.push(
            tokio::time::timeout(Duration::from_secs(30), c)
                .await
                .unwrap()
                .unwrap(),
        );
    }
    outcomes.sort_by_key(|(_, took)| *took);
    // The second request waited ~1.2 s for the slot and ran 1.2 s: longer than
    // its 2 s timeout in all, yet it is the tool's answer.
    let (second, took) = &outcomes[1];
    assert_eq!(
        second,
        &Outcome::Ok {
            output: serde_json::json!({"n": 2})
        }
    );
    assert!(*took > Duration::from_secs(2), "{took:?}");
    // The third got the slot after ~2.4 s; its own 2 s then ran out.
    let (third, took) = &outcomes[2];
    assert_eq!(
        kind(third),
        ("in_doubt", "outcome_unknown".into()),
        "{third:?}"
    );
    let Outcome::InDoubt { error } = third else {
        unreachable!()
    };
    assert!(error.message.contains("timed out"), "{}", error.message);
    assert!(*took > Duration::from_millis(4000), "{took:?}");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        3,
        "every call reached the tool"
    );
}

#[tokio::test]
async fn configured_headers_arrive_on_every_call_from_env_and_file() {
    let (url, hits, seen) = server(vec![200], Duration::ZERO).await;
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("pay_key");
    // A secret file usually ends with a newline; it is not part of the value.
    std::fs::write(&key_file, "k-123\n").unwrap();
    let mut cfg = Config::from_toml_str(
        &format!(
            "[tools.t]\ncategory = \"keyed\"\nurl = \"{url}\"\n\
             headers = {{ Authorization = \"env:PAY_TOKEN\", \"X-Api-Key\" = \"file:{}\", \"X-Tenant\" = \"acme\" }}\n",
            key_file.display()
        ),
        Vec::new(),
    )
    .unwrap();
    cfg.resolve_tool_headers(|var| (var == "PAY_TOKEN").then(|| "Bearer t-456".to_owned()))
        .unwrap();
    let tools = ToolRegistry::new(&cfg.tools, cfg.executor.concurrency);
    for n in 1..=2 {
        let o = tools.invoke(&call()).await;
        assert_eq!(kind(&o).0, "ok", "{o:?}");
        assert_eq!(hits.load(Ordering::SeqCst), n);
        let h = seen.lock().unwrap().clone().unwrap();
        assert_eq!(h["authorization"], "Bearer t-456");
        assert_eq!(h["x-api-key"], "k-123");
        assert_eq!(h["x-tenant"], "acme");
        // The protocol's headers are still there, once each.
        assert_eq!(h.get_all("idempotency-key").iter().count(), 1);
        assert_eq!(h["stepgate-step-index"], "4");
    }
}

#[tokio::test]
async fn a_header_without_its_value_sends_nothing() {
    let (url, hits, _) = server(vec![200], Duration::ZERO).await;
    // Loaded but never resolved (start does that): the call is not sent
    // without its credentials, and the message names the header only.
    let tools = registry_with(
        "unkeyed",
        &url,
        "headers = { Authorization = \"env:PAY_TOKEN\" }\n",
    );
    let o = tools.invoke(&call()).await;
    assert_eq!(kind(&o), ("error", "tool_unreachable".into()));
    if let Outcome::Error { error } = &o {
        assert!(error.message.contains("Authorization"), "{}", error.message);
    }
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_invalid_traceparent_is_dropped_and_the_call_still_runs() {
    let (url, hits, seen) = server(vec![200], Duration::ZERO).await;
    let tools = registry("unkeyed", &url, "5s");
    for bad in [
        // Not a header value at all: it used to fail the request builder,
        // and the unkeyed call ended in doubt though nothing was sent.
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n",
        "00-abc-01",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
    ] {
        let mut c = call();
        c.traceparent = Some(bad.to_owned());
        let before = hits.load(Ordering::SeqCst);
        let o = tools.invoke(&c).await;
        assert_eq!(kind(&o).0, "ok", "{bad:?}: {o:?}");
        assert_eq!(hits.load(Ordering::SeqCst), before + 1, "{bad:?}");
        let h = seen.lock().unwrap().clone().unwrap();
        assert!(h.get("traceparent").is_none(), "{bad:?} was sent");
    }
}

#[tokio::test]
async fn a_refusal_quoting_the_credential_does_not_pass_it_on() {
    let addr = serve(|_| {
        Router::new().route(
            "/r",
            post(|headers: HeaderMap| async move {
                let auth = headers["authorization"].to_str().unwrap().to_owned();
                let token = auth.trim_start_matches("Bearer ").to_owned();
                (
                    StatusCode::UNAUTHORIZED,
                    format!("invalid credentials `{auth}` (token {token})"),
                )
            }),
        )
    })
    .await;
    let mut cfg = Config::from_toml_str(
        &format!(
            "[tools.t]\ncategory = \"keyed\"\nurl = \"http://{addr}/r\"\nheaders = {{ Authorization = \"env:T\" }}\n"
        ),
        Vec::new(),
    )
    .unwrap();
    cfg.resolve_tool_headers(|_| Some("Bearer hunter2-token".into()))
        .unwrap();
    let o = ToolRegistry::new(&cfg.tools, cfg.executor.concurrency)
        .invoke(&call())
        .await;
    let Outcome::Error { error } = o else {
        panic!("{o:?}")
    };
    assert_eq!(error.kind, "tool_refused");
    assert!(!error.message.contains("hunter2"), "{}", error.message);
    assert!(
        error.message.contains("invalid credentials"),
        "{}",
        error.message
    );
}

#[tokio::test]
async fn an_output_nested_deeper_than_arguments_may_be_is_an_error_that_says_it_ran() {
    let deep = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
    let (ok_body, deep_body) = (deep(crate::contract::MAX_NESTING_DEPTH), deep(100));
    let url = answering(move || axum::body::Body::from(ok_body.clone())).await;
    let reg = registry_with("unkeyed", &url, "");
    assert_eq!(
        kind(&reg.invoke(&call()).await).0,
        "ok",
        "at the limit: returned"
    );
    let url = answering(move || axum::body::Body::from(deep_body.clone())).await;
    let reg = registry_with("unkeyed", &url, "");
    let o = reg.invoke(&call()).await;
    assert_eq!(kind(&o), ("error", "output_too_deep".into()));
    let Outcome::Error { error } = o else {
        unreachable!()
    };
    assert!(
        error.message.contains("ran and succeeded"),
        "{}",
        error.message
    );
}

/// A port nothing listens on (bound, then dropped).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// The texts of an outcome that a model, a record or a log gets.
fn texts(o: &Outcome) -> String {
    format!("{o:?} {}", serde_json::to_string(o).unwrap())
}

#[tokio::test]
async fn an_http_tool_url_with_credentials_never_reaches_an_error_text() {
    let secret_url = |addr: &str| {
        format!("http://bot:hunter2-pw@{addr}/r?api_key=hunter3-key&signature=hunter4-sig&q=1")
    };
    // Nothing listens: refused, for every try.
    let url = secret_url(&format!("127.0.0.1:{}", closed_port()));
    let o = registry_with("keyed", &url, "timeout = \"2s\"\nbackoff = \"10ms\"\n")
        .invoke(&call())
        .await;
    assert_eq!(kind(&o), ("error", "tool_unreachable".into()));
    let t = texts(&o);
    assert!(t.contains("connection refused"), "{t}");
    for secret in ["hunter2", "hunter3", "hunter4"] {
        assert!(!t.contains(secret), "{t}");
    }
    // A tool that times out: in doubt, with no URL either.
    let (slow, _, _) = server(vec![200], Duration::from_secs(5)).await;
    let addr = slow.trim_start_matches("http://").trim_end_matches("/r");
    let o = registry_with("unkeyed", &secret_url(addr), "timeout = \"200ms\"\n")
        .invoke(&call())
        .await;
    assert_eq!(kind(&o).0, "in_doubt");
    let t = texts(&o);
    assert!(t.contains("timed out"), "{t}");
    assert!(!t.contains("hunter"), "{t}");
    // A refusal that quotes the request's URL: its credentials are cut out.
    let addr = serve(|_| {
        Router::new().route(
            "/r",
            post(|uri: axum::http::Uri| async move {
                (StatusCode::FORBIDDEN, format!("no access for {uri}"))
            }),
        )
    })
    .await;
    let o = registry_with("keyed", &secret_url(&addr.to_string()), "")
        .invoke(&call())
        .await;
    assert_eq!(kind(&o), ("error", "tool_refused".into()));
    let t = texts(&o);
    assert!(t.contains("no access for /r?api_key=redacted"), "{t}");
    assert!(!t.contains("hunter"), "{t}");
}

#[tokio::test]
async fn an_mcp_tool_url_with_credentials_never_reaches_an_error_text() {
    let url = format!(
        "http://bot:hunter2-pw@127.0.0.1:{}/mcp?access_token=hunter3-tok&key=hunter4-key",
        closed_port()
    );
    let cfg = Config::from_toml_str(
        &format!(
            "[tools.t]\ncategory = \"keyed\"\nmcp = \"{url}\"\ntimeout = \"2s\"\nbackoff = \"10ms\"\n"
        ),
        Vec::new(),
    )
    .unwrap();
    let o = ToolRegistry::new(&cfg.tools, cfg.executor.concurrency)
        .invoke(&call())
        .await;
    assert_eq!(kind(&o), ("error", "tool_unreachable".into()));
    let t = texts(&o);
    assert!(t.contains("no MCP session could be opened"), "{t}");
    for secret in ["hunter2", "hunter3", "hunter4"] {
        assert!(!t.contains(secret), "{t}");
    }
    // rmcp's own texts (and log lines) get reqwest's error without its URL.
    assert!(!t.contains("access_token"), "{t}");
}

/// The `[pools.gpu]` every config naming the pool `gpu` has.
const GPU_POOL: &str = "[pools.gpu]\nkey = \"a-test-pool-key-of-at-least-32-bytes\"\n";

/// A pool tool (docs/design.md "Worker pools"): no address and no credentials
/// on the gate, always recorded; its config round-trips through the TOML the
/// tests and operators write.
#[test]
fn a_pool_tool_has_no_address_no_headers_and_always_a_step_log() {
    let read = |extra: &str| {
        Config::from_toml_str(
            &format!("[kafka]\nbrokers = \"h:1\"\n{GPU_POOL}[tools.render]\n{extra}\n"),
            Vec::new(),
        )
        .map_err(|e| e.to_string())
    };
    let c = read("category = \"read_only\"\npool = \"gpu\"").unwrap();
    let t = &c.tools["render"];
    assert_eq!(t.pool.as_deref(), Some("gpu"));
    assert!(t.url.is_empty());
    assert!(
        t.recorded(),
        "a pool's calls are published with their record"
    );
    assert_eq!(c.kafka.topics.calls_for("gpu"), "stepgate.calls.gpu");
    let again = Config::from_toml_str(&toml::to_string(&c).unwrap(), Vec::new()).unwrap();
    assert_eq!(again.tools["render"].pool.as_deref(), Some("gpu"));

    let e = read("category = \"keyed\"\npool = \"gpu\"\nurl = \"http://h/x\"").unwrap_err();
    assert!(e.contains("either `pool`"), "{e}");
    let e = read("category = \"keyed\"\npool = \"gpu\"\nheaders = { Authorization = \"env:T\" }")
        .unwrap_err();
    assert!(e.contains("configured on its workers"), "{e}");
    let e = read("category = \"keyed\"\npool = \"a b\"").unwrap_err();
    assert!(e.contains("not a pool name"), "{e}");
    let e = Config::from_toml_str(
        &format!(
            "[kafka]\nbrokers = \"h:1\"\n[kafka.topics]\npool_calls = \"calls\"\n{GPU_POOL}\
             [tools.render]\ncategory = \"keyed\"\npool = \"gpu\"\n"
        ),
        Vec::new(),
    )
    .and_then(|c| c.validate().map(|_| c))
    .unwrap_err()
    .to_string();
    assert!(e.contains("kafka.topics.pool_calls"), "{e}");
}

/// `reg` with every HTTP tool sent through reqwest, as a proxied or `https://`
/// one is.
fn through_reqwest(mut reg: ToolRegistry) -> ToolRegistry {
    for route in reg.routes.values_mut() {
        *route = Route::Reqwest;
    }
    reg
}

/// A tool that answers 200 with a body that breaks off: the status line and
/// part of a declared 100-byte body, then the connection closes.
async fn breaking_off() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                // The whole request: headers, then as much body as declared.
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while let Ok(n) = conn.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                    req.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&req);
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap())
                            })
                            .unwrap_or(0);
                        if req.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                let _ = conn
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{\"partial\":")
                    .await;
                // Dropped: the body ends 89 bytes short.
            });
        }
    });
    format!("http://{addr}/r")
}

/// The headers a tool saw, as sorted `name: value` lines.
fn header_lines(h: &HeaderMap) -> Vec<String> {
    let mut lines: Vec<String> = h
        .iter()
        .map(|(n, v)| format!("{n}: {}", v.to_str().unwrap()))
        .collect();
    lines.sort();
    lines
}

#[tokio::test]
async fn both_clients_send_the_same_request_and_end_each_try_alike() {
    let mut seen_by_route = Vec::new();
    for reqwest in [false, true] {
        let via = |reg: ToolRegistry| {
            let reg = if reqwest { through_reqwest(reg) } else { reg };
            assert_eq!(
                matches!(reg.routes["t"], Route::Reqwest),
                reqwest,
                "a plain http:// tool on 127.0.0.1 goes direct"
            );
            reg
        };
        let label = if reqwest { "reqwest" } else { "direct" };

        // The same request: every header (host, length, agent, accept and the
        // protocol's), and the body byte for byte.
        let (url, hits, seen) = server(vec![200], Duration::ZERO).await;
        let o = via(registry("keyed", &url, "5s")).invoke(&call()).await;
        assert_eq!(
            o,
            Outcome::Ok {
                output: serde_json::json!({"echo": {"a": 1}})
            },
            "{label}"
        );
        assert_eq!(hits.load(Ordering::SeqCst), 1, "{label}");
        let lines = header_lines(&seen.lock().unwrap().clone().unwrap());
        let port = url.split(':').nth(2).unwrap().split('/').next().unwrap();
        seen_by_route.push(
            lines
                .into_iter()
                .map(|l| l.replace(port, "PORT"))
                .collect::<Vec<_>>(),
        );

        // A refusal is definite, and read.
        let (url, hits, _) = server(vec![422], Duration::ZERO).await;
        let o = via(registry("unkeyed", &url, "5s")).invoke(&call()).await;
        assert_eq!(kind(&o), ("error", "tool_refused".into()), "{label}");
        let Outcome::Error { error } = &o else {
            unreachable!()
        };
        assert!(
            error.message.contains(r#"Its answer: {"echo":{"a":1}}"#),
            "{label}: {o:?}"
        );
        assert_eq!(hits.load(Ordering::SeqCst), 1, "{label}");

        // A 5xx may have run.
        let (url, hits, _) = server(vec![503, 200], Duration::ZERO).await;
        let o = via(registry("unkeyed", &url, "5s")).invoke(&call()).await;
        assert_eq!(kind(&o), ("in_doubt", "outcome_unknown".into()), "{label}");
        assert_eq!(hits.load(Ordering::SeqCst), 1, "{label}");

        // A timeout after sending may have run.
        let (url, hits, _) = server(vec![200], Duration::from_millis(800)).await;
        let o = via(registry("unkeyed", &url, "100ms"))
            .invoke(&call())
            .await;
        assert_eq!(kind(&o).0, "in_doubt", "{label}");
        assert!(texts(&o).contains("timed out"), "{label}: {o:?}");
        assert_eq!(hits.load(Ordering::SeqCst), 1, "{label}");

        // A 2xx whose body breaks off: the tool ran, its answer is lost.
        let url = breaking_off().await;
        let o = via(registry("unkeyed", &url, "5s")).invoke(&call()).await;
        assert_eq!(kind(&o), ("in_doubt", "outcome_unknown".into()), "{label}");
        assert!(texts(&o).contains("connection broken"), "{label}: {o:?}");

        // Nothing listening: never sent, so retried, then not performed.
        let url = format!("http://127.0.0.1:{}/r", closed_port());
        let o = via(registry("unkeyed", &url, "1s")).invoke(&call()).await;
        assert_eq!(kind(&o), ("error", "tool_unreachable".into()), "{label}");
        assert!(texts(&o).contains("after 3 tries"), "{label}: {o:?}");
        assert!(texts(&o).contains("connection refused"), "{label}: {o:?}");
    }
    assert_eq!(seen_by_route[0], seen_by_route[1]);
    for want in [
        "accept: */*",
        "content-type: application/json",
        "content-length: 7",
        "host: 127.0.0.1:PORT",
        concat!("user-agent: stepgate/", env!("CARGO_PKG_VERSION")),
    ] {
        assert!(
            seen_by_route[0].iter().any(|l| l == want),
            "{want} in {:?}",
            seen_by_route[0]
        );
    }
}

#[tokio::test]
async fn a_tool_behind_a_proxy_is_called_through_it() {
    // The proxy: it sees the request in absolute form, and answers it.
    let (proxied, seen) = (
        Arc::new(std::sync::Mutex::new(Vec::new())),
        Arc::new(std::sync::Mutex::new(None)),
    );
    let (p, s) = (proxied.clone(), seen.clone());
    let proxy = serve(move |_| {
        Router::new().fallback(move |uri: axum::http::Uri, headers: HeaderMap| {
            let (p, s) = (p.clone(), s.clone());
            async move {
                p.lock().unwrap().push(uri.to_string());
                *s.lock().unwrap() = Some(headers);
                (StatusCode::OK, "{\"via\":\"proxy\"}")
            }
        })
    })
    .await;
    let proxy_url = format!("http://{proxy}");
    let cfg = Config::from_toml_str(
        "[tools.t]\ncategory = \"keyed\"\nurl = \"http://tool.invalid/r\"\n",
        Vec::new(),
    )
    .unwrap();
    let matcher = hyper_util::client::proxy::matcher::Matcher::builder()
        .http(proxy_url.clone())
        .build();
    let routes = Http::routes_with(&cfg.tools, &matcher);
    let reg = ToolRegistry::with_http(&cfg.tools, Http::with_proxy(4, &proxy_url), routes);
    assert!(matches!(reg.routes["t"], Route::Reqwest));
    let o = reg.invoke(&call()).await;
    assert_eq!(
        o,
        Outcome::Ok {
            output: serde_json::json!({"via": "proxy"})
        }
    );
    assert_eq!(*proxied.lock().unwrap(), ["http://tool.invalid/r"]);
    let h = seen.lock().unwrap().clone().unwrap();
    assert_eq!(h["idempotency-key"], call().step.idempotency_key().as_str());
}

#[test]
fn only_a_plain_unproxied_http_url_goes_direct() {
    use hyper_util::client::proxy::matcher::Matcher;
    let none = Matcher::builder().build();
    let proxied = Matcher::builder()
        .http("http://proxy.example:3128")
        .no("internal.example")
        .build();
    let direct = |url: &str, m: &Matcher| matches!(Http::route(url, m), Route::Direct(_));
    assert!(direct("http://127.0.0.1:8080/tool?x=1", &none));
    assert!(direct("http://tools.example/send", &none));
    // reqwest's text of the URL is what goes out: normalised, as before.
    match Http::route("http://Tools.Example:80/a b", &none) {
        Route::Direct(uri) => assert_eq!(uri.to_string(), "http://tools.example/a%20b"),
        Route::Reqwest => panic!("a plain URL goes direct"),
    }
    // TLS, credentials (sent as basic auth), a fragment: reqwest's.
    assert!(!direct("https://tools.example/send", &none));
    assert!(!direct("http://user:pw@tools.example/send", &none));
    assert!(!direct("http://tools.example/send#x", &none));
    // A proxy setting that covers the host: reqwest's, which honours it.
    assert!(!direct("http://tools.example/send", &proxied));
    assert!(direct("http://internal.example/send", &proxied));
}
