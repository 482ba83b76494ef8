//! The metrics endpoint (`selector run --metrics-addr ADDR:PORT`): `GET
//! /metrics` answers with the exposition of the agent's status (see
//! [`crate::agent::metrics`]), in OpenMetrics when the client asks for it
//! (Prometheus does), else in the classic text format (curl, `promtool
//! check metrics`). `GET /healthz` and `GET /readyz` answer 200 or 503
//! with a short text (see [`crate::agent::health`]); other paths 404.
//! Hand-written rather than on an HTTP crate: one request per connection,
//! three paths, GET only, bounded as [`crate::agent::limits`] says.

use std::{
    future::Future,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{TcpListener, TcpStream},
};

use crate::{
    agent::{
        health::{self, Health},
        limits::{ACCEPT_BACKOFF, ConnectionLimit, WRITE_WAIT},
        metrics::{
            Format, LIVENESS_PATH, OPENMETRICS_CONTENT_TYPE, PROMETHEUS_TEXT_CONTENT_TYPE,
            READINESS_PATH, render,
        },
    },
    api::Status,
};

/// How long a client has to send its request head.
const REQUEST_WAIT: Duration = Duration::from_secs(5);
/// Longest request head read; a scrape's is a few hundred bytes.
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

/// The listening endpoint.
pub struct MetricsServer {
    listener: TcpListener,
}

impl MetricsServer {
    /// Binds before anything is attached, so a taken address fails the start.
    pub async fn bind(addr: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("--metrics-addr {addr}: cannot listen"))?;
        Ok(Self { listener })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.listener.local_addr()?)
    }

    /// Answers connections until the task is dropped, each in a task of its
    /// own; `status` fetches the agent's status for a scrape, and `health`
    /// is what the agent's loop last recorded, for the probes.
    pub async fn serve<F, Fut>(self, status: F, health: Health)
    where
        F: Fn() -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<Status>> + Send + 'static,
    {
        let limit = ConnectionLimit::default();
        loop {
            match self.listener.accept().await {
                Ok((stream, _)) => {
                    // Beyond the limit: closed at once (dropped).
                    if let Some(permit) = limit.admit() {
                        let (status, health) = (status.clone(), health.clone());
                        tokio::spawn(async move {
                            answer(stream, status, health).await;
                            drop(permit);
                        });
                    }
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

/// Reads one request and writes one response, then closes the connection.
async fn answer<F, Fut>(mut stream: TcpStream, status: F, health: Health)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<Status>>,
{
    let head = match tokio::time::timeout(REQUEST_WAIT, read_head(&mut stream)).await {
        Ok(Ok(head)) => head,
        _ => return,
    };
    let response = match route(&head) {
        Route::Metrics(format) => match status().await {
            Ok(status) => Response::ok(format, render(format, &status)),
            Err(e) => Response::text("503 Service Unavailable", &format!("{e:#}\n")),
        },
        Route::Live => Response::verdict(health::liveness(&health.state(), Instant::now())),
        Route::Ready => Response::verdict(health::readiness(&health.state(), Instant::now())),
        Route::NotFound => Response::text(
            "404 Not Found",
            "served here: /metrics, /healthz, /readyz\n",
        ),
        Route::MethodNotAllowed => Response::text("405 Method Not Allowed", "only GET\n"),
        Route::BadRequest => Response::text("400 Bad Request", "bad request\n"),
    };
    let bytes = response.into_bytes();
    let _ = tokio::time::timeout(WRITE_WAIT, async {
        stream.write_all(&bytes).await?;
        stream.shutdown().await
    })
    .await;
}

/// The request head, up to the blank line (or as much as arrived).
async fn read_head(stream: &mut TcpStream) -> std::io::Result<String> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST_HEAD {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(String::from_utf8_lossy(&head).into_owned())
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
    BadRequest,
}

/// What a request head asks for.
fn route(head: &str) -> Route {
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or("").split(' ');
    let (Some(method), Some(target), Some(version)) = (
        request_line.next(),
        request_line.next(),
        request_line.next(),
    ) else {
        return Route::BadRequest;
    };
    if !version.starts_with("HTTP/1.") {
        return Route::BadRequest;
    }
    if method != "GET" {
        return Route::MethodNotAllowed;
    }
    match target.split('?').next() {
        Some("/metrics") => {}
        Some(LIVENESS_PATH) => return Route::Live,
        Some(READINESS_PATH) => return Route::Ready,
        _ => return Route::NotFound,
    }
    let accept = lines
        .filter_map(|line| line.split_once(':'))
        .filter(|(name, _)| name.trim().eq_ignore_ascii_case("accept"))
        .map(|(_, value)| value.trim())
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

struct Response {
    status: &'static str,
    content_type: &'static str,
    body: String,
}

impl Response {
    fn ok(format: Format, body: String) -> Self {
        let content_type = match format {
            Format::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
            Format::PrometheusText => PROMETHEUS_TEXT_CONTENT_TYPE,
        };
        Self {
            status: "200 OK",
            content_type,
            body,
        }
    }

    /// 200 or 503, with the verdict's text.
    fn verdict(verdict: health::Verdict) -> Self {
        let status = if verdict.ok {
            "200 OK"
        } else {
            "503 Service Unavailable"
        };
        Self::text(status, &verdict.body)
    }

    fn text(status: &'static str, body: &str) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }

    fn into_bytes(self) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.status,
            self.content_type,
            self.body.len()
        );
        if self.status.starts_with("405") {
            out += "Allow: GET\r\n";
        }
        out += "\r\n";
        out += &self.body;
        out.into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::metrics::{openmetrics, tests::status};

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
    #[test]
    fn scrapes_are_routed_and_negotiated() {
        let prometheus = "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n\r\n";
        assert_eq!(route(prometheus), Route::Metrics(Format::OpenMetrics));
        let curl = "GET /metrics HTTP/1.1\r\nHost: x\r\nUser-Agent: curl\r\naccept: */*\r\n\r\n";
        assert_eq!(route(curl), Route::Metrics(Format::PrometheusText));
        let bare = "GET /metrics?debug=1 HTTP/1.0\r\n\r\n";
        assert_eq!(route(bare), Route::Metrics(Format::PrometheusText));
        let text_first = "GET /metrics HTTP/1.1\r\nAccept: text/plain, application/openmetrics-text;q=0.5\r\n\r\n";
        assert_eq!(route(text_first), Route::Metrics(Format::PrometheusText));
        let refused = "GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;q=0\r\n\r\n";
        assert_eq!(route(refused), Route::Metrics(Format::PrometheusText));
        assert_eq!(route("GET /healthz HTTP/1.1\r\n\r\n"), Route::Live);
        assert_eq!(route("GET /readyz?verbose HTTP/1.1\r\n\r\n"), Route::Ready);
        assert_eq!(route("GET /readyzz HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(route("GET / HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(route("GET /metricsx HTTP/1.1\r\n\r\n"), Route::NotFound);
        assert_eq!(
            route("POST /metrics HTTP/1.1\r\n\r\n"),
            Route::MethodNotAllowed
        );
        assert_eq!(route("hello\r\n\r\n"), Route::BadRequest);
        assert_eq!(route(""), Route::BadRequest);
    }

    #[tokio::test]
    async fn the_endpoint_answers_over_http() {
        let server = MetricsServer::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = server.local_addr().unwrap();
        let health = Health::new(Duration::from_millis(250));
        let serving = tokio::spawn(server.serve(|| async { Ok(status()) }, health.clone()));
        let get = |request: &'static str| async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            stream.write_all(request.as_bytes()).await.unwrap();
            let mut response = String::new();
            stream.read_to_string(&mut response).await.unwrap();
            response
        };
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
            head.contains(&format!("Content-Length: {}", body.len())),
            "{head}"
        );
        assert_eq!(body, openmetrics(&status()));
        let response = get("GET /metrics HTTP/1.0\r\n\r\n").await;
        assert!(
            response.contains(PROMETHEUS_TEXT_CONTENT_TYPE),
            "{response}"
        );
        let response = get("GET /nothing HTTP/1.1\r\n\r\n").await;
        assert!(response.starts_with("HTTP/1.1 404 "), "{response}");
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
}
