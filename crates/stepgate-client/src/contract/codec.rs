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
    /// A fixed-size value (a local index entry) of another size.
    #[error("{len} bytes where {expected} were expected")]
    Length { len: usize, expected: usize },
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

/// Decode an internal record.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    match bytes.first() {
        None => Err(DecodeError::Empty),
        Some(&MSGPACK_NAMED_V1) => Ok(rmp_serde::from_slice(&bytes[1..])?),
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
