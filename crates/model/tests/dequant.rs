//! Dequantisation of every tensor type we load agrees with ggml's reference, as the `gguf`
//! Python package computes it (`scripts/dequant-fixtures.py` recorded the fixture from
//! random blocks of each type).

use bulkhead_gguf::GgmlType;
use bulkhead_model::quant::dequantize_row;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

#[test]
fn every_type_dequantises_as_ggml_does() {
    let v: serde_json::Value = serde_json::from_str(include_str!("fixtures/dequant.json")).expect("fixture");
    let cases = v["cases"].as_array().expect("cases");
    let mut seen = Vec::new();
    for case in cases {
        let name = case["type"].as_str().expect("type");
        let ty = GgmlType::known().find(|t| t.to_string() == name).unwrap_or_else(|| panic!("unknown type {name}"));
        let bytes = hex(case["bytes"].as_str().expect("bytes"));
        let want: Vec<f32> = case["values"].as_array().expect("values").iter().map(|x| x.as_f64().expect("number") as f32).collect();
        let mut got = vec![0.0f32; want.len()];
        dequantize_row(ty, &bytes, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // The reference computes in f32 in ggml's order; allow one rounding of slack.
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-3), "{name} element {i}: {g} vs {w}");
        }
        seen.push(ty);
    }
    for ty in GgmlType::known().filter(|t| *t != GgmlType::F32) {
        assert!(seen.contains(&ty), "{ty} has no fixture");
    }
}
