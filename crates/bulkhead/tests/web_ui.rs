//! The web UI on a real `bulkhead serve` (`--web-ui`, its default, the API key switch), and
//! the Grafana dashboard (`deploy/grafana/bulkhead.json`) held to the metrics a running
//! `serve` exports, so neither it nor the `/dashboard` page can drift from the code.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{MODEL_ID, Server, request};

fn serve(args: &[&str]) -> Server {
    Server::start(&[&["--context-length", "512"], args].concat(), &[])
}

/// A gateway alone: enough for the pages, no workers to wait for.
fn gateway(args: &[&str]) -> Server {
    serve(&[&["--role", "gateway", "--worker-listen", "127.0.0.1:0"], args].concat())
}

const PAGES: [&str; 5] = ["/", "/dashboard", "/ui/chat.js", "/ui/dashboard.js", "/ui/style.css"];

#[test]
fn the_pages_are_on_by_default_on_loopback_under_the_csp_and_off_with_the_flag() {
    let s = gateway(&[]);
    for page in PAGES {
        let r = request(&s.http, "GET", page, &[], "");
        assert_eq!(r.status, 200, "{page}: {}", r.body);
        assert_eq!(
            r.headers.get("content-security-policy").map(String::as_str),
            Some(bulkhead_api::web::CONTENT_SECURITY_POLICY),
            "{page}"
        );
    }
    let chat = request(&s.http, "GET", "/", &[], "");
    assert!(chat.headers["content-type"].starts_with("text/html") && chat.body.contains("data-auth=\"open\""), "{}", chat.body);
    // A page path that does not exist is the API's 404, not the chat page.
    for path in ["/chat", "/index.html", "/dashboard/x", "/ui/missing.js"] {
        let r = request(&s.http, "GET", path, &[], "");
        assert_eq!(r.status, 404, "{path}: {}", r.body);
        assert!(r.body.contains("unknown_url") && !r.body.contains("<html"), "{path}: {}", r.body);
    }
    drop(s);

    let off = gateway(&["--web-ui", "off"]);
    for page in PAGES {
        assert_eq!(request(&off.http, "GET", page, &[], "").status, 404, "{page} with --web-ui off");
    }
    assert_eq!(request(&off.http, "GET", "/v1/models", &[], "").status, 200, "the API stays");
}

#[test]
fn with_an_api_key_the_chat_page_asks_for_it_and_the_api_still_refuses_without() {
    let s = gateway(&["--api-key", "sk-web-ui-test"]);
    let chat = request(&s.http, "GET", "/", &[], "");
    assert_eq!(chat.status, 200, "{}", chat.body);
    assert!(chat.body.contains("data-auth=\"required\""), "{}", chat.body);
    assert!(!chat.body.contains("sk-web-ui-test"), "the page never carries a key");
    assert_eq!(request(&s.http, "GET", "/v1/models", &[], "").status, 401);
    let ok = request(&s.http, "GET", "/v1/models", &[("authorization", "Bearer sk-web-ui-test")], "");
    assert_eq!(ok.status, 200, "{}", ok.body);
    // The dashboard's one source needs no key and carries none.
    let m = request(&s.http, "GET", "/metrics", &[], "");
    assert_eq!(m.status, 200);
    assert!(!m.body.contains("sk-web-ui-test"));
}

/// Every `bulkhead:` metric name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices("bulkhead:") {
        let name: String = text[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == ':').collect();
        out.insert(name);
    }
    out
}

/// Every query (`expr`) in a Grafana panel tree, with its panel's title.
fn queries(v: &Value, title: &str, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(o) => {
            let title = o.get("title").and_then(Value::as_str).unwrap_or(title);
            if let Some(expr) = o.get("expr").and_then(Value::as_str) {
                out.push((title.to_string(), expr.to_string()));
            }
            for child in o.values() {
                queries(child, title, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|c| queries(c, title, out)),
        _ => {}
    }
}

/// The families of a scrape: name to type, from its `# TYPE` lines.
fn families(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, t)| (n.to_string(), t.to_string()))
        .collect()
}

/// The family `name` is a series of, if exported: a family of its own, or a histogram's
/// `_bucket`, `_sum` or `_count` (a histogram's bare name has no series for Prometheus).
fn family_of<'a>(name: &'a str, families: &BTreeMap<String, String>) -> Option<&'a str> {
    if families.get(name).is_some_and(|t| t != "histogram") {
        return Some(name);
    }
    ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).filter(|b| families.get(*b).is_some_and(|t| t == "histogram"))
}

#[test]
fn the_grafana_dashboard_and_the_dashboard_page_name_only_metrics_serve_exports() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/grafana/bulkhead.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("deploy/grafana/bulkhead.json")).expect("valid JSON");

    // The file's shape: panels with ids, places on the 24-column grid, and Prometheus queries
    // through the dashboard's datasource variable.
    let mut all = Vec::new();
    for p in dash["panels"].as_array().expect("panels") {
        all.push(p);
        all.extend(p["panels"].as_array().into_iter().flatten());
    }
    let mut ids = BTreeSet::new();
    for p in &all {
        let title = p["title"].as_str().unwrap_or_default();
        assert!(ids.insert(p["id"].as_u64().expect("panel id")), "duplicate id at {title}");
        let g = &p["gridPos"];
        assert!(g["x"].as_u64().unwrap_or(99) + g["w"].as_u64().unwrap_or(99) <= 24, "{title}: off the grid");
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("{title}: no targets"));
        assert!(!targets.is_empty(), "{title}: no queries");
        for t in targets {
            let expr = t["expr"].as_str().unwrap_or_default();
            assert!(!metric_names(expr).is_empty(), "{title}: a query naming no Bulkhead metric: {expr:?}");
        }
    }
    let mut grafana = Vec::new();
    queries(&dash, "", &mut grafana);
    let grafana_names: BTreeSet<String> = grafana.iter().flat_map(|(_, e)| metric_names(e)).collect();
    let page_names = metric_names(bulkhead_api::web::DASHBOARD_JS);

    // The live exposition after traffic: a finished request, and one whose client went away
    // (so the failure counter has a series too).
    let s = serve(&[]);
    let deadline = Instant::now() + Duration::from_secs(60);
    while request(&s.http, "GET", "/ready", &[], "").status != 200 {
        assert!(Instant::now() < deadline, "never ready: {}", s.logs());
        std::thread::sleep(Duration::from_millis(50));
    }
    let body = serde_json::json!({"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4});
    let r = request(&s.http, "POST", "/v1/chat/completions", &[], &body.to_string());
    assert_eq!(r.status, 200, "{}", r.body);
    abandon_a_stream(&s.http);

    // Grafana's queries name series; the page names families (it adds `_bucket` itself).
    let deadline = Instant::now() + Duration::from_secs(10);
    let (fams, missing) = loop {
        let m = request(&s.http, "GET", "/metrics", &[], "");
        assert_eq!(m.status, 200, "{}", m.body);
        // The cache activity is on the operator's page (Grafana scrapes both).
        let auth = format!("Bearer {}", support::ADMIN_KEY);
        let op = request(&s.http, "GET", "/metrics/tenants", &[("Authorization", &auth)], "");
        assert_eq!(op.status, 200, "{}", op.body);
        let fams = families(&format!("{}{}", m.body, op.body));
        let missing: Vec<String> = grafana_names
            .iter()
            .filter(|n| family_of(n, &fams).is_none())
            .chain(page_names.iter().filter(|n| !fams.contains_key(*n) && family_of(n, &fams).is_none()))
            .cloned()
            .collect();
        if missing.is_empty() || Instant::now() > deadline {
            break (fams, missing);
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let culprits: Vec<String> =
        grafana.iter().filter(|(_, e)| metric_names(e).iter().any(|n| missing.contains(n))).map(|(t, e)| format!("{t}: {e}")).collect();
    assert!(
        missing.is_empty(),
        "metrics named by deploy/grafana/bulkhead.json or /dashboard that serve does not export: {missing:?}\nGrafana queries: {culprits:#?}\nexported: {:?}",
        fams.keys().collect::<Vec<_>>()
    );

    // The Grafana dashboard has every panel of the page: each family the page reads.
    let grafana_families: BTreeSet<&str> = grafana_names.iter().filter_map(|n| family_of(n, &fams)).collect();
    let only_page: Vec<&String> =
        page_names.iter().filter(|n| !grafana_families.contains(family_of(n, &fams).unwrap_or(n.as_str()))).collect();
    assert!(only_page.is_empty(), "metrics on /dashboard without a Grafana panel: {only_page:?}");
}

/// Starts a streamed completion, reads its first bytes, and hangs up.
fn abandon_a_stream(addr: &str) {
    let body = serde_json::json!({"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": true, "stream": true})
        .to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len())
        .expect("send");
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("data: ") {
        let n = s.read(&mut buf).expect("read the stream");
        assert!(n > 0, "the stream ended early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
    }
}
