//! Replays the committed `tokenizer_encode` fuzz corpus (`fuzz/corpus/tokenizer_encode`)
//! through the fuzz target's own check (`fuzz/checks`) on the default model's tokenizer.

#[path = "../../../fuzz/checks/tokenizer_encode.rs"]
mod tokenizer_encode;

#[path = "../../../fuzz/checks/corpus.rs"]
mod corpus;

#[test]
fn every_committed_tokenizer_encode_input_passes_the_fuzz_check() {
    corpus::replay("tokenizer_encode", tokenizer_encode::check);
}
