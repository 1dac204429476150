//! OpenTelemetry traces of each step (#30), against a real Kafka broker
//! (`KAFKA_BROKERS`, default 127.0.0.1:9092) and the `stepgate` binary: what
//! a run exports over OTLP/HTTP reaches an OTLP/HTTP endpoint served by the
//! test, which decodes every request with the protocol's own protobuf types
//! (`opentelemetry-proto`). The spans nest under the agent's `traceparent`:
//! the gate's decision, then the tool call as an `execute_tool` span with the
//! GenAI semantic conventions' attributes, a repeat as a span event; the
//! tool is sent the `execute_tool` span as its parent; an agent's unsampled
//! trace exports nothing.

use crate::common;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::routing::post;
use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use prost::Message;
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use stepgate::contract::{Status, hex};

const WAIT: Duration = Duration::from_secs(30);

/// A span as received, with its resource's `service.name`.
#[derive(Clone, Debug)]
struct Received {
    service: Option<String>,
    span: Span,
}

/// An OTLP/HTTP traces endpoint (protobuf): every span of every request.
#[derive(Clone, Default)]
struct Receiver {
    spans: Arc<Mutex<Vec<Received>>>,
    /// Requests that were not an OTLP/HTTP protobuf export.
    refused: Arc<Mutex<Vec<String>>>,
}

async fn export(
    State(r): State<Receiver>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], Vec<u8>) {
    let protobuf = [(header::CONTENT_TYPE, "application/x-protobuf")];
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if content_type != "application/x-protobuf" {
        r.refused
            .lock()
            .unwrap()
            .push(format!("content-type {content_type:?}"));
        return (StatusCode::UNSUPPORTED_MEDIA_TYPE, protobuf, Vec::new());
    }
    let request = match ExportTraceServiceRequest::decode(body) {
        Ok(req) => req,
        Err(e) => {
            r.refused.lock().unwrap().push(format!("undecodable: {e}"));
            return (StatusCode::BAD_REQUEST, protobuf, Vec::new());
        }
    };
    let mut spans = r.spans.lock().unwrap();
    for rs in request.resource_spans {
        let service = rs
            .resource
            .as_ref()
            .and_then(|res| string_attr(&res.attributes, "service.name"));
        for ss in rs.scope_spans {
            for span in ss.spans {
                spans.push(Received {
                    service: service.clone(),
                    span,
                });
            }
        }
    }
    (
        StatusCode::OK,
        protobuf,
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

impl Receiver {
    /// Serve on a loopback port; the traces URL.
    async fn start(&self) -> String {
        let app = Router::new()
            .route("/v1/traces", post(export))
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        format!("http://{addr}/v1/traces")
    }

    fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }
}

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a AnyValue> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn string_attr(attrs: &[KeyValue], key: &str) -> Option<String> {
    match attr(attrs, key)? {
        AnyValue::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

/// A W3C trace id or span id of `len` bytes, random (std's randomly keyed
/// hasher), none of them zero.
fn random_id(len: usize) -> String {
    use std::hash::{BuildHasher, Hasher};
    let keys = std::collections::hash_map::RandomState::new();
    (0..len)
        .map(|i| {
            let mut h = keys.build_hasher();
            h.write_usize(i);
            format!("{:02x}", (h.finish() as u8) | 1)
        })
        .collect()
}

fn is_root_of(span: &Span, trace: &str, parent: &str) -> bool {
    hex(&span.trace_id) == trace && hex(&span.parent_span_id) == parent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_step_is_traced_under_the_agents_traceparent_with_genai_attributes() {
    let receiver = Receiver::default();
    let url = receiver.start().await;
    let mut s = Stack::new(StackOptions::default()).await;
    // From the environment, as a deployment would set it.
    s.spawn(
        &[],
        &[
            ("STEPGATE_TRACES_ENDPOINT", &url),
            ("STEPGATE_TRACES_EXPORT_INTERVAL", "200ms"),
            ("STEPGATE_TRACES_SERVICE_NAME", "stepgate-under-test"),
        ],
    );
    s.wait_ready().await;
    let agent = s.agent();
    let trace = random_id(16);
    let (a1, a2, a3) = (random_id(8), random_id(8), random_id(8));
    assert!(a1 != a2 && a2 != a3 && a1 != a3);
    let tp = |span: &str, flags: &str| format!("00-{trace}-{span}-{flags}");

    // An agent whose trace is not sampled: nothing of it is exported, and
    // its tool is still told the trace (not sampled).
    let quiet_trace = random_id(16);
    let quiet = format!("00-{quiet_trace}-{}-00", random_id(8));
    let step0 = intent("wf-q", 1, "send_email", json!({"subject": "quiet"}), "q1");
    agent
        .send_raw(
            "wf-q",
            step0.to_string().as_bytes(),
            None,
            &[("traceparent", &quiet)],
        )
        .await;
    assert_eq!(agent.answer("q1", WAIT).await.status, Status::Ok);

    // A new step, its repeat (another agent span of the same trace), and a
    // fast-path read.
    let step1 = intent("wf-t", 1, "send_email", json!({"subject": "hi"}), "c1");
    agent
        .send_raw(
            "wf-t",
            step1.to_string().as_bytes(),
            None,
            &[("traceparent", &tp(&a1, "01"))],
        )
        .await;
    let first = agent.answer("c1", WAIT).await;
    let step1_again = intent("wf-t", 1, "send_email", json!({"subject": "hi!"}), "c2");
    agent
        .send_raw(
            "wf-t",
            step1_again.to_string().as_bytes(),
            None,
            &[("traceparent", &tp(&a2, "01"))],
        )
        .await;
    let repeat = agent.answer("c2", WAIT).await;
    assert!(!first.deduplicated && repeat.deduplicated, "{repeat:?}");
    let read = intent("wf-t", 2, "search", json!({"q": "x"}), "s1");
    agent
        .send_raw(
            "wf-t",
            read.to_string().as_bytes(),
            None,
            &[("traceparent", &tp(&a3, "01"))],
        )
        .await;
    assert_eq!(agent.answer("s1", WAIT).await.status, Status::Ok);

    // Five spans of the sampled trace: three decisions, two tool calls.
    eventually(WAIT, "the run's spans at the OTLP endpoint", || {
        receiver
            .spans()
            .iter()
            .filter(|r| hex(&r.span.trace_id) == trace)
            .count()
            >= 5
    })
    .await;
    assert!(
        receiver.refused.lock().unwrap().is_empty(),
        "{:?}",
        receiver.refused.lock().unwrap()
    );
    let all = receiver.spans();
    assert!(
        all.iter()
            .all(|r| r.service.as_deref() == Some("stepgate-under-test")),
        "{all:#?}"
    );
    assert!(
        !all.iter().any(|r| hex(&r.span.trace_id) == quiet_trace),
        "an unsampled trace exports nothing: {all:#?}"
    );
    let spans: Vec<&Span> = all
        .iter()
        .map(|r| &r.span)
        .filter(|s| hex(&s.trace_id) == trace)
        .collect();
    let named = |name: &str, parent: &str| -> Vec<&Span> {
        spans
            .iter()
            .copied()
            .filter(|s| s.name == name && hex(&s.parent_span_id) == parent)
            .collect()
    };

    // The new step: the gate's decision under the agent's span, and the
    // tool call under the decision.
    let decided = named("stepgate.step send_email", &a1);
    assert_eq!(decided.len(), 1, "{spans:#?}");
    let decided = decided[0];
    assert!(is_root_of(decided, &trace, &a1));
    assert_eq!(decided.kind, SpanKind::Consumer as i32);
    assert_eq!(
        string_attr(&decided.attributes, "stepgate.decision").as_deref(),
        Some("new_step")
    );
    assert_eq!(
        string_attr(&decided.attributes, "gen_ai.tool.call.id").as_deref(),
        Some("c1")
    );
    assert_eq!(
        string_attr(&decided.attributes, "messaging.destination.name"),
        Some(s.config.kafka.topics.intents.clone())
    );
    let called = named("execute_tool send_email", &hex(&decided.span_id));
    assert_eq!(
        called.len(),
        1,
        "one tool call, under the decision: {spans:#?}"
    );
    let called = called[0];
    assert_eq!(called.kind, SpanKind::Internal as i32);
    for (key, value) in [
        ("gen_ai.operation.name", "execute_tool"),
        ("gen_ai.tool.name", "send_email"),
        ("gen_ai.tool.call.id", "c1"),
        ("gen_ai.tool.type", "extension"),
        ("stepgate.workflow_id", "wf-t"),
        ("stepgate.outcome", "ok"),
    ] {
        assert_eq!(
            string_attr(&called.attributes, key).as_deref(),
            Some(value),
            "{key} on {called:#?}"
        );
    }
    assert_eq!(
        attr(&called.attributes, "stepgate.dispatch"),
        Some(&AnyValue::IntValue(1))
    );
    assert!(called.start_time_unix_nano >= decided.start_time_unix_nano);
    assert!(called.end_time_unix_nano >= called.start_time_unix_nano);
    // The tool was told its call's span as the parent (its own spans nest there).
    let sent = &s.tools.calls("send_email");
    let sent_tp = sent
        .iter()
        .find(|c| c.body["subject"] == "hi")
        .and_then(|c| c.headers.get("traceparent"))
        .expect("the tool got a traceparent");
    assert_eq!(sent_tp, &format!("00-{trace}-{}-01", hex(&called.span_id)));

    // The repeat: a decision under its own agent span, with the repeat as an
    // event, and no tool call.
    let repeated = named("stepgate.step send_email", &a2);
    assert_eq!(repeated.len(), 1, "{spans:#?}");
    let repeated = repeated[0];
    assert_eq!(
        string_attr(&repeated.attributes, "stepgate.decision").as_deref(),
        Some("repeat")
    );
    let event = repeated
        .events
        .iter()
        .find(|e| e.name == "stepgate.repeat")
        .expect("the repeat is an event of its decision");
    assert_eq!(
        string_attr(&event.attributes, "stepgate.first_call_id").as_deref(),
        Some("c1")
    );
    assert_eq!(
        attr(&event.attributes, "stepgate.rephrased"),
        Some(&AnyValue::BoolValue(true))
    );
    assert!(named("execute_tool send_email", &hex(&repeated.span_id)).is_empty());
    assert_eq!(
        spans
            .iter()
            .filter(|s| s.name == "execute_tool send_email")
            .count(),
        1,
        "the step ran once: {spans:#?}"
    );

    // The fast-path read: decided and called, each a span.
    let read = named("stepgate.step search", &a3);
    assert_eq!(read.len(), 1, "{spans:#?}");
    assert_eq!(
        string_attr(&read[0].attributes, "stepgate.decision").as_deref(),
        Some("fast_path")
    );
    let read_call = named("execute_tool search", &hex(&read[0].span_id));
    assert_eq!(read_call.len(), 1, "{spans:#?}");
    assert_eq!(
        string_attr(&read_call[0].attributes, "gen_ai.tool.call.id").as_deref(),
        Some("s1")
    );

    // The unsampled agent's tool got its trace, not sampled.
    let quiet_sent = sent
        .iter()
        .find(|c| c.body["subject"] == "quiet")
        .and_then(|c| c.headers.get("traceparent"))
        .expect("the quiet call's tool got a traceparent");
    assert!(
        quiet_sent.starts_with(&format!("00-{quiet_trace}-")) && quiet_sent.ends_with("-00"),
        "{quiet_sent}"
    );
}

/// A call held for approval: its decision (`awaiting_approval`) under the
/// agent's span, then the operator's `approve` under the same span, naming
/// who, and the tool call under the approval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_call_runs_under_the_operators_decision_in_the_agents_trace() {
    let receiver = Receiver::default();
    let url = receiver.start().await;
    let mut s = Stack::new(StackOptions {
        tool_tables: r#"
[tools.wire_approved]
category = "unkeyed"
policy = "approval"
url = "{tools}/wire_approved"
timeout = "2s"
"#
        .to_owned(),
        ..StackOptions::default()
    })
    .await;
    s.spawn(
        &[],
        &[
            ("STEPGATE_TRACES_ENDPOINT", &url),
            ("STEPGATE_TRACES_EXPORT_INTERVAL", "200ms"),
        ],
    );
    s.wait_ready().await;
    let agent = s.agent();
    let (trace, a1) = (random_id(16), random_id(8));
    let held = intent("pay-t", 0, "wire_approved", json!({"amount": 5}), "w1");
    agent
        .send_raw(
            "pay-t",
            held.to_string().as_bytes(),
            None,
            &[("traceparent", &format!("00-{trace}-{a1}-01"))],
        )
        .await;
    eventually(
        WAIT,
        "the held call's decision at the OTLP endpoint",
        || {
            receiver
                .spans()
                .iter()
                .any(|r| r.span.name == "stepgate.step wire_approved")
        },
    )
    .await;
    let ok = s
        .cli(&[
            "approvals",
            "approve",
            "pay-t",
            "0",
            "wire_approved",
            "--by",
            "alice",
        ])
        .await;
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(agent.answer("w1", WAIT).await.status, Status::Ok);
    eventually(WAIT, "the approved call's span", || {
        receiver
            .spans()
            .iter()
            .any(|r| r.span.name == "execute_tool wire_approved")
    })
    .await;
    let all = receiver.spans();
    let spans: Vec<&Span> = all
        .iter()
        .map(|r| &r.span)
        .filter(|s| hex(&s.trace_id) == trace)
        .collect();
    let held = spans
        .iter()
        .find(|s| s.name == "stepgate.step wire_approved")
        .expect("the held call's decision");
    assert!(is_root_of(held, &trace, &a1));
    assert_eq!(
        string_attr(&held.attributes, "stepgate.decision").as_deref(),
        Some("awaiting_approval")
    );
    let approved = spans
        .iter()
        .find(|s| s.name == "stepgate.command approve")
        .expect("the approval's span, in the agent's trace");
    assert!(is_root_of(approved, &trace, &a1), "{approved:#?}");
    assert_eq!(
        string_attr(&approved.attributes, "stepgate.operator.by").as_deref(),
        Some("alice")
    );
    let called = spans
        .iter()
        .find(|s| s.name == "execute_tool wire_approved")
        .expect("the call's span");
    assert_eq!(
        hex(&called.parent_span_id),
        hex(&approved.span_id),
        "the call runs under the approval: {spans:#?}"
    );
    assert_eq!(
        string_attr(&called.attributes, "gen_ai.tool.call.id").as_deref(),
        Some("w1")
    );
    assert_eq!(s.tools.count("wire_approved"), 1);
}
