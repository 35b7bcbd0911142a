//! Helpers shared by the end-to-end tests: the binary, the default model, one HTTP/1.1
//! request over a fresh connection, and a strict reader of the Prometheus text format.
#![allow(dead_code)] // each test binary uses its own subset

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// The `bulkhead` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_bulkhead");

/// The name `serve` gives the default model in the API: its file name without `.gguf`.
pub const MODEL_ID: &str = "SmolLM2-135M-Instruct.Q4_1";

/// The default model, fetched if missing.
pub fn model() -> std::path::PathBuf {
    bulkhead_fetch::ensure_default_model(false).expect("default model")
}

/// A unique-enough number for file names and markers.
pub fn rand_u64() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

/// An HTTP response, headers lower-cased.
pub struct Response {
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

/// One request on its own connection (`Connection: close`), read to the end.
pub fn request(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Response {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).expect("timeout");
    let extra: String = headers.iter().map(|(k, v)| format!("{k}: {v}\r\n")).collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n{extra}\r\n{body}",
        body.len()
    )
    .expect("send request");
    let mut resp = String::new();
    s.read_to_string(&mut resp).expect("read response");
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|c| c.parse().ok()).unwrap_or(0);
    let headers = lines.filter_map(|l| l.split_once(':')).map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string())).collect();
    Response { status, headers, body: body.to_string() }
}

/// One sample of the exposition.
#[derive(Debug)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

pub fn valid_name(s: &str) -> bool {
    let mut b = s.bytes();
    b.next().is_some_and(|c| c.is_ascii_alphabetic() || c == b'_' || c == b':')
        && b.all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b':')
}

/// `{k="v",…}` with the format's escapes; returns the labels and the rest of the line.
fn parse_labels(s: &str) -> Result<(BTreeMap<String, String>, &str), String> {
    let mut labels = BTreeMap::new();
    let mut rest = s.strip_prefix('{').ok_or("no {")?;
    loop {
        if let Some(r) = rest.strip_prefix('}') {
            return Ok((labels, r));
        }
        let (key, r) = rest.split_once("=\"").ok_or(format!("no =\" in {rest:?}"))?;
        let mut value = String::new();
        let mut chars = r.char_indices();
        let end = loop {
            match chars.next().ok_or("unterminated label value")? {
                (i, '"') => break i,
                (_, '\\') => match chars.next().ok_or("dangling escape")?.1 {
                    'n' => value.push('\n'),
                    c @ ('\\' | '"') => value.push(c),
                    c => return Err(format!("bad escape \\{c}")),
                },
                (_, c) => value.push(c),
            }
        };
        if !valid_name(key) || key.contains(':') || labels.insert(key.to_string(), value).is_some() {
            return Err(format!("bad or repeated label name {key:?}"));
        }
        rest = &r[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
}

/// A small parser of the text format (0.0.4): every sample belongs to a family declared by
/// one `# TYPE` line before it, all of a family's samples are together, names and labels are
/// well formed, and every value is a number.
pub fn parse(text: &str) -> Result<Vec<Sample>, String> {
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut current = String::new();
    let mut samples = Vec::new();
    for line in text.lines() {
        if let Some(c) = line.strip_prefix("# ") {
            let mut parts = c.splitn(3, ' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some("HELP"), Some(name), _) if valid_name(name) => {}
                (Some("TYPE"), Some(name), Some(t))
                    if valid_name(name) && ["counter", "gauge", "histogram", "summary", "untyped"].contains(&t) =>
                {
                    if types.insert(name.to_string(), t.to_string()).is_some() {
                        return Err(format!("family {name} declared twice"));
                    }
                    current = name.to_string();
                }
                _ => return Err(format!("bad comment line {line:?}")),
            }
            continue;
        }
        let split = line.find(['{', ' ']).ok_or(format!("bad line {line:?}"))?;
        let (name, rest) = line.split_at(split);
        let (labels, rest) = if rest.starts_with('{') { parse_labels(rest)? } else { (BTreeMap::new(), rest) };
        let value = match rest.trim() {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v.parse().map_err(|_| format!("bad value in {line:?}"))?,
        };
        let family = match types.get(&current).map(String::as_str) {
            Some("histogram") => ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name),
            _ => name,
        };
        if family != current || !valid_name(name) {
            return Err(format!("sample {name} outside its family's block (in {current})"));
        }
        samples.push(Sample { name: name.to_string(), labels, value });
    }
    Ok(samples)
}

/// Sum of the samples named `name` whose labels include `want`.
pub fn sum(samples: &[Sample], name: &str, want: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name && want.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
        .map(|s| s.value)
        .sum()
}

/// Whether every worker's pool is idle: each page free or cached with no reader, nothing
/// quarantined.
pub fn pools_idle(m: &[Sample]) -> bool {
    let s = |name: &str| sum(m, name, &[]);
    s("bulkhead:kv_free_pages") + s("bulkhead:kv_cached_pages") == s("bulkhead:kv_pool_pages")
        && s("bulkhead:quarantined_pages") == 0.0
        && s("bulkhead:kv_shared_leases") == 0.0
}

/// The sum of the samples named `name` whose labels include `want`, polled until it
/// reaches `enough` or 5 s pass (workers report their metrics every 500 ms and when a
/// request ends).
pub fn polled_sum(addr: &str, name: &str, want: &[(&str, &str)], enough: f64) -> f64 {
    let mut last = 0.0;
    for _ in 0..50 {
        last = sum(&scrape(addr), name, want);
        if last >= enough {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    last
}

/// Poll `ok` until it holds; past `timeout`, fail with `what` and the text of `logs`.
pub fn wait_for(what: &str, timeout: Duration, logs: &[&std::path::Path], mut ok: impl FnMut() -> bool) {
    let t = std::time::Instant::now();
    while !ok() {
        if t.elapsed() > timeout {
            let logs: Vec<String> = logs.iter().map(|l| std::fs::read_to_string(l).unwrap_or_default()).collect();
            panic!("timed out waiting for {what}\n{}", logs.join("\n----\n"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `GET /metrics`, parsed strictly.
pub fn scrape(addr: &str) -> Vec<Sample> {
    let mut samples = scrape_public(addr);
    // The cache activity is on the operator's page (every test server has ADMIN_KEY).
    let r = request(addr, "GET", "/metrics/tenants", &[("Authorization", &format!("Bearer {ADMIN_KEY}"))], "");
    if r.status == 200 {
        samples.extend(parse(&r.body).unwrap_or_else(|e| panic!("/metrics/tenants does not parse: {e}\n{}", r.body)));
    }
    samples
}

/// What anyone who reaches the port reads: `/metrics` alone.
pub fn scrape_public(addr: &str) -> Vec<Sample> {
    let r = request(addr, "GET", "/metrics", &[], "");
    assert_eq!(r.status, 200, "{}", r.body);
    parse(&r.body).unwrap_or_else(|e| panic!("/metrics does not parse: {e}\n{}", r.body))
}

/// The operator's key of every test server (`BULKHEAD_ADMIN_KEY`; `--admin-key` overrides
/// it): [`scrape`] reads the cache activity on the operator's page with it.
pub const ADMIN_KEY: &str = "test-operator-key";

/// A running `bulkhead serve`, killed (with its workers, whose gateway connections close)
/// on drop; its log is removed then.
pub struct Server {
    /// The `serve` process.
    pub child: std::process::Child,
    /// The gateway's HTTP address.
    pub http: String,
    /// The gateway's worker port.
    pub workers: String,
    /// The HTTP addresses of the other gateways (`--gateways`), in order.
    pub gateways: Vec<String>,
    /// Its standard error, logged at `info`.
    pub log: std::path::PathBuf,
}

impl Server {
    /// `serve` on the default model on a free port with one thread per worker, `args` and
    /// `env` added; returns once it printed its addresses (see [`Server::wait_ready`]).
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Server {
        Server::start_model(&model(), args, env)
    }

    /// [`Server::start`] on the model at `model`.
    pub fn start_model(model: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        use std::io::BufRead;
        let log = std::env::temp_dir().join(format!("bulkhead-e2e-{}-{}.log", std::process::id(), rand_u64()));
        let mut cmd = std::process::Command::new(BIN);
        cmd.args(["serve", "--port", "0", "--threads", "1", "--model"]).arg(model).args(args);
        // What a developer's shell may set must not change what a test asks for.
        cmd.env_remove("BULKHEAD_API_KEY").env_remove("BULKHEAD_WEB_UI").env("BULKHEAD_LOG", "info").env("BULKHEAD_ADMIN_KEY", ADMIN_KEY);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn bulkhead serve");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("serve prints its address");
        // "bulkhead: serving on http://ADDR (workers register at ADDR)[, gateway N on http://ADDR (...)]..."
        let http = line.split("http://").nth(1).and_then(|r| r.split_whitespace().next()).map(str::to_string);
        let workers = line.split("register at ").nth(1).and_then(|r| r.split(')').next()).map(str::to_string);
        let gateways = line.split("http://").skip(2).filter_map(|r| r.split_whitespace().next()).map(str::to_string).collect();
        let (Some(http), Some(workers)) = (http, workers) else {
            let _ = child.wait();
            panic!("serve did not start: {line:?}\n{}", std::fs::read_to_string(&log).unwrap_or_default());
        };
        Server { child, http, workers, gateways, log }
    }

    /// What it logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls `/ready` for 30 s; panics with the log if it never answers 200.
    pub fn wait_ready(&self) {
        for _ in 0..300 {
            if request(&self.http, "GET", "/ready", &[], "").status == 200 {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("server never became ready: {}", self.logs());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}
