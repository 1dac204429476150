//! The deployment files parse, reference files that exist, agree with each
//! other, and name only metrics stepgate exports.

use serde_yaml_ng::Value as Yaml;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn yaml(rel: &str) -> Yaml {
    let path = root().join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{rel} is not valid YAML: {e}"))
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            yaml_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "yaml" || x == "yml") {
            out.push(p);
        }
    }
}

/// Every `stepgate_*` metric a PromQL expression names, without histogram suffixes.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (i, _) in expr.match_indices("stepgate_") {
        let name: String = expr[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name)
            .to_owned();
        names.insert(base);
    }
    names
}

fn exported() -> String {
    // Every file of the telemetry module registers metrics (`lifecycle.rs` too).
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join("src/telemetry"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .collect();
    files.sort();
    files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect()
}

#[test]
fn every_yaml_file_parses() {
    let mut files = vec![root().join("docker-compose.yml")];
    yaml_files(&root().join("deploy"), &mut files);
    assert!(files.len() >= 12, "{files:?}");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        serde_yaml_ng::from_str::<Yaml>(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
    }
}

#[test]
fn kustomizations_reference_existing_files() {
    for dir in [
        "deploy/k8s/base",
        "deploy/k8s/sidecar",
        "deploy/k8s/monitoring",
        "deploy/k8s/config",
    ] {
        let k = yaml(&format!("{dir}/kustomization.yaml"));
        let mut refs: Vec<String> = k["resources"]
            .as_sequence()
            .map(|s| {
                s.iter()
                    .filter_map(|r| r.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default();
        for g in k["configMapGenerator"].as_sequence().into_iter().flatten() {
            for f in g["files"].as_sequence().into_iter().flatten() {
                let f = f.as_str().unwrap();
                refs.push(f.split_once('=').map_or(f, |(_, path)| path).to_owned());
            }
        }
        assert!(!refs.is_empty(), "{dir}");
        for r in refs {
            assert!(
                root().join(dir).join(&r).exists(),
                "{dir}: {r} does not exist"
            );
        }
    }
}

#[test]
fn the_statefulset_probes_the_health_endpoints_on_the_configured_port() {
    let sts = yaml("deploy/k8s/base/statefulset.yaml");
    let c = &sts["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        c["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(
        c["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    assert_eq!(c["ports"][0]["containerPort"].as_u64(), Some(9464));
    let env = c["env"].as_sequence().unwrap();
    assert!(
        env.iter()
            .any(|e| e["name"].as_str() == Some("STEPGATE_KAFKA_INSTANCE_ID")),
        "each pod its own instance id"
    );
    assert!(sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"].as_str() == Some("state"));
    // The cluster config loads, and serves metrics where the probes look.
    let text = std::fs::read_to_string(root().join("deploy/k8s/config/stepgate.toml")).unwrap();
    let cfg = stepgate::config::Config::from_toml_str(&text, Vec::new()).unwrap();
    assert!(cfg.http.listen.ends_with(":9464"));
    for path in [
        "deploy/stepgate.example.toml",
        "deploy/compose/stepgate.toml",
    ] {
        let text = std::fs::read_to_string(root().join(path)).unwrap();
        stepgate::config::Config::from_toml_str(&text, Vec::new())
            .unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

#[test]
fn compose_has_the_whole_stack_and_its_mounts_exist() {
    let c = yaml("docker-compose.yml");
    let services = c["services"].as_mapping().unwrap();
    for s in [
        "kafka",
        "topics",
        "tool",
        "stepgate",
        "prometheus",
        "grafana",
    ] {
        assert!(services.contains_key(s), "service {s}");
    }
    assert!(
        c["services"]["kafka"]["image"]
            .as_str()
            .unwrap()
            .starts_with("apache/kafka:")
    );
    for (_, svc) in services {
        for v in svc["volumes"].as_sequence().into_iter().flatten() {
            let v = v.as_str().unwrap();
            if let Some(local) = v.strip_prefix("./") {
                let local = local.split(':').next().unwrap();
                assert!(
                    root().join(local).exists(),
                    "compose mounts a missing file: {local}"
                );
            }
        }
    }
    assert!(root().join("Dockerfile").exists());
}

#[test]
fn alert_rules_agree_and_name_exported_metrics() {
    let plain = yaml("deploy/prometheus/alerts.yaml");
    let operator = yaml("deploy/k8s/monitoring/prometheusrule.yaml");
    assert_eq!(
        plain["groups"], operator["spec"]["groups"],
        "the two rule files must not drift"
    );
    let src = exported();
    let rules = plain["groups"][0]["rules"].as_sequence().unwrap();
    let alerts: Vec<&str> = rules.iter().filter_map(|r| r["alert"].as_str()).collect();
    for a in [
        "StepgateInDoubtSteps",
        "StepgateConsumerLagGrowing",
        "StepgateDeadLettersGrowing",
    ] {
        assert!(alerts.contains(&a), "{a}");
    }
    for r in rules {
        for m in metric_names(r["expr"].as_str().unwrap()) {
            assert!(
                src.contains(&format!("\"{m}\"")),
                "alert uses {m}, which stepgate does not export"
            );
        }
    }
}

#[test]
fn the_dashboard_queries_name_exported_metrics() {
    let text =
        std::fs::read_to_string(root().join("deploy/grafana/stepgate-dashboard.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let src = exported();
    let mut seen = BTreeSet::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            for m in metric_names(t["expr"].as_str().unwrap()) {
                assert!(
                    src.contains(&format!("\"{m}\"")),
                    "panel `{}` uses {m}, which stepgate does not export",
                    p["title"]
                );
                seen.insert(m);
            }
        }
    }
    for needed in [
        "stepgate_repeats_total",
        "stepgate_effectful_calls_total",
        "stepgate_rephrased_retries_total",
        "stepgate_in_doubt_steps_total",
        "stepgate_answer_latency_seconds",
        "stepgate_consumer_lag",
    ] {
        assert!(seen.contains(needed), "the dashboard shows {needed}");
    }
}

/// The dashboard's dedup-rate panels compute repeats over effectful calls
/// (not over every intent, which fast-path reads and refused input dilute),
/// in all and per tool, with exactly the expressions whose values
/// `deploy/prometheus/alerts.test.yaml` checks under promtool.
#[test]
fn the_dedup_rate_panels_use_the_expressions_promtool_checks() {
    let text =
        std::fs::read_to_string(root().join("deploy/grafana/stepgate-dashboard.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).unwrap();
    let tests = yaml("deploy/prometheus/alerts.test.yaml");
    let checked: BTreeSet<&str> = tests["tests"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|t| t["promql_expr_test"].as_sequence().into_iter().flatten())
        .filter_map(|e| e["expr"].as_str())
        .collect();
    let mut dedup = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        if !p["title"].as_str().unwrap().starts_with("Dedup rate") {
            continue;
        }
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            assert!(
                metric_names(expr)
                    == BTreeSet::from([
                        "stepgate_repeats_total".to_owned(),
                        "stepgate_effectful_calls_total".to_owned()
                    ]),
                "panel `{}`: {expr}",
                p["title"]
            );
            assert!(
                checked.contains(expr),
                "panel `{}`: `{expr}` is not among the expressions alerts.test.yaml checks: {checked:?}",
                p["title"]
            );
            dedup.push(expr.to_owned());
        }
    }
    assert!(
        dedup.iter().any(|e| e.contains("by (tool)")),
        "a per-tool dedup panel: {dedup:?}"
    );
    assert!(
        dedup.iter().any(|e| !e.contains("by (tool)")),
        "an overall dedup panel: {dedup:?}"
    );
}

/// `docker compose config` (or the standalone `docker-compose`) validates the
/// compose file against the Compose schema; it needs no Docker engine.
#[test]
fn docker_compose_config_validates_the_stack() {
    let attempts: [&[&str]; 2] = [&["docker", "compose"], &["docker-compose"]];
    for cmd in attempts {
        let Ok(out) = std::process::Command::new(cmd[0])
            .args(&cmd[1..])
            .args(["config", "-q"])
            .current_dir(root())
            .output()
        else {
            continue;
        };
        if cmd.len() == 2
            && !out.status.success()
            && String::from_utf8_lossy(&out.stderr).contains("unknown")
        {
            continue; // the compose plugin is not installed: try docker-compose
        }
        assert!(
            out.status.success(),
            "{}: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    panic!(
        "neither `docker compose` nor `docker-compose` is installed (deploy/local/test.sh installs docker-compose)"
    );
}

/// `kubectl kustomize <dir>` (or `kustomize build`), as `kubectl apply -k`
/// would render it: the documents it outputs.
fn kustomize(dir: &str) -> Vec<Yaml> {
    let text = kustomize_text(dir);
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect()
}

/// What `kubectl kustomize <dir>` (or `kustomize build`) outputs.
fn kustomize_text(dir: &str) -> String {
    let path = root().join(dir);
    let attempts: [&[&str]; 2] = [&["kubectl", "kustomize"], &["kustomize", "build"]];
    for cmd in attempts {
        let Ok(out) = std::process::Command::new(cmd[0])
            .args(&cmd[1..])
            .arg(&path)
            .output()
        else {
            continue;
        };
        assert!(
            out.status.success(),
            "{} {dir}: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        return String::from_utf8(out.stdout).unwrap();
    }
    panic!(
        "neither `kubectl` nor `kustomize` is installed (deploy/local/test.sh installs kustomize)"
    );
}

fn of_kind<'a>(docs: &'a [Yaml], kind: &str) -> Vec<&'a Yaml> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some(kind))
        .collect()
}

/// The user the image runs as (the Dockerfile's `USER uid:gid`).
fn image_uid() -> u64 {
    let text = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let user = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("the Dockerfile sets USER");
    user.split(':').next().unwrap().trim().parse().unwrap()
}

#[test]
fn every_kubernetes_overlay_renders_with_its_namespace_config_and_a_writable_state_volume() {
    let uid = image_uid();
    for (dir, namespace, workload) in [
        ("deploy/k8s/base", "stepgate", "StatefulSet"),
        ("deploy/k8s/sidecar", "agents", "Deployment"),
    ] {
        let docs = kustomize(dir);
        // The namespace is created, not assumed.
        assert!(
            of_kind(&docs, "Namespace")
                .iter()
                .any(|n| n["metadata"]["name"].as_str() == Some(namespace)),
            "{dir}: no Namespace {namespace}"
        );
        // The generated config map is in that namespace and is the one mounted.
        let cms = of_kind(&docs, "ConfigMap");
        assert_eq!(cms.len(), 1, "{dir}");
        let cm = cms[0];
        assert_eq!(cm["metadata"]["namespace"].as_str(), Some(namespace));
        let toml = cm["data"]["stepgate.toml"]
            .as_str()
            .expect("stepgate.toml in it");
        stepgate::config::Config::from_toml_str(toml, Vec::new())
            .unwrap_or_else(|e| panic!("{dir}: {e}"));
        let w = of_kind(&docs, workload);
        assert_eq!(w.len(), 1, "{dir}: one {workload}");
        let pod = &w[0]["spec"]["template"]["spec"];
        let volumes = pod["volumes"].as_sequence().unwrap();
        assert!(
            volumes
                .iter()
                .any(|v| v["configMap"]["name"] == cm["metadata"]["name"]),
            "{dir}: the {workload} mounts {:?}",
            cm["metadata"]["name"]
        );
        // The state volume is writable by the image's user.
        let sc = &pod["securityContext"];
        assert_eq!(sc["fsGroup"].as_u64(), Some(uid), "{dir}: fsGroup");
        assert_eq!(sc["runAsUser"].as_u64(), Some(uid), "{dir}: runAsUser");
        let gate = pod["containers"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|c| c["name"].as_str() == Some("stepgate"))
            .expect("a stepgate container");
        // A long restore is not a failed liveness probe.
        assert_eq!(
            gate["startupProbe"]["httpGet"]["path"].as_str(),
            Some("/healthz"),
            "{dir}"
        );
    }
    // Standalone gates leave one at a time in a drain.
    let base = kustomize("deploy/k8s/base");
    let pdb = of_kind(&base, "PodDisruptionBudget");
    assert_eq!(pdb.len(), 1);
    assert_eq!(pdb[0]["spec"]["maxUnavailable"].as_u64(), Some(1));
    // The monitoring overlay renders too.
    let mon = kustomize("deploy/k8s/monitoring");
    assert!(!of_kind(&mon, "PrometheusRule").is_empty());
    assert!(!of_kind(&mon, "PodMonitor").is_empty());
}

#[test]
fn the_compose_broker_is_reachable_from_the_host() {
    let c = yaml("docker-compose.yml");
    let kafka = &c["services"]["kafka"];
    let env = &kafka["environment"];
    let advertised = env["KAFKA_ADVERTISED_LISTENERS"].as_str().unwrap();
    assert!(
        advertised.contains("HOST://127.0.0.1:19092"),
        "{advertised}"
    );
    assert!(
        advertised.contains("PLAINTEXT://kafka:9092"),
        "{advertised}"
    );
    let ports: Vec<&str> = kafka["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|p| p.as_str())
        .collect();
    assert!(ports.contains(&"127.0.0.1:19092:19092"), "{ports:?}");
    assert!(
        env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
            .as_str()
            .unwrap()
            .contains("HOST:PLAINTEXT")
    );
}

#[test]
fn every_scrape_config_names_the_job_the_down_alert_watches() {
    let rules = yaml("deploy/prometheus/alerts.yaml");
    let down = rules["groups"][0]["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|r| r["alert"].as_str() == Some("StepgateDown"))
        .expect("a StepgateDown alert");
    let expr = down["expr"].as_str().unwrap();
    let job = expr
        .split("job=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .expect("StepgateDown selects a job");
    // Plain Prometheus (compose): the scrape job's name.
    let prom = yaml("deploy/prometheus/prometheus.yml");
    assert!(
        prom["scrape_configs"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|c| c["job_name"].as_str() == Some(job)),
        "no scrape job named {job}"
    );
    // The Prometheus Operator names a PodMonitor's job "<namespace>/<name>"
    // unless it is relabelled: the alert would never fire.
    let pm = yaml("deploy/k8s/monitoring/podmonitor.yaml");
    for ep in pm["spec"]["podMetricsEndpoints"].as_sequence().unwrap() {
        assert!(
            ep["relabelings"]
                .as_sequence()
                .into_iter()
                .flatten()
                .any(|r| {
                    r["targetLabel"].as_str() == Some("job")
                        && r["replacement"].as_str() == Some(job)
                }),
            "the PodMonitor's endpoint does not set job={job}"
        );
    }
}

#[test]
fn promtool_checks_the_rules_and_each_alert_fires_and_clears_as_its_unit_test_says() {
    let dir = root().join("deploy/prometheus");
    for args in [
        vec!["check", "rules", "alerts.yaml"],
        vec!["test", "rules", "alerts.test.yaml"],
    ] {
        let out = std::process::Command::new("promtool")
            .args(&args)
            .current_dir(&dir)
            .output()
            .expect("promtool runs (deploy/local/test.sh installs it)");
        assert_succeeded(&out, &format!("promtool {}", args.join(" ")));
    }
    // Every alert has a unit test.
    let rules = yaml("deploy/prometheus/alerts.yaml");
    let tests = std::fs::read_to_string(dir.join("alerts.test.yaml")).unwrap();
    for r in rules["groups"][0]["rules"].as_sequence().unwrap() {
        let name = r["alert"].as_str().unwrap();
        assert!(
            tests.contains(&format!("alertname: {name}")),
            "no unit test for {name}"
        );
    }
}

/// The Kubernetes versions whose API schemas every overlay is validated
/// against: the oldest and the newest that deploy/local/deps.sh's pinned
/// kubernetes-validate ships.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.25.0", "1.37.0"];

/// Where deploy/local/deps.sh writes the JSON schemas kubeconform reads
/// (deploy/local/kubeconform-schemas.py): `kubernetes/` and `crds/`.
fn k8s_schemas() -> PathBuf {
    std::env::var_os("STEPGATE_K8S_SCHEMAS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/local/share/stepgate/k8s-schemas"))
}

#[test]
fn kubeconform_validates_every_overlay_strictly_against_the_kubernetes_and_operator_schemas() {
    use std::io::Write;
    let schemas = k8s_schemas();
    assert!(
        schemas.join("SOURCE").is_file(),
        "no schemas in {} (deploy/local/test.sh writes them; STEPGATE_K8S_SCHEMAS moves them)",
        schemas.display()
    );
    // Offline: only these locations, no default (remote) one. A kind with no
    // schema in either is an error, not a skip.
    let builtin = format!(
        "{}/kubernetes/{{{{ .NormalizedKubernetesVersion }}}}-local{{{{ .StrictSuffix }}}}/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json",
        schemas.display()
    );
    let crds = format!(
        "{}/crds/{{{{ .ResourceKind }}}}{{{{ .KindSuffix }}}}.json",
        schemas.display()
    );
    let mut overlays: Vec<String> = std::fs::read_dir(root().join("deploy/k8s"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("kustomization.yaml").is_file())
        .map(|p| format!("deploy/k8s/{}", p.file_name().unwrap().to_str().unwrap()))
        .collect();
    overlays.sort();
    for dir in [
        "deploy/k8s/base",
        "deploy/k8s/sidecar",
        "deploy/k8s/monitoring",
    ] {
        assert!(overlays.iter().any(|o| o == dir), "{dir} is an overlay");
    }
    for dir in &overlays {
        let rendered = kustomize_text(dir);
        for version in KUBERNETES_VERSIONS {
            let args = [
                "-strict",
                "-summary",
                "-kubernetes-version",
                version,
                "-schema-location",
                &builtin,
                "-schema-location",
                &crds,
            ];
            let mut child = std::process::Command::new("kubeconform")
                .args(args)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("kubeconform runs (deploy/local/test.sh installs it)");
            // A kubeconform that stops early fails the status check below.
            let _ = child.stdin.take().unwrap().write_all(rendered.as_bytes());
            let out = child.wait_with_output().unwrap();
            assert_succeeded(
                &out,
                &format!("kubeconform on {dir} (Kubernetes {version})"),
            );
        }
    }
}

/// `go`, on PATH or where deploy/local/deps.sh looks for it.
fn go() -> &'static str {
    if std::process::Command::new("go")
        .arg("version")
        .output()
        .is_ok()
    {
        "go"
    } else {
        "/usr/local/go/bin/go"
    }
}

#[test]
fn every_grafana_dashboard_matches_grafanas_dashboard_schema() {
    let mut dashboards: Vec<String> = std::fs::read_dir(root().join("deploy/grafana"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| p.to_str().unwrap().to_owned())
        .collect();
    dashboards.sort();
    assert!(!dashboards.is_empty());
    // deploy/grafana/check: the Grafana Foundation SDK's strict decoding and
    // constraints. Offline: deploy/local/test.sh fetched the SDK.
    let out = std::process::Command::new(go())
        .args(["run", "."])
        .args(&dashboards)
        .current_dir(root().join("deploy/grafana/check"))
        .env("GOPROXY", "off")
        .output()
        .expect("go runs (deploy/local/deps.sh uses /usr/local/go/bin/go)");
    assert_succeeded(
        &out,
        &format!("deploy/grafana/check {}", dashboards.join(" ")),
    );
}

/// A checker's run passed; else fail with what it said (stdout and stderr).
fn assert_succeeded(out: &std::process::Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Release builds never carry the fault-injection hooks: `test-hooks` is not a
/// default feature, and no build of the image or the benchmarks enables it
/// (without it, `STEPGATE_TEST_*` does nothing: `cargo test --lib -- hook_tests`
/// without the feature checks that).
#[test]
fn release_builds_do_not_enable_the_test_hooks() {
    let manifest: toml::Table = std::fs::read_to_string(root().join("Cargo.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let features = manifest["features"].as_table().unwrap();
    assert!(features.contains_key("test-hooks"));
    let default = features["default"].as_array().unwrap();
    assert!(
        !default.iter().any(|f| f.as_str() == Some("test-hooks")),
        "test-hooks must not be a default feature"
    );
    for file in ["Dockerfile", "benches/bench.sh", "deploy/local/demo.sh"] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        for line in text.lines().filter(|l| l.contains("cargo build")) {
            assert!(!line.contains("test-hooks"), "{file}: {line}");
        }
    }
}
