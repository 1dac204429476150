//! Inputs that keep failing, and batches whose records Kafka refuses: counted
//! across sessions, and set aside once they have failed often enough.

use super::{GateError, Input};
use crate::state::StateError;
use std::collections::HashMap;

/// Inputs whose processing failed on a record stepgate cannot read, counted
/// across sessions. Such a failure repeats each time the input is re-read, so
/// after [`Poison::SET_ASIDE_AFTER`] of them the input is set aside — dead-lettered
/// with the reason (and answered, when its caller can be told) — and the
/// partition moves on. Failures of the broker or the disk are not counted:
/// they pass, and the input is processed then.
#[derive(Default)]
pub(super) struct Poison {
    pub(super) failures: HashMap<(String, i32, i64), (u32, String)>,
    /// Batches whose records the broker refused for what they are (see
    /// [`GateError::refused_record`]), by their first input. Kept apart from
    /// `failures`: the input itself is processed fine each time.
    pub(super) refused: HashMap<(String, i32, i64), (u32, String)>,
    /// After a refusal, this many batches of one input each follow, so the
    /// input whose records are refused is the first of its batch.
    pub(super) careful: u32,
}

impl Poison {
    pub(super) const SET_ASIDE_AFTER: u32 = 3;

    pub(super) fn key(input: &Input) -> (String, i32, i64) {
        (input.topic.clone(), input.partition, input.offset)
    }

    pub(super) fn failed(&mut self, input: &Input, error: &StateError) {
        let e = self.failures.entry(Self::key(input)).or_default();
        e.0 += 1;
        e.1 = crate::telemetry::error_chain(error);
    }

    /// One-input batches after a refused record.
    const CAREFUL_BATCHES: u32 = 64;

    /// A batch starting with `first` was refused (its session fails).
    pub(super) fn refused(&mut self, first: (String, i32, i64), error: &GateError) {
        let e = self.refused.entry(first).or_default();
        e.0 += 1;
        e.1 = format!(
            "a record it produces is refused by Kafka: {}",
            crate::telemetry::error_chain(error)
        );
        self.careful = Self::CAREFUL_BATCHES;
    }

    /// A batch starting with `first` committed.
    pub(super) fn committed(&mut self, first: Option<&(String, i32, i64)>) {
        if let Some(k) = first
            && !self.refused.is_empty()
        {
            self.refused.remove(k);
        }
        self.careful = self.careful.saturating_sub(1);
    }

    /// The error to set this input aside with, once it failed often enough.
    /// (Every input asks: nothing is built while no input has failed.)
    pub(super) fn set_aside(&self, input: &Input) -> Option<&str> {
        if self.failures.is_empty() && self.refused.is_empty() {
            return None;
        }
        let key = Self::key(input);
        self.failures
            .get(&key)
            .or_else(|| self.refused.get(&key))
            .filter(|(n, _)| *n >= Self::SET_ASIDE_AFTER)
            .map(|(_, e)| e.as_str())
    }

    pub(super) fn forget(&mut self, input: &Input) {
        if !self.failures.is_empty() {
            self.failures.remove(&Self::key(input));
        }
    }
}
