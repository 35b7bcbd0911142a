//! Arbitrary bytes from a peer into the protocol's frame decoder; see `checks/wire_codec.rs`.
#![no_main]

#[path = "../checks/wire_codec.rs"]
mod wire_codec;

libfuzzer_sys::fuzz_target!(|data: &[u8]| wire_codec::check(data));
