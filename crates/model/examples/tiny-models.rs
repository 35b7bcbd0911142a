//! Writes the tiny random models that `tests/llamacpp.rs` compares with llama.cpp into DIR,
//! one `<arch>.gguf` each, and prints `<arch> <xxh3 digest>` per line, for
//! `scripts/llamacpp-fixtures.py`.

#[path = "../tests/support/mod.rs"]
mod support;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: tiny-models DIR")?;
    std::fs::create_dir_all(&dir)?;
    for (arch, window) in support::LLAMACPP_TINY {
        let bytes = support::llamacpp_tiny(arch, window).to_bytes();
        std::fs::write(std::path::Path::new(&dir).join(format!("{arch}.gguf")), &bytes)?;
        let digest = bulkhead_gguf::GgufFile::parse(bytes)?.digest().ok_or("no digest")?;
        println!("{arch} {digest:016x}");
    }
    Ok(())
}
