//! `bulkhead bench-transfer`: KV handoff throughput over loopback TCP — export from a
//! prefill pool, frame, send, decode, verify and import into a decode pool, exactly the
//! production path minus the model — next to plain memcpy of the same bytes, with the
//! cluster MAC (issue 18) on every frame, and with every frame encrypted as well.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use bulkhead_kv::transfer::{export_chunks, Manifest};
use bulkhead_kv::{Inbound, KvLayout, KvPool, KvChecks, PoolConfig, RequestId, SequenceKv};
use bulkhead_protocol::auth::{Client, ClusterKey, Server, Session};
use bulkhead_protocol::{FrameDecoder, FrameEncoder, Message, Purpose, DEFAULT_MAX_FRAME};
use clap::Args;

#[derive(Args, Debug)]
pub struct TransferArgs {
    /// Prompt tokens per transfer.
    #[arg(long, env = "BULKHEAD_BENCH_TRANSFER_TOKENS", default_value_t = 2000)]
    tokens: usize,
    /// Transfers timed (the median is reported).
    #[arg(long, env = "BULKHEAD_BENCH_TRANSFER_REPS", default_value_t = 5)]
    reps: usize,
}

/// The default model's KV shape.
const LAYOUT: KvLayout = KvLayout { layers: 30, kv_heads: 3, head_dim: 64, page_size: 16 };

/// The two ends of one direction of a session under `key`, encrypted or not (the
/// production handshake, in memory): what the prefill side seals with and what the decode
/// side opens with.
fn session(key: &ClusterKey, encrypt: bool) -> anyhow::Result<(FrameEncoder, FrameDecoder)> {
    let (client, hello) = Client::start(key, Purpose::Kv, 1, encrypt, bulkhead_server::trust::random()?);
    let (server, challenge) = Server::start(key, Purpose::Kv, hello, encrypt, bulkhead_server::trust::random()?)?;
    let (proof, sender): (Message, Session) = client.finish(challenge)?;
    let receiver = server.finish(proof)?;
    anyhow::ensure!(receiver.encrypted == encrypt, "the session's encryption is not what was asked");
    let mut dec = FrameDecoder::new(DEFAULT_MAX_FRAME);
    dec.open_with(receiver.recv);
    Ok((FrameEncoder::sealed(sender.send), dec))
}

/// Seconds per verified transfer of `n` tokens between two pools running `checks`, `reps`
/// times; with `key`, every frame is sealed as in production (encrypted if its flag says so).
fn transfer_times(checks: KvChecks, key: Option<(&ClusterKey, bool)>, n: usize, reps: usize) -> anyhow::Result<Vec<f64>> {
    let pages = LAYOUT.pages_for_tokens(n);
    let mut src = KvPool::new(PoolConfig { layout: LAYOUT, pages, checks })?;
    let mut seq = SequenceKv::new(RequestId(1));
    seq.reserve(&mut src, n)?;
    let row: Vec<f32> = (0..LAYOUT.row_elems()).map(|i| i as f32 * 0.01).collect();
    for pos in 0..n {
        let (lease, slot) = seq.locate(pos)?;
        for layer in 0..LAYOUT.layers {
            src.write(lease, layer, slot, &row, &row)?;
        }
    }
    seq.commit(&src, n)?;
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let mut dst = KvPool::new(PoolConfig { layout: LAYOUT, pages, checks })?;
    let mut times = Vec::new();
    for rep in 0..reps {
        let req = RequestId(100 + rep as u64);
        let mut inbound = Inbound::reserve(&mut dst, req, n, n)?;
        let targets = inbound.prompt_pages(LAYOUT.page_size);
        let (mut enc, mut dec) = match key {
            Some((k, encrypt)) => session(k, encrypt)?,
            None => (FrameEncoder::plain(), FrameDecoder::new(DEFAULT_MAX_FRAME)),
        };
        let t = Instant::now();
        let (srcref, seqref) = (&src, &seq);
        let (manifest, received) = std::thread::scope(|s| -> anyhow::Result<(u64, anyhow::Result<()>)> {
            let sender = s.spawn(move || -> anyhow::Result<u64> {
                let mut c = TcpStream::connect(addr)?;
                c.set_nodelay(true)?;
                let mut m = Manifest::default();
                let mut buf = Vec::new();
                for (header, data) in export_chunks(srcref, seqref, &targets, 0, n, &mut m)? {
                    buf.clear();
                    enc.encode(&Message::KvChunk { req, header, data }, &mut buf);
                    c.write_all(&buf)?;
                }
                Ok(m.digest())
            });
            let (mut conn, _) = listener.accept()?;
            let recv = (|| -> anyhow::Result<()> {
                while inbound.received_tokens() < n {
                    // As the production reader does (server::wire::FrameReader).
                    let k = std::io::Read::read(&mut conn, dec.spare(256 << 10))?;
                    anyhow::ensure!(k > 0, "sender closed early");
                    dec.filled(k);
                    while let Some(Message::KvChunk { header, data, .. }) = dec.next_message()? {
                        inbound.accept(&mut dst, &header, &data)?;
                    }
                }
                Ok(())
            })();
            let digest = sender.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
            Ok((digest, recv))
        })?;
        received?;
        let v = inbound.finish(&dst, n, manifest).map_err(|(e, _)| e)?;
        times.push(t.elapsed().as_secs_f64());
        v.into_sequence().release(&mut dst)?;
    }
    Ok(times)
}

/// One core's rate (GB/s) of sealing `bytes` in 1 MiB frames with each candidate for the
/// frame tag: why the encrypted session uses AES-256-GCM (with AES-NI) and not
/// ChaCha20-Poly1305, and what the MAC-only session's BLAKE3 costs.
fn cipher_rates(bytes: usize) -> anyhow::Result<Vec<(&'static str, f64)>> {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, CHACHA20_POLY1305};
    let key = bulkhead_server::trust::random()?;
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
            let tag = k.seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::from(b"header"), &mut frame)
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
    let bytes = n * LAYOUT.bytes_per_token();
    // Production checks (checksums on) without and with the cluster MAC, encrypted, and
    // checksums off, alternating, for the ratios.
    let no_checksums = KvChecks { checksums: false, ..KvChecks::default() };
    let key = bulkhead_server::trust::generate_key()?;
    let (mut times, mut sealed, mut encrypted, mut unchecked) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..a.reps.max(1) {
        times.extend(transfer_times(KvChecks::default(), None, n, 1)?);
        sealed.extend(transfer_times(KvChecks::default(), Some((&key, false)), n, 1)?);
        encrypted.extend(transfer_times(KvChecks::default(), Some((&key, true)), n, 1)?);
        unchecked.extend(transfer_times(no_checksums, None, n, 1)?);
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (transfer, transfer_sealed, transfer_encrypted, transfer_unchecked) = (median(times), median(sealed), median(encrypted), median(unchecked));
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
    println!("KV transfer of {n} tokens ({:.1} MB): {:.3} s, {:.2} GB/s verified over loopback TCP", bytes as f64 / 1e6, transfer, gb / transfer);
    println!("memcpy of the same bytes: {:.2} GB/s; transfer / memcpy = {:.3}", gb / copy, copy / transfer);
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
        "without checksums (measurement only): {:.2} GB/s; throughput with / without checksums = {:.3}",
        gb / transfer_unchecked,
        transfer_unchecked / transfer
    );
    Ok(())
}
