//! The workspace's promises about its crates: the agent-side client crate stays
//! light (an agent process links librdkafka and serde, not the server).

use std::process::Command;

#[test]
fn the_client_crate_pulls_in_no_server_dependency() {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "--offline",
            "--locked",
            "-p",
            "stepgate-client",
            "-e",
            "normal",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo runs");
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo tree: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(crates.contains(&"rdkafka"), "{tree}");
    for server_only in [
        "rocksdb",
        "librocksdb-sys",
        "rusqlite",
        "axum",
        "hyper",
        "reqwest",
        "rmcp",
        "prometheus",
        "tikv-jemallocator",
        "stepgate",
    ] {
        assert!(
            !crates.contains(&server_only),
            "stepgate-client depends on {server_only}:\n{tree}"
        );
    }
}
