//! The gates' hold on each partition and its restore, read from their
//! `/metrics` (`console.gates`): the console cannot see a gate's RocksDB, but
//! each gate exports per partition whether it owns it, whether its state is
//! restored, its restore's records and duration, and whether it keeps a
//! standby copy and how far behind (the `stepgate_partition_*` gauges). Scraped every few seconds into the cache;
//! nothing else is kept.

use super::Shared;
use prometheus_parse::{Scrape, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use thiserror::Error;
use tokio_util::sync::CancellationToken;

/// How often every gate is scraped (the lag's cadence).
const EVERY: Duration = Duration::from_secs(3);
/// How long one scrape may take: a gate slower than this counts as unreachable.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Error)]
pub enum ScrapeError {
    #[error(transparent)]
    Http(#[from] reqwest::Error),
    #[error("HTTP {0}")]
    Status(u16),
    #[error("reading the metrics")]
    Parse(#[from] std::io::Error),
    #[error("no stepgate metrics there (is it a gate's `http.listen`?)")]
    NotAGate,
}

/// What one gate says of one partition.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GatePartition {
    pub owned: bool,
    pub ready: bool,
    /// When it became ready (Unix milliseconds).
    pub ready_since_ms: Option<i64>,
    /// Records applied by its current restore so far, or by its last one.
    pub restore_records: u64,
    /// How long its current restore has run, or its last one took.
    pub restore_took: Duration,
    /// It keeps a standby copy of the partition (`gate.standby_replicas`).
    pub standby: bool,
    /// How far that copy is behind the changelog's end (records).
    pub standby_lag: u64,
}

/// A gate's last scrape.
#[derive(Debug, Clone)]
pub enum GateScrape {
    Reached(BTreeMap<i32, GatePartition>),
    /// Why not (already redacted of the URL's credentials).
    Unreachable(String),
}

/// One configured gate, as last scraped.
#[derive(Debug, Clone)]
pub struct GateView {
    /// Its base URL as the page shows it (credentials redacted).
    pub name: String,
    /// `None` until its first scrape ended.
    pub scrape: Option<GateScrape>,
}

/// Where a partition's state is, across the listed gates.
#[derive(Debug, Clone, PartialEq)]
pub enum RestoreState {
    Ready {
        since_ms: Option<i64>,
    },
    Restoring {
        records: u64,
        took: Duration,
    },
    /// Every listed gate answered, and none owns it.
    NotOwned,
    /// No reachable gate owns it, and these listed gates did not answer: it
    /// may be one of theirs.
    Unknown {
        unreachable: Vec<String>,
    },
    /// Some gate has not been scraped yet.
    Pending,
}

/// One partition's row: who owns it, its state, its restore's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct PartitionRestore {
    pub partition: i32,
    /// The gates claiming it: one, or two while the scrapes straddle a
    /// rebalance (the old owner not yet told, the new one restoring).
    pub owners: Vec<String>,
    pub state: RestoreState,
    /// The last restore's records and duration (once ready).
    pub last_restore: Option<(u64, Duration)>,
    /// The gates keeping a standby copy of it, each with its lag (records).
    pub standbys: Vec<(String, u64)>,
}

/// The `stepgate_partition_*` gauges of a gate's `/metrics` text, by partition.
pub fn parse(text: &str) -> Result<BTreeMap<i32, GatePartition>, ScrapeError> {
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned())))?;
    if !scrape
        .samples
        .iter()
        .any(|s| s.metric == "stepgate_build_info")
    {
        return Err(ScrapeError::NotAGate);
    }
    let mut out: BTreeMap<i32, GatePartition> = BTreeMap::new();
    for s in &scrape.samples {
        let Some(p) = s.labels.get("partition").and_then(|p| p.parse().ok()) else {
            continue;
        };
        let v = match s.value {
            Value::Gauge(v) | Value::Untyped(v) | Value::Counter(v) => v,
            _ => continue,
        };
        // Gauges are finite and not negative when a gate writes them.
        let v = if v.is_finite() { v.max(0.0) } else { 0.0 };
        let set: fn(&mut GatePartition, f64) = match s.metric.as_str() {
            "stepgate_partition_owned" => |e, v| e.owned = v >= 1.0,
            "stepgate_partition_ready" => |e, v| e.ready = v >= 1.0,
            "stepgate_partition_ready_timestamp_seconds" => {
                |e, v| e.ready_since_ms = (v > 0.0).then_some((v * 1000.0) as i64)
            }
            "stepgate_partition_restore_records" => |e, v| e.restore_records = v as u64,
            "stepgate_partition_restore_seconds" => {
                |e, v| e.restore_took = Duration::from_secs_f64(v)
            }
            "stepgate_partition_standby" => |e, v| e.standby = v >= 1.0,
            "stepgate_partition_standby_lag_records" => |e, v| e.standby_lag = v as u64,
            _ => continue,
        };
        set(out.entry(p).or_default(), v);
    }
    Ok(out)
}

/// Each partition's row, for `partitions` and any partition a gate names.
pub fn derive(partitions: &[i32], gates: &[GateView]) -> Vec<PartitionRestore> {
    let mut all: BTreeSet<i32> = partitions.iter().copied().collect();
    for g in gates {
        if let Some(GateScrape::Reached(ps)) = &g.scrape {
            all.extend(ps.iter().filter(|(_, s)| s.owned).map(|(p, _)| *p));
        }
    }
    let pending = gates.iter().any(|g| g.scrape.is_none());
    let unreachable: Vec<String> = gates
        .iter()
        .filter(|g| matches!(g.scrape, Some(GateScrape::Unreachable(_))))
        .map(|g| g.name.clone())
        .collect();
    all.into_iter()
        .map(|p| {
            let claims: Vec<(&str, &GatePartition)> = gates
                .iter()
                .filter_map(|g| match &g.scrape {
                    Some(GateScrape::Reached(ps)) => {
                        ps.get(&p).filter(|s| s.owned).map(|s| (g.name.as_str(), s))
                    }
                    _ => None,
                })
                .collect();
            // Of two claimants, the one restoring is the newer owner.
            let shown = claims
                .iter()
                .find(|(_, s)| !s.ready)
                .or(claims.first())
                .map(|(_, s)| *s);
            let (state, last_restore) = match shown {
                Some(s) if s.ready => (
                    RestoreState::Ready {
                        since_ms: s.ready_since_ms,
                    },
                    Some((s.restore_records, s.restore_took)),
                ),
                Some(s) => (
                    RestoreState::Restoring {
                        records: s.restore_records,
                        took: s.restore_took,
                    },
                    None,
                ),
                None if pending => (RestoreState::Pending, None),
                None if !unreachable.is_empty() => (
                    RestoreState::Unknown {
                        unreachable: unreachable.clone(),
                    },
                    None,
                ),
                None => (RestoreState::NotOwned, None),
            };
            PartitionRestore {
                partition: p,
                owners: claims.iter().map(|(n, _)| (*n).to_owned()).collect(),
                state,
                last_restore,
                standbys: gates
                    .iter()
                    .filter_map(|g| match &g.scrape {
                        Some(GateScrape::Reached(ps)) => ps
                            .get(&p)
                            .filter(|s| s.standby && !s.owned)
                            .map(|s| (g.name.clone(), s.standby_lag)),
                        _ => None,
                    })
                    .collect(),
            }
        })
        .collect()
}

/// One gate's partitions, from `<base>/metrics`.
async fn scrape(
    http: &reqwest::Client,
    base: &str,
) -> Result<BTreeMap<i32, GatePartition>, ScrapeError> {
    let url = format!("{}/metrics", base.trim_end_matches('/'));
    let r = http.get(url).send().await?;
    if !r.status().is_success() {
        return Err(ScrapeError::Status(r.status().as_u16()));
    }
    parse(&r.text().await?)
}

/// The listed gates before their first scrape (the page says so rather than
/// call every partition unowned).
pub fn unscraped(gates: &[String]) -> Vec<GateView> {
    gates
        .iter()
        .map(|g| GateView {
            // `url` adds a `/` to a bare host: shown as written.
            name: crate::redact::redact_url(g)
                .trim_end_matches('/')
                .to_owned(),
            scrape: None,
        })
        .collect()
}

/// Scrape every gate of `gates` into the cache every few seconds, until
/// `shutdown`.
pub async fn follow(gates: Vec<String>, cache: Shared, shutdown: CancellationToken) {
    let names: Vec<String> = unscraped(&gates).into_iter().map(|g| g.name).collect();
    let http = match reqwest::Client::builder().timeout(SCRAPE_TIMEOUT).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "console: no HTTP client to read the gates' metrics");
            cache.write().expect("cache lock").gates = names
                .into_iter()
                .map(|name| GateView {
                    name,
                    scrape: Some(GateScrape::Unreachable(format!("no HTTP client: {e}"))),
                })
                .collect();
            return;
        }
    };
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let scrapes = futures::future::join_all(gates.iter().map(|g| scrape(&http, g))).await;
        let views: Vec<GateView> = gates
            .iter()
            .zip(&names)
            .zip(scrapes)
            .map(|((url, name), r)| GateView {
                name: name.clone(),
                scrape: Some(match r {
                    Ok(ps) => GateScrape::Reached(ps),
                    Err(e) => {
                        // reqwest's errors name the URL: without its credentials.
                        let mut why = crate::telemetry::error_chain(&e);
                        if crate::redact::redact_url(url).trim_end_matches('/')
                            != url.trim_end_matches('/')
                        {
                            why = crate::redact::redact_url_in(&why, url);
                        }
                        tracing::debug!(gate = %name, error = %why, "console: reading a gate's metrics");
                        GateScrape::Unreachable(why)
                    }
                }),
            })
            .collect();
        cache.write().expect("cache lock").gates = views;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gate's `/metrics`, as the gate renders it: partition 0 ready, 1
    /// restoring, 2 let go.
    fn gate_text() -> String {
        let m = crate::telemetry::Metrics::new();
        m.partition_restoring(0);
        m.partition_ready(0, 1200, Duration::from_millis(2500));
        m.partition_restoring(1);
        m.partition_restore_progress(1, 30_000, Duration::from_secs(4));
        m.partition_restoring(2);
        m.partition_ready(2, 0, Duration::ZERO);
        m.partition_released(2);
        m.render()
    }

    fn reached(name: &str, text: &str) -> GateView {
        GateView {
            name: name.into(),
            scrape: Some(GateScrape::Reached(parse(text).unwrap())),
        }
    }

    #[test]
    fn a_gates_metrics_read_per_partition() {
        let before = chrono::Utc::now().timestamp_millis();
        let ps = parse(&gate_text()).unwrap();
        let p0 = &ps[&0];
        assert!(p0.owned && p0.ready, "{p0:?}");
        assert_eq!(p0.restore_records, 1200);
        assert_eq!(p0.restore_took, Duration::from_millis(2500));
        let since = p0.ready_since_ms.unwrap();
        assert!((before - 1000..before + 60_000).contains(&since), "{since}");
        let p1 = &ps[&1];
        assert!(p1.owned && !p1.ready && p1.ready_since_ms.is_none());
        assert_eq!(p1.restore_records, 30_000);
        assert_eq!(ps[&2], GatePartition::default());
        // The consumer lag's `partition` label is not one of these gauges.
        let with_lag = format!(
            "{}\nstepgate_consumer_lag{{group=\"g\",partition=\"7\",topic=\"t\"}} 5\n",
            gate_text()
        );
        assert!(!parse(&with_lag).unwrap().contains_key(&7));
        // Something else's metrics, or none.
        assert!(matches!(
            parse("# TYPE up gauge\nup 1\n"),
            Err(ScrapeError::NotAGate)
        ));
        assert!(matches!(parse("<html>"), Err(ScrapeError::NotAGate)));
    }

    #[test]
    fn each_partitions_state_across_the_gates() {
        let a = reached("http://a:9464", &gate_text());
        let b_text = {
            let m = crate::telemetry::Metrics::new();
            m.partition_restoring(3);
            m.partition_ready(3, 7, Duration::from_millis(100));
            m.standby(0, Some(12));
            m.render()
        };
        let b = reached("http://b:9464", &b_text);
        let rows = derive(&[0, 1, 2, 3], &[a.clone(), b.clone()]);
        assert_eq!(rows[0].owners, ["http://a:9464"]);
        // b keeps a copy of a's partition 0, 12 records behind.
        assert_eq!(rows[0].standbys, [("http://b:9464".to_owned(), 12)]);
        assert!(rows[1].standbys.is_empty());
        assert!(matches!(
            rows[0].state,
            RestoreState::Ready { since_ms: Some(_) }
        ));
        assert_eq!(
            rows[0].last_restore,
            Some((1200, Duration::from_millis(2500)))
        );
        assert_eq!(
            rows[1].state,
            RestoreState::Restoring {
                records: 30_000,
                took: Duration::from_secs(4)
            }
        );
        assert_eq!(rows[1].last_restore, None);
        // Let go by a, owned by no one else: not owned.
        assert_eq!(rows[2].state, RestoreState::NotOwned);
        assert!(rows[2].owners.is_empty());
        assert_eq!(rows[3].owners, ["http://b:9464"]);

        // b unreachable: what it may own is unknown, what a owns is known.
        let down = GateView {
            name: "http://b:9464".into(),
            scrape: Some(GateScrape::Unreachable("connection refused".into())),
        };
        let rows = derive(&[0, 1, 2, 3], &[a.clone(), down]);
        assert!(matches!(rows[0].state, RestoreState::Ready { .. }));
        assert_eq!(
            rows[3].state,
            RestoreState::Unknown {
                unreachable: vec!["http://b:9464".into()]
            }
        );
        // Not scraped yet: a's partitions are known, the rest not yet.
        let rows = derive(
            &[3],
            &[
                a.clone(),
                GateView {
                    name: "http://b:9464".into(),
                    scrape: None,
                },
            ],
        );
        assert_eq!(
            rows.iter().map(|r| r.partition).collect::<Vec<_>>(),
            [0, 1, 3]
        );
        assert!(matches!(rows[0].state, RestoreState::Ready { .. }));
        assert_eq!(rows[2].state, RestoreState::Pending);

        // Both claim partition 0 (a rebalance between the two scrapes): the
        // restoring one is the new owner.
        let c_text = {
            let m = crate::telemetry::Metrics::new();
            m.partition_restoring(0);
            m.partition_restore_progress(0, 10, Duration::from_secs(1));
            m.render()
        };
        let rows = derive(&[0], &[a, reached("http://c:9464", &c_text)]);
        assert_eq!(rows[0].owners, ["http://a:9464", "http://c:9464"]);
        assert_eq!(
            rows[0].state,
            RestoreState::Restoring {
                records: 10,
                took: Duration::from_secs(1)
            }
        );
        // A partition only a gate names (the lag not read yet) has its row;
        // a standby copy is not a claim.
        let rows = derive(&[], &[b]);
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].partition, 3);
    }

    #[test]
    fn the_overview_shows_each_partitions_owner_and_state_or_how_to_list_the_gates() {
        use crate::console::cache::PartitionLag;
        let lag: Vec<PartitionLag> = (0..4)
            .map(|p| PartitionLag {
                partition: p,
                end: 10,
                committed: Some(10),
            })
            .collect();
        let page = |restore: Option<&[PartitionRestore]>, gates: &[GateView]| {
            crate::console::pages::overview(&Default::default(), &lag, restore, gates, 0, None)
                .into_string()
        };
        let none = page(None, &[]);
        assert!(none.contains("console.gates"), "{none}");
        assert!(!none.contains("data-state"), "{none}");

        let gates = vec![
            reached("http://a:9464", &gate_text()),
            GateView {
                name: "http://b:9464".into(),
                scrape: Some(GateScrape::Unreachable("connection refused".into())),
            },
        ];
        let rows = derive(&[0, 1, 2, 3], &gates);
        let html = page(Some(&rows), &gates);
        for (p, state, owner) in [
            (0, "ready", "http://a:9464"),
            (1, "restoring", "http://a:9464"),
            (2, "unknown", ""),
            (3, "unknown", ""),
        ] {
            let row =
                format!(r#"<tr data-partition="{p}" data-state="{state}" data-owner="{owner}">"#);
            assert!(html.contains(&row), "no {row} in {html}");
        }
        assert!(html.contains("1200 records in 2.5 s"), "{html}");
        assert!(html.contains("30000 records so far"), "{html}");
        assert!(html.contains("http://b:9464 unreachable"), "{html}");
        assert!(html.contains("unreachable: connection refused"), "{html}");
        // Credentials in a listed URL are not shown.
        let shown = &unscraped(&["http://user:hunter2@127.0.0.1:9464/".into()])[0].name;
        assert_eq!(shown, "http://user:redacted@127.0.0.1:9464");
    }

    #[tokio::test]
    async fn a_gate_nothing_answers_for_is_unreachable_without_its_credentials_shown() {
        let cache: Shared = Default::default();
        let stop = CancellationToken::new();
        // Loopback port 1: nothing listens there.
        let gates = vec!["http://ops:s3cret-pw@127.0.0.1:1".to_owned()];
        cache.write().unwrap().gates = unscraped(&gates);
        let task = tokio::spawn(follow(gates, cache.clone(), stop.clone()));
        let why = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(GateScrape::Unreachable(why)) = &cache.read().unwrap().gates[0].scrape {
                    return why.clone();
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("scraped within 10 s");
        stop.cancel();
        task.await.unwrap();
        assert!(why.contains("refused"), "{why}");
        assert!(!why.contains("s3cret-pw"), "{why}");
        let rows = derive(&[0], &cache.read().unwrap().gates);
        assert!(matches!(rows[0].state, RestoreState::Unknown { .. }));
    }

    #[test]
    fn the_gates_are_a_typed_list_settable_from_the_environment() {
        let c = crate::config::Config::from_toml_str(
            "[console]\ngates = [\"http://127.0.0.1:9464\"]\n",
            Vec::new(),
        )
        .unwrap();
        assert_eq!(c.console.gates, ["http://127.0.0.1:9464"]);
        let c = crate::config::Config::from_toml_str(
            "",
            vec![(
                "STEPGATE_CONSOLE_GATES".into(),
                "http://127.0.0.1:9464,http://127.0.0.1:9465".into(),
            )],
        )
        .unwrap();
        assert_eq!(
            c.console.gates,
            ["http://127.0.0.1:9464", "http://127.0.0.1:9465"]
        );
        assert!(crate::config::Config::default().console.gates.is_empty());
        let mut bad = crate::config::Config::default();
        bad.console.gates = vec!["127.0.0.1:9464".into()];
        let e = bad.console.validate().unwrap_err().to_string();
        assert!(e.contains("console.gates[0]"), "{e}");
        // A refused URL is echoed without its credentials.
        bad.console.gates = vec!["ftp://admin:hunter2@127.0.0.1:9464".into()];
        let e = bad.console.validate().unwrap_err().to_string();
        assert!(
            e.contains("console.gates[0]") && !e.contains("hunter2"),
            "{e}"
        );
    }
}
