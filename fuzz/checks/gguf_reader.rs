//! The `gguf_reader` fuzz check, shared by the cargo-fuzz target (`fuzz/fuzz_targets/
//! gguf_reader.rs`, nightly) and `crates/gguf/tests/fuzz_corpus.rs`, which replays the
//! committed corpus on stable.
//!
//! Input: a whole file. Parsing must fail cleanly or give a file whose every accessor works
//! without panicking, whose every readable tensor has exactly its declared size, and which
//! `GgufWriter` writes back into a file that parses to the same metadata, tensor table
//! (offsets aside) and tensor bytes.

use bulkhead_gguf::{GgufFile, GgufWriter};

/// Runs one input; panics if a property fails.
pub fn check(data: &[u8]) {
    let Ok(f) = GgufFile::parse(data.to_vec()) else {
        return;
    };
    for key in f.metadata().keys() {
        // Wrong types are errors; only panics matter here.
        let _ = (f.get_u64(key), f.get_count(key), f.get_f64(key), f.get_bool(key), f.get_str(key));
        let _ = (f.get_array(key), f.get_str_array(key), f.get_int_array(key));
    }
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.meta(k, v.clone());
    }
    for t in f.tensors() {
        let bytes = match f.tensor(&t.name) {
            Ok((info, bytes)) => {
                assert_eq!(bytes.len() as u64, info.size, "tensor {}", info.name);
                bytes.to_vec()
            }
            Err(_) => {
                assert!(t.ty.block().is_none(), "a tensor of known type {} is unreadable", t.ty);
                Vec::new()
            }
        };
        w.tensor(&t.name, &t.dims, t.ty, bytes);
    }
    let g = GgufFile::parse(w.to_bytes()).unwrap_or_else(|e| panic!("the writer's copy does not parse: {e}"));
    // Debug, not ==: a NaN metadata value is the same value written back.
    assert_eq!(format!("{:?}", g.metadata()), format!("{:?}", f.metadata()));
    assert_eq!(g.tensors().len(), f.tensors().len());
    for (a, b) in f.tensors().iter().zip(g.tensors()) {
        assert_eq!((&a.name, &a.dims, a.ty, a.size), (&b.name, &b.dims, b.ty, b.size));
        let bytes = |file: &GgufFile| file.tensor(&a.name).ok().map(|(_, b)| b.to_vec());
        assert!(bytes(&f) == bytes(&g), "tensor {} reads differently after writing", a.name);
    }
}
