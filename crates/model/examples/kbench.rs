use bulkhead_gguf::GgmlType;
use bulkhead_model::kernels::{Isa, dot_q_packed, packed, quantize_acts};
use bulkhead_model::quant::Q8Acts;
use std::time::Instant;

fn main() {
    let isa = Isa::detect();
    let cols = 2048usize;
    for (ty, bb, per) in
        [(GgmlType::Q4_0, 18usize, 32usize), (GgmlType::Q6_K, 210, 256), (GgmlType::Q4_K, 144, 256), (GgmlType::Q8_0, 34, 32)]
    {
        for mb in [1usize, 200] {
            let row_bytes = cols / per * bb;
            let rows = (mb << 20) / row_bytes / 16 * 16;
            let mut data = vec![0u8; rows * row_bytes];
            let mut x = 12345u64;
            for b in data.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *b = x as u8;
            }
            // finite scales: set f16 d fields
            for blk in data.chunks_exact_mut(bb) {
                let o = match ty {
                    GgmlType::Q6_K => 208,
                    _ => 0,
                };
                blk[o] = 0x00;
                blk[o + 1] = 0x1c;
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
            let gb = p.len() / (rows / 16);
            let mut buf = vec![0u8; gb];
            let mut o16 = vec![0f32; 16];
            let t2 = Instant::now();
            for _ in 0..reps {
                for g in p.chunks_exact(gb) {
                    buf.copy_from_slice(g);
                    dot_q_packed(isa, ty, &buf, 16, &q8, 0, 1, &mut o16);
                }
            }
            let s2 = t2.elapsed().as_secs_f64();
            println!("   copied first: {:.1} GB/s", (p.len() * reps) as f64 / s2 / 1e9);
            println!(
                "{ty:?} {mb} MB: {:.1} GB/s  ({:.1} ns per 16-row x 256-col)",
                (p.len() * reps) as f64 / s / 1e9,
                s / reps as f64 / (rows / 16 * cols / 256) as f64 * 1e9
            );
        }
    }
}
