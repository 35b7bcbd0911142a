//! The gateway's HTTP front: a connection limit and the header timeout, around the API
//! router. Requests themselves are the API's business (it bounds body size and body
//! read time).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, oneshot, watch};

/// Limits on client connections.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    /// Connections served at once. Past this, new connections wait in the listen backlog
    /// (the kernel's) until one closes; those being served go on.
    pub max_connections: usize,
    /// How long a connection may take to send a request's headers, counted from when it
    /// opens or from the end of the previous response: so it is also the keep-alive idle
    /// timeout. A connection that exceeds it is closed.
    pub header_timeout: Duration,
}

/// Serve `app` on `listener` within `limits` until `shutdown` fires; then stop accepting,
/// let every connection finish its in-flight request, and return once all have closed.
pub async fn serve(listener: TcpListener, app: Router, limits: HttpLimits, shutdown: oneshot::Receiver<()>) -> std::io::Result<()> {
    let max = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS) as u32;
    let slots = Arc::new(Semaphore::new(max as usize));
    let (closing_tx, closing) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => s,
            _ = &mut shutdown => break,
        };
        let Ok(slot) = slot else { break };
        let stream = tokio::select! {
            r = listener.accept() => r,
            _ = &mut shutdown => break,
        };
        let stream = match stream {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors or a connection reset before accept: serving goes on.
                tracing::warn!(error = %e, "accepting an HTTP connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let svc = TowerToHyperService::new(app.clone());
        let mut closing = closing.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = closing.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    drop(listener);
    let _ = closing_tx.send(true);
    // Every connection holds a slot until it closes.
    let _all = slots.acquire_many(max).await;
    Ok(())
}
