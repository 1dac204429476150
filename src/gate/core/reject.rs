//! Bad input: rejected with a model-readable answer where someone waits, and
//! a dead-letter copy.

use super::{GateCore, Out, When, at};
use crate::contract::{
    Address, DlqRecord, ErrorBody, Rejection, RejectionReason, Status, Texts, ToolResult,
    parse_intent,
};
use crate::kafka::Input;

impl GateCore {
    /// Set aside an input whose processing keeps failing (`error`): dead-letter
    /// it, and answer its caller when it is an intent that can be addressed.
    pub fn set_aside(&mut self, input: &Input, is_intent: bool, error: &str, now_ms: i64) {
        let payload = input.payload.as_deref().unwrap_or_default();
        let intent = is_intent
            .then(|| parse_intent(payload, self.settings.max_intent_bytes, &self.tool_names).ok())
            .flatten();
        let (message, address) = match intent {
            Some(i) => (
                Texts::unprocessable(&i.tool),
                Some(Address {
                    step: i.step_key(),
                    call_id: i.call_id,
                }),
            ),
            None => (String::new(), None),
        };
        let rejection = Rejection {
            reason: RejectionReason::Unprocessable,
            message: format!("{message} (processing failed: {error})")
                .trim_start()
                .to_owned(),
            address,
        };
        self.reject(input, rejection, now_ms);
    }

    pub(super) fn reject(&mut self, input: &Input, rejection: Rejection, now_ms: i64) {
        self.metrics.rejected(
            rejection.reason.as_str(),
            &rejection.message,
            input.partition,
            input.offset,
        );
        let payload = input.payload.as_deref().unwrap_or_default();
        if let Some(addr) = &rejection.address {
            self.outs.push(Out::Result {
                partition: input.reply_partition(self.intent_partitions),
                result: ToolResult {
                    workflow_id: addr.step.workflow_id.clone(),
                    step_index: addr.step.step_index,
                    tool: addr.step.tool.clone(),
                    attempt: addr.step.attempt,
                    call_id: addr.call_id.clone(),
                    status: Status::Rejected,
                    output: None,
                    error: Some(ErrorBody {
                        kind: rejection.reason.as_str().to_owned(),
                        message: rejection.message.clone(),
                    }),
                    deduplicated: false,
                    completed_at: crate::contract::timestamp(at(now_ms)),
                },
                traceparent: input.traceparent(),
                since_ms: input.timestamp_ms,
                when: When::WithBatch,
            });
        }
        self.outs.push(Out::Dlq {
            key: input.key.clone(),
            headers: input.headers.clone(),
            record: DlqRecord::new(
                &rejection,
                &input.topic,
                input.partition,
                input.offset,
                payload,
                at(now_ms),
            ),
        });
    }
}
