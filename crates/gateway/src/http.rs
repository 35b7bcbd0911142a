//! The gateway's HTTP front: which client connections are served, and for how long, around
//! the API router. Requests themselves are the API's business (it bounds body size and
//! body read time).
//!
//! A connection that has not yet carried an authenticated request (a tenant's key, or any
//! `/v1/` request where no keys are configured: [`Authenticated`]) is a stranger, and
//! strangers cannot hold the server:
//!
//! - its first request's headers are due within [`HttpLimits::first_header_timeout`], shorter
//!   than the keep-alive idle timeout between requests ([`HttpLimits::header_timeout`]);
//! - it stays at most [`HttpLimits::stranger_lifetime`] (then its request in flight, if any,
//!   finishes and it closes);
//! - one source address holds at most [`HttpLimits::max_per_source`] connections, and when
//!   the server holds [`HttpLimits::max_connections`] a new connection takes the place of
//!   the oldest idle stranger of the source that holds the most. So idle connections from
//!   one address, or a few, cannot keep another client out: the newest always gets its
//!   chance, and a connection that has authenticated is never closed to make room.
//!
//! What this cannot do (many addresses, a slow body) is in SECURITY.md.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use bulkhead_api::Authenticated;
use hyper::service::Service as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Notify, Semaphore, oneshot, watch};

/// Limits on client connections.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    /// Connections served at once. At the cap a new connection takes the place of the oldest
    /// idle stranger (of the source with the most); with none, it waits in the listen
    /// backlog until one closes.
    pub max_connections: usize,
    /// Connections one source address may hold at once; one more takes the place of that
    /// source's oldest idle stranger, or is closed.
    pub max_per_source: usize,
    /// How long a new connection may take to send its first request's headers.
    pub first_header_timeout: Duration,
    /// How long a connection may take to send a later request's headers, counted from the
    /// end of the previous response: the keep-alive idle timeout.
    pub header_timeout: Duration,
    /// How long a connection that never carried an authenticated request may stay open.
    pub stranger_lifetime: Duration,
}

/// Why the front closed a client connection itself (`bulkhead:http_connections_closed_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// No first request's headers within [`HttpLimits::first_header_timeout`].
    FirstHeader,
    /// A stranger past [`HttpLimits::stranger_lifetime`].
    StrangerLifetime,
    /// An idle stranger closed to make room for a new connection.
    Evicted,
    /// A new connection over [`HttpLimits::max_per_source`] with no stranger of its source to
    /// replace.
    SourceFull,
}

impl Closed {
    /// Every reason, in metric order.
    pub const ALL: [Closed; 4] = [Closed::FirstHeader, Closed::StrangerLifetime, Closed::Evicted, Closed::SourceFull];

    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Closed::FirstHeader => "first_header_deadline",
            Closed::StrangerLifetime => "stranger_lifetime",
            Closed::Evicted => "evicted",
            Closed::SourceFull => "source_full",
        }
    }
}

/// Counts of [`Closed`], for `/metrics`.
#[derive(Debug, Default)]
pub struct HttpStats {
    closed: [AtomicU64; 4],
}

impl HttpStats {
    /// Connections closed for `reason` so far.
    pub fn closed(&self, reason: Closed) -> u64 {
        self.closed[reason as usize].load(Ordering::Relaxed)
    }

    fn count(&self, reason: Closed) {
        self.closed[reason as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// One connection as the front sees it.
#[derive(Default)]
struct Conn {
    /// It carried an authenticated request: never evicted, no lifetime.
    known: AtomicBool,
    /// Requests in the service now (their responses' heads not yet sent).
    in_service: AtomicUsize,
    /// Requests whose headers arrived.
    requests: AtomicU64,
    /// Fired to close it to make room.
    evict: Notify,
}

impl Conn {
    fn idle_stranger(&self) -> bool {
        !self.known.load(Ordering::Acquire) && self.in_service.load(Ordering::Acquire) == 0
    }
}

/// The connections open now, by accept order, with their sources.
#[derive(Default)]
struct Table {
    next: u64,
    open: BTreeMap<u64, (IpAddr, Arc<Conn>)>,
}

impl Table {
    fn of(&self, source: IpAddr) -> usize {
        self.open.values().filter(|(s, _)| *s == source).count()
    }

    /// Tell the oldest idle stranger of `source` (or, with none given, of the source with
    /// the most idle strangers) to close. False when there is none.
    fn evict(&self, source: Option<IpAddr>) -> bool {
        let source = source.or_else(|| {
            let mut per: BTreeMap<IpAddr, usize> = BTreeMap::new();
            for (s, _) in self.open.values().filter(|(_, c)| c.idle_stranger()) {
                *per.entry(*s).or_default() += 1;
            }
            per.into_iter().max_by_key(|(_, n)| *n).map(|(s, _)| s)
        });
        let oldest = self.open.values().find(|(s, c)| Some(*s) == source && c.idle_stranger());
        oldest.inspect(|(_, c)| c.evict.notify_one()).is_some()
    }
}

/// Removes its connection from the table when the connection's task ends.
struct Entry {
    table: Arc<Mutex<Table>>,
    id: u64,
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.table.lock().unwrap_or_else(PoisonError::into_inner).open.remove(&self.id);
    }
}

/// Counts a request in service until its response's head is out (or it is dropped).
struct InService(Arc<Conn>);

impl Drop for InService {
    fn drop(&mut self) {
        self.0.in_service.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Serve `app` on `listener` within `limits` until `shutdown` fires; then stop accepting,
/// let every connection finish its in-flight request, and return once all have closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    stats: Arc<HttpStats>,
    shutdown: oneshot::Receiver<()>,
) -> std::io::Result<()> {
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS) as u32;
    let per_source = limits.max_per_source.max(1);
    let slots = Arc::new(Semaphore::new(max as usize));
    let table = Arc::new(Mutex::new(Table::default()));
    let (closing_tx, closing) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = &mut shutdown => break,
        };
        let (stream, source) = match accepted {
            Ok((s, addr)) => (s, addr.ip()),
            Err(e) => {
                // Out of descriptors or a connection reset before accept: serving goes on.
                tracing::warn!(error = %e, "accepting an HTTP connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        {
            let t = table.lock().unwrap_or_else(PoisonError::into_inner);
            if t.of(source) >= per_source && !t.evict(Some(source)) {
                stats.count(Closed::SourceFull);
                tracing::debug!(%source, "HTTP connection closed: its source holds --max-connections-per-source");
                continue;
            }
        }
        let slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(s) => s,
            Err(_) => {
                // Full: make room if a stranger idles, else wait for any connection to end.
                table.lock().unwrap_or_else(PoisonError::into_inner).evict(None);
                let s = tokio::select! {
                    s = Arc::clone(&slots).acquire_owned() => s,
                    _ = &mut shutdown => break,
                };
                let Ok(s) = s else { break };
                s
            }
        };
        let conn = Arc::new(Conn::default());
        let entry = {
            let mut t = table.lock().unwrap_or_else(PoisonError::into_inner);
            let id = t.next;
            t.next += 1;
            t.open.insert(id, (source, Arc::clone(&conn)));
            Entry { table: Arc::clone(&table), id }
        };
        let tower = TowerToHyperService::new(app.clone());
        let counted = Arc::clone(&conn);
        let svc = hyper::service::service_fn(move |req| {
            counted.requests.fetch_add(1, Ordering::AcqRel);
            counted.in_service.fetch_add(1, Ordering::AcqRel);
            let guard = InService(Arc::clone(&counted));
            let resp = tower.call(req);
            async move {
                let resp = resp.await;
                if resp.as_ref().is_ok_and(|r| r.extensions().get::<Authenticated>().is_some()) {
                    guard.0.known.store(true, Ordering::Release);
                }
                drop(guard);
                resp
            }
        });
        let mut closing = closing.clone();
        let stats = Arc::clone(&stats);
        tokio::spawn(async move {
            let _slot = slot;
            let _entry = entry;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
            let served = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(served);
            let first_header = tokio::time::sleep(limits.first_header_timeout);
            let lifetime = tokio::time::sleep(limits.stranger_lifetime);
            tokio::pin!(first_header, lifetime);
            let (mut first_checked, mut lifetime_checked) = (false, false);
            loop {
                tokio::select! {
                    _ = served.as_mut() => return,
                    _ = closing.changed() => break,
                    _ = &mut first_header, if !first_checked => {
                        first_checked = true;
                        if conn.requests.load(Ordering::Acquire) == 0 {
                            stats.count(Closed::FirstHeader);
                            return;
                        }
                    }
                    _ = &mut lifetime, if !lifetime_checked => {
                        lifetime_checked = true;
                        if conn.known.load(Ordering::Acquire) {
                            // A known client keeps only the keep-alive idle timeout.
                            continue;
                        }
                        stats.count(Closed::StrangerLifetime);
                        if conn.in_service.load(Ordering::Acquire) == 0 {
                            return;
                        }
                        break;
                    }
                    _ = conn.evict.notified() => {
                        if conn.idle_stranger() {
                            stats.count(Closed::Evicted);
                            return;
                        }
                    }
                }
            }
            // Finish the request in flight, then close.
            served.as_mut().graceful_shutdown();
            let _ = served.await;
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    // Every connection holds a slot until it closes.
    let _all = slots.acquire_many(max).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Instant;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpSocket, TcpStream};

    use super::*;

    const LONG: Duration = Duration::from_secs(60);

    /// A front on 127.0.0.1 with a public `/health` and an authenticated `/v1/x`.
    async fn front(limits: HttpLimits) -> (SocketAddr, Arc<HttpStats>, oneshot::Sender<()>) {
        let known = |mut r: axum::response::Response| {
            r.extensions_mut().insert(Authenticated);
            r
        };
        let app = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/v1/x", get(move || async move { known(axum::response::IntoResponse::into_response("ok")) }));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stats = Arc::new(HttpStats::default());
        let (tx, rx) = oneshot::channel();
        tokio::spawn(serve(listener, app, limits, Arc::clone(&stats), rx));
        (addr, stats, tx)
    }

    fn limits(max_connections: usize, max_per_source: usize) -> HttpLimits {
        HttpLimits { max_connections, max_per_source, first_header_timeout: LONG, header_timeout: LONG, stranger_lifetime: LONG }
    }

    async fn connect(from: [u8; 4], to: SocketAddr) -> TcpStream {
        let s = TcpSocket::new_v4().expect("socket");
        s.bind(SocketAddr::from((from, 0))).expect("bind the source");
        s.connect(to).await.expect("connect")
    }

    /// Sends `GET path` (keep-alive) and reads its response, `None` if the connection
    /// closed first.
    async fn get_on(c: &mut TcpStream, path: &str) -> Option<String> {
        c.write_all(format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").as_bytes()).await.ok()?;
        let mut got = Vec::new();
        let mut buf = [0u8; 512];
        while !got.ends_with(b"ok") {
            let n = c.read(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            got.extend_from_slice(&buf[..n]);
        }
        Some(String::from_utf8_lossy(&got).into_owned())
    }

    /// Whether the server closes `c` within `within`.
    async fn closed_within(c: &mut TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 64];
        matches!(tokio::time::timeout(within, c.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
    }

    /// Idle connections from one address, each with half a request line (the testers'
    /// attack), up to the whole connection cap: another address is served at once, by the
    /// per-source cap (`per_source` < cap) or, with no such cap, by evicting the oldest.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_strangers_from_one_address_cannot_keep_another_address_out() {
        for per_source in [4, 8] {
            let (addr, stats, _stop) = front(limits(8, per_source)).await;
            let mut held = Vec::new();
            for _ in 0..8 {
                let mut c = connect([127, 0, 0, 1], addr).await;
                c.write_all(b"GET /heal").await.expect("half a request line");
                held.push(c);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            let t = Instant::now();
            let mut c = connect([127, 0, 0, 2], addr).await;
            let answer = tokio::time::timeout(Duration::from_secs(1), get_on(&mut c, "/health")).await;
            assert!(matches!(answer, Ok(Some(ref r)) if r.starts_with("HTTP/1.1 200")), "per source {per_source}: {answer:?}");
            assert!(t.elapsed() < Duration::from_secs(1));
            assert!(stats.closed(Closed::Evicted) >= 1, "per source {per_source}");
        }
    }

    /// A client that authenticated is never evicted: at the cap, with only known clients
    /// open, a new connection waits for one to close.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_known_connection_is_never_closed_to_make_room() {
        let (addr, stats, _stop) = front(limits(2, 2)).await;
        let mut a = connect([127, 0, 0, 1], addr).await;
        let mut b = connect([127, 0, 0, 1], addr).await;
        assert!(get_on(&mut a, "/v1/x").await.is_some());
        assert!(get_on(&mut b, "/v1/x").await.is_some());
        let mut c = connect([127, 0, 0, 2], addr).await;
        let waiting = tokio::time::timeout(Duration::from_millis(500), get_on(&mut c, "/health")).await;
        assert!(waiting.is_err(), "served while both known connections are open: {waiting:?}");
        assert_eq!(stats.closed(Closed::Evicted), 0);
        assert!(get_on(&mut a, "/v1/x").await.is_some(), "the known connection is still open");
    }

    /// Over the per-source cap with only known connections of that source, the new one is
    /// closed (another source is not affected).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_source_at_its_cap_of_known_connections_gets_no_more() {
        let (addr, stats, _stop) = front(limits(8, 1)).await;
        let mut a = connect([127, 0, 0, 1], addr).await;
        assert!(get_on(&mut a, "/v1/x").await.is_some());
        let mut b = connect([127, 0, 0, 1], addr).await;
        assert!(closed_within(&mut b, Duration::from_secs(1)).await);
        assert_eq!(stats.closed(Closed::SourceFull), 1);
        let mut c = connect([127, 0, 0, 2], addr).await;
        assert!(get_on(&mut c, "/health").await.is_some());
    }

    /// The first request's headers are due sooner than the keep-alive idle timeout: a silent
    /// connection is closed at the first deadline, one that sent a request may idle longer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn first_headers_are_due_sooner_than_the_keep_alive_idle_timeout() {
        let first = Duration::from_millis(300);
        let (addr, stats, _stop) = front(HttpLimits { first_header_timeout: first, ..limits(8, 8) }).await;
        let mut silent = connect([127, 0, 0, 1], addr).await;
        let mut talker = connect([127, 0, 0, 1], addr).await;
        assert!(get_on(&mut talker, "/v1/x").await.is_some());
        assert!(closed_within(&mut silent, Duration::from_secs(2)).await, "the silent connection is still open");
        assert_eq!(stats.closed(Closed::FirstHeader), 1);
        tokio::time::sleep(first * 2).await;
        assert!(get_on(&mut talker, "/v1/x").await.is_some(), "the keep-alive connection was closed");
    }

    /// A connection that never authenticated is closed after its lifetime even while it
    /// keeps asking for public pages; one that authenticated stays.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stranger_is_closed_after_its_lifetime_and_a_known_client_stays() {
        let life = Duration::from_millis(400);
        let (addr, stats, _stop) = front(HttpLimits { stranger_lifetime: life, ..limits(8, 8) }).await;
        let mut stranger = connect([127, 0, 0, 1], addr).await;
        let mut known = connect([127, 0, 0, 1], addr).await;
        assert!(get_on(&mut known, "/v1/x").await.is_some());
        let t = Instant::now();
        let mut served = 0;
        while get_on(&mut stranger, "/health").await.is_some() {
            served += 1;
            assert!(t.elapsed() < Duration::from_secs(3), "the stranger is still served after {served} requests");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(served >= 1);
        assert_eq!(stats.closed(Closed::StrangerLifetime), 1);
        assert!(get_on(&mut known, "/health").await.is_some(), "the known connection was closed");
    }
}
