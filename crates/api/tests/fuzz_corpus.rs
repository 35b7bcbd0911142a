//! Replays the committed `openai_request` fuzz corpus (`fuzz/corpus/openai_request`)
//! through the fuzz target's own check (`fuzz/checks`), so every input the fuzzer kept runs
//! in CI on stable.

#[path = "../../../fuzz/checks/openai_request.rs"]
mod openai_request;

#[path = "../../../fuzz/checks/corpus.rs"]
mod corpus;

#[test]
fn every_committed_openai_request_input_passes_the_fuzz_check() {
    corpus::replay("openai_request", openai_request::check);
}
