//! Arbitrary bytes as a GGUF file; see `checks/gguf_reader.rs`.
#![no_main]

#[path = "../checks/gguf_reader.rs"]
mod gguf_reader;

libfuzzer_sys::fuzz_target!(|data: &[u8]| gguf_reader::check(data));
