//! A real Prometheus server (Debian's `prometheus`) in a namespace, scraping
//! the agent's `/metrics`, and a minimal HTTP/1.0 client to read both.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};

use crate::netns::{Namespace, unique_tag};

/// `promtool check metrics` on `exposition`: (success, what it said).
pub fn promtool_check(exposition: &str) -> (bool, String) {
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool (is prometheus installed? run `cargo xtask setup`)");
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), exposition.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// One HTTP response: status code, header lines, body.
#[derive(Clone, Debug)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<String>,
    pub body: String,
}

impl HttpResponse {
    /// The value of header `name` (case-insensitive), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find_map(|line| {
            let (n, v) = line.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

/// `GET path` over HTTP/1.0 (so the body is never chunked and ends with
/// the connection). Must run on a thread inside the server's namespace.
pub fn http_get(addr: SocketAddr, path: &str, accept: Option<&str>) -> Result<HttpResponse> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{accept}\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("no end of headers in {text:?}"))?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status line in {head:?}"))?;
    Ok(HttpResponse {
        status,
        headers: lines.map(str::to_string).collect(),
        body: body.to_string(),
    })
}

/// Percent-encodes a query parameter value.
pub fn url_encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A `prometheus` process scraping one target, with its config and
/// storage in a temporary directory; killed and removed on drop.
pub struct PrometheusServer {
    pub addr: SocketAddr,
    ns_name: String,
    dir: PathBuf,
    child: Child,
}

impl PrometheusServer {
    /// Starts Prometheus in `ns`, listening on `listen`, scraping
    /// `http://target/metrics` every `every`, and waits until it is ready.
    pub fn start(
        ns: &Namespace,
        listen: SocketAddr,
        target: SocketAddr,
        every: Duration,
    ) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("selector-prometheus-{}", unique_tag()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let config = dir.join("prometheus.yml");
        let ms = every.as_millis();
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: {ms}ms\n  scrape_timeout: {ms}ms\n\
                 scrape_configs:\n  - job_name: selector\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )?;
        let log = std::fs::File::create(dir.join("prometheus.log"))?;
        let child = ns
            .command("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={listen}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting prometheus (is it installed? run `cargo xtask setup`)")?;
        let server = Self {
            addr: listen,
            ns_name: ns.name.clone(),
            dir,
            child,
        };
        server.wait_ready(ns)?;
        Ok(server)
    }

    fn wait_ready(&self, ns: &Namespace) -> Result<()> {
        let addr = self.addr;
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let ready = ns.run(move || http_get(addr, "/-/ready", None))?;
            if ready.is_ok_and(|r| r.status == 200) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        bail!("prometheus not ready after 60 s; its log:\n{}", self.log())
    }

    /// Prometheus's own log, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default()
    }

    /// The value of an instant PromQL query with one result (`None` when
    /// it has no result yet), through the HTTP API.
    pub fn query(&self, ns: &Namespace, promql: &str) -> Result<Option<f64>> {
        assert_eq!(ns.name, self.ns_name, "query from the server's namespace");
        let (addr, path) = (
            self.addr,
            format!("/api/v1/query?query={}", url_encode(promql)),
        );
        let response = ns.run(move || http_get(addr, &path, None))??;
        if response.status != 200 {
            bail!("{promql}: HTTP {}: {}", response.status, response.body);
        }
        let json: serde_json::Value = serde_json::from_str(&response.body)?;
        let results = json["data"]["result"]
            .as_array()
            .with_context(|| format!("{promql}: no result in {json}"))?;
        match results.as_slice() {
            [] => Ok(None),
            [one] => {
                let value = one["value"][1]
                    .as_str()
                    .with_context(|| format!("{promql}: no value in {one}"))?;
                Ok(Some(value.parse()?))
            }
            _ => bail!("{promql}: more than one series: {json}"),
        }
    }

    /// Polls `promql` until it returns `wanted` or `timeout` passes; the
    /// last value seen either way.
    pub fn wait_for(
        &self,
        ns: &Namespace,
        promql: &str,
        wanted: f64,
        timeout: Duration,
    ) -> Result<Option<f64>> {
        let deadline = Instant::now() + timeout;
        loop {
            let value = self.query(ns, promql)?;
            if value == Some(wanted) || Instant::now() >= deadline {
                return Ok(value);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for PrometheusServer {
    fn drop(&mut self) {
        // `ip netns exec` execs prometheus in place: the pid is its own.
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_are_percent_encoded() {
        assert_eq!(
            url_encode("sum(selector_requests_total{group=\"1\"})"),
            "sum%28selector_requests_total%7Bgroup%3D%221%22%7D%29"
        );
    }
}
