//! `bulkhead synth-model`: a GGUF file of a public model's shape with seeded random weights
//! (the work is in `bulkhead_synth`).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use bulkhead_gguf::GgufFile;
use bulkhead_synth::{Quant, ShapeName, Spec};
use clap::Args;

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// The public model shape to copy (hyperparameters from its published config).
    #[arg(long, env = "BULKHEAD_SYNTH_SHAPE", ignore_case = true)]
    shape: ShapeName,
    /// The weights' quantisation, with llama.cpp's choice of type for each tensor.
    #[arg(long, env = "BULKHEAD_SYNTH_QUANT", ignore_case = true)]
    quant: Quant,
    /// The GGUF file to write (refused when its file system lacks the space).
    #[arg(long, env = "BULKHEAD_SYNTH_OUT")]
    out: PathBuf,
    /// Seed of the random weights: the same seed writes the same bytes.
    #[arg(long, env = "BULKHEAD_SYNTH_SEED", default_value_t = 0)]
    seed: u64,
    /// A GGUF model whose tokenizer and chat template to copy, padded or cut to the shape's
    /// vocabulary. Default: SmolLM2-135M's (Gemma 3 270M's for gemma-3-1b), fetched into
    /// $BULKHEAD_HOME if missing.
    #[arg(long, env = "BULKHEAD_SYNTH_DONOR")]
    donor: Option<PathBuf>,
    /// Context length to write instead of the shape's own.
    #[arg(long, env = "BULKHEAD_SYNTH_CONTEXT")]
    context: Option<usize>,
}

pub fn run(a: SynthArgs) -> anyhow::Result<()> {
    let donor_path = match a.donor {
        Some(p) => p,
        None => bulkhead_fetch::ensure(a.shape.default_donor(), true).context("cannot get the default donor model; pass --donor PATH")?,
    };
    let donor = GgufFile::open_metadata(&donor_path).with_context(|| format!("cannot read the donor {}", donor_path.display()))?;
    let spec = Spec { shape: a.shape.shape(), quant: a.quant, seed: a.seed, context: a.context };
    let size = bulkhead_synth::plan(&spec, &donor).with_context(|| format!("donor {}", donor_path.display()))?.file_size();
    eprintln!(
        "bulkhead: writing {} ({} {}, {:.2}B parameters, {:.2} GB, vocabulary from {})",
        a.out.display(),
        a.shape,
        a.quant,
        spec.shape.params() as f64 / 1e9,
        size as f64 / 1e9,
        donor_path.display()
    );
    let mut shown = 0;
    let mut progress = |done: u64, total: u64| {
        let pct = done * 100 / total.max(1);
        if pct >= shown + 10 {
            shown = pct - pct % 10;
            eprint!("\r  {shown}%");
            let _ = std::io::stderr().flush();
        }
    };
    let s = bulkhead_synth::write_file(&spec, &donor, &a.out, &mut progress)?;
    let types: Vec<String> = s.types.iter().map(|(t, n)| format!("{t} {:.1}M", *n as f64 / 1e6)).collect();
    eprintln!();
    println!("bulkhead: wrote {} ({} bytes; {})", s.path.display(), s.bytes, types.join(", "));
    Ok(())
}
