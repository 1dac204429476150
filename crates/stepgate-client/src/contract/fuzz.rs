//! Property tests (proptest) over everything that decodes untrusted bytes in
//! the contract: intent parsing, operator commands, executor progress, and the
//! dead-letter copy of whatever was refused. Each property also holds when no
//! input panics: proptest turns a panic into a failure and shrinks it.
//!
//! `STEPGATE_FUZZ_CASES` sets the inputs per property; without it `cargo test`
//! does a short run (7 500 inputs in all). Each property prints how many ran.

use super::*;
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};

fn cases(default: u32) -> u32 {
    std::env::var("STEPGATE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Run `check` on `n` inputs from `strategy`; panic with the shrunk failing
/// input if one fails or panics. Prints how many inputs ran.
fn run<S: Strategy>(
    name: &str,
    n: u32,
    strategy: S,
    check: impl Fn(S::Value) -> Result<(), TestCaseError>,
) {
    let mut runner = TestRunner::new(Config {
        cases: n,
        failure_persistence: None,
        ..Config::default()
    });
    let ran = AtomicU64::new(0);
    let result = runner.run(&strategy, |v| {
        ran.fetch_add(1, Ordering::Relaxed);
        check(v)
    });
    if let Err(e) = result {
        panic!("{name}: {e}");
    }
    eprintln!(
        "fuzz {name}: {} inputs, none panicked",
        ran.load(Ordering::Relaxed)
    );
}

fn tools() -> Vec<String> {
    vec!["search".into(), "send_email".into()]
}

/// Strings a model, a buggy agent or an attacker might send: any Unicode,
/// control characters, lone escapes' results, very long runs.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        "[\\x00-\\x1f\\x7f-\\x{9f}]{0,16}",
        "[a-z0-9_.:-]{0,20}",
        Just("search".to_owned()),
        Just("send_email".to_owned()),
        (0usize..400).prop_map(|n| "w".repeat(n)),
    ]
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_filter_map("finite", |f| {
            serde_json::Number::from_f64(f).map(Value::Number)
        }),
        text().prop_map(Value::String),
    ]
}

/// Arbitrary JSON values, a few levels deep and wide.
fn json_value() -> impl Strategy<Value = Value> {
    json_value_keyed(text().boxed())
}

/// [`json_value`] with its objects' keys drawn from `keys`.
fn json_value_keyed(keys: BoxedStrategy<String>) -> impl Strategy<Value = Value> {
    leaf().prop_recursive(6, 48, 6, move |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Value::Array),
            btree_map(keys.clone(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A value `depth` containers deep (objects or arrays), for the depth bounds.
fn deep(depth: usize, arrays: bool) -> Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = if arrays {
            json!([v])
        } else {
            json!({ "k": v })
        };
    }
    v
}

/// A field value: usually plausible for the field, sometimes anything.
fn field(plausible: BoxedStrategy<Value>) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        3 => plausible.prop_map(Some),
        1 => json_value().prop_map(Some),
        1 => Just(None),
    ]
}

/// Intent-shaped objects: each field present or not, well-typed or not;
/// arguments sometimes nested far past every limit.
fn intent_like() -> impl Strategy<Value = Value> {
    let workflow_id = text().prop_map(Value::String).boxed();
    let index = prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (0u64..10).prop_map(Value::from),
    ]
    .boxed();
    let tool = text().prop_map(Value::String).boxed();
    let arguments = prop_oneof![
        btree_map(text(), json_value(), 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        (0usize..200, any::<bool>()).prop_map(|(d, arrays)| json!({ "a": deep(d, arrays) })),
    ]
    .boxed();
    let object = btree_map(text(), json_value(), 0..3)
        .prop_map(|m| Value::Object(m.into_iter().collect()))
        .boxed();
    (
        field(workflow_id),
        field(index.clone()),
        field(tool),
        field(index),
        field(arguments),
        field(text().prop_map(Value::String).boxed()),
        field(object),
    )
        .prop_map(
            |(workflow_id, step_index, tool, attempt, arguments, call_id, metadata)| {
                let mut m = Map::new();
                for (k, v) in [
                    ("workflow_id", workflow_id),
                    ("step_index", step_index),
                    ("tool", tool),
                    ("attempt", attempt),
                    ("arguments", arguments),
                    ("call_id", call_id),
                    ("metadata", metadata),
                ] {
                    if let Some(v) = v {
                        m.insert(k.to_owned(), v);
                    }
                }
                Value::Object(m)
            },
        )
}

/// Byte-level damage to a JSON text: what a buggy or hostile producer sends.
#[derive(Debug, Clone)]
enum Mutation {
    Insert(prop::sample::Index, Vec<u8>),
    Truncate(prop::sample::Index),
    Flip(prop::sample::Index, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let snippet = prop_oneof![
        vec(any::<u8>(), 1..8),
        Just(b"1e99999".to_vec()),
        Just(b"-123456789012345678901234567890".to_vec()),
        Just(b"\\ud800".to_vec()),
        Just(vec![0xff, 0xfe, 0x00]),
        Just(vec![0xed, 0xa0, 0x80]),
        (1usize..300).prop_map(|n| vec![b'['; n]),
        (1usize..300).prop_map(|n| b"{\"a\":".repeat(n)),
    ];
    prop_oneof![
        (any::<prop::sample::Index>(), snippet).prop_map(|(i, s)| Mutation::Insert(i, s)),
        any::<prop::sample::Index>().prop_map(Mutation::Truncate),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
    ]
}

fn apply(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let len = bytes.len().max(1);
        match m {
            Mutation::Insert(i, s) => {
                let at = i.index(len + 1).min(bytes.len());
                bytes.splice(at..at, s.iter().copied());
            }
            Mutation::Truncate(i) => bytes.truncate(i.index(len)),
            Mutation::Flip(i, b) => {
                if !bytes.is_empty() {
                    let at = i.index(bytes.len());
                    bytes[at] = *b;
                }
            }
        }
    }
    bytes
}

/// What every parse must satisfy: no panic (the runner catches those); an
/// accepted intent is within the depth bound, survives being stored inside
/// records of ours 32 levels deeper, and re-parses to itself; a rejection's
/// dead-letter copy stays under the bound.
fn check_intent(bytes: &[u8], max_bytes: usize) -> Result<(), TestCaseError> {
    match parse_intent(bytes, max_bytes, &tools()) {
        Ok(intent) => {
            // The text sent to the tool is one JSON object, the byte scan
            // of its depth agrees with the tree's, and the record keeps it.
            let parsed = serde_json::from_str::<Value>(intent.arguments.as_str());
            prop_assert!(
                matches!(parsed, Ok(Value::Object(_))),
                "arguments text: {:?}",
                parsed
            );
            let args = intent.arguments.to_value();
            prop_assert!(!nested_deeper_than(&args, MAX_NESTING_DEPTH));
            let stored: crate::contract::Arguments =
                crate::contract::codec::decode(&crate::contract::codec::encode(&intent.arguments))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(stored.as_str(), intent.arguments.as_str());
            let mut stored = args;
            for _ in 0..32 {
                stored = json!({ "record": stored });
            }
            let text =
                serde_json::to_vec(&stored).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(
                serde_json::from_slice::<Value>(&text).is_ok(),
                "stored arguments unreadable"
            );
            // What stepgate re-publishes of it parses again to the same step
            // (floats may differ in the last bit: serde_json's fast parser).
            let again =
                serde_json::to_vec(&intent).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let reparsed = parse_intent(&again, usize::MAX, &tools())
                .map_err(|r| TestCaseError::fail(format!("re-parse: {}", r.message)))?;
            prop_assert_eq!(reparsed.step_key(), intent.step_key());
            prop_assert_eq!(reparsed.call_id, intent.call_id);
        }
        Err(rejection) => {
            prop_assert!(!rejection.message.is_empty());
            let d = DlqRecord::new(&rejection, "stepgate.intents", 0, 0, bytes, Utc::now());
            let json = d.to_json();
            prop_assert!(json.len() <= DLQ_RECORD_MAX_BYTES, "{} bytes", json.len());
            prop_assert_eq!(d.payload_bytes, bytes.len() as u64);
        }
    }
    Ok(())
}

#[test]
fn intent_parsing_never_panics_on_arbitrary_bytes() {
    run(
        "parse_intent(arbitrary bytes)",
        cases(2_000),
        (vec(any::<u8>(), 0..2048), 0usize..4096),
        |(bytes, max)| check_intent(&bytes, max),
    );
}

#[test]
fn intent_parsing_never_panics_on_plausible_json() {
    run(
        "parse_intent(intent-shaped JSON)",
        cases(1_000),
        intent_like(),
        |v| check_intent(v.to_string().as_bytes(), 1 << 20),
    );
}

#[test]
fn intent_parsing_never_panics_on_damaged_json() {
    run(
        "parse_intent(damaged intent JSON)",
        cases(1_000),
        (
            intent_like(),
            vec(mutation(), 1..4),
            prop_oneof![Just(1usize << 20), 0usize..512],
        ),
        |(v, muts, max)| check_intent(&apply(v.to_string().into_bytes(), &muts), max),
    );
}

/// Command-shaped objects: an action, a step key, anything else.
fn command_like() -> impl Strategy<Value = Value> {
    (
        intent_like(),
        prop_oneof![
            Just("resolve_executed"),
            Just("resolve_not_executed"),
            Just("resolve_failed"),
            Just("approve"),
            Just("deny"),
            Just("explode"),
        ],
        field(text().prop_map(Value::String).boxed()),
        field(json_value().boxed()),
    )
        .prop_map(|(mut v, action, by, output)| {
            v["action"] = json!(action);
            v["id"] = json!("cmd-1");
            v["at"] = json!("2026-11-29T20:00:00Z");
            if let Some(by) = by {
                v["by"] = by;
            }
            if let Some(o) = output {
                v["output"] = o;
            }
            v
        })
}

#[test]
fn command_and_progress_decoding_never_panics() {
    let decode = |bytes: &[u8]| {
        // A command that decodes re-encodes to something that decodes.
        if let Ok(c) = serde_json::from_slice::<Command>(bytes) {
            let again = serde_json::to_vec(&c).expect("a Command serialises");
            assert!(serde_json::from_slice::<Command>(&again).is_ok());
        }
        let _ = serde_json::from_slice::<Progress>(bytes);
        let _ = serde_json::from_slice::<ApprovalEvent>(bytes);
        let _ = serde_json::from_slice::<ToolResult>(bytes);
    };
    run(
        "decode command/progress(arbitrary bytes)",
        cases(2_000),
        vec(any::<u8>(), 0..1024),
        |b| {
            decode(&b);
            Ok(())
        },
    );
    run(
        "decode command/progress(command-shaped, damaged)",
        cases(1_000),
        (command_like(), vec(mutation(), 0..3)),
        |(v, muts)| {
            decode(&apply(v.to_string().into_bytes(), &muts));
            Ok(())
        },
    );
}

#[test]
fn dlq_records_never_panic_and_stay_under_the_bound() {
    let reasons = [
        RejectionReason::Oversized,
        RejectionReason::MalformedJson,
        RejectionReason::BadCommand,
        RejectionReason::TooDeep,
        RejectionReason::Unprocessable,
        RejectionReason::WrongPartition,
    ];
    let payload = prop_oneof![
        vec(any::<u8>(), 0..512),
        // Large: past the prefix, all control bytes (6 bytes each escaped),
        // all high bytes (base64), or text with multi-byte characters.
        (0usize..300_000, any::<u8>()).prop_map(|(n, b)| vec![b; n]),
        (
            DLQ_PAYLOAD_PREFIX_BYTES - 4..DLQ_PAYLOAD_PREFIX_BYTES + 4,
            any::<char>()
        )
            .prop_map(|(n, c)| c.to_string().repeat(n / c.len_utf8()).into_bytes()),
    ];
    run(
        "DlqRecord::new",
        cases(500),
        (payload, any::<String>(), 0usize..4, text(), any::<i64>()),
        |(payload, message, r, topic, offset)| {
            let rej = Rejection::new(reasons[r], message.repeat(1 + 5000 / (message.len() + 1)));
            let d = DlqRecord::new(&rej, &topic, 3, offset, &payload, Utc::now());
            let json = d.to_json();
            prop_assert!(json.len() <= DLQ_RECORD_MAX_BYTES, "{} bytes", json.len());
            let back: DlqRecord =
                serde_json::from_slice(&json).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&back, &d);
            prop_assert_eq!(d.payload_bytes, payload.len() as u64);
            prop_assert_eq!(
                d.payload_truncated,
                payload.len() > DLQ_PAYLOAD_PREFIX_BYTES
            );
            Ok(())
        },
    );
}

#[test]
fn compact_records_decode_as_the_named_ones_and_bad_ones_never_panic() {
    // Keys drawn from the field names as often as not: those are compacted.
    let key = prop_oneof![
        text(),
        proptest::sample::select(codec::FIELD_NAMES).prop_map(str::to_owned),
    ];
    let value = json_value_keyed(key.boxed());
    run("compact(any record)", cases(1_500), value, |v| {
        let named = codec::encode(&v);
        let compact = codec::compact(&named).expect("a JSON value always compacts");
        prop_assert!(compact.len() <= named.len());
        prop_assert_eq!(&*codec::expand(&compact).unwrap(), &named[..]);
        prop_assert_eq!(codec::decode::<Value>(&compact).unwrap(), v);
        Ok(())
    });
    run(
        "decode compact(arbitrary bytes)",
        cases(1_500),
        vec(any::<u8>(), 0..512),
        |mut b| {
            b.insert(0, codec::MSGPACK_NUMBERED_V2);
            let _ = codec::decode::<Value>(&b);
            Ok(())
        },
    );
}
