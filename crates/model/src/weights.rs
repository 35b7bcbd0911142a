//! Weight tensors copied out of the GGUF file, checked for shape and type.

use bulkhead_gguf::{GgmlType, GgufFile};

use crate::ModelError;
use crate::config::{Arch, LlamaConfig};
use crate::kernels::{Isa, packed};
use crate::quant::dequantize_row;

/// A weight matrix of `rows` output features by `cols` input features, rows stored in
/// ggml's layout for its type (F32, F16, Q4_0, Q4_1 or Q8_0), or, for the quantised types
/// on a CPU with AVX-512 VNNI, in the packed layout of [`packed`] (or both, for an
/// embedding that is also the output projection).
#[derive(Debug)]
pub struct Matrix {
    /// Element type.
    pub ty: GgmlType,
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    row_bytes: usize,
    /// ggml's row layout; empty once packed.
    data: Bytes,
    packed: Option<Bytes>,
}

/// A matrix's bytes: its own, or a range of the host's shared weights file, mapped
/// read-only ([`crate::shared`]), which every worker process of the host maps.
pub enum Bytes {
    /// Held by this matrix.
    Owned(Vec<u8>),
    /// Held by this matrix in memory of its own asked to be backed by huge pages
    /// ([`Bytes::laid_out`]).
    Huge(memmap2::Mmap),
    /// `len` bytes from `start` of a shared map.
    Mapped {
        /// The map, kept alive by every matrix in it.
        map: std::sync::Arc<crate::shared::Map>,
        /// Offset in the map.
        start: usize,
        /// Length.
        len: usize,
    },
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Owned(v) => v,
            Bytes::Huge(m) => m,
            Bytes::Mapped { map, start, len } => &map.bytes()[*start..*start + *len],
        }
    }
}

impl Bytes {
    /// A laid-out matrix's bytes. From one huge page up they move into memory of their own
    /// advised for transparent huge pages ([`bulkhead_kv::huge_map`]): a batch-1 decode step
    /// reads every weight once, and through 4 KB pages it read the 1B shape about 11% slower
    /// on the Zen 4 (BENCHMARKS.md). Where the map cannot be made, they stay where they are.
    pub(crate) fn laid_out(v: Vec<u8>) -> Bytes {
        let Some(mut map) = bulkhead_kv::huge_map(v.len()) else { return Bytes::Owned(v) };
        map.copy_from_slice(&v);
        map.make_read_only().map_or(Bytes::Owned(v), Bytes::Huge)
    }
}

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Bytes::Owned(v) => write!(f, "Owned({} bytes)", v.len()),
            Bytes::Huge(m) => write!(f, "Huge({} bytes)", m.len()),
            Bytes::Mapped { start, len, .. } => write!(f, "Mapped({len} bytes at {start})"),
        }
    }
}

impl Matrix {
    /// Build from raw ggml bytes; shape and type are checked.
    pub fn new(name: &str, ty: GgmlType, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self, ModelError> {
        let row_bytes = Self::check(name, ty, rows, cols, data.len())?;
        Ok(Matrix { ty, rows, cols, row_bytes, data: Bytes::Owned(data), packed: None })
    }

    /// Build from the file's bytes in the layout `isa` multiplies (packed straight from
    /// them, without a copy in rows first).
    pub fn from_bytes(name: &str, ty: GgmlType, rows: usize, cols: usize, data: &[u8], isa: Isa) -> Result<Self, ModelError> {
        let row_bytes = Self::check(name, ty, rows, cols, data.len())?;
        let packs = isa.packs_weights() && packed::supports(ty);
        let packed = packs.then(|| Bytes::laid_out(packed::pack(ty, rows, row_bytes, data)));
        let data = if packs { Bytes::Owned(Vec::new()) } else { Bytes::laid_out(data.to_vec()) };
        Ok(Matrix { ty, rows, cols, row_bytes, data, packed })
    }

    /// Check `ty` and the shape against `len` bytes; the bytes of one row.
    fn check(name: &str, ty: GgmlType, rows: usize, cols: usize, len: usize) -> Result<usize, ModelError> {
        let supported = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) || crate::kernels::is_block_quantized(ty);
        if !supported {
            return Err(ModelError::UnsupportedTensorType { tensor: name.to_string(), ty: ty.to_string() });
        }
        if let Some((be, _)) = ty.block().filter(|(be, _)| *be > 1)
            && !cols.is_multiple_of(be)
        {
            return Err(ModelError::BadShape {
                tensor: name.to_string(),
                why: format!("{cols} columns is not a multiple of the {be}-element {ty} block"),
            });
        }
        let row_bytes = ty.bytes_for(cols as u64).map(|b| b as usize).unwrap_or(0);
        if len != rows * row_bytes {
            return Err(ModelError::BadShape { tensor: name.to_string(), why: format!("{len} bytes for {rows}x{cols} {ty}") });
        }
        Ok(row_bytes)
    }

    /// Store a quantised matrix packed for `isa` when it multiplies packed weights, in rows
    /// otherwise: one layout, never both. Lossless both ways.
    pub fn set_layout(&mut self, isa: Isa) {
        if !self.is_quantized() {
            return;
        }
        if let (true, Some(p)) = (self.data.is_empty(), &self.packed) {
            self.data = Bytes::Owned(packed::unpack(self.ty, self.rows, self.row_bytes, p));
        }
        self.packed = (isa.packs_weights() && packed::supports(self.ty))
            .then(|| Bytes::laid_out(packed::pack(self.ty, self.rows, self.row_bytes, &self.data)));
        if self.packed.is_some() {
            self.data = Bytes::Owned(Vec::new());
        }
    }

    /// Whether the matrix is held in the packed layout.
    pub fn is_packed(&self) -> bool {
        self.packed.is_some()
    }

    /// The packed groups holding rows `r0..r1` (`r0` a multiple of [`packed::GROUP`]), if
    /// this matrix is packed.
    pub fn packed_rows(&self, r0: usize, r1: usize) -> Option<&[u8]> {
        let p = self.packed.as_deref()?;
        let gb = packed::group_bytes(self.ty, self.row_bytes);
        debug_assert!(r0.is_multiple_of(packed::GROUP));
        Some(&p[r0 / packed::GROUP * gb..r1.div_ceil(packed::GROUP) * gb])
    }

    fn load(f: &GgufFile, name: &str, rows: usize, cols: usize, isa: Isa) -> Result<Self, ModelError> {
        let (info, bytes) = f.tensor(name).map_err(|e| match e {
            bulkhead_gguf::GgufError::BadTensor { name, why } if why.starts_with("unsupported") => {
                ModelError::UnsupportedTensorType { tensor: name, ty: why.trim_start_matches("unsupported tensor type ").to_string() }
            }
            e => e.into(),
        })?;
        let want = [cols as u64, rows as u64];
        if info.dims != want {
            return Err(ModelError::BadShape { tensor: name.to_string(), why: format!("dims {:?}, expected {want:?}", info.dims) });
        }
        Matrix::from_bytes(name, info.ty, rows, cols, &bytes, isa)
    }

    /// A matrix whose bytes are already laid out (`packed` or in rows), as a shared weights
    /// file holds them; refused unless their length is what the shape and layout make.
    pub fn from_layout(name: &str, ty: GgmlType, rows: usize, cols: usize, bytes: Bytes, packed: bool) -> Result<Self, ModelError> {
        let row_bytes = Self::check(name, ty, rows, cols, rows * ty.bytes_for(cols as u64).map_or(0, |b| b as usize))?;
        let want = if packed { rows.div_ceil(packed::GROUP) * packed::group_bytes(ty, row_bytes) } else { rows * row_bytes };
        if bytes.len() != want {
            return Err(ModelError::BadShape { tensor: name.to_string(), why: format!("{} bytes laid out, expected {want}", bytes.len()) });
        }
        Ok(if packed {
            Matrix { ty, rows, cols, row_bytes, data: Bytes::Owned(Vec::new()), packed: Some(bytes) }
        } else {
            Matrix { ty, rows, cols, row_bytes, data: bytes, packed: None }
        })
    }

    /// The bytes the matrix is held in: packed, or its rows.
    pub fn held(&self) -> &[u8] {
        self.packed.as_deref().unwrap_or(&self.data)
    }

    /// Hold the same bytes from `b` (a shared map of them) instead of this copy.
    pub fn share(&mut self, b: Bytes) {
        debug_assert_eq!(b.len(), self.held().len());
        if b.len() != self.held().len() {
            return;
        }
        match &mut self.packed {
            Some(p) => *p = b,
            None => self.data = b,
        }
    }

    /// Raw bytes of row `r` (ggml's layout; panics on a matrix packed without keeping rows,
    /// which only the layers' quantised matrices are, and only the matrix products read).
    #[inline]
    pub fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Raw bytes of rows `r0..r1`, consecutive.
    #[inline]
    pub fn rows_bytes(&self, r0: usize, r1: usize) -> &[u8] {
        &self.data[r0 * self.row_bytes..r1 * self.row_bytes]
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// True for the block-quantised types (which take 8-bit activations).
    pub fn is_quantized(&self) -> bool {
        crate::kernels::is_block_quantized(self.ty)
    }

    /// Row `r` as f32 values: from the rows, or unpacked from the packed layout (a tied
    /// embedding's lookups: held once, for the head), on the stack up to
    /// [`MAX_LOOKUP_ROW_BYTES`] so a decode step allocates nothing.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let out = &mut out[..self.cols];
        match &self.packed {
            Some(p) if self.data.is_empty() => {
                let mut stack = [0u8; MAX_LOOKUP_ROW_BYTES];
                let mut heap = Vec::new();
                let row = if self.row_bytes <= stack.len() {
                    &mut stack[..self.row_bytes]
                } else {
                    heap.resize(self.row_bytes, 0);
                    &mut heap[..]
                };
                packed::unpack_row(self.ty, self.row_bytes, p, r, row);
                dequantize_row(self.ty, row, out);
            }
            _ => dequantize_row(self.ty, self.row(r), out),
        }
    }

    /// Bytes held (both layouts).
    pub fn bytes(&self) -> usize {
        self.data.len() + self.packed.as_ref().map_or(0, |p| p.len())
    }

    /// Bytes a product over every row reads: the packed layout where there is one.
    pub fn streamed_bytes(&self) -> usize {
        self.packed.as_ref().map_or(self.data.len(), |p| p.len())
    }
}

/// The largest row a token lookup unpacks on the stack: a hidden size of 8,192 at Q8_0
/// (8,704 bytes) fits; a larger one takes the heap.
pub const MAX_LOOKUP_ROW_BYTES: usize = 16 * 1024;

/// One transformer block. The optional parts are what the families add to llama's.
#[derive(Debug)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    /// Biases of Q, K and V (Qwen2).
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// RMS-norm weights applied to each head of Q and K (Qwen3, Gemma 3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: Matrix,
    /// RMS norm of the attention output before the residual add (Gemma 3).
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Matrix,
    pub w_up: Matrix,
    pub w_down: Matrix,
    /// RMS norm of the MLP output before the residual add (Gemma 3).
    pub post_ffn_norm: Option<Vec<f32>>,
}

impl Layer {
    /// The matrices' tensor names in a block, in the order of [`Layer::matrices`].
    const MATRICES: [&'static str; 7] = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"];

    /// The block's matrices, in the order of [`Layer::MATRICES`].
    pub fn matrices(&self) -> [&Matrix; 7] {
        [&self.wq, &self.wk, &self.wv, &self.wo, &self.w_gate, &self.w_up, &self.w_down]
    }
}

/// All weights of a model.
#[derive(Debug)]
pub struct Weights {
    pub embedding: Matrix,
    pub layers: Vec<Layer>,
    pub out_norm: Vec<f32>,
    /// `None` when the output projection is tied to the embedding.
    pub output: Option<Matrix>,
    /// Per-pair RoPE frequency divisors (`rope_freqs.weight`: Llama 3's scaling), if any.
    pub rope_freqs: Option<Vec<f32>>,
}

fn vector(f: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let (info, bytes) = f.tensor(name)?;
    if info.dims != [len as u64] || !matches!(info.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return Err(ModelError::BadShape { tensor: name.to_string(), why: format!("{} {:?}, expected F32 [{len}]", info.ty, info.dims) });
    }
    let mut v = vec![0.0; len];
    dequantize_row(info.ty, &bytes, &mut v);
    Ok(v)
}

/// A vector the file may have; `required` makes its absence an error naming it.
fn optional_vector(f: &GgufFile, name: &str, len: usize, required: bool) -> Result<Option<Vec<f32>>, ModelError> {
    match f.tensor_info(name) {
        Ok(_) => vector(f, name, len).map(Some),
        Err(_) if required => Err(ModelError::BadShape { tensor: name.to_string(), why: "missing: this architecture needs it".into() }),
        Err(_) => Ok(None),
    }
}

/// Where [`Weights::load_with`] takes each matrix from: `(name, rows, cols, layout)`.
pub type MatrixSource<'a> = dyn FnMut(&str, usize, usize, Isa) -> Result<Matrix, ModelError> + 'a;

impl Weights {
    /// Load every tensor the config implies, laid out for `isa` (see [`Weights::set_layout`]).
    pub fn load(f: &GgufFile, c: &LlamaConfig, isa: Isa) -> Result<Self, ModelError> {
        Self::load_with(f, c, isa, &mut |name, rows, cols, isa| Matrix::load(f, name, rows, cols, isa))
    }

    /// [`Weights::load`], with the matrices from `mat` (the vectors from `f`).
    pub fn load_with(f: &GgufFile, c: &LlamaConfig, isa: Isa, mat: &mut MatrixSource<'_>) -> Result<Self, ModelError> {
        let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let qk_norm = matches!(c.arch, Arch::Qwen3 | Arch::Gemma3);
        let post_norms = c.arch == Arch::Gemma3;
        let biases = c.arch == Arch::Qwen2;
        let mut layers = Vec::with_capacity(c.layers);
        for i in 0..c.layers {
            let n = |s: &str| format!("blk.{i}.{s}.weight");
            let b = |s: &str| format!("blk.{i}.{s}.bias");
            layers.push(Layer {
                attn_norm: vector(f, &n("attn_norm"), c.hidden)?,
                wq: mat(&n("attn_q"), q_dim, c.hidden, isa)?,
                wk: mat(&n("attn_k"), kv_dim, c.hidden, isa)?,
                wv: mat(&n("attn_v"), kv_dim, c.hidden, isa)?,
                bq: optional_vector(f, &b("attn_q"), q_dim, biases)?,
                bk: optional_vector(f, &b("attn_k"), kv_dim, biases)?,
                bv: optional_vector(f, &b("attn_v"), kv_dim, biases)?,
                q_norm: optional_vector(f, &n("attn_q_norm"), c.head_dim, qk_norm)?,
                k_norm: optional_vector(f, &n("attn_k_norm"), c.head_dim, qk_norm)?,
                wo: mat(&n("attn_output"), c.hidden, q_dim, isa)?,
                post_attn_norm: optional_vector(f, &n("post_attention_norm"), c.hidden, post_norms)?,
                ffn_norm: vector(f, &n("ffn_norm"), c.hidden)?,
                w_gate: mat(&n("ffn_gate"), c.ffn, c.hidden, isa)?,
                w_up: mat(&n("ffn_up"), c.ffn, c.hidden, isa)?,
                w_down: mat(&n("ffn_down"), c.hidden, c.ffn, isa)?,
                post_ffn_norm: optional_vector(f, &n("post_ffw_norm"), c.hidden, post_norms)?,
            });
        }
        let output = match f.tensor_info("output.weight") {
            Ok(_) => Some(mat("output.weight", c.vocab, c.hidden, isa)?),
            Err(_) => None,
        };
        // The embedding is packed only when it is the output: held once, its lookups unpack.
        let embed_isa = if output.is_some() { Isa::scalar() } else { isa };
        Ok(Weights {
            embedding: mat("token_embd.weight", c.vocab, c.hidden, embed_isa)?,
            layers,
            out_norm: vector(f, "output_norm.weight", c.hidden)?,
            output,
            rope_freqs: optional_vector(f, "rope_freqs.weight", c.head_dim / 2, false)?,
        })
    }

    /// Every matrix with its tensor name, in a fixed order.
    pub fn matrices(&self) -> Vec<(String, &Matrix)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            for (s, m) in Layer::MATRICES.iter().zip(l.matrices()) {
                out.push((format!("blk.{i}.{s}.weight"), m));
            }
        }
        out.push(("token_embd.weight".into(), &self.embedding));
        if let Some(o) = &self.output {
            out.push(("output.weight".into(), o));
        }
        out
    }

    /// [`Weights::matrices`], to change.
    pub fn matrices_mut(&mut self) -> Vec<(String, &mut Matrix)> {
        let mut out = Vec::new();
        for (i, l) in self.layers.iter_mut().enumerate() {
            let ms = [&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo, &mut l.w_gate, &mut l.w_up, &mut l.w_down];
            for (s, m) in Layer::MATRICES.iter().zip(ms) {
                out.push((format!("blk.{i}.{s}.weight"), m));
            }
        }
        out.push(("token_embd.weight".into(), &mut self.embedding));
        if let Some(o) = &mut self.output {
            out.push(("output.weight".into(), o));
        }
        out
    }

    /// The output projection (the embedding when tied).
    pub fn output(&self) -> &Matrix {
        self.output.as_ref().unwrap_or(&self.embedding)
    }

    /// Lay the quantised matrices out for `isa`: the layers' packed, the embedding packed
    /// only when it is the output (its lookups unpack their rows), in rows otherwise.
    pub fn set_layout(&mut self, isa: Isa) {
        for l in &mut self.layers {
            for m in [&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo, &mut l.w_gate, &mut l.w_up, &mut l.w_down] {
                m.set_layout(isa);
            }
        }
        match &mut self.output {
            Some(out) => {
                out.set_layout(isa);
                self.embedding.set_layout(Isa::scalar());
            }
            None => self.embedding.set_layout(isa),
        }
    }

    /// Which kernel family multiplies each weight type of the matrices the forward pass
    /// multiplies (the layers' and the output's), with its parameter count, by type:
    /// `vnni512` (packed), `avx2-packed` (packed, AVX2 with block sums), `avx2` (the row
    /// kernels, on AVX2 or AVX-512 CPUs), `scalar`.
    pub fn kernels(&self, isa: Isa) -> Vec<(GgmlType, &'static str, usize)> {
        let mut by_type: std::collections::BTreeMap<String, (GgmlType, &'static str, usize)> = Default::default();
        for m in self.layers.iter().flat_map(Layer::matrices).chain(std::iter::once(self.output())) {
            let kernel = match (m.is_packed(), isa.level()) {
                (true, crate::kernels::IsaLevel::Avx2) => "avx2-packed",
                (true, _) => "vnni512",
                (false, crate::kernels::IsaLevel::Scalar) => "scalar",
                (false, _) => "avx2",
            };
            let e = by_type.entry(format!("{}/{kernel}", m.ty)).or_insert((m.ty, kernel, 0));
            e.2 += m.rows * m.cols;
        }
        by_type.into_values().collect()
    }

    /// Total bytes of weights held.
    pub fn bytes(&self) -> usize {
        let l: usize = self.layers.iter().flat_map(Layer::matrices).map(Matrix::bytes).sum();
        l + self.embedding.bytes() + self.output.as_ref().map_or(0, Matrix::bytes)
    }

    /// Weight bytes one forward step reads however few its rows: every layer's matrices
    /// and the output head (token lookups read only their rows of the embedding). At batch
    /// 1 decode is a stream of these: the memory wall's numerator.
    pub fn streamed_bytes_per_step(&self) -> usize {
        let l: usize = self.layers.iter().flat_map(Layer::matrices).map(Matrix::streamed_bytes).sum();
        l + self.output().streamed_bytes()
    }

    /// Multiply-adds in the matrices of a prefill of `tokens` tokens that ends in one row of
    /// logits: every layer's matrices for every token, the output head once (attention's
    /// are not counted). Over a measured time, the numerator of the compute wall's share.
    pub fn prefill_matrix_macs(&self, tokens: usize) -> usize {
        let per_token: usize = self.layers.iter().flat_map(Layer::matrices).map(|m| m.rows * m.cols).sum();
        per_token * tokens + self.output().rows * self.output().cols
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bulkhead_kv::HUGE_PAGE;

    #[test]
    fn laid_out_bytes_keep_their_values_in_a_map_of_their_own_from_a_huge_page_up() {
        for len in [HUGE_PAGE - 1, HUGE_PAGE + 4097] {
            let v: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
            let b = Bytes::laid_out(v.clone());
            assert_eq!(&b[..], &v[..], "{len} bytes");
            assert_eq!(matches!(b, Bytes::Huge(_)), len >= HUGE_PAGE, "{b:?}");
        }
    }

    /// A matrix held only packed (a tied embedding) gives its rows' values to lookups as
    /// the rows themselves do, for the 32-element formats and the k-quants.
    #[test]
    fn lookups_unpack_a_packed_matrix_to_its_rows_values() {
        let isa = Isa::detect();
        if !isa.packs_weights() {
            eprintln!("skipped: this CPU does not pack weights");
            return;
        }
        let mut seed = 5u64;
        let mut byte = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 56) as u8
        };
        for (ty, scales) in [(GgmlType::Q4_0, [0usize].as_slice()), (GgmlType::Q8_0, [0].as_slice()), (GgmlType::Q6_K, [208].as_slice())] {
            let (rows, cols) = (19, 256);
            let row_bytes = ty.bytes_for(cols as u64).unwrap() as usize;
            let block = ty.block().unwrap().1;
            let mut data: Vec<u8> = (0..rows * row_bytes).map(|_| byte()).collect();
            for blk in data.chunks_exact_mut(block) {
                for &at in scales {
                    // A modest positive f16 scale: no infinities or NaNs.
                    blk[at..at + 2].copy_from_slice(&(0x1c00u16 + u16::from(byte())).to_le_bytes());
                }
            }
            let m = Matrix::from_bytes("m", ty, rows, cols, &data, isa).unwrap();
            assert!(m.is_packed() && m.data.is_empty(), "{ty}: held once, packed");
            let (mut got, mut want) = (vec![0.0; cols], vec![0.0; cols]);
            for r in 0..rows {
                m.dequantize_row(r, &mut got);
                dequantize_row(ty, &data[r * row_bytes..(r + 1) * row_bytes], &mut want);
                assert_eq!(
                    got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "{ty} row {r}"
                );
            }
        }
    }
}
