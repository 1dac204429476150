//! What is written again of commits a broker lost, without Kafka.
use super::*;

const CHANGELOG: &str = "changelog";
const DLQ: &str = "dlq";

fn record(topic: &str, key: &str, value: &str) -> OutRecord {
    OutRecord {
        topic: topic.to_owned(),
        partition: None,
        key: Some(key.as_bytes().to_vec()),
        payload: Some(value.as_bytes().to_vec()),
        headers: Vec::new(),
        timestamp_ms: None,
    }
}

fn commit(records: Vec<(OutRecord, i32, i64)>, offsets: Vec<(&str, i32, i64)>) -> Committed {
    let landed = records.iter().map(|(_, p, o)| (*p, *o)).collect();
    Committed {
        records: Arc::new(records.into_iter().map(|(r, _, _)| r).collect()),
        landed,
        offsets: offsets
            .into_iter()
            .map(|(t, p, o)| InputOffset {
                topic: t.to_owned(),
                partition: p,
                offset: o,
                metadata: Some(format!("m{o}")),
            })
            .collect(),
        at: Instant::now(),
    }
}

/// What a reader sees, every partition read to its end with no transaction
/// open (the last stable offset past every record).
fn seen(records: &[(&str, i32, &[i64])], offsets: &[(&str, i32, i64)]) -> Seen {
    Seen {
        records: records
            .iter()
            .map(|(t, p, os)| (((*t).to_owned(), *p), os.iter().copied().collect()))
            .collect(),
        stable: records
            .iter()
            .map(|(t, p, _)| (((*t).to_owned(), *p), i64::MAX))
            .collect(),
        offsets: offsets
            .iter()
            .map(|(t, p, o)| (((*t).to_owned(), *p), Position::of(*o, None)))
            .collect(),
    }
}

fn owned(ps: &[i32]) -> BTreeSet<i32> {
    ps.iter().copied().collect()
}

fn values(r: &Rewrite) -> Vec<(String, Option<i32>, String)> {
    r.records
        .iter()
        .map(|r| {
            (
                r.topic.clone(),
                r.partition,
                String::from_utf8(r.payload.clone().unwrap()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn nothing_is_written_again_when_every_record_and_offset_is_there() {
    let c = [commit(
        vec![
            (record("results", "wf", "answer"), 0, 10),
            (record(CHANGELOG, "step", "answered"), 0, 20),
        ],
        vec![("intents", 0, 5)],
    )];
    let s = seen(
        &[("results", 0, &[10]), (CHANGELOG, 0, &[20])],
        &[("intents", 0, 5)],
    );
    let r = plan(&c, &s, &owned(&[0]), CHANGELOG);
    assert!(r.is_empty(), "{r:?}");
    assert!(r.overtaken.is_empty());
}

#[test]
fn the_records_and_offsets_a_reader_does_not_see_are_written_again_in_their_partitions() {
    let c = [commit(
        vec![
            (record("results", "wf", "answer"), 1, 10),
            (record(CHANGELOG, "step", "answered"), 1, 20),
            (record(DLQ, "bad", "dead letter"), 2, 7),
        ],
        vec![("intents", 1, 5), ("progress", 1, 3)],
    )];
    // The results marker was lost, the changelog's was not; the offsets of
    // intents were lost, those of progress were not.
    let s = seen(
        &[("results", 1, &[]), (CHANGELOG, 1, &[20]), (DLQ, 2, &[])],
        &[("intents", 1, 2), ("progress", 1, 3)],
    );
    let r = plan(&c, &s, &owned(&[1]), CHANGELOG);
    assert_eq!(
        values(&r),
        [
            ("results".to_owned(), Some(1), "answer".to_owned()),
            (DLQ.to_owned(), Some(2), "dead letter".to_owned()),
        ]
    );
    assert_eq!(r.offsets.len(), 1);
    assert_eq!(
        (r.offsets[0].topic.as_str(), r.offsets[0].offset),
        ("intents", 5)
    );
    assert_eq!(
        r.offsets[0].metadata.as_deref(),
        Some("m5"),
        "the applied tag goes with it"
    );
}

#[test]
fn a_partition_written_to_since_is_left_alone() {
    let c = [commit(
        vec![(record(CHANGELOG, "step", "started"), 0, 20)],
        vec![],
    )];
    let s = seen(&[(CHANGELOG, 0, &[23])], &[]);
    let r = plan(&c, &s, &owned(&[0]), CHANGELOG);
    assert!(r.records.is_empty(), "{r:?}");
    assert_eq!(
        r.overtaken.iter().collect::<Vec<_>>(),
        [&(CHANGELOG.to_owned(), 0)]
    );
}

#[test]
fn the_later_of_the_two_commits_is_not_taken_for_a_stranger() {
    // The first commit's records were lost, the second's landed after them.
    let c = [
        commit(
            vec![
                (record(CHANGELOG, "a", "started"), 0, 20),
                (record(CHANGELOG, "b", "started"), 0, 21),
            ],
            vec![],
        ),
        commit(vec![(record(CHANGELOG, "a", "answered"), 0, 25)], vec![]),
    ];
    let s = seen(&[(CHANGELOG, 0, &[25])], &[]);
    let r = plan(&c, &s, &owned(&[0]), CHANGELOG);
    assert!(r.overtaken.is_empty());
    // `a`'s later record is there and replaces the lost one: only `b`'s.
    assert_eq!(
        values(&r),
        [(CHANGELOG.to_owned(), Some(0), "started".to_owned())]
    );
}

#[test]
fn two_lost_commits_are_written_again_in_their_order() {
    let c = [
        commit(
            vec![(record("results", "wf", "first"), 0, 10)],
            vec![("intents", 0, 4)],
        ),
        commit(
            vec![(record("results", "wf", "second"), 0, 12)],
            vec![("intents", 0, 6)],
        ),
    ];
    let s = seen(&[("results", 0, &[])], &[("intents", 0, 2)]);
    let r = plan(&c, &s, &owned(&[0]), CHANGELOG);
    assert_eq!(
        values(&r)
            .into_iter()
            .map(|(_, _, v)| v)
            .collect::<Vec<_>>(),
        ["first", "second"]
    );
    assert_eq!(r.offsets.len(), 1, "{:?}", r.offsets);
    assert_eq!(r.offsets[0].offset, 6, "the later commit's offset");
}

#[test]
fn a_record_past_another_producers_open_transaction_is_not_known_yet_not_lost() {
    // Ours at 10 and 12 in `results`; another gate's transaction is open at
    // 11, so a read_committed reader stops at the last stable offset, 11, and
    // never sees 12: late, not lost. In the changelog, 20 was truly lost
    // (aborted), below its partition's last stable offset.
    let c = [
        commit(
            vec![
                (record("results", "wf", "first"), 0, 10),
                (record(CHANGELOG, "a", "started"), 0, 20),
            ],
            vec![("intents", 0, 4)],
        ),
        commit(
            vec![(record("results", "wf", "second"), 0, 12)],
            vec![("intents", 0, 6)],
        ),
    ];
    let mut s = seen(
        &[("results", 0, &[10]), (CHANGELOG, 0, &[])],
        &[("intents", 0, 6)],
    );
    s.stable.insert(("results".to_owned(), 0), 11);
    s.stable.insert((CHANGELOG.to_owned(), 0), 25);
    let r = plan(&c, &s, &owned(&[0]), CHANGELOG);
    assert_eq!(
        r.unknown.iter().collect::<Vec<_>>(),
        [&("results".to_owned(), 0)],
        "the read of `results` is inconclusive"
    );
    assert!(
        !values(&r).iter().any(|(t, _, _)| t == "results"),
        "a record past the last stable offset is never written again: {r:?}"
    );
    assert!(r.overtaken.is_empty(), "{r:?}");
    // The changelog record below its last stable offset is lost, but while
    // any partition is inconclusive `mend` writes nothing (retried, then
    // given up, as on a timeout).
    assert_eq!(
        values(&r),
        [(CHANGELOG.to_owned(), Some(0), "started".to_owned())]
    );
    // A partition whose last stable offset is not known tells nothing either.
    s.stable.remove(&(CHANGELOG.to_owned(), 0));
    let r = plan(&c, &s, &owned(&[0]), CHANGELOG);
    assert_eq!(r.unknown.len(), 2, "{r:?}");
    assert!(r.records.is_empty(), "{r:?}");
}

#[test]
fn partitions_now_owned_elsewhere_are_not_touched() {
    let c = [commit(
        vec![(record("results", "wf", "answer"), 3, 10)],
        vec![("intents", 3, 5)],
    )];
    let owned = owned(&[0]);
    assert!(starts(&c, &owned, DLQ).is_empty());
    let s = seen(&[], &[]);
    let r = plan(&c, &s, &owned, CHANGELOG);
    assert!(r.is_empty(), "{r:?}");
}

/// A batch whose intents all wait on a call still running commits the same
/// offset with a later applied mark: the group holding that offset with an
/// earlier mark has lost the commit.
#[test]
fn an_offset_whose_applied_mark_moved_alone_is_written_again() {
    let applied = |o: i64, a: i64| InputOffset {
        topic: "intents".to_owned(),
        partition: 0,
        offset: o,
        metadata: Some(crate::gate::mark::AppliedMark::encode(a, Some(4))),
    };
    let lost = Committed {
        records: Arc::new(Vec::new()),
        landed: Vec::new(),
        offsets: vec![applied(5, 9)],
        at: Instant::now(),
    };
    let group_at = |o: i64, meta: &str| Seen {
        records: BTreeMap::new(),
        stable: BTreeMap::new(),
        offsets: [(("intents".to_owned(), 0), Position::of(o, Some(meta)))].into(),
    };
    let mark = |a: i64| crate::gate::mark::AppliedMark::encode(a, Some(4));
    let r = plan(
        std::slice::from_ref(&lost),
        &group_at(5, &mark(7)),
        &owned(&[0]),
        CHANGELOG,
    );
    assert_eq!(r.offsets, [applied(5, 9)], "the mark goes with it");
    for (o, meta) in [
        (5, mark(9)),
        (5, mark(11)),
        (6, mark(6)),
        (6, String::new()),
    ] {
        let r = plan(
            std::slice::from_ref(&lost),
            &group_at(o, &meta),
            &owned(&[0]),
            CHANGELOG,
        );
        assert!(r.is_empty(), "the group at {o} {meta:?}: {r:?}");
    }
    // Metadata another tool wrote (no mark): the offset alone counts.
    let r = plan(
        std::slice::from_ref(&lost),
        &group_at(5, "by hand"),
        &owned(&[0]),
        CHANGELOG,
    );
    assert_eq!(r.offsets.len(), 1);
}

/// The first input offset of each commit taken.
fn taken_offsets(last: &mut LastCommits, max_age: Duration) -> Vec<i64> {
    last.take(max_age)
        .iter()
        .map(|c| c.offsets[0].offset)
        .collect()
}

#[test]
fn the_last_commits_are_taken_oldest_first_and_put_back() {
    let minute = Duration::from_secs(60);
    let mut last = LastCommits::default();
    last.record(1, commit(vec![], vec![("intents", 0, 1)]));
    last.record(0, commit(vec![], vec![("intents", 0, 2)]));
    let taken = last.take(minute);
    assert_eq!(taken.len(), 2);
    assert!(last.take(minute).is_empty());
    last.put_back(taken);
    assert_eq!(taken_offsets(&mut last, minute), [1, 2]);
}

#[test]
fn commits_older_than_the_age_limit_are_not_checked() {
    let mut last = LastCommits::default();
    let mut old = commit(vec![], vec![("intents", 0, 1)]);
    old.at = Instant::now() - Duration::from_secs(120);
    last.record(0, old);
    last.record(1, commit(vec![], vec![("intents", 0, 2)]));
    assert_eq!(taken_offsets(&mut last, Duration::from_secs(60)), [2]);
}
