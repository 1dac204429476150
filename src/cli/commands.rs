//! What each command does: a function per command group, called by [`run`].

use super::{
    ApprovalsCommand, AuditFormat, CallArgs, Cli, Command, Deployment, StateCommand, StepsCommand,
    Target, TopicsCommand, Who,
};
use crate::client::{Client, StepCall};
use crate::config::Config;
use crate::contract::{Action, StepKey};
use anyhow::Context as _;
use std::path::PathBuf;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

/// Run a parsed command line. `Ok` carries the exit status (`call` exits 2
/// when its answer is not `ok`); an error is the binary's to print.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Run { deployment, local } => gate(&deployment, local).await?,
        Command::Worker {
            deployment,
            pool,
            concurrency,
            instance_id,
            rate,
        } => {
            let opts = crate::worker::WorkerOptions {
                pool,
                concurrency,
                instance_id,
                rates: rate,
            };
            worker(&deployment, opts).await?
        }
        Command::Topics { action } => topics(action).await?,
        Command::Demo {
            metrics,
            keep_running,
        } => demo(&metrics, keep_running).await?,
        Command::Call(args) => return call(args).await,
        Command::Mcp {
            deployment,
            listen,
            allowed_host,
            allowed_origin,
            insecure_no_auth,
            timeout,
        } => {
            let transport = match listen {
                Some(listen) => crate::mcp::Transport::Http {
                    listen,
                    allowed_hosts: allowed_host,
                    allowed_origins: allowed_origin,
                    insecure_no_auth,
                },
                None => crate::mcp::Transport::Stdio,
            };
            mcp(&deployment, transport, timeout).await?
        }
        Command::Console { deployment, listen } => console(&deployment, listen).await?,
        Command::Audit {
            deployment,
            workflow,
            since,
            format,
            out,
        } => audit(&deployment, workflow, since, format, out).await?,
        Command::Steps { action } => steps(action).await?,
        Command::Resolve {
            step,
            executed,
            output,
            not_executed: _,
            failed,
            who,
            target,
        } => resolve(step.key(), executed, output, failed, who, target).await?,
        Command::Approvals { action } => approvals(action).await?,
        Command::State {
            action: StateCommand::Rebuild { deployment, path },
        } => rebuild_state(&deployment, path).await?,
        Command::CheckConfig { deployment } => check_config(&deployment)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// The config from file and environment, with `--brokers` applied when given.
fn load(d: &Deployment) -> anyhow::Result<Config> {
    d.load().context("loading the configuration")
}

/// `run`: the gate, until a signal.
async fn gate(deployment: &Deployment, local: super::Local) -> anyhow::Result<()> {
    let mut cfg = load(deployment)?;
    local.apply(&mut cfg);
    cfg.validate()?;
    crate::telemetry::init_logging(&cfg.log);
    cfg.resolve_tool_headers(|var| std::env::var(var).ok())?;
    cfg.resolve_pool_keys(None, |var| std::env::var(var).ok())?;
    // Before any Kafka call: a second process on this host sharing this one's
    // instance id, state or address is told so at once.
    let claims = crate::app::claims::claim(&cfg)?;
    crate::app::check_record_limits(&cfg).await?;
    let shutdown = shutdown_on_signals();
    crate::app::run(cfg, claims, shutdown).await?;
    tracing::info!("stopped cleanly");
    Ok(())
}

async fn worker(deployment: &Deployment, opts: crate::worker::WorkerOptions) -> anyhow::Result<()> {
    let mut cfg = load(deployment)?;
    cfg.validate()?;
    // The tools' credentials live here, not on the gate; the pool's key on both.
    cfg.resolve_tool_headers(|var| std::env::var(var).ok())?;
    cfg.resolve_pool_keys(Some(&opts.pool), |var| std::env::var(var).ok())?;
    crate::telemetry::init_logging(&cfg.log);
    crate::worker::run(std::sync::Arc::new(cfg), opts, shutdown_on_signals()).await?;
    Ok(())
}

async fn topics(action: TopicsCommand) -> anyhow::Result<()> {
    let TopicsCommand::Create {
        deployment,
        partitions,
    } = action;
    let mut cfg = load(&deployment)?;
    if let Some(n) = partitions {
        cfg.kafka.partitions = n;
    }
    cfg.validate()?;
    let mut created = crate::kafka::create_topics(&cfg.kafka, &cfg.state).await?;
    let pools: std::collections::BTreeSet<String> =
        cfg.tools.values().filter_map(|t| t.pool.clone()).collect();
    let pools: Vec<String> = pools.into_iter().collect();
    created.extend(crate::kafka::create_pool_topics(&cfg.kafka, &cfg.state, &pools).await?);
    for (name, new) in created {
        println!("{} {name}", if new { "created" } else { "exists " });
    }
    let k = cfg.kafka.clone();
    let n = tokio::task::spawn_blocking(move || crate::kafka::check_layout(&k)).await??;
    crate::app::check_record_limits(&cfg).await?;
    println!("ok: every topic has a valid layout ({n} intent partitions)");
    Ok(())
}

async fn demo(metrics: &str, keep_running: bool) -> anyhow::Result<()> {
    crate::telemetry::init_logging(&crate::config::LogConfig {
        format: "pretty".into(),
        level: "error".into(),
    });
    crate::demo::run(metrics, keep_running, shutdown_on_signals()).await?;
    Ok(())
}

/// `call`: one intent, its answer printed; exit status 2 unless it is `ok`.
async fn call(a: CallArgs) -> anyhow::Result<ExitCode> {
    let cfg = load(&a.deployment)?;
    let arguments: serde_json::Value =
        serde_json::from_str(&a.args).context("--args must be a JSON object")?;
    let mut call = StepCall::new(&a.workflow, a.step, &a.tool, arguments)?.attempt(a.attempt);
    if let Some(id) = a.call_id {
        call = call.call_id(&id);
    }
    let mut options = crate::client::options_from_config(&cfg);
    options.timeout = a.timeout.into();
    let client = Client::new(options).await?;
    let answer = client.call(call).await?;
    println!("{}", serde_json::to_string_pretty(&answer)?);
    Ok(if answer.status == crate::contract::Status::Ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(2)
    })
}

async fn mcp(
    deployment: &Deployment,
    transport: crate::mcp::Transport,
    timeout: humantime::Duration,
) -> anyhow::Result<()> {
    let cfg = load(deployment)?;
    // To standard error: on stdio, standard output is the MCP session.
    crate::telemetry::init_logging(&cfg.log);
    // Refused before Kafka is connected: a network without authorization.
    transport.check(&cfg.mcp).await?;
    let front = crate::mcp::McpFront::connect(&cfg, timeout.into()).await?;
    front.run(transport, shutdown_on_signals()).await?;
    Ok(())
}

async fn console(deployment: &Deployment, listen: Option<String>) -> anyhow::Result<()> {
    let mut cfg = load(deployment)?;
    if let Some(l) = listen {
        cfg.console.listen = l;
    }
    cfg.console.validate()?;
    crate::telemetry::init_logging(&cfg.log);
    cfg.resolve_tool_headers(|var| std::env::var(var).ok())?;
    let shutdown = shutdown_on_signals();
    let console =
        crate::console::start(cfg, &|var| std::env::var(var).ok(), shutdown.clone()).await?;
    eprintln!("stepgate console on http://{}/", console.addr);
    shutdown.cancelled().await;
    let _ = console.server.await;
    Ok(())
}

async fn audit(
    deployment: &Deployment,
    workflow: Option<String>,
    since: Option<String>,
    format: AuditFormat,
    out: Option<PathBuf>,
) -> anyhow::Result<()> {
    let cfg = load(deployment)?;
    let since_ms = since
        .map(|s| {
            chrono::DateTime::parse_from_rfc3339(&s)
                .map(|t| t.timestamp_millis())
                .with_context(|| format!("--since `{s}` is not an RFC 3339 time"))
        })
        .transpose()?;
    let query = crate::audit::AuditQuery { workflow, since_ms };
    let r = redactor(&cfg);
    let report = tokio::task::spawn_blocking(move || {
        let mut last = String::new();
        crate::audit::report(&cfg.kafka, &query, |topic, n| {
            if topic != last {
                if !last.is_empty() {
                    eprintln!();
                }
                last = topic.to_owned();
            }
            eprint!("\rreading {topic}: {n} records");
        })
    })
    .await??;
    eprintln!();
    // The one rule of what people are shown: the console's, the CLI's.
    let report = report.redacted(&r);
    let text = match format {
        AuditFormat::Text => crate::audit::render_text(&report),
        AuditFormat::Json => serde_json::to_string_pretty(&report)? + "\n",
        AuditFormat::Html => crate::audit::render_html(&report),
    };
    match out {
        Some(path) => {
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?
        }
        None => print!("{text}"),
    }
    Ok(())
}

async fn steps(action: StepsCommand) -> anyhow::Result<()> {
    match action {
        StepsCommand::Show {
            workflow_id,
            json,
            deployment,
        } => {
            let cfg = load(&deployment)?;
            let k = cfg.kafka.clone();
            let steps = tokio::task::spawn_blocking(move || {
                crate::operator::workflow_steps(&k, &workflow_id)
            })
            .await??;
            let r = redactor(&cfg);
            if json {
                let shown = crate::operator::WorkflowSteps {
                    steps: steps
                        .steps
                        .iter()
                        .map(|rec| crate::operator::redacted_record(rec, &r))
                        .collect(),
                    ..steps
                };
                println!("{}", serde_json::to_string_pretty(&shown)?);
            } else {
                print!("{}", crate::operator::render_steps(&steps, &r));
            }
        }
        StepsCommand::List {
            unresolved: _,
            json,
            deployment,
        } => {
            let cfg = load(&deployment)?;
            let k = cfg.kafka.clone();
            let steps = tokio::task::spawn_blocking(move || crate::operator::unresolved_steps(&k))
                .await??;
            if json {
                let r = redactor(&cfg);
                let shown: Vec<_> = steps
                    .iter()
                    .map(|rec| crate::operator::redacted_record(rec, &r))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&shown)?);
            } else {
                print!("{}", crate::operator::render_unresolved(&steps));
            }
        }
    }
    Ok(())
}

async fn resolve(
    step: StepKey,
    executed: bool,
    output: Option<String>,
    failed: bool,
    who: Who,
    target: Target,
) -> anyhow::Result<()> {
    let action = if failed {
        Action::ResolveFailed
    } else if executed {
        let text = output.unwrap_or_default();
        let output: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("--output must be JSON, got `{text}`"))?;
        Action::ResolveExecuted { output }
    } else {
        Action::ResolveNotExecuted
    };
    decide(step, action, who, target).await
}

async fn approvals(action: ApprovalsCommand) -> anyhow::Result<()> {
    match action {
        ApprovalsCommand::List { json, deployment } => {
            let cfg = load(&deployment)?;
            let k = cfg.kafka.clone();
            let pending =
                tokio::task::spawn_blocking(move || crate::operator::pending_approvals(&k))
                    .await??;
            let r = redactor(&cfg);
            if json {
                let shown: Vec<_> = pending
                    .iter()
                    .map(|a| crate::operator::redacted_approval(a, &r))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&shown)?);
            } else {
                print!("{}", crate::operator::render_approvals(&pending, &r));
            }
            Ok(())
        }
        ApprovalsCommand::Approve { step, who, target } => {
            decide(step.key(), Action::Approve, who, target).await
        }
        ApprovalsCommand::Deny { step, who, target } => {
            if who.reason.as_deref().is_none_or(|r| r.trim().is_empty()) {
                anyhow::bail!(
                    "a denial needs --reason: the agent's model is told it, so it can explain the refusal"
                );
            }
            decide(step.key(), Action::Deny, who, target).await
        }
    }
}

/// Send an operator's decision and print the step once a gate applied it.
async fn decide(step: StepKey, action: Action, who: Who, target: Target) -> anyhow::Result<()> {
    let cfg = load(&target.deployment)?;
    let by = who
        .by
        .or_else(|| std::env::var("USER").ok())
        .filter(|b| !b.trim().is_empty())
        .context(
            "say who decides with --by NAME (or STEPGATE_OPERATOR): it is recorded for audit",
        )?;
    let name = action.as_str();
    let record = crate::operator::decide(
        &cfg.kafka,
        step,
        action,
        &by,
        who.reason,
        target.run,
        target.wait.into(),
    )
    .await?;
    println!(
        "{name} applied by the gate: step {} is now {}",
        record.step,
        record.phase.as_str()
    );
    Ok(())
}

async fn rebuild_state(deployment: &Deployment, path: Option<PathBuf>) -> anyhow::Result<()> {
    let cfg = load(deployment)?;
    let path = path.unwrap_or_else(|| cfg.state.path.clone());
    let report = tokio::task::spawn_blocking(move || {
        crate::state::rebuild_state(&cfg.kafka, &path, |p, n, records| {
            eprintln!("partition {p}/{n}: {records} changelog records applied");
        })
    })
    .await??;
    println!(
        "rebuilt {} partitions, {} changelog records, into {}",
        report.partitions,
        report.records,
        report.path.display()
    );
    Ok(())
}

fn check_config(deployment: &Deployment) -> anyhow::Result<()> {
    let mut cfg = load(deployment)?;
    crate::state::check_record_sizes(&cfg)?;
    // As `run` does: a tool header or pool key whose variable or file is
    // missing (or a key too short) fails.
    cfg.resolve_tool_headers(|var| std::env::var(var).ok())?;
    cfg.resolve_pool_keys(None, |var| std::env::var(var).ok())?;
    // A configured console is checked as `stepgate console` checks it at
    // start (its tokens and key readable, `mcp_auth` complete, …).
    if console_configured(&cfg.console) {
        crate::console::check(&cfg, &|var| std::env::var(var).ok())
            .context("`[console]`: `stepgate console` would refuse to start")?;
    }
    // Secrets (passwords, tokens, key material, header values) are printed redacted.
    print!("{}", super::render_config(&cfg)?);
    Ok(())
}

/// Whether the config sets up a console (anything beyond the defaults that
/// names people): then `check-config` checks it as `stepgate console` does.
fn console_configured(c: &crate::config::ConsoleConfig) -> bool {
    c.has_identity() || !c.roles.is_empty() || c.session_key.is_some()
}

/// The one redaction of what people are shown, with a note on standard
/// error for each tool header this process cannot read (its value cannot be
/// recognised in what is printed).
fn redactor(cfg: &Config) -> crate::redact::Redactor {
    let (r, unread) = crate::operator::display_redactor(cfg, &|var| std::env::var(var).ok());
    for u in unread {
        eprintln!("note: {u}");
    }
    r
}

/// Cancelled on the first SIGTERM or SIGINT; a second one exits at once. Only
/// the long-running commands listen: the others keep the default (exit).
fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot listen for SIGTERM");
                    return;
                }
            };
        for n in 0.. {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            if n > 0 {
                eprintln!("second signal: exiting without draining");
                std::process::exit(130);
            }
            tracing::info!("shutdown requested: finishing in-flight work and committing");
            t.cancel();
        }
    });
    token
}
