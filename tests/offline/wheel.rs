//! stepgate installs without Rust: the wheel that `deploy/local/wheel.sh`
//! builds (maturin's `bin` bindings) installs into a fresh venv, offline, and
//! the `stepgate` it puts on that venv's PATH runs `--version` and the demo.
//!
//! The wheel is built with the dev profile: the tests have already built its
//! C dependencies (RocksDB, librdkafka), so it compiles stepgate and the few
//! Rust crates whose features the tests' dev-dependencies widen, not the
//! release build (~25 minutes on 2 cores). `deploy/release/archives.sh`'s
//! archive is checked the same way: its checksum, its files, its binary. And
//! the Dockerfile's build stage runs here without Docker (there is no engine on
//! these machines): its COPY and RUN steps in a directory of their own, so a
//! file the build reads but the image never copies fails here, not on a user.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, mpsc};
use std::time::Duration;

use sha2::{Digest, Sha256};

/// One packaging build at a time: both compile stepgate in the same Cargo
/// build directory, and two at once only wait on each other's lock.
static BUILD: Mutex<()> = Mutex::new(());

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The target directory this test was built in (`<target>/debug/deps/wheel-…`),
/// whose dependencies the wheel's build reuses.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    exe.ancestors()
        .nth(3)
        .expect("<target>/<profile>/deps/<test>")
        .to_path_buf()
}

/// Runs `cmd` to its end, or kills it (and every process it started) after
/// `limit`: a wedged build fails the test instead of hanging the suite.
fn run(mut cmd: Command, limit: Duration) -> Output {
    let what = format!("{cmd:?}");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{what}: {e}"));
    let pid = child.id() as i32;
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    // Both pipes drained as the child writes, so a chatty build never blocks.
    let stderr = std::thread::spawn(move || {
        let mut buf = Vec::new();
        err.read_to_end(&mut buf).map(|_| buf)
    });
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut stdout = Vec::new();
        let read = out.read_to_end(&mut stdout);
        let _ = tx.send((read.map(|_| stdout), child.wait()));
    });
    match rx.recv_timeout(limit) {
        Ok((stdout, status)) => Output {
            status: status.expect("wait"),
            stdout: stdout.expect("stdout"),
            stderr: stderr.join().unwrap().expect("stderr"),
        },
        Err(_) => {
            // SAFETY: signals the process group this test started.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            panic!("{what} did not finish within {limit:?}");
        }
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn succeeded(out: &Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what}: {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    text(&out.stdout)
}

#[test]
fn the_wheel_installs_in_a_fresh_venv_and_runs_the_demo() {
    let dir = tempfile::tempdir().unwrap();
    let wheels = dir.path().join("wheels");

    let guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let mut build = Command::new("bash");
    build
        .arg(root().join("deploy/local/wheel.sh"))
        .args(["--dev", "--out"])
        .arg(&wheels)
        .env("CARGO_TARGET_DIR", target_dir())
        .current_dir(root());
    let built = succeeded(
        &run(build, Duration::from_secs(45 * 60)),
        "deploy/local/wheel.sh",
    );
    drop(guard);
    let wheel = PathBuf::from(built.lines().last().expect("the wheel's path").trim());
    let name = wheel.file_name().unwrap().to_string_lossy().into_owned();
    assert!(wheel.starts_with(&wheels) && wheel.is_file(), "{built}");
    // A platform wheel for any Python 3 (the binary is the payload), under the
    // distribution's own name, at the crate's version.
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        name.starts_with(&format!("stepgate_server-{version}-py3-none-"))
            && name.ends_with(".whl")
            && name.contains("linux"),
        "{name}"
    );

    // A fresh venv, and nothing from the network: the wheel is all it needs.
    let venv = dir.path().join("venv");
    let mut create = Command::new("python3");
    create.args(["-m", "venv"]).arg(&venv);
    succeeded(&run(create, Duration::from_secs(300)), "python3 -m venv");
    let mut install = Command::new(venv.join("bin/python"));
    install
        .args(["-m", "pip", "install", "--no-index", "--no-cache-dir"])
        .arg(&wheel)
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1");
    succeeded(&run(install, Duration::from_secs(300)), "pip install");

    let stepgate = venv.join("bin/stepgate");
    assert!(stepgate.is_file(), "pip put no stepgate in {venv:?}/bin");
    // Run from elsewhere, so nothing of the checkout or the build is found by
    // accident: the venv's program is what answers.
    let installed = |args: &[&str]| {
        let mut cmd = Command::new(&stepgate);
        cmd.args(args)
            .current_dir(dir.path())
            .env_remove("LD_LIBRARY_PATH");
        cmd
    };
    let version_line = succeeded(
        &run(installed(&["--version"]), Duration::from_secs(120)),
        "stepgate --version",
    );
    assert_eq!(version_line.trim(), format!("stepgate {version}"));

    let demo = run(
        installed(&["demo", "--metrics", "127.0.0.1:0"]),
        Duration::from_secs(600),
    );
    let tour = succeeded(&demo, "stepgate demo");
    assert!(tour.starts_with("stepgate demo"), "{tour}");
    let line = |needle: &str| {
        tour.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with `{needle}`:\n{tour}"))
            .to_owned()
    };
    // The tour's key lines (tests/offline/demo.rs checks every one on the built binary).
    assert!(line("send_email ran 1 time(s)").contains("original answer"));
    assert!(line("retry     call_002").contains("deduplicated=true"));
    assert!(tour.contains("create_ticket ran 2 times"), "{tour}");
    assert!(line("first     call_006").contains("status=in_doubt"));
    assert!(tour.contains("wire_transfer ran 1 time(s)"), "{tour}");
    assert!(line("typo").contains("status=rejected"));
}

#[test]
fn the_release_archive_matches_its_checksum_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let dist = dir.path().join("dist");
    let guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let mut build = Command::new("bash");
    build
        .arg(root().join("deploy/release/archives.sh"))
        .args(["--dev", "--no-wheel", "--out"])
        .arg(&dist)
        .env("CARGO_TARGET_DIR", target_dir())
        .current_dir(root());
    let built = succeeded(
        &run(build, Duration::from_secs(45 * 60)),
        "deploy/release/archives.sh",
    );
    drop(guard);
    let files: Vec<PathBuf> = built.lines().map(PathBuf::from).collect();
    let [archive, sum] = &files[..] else {
        panic!("an archive and its checksum: {built}")
    };
    let version = env!("CARGO_PKG_VERSION");
    let name = archive.file_name().unwrap().to_string_lossy().into_owned();
    let stem = name.strip_suffix(".tar.gz").expect("a .tar.gz");
    assert!(
        stem.starts_with(&format!("stepgate-{version}-")) && stem.contains("linux"),
        "{name}"
    );
    assert_eq!(sum, &dist.join(format!("{name}.sha256")));

    // `sha256sum`'s format, naming the archive beside it.
    let digest: String = Sha256::digest(std::fs::read(archive).unwrap())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        std::fs::read_to_string(sum).unwrap(),
        format!("{digest}  {name}\n")
    );

    let mut unpack = Command::new("tar");
    unpack.arg("-xzf").arg(archive).current_dir(dir.path());
    succeeded(&run(unpack, Duration::from_secs(300)), "tar -xzf");
    let unpacked = dir.path().join(stem);
    for file in ["stepgate", "README.md", "LICENSE", "stepgate.example.toml"] {
        assert!(unpacked.join(file).is_file(), "{file} not in {name}");
    }
    let mut version_cmd = Command::new(unpacked.join("stepgate"));
    version_cmd
        .arg("--version")
        .current_dir(dir.path())
        .env_remove("LD_LIBRARY_PATH");
    let version_line = succeeded(
        &run(version_cmd, Duration::from_secs(120)),
        "stepgate --version",
    );
    assert_eq!(version_line.trim(), format!("stepgate {version}"));
}

/// The Dockerfile's build stage (its first `FROM` to the next): instructions
/// joined across `\` continuations, split into the instruction and the rest.
fn build_stage(dockerfile: &str) -> Vec<(String, String)> {
    let mut steps = Vec::new();
    let mut line = String::new();
    for raw in dockerfile.lines() {
        let raw = raw.trim();
        if line.is_empty() && (raw.is_empty() || raw.starts_with('#')) {
            continue;
        }
        match raw.strip_suffix('\\') {
            Some(part) => line.push_str(part),
            None => {
                line.push_str(raw);
                let (op, rest) = line.split_once(' ').unwrap_or((&line, ""));
                steps.push((op.to_uppercase(), rest.trim().to_owned()));
                line.clear();
            }
        }
    }
    let from: Vec<usize> = (0..steps.len()).filter(|&i| steps[i].0 == "FROM").collect();
    assert!(from.len() >= 2, "a build stage and a runtime stage");
    steps[from[0] + 1..from[1]].to_vec()
}

fn copy_tree(from: &std::path::Path, to: &std::path::Path) {
    if from.is_dir() {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            copy_tree(&e.path(), &to.join(e.file_name()));
        }
    } else {
        std::fs::copy(from, to).unwrap_or_else(|e| panic!("COPY {from:?}: {e}"));
    }
}

#[test]
fn the_images_build_stage_builds_from_what_the_dockerfile_copies() {
    let dockerfile = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let steps = build_stage(&dockerfile);
    // A fixed place, so repeated runs reuse its artefacts in the build dir.
    let context = target_dir().join("dockerfile-build");
    let _ = std::fs::remove_dir_all(&context);
    std::fs::create_dir_all(&context).unwrap();
    let mut workdir = context.clone();
    let guard = BUILD.lock().unwrap_or_else(|e| e.into_inner());
    let mut cargo_builds = 0;
    for (op, rest) in &steps {
        match op.as_str() {
            "WORKDIR" => {
                workdir = context.join(rest.trim_start_matches('/'));
                std::fs::create_dir_all(&workdir).unwrap();
            }
            "COPY" => {
                let args: Vec<&str> = rest.split_whitespace().collect();
                assert!(!args[0].starts_with("--"), "COPY {rest}");
                let (dest, sources) = args.split_last().unwrap();
                let into = workdir.join(dest);
                if dest.ends_with('/') || sources.len() > 1 {
                    std::fs::create_dir_all(&into).unwrap();
                    for s in sources {
                        copy_tree(
                            &root().join(s),
                            &into.join(Path::new(s).file_name().unwrap()),
                        );
                    }
                } else {
                    copy_tree(&root().join(sources[0]), &into);
                }
            }
            // The system packages are the image's; this machine has its own.
            "RUN" if rest.starts_with("apt-get") => {}
            "RUN" => {
                // A dev build, with the dependencies the tests built: the
                // same sources and manifests, not the ~25-minute release one.
                cargo_builds += rest.matches("cargo build --release").count();
                let mut sh = Command::new("sh");
                sh.arg("-c")
                    .arg(rest.replace("cargo build --release", "cargo build"))
                    .current_dir(&workdir)
                    .env("CARGO_BUILD_BUILD_DIR", target_dir())
                    .env("CARGO_TARGET_DIR", workdir.join("target"));
                succeeded(
                    &run(sh, Duration::from_secs(45 * 60)),
                    &format!("RUN {rest}"),
                );
            }
            _ => {}
        }
    }
    drop(guard);
    assert_eq!(cargo_builds, 2, "the dependencies' layer, then stepgate's");
    assert!(workdir.starts_with(&context));
    let mut version = Command::new(workdir.join("target/debug/stepgate"));
    version.arg("--version").env_remove("LD_LIBRARY_PATH");
    let line = succeeded(
        &run(version, Duration::from_secs(120)),
        "stepgate --version",
    );
    assert_eq!(
        line.trim(),
        format!("stepgate {}", env!("CARGO_PKG_VERSION"))
    );
    // The runtime stage copies the binary from where the build stage wrote it.
    assert!(
        dockerfile.contains("COPY --from=build /src/target/release/stepgate "),
        "the runtime stage's COPY of the binary"
    );
    let _ = std::fs::remove_dir_all(&context);
}
