//! How fast the packed kernels read one activation row's weights (a batch-1 decode step's
//! work), from cache (a 1 MB matrix) and from memory (200 MB), per weight format, on this
//! CPU's kernels (`BULKHEAD_NO_VNNI=1`: the AVX2 ones). Single-threaded; the weights are
//! random bytes with finite scales. `cargo run --release -p bulkhead-model --example
//! kernel-bandwidth`.

use bulkhead_gguf::GgmlType;
use bulkhead_model::kernels::{Isa, dot_q_packed, packed, quantize_acts};
use bulkhead_model::quant::Q8Acts;
use std::time::Instant;

fn main() {
    let isa = Isa::detect();
    let cols = 2048usize;
    println!("kernels {}, one thread, {cols} columns", isa.name());
    // (format, bytes per block, elements per block, offset of the block's f16 scale)
    for (ty, block, per, scale_at) in [
        (GgmlType::Q4_0, 18usize, 32usize, 0usize),
        (GgmlType::Q8_0, 34, 32, 0),
        (GgmlType::Q4_K, 144, 256, 0),
        (GgmlType::Q6_K, 210, 256, 208),
    ] {
        let row_bytes = cols / per * block;
        for mb in [1usize, 200] {
            let rows = (mb << 20) / row_bytes / packed::GROUP * packed::GROUP;
            let mut data = vec![0u8; rows * row_bytes];
            let mut x = 0x2545_F491_4F6C_DD1Du64;
            for b in data.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            for blk in data.chunks_exact_mut(block) {
                // A small positive f16 (2^-8) keeps every product finite.
                blk[scale_at..scale_at + 2].copy_from_slice(&0x1C00u16.to_le_bytes());
            }
            let p = packed::pack(ty, rows, row_bytes, &data);
            drop(data);
            let xs: Vec<f32> = (0..cols).map(|i| ((i * 7919) % 13) as f32 - 6.0).collect();
            let mut q8 = Q8Acts::default();
            quantize_acts(isa, &xs, 1, cols, &mut q8);
            let mut out = vec![0f32; rows];
            let reps = if mb == 1 { 2000 } else { 20 };
            let t = Instant::now();
            for _ in 0..reps {
                dot_q_packed(isa, ty, &p, rows, &q8, 0, 1, &mut out);
            }
            let s = t.elapsed().as_secs_f64();
            println!("{ty:>5} {mb:>4} MB: {:6.1} GB/s", (p.len() * reps) as f64 / s / 1e9);
        }
    }
}
