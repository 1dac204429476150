//! Processes of the fault tests' own: `stepgate run` gates that can be
//! killed, stopped and restarted, a single-node broker that can be killed,
//! and what their logs and `/metrics` say.

use super::{Stack, connection_noise, free_port, stepgate_bin};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A counter or gauge from a process's `/metrics` (`http` is its host:port),
/// summed over its labels; None while it does not answer.
pub async fn metric_sum(http: &str, name: &str) -> Option<f64> {
    let text = reqwest::Client::new()
        .get(format!("http://{http}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    Some(
        text.lines()
            .filter(|l| {
                l.strip_prefix(name)
                    .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

/// A `stepgate run` of the stack's deployment, as a child process that can be
/// killed, stopped and restarted (same instance id and state directory).
pub struct Gate {
    pub name: String,
    pub http: String,
    pub config: PathBuf,
    pub dir: PathBuf,
    pub child: Option<Child>,
    pub starts: u32,
}

impl Gate {
    pub fn start(s: &Stack, name: &str) -> Gate {
        let http = format!("127.0.0.1:{}", free_port());
        let mut g = Gate {
            name: name.into(),
            config: s.config_for(name, &http),
            http,
            dir: s.dir.path().to_owned(),
            child: None,
            starts: 0,
        };
        g.spawn();
        g
    }

    pub fn spawn(&mut self) {
        assert!(self.child.is_none());
        self.starts += 1;
        let log = std::fs::File::create(self.log_path()).unwrap();
        self.child = Some(
            Command::new(stepgate_bin())
                .args(["run", "--config"])
                .arg(&self.config)
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("stepgate binary starts"),
        );
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join(format!("{}-{}.log", self.name, self.starts))
    }

    /// The log of the current process.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn pid(&self) -> String {
        self.child.as_ref().expect("running").id().to_string()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig} {}", self.name);
    }

    pub fn sigkill(&mut self) {
        let mut c = self.child.take().expect("running");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().unwrap().is_none())
    }

    /// The partitions this process owns, by its log.
    pub fn owned(&self) -> BTreeSet<i32> {
        owned_from_log(&self.log())
    }

    /// A counter or gauge from /metrics, summed over its labels.
    pub async fn metric(&self, name: &str) -> Option<f64> {
        metric_sum(&self.http, name).await
    }

    /// A per-partition gauge from /metrics: partition → value.
    pub async fn per_partition(&self, name: &str) -> std::collections::BTreeMap<i32, f64> {
        let Ok(r) = reqwest::get(format!("http://{}/metrics", self.http)).await else {
            return Default::default();
        };
        let text = r.text().await.unwrap_or_default();
        let prefix = format!("{name}{{partition=\"");
        text.lines()
            .filter_map(|l| {
                let rest = l.strip_prefix(&prefix)?;
                let (p, v) = rest.split_once("\"} ")?;
                Some((p.parse().ok()?, v.trim().parse().ok()?))
            })
            .collect()
    }

    /// The partitions this gate keeps a standby copy of
    /// (`gate.standby_replicas`).
    pub async fn standbys(&self) -> BTreeSet<i32> {
        self.per_partition("stepgate_partition_standby")
            .await
            .into_iter()
            .filter(|(_, v)| *v >= 1.0)
            .map(|(p, _)| p)
            .collect()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL ends a stopped process too
            let _ = c.wait();
        }
    }
}

pub fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Replays a gate's "partitions assigned/revoked" log lines (a new session
/// starts with none).
pub fn owned_from_log(log: &str) -> BTreeSet<i32> {
    let set = |line: &str| -> Vec<i32> {
        let (Some(a), Some(b)) = (line.rfind('{'), line.rfind('}')) else {
            return Vec::new();
        };
        if b < a {
            return Vec::new();
        }
        line[a + 1..b]
            .split(',')
            .filter_map(|x| x.trim().parse().ok())
            .collect()
    };
    let mut owned = BTreeSet::new();
    for line in log.lines().map(strip_ansi) {
        if line.contains("gate consuming") || line.contains("gate session failed") {
            owned.clear();
        } else if line.contains("partitions assigned") {
            owned.extend(set(&line));
        } else if line.contains("partitions revoked") {
            for p in set(&line) {
                owned.remove(&p);
            }
        }
    }
    owned
}

/// The gates' partition events, for failure messages.
pub fn partition_lines(gates: &[Gate]) -> String {
    gates
        .iter()
        .map(|g| {
            let log = g.log();
            let lines: Vec<String> = log
                .lines()
                .map(strip_ansi)
                .filter(|l| {
                    l.contains("partitions")
                        || l.contains("gate ")
                        || ((l.contains("WARN") || l.contains("ERROR")) && !connection_noise(l))
                })
                .collect();
            format!(
                "--- {} (owns {:?})\n{}",
                g.name,
                g.owned(),
                lines[lines.len().saturating_sub(80)..].join("\n")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A single-node broker of the test's own (ports 29092/29093, its own data
/// directory), so the shared one is never touched.
pub struct Broker {
    pub dir: tempfile::TempDir,
}

pub const BROKER: &str = "127.0.0.1:29092";

impl Broker {
    pub fn script(&self, action: &str) -> std::process::Output {
        Command::new("bash")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/deploy/local/kafka.sh"
            ))
            .arg(action)
            .env("KAFKA_PORT", "29092")
            .env("KAFKA_CONTROLLER_PORT", "29093")
            .env("KAFKA_DATA_DIR", self.dir.path())
            .output()
            .expect("kafka.sh runs")
    }

    pub fn start(&self) {
        let out = self.script("start");
        assert!(
            out.status.success(),
            "kafka.sh start: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// SIGKILL the broker (no controlled shutdown) and wait until it is gone.
    pub fn kill_9(&self) {
        let pid = std::fs::read_to_string(self.dir.path().join("kafka.pid"))
            .unwrap()
            .trim()
            .to_owned();
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        assert!(
            String::from_utf8_lossy(&cmdline).contains("kafka.Kafka")
                && String::from_utf8_lossy(&cmdline)
                    .contains(&self.dir.path().display().to_string()),
            "pid {pid} is this test's broker"
        );
        assert!(
            Command::new("kill")
                .args(["-KILL", &pid])
                .status()
                .unwrap()
                .success()
        );
        let gone = Instant::now() + Duration::from_secs(30);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() {
            assert!(Instant::now() < gone, "broker {pid} still there");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.script("stop");
        super::keep_dir_on_failure(self.dir.path(), "broker");
    }
}
