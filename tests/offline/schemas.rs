//! The Rust types and the published JSON Schemas cannot drift: every message the
//! code produces validates, the schemas' examples parse, and invalid intents are
//! refused by both.

use serde_json::{Value, json};
use stepgate::contract::{
    DLQ_PAYLOAD_PREFIX_BYTES, DLQ_RECORD_MAX_BYTES, DlqRecord, ErrorBody, Outcome, Progress,
    ProgressEvent, Rejection, RejectionReason, Status, StepKey, ToolResult, parse_intent,
};

fn schema(name: &str) -> jsonschema::Validator {
    let path = format!("{}/schemas/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
    jsonschema::validator_for(&v).unwrap_or_else(|e| panic!("{path} is not a valid schema: {e}"))
}

fn examples(name: &str) -> Vec<Value> {
    let path = format!("{}/schemas/{name}", env!("CARGO_MANIFEST_DIR"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v["examples"].as_array().cloned().unwrap_or_default()
}

fn assert_valid(v: &jsonschema::Validator, instance: &Value) {
    let errors: Vec<String> = v.iter_errors(instance).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{instance} is invalid: {errors:?}");
}

fn step() -> StepKey {
    StepKey {
        workflow_id: "order-7781".into(),
        step_index: 3,
        tool: "send_email".into(),
        attempt: 0,
    }
}

const TOOLS: &[&str] = &["send_email", "wire_transfer"];

fn tools() -> Vec<String> {
    TOOLS.iter().map(|s| s.to_string()).collect()
}

#[test]
fn intent_examples_validate_and_parse() {
    let v = schema("intent.v1.json");
    for ex in examples("intent.v1.json") {
        assert_valid(&v, &ex);
        let i = parse_intent(ex.to_string().as_bytes(), 1 << 20, &tools())
            .expect("schema example parses");
        // What we would publish ourselves validates too.
        assert_valid(&v, &serde_json::to_value(&i).unwrap());
    }
}

#[test]
fn schema_and_parser_agree_on_intents() {
    let v = schema("intent.v1.json");
    let valid = [
        json!({"workflow_id": "w", "step_index": 0, "tool": "send_email", "arguments": {}}),
        json!({"workflow_id": "w", "step_index": 9, "tool": "send_email", "attempt": 2, "arguments": {"a": [1]}, "call_id": null, "extra": 1}),
    ];
    for i in &valid {
        assert!(v.is_valid(i), "{i}");
        assert!(
            parse_intent(i.to_string().as_bytes(), 1 << 20, &tools()).is_ok(),
            "{i}"
        );
    }
    let invalid = [
        json!({"step_index": 0, "tool": "send_email", "arguments": {}}),
        json!({"workflow_id": "", "step_index": 0, "tool": "send_email", "arguments": {}}),
        json!({"workflow_id": "a\u{1}b", "step_index": 0, "tool": "send_email", "arguments": {}}),
        json!({"workflow_id": "w", "step_index": -1, "tool": "send_email", "arguments": {}}),
        json!({"workflow_id": "w", "step_index": "1", "tool": "send_email", "arguments": {}}),
        json!({"workflow_id": "w", "step_index": 1, "tool": "no spaces", "arguments": {}}),
        json!({"workflow_id": "w", "step_index": 1, "tool": "send_email", "arguments": [1]}),
        json!({"workflow_id": "w", "step_index": 1, "tool": "send_email"}),
        json!({"workflow_id": "w", "step_index": 1, "tool": "send_email", "arguments": {}, "attempt": 1.5}),
        json!({"workflow_id": "w", "step_index": 1, "tool": "send_email", "arguments": {}, "call_id": 3}),
        json!({"workflow_id": "w", "step_index": 1, "tool": "send_email", "arguments": {}, "call_id": "a\u{1b}[2J"}),
        json!({"workflow_id": "w", "step_index": 1, "tool": "send_email", "arguments": {}, "metadata": "x"}),
        json!({"workflow_id": "w".repeat(256), "step_index": 1, "tool": "send_email", "arguments": {}}),
    ];
    for i in &invalid {
        assert!(!v.is_valid(i), "schema accepts {i}");
        assert!(
            parse_intent(i.to_string().as_bytes(), 1 << 20, &tools()).is_err(),
            "parser accepts {i}"
        );
    }
}

#[test]
fn every_result_status_validates() {
    let v = schema("result.v1.json");
    for ex in examples("result.v1.json") {
        assert_valid(&v, &ex);
        let r: ToolResult = serde_json::from_value(ex.clone()).expect("example deserialises");
        assert_eq!(serde_json::to_value(&r).unwrap(), ex, "round trip is exact");
    }
    let at = chrono::Utc::now();
    let err = ErrorBody {
        kind: "k".into(),
        message: "m".into(),
    };
    let outcomes = [
        Outcome::Ok {
            output: json!({"message_id": "m-1"}),
        },
        Outcome::Ok {
            output: Value::Null,
        },
        Outcome::Error { error: err.clone() },
        Outcome::InDoubt { error: err.clone() },
    ];
    for o in outcomes {
        let r = ToolResult::from_outcome(&step(), None, o, at);
        assert_valid(&v, &serde_json::to_value(&r).unwrap());
        assert_valid(
            &v,
            &serde_json::to_value(r.for_repeat(Some("c2".into()))).unwrap(),
        );
    }
    let rejected = ToolResult {
        workflow_id: "w".into(),
        step_index: 1,
        tool: "t".into(),
        attempt: 0,
        call_id: Some("c".into()),
        status: Status::Rejected,
        output: None,
        error: Some(err),
        deduplicated: false,
        completed_at: stepgate::contract::timestamp(at),
    };
    assert_valid(&v, &serde_json::to_value(&rejected).unwrap());
    // The schema really constrains: an ok without output, or an unknown status, fails.
    let mut bad = serde_json::to_value(&rejected).unwrap();
    bad["status"] = json!("ok");
    assert!(!v.is_valid(&bad));
    bad["status"] = json!("maybe");
    assert!(!v.is_valid(&bad));
}

/// Every rejection reason. The match makes a new variant a compile error here
/// until it is listed (and so checked against the schema's enum).
fn all_reasons() -> Vec<RejectionReason> {
    use RejectionReason::*;
    let all = vec![
        Oversized,
        MalformedJson,
        NotAnObject,
        MissingField,
        WrongType,
        InvalidValue,
        UnknownTool,
        WorkflowEnded,
        BadCommand,
        StaleCommand,
        IdentityConflict,
        TooDeep,
        Unprocessable,
        WrongPartition,
        Expired,
        RefusedProgress,
    ];
    for r in &all {
        match r {
            Oversized | MalformedJson | NotAnObject | MissingField | WrongType | InvalidValue
            | UnknownTool | WorkflowEnded | BadCommand | StaleCommand | IdentityConflict
            | TooDeep | Unprocessable | WrongPartition | Expired | RefusedProgress => {}
        }
    }
    all
}

#[test]
fn dlq_records_validate() {
    let v = schema("dlq.v1.json");
    let big_text = "é".repeat(100_000);
    let big_bytes: Vec<u8> = (0..300_000u32).map(|i| (i % 256) as u8).collect();
    for reason in all_reasons() {
        let rej = Rejection::new(reason, "why".into());
        for payload in [
            b"{oops".as_slice(),
            &[0xff, 0x00],
            b"",
            big_text.as_bytes(),
            &big_bytes,
        ] {
            let d = DlqRecord::new(&rej, "stepgate.intents", 2, 41, payload, chrono::Utc::now());
            let json = d.to_json();
            assert!(json.len() <= DLQ_RECORD_MAX_BYTES, "{}", json.len());
            assert_valid(&v, &serde_json::from_slice(&json).unwrap());
            assert_eq!(d.payload_bytes, payload.len() as u64);
            assert_eq!(
                d.payload_truncated,
                payload.len() > DLQ_PAYLOAD_PREFIX_BYTES
            );
        }
    }
}

#[test]
fn dlq_reasons_are_the_schemas() {
    let path = format!("{}/schemas/dlq.v1.json", env!("CARGO_MANIFEST_DIR"));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut in_schema: Vec<String> = v["properties"]["reason"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_str().unwrap().to_owned())
        .collect();
    let mut in_code: Vec<String> = all_reasons()
        .iter()
        .map(|r| r.as_str().to_owned())
        .collect();
    in_schema.sort();
    in_code.sort();
    assert_eq!(in_schema, in_code);
    for r in all_reasons() {
        assert_eq!(serde_json::to_value(r).unwrap(), json!(r.as_str()));
    }
}

#[test]
fn internal_records_validate() {
    let p = schema("progress.v1.json");
    let started = Progress {
        step: step(),
        dispatch: 1,
        fast_ref: None,
        at_ms: 1,
        token: Some("5f1d3a0b9c8e7f6a5b4c3d2e1f0a9b8c".into()),
        event: ProgressEvent::Started,
    };
    assert_valid(&p, &serde_json::to_value(&started).unwrap());
    for outcome in [
        Outcome::Ok { output: json!(1) },
        Outcome::InDoubt {
            error: ErrorBody {
                kind: "k".into(),
                message: "m".into(),
            },
        },
    ] {
        let fin = Progress {
            event: ProgressEvent::Finished { outcome },
            ..started.clone()
        };
        assert_valid(&p, &serde_json::to_value(&fin).unwrap());
    }
    let not_invoked = Progress {
        event: ProgressEvent::NotInvoked,
        ..started.clone()
    };
    assert_valid(&p, &serde_json::to_value(&not_invoked).unwrap());
}

#[test]
fn operator_commands_and_approval_events_match_their_schemas() {
    use stepgate::contract::{Action, ApprovalEvent, ApprovalKind, Command};
    let v = schema("command.v1.json");
    for ex in examples("command.v1.json") {
        assert_valid(&v, &ex);
        let c: Command = serde_json::from_value(ex.clone()).expect("schema example parses");
        assert_eq!(serde_json::to_value(&c).unwrap(), ex, "round trip");
    }
    for action in [
        Action::ResolveExecuted {
            output: json!({"ok": true}),
        },
        Action::ResolveNotExecuted,
        Action::ResolveFailed,
        Action::Approve,
        Action::Deny,
    ] {
        let c = Command {
            id: "x-1".into(),
            step: step(),
            action,
            by: "alice".into(),
            at: "2026-11-29T08:00:00.000Z".into(),
            reason: Some("why".into()),
            run: Some(stepgate::contract::Run {
                dispatch: 2,
                intended_at_ms: 1_764_316_800_000,
            }),
        };
        assert_valid(&v, &serde_json::to_value(&c).unwrap());
    }
    // resolve_executed needs its output.
    let mut bad = examples("command.v1.json")[0].clone();
    bad.as_object_mut().unwrap().remove("output");
    assert!(!v.is_valid(&bad));
    assert!(serde_json::from_value::<Command>(bad).is_err());
    // resolve_failed needs what was found (the model is told it).
    let failed = json!({"id": "x-2", "workflow_id": "wf", "step_index": 0, "tool": "t",
        "attempt": 0, "action": "resolve_failed", "by": "dave", "at": "2026-11-29T08:00:00.000Z"});
    assert!(!v.is_valid(&failed));
    let mut with_reason = failed.clone();
    with_reason["reason"] = json!("the bank rejected it");
    assert_valid(&v, &with_reason);
    assert_eq!(
        serde_json::from_value::<Command>(with_reason)
            .unwrap()
            .action,
        Action::ResolveFailed
    );

    let v = schema("approval.v1.json");
    for ex in examples("approval.v1.json") {
        assert_valid(&v, &ex);
        let e: ApprovalEvent = serde_json::from_value(ex.clone()).expect("schema example parses");
        assert_eq!(serde_json::to_value(&e).unwrap(), ex, "round trip");
    }
    for kind in [
        ApprovalKind::Requested {
            arguments: serde_json::Map::new(),
            call_id: None,
            metadata: None,
        },
        ApprovalKind::Approved {
            by: "alice".into(),
            reason: None,
        },
        ApprovalKind::Denied {
            by: "bob".into(),
            reason: Some("no".into()),
        },
    ] {
        let e = ApprovalEvent {
            step: step(),
            event: kind,
            at: "2026-11-29T08:00:00.000Z".into(),
        };
        assert_valid(&v, &serde_json::to_value(&e).unwrap());
    }
}

/// Call v1 and Outcome v1, the messages of a pool's workers: what the gate
/// publishes and what a worker writes validate, and the schemas' examples
/// parse as the types the gate and `stepgate worker` use.
#[test]
fn worker_pool_messages_match_their_schemas() {
    use stepgate::contract::{Arguments, Call, PoolCall};
    let c = schema("call.v1.json");
    let call = Call {
        step: step(),
        arguments: Arguments::from(json!({"to": "a@example.com"}).as_object().unwrap().clone()),
        dispatch: 2,
        fast_ref: None,
        traceparent: None,
        call_id: Some("call_1".into()),
        token: Some("5f1d3a0b9c8e7f6a5b4c3d2e1f0a9b8c".into()),
    };
    let published = PoolCall::new(&call, 3, "unkeyed", 1_764_763_200_000);
    let v = serde_json::to_value(&published).unwrap();
    assert_valid(&c, &v);
    assert_eq!(v["idempotency_key"], json!(step().idempotency_key()));
    assert_eq!(v["arguments"], json!({"to": "a@example.com"}));
    let back: PoolCall = serde_json::from_slice(&published.to_json()).unwrap();
    assert_eq!(back.to_call(), call);
    for ex in examples("call.v1.json") {
        assert_valid(&c, &ex);
        serde_json::from_value::<PoolCall>(ex).expect("the example parses as a PoolCall");
    }
    // A call without its key, its partition or its token is not a call.
    for field in [
        "idempotency_key",
        "partition",
        "take_by_ms",
        "dispatch",
        "token",
    ] {
        let mut bad = v.clone();
        bad.as_object_mut().unwrap().remove(field);
        assert!(!c.is_valid(&bad), "valid without {field}");
    }

    let o = schema("outcome.v1.json");
    let started = Progress {
        step: step(),
        dispatch: 2,
        fast_ref: None,
        at_ms: 5,
        token: Some("5f1d3a0b9c8e7f6a5b4c3d2e1f0a9b8c".into()),
        event: ProgressEvent::Started,
    };
    assert_valid(&o, &serde_json::to_value(&started).unwrap());
    for outcome in [
        Outcome::Ok {
            output: json!({"id": 1}),
        },
        Outcome::Error {
            error: ErrorBody {
                kind: "tool_failed".into(),
                message: "m".into(),
            },
        },
        Outcome::InDoubt {
            error: ErrorBody {
                kind: "outcome_unknown".into(),
                message: "m".into(),
            },
        },
    ] {
        let fin = Progress {
            event: ProgressEvent::Finished { outcome },
            ..started.clone()
        };
        assert_valid(&o, &serde_json::to_value(&fin).unwrap());
    }
    // What workers write is read by the gate's decoder of `progress`.
    for ex in examples("outcome.v1.json") {
        assert_valid(&o, &ex);
        let p = Progress::decode(ex.to_string().as_bytes())
            .expect("an Outcome v1 example is a progress record");
        assert!(matches!(
            p.event,
            ProgressEvent::Started | ProgressEvent::Finished { .. }
        ));
    }
    // `not_invoked` is the gates' own, not a worker's.
    let not_invoked = Progress {
        event: ProgressEvent::NotInvoked,
        ..started.clone()
    };
    assert!(!o.is_valid(&serde_json::to_value(&not_invoked).unwrap()));
    // An outcome echoes its call's token.
    let tokenless = Progress {
        token: None,
        ..started
    };
    assert!(!o.is_valid(&serde_json::to_value(&tokenless).unwrap()));
    assert!(!o.is_valid(&json!({"step": {"workflow_id": "w", "step_index": 0, "tool": "t", "attempt": 0}, "dispatch": 1, "at_ms": 1, "event": "finished", "outcome": {"status": "ok"}})));
}
