//! The events of held calls and in-doubt steps that settle themselves:
//! approval lifecycle events, reconcile lookups and their settlements, and
//! the notifications sent about them (`[notify]`). Each logs and counts.

use super::{Metrics, counter_vec};
use prometheus::{IntCounterVec, Registry};
use tracing::{info, warn};

/// The lifecycle's counters, registered with the process's other metrics.
pub(super) struct LifecycleMetrics {
    approval_events: IntCounterVec,
    lookups: IntCounterVec,
    reconciled: IntCounterVec,
    notifications: IntCounterVec,
}

impl LifecycleMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        LifecycleMetrics {
            approval_events: counter_vec(
                r,
                "stepgate_approval_events_total",
                "Lifecycle events of calls held for approval, decided by the gate: escalated (nobody decided by escalate_after), expiring (notify.expiring_before ahead of the expiry), expired (nobody decided by approval_ttl: answered approval_expired, nothing ran), asked_again (the tool's policy changed while held).",
                &["tool", "event"],
            ),
            lookups: counter_vec(
                r,
                "stepgate_reconcile_lookups_total",
                "Answers of tools' reconcile lookups about in-doubt steps: executed, not_executed, unknown, failed (the lookup did not answer usably).",
                &["tool", "answer"],
            ),
            reconciled: counter_vec(
                r,
                "stepgate_reconciled_steps_total",
                "In-doubt steps the reconciler dealt with: executed (settled ok with the lookup's output), not_executed (the next call runs it), to_person (the lookups could not tell by `until`: left to a person).",
                &["tool", "settled"],
            ),
            notifications: counter_vec(
                r,
                "stepgate_notifications_total",
                "Approval lifecycle notifications to the [notify] webhook, by event (held, escalated, expiring, expired) and outcome (delivered, failed: every try refused or timed out within notify.give_up_after).",
                &["event", "outcome"],
            ),
        }
    }
}

impl Metrics {
    /// A held call's lifecycle event (`escalated`, `expiring`, `expired`,
    /// `asked_again`).
    pub fn approval_event(&self, step: &crate::contract::StepKey, event: &'static str) {
        match event {
            "expired" => {
                warn!(step = %step, "a call held for approval expired: nobody decided it in time, nothing ran")
            }
            _ => info!(step = %step, event, "a call held for approval: lifecycle event"),
        }
        self.lifecycle
            .approval_events
            .with_label_values(&[self.tool_label(&step.tool), event])
            .inc();
    }

    /// A reconcile lookup answered (`answer`: executed, not_executed,
    /// unknown, failed).
    pub fn lookup_answered(&self, step: &crate::contract::StepKey, ask: u32, answer: &'static str) {
        info!(step = %step, ask, answer, "reconcile lookup answered");
        self.lifecycle
            .lookups
            .with_label_values(&[self.tool_label(&step.tool), answer])
            .inc();
    }

    /// The reconciler settled an in-doubt step (`executed`, `not_executed`)
    /// or left it to a person (`to_person`).
    pub fn reconciled(&self, step: &crate::contract::StepKey, settled: &'static str) {
        match settled {
            "to_person" => {
                warn!(step = %step, "the reconcile lookups could not tell what happened: the in-doubt step is left to a person")
            }
            _ => info!(step = %step, settled, "in-doubt step settled by the reconciler"),
        }
        self.lifecycle
            .reconciled
            .with_label_values(&[self.tool_label(&step.tool), settled])
            .inc();
    }

    /// A notification delivered to the webhook, or given up on.
    pub fn notification(&self, event: &str, delivered: bool, detail: &str) {
        let event = match event {
            "held" | "escalated" | "expiring" | "expired" => event,
            _ => "other",
        };
        if delivered {
            info!(event, "approval notification delivered");
        } else {
            warn!(
                event,
                detail, "approval notification not delivered: every try failed"
            );
        }
        self.lifecycle
            .notifications
            .with_label_values(&[event, if delivered { "delivered" } else { "failed" }])
            .inc();
    }
}
