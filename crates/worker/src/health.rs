//! A worker's health listener (`serve --health-listen`): liveness and readiness over plain
//! HTTP for probes (Kubernetes `httpGet`), since workers serve no HTTP otherwise.
//!
//! What it reports is the worker's main loop, not the process: the loop turns at least
//! every 50 ms when idle and after every compute step when busy, and a worker whose gateway
//! connection closes exits, so a loop that turned recently means a worker still registered
//! and still serving. A loop that stopped turning (a hung step, a deadlock) is what a
//! process-alive check cannot see.
//!
//! - `GET /health`: 200 while the worker loads its model and registers, and while its loop
//!   turned within [`STALL`]; 503 once it has not.
//! - `GET /ready`: 200 while the worker is registered and its loop turned within
//!   [`STALL`]; 503 before it registered, while a prefill worker rejoins, and when stalled.
//!
//! The answer carries nothing but the state and the loop's age: no key, no request data.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long the main loop may go without turning before the worker counts as stalled: far
/// above one compute step of any model this serves on a CPU.
pub const STALL: Duration = Duration::from_secs(60);

/// The main loop's heartbeat, shared with the listener's thread.
#[derive(Debug)]
pub struct Health {
    start: Instant,
    /// Milliseconds since `start` at the loop's last turn.
    last_turn_ms: AtomicU64,
    /// Whether the loop has turned at least once (the worker registered once).
    turned: AtomicBool,
    /// Whether the worker is registered now.
    registered: AtomicBool,
}

impl Health {
    pub fn new() -> Arc<Health> {
        Arc::new(Health {
            start: Instant::now(),
            last_turn_ms: AtomicU64::new(0),
            turned: AtomicBool::new(false),
            registered: AtomicBool::new(false),
        })
    }

    /// The main loop turned, registered with the gateway.
    pub fn beat(&self) {
        self.last_turn_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
        self.turned.store(true, Ordering::Relaxed);
        self.registered.store(true, Ordering::Relaxed);
    }

    /// The worker left the gateway and will register again (a prefill worker rejoining).
    pub fn unregistered(&self) {
        self.registered.store(false, Ordering::Relaxed);
    }

    /// (status code, body) for a path.
    pub fn answer(&self, path: &str) -> (u16, String) {
        let now = self.start.elapsed().as_millis() as u64;
        let age = now.saturating_sub(self.last_turn_ms.load(Ordering::Relaxed));
        let turned = self.turned.load(Ordering::Relaxed);
        let stalled = turned && age > STALL.as_millis() as u64;
        let registered = self.registered.load(Ordering::Relaxed);
        let state = if !turned {
            "starting"
        } else if stalled {
            "stalled"
        } else if registered {
            "ok"
        } else {
            "rejoining"
        };
        let body =
            if turned { format!("{{\"status\":\"{state}\",\"loop_age_ms\":{age}}}\n") } else { format!("{{\"status\":\"{state}\"}}\n") };
        match path {
            "/health" => (if stalled { 503 } else { 200 }, body),
            "/ready" => (if registered && !stalled { 200 } else { 503 }, body),
            _ => (404, "{\"status\":\"not found\"}\n".into()),
        }
    }
}

/// Answer probes on `listener` on a thread of its own, one short connection at a time.
pub fn spawn(listener: TcpListener, health: Arc<Health>) {
    std::thread::Builder::new()
        .name("health".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                let _ = respond(stream, &health);
            }
        })
        .expect("cannot start the health listener's thread");
}

fn respond(mut stream: TcpStream, health: &Health) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    // The request line is all we read: `GET /path HTTP/1.1`, within the first 1 KiB.
    let mut buf = [0u8; 1024];
    let mut len = 0;
    while len < buf.len() && !buf[..len].contains(&b'\n') {
        match stream.read(&mut buf[len..])? {
            0 => break,
            n => len += n,
        }
    }
    let line = String::from_utf8_lossy(&buf[..len]);
    let mut words = line.split_whitespace();
    let (code, body) = match (words.next(), words.next()) {
        (Some("GET" | "HEAD"), Some(path)) => health.answer(path),
        _ => (400, "{\"status\":\"bad request\"}\n".into()),
    };
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    if !line.starts_with("HEAD") {
        stream.write_all(body.as_bytes())?;
    }
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starting_then_ok_then_rejoining() {
        let h = Health::new();
        assert_eq!(h.answer("/health").0, 200);
        assert_eq!(h.answer("/ready").0, 503);
        h.beat();
        assert_eq!(h.answer("/health").0, 200);
        assert_eq!(h.answer("/ready").0, 200);
        h.unregistered();
        assert_eq!(h.answer("/health").0, 200);
        assert_eq!(h.answer("/ready").0, 503);
        assert_eq!(h.answer("/metrics").0, 404);
    }

    #[test]
    fn a_stalled_loop_fails_both() {
        let h = Health::new();
        h.beat();
        // A last turn longer ago than STALL.
        h.last_turn_ms.store(0, Ordering::Relaxed);
        let Some(start) = h.start.checked_sub(STALL + Duration::from_secs(1)) else {
            return; // the monotonic clock is younger than STALL: nothing to go back to
        };
        let h = Health { start, ..Arc::try_unwrap(h).unwrap() };
        assert_eq!(h.answer("/health").0, 503);
        assert_eq!(h.answer("/ready").0, 503);
        assert!(h.answer("/health").1.contains("stalled"));
    }

    #[test]
    fn over_tcp() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let h = Health::new();
        h.beat();
        spawn(listener, h);
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(out.contains("\"status\":\"ok\""), "{out}");
    }
}
