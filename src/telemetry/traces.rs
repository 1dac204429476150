//! Traces: each step as OpenTelemetry spans, exported over OTLP/HTTP
//! (protobuf) when `[traces] endpoint` is configured.
//!
//! - The gate's decision about an intent is a span (`stepgate.step {tool}`,
//!   kind consumer) under the intent's `traceparent` (a root span when it has
//!   none): `stepgate.decision` says what was decided (`new_step`,
//!   `awaiting_approval`, `rerun`, `repeat`, `fast_path`, `rejected`); a
//!   repeat carries a `stepgate.repeat` event.
//! - Each invocation of a tool (each dispatch of a step, each fast-path call)
//!   is an `execute_tool {tool}` span after the OpenTelemetry GenAI semantic
//!   conventions (`gen_ai.operation.name`, `gen_ai.tool.name`,
//!   `gen_ai.tool.call.id`, `gen_ai.tool.type`, `error.type`), a child of the
//!   decision that started it (an approved call's: of the operator's
//!   `stepgate.command approve`; a re-run after a deadline: of the agent's
//!   span); the tool is sent its `traceparent`, so the tool's own spans nest
//!   under it.
//! - An operator's command applied to a step is a `stepgate.command {action}`
//!   span under the agent's span recorded with the step.
//!
//! Not configured, nothing is built: every hook checks one `Option` and
//! returns, and the `traceparent` passed through to tools is the agent's.
//! Arguments and outputs are never put on a span (they may be personal data
//! or secrets).

use crate::config::TracesConfig;
use crate::contract::{Call, Outcome, StepKey};
use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId,
    TraceState, Tracer as _, TracerProvider as _,
};
use opentelemetry::{Context, InstrumentationScope, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, Span,
};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TracesError {
    #[error("cannot set up the OTLP traces exporter for {endpoint}: {message}")]
    Exporter { endpoint: String, message: String },
}

/// The spans of one process: nothing when not configured.
#[derive(Default)]
pub struct Traces {
    inner: Option<Inner>,
}

struct Inner {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl Traces {
    /// No traces: every hook returns at once.
    pub fn disabled() -> Traces {
        Traces { inner: None }
    }

    /// The exporter `config` describes, or [`Traces::disabled`] without an
    /// endpoint. Spans are sent in batches from a thread of the exporter's own.
    pub fn from_config(config: &TracesConfig) -> Result<Traces, TracesError> {
        let Some(endpoint) = config.endpoint.as_deref() else {
            return Ok(Traces::disabled());
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(endpoint)
            .with_timeout(config.timeout.0)
            .with_headers(config.headers.clone().into_iter().collect())
            .build()
            .map_err(|e| TracesError::Exporter {
                endpoint: crate::config::redact_url(endpoint),
                message: e.to_string(),
            })?;
        let ratio = Sampler::TraceIdRatioBased(config.sample_ratio);
        let sampler = if config.parent_based {
            Sampler::ParentBased(Box::new(ratio))
        } else {
            ratio
        };
        let processor = BatchSpanProcessor::builder(exporter)
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_scheduled_delay(config.export_interval.0)
                    .build(),
            )
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(sampler)
            .with_resource(
                Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer_with_scope(
            InstrumentationScope::builder("stepgate")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
        );
        tracing::info!(endpoint = %crate::config::redact_url(endpoint), ratio = config.sample_ratio, "exporting traces over OTLP/HTTP");
        Ok(Traces {
            inner: Some(Inner { provider, tracer }),
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Send the spans still buffered, and stop exporting (blocks up to the
    /// export timeout: call it off the async runtime's threads).
    pub fn shutdown(&self) {
        if let Some(i) = &self.inner
            && let Err(e) = i.provider.shutdown()
        {
            tracing::warn!(error = %e, "the last traces could not be exported");
        }
    }

    /// The gate's decision about an intent of `step` (read from `topic`,
    /// `partition`, `offset`): a span under the intent's `traceparent`, ended
    /// when the returned value is dropped.
    pub fn decision(
        &self,
        step: &StepKey,
        call_id: Option<&str>,
        traceparent: Option<&str>,
        (topic, partition, offset): (&str, i32, i64),
    ) -> Decision {
        let Some(i) = &self.inner else {
            return Decision(None);
        };
        let mut attributes = step_attributes(step);
        attributes.extend([
            KeyValue::new("gen_ai.tool.name", step.tool.clone()),
            KeyValue::new("messaging.system", "kafka"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.destination.name", topic.to_owned()),
            KeyValue::new("messaging.destination.partition.id", partition.to_string()),
            KeyValue::new("messaging.kafka.offset", offset),
        ]);
        if let Some(id) = call_id {
            attributes.push(KeyValue::new("gen_ai.tool.call.id", id.to_owned()));
        }
        let span = i
            .tracer
            .span_builder(format!("stepgate.step {}", step.tool))
            .with_kind(SpanKind::Consumer)
            .with_attributes(attributes)
            .start_with_context(&i.tracer, &parent(traceparent));
        Decision(Some(span))
    }

    /// An operator's command about `step` (`action`: `approve`, `deny`,
    /// `resolve_executed`, `resolve_not_executed`, applied): a span under the
    /// agent's span recorded with the step; an approved call runs under it.
    pub fn command(
        &self,
        step: &StepKey,
        action: &'static str,
        by: &str,
        traceparent: Option<&str>,
    ) -> Decision {
        let Some(i) = &self.inner else {
            return Decision(None);
        };
        let mut attributes = step_attributes(step);
        attributes.extend([
            KeyValue::new("gen_ai.tool.name", step.tool.clone()),
            KeyValue::new("stepgate.decision", action),
            KeyValue::new("stepgate.operator.by", by.to_owned()),
        ]);
        let span = i
            .tracer
            .span_builder(format!("stepgate.command {action}"))
            .with_kind(SpanKind::Consumer)
            .with_attributes(attributes)
            .start_with_context(&i.tracer, &parent(traceparent));
        Decision(Some(span))
    }

    /// The invocation of `call`'s tool: an `execute_tool` span under the
    /// call's `traceparent` (the decision that started it), ended by
    /// [`ToolSpan::finished`] or [`ToolSpan::not_invoked`].
    pub fn execute_tool(&self, call: &Call) -> ToolSpan {
        let Some(i) = &self.inner else {
            return ToolSpan(None);
        };
        let mut attributes = step_attributes(&call.step);
        attributes.extend([
            KeyValue::new("gen_ai.operation.name", "execute_tool"),
            KeyValue::new("gen_ai.tool.name", call.step.tool.clone()),
            // Called by stepgate over HTTP (or MCP), not by the model's host.
            KeyValue::new("gen_ai.tool.type", "extension"),
            KeyValue::new("stepgate.dispatch", i64::from(call.dispatch)),
            KeyValue::new("stepgate.fast_path", call.fast_ref.is_some()),
        ]);
        if let Some(id) = &call.call_id {
            attributes.push(KeyValue::new("gen_ai.tool.call.id", id.clone()));
        }
        let span = i
            .tracer
            .span_builder(format!("execute_tool {}", call.step.tool))
            .with_kind(SpanKind::Internal)
            .with_attributes(attributes)
            .start_with_context(&i.tracer, &parent(call.traceparent.as_deref()));
        ToolSpan(Some(span))
    }
}

/// The step key as attributes.
fn step_attributes(step: &StepKey) -> Vec<KeyValue> {
    vec![
        KeyValue::new("stepgate.workflow_id", step.workflow_id.clone()),
        KeyValue::new(
            "stepgate.step_index",
            i64::try_from(step.step_index).unwrap_or(i64::MAX),
        ),
        KeyValue::new(
            "stepgate.attempt",
            i64::try_from(step.attempt).unwrap_or(i64::MAX),
        ),
    ]
}

/// The context of a W3C `traceparent` (`00-<trace id>-<parent id>-<flags>`),
/// or none (a root span) when absent or unreadable.
fn parent(traceparent: Option<&str>) -> Context {
    let remote = traceparent.and_then(|tp| {
        let mut parts = tp.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version.len() != 2 || version == "ff" || trace.len() != 32 || span.len() != 16 {
            return None;
        }
        let flags = u8::from_str_radix(flags.get(..2)?, 16).ok()?;
        let sc = SpanContext::new(
            TraceId::from_hex(trace).ok()?,
            SpanId::from_hex(span).ok()?,
            TraceFlags::new(flags & 0x01),
            true,
            TraceState::default(),
        );
        sc.is_valid().then_some(sc)
    });
    match remote {
        Some(sc) => Context::new().with_remote_span_context(sc),
        None => Context::new(),
    }
}

/// The W3C `traceparent` naming `span` as the parent.
fn traceparent_of(span: &Span) -> Option<String> {
    let sc = span.span_context();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// The span of one decision; ended when dropped.
pub struct Decision(Option<Span>);

impl Decision {
    /// What was decided: `new_step`, `awaiting_approval`, `rerun`, `fast_path`.
    pub fn decided(&mut self, decision: &'static str) {
        if let Some(s) = &mut self.0 {
            s.set_attribute(KeyValue::new("stepgate.decision", decision));
        }
    }

    /// A repeat of a known step, answered from its record (`in_flight`:
    /// waits for its outcome); `first_call_id` is the call that ran it.
    pub fn repeat(&mut self, in_flight: bool, rephrased: bool, first_call_id: Option<&str>) {
        let Some(s) = &mut self.0 else {
            return;
        };
        s.set_attribute(KeyValue::new("stepgate.decision", "repeat"));
        let mut attributes = vec![
            KeyValue::new(
                "stepgate.step.state",
                if in_flight { "in_flight" } else { "completed" },
            ),
            KeyValue::new("stepgate.rephrased", rephrased),
            KeyValue::new("stepgate.deduplicated", true),
        ];
        if let Some(id) = first_call_id {
            attributes.push(KeyValue::new("stepgate.first_call_id", id.to_owned()));
        }
        s.add_event("stepgate.repeat", attributes);
    }

    /// Refused (`reason`, as the answer's `error.kind`): nothing run.
    pub fn rejected(&mut self, reason: &str, message: &str) {
        if let Some(s) = &mut self.0 {
            s.set_attribute(KeyValue::new("stepgate.decision", "rejected"));
            s.set_attribute(KeyValue::new("error.type", reason.to_owned()));
            s.set_status(Status::error(message.to_owned()));
        }
    }

    /// The `traceparent` of the calls this decision starts: this span.
    pub fn traceparent(&self) -> Option<String> {
        self.0.as_ref().and_then(traceparent_of)
    }
}

/// The span of one tool invocation.
pub struct ToolSpan(Option<Span>);

impl ToolSpan {
    /// No span (a call never invoked, or traces not configured).
    pub fn none() -> ToolSpan {
        ToolSpan(None)
    }

    /// The `traceparent` the tool is sent: this span.
    pub fn traceparent(&self) -> Option<String> {
        self.0.as_ref().and_then(traceparent_of)
    }

    /// The invocation's outcome; ends the span.
    pub fn finished(self, outcome: &Outcome) {
        let Some(mut s) = self.0 else {
            return;
        };
        s.set_attribute(KeyValue::new("stepgate.outcome", outcome.label()));
        match outcome {
            Outcome::Ok { .. } => {}
            Outcome::Error { error } | Outcome::InDoubt { error } => {
                s.set_attribute(KeyValue::new("error.type", error.kind.clone()));
                s.set_status(Status::error(error.message.clone()));
            }
        }
        s.end();
    }

    /// Never invoked (`why`: `partition_moved`, `stopping`); ends the span.
    pub fn not_invoked(self, why: &'static str) {
        let Some(mut s) = self.0 else {
            return;
        };
        s.set_attribute(KeyValue::new("stepgate.outcome", "not_invoked"));
        s.add_event("stepgate.not_invoked", vec![KeyValue::new("why", why)]);
        s.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_the_parent_and_a_bad_one_makes_a_root() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let cx = parent(Some(tp));
        let sc = cx.span().span_context().clone();
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(
            sc.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(sc.span_id().to_string(), "b7ad6b7169203331");
        for bad in [
            "",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd-b7ad6b7169203331-01",
            "00-xyz",
        ] {
            assert!(!parent(Some(bad)).span().span_context().is_valid(), "{bad}");
        }
    }

    #[test]
    fn not_configured_nothing_is_built() {
        let t = Traces::from_config(&TracesConfig::default()).unwrap();
        assert!(!t.is_enabled());
        let step = StepKey {
            workflow_id: "w".into(),
            step_index: 0,
            tool: "t".into(),
            attempt: 0,
        };
        let d = t.decision(&step, None, None, ("intents", 0, 0));
        assert_eq!(d.traceparent(), None);
    }

    /// `sample_ratio` decides for intents without a traceparent; with
    /// `parent_based`, an agent's sampled flag decides for its own: kept
    /// (recorded, flags 01) or not (flags 00, nothing exported), and the
    /// tool call follows its decision.
    #[test]
    fn sampling_follows_the_ratio_and_the_agents_flag() {
        let step = StepKey {
            workflow_id: "w".into(),
            step_index: 0,
            tool: "t".into(),
            attempt: 0,
        };
        let call = |tp: Option<String>| Call {
            step: step.clone(),
            arguments: serde_json::from_str("{}").unwrap(),
            dispatch: 1,
            fast_ref: None,
            traceparent: tp,
            call_id: None,
            token: None,
        };
        let at = ("intents", 0, 0);
        let sampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let unsampled = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00";
        let traces = |ratio: f64, parent_based: bool| {
            // Nothing listens there: the spans kept are sent once, when
            // each provider is dropped, and refused (loopback, 100 ms).
            Traces::from_config(&TracesConfig {
                endpoint: Some("http://127.0.0.1:9/v1/traces".into()),
                sample_ratio: ratio,
                parent_based,
                timeout: crate::duration::dur("100ms"),
                ..TracesConfig::default()
            })
            .unwrap()
        };
        let flags = |tp: Option<String>| {
            tp.expect("a traceparent")
                .split('-')
                .nth(3)
                .unwrap()
                .to_owned()
        };
        let none = traces(0.0, true);
        let d = none.decision(&step, None, None, at);
        assert_eq!(flags(d.traceparent()), "00", "a root at ratio 0 is dropped");
        let d = none.decision(&step, None, Some(sampled), at);
        let tp = d.traceparent();
        assert_eq!(
            flags(tp.clone()),
            "01",
            "the agent's sampled flag is followed"
        );
        assert!(
            tp.as_deref()
                .unwrap()
                .starts_with("00-0af7651916cd43dd8448eb211c80319c-")
        );
        assert_ne!(tp.as_deref(), Some(sampled), "the decision is a new span");
        let tool = none.execute_tool(&call(tp));
        assert_eq!(
            flags(tool.traceparent()),
            "01",
            "the call follows its decision"
        );
        let all = traces(1.0, true);
        let d = all.decision(&step, None, Some(unsampled), at);
        assert_eq!(
            flags(d.traceparent()),
            "00",
            "the agent's not-sampled flag too"
        );
        let d = all.decision(&step, None, None, at);
        assert_eq!(flags(d.traceparent()), "01");
        // Not parent-based: the ratio decides for every trace.
        let d = traces(0.0, false).decision(&step, None, Some(sampled), at);
        assert_eq!(flags(d.traceparent()), "00");
    }

    #[test]
    fn the_config_is_checked_and_its_headers_never_shown() {
        let mut c = TracesConfig {
            endpoint: Some("http://u:pw@127.0.0.1:4318/v1/traces".into()),
            ..TracesConfig::default()
        };
        c.headers
            .insert("authorization".into(), "Basic c2VjcmV0".into());
        c.validate().unwrap();
        let shown = format!("{c:?}");
        assert!(
            !shown.contains("c2VjcmV0") && !shown.contains("pw"),
            "{shown}"
        );
        for bad in [
            TracesConfig {
                endpoint: Some("127.0.0.1:4318".into()),
                ..TracesConfig::default()
            },
            TracesConfig {
                sample_ratio: 1.5,
                ..TracesConfig::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
