// TEMPORARY differential check against llama.cpp output in /tmp; deleted after use.
use bulkhead_gguf::GgufFile;
use bulkhead_tokenizer::Tokenizer;

#[derive(serde::Deserialize)]
struct Out { cases: Vec<Case>, pieces: Vec<String>, eog: Vec<u32> }
#[derive(serde::Deserialize)]
struct Case { text: String, special: Vec<u32>, plain: Vec<u32> }

#[test]
fn diff() {
    let path = bulkhead_fetch::ensure_default_model(false).unwrap();
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let f = std::env::var("DIFF_FILE").unwrap();
    let out: Out = serde_json::from_str(&std::fs::read_to_string(f).unwrap()).unwrap();
    let mut bad = 0;
    for c in &out.cases {
        for (flag, want) in [(true, &c.special), (false, &c.plain)] {
            let got = tok.encode(&c.text, flag);
            if &got != want {
                bad += 1;
                if bad < 30 { println!("MISMATCH special={flag} {:?}\n  got  {:?}\n  want {:?}", c.text, got, want); }
            }
        }
    }
    let mut pbad = 0;
    for (i, p) in out.pieces.iter().enumerate() {
        let hex: String = tok.token_bytes(i as u32).unwrap().iter().map(|b| format!("{b:02x}")).collect();
        if &hex != p && !(p.is_empty() && hex.len() > 64) { pbad += 1; if pbad < 10 { println!("PIECE {i} got {hex} want {p}"); } }
    }
    println!("cases {} mismatches {bad}; piece mismatches {pbad}; eog llama {:?} ours {:?}", out.cases.len(), out.eog, tok.eog_ids());
    assert_eq!(bad + pbad, 0);
}
