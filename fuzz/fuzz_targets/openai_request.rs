//! Arbitrary request bodies into the OpenAI API router; see `checks/openai_request.rs`.
#![no_main]

#[path = "../checks/openai_request.rs"]
mod openai_request;

libfuzzer_sys::fuzz_target!(|data: &[u8]| openai_request::check(data));
