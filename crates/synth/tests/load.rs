//! Every shape, scaled down, generated and loaded by Bulkhead's loader (config, weights,
//! tokenizer) and run for a few tokens; the full-size shapes' headers read back as the
//! published configs; the streamed file equals the in-memory one.

use std::path::PathBuf;

use bulkhead_gguf::{GgufFile, GgufWriter, Value};
use bulkhead_model::reference::ReferenceState;
use bulkhead_model::{Llama, LlamaConfig};
use bulkhead_synth::{Quant, Shape, ShapeName, Spec};
use bulkhead_tokenizer::Tokenizer;

/// GPT-2's byte-to-character map (byte-level BPE's alphabet).
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

/// A small byte-level BPE vocabulary like SmolLM2's: three specials, the 256 byte
/// characters, a few merges, a ChatML template.
fn bpe_donor() -> GgufFile {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"].map(String::from).to_vec();
    tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
    let merges = ["t h", "th e", "Ġ the", "i s", "Ġ is"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    let types = (0..tokens.len()).map(|i| Value::I32(if i < 3 { 3 } else { 1 }));
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", Value::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", Value::String("smollm".into()))
        .meta("tokenizer.ggml.tokens", Value::Array(tokens.into_iter().map(Value::String).collect()))
        .meta("tokenizer.ggml.token_type", Value::Array(types.collect()))
        .meta("tokenizer.ggml.merges", Value::Array(merges.iter().map(|m| Value::String(m.to_string())).collect()))
        .meta("tokenizer.ggml.bos_token_id", Value::U32(1))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(2))
        .meta(
            "tokenizer.chat_template",
            Value::String("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}".into()),
        );
    GgufFile::parse(w.to_bytes()).unwrap()
}

/// A small SentencePiece vocabulary like Gemma's: specials, byte tokens, pieces.
fn spm_donor() -> GgufFile {
    let mut tokens = vec!["<pad>".to_string(), "<eos>".into(), "<bos>".into(), "<unk>".into()];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    tokens.extend(["▁the", "▁is", "▁a", "the", "is"].map(String::from));
    let n = tokens.len();
    let types = (0..n).map(|i| {
        Value::I32(match i {
            0..=2 => 3,
            3 => 2,
            4..260 => 6,
            _ => 1,
        })
    });
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", Value::String("llama".into()))
        .meta("tokenizer.ggml.tokens", Value::Array(tokens.into_iter().map(Value::String).collect()))
        .meta("tokenizer.ggml.scores", Value::Array((0..n).map(|i| Value::F32(-(i as f32))).collect()))
        .meta("tokenizer.ggml.token_type", Value::Array(types.collect()))
        .meta("tokenizer.ggml.bos_token_id", Value::U32(2))
        .meta("tokenizer.ggml.eos_token_id", Value::U32(1))
        .meta("tokenizer.ggml.unknown_token_id", Value::U32(3))
        .meta("tokenizer.ggml.padding_token_id", Value::U32(0))
        .meta("tokenizer.ggml.add_bos_token", Value::Bool(true));
    GgufFile::parse(w.to_bytes()).unwrap()
}

fn donor_for(n: ShapeName) -> GgufFile {
    if n == ShapeName::Gemma3_1b { spm_donor() } else { bpe_donor() }
}

/// What Bulkhead's loader must derive from a shape's file.
fn check_config(c: &LlamaConfig, s: &Shape, context: usize) {
    let n = s.name;
    assert_eq!((c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim), (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim), "{n}");
    assert_eq!((c.ffn, c.vocab, c.context_length), (s.ffn, s.vocab, context), "{n}");
    assert_eq!(c.rope_base, s.rope_theta, "{n}");
    assert_eq!(c.rope_base_local, s.rope_theta_local.unwrap_or(s.rope_theta), "{n}");
    assert_eq!(c.rope_scale, 1.0, "{n}: Llama 3's scaling is rope_freqs.weight, not a position scale");
    assert_eq!(c.sliding_window, s.sliding_window, "{n}");
    let swa: Vec<bool> = (0..s.layers).map(|l| s.sliding_window.is_some() && l % 6 != 5).collect();
    assert_eq!(c.swa_layers, swa, "{n}");
    assert_eq!(c.norm_eps, s.norm_eps, "{n}");
}

fn quant_for(n: ShapeName) -> Quant {
    match n {
        ShapeName::Llama31_8b => Quant::Q4_0,
        ShapeName::Mistral7b => Quant::Q8_0,
        _ => Quant::Q4_K_M,
    }
}

#[test]
fn every_shape_scaled_down_loads_and_gives_finite_logits() {
    for n in ShapeName::ALL {
        let shape = n.shape().scaled_down();
        let spec = Spec { shape, quant: quant_for(n), seed: 7, context: None };
        let f = GgufFile::parse(bulkhead_synth::to_bytes(&spec, &donor_for(n)).unwrap()).unwrap();
        check_config(&LlamaConfig::from_gguf(&f).unwrap(), &shape, shape.context);
        let model = Llama::from_gguf(&f, 2).unwrap_or_else(|e| panic!("{n}: {e}"));
        assert_eq!(model.weights.rope_freqs.as_ref().map(Vec::len), shape.llama3_rope.map(|_| shape.head_dim / 2), "{n}");
        let tok = Tokenizer::from_gguf(&f).unwrap_or_else(|e| panic!("{n}: {e}"));
        assert_eq!(tok.vocab_size(), shape.vocab, "{n}");
        let ids = tok.encode("the sea is the sea", false);
        assert!(!ids.is_empty() && ids.iter().all(|&i| (i as usize) < shape.vocab), "{n}: {ids:?}");
        let mut st = ReferenceState::default();
        for &t in ids.iter().take(3) {
            let logits = model.reference_step(&mut st, t);
            assert_eq!(logits.len(), shape.vocab, "{n}");
            assert!(logits.iter().all(|l| l.is_finite()), "{n}: non-finite logits");
            assert!(logits.iter().any(|&l| l != logits[0]), "{n}: constant logits");
        }
    }
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("bulkhead-synth-{}-{name}", std::process::id()))
}

#[test]
fn the_streamed_file_equals_the_in_memory_one_and_depends_only_on_the_seed() {
    for (n, quant) in [(ShapeName::Llama32_1b, Quant::Q4_K_M), (ShapeName::Gemma3_1b, Quant::Q4_0)] {
        let spec = Spec { shape: n.shape().scaled_down(), quant, seed: 11, context: Some(64) };
        let donor = donor_for(n);
        let held = bulkhead_synth::to_bytes(&spec, &donor).unwrap();
        let mut steps = Vec::new();
        let streamed = bulkhead_synth::write_to(&spec, &donor, Vec::new(), &mut |done, total| steps.push((done, total))).unwrap();
        assert!(held == streamed, "{n}: the streamed bytes differ from the in-memory ones");
        let &(done, total) = steps.last().unwrap();
        assert!(done == total && total > 0 && total < held.len() as u64, "{n}: progress {steps:?}");
        // Through the file path too (written beside, renamed into place).
        let path = temp_path(&format!("{n}.gguf"));
        let summary = bulkhead_synth::write_file(&spec, &donor, &path, &mut |_, _| {}).unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(on_disk == held, "{n}: the file differs");
        assert_eq!(summary.bytes, held.len() as u64);
        assert!(!std::path::Path::new(&format!("{}.partial", path.display())).exists());
        let other = bulkhead_synth::to_bytes(&Spec { seed: 12, ..spec }, &donor).unwrap();
        assert_eq!(other.len(), held.len());
        assert!(other != held, "{n}: another seed gives other weights");
    }
}

#[test]
fn full_size_headers_carry_the_published_shapes() {
    // (shape, quant, file size in GB within which the file must fall)
    let cases = [
        (ShapeName::Llama32_1b, Quant::Q4_0, 0.70..0.80),
        (ShapeName::Llama32_1b, Quant::Q4_K_M, 0.75..0.85),
        (ShapeName::Llama31_8b, Quant::Q4_K_M, 4.8..5.0),
        (ShapeName::Qwen25_7b, Quant::Q4_K_M, 4.6..4.8),
        (ShapeName::Gemma3_1b, Quant::Q4_K_M, 0.7..0.85),
        (ShapeName::Mistral7b, Quant::Q8_0, 7.6..7.8),
    ];
    for (n, quant, gb) in cases {
        let shape = n.shape();
        let spec = Spec { shape, quant, seed: 1, context: Some(4096) };
        let w = bulkhead_synth::plan(&spec, &donor_for(n)).unwrap();
        let size = w.file_size() as f64 / 1e9;
        assert!(gb.contains(&size), "{n} {quant}: {size:.3} GB, expected {gb:?}");
        // The header alone: what a loader derives the config from.
        let mut head = Vec::new();
        drop(w.stream(&mut head).unwrap());
        let path = temp_path(&format!("{n}-{quant}-head.gguf"));
        std::fs::write(&path, &head).unwrap();
        let f = GgufFile::open_metadata(&path);
        std::fs::remove_file(&path).unwrap();
        let f = f.unwrap();
        check_config(&LlamaConfig::from_gguf(&f).unwrap(), &shape, 4096);
        assert_eq!(f.get_str_array("tokenizer.ggml.tokens").unwrap().len(), shape.vocab);
        assert_eq!(
            f.tensor_info("rope_freqs.weight").ok().map(|t| t.dims.clone()),
            shape.llama3_rope.map(|_| vec![shape.head_dim as u64 / 2])
        );
        assert_eq!(f.tensor_info("output.weight").is_ok(), !shape.tied, "{n}");
    }
}

#[test]
fn an_unknown_shape_or_quant_is_refused_with_the_list() {
    #[derive(clap::Parser, Debug)]
    struct Cli {
        #[arg(long)]
        shape: ShapeName,
        #[arg(long)]
        quant: Quant,
    }
    use clap::Parser;
    let e = Cli::try_parse_from(["x", "--shape", "llama-9b", "--quant", "q4_0"]).unwrap_err().to_string();
    for n in ShapeName::ALL {
        assert!(e.contains(n.name()), "{e}");
    }
    let e = Cli::try_parse_from(["x", "--shape", "gemma-3-1b", "--quant", "q3_k"]).unwrap_err().to_string();
    for q in Quant::ALL {
        assert!(e.contains(q.name()), "{e}");
    }
    let ok = Cli::try_parse_from(["x", "--shape", "qwen2.5-7b", "--quant", "q4_k_m"]).unwrap();
    assert_eq!((ok.shape, ok.quant), (ShapeName::Qwen25_7b, Quant::Q4_K_M));
}
