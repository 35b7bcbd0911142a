//! `bulkhead bench-transfer`: KV handoff throughput between two threads over loopback —
//! export from a prefill pool, frame, send, decode, verify and import into a decode pool,
//! exactly the production path minus the model (the production `FrameWriter`,
//! `FrameReader` and transport negotiation, over TCP or UCX) — next to plain memcpy of the
//! same bytes, with the cluster MAC (issue 18) on every frame, and with every frame
//! encrypted as well.

use std::net::{TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Instant;

use bulkhead_kv::transfer::{ChunkExport, Manifest};
use bulkhead_kv::{Inbound, KvChecks, KvLayout, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_protocol::auth::{Client, ClusterKey, Server, Session};
use bulkhead_protocol::{Message, Purpose};
use bulkhead_transport::kv_transport::{Chosen, KvTransport};
use bulkhead_transport::wire::{FrameReader, FrameWriter};
use clap::Args;

use crate::serve::args::KvTransportArg;

#[derive(Args, Debug)]
pub struct TransferArgs {
    /// Prompt tokens per transfer.
    #[arg(long, env = "BULKHEAD_BENCH_TRANSFER_TOKENS", default_value_t = 2000)]
    tokens: usize,
    /// Transfers timed (the median is reported).
    #[arg(long, env = "BULKHEAD_BENCH_TRANSFER_REPS", default_value_t = 5)]
    reps: usize,
    /// The road the chunks take, chosen as `serve` chooses it; other than tcp, the TCP figure is measured beside it.
    #[arg(long, env = "BULKHEAD_KV_TRANSPORT", value_enum, default_value_t = KvTransportArg::Auto)]
    kv_transport: KvTransportArg,
    /// A GGUF model whose KV shape (layers, KV heads, head size) the transfers take; only its
    /// metadata is read. The default model's shape without it.
    #[arg(long = "model", env = "BULKHEAD_BENCH_TRANSFER_MODEL")]
    model: Option<std::path::PathBuf>,
}

/// The default model's KV shape.
const DEFAULT_LAYOUT: KvLayout = KvLayout { layers: 30, kv_heads: 3, head_dim: 64, page_size: 16 };

/// Both sides of a session under `key`, encrypted or not (the production handshake, in
/// memory): the prefill side's and the decode side's.
fn sessions(key: &ClusterKey, encrypt: bool) -> anyhow::Result<(Session, Session)> {
    let (client, hello) = Client::start(key, Purpose::Kv, 1, encrypt, bulkhead_transport::trust::random()?);
    let (server, challenge) = Server::start(key, Purpose::Kv, hello, encrypt, bulkhead_transport::trust::random()?)?;
    let (proof, prefill) = client.finish(challenge)?;
    let decode = server.finish(proof)?;
    anyhow::ensure!(decode.encrypted == encrypt, "the session's encryption is not what was asked");
    Ok((prefill, decode))
}

/// A connection's two ends as the workers hold them, sealed under `session` if any.
fn ends(stream: TcpStream, session: Option<Session>) -> anyhow::Result<(FrameReader, FrameWriter)> {
    stream.set_nodelay(true)?;
    let mut r = FrameReader::new(stream.try_clone()?);
    let mut w = FrameWriter::new(stream);
    if let Some(s) = session {
        r.open_with(s.recv);
        w.seal_with(s.send);
    }
    Ok((r, w))
}

/// Seconds per verified transfer of `n` tokens between two pools running `checks`, `reps`
/// times over one connection (set up untimed, as a worker's lives long), and the road it
/// took; with `key`, every frame is sealed as in production (encrypted if its flag says so).
fn transfer_times(
    layout: KvLayout,
    checks: KvChecks,
    key: Option<(&ClusterKey, bool)>,
    transport: KvTransport,
    n: usize,
    reps: usize,
) -> anyhow::Result<(Vec<f64>, Chosen)> {
    let pages = layout.pages_for_tokens(n);
    let mut src = KvPool::new(PoolConfig { layout, pages, checks })?;
    let mut seq = SequenceKv::new(RequestId(1));
    seq.reserve(&mut src, n)?;
    let row: Vec<f32> = (0..layout.row_elems()).map(|i| i as f32 * 0.01).collect();
    for pos in 0..n {
        let (lease, slot) = seq.locate(pos)?;
        for layer in 0..layout.layers {
            src.write(lease, layer, slot, &row, &row)?;
        }
    }
    seq.commit(&src, n)?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut dst = KvPool::new(PoolConfig { layout, pages, checks })?;
    let (prefill_session, decode_session) = match key {
        Some((k, encrypt)) => sessions(k, encrypt).map(|(p, d)| (Some(p), Some(d)))?,
        None => (None, None),
    };
    let (targets_tx, targets_rx) = mpsc::channel::<(RequestId, Vec<bulkhead_kv::PageRef>)>();
    let (digest_tx, digest_rx) = mpsc::channel();
    let (srcref, seqref) = (&src, &seq);
    std::thread::scope(|s| -> anyhow::Result<(Vec<f64>, Chosen)> {
        let sender = s.spawn(move || -> anyhow::Result<Chosen> {
            let (mut r, mut w) = ends(TcpStream::connect(addr)?, prefill_session)?;
            // The bench's peers are its own two threads: "authenticated" even unsealed, so
            // the unsealed figures can take UCX too.
            let chosen = transport.connect(true, &mut r, &mut w)?;
            for (req, targets) in targets_rx {
                let mut m = Manifest::default();
                let mut chunks = ChunkExport::new(srcref, seqref, &targets, 0, 0, n, &mut m);
                while w.send_kv_chunk(req, &mut chunks)?.is_some() {}
                digest_tx.send(m.digest())?;
            }
            Ok(chosen)
        });
        let (conn, _) = listener.accept()?;
        let (mut r, mut w) = ends(conn, decode_session)?;
        transport.accept(true, &mut r, &mut w)?;
        let mut times = Vec::new();
        for rep in 0..reps {
            let req = RequestId(100 + rep as u64);
            let mut inbound = Inbound::reserve(&mut dst, req, n, n)?;
            let t = Instant::now();
            targets_tx.send((req, inbound.prompt_pages(layout.page_size)))?;
            while inbound.received_tokens() < n {
                match r.recv()? {
                    Message::KvChunk { header, data, .. } => inbound.accept(&mut dst, &header, &data)?,
                    other => anyhow::bail!("{} where a KV chunk was due", other.kind_name()),
                }
            }
            let v = inbound.finish(&dst, n, digest_rx.recv()?).map_err(|(e, _)| e)?;
            times.push(t.elapsed().as_secs_f64());
            v.into_sequence().release(&mut dst)?;
        }
        drop(targets_tx);
        let chosen = sender.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
        Ok((times, chosen))
    })
}

/// One core's rate (GB/s) of sealing `bytes` in 1 MiB frames with each candidate for the
/// frame tag: why the encrypted session uses AES-256-GCM (with AES-NI) and not
/// ChaCha20-Poly1305, and what the MAC-only session's BLAKE3 costs.
fn cipher_rates(bytes: usize) -> anyhow::Result<Vec<(&'static str, f64)>> {
    use ring::aead::{AES_256_GCM, Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};
    let key = bulkhead_transport::trust::random()?;
    let mut frame = vec![7u8; 1 << 20];
    let frames = bytes.div_ceil(frame.len());
    let total = (frames * frame.len()) as f64;
    let rate = |t: Instant| total / 1e9 / t.elapsed().as_secs_f64();
    let mut out = Vec::new();
    for (name, alg) in [("AES-256-GCM", &AES_256_GCM), ("ChaCha20-Poly1305", &CHACHA20_POLY1305)] {
        let k = LessSafeKey::new(UnboundKey::new(alg, &key).map_err(|_| anyhow::anyhow!("{name} refused the key"))?);
        let t = Instant::now();
        for i in 0..frames as u64 {
            let mut n = [0u8; 12];
            n[4..].copy_from_slice(&i.to_le_bytes());
            let tag = k
                .seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::from(b"header"), &mut frame)
                .map_err(|_| anyhow::anyhow!("{name} refused a frame"))?;
            std::hint::black_box(tag.as_ref()[0]);
        }
        out.push((name, rate(t)));
    }
    let t = Instant::now();
    for _ in 0..frames {
        std::hint::black_box(blake3::keyed_hash(&key, &frame));
    }
    out.push(("keyed BLAKE3 (MAC only)", rate(t)));
    Ok(out)
}

pub fn run(a: TransferArgs) -> anyhow::Result<()> {
    let n = a.tokens.max(1);
    let reps = a.reps.max(1);
    let layout = match &a.model {
        Some(path) => {
            let c = bulkhead_model::LlamaConfig::from_gguf(&bulkhead_gguf::GgufFile::open_metadata(path)?)?;
            KvLayout { layers: c.layers, kv_heads: c.kv_heads, head_dim: c.head_dim, page_size: DEFAULT_LAYOUT.page_size }
        }
        None => DEFAULT_LAYOUT,
    };
    let bytes = n * layout.bytes_per_token();
    let transport = KvTransport::from(a.kv_transport);
    // Production checks (checksums on) without and with the cluster MAC, encrypted, and
    // checksums off, each over one connection, and plain TCP beside them.
    let no_checksums = KvChecks { checksums: false, ..KvChecks::default() };
    let key = bulkhead_transport::trust::generate_key()?;
    let (times, chosen) = transfer_times(layout, KvChecks::default(), None, transport, n, reps)?;
    let (sealed, _) = transfer_times(layout, KvChecks::default(), Some((&key, false)), transport, n, reps)?;
    let (encrypted, _) = transfer_times(layout, KvChecks::default(), Some((&key, true)), transport, n, reps)?;
    let (unchecked, _) = transfer_times(layout, no_checksums, None, transport, n, reps)?;
    let tcp = if matches!(chosen, Chosen::Ucx(_)) {
        Some(transfer_times(layout, KvChecks::default(), None, KvTransport::Tcp, n, reps)?.0)
    } else {
        None
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (transfer, transfer_sealed, transfer_encrypted, transfer_unchecked) =
        (median(times), median(sealed), median(encrypted), median(unchecked));
    // memcpy of the same number of bytes, median of several copies.
    let from = vec![7u8; bytes];
    let mut to = vec![0u8; bytes];
    let mut copies = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        to.copy_from_slice(std::hint::black_box(&from));
        std::hint::black_box(&to);
        copies.push(t.elapsed().as_secs_f64());
    }
    copies.sort_by(f64::total_cmp);
    let copy = copies[copies.len() / 2];
    let gb = bytes as f64 / 1e9;
    let road = match &chosen {
        Chosen::Ucx(lanes) => format!("UCX {} ({lanes})", bulkhead_ucx::version().map(|v| v.to_string()).unwrap_or_default()),
        Chosen::Tcp(why) => format!("loopback TCP ({why})"),
    };
    println!("KV transfer of {n} tokens ({:.1} MB) over {road}: {:.3} s, {:.2} GB/s verified", bytes as f64 / 1e6, transfer, gb / transfer);
    println!("memcpy of the same bytes: {:.2} GB/s; transfer / memcpy = {:.3}", gb / copy, copy / transfer);
    if let Some(tcp) = tcp {
        let tcp = median(tcp);
        println!(
            "the same over loopback TCP: {:.2} GB/s, transfer / memcpy = {:.3}; UCX / TCP throughput = {:.2}",
            gb / tcp,
            copy / tcp,
            tcp / transfer
        );
    }
    println!(
        "with the cluster MAC on every frame (keyed BLAKE3): {:.2} GB/s; throughput with / without the MAC = {:.3}",
        gb / transfer_sealed,
        transfer / transfer_sealed
    );
    println!(
        "with every frame encrypted as well (AES-256-GCM, --cluster-encryption on): {:.2} GB/s; throughput encrypted / unauthenticated = {:.3}",
        gb / transfer_encrypted,
        transfer / transfer_encrypted
    );
    let rates: Vec<String> = cipher_rates(bytes)?.iter().map(|(name, r)| format!("{name} {r:.2} GB/s")).collect();
    println!("one core sealing the same bytes in 1 MiB frames: {}", rates.join(", "));
    println!(
        "without checksums (measurement only): {:.2} GB/s, transfer / memcpy = {:.3}; throughput with / without checksums = {:.3}",
        gb / transfer_unchecked,
        copy / transfer_unchecked,
        transfer_unchecked / transfer
    );
    Ok(())
}
