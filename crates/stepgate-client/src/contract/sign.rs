//! Signatures on the records a gate and its pool's workers exchange: a Call
//! v1 (gate → workers, on `calls.<pool>`) and an Outcome v1 (worker → gate,
//! on `progress`), each with the header [`super::headers::SIGNATURE`].
//!
//! The signature is HMAC-SHA256, keyed by the pool's key (shared by the gates
//! and that pool's workers, `[pools.<name>] key`), over a label naming the
//! record's kind, a newline, and the record's value exactly as written:
//! `HMAC(key, "stepgate-call-v1\n" || value)` or `HMAC(key,
//! "stepgate-outcome-v1\n" || value)`, sent as 64 lowercase hex characters.
//! The label keeps a signed call from passing as a signed outcome and back.
//! Workers in any language compute the same (docs/tools.md, "Worker
//! protocol", has a test vector).

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// A pool key shorter than this (in bytes) is refused: 32 bytes is what
/// HMAC-SHA256's strength needs (`openssl rand -hex 32` gives 64).
pub const MIN_POOL_KEY_BYTES: usize = 32;

/// Which record a signature is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signed {
    /// A Call v1, signed by the gate that publishes it.
    Call,
    /// An Outcome v1, signed by the worker that took the call.
    Outcome,
}

impl Signed {
    fn label(self) -> &'static [u8] {
        match self {
            Signed::Call => b"stepgate-call-v1\n",
            Signed::Outcome => b"stepgate-outcome-v1\n",
        }
    }
}

fn mac(key: &[u8], what: Signed, value: &[u8]) -> Hmac<Sha256> {
    let mut m =
        <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes a key of any length");
    m.update(what.label());
    m.update(value);
    m
}

/// The signature of a record's value: 64 lowercase hex characters.
pub fn sign(key: &[u8], what: Signed, value: &[u8]) -> String {
    super::hex(&mac(key, what, value).finalize().into_bytes())
}

/// Whether `signature` (the header's bytes) is the signature of `value` under
/// `key`, compared in constant time. Anything but 64 lowercase hex
/// characters is no signature.
pub fn verify(key: &[u8], what: Signed, value: &[u8], signature: &[u8]) -> bool {
    let Some(bytes) = unhex(signature) else {
        return false;
    };
    mac(key, what, value).verify_slice(&bytes).is_ok()
}

fn unhex(s: &[u8]) -> Option<Vec<u8>> {
    if s.len() != 64 {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    s.chunks(2)
        .map(|p| Some(digit(p[0])? << 4 | digit(p[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test vector docs/tools.md gives, and the Python worker's tests
    /// check byte for byte (clients/python/tests/test_worker.py).
    const VECTOR_KEY: &str = "0123456789abcdef0123456789abcdef";
    const VECTOR_VALUE: &str = r#"{"step":{"workflow_id":"order-7781","step_index":3,"tool":"render_invoice","attempt":0},"dispatch":1,"token":"5f1d3a0b9c8e7f6a5b4c3d2e1f0a9b8c"}"#;

    #[test]
    fn the_published_vector_holds() {
        let key = VECTOR_KEY.as_bytes();
        let call = sign(key, Signed::Call, VECTOR_VALUE.as_bytes());
        let outcome = sign(key, Signed::Outcome, VECTOR_VALUE.as_bytes());
        assert_eq!(
            call,
            "643949ffd1e8884f9730ef1ce5f53d9c3eb81e6fde1e7c2d6413218ce77d3d6d"
        );
        assert_eq!(
            outcome,
            "73d676881e0d7c09187e616e0458698db0d48bca7295f482d6c60b036f44c7b5"
        );
    }

    #[test]
    fn a_signature_verifies_only_for_its_key_kind_and_bytes() {
        let key = VECTOR_KEY.as_bytes();
        let v = VECTOR_VALUE.as_bytes();
        let s = sign(key, Signed::Call, v);
        assert!(verify(key, Signed::Call, v, s.as_bytes()));
        assert!(!verify(key, Signed::Outcome, v, s.as_bytes()), "kind");
        assert!(!verify(
            b"another key of thirty-two bytes!",
            Signed::Call,
            v,
            s.as_bytes()
        ));
        let mut changed = v.to_vec();
        changed[10] ^= 1;
        assert!(!verify(key, Signed::Call, &changed, s.as_bytes()), "bytes");
        assert!(!verify(key, Signed::Call, v, s.to_uppercase().as_bytes()));
        assert!(!verify(key, Signed::Call, v, &s.as_bytes()[..63]));
        assert!(!verify(key, Signed::Call, v, b""));
    }
}
