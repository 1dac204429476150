//! The fixtures the config's tests share, and the tests of `[tools.*]` tables
//! and of redaction, which go through the whole `Config`.

use super::*;
use std::time::Duration;

pub(super) const SAMPLE: &str = r#"
[kafka]
brokers = "10.0.0.1:9092"

[state]
retention = "2d"

[tools.send_email]
category = "keyed"
url = "http://127.0.0.1:8080/send_email"
timeout = "5s"
"#;

pub(super) fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

#[test]
fn unkeyed_tools_take_a_policy_and_only_they_do() {
    let load =
        |t: &str| Config::from_toml_str(&format!("[tools.t]\nurl = \"http://h/t\"\n{t}"), env(&[]));
    let c = load("category = \"unkeyed\"\n").unwrap();
    assert_eq!(c.tools["t"].policy, Policy::InDoubt);
    for (text, policy) in [
        ("approval", Policy::Approval),
        ("last_step", Policy::LastStep),
        ("in_doubt", Policy::InDoubt),
    ] {
        let c = load(&format!("category = \"unkeyed\"\npolicy = \"{text}\"\n")).unwrap();
        assert_eq!(c.tools["t"].policy, policy);
    }
    let e = load("category = \"keyed\"\npolicy = \"approval\"\n").unwrap_err();
    assert!(e.to_string().contains("unkeyed tools only"), "{e}");
    let e = load("category = \"unkeyed\"\npolicy = \"sometimes\"\n").unwrap_err();
    assert!(e.to_string().contains("sometimes"), "{e}");
}

#[test]
fn mcp_annotations_choose_a_category_unless_one_is_given() {
    let cases = [
        ("{readOnlyHint = true}", Category::ReadOnly),
        (
            "{readOnlyHint = false, idempotentHint = true}",
            Category::Idempotent,
        ),
        ("{destructiveHint = false}", Category::Unkeyed),
        (
            "{destructiveHint = true, openWorldHint = true}",
            Category::Unkeyed,
        ),
        ("{}", Category::Unkeyed),
    ];
    for (ann, want) in cases {
        let c = Config::from_toml_str(
            &format!("[tools.t]\nurl = \"http://h/t\"\nannotations = {ann}\n"),
            env(&[]),
        )
        .unwrap();
        assert_eq!(c.tools["t"].category, want, "{ann}");
    }
    let c = Config::from_toml_str(
        "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\nannotations = {readOnlyHint = true}\n",
        env(&[]),
    )
    .unwrap();
    assert_eq!(
        c.tools["t"].category,
        Category::Keyed,
        "explicit config overrides"
    );
    let e = Config::from_toml_str("[tools.t]\nurl = \"http://h/t\"\n", env(&[])).unwrap_err();
    assert!(e.to_string().contains("needs `category`"), "{e}");
}

#[test]
fn a_tool_is_served_over_http_or_over_mcp() {
    let c = Config::from_toml_str(
        "[tools.a]\ncategory = \"keyed\"\nmcp = \"http://h/mcp\"\n\
         [tools.b]\ncategory = \"keyed\"\nmcp = \"http://h/mcp\"\nmcp_tool = \"open\"\n\
         description = \"Open one.\"\ninput_schema = { type = \"object\" }\n\
         [tools.c]\ncategory = \"keyed\"\nurl = \"http://h/c\"\n",
        env(&[]),
    )
    .unwrap();
    assert_eq!(c.tools["a"].url, "http://h/mcp");
    assert_eq!(c.tools["a"].mcp_name("a"), Some("a"));
    assert_eq!(c.tools["b"].mcp_name("b"), Some("open"));
    assert_eq!(c.tools["b"].description.as_deref(), Some("Open one."));
    assert_eq!(
        c.tools["b"].input_schema.as_ref().unwrap()["type"],
        "object"
    );
    assert_eq!(c.tools["c"].mcp_name("c"), None);
    for (toml, wanted) in [
        ("url = \"http://h/x\"\nmcp = \"http://h/mcp\"", "not both"),
        ("", "needs `url`"),
        ("mcp = \"stdio:server\"", "tools.x.mcp"),
    ] {
        let e = Config::from_toml_str(
            &format!("[tools.x]\ncategory = \"keyed\"\n{toml}\n"),
            env(&[]),
        )
        .unwrap_err();
        assert!(e.to_string().contains(wanted), "{toml}: {e}");
    }
}

#[test]
fn provider_key_settings_are_checked() {
    let c = Config::from_toml_str(SAMPLE, env(&[])).unwrap();
    assert_eq!(c.tools["send_email"].idempotency_header, "Idempotency-Key");
    let e = Config::from_toml_str(
        "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\nidempotency_header = \"bad header\"\n",
        env(&[]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("tools.t.idempotency_header"), "{e}");
    let e = Config::from_toml_str(
        "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\nidempotency_field = \"a..b\"\n",
        env(&[]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("tools.t.idempotency_field"), "{e}");
}

#[test]
fn tool_deadline_covers_every_try() {
    let c = Config::from_toml_str(SAMPLE, env(&[])).unwrap();
    let t = &c.tools["send_email"];
    // 3 tries × 5 s + 200 ms + 400 ms of backoff
    assert_eq!(t.deadline(), Duration::from_millis(15_600));
}

#[test]
fn output_cap_and_concurrency_limit_are_checked() {
    let load = |t: &str| {
        Config::from_toml_str(
            &format!(
                "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\ntimeout = \"5s\"\n{t}"
            ),
            env(&[]),
        )
    };
    let c = load("").unwrap();
    assert_eq!(c.tools["t"].max_output_bytes, 512 * 1024);
    assert_eq!(c.tools["t"].max_concurrency, None);
    let c = load("max_output_bytes = 4096\nmax_concurrency = 2\n").unwrap();
    assert_eq!(c.tools["t"].max_output_bytes, 4096);
    assert_eq!(c.tools["t"].max_concurrency, Some(2));
    assert_eq!(
        c.tools["t"].queue_timeout.0,
        Duration::from_secs(5),
        "defaults to timeout"
    );
    // Each of the 3 tries may wait for a slot as long as it may run.
    assert_eq!(c.tools["t"].deadline(), Duration::from_millis(30_600));
    let c = load("max_concurrency = 2\nqueue_timeout = \"1s\"\n").unwrap();
    assert_eq!(c.tools["t"].deadline(), Duration::from_millis(18_600));
    for (line, field) in [
        ("max_output_bytes = 0", "tools.t.max_output_bytes"),
        ("max_concurrency = 0", "tools.t.max_concurrency"),
        ("queue_timeout = \"0s\"", "tools.t.queue_timeout"),
    ] {
        let e = load(&format!("{line}\n")).unwrap_err();
        assert!(e.to_string().contains(field), "{e}");
    }
    let e = load("max_output_bytes = -1\n").unwrap_err();
    assert!(e.to_string().contains("max_output_bytes"), "{e}");
    let c = Config::from_toml_str(
        "[tools.t]\nurl = \"http://h/t\"\ncategory = \"keyed\"\nmax_concurrency = 2\n",
        env(&[("STEPGATE_TOOLS_T_MAX_CONCURRENCY", "3")]),
    )
    .unwrap();
    assert_eq!(c.tools["t"].max_concurrency, Some(3));
}

fn tool_with(headers: &str) -> Result<Config, ConfigError> {
    Config::from_toml_str(
        &format!("[tools.pay]\ncategory = \"keyed\"\nurl = \"http://h/pay\"\n{headers}"),
        env(&[]),
    )
}

#[test]
fn tool_headers_resolve_from_env_file_or_literal() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("key");
    std::fs::write(&file, "  secret-from-file\r\n").unwrap();
    let mut c = tool_with(&format!(
        "headers = {{ Authorization = \"env:PAY_TOKEN\", \"X-Api-Key\" = \"file:{}\", \"X-Tenant\" = \"acme\" }}\n",
        file.display()
    ))
    .unwrap();
    let h = &c.tools["pay"].headers;
    assert_eq!(
        h["Authorization"].source,
        HeaderSource::Env("PAY_TOKEN".into())
    );
    assert_eq!(h["Authorization"].value(), None, "not read before start");
    assert_eq!(h["X-Tenant"].value(), Some("acme"));
    c.resolve_tool_headers(|v| (v == "PAY_TOKEN").then(|| "Bearer abc".into()))
        .unwrap();
    let h = &c.tools["pay"].headers;
    assert_eq!(h["Authorization"].value(), Some("Bearer abc"));
    assert_eq!(h["X-Api-Key"].value(), Some("secret-from-file"));
    // Serialized as configured, so check-config shows where values come from.
    let out = toml::to_string(&c).unwrap();
    assert!(out.contains("env:PAY_TOKEN"), "{out}");
    assert!(
        !out.contains("Bearer abc") && !out.contains("secret-from-file"),
        "{out}"
    );
    // From the environment too, like every key.
    let c = Config::from_toml_str(
        "[tools.pay]\ncategory = \"keyed\"\nurl = \"http://h/pay\"\nheaders = { Authorization = \"env:A\" }\n",
        env(&[("STEPGATE_TOOLS_PAY_HEADERS_AUTHORIZATION", "env:B")]),
    )
    .unwrap();
    assert_eq!(
        c.tools["pay"].headers["Authorization"].source,
        HeaderSource::Env("B".into())
    );
}

#[test]
fn a_missing_header_secret_names_tool_and_header_never_a_value() {
    let mut c = tool_with("headers = { Authorization = \"env:PAY_TOKEN\" }\n").unwrap();
    let e = c.resolve_tool_headers(|_| None).unwrap_err().to_string();
    assert!(e.contains("tools.pay.headers.Authorization"), "{e}");
    assert!(e.contains("PAY_TOKEN") && e.contains("not set"), "{e}");
    // A value that is not a header value: refused, and not echoed.
    let e = c
        .resolve_tool_headers(|_| Some("Bearer hunter2\u{7}".into()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a valid HTTP header value"), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
    let e = c.resolve_tool_headers(|_| Some(" ".into())).unwrap_err();
    assert!(e.to_string().contains("is empty"), "{e}");
    let mut c =
        tool_with("headers = { \"X-Api-Key\" = \"file:/nonexistent/stepgate/key\" }\n").unwrap();
    let e = c.resolve_tool_headers(|_| None).unwrap_err().to_string();
    assert!(e.contains("tools.pay.headers.X-Api-Key"), "{e}");
    assert!(e.contains("/nonexistent/stepgate/key"), "{e}");
    let e = tool_with("headers = { Authorization = \"Bearer hunter2\\u0001\" }\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("tools.pay.headers.Authorization"), "{e}");
    assert!(!e.contains("hunter2"), "{e}");
}

#[test]
fn protocol_headers_cannot_be_configured() {
    for name in [
        "Idempotency-Key",
        "idempotency-key",
        "Content-Type",
        "traceparent",
        "Stepgate-Workflow-Id",
        "Host",
    ] {
        let e = tool_with(&format!("headers = {{ \"{name}\" = \"x\" }}\n")).unwrap_err();
        assert!(e.to_string().contains("cannot be set"), "{name}: {e}");
    }
    // The tool's own key header is reserved too.
    let e = tool_with(
        "idempotency_header = \"X-Request-Id\"\nheaders = { \"x-request-id\" = \"x\" }\n",
    )
    .unwrap_err();
    assert!(e.to_string().contains("X-Request-Id"), "{e}");
    for (headers, says) in [
        ("{ \"bad header\" = \"x\" }", "not a valid HTTP header name"),
        ("{ A = \"env:\" }", "needs a variable name"),
        ("{ A = \"file:\" }", "needs a path"),
        ("{ A = \"x\", a = \"y\" }", "given twice"),
    ] {
        let e = tool_with(&format!("headers = {headers}\n")).unwrap_err();
        assert!(e.to_string().contains(says), "{headers}: {e}");
    }
}

#[test]
fn urls_lose_their_credentials() {
    for (url, shown) in [
        (
            "https://bot:pw@h.example/x",
            "https://bot:redacted@h.example/x",
        ),
        ("https://tok@h.example/x", "https://redacted@h.example/x"),
        (
            "https://h.example/x?api_key=k1&q=a+b&access_token=t",
            "https://h.example/x?api_key=redacted&q=a+b&access_token=redacted",
        ),
        ("https://h.example/x?q=1", "https://h.example/x?q=1"),
        ("127.0.0.1:9092", "127.0.0.1:9092"),
    ] {
        assert_eq!(redact_url(url), shown);
    }
}

#[test]
fn debug_shows_no_secret() {
    let mut c = Config::from_toml_str(
        "[kafka.client]\n\"sasl.password\" = \"hunter2-a\"\n\"ssl.key.password\" = \"hunter2-b\"\n\
         \"sasl.oauthbearer.client.secret\" = \"hunter2-c\"\n\"ssl.key.location\" = \"/etc/k.pem\"\n\
         [tools.pay]\ncategory = \"keyed\"\nurl = \"https://u:hunter2-d@h/pay\"\n\
         headers = { Authorization = \"env:T\", \"X-Key\" = \"hunter2-e\" }\n",
        env(&[]),
    )
    .unwrap();
    c.resolve_tool_headers(|_| Some("hunter2-f".into()))
        .unwrap();
    let d = format!("{c:?}");
    assert!(!d.contains("hunter2"), "{d}");
    assert!(d.contains("/etc/k.pem") && d.contains("env:T"), "{d}");
}
