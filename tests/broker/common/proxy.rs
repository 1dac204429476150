//! A TCP proxy in front of the broker's proxied listener (`deploy/local/
//! kafka.sh`: it advertises the proxy's port, so a client bootstrapped here
//! sends every request through it), able to hold back one request to end a
//! transaction and let it through later — the late copy librdkafka's
//! transaction protocol v1 leaves on its way when an `EndTxn` times out.

use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// One proxy at a time: its port is fixed by the broker's config.
pub static PROXY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Kafka's API key of `EndTxn`.
const END_TXN: i16 = 26;

/// The proxy's ports for the broker of `brokers` (`host:port`): it listens on
/// port + 4 and forwards to port + 3.
pub fn ports(brokers: &str) -> (u16, u16) {
    let port: u16 = brokers
        .split(',')
        .next()
        .and_then(|b| b.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .expect("KAFKA_BROKERS names a port");
    (port + 4, port + 3)
}

/// A held `EndTxn(commit)`: its bytes, the broker connection it came on, and
/// where the broker's answer to it is reported.
struct Held {
    frame: Vec<u8>,
    upstream: OwnedWriteHalf,
    answer: oneshot::Receiver<i16>,
}

#[derive(Default)]
struct Shared {
    armed: bool,
    held: Option<Held>,
}

pub struct KafkaProxy {
    pub brokers: String,
    shared: Arc<Mutex<Shared>>,
}

impl KafkaProxy {
    /// Listen on `127.0.0.1:listen`, forwarding every connection to
    /// `127.0.0.1:upstream`.
    pub async fn start(listen: u16, upstream: u16) -> KafkaProxy {
        let listener = TcpListener::bind(("127.0.0.1", listen))
            .await
            .unwrap_or_else(|e| panic!("the proxy's port {listen}: {e}"));
        assert!(
            TcpStream::connect(("127.0.0.1", upstream)).await.is_ok(),
            "the broker has no proxied listener on {upstream}: restart it with this kafka.sh (`deploy/local/kafka.sh stop && deploy/local/kafka.sh start`)"
        );
        let shared = Arc::new(Mutex::new(Shared::default()));
        let s = shared.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(broker) = TcpStream::connect(("127.0.0.1", upstream)).await else {
                    continue;
                };
                tokio::spawn(connection(client, broker, s.clone()));
            }
        });
        KafkaProxy {
            brokers: format!("127.0.0.1:{listen}"),
            shared,
        }
    }

    /// Hold back the next `EndTxn(commit)` request, and everything after it
    /// on its connection.
    pub fn hold_next_commit(&self) {
        self.shared.lock().unwrap().armed = true;
    }

    /// Whether a request is held.
    pub fn holding(&self) -> bool {
        self.shared.lock().unwrap().held.is_some()
    }

    /// Let the held request through, on the broker connection it came on, and
    /// return the error code of the broker's answer to it.
    pub async fn release(&self) -> i16 {
        let Held {
            frame,
            mut upstream,
            answer,
        } = self
            .shared
            .lock()
            .unwrap()
            .held
            .take()
            .expect("a request is held");
        upstream.write_all(&frame).await.expect("written late");
        tokio::time::timeout(std::time::Duration::from_secs(30), answer)
            .await
            .expect("the broker answers the late request")
            .expect("its answer is read")
    }
}

/// Read one length-prefixed Kafka frame (with its length).
async fn frame(r: &mut (impl AsyncReadExt + Unpin)) -> Option<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await.ok()?;
    let n = i32::from_be_bytes(len) as usize;
    let mut f = Vec::with_capacity(4 + n);
    f.extend_from_slice(&len);
    f.resize(4 + n, 0);
    r.read_exact(&mut f[4..]).await.ok()?;
    Some(f)
}

async fn connection(client: TcpStream, broker: TcpStream, shared: Arc<Mutex<Shared>>) {
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_broker, mut to_broker) = broker.into_split();
    // The correlation id of a held request, and where its answer goes.
    let (watch_tx, watch_rx) = oneshot::channel::<(i32, oneshot::Sender<i16>)>();
    // Broker to client: everything, and on past the client's close, to read
    // the answer to a held request.
    tokio::spawn(async move {
        let mut watch_rx = Some(watch_rx);
        let mut watching: Option<(i32, oneshot::Sender<i16>)> = None;
        let mut client_open = true;
        while let Some(f) = frame(&mut from_broker).await {
            if let Some(rx) = watch_rx.as_mut()
                && let Ok(w) = rx.try_recv()
            {
                watching = Some(w);
                watch_rx = None;
            }
            // Response header v0: the correlation id; EndTxn v0/v1's body:
            // throttle_time_ms, then error_code.
            let corr = i32::from_be_bytes(f[4..8].try_into().unwrap());
            if watching.as_ref().is_some_and(|(c, _)| *c == corr) && f.len() >= 14 {
                let code = i16::from_be_bytes(f[12..14].try_into().unwrap());
                let (_, tx) = watching.take().unwrap();
                let _ = tx.send(code);
                return;
            }
            if client_open && to_client.write_all(&f).await.is_err() {
                client_open = false;
            }
        }
    });
    // Client to broker: everything, until a request is held.
    while let Some(f) = frame(&mut from_client).await {
        // Request header: api_key, api_version, correlation_id, client_id;
        // EndTxn v0/v1's body ends with `committed` (a boolean).
        let api_key = i16::from_be_bytes(f[4..6].try_into().unwrap());
        let version = i16::from_be_bytes(f[6..8].try_into().unwrap());
        let corr = i32::from_be_bytes(f[8..12].try_into().unwrap());
        let hold = {
            let mut s = shared.lock().unwrap();
            let hold = s.armed && api_key == END_TXN && version <= 1 && f.last() == Some(&1);
            if hold {
                s.armed = false;
            }
            hold
        };
        if hold {
            let (tx, rx) = oneshot::channel();
            let _ = watch_tx.send((corr, tx));
            shared.lock().unwrap().held = Some(Held {
                frame: f,
                upstream: to_broker,
                answer: rx,
            });
            // The client times out, closes this connection and sends the
            // request again on a new one.
            return;
        }
        if to_broker.write_all(&f).await.is_err() {
            return;
        }
    }
}
