//! The `bulkhead` binary's small commands as a user runs them, without a model: what
//! `keygen` says on an existing file, and what `loadgen` prints in an open-loop run (against
//! a scripted server here).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_bulkhead");

fn temp_path(what: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    std::env::temp_dir().join(format!("bulkhead-cli-{what}-{}-{nanos}", std::process::id()))
}

#[test]
fn keygen_on_an_existing_file_says_it_exists_once_and_keeps_the_key() {
    let path = temp_path("key");
    let made = Command::new(BIN).arg("keygen").arg(&path).output().unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let key = std::fs::read_to_string(&path).unwrap();
    let again = Command::new(BIN).arg("keygen").arg(&path).output().unwrap();
    let err = String::from_utf8_lossy(&again.stderr).into_owned();
    let kept = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(again.status.code(), Some(1), "{err}");
    assert_eq!(kept, key, "the key was overwritten");
    assert!(err.contains("already exists") && err.contains("remove the file first"), "{err}");
    assert!(!err.contains("cannot read"), "nothing was being read: {err}");
    assert!(!err.contains("os error"), "the OS's words, once or twice, add nothing here: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn keygen_into_a_missing_directory_names_the_cause_once() {
    let path = temp_path("no-such-dir").join("cluster.key");
    let out = Command::new(BIN).arg("keygen").arg(&path).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot write the cluster key file"), "{err}");
    assert_eq!(err.matches("os error 2").count(), 1, "the cause once: {err}");
}

/// A scripted OpenAI-compatible server: every request gets a four-token stream; one
/// request per connection.
fn fake_server() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(s) = s else { return };
            std::thread::spawn(move || answer(s));
        }
    });
    format!("http://{addr}")
}

fn answer(mut s: TcpStream) {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 4096];
    loop {
        let Ok(n) = s.read(&mut tmp) else { return };
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&tmp[..n]);
        let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
        let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
        let len: usize = head.lines().find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0))).unwrap_or(0);
        if buf.len() >= i + 4 + len {
            break;
        }
    }
    let chunk = |payload: &str| {
        let event = format!("data: {payload}\n\n");
        format!("{:x}\r\n{event}\r\n", event.len())
    };
    let mut out =
        String::from("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n");
    for t in ["a", "b", "c", "d"] {
        out.push_str(&chunk(&serde_json::json!({"choices": [{"index": 0, "text": t, "finish_reason": null}]}).to_string()));
    }
    out.push_str(&chunk(&serde_json::json!({"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 4}}).to_string()));
    out.push_str(&chunk("[DONE]"));
    out.push_str("0\r\n\r\n");
    let _ = s.write_all(out.as_bytes());
}

/// An open-loop run prints its table once: the report on stdout, row by row as each rate is
/// measured (it printed the rows on stderr as progress, then the whole report again).
#[test]
fn open_loop_loadgen_prints_its_table_once() {
    let url = fake_server();
    let json = temp_path("report.json");
    let out = Command::new(BIN)
        .args(["loadgen", &url, "--model", "m", "--rates", "20,40", "-n", "6", "--warmup", "0"])
        .args(["--prompt-tokens", "8", "--output-tokens", "4", "--seed", "3", "--label", "fake", "--json-out"])
        .arg(&json)
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let both = format!("{stdout}{stderr}");
    let header = "TTFT ms p50/p90/p99";
    assert_eq!(both.matches(header).count(), 1, "the table's header, once:\n{both}");
    // One row per rate, each once, on stdout with the report around it.
    let rows: Vec<&str> = both.lines().filter(|l| l.trim_start().starts_with("20.00 ") || l.trim_start().starts_with("40.00 ")).collect();
    assert_eq!(rows.len(), 2, "one row per rate:\n{both}");
    assert!(stdout.starts_with("open-loop loadgen (fake)"), "{stdout}");
    assert!(stdout.contains("goodput, SLO 1"), "{stdout}");
    // What was printed is the report's own text.
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_file(&json);
    assert_eq!(report["points"].as_array().map(Vec::len), Some(2));

    // With --json, stdout is the report alone and the rows go to stderr, once.
    let out = Command::new(BIN)
        .args(["loadgen", &url, "--model", "m", "--rates", "20", "-n", "4", "--warmup", "0", "--json"])
        .args(["--prompt-tokens", "8", "--output-tokens", "4", "--seed", "3"])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let v: serde_json::Value = serde_json::from_str(&stdout).expect("stdout is the JSON report");
    assert_eq!(v["mode"], "open-loop");
    assert_eq!(stderr.matches(header).count(), 1, "{stderr}");
}
