//! What a run ran on and how it was started, read from the machine at the start
//! of the run (never written by hand): the CPU, memory and kernel from /proc, the
//! broker's version and JVM from its process, the command, and the `STEPGATE_`
//! variables stepgate inherits from the bench.

use crate::render::Machine;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// The machine the bench runs on and its local broker's processes (`pids`; none
/// when the broker is not a local process).
pub fn read(pids: &[String]) -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let cmdlines: Vec<Vec<String>> = pids.iter().filter_map(|p| cmdline(p)).collect();
    Machine {
        cpu_model: field(&cpuinfo, "model name"),
        memory_mib: field(&meminfo, "MemTotal")
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kib| kib / 1024),
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .map(|r| format!("Linux {}", r.trim())),
        broker_nodes: pids.len(),
        broker_version: cmdlines.iter().find_map(|c| kafka_version(c)),
        broker_jvm: pids.first().and_then(|p| jvm_version(p)),
        broker_jvm_options: jvm_options(&cmdlines),
    }
}

/// The command that started the run: bench.sh's own command line, which it
/// passes down as `STEPGATE_BENCH_COMMAND`, or this process's.
pub fn command() -> String {
    match std::env::var("STEPGATE_BENCH_COMMAND") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_owned(),
        _ => {
            let mut args: Vec<String> = std::env::args().collect();
            if let Some(exe) = args.first_mut()
                && let Some(name) = Path::new(exe).file_name()
            {
                *exe = name.to_string_lossy().into_owned();
            }
            args.join(" ")
        }
    }
}

/// The `STEPGATE_…` variables in the bench's environment, which every stepgate
/// it starts inherits and reads as config overrides (the bench's own
/// `STEPGATE_BENCH_…` aside). Values of variables named like secrets are hidden.
pub fn stepgate_env() -> BTreeMap<String, String> {
    std::env::vars()
        .filter(|(k, _)| k.starts_with("STEPGATE_") && !k.starts_with("STEPGATE_BENCH_"))
        .map(|(k, v)| {
            let secret = ["PASSWORD", "SECRET", "TOKEN", "KEY"]
                .iter()
                .any(|s| k.contains(s));
            let v = if secret { "(hidden)".to_owned() } else { v };
            (k, v)
        })
        .collect()
}

/// The value of the first `name : value` line of a /proc file.
fn field(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        (k.trim() == name).then(|| v.trim().to_owned())
    })
}

fn cmdline(pid: &str) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    Some(
        raw.split(|&b| b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect(),
    )
}

/// Kafka's version from the jars on a broker's class path (`kafka_2.13-4.4.0.jar`,
/// else `kafka-server-…` or `kafka-clients-…`); a `dir/*` entry is listed.
fn kafka_version(cmd: &[String]) -> Option<String> {
    let at = cmd.iter().position(|a| a == "-cp" || a == "-classpath")?;
    let mut jars = Vec::new();
    for entry in cmd.get(at + 1)?.split(':') {
        match entry.strip_suffix("/*") {
            Some(dir) => {
                if let Ok(list) = std::fs::read_dir(dir) {
                    jars.extend(
                        list.flatten()
                            .map(|e| e.file_name().to_string_lossy().into_owned()),
                    );
                }
            }
            None => jars.extend(
                Path::new(entry)
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned()),
            ),
        }
    }
    let version_of = |prefix: &str| {
        jars.iter().find_map(|j| {
            let rest = j.strip_prefix(prefix)?.strip_suffix(".jar")?;
            rest.chars()
                .next()
                .is_some_and(|c| c.is_ascii_digit())
                .then(|| rest.to_owned())
        })
    };
    // `kafka_2.13-4.4.0.jar`: the Scala version, then Kafka's.
    jars.iter()
        .find_map(|j| {
            let rest = j.strip_prefix("kafka_2.")?.strip_suffix(".jar")?;
            let (_, v) = rest.split_once('-')?;
            v.chars().next()?.is_ascii_digit().then(|| v.to_owned())
        })
        .or_else(|| version_of("kafka-server-"))
        .or_else(|| version_of("kafka-clients-"))
}

/// The broker JVM's name and version (`openjdk 17.0.17`), from `java -version` of
/// the executable the process runs.
fn jvm_version(pid: &str) -> Option<String> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let out = Command::new(exe).arg("-version").output().ok()?;
    // `openjdk version "17.0.17" 2025-10-21`: the name and the quoted version.
    let text = String::from_utf8_lossy(&out.stderr);
    let first = text.lines().next()?;
    let (name, rest) = first.split_once(" version ")?;
    let version = rest.split('"').nth(1)?;
    Some(format!("{name} {version}"))
}

/// The `-X…` options (heap, `-XX:` flags) before the main class on the JVMs'
/// command lines, deduplicated.
fn jvm_options(cmdlines: &[Vec<String>]) -> Vec<String> {
    let mut opts = Vec::new();
    for cmd in cmdlines {
        let mut args = cmd.iter().skip(1);
        while let Some(a) = args.next() {
            if a == "-cp" || a == "-classpath" {
                args.next();
            } else if !a.starts_with('-') {
                break;
            } else if a.starts_with("-X") {
                opts.push(a.clone());
            }
        }
    }
    opts.sort();
    opts.dedup();
    opts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kafka_version_comes_from_the_broker_jar_else_the_server_or_client_jar() {
        let cmd = |cp: &str| vec!["java".into(), "-cp".into(), cp.into(), "kafka.Kafka".into()];
        assert_eq!(
            kafka_version(&cmd("/x/kafka-clients-4.4.0.jar:/x/kafka_2.13-4.4.0.jar")).as_deref(),
            Some("4.4.0")
        );
        assert_eq!(
            kafka_version(&cmd("/x/kafka-clients-4.1.1.jar")).as_deref(),
            Some("4.1.1")
        );
        assert_eq!(kafka_version(&cmd("/x/other.jar")), None);
        assert_eq!(kafka_version(&["java".into()]), None);
    }

    #[test]
    fn jvm_options_are_the_x_options_before_the_main_class() {
        let c: Vec<String> = [
            "/usr/bin/java",
            "-Xmx512m",
            "-XX:+UseG1GC",
            "-Dx=1",
            "-cp",
            "/x/*",
            "-XX:-UseCodeCacheFlushing",
            "kafka.Kafka",
            "-Xnot-a-jvm-option",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            jvm_options(&[c.clone(), c]),
            vec!["-XX:+UseG1GC", "-XX:-UseCodeCacheFlushing", "-Xmx512m"]
        );
    }
}
