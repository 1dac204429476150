//! Fault injection for the crash, recovery and liveness tests. Every
//! `STEPGATE_TEST_*` variable the process reads is read here, once, and only
//! in builds with the `test-hooks` feature (the tests enable it; release
//! builds do not): elsewhere setting one does nothing.

use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A hook's setting, if the build has the feature and the variable is set.
fn setting(name: &str) -> Option<String> {
    if cfg!(feature = "test-hooks") {
        std::env::var(name).ok()
    } else {
        None
    }
}

/// A counting hook (`NAME=N`: the N-th occurrence fires): its N, read from
/// the environment once, and how many occurrences it has seen.
struct Nth {
    name: &'static str,
    n: OnceLock<Option<u64>>,
    seen: AtomicU64,
}

impl Nth {
    const fn new(name: &'static str) -> Nth {
        Nth {
            name,
            n: OnceLock::new(),
            seen: AtomicU64::new(0),
        }
    }

    /// Counts one occurrence; its N if this is the N-th.
    fn hit(&self) -> Option<u64> {
        let n = (*self
            .n
            .get_or_init(|| setting(self.name).and_then(|v| v.parse().ok())))?;
        (self.seen.fetch_add(1, Ordering::SeqCst) + 1 == n).then_some(n)
    }

    /// When `counted`, counts one occurrence; at the N-th, logs `what` and
    /// returns true.
    fn fires(&self, counted: bool, what: &str) -> bool {
        match counted.then(|| self.hit()).flatten() {
            Some(n) => {
                tracing::warn!("{}={n}: {what}", self.name);
                true
            }
            None => false,
        }
    }

    /// Counts one occurrence; aborts the process (a crash, no clean-up) at
    /// the N-th, saying where.
    fn abort_at(&self, where_: &str) {
        if let Some(n) = self.hit() {
            eprintln!("{}={n}: aborting {where_}", self.name);
            std::process::abort();
        }
    }
}

/// `STEPGATE_TEST_STALL_AFTER=S`: the gate's loop blocks for good S seconds
/// after it started — a stuck gate, to be seen by `/healthz`.
pub(crate) fn maybe_stall() {
    static AT: OnceLock<Option<Instant>> = OnceLock::new();
    let at = AT.get_or_init(|| {
        setting("STEPGATE_TEST_STALL_AFTER")
            .and_then(|s| s.parse().ok())
            .map(|s| Instant::now() + Duration::from_secs(s))
    });
    if at.is_some_and(|t| Instant::now() >= t) {
        tracing::error!("STEPGATE_TEST_STALL_AFTER: the gate's loop stops here for good");
        loop {
            std::thread::park();
        }
    }
}

/// `STEPGATE_TEST_CRASH_BEFORE_COMMIT=N`: the process aborts when the N-th
/// transaction has sent everything and is about to commit.
pub(crate) fn crash_before_commit() {
    static HOOK: Nth = Nth::new("STEPGATE_TEST_CRASH_BEFORE_COMMIT");
    HOOK.abort_at("before the transaction commits");
}

/// `STEPGATE_TEST_CRASH_AFTER_COMMIT=N`: the process aborts when the N-th
/// transaction that starts calls has committed, before its batch is applied
/// to the local state.
pub(crate) fn crash_after_commit(starts_calls: bool) {
    static HOOK: Nth = Nth::new("STEPGATE_TEST_CRASH_AFTER_COMMIT");
    if starts_calls {
        HOOK.abort_at("after the transaction committed, before it is applied");
    }
}

/// `STEPGATE_TEST_CRASH_BEFORE_MEND=N`: the process aborts when the N-th
/// session is about to read back what a broker may have lost of the
/// process's last commits (`gate::lost`): a crash before the mend.
pub(crate) fn crash_before_mend() {
    static HOOK: Nth = Nth::new("STEPGATE_TEST_CRASH_BEFORE_MEND");
    HOOK.abort_at("before reading back the last commits");
}

/// `STEPGATE_TEST_LOSE_COMMIT_REPLY=N`: the N-th transaction that starts
/// calls commits, and is then reported failed, as when the commit's reply is
/// lost.
pub(crate) fn lose_commit_reply(starts_calls: bool) -> Result<(), KafkaError> {
    static HOOK: Nth = Nth::new("STEPGATE_TEST_LOSE_COMMIT_REPLY");
    if HOOK.fires(starts_calls, "a committed transaction is reported failed") {
        return Err(KafkaError::MessageProduction(
            RDKafkaErrorCode::RequestTimedOut,
        ));
    }
    Ok(())
}

/// `STEPGATE_TEST_SLOW_TRANSACTION_END=N`: the N-th transaction that starts
/// calls commits, and is then taken to have ended slowly enough that a late
/// copy of its commit request may be on its way (`kafka::stale_end_possible`).
pub(crate) fn slow_transaction_end(starts_calls: bool) -> bool {
    static HOOK: Nth = Nth::new("STEPGATE_TEST_SLOW_TRANSACTION_END");
    HOOK.fires(
        starts_calls,
        "a committed transaction is taken to have ended slowly",
    )
}

/// `STEPGATE_TEST_LOSE_COMMIT_MARKER=N`: the N-th transaction that commits
/// answers (its own, or the offsets of repeats answered at once before it) is
/// aborted where it would commit, and reported committed; the
/// session then fails ([`session_lost`]). That is where a broker that lost an
/// acknowledged transaction's commit marker leaves the gate once the next
/// session has ended the hanging transaction (by aborting it).
pub(crate) fn lose_commit_marker(answers: bool) -> bool {
    static HOOK: Nth = Nth::new("STEPGATE_TEST_LOSE_COMMIT_MARKER");
    HOOK.fires(answers, "a transaction is aborted and reported committed")
}

/// The error a session fails with after [`lose_commit_marker`], as when the
/// broker went away.
pub(crate) fn session_lost() -> KafkaError {
    KafkaError::MessageProduction(RDKafkaErrorCode::BrokerTransportFailure)
}

/// `STEPGATE_TEST_HANG_SEND=N`: the N-th transaction that publishes answers
/// never finishes sending its records and offsets, as a send seen to hang
/// after a partition leader's SIGKILL (`kafka::send_limit` bounds it).
/// [`arm_hang_send`] counts the gate's batches; the transaction that follows
/// hangs in [`hang_send`].
pub(crate) fn arm_hang_send(answers: bool) {
    static HOOK: Nth = Nth::new("STEPGATE_TEST_HANG_SEND");
    if HOOK.fires(answers, "this transaction's send never returns") {
        HANG_ARMED.store(true, Ordering::SeqCst);
    }
}

static HANG_ARMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Never returns for a transaction [`arm_hang_send`] armed; at once otherwise.
pub(crate) async fn hang_send() {
    if HANG_ARMED.swap(false, Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
}

/// `STEPGATE_TEST_DELAY_COMMIT_MS=MS`: every gate transaction waits this long
/// before it sends anything — a slow broker, which lets a test act between a
/// call sent before its batch commits and that commit.
pub(crate) async fn delay_commit() {
    static MS: OnceLock<Option<u64>> = OnceLock::new();
    let ms =
        *MS.get_or_init(|| setting("STEPGATE_TEST_DELAY_COMMIT_MS").and_then(|v| v.parse().ok()));
    if let Some(ms) = ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
}

/// `STEPGATE_TEST_CRASH_BEFORE_INVOKE=N`: the process aborts when the N-th
/// call is handed over (after its `started` commit, before the tool is called).
pub(crate) fn crash_before_invoke() {
    static HOOK: Nth = Nth::new("STEPGATE_TEST_CRASH_BEFORE_INVOKE");
    HOOK.abort_at("before the tool is called");
}

/// `STEPGATE_TEST_CRASH_AFTER_INVOKE=N`: the process aborts when the N-th
/// call has returned, before its outcome is committed.
pub(crate) fn crash_after_invoke() {
    static HOOK: Nth = Nth::new("STEPGATE_TEST_CRASH_AFTER_INVOKE");
    HOOK.abort_at("before the outcome is committed");
}

#[cfg(test)]
mod hook_tests {
    /// The fault hooks live here alone: no other module reads a
    /// `STEPGATE_TEST_*` variable, and the modules that call hooks read no
    /// environment at all.
    #[test]
    fn every_test_hook_is_read_here() {
        for (file, text, calls_hooks) in [
            ("src/gate/mod.rs", include_str!("gate/mod.rs"), false),
            ("src/gate/session.rs", include_str!("gate/session.rs"), true),
            ("src/gate/commit.rs", include_str!("gate/commit.rs"), true),
            (
                "src/gate/ownership.rs",
                include_str!("gate/ownership.rs"),
                false,
            ),
            ("src/executor/mod.rs", include_str!("executor/mod.rs"), true),
            ("src/app/mod.rs", include_str!("app/mod.rs"), false),
            ("src/app/claims.rs", include_str!("app/claims.rs"), false),
            ("src/main.rs", include_str!("main.rs"), false),
            (
                "src/cli/commands.rs",
                include_str!("cli/commands.rs"),
                false,
            ),
        ] {
            assert!(
                !text.contains("env::var(\"STEPGATE_TEST_"),
                "{file} reads a test hook directly: hooks live in src/hooks.rs"
            );
            assert!(
                !calls_hooks || !text.contains("std::env::var("),
                "{file} reads the environment directly"
            );
            assert_eq!(calls_hooks, text.contains("hooks::"), "{file}");
        }
    }

    /// Without the feature (a release build), a hook's variable does nothing.
    #[cfg(not(feature = "test-hooks"))]
    #[test]
    fn test_hooks_do_nothing_without_their_feature() {
        for v in [
            "STEPGATE_TEST_LOSE_COMMIT_MARKER",
            "STEPGATE_TEST_LOSE_COMMIT_REPLY",
            "STEPGATE_TEST_CRASH_BEFORE_COMMIT",
            "STEPGATE_TEST_CRASH_BEFORE_INVOKE",
        ] {
            // SAFETY: no other test of this binary reads these variables.
            unsafe { std::env::set_var(v, "1") };
        }
        assert_eq!(super::setting("STEPGATE_TEST_CRASH_BEFORE_COMMIT"), None);
        assert!(!super::lose_commit_marker(true));
        assert!(super::lose_commit_reply(true).is_ok());
        super::crash_before_commit(); // would abort the test binary
        super::crash_before_invoke(); // likewise
    }
}
