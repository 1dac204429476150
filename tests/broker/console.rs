//! `stepgate console` in a real headless Chromium (Debian's `chromium`,
//! driven by Playwright for Python: tests/console/driver.py), against the real
//! broker, a running gate and the test's tool server: held calls show up live
//! and are approved or denied, an in-doubt step is resolved so the agent's
//! retry runs, a viewer cannot act, no page shows a tool header's secret; the
//! Overview shows each partition ready on the gate, read from its `/metrics`.
//!
//! With `STEPGATE_CONSOLE_SCREENSHOTS=DIR` it saves the screenshots of the
//! Inbox, the in-doubt view and a timeline there (docs/ holds the last ones).

use crate::common;

use common::*;
use serde_json::{Value, json};
use std::process::Stdio;
use std::time::Duration;
use stepgate::contract::Status;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout};

/// A tool header's secret: no page may show it, wherever it turns up.
const SECRET: &str = "sk-live-CONSOLE-SECRET-4711";
/// The token of a tool's `Authorization: Bearer …` header: no page may show
/// it either, even alone (as a tool that echoes its key writes it).
const BARE: &str = "bare-token-value-0042";
/// A value hidden because its field is named like a credential: an approver
/// may reveal it, a viewer never gets it.
const HIDDEN: &str = "tok_live_visible_123";

const TOOLS: &str = r#"
[tools.wire_money]
category = "unkeyed"
policy = "approval"
url = "{tools}/wire_money"
timeout = "2s"
headers = { "X-Api-Key" = "sk-live-CONSOLE-SECRET-4711", Authorization = "Bearer bare-token-value-0042" }
"#;

/// The agent's trace: the timeline links the step to it.
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

const ALICE: &str = "alice-approver-token-0001";
const OLIVIA: &str = "olivia-operator-token-0001";
const VICTOR: &str = "victor-viewer-token-00001";

fn configure(c: &mut stepgate::config::Config) {
    c.console = toml::from_str(
        r#"
roles = { alice = "approver", olivia = "operator", victor = "viewer" }
tokens = [
  { name = "alice", token = "alice-approver-token-0001" },
  { name = "olivia", token = "olivia-operator-token-0001" },
  { name = "victor", token = "victor-viewer-token-00001" },
]
trace_url = "http://127.0.0.1:16686/trace/{trace_id}"
refresh = "500ms"
"#,
    )
    .expect("the console's test config");
    // The stack's gate, and a listed gate nothing answers for (loopback port 1).
    c.console.gates = vec![format!("http://{}", c.http.listen), DOWN_GATE.into()];
}

/// A listed gate that is not there.
const DOWN_GATE: &str = "http://127.0.0.1:1";

/// The browser, one command at a time.
struct Browser {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Browser {
    async fn start(base: &str) -> Browser {
        let mut child = tokio::process::Command::new("python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/tests/console/driver.py"
            ))
            .arg(base)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs (deploy/local/deps.sh installs playwright)");
        let stdin = child.stdin.take().unwrap();
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut b = Browser {
            child,
            stdin,
            lines,
        };
        let ready = b.read().await;
        assert_eq!(ready["ready"], true, "{ready}");
        b
    }

    async fn read(&mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(90), self.lines.next_line())
            .await
            .expect("the browser answers within 90 s")
            .expect("reading the browser's answer")
            .expect("the browser is still running (is playwright installed?)");
        serde_json::from_str(&line).unwrap_or_else(|_| panic!("not JSON: {line}"))
    }

    async fn send(&mut self, cmd: &str) {
        self.stdin
            .write_all(format!("{cmd}\n").as_bytes())
            .await
            .unwrap();
        self.stdin.flush().await.unwrap();
    }

    /// A command and its answer, which must not be an error.
    async fn cmd(&mut self, cmd: &str) -> Value {
        self.send(cmd).await;
        let a = self.read().await;
        assert!(a.get("error").is_none(), "browser: {cmd}: {a}");
        a
    }

    async fn screenshot(&mut self, name: &str) {
        if let Ok(dir) = std::env::var("STEPGATE_CONSOLE_SCREENSHOTS") {
            let path = std::path::Path::new(&dir).join(name);
            self.cmd(&format!("screenshot {}", path.display())).await;
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

async fn console_ready(base: &str) {
    let c = reqwest::Client::new();
    let until = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(r) = c.get(format!("{base}/readyz")).send().await
            && r.status().is_success()
        {
            return;
        }
        assert!(
            std::time::Instant::now() < until,
            "the console did not read the topics in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A form's body (the test's values need no escaping but `%`-escape anyway).
fn urlencoded(form: &[(&str, String)]) -> String {
    form.iter()
        .map(|(k, v)| format!("{k}={}", stepgate::console::percent(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// The CSRF cookie (`name=value`) and the forms' token of a page as `token`
/// sees it: the token is derived from the cookie and the principal.
async fn csrf_pair(base: &str, token: &str) -> (String, String) {
    let r = reqwest::Client::new()
        .get(format!("{base}/inbox"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let cookie = set_cookies(&r)
        .into_iter()
        .find(|c| c.starts_with("stepgate_console_csrf="))
        .expect("a CSRF cookie for a request without one");
    let cookie = cookie.split(';').next().unwrap().to_owned();
    let page = r.text().await.unwrap();
    (cookie, field(&page, "csrf"))
}

/// A response's `Set-Cookie` values.
fn set_cookies(r: &reqwest::Response) -> Vec<String> {
    r.headers()
        .get_all("set-cookie")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect()
}

/// The banner of the page a decision's redirect leads to, as `token` sees it.
async fn banner(base: &str, token: &str, location: &str) -> String {
    let (_, _, page) = get_as(base, location, token).await;
    let start = page
        .find("class=\"notice")
        .unwrap_or_else(|| panic!("no banner on {location}: {page}"));
    let end = page[start..].find("</p>").unwrap() + start;
    page[start..end].to_owned()
}

/// A form posted as `token` with a valid CSRF pair: its status and `Location`.
async fn post_form(
    base: &str,
    token: &str,
    path: &str,
    mut form: Vec<(&str, String)>,
) -> (u16, String) {
    let (cookie, csrf) = csrf_pair(base, token).await;
    form.push(("csrf", csrf));
    let r = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(format!("{base}{path}"))
        .bearer_auth(token)
        .header("cookie", cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(urlencoded(&form))
        .send()
        .await
        .unwrap();
    let location = r
        .headers()
        .get("location")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (r.status().as_u16(), location)
}

/// The values of a page's hidden inputs named `name`.
fn field_values(page: &str, name: &str) -> Vec<String> {
    let marker = format!("name=\"{name}\" value=\"");
    page.match_indices(&marker)
        .map(|(i, _)| {
            let rest = &page[i + marker.len()..];
            rest[..rest.find('"').unwrap()].to_owned()
        })
        .collect()
}

fn field(page: &str, name: &str) -> String {
    field_values(page, name)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("no {name} in {page}"))
}

/// A page once it shows `text` (within 15 s).
async fn eventually_page(base: &str, path: &str, token: &str, text: &str) -> String {
    for _ in 0..300 {
        let (_, _, page) = get_as(base, path, token).await;
        if page.contains(text) {
            return page;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{path} did not show {text} in 15 s");
}

/// A page as `token` sees it: status, CSP header, body.
async fn get_as(base: &str, path: &str, token: &str) -> (u16, String, String) {
    let r = reqwest::Client::new()
        .get(format!("{base}{path}"))
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    let csp = r
        .headers()
        .get("content-security-policy")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (r.status().as_u16(), csp, r.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn people_in_the_loop_decide_in_the_console() {
    let s = {
        let mut s = Stack::new(StackOptions {
            tool_tables: TOOLS.to_owned(),
            configure,
            ..StackOptions::default()
        })
        .await;
        s.start().await;
        s
    };
    // The gate exports each partition as its own and restored, from its assignment.
    let partitions = s.config.kafka.partitions;
    for p in 0..partitions {
        let m = s
            .metrics_until(
                &format!("stepgate_partition_ready{{partition=\"{p}\"}} 1"),
                Duration::from_secs(10),
            )
            .await;
        assert!(
            m.contains(&format!("stepgate_partition_owned{{partition=\"{p}\"}} 1")),
            "{m}"
        );
        let since: f64 = m
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "stepgate_partition_ready_timestamp_seconds{{partition=\"{p}\"}} "
                ))
            })
            .expect("when the partition became ready")
            .parse()
            .unwrap();
        assert!(since > 1.7e9, "{since}");
    }
    let agent = s.agent();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _console = Killed(
        std::process::Command::new(stepgate_bin())
            .args(["console", "--config"])
            .arg(&s.config_path)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(s.dir.path().join("console.log")).unwrap())
            .spawn()
            .expect("stepgate console starts"),
    );
    console_ready(&base).await;

    // Earlier steps of the workflow whose payment is then held.
    let r = agent
        .call(intent(
            "order-7781",
            0,
            "search",
            json!({"q": "order 7781"}),
            "c0",
        ))
        .await;
    assert_eq!(r.status, Status::Ok);
    let r = agent
        .call(intent(
            "order-7781",
            1,
            "send_email",
            json!({"to": "ana@example.com", "subject": "Your refund"}),
            "c1",
        ))
        .await;
    assert_eq!(r.status, Status::Ok);

    let mut b = Browser::start(&base).await;
    let signed_in = b.cmd(&format!("login {ALICE}")).await;
    assert!(
        signed_in["url"].as_str().unwrap().ends_with("/inbox"),
        "{signed_in}"
    );

    // The Overview: every partition ready, owned by the stack's gate (read
    // from its /metrics); the listed gate that is not there, unreachable.
    let gate = format!("http://{}", s.http);
    let ready_rows = format!("tr[data-state=ready][data-owner='{gate}']");
    let until = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        b.cmd("goto /overview").await;
        if b.cmd(&format!("count {ready_rows}")).await["n"] == partitions {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the overview did not show {partitions} partitions ready on {gate} in 20 s: {}",
            b.cmd("text").await["text"]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(b.cmd("count tr[data-partition]").await["n"], partitions);
    let text = b.cmd("text").await["text"].as_str().unwrap().to_owned();
    assert!(text.contains("ready since"), "{text}");
    assert!(
        text.contains(" records in "),
        "the last restore's figures: {text}"
    );
    assert!(
        text.contains(&format!("{DOWN_GATE}: unreachable")),
        "{text}"
    );
    // Back to the Inbox, where the rest begins.
    b.cmd("goto /inbox").await;

    // A held call appears in the open Inbox, without a reload, within 2 s.
    b.send("wait_card order-7781 15000").await;
    let held = intent(
        "order-7781",
        2,
        "wire_money",
        json!({"amount_eur": 1250, "iban": "DE89 3704 0044 0532 0130 00",
               "memo": format!("refund, auth {SECRET}"), "api_key": SECRET,
               "note": format!("key {BARE}"), "payment_token": HIDDEN,
               "password": "hunter2-first"}),
        "c2",
    );
    agent
        .send_raw(
            "order-7781",
            held.to_string().as_bytes(),
            None,
            &[("traceparent", TRACEPARENT)],
        )
        .await;
    let shown = b.read().await;
    assert!(shown.get("error").is_none(), "{shown}");
    let (ms, held_ms) = (
        shown["ms"].as_u64().unwrap(),
        shown["since_held_ms"].as_i64().unwrap(),
    );
    eprintln!(
        "a held call appeared in the open Inbox {held_ms} ms after the gate held it ({ms} ms after the agent sent it)"
    );
    assert!(
        held_ms <= 2000,
        "the held call took {held_ms} ms to appear after it was held"
    );
    // The model asks again, rephrased, while it waits: the timeline shows the diff.
    agent
        .send(&intent(
            "order-7781",
            2,
            "wire_money",
            json!({"amount_eur": 1250, "iban": "DE89370400440532013000",
                   "memo": format!("refund, auth {SECRET}"), "api_key": SECRET,
                   "note": format!("key {BARE}"), "payment_token": HIDDEN,
                   "password": "hunter2-second"}),
            "c2-again",
        ))
        .await;
    let html = b.cmd("html").await["html"].as_str().unwrap().to_owned();
    assert!(!html.contains(SECRET), "the Inbox shows the tool's secret");
    assert!(
        !html.contains(BARE),
        "the Inbox shows the bare token of a tool's header"
    );
    assert!(html.contains("DE89 3704"));
    // A value hidden by its field's name is said to be hidden, and the
    // approver reveals it on demand.
    let text = b.cmd("text").await["text"].as_str().unwrap().to_owned();
    assert!(
        text.contains("hidden because the field is named like a credential"),
        "{text}"
    );
    assert!(text.contains("payment_token"), "{text}");
    assert_eq!(b.cmd(&format!("visible {HIDDEN}")).await["visible"], false);
    b.cmd("click_text Show the hidden values").await;
    assert_eq!(
        b.cmd(&format!("visible {HIDDEN}")).await["visible"],
        true,
        "the approver revealed the hidden value"
    );
    let html = b.cmd("html").await["html"].as_str().unwrap().to_owned();
    assert!(
        !html.contains(SECRET) && !html.contains(BARE),
        "a configured secret is never revealed"
    );
    // A viewer is told it is hidden, and never sent it.
    let (_, _, viewed) = get_as(&base, "/inbox", VICTOR).await;
    assert!(
        viewed.contains("payment_token") && !viewed.contains(HIDDEN),
        "{viewed}"
    );
    b.screenshot("console-inbox.png").await;

    // Approve: the agent gets its answer, the tool ran once, and the
    // timeline says who decided.
    let done = b.cmd("click_in_card order-7781 Approve — run it").await;
    assert!(
        done["notice"]
            .as_str()
            .unwrap()
            .contains("Approved by alice: wire_money in workflow order-7781 (step 2)"),
        "{done}"
    );
    assert_eq!(
        b.cmd("count .notice a.timeline[href='/workflows/order-7781']")
            .await["n"],
        1,
        "the banner links to the workflow's timeline"
    );
    let answer = agent.answer("c2", Duration::from_secs(30)).await;
    assert_eq!(answer.status, Status::Ok, "{answer:?}");
    eventually(Duration::from_secs(10), "the approved call ran", || {
        s.tools.count("wire_money") == 1
    })
    .await;
    b.cmd("goto /workflows/order-7781").await;
    let text = b.cmd("text").await["text"].as_str().unwrap().to_owned();
    assert!(text.contains("approve by alice"), "{text}");
    assert!(text.contains("iban"), "the rephrasing's diff: {text}");
    let html = b.cmd("html").await["html"].as_str().unwrap().to_owned();
    assert!(!html.contains(SECRET) && !html.contains(BARE));
    assert!(
        !html.contains("hunter2"),
        "the rephrasing's diff shows a password: {html}"
    );
    assert_eq!(
        b.cmd(
            "count a.trace[href='http://127.0.0.1:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736']"
        )
        .await["n"],
        1,
        "a link to the step's trace"
    );
    b.screenshot("console-timeline.png").await;

    // Deny with a reason: the agent's answer carries it; nothing ran.
    b.cmd("goto /inbox").await;
    b.send("wait_card refund-88 15000").await;
    agent
        .send(&intent(
            "refund-88",
            0,
            "wire_money",
            json!({"amount_eur": 90000, "iban": "GB33 BUKB 2020 1555 5555 55"}),
            "d0",
        ))
        .await;
    let shown = b.read().await;
    assert!(shown.get("error").is_none(), "{shown}");
    // Held, it has not run, and its timeline says so in plain words.
    let (_, _, page) = get_as(&base, "/workflows/refund-88", ALICE).await;
    assert!(page.contains("held for approval, not run"), "{page}");
    assert!(!page.contains("1 run(s)"), "{page}");
    let done = b.cmd("deny refund-88 the account is frozen").await;
    assert!(
        done["notice"]
            .as_str()
            .unwrap()
            .contains("Denied by alice: wire_money in workflow refund-88 (step 0) will not run"),
        "{done}"
    );
    let denied = agent.answer("d0", Duration::from_secs(30)).await;
    assert_eq!(denied.status, Status::Error);
    let message = &denied.error.as_ref().unwrap().message;
    assert!(message.contains("the account is frozen"), "{message}");
    assert_eq!(s.tools.count("wire_money"), 1, "a denied call does not run");
    let page = eventually_page(&base, "/workflows/refund-88", ALICE, "denied, never run").await;
    assert!(!page.contains("run(s)"), "{page}");

    // In doubt: an approver sees it and cannot resolve it; an operator
    // resolves it "not executed", and the agent's retry runs once.
    s.tools.script("wire", vec![Reply::Status(503), Reply::Ok]);
    let doubt = agent
        .call(intent(
            "invoice-512",
            0,
            "wire",
            json!({"amount_eur": 310, "to": "ACME GmbH"}),
            "w0",
        ))
        .await;
    assert_eq!(doubt.status, Status::InDoubt);
    assert_eq!(s.tools.count("wire"), 1);
    b.cmd("goto /in-doubt").await;
    b.cmd("wait_card invoice-512 15000").await;
    assert_eq!(
        b.cmd("count article.doubt form[action='/resolve']").await["n"],
        0,
        "an approver cannot resolve"
    );
    b.cmd("fresh").await;
    b.cmd(&format!("login {OLIVIA}")).await;
    b.cmd("goto /in-doubt").await;
    b.cmd("wait_card invoice-512 15000").await;
    let text = b.cmd("text").await["text"].as_str().unwrap().to_owned();
    let key = stepgate::contract::StepKey {
        workflow_id: "invoice-512".into(),
        step_index: 0,
        tool: "wire".into(),
        attempt: 0,
    }
    .idempotency_key();
    assert!(
        text.contains(&key),
        "the Idempotency-Key to look up: {text}"
    );
    b.screenshot("console-in-doubt.png").await;
    let done = b
        .cmd("click_in_card invoice-512 It did NOT happen — run it again")
        .await;
    assert!(
        done["notice"]
            .as_str()
            .unwrap()
            .contains("Marked as not executed by olivia: the agent's next call of wire in workflow invoice-512 (step 0) runs it again"),
        "{done}"
    );
    let retry = agent
        .call(intent(
            "invoice-512",
            0,
            "wire",
            json!({"amount_eur": 310, "to": "ACME GmbH"}),
            "w1",
        ))
        .await;
    assert_eq!(retry.status, Status::Ok, "{retry:?}");
    assert!(!retry.deduplicated);
    assert_eq!(s.tools.count("wire"), 2, "the retry ran once");
    let again = agent
        .call(intent(
            "invoice-512",
            0,
            "wire",
            json!({"amount_eur": 310, "to": "ACME GmbH"}),
            "w2",
        ))
        .await;
    assert!(again.deduplicated);
    assert_eq!(s.tools.count("wire"), 2, "and only once");

    // Resolved "failed": the agent's later calls get the error with what the
    // operator found, and the tool is not run again.
    s.tools.script("wire", vec![Reply::Status(503)]);
    let failing = intent("invoice-513", 0, "wire", json!({"amount_eur": 99}), "fx0");
    assert_eq!(agent.call(failing).await.status, Status::InDoubt);
    assert_eq!(s.tools.count("wire"), 3);
    b.cmd("goto /in-doubt").await;
    b.cmd("wait_card invoice-513 15000").await;
    let done = b
        .cmd("fail invoice-513 the bank rejected it: account closed")
        .await;
    assert!(
        done["notice"]
            .as_str()
            .unwrap()
            .contains("Marked as failed by olivia"),
        "{done}"
    );
    let after = agent
        .call(intent(
            "invoice-513",
            0,
            "wire",
            json!({"amount_eur": 99}),
            "fx1",
        ))
        .await;
    assert!(after.deduplicated);
    assert_eq!(after.status, Status::Error);
    let message = &after.error.as_ref().unwrap().message;
    assert!(
        message.contains("the bank rejected it: account closed"),
        "{message}"
    );
    assert_eq!(s.tools.count("wire"), 3, "a failed step is not run again");

    // A decision is bound to the run the page showed: once the step ran
    // again, the form about the first run is refused, not applied to the new one.
    s.tools.script(
        "wire",
        vec![Reply::Ok, Reply::Ok, Reply::Status(503), Reply::Status(503)],
    );
    let call = |id: &'static str| {
        intent(
            "invoice-600",
            0,
            "wire",
            json!({"amount_eur": 75, "to": "Globex"}),
            id,
        )
    };
    assert_eq!(agent.call(call("x0")).await.status, Status::InDoubt);
    let page = eventually_page(&base, "/in-doubt", OLIVIA, "invoice-600").await;
    let intended_at = field(&page, "intended_at_ms");
    let form = |dispatch: &str| {
        vec![
            ("workflow_id", "invoice-600".to_owned()),
            ("step_index", "0".into()),
            ("tool", "wire".into()),
            ("attempt", "0".into()),
            ("dispatch", dispatch.into()),
            ("intended_at_ms", intended_at.clone()),
            ("outcome", "not_executed".into()),
        ]
    };
    let (status, location) = post_form(&base, OLIVIA, "/resolve", form("1")).await;
    assert_eq!(status, 303);
    let said = banner(&base, OLIVIA, &location).await;
    assert!(said.contains("Marked as not executed"), "{said}");
    assert_eq!(
        agent.call(call("x1")).await.status,
        Status::InDoubt,
        "run 2"
    );
    assert_eq!(s.tools.count("wire"), 5);
    let mut waited = 0;
    while !field_values(&get_as(&base, "/in-doubt", OLIVIA).await.2, "dispatch")
        .contains(&"2".to_owned())
    {
        waited += 1;
        assert!(waited < 200, "the console never showed run 2");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, location) = post_form(&base, OLIVIA, "/resolve", form("1")).await;
    assert_eq!(status, 303);
    let said = banner(&base, OLIVIA, &location).await;
    assert!(
        said.contains("notice failed") && said.contains("stale_command"),
        "the form about run 1: {said}"
    );
    // The gate refused it before the console answered: nothing to wait for.
    let (_, _, page) = get_as(&base, "/in-doubt", OLIVIA).await;
    assert!(page.contains("invoice-600"), "run 2 is still in doubt");
    assert_eq!(s.tools.count("wire"), 5, "and nothing ran");

    // A viewer: no buttons, and a forged POST (with a valid CSRF pair) is 403.
    agent
        .send(&intent(
            "order-9000",
            0,
            "wire_money",
            json!({"amount_eur": 5}),
            "v0",
        ))
        .await;
    // A repeat while it is held: the timeline says it waits for the decision.
    agent
        .send(&intent(
            "order-9000",
            0,
            "wire_money",
            json!({"amount_eur": 5}),
            "v1",
        ))
        .await;
    let page = eventually_page(
        &base,
        "/workflows/order-9000",
        ALICE,
        "waiting for the decision",
    )
    .await;
    assert!(page.contains("held for approval, not run"), "{page}");
    assert!(!page.contains("answered from the record"), "{page}");
    b.cmd("fresh").await;
    b.cmd(&format!("login {VICTOR}")).await;
    b.cmd("goto /inbox").await;
    b.cmd("wait_card order-9000 15000").await;
    assert_eq!(b.cmd("count button.approve").await["n"], 0);
    assert_eq!(b.cmd("count button.deny").await["n"], 0);
    let csrf = "c".repeat(64);
    let forged = |token: &'static str, with_csrf: bool| {
        let base = base.clone();
        let csrf = csrf.clone();
        async move {
            let mut form = vec![
                ("workflow_id", "order-9000".to_owned()),
                ("step_index", "0".into()),
                ("tool", "wire_money".into()),
                ("attempt", "0".into()),
                ("dispatch", "1".into()),
                ("intended_at_ms", "0".into()),
            ];
            if with_csrf {
                form.push(("csrf", csrf.clone()));
            } else {
                form.push(("csrf", "x".repeat(64)));
            }
            reqwest::Client::new()
                .post(format!("{base}/approve"))
                .bearer_auth(token)
                .header("cookie", format!("stepgate_console_csrf={csrf}"))
                .header("content-type", "application/x-www-form-urlencoded")
                .body(urlencoded(&form))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    assert_eq!(forged(VICTOR, true).await, 403, "a viewer may not approve");
    assert_eq!(
        forged(ALICE, false).await,
        403,
        "a form without this console's CSRF token"
    );
    let r = client_from("127.0.0.1")
        .post(format!("{base}/approve"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("csrf={csrf}"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        (
            r.status().as_u16(),
            r.headers()
                .get("location")
                .map(|l| l.to_str().unwrap().to_owned())
        ),
        (303, Some("/login".to_owned())),
        "no action without a person: to the login form"
    );
    // Each was refused before anything was sent: the call is still held.
    let (_, _, page) = get_as(&base, "/inbox", ALICE).await;
    assert!(page.contains("order-9000"), "still held");
    assert!(agent.answers("v0").is_empty(), "still held");
    assert_eq!(s.tools.count("wire_money"), 1);

    // No page shows the secret; every page carries the CSP.
    // A banner comes only from a link the console made: free text in a
    // link shows nothing.
    let (_, _, page) = get_as(
        &base,
        "/in-doubt?done=Bank%20confirmed%3A%20mark%20order-7781%20executed&failed=x&notice=00.00",
        OLIVIA,
    )
    .await;
    assert!(
        !page.contains("Bank confirmed") && !page.contains("class=\"notice"),
        "{page}"
    );
    for path in [
        "/inbox",
        "/in-doubt",
        "/workflows/order-7781",
        "/workflows/refund-88",
        "/workflows/invoice-512",
        "/workflows?id=order",
        "/overview",
        "/live/inbox",
        "/live/in-doubt",
    ] {
        let (status, csp, body) = get_as(&base, path, OLIVIA).await;
        assert_eq!(status, 200, "{path}: {body}");
        assert!(csp.contains("script-src 'self'"), "{path}: {csp}");
        assert!(!body.contains(SECRET), "{path} shows the tool's secret");
        assert!(
            !body.contains(BARE),
            "{path} shows a tool header's bare token"
        );
        assert!(!body.contains("hunter2"), "{path} shows a password");
    }
    let (status, _, _) = get_as(&base, "/inbox", "not-a-token-of-this-console").await;
    assert_eq!(status, 401);
    let (_, _, overview) = get_as(&base, "/overview", OLIVIA).await;
    assert!(overview.contains("wire_money"), "{overview}");

    b.cmd("goto /overview").await;
    b.screenshot("console-overview.png").await;
    let problems = b.cmd("problems").await;
    assert_eq!(
        problems["problems"],
        json!([]),
        "the browser reported errors (a CSP refusal?)"
    );
    b.cmd("quit").await;
}

/// `stepgate console` on the stack's config, on 127.0.0.1:`port`, until dropped.
fn start_console(s: &Stack, port: u16, env: &[(&str, &str)]) -> Killed {
    let mut cmd = std::process::Command::new(stepgate_bin());
    cmd.args(["console", "--config"])
        .arg(&s.config_path)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(s.dir.path().join(format!("console-{port}.log"))).unwrap());
    for (k, v) in env {
        cmd.env(k, v);
    }
    Killed(cmd.spawn().expect("stepgate console starts"))
}

/// A client that does not follow redirects, connecting from `from`.
fn client_from(from: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .local_address(from.parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap()
}

/// An agent's MCP token (all tools): not a console login.
const AGENT_MCP: &str = "mcp-agent-token-000000001";
/// An MCP token granted the console (`stepgate:console`): `token:alice`.
const ALICE_MCP: &str = "mcp-alice-console-token-0001";
/// A console token of another approver.
const BOB: &str = "bob-approver-console-token-01";

fn configure_trust(c: &mut stepgate::config::Config) {
    c.mcp = toml::from_str(
        r#"
[auth]
scopes = { all = ["*"], "stepgate:console" = [] }
tokens = [
  { name = "agent", token = "mcp-agent-token-000000001", scopes = ["all"] },
  { name = "alice", token = "mcp-alice-console-token-0001", scopes = ["stepgate:console"] },
]
"#,
    )
    .expect("the test's [mcp]");
    // `agent` as a role too: before principals were keyed by their kind, the
    // agent's MCP token named this role.
    c.console = toml::from_str(
        r#"
mcp_auth = true
proxy_user_header = "X-Forwarded-User"
trusted_proxies = ["127.0.0.1"]
roles = { agent = "approver", "token:agent" = "approver", "token:alice" = "approver", bob = "approver", carol = "operator" }
tokens = [{ name = "bob", token = "bob-approver-console-token-01" }]
refresh = "500ms"
"#,
    )
    .expect("the console's test config");
}

/// The console only people reach: an agent's MCP token is no login unless
/// granted the console; the proxy's user header counts only from a trusted
/// proxy, once; the `Host` must be the console's; no one decides a call their
/// own credential sent; cookies are `__Host-`/`Secure` over https, hold a
/// signed session (never the token), and come once; a malformed form is 403.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_for_people_it_knows() {
    let mut s = Stack::new(StackOptions {
        tool_tables: TOOLS.to_owned(),
        configure: configure_trust,
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _console = start_console(&s, port, &[]);
    console_ready(&base).await;
    let direct = client_from("127.0.0.1");

    // An agent's MCP token is not a console login; one granted the console is,
    // named by its kind.
    let r = direct
        .get(format!("{base}/inbox"))
        .bearer_auth(AGENT_MCP)
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status().as_u16(),
        401,
        "an agent's MCP token at the console"
    );
    let body = r.text().await.unwrap();
    assert!(body.contains("stepgate:console"), "{body}");
    let (status, _, page) = get_as(&base, "/inbox", ALICE_MCP).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("token:alice"), "{page}");

    // The Host must be one the console answers to.
    let r = direct
        .get(format!("{base}/inbox"))
        .bearer_auth(BOB)
        .header("host", format!("attacker.example:{port}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403, "a rebinding page's Host");

    // The proxy's header: believed from the trusted proxy (127.0.0.1) only,
    // and only once.
    let r = direct
        .get(format!("{base}/in-doubt"))
        .header("x-forwarded-user", "carol")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(
        r.text()
            .await
            .unwrap()
            .contains("signed in as <b>carol</b>")
    );
    let r = client_from("127.0.0.2")
        .get(format!("{base}/in-doubt"))
        .header("x-forwarded-user", "carol")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403, "the header from a direct peer");
    let r = direct
        .get(format!("{base}/in-doubt"))
        .header("x-forwarded-user", "carol")
        .header("x-forwarded-user", "mallory")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400, "the header twice");

    // Sign in through the trusted proxy over https: a `__Host-` session,
    // `Secure`, signed, not the token.
    let r = direct
        .get(format!("{base}/login"))
        .header("x-forwarded-proto", "https")
        .send()
        .await
        .unwrap();
    let csrf_cookie = set_cookies(&r)
        .into_iter()
        .find(|c| c.starts_with("__Host-stepgate_console_csrf="))
        .expect("the CSRF cookie, __Host- over https");
    assert!(csrf_cookie.contains("; Secure"), "{csrf_cookie}");
    let csrf_cookie = csrf_cookie.split(';').next().unwrap().to_owned();
    let csrf = field(&r.text().await.unwrap(), "csrf");
    let r = direct
        .post(format!("{base}/login"))
        .header("x-forwarded-proto", "https")
        .header("cookie", &csrf_cookie)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(urlencoded(&[("token", BOB.into()), ("csrf", csrf.clone())]))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 303);
    let session = set_cookies(&r)
        .into_iter()
        .find(|c| c.starts_with("__Host-stepgate_console_session="))
        .expect("a session cookie");
    for attribute in ["; Path=/", "; HttpOnly", "; SameSite=Strict", "; Secure"] {
        assert!(session.contains(attribute), "{attribute} in {session}");
    }
    assert!(
        !session.contains(BOB),
        "the cookie holds the token: {session}"
    );
    let session = session.split(';').next().unwrap().to_owned();
    let r = direct
        .get(format!("{base}/inbox"))
        .header("x-forwarded-proto", "https")
        .header("cookie", format!("{session}; {csrf_cookie}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.text().await.unwrap().contains("signed in as <b>bob</b>"));
    // A planted second cookie of the same name is refused.
    let r = direct
        .get(format!("{base}/inbox"))
        .header("x-forwarded-proto", "https")
        .header(
            "cookie",
            format!(
                "{session}; {csrf_cookie}; __Host-stepgate_console_csrf={}",
                "e".repeat(64)
            ),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400, "a cookie of the console's twice");
    // Over plain http the cookies are plain (no `Secure`, which a browser
    // would refuse there).
    let r = direct.get(format!("{base}/login")).send().await.unwrap();
    let plain = set_cookies(&r);
    assert!(
        plain
            .iter()
            .any(|c| c.starts_with("stepgate_console_csrf=") && !c.contains("Secure")),
        "{plain:?}"
    );

    // A call sent with alice's own credential (the MCP front records it in
    // the intent's metadata): alice cannot decide it; bob can.
    let agent = s.agent();
    let mut held = intent(
        "alice/pay-1",
        0,
        "wire_money",
        json!({"amount_eur": 700, "to": "alice's landlord"}),
        "a0",
    );
    held["metadata"] = json!({"stepgate.principal": "token:alice"});
    agent.send(&held).await;
    let page = eventually_page(&base, "/inbox", ALICE_MCP, "alice/pay-1").await;
    let form = vec![
        ("workflow_id", "alice/pay-1".to_owned()),
        ("step_index", "0".into()),
        ("tool", "wire_money".into()),
        ("attempt", "0".into()),
        ("dispatch", field(&page, "dispatch")),
        ("intended_at_ms", field(&page, "intended_at_ms")),
    ];
    let (status, location) = post_form(&base, ALICE_MCP, "/approve", form.clone()).await;
    assert_eq!(status, 303);
    let said = banner(&base, ALICE_MCP, &location).await;
    assert!(
        said.contains("notice failed") && said.contains("your own credential (token:alice)"),
        "{said}"
    );
    assert!(agent.answers("a0").is_empty(), "still held");
    assert_eq!(s.tools.count("wire_money"), 0, "and not run");
    let (status, location) = post_form(&base, BOB, "/approve", form.clone()).await;
    assert_eq!(status, 303);
    let said = banner(&base, BOB, &location).await;
    assert!(said.contains("Approved by bob"), "{said}");
    assert_eq!(
        agent.answer("a0", Duration::from_secs(30)).await.status,
        Status::Ok
    );
    assert_eq!(s.tools.count("wire_money"), 1);

    // A form the console cannot read — no CSRF token, or a malformed field —
    // gets the documented 403, not a framework's 422.
    let (cookie, csrf) = csrf_pair(&base, BOB).await;
    for body in [
        "workflow_id=x&step_index=0&tool=wire_money&attempt=0&dispatch=1&intended_at_ms=0"
            .to_owned(),
        format!(
            "csrf={csrf}&workflow_id=x&step_index=zero&tool=wire_money&attempt=0&dispatch=1&intended_at_ms=0"
        ),
    ] {
        let r = direct
            .post(format!("{base}/approve"))
            .bearer_auth(BOB)
            .header("cookie", &cookie)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 403, "{body}");
        assert!(
            r.text()
                .await
                .unwrap()
                .contains("did not come from this console"),
            "{body}"
        );
    }
}

fn configure_bounded(c: &mut stepgate::config::Config) {
    c.console = toml::from_str(
        r#"
roles = { alice = "approver", victor = "viewer" }
tokens = [
  { name = "alice", token = "alice-approver-token-0001" },
  { name = "victor", token = "victor-viewer-token-00001" },
]
refresh = "500ms"
"#,
    )
    .expect("the console's test config");
}

/// What agents send cannot swamp the console: calls naming tools that are
/// not configured share one row of the overview; the Inbox is paginated and a
/// card shows a few KiB of a large call's arguments, with a link to the rest;
/// an unchanged live list answers 204.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_agents_send_does_not_swamp_the_console() {
    let mut s = Stack::new(StackOptions {
        tool_tables: TOOLS.to_owned(),
        configure: configure_bounded,
        ..StackOptions::default()
    })
    .await;
    s.start().await;
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let _console = start_console(&s, port, &[]);
    console_ready(&base).await;
    let agent = s.agent();

    // 300 calls, each naming a tool nobody configured.
    for i in 0..300 {
        agent
            .send(&intent(
                &format!("ghost-{i}"),
                0,
                &format!("ghost_tool_{i:04}"),
                json!({}),
                &format!("g{i}"),
            ))
            .await;
    }
    // 23 held calls, one with 20 KB of arguments.
    let long = "x".repeat(20_000);
    for i in 0..23 {
        let args = if i == 0 {
            json!({"amount_eur": 1, "memo": long})
        } else {
            json!({"amount_eur": i})
        };
        agent
            .send(&intent(
                &format!("held-{i:02}"),
                0,
                "wire_money",
                args,
                &format!("h{i}"),
            ))
            .await;
    }
    let page = eventually_page(&base, "/overview", VICTOR, ">300<").await;
    let rows = page.matches("<tr class=\"tool\"").count();
    assert!(
        rows <= s.config.tools.len() + 1,
        "{rows} tool rows for {} configured tools",
        s.config.tools.len()
    );
    assert!(page.contains("data-tool=\"(not configured)\""), "{page}");
    assert!(
        !page.contains("ghost_tool_"),
        "an unconfigured name has no row"
    );

    // The Inbox: 20 a page, oldest first.
    let page = eventually_page(&base, "/inbox", VICTOR, "of 23").await;
    assert_eq!(
        page.matches("<article class=\"card held\"").count(),
        20,
        "{page}"
    );
    assert!(page.contains("Showing 1–20 of 23"), "{page}");
    assert!(page.contains("/inbox?page=2"), "{page}");
    let (_, _, second) = get_as(&base, "/inbox?page=2", VICTOR).await;
    assert_eq!(second.matches("<article class=\"card held\"").count(), 3);
    // The large call's card shows a few KiB, and links to the rest.
    let both = format!("{page}{second}");
    assert!(!both.contains(&long), "the whole 20 KB in the Inbox");
    assert!(both.contains("Show all the arguments"), "{both}");
    let link = "/arguments?workflow_id=held-00&step_index=0&tool=wire_money&attempt=0";
    assert!(both.contains(&link.replace('&', "&amp;")), "{both}");
    let (status, _, all) = get_as(&base, link, VICTOR).await;
    assert_eq!(status, 200);
    assert!(all.contains(&long), "the arguments page shows them whole");

    // The live list: 204 while nothing changed.
    let v: String = {
        let marker = "/live/inbox?page=1&amp;v=";
        let at = page.find(marker).expect("the live list's version") + marker.len();
        page[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect()
    };
    let r = reqwest::Client::new()
        .get(format!("{base}/live/inbox?page=1&v={v}"))
        .bearer_auth(VICTOR)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 204);
}

/// `stepgate check-config` refuses what `stepgate console` would refuse at
/// start (a console token it cannot read), and prints the console's URLs
/// without their credentials.
#[tokio::test]
async fn check_config_checks_the_console_as_it_starts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("stepgate.toml");
    std::fs::write(
        &path,
        r#"
[tools.search]
category = "read_only"
url = "http://127.0.0.1:1/search"

[console]
gates = ["http://admin:s3cret-gate-pw@gate-0:9464"]
trace_url = "http://viewer:s3cret-trace-pw@jaeger:16686/trace/{trace_id}"
roles = { alice = "approver" }
tokens = [{ name = "alice", token = "env:CONSOLE_TEST_ALICE_TOKEN" }]
"#,
    )
    .unwrap();
    let run = |token: Option<&str>| {
        let mut c = std::process::Command::new(stepgate_bin());
        c.args(["check-config", "--config"]).arg(&path);
        c.env_remove("CONSOLE_TEST_ALICE_TOKEN");
        if let Some(t) = token {
            c.env("CONSOLE_TEST_ALICE_TOKEN", t);
        }
        c.output().unwrap()
    };
    let out = run(None);
    assert!(
        !out.status.success(),
        "a console token nobody can read passed"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("CONSOLE_TEST_ALICE_TOKEN"), "{err}");
    let out = run(Some("short"));
    assert!(!out.status.success(), "a too short console token passed");
    let out = run(Some("alice-token-long-enough-0001"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(!shown.contains("s3cret"), "{shown}");
    assert!(
        shown.contains("gate-0:9464") && shown.contains("{trace_id}"),
        "{shown}"
    );
}
