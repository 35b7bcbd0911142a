//! Teacher-forced logits of a GGUF against llama.cpp's on the same file and tokens, held to
//! the bound the llama.cpp fixtures use (`tests/llamacpp.rs`): at every position the largest
//! gap within 5% of the logits' scale (their largest magnitude) and the mean gap within
//! 1.2%, and the same top token unless llama.cpp's top two are closer than twice the largest
//! gap (a near tie either arithmetic may break). Run by `scripts/logits-vs-llamacpp.sh`,
//! which writes llama.cpp's rows with `scripts/llamacpp-logits.c`; not part of CI (the
//! files are gigabytes).
//!
//! Usage: logits-vs-llamacpp MODEL.gguf LLAMACPP.f32 THREADS TOKEN [TOKEN ...]
//! Prints one line per position and a verdict; exits 1 when a position is out of bounds.

use std::process::ExitCode;

use bulkhead_gguf::GgufFile;
use bulkhead_kv::{KvChecks, KvPool, PoolConfig, RequestId, SequenceKv};
use bulkhead_model::{Llama, SeqInput};

fn argmax(l: &[f32]) -> usize {
    l.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0
}

/// The gap between the largest and the second largest of `l`.
fn top_gap(l: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in l {
        if x > a {
            (a, b) = (x, a);
        } else if x > b {
            b = x;
        }
    }
    a - b
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: logits-vs-llamacpp MODEL.gguf LLAMACPP.f32 THREADS TOKEN [TOKEN ...]");
        return ExitCode::from(2);
    }
    match compare(&args[1], &args[2], &args[3], &args[4..]) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn compare(model: &str, theirs: &str, threads: &str, tokens: &[String]) -> Result<bool, Box<dyn std::error::Error>> {
    let tokens: Vec<u32> = tokens.iter().map(|t| t.parse()).collect::<Result<_, _>>()?;
    let f = GgufFile::open(std::path::Path::new(model))?;
    let m = Llama::from_gguf(&f, threads.parse()?)?;
    let vocab = m.config.vocab;
    let bytes = std::fs::read(theirs)?;
    if bytes.len() != tokens.len() * vocab * 4 {
        return Err(format!("{theirs} holds {} bytes, not {} positions of {vocab} logits", bytes.len(), tokens.len()).into());
    }
    let theirs: Vec<f32> = bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let layout = m.kv_layout(16);
    let mut pool = KvPool::new(PoolConfig { layout, pages: layout.pages_for_tokens(tokens.len()), checks: KvChecks::default() })?;
    let mut kv = SequenceKv::new(RequestId(1));
    kv.reserve(&mut pool, tokens.len())?;
    // One prefill of every token with a row each, as llama.cpp's one batch.
    let ours = m.forward(&mut pool, &mut [SeqInput { kv: &mut kv, tokens: &tokens, logit_rows: tokens.len() }])?;
    let (mut ok, mut worst_max, mut worst_mean, mut agree, mut ties) = (true, 0.0f32, 0.0f32, 0, 0);
    for (pos, (o, t)) in ours.chunks_exact(vocab).zip(theirs.chunks_exact(vocab)).enumerate() {
        let scale = t.iter().fold(f32::MIN_POSITIVE, |m, x| m.max(x.abs()));
        let max = o.iter().zip(t).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        let mean = o.iter().zip(t).map(|(a, b)| (a - b).abs()).sum::<f32>() / vocab as f32;
        let (same, tie) = (argmax(o) == argmax(t), top_gap(t) < 2.0 * max);
        let within = max <= 0.05 * scale && mean <= 0.012 * scale && (same || tie);
        (worst_max, worst_mean) = (worst_max.max(max / scale), worst_mean.max(mean / scale));
        agree += usize::from(same);
        ties += usize::from(!same && tie);
        ok &= within;
        println!(
            "position {pos:3}: scale {scale:8.4}, largest gap {:.4}, mean {:.5} (of the scale), top token {}{}",
            max / scale,
            mean / scale,
            if same { "same" } else { "differs" },
            if within { "" } else { "  OUT OF BOUNDS" }
        );
    }
    println!(
        "{model}: {} positions, largest gap {worst_max:.4} of the scale (bound 0.05), mean {worst_mean:.5} (bound 0.012), \
         same top token at {agree} ({ties} near ties differ): {}",
        tokens.len(),
        if ok { "within bounds" } else { "OUT OF BOUNDS" }
    );
    Ok(ok)
}
