//! The command line's defaults, as the docs give them.

use std::process::Command;

fn check_config_in(dir: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_stepgate"))
        .arg("check-config")
        .current_dir(dir)
        .env_remove("STEPGATE_CONFIG")
        .env_remove("STEPGATE_KAFKA_BROKERS")
        .output()
        .expect("stepgate runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Without `--config`, every command reads `./stepgate.toml`, the file the
/// docs have a newcomer write; without one, the defaults.
#[test]
fn a_command_without_config_reads_stepgate_toml_here() {
    let dir = tempfile::tempdir().unwrap();
    assert!(
        check_config_in(dir.path()).contains("brokers = \"127.0.0.1:9092\""),
        "the default brokers without a file"
    );
    std::fs::write(
        dir.path().join("stepgate.toml"),
        "[kafka]\nbrokers = \"127.0.0.1:19999\"\n",
    )
    .unwrap();
    let shown = check_config_in(dir.path());
    assert!(shown.contains("brokers = \"127.0.0.1:19999\""), "{shown}");
}
