//! Synthetic models: GGUF files of real public shapes (Llama 3.2 1B, Llama 3.1 8B, Qwen 2.5
//! 7B, Gemma 3 1B, Mistral 7B) with seeded random weights, in Q4_0, Q8_0 or llama.cpp's
//! Q4_K_M mix, that Bulkhead and llama.cpp both load. Speed does not depend on the weights'
//! values, so these stand in for the 1B–8B models that cannot be downloaded here
//! (`bulkhead synth-model`).
//!
//! # Layout
//! - [`shapes`]: the shapes table, with where each number comes from.
//! - [`quant`]: the quantisations and llama.cpp's per-tensor type mix.
//! - [`vocab`]: a donor model's tokenizer fitted to the shape's vocabulary size.
//! - `generate`: the plan of the file and the weights, generated and quantised a block of
//!   rows at a time and streamed ([`bulkhead_gguf::GgufWriter::stream`]): an 8B file is never
//!   held in memory.
//! - `disk`: the free-space check before writing.
#![forbid(unsafe_code)]

mod disk;
mod generate;
pub mod quant;
pub mod shapes;
pub mod vocab;

use std::collections::BTreeMap;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use bulkhead_gguf::{GgufError, GgufFile, GgufWriter};

pub use generate::Spec;
pub use quant::Quant;
pub use shapes::{Shape, ShapeName};

/// Why a model could not be synthesised.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    /// A `--shape` name that is not in the table.
    #[error("unknown shape `{name}` (known: {known})")]
    UnknownShape {
        /// The name given.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// The donor's tokenizer cannot be used.
    #[error("donor vocabulary: {why}")]
    Donor {
        /// What is wrong with it.
        why: String,
    },
    /// A context length of 0.
    #[error("context length {context} is not a positive number of tokens")]
    BadContext {
        /// The length given.
        context: usize,
    },
    /// Not enough free space for the file.
    #[error("not enough free space for {path}: it needs {needed} bytes, {available} are available")]
    NoSpace {
        /// The file.
        path: PathBuf,
        /// Its size.
        needed: u64,
        /// Free space in its file system.
        available: u64,
    },
    /// Writing failed.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// Generating in memory failed.
    #[error("generating the weights failed: {why}")]
    Generate {
        /// The error.
        why: String,
    },
    /// The donor or the plan broke a GGUF rule.
    #[error(transparent)]
    Gguf(#[from] GgufError),
}

/// What [`write_file`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// Parameters.
    pub params: u64,
    /// Matrices by type, with their parameter counts.
    pub types: BTreeMap<String, u64>,
    /// Free space found before writing, `None` when it could not be checked.
    pub available: Option<u64>,
}

/// The file `spec` makes with `donor`'s vocabulary, every matrix declared but none generated:
/// its [`GgufWriter::file_size`], and its header through [`GgufWriter::stream`].
pub fn plan(spec: &Spec, donor: &GgufFile) -> Result<GgufWriter, SynthError> {
    Ok(generate::plan(spec, donor, false)?.writer)
}

/// The whole file in memory, built with [`GgufWriter::to_bytes`] (small shapes only: tests).
pub fn to_bytes(spec: &Spec, donor: &GgufFile) -> Result<Vec<u8>, SynthError> {
    Ok(generate::plan(spec, donor, true)?.writer.to_bytes())
}

/// Stream the file to `out`, generating each matrix as its turn comes; `progress` is told
/// the bytes of matrices written so far and their total after each matrix.
pub fn write_to<W: Write>(spec: &Spec, donor: &GgufFile, out: W, progress: &mut dyn FnMut(u64, u64)) -> Result<W, SynthError> {
    let plan = generate::plan(spec, donor, false)?;
    generate::stream(&plan, spec.seed, out, progress).map_err(|e| SynthError::Generate { why: e.to_string() })
}

/// Write the file to `path`: after checking the free space there (an error naming the bytes
/// needed and available), streamed into `path.partial` and renamed into place, so that an
/// interrupted run never leaves a file that looks whole.
pub fn write_file(spec: &Spec, donor: &GgufFile, path: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<Summary, SynthError> {
    let plan = generate::plan(spec, donor, false)?;
    let needed = plan.writer.file_size();
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let available = disk::available(dir);
    if let Some(available) = available.filter(|&a| a < needed) {
        return Err(SynthError::NoSpace { path: path.to_path_buf(), needed, available });
    }
    let mut partial = path.as_os_str().to_owned();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let io_err = |source| SynthError::Io { path: path.to_path_buf(), source };
    let written = std::fs::File::create(&partial)
        .and_then(|f| generate::stream(&plan, spec.seed, BufWriter::with_capacity(8 << 20, f), progress))
        .and_then(|w| w.into_inner().map_err(io::IntoInnerError::into_error))
        .and_then(|f| f.sync_all())
        .and_then(|()| std::fs::rename(&partial, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&partial);
        return Err(io_err(e));
    }
    let mut types = BTreeMap::new();
    for m in &plan.matrices {
        *types.entry(m.ty.to_string()).or_insert(0) += (m.rows * m.cols) as u64;
    }
    Ok(Summary { path: path.to_path_buf(), bytes: needed, params: spec.shape.params(), types, available })
}
