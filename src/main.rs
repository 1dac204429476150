//! The `stepgate` binary: parse the command line, set up logging, dispatch.

use anyhow::Context as _;
use clap::Parser;
use std::process::ExitCode;
use stepgate::cli::{
    ApprovalsCommand, AuditFormat, Cli, Command, Deployment, StateCommand, StepsCommand, Target,
    TopicsCommand, Who,
};
use stepgate::client::{Client, StepCall};
use stepgate::config::Config;
use stepgate::contract::{Action, StepKey};
use tokio_util::sync::CancellationToken;

#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(execute(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
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
    let record = stepgate::operator::decide(
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

/// The config from file and environment, with `--brokers` applied when given.
fn load(d: &Deployment) -> anyhow::Result<Config> {
    d.load().context("loading the configuration")
}

async fn execute(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run {
            deployment,
            instance_id,
        } => {
            let mut cfg = load(&deployment)?;
            if let Some(i) = instance_id {
                cfg.kafka.instance_id = i;
            }
            cfg.validate()?;
            stepgate::telemetry::init_logging(&cfg.log);
            stepgate::app::check_record_limits(&cfg).await?;
            let shutdown = shutdown_on_signals();
            stepgate::app::run(cfg, shutdown).await?;
            tracing::info!("stopped cleanly");
            Ok(())
        }
        Command::Worker {
            deployment,
            pool,
            concurrency,
            instance_id,
            rate,
        } => {
            let mut cfg = load(&deployment)?;
            cfg.validate()?;
            // The tools' credentials live here, not on the gate.
            cfg.resolve_tool_headers(|var| std::env::var(var).ok())?;
            stepgate::telemetry::init_logging(&cfg.log);
            let opts = stepgate::worker::WorkerOptions {
                pool,
                concurrency,
                instance_id,
                rates: rate,
            };
            stepgate::worker::run(std::sync::Arc::new(cfg), opts, shutdown_on_signals()).await?;
            Ok(())
        }
        Command::Topics {
            action:
                TopicsCommand::Create {
                    deployment,
                    partitions,
                },
        } => {
            let mut cfg = load(&deployment)?;
            if let Some(n) = partitions {
                cfg.kafka.partitions = n;
            }
            cfg.validate()?;
            let mut created = stepgate::kafka::create_topics(&cfg.kafka, &cfg.state).await?;
            let pools: std::collections::BTreeSet<String> =
                cfg.tools.values().filter_map(|t| t.pool.clone()).collect();
            let pools: Vec<String> = pools.into_iter().collect();
            created
                .extend(stepgate::kafka::create_pool_topics(&cfg.kafka, &cfg.state, &pools).await?);
            for (name, new) in created {
                println!("{} {name}", if new { "created" } else { "exists " });
            }
            let k = cfg.kafka.clone();
            let n =
                tokio::task::spawn_blocking(move || stepgate::kafka::check_layout(&k)).await??;
            stepgate::app::check_record_limits(&cfg).await?;
            println!("ok: every topic has a valid layout ({n} intent partitions)");
            Ok(())
        }
        Command::Demo {
            metrics,
            keep_running,
        } => {
            stepgate::telemetry::init_logging(&stepgate::config::LogConfig {
                format: "pretty".into(),
                level: "error".into(),
            });
            stepgate::demo::run(&metrics, keep_running, shutdown_on_signals()).await?;
            Ok(())
        }
        Command::Call {
            deployment,
            workflow,
            step,
            tool,
            args,
            attempt,
            call_id,
            timeout,
        } => {
            let cfg = load(&deployment)?;
            let arguments: serde_json::Value =
                serde_json::from_str(&args).context("--args must be a JSON object")?;
            let mut call = StepCall::new(&workflow, step, &tool, arguments)?.attempt(attempt);
            if let Some(id) = call_id {
                call = call.call_id(&id);
            }
            let mut options = stepgate::client::options_from_config(&cfg);
            options.timeout = timeout.into();
            let client = Client::new(options).await?;
            let answer = client.call(call).await?;
            println!("{}", serde_json::to_string_pretty(&answer)?);
            if answer.status != stepgate::contract::Status::Ok {
                std::process::exit(2);
            }
            Ok(())
        }
        Command::Mcp {
            deployment,
            listen,
            allowed_host,
            allowed_origin,
            insecure_no_auth,
            timeout,
        } => {
            let cfg = load(&deployment)?;
            // To standard error: on stdio, standard output is the MCP session.
            stepgate::telemetry::init_logging(&cfg.log);
            let transport = match listen {
                Some(listen) => stepgate::mcp::Transport::Http {
                    listen,
                    allowed_hosts: allowed_host,
                    allowed_origins: allowed_origin,
                    insecure_no_auth,
                },
                None => stepgate::mcp::Transport::Stdio,
            };
            // Refused before Kafka is connected: a network without authorization.
            transport.check(&cfg.mcp).await?;
            let front = stepgate::mcp::McpFront::connect(&cfg, timeout.into()).await?;
            front.run(transport, shutdown_on_signals()).await?;
            Ok(())
        }
        Command::Console { deployment, listen } => {
            let mut cfg = load(&deployment)?;
            if let Some(l) = listen {
                cfg.console.listen = l;
            }
            cfg.console.validate()?;
            stepgate::telemetry::init_logging(&cfg.log);
            cfg.resolve_tool_headers(|var| std::env::var(var).ok())?;
            let shutdown = shutdown_on_signals();
            let console =
                stepgate::console::start(cfg, &|var| std::env::var(var).ok(), shutdown.clone())
                    .await?;
            eprintln!("stepgate console on http://{}/", console.addr);
            shutdown.cancelled().await;
            let _ = console.server.await;
            Ok(())
        }
        Command::Audit {
            deployment,
            workflow,
            since,
            format,
            out,
        } => {
            let cfg = load(&deployment)?;
            let since_ms = since
                .map(|s| {
                    chrono::DateTime::parse_from_rfc3339(&s)
                        .map(|t| t.timestamp_millis())
                        .with_context(|| format!("--since `{s}` is not an RFC 3339 time"))
                })
                .transpose()?;
            let query = stepgate::audit::AuditQuery { workflow, since_ms };
            let report = tokio::task::spawn_blocking(move || {
                let mut last = String::new();
                stepgate::audit::report(&cfg.kafka, &query, |topic, n| {
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
            let text = match format {
                AuditFormat::Text => stepgate::audit::render_text(&report),
                AuditFormat::Json => serde_json::to_string_pretty(&report)? + "\n",
                AuditFormat::Html => stepgate::audit::render_html(&report),
            };
            match out {
                Some(path) => std::fs::write(&path, text)
                    .with_context(|| format!("writing {}", path.display()))?,
                None => print!("{text}"),
            }
            Ok(())
        }
        Command::Steps {
            action:
                StepsCommand::Show {
                    workflow_id,
                    json,
                    deployment,
                },
        } => {
            let cfg = load(&deployment)?;
            let k = cfg.kafka.clone();
            let steps = tokio::task::spawn_blocking(move || {
                stepgate::operator::workflow_steps(&k, &workflow_id)
            })
            .await??;
            if json {
                println!("{}", serde_json::to_string_pretty(&steps)?);
            } else {
                print!("{}", stepgate::operator::render_steps(&steps));
            }
            Ok(())
        }
        Command::Steps {
            action:
                StepsCommand::List {
                    unresolved: _,
                    json,
                    deployment,
                },
        } => {
            let cfg = load(&deployment)?;
            let k = cfg.kafka.clone();
            let steps =
                tokio::task::spawn_blocking(move || stepgate::operator::unresolved_steps(&k))
                    .await??;
            if json {
                println!("{}", serde_json::to_string_pretty(&steps)?);
            } else {
                print!("{}", stepgate::operator::render_unresolved(&steps));
            }
            Ok(())
        }
        Command::Resolve {
            step,
            executed,
            output,
            not_executed: _,
            failed,
            who,
            target,
        } => {
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
            decide(step.key(), action, who, target).await
        }
        Command::Approvals { action } => match action {
            ApprovalsCommand::List { json, deployment } => {
                let cfg = load(&deployment)?;
                let k = cfg.kafka.clone();
                let pending =
                    tokio::task::spawn_blocking(move || stepgate::operator::pending_approvals(&k))
                        .await??;
                if json {
                    println!("{}", serde_json::to_string_pretty(&pending)?);
                } else {
                    print!("{}", stepgate::operator::render_approvals(&pending));
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
        },
        Command::State {
            action: StateCommand::Rebuild { deployment, path },
        } => {
            let cfg = load(&deployment)?;
            let path = path.unwrap_or_else(|| cfg.state.path.clone());
            let report = tokio::task::spawn_blocking(move || {
                stepgate::state::rebuild_state(&cfg.kafka, &path, |p, n, records| {
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
        Command::CheckConfig { deployment } => {
            let mut cfg = load(&deployment)?;
            stepgate::state::check_record_sizes(&cfg)?;
            // As `run` does: a tool header whose variable or file is missing fails.
            cfg.resolve_tool_headers(|var| std::env::var(var).ok())?;
            // Secrets (passwords, tokens, key material, header values) are printed redacted.
            print!("{}", stepgate::cli::render_config(&cfg)?);
            Ok(())
        }
    }
}

/// Cancelled on the first SIGTERM or SIGINT; a second one exits at once.
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
