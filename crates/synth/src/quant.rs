//! The quantisations, as llama.cpp's `llama-quantize` mixes them (`src/llama-quant.cpp`:
//! `llama_tensor_get_type` and its shape fallback), so that a synthetic file has the tensor
//! types a real file of that name has.

use std::fmt;

use bulkhead_gguf::GgmlType;

/// A file's quantisation, by its `--quant` name.
#[allow(non_camel_case_types)] // ggml's own names, which users see in file names
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Quant {
    /// Every matrix Q4_0; the output projection (or a tied embedding) Q6_K.
    #[value(name = "q4_0")]
    Q4_0,
    /// Every matrix Q8_0, the output projection too.
    #[value(name = "q8_0")]
    Q8_0,
    /// llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for `attn_v` and `ffn_down` in the first and
    /// last eighth of the layers and every third layer between, and for the output
    /// projection (or a tied embedding); an untied embedding is Q4_K.
    #[value(name = "q4_k_m")]
    Q4_K_M,
}

/// What a tensor is, as far as the mix cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `token_embd.weight`.
    Embedding,
    /// `output.weight`.
    Output,
    /// `blk.N.attn_v.weight`.
    AttnV,
    /// `blk.N.ffn_down.weight`.
    FfnDown,
    /// Any other layer matrix.
    Other,
}

impl Quant {
    /// Every quantisation, in `--help` order.
    pub const ALL: [Quant; 3] = [Quant::Q4_0, Quant::Q8_0, Quant::Q4_K_M];

    /// The `--quant` name.
    pub fn name(self) -> &'static str {
        match self {
            Quant::Q4_0 => "q4_0",
            Quant::Q8_0 => "q8_0",
            Quant::Q4_K_M => "q4_k_m",
        }
    }

    /// `general.file_type` (llama.cpp's `llama_ftype`).
    pub fn file_type(self) -> u32 {
        match self {
            Quant::Q4_0 => 2,
            Quant::Q8_0 => 7,
            Quant::Q4_K_M => 15,
        }
    }

    /// The type most matrices get.
    pub fn base(self) -> GgmlType {
        match self {
            Quant::Q4_0 => GgmlType::Q4_0,
            Quant::Q8_0 => GgmlType::Q8_0,
            Quant::Q4_K_M => GgmlType::Q4_K,
        }
    }

    /// The type of a matrix of `cols` input features with role `role` in layer `layer` of
    /// `layers`, `tied` when the embedding is also the output projection.
    pub fn tensor_type(self, role: Role, layer: usize, layers: usize, cols: usize, tied: bool) -> GgmlType {
        let base = self.base();
        let block = |t: GgmlType| t.block().map_or(1, |b| b.0);
        let more_bits = self == Quant::Q4_K_M && use_more_bits(layer, layers);
        let ty = match role {
            Role::Output | Role::Embedding if role == Role::Output || tied => {
                if !cols.is_multiple_of(block(base)) || base == GgmlType::Q8_0 { GgmlType::Q8_0 } else { GgmlType::Q6_K }
            }
            Role::AttnV | Role::FfnDown if more_bits => GgmlType::Q6_K,
            _ => base,
        };
        fallback(ty, cols)
    }
}

/// llama.cpp's choice of the layers that get more bits: the first and last eighth, and every
/// third layer between.
fn use_more_bits(layer: usize, layers: usize) -> bool {
    // Past the first eighth, `layer - layers / 8` cannot underflow.
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

/// llama.cpp's fallback for rows that are not whole 256-element superblocks: Q4_K to Q5_0,
/// Q6_K to Q8_0; F16 where even 32-element blocks do not fit.
fn fallback(ty: GgmlType, cols: usize) -> GgmlType {
    let fits = |t: GgmlType| t.block().is_some_and(|b| cols.is_multiple_of(b.0));
    if fits(ty) {
        return ty;
    }
    let next = match ty {
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q6_K => GgmlType::Q8_0,
        other => other,
    };
    if fits(next) { next } else { GgmlType::F16 }
}

impl fmt::Display for Quant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlType as T;

    #[test]
    fn q4_k_m_gives_attn_v_and_ffn_down_more_bits_where_llama_cpp_does() {
        // 32 layers (Llama 3.1 8B): 0..4, 28..32 and every third from 4 + 2.
        let six: Vec<usize> = (0..32).filter(|&l| Quant::Q4_K_M.tensor_type(Role::FfnDown, l, 32, 14336, false) == T::Q6_K).collect();
        assert_eq!(six, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]);
        assert_eq!(Quant::Q4_K_M.tensor_type(Role::AttnV, 4, 32, 4096, false), T::Q4_K);
        assert_eq!(Quant::Q4_K_M.tensor_type(Role::Other, 0, 32, 4096, false), T::Q4_K);
        assert_eq!(Quant::Q4_K_M.tensor_type(Role::Embedding, 0, 32, 4096, false), T::Q4_K);
        assert_eq!(Quant::Q4_K_M.tensor_type(Role::Output, 0, 32, 4096, false), T::Q6_K);
        assert_eq!(Quant::Q4_K_M.tensor_type(Role::Embedding, 0, 16, 2048, true), T::Q6_K);
    }

    #[test]
    fn rows_that_are_not_whole_superblocks_fall_back_like_llama_cpp() {
        // Gemma 3 1B: 1152 columns.
        assert_eq!(Quant::Q4_K_M.tensor_type(Role::Other, 0, 26, 1152, true), T::Q5_0);
        assert_eq!(Quant::Q4_K_M.tensor_type(Role::AttnV, 0, 26, 1152, true), T::Q8_0);
        assert_eq!(Quant::Q4_K_M.tensor_type(Role::Embedding, 0, 26, 1152, true), T::Q8_0);
        assert_eq!(Quant::Q4_0.tensor_type(Role::Embedding, 0, 26, 1152, true), T::Q8_0);
        assert_eq!(Quant::Q4_0.tensor_type(Role::Other, 0, 26, 1152, true), T::Q4_0);
        // ffn_down's 6912 columns are 27 superblocks.
        assert_eq!(Quant::Q4_K_M.tensor_type(Role::FfnDown, 0, 26, 6912, true), T::Q6_K);
    }

    #[test]
    fn q4_0_and_q8_0_keep_their_type_but_for_the_output() {
        for role in [Role::AttnV, Role::FfnDown, Role::Other, Role::Embedding] {
            assert_eq!(Quant::Q4_0.tensor_type(role, 0, 32, 4096, false), T::Q4_0);
            assert_eq!(Quant::Q8_0.tensor_type(role, 0, 32, 4096, false), T::Q8_0);
        }
        assert_eq!(Quant::Q4_0.tensor_type(Role::Output, 0, 32, 4096, false), T::Q6_K);
        assert_eq!(Quant::Q8_0.tensor_type(Role::Output, 0, 32, 4096, false), T::Q8_0);
    }
}
