//! Turning raw intent bytes into an [`Intent`], or a precise [`Rejection`].

use super::{
    Arguments, Intent, MAX_TOOL_NAME_CHARS, MAX_WORKFLOW_ID_BYTES, StepKey, Texts, text_deeper_than,
};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashSet;

/// Why an input was refused (the `reason` of a DLQ record, the `error.kind` of a
/// `rejected` result).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RejectionReason {
    Oversized,
    MalformedJson,
    NotAnObject,
    MissingField,
    WrongType,
    InvalidValue,
    UnknownTool,
    /// A new step of a workflow that a `last_step` tool ended.
    WorkflowEnded,
    /// An operator command that is unreadable or does not fit the step's state.
    BadCommand,
    /// An operator command about a run of its step that is no longer the
    /// current one (the step was re-run or re-created since it was looked at).
    StaleCommand,
    /// A repeat of a recorded step whose identity arguments (the tool's
    /// `identity`) differ: another call, not a retry.
    IdentityConflict,
    /// `arguments` or `metadata` nested deeper than [`MAX_NESTING_DEPTH`].
    TooDeep,
    /// Processing failed again and again on a stored record stepgate cannot
    /// read: the input was set aside so the partition moves on.
    Unprocessable,
    /// Published to a partition other than its workflow's.
    WrongPartition,
    /// Older than the state retention and its step has no record: it may be a
    /// re-read (group offsets lost) of a call whose record was purged.
    Expired,
    /// A record of `progress` that does not prove where it comes from (a
    /// worker's without its pool's signature, one without its dispatch's
    /// token, …): it settles nothing.
    RefusedProgress,
}

impl RejectionReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RejectionReason::Oversized => "oversized",
            RejectionReason::MalformedJson => "malformed_json",
            RejectionReason::NotAnObject => "not_an_object",
            RejectionReason::MissingField => "missing_field",
            RejectionReason::WrongType => "wrong_type",
            RejectionReason::InvalidValue => "invalid_value",
            RejectionReason::UnknownTool => "unknown_tool",
            RejectionReason::WorkflowEnded => "workflow_ended",
            RejectionReason::BadCommand => "bad_command",
            RejectionReason::StaleCommand => "stale_command",
            RejectionReason::IdentityConflict => "identity_conflict",
            RejectionReason::TooDeep => "too_deep",
            RejectionReason::Unprocessable => "unprocessable",
            RejectionReason::WrongPartition => "wrong_partition",
            RejectionReason::Expired => "expired",
            RejectionReason::RefusedProgress => "refused_progress",
        }
    }
}

/// A refused intent: the reason, a model-readable message, and — when the intent's
/// `workflow_id`, `step_index` and `tool` could be read — where to address a
/// `rejected` result.
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub reason: RejectionReason,
    pub message: String,
    pub address: Option<Address>,
}

/// Enough of an invalid intent to answer the agent waiting for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Address {
    pub step: StepKey,
    pub call_id: Option<String>,
}

impl Rejection {
    pub fn new(reason: RejectionReason, message: String) -> Self {
        Rejection {
            reason,
            message,
            address: None,
        }
    }
}

/// Any JSON value, read whole and dropped, refusing an object with a key
/// twice. Unlike `IgnoredAny`, which skips a number's digits, every number is
/// parsed: one beyond a double's range (`1e400`) is refused with its intent,
/// where the gate, a tool's body with its idempotency key set inside, or the
/// console would otherwise each read the arguments as a tree and fail on it.
/// A duplicate key is refused because readers disagree on it: the console
/// (serde_json) shows the last value, a tool's parser may take the first, and
/// the approver would approve what does not run. Where the duplicate is goes
/// to `duplicate` (a JSON Pointer) and the parse stops.
#[derive(Clone, Copy)]
struct Parses<'a> {
    at: Option<&'a PathStep<'a>>,
    duplicate: &'a RefCell<Option<String>>,
}

/// One step of the path from the checked value's root: a key or an index,
/// and the step above it (a list on the stack: nothing is allocated for a
/// path unless a duplicate is found).
struct PathStep<'a> {
    step: KeyOrIndex<'a>,
    up: Option<&'a PathStep<'a>>,
}

enum KeyOrIndex<'a> {
    Key(&'a str),
    Index(usize),
}

impl<'a> Parses<'a> {
    fn below<'b>(&self, at: &'b PathStep<'b>) -> Parses<'b>
    where
        'a: 'b,
    {
        Parses {
            at: Some(at),
            duplicate: self.duplicate,
        }
    }

    /// The JSON Pointer (RFC 6901) of `key` under this value.
    fn pointer_to(&self, key: &str) -> String {
        let escape = |s: &str| s.replace('~', "~0").replace('/', "~1");
        let mut parts = vec![escape(key)];
        let mut at = self.at;
        while let Some(s) = at {
            parts.push(match s.step {
                KeyOrIndex::Key(k) => escape(k),
                KeyOrIndex::Index(i) => i.to_string(),
            });
            at = s.up;
        }
        parts.reverse();
        format!("/{}", parts.join("/"))
    }
}

impl<'de> DeserializeSeed<'de> for Parses<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// A map key, borrowed from the input when it has no escapes.
struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("an object key")
    }
    fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(s))
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(s.to_owned()))
    }
    fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(s))
    }
}

/// The keys an object has shown so far: a list while it is short, a set
/// beyond.
#[derive(Default)]
struct Seen<'de> {
    few: Vec<Cow<'de, str>>,
    many: HashSet<Cow<'de, str>>,
}

impl<'de> Seen<'de> {
    /// Whether `key` was new.
    fn insert(&mut self, key: Cow<'de, str>) -> bool {
        const FEW: usize = 16;
        if self.many.is_empty() {
            if self.few.contains(&key) {
                return false;
            }
            if self.few.len() < FEW {
                self.few.push(key);
                return true;
            }
            self.many.extend(self.few.drain(..));
        }
        self.many.insert(key)
    }
}

impl<'de> Visitor<'de> for Parses<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0;
        loop {
            let at = PathStep {
                step: KeyOrIndex::Index(i),
                up: self.at,
            };
            if seq.next_element_seed(self.below(&at))?.is_none() {
                return Ok(());
            }
            i += 1;
        }
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = Seen::default();
        while let Some(key) = map.next_key_seed(Key)? {
            let at = PathStep {
                step: KeyOrIndex::Key(&key),
                up: self.at,
            };
            map.next_value_seed(self.below(&at))?;
            if !seen.insert(key.clone()) {
                *self.duplicate.borrow_mut() = Some(self.pointer_to(&key));
                return Err(de::Error::custom("an object has a key twice"));
            }
        }
        Ok(())
    }
}

/// Why [`check_json`] refused a value's text.
enum JsonProblem {
    /// A key twice in one object, at this JSON Pointer.
    Duplicate(String),
    /// Not valid JSON, or a number beyond a double's range.
    Invalid(serde_json::Error),
}

/// Read a JSON text whole, refusing a key twice in any object.
fn check_json(text: &str) -> Result<(), JsonProblem> {
    let duplicate = RefCell::new(None);
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = Parses {
        at: None,
        duplicate: &duplicate,
    }
    .deserialize(&mut de)
    .and_then(|()| de.end());
    match (parsed, duplicate.into_inner()) {
        (Ok(()), _) => Ok(()),
        (Err(_), Some(pointer)) => Err(JsonProblem::Duplicate(pointer)),
        (Err(e), None) => Err(JsonProblem::Invalid(e)),
    }
}

/// The top level of an intent, each field's value as its raw text, in order;
/// and the first field that came twice (its first value is kept).
struct Fields<'a> {
    fields: Vec<(String, &'a RawValue)>,
    twice: Option<String>,
}

impl<'de: 'a, 'a> Deserialize<'de> for Fields<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Fields<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Fields<'de>, A::Error> {
                let mut out = Fields {
                    fields: Vec::new(),
                    twice: None,
                };
                while let Some(name) = map.next_key::<String>()? {
                    let value: &'de RawValue = map.next_value()?;
                    if out.fields.iter().any(|(n, _)| *n == name) {
                        out.twice.get_or_insert(name);
                    } else {
                        out.fields.push((name, value));
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_map(V)
    }
}

/// Deepest nesting of an intent's `arguments` and `metadata` (the object itself
/// is level 1). serde_json refuses documents nested deeper than 128, and
/// stepgate stores arguments and outputs inside records of its own, a few
/// levels deeper: an intent accepted near that limit made a record that could
/// never be read back, and every later repeat of its step failed. 64 leaves
/// ample room on both sides.
pub const MAX_NESTING_DEPTH: usize = 64;

/// Beyond this size an oversized intent is not even parsed to find its address.
const PARSE_FOR_ADDRESS_LIMIT: usize = 16 * 1024 * 1024;

/// Parse and validate an intent. `known_tools` is the configured tool names, sorted.
pub fn parse_intent(
    bytes: &[u8],
    max_bytes: usize,
    known_tools: &[String],
) -> Result<Intent, Rejection> {
    if bytes.len() > max_bytes {
        let address = if bytes.len() <= PARSE_FOR_ADDRESS_LIMIT {
            serde_json::from_slice::<Value>(bytes)
                .ok()
                .and_then(|v| v.as_object().and_then(read_address))
        } else {
            None
        };
        let tool = address.as_ref().map_or("?", |a| a.step.tool.as_str());
        return Err(Rejection {
            reason: RejectionReason::Oversized,
            message: Texts::oversized(tool, bytes.len(), max_bytes),
            address,
        });
    }
    // The top level is read field by field, each as its raw text: `arguments`
    // stays text (see [`Arguments`]), the other fields are small and parsed.
    let Fields { fields, twice } = match serde_json::from_slice(bytes) {
        Ok(f) => f,
        Err(_) => {
            return Err(match serde_json::from_slice::<Value>(bytes) {
                Ok(value) => Rejection::new(
                    RejectionReason::NotAnObject,
                    format!(
                        "the intent must be a JSON object, got {}",
                        type_name(&value)
                    ),
                ),
                Err(e) => Rejection::new(
                    RejectionReason::MalformedJson,
                    format!("the intent is not valid JSON: {e}"),
                ),
            });
        }
    };
    let mut obj = Map::new();
    let mut raw_arguments = None;
    let mut raw_metadata = None;
    for (name, raw) in fields {
        if name == "arguments" {
            raw_arguments = Some(raw);
            continue;
        }
        if name == "metadata" {
            raw_metadata = Some(raw);
        }
        // Valid JSON already; what can still fail is a number out of range.
        let value = serde_json::from_str(raw.get()).map_err(|e| {
            Rejection::new(
                RejectionReason::MalformedJson,
                format!("the intent is not valid JSON: {e}"),
            )
        })?;
        obj.insert(name, value);
    }
    let address = read_address(&obj);
    let tool_label = obj
        .get("tool")
        .and_then(Value::as_str)
        .filter(|t| valid_tool_name(t))
        .unwrap_or("?")
        .to_owned();
    let reject = |reason: RejectionReason, problem: String| Rejection {
        reason,
        message: Texts::rejected_field(&tool_label, &problem),
        address: address.clone(),
    };
    let duplicate = |place: &str, pointer: &str| Rejection {
        reason: RejectionReason::InvalidValue,
        message: Texts::duplicate_key(&tool_label, place, &quoted(pointer)),
        address: address.clone(),
    };
    if let Some(name) = twice {
        return Err(duplicate("the intent", &format!("/{name}")));
    }

    let workflow_id = match obj.get("workflow_id") {
        None | Some(Value::Null) => {
            return Err(reject(
                RejectionReason::MissingField,
                "the required field `workflow_id` is missing (a string of 1 to 255 bytes naming the workflow)".into(),
            ));
        }
        Some(Value::String(s)) => {
            if let Err(problem) = check_workflow_id(s) {
                return Err(reject(RejectionReason::InvalidValue, problem));
            }
            s.clone()
        }
        Some(other) => {
            return Err(reject(
                RejectionReason::WrongType,
                format!("`workflow_id` must be a string, got {}", type_name(other)),
            ));
        }
    };
    let step_index = match required_u64(&obj, "step_index") {
        Ok(n) => n,
        Err((reason, problem)) => return Err(reject(reason, problem)),
    };
    let tool = match obj.get("tool") {
        None | Some(Value::Null) => {
            return Err(reject(
                RejectionReason::MissingField,
                "the required field `tool` is missing (the name of the tool to call)".into(),
            ));
        }
        Some(Value::String(t)) if valid_tool_name(t) => t.clone(),
        Some(Value::String(_)) => {
            return Err(reject(
                RejectionReason::InvalidValue,
                format!(
                    "`tool` must be 1 to {MAX_TOOL_NAME_CHARS} characters of letters, digits, `_`, `.`, `:` or `-`"
                ),
            ));
        }
        Some(other) => {
            return Err(reject(
                RejectionReason::WrongType,
                format!("`tool` must be a string, got {}", type_name(other)),
            ));
        }
    };
    let attempt = match obj.get("attempt") {
        None | Some(Value::Null) => 0,
        Some(_) => match required_u64(&obj, "attempt") {
            Ok(n) => n,
            Err((reason, problem)) => return Err(reject(reason, problem)),
        },
    };
    let (arguments, arguments_too_deep) = match raw_arguments.map(RawValue::get) {
        None | Some("null") => {
            return Err(reject(
                RejectionReason::MissingField,
                "the required field `arguments` is missing (a JSON object of the tool's arguments, `{}` when there are none)".into(),
            ));
        }
        Some(text) if text.starts_with('{') => {
            // Checked whole (numbers in range, each key once), without
            // building the tree; too deep, it is refused below as such, with
            // no parse.
            let too_deep = text_deeper_than(text, MAX_NESTING_DEPTH);
            match if too_deep { Ok(()) } else { check_json(text) } {
                Ok(()) => {}
                Err(JsonProblem::Duplicate(pointer)) => {
                    return Err(duplicate("`arguments`", &pointer));
                }
                Err(JsonProblem::Invalid(e)) => {
                    return Err(if e.to_string().starts_with("number out of range") {
                        reject(
                            RejectionReason::InvalidValue,
                            format!(
                                "a number in `arguments` is beyond what JSON readers hold (a 64-bit float, at most about 1.8e308; {e}): send it as a string, or a smaller number"
                            ),
                        )
                    } else {
                        Rejection::new(
                            RejectionReason::MalformedJson,
                            format!("the intent is not valid JSON: {e}"),
                        )
                    });
                }
            }
            (Arguments::from_checked(text), too_deep)
        }
        Some(text) => {
            // Valid JSON: its first byte says what it is (no parse, however deep).
            let got = match text.as_bytes()[0] {
                b'[' => "an array",
                b'"' => "a string",
                b't' | b'f' => "a boolean",
                _ => "a number",
            };
            return Err(reject(
                RejectionReason::WrongType,
                format!("`arguments` must be a JSON object of named arguments, got {got}"),
            ));
        }
    };
    let call_id = match obj.get("call_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.chars().any(char::is_control) => {
            return Err(reject(
                RejectionReason::InvalidValue,
                "`call_id` must not contain control characters (it is echoed in answers, logs and audits): use letters, digits and punctuation".into(),
            ));
        }
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => {
            return Err(reject(
                RejectionReason::WrongType,
                format!("`call_id` must be a string, got {}", type_name(other)),
            ));
        }
    };
    let metadata = match obj.get("metadata") {
        None | Some(Value::Null) => None,
        Some(Value::Object(m)) => {
            // Parsed already (last value wins): its text says whether a key
            // came twice.
            if let Some(Err(JsonProblem::Duplicate(pointer))) =
                raw_metadata.map(|r| check_json(r.get()))
            {
                return Err(duplicate("`metadata`", &pointer));
            }
            Some(m.clone())
        }
        Some(other) => {
            return Err(reject(
                RejectionReason::WrongType,
                format!("`metadata` must be a JSON object, got {}", type_name(other)),
            ));
        }
    };
    let too_deep = if arguments_too_deep {
        Some("arguments")
    } else if metadata
        .as_ref()
        .is_some_and(|m| object_deeper_than(m, MAX_NESTING_DEPTH))
    {
        Some("metadata")
    } else {
        None
    };
    if let Some(field) = too_deep {
        return Err(Rejection {
            reason: RejectionReason::TooDeep,
            message: Texts::too_deep(&tool_label, field, MAX_NESTING_DEPTH),
            address,
        });
    }
    if known_tools.binary_search(&tool).is_err() {
        return Err(Rejection {
            reason: RejectionReason::UnknownTool,
            message: Texts::unknown_tool(&tool, known_tools),
            address,
        });
    }
    Ok(Intent {
        workflow_id,
        step_index,
        tool,
        attempt,
        arguments,
        call_id,
        metadata,
    })
}

/// A JSON Pointer as a JSON string: quoted, control characters escaped (it
/// is read by a model, and may hold any key an agent sent).
fn quoted(pointer: &str) -> String {
    serde_json::to_string(pointer).unwrap_or_else(|_| "\"?\"".into())
}

fn required_u64(obj: &Map<String, Value>, field: &str) -> Result<u64, (RejectionReason, String)> {
    match obj.get(field) {
        None | Some(Value::Null) => Err((
            RejectionReason::MissingField,
            format!("the required field `{field}` is missing (an integer ≥ 0)"),
        )),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(v) => Ok(v),
            None if n.as_i64().is_some() => Err((
                RejectionReason::InvalidValue,
                format!("`{field}` must be an integer ≥ 0, got {n}"),
            )),
            None => Err((
                RejectionReason::WrongType,
                format!("`{field}` must be an integer ≥ 0, got the non-integer {n}"),
            )),
        },
        Some(other) => Err((
            RejectionReason::WrongType,
            format!("`{field}` must be an integer ≥ 0, got {}", type_name(other)),
        )),
    }
}

fn check_workflow_id(s: &str) -> Result<(), String> {
    if s.is_empty() {
        return Err("`workflow_id` must not be empty".into());
    }
    if s.len() > MAX_WORKFLOW_ID_BYTES {
        return Err(format!(
            "`workflow_id` must be at most {MAX_WORKFLOW_ID_BYTES} bytes, got {}",
            s.len()
        ));
    }
    if s.chars().any(char::is_control) {
        return Err("`workflow_id` must not contain control characters".into());
    }
    Ok(())
}

/// The one tool-name rule (intents and the config): 1 to 128 of
/// `[A-Za-z0-9_.:-]` (ASCII, so characters and bytes count alike).
pub fn valid_tool_name(t: &str) -> bool {
    (1..=MAX_TOOL_NAME_CHARS).contains(&t.len())
        && t.bytes()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b':' | b'-'))
}

/// Best-effort: the step key of an intent that fails validation, if it can be read.
fn read_address(obj: &Map<String, Value>) -> Option<Address> {
    let workflow_id = obj.get("workflow_id")?.as_str()?;
    check_workflow_id(workflow_id).ok()?;
    let step_index = obj.get("step_index")?.as_u64()?;
    let tool = obj.get("tool")?.as_str().filter(|t| valid_tool_name(t))?;
    let attempt = obj.get("attempt").and_then(Value::as_u64).unwrap_or(0);
    Some(Address {
        step: StepKey {
            workflow_id: workflow_id.to_owned(),
            step_index,
            tool: tool.to_owned(),
            attempt,
        },
        call_id: obj
            .get("call_id")
            .and_then(Value::as_str)
            .map(str::to_owned),
    })
}

/// Whether a JSON value nests arrays or objects more than `limit` levels deep
/// (a scalar is level 0, `{}` and `[]` level 1). For every value stepgate
/// stores inside records of its own (arguments, metadata, outputs, an
/// operator's `output`): within the bound, it can always be read back.
pub fn nested_deeper_than(v: &Value, limit: usize) -> bool {
    deeper_than(vec![(v, 1)], limit)
}

/// Whether an object holds arrays or objects more than `limit` levels deep
/// (the object itself is level 1).
fn object_deeper_than(obj: &Map<String, Value>, limit: usize) -> bool {
    limit == 0 || deeper_than(obj.values().map(|v| (v, 2)).collect(), limit)
}

/// Iterative, as depth is what it guards against: `stack` holds values with
/// the level each container among them would be at.
fn deeper_than(mut stack: Vec<(&Value, usize)>, limit: usize) -> bool {
    while let Some((v, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Array(a) => Box::new(a.iter()),
            Value::Object(m) => Box::new(m.values()),
            _ => continue,
        };
        if depth > limit {
            return true;
        }
        stack.extend(children.map(|c| (c, depth + 1)));
    }
    false
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Vec<String> {
        vec!["search".into(), "send_email".into()]
    }

    fn parse(v: Value) -> Result<Intent, Rejection> {
        parse_intent(v.to_string().as_bytes(), 1 << 20, &tools())
    }

    #[test]
    fn a_full_intent_parses_and_unknown_fields_are_ignored() {
        let i = parse(
            json!({"workflow_id": "w", "step_index": 3, "tool": "send_email",
            "attempt": 1, "arguments": {"to": "a"}, "call_id": "c", "metadata": {"m": 1},
            "future_field": true}),
        )
        .unwrap();
        assert_eq!(i.step_key().to_string(), "w#3/send_email@1");
        assert_eq!(i.call_id.as_deref(), Some("c"));
    }

    fn raw(text: &str) -> Result<Intent, Rejection> {
        parse_intent(text.as_bytes(), 1 << 20, &tools())
    }

    #[test]
    fn a_key_twice_anywhere_is_refused_naming_where() {
        let head = r#""workflow_id":"w","step_index":0,"tool":"send_email","call_id":"c1""#;
        for (text, place, pointer) in [
            (
                format!(r#"{{{head},"arguments":{{"to":"attacker","amount":1,"to":"alice"}}}}"#),
                "`arguments`",
                r#""/to""#,
            ),
            (
                format!(r#"{{{head},"arguments":{{"a":[{{"x":1}},{{"y/z":1,"y/z":2}}]}}}}"#),
                "`arguments`",
                r#""/a/1/y~1z""#,
            ),
            // An escaped key is the same key.
            (
                format!(r#"{{{head},"arguments":{{"k":1,"k":2}}}}"#),
                "`arguments`",
                r#""/k""#,
            ),
            (
                format!(r#"{{{head},"arguments":{{}},"metadata":{{"m":{{"n":1,"n":2}}}}}}"#),
                "`metadata`",
                r#""/m/n""#,
            ),
            (
                format!(r#"{{{head},"arguments":{{}},"tool":"search"}}"#),
                "the intent",
                r#""/tool""#,
            ),
        ] {
            let r = raw(&text).unwrap_err();
            assert_eq!(r.reason, RejectionReason::InvalidValue, "{text}");
            assert!(r.message.contains(place), "{text}: {}", r.message);
            assert!(r.message.contains(pointer), "{text}: {}", r.message);
            assert!(r.message.contains("Send each key once"), "{}", r.message);
            // Still answered: the agent waiting for c1 learns why.
            assert_eq!(r.address.unwrap().call_id.as_deref(), Some("c1"));
        }
        // Many keys (past the short list) and the same key in sibling
        // objects are fine; so is a key in an object nested in itself.
        let many: Vec<String> = (0..40).map(|i| format!(r#""k{i}":{i}"#)).collect();
        let ok = format!(
            r#"{{{head},"arguments":{{{},"o":{{"k0":1,"o":{{"k0":2}}}},"p":[{{"k0":1}},{{"k0":1}}]}}}}"#,
            many.join(",")
        );
        raw(&ok).expect("no key twice in one object");
        let dup_late = format!(r#"{{{head},"arguments":{{{},"k39":0}}}}"#, many.join(","));
        assert!(raw(&dup_late).unwrap_err().message.contains(r#""/k39""#));
    }

    #[test]
    fn a_call_id_with_control_characters_is_refused() {
        let r = parse(
            json!({"workflow_id": "w", "step_index": 0, "tool": "search",
            "arguments": {}, "call_id": "c\u{1b}[2J"}),
        )
        .unwrap_err();
        assert_eq!(r.reason, RejectionReason::InvalidValue);
        assert!(
            r.message
                .contains("`call_id` must not contain control characters")
        );
        parse(
            json!({"workflow_id": "w", "step_index": 0, "tool": "search",
            "arguments": {}, "call_id": "call_ABC-1.2:é"}),
        )
        .expect("printable");
    }

    #[test]
    fn attempt_defaults_to_zero() {
        let i =
            parse(json!({"workflow_id": "w", "step_index": 0, "tool": "search", "arguments": {}}))
                .unwrap();
        assert_eq!(i.attempt, 0);
        assert_eq!(i.call_id, None);
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases = [
            (
                json!({"step_index": 0, "tool": "search", "arguments": {}}),
                RejectionReason::MissingField,
                "`workflow_id`",
            ),
            (
                json!({"workflow_id": 5, "step_index": 0, "tool": "search", "arguments": {}}),
                RejectionReason::WrongType,
                "`workflow_id` must be a string",
            ),
            (
                json!({"workflow_id": "", "step_index": 0, "tool": "search", "arguments": {}}),
                RejectionReason::InvalidValue,
                "must not be empty",
            ),
            (
                json!({"workflow_id": "a\nb", "step_index": 0, "tool": "search", "arguments": {}}),
                RejectionReason::InvalidValue,
                "control characters",
            ),
            (
                json!({"workflow_id": "w", "step_index": "3", "tool": "search", "arguments": {}}),
                RejectionReason::WrongType,
                "`step_index` must be an integer ≥ 0, got a string",
            ),
            (
                json!({"workflow_id": "w", "step_index": -1, "tool": "search", "arguments": {}}),
                RejectionReason::InvalidValue,
                "got -1",
            ),
            (
                json!({"workflow_id": "w", "step_index": 1.5, "tool": "search", "arguments": {}}),
                RejectionReason::WrongType,
                "non-integer 1.5",
            ),
            (
                json!({"workflow_id": "w", "step_index": 0, "tool": "bad tool", "arguments": {}}),
                RejectionReason::InvalidValue,
                "`tool` must be 1 to 128",
            ),
            (
                json!({"workflow_id": "w", "step_index": 0, "tool": "search", "arguments": "q"}),
                RejectionReason::WrongType,
                "`arguments` must be a JSON object",
            ),
            (
                json!({"workflow_id": "w", "step_index": 0, "tool": "search"}),
                RejectionReason::MissingField,
                "`arguments` is missing",
            ),
            (
                json!({"workflow_id": "w", "step_index": 0, "tool": "search", "arguments": {}, "attempt": "1"}),
                RejectionReason::WrongType,
                "`attempt`",
            ),
            (
                json!({"workflow_id": "w", "step_index": 0, "tool": "search", "arguments": {}, "call_id": 7}),
                RejectionReason::WrongType,
                "`call_id` must be a string",
            ),
            (
                json!({"workflow_id": "w", "step_index": 0, "tool": "search", "arguments": {}, "metadata": []}),
                RejectionReason::WrongType,
                "`metadata` must be a JSON object",
            ),
        ];
        for (input, reason, needle) in cases {
            let r = parse(input.clone()).unwrap_err();
            assert_eq!(r.reason, reason, "{input}");
            assert!(r.message.contains(needle), "{input}: {}", r.message);
        }
    }

    #[test]
    fn addressable_rejections_carry_the_step() {
        let r = parse(json!({"workflow_id": "w", "step_index": 2, "tool": "search", "arguments": [1], "call_id": "c1"}))
            .unwrap_err();
        let a = r.address.unwrap();
        assert_eq!(a.step.to_string(), "w#2/search@0");
        assert_eq!(a.call_id.as_deref(), Some("c1"));
        let r = parse(
            json!({"workflow_id": "w", "step_index": "x", "tool": "search", "arguments": {}}),
        )
        .unwrap_err();
        assert!(r.address.is_none());
    }

    #[test]
    fn unknown_tool_lists_the_available_ones() {
        let r = parse(
            json!({"workflow_id": "w", "step_index": 0, "tool": "send_mail", "arguments": {}}),
        )
        .unwrap_err();
        assert_eq!(r.reason, RejectionReason::UnknownTool);
        assert!(r.message.contains("`search`, `send_email`"));
        assert!(r.address.is_some());
    }

    /// `{"k": {"k": … {}}}`, `levels` objects deep (the outer one included).
    fn nested(levels: usize) -> Value {
        let mut v = json!({});
        for _ in 1..levels {
            v = json!({ "k": v });
        }
        v
    }

    #[test]
    fn one_tool_name_rule() {
        assert!(valid_tool_name("a"));
        assert!(valid_tool_name("crm.create_ticket:v2-b"));
        assert!(valid_tool_name(&"x".repeat(MAX_TOOL_NAME_CHARS)));
        assert!(!valid_tool_name(&"x".repeat(MAX_TOOL_NAME_CHARS + 1)));
        for bad in ["", "bad tool", "café", "a/b", "a\n"] {
            assert!(!valid_tool_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn arguments_and_metadata_deeper_than_the_limit_are_rejected() {
        let ok = parse(
            json!({"workflow_id": "w", "step_index": 0, "tool": "search",
            "arguments": nested(MAX_NESTING_DEPTH), "metadata": nested(MAX_NESTING_DEPTH)}),
        );
        assert!(ok.is_ok(), "{ok:?}");
        for field in ["arguments", "metadata"] {
            let mut intent = json!({"workflow_id": "w", "step_index": 1, "tool": "search",
                "arguments": {}, "call_id": "c"});
            intent[field] = nested(MAX_NESTING_DEPTH + 1);
            let r = parse(intent).unwrap_err();
            assert_eq!(r.reason, RejectionReason::TooDeep, "{field}");
            assert!(
                r.message
                    .contains(&format!("`{field}` is nested more than 64")),
                "{}",
                r.message
            );
            assert_eq!(r.address.unwrap().step.to_string(), "w#1/search@0");
        }
        // Arrays count as levels too.
        let mut deep = json!([]);
        for _ in 0..MAX_NESTING_DEPTH {
            deep = json!([deep]);
        }
        let r = parse(
            json!({"workflow_id": "w", "step_index": 0, "tool": "search",
            "arguments": {"a": deep}}),
        )
        .unwrap_err();
        assert_eq!(r.reason, RejectionReason::TooDeep);
    }

    #[test]
    fn depth_of_any_value() {
        assert!(!nested_deeper_than(&json!(1), 0));
        assert!(nested_deeper_than(&json!([]), 0));
        assert!(!nested_deeper_than(&json!([]), 1));
        assert!(!nested_deeper_than(&nested(64), 64));
        assert!(nested_deeper_than(&nested(65), 64));
        assert!(nested_deeper_than(&json!([1, [2, [3]]]), 2));
        assert!(!nested_deeper_than(&json!([1, [2, [3]]]), 3));
    }

    #[test]
    fn beyond_serde_jsons_own_limit_is_malformed_not_a_panic() {
        let deep = format!("{}{}", "[".repeat(200_000), "]".repeat(200_000));
        let text = format!(
            r#"{{"workflow_id":"w","step_index":0,"tool":"search","arguments":{{}},"metadata":{deep}}}"#
        );
        let r = parse_intent(text.as_bytes(), 1 << 20, &tools()).unwrap_err();
        assert_eq!(r.reason, RejectionReason::MalformedJson);
        assert!(r.message.contains("recursion limit"), "{}", r.message);
        // Arguments are never parsed into a tree: their depth is scanned, so
        // any depth is the model-readable `too_deep`.
        let text = format!(
            r#"{{"workflow_id":"w","step_index":0,"tool":"search","arguments":{{"a":{deep}}}}}"#
        );
        let r = parse_intent(text.as_bytes(), 1 << 20, &tools()).unwrap_err();
        assert_eq!(r.reason, RejectionReason::TooDeep);
        // As deep, but not an object: named for what it is, without a parse.
        let text =
            format!(r#"{{"workflow_id":"w","step_index":0,"tool":"search","arguments":{deep}}}"#);
        let r = parse_intent(text.as_bytes(), 1 << 20, &tools()).unwrap_err();
        assert_eq!(r.reason, RejectionReason::WrongType);
        assert!(r.message.contains("got an array"), "{}", r.message);
    }

    /// `1e400` is JSON, but no reader holds it: a tool's body with its
    /// idempotency key set inside, the MCP call and the console parse the
    /// arguments, and would have lost them. Refused, saying what to do, to
    /// the agent that waits (the address is kept); the largest double passes.
    #[test]
    fn a_number_beyond_a_double_is_refused_where_the_agent_reads_it() {
        for n in ["1e400", "-1e400", "1e999999"] {
            let text = format!(
                r#"{{"workflow_id":"w","step_index":0,"tool":"search","arguments":{{"q":"a","n":[1,{{"x":{n}}}]}}}}"#
            );
            let r = parse_intent(text.as_bytes(), 1 << 20, &tools()).unwrap_err();
            assert_eq!(r.reason, RejectionReason::InvalidValue, "{n}");
            assert!(r.message.contains("send it as a string"), "{}", r.message);
            assert!(r.message.contains("nothing was performed"), "{}", r.message);
            assert!(r.address.is_some(), "answered where the agent waits");
        }
        let text = r#"{"workflow_id":"w","step_index":0,"tool":"search","arguments":{"n":1.7976931348623157e308,"m":-1e-400,"big":123456789012345678901234567890}}"#;
        let i = parse_intent(text.as_bytes(), 1 << 20, &tools()).unwrap();
        assert_eq!(i.arguments.to_value()["n"], json!(f64::MAX));
    }

    #[test]
    fn malformed_and_oversized() {
        let r = parse_intent(b"{not json", 1 << 20, &tools()).unwrap_err();
        assert_eq!(r.reason, RejectionReason::MalformedJson);
        assert!(r.address.is_none());
        let r = parse_intent(b"[1,2]", 1 << 20, &tools()).unwrap_err();
        assert_eq!(r.reason, RejectionReason::NotAnObject);
        let big = json!({"workflow_id": "w", "step_index": 0, "tool": "search",
            "arguments": {"blob": "x".repeat(2000)}})
        .to_string();
        let r = parse_intent(big.as_bytes(), 1000, &tools()).unwrap_err();
        assert_eq!(r.reason, RejectionReason::Oversized);
        assert!(r.message.contains("over the limit of 1000 bytes"));
        assert_eq!(r.address.unwrap().step.tool, "search");
    }
}
