//! The README's "Run it" runs as written: its config blocks become a
//! `stepgate.toml` (only the broker, the tools' host and the topics are this
//! test's own), and its commands run in that directory — `topics create`,
//! `run`, the second gate's line, `check-config` with the console's block,
//! `call`. Its Rust lines are the tested example's (`examples/agent.rs`, which
//! `interop` runs); its Python quick start is run by the Python suite
//! (`clients/python/tests/test_readme.py`).

use crate::common::*;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const README: &str = include_str!("../../README.md");

/// The fenced blocks of `lang` after the heading `section` (and before the next `## `).
fn blocks(section: &str, lang: &str) -> Vec<String> {
    let start = README
        .find(&format!("\n## {section}\n"))
        .unwrap_or_else(|| panic!("no section {section}"));
    let rest = &README[start + 4..];
    let body = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    body.split(&format!("```{lang}\n"))
        .skip(1)
        .map(|b| b.split("```").next().unwrap().to_owned())
        .collect()
}

/// The command lines of a `sh` block (`stepgate …`, comments and
/// continuation lines dropped).
fn commands(block: &str) -> Vec<Vec<String>> {
    block
        .lines()
        .map(|l| l.split('#').next().unwrap().trim())
        .filter(|l| l.starts_with("stepgate "))
        .map(|l| l.split_whitespace().skip(1).map(str::to_owned).collect())
        .collect()
}

struct Dir {
    dir: tempfile::TempDir,
    env: Vec<(String, String)>,
}

impl Dir {
    fn command(&self, args: &[String]) -> Command {
        let mut c = Command::new(stepgate_bin());
        c.args(args)
            .current_dir(self.dir.path())
            .env_remove("STEPGATE_CONFIG")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        c
    }

    fn output(&self, args: &[String]) -> std::process::Output {
        let out = self.command(args).output().expect("stepgate runs");
        assert!(
            out.status.success(),
            "`stepgate {}` failed:\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn spawn(&self, args: &[String], log: &str) -> Child {
        let log = std::fs::File::create(self.dir.path().join(log)).unwrap();
        self.command(args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("stepgate starts")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_run_it_runs_as_written() {
    let tools = ToolServer::start().await;
    let toml = blocks("Run it", "toml");
    assert_eq!(toml.len(), 2, "the gate's config, then the console's");
    let prefix = random_name("readme");
    // The README's tools live at 127.0.0.1:8080; here, at the test's server.
    let config = toml[0]
        .replace("127.0.0.1:9092", &brokers())
        .replace("http://127.0.0.1:8080", &tools.base);
    assert!(
        !config.contains("env:"),
        "the config block needs no variable to start:\n{config}"
    );
    let dir = Dir {
        dir: tempfile::tempdir().unwrap(),
        env: [
            "intents",
            "results",
            "dlq",
            "progress",
            "changelog",
            "commands",
            "approvals",
        ]
        .iter()
        .map(|t| {
            (
                format!("STEPGATE_KAFKA_TOPICS_{}", t.to_uppercase()),
                format!("{prefix}.{t}"),
            )
        })
        .chain([
            ("STEPGATE_KAFKA_GATE_GROUP".into(), format!("{prefix}-gate")),
            ("STEPGATE_KAFKA_INSTANCE_ID".into(), format!("{prefix}-0")),
            (
                "STEPGATE_KAFKA_REPLICATION_FACTOR".into(),
                replication_factor().to_string(),
            ),
            (
                "STEPGATE_HTTP_LISTEN".into(),
                format!("127.0.0.1:{}", free_port()),
            ),
        ])
        .collect(),
    };
    std::fs::write(dir.dir.path().join("stepgate.toml"), &config).unwrap();

    let sh = blocks("Run it", "sh");
    let lines: Vec<Vec<String>> = sh.iter().flat_map(|b| commands(b)).collect();
    let named = |verb: &str| {
        lines
            .iter()
            .filter(|l| l.first().map(String::as_str) == Some(verb))
            .cloned()
            .collect::<Vec<_>>()
    };
    // `stepgate topics create`, then the first gate.
    for l in named("topics") {
        dir.output(&l);
    }
    let runs = named("run");
    assert_eq!(runs.len(), 2, "a gate, and a second one on this host");
    let http = dir
        .env
        .iter()
        .find(|(k, _)| k == "STEPGATE_HTTP_LISTEN")
        .unwrap()
        .1
        .clone();
    let first = Killed(dir.spawn(&runs[0], "gate-1.log"));
    wait_ready(&http).await;
    // The second gate's line: its own instance id, state and address.
    let second_http = runs[1]
        .iter()
        .skip_while(|a| *a != "--http-listen")
        .nth(1)
        .expect("the second gate names its address")
        .clone();
    let second = Killed(dir.spawn(&runs[1], "gate-2.log"));
    wait_ready(&second_http).await;

    // The shell's call, as the README gives it.
    let call = README
        .lines()
        .find_map(|l| l.split("`stepgate call ").nth(1))
        .and_then(|rest| rest.split('`').next())
        .expect("the README shows `stepgate call`");
    let args = shell_words(&format!("call {call}"));
    let out = tokio::task::spawn_blocking({
        let mut c = dir.command(&args);
        move || c.output().unwrap()
    })
    .await
    .unwrap();
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(out.status.success() && answer["status"] == "ok", "{answer}");
    let tool = args[args.iter().position(|a| a == "--tool").unwrap() + 1].clone();
    eventually(Duration::from_secs(30), "the tool ran once", || {
        tools.count(&tool) == 1
    })
    .await;

    // With the console's block, `check-config` checks what `stepgate console`
    // would: the token's variable must be set.
    let with_console = format!("{config}\n{}", toml[1]);
    std::fs::write(dir.dir.path().join("stepgate.toml"), &with_console).unwrap();
    let var = toml[1]
        .split("\"env:")
        .nth(1)
        .and_then(|v| v.split('"').next())
        .expect("the console's token comes from a variable");
    let refused = dir.command(&["check-config".into()]).output().unwrap();
    assert!(
        !refused.status.success() && String::from_utf8_lossy(&refused.stderr).contains(var),
        "check-config names the missing {var}: {}",
        String::from_utf8_lossy(&refused.stderr)
    );
    let mut check = dir.command(&["check-config".into()]);
    check.env(var, "a-console-token-of-enough-length-1234");
    let ok = check.output().unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    drop((second, first));
}

/// Split a shell line on spaces, keeping '…'-quoted words whole.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '\'' => quoted = !quoted,
            ' ' if !quoted => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

/// Every statement of the README's Rust block is in `examples/agent.rs`, the
/// complete program `interop::the_rust_example_agent_runs` runs.
#[test]
fn the_readmes_rust_lines_are_the_tested_examples() {
    let squash = |s: &str| {
        s.chars()
            .filter(|c| !c.is_whitespace())
            .collect::<String>()
            .replace(",)", ")")
            .replace(",}", "}")
    };
    let example = squash(include_str!("../../examples/agent.rs"));
    let rust = blocks("Agent code", "rust");
    assert_eq!(rust.len(), 1);
    for statement in rust[0].split(';') {
        let code: String = statement
            .lines()
            .map(|l| l.split("//").next().unwrap())
            .collect();
        let code = squash(&code);
        if !code.is_empty() {
            assert!(
                example.contains(&code),
                "`{code}` is not in examples/agent.rs"
            );
        }
    }
}
