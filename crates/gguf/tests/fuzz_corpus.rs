//! Replays the committed `gguf_reader` fuzz corpus (`fuzz/corpus/gguf_reader`) through the
//! fuzz target's own check (`fuzz/checks`), and pins the bugs it found.

#[path = "../../../fuzz/checks/gguf_reader.rs"]
mod gguf_reader;

#[path = "../../../fuzz/checks/corpus.rs"]
mod corpus;

use bulkhead_gguf::{GgmlType, GgufFile, GgufWriter, Value};

#[test]
fn every_committed_gguf_reader_input_passes_the_fuzz_check() {
    corpus::replay("gguf_reader", gguf_reader::check);
}

/// Found by `gguf_reader`: a file cut inside the padding before the data section, whose
/// tensors all have no bytes, parsed, and reading such a tensor then sliced past the end.
#[test]
fn a_file_cut_before_its_data_section_is_refused_even_when_every_tensor_is_empty() {
    let mut w = GgufWriter::new();
    w.tensor("z", &[0, 3], GgmlType::F32, Vec::new());
    let bytes = w.to_bytes();
    // The tensor table ends mid-block, so the last bytes are padding.
    assert!(bytes.ends_with(&[0; 4]));
    for n in 0..bytes.len() {
        if let Ok(f) = GgufFile::parse(bytes[..n].to_vec()) {
            panic!("a cut at {n} of {} parsed ({} tensors)", bytes.len(), f.tensors().len());
        }
    }
    let f = GgufFile::parse(bytes).expect("the whole file parses");
    assert_eq!(f.tensor("z").expect("an empty tensor reads").1, &[] as &[u8]);
}

/// Found by `gguf_reader`: the writer laid tensor data out at 32 bytes whatever
/// `general.alignment` said, so readers (which honour it) read the wrong bytes.
#[test]
fn the_writer_aligns_tensor_data_to_general_alignment() {
    let mut w = GgufWriter::new();
    w.meta("general.alignment", Value::U32(64)).tensor_f32("x", &[3], &[1.0, 2.0, 3.0]).tensor_f32("y", &[2], &[4.0, 5.0]);
    let f = GgufFile::parse(w.to_bytes()).expect("the writer's file parses");
    assert_eq!(f.tensor_info("y").expect("y").offset, 64);
    let y: Vec<u8> = [4.0f32, 5.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(f.tensor("y").expect("y reads").1, y.as_slice());
}
