//! Arbitrary text into the default model's tokenizer; see `checks/tokenizer_encode.rs`.
#![no_main]

#[path = "../checks/tokenizer_encode.rs"]
mod tokenizer_encode;

libfuzzer_sys::fuzz_target!(|data: &[u8]| tokenizer_encode::check(data));
