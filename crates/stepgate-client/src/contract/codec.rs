//! The encoding of internal records: step records and workflow ends (RocksDB and
//! the changelog topic) and progress records (the `progress` topic).
//!
//! A record is one version byte, then the record in MessagePack with field
//! names (`rmp_serde::encode::write_named`): named fields keep the records
//! readable by the next version the way JSON was (optional fields can be added;
//! unknown ones are skipped), at about a third of JSON's encoding cost and no
//! escaping. Public messages (intents, results, DLQ records, commands,
//! approvals, a pool worker's Outcome v1) stay JSON: people, agents and
//! workers in any language read and write them.
//!
//! **Compact records** ([`MSGPACK_NUMBERED_V2`], the changelog's, and what a
//! restore keeps in RocksDB; the gate's own writes there are named): the same MessagePack with each map key found
//! in [`FIELD_NAMES`] written as its number there (one byte for
//! `"intended_at_ms"`) — half a settled step record's bytes are its field
//! names. [`compact`] and [`expand`] turn one form into the other byte for
//! byte, so a compact record decodes exactly as the named one it came from.
//! The list only grows: a number, once given, names that field forever; a
//! number a reader's list does not have yet (a newer writer's field) expands
//! to a name no record type has, and is skipped like any unknown field.

use serde::Serialize;
use serde::de::DeserializeOwned;
use thiserror::Error;

/// Version byte: MessagePack, named fields.
pub const MSGPACK_NAMED_V1: u8 = 0x01;

/// Version byte: MessagePack, field names in [`FIELD_NAMES`] written as their
/// number there (see the module's docs).
pub const MSGPACK_NUMBERED_V2: u8 = 0x02;

/// The field names of the internal records, numbered by position for
/// [`MSGPACK_NUMBERED_V2`]. **Append only**: changelogs written with a number
/// are read back for as long as they are kept. A name missing here still
/// works; it is only written out in full.
pub const FIELD_NAMES: &[&str] = &[
    // The step record (`state::StepRecord`).
    "step",
    "category",
    "phase",
    "arguments",
    "call_id",
    "metadata",
    "traceparent",
    "dispatch",
    "intended_at_ms",
    "started_at_ms",
    "deadline_ms",
    "result",
    "waiters",
    "repeats",
    "rephrased_count",
    "rephrased",
    "late_outcome",
    "evidence",
    "open_dispatches",
    "not_invoked",
    "taken",
    "settled_through",
    "expires_at_ms",
    "intent_ts_ms",
    "operator_log",
    "partition",
    "reply_partition",
    "unseen_reader",
    // The step key, an answer (Result v1) and its error.
    "workflow_id",
    "step_index",
    "tool",
    "attempt",
    "status",
    "output",
    "error",
    "deduplicated",
    "completed_at",
    "kind",
    "message",
    // Kept repeats, operators' decisions, evidence, a workflow's end.
    "at_ms",
    "id",
    "action",
    "by",
    "at",
    "reason",
    "from",
    "why",
    // Dispatch tokens (`state::DispatchToken`).
    "tokens",
    "digest",
];

#[derive(Debug, Error)]
pub enum DecodeError {
    #[error("empty record")]
    Empty,
    #[error("unknown record version byte {0:#04x} (written by a newer stepgate?)")]
    UnknownVersion(u8),
    /// A fixed-size value (a local index entry) of another size.
    #[error("{len} bytes where {expected} were expected")]
    Length { len: usize, expected: usize },
    #[error(transparent)]
    MsgPack(#[from] rmp_serde::decode::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("compact record: {0}")]
    Compact(&'static str),
}

/// Encode an internal record.
pub fn encode<T: Serialize + ?Sized>(record: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.push(MSGPACK_NAMED_V1);
    rmp_serde::encode::write_named(&mut out, record)
        .expect("internal records serialise (string keys, no non-serialisable fields)");
    out
}

/// Decode an internal record, named or compact.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    match bytes.first() {
        None => Err(DecodeError::Empty),
        Some(&MSGPACK_NAMED_V1) => Ok(rmp_serde::from_slice(&bytes[1..])?),
        Some(&MSGPACK_NUMBERED_V2) => Ok(rmp_serde::from_slice(&expand(bytes)?[1..])?),
        Some(&b) => Err(DecodeError::UnknownVersion(b)),
    }
}

/// The compact form of a named record ([`MSGPACK_NUMBERED_V2`]); `None` when
/// it has none — not a named record, malformed, or with a map key that is
/// already a number (which the compact form could not tell from a field's) —
/// and the record is written as it is.
pub fn compact(named: &[u8]) -> Option<Vec<u8>> {
    let (&MSGPACK_NAMED_V1, body) = named.split_first()? else {
        return None;
    };
    let mut out = Vec::with_capacity(named.len());
    out.push(MSGPACK_NUMBERED_V2);
    let mut w = Walk {
        input: body,
        out: &mut out,
        to_compact: true,
    };
    w.value(0).ok()?;
    w.input.is_empty().then_some(out)
}

/// The named form of a compact record; a named record as it is.
pub fn expand(bytes: &[u8]) -> Result<std::borrow::Cow<'_, [u8]>, DecodeError> {
    let body = match bytes.split_first() {
        None => return Err(DecodeError::Empty),
        Some((&MSGPACK_NUMBERED_V2, body)) => body,
        Some((&MSGPACK_NAMED_V1, _)) => return Ok(bytes.into()),
        Some((&b, _)) => return Err(DecodeError::UnknownVersion(b)),
    };
    let mut out = Vec::with_capacity(bytes.len() * 2);
    out.push(MSGPACK_NAMED_V1);
    let mut w = Walk {
        input: body,
        out: &mut out,
        to_compact: false,
    };
    w.value(0).map_err(DecodeError::Compact)?;
    if !w.input.is_empty() {
        return Err(DecodeError::Compact("bytes after the record"));
    }
    Ok(out.into())
}

/// Decode only the top-level fields `wanted` of a record, named or compact,
/// into `T`: the others are stepped over, never decoded or copied. For a
/// reader that needs a few fields of many records (a restore indexing every
/// step it writes); `T` must not need a field outside `wanted`.
pub fn decode_fields<T: DeserializeOwned>(bytes: &[u8], wanted: &[&str]) -> Result<T, DecodeError> {
    let (compact, body) = match bytes.split_first() {
        None => return Err(DecodeError::Empty),
        Some((&MSGPACK_NUMBERED_V2, body)) => (true, body),
        Some((&MSGPACK_NAMED_V1, body)) => (false, body),
        Some((&b, _)) => return Err(DecodeError::UnknownVersion(b)),
    };
    let mut input = body;
    let entries = map_header(&mut input).map_err(DecodeError::Compact)?;
    let mut out = Vec::with_capacity(64);
    let mut found = 0u32;
    for _ in 0..entries {
        let key = match input.first() {
            Some(&m) if compact && m <= 0x7f => {
                input = &input[1..];
                FIELD_NAMES.get(usize::from(m)).map(|n| n.as_bytes())
            }
            _ => {
                let n = value_len(input, 0).map_err(DecodeError::Compact)?;
                let (k, rest) = input.split_at(n);
                input = rest;
                str_body(k)
            }
        };
        let n = value_len(input, 0).map_err(DecodeError::Compact)?;
        let (value, rest) = input.split_at(n);
        input = rest;
        let Some(name) = key.filter(|k| wanted.iter().any(|w| w.as_bytes() == *k)) else {
            continue;
        };
        write_str(&mut out, name);
        if compact {
            let mut w = Walk {
                input: value,
                out: &mut out,
                to_compact: false,
            };
            w.value(1).map_err(DecodeError::Compact)?;
        } else {
            out.extend_from_slice(value);
        }
        found += 1;
    }
    if !input.is_empty() {
        return Err(DecodeError::Compact("bytes after the record"));
    }
    let mut record = Vec::with_capacity(out.len() + 5);
    match u8::try_from(found) {
        Ok(n) if n <= 0x0f => record.push(0x80 | n),
        _ => {
            record.push(0xdf);
            record.extend_from_slice(&found.to_be_bytes());
        }
    }
    record.extend_from_slice(&out);
    Ok(rmp_serde::from_slice(&record)?)
}

/// A map's entry count, its header taken off `input`.
fn map_header(input: &mut &[u8]) -> Result<usize, &'static str> {
    let (n, header) = match input.first() {
        Some(&m @ 0x80..=0x8f) => (usize::from(m & 0x0f), 1),
        Some(0xde) if input.len() >= 3 => {
            (usize::from(u16::from_be_bytes([input[1], input[2]])), 3)
        }
        Some(0xdf) if input.len() >= 5 => (
            u32::from_be_bytes([input[1], input[2], input[3], input[4]]) as usize,
            5,
        ),
        Some(_) => return Err("a record is a map"),
        None => return Err("the record ends inside a value"),
    };
    *input = &input[header..];
    Ok(n)
}

/// A MessagePack string's bytes (None: not a string).
fn str_body(v: &[u8]) -> Option<&[u8]> {
    match *v.first()? {
        m @ 0xa0..=0xbf => v.get(1..1 + usize::from(m & 0x1f)),
        0xd9 => v.get(2..),
        0xda => v.get(3..),
        0xdb => v.get(5..),
        _ => None,
    }
}

/// The length of the MessagePack value `input` starts with, read without
/// copying it.
fn value_len(input: &[u8], depth: usize) -> Result<usize, &'static str> {
    if depth > MAX_DEPTH {
        return Err("nested too deeply");
    }
    let m = *input.first().ok_or("the record ends inside a value")?;
    let be = |at: usize, n: usize| -> Result<usize, &'static str> {
        let b = input
            .get(at..at + n)
            .ok_or("the record ends inside a value")?;
        Ok(b.iter().fold(0usize, |acc, &x| (acc << 8) | usize::from(x)))
    };
    let items = |head: usize, n: usize, per: usize| -> Result<usize, &'static str> {
        let mut at = head;
        for _ in 0..n * per {
            at += value_len(
                input.get(at..).ok_or("the record ends inside a value")?,
                depth + 1,
            )?;
        }
        Ok(at)
    };
    let len = match m {
        0x00..=0x7f | 0xc0 | 0xc2 | 0xc3 | 0xe0..=0xff => 1,
        0x80..=0x8f => items(1, usize::from(m & 0x0f), 2)?,
        0x90..=0x9f => items(1, usize::from(m & 0x0f), 1)?,
        0xa0..=0xbf => 1 + usize::from(m & 0x1f),
        0xc4 | 0xd9 => 2 + be(1, 1)?,
        0xc5 | 0xda => 3 + be(1, 2)?,
        0xc6 | 0xdb => 5 + be(1, 4)?,
        0xc7 => 3 + be(1, 1)?,
        0xc8 => 4 + be(1, 2)?,
        0xc9 => 6 + be(1, 4)?,
        0xca | 0xce | 0xd2 => 5,
        0xcb | 0xcf | 0xd3 => 9,
        0xcc | 0xd0 => 2,
        0xcd | 0xd1 => 3,
        0xd4 => 3,
        0xd5 => 4,
        0xd6 => 6,
        0xd7 => 10,
        0xd8 => 18,
        0xdc => items(3, be(1, 2)?, 1)?,
        0xdd => items(5, be(1, 4)?, 1)?,
        0xde => items(3, be(1, 2)?, 2)?,
        0xdf => items(5, be(1, 4)?, 2)?,
        0xc1 => return Err("0xc1 is no MessagePack marker"),
    };
    if len > input.len() {
        return Err("the record ends inside a value");
    }
    Ok(len)
}

/// Deeper than this, a record is refused (rmp_serde's own limit is 1 024).
const MAX_DEPTH: usize = 1024;

/// The number of a field name, by binary search over the sorted list.
fn field_number(name: &[u8]) -> Option<u8> {
    static SORTED: std::sync::OnceLock<Vec<(&'static [u8], u8)>> = std::sync::OnceLock::new();
    let sorted = SORTED.get_or_init(|| {
        let mut v: Vec<(&[u8], u8)> = FIELD_NAMES
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_bytes(), u8::try_from(i).expect("at most 128 names")))
            .collect();
        v.sort_unstable();
        v
    });
    sorted
        .binary_search_by(|(n, _)| (*n).cmp(name))
        .ok()
        .map(|i| sorted[i].1)
}

/// One pass over a MessagePack value, copying it to `out` with map keys
/// turned from names to numbers (`to_compact`) or back.
struct Walk<'a, 'o> {
    input: &'a [u8],
    out: &'o mut Vec<u8>,
    to_compact: bool,
}

type WalkResult = Result<(), &'static str>;

impl<'a> Walk<'a, '_> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.input.len() < n {
            return Err("the record ends inside a value");
        }
        let (head, rest) = self.input.split_at(n);
        self.input = rest;
        Ok(head)
    }

    /// Copy `n` bytes as they are.
    fn copy(&mut self, n: usize) -> WalkResult {
        let b = self.take(n)?;
        self.out.extend_from_slice(b);
        Ok(())
    }

    /// A big-endian length of `n` bytes, copied.
    fn len(&mut self, n: usize) -> Result<usize, &'static str> {
        let b = self.take(n)?;
        let len = b.iter().fold(0usize, |acc, &x| (acc << 8) | usize::from(x));
        self.out.extend_from_slice(b);
        Ok(len)
    }

    /// A value of a `len_bytes` length and `extra` bytes more, copied.
    fn sized(&mut self, len_bytes: usize, extra: usize) -> WalkResult {
        let n = self.len(len_bytes)?;
        self.copy(n + extra)
    }

    fn value(&mut self, depth: usize) -> WalkResult {
        if depth > MAX_DEPTH {
            return Err("nested too deeply");
        }
        let m = self.take(1)?[0];
        self.out.push(m);
        match m {
            0x00..=0x7f | 0xc0 | 0xc2 | 0xc3 | 0xe0..=0xff => Ok(()),
            0x80..=0x8f => self.map(usize::from(m & 0x0f), depth),
            0x90..=0x9f => self.array(usize::from(m & 0x0f), depth),
            0xa0..=0xbf => self.copy(usize::from(m & 0x1f)),
            // bin and str 8/16/32: length, data.
            0xc4 | 0xd9 => self.sized(1, 0),
            0xc5 | 0xda => self.sized(2, 0),
            0xc6 | 0xdb => self.sized(4, 0),
            // ext 8/16/32: length, type byte, data.
            0xc7 => self.sized(1, 1),
            0xc8 => self.sized(2, 1),
            0xc9 => self.sized(4, 1),
            0xca | 0xce | 0xd2 => self.copy(4),
            0xcb | 0xcf | 0xd3 => self.copy(8),
            0xcc | 0xd0 => self.copy(1),
            0xcd | 0xd1 => self.copy(2),
            // fixext 1/2/4/8/16: type byte, data.
            0xd4 => self.copy(2),
            0xd5 => self.copy(3),
            0xd6 => self.copy(5),
            0xd7 => self.copy(9),
            0xd8 => self.copy(17),
            0xdc => {
                let n = self.len(2)?;
                self.array(n, depth)
            }
            0xdd => {
                let n = self.len(4)?;
                self.array(n, depth)
            }
            0xde => {
                let n = self.len(2)?;
                self.map(n, depth)
            }
            0xdf => {
                let n = self.len(4)?;
                self.map(n, depth)
            }
            0xc1 => Err("0xc1 is no MessagePack marker"),
        }
    }

    fn array(&mut self, n: usize, depth: usize) -> WalkResult {
        (0..n).try_for_each(|_| self.value(depth + 1))
    }

    fn map(&mut self, n: usize, depth: usize) -> WalkResult {
        for _ in 0..n {
            self.key(depth + 1)?;
            self.value(depth + 1)?;
        }
        Ok(())
    }

    fn key(&mut self, depth: usize) -> WalkResult {
        let Some(&m) = self.input.first() else {
            return Err("the record ends inside a map");
        };
        if self.to_compact {
            if m <= 0x7f || (0xcc..=0xd3).contains(&m) || m >= 0xe0 {
                return Err("a map key is a number");
            }
            if let 0xa0..=0xbf = m {
                let n = usize::from(m & 0x1f);
                if let Some(name) = self.input.get(1..1 + n)
                    && let Some(num) = field_number(name)
                {
                    self.out.push(num);
                    self.input = &self.input[1 + n..];
                    return Ok(());
                }
            }
            return self.value(depth);
        }
        // Expanding: a positive fixint key is a field's number.
        if m <= 0x7f {
            self.input = &self.input[1..];
            match FIELD_NAMES.get(usize::from(m)) {
                Some(name) => write_str(self.out, name.as_bytes()),
                // A newer writer's field: a name no record type has, so that
                // a reader skips it as an unknown field.
                None => write_str(self.out, format!("\u{0}field {m}").as_bytes()),
            }
            return Ok(());
        }
        self.value(depth)
    }
}

/// A field name as a MessagePack fixstr: every name, and the stand-in for an
/// unknown number, is at most 31 bytes (a test checks the list).
fn write_str(out: &mut Vec<u8>, s: &[u8]) {
    let n = u8::try_from(s.len())
        .ok()
        .filter(|n| *n <= 31)
        .expect("field names are at most 31 bytes");
    out.push(0xa0 | n);
    out.extend_from_slice(s);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct V1 {
        a: i64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        b: Option<String>,
        v: serde_json::Value,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    struct Partial {
        a: i64,
    }

    #[test]
    fn round_trips_with_a_version_byte_and_arbitrary_json_inside() {
        let r = V1 {
            a: -3,
            b: None,
            v: json!({"x": [1, 2.5, "s", null, true, {"deep": {"er": u64::MAX}}]}),
        };
        let bytes = encode(&r);
        assert_eq!(bytes[0], MSGPACK_NAMED_V1);
        assert_eq!(decode::<V1>(&bytes).unwrap(), r);
        // Fields a reader does not know are skipped; missing optional ones default.
        assert_eq!(decode::<Partial>(&bytes).unwrap(), Partial { a: -3 });
        assert_eq!(
            decode::<serde_json::Value>(&bytes).unwrap()["v"]["x"][1],
            json!(2.5)
        );
    }

    #[test]
    fn a_compact_record_is_the_named_one_byte_for_byte_with_numbers_for_names() {
        let r = V1 {
            a: 7,
            b: Some("phase".into()),
            // Data maps compact too (a JSON key is a string, never a number),
            // and come back the same.
            v: json!({"status": "ok", "intended_at_ms": [1, {"why": null}], "unlisted": -1.5, "": {}}),
        };
        let named = encode(&r);
        let compact = compact(&named).expect("compacts");
        assert_eq!(compact[0], MSGPACK_NUMBERED_V2);
        // "status", "intended_at_ms" and "why" (a length byte and the name
        // each) each became one byte.
        assert_eq!(named.len() - compact.len(), 6 + 14 + 3);
        assert_eq!(&*expand(&compact).unwrap(), &named[..]);
        assert_eq!(decode::<V1>(&compact).unwrap(), r);
        assert_eq!(decode::<Partial>(&compact).unwrap(), Partial { a: 7 });
        // A named record expands to itself.
        assert_eq!(&*expand(&named).unwrap(), &named[..]);
    }

    #[test]
    fn only_the_wanted_fields_are_decoded_from_either_form() {
        #[derive(Debug, PartialEq, Deserialize)]
        struct Few {
            a: i64,
            #[serde(default)]
            b: Option<String>,
            status: Option<serde_json::Value>,
        }
        let big = "x".repeat(300);
        let r = json!({
            "v": {"deep": [1, {"why": big}], "n": -1.5},
            "a": -7,
            "status": {"why": [null, true, u64::MAX]},
            "junk": [big, {"": {}}],
        });
        let named = encode(&r);
        let compact = compact(&named).expect("compacts");
        let wanted = ["a", "b", "status"];
        let expect = Few {
            a: -7,
            b: None,
            status: Some(json!({"why": [null, true, u64::MAX]})),
        };
        assert_eq!(decode_fields::<Few>(&named, &wanted).unwrap(), expect);
        assert_eq!(decode_fields::<Few>(&compact, &wanted).unwrap(), expect);
        assert_eq!(decode::<Few>(&compact).unwrap(), expect);
        // A field not wanted is never read: its absence is what `T` sees.
        assert!(decode_fields::<Few>(&named, &["b", "status"]).is_err());
        // Cut short anywhere, or not a record: an error, never a panic.
        for bytes in [&named, &compact] {
            for cut in 1..bytes.len() {
                assert!(
                    decode_fields::<Few>(&bytes[..cut], &wanted).is_err(),
                    "cut at {cut}"
                );
            }
        }
        assert!(decode_fields::<Few>(&[], &wanted).is_err());
        assert!(decode_fields::<Few>(&[MSGPACK_NAMED_V1, 0x93, 1, 2, 3], &wanted).is_err());
    }

    #[test]
    fn field_numbers_never_change() {
        // Append only: a changelog written with these numbers is read back for
        // as long as it is kept. Never edit this line; extend it.
        let pinned = "step category phase arguments call_id metadata traceparent dispatch \
            intended_at_ms started_at_ms deadline_ms result waiters repeats rephrased_count \
            rephrased late_outcome evidence open_dispatches not_invoked taken settled_through \
            expires_at_ms intent_ts_ms operator_log partition reply_partition unseen_reader \
            workflow_id step_index tool attempt status output error deduplicated completed_at \
            kind message at_ms id action by at reason from why";
        let pinned: Vec<&str> = pinned.split_whitespace().collect();
        assert_eq!(&FIELD_NAMES[..pinned.len()], &pinned[..]);
        assert!(FIELD_NAMES.len() <= 128, "one byte per number");
        let mut unique = FIELD_NAMES.to_vec();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), FIELD_NAMES.len(), "no name twice");
        assert!(FIELD_NAMES.iter().all(|n| n.len() <= 31));
    }

    #[test]
    fn a_number_a_reader_does_not_know_is_a_field_it_skips() {
        // A newer writer's record: {a: 5, <field 127>: "new", v: null}.
        let mut newer = vec![MSGPACK_NUMBERED_V2, 0x83, 0xa1, b'a', 0x05, 0x7f];
        newer.extend_from_slice(&[0xa3, b'n', b'e', b'w', 0xa1, b'v', 0xc0]);
        assert_eq!(decode::<Partial>(&newer).unwrap(), Partial { a: 5 });
        let seen: serde_json::Value = decode(&newer).unwrap();
        assert_eq!(seen["\u{0}field 127"], json!("new"));
    }

    #[test]
    fn what_cannot_be_compacted_is_written_named_and_bad_bytes_are_errors() {
        // A map keyed by numbers: its keys could not be told from fields'.
        let numbered: std::collections::BTreeMap<u32, bool> = [(3, true)].into();
        assert!(compact(&encode(&numbered)).is_none());
        assert!(compact(&[]).is_none());
        assert!(
            compact(&[MSGPACK_NUMBERED_V2, 0xc0]).is_none(),
            "already compact"
        );
        assert!(
            compact(&[MSGPACK_NAMED_V1, 0x82, 0xa1]).is_none(),
            "truncated"
        );
        assert!(
            compact(&[MSGPACK_NAMED_V1, 0xc0, 0xc0]).is_none(),
            "trailing bytes"
        );
        for bad in [
            &[MSGPACK_NUMBERED_V2][..],
            &[MSGPACK_NUMBERED_V2, 0x81, 0x01],
            &[MSGPACK_NUMBERED_V2, 0xdb, 0xff, 0xff, 0xff, 0xff],
            &[MSGPACK_NUMBERED_V2, 0xc1],
            &[MSGPACK_NUMBERED_V2, 0xc0, 0xc0],
        ] {
            assert!(
                matches!(
                    decode::<serde_json::Value>(bad),
                    Err(DecodeError::Compact(_))
                ),
                "{bad:?}"
            );
        }
        // Nested past any record's depth: refused, never a stack overflow.
        let mut deep = vec![MSGPACK_NUMBERED_V2];
        deep.extend(std::iter::repeat_n(0x91, 100_000));
        deep.push(0xc0);
        assert!(decode::<serde_json::Value>(&deep).is_err());
    }

    #[test]
    fn refuses_json_and_unknown_versions() {
        // JSON was never an internal record's encoding: `{` is no version.
        assert!(matches!(
            decode::<V1>(br#"{"a":7,"v":{"k":"v"}}"#),
            Err(DecodeError::UnknownVersion(b'{'))
        ));
        assert!(matches!(
            decode::<V1>(&[0x7f, 1, 2]),
            Err(DecodeError::UnknownVersion(0x7f))
        ));
        assert!(matches!(decode::<V1>(&[]), Err(DecodeError::Empty)));
    }
}
