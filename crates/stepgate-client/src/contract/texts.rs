//! Every text a model can receive from stepgate. Each says what happened, whether
//! the action may have taken effect, and what to do next. Golden tests pin them.

/// Model-facing messages, one function per situation.
pub struct Texts;

impl Texts {
    /// A field of the intent is wrong (`problem` names the field and the rule).
    pub fn rejected_field(tool: &str, problem: &str) -> String {
        format!(
            "This call to `{tool}` was rejected before execution, so nothing was performed: {problem}. \
             Correct that and call the tool again."
        )
    }

    /// An object of the intent (`place`: "`arguments`", "`metadata`" or "the
    /// intent") has a key twice; `pointer` is where (a JSON Pointer, quoted).
    pub fn duplicate_key(tool: &str, place: &str, pointer: &str) -> String {
        format!(
            "This call to `{tool}` was rejected before execution, so nothing was performed: \
             {place} has the key at {pointer} more than once, and a tool and the person \
             approving the call could each read a different one of its values. Send each key \
             once and call the tool again."
        )
    }

    /// The intent names a tool that is not configured.
    pub fn unknown_tool(tool: &str, available: &[String]) -> String {
        let list = if available.is_empty() {
            "none".to_owned()
        } else {
            available
                .iter()
                .map(|t| format!("`{t}`"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "There is no tool named `{tool}`, so nothing was performed. Available tools: {list}. \
             Call one of those instead, or continue without this tool."
        )
    }

    /// The whole intent exceeds the configured size limit.
    pub fn oversized(tool: &str, size: usize, limit: usize) -> String {
        format!(
            "This call to `{tool}` was rejected before execution, so nothing was performed: it is \
             {size} bytes, over the limit of {limit} bytes. Send smaller arguments (for example a \
             reference to large content instead of the content itself) and call the tool again."
        )
    }

    /// `arguments` or `metadata` is nested deeper than stepgate accepts.
    pub fn too_deep(tool: &str, field: &str, limit: usize) -> String {
        format!(
            "This call to `{tool}` was rejected before execution, so nothing was performed: \
             `{field}` is nested more than {limit} levels deep. Flatten it (for example pass \
             deeply nested content as a JSON string) and call the tool again."
        )
    }

    /// A pool tool's call that no worker took before its deadline: never invoked.
    pub fn no_worker(tool: &str, pool: &str) -> String {
        format!(
            "The call to `{tool}` was not performed: no worker of its pool `{pool}` took it \
             before its deadline (the pool has no running worker, or all were busy). Nothing was \
             done. Call `{tool}` again later (a new call), or tell the user the tool is \
             unavailable."
        )
    }

    /// Started, then no outcome arrived before the tool's deadline (e.g. the executor died).
    pub fn in_doubt_lost(tool: &str) -> String {
        format!(
            "The call to `{tool}` was started but no outcome was received, so it may or may not \
             have taken effect. Do not call `{tool}` again for this step: repeating it returns \
             this same answer. Tell the user that the outcome is unconfirmed and a person must \
             check it before anything else is done about it."
        )
    }

    /// The request reached the tool, then the answer was lost (5xx, timeout, broken connection).
    pub fn in_doubt_unconfirmed(tool: &str, detail: &str) -> String {
        format!(
            "The call to `{tool}` reached the tool but its outcome is unknown ({detail}), so it may \
             have taken effect. Do not call `{tool}` again for this step: repeating it returns \
             this same answer. Tell the user that the outcome is unconfirmed and a person must \
             check it before anything else is done about it."
        )
    }

    /// This dispatch says "not performed", but an earlier dispatch of the same
    /// step (re-run after its deadline) was never accounted for: it may have
    /// taken effect.
    pub fn in_doubt_earlier_try(tool: &str, detail: &str) -> String {
        let detail = excerpt(detail);
        format!(
            "The call to `{tool}` may have taken effect: an earlier try of this same call may \
             have performed it (it never reported back, or reported that it ran), and the \
             latest try ended without performing it ({detail}). Do not call `{tool}` again for this step: repeating it returns this \
             same answer. Tell the user that the outcome is unconfirmed and a person must check \
             it before anything else is done about it."
        )
    }

    /// A keyed call could not reach its tool, and an earlier try of the same
    /// step (by a stepgate process that received it just before, or an
    /// earlier run) may have: asking again with the same key is safe, and
    /// is how to learn what happened.
    pub fn unreached_keyed(tool: &str, detail: &str) -> String {
        let detail = excerpt(detail);
        format!(
            "The tool `{tool}` could not be reached this time ({detail}), and an earlier try of \
             this same call may have reached it, so the action may or may not have been \
             performed. Calling `{tool}` again for this same step (the same step_index) asks the \
             tool again under the same idempotency key, which is safe: if an earlier try took \
             effect, the tool returns that result instead of acting twice. Call it again for this \
             step later, or tell the user the tool is unavailable for now."
        )
    }

    /// A keyed tool kept answering that a request with this call's key is
    /// still being processed (409/423/425), past the time stepgate waits.
    pub fn in_doubt_still_processing(tool: &str, http_status: u16, waited: &str) -> String {
        format!(
            "The call to `{tool}` is still being processed by the tool: it answered HTTP \
             {http_status} (a request with this call's key is in progress) for {waited}, so it \
             may take effect or may already have. Do not call `{tool}` again for this step: \
             repeating it returns this same answer. Tell the user that the outcome is \
             unconfirmed and a person must check it before anything else is done about it."
        )
    }

    /// A repeat of a recorded step that names another call (its identity
    /// arguments differ): not run, and not given the recorded answer.
    /// `fields` are (field, recorded value, this call's value).
    pub fn identity_conflict(tool: &str, fields: &[(String, String, String)]) -> String {
        let diff: Vec<String> = fields
            .iter()
            .map(|(f, recorded, sent)| {
                format!(
                    "`{}` is {} here but {} in the recorded call",
                    f.trim_start_matches('/'),
                    excerpt(sent),
                    excerpt(recorded)
                )
            })
            .collect();
        format!(
            "This call of `{tool}` was not performed: it arrived as a retry of a call already \
             recorded for this step, but it is a different call ({}). It was not run, and the \
             recorded call's answer is not its answer. If this call is still wanted, call \
             `{tool}` again: that is a new call, and it runs.",
            diff.join("; ")
        )
    }

    /// A 4xx answer: a definite refusal, nothing performed.
    pub fn tool_refused(tool: &str, http_status: u16, body: &str) -> String {
        let body = excerpt(body);
        format!(
            "The tool `{tool}` refused the call (HTTP {http_status}) and did not perform the \
             action. Its answer: {body}. Sending this same call again returns this same answer. If the \
             refusal is about the arguments, call `{tool}` again with corrected arguments: \
             that is a new call, and it runs."
        )
    }

    /// A text from a tool as a message may quote it: one line, at most 300
    /// characters (the cap every quoting message here applies).
    pub fn excerpt(text: &str) -> String {
        excerpt(text)
    }

    /// An MCP tool answered with a result marked `isError`: it ran (or tried
    /// to) and says what went wrong, so this answer is final for the step.
    pub fn tool_reported_error(tool: &str, text: &str) -> String {
        let text = if text.trim().is_empty() {
            "(no text)".to_owned()
        } else {
            excerpt(text)
        };
        format!(
            "The tool `{tool}` reported an error: {text}. Sending this same call again returns \
             this same answer. If the error is about the arguments, call `{tool}` again with \
             corrected arguments: that is a new call, and it runs."
        )
    }

    /// An MCP server refused the `tools/call` request itself (unknown tool,
    /// invalid parameters): the tool did not run.
    pub fn mcp_refused(tool: &str, code: i32, message: &str) -> String {
        let message = excerpt(message);
        format!(
            "The tool `{tool}` refused the call (MCP error {code}: {message}) and did not perform \
             the action. Sending this same call again returns this same answer. If the refusal is \
             about the arguments, call `{tool}` again with corrected arguments: that is a new \
             call, and it runs."
        )
    }

    /// A read-only or idempotent tool kept failing; re-running it is safe.
    pub fn tool_failed_safe(tool: &str, tries: u32, detail: &str) -> String {
        format!(
            "The tool `{tool}` failed after {tries} tries ({detail}). This tool is safe to run \
             again: call `{tool}` again later (a new call), or continue without its result."
        )
    }

    /// The tool could not be reached at all: the request was never sent.
    pub fn tool_unreachable(tool: &str, tries: u32, detail: &str) -> String {
        format!(
            "The tool `{tool}` could not be reached after {tries} tries ({detail}), so the action \
             was not performed. Call `{tool}` again later (a new call), or tell the user the tool \
             is unavailable."
        )
    }

    /// The tool's address answered with a redirect that means "not here" (301,
    /// 307, 308, …): nothing was performed, and the redirect was not followed.
    /// The address is not echoed: it may carry credentials.
    pub fn tool_redirected(tool: &str, http_status: u16) -> String {
        format!(
            "The tool `{tool}` did not perform the action: the tool's configured address \
             answered with a redirect (HTTP {http_status}), and stepgate does not follow \
             redirects, so the call was not sent anywhere else. Calling `{tool}` again will be \
             answered the same way until a person corrects the tool's address: tell the user \
             the tool is misconfigured, and continue without it."
        )
    }

    /// A 302 or 303 from a tool that is not safe to re-run: services send these
    /// after performing a POST ("see the result there"), so it may have run.
    pub fn tool_redirected_in_doubt(tool: &str, http_status: u16) -> String {
        format!(
            "The call to `{tool}` reached the tool, and the tool's configured address answered \
             with a redirect (HTTP {http_status}) instead of a result. Some services answer so \
             after performing the action, so it may have taken effect; stepgate does not follow \
             redirects. Do not call `{tool}` again for this step: repeating it returns this same \
             answer. Tell the user that the outcome is unconfirmed and a person must check it \
             before anything else is done about it."
        )
    }

    /// A 302 or 303 from a read-only or idempotent tool: no result, and running
    /// it again is harmless but answered the same way.
    pub fn tool_redirected_safe(tool: &str, http_status: u16) -> String {
        format!(
            "The tool `{tool}` gave no result: the tool's configured address answered with a \
             redirect (HTTP {http_status}), and stepgate does not follow redirects. This tool is \
             safe to run again, but it will be answered the same way until a person corrects \
             the tool's address: tell the user the tool is misconfigured, and continue without \
             its result."
        )
    }

    /// A 2xx answer over the tool's `max_output_bytes`: the tool ran and
    /// succeeded, the output is dropped. `size` is the declared length when the
    /// tool sent one (otherwise only "over the limit" is known).
    pub fn output_too_large(tool: &str, size: Option<u64>, limit: u64) -> String {
        let size = match size {
            Some(n) => format!("{n} bytes, over the limit of {limit} bytes"),
            None => format!("more than the limit of {limit} bytes"),
        };
        format!(
            "The tool `{tool}` ran and succeeded, so the action took effect, but its answer was \
             too large to return ({size}). Do not call `{tool}` again for this step: the action \
             is done and its answer would be as large again. Continue without its output, and \
             tell the user the action succeeded but its result was too large to show."
        )
    }

    /// A 2xx output nested deeper than arguments may be.
    pub fn output_too_deep(tool: &str, limit: usize) -> String {
        format!(
            "The tool `{tool}` ran and succeeded, so the action took effect, but its answer \
             nests deeper than {limit} levels and cannot be returned. Do not call `{tool}` \
             again for this step: the action is done and its answer would be as deep again. \
             Continue without its output, and tell the user the action succeeded but its \
             result could not be shown."
        )
    }

    /// An intent set aside after its processing failed on stored state that
    /// cannot be read: whether the step ran before is unknown.
    pub fn unprocessable(tool: &str) -> String {
        format!(
            "stepgate could not process this call of `{tool}`: the record it keeps for this \
             step cannot be read, so it cannot tell whether an earlier call of this step already \
             took effect. The call was not made now. Do not call `{tool}` again for this step \
             on your own: tell the user that this action needs a person to check whether it was \
             done, and continue with what does not depend on it."
        )
    }

    /// An intent outside its workflow's partition.
    pub fn wrong_partition(tool: &str, workflow_id: &str, got: i32, owner: i32) -> String {
        format!(
            "Nothing was performed: this call of `{tool}` was published to partition {got}, \
             but the calls of workflow `{workflow_id}` belong to partition {owner}, where its \
             earlier steps are recorded; run here, it could repeat an action already done. \
             This is a setup problem of the agent's Kafka client (its partitioner), not of the \
             call: do not retry it unchanged. Tell the user the tool could not be called \
             because of a configuration error."
        )
    }

    /// An intent read after the state retention, its step without a record.
    pub fn expired(tool: &str, workflow_id: &str, age: std::time::Duration) -> String {
        format!(
            "Nothing was performed: this call of `{tool}` (workflow `{workflow_id}`) was \
             published {} ago, longer than stepgate keeps step records, and its step has no \
             record: it may be an old call read again (the gate's consumer offsets were lost) \
             whose record was already purged, so running it could repeat an action done long \
             ago. If the call is still wanted, publish it again now.",
            humantime::format_duration(std::time::Duration::from_secs(age.as_secs()))
        )
    }

    /// A new step of a workflow after a `last_step` tool ended it.
    pub fn workflow_ended(
        tool: &str,
        workflow_id: &str,
        last_index: u64,
        last_tool: &str,
    ) -> String {
        format!(
            "This call to `{tool}` was rejected before execution, so nothing was performed: \
             workflow `{workflow_id}` already ended with step {last_index} (`{last_tool}`), a \
             tool that must be the last step of its workflow because it cannot be safely \
             repeated. Do not call more tools in this workflow; report the outcome of step \
             {last_index} to the user. Further work needs a new workflow."
        )
    }

    /// A person refused a call that needed approval.
    pub fn denied(tool: &str, reason: Option<&str>) -> String {
        let reason = match reason.map(str::trim).filter(|r| !r.is_empty()) {
            Some(r) => format!(" Their reason: {}.", excerpt(r).trim_end_matches('.')),
            None => String::new(),
        };
        format!(
            "A person reviewed this call to `{tool}` and refused it, so it was not performed.\
             {reason} Do not call `{tool}` again for this step: repeating it returns this same \
             answer. Tell the user the action was refused, and continue without it or ask them \
             how to proceed."
        )
    }

    /// An operator found that an in-doubt call ran and failed without effect.
    pub fn resolved_failed(tool: &str, found: Option<&str>) -> String {
        let found = match found.map(str::trim).filter(|r| !r.is_empty()) {
            Some(r) => format!(" What they found: {}.", excerpt(r).trim_end_matches('.')),
            None => String::new(),
        };
        format!(
            "A person checked the earlier call to `{tool}` for this step and found that it \
             failed without taking effect.{found} Do not repeat this call for this step: \
             repeating it returns this same answer. If the action is still wanted, make a new \
             call of `{tool}`; otherwise tell the user it failed."
        )
    }

    /// An operator confirmed an in-doubt call did not take effect.
    pub fn resolved_not_executed(tool: &str) -> String {
        format!(
            "A person checked the earlier call to `{tool}` for this step and confirmed that it \
             was not performed. If the action is still wanted, call `{tool}` again for this same \
             step: it will run once."
        )
    }
}

/// A bounded, single-line excerpt of a tool's answer for a message.
fn excerpt(body: &str) -> String {
    let flat: String = body
        .trim()
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.is_empty() {
        return "(empty)".to_owned();
    }
    if flat.chars().count() > 300 {
        let cut: String = flat.chars().take(300).collect();
        format!("{cut}…")
    } else {
        flat
    }
}

#[cfg(test)]
mod golden {
    //! Golden texts: a change to what a model reads must be deliberate.
    use super::*;

    #[test]
    fn rejected_field() {
        assert_eq!(
            Texts::rejected_field(
                "send_email",
                "`step_index` must be an integer ≥ 0, got a string"
            ),
            "This call to `send_email` was rejected before execution, so nothing was performed: \
             `step_index` must be an integer ≥ 0, got a string. Correct that and call the tool again."
        );
    }

    #[test]
    fn unknown_tool() {
        assert_eq!(
            Texts::unknown_tool("send_mail", &["search".into(), "send_email".into()]),
            "There is no tool named `send_mail`, so nothing was performed. Available tools: \
             `search`, `send_email`. Call one of those instead, or continue without this tool."
        );
        assert!(Texts::unknown_tool("x", &[]).contains("Available tools: none."));
    }

    #[test]
    fn mcp_tool_texts() {
        assert_eq!(
            Texts::tool_reported_error("create_ticket", "queue `OPS` does not exist"),
            "The tool `create_ticket` reported an error: queue `OPS` does not exist. Sending \
             this same call again returns this same answer. If the error is about the \
             arguments, call `create_ticket` again with corrected arguments: that is a new \
             call, and it runs."
        );
        assert!(Texts::tool_reported_error("t", " ").contains("an error: (no text)."));
        assert_eq!(
            Texts::mcp_refused("create_ticket", -32602, "missing `title`"),
            "The tool `create_ticket` refused the call (MCP error -32602: missing `title`) and \
             did not perform the action. Sending this same call again returns this same answer. \
             If the refusal is about the arguments, call `create_ticket` again with corrected \
             arguments: that is a new call, and it runs."
        );
    }

    #[test]
    fn oversized() {
        assert_eq!(
            Texts::oversized("upload", 2_000_000, 1_048_576),
            "This call to `upload` was rejected before execution, so nothing was performed: it is \
             2000000 bytes, over the limit of 1048576 bytes. Send smaller arguments (for example a \
             reference to large content instead of the content itself) and call the tool again."
        );
    }

    #[test]
    fn too_deep() {
        assert_eq!(
            Texts::too_deep("search", "arguments", 64),
            "This call to `search` was rejected before execution, so nothing was performed: \
             `arguments` is nested more than 64 levels deep. Flatten it (for example pass deeply \
             nested content as a JSON string) and call the tool again."
        );
    }

    #[test]
    fn in_doubt_lost() {
        assert_eq!(
            Texts::in_doubt_lost("wire_money"),
            "The call to `wire_money` was started but no outcome was received, so it may or may \
             not have taken effect. Do not call `wire_money` again for this step: repeating it \
             returns this same answer. Tell the user that the outcome is unconfirmed and a person \
             must check it before anything else is done about it."
        );
    }

    #[test]
    fn in_doubt_unconfirmed() {
        assert_eq!(
            Texts::in_doubt_unconfirmed("wire_money", "HTTP 503"),
            "The call to `wire_money` reached the tool but its outcome is unknown (HTTP 503), so \
             it may have taken effect. Do not call `wire_money` again for this step: repeating it \
             returns this same answer. Tell the user that the outcome is unconfirmed and a person \
             must check it before anything else is done about it."
        );
    }

    #[test]
    fn tool_refused() {
        assert_eq!(
            Texts::tool_refused("create_ticket", 422, "{\"error\":\"title is required\"}\n"),
            "The tool `create_ticket` refused the call (HTTP 422) and did not perform the action. \
             Its answer: {\"error\":\"title is required\"}. Sending this same call again \
             returns this same answer. If the refusal is about the arguments, call \
             `create_ticket` again with corrected arguments: that is a new call, and it runs."
        );
        assert!(Texts::tool_refused("t", 400, "").contains("Its answer: (empty)."));
        assert!(Texts::tool_refused("t", 400, &"x".repeat(1000)).contains("x…."));
    }

    #[test]
    fn an_unreached_keyed_call_is_asked_again_by_the_same_step() {
        let t = Texts::unreached_keyed("charge", "connection refused");
        assert!(t.contains("(connection refused)"), "{t}");
        assert!(t.contains("may or may not have been performed"), "{t}");
        assert!(
            t.contains("for this same step (the same step_index)"),
            "{t}"
        );
        assert!(!t.contains("person"), "never a person's job: {t}");
    }

    #[test]
    fn edges_texts_never_ask_for_a_new_attempt() {
        let texts = [
            Texts::in_doubt_earlier_try("charge", "refused (HTTP 400)"),
            Texts::in_doubt_still_processing("charge", 409, "10s"),
            Texts::no_worker("render", "gpu"),
            Texts::unreached_keyed("charge", "connection refused"),
            Texts::identity_conflict(
                "send_email",
                &[("/to".into(), "\"alice@x\"".into(), "\"bob@x\"".into())],
            ),
        ];
        for t in &texts {
            assert!(!t.contains("attempt"), "{t}");
        }
        assert_eq!(
            texts[4],
            "This call of `send_email` was not performed: it arrived as a retry of a call \
             already recorded for this step, but it is a different call (`to` is \"bob@x\" here \
             but \"alice@x\" in the recorded call). It was not run, and the recorded call's \
             answer is not its answer. If this call is still wanted, call `send_email` again: \
             that is a new call, and it runs."
        );
        assert!(texts[0].contains("may have taken effect") && texts[0].contains("Do not call"));
        assert!(texts[1].contains("HTTP 409") && texts[1].contains("Do not call"));
        assert!(texts[2].contains("not performed") && texts[2].contains("`gpu`"));
        assert!(
            texts[3].contains("may or may not have been performed")
                && texts[3].contains("connection refused")
                && texts[3].contains("for this same step")
        );
    }

    #[test]
    fn tool_failed_safe() {
        assert_eq!(
            Texts::tool_failed_safe("search", 3, "HTTP 500"),
            "The tool `search` failed after 3 tries (HTTP 500). This tool is safe to run again: \
             call `search` again later (a new call), or continue without its result."
        );
    }

    #[test]
    fn expired() {
        assert_eq!(
            Texts::expired(
                "send_email",
                "order-7781",
                std::time::Duration::from_millis(8 * 86_400_000 + 3_600_500)
            ),
            "Nothing was performed: this call of `send_email` (workflow `order-7781`) was \
             published 8days 1h ago, longer than stepgate keeps step records, and its step has no \
             record: it may be an old call read again (the gate's consumer offsets were lost) \
             whose record was already purged, so running it could repeat an action done long \
             ago. If the call is still wanted, publish it again now."
        );
    }

    #[test]
    fn workflow_ended() {
        assert_eq!(
            Texts::workflow_ended("search", "order-7781", 4, "send_fax"),
            "This call to `search` was rejected before execution, so nothing was performed: \
             workflow `order-7781` already ended with step 4 (`send_fax`), a tool that must be \
             the last step of its workflow because it cannot be safely repeated. Do not call \
             more tools in this workflow; report the outcome of step 4 to the user. Further work \
             needs a new workflow."
        );
    }

    #[test]
    fn denied() {
        assert_eq!(
            Texts::denied("wire_money", Some("amount above the daily limit.")),
            "A person reviewed this call to `wire_money` and refused it, so it was not \
             performed. Their reason: amount above the daily limit. Do not call `wire_money` \
             again for this step: repeating it returns this same answer. Tell the user the \
             action was refused, and continue without it or ask them how to proceed."
        );
        assert_eq!(
            Texts::denied("wire_money", Some("  ")),
            Texts::denied("wire_money", None)
        );
        assert!(Texts::denied("t", None).starts_with(
            "A person reviewed this call to `t` and refused it, so it was not performed. Do not"
        ));
    }

    #[test]
    fn resolved_not_executed() {
        assert_eq!(
            Texts::resolved_not_executed("send_fax"),
            "A person checked the earlier call to `send_fax` for this step and confirmed that it \
             was not performed. If the action is still wanted, call `send_fax` again for this \
             same step: it will run once."
        );
    }

    #[test]
    fn resolved_failed() {
        assert_eq!(
            Texts::resolved_failed("wire", Some("the bank rejected it: account closed.")),
            "A person checked the earlier call to `wire` for this step and found that it failed \
             without taking effect. What they found: the bank rejected it: account closed. Do \
             not repeat this call for this step: repeating it returns this same answer. If the \
             action is still wanted, make a new call of `wire`; otherwise tell the user it failed."
        );
    }

    #[test]
    fn tool_redirected() {
        assert_eq!(
            Texts::tool_redirected("send_email", 307),
            "The tool `send_email` did not perform the action: the tool's configured address \
             answered with a redirect (HTTP 307), and stepgate does not follow redirects, so the \
             call was not sent anywhere else. Calling `send_email` again will be answered the \
             same way until a person corrects the tool's address: tell the user the tool is \
             misconfigured, and continue without it."
        );
    }

    #[test]
    fn tool_redirected_in_doubt() {
        assert_eq!(
            Texts::tool_redirected_in_doubt("create_order", 303),
            "The call to `create_order` reached the tool, and the tool's configured address \
             answered with a redirect (HTTP 303) instead of a result. Some services answer so \
             after performing the action, so it may have taken effect; stepgate does not follow \
             redirects. Do not call `create_order` again for this step: repeating it returns \
             this same answer. Tell the user that the outcome is unconfirmed and a person must \
             check it before anything else is done about it."
        );
    }

    #[test]
    fn tool_redirected_safe() {
        assert_eq!(
            Texts::tool_redirected_safe("search", 302),
            "The tool `search` gave no result: the tool's configured address answered with a \
             redirect (HTTP 302), and stepgate does not follow redirects. This tool is safe to \
             run again, but it will be answered the same way until a person corrects the tool's \
             address: tell the user the tool is misconfigured, and continue without its result."
        );
    }

    #[test]
    fn output_too_large() {
        assert_eq!(
            Texts::output_too_large("export_report", Some(5_000_000), 1_048_576),
            "The tool `export_report` ran and succeeded, so the action took effect, but its \
             answer was too large to return (5000000 bytes, over the limit of 1048576 bytes). Do \
             not call `export_report` again for this step: the action is done and its answer \
             would be as large again. Continue without its output, and tell the user the action \
             succeeded but its result was too large to show."
        );
        assert!(
            Texts::output_too_large("t", None, 1024)
                .contains("too large to return (more than the limit of 1024 bytes).")
        );
    }

    #[test]
    fn tool_unreachable() {
        assert_eq!(
            Texts::tool_unreachable("send_email", 3, "connection refused"),
            "The tool `send_email` could not be reached after 3 tries (connection refused), so \
             the action was not performed. Call `send_email` again later (a new call), or tell \
             the user the tool is unavailable."
        );
    }
}
