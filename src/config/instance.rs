//! Per-instance settings: the default `kafka.instance_id`, this host's name
//! (static membership and transactional ids derive from it).

/// The default `kafka.instance_id`: this host's name, which is distinct per
/// host, container and Kubernetes pod and stable across restarts of one (static
/// membership and transactional ids rely on both). `HOSTNAME` first (Kubernetes
/// sets it to the pod's name, Docker to the container's id), then the system's
/// host name.
pub fn default_instance_id() -> String {
    instance_id_from(std::env::var("HOSTNAME").ok(), system_hostname)
}

/// [`default_instance_id`] from its sources: the first usable name, made of
/// the characters Kafka accepts in a `group.instance.id` (`[A-Za-z0-9._-]`,
/// anything else becomes `-`) and at most 200 of them; `stepgate-0` only when
/// no source names the host.
pub fn instance_id_from(
    hostname_env: Option<String>,
    system: impl FnOnce() -> Option<String>,
) -> String {
    fn usable(name: Option<String>) -> Option<String> {
        let name = name?;
        let name = name.trim();
        if name.is_empty() {
            return None;
        }
        Some(
            name.chars()
                .take(200)
                .map(|c| {
                    if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                        c
                    } else {
                        '-'
                    }
                })
                .collect(),
        )
    }
    usable(hostname_env)
        .or_else(|| usable(system()))
        .unwrap_or_else(|| "stepgate-0".to_owned())
}

/// The kernel's host name (`gethostname(2)`), else `/etc/hostname`.
fn system_hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what we pass;
    // gethostname writes at most that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        if let Ok(name) = std::str::from_utf8(&buf[..end])
            && !name.trim().is_empty()
        {
            return Some(name.to_owned());
        }
    }
    std::fs::read_to_string("/etc/hostname").ok()
}
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KafkaConfig;

    #[test]
    fn the_default_instance_id_is_the_host_name() {
        let sys = |name: &'static str| move || Some(name.to_owned());
        // Kubernetes sets HOSTNAME to the pod's name.
        assert_eq!(
            instance_id_from(Some("gate-7f9c-x2x".into()), sys("node")),
            "gate-7f9c-x2x"
        );
        // Without it, the system's host name (as gethostname or /etc/hostname give it).
        assert_eq!(instance_id_from(None, sys("build-box\n")), "build-box");
        assert_eq!(instance_id_from(Some("  ".into()), sys("h1")), "h1");
        // Only characters Kafka takes in a group.instance.id, and a bounded length.
        assert_eq!(
            instance_id_from(Some("a b/c:d".into()), sys("x")),
            "a-b-c-d"
        );
        assert_eq!(instance_id_from(Some("h".repeat(300)), sys("x")).len(), 200);
        assert_eq!(instance_id_from(None, || None), "stepgate-0");
        // Stable: the same host gives the same id each time (restarts keep
        // their static membership and transactional ids).
        assert_eq!(default_instance_id(), default_instance_id());
        assert_eq!(KafkaConfig::default().instance_id, default_instance_id());
        assert!(!default_instance_id().is_empty());
    }
}
