//! The gateway's worker port: each connection through the port's door and the cluster
//! handshake (the accepting side shared with the decode workers' KV port,
//! [`bulkhead_transport::handshake::admit`]), then registered with the actor and served.

use bulkhead_protocol::{FrameDecoder, FrameEncoder, Hello, Message, Purpose};
use bulkhead_transport::door::{Port, Refusal};
use bulkhead_transport::handshake::{Admitted, admit};
use bulkhead_transport::trust::Trust;
use bulkhead_transport::wire::{READ_BYTES, count_bad_connection};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::inbox::{Cmd, WORKER_OUTBOX};

/// Worker connections the gateway serves at once (registered or still in their handshake);
/// more are closed at once (and counted).
pub const MAX_WORKER_CONNECTIONS: usize = 256;

/// Accept worker connections, at most [`MAX_WORKER_CONNECTIONS`] at once, each admitted
/// on a blocking thread (the handshake is a few round trips within the door's deadline)
/// and served on the runtime from then on.
pub(crate) async fn accept(l: TcpListener, cmds: mpsc::Sender<Cmd>, trust: Trust) {
    let port = std::sync::Arc::new(Port::new("worker", MAX_WORKER_CONNECTIONS));
    loop {
        let Ok((s, peer)) = l.accept().await else { continue };
        let Ok(s) = s.into_std().and_then(|s| s.set_nonblocking(false).map(|()| s)) else { continue };
        let Some((open, waiter)) = port.enter(&s) else { continue };
        let (cmds, trust) = (cmds.clone(), trust.clone());
        tokio::spawn(async move {
            let admitted = tokio::task::spawn_blocking(move || admit(s, waiter, "worker", &trust, Purpose::Control, introduce)).await;
            if let Ok(Some(a)) = admitted
                && let Err(e) = serve(a, cmds).await
            {
                if e.kind() == std::io::ErrorKind::Other {
                    let total = count_bad_connection();
                    tracing::warn!(%peer, error = %e, bad_connections = total, "worker connection closed for bad bytes");
                } else {
                    tracing::warn!(%peer, error = %e, "worker connection closed");
                }
            }
            drop(open);
        });
    }
}

/// A worker introduces itself with its `Hello`.
fn introduce(_: Option<&bulkhead_transport::handshake::Authenticated>, first: Message) -> Result<Hello, (Refusal, String)> {
    match first {
        Message::Hello(hello) => Ok(hello),
        other => Err((Refusal::Unexpected, format!("the first frame was {}, not Hello", other.kind_name()))),
    }
}

async fn read_msg(r: &mut tokio::net::tcp::OwnedReadHalf, d: &mut FrameDecoder) -> std::io::Result<Message> {
    loop {
        if let Some(m) = d.next_message().map_err(std::io::Error::other)? {
            return Ok(m);
        }
        let want = READ_BYTES.min(d.max_wire_frame());
        let n = r.read(d.spare(want)).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        d.filled(n);
    }
}

async fn write_msg(w: &mut tokio::net::tcp::OwnedWriteHalf, enc: &mut FrameEncoder, m: &Message) -> std::io::Result<()> {
    let mut b = Vec::new();
    enc.encode(m, &mut b);
    w.write_all(&b).await
}

/// An admitted worker: registered with the actor (or told why not), then its messages
/// forwarded to the actor and the actor's to it until either side ends.
async fn serve(a: Admitted<Hello>, cmds: mpsc::Sender<Cmd>) -> std::io::Result<()> {
    let Admitted { reader, writer, intro: hello, .. } = a;
    let (stream, mut d) = reader.into_parts();
    let (_, mut enc) = writer.into_parts();
    stream.set_nonblocking(true)?;
    let (mut r, mut w) = tokio::net::TcpStream::from_std(stream)?.into_split();
    let (wtx, mut wrx) = mpsc::channel::<Message>(WORKER_OUTBOX);
    let (reply, answer) = oneshot::channel();
    cmds.send(Cmd::Register { hello, writer: wtx, reply }).await.map_err(|_| std::io::Error::other("gateway stopped"))?;
    let id = match answer.await {
        Ok(Ok(id)) => id,
        Ok(Err(why)) => {
            let reason = why.to_string();
            write_msg(&mut w, &mut enc, &Message::Refuse { reason: reason.clone() }).await?;
            return Err(std::io::Error::other(format!("refused: {reason}")));
        }
        Err(_) => return Err(std::io::Error::other("gateway stopped")),
    };
    tokio::spawn(async move {
        let mut b = Vec::new();
        while let Some(m) = wrx.recv().await {
            b.clear();
            enc.encode(&m, &mut b);
            if w.write_all(&b).await.is_err() {
                return;
            }
        }
    });
    let result = loop {
        match read_msg(&mut r, &mut d).await {
            Ok(msg) => {
                if cmds.send(Cmd::Worker { from: id, msg }).await.is_err() {
                    break Ok(());
                }
            }
            Err(e) => break Err(e),
        }
    };
    let _ = cmds.send(Cmd::Left { id }).await;
    result
}
