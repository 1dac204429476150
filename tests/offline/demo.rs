//! `stepgate demo`, the zero-setup tour, says what the README says it shows.
//! It runs on librdkafka's in-process mock cluster, so it proves the tour
//! works, not any guarantee: those are proven against the real broker.

use std::process::Command;

#[test]
fn the_demo_tells_the_tour_the_readme_promises() {
    let out = Command::new(env!("CARGO_BIN_EXE_stepgate"))
        .args(["demo", "--metrics", "127.0.0.1:0"])
        .output()
        .expect("stepgate demo runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let errors = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}\n{errors}");
    // A normal run ends clean: no error lines (librdkafka's clients once
    // logged refused connections as the mock cluster shut down before them).
    assert!(
        !errors.contains("ERROR") && !text.contains("ERROR"),
        "{errors}"
    );
    assert!(text.starts_with("stepgate demo"), "{text}");
    // One malformed intent, one dead letter (the mock cluster once delivered
    // the gate's aborted probe records, dead-lettered as malformed too).
    assert!(
        text.contains("a malformed record went to the dead-letter topic")
            && text.contains("stepgate_rejected_inputs_total{reason=\"malformed_json\"} 1\n"),
        "{text}"
    );
    assert!(!text.lines().next().unwrap_or_default().contains("executor"));
    let line = |needle: &str| {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with `{needle}`:\n{text}"))
            .to_owned()
    };
    // A rephrased retry: the tool ran once, the retry got the first answer.
    assert!(line("send_email ran 1 time(s)").contains("original answer"));
    assert!(
        line("retry     call_002").contains("deduplicated=true"),
        "{text}"
    );
    // Identical arguments at two steps: two tickets.
    assert!(text.contains("create_ticket ran 2 times"), "{text}");
    // attempt 1 runs again, with another key.
    assert!(
        text.contains("send_email ran 2 times; Idempotency-Key"),
        "{text}"
    );
    // The unkeyed call that timed out is in doubt, and its retry is not re-run.
    assert!(
        line("first     call_006").contains("status=in_doubt"),
        "{text}"
    );
    assert!(
        line("retry     call_007").contains("status=in_doubt"),
        "{text}"
    );
    assert!(text.contains("wire_transfer ran 1 time(s)"), "{text}");
    // A typo in the tool's name is answered, not crashed on.
    assert!(line("typo").contains("status=rejected"), "{text}");
}
