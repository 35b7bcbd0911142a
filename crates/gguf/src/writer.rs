//! Writing GGUF files: small synthetic models for tests, built in memory
//! ([`GgufWriter::to_bytes`]), and large ones streamed tensor by tensor to any
//! [`std::io::Write`] ([`GgufWriter::stream`]) so that no file is ever held whole.

use std::io::{self, Read, Write};

use crate::reader::GgufError;
use crate::types::{GgmlType, Value};
use crate::{DEFAULT_ALIGNMENT, MAGIC};

/// Builds a GGUF v3 file: in memory, or streamed with tensors whose bytes come later.
#[derive(Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<Entry>,
}

/// One tensor of the table.
#[derive(Debug)]
struct Entry {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Data,
}

/// A tensor's bytes, or only their count when they are streamed later.
#[derive(Debug)]
enum Data {
    Bytes(Vec<u8>),
    Later(u64),
}

impl Entry {
    fn size(&self) -> u64 {
        match &self.data {
            Data::Bytes(b) => b.len() as u64,
            Data::Later(n) => *n,
        }
    }
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
        self.tensors.push(Entry { name: name.to_string(), dims: dims.to_vec(), ty, data: Data::Bytes(bytes) });
        self
    }

    /// Add an F32 tensor.
    pub fn tensor_f32(&mut self, name: &str, dims: &[u64], values: &[f32]) -> &mut Self {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, GgmlType::F32, bytes)
    }

    /// Declare a tensor whose bytes are not held here but written later, in table order,
    /// through [`GgufWriter::stream`]; its size follows from `dims` and `ty` (an error for a
    /// type of unknown layout or dims that are not whole blocks).
    pub fn tensor_later(&mut self, name: &str, dims: &[u64], ty: GgmlType) -> Result<&mut Self, GgufError> {
        let elems = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        let size = elems.and_then(|n| ty.bytes_for(n)).ok_or_else(|| GgufError::BadTensor {
            name: name.to_string(),
            why: format!("dims {dims:?} are not a whole number of {ty} blocks (or the type's layout is unknown)"),
        })?;
        self.tensors.push(Entry { name: name.to_string(), dims: dims.to_vec(), ty, data: Data::Later(size) });
        Ok(self)
    }

    /// The alignment of tensor data: `general.alignment` when it is set (readers align to
    /// it), else the default.
    fn alignment(&self) -> u64 {
        self.metadata
            .iter()
            .rfind(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_u64())
            .filter(|a| a.is_power_of_two())
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// Everything before the tensors' data (magic, counts, metadata, the tensor table, and
    /// the padding that aligns the data section when there are tensors), with each
    /// tensor's offset within the data section: every offset is computable from the sizes.
    fn header(&self) -> (Vec<u8>, Vec<u64>) {
        let align = self.alignment();
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
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for e in &self.tensors {
            put_str(&mut out, &e.name);
            out.extend_from_slice(&(e.dims.len() as u32).to_le_bytes());
            for d in &e.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&e.ty.code().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + e.size()).div_ceil(align) * align;
        }
        // The data section starts aligned; without tensors there is none to pad for.
        if !self.tensors.is_empty() {
            out.resize((out.len() as u64).div_ceil(align) as usize * align as usize, 0);
        }
        (out, offsets)
    }

    /// Bytes of the whole file (as [`GgufWriter::to_bytes`] or [`GgufWriter::stream`] write it).
    pub fn file_size(&self) -> u64 {
        let (header, offsets) = self.header();
        let data = self.tensors.last().zip(offsets.last()).map_or(0, |(e, off)| off + e.size());
        header.len() as u64 + data
    }

    /// Serialise in memory, aligning tensor data to `general.alignment` when it is set,
    /// else to the default. A tensor declared with [`GgufWriter::tensor_later`] has no bytes
    /// here and is written as zeros.
    pub fn to_bytes(&self) -> Vec<u8> {
        let (mut out, offsets) = self.header();
        let base = out.len();
        for (e, off) in self.tensors.iter().zip(offsets) {
            out.resize(base + off as usize, 0);
            match &e.data {
                Data::Bytes(bytes) => out.extend_from_slice(bytes),
                Data::Later(n) => out.resize(out.len() + *n as usize, 0),
            }
        }
        out
    }

    /// Write the header (metadata and the tensor table, whose offsets follow from the sizes)
    /// to `out` now, and return the stream that takes the tensors' data in table order:
    /// tensors added with their bytes are written by the stream itself, those declared with
    /// [`GgufWriter::tensor_later`] through [`GgufStream::write`]. The bytes written equal
    /// [`GgufWriter::to_bytes`]'s for the same tensors.
    pub fn stream<W: Write>(&self, mut out: W) -> io::Result<GgufStream<'_, W>> {
        let (header, offsets) = self.header();
        out.write_all(&header)?;
        Ok(GgufStream { out, entries: &self.tensors, offsets, next: 0, filled: 0, pos: 0 })
    }
}

/// A GGUF file being written tensor by tensor (see [`GgufWriter::stream`]): at most one
/// tensor's bytes, as the caller chunks them, are held at a time.
#[derive(Debug)]
pub struct GgufStream<'a, W: Write> {
    out: W,
    entries: &'a [Entry],
    offsets: Vec<u64>,
    /// The tensor being written (`entries.len()` once all are).
    next: usize,
    /// Its bytes written so far.
    filled: u64,
    /// Bytes written into the data section.
    pos: u64,
}

fn invalid(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, why)
}

impl<W: Write> GgufStream<'_, W> {
    /// Write the padding before the next tensor and every tensor whose bytes the writer
    /// holds, up to the next one the caller must write.
    fn advance(&mut self) -> io::Result<()> {
        while let Some(e) = self.entries.get(self.next) {
            if self.filled == 0 {
                let pad = self.offsets[self.next] - self.pos;
                io::copy(&mut io::repeat(0).take(pad), &mut self.out)?;
                self.pos += pad;
            }
            match &e.data {
                Data::Bytes(b) => {
                    self.out.write_all(b)?;
                    self.pos += b.len() as u64;
                    self.next += 1;
                }
                Data::Later(n) if self.filled == *n => {
                    self.filled = 0;
                    self.next += 1;
                }
                Data::Later(_) => return Ok(()),
            }
        }
        Ok(())
    }

    /// The tensor the next [`GgufStream::write`] belongs to: its name and the bytes still to
    /// write; `None` once every tensor is written.
    pub fn next_tensor(&mut self) -> io::Result<Option<(&str, u64)>> {
        self.advance()?;
        Ok(self.entries.get(self.next).map(|e| (e.name.as_str(), e.size() - self.filled)))
    }

    /// Write the next `bytes` of the current tensor (any chunking; a chunk may not run past
    /// the tensor's end).
    pub fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.advance()?;
        let Some(e) = self.entries.get(self.next) else {
            return Err(invalid(format!("{} bytes written after the last tensor", bytes.len())));
        };
        let left = e.size() - self.filled;
        if bytes.len() as u64 > left {
            return Err(invalid(format!("{} bytes for tensor `{}`, which has {left} left", bytes.len(), e.name)));
        }
        self.out.write_all(bytes)?;
        self.filled += bytes.len() as u64;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    /// Check that every tensor was written whole, flush, and return the writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.advance()?;
        if let Some(e) = self.entries.get(self.next) {
            return Err(invalid(format!("tensor `{}` has {} of its {} bytes", e.name, self.filled, e.size())));
        }
        self.out.flush()?;
        Ok(self.out)
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

    /// Two writers with the same tensors: one holding every tensor's bytes, one holding only
    /// the F32 ones and declaring the quantised ones for later.
    fn pair(align: Option<u32>) -> (GgufWriter, GgufWriter, Vec<(String, Vec<u8>)>) {
        let (mut held, mut later) = (GgufWriter::new(), GgufWriter::new());
        let mut streamed = Vec::new();
        for w in [&mut held, &mut later] {
            w.meta("general.architecture", Value::String("llama".into()));
            if let Some(a) = align {
                w.meta("general.alignment", Value::U32(a));
            }
        }
        // Sizes that are not multiples of the alignment, so that padding shows.
        for (i, n) in [3u64, 64, 5, 96].into_iter().enumerate() {
            let name = format!("t{i}");
            if i % 2 == 0 {
                let v: Vec<f32> = (0..n).map(|x| x as f32).collect();
                held.tensor_f32(&name, &[n], &v);
                later.tensor_f32(&name, &[n], &v);
            } else {
                let bytes: Vec<u8> = (0..n / 32 * 34).map(|x| (x * 7 + i as u64) as u8).collect();
                held.tensor(&name, &[n], GgmlType::Q8_0, bytes.clone());
                later.tensor_later(&name, &[n], GgmlType::Q8_0).unwrap();
                streamed.push((name, bytes));
            }
        }
        (held, later, streamed)
    }

    #[test]
    fn a_streamed_file_equals_the_in_memory_one() {
        for align in [None, Some(64)] {
            let (held, later, streamed) = pair(align);
            let want = held.to_bytes();
            assert_eq!(held.file_size(), want.len() as u64);
            assert_eq!(later.file_size(), want.len() as u64);
            // Every tensor held: the stream writes them itself.
            assert_eq!(held.stream(Vec::new()).unwrap().finish().unwrap(), want);
            // Tensors streamed in uneven chunks, named in table order.
            let mut s = later.stream(Vec::new()).unwrap();
            for (name, bytes) in &streamed {
                let (next, left) = s.next_tensor().unwrap().unwrap();
                assert_eq!((next, left), (name.as_str(), bytes.len() as u64));
                for chunk in bytes.chunks(7) {
                    s.write(chunk).unwrap();
                }
            }
            assert!(s.next_tensor().unwrap().is_none());
            assert_eq!(s.finish().unwrap(), want, "alignment {align:?}");
            GgufFile::parse(want).unwrap();
        }
    }

    #[test]
    fn a_stream_refuses_overlong_and_missing_bytes() {
        let (_, later, streamed) = pair(None);
        let mut s = later.stream(Vec::new()).unwrap();
        let too_long = vec![0u8; streamed[0].1.len() + 1];
        let e = s.write(&too_long).unwrap_err().to_string();
        assert!(e.contains("t1") && e.contains("left"), "{e}");
        s.write(&streamed[0].1[..10]).unwrap();
        let e = s.finish().unwrap_err().to_string();
        assert!(e.contains("t1") && e.contains("10 of its 68 bytes"), "{e}");
        let mut w = GgufWriter::new();
        let e = w.tensor_later("odd", &[33], GgmlType::Q4_0).unwrap_err().to_string();
        assert!(e.contains("odd") && e.contains("Q4_0"), "{e}");
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
    fn an_opened_file_reads_each_tensor_from_disk_as_the_parsed_one_holds_it() {
        let dir = std::env::temp_dir().join(format!("bulkhead-gguf-open-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (held, _, _) = pair(Some(64));
        let bytes = held.to_bytes();
        let path = dir.join("m.gguf");
        std::fs::write(&path, &bytes).unwrap();
        let (opened, parsed) = (GgufFile::open(&path).unwrap(), GgufFile::parse(bytes.clone()).unwrap());
        assert_eq!(opened.digest(), parsed.digest());
        assert_eq!(opened.digest(), Some(xxhash_rust::xxh3::xxh3_64(&bytes)));
        for t in parsed.tensors() {
            assert_eq!(opened.tensor(&t.name).unwrap().1, parsed.tensor(&t.name).unwrap().1, "{}", t.name);
        }
        // Metadata only: the same table, no tensor, no digest.
        let meta = GgufFile::open_metadata(&path).unwrap();
        assert_eq!(meta.tensors().len(), parsed.tensors().len());
        assert!(meta.tensor(&parsed.tensors()[0].name).is_err() && meta.digest().is_none());
        // A file cut short is refused when opened, naming it, not when a tensor is read.
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        let err = GgufFile::open(&path).unwrap_err().to_string();
        assert!(err.contains("m.gguf") && err.contains("outside"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
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
