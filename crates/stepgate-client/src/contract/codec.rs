//! The encoding of internal records: step records and workflow ends (RocksDB and
//! the changelog topic) and progress records (the `progress` topic).
//!
//! A record is one version byte, then the record in MessagePack with field
//! names (`rmp_serde::encode::write_named`): named fields keep the records
//! readable by the next version the way JSON was (optional fields can be added;
//! unknown ones are skipped), at about a third of JSON's encoding cost and no
//! escaping. Records written as JSON by earlier versions start with `{`, which
//! is never a version byte, and are still read. Public messages (intents,
//! results, DLQ records, commands, approvals) stay JSON: people and agents
//! read them.

use serde::Serialize;
use serde::de::DeserializeOwned;
use thiserror::Error;

/// Version byte: MessagePack, named fields.
pub const MSGPACK_NAMED_V1: u8 = 0x01;

#[derive(Debug, Error)]
pub enum DecodeError {
    #[error("empty record")]
    Empty,
    #[error("unknown record version byte {0:#04x} (written by a newer stepgate?)")]
    UnknownVersion(u8),
    #[error(transparent)]
    MsgPack(#[from] rmp_serde::decode::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// Encode an internal record.
pub fn encode<T: Serialize + ?Sized>(record: &T) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    out.push(MSGPACK_NAMED_V1);
    rmp_serde::encode::write_named(&mut out, record)
        .expect("internal records serialise (string keys, no non-serialisable fields)");
    out
}

/// Decode an internal record, in the current encoding or as earlier versions
/// wrote it (JSON).
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    match bytes.first() {
        None => Err(DecodeError::Empty),
        Some(&MSGPACK_NAMED_V1) => Ok(rmp_serde::from_slice(&bytes[1..])?),
        Some(b'{') => Ok(serde_json::from_slice(bytes)?),
        Some(&b) => Err(DecodeError::UnknownVersion(b)),
    }
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
    fn reads_json_written_by_earlier_versions_and_refuses_unknown_versions() {
        let legacy = br#"{"a":7,"v":{"k":"v"}}"#;
        assert_eq!(
            decode::<V1>(legacy).unwrap(),
            V1 {
                a: 7,
                b: None,
                v: json!({"k": "v"})
            }
        );
        assert!(matches!(
            decode::<V1>(&[0x7f, 1, 2]),
            Err(DecodeError::UnknownVersion(0x7f))
        ));
        assert!(matches!(decode::<V1>(&[]), Err(DecodeError::Empty)));
    }
}
