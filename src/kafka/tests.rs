use super::*;
use crate::config::KafkaConfig;
use rdkafka::ClientConfig;
use rdkafka::consumer::BaseConsumer;
use rdkafka::consumer::Consumer;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::{BaseProducer, Producer};
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// Production Kafkas ask for logins this build must speak: Kerberos
/// (GSSAPI) and OAUTHBEARER with OIDC token fetching. librdkafka refuses
/// to create a client configured for a mechanism it was built without.
#[test]
fn the_built_in_librdkafka_speaks_gssapi_and_oidc() {
    let gssapi: Result<BaseProducer, _> = ClientConfig::new()
        .set("bootstrap.servers", "127.0.0.1:1")
        .set("security.protocol", "SASL_PLAINTEXT")
        .set("sasl.mechanism", "GSSAPI")
        // No Kerberos ticket is fetched in a test.
        .set("sasl.kerberos.kinit.cmd", "true")
        .create();
    assert!(gssapi.is_ok(), "GSSAPI: {:?}", gssapi.err());
    let oidc: Result<BaseProducer, _> = ClientConfig::new()
        .set("bootstrap.servers", "127.0.0.1:1")
        .set("security.protocol", "SASL_SSL")
        .set("sasl.mechanism", "OAUTHBEARER")
        .set("sasl.oauthbearer.method", "oidc")
        .set("sasl.oauthbearer.client.id", "stepgate")
        .set("sasl.oauthbearer.client.secret", "s")
        .set(
            "sasl.oauthbearer.token.endpoint.url",
            "https://127.0.0.1:1/token",
        )
        .create();
    assert!(oidc.is_ok(), "OIDC: {:?}", oidc.err());
}

/// A client whose close never finishes (as a consumer whose group will not
/// let it go) holds the session at most `limit`: it is dropped on a
/// blocking thread and left there.
#[tokio::test(flavor = "current_thread")]
async fn a_client_that_never_closes_holds_the_caller_at_most_the_limit() {
    struct NeverCloses(std::sync::mpsc::Receiver<()>);
    impl Drop for NeverCloses {
        fn drop(&mut self) {
            let _ = self.0.recv();
        }
    }
    let (release, stuck) = std::sync::mpsc::channel();
    let started = std::time::Instant::now();
    close_within("stuck", NeverCloses(stuck), Duration::from_millis(200)).await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    drop(release);
}

/// A client left closing does not keep the runtime, and so the process, from
/// ending: a stopped gate whose consumer never closed once ran until killed.
#[test]
fn a_client_left_closing_does_not_hold_the_runtime_at_its_end() {
    struct NeverCloses(std::sync::mpsc::Receiver<()>);
    impl Drop for NeverCloses {
        fn drop(&mut self) {
            let _ = self.0.recv();
        }
    }
    let (release, stuck) = std::sync::mpsc::channel();
    let (ended, end) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(close_within(
            "stuck",
            NeverCloses(stuck),
            Duration::from_millis(100),
        ));
        drop(rt);
        let _ = ended.send(());
    });
    let dropped = end.recv_timeout(Duration::from_secs(30));
    drop(release);
    assert!(dropped.is_ok(), "the runtime waited for the client's close");
}

/// Produce one record with raw header names through librdkafka's C API:
/// rdkafka's own `OwnedHeaders` only takes `&str` names.
fn produce_raw(
    producer: &BaseProducer,
    topic: &std::ffi::CStr,
    headers: &[(&[u8], &[u8])],
    value: &[u8],
) {
    use rd::rd_kafka_vtype_t as V;
    use rdkafka::bindings as rd;
    // Names NUL-terminated, for librdkafka's `strlen`.
    let names: Vec<Vec<u8>> = headers
        .iter()
        .map(|(n, _)| n.iter().copied().chain([0]).collect())
        .collect();
    // SAFETY: plain-old-data unions, every field written before use.
    let mut vus: Vec<rd::rd_kafka_vu_t> = Vec::new();
    let mut vu =
        |vtype: V, u: rd::rd_kafka_vu_s__bindgen_ty_1| vus.push(rd::rd_kafka_vu_t { vtype, u });
    vu(
        V::RD_KAFKA_VTYPE_TOPIC,
        rd::rd_kafka_vu_s__bindgen_ty_1 {
            cstr: topic.as_ptr(),
        },
    );
    vu(
        V::RD_KAFKA_VTYPE_PARTITION,
        rd::rd_kafka_vu_s__bindgen_ty_1 { i32_: 0 },
    );
    vu(
        V::RD_KAFKA_VTYPE_VALUE,
        rd::rd_kafka_vu_s__bindgen_ty_1 {
            mem: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_1 {
                ptr: value.as_ptr() as *mut c_void,
                size: value.len(),
            },
        },
    );
    // RD_KAFKA_MSG_F_COPY: librdkafka copies the value.
    vu(
        V::RD_KAFKA_VTYPE_MSGFLAGS,
        rd::rd_kafka_vu_s__bindgen_ty_1 { i: 0x2 },
    );
    for (name, (_, v)) in names.iter().zip(headers) {
        vu(
            V::RD_KAFKA_VTYPE_HEADER,
            rd::rd_kafka_vu_s__bindgen_ty_1 {
                header: rd::rd_kafka_vu_s__bindgen_ty_1__bindgen_ty_2 {
                    name: name.as_ptr().cast(),
                    val: v.as_ptr().cast(),
                    size: v.len() as isize,
                },
            },
        );
    }
    // SAFETY: every pointer in `vus` outlives the call (librdkafka copies).
    let err =
        unsafe { rd::rd_kafka_produceva(producer.client().native_ptr(), vus.as_ptr(), vus.len()) };
    assert!(err.is_null(), "rd_kafka_produceva failed");
    producer.flush(Duration::from_secs(10)).unwrap();
}

const TRACEPARENT: &[u8] = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

#[test]
fn an_invalid_traceparent_is_ignored_where_it_enters() {
    let input = |tp: &[u8]| Input {
        topic: "in".into(),
        partition: 0,
        offset: 0,
        key: None,
        payload: None,
        headers: vec![("Traceparent".to_owned(), Some(tp.to_vec()))],
        timestamp_ms: None,
    };
    assert_eq!(
        input(TRACEPARENT)
            .traceparent()
            .as_deref()
            .map(str::as_bytes),
        Some(TRACEPARENT)
    );
    for bad in [
        b"00-abc-01".as_slice(),
        b"",
        b"\xff\xfe",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\n",
        b"00-00000000000000000000000000000000-b7ad6b7169203331-01",
    ] {
        assert_eq!(
            input(bad).traceparent(),
            None,
            "{:?}",
            String::from_utf8_lossy(bad)
        );
    }
}

#[test]
fn a_header_name_that_is_not_utf8_is_read_without_panicking() {
    let mock = MockCluster::new(1).unwrap();
    mock.create_topic("in", 1, 1).unwrap();
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", mock.bootstrap_servers())
        .create()
        .unwrap();
    produce_raw(
        &producer,
        c"in",
        &[(b"\xff\xfe", b"x"), (b"traceparent", TRACEPARENT)],
        br#"{"workflow_id":"w"}"#,
    );
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", mock.bootstrap_servers())
        .set("group.id", "g")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset("in", 0, rdkafka::Offset::Beginning)
        .unwrap();
    consumer.assign(&tpl).unwrap();
    drop(tpl);
    let deadline = Instant::now() + Duration::from_secs(20);
    let input = loop {
        assert!(Instant::now() < deadline, "no record within 20 s");
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => break to_input(&m),
            Some(Err(e)) => panic!("{e}"),
            None => {}
        }
    };
    assert_eq!(
        input.headers,
        vec![
            ("\u{fffd}\u{fffd}".to_owned(), Some(b"x".to_vec())),
            ("traceparent".to_owned(), Some(TRACEPARENT.to_vec())),
        ]
    );
    assert_eq!(
        input.traceparent().as_deref().map(str::as_bytes),
        Some(TRACEPARENT)
    );
    assert_eq!(
        input.payload.as_deref(),
        Some(br#"{"workflow_id":"w"}"#.as_slice())
    );
}

#[test]
fn producers_set_message_max_bytes_and_sizes_are_checked() {
    let mut cfg = KafkaConfig::default();
    let p = txn_producer_config(&cfg, "t");
    assert_eq!(
        p.get("message.max.bytes"),
        Some(MESSAGE_MAX_BYTES.to_string().as_str())
    );
    check_sizes(&cfg, 1024 * 1024).unwrap();
    check_sizes(&cfg, MESSAGE_MAX_BYTES - RECORD_ENVELOPE_BYTES).unwrap();
    let e = check_sizes(&cfg, MESSAGE_MAX_BYTES)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`gate.max_intent_bytes` is 4194304"), "{e}");
    assert!(
        e.contains("Lower `gate.max_intent_bytes` to at most 4128768"),
        "{e}"
    );
    // An operator's override is what counts.
    cfg.client
        .insert("message.max.bytes".into(), "1000000".into());
    assert_eq!(
        txn_producer_config(&cfg, "t").get("message.max.bytes"),
        Some("1000000")
    );
    assert!(check_sizes(&cfg, 1024 * 1024).is_err());
    cfg.client.insert("message.max.bytes".into(), "lots".into());
    let e = check_sizes(&cfg, 1).unwrap_err().to_string();
    assert!(e.contains("must be a number of bytes, got `lots`"), "{e}");
}

#[test]
fn the_default_largest_intent_fits() {
    assert!(
        crate::config::GateConfig::default().max_intent_bytes + RECORD_ENVELOPE_BYTES
            <= MESSAGE_MAX_BYTES
    );
}

/// librdkafka times out a request to the transaction coordinator, and sends
/// it again, after `socket.timeout.ms`: by default 100 ms under the
/// transaction timeout (at least 900 ms), or what `[kafka.client]` sets.
#[test]
fn the_end_request_timeout_is_librdkafkas() {
    let mut k = KafkaConfig {
        transaction_timeout: crate::duration::Dur(Duration::from_secs(30)),
        ..KafkaConfig::default()
    };
    let l = TxnLimits::of(&k);
    assert_eq!(l.end_request, Duration::from_millis(29_900));
    assert_eq!(l.send, send_limit(Duration::from_secs(30)));
    k.client.insert("socket.timeout.ms".into(), "5000".into());
    assert_eq!(TxnLimits::of(&k).end_request, Duration::from_secs(5));
    k.client.insert("socket.timeout.ms".into(), "soon".into());
    assert_eq!(TxnLimits::of(&k).end_request, Duration::ZERO);
}

/// A transaction's end that was retried, or took as long as one request may
/// before librdkafka sends it again, may have a late copy on its way: its
/// producer is replaced. A prompt one is not.
#[test]
fn an_end_that_may_have_been_sent_twice_renews_the_producer() {
    let l = TxnLimits {
        send: Duration::from_secs(40),
        end_request: Duration::from_millis(29_900),
    };
    assert!(!stale_end_possible(false, Duration::from_millis(3), l));
    assert!(!stale_end_possible(false, Duration::from_millis(29_899), l));
    assert!(stale_end_possible(false, Duration::from_millis(29_900), l));
    assert!(stale_end_possible(true, Duration::from_millis(3), l));
}
