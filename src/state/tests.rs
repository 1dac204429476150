use super::*;
use crate::contract::Arguments;
use crate::tools::Category;
use serde_json::{Map, Value};

fn step(i: u64) -> StepKey {
    StepKey {
        workflow_id: "wf".into(),
        step_index: i,
        tool: "t".into(),
        attempt: 0,
    }
}

fn record(i: u64, phase: Phase, expires: i64) -> StepRecord {
    StepRecord {
        deadline_ms: Some(500),
        ..StepRecord::new(
            step(i),
            Category::Unkeyed,
            phase,
            Arguments::empty(),
            0,
            0,
            expires,
        )
    }
}

/// A batch that landed in partition `p` with its last changelog record at
/// `next - 1`, committed by session 0's first producer.
fn at(p: i32, next: i64) -> Landing {
    landing(0, 0, &[(p, next - 1)])
}

/// A batch committed by `slot` of `session`, its last changelog record in
/// each partition at the given offset.
fn landing(session: u64, slot: usize, tails: &[(i32, i64)]) -> Landing {
    Landing {
        committer: Committer { session, slot },
        tails: tails.iter().map(|&(p, o)| (p, tail(o))).collect(),
    }
}

/// The tail of a record at `o` whose key is its offset.
fn tail(o: i64) -> Tail {
    Tail::of(o, Some(&o.to_be_bytes()), Some(b"v"))
}

fn from(next: i64, check: &[i64]) -> Resume {
    Resume::From {
        next,
        check: check.iter().map(|&o| tail(o)).collect(),
    }
}

#[test]
fn committed_batches_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = StateStore::open(dir.path()).unwrap();
        let mut b = Batch::default();
        b.put_step(&s, 2, &record(1, Phase::Started, 1000)).unwrap();
        s.apply(&b, &at(2, 1)).unwrap();
    }
    let s = StateStore::open(dir.path()).unwrap();
    assert_eq!(s.step(2, &step(1)).unwrap().unwrap().phase, Phase::Started);
    assert_eq!(
        s.step(1, &step(1)).unwrap(),
        None,
        "partitions are separate"
    );
    assert_eq!(s.deadlines(2).unwrap(), vec![(step(1), 500)]);
    assert_eq!(s.changelog_next(2).unwrap(), Some(1));
    assert_eq!(s.changelog_next(1).unwrap(), None);
}

#[test]
fn expiry_index_follows_the_record() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let mut b = Batch::default();
    b.put_step(&s, 0, &record(1, Phase::Started, 1000)).unwrap();
    b.put_step(&s, 0, &record(2, Phase::Completed, 3000))
        .unwrap();
    s.apply(&b, &at(0, 1)).unwrap();
    let mut b = Batch::default();
    b.put_step(&s, 0, &record(1, Phase::Completed, 4000))
        .unwrap();
    s.apply(&b, &at(0, 2)).unwrap();
    assert_eq!(s.expired(0, 3500, 10).unwrap(), vec![(3000, step(2))]);
    let mut b = Batch::default();
    b.delete_step(&s, 0, &step(2)).unwrap();
    s.apply(&b, &at(0, 3)).unwrap();
    assert!(s.expired(0, 3500, 10).unwrap().is_empty());
    assert_eq!(s.expired(0, 9999, 10).unwrap(), vec![(4000, step(1))]);
    assert_eq!(s.workflow_steps(0, "wf").unwrap().len(), 1);
    assert!(s.workflow_steps(0, "w").unwrap().is_empty());
}

#[test]
fn a_batch_reads_through_the_batch_still_committing() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let mut committing = Batch::default();
    committing
        .put_step(&s, 0, &record(1, Phase::Started, 1000))
        .unwrap();
    let committing = std::sync::Arc::new(committing);
    let next = Batch::on_top_of(Some(committing.clone()));
    assert_eq!(
        next.step(&s, 0, &step(1)).unwrap().map(|r| r.phase),
        Some(Phase::Started),
        "decided before its commit returned, seen by the next batch"
    );
    assert!(s.step(0, &step(1)).unwrap().is_none(), "not applied yet");
    s.apply(&committing, &at(0, 1)).unwrap();
    assert!(s.step(0, &step(1)).unwrap().is_some());
}

#[test]
fn a_batch_reads_its_own_writes() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let mut b = Batch::default();
    b.put_step(&s, 0, &record(1, Phase::Started, 1000)).unwrap();
    assert!(b.step(&s, 0, &step(1)).unwrap().is_some());
    assert!(s.step(0, &step(1)).unwrap().is_none());
    assert_eq!(b.partitions().into_iter().collect::<Vec<_>>(), vec![0]);
}

#[test]
fn a_step_written_over_its_read_indexes_as_a_write_that_reads_again() {
    // `put_step_known` skips the read `put_step` makes; given what `step`
    // returned, it must leave the same writes, whatever changed of the
    // indexed fields — and an index entry wrongly kept or left behind would
    // show here as a differing write.
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let mut b = Batch::default();
    b.put_step(&s, 0, &record(1, Phase::Started, 1000)).unwrap();
    b.put_step(&s, 0, &record(2, Phase::InDoubt, 1000)).unwrap();
    s.apply(&b, &at(0, 1)).unwrap();
    let below = std::sync::Arc::new({
        let mut b = Batch::default();
        b.put_step(&s, 0, &record(3, Phase::Started, 1000)).unwrap();
        b
    });
    let cases = [
        record(1, Phase::Completed, 4000), // committed; phase, deadline, expiry change
        record(1, Phase::Started, 1000),   // committed; nothing indexed changes
        record(2, Phase::Completed, 1000), // committed; leaves the attention index
        record(3, Phase::AwaitingApproval, 2000), // in the batch below
        record(4, Phase::Started, 1000),   // no record yet
    ];
    for new in cases {
        let mut read_again = Batch::on_top_of(Some(below.clone()));
        read_again.put_step(&s, 0, &new).unwrap();
        let mut known = Batch::on_top_of(Some(below.clone()));
        let old = known.step(&s, 0, &new.step).unwrap();
        known.put_step_known(0, old.as_ref().map(Indexed::of), &new);
        assert_eq!(known.writes, read_again.writes, "{:?}", new.step);
        if old.is_none() {
            // A deferred step's first write, which reads nothing.
            let mut first = Batch::on_top_of(Some(below.clone()));
            first.put_first_step(&s, 0, &new);
            assert_eq!(first.writes, read_again.writes, "{:?}", new.step);
        }
    }
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "written as new has a record")]
fn a_step_with_a_record_is_never_written_as_new() {
    // The debug check the simulation and the suites run under: a write that
    // skipped the read over an existing record would leave its old index
    // entries behind.
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let mut b = Batch::default();
    b.put_step(&s, 0, &record(1, Phase::Started, 1000)).unwrap();
    s.apply(&b, &at(0, 1)).unwrap();
    Batch::default().put_first_step(&s, 0, &record(1, Phase::Completed, 4000));
}

/// The expiry entries of `p` that are their step's current one (a
/// superseded record's may dangle until a purge drops it).
fn live_expiry(s: &StateStore, p: i32) -> Vec<(i64, StepKey)> {
    s.expired(p, i64::MAX, usize::MAX)
        .unwrap()
        .into_iter()
        .filter(|(at, k)| {
            s.step(p, k)
                .unwrap()
                .is_some_and(|r| r.expires_at_ms == *at)
        })
        .collect()
}

#[test]
fn a_partition_restored_from_its_changelog_equals_the_original() {
    let a_dir = tempfile::tempdir().unwrap();
    let a = StateStore::open(a_dir.path()).unwrap();
    let mut log = Vec::new();
    let mut seq = 0;
    for batch in [
        vec![
            record(1, Phase::Started, 1000),
            record(2, Phase::Started, 1000),
        ],
        vec![
            record(1, Phase::Completed, 5000),
            record(4, Phase::Started, 2000),
        ],
    ] {
        let mut b = Batch::default();
        for r in &batch {
            b.put_step(&a, 3, r).unwrap();
        }
        log.extend(b.changelog());
        seq += 1;
        a.apply(&b, &at(3, seq)).unwrap();
    }
    let mut b = Batch::default();
    b.delete_step(&a, 3, &step(2)).unwrap();
    log.extend(b.changelog());
    a.apply(&b, &at(3, 3)).unwrap();
    assert!(log.iter().all(|e| e.partition == 3));
    assert!(
        log.iter().any(|e| e.value.is_none()),
        "deletes are tombstones"
    );
    assert!(
        log.iter().all(|e| e.key[0] == Cf::Steps.tag()),
        "the deadline and expiry indexes are derived, not logged"
    );

    // Another disk holds stale data of the same partition: wiped, then restored.
    let b_dir = tempfile::tempdir().unwrap();
    let b = StateStore::open(b_dir.path()).unwrap();
    let mut stale = Batch::default();
    stale
        .put_step(&b, 3, &record(9, Phase::Started, 1))
        .unwrap();
    b.apply(&stale, &at(3, 1)).unwrap();
    b.wipe_partition(3).unwrap();
    let records: Vec<_> = log.into_iter().map(|e| (e.key, e.value)).collect();
    b.apply_changelog(&records).unwrap();
    b.finish_restore(3, Some(3)).unwrap();
    assert_eq!(b.step(3, &step(9)).unwrap(), None);
    assert_eq!(b.step(3, &step(1)).unwrap(), a.step(3, &step(1)).unwrap());
    assert_eq!(b.step(3, &step(2)).unwrap(), None);
    // Superseded versions may leave dangling expiry entries (purging drops
    // them); the live ones are the original's.
    let live = |s: &StateStore| live_expiry(s, 3);
    assert_eq!(live(&a), a.expired(3, 9999, 100).unwrap());
    assert_eq!(live(&b), live(&a));
    assert_eq!(a.deadlines(3).unwrap(), vec![(step(4), 500)]);
    assert_eq!(a.expired(3, 9999, 10).unwrap().len(), 2);
    assert_eq!(b.deadlines(3).unwrap(), a.deadlines(3).unwrap());
    assert_eq!(b.changelog_next(3).unwrap(), Some(3));
}

#[test]
fn size_counts_index_and_filter_blocks_in_the_bounded_cache() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open_with_cache(dir.path(), 4 << 20).unwrap();
    let n = 20_000;
    let mut b = Batch::default();
    for i in 0..n {
        b.put_step(&s, 0, &record(i, Phase::Completed, 1000))
            .unwrap();
    }
    s.apply(&b, &at(0, 1)).unwrap();
    let written = s.size();
    assert!(written.steps >= n / 2, "{written:?}");
    assert!(written.memtable_bytes > 0, "{written:?}");

    for cf in Cf::ALL {
        s.db.flush_cf(s.cf(cf)).unwrap();
    }
    for i in (0..n).step_by(7) {
        assert!(s.step(0, &step(i)).unwrap().is_some());
        assert!(s.step(1, &step(i)).unwrap().is_none());
    }
    let flushed = s.size();
    assert!(flushed.disk_bytes > 0, "{flushed:?}");
    // Index and filter blocks (~100 KiB for 20 k records) are charged to
    // the cache, not held beside it by the open files.
    assert!(flushed.block_cache_bytes > 0, "{flushed:?}");
    assert!(
        flushed.table_reader_bytes < 32 << 10,
        "index/filter memory outside the cache: {flushed:?}"
    );
}

/// A step record with every field set (and data in its arguments, metadata,
/// answer and late outcome).
fn full_record() -> StepRecord {
    use crate::contract::{ErrorBody, Outcome, ToolResult};
    let mut r = record(7, Phase::InDoubt, 9_000);
    r.arguments = Arguments::try_from(
        serde_json::json!({"to": "a@b.c", "n": [1, 2.5, null, {"deep": true}], "big": u64::MAX}),
    )
    .unwrap();
    r.call_id = Some("c-1".into());
    r.metadata = Some(
        serde_json::json!({"m": "é\u{0000}"})
            .as_object()
            .cloned()
            .unwrap(),
    );
    r.traceparent = Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into());
    r.result = Some(ToolResult::from_outcome(
        &r.step,
        Some("c-1".into()),
        Outcome::InDoubt {
            error: ErrorBody {
                kind: "tool_timeout".into(),
                message: "may have run".into(),
            },
        },
        chrono::Utc::now(),
    ));
    r.late_outcome = Some(Outcome::Ok {
        output: serde_json::json!({"id": -3}),
    });
    r.waiters = vec![Waiter {
        call_id: Some("c-2".into()),
        intent_ts_ms: Some(5),
        traceparent: None,
        reply_partition: Some(3),
    }];
    r.rephrased = vec![RephrasedCall {
        call_id: None,
        arguments: Arguments::empty(),
        at_ms: 3,
    }];
    r.operator_log = vec![OperatorEntry {
        id: "cmd-1".into(),
        action: "resolve_executed".into(),
        by: "ops".into(),
        at: "2026-11-30T00:00:00Z".into(),
        reason: Some("checked".into()),
        from: Phase::InDoubt,
    }];
    r.started_at_ms = Some(2);
    r.evidence = vec![Evidence {
        dispatch: 1,
        status: "error".into(),
        kind: Some("tool_unreachable".into()),
        why: "stale_dispatch".into(),
        at_ms: 4,
    }];
    r.open_dispatches = vec![2];
    r.not_invoked = Some(2);
    r.taken = Some(2);
    r.settled_through = 1;
    r.intent_ts_ms = Some(1);
    r.reply_partition = Some(2);
    r.unseen_reader = true;
    r
}

/// Every field of a step record survives the record encoding, through the
/// batch (decoded overlay) and through RocksDB (encoded bytes); JSON, never a
/// step record's encoding, is not read as one.
#[test]
fn a_full_record_round_trips_and_json_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let r = full_record();
    let mut b = Batch::default();
    b.put_step(&s, 1, &r).unwrap();
    assert_eq!(b.step(&s, 1, &r.step).unwrap().as_ref(), Some(&r));
    s.apply(&b, &at(1, 1)).unwrap();
    assert_eq!(s.step(1, &r.step).unwrap().as_ref(), Some(&r));
    let entries = b.changelog();
    let value = entries[0].value.as_deref().unwrap();
    assert_eq!(value[0], codec::MSGPACK_NAMED_V1);
    let (p, step, decoded) = changelog_step(&entries[0].key, Some(value)).unwrap();
    assert_eq!((p, &step, decoded.as_ref()), (1, &r.step, Some(&r)));
    let json = serde_json::to_vec(&r).unwrap();
    assert!(changelog_step(&entries[0].key, Some(&json)).is_none());
}

/// A record of a phase no release has (`intended`) is a corrupt record, as
/// any unreadable one: an error for the gate's poison handling, no panic.
#[test]
fn a_record_of_an_unknown_phase_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let mut b = Batch::default();
    b.put_step(&s, 0, &record(1, Phase::Started, 1000)).unwrap();
    let entry = b.changelog().remove(0);
    let value = entry.value.unwrap();
    // MessagePack strings carry their length: "started" → "intended".
    let (from, to) = (
        [&[0xa7][..], b"started"].concat(),
        [&[0xa8][..], b"intended"].concat(),
    );
    let at = value.windows(from.len()).position(|w| w == from).unwrap();
    assert_eq!(value.windows(from.len()).filter(|w| *w == from).count(), 1);
    let bad = [&value[..at], &to, &value[at + from.len()..]].concat();
    assert!(changelog_step(&entry.key, Some(&bad)).is_none());
    s.apply_changelog(&[(entry.key, Some(bad))]).unwrap();
    let e = s.step(0, &step(1)).unwrap_err();
    assert!(
        matches!(e, StateError::Corrupt { cf: "steps", .. }),
        "{e:?}"
    );
    assert!(format!("{:?}", e).contains("intended"), "{e:?}");
}

/// A step record stays writable to the changelog whatever callers send: waiting
/// repeats and rephrased copies are bounded, counts stay exact, and one
/// `call_id` waits once.
#[test]
fn a_step_record_stays_within_its_budgets() {
    let mut r = record(1, Phase::Started, 10_000);
    r.call_id = Some("first".into());
    let waiter = |id: String| Waiter {
        call_id: Some(id),
        intent_ts_ms: None,
        traceparent: None,
        reply_partition: None,
    };
    assert_eq!(
        r.add_waiter(waiter("first".into())),
        Err(NotWaiting::AlreadyWaiting)
    );
    assert_eq!(r.add_waiter(waiter("w1".into())), Ok(()));
    assert_eq!(
        r.add_waiter(waiter("w1".into())),
        Err(NotWaiting::AlreadyWaiting)
    );
    // Many small waiters: capped by count.
    for i in 2..=MAX_WAITERS {
        assert_eq!(r.add_waiter(waiter(format!("w{i}"))), Ok(()));
    }
    assert_eq!(
        r.add_waiter(waiter("one more".into())),
        Err(NotWaiting::OverBudget)
    );
    assert_eq!(r.waiters.len(), MAX_WAITERS);
    // Few large ones: capped by bytes.
    let mut big = record(2, Phase::Started, 10_000);
    let kept = (0..100)
        .filter(|i| {
            big.add_waiter(waiter(format!("{i}{}", "x".repeat(10_000))))
                .is_ok()
        })
        .count();
    assert_eq!(kept, WAITERS_BUDGET_BYTES / 10_002);
    // Rephrased copies: 40 KiB each, so one fits the budget; all are counted.
    for i in 0..40 {
        let mut a = Map::new();
        a.insert("n".into(), Value::from(i));
        a.insert("blob".into(), Value::from("y".repeat(40 * 1024)));
        assert!(r.note_repeat(Some(format!("r{i}")), &Arguments::from(a), 0));
    }
    assert_eq!(r.rephrased_count, 40);
    assert_eq!(r.rephrased.len(), 1);
    assert!(
        // `{ }` as an intent's text (read back as the gate's records keep it).
        !r.note_repeat(
            None,
            &rmp_serde::from_slice::<Arguments>(&rmp_serde::to_vec("{ }").unwrap()).unwrap(),
            0
        ),
        "the same object, other spacing: verbatim"
    );
    let encoded = crate::contract::codec::encode(&r);
    assert!(
        encoded.len() < REPHRASED_BUDGET_BYTES + WAITERS_BUDGET_BYTES + 16 * 1024,
        "{} bytes",
        encoded.len()
    );
}

#[test]
fn steps_waiting_for_a_person_are_counted_until_settled_and_after_a_restore() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let mut log = Vec::new();
    let mut b = Batch::default();
    b.put_step(&s, 1, &record(1, Phase::InDoubt, 1000)).unwrap();
    b.put_step(&s, 1, &record(2, Phase::InDoubt, 1000)).unwrap();
    b.put_step(&s, 1, &record(3, Phase::AwaitingApproval, 1000))
        .unwrap();
    b.put_step(&s, 1, &record(4, Phase::Started, 1000)).unwrap();
    b.put_step(&s, 2, &record(5, Phase::InDoubt, 1000)).unwrap();
    log.extend(b.changelog());
    s.apply(&b, &at(1, 1)).unwrap();
    let open = |i, a| OpenSteps {
        in_doubt: i,
        awaiting_approval: a,
    };
    assert_eq!(s.open_steps(1).unwrap(), open(2, 1));
    assert_eq!(s.open_steps(2).unwrap(), open(1, 0), "per partition");

    // An operator settles one in-doubt step, the approval is given (the call
    // starts), and one in-doubt step expires.
    let mut b = Batch::default();
    b.put_step(&s, 1, &record(1, Phase::Completed, 1000))
        .unwrap();
    b.put_step(&s, 1, &record(3, Phase::Started, 1000)).unwrap();
    b.delete_step(&s, 1, &step(2)).unwrap();
    log.extend(b.changelog());
    s.apply(&b, &at(1, 2)).unwrap();
    assert_eq!(s.open_steps(1).unwrap(), open(0, 0));
    assert_eq!(s.open_steps(2).unwrap(), open(1, 0));

    // A new owner restores the count from the changelog.
    let b_dir = tempfile::tempdir().unwrap();
    let restored = StateStore::open(b_dir.path()).unwrap();
    let records: Vec<_> = log.into_iter().map(|e| (e.key, e.value)).collect();
    restored.apply_changelog(&records).unwrap();
    assert_eq!(restored.open_steps(1).unwrap(), open(0, 0));
    assert_eq!(restored.open_steps(2).unwrap(), open(1, 0));
}

#[test]
fn a_step_record_must_fit_the_producer_with_its_outputs() {
    let load = |extra: &str| {
        crate::config::Config::from_toml_str(
            &format!("[tools.t]\ncategory = \"keyed\"\nurl = \"http://127.0.0.1:1/t\"\n{extra}"),
            Vec::new(),
        )
        .unwrap()
    };
    check_record_sizes(&load("")).unwrap();
    check_record_sizes(&load("max_output_bytes = 1400000\n")).unwrap();
    let e = check_record_sizes(&load("max_output_bytes = 2000000\n"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("`tools.t.max_output_bytes` is 2000000"), "{e}");
    assert!(e.contains("Lower it to at most 1474560"), "{e}");
}

#[test]
fn a_local_state_is_resumed_from_only_while_younger_than_the_tombstones() {
    let dir = tempfile::tempdir().unwrap();
    let s = StateStore::open(dir.path()).unwrap();
    let trust = Trust {
        max_age: Duration::from_secs(3600),
    };
    let now = chrono::Utc::now().timestamp_millis();
    assert_eq!(
        s.resume_point(1, now, &trust).unwrap(),
        Resume::Full(FullReason::NoLocalState)
    );
    let mut b = Batch::default();
    b.put_step(&s, 1, &record(1, Phase::Started, i64::MAX))
        .unwrap();
    s.apply(&b, &at(1, 7)).unwrap();
    let synced = s.synced_at(1).unwrap().expect("a committed batch sets it");
    assert!((synced - now).abs() < 60_000, "{synced} vs {now}");
    assert_eq!(s.resume_point(1, now, &trust).unwrap(), from(7, &[6]));
    assert_eq!(
        s.resume_point(1, synced + 3_599_000, &trust).unwrap(),
        from(7, &[6])
    );
    // Past the changelog's delete.retention.ms (less the margin): a tombstone
    // written after the offset may be gone.
    match s.resume_point(1, synced + 3_600_000, &trust).unwrap() {
        Resume::Full(FullReason::Stale { age, max_age }) => {
            assert_eq!(age, Duration::from_secs(3600));
            assert_eq!(max_age, trust.max_age);
        }
        other => panic!("{other:?}"),
    }
    // A restore brings it in sync again.
    s.finish_restore(1, Some(9)).unwrap();
    let later = s.synced_at(1).unwrap().unwrap();
    assert!(later >= synced);
    assert_eq!(
        s.resume_point(1, later + 1000, &trust).unwrap(),
        from(9, &[])
    );
    // Without its sync time (an older version removed it after an unclean
    // shutdown): its age is unknown.
    let mut wb = WriteBatch::default();
    wb.delete_cf(s.meta(), sync_key(1));
    s.db.write(wb).unwrap();
    assert_eq!(
        s.resume_point(1, later, &trust).unwrap(),
        Resume::Full(FullReason::UnknownAge)
    );
    s.finish_restore(1, Some(9)).unwrap();
    s.wipe_partition(1).unwrap();
    assert_eq!(s.synced_at(1).unwrap(), None);
}

#[test]
fn the_margin_under_delete_retention_leaves_small_retentions_untrusted() {
    let day = Trust::from_delete_retention(None);
    assert_eq!(
        day,
        Trust::from_delete_retention(Some(Trust::DEFAULT_DELETE_RETENTION))
    );
    assert!(day.max_age < Duration::from_secs(22 * 3600), "{day:?}");
    assert!(day.max_age > Duration::from_secs(21 * 3600), "{day:?}");
    assert_eq!(
        Trust::from_delete_retention(Some(Duration::from_secs(1))).max_age,
        Duration::ZERO
    );
}

#[test]
fn after_an_unclean_stop_each_partition_resumes_once_its_last_batches_are_confirmed() {
    let dir = tempfile::tempdir().unwrap();
    let trust = Trust {
        max_age: Duration::from_secs(3600),
    };
    let now = || chrono::Utc::now().timestamp_millis();
    let put = |s: &StateStore, p: i32, i: u64, l: &Landing| {
        let mut b = Batch::default();
        b.put_step(s, p, &record(i, Phase::Started, i64::MAX))
            .unwrap();
        s.apply(&b, l).unwrap();
    };
    {
        let s = StateStore::open(dir.path()).unwrap();
        assert!(!s.begin_gate().unwrap(), "a new state");
        // A session's two producers take turns.
        put(&s, 0, 1, &landing(7, 0, &[(0, 2), (5, 3)]));
        put(&s, 0, 2, &landing(7, 1, &[(0, 5)]));
        // Producer 0's next batch: its last one (0@2, 5@3) is settled.
        put(&s, 0, 3, &landing(7, 0, &[(0, 8)]));
        assert_eq!(s.unconfirmed(5).unwrap(), vec![]);
        assert_eq!(s.unconfirmed(0).unwrap(), vec![tail(5), tail(8)]);
        // ... and then killed (no end_gate).
    }
    {
        let s = StateStore::open(dir.path()).unwrap();
        assert!(s.begin_gate().unwrap(), "the last stop was unclean");
        // Nothing is dropped: each partition resumes from its offset once
        // the last batch of each producer is confirmed on its changelog.
        assert_eq!(s.resume_point(0, now(), &trust).unwrap(), from(9, &[5, 8]));
        assert_eq!(s.resume_point(5, now(), &trust).unwrap(), from(4, &[]));
        // A new session's producers settle nothing of the old ones: those
        // tails wait for a reader of the changelog.
        put(&s, 5, 4, &landing(8, 0, &[(5, 10)]));
        put(&s, 5, 5, &landing(8, 0, &[(5, 12)]));
        assert_eq!(s.unconfirmed(0).unwrap(), vec![tail(5), tail(8)]);
        assert_eq!(s.unconfirmed(5).unwrap(), vec![tail(12)]);
        // A restore that confirmed them clears them; a wipe too.
        s.finish_restore(0, Some(9)).unwrap();
        assert_eq!(s.resume_point(0, now(), &trust).unwrap(), from(9, &[]));
        s.wipe_partition(5).unwrap();
        assert_eq!(s.unconfirmed(5).unwrap(), vec![]);
        s.end_gate().unwrap();
    }
    {
        let s = StateStore::open(dir.path()).unwrap();
        assert!(!s.begin_gate().unwrap(), "stopped gracefully");
        assert_eq!(s.resume_point(0, now(), &trust).unwrap(), from(9, &[]));
    }
}

#[test]
fn a_tail_is_confirmed_only_by_its_own_record_at_its_offset() {
    let (a, b) = (tail(5), tail(9));
    let key = |o: i64| o.to_be_bytes();
    let seen = |c: &mut Confirming, o: i64| c.record(o, Some(&key(o)), Some(b"v"));
    // Both seen, with their digests.
    let mut c = Confirming::new(&[a, b]);
    assert_eq!(c.start(20), 5);
    for o in [5, 6, 9, 10] {
        seen(&mut c, o);
    }
    assert_eq!(c.verdict(11), Verdict::Confirmed);
    assert!(!c.pending());
    // 5 skipped (aborted: a read_committed reader never returns it).
    let mut c = Confirming::new(&[a, b]);
    seen(&mut c, 6);
    assert_eq!(c.verdict(11), Verdict::Refuted { offset: 5 });
    // Another record at 9 (the log lost ours and reused the offset).
    let mut c = Confirming::new(&[a, b]);
    seen(&mut c, 5);
    c.record(9, Some(&key(9)), Some(b"other"));
    assert_eq!(c.verdict(11), Verdict::Refuted { offset: 9 });
    // A tombstone is not the value.
    let mut c = Confirming::new(&[b]);
    c.record(9, Some(&key(9)), None);
    assert_eq!(c.verdict(11), Verdict::Refuted { offset: 9 });
    // The read ended past 9 without it: aborted.
    let mut c = Confirming::new(&[a, b]);
    seen(&mut c, 5);
    assert!(c.pending());
    assert_eq!(c.verdict(10), Verdict::Refuted { offset: 9 });
    // The read ended at 9 (a transaction open below it): not known yet.
    assert_eq!(c.verdict(9), Verdict::Unknown { offset: 9 });
    // Nothing to confirm: resumes where the state ends.
    assert_eq!(Confirming::new(&[]).start(20), 20);
    assert_eq!(Confirming::new(&[]).verdict(0), Verdict::Confirmed);
}

#[test]
fn a_compact_changelog_restores_what_a_named_one_does() {
    let r = full_record();
    let named = codec::encode(&r);
    let compact = codec::compact(&named).unwrap();
    // Struct field names are map keys outside the data the record carries
    // (metadata, outputs: their keys are the caller's).
    fn unnumbered(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    if !codec::FIELD_NAMES.contains(&k.as_str()) {
                        out.push(k.clone());
                    }
                    if k != "metadata" && k != "output" {
                        unnumbered(v, out);
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| unnumbered(v, out)),
            _ => {}
        }
    }
    let mut missing = Vec::new();
    unnumbered(&codec::decode::<Value>(&named).unwrap(), &mut missing);
    assert!(
        missing.is_empty(),
        "field names without a number: {missing:?}"
    );
    assert!(
        compact.len() * 2 < named.len() + 120,
        "{} of {}",
        compact.len(),
        named.len()
    );

    // The same batch restored from its changelog written named and compact.
    let src_dir = tempfile::tempdir().unwrap();
    let src = StateStore::open(src_dir.path()).unwrap();
    let mut b = Batch::default();
    b.put_step(&src, 1, &r).unwrap();
    let mut started = record(8, Phase::Started, 7_000);
    started.deadline_ms = Some(600);
    b.put_step(&src, 1, &started).unwrap();
    let log: Vec<(Vec<u8>, Option<Vec<u8>>)> = b
        .changelog()
        .into_iter()
        .map(|e| (e.key, e.value))
        .collect();
    let compacted: Vec<(Vec<u8>, Option<Vec<u8>>)> = log
        .iter()
        .map(|(k, v)| (k.clone(), v.as_deref().map(|v| codec::compact(v).unwrap())))
        .collect();
    let restore = |log: &[(Vec<u8>, Option<Vec<u8>>)]| {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        assert_eq!(s.apply_changelog(log).unwrap(), 2);
        let steps = (
            s.step(1, &r.step).unwrap(),
            s.step(1, &started.step).unwrap(),
        );
        let due = s.deadlines(1).unwrap();
        // RocksDB holds the record as the changelog had it.
        let raw = s.get_raw(Cf::Steps, &log[0].0[1..]).unwrap().unwrap();
        assert_eq!(raw, log[0].1.as_deref().unwrap());
        (steps, due, dir)
    };
    let (named_steps, named_due, _a) = restore(&log);
    let (compact_steps, compact_due, _b) = restore(&compacted);
    assert_eq!(named_steps, (Some(r.clone()), Some(started.clone())));
    assert_eq!(compact_steps, named_steps);
    assert_eq!(compact_due, named_due);
    assert!(
        !named_due.is_empty(),
        "the started step's deadline is indexed"
    );
    // What readers of the changelog (steps show, the console) decode.
    let (p, step, decoded) = changelog_step(&compacted[0].0, compacted[0].1.as_deref()).unwrap();
    assert_eq!((p, step), (1, r.step.clone()));
    assert_eq!(decoded.as_ref(), Some(&r));
}

/// A partition restored by a bulk load (sorted files, ingested) holds what
/// one restored through the memtables does — records, workflow ends and
/// indexes — with no superseded expiry entry, and its neighbours are
/// untouched; spilled runs and a range that held stale data included.
#[test]
fn a_bulk_load_restores_what_the_memtables_do() {
    let phases = [
        Phase::Started,
        Phase::Completed,
        Phase::InDoubt,
        Phase::AwaitingApproval,
    ];
    // The log a gate wrote for partition 3: steps changing phase and expiry,
    // some deleted, a workflow ended.
    let src_dir = tempfile::tempdir().unwrap();
    let src = StateStore::open(src_dir.path()).unwrap();
    let mut log = Vec::new();
    let mut x: u64 = 11;
    for n in 0..60 {
        let mut b = Batch::default();
        for _ in 0..50 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let (i, roll) = ((x >> 33) % 300, (x >> 20) % 10);
            if roll == 0 {
                b.delete_step(&src, 3, &step(i)).unwrap();
            } else {
                let r = StepRecord {
                    deadline_ms: (roll % 3 != 0).then_some(1000 + roll as i64),
                    ..record(i, phases[(roll % 4) as usize], 10_000 + (x % 7) as i64)
                };
                b.put_step(&src, 3, &r).unwrap();
            }
        }
        if n == 30 {
            b.put_workflow_end(
                3,
                &WorkflowEnd {
                    step: step(7),
                    at_ms: 5,
                },
            );
        }
        log.extend(b.changelog());
        src.apply(&b, &at(3, n + 1)).unwrap();
    }
    let records: Vec<_> = log.into_iter().map(|e| (e.key, e.value)).collect();

    // Two disks with stale data in partition 3 and live data beside it.
    let disk = || {
        let dir = tempfile::tempdir().unwrap();
        let s = StateStore::open(dir.path()).unwrap();
        let mut b = Batch::default();
        for p in [2, 3, 4] {
            b.put_step(&s, p, &record(1000 + p as u64, Phase::InDoubt, 1))
                .unwrap();
        }
        s.apply(&b, &landing(0, 0, &[(2, 0), (3, 0), (4, 0)]))
            .unwrap();
        s.wipe_partition(3).unwrap();
        (dir, s)
    };
    let (_a_dir, memtables) = disk();
    memtables.apply_changelog(&records).unwrap();
    let (_b_dir, bulk) = disk();
    let mut staged = Staged::default();
    staged.wiped(3);
    staged.bulk = Some(bulk.bulk_load(3));
    for (i, (k, v)) in records.iter().enumerate() {
        bulk.stage(&mut staged, k, v.as_deref()).unwrap();
        if i % 700 == 699 {
            staged.bulk.as_mut().unwrap().spill().unwrap();
        }
    }
    bulk.write_staged(&mut staged, false).unwrap();
    bulk.ingest(staged.bulk.take().unwrap()).unwrap();

    assert_eq!(
        bulk.logged_records(3).unwrap(),
        memtables.logged_records(3).unwrap()
    );
    assert_eq!(
        bulk.logged_records(3).unwrap(),
        src.logged_records(3).unwrap()
    );
    assert!(
        Batch::default()
            .workflow_end(&bulk, 3, "wf")
            .unwrap()
            .is_some(),
        "workflow ends are restored"
    );
    assert_eq!(bulk.deadlines(3).unwrap(), memtables.deadlines(3).unwrap());
    assert!(!bulk.deadlines(3).unwrap().is_empty());
    assert_eq!(
        bulk.open_steps(3).unwrap(),
        memtables.open_steps(3).unwrap()
    );
    assert_eq!(bulk.open_steps(3).unwrap(), src.open_steps(3).unwrap());
    let live = |s: &StateStore| live_expiry(s, 3);
    assert_eq!(live(&bulk), live(&memtables));
    assert_eq!(
        bulk.expired(3, i64::MAX, usize::MAX).unwrap(),
        live(&bulk),
        "one expiry entry per step, its current one"
    );
    for p in [2, 4] {
        assert_eq!(
            bulk.logged_records(p).unwrap(),
            memtables.logged_records(p).unwrap()
        );
        assert_eq!(bulk.open_steps(p).unwrap().in_doubt, 1);
    }
    assert_eq!(
        std::fs::read_dir(_b_dir.path().join("bulk"))
            .unwrap()
            .count(),
        0,
        "the ingested files moved, the runs are gone"
    );
}
