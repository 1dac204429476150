//! How a tool's request travels. A plain `http://` tool that no proxy
//! setting of the environment intercepts is called through hyper-util's
//! pooled HTTP/1.1 client directly; every other one (`https://`, a proxied
//! host, a URL with credentials in it) through reqwest, which brings TLS,
//! proxies and basic auth from the URL. The direct way costs about 10 µs of
//! CPU less per call (docs/performance.md, "The floor"); both are set up
//! alike (the same pool, timeouts, keep-alive and `TCP_NODELAY`) and send the
//! same request, and both end a try in the same [`Sent`] or [`SendError`], so
//! "never sent" and "may have run" mean the same thing on either.

use super::ToolConfig;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::proxy::matcher::Matcher;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use reqwest::header::{ACCEPT, HeaderMap, HeaderValue, USER_AGENT};
use std::collections::BTreeMap;
use std::time::Duration;

/// Idle connections kept per tool host (scheme, host and port): as many as
/// calls can run at once (`executor.concurrency`), so a steady load reuses its
/// connections — with fewer, every call beyond them opened and closed a TCP
/// connection, which cost more CPU than the rest of the hot path — and at most
/// this many, so the sockets a burst leaves open stay bounded.
const POOL_MAX_IDLE_PER_HOST_CAP: usize = 1024;
/// How long an idle connection is kept for reuse. Below the 5 s keep-alive
/// timeout of Node.js, uvicorn, hypercorn and Apache: a request written to a
/// connection the server is closing at that moment fails after it was sent,
/// which for an `unkeyed` tool is an `in_doubt` answer no one needed.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// TCP keep-alive probes, so a peer that vanished during a long call is noticed
/// by the OS, not only by the tool's timeout.
const TCP_KEEPALIVE: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const USER_AGENT_VALUE: &str = concat!("stepgate/", env!("CARGO_PKG_VERSION"));

/// The two clients, set up alike.
#[derive(Clone)]
pub(super) struct Http {
    direct: HyperClient<HttpConnector, Full<Bytes>>,
    /// Also the MCP sessions' client.
    pub(super) reqwest: reqwest::Client,
}

/// Which client a tool's URL goes through, decided once per registry.
#[derive(Clone, Debug)]
pub(super) enum Route {
    Direct(hyper::Uri),
    Reqwest,
}

/// A try that got an answer's status; its body is read from it.
pub(super) struct Sent {
    pub status: reqwest::StatusCode,
    body: Body,
}

enum Body {
    Direct(hyper::body::Incoming),
    Reqwest(reqwest::Response),
}

/// A try that got no status.
pub(super) enum SendError {
    /// Nothing reached the tool (no connection, or no request to send).
    NotSent(String),
    /// The request may have reached the tool.
    MaybeRan(String),
}

impl Http {
    /// The clients, keeping up to `concurrency` idle connections per host.
    pub(super) fn new(concurrency: usize) -> Http {
        Self::with(concurrency, reqwest::Client::builder())
    }

    /// [`Http::new`], with every request of reqwest's through `proxy`.
    #[cfg(test)]
    pub(super) fn with_proxy(concurrency: usize, proxy: &str) -> Http {
        let proxy = reqwest::Proxy::all(proxy).expect("a test proxy's URL parses");
        Self::with(concurrency, reqwest::Client::builder().proxy(proxy))
    }

    fn with(concurrency: usize, reqwest: reqwest::ClientBuilder) -> Http {
        let idle = concurrency.clamp(1, POOL_MAX_IDLE_PER_HOST_CAP);
        let reqwest = reqwest
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(USER_AGENT_VALUE)
            // A 307/308 would re-POST the arguments and the key to another
            // address; a 302/303 would turn into a GET whose answer looks like
            // the tool's output. The tool at the configured URL answers, or no one.
            .redirect(reqwest::redirect::Policy::none())
            .pool_max_idle_per_host(idle)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .tcp_keepalive(TCP_KEEPALIVE)
            .build()
            .expect("the HTTP client builds with static settings");
        // As reqwest sets up its own hyper-util client (`TCP_NODELAY` is its
        // default, not hyper-util's). hyper-util never follows a redirect.
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
        connector.set_keepalive(Some(TCP_KEEPALIVE));
        connector.set_nodelay(true);
        let direct = HyperClient::builder(TokioExecutor::new())
            .timer(TokioTimer::new())
            .pool_timer(TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .pool_max_idle_per_host(idle)
            .build(connector);
        Http { direct, reqwest }
    }

    /// How each HTTP tool of `tools` is called, with the environment's proxy
    /// settings (`HTTP_PROXY`, `ALL_PROXY`, `NO_PROXY`, …) read once, as
    /// reqwest reads them.
    pub(super) fn routes(tools: &BTreeMap<String, ToolConfig>) -> BTreeMap<String, Route> {
        Self::routes_with(tools, &Matcher::from_system())
    }

    /// [`Http::routes`] under the proxy settings of `proxies`.
    pub(super) fn routes_with(
        tools: &BTreeMap<String, ToolConfig>,
        proxies: &Matcher,
    ) -> BTreeMap<String, Route> {
        tools
            .iter()
            .filter(|(_, t)| t.mcp_tool.is_none())
            .map(|(name, t)| (name.clone(), Self::route(&t.url, proxies)))
            .collect()
    }

    /// How `url` is called under the proxy settings of `proxies`.
    pub(super) fn route(url: &str, proxies: &Matcher) -> Route {
        let Ok(parsed) = reqwest::Url::parse(url) else {
            return Route::Reqwest;
        };
        // Credentials in the URL are sent as basic auth by reqwest only; a
        // fragment is never sent. Reqwest's own text of the URL is parsed, so
        // the direct request goes to exactly the address reqwest would use.
        if parsed.scheme() != "http"
            || !parsed.username().is_empty()
            || parsed.password().is_some()
            || parsed.fragment().is_some()
        {
            return Route::Reqwest;
        }
        match parsed.as_str().parse::<hyper::Uri>() {
            Ok(uri) if proxies.intercept(&uri).is_none() => Route::Direct(uri),
            _ => Route::Reqwest,
        }
    }

    /// POST `body` with `headers` to the tool at `url` by `route`, waiting at
    /// most until the status line. `User-Agent` and `Accept: */*` are added
    /// unless the tool's headers set them.
    pub(super) async fn post(
        &self,
        route: &Route,
        url: &str,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Result<Sent, SendError> {
        headers
            .entry(USER_AGENT)
            .or_insert(HeaderValue::from_static(USER_AGENT_VALUE));
        headers
            .entry(ACCEPT)
            .or_insert(HeaderValue::from_static("*/*"));
        match route {
            Route::Direct(uri) => {
                let mut req = hyper::Request::new(Full::new(body));
                *req.method_mut() = hyper::Method::POST;
                *req.uri_mut() = uri.clone();
                *req.headers_mut() = headers;
                match self.direct.request(req).await {
                    Ok(resp) => Ok(Sent {
                        status: resp.status(),
                        body: Body::Direct(resp.into_body()),
                    }),
                    Err(e) if e.is_connect() => Err(SendError::NotSent(describe_connect(&e))),
                    Err(_) => Err(SendError::MaybeRan("connection broken".into())),
                }
            }
            Route::Reqwest => match self
                .reqwest
                .post(url)
                .headers(headers)
                .body(body)
                .send()
                .await
            {
                Ok(resp) => Ok(Sent {
                    status: resp.status(),
                    body: Body::Reqwest(resp),
                }),
                Err(e) if e.is_connect() => Err(SendError::NotSent(describe(&e))),
                // The request could not even be built: nothing was sent.
                Err(e) if e.is_builder() => Err(SendError::NotSent(describe(&e))),
                Err(e) => Err(SendError::MaybeRan(describe(&e))),
            },
        }
    }
}

impl Sent {
    /// The body's length as the tool declared it.
    pub(super) fn declared_length(&self) -> Option<u64> {
        match &self.body {
            Body::Direct(b) => hyper::body::Body::size_hint(b).exact(),
            Body::Reqwest(r) => r.content_length(),
        }
    }

    /// The body's next chunk; `None` at its end. An error (the body broke
    /// off) is described for a message.
    pub(super) async fn chunk(&mut self) -> Result<Option<Bytes>, String> {
        match &mut self.body {
            Body::Direct(b) => loop {
                match b.frame().await {
                    None => return Ok(None),
                    // Trailers carry nothing a tool's answer is read from.
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data) => return Ok(Some(data)),
                        Err(_trailers) => continue,
                    },
                    Some(Err(_)) => return Err("connection broken".into()),
                }
            },
            Body::Reqwest(r) => r.chunk().await.map_err(|e| describe(&e)),
        }
    }
}

/// A connection that could not be made, as text: never the URL.
fn describe_connect(e: &hyper_util::client::legacy::Error) -> String {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return "timed out".into();
        }
        source = s.source();
    }
    "connection refused".into()
}

/// A transport error as text: what happened, never the URL (reqwest's own
/// text names it, with any credential in it).
fn describe(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out".into()
    } else if e.is_connect() {
        "connection refused".into()
    } else if e.is_builder() {
        "the request could not be built (nothing was sent)".into()
    } else {
        "connection broken".into()
    }
}
