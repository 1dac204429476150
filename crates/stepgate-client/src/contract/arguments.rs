//! A call's `arguments`, kept as the JSON text the intent carried.

use serde::de::{self, Deserializer, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use std::fmt;
use std::sync::Arc;

/// A tool call's `arguments`: one JSON object, kept as the text it arrived
/// in. The intent parser checks it once (an object, within the depth bound);
/// from there it is carried as is — into the step record and, byte for byte,
/// into the tool's HTTP body — never parsed into a tree and rebuilt. Cloning
/// is a reference count.
///
/// Equality (`==`) is of the text; [`Arguments::same_as`] compares the JSON
/// (another key order or spacing is the same arguments).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Arguments(Arc<str>);

impl Arguments {
    /// Text already checked to be one JSON object (the intent parser's).
    pub(crate) fn from_checked(text: &str) -> Self {
        Arguments(Arc::from(text))
    }

    /// No arguments: `{}`.
    pub fn empty() -> Self {
        Arguments(Arc::from("{}"))
    }

    /// The JSON text, as the intent carried it.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Length of the JSON text in bytes.
    pub fn text_len(&self) -> usize {
        self.0.len()
    }

    /// The arguments as a JSON object (parsed on each call: for the paths
    /// that need the tree, never for the step's own way through the gate).
    /// An error for text no reader holds — only a record written before the
    /// intent parser refused numbers beyond a double can carry it.
    pub fn parse(&self) -> Result<Map<String, Value>, serde_json::Error> {
        serde_json::from_str(&self.0)
    }

    /// [`Arguments::parse`], for display: `{}` when it fails.
    pub fn to_map(&self) -> Map<String, Value> {
        self.parse().unwrap_or_default()
    }

    /// The arguments as a JSON value (an object).
    pub fn to_value(&self) -> Value {
        Value::Object(self.to_map())
    }

    /// The same JSON object, whatever the key order or spacing.
    pub fn same_as(&self, other: &Arguments) -> bool {
        self.0 == other.0 || self.to_map() == other.to_map()
    }
}

impl From<Map<String, Value>> for Arguments {
    fn from(m: Map<String, Value>) -> Self {
        Arguments::from(&m)
    }
}

impl From<&Map<String, Value>> for Arguments {
    fn from(m: &Map<String, Value>) -> Self {
        Arguments(Arc::from(
            serde_json::to_string(m)
                .expect("a JSON map always serialises")
                .as_str(),
        ))
    }
}

impl TryFrom<Value> for Arguments {
    /// The value, when it is not an object.
    type Error = Value;

    fn try_from(v: Value) -> Result<Self, Value> {
        match v {
            Value::Object(m) => Ok(Arguments::from(&m)),
            other => Err(other),
        }
    }
}

impl fmt::Debug for Arguments {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for Arguments {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// In JSON (intents, approvals, `steps show`): the object itself. In the
/// binary internal records: its text, as one string.
impl Serialize for Arguments {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() {
            match serde_json::from_str::<&RawValue>(&self.0) {
                Ok(raw) => raw.serialize(s),
                Err(_) => self.to_map().serialize(s),
            }
        } else {
            s.serialize_str(&self.0)
        }
    }
}

/// Reads what [`Serialize`] writes.
impl<'de> Deserialize<'de> for Arguments {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        if d.is_human_readable() {
            Map::<String, Value>::deserialize(d).map(Arguments::from)
        } else {
            d.deserialize_str(ArgumentsVisitor)
        }
    }
}

struct ArgumentsVisitor;

impl<'de> Visitor<'de> for ArgumentsVisitor {
    type Value = Arguments;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("the text of a JSON object")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Arguments, E> {
        // Only stepgate writes these records, from checked arguments; a
        // damaged one must still read as an object.
        match serde_json::from_str::<&RawValue>(v) {
            Ok(raw) if raw.get().starts_with('{') => Ok(Arguments::from_checked(v)),
            _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
        }
    }
}

/// Whether JSON text (valid JSON) nests arrays or objects more than `limit`
/// levels deep (a scalar is level 0, `{}` and `[]` level 1). A scan of the
/// bytes, no tree: for arguments kept as text.
pub fn text_deeper_than(json: &str, limit: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for b in json.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn args(text: &str) -> Arguments {
        Arguments::from_checked(text)
    }

    #[test]
    fn json_carries_the_object_and_msgpack_the_text() {
        let a = args(r#"{"to": "a",  "n": [1, 2]}"#);
        assert_eq!(
            serde_json::to_value(&a).unwrap(),
            json!({"to": "a", "n": [1, 2]})
        );
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            r#"{"to": "a",  "n": [1, 2]}"#
        );
        let packed = rmp_serde::to_vec_named(&a).unwrap();
        let back: Arguments = rmp_serde::from_slice(&packed).unwrap();
        assert_eq!(back.as_str(), a.as_str(), "the text, byte for byte");
        let from_json: Arguments = serde_json::from_str(r#"{"n": 1}"#).unwrap();
        assert_eq!(from_json.to_value(), json!({"n": 1}));
    }

    #[test]
    fn a_record_holds_the_text_of_an_object_or_is_refused() {
        // Never written (a map, not its text): refused, not read.
        let map = rmp_serde::to_vec_named(&json!({"subject": "Order confirmed"})).unwrap();
        let e = rmp_serde::from_slice::<Arguments>(&map).unwrap_err();
        assert!(e.to_string().contains("the text of a JSON object"), "{e}");
        let not_object = rmp_serde::to_vec_named(&"[1]").unwrap();
        assert!(rmp_serde::from_slice::<Arguments>(&not_object).is_err());
    }

    #[test]
    fn same_as_compares_the_json_not_the_text() {
        assert!(args(r#"{"a":1,"b":2}"#).same_as(&args(r#"{ "b": 2, "a": 1 }"#)));
        assert!(!args(r#"{"a":1}"#).same_as(&args(r#"{"a":2}"#)));
        assert_ne!(args(r#"{"a":1,"b":2}"#), args(r#"{ "b": 2, "a": 1 }"#));
    }

    #[test]
    fn depth_is_counted_outside_strings_only() {
        assert!(!text_deeper_than(r#"{"a": "[[[[{{{{"}"#, 1));
        assert!(!text_deeper_than(r#"{"a": "\"[[[["}"#, 1));
        assert!(text_deeper_than(r#"{"a": [{}]}"#, 2));
        assert!(!text_deeper_than(r#"{"a": [{}]}"#, 3));
        assert!(!text_deeper_than(r#"{"a": [1], "b": [2]}"#, 2));
        let deep = format!("{}{}", "[".repeat(70), "]".repeat(70));
        assert!(text_deeper_than(&format!(r#"{{"a": {deep}}}"#), 64));
    }
}
