//! The metrics endpoint (`selector run --metrics-addr ADDR:PORT`): `GET
//! /metrics` answers with the exposition of the agent's status (see
//! [`crate::agent::metrics`]), in OpenMetrics when the client asks for it
//! (Prometheus does), else in the classic text format (curl, `promtool
//! check metrics`). `GET /healthz` and `GET /readyz` answer 200 or 503
//! with a short text (see [`crate::agent::health`]); other paths 404, other
//! methods 405.
//!
//! HTTP/1 is served by hyper's connection driver (`hyper`, with
//! `hyper-util`'s tokio I/O and timer), one request per connection;
//! malformed requests are answered by hyper (400, or 431 for a head over
//! `MAX_REQUEST_HEAD` bytes). So that idle connections and slow readers
//! cannot stall the endpoint: at most the connections
//! [`crate::agent::limits`] allows at once, the request head within
//! `REQUEST_WAIT` of the accept (hyper's header read timeout), the response
//! written within [`WRITE_WAIT`] of being ready, else the connection is
//! dropped.
//!
//! An agent serving several attachments (`selector run --attachment`)
//! serves them all here ([`Sources`]): every sample carries the label
//! `attachment`, and a probe is healthy when every attachment is.

use std::{
    convert::Infallible,
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use http_body_util::Full;
use hyper::{
    Method, Request, Response, StatusCode,
    body::{Bytes, Incoming},
    header::{ACCEPT, ALLOW, CONTENT_TYPE, HeaderValue},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, TcpStream},
    sync::Notify,
};

use crate::{
    agent::{
        control_server::LocalCaller,
        health::{self, Health},
        limits::{ACCEPT_BACKOFF, EvictingLimit, WRITE_WAIT},
        metrics::{
            Format, LIVENESS_PATH, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE,
            READINESS_PATH, render, render_labelled,
        },
    },
    api::Status,
};

/// A status being fetched for a scrape.
type StatusFuture = Pin<Box<dyn Future<Output = Result<Status>> + Send>>;

/// One attachment as the endpoint sees it: its label (`None` for an agent
/// with one attachment: no label), how to fetch its status, its health.
#[derive(Clone)]
pub struct Source {
    label: Option<String>,
    fetch: Arc<dyn Fn() -> StatusFuture + Send + Sync>,
    health: Health,
    /// Its owner loop, for the control requests routed to it.
    caller: Option<LocalCaller>,
}

impl Source {
    pub fn new<F, Fut>(label: Option<String>, status: F, health: Health) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Status>> + Send + 'static,
    {
        Self {
            label,
            fetch: Arc::new(move || Box::pin(status())),
            health,
            caller: None,
        }
    }

    /// An attachment's owner loop, asked through `caller` at most once per
    /// [`SCRAPE_REUSE`] however many scrapes arrive.
    pub fn of_caller(label: Option<String>, caller: LocalCaller, health: Health) -> Self {
        let cache = CachedStatus::default();
        let fetching = caller.clone();
        Self {
            caller: Some(caller),
            ..Self::new(
                label,
                move || {
                    let (caller, cache) = (fetching.clone(), cache.clone());
                    async move { cache.get(|| caller.status()).await }
                },
                health,
            )
        }
    }
}

/// The attachments the endpoint serves, added as each attaches, and the
/// labels of those there will be (until all are there, the agent is not
/// ready).
#[derive(Clone)]
pub struct Sources {
    expected: Arc<[Option<String>]>,
    list: Arc<Mutex<Vec<Source>>>,
}

impl Sources {
    /// For an agent of one attachment (no label).
    pub fn alone() -> Self {
        Self::expecting(vec![None])
    }

    /// For an agent of the attachments labelled `labels`.
    pub fn of_attachments(labels: Vec<String>) -> Self {
        Self::expecting(labels.into_iter().map(Some).collect())
    }

    fn expecting(expected: Vec<Option<String>>) -> Self {
        Self {
            expected: expected.into(),
            list: Arc::default(),
        }
    }

    /// The labels of the attachments there will be, in the order given.
    pub fn expected_labels(&self) -> Vec<String> {
        self.expected.iter().flatten().cloned().collect()
    }

    /// The owner loops of the attachments started, with their labels, in
    /// the order given.
    pub fn callers(&self) -> Vec<(String, LocalCaller)> {
        let sources = self.sources();
        self.expected
            .iter()
            .filter_map(|label| {
                let source = sources.iter().find(|s| &s.label == label)?;
                Some((label.clone()?, source.caller.clone()?))
            })
            .collect()
    }

    pub fn add(&self, source: Source) {
        self.list
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(source);
    }

    fn sources(&self) -> Vec<Source> {
        self.list.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Every attachment's status in `format`, labelled when there are
    /// several (or one of several: the label says which).
    async fn exposition(&self, format: Format) -> Result<String> {
        let sources = self.sources();
        if let [Source { label: None, .. }] = sources.as_slice() {
            return Ok(render(format, &(sources[0].fetch)().await?));
        }
        // Every attachment there will be, in the order given: one not
        // started yet, or ended (a shutdown ends them one by one), is
        // down in the exposition and the others are served.
        let mut statuses = Vec::with_capacity(self.expected.len());
        for label in self.expected.iter().flatten() {
            let source = sources.iter().find(|s| s.label.as_ref() == Some(label));
            let status = match source {
                Some(source) => match (source.fetch)().await {
                    Ok(status) => Some(status),
                    Err(e) => {
                        log::debug!("metrics: attachment {label}: {e:#}");
                        None
                    }
                },
                None => None,
            };
            statuses.push((label.clone(), status));
        }
        Ok(render_labelled(format, &statuses))
    }

    /// Whether every attachment has started and is ready (`/readyz`).
    pub fn all_ready(&self) -> bool {
        self.verdict(health::readiness).ok
    }

    /// Whether every attachment has started and its loop turns (`/healthz`).
    pub fn all_live(&self) -> bool {
        self.verdict(health::liveness).ok
    }

    /// A probe's verdict over every attachment: healthy if each is and all
    /// have attached; the text of each, prefixed by its label.
    fn verdict(
        &self,
        probe: fn(&health::HealthState, Instant) -> health::Verdict,
    ) -> health::Verdict {
        let sources = self.sources();
        let now = Instant::now();
        if let [
            Source {
                label: None,
                health,
                ..
            },
        ] = sources.as_slice()
        {
            return probe(&health.state(), now);
        }
        let mut ok = sources.len() == self.expected.len();
        let mut body = String::new();
        if !ok {
            body += &format!(
                "{} of {} attachments started\n",
                sources.len(),
                self.expected.len()
            );
        }
        for source in &sources {
            let verdict = probe(&source.health.state(), now);
            ok &= verdict.ok;
            body += &format!(
                "{}: {}",
                source.label.as_deref().unwrap_or_default(),
                verdict.body
            );
        }
        health::Verdict { ok, body }
    }
}

/// How long a client has to send its request head (from the accept).
const REQUEST_WAIT: Duration = Duration::from_secs(5);
/// Longest request head read (start line and headers); a scrape's is a
/// few hundred bytes. A longer one is answered 431.
const MAX_REQUEST_HEAD: usize = 16 * 1024;

/// How long a status built for one scrape serves the next ones: a flood
/// of scrapes costs the owner loop at most one status per this.
pub const SCRAPE_REUSE: Duration = Duration::from_millis(200);

/// The status scrapes share (see [`SCRAPE_REUSE`]); scrapes that arrive
/// while it is being built wait for it.
#[derive(Clone, Default)]
pub struct CachedStatus(Arc<tokio::sync::Mutex<Option<(Instant, Status)>>>);

impl CachedStatus {
    /// The status built less than [`SCRAPE_REUSE`] ago, else `fetch`'s.
    pub async fn get<F, Fut>(&self, fetch: F) -> Result<Status>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Status>>,
    {
        let mut slot = self.0.lock().await;
        if let Some((at, status)) = slot.as_ref()
            && at.elapsed() < SCRAPE_REUSE
        {
            return Ok(status.clone());
        }
        let status = fetch().await?;
        *slot = Some((Instant::now(), status.clone()));
        Ok(status)
    }
}

/// How long a connection may wait for each stage.
#[derive(Clone, Copy, Debug)]
struct Waits {
    /// For the request head, from the accept.
    request: Duration,
    /// For the response to be written, from when it is ready.
    write: Duration,
}

/// The listening endpoint.
pub struct MetricsServer {
    listener: TcpListener,
    waits: Waits,
}

impl MetricsServer {
    /// Binds before anything is attached, so a taken address fails the start.
    pub async fn bind(addr: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("--metrics-addr {addr}: cannot listen"))?;
        Ok(Self {
            listener,
            waits: Waits {
                request: REQUEST_WAIT,
                write: WRITE_WAIT,
            },
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// Answers connections until the task is dropped, each in a task of its
    /// own; `status` fetches the agent's status for a scrape, and `health`
    /// is what the agent's loop last recorded, for the probes.
    pub async fn serve<F, Fut>(self, status: F, health: Health)
    where
        F: Fn() -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<Status>> + Send + 'static,
    {
        let sources = Sources::alone();
        sources.add(Source::new(None, status, health));
        self.serve_sources(sources).await
    }

    /// As [`Self::serve`], for the attachments in `sources` (added as they
    /// attach).
    pub async fn serve_sources(self, sources: Sources) {
        let limit = EvictingLimit::default();
        let http = Arc::new(http1_builder(self.waits.request));
        loop {
            match self.listener.accept().await {
                Ok((stream, _)) => {
                    // Beyond the limit: the oldest connection gives its
                    // place up (the probes share this port).
                    let place = limit.admit();
                    let (http, sources) = (http.clone(), sources.clone());
                    let write_wait = self.waits.write;
                    tokio::spawn(async move {
                        tokio::select! {
                            _ = answer(&http, write_wait, stream, sources) => {}
                            _ = place.evicted.notified() => {}
                        }
                        drop(place);
                    });
                }
                // Out of descriptors, say: wait instead of spinning.
                Err(e) => {
                    log::warn!("metrics endpoint: accept failed: {e}");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                }
            }
        }
    }
}

/// hyper's HTTP/1 server as the endpoint runs it: the request head within
/// `request_wait` and [`MAX_REQUEST_HEAD`] bytes, one request per
/// connection (`Connection: close`), header names in title case.
fn http1_builder(request_wait: Duration) -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(request_wait)
        .max_header_size(MAX_REQUEST_HEAD)
        .keep_alive(false)
        .title_case_headers(true);
    builder
}

/// Reads one request and writes one response, then closes the connection;
/// gives the connection up when the response is not written within
/// `write_wait` of being ready (a reader that never reads).
async fn answer(http: &http1::Builder, write_wait: Duration, stream: TcpStream, sources: Sources) {
    let responded = Arc::new(Notify::new());
    let service = {
        let responded = responded.clone();
        service_fn(move |request: Request<Incoming>| {
            let (responded, sources) = (responded.clone(), sources.clone());
            let route = route(&request);
            async move {
                let response = respond(route, &sources).await;
                responded.notify_one();
                Ok::<_, Infallible>(response)
            }
        })
    };
    let connection = http.serve_connection(TokioIo::new(stream), service);
    // Dropping the connection closes it; its errors (a head too slow, too
    // long or malformed, a reset) end it and concern nobody else.
    tokio::select! {
        _ = connection => {}
        _ = async {
            responded.notified().await;
            tokio::time::sleep(write_wait).await;
        } => {}
    }
}

/// The response to what a request asks for.
async fn respond(route: Route, sources: &Sources) -> Response<Full<Bytes>> {
    match route {
        Route::Metrics(format) => match sources.exposition(format).await {
            Ok(body) => {
                let content_type = match format {
                    Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
                    Format::PrometheusText => PROMETHEUS_TEXT_CONTENT_TYPE,
                };
                response(StatusCode::OK, content_type, body)
            }
            Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, format!("{e:#}\n")),
        },
        Route::Live => verdict(sources.verdict(health::liveness)),
        Route::Ready => verdict(sources.verdict(health::readiness)),
        Route::NotFound => text(
            StatusCode::NOT_FOUND,
            "served here: /metrics, /healthz, /readyz\n".into(),
        ),
        Route::MethodNotAllowed => {
            let mut response = text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
            response
                .headers_mut()
                .insert(ALLOW, HeaderValue::from_static("GET"));
            response
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Route {
    Metrics(Format),
    /// `/healthz`: the agent's loop is turning.
    Live,
    /// `/readyz`: attached, swept recently, configuration applied.
    Ready,
    NotFound,
    MethodNotAllowed,
}

/// What a request asks for (hyper answers a malformed one 400 itself).
fn route<B>(request: &Request<B>) -> Route {
    if request.method() != Method::GET {
        return Route::MethodNotAllowed;
    }
    match request.uri().path() {
        "/metrics" => {}
        LIVENESS_PATH => return Route::Live,
        READINESS_PATH => return Route::Ready,
        _ => return Route::NotFound,
    }
    let accept = request
        .headers()
        .get_all(ACCEPT)
        .iter()
        .map(|value| String::from_utf8_lossy(value.as_bytes()).trim().to_string())
        .collect::<Vec<_>>()
        .join(",");
    Route::Metrics(negotiate(&accept))
}

/// OpenMetrics when the Accept header prefers it to the classic text
/// format (Prometheus asks for it first), the classic format otherwise.
fn negotiate(accept: &str) -> Format {
    let (mut openmetrics, mut text) = (0.0f64, 0.0f64);
    for range in accept.split(',') {
        let mut params = range.split(';').map(str::trim);
        let media = params.next().unwrap_or("").to_ascii_lowercase();
        let q = params
            .filter_map(|p| p.strip_prefix("q="))
            .find_map(|q| q.parse::<f64>().ok())
            .unwrap_or(1.0);
        match media.as_str() {
            "application/openmetrics-text" => openmetrics = openmetrics.max(q),
            "text/plain" | "text/*" | "*/*" => text = text.max(q),
            _ => {}
        }
    }
    if openmetrics > 0.0 && openmetrics >= text {
        Format::OpenMetrics
    } else {
        Format::PrometheusText
    }
}

/// 200 or 503, with the verdict's text.
fn verdict(verdict: health::Verdict) -> Response<Full<Bytes>> {
    let status = if verdict.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    text(status, verdict.body)
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    response(status, "text/plain; charset=utf-8", body)
}

/// hyper adds `Content-Length` (the body is whole) and `Connection: close`.
fn response(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

#[cfg(test)]
mod tests {
    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        net::TcpSocket,
    };

    use super::*;
    use crate::agent::{
        limits::MAX_CONNECTIONS,
        metrics::{openmetrics, tests::status},
    };

    #[tokio::test(flavor = "current_thread")]
    async fn scrapes_in_a_burst_share_one_status() {
        let cache = CachedStatus::default();
        let built = std::sync::atomic::AtomicU32::new(0);
        for _ in 0..5 {
            let got = cache
                .get(|| async {
                    built.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Ok(status())
                })
                .await
                .unwrap();
            assert_eq!(got, status());
        }
        assert_eq!(built.load(std::sync::atomic::Ordering::SeqCst), 1);
        // Older than SCRAPE_REUSE: built again.
        tokio::time::sleep(SCRAPE_REUSE).await;
        cache
            .get(|| async {
                built.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(status())
            })
            .await
            .unwrap();
        assert_eq!(built.load(std::sync::atomic::Ordering::SeqCst), 2);
    }
    fn request(method: &str, target: &str, accept: &[&str]) -> Request<()> {
        let mut request = Request::builder().method(method).uri(target);
        for value in accept {
            request = request.header(ACCEPT, *value);
        }
        request.body(()).unwrap()
    }

    /// An agent of three attachments, one answering, one ended (its
    /// status gone), one not started: the scrape serves the one and says
    /// which are down, instead of failing whole.
    #[tokio::test]
    async fn a_scrape_serves_the_attachments_that_answer() {
        let sources = Sources::of_attachments(vec!["a".into(), "b".into(), "c".into()]);
        let health = Health::new(Duration::from_millis(250));
        sources.add(Source::new(
            Some("b".into()),
            || async { Err(anyhow::anyhow!("the attachment has ended")) },
            health.clone(),
        ));
        sources.add(Source::new(
            Some("a".into()),
            || async { Ok(status()) },
            health,
        ));
        let text = sources.exposition(Format::OpenMetrics).await.unwrap();
        let up = |label: &str, value: u8| {
            format!("selector_attachment_up{{attachment=\"{label}\"}} {value}\n")
        };
        // In the order the attachments were given.
        let ups = [up("a", 1), up("b", 0), up("c", 0)].concat();
        assert!(text.contains(&ups), "{text}");
        assert!(
            text.contains("selector_in_flight{attachment=\"a\"} 3\n"),
            "{text}"
        );
        assert!(
            !text.contains("selector_in_flight{attachment=\"b\"}"),
            "{text}"
        );
    }

    #[test]
    fn scrapes_are_routed_and_negotiated() {
        fn get(target: &str, accept: &[&str]) -> Route {
            route(&request("GET", target, accept))
        }
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(
            get("/metrics", &[prometheus]),
            Route::Metrics(Format::OpenMetrics)
        );
        assert_eq!(
            get("/metrics", &["*/*"]),
            Route::Metrics(Format::PrometheusText)
        );
        assert_eq!(
            get("/metrics?debug=1", &[]),
            Route::Metrics(Format::PrometheusText)
        );
        assert_eq!(
            get(
                "/metrics",
                &["text/plain, application/openmetrics-text;q=0.5"]
            ),
            Route::Metrics(Format::PrometheusText)
        );
        assert_eq!(
            get("/metrics", &["application/openmetrics-text;q=0"]),
            Route::Metrics(Format::PrometheusText)
        );
        // Accept given twice: both count.
        assert_eq!(
            get(
                "/metrics",
                &["text/plain;q=0.5", "application/openmetrics-text"]
            ),
            Route::Metrics(Format::OpenMetrics)
        );
        assert_eq!(get("/healthz", &[]), Route::Live);
        assert_eq!(get("/readyz?verbose", &[]), Route::Ready);
        assert_eq!(get("/readyzz", &[]), Route::NotFound);
        assert_eq!(get("/", &[]), Route::NotFound);
        assert_eq!(get("/metricsx", &[]), Route::NotFound);
        assert_eq!(
            route(&request("POST", "/metrics", &[])),
            Route::MethodNotAllowed
        );
        assert_eq!(
            route(&request("HEAD", "/healthz", &[])),
            Route::MethodNotAllowed
        );
    }

    /// Writes `request` to `addr`, then reads until the endpoint closes.
    async fn exchange(addr: SocketAddr, request: &[u8]) -> String {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(request).await.unwrap();
        let mut response = Vec::new();
        // A connection beyond the limit may be reset rather than closed.
        let _ = stream.read_to_end(&mut response).await;
        String::from_utf8(response).unwrap()
    }

    #[tokio::test]
    async fn the_endpoint_answers_over_http() {
        let server = MetricsServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = server.local_addr().unwrap();
        let health = Health::new(Duration::from_millis(250));
        let serving = tokio::spawn(server.serve(|| async { Ok(status()) }, health.clone()));
        let get = |request: &'static str| exchange(addr, request.as_bytes());
        let response = get(
            "GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0\r\n\r\n",
        )
        .await;
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(
            head.contains(&format!("Content-Type: {OPENMETRICS_CONTENT_TYPE}\r\n")),
            "{head}"
        );
        assert!(
            head.contains(&format!("Content-Length: {}\r\n", body.len())),
            "{head}"
        );
        // One request per connection.
        assert!(head.contains("Connection: close\r\n"), "{head}");
        assert_eq!(body, openmetrics(&status()));
        let response = get("GET /metrics HTTP/1.0\r\n\r\n").await;
        assert!(
            response.contains(PROMETHEUS_TEXT_CONTENT_TYPE),
            "{response}"
        );
        let response = get("GET /nothing HTTP/1.1\r\n\r\n").await;
        assert!(response.starts_with("HTTP/1.1 404 "), "{response}");
        let response = get("POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n").await;
        assert!(response.starts_with("HTTP/1.1 405 "), "{response}");
        assert!(response.contains("\r\nAllow: GET\r\n"), "{response}");
        let response = get("hello\r\n\r\n").await;
        assert!(response.starts_with("HTTP/1.1 400 "), "{response}");
        let mut oversized = b"GET /metrics HTTP/1.1\r\n".to_vec();
        while oversized.len() <= MAX_REQUEST_HEAD {
            oversized.extend_from_slice(b"X-Padding: 0123456789abcdef0123456789abcdef\r\n");
        }
        oversized.extend_from_slice(b"\r\n");
        let response = exchange(addr, &oversized).await;
        assert!(response.starts_with("HTTP/1.1 431 "), "{response}");
        // Not attached, never swept: alive, not ready, and why.
        let response = get("GET /healthz HTTP/1.1\r\n\r\n").await;
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        let response = get("GET /readyz HTTP/1.1\r\n\r\n").await;
        assert!(
            response.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{response}"
        );
        assert!(
            response.ends_with(
                "\r\n\r\nnot ready: the agent has not attached yet; no sweep completed yet\n"
            ),
            "{response}"
        );
        health.update(|s| s.not_attached = None);
        health.swept();
        let response = get("GET /readyz HTTP/1.1\r\n\r\n").await;
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        // A loop that stopped turning.
        health.update(|s| s.last_turn = Instant::now() - Duration::from_secs(30));
        let response = get("GET /healthz HTTP/1.1\r\n\r\n").await;
        assert!(
            response.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{response}"
        );
        serving.abort();
    }

    /// Every place taken by connections that never finish their request
    /// head (a peer starving the kubelet's probes), then by readers that
    /// never read a large response: a probe is still answered at once, in
    /// the oldest's place, and each kind gives its place up after its wait
    /// in any case.
    #[tokio::test]
    async fn idle_connections_and_slow_readers_never_keep_a_probe_out() {
        let waits = Waits {
            request: Duration::from_millis(1500),
            write: Duration::from_millis(1500),
        };
        // Small socket buffers, so that a response of 256 KiB stalls.
        let socket = TcpSocket::new_v4().unwrap();
        socket.set_send_buffer_size(4096).unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let server = MetricsServer {
            listener: socket.listen(1024).unwrap(),
            waits,
        };
        let addr = server.local_addr().unwrap();
        let large = "x".repeat(256 * 1024);
        let serving = tokio::spawn(server.serve(
            move || {
                let large = large.clone();
                async move { Err(anyhow::anyhow!(large)) }
            },
            Health::new(Duration::from_millis(250)),
        ));

        for (slow_reader, request) in [
            // Half a head, and nothing more.
            (false, &b"GET /metrics HTTP/1.1\r\n"[..]),
            // The whole request; its 503 is not read.
            (true, &b"GET /metrics HTTP/1.0\r\n\r\n"[..]),
        ] {
            let mut held = Vec::new();
            for _ in 0..MAX_CONNECTIONS {
                let socket = TcpSocket::new_v4().unwrap();
                socket.set_recv_buffer_size(4096).unwrap();
                let mut stream = socket.connect(addr).await.unwrap();
                stream.write_all(request).await.unwrap();
                held.push(stream);
            }
            // Let the endpoint accept them all and start the responses.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let started = Instant::now();
            let response = exchange(addr, b"GET /healthz HTTP/1.1\r\n\r\n").await;
            assert!(
                response.starts_with("HTTP/1.1 200 OK\r\n"),
                "a probe beyond the limit: {response:?}"
            );
            assert!(started.elapsed() < Duration::from_millis(500));
            // The oldest gave its place up (closed; a slow reader's
            // response cut short), long before its wait.
            let mut oldest = held.remove(0);
            let mut rest = Vec::new();
            let read =
                tokio::time::timeout(Duration::from_millis(500), oldest.read_to_end(&mut rest))
                    .await;
            assert!(read.is_ok(), "the oldest still open");
            // The others end with their waits: an idle head's from the
            // accept, a slow reader's from when its response was ready (it
            // then finds the response cut short).
            let mut newest = held.pop().unwrap();
            if slow_reader {
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            let mut read = Vec::new();
            let ended =
                tokio::time::timeout(Duration::from_secs(5), newest.read_to_end(&mut read)).await;
            assert!(ended.is_ok(), "held past its wait");
            if slow_reader {
                assert!(read.len() < 256 * 1024, "{} bytes read", read.len());
            } else {
                assert!(started.elapsed() >= Duration::from_millis(1000));
            }
        }
        serving.abort();
    }
}
