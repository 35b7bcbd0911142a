//! Writing GGUF files, used to build small synthetic models for tests.

use crate::types::{GgmlType, Value};
use crate::{DEFAULT_ALIGNMENT, MAGIC};

/// Builds a GGUF v3 file in memory.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::Array(items) => {
            let code = items.first().map_or(4, Value::type_code);
            out.extend_from_slice(&code.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add a metadata entry.
    pub fn meta(&mut self, key: &str, v: Value) -> &mut Self {
        self.metadata.push((key.to_string(), v));
        self
    }

    /// Add a tensor with raw (already encoded) bytes; `dims` innermost first.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, bytes: Vec<u8>) -> &mut Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, bytes));
        self
    }

    /// Add an F32 tensor.
    pub fn tensor_f32(&mut self, name: &str, dims: &[u64], values: &[f32]) -> &mut Self {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, GgmlType::F32, bytes)
    }

    /// Serialise, aligning tensor data to `general.alignment` when it is set (readers align
    /// to it), else to the default.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self
            .metadata
            .iter()
            .rfind(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT) as usize;
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut out, k);
            out.extend_from_slice(&v.type_code().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ty, bytes) in &self.tensors {
            put_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.code().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + bytes.len()).div_ceil(align) * align;
        }
        // The data section starts aligned; without tensors there is none to pad for.
        if !self.tensors.is_empty() {
            out.resize(out.len().div_ceil(align) * align, 0);
        }
        let base = out.len();
        for ((_, _, _, bytes), off) in self.tensors.iter().zip(offsets) {
            out.resize(base + off, 0);
            out.extend_from_slice(bytes);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GgufError, GgufFile};

    #[test]
    fn a_written_file_reads_back_identically() {
        let mut w = GgufWriter::new();
        w.meta("general.architecture", Value::String("llama".into()))
            .meta("llama.block_count", Value::U32(2))
            .meta("names", Value::Array(vec![Value::String("a".into()), Value::String("bc".into())]))
            .tensor_f32("x", &[3], &[1.0, 2.0, 3.0])
            .tensor_f32("y", &[2, 2], &[4.0, 5.0, 6.0, 7.0]);
        let f = GgufFile::parse(w.to_bytes()).unwrap();
        assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
        assert_eq!(f.get_count("llama.block_count").unwrap(), 2);
        assert_eq!(f.get_str_array("names").unwrap(), vec!["a", "bc"]);
        let (t, b) = f.tensor("y").unwrap();
        assert_eq!(t.dims, vec![2, 2]);
        assert_eq!(b.len(), 16);
        assert_eq!(f32::from_le_bytes(b[12..16].try_into().unwrap()), 7.0);
    }

    #[test]
    fn every_truncation_of_a_valid_file_is_an_error_not_a_panic() {
        let mut w = GgufWriter::new();
        w.meta("k", Value::Array(vec![Value::U32(1), Value::U32(2)])).tensor_f32("x", &[4], &[0.0; 4]);
        let bytes = w.to_bytes();
        for n in 0..bytes.len() {
            // A cut inside the padding after the last tensor's data can still be whole; all
            // others must fail.
            if let Ok(f) = GgufFile::parse(bytes[..n].to_vec()) {
                assert!(f.tensor("x").is_ok(), "cut at {n} parsed but lost data");
            }
        }
    }

    #[test]
    fn corrupt_lengths_and_types_are_errors() {
        let mut w = GgufWriter::new();
        w.meta("k", Value::String("v".into()));
        let good = w.to_bytes();
        // Metadata count claiming billions of entries.
        let mut b = good.clone();
        b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(GgufFile::parse(b).is_err());
        // Bad magic.
        let mut b = good.clone();
        b[0] = b'X';
        assert!(matches!(GgufFile::parse(b), Err(GgufError::BadMagic { .. })));
        // Bad value type code (after key: 24 header + 8 len + 1 byte key).
        let mut b = good;
        b[33..37].copy_from_slice(&99u32.to_le_bytes());
        assert!(matches!(GgufFile::parse(b), Err(GgufError::BadValueType { code: 99, .. })));
    }

    #[test]
    fn a_tensor_past_the_end_of_the_file_is_refused() {
        let mut w = GgufWriter::new();
        w.tensor("x", &[64], GgmlType::F32, vec![0; 128]); // needs 256 bytes
        let err = GgufFile::parse(w.to_bytes()).unwrap_err();
        assert!(err.to_string().contains("outside"), "{err}");
    }

    #[test]
    fn wrong_metadata_types_name_the_key() {
        let mut w = GgufWriter::new();
        w.meta("llama.block_count", Value::String("thirty".into()));
        let f = GgufFile::parse(w.to_bytes()).unwrap();
        let e = f.get_count("llama.block_count").unwrap_err().to_string();
        assert!(e.contains("llama.block_count") && e.contains("string"), "{e}");
        let e = f.get_f64("missing.key").unwrap_err().to_string();
        assert!(e.contains("missing.key"), "{e}");
    }
}
