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
    std::fs::read_to_string(root().join("src/telemetry/mod.rs")).unwrap()
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
    let text = std::fs::read_to_string(root().join("deploy/k8s/base/stepgate.toml")).unwrap();
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
        "stepgate_rephrased_retries_total",
        "stepgate_in_doubt_steps_total",
        "stepgate_answer_latency_seconds",
        "stepgate_consumer_lag",
    ] {
        assert!(seen.contains(needed), "the dashboard shows {needed}");
    }
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
