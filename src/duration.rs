//! `Dur`: a duration as configuration writes it (`"250ms"`, `"10s"`, `"7d"`).
//! A leaf module: the config and the tool definitions both use it.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// A duration written as `"250ms"`, `"10s"`, `"7d"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl Serialize for Dur {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(self.0).to_string())
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map(Dur).map_err(|e| {
            serde::de::Error::custom(format!(
                "`{s}` is not a duration like \"250ms\", \"10s\" or \"7d\": {e}"
            ))
        })
    }
}

impl From<Dur> for Duration {
    fn from(d: Dur) -> Duration {
        d.0
    }
}

/// A duration literal known to be valid: a built-in default, or one a test
/// or a program writes (panics on a malformed one).
pub fn dur(s: &str) -> Dur {
    Dur(humantime::parse_duration(s).expect("built-in durations are valid"))
}
