//! What one gate process holds on its host, claimed before anything else
//! starts: its instance id (static group membership and transactional ids
//! derive from it), its state directory and its HTTP address. Two processes
//! on one host that shared one of them would fence each other every few
//! seconds, fail to open the state, or fail to serve `/metrics`; every clash
//! is named at once, with the flag that ends it.
//!
//! The instance and state claims are `flock`s: the kernel drops them when
//! their process dies, however it dies, so a gate restarted after `kill -9`
//! claims them again at once.

use crate::config::Config;
use sha2::{Digest, Sha256};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClaimError {
    /// One or more of the process's claims is another process's.
    #[error("{}", clash_text(.0))]
    Clash(Vec<String>),
    #[error("cannot create {path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

fn clash_text(clashes: &[String]) -> String {
    let mut text = String::from(
        "another stepgate process on this host holds what this one needs (each process sharing the partitions needs its own):",
    );
    for c in clashes {
        text.push_str("\n- ");
        text.push_str(c);
    }
    text
}

/// The claims of a running gate, released when dropped (or when the process
/// ends).
#[derive(Debug)]
pub struct HostClaims {
    _instance: File,
    _state: File,
    /// The bound `/metrics` listener (`http.listen`), unless disabled.
    pub http: Option<TcpListener>,
}

/// Claim `config`'s instance id, state directory and HTTP address, or name
/// every one another process holds.
pub fn claim(config: &Config) -> Result<HostClaims, ClaimError> {
    let k = &config.kafka;
    let mut clashes = Vec::new();
    let instance = lock(&instance_lock_path(config))?.map_err(|pid| {
        clashes.push(format!(
            "the instance id `{}` of group `{}`{}: give this one its own `--instance-id` (kafka.instance_id, STEPGATE_KAFKA_INSTANCE_ID)",
            k.instance_id,
            k.gate_group,
            held_by(pid)
        ))
    });
    let state_dir = &config.state.path;
    std::fs::create_dir_all(state_dir).map_err(|source| ClaimError::Io {
        path: state_dir.display().to_string(),
        source,
    })?;
    let state = lock(&state_dir.join("stepgate.lock"))?.map_err(|pid| {
        clashes.push(format!(
            "the state directory `{}`{}: give this one its own `--state` (state.path, STEPGATE_STATE_PATH)",
            state_dir.display(),
            held_by(pid)
        ))
    });
    let http = if config.http.listen.is_empty() {
        Ok(None)
    } else {
        let addr: SocketAddr = config.http.listen.parse().expect("validated at load");
        match TcpListener::bind(addr) {
            Ok(l) => Ok(Some(l)),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                clashes.push(format!(
                    "`{addr}` (http.listen, where /metrics, /healthz and /readyz are served) is in use: give this one its own `--http-listen` (STEPGATE_HTTP_LISTEN), or \"\" to serve none"
                ));
                Err(())
            }
            Err(source) => {
                return Err(ClaimError::Io {
                    path: format!("a listener on {addr}"),
                    source,
                });
            }
        }
    };
    match (instance, state, http) {
        (Ok(instance), Ok(state), Ok(http)) => Ok(HostClaims {
            _instance: instance,
            _state: state,
            http,
        }),
        _ => Err(ClaimError::Clash(clashes)),
    }
}

fn held_by(pid: Option<u32>) -> String {
    match pid {
        Some(pid) => format!(" is held by process {pid}"),
        None => " is held by another process".to_owned(),
    }
}

/// Where this host's processes claim an instance id: one file per brokers,
/// group and instance id (two clusters may each have a gate of that name) in
/// the temporary directory all of this host's processes see.
fn instance_lock_path(config: &Config) -> PathBuf {
    let k = &config.kafka;
    let mut h = Sha256::new();
    for part in [&k.brokers, &k.gate_group, &k.instance_id] {
        h.update(part.as_bytes());
        h.update([0]);
    }
    let digest = crate::contract::hex(&h.finalize());
    std::env::temp_dir().join(format!("stepgate-instance-{}.lock", &digest[..32]))
}

/// Take an exclusive `flock` on `path` (made if missing) and write our pid
/// in it; `Ok(Err(pid))` when another process holds it (its pid, if the
/// file names one).
fn lock(path: &Path) -> Result<Result<File, Option<u32>>, ClaimError> {
    let io = |source| ClaimError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io)?;
    // SAFETY: the descriptor is open for the call's duration (`file` lives).
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::WouldBlock {
            return Err(io(e));
        }
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        return Ok(Err(text.trim().parse().ok()));
    }
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    write!(file, "{}", std::process::id()).map_err(io)?;
    Ok(Ok(file))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(dir: &Path, instance: &str) -> Config {
        let mut c = Config::default();
        c.kafka.instance_id = instance.into();
        c.kafka.gate_group = format!("claims-test-{}", std::process::id());
        c.state.path = dir.join("state");
        c.http.listen = "127.0.0.1:0".into();
        c
    }

    #[test]
    fn a_second_claim_of_any_part_names_each_clash_and_its_flag() {
        let dir = tempfile::tempdir().unwrap();
        let first = claim(&config(dir.path(), "gate-a")).unwrap();
        let bound = first.http.as_ref().unwrap().local_addr().unwrap();

        // Same instance, same state, same address: three clashes, one error.
        let mut same = config(dir.path(), "gate-a");
        same.http.listen = bound.to_string();
        let e = claim(&same).unwrap_err().to_string();
        for flag in ["--instance-id", "--state", "--http-listen"] {
            assert!(e.contains(flag), "{flag} missing from: {e}");
        }
        // flock is per open file description: a second claim in this very
        // process clashes too, and names it.
        assert!(
            e.contains(&format!("process {}", std::process::id())),
            "{e}"
        );

        // Only the state shared: that one clash.
        let e = claim(&config(dir.path(), "gate-b"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("--state") && !e.contains("--instance-id"), "{e}");

        // Everything its own: claimed; and after the first is dropped, its
        // claims are free again.
        let mut other = config(dir.path(), "gate-b");
        other.state.path = dir.path().join("state-b");
        let second = claim(&other).unwrap();
        drop(first);
        let again = claim(&config(dir.path(), "gate-a")).unwrap();
        drop((second, again));
    }

    #[test]
    fn no_http_listener_when_disabled() {
        let dir = tempfile::tempdir().unwrap();
        let mut c = config(dir.path(), "gate-c");
        c.http.listen = String::new();
        assert!(claim(&c).unwrap().http.is_none());
    }
}
