//! Multi-host: gateway, prefill and decode each in its own Linux network namespace, joined by
//! veth links, real TCP between them. The prefill–decode link is cut in the middle of a KV
//! transfer: the request fails cleanly, its decode pages stay quarantined (nothing is freed
//! before the writer is fenced), and once the link is back later requests succeed and both
//! pools return to full. Before that, the same three hosts with the default KV transport:
//! on one machine UCX finds shared memory between the namespaces, and the KV takes it.
//!
//! Needs root and `ip` (iproute2); elsewhere it says why and passes without running.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::{BIN, MODEL_ID, model, pools_idle, request, scrape, sum, wait_for};

/// `ip` with arguments; Err with its stderr on failure.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() { Ok(()) } else { Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim())) }
}

/// Namespaces and links made for one test, removed on drop (processes first).
struct Hosts {
    tag: String,
    namespaces: Vec<String>,
    children: Vec<Child>,
    /// The cluster key file every process gets.
    key: std::path::PathBuf,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.namespaces {
            let _ = ip(&["netns", "del", ns]);
        }
        // A root-namespace end of a veth pair goes away with its peer's namespace.
        let _ = ip(&["link", "del", &format!("{}r", self.tag)]);
        let _ = std::fs::remove_file(&self.key);
    }
}

impl Hosts {
    fn ns(&self, name: &str) -> String {
        format!("{}-{name}", self.tag)
    }

    /// A veth pair between namespace `a` (None: this one) and `b`, with /30 addresses.
    fn link(&self, a: Option<&str>, a_if: &str, a_addr: &str, b: &str, b_if: &str, b_addr: &str) -> Result<(), String> {
        let (ai, bi) = (format!("{}{a_if}", self.tag), format!("{}{b_if}", self.tag));
        ip(&["link", "add", &ai, "type", "veth", "peer", "name", &bi])?;
        ip(&["link", "set", &bi, "netns", &self.ns(b)])?;
        ip(&["-n", &self.ns(b), "addr", "add", b_addr, "dev", &bi])?;
        ip(&["-n", &self.ns(b), "link", "set", &bi, "up"])?;
        match a {
            Some(a) => {
                ip(&["link", "set", &ai, "netns", &self.ns(a)])?;
                ip(&["-n", &self.ns(a), "addr", "add", a_addr, "dev", &ai])?;
                ip(&["-n", &self.ns(a), "link", "set", &ai, "up"])
            }
            None => {
                ip(&["addr", "add", a_addr, "dev", &ai])?;
                ip(&["link", "set", &ai, "up"])
            }
        }
    }

    /// `bulkhead serve` inside namespace `ns`, logging to a file.
    fn spawn(&mut self, ns: &str, args: &[&str]) -> std::path::PathBuf {
        let log = std::env::temp_dir().join(format!("{}-{ns}.log", self.tag));
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns(ns), BIN, "serve", "--threads", "1", "--context-length", "2048", "--model"])
            .arg(model())
            // Listeners that face the network need the cluster's key (they refuse to start
            // without one).
            .arg("--cluster-key-file")
            .arg(&self.key)
            .args(args)
            .env("BULKHEAD_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn bulkhead serve in a namespace");
        self.children.push(child);
        log
    }
}

/// Gateway (g), prefill (p) and decode (d) namespaces, linked g–root, g–p, g–d and p–d.
fn hosts() -> Result<Hosts, String> {
    let id = std::process::id() % 100_000;
    let key = std::env::temp_dir().join(format!("bh{id}-cluster.key"));
    let _ = std::fs::remove_file(&key);
    let made = Command::new(BIN).arg("keygen").arg(&key).output().map_err(|e| e.to_string())?;
    if !made.status.success() {
        return Err(String::from_utf8_lossy(&made.stderr).into_owned());
    }
    let mut h = Hosts { tag: format!("bh{id}"), namespaces: Vec::new(), children: Vec::new(), key };
    for n in ["g", "p", "d"] {
        ip(&["netns", "add", &h.ns(n)])?;
        h.namespaces.push(h.ns(n));
        ip(&["-n", &h.ns(n), "link", "set", "lo", "up"])?;
    }
    h.link(None, "r", "10.231.0.1/30", "g", "gr", "10.231.0.2/30")?;
    h.link(Some("g"), "gp", "10.231.1.1/30", "p", "pg", "10.231.1.2/30")?;
    h.link(Some("g"), "gd", "10.231.2.1/30", "d", "dg", "10.231.2.2/30")?;
    h.link(Some("p"), "pd", "10.231.3.1/30", "d", "dp", "10.231.3.2/30")?;
    Ok(h)
}

const HTTP: &str = "10.231.0.2:8080";

fn chat(max_tokens: usize, user: &str) -> support::Response {
    let body = serde_json::json!({"model": MODEL_ID, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": user}]});
    request(HTTP, "POST", "/v1/chat/completions", &[], &body.to_string())
}

/// The gateway host's flags (the operator's key: the pools' cache pages are on its page).
const GATEWAY: &[&str] =
    &["--role", "gateway", "--host", "10.231.0.2", "--port", "8080", "--worker-listen", "0.0.0.0:7000", "--admin-key", support::ADMIN_KEY];

/// Three hosts with the default `--kv-transport auto`: where UCX loads, the KV connection
/// takes its shared memory (the namespaces share one machine's memory), the answer is the
/// same greedy text as over TCP, and both sides log the road; without UCX, TCP.
fn kv_over_ucx_between_namespaces() {
    let mut h = hosts().expect("namespaces");
    let g = h.spawn("g", GATEWAY);
    let p = h.spawn("p", &["--role", "prefill", "--gateway", "10.231.1.1:7000", "--transfer-batch-pages", "8"]);
    let d = h.spawn("d", &["--role", "decode", "--gateway", "10.231.2.1:7000", "--kv-listen", "10.231.3.2:7100"]);
    let logs = [g.as_path(), p.as_path(), d.as_path()];
    wait_for("all roles registered", Duration::from_secs(60), &logs, || {
        std::net::TcpStream::connect(HTTP).is_ok() && request(HTTP, "GET", "/ready", &[], "").status == 200
    });
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(100);
    let r = chat(8, &long);
    assert_eq!(r.status, 200, "across three hosts: {}", r.body);
    let road = if bulkhead_ucx::version().is_ok() { "transport=\"ucx\"" } else { "transport=\"tcp\"" };
    for (log, line) in [(&p, "KV connection open"), (&d, "KV connection from a prefill worker")] {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        assert!(
            text.lines().any(|l| l.contains(line) && l.contains(road) && l.contains("encrypted=true")),
            "{line} {road} in {}:\n{text}",
            log.display()
        );
    }
    eprintln!(
        "between namespaces: {}",
        std::fs::read_to_string(&p).unwrap_or_default().lines().filter(|l| l.contains("KV connection open")).collect::<Vec<_>>().join("\n")
    );
}

/// A fourth host on the cluster's networks, with a key of its own: it tries to register as
/// a decode worker, and to open a KV connection as prefill worker 1 without a handshake.
/// Both are refused and counted.
fn rogue_host_is_refused_by_the_gateway_and_the_kv_port(h: &mut Hosts, logs: &[&std::path::Path]) {
    let refusals = || sum(&scrape(HTTP), "bulkhead:auth_refusals_total", &[]);
    let before = refusals();
    ip(&["netns", "add", &h.ns("x")]).expect("rogue namespace");
    h.namespaces.push(h.ns("x"));
    ip(&["-n", &h.ns("x"), "link", "set", "lo", "up"]).expect("rogue loopback");
    h.link(Some("g"), "gx", "10.231.4.1/30", "x", "xg", "10.231.4.2/30").expect("rogue-gateway link");
    h.link(Some("d"), "dx", "10.231.5.1/30", "x", "xd", "10.231.5.2/30").expect("rogue-decode link");
    ip(&["-n", &h.ns("x"), "route", "add", "10.231.3.0/30", "via", "10.231.5.1"]).expect("route to the KV port");
    let rogue_key = std::env::temp_dir().join(format!("{}-rogue.key", h.tag));
    let _ = std::fs::remove_file(&rogue_key);
    assert!(Command::new(BIN).arg("keygen").arg(&rogue_key).status().expect("keygen").success());
    let out = Command::new("ip")
        .args(["netns", "exec", &h.ns("x"), BIN, "serve", "--role", "decode", "--threads", "1", "--context-length", "2048", "--model"])
        .arg(model())
        .args(["--gateway", "10.231.4.1:7000", "--cluster-key-file"])
        .arg(&rogue_key)
        .output()
        .expect("run the rogue worker");
    let _ = std::fs::remove_file(&rogue_key);
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!("rogue worker: {}\n{err}", out.status);
    assert!(!out.status.success() && err.contains("refused"), "the rogue worker must fail and say why: {err}");
    // A plain KvHello (this build's protocol version, kind 4) naming prefill worker 1.
    let inject = format!(
        "import socket,sys\n\
        s=socket.create_connection(('10.231.3.2',7100),timeout=10)\n\
        s.sendall(b'BH\\x{:02x}\\x04\\x04\\x00\\x00\\x00\\x01\\x00\\x00\\x00')\n\
        got=b''\n\
        while True:\n\
        \x20   b=s.recv(4096)\n\
        \x20   if not b: break\n\
        \x20   got+=b\n\
        sys.stdout.write(repr(got))\n",
        bulkhead_protocol::VERSION
    );
    let out = Command::new("ip").args(["netns", "exec", &h.ns("x"), "python3", "-c", &inject]).output().expect("run the rogue KV client");
    assert!(out.status.success(), "the rogue KV client: {}", String::from_utf8_lossy(&out.stderr));
    wait_for("both rogue attempts counted", Duration::from_secs(10), logs, || refusals() >= before + 2.0);
    let r = chat(8, "Name a fruit.");
    assert_eq!(r.status, 200, "the cluster serves on after the rogue host: {}", r.body);
}

#[test]
fn cutting_the_prefill_decode_link_mid_transfer_fails_one_request_and_frees_nothing_before_the_fence() {
    if let Err(e) = hosts() {
        eprintln!("SKIPPED: network namespaces are not available here (needs root and iproute2): {e}");
        return;
    }
    kv_over_ucx_between_namespaces();
    let mut h = hosts().expect("the namespaces again");
    let g = h.spawn("g", GATEWAY);
    // The cut is of the network link, which only TCP takes (UCX's shared memory between the
    // namespaces does not cross it).
    let p = h.spawn("p", &["--role", "prefill", "--gateway", "10.231.1.1:7000", "--transfer-batch-pages", "8", "--kv-transport", "tcp"]);
    let d = h.spawn(
        "d",
        &[
            "--role",
            "decode",
            "--gateway",
            "10.231.2.1:7000",
            "--kv-listen",
            "10.231.3.2:7100",
            "--transfer-timeout-ms",
            "2000",
            "--kv-transport",
            "tcp",
        ],
    );
    let logs = [g.as_path(), p.as_path(), d.as_path()];
    wait_for("all roles registered", Duration::from_secs(60), &logs, || {
        std::net::TcpStream::connect(HTTP).is_ok() && request(HTTP, "GET", "/ready", &[], "").status == 200
    });
    let r = chat(8, "What is the capital of France?");
    assert_eq!(r.status, 200, "across three hosts: {}", r.body);
    // Every internal connection here crosses hosts, so each is encrypted (the default),
    // and each side's log says so.
    for (log, line) in [(&g, "worker connection authenticated"), (&p, "KV connection open"), (&d, "KV connection from a prefill worker")] {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        assert!(text.lines().any(|l| l.contains(line) && l.contains("encrypted=true")), "{line}, encrypted, in {}:\n{text}", log.display());
    }
    rogue_host_is_refused_by_the_gateway_and_the_kv_port(&mut h, &logs);

    // A long prompt: its KV goes to decode in batches of 8 pages (128 tokens).
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(150);
    let victim = std::thread::spawn(move || chat(8, &long));
    let decode = [("role", "decode")];
    wait_for("the first KV chunks at the decode worker", Duration::from_secs(120), &logs, || {
        sum(&scrape(HTTP), "bulkhead:isolation_checks_total", &[("role", "decode"), ("check", "chunk_verified")]) > 0.0
    });
    let pd = format!("{}pd", h.tag);
    ip(&["-n", &h.ns("p"), "link", "set", &pd, "down"]).expect("cut the prefill-decode link");

    let r = victim.join().expect("client thread");
    assert!(r.status >= 500 && r.body.contains("\"error\""), "the cut request fails with an error body: {} {}", r.status, r.body);
    // The writer is not fenced while the link is down: its pages stay quarantined.
    wait_for("decode metrics after the timeout", Duration::from_secs(10), &logs, || {
        sum(&scrape(HTTP), "bulkhead:kv_transfer_timeouts_total", &decode) > 0.0
    });
    let m = scrape(HTTP);
    eprintln!(
        "link down: request failed with {}; decode quarantined pages {}, chunks verified {}",
        r.status,
        sum(&m, "bulkhead:quarantined_pages", &decode),
        sum(&m, "bulkhead:isolation_checks_total", &[("role", "decode"), ("check", "chunk_verified")])
    );
    assert!(sum(&m, "bulkhead:quarantined_pages", &decode) > 0.0, "pages freed before the writer was fenced");
    assert_eq!(sum(&m, "bulkhead:fenced_releases_total", &decode), 0.0);

    ip(&["-n", &h.ns("p"), "link", "set", &pd, "up"]).expect("restore the link");
    // TCP delivers the rest once the link is back; the fence releases the pages.
    wait_for("quarantine released and both pools full", Duration::from_secs(120), &logs, || {
        let m = scrape(HTTP);
        sum(&m, "bulkhead:quarantined_pages", &decode) == 0.0 && sum(&m, "bulkhead:fenced_releases_total", &decode) > 0.0 && pools_idle(&m)
    });
    let m = scrape(HTTP);
    eprintln!(
        "link up: decode fenced releases {}, late chunks {}",
        sum(&m, "bulkhead:fenced_releases_total", &decode),
        sum(&m, "bulkhead:late_chunks_total", &decode)
    );
    for q in ["Name a color.", "What is two plus two?"] {
        let r = chat(8, q);
        assert_eq!(r.status, 200, "after the link is back: {}", r.body);
    }
    wait_for("pools full after later requests", Duration::from_secs(10), &logs, || {
        let m = scrape(HTTP);
        pools_idle(&m)
    });
}
