//! Parsing. The whole file is read into memory (the default model is under 100 MB); every
//! length read from the file is checked against the bytes that remain before anything is
//! allocated for it.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::types::{GgmlType, Value};
use crate::{DEFAULT_ALIGNMENT, MAGIC};

/// Why a GGUF file could not be read or lacks what was asked of it.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    InFile { path: PathBuf, source: Box<GgufError> },
    #[error("not a GGUF file (magic {found:?}, expected \"GGUF\")")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("file truncated: needed {needed} bytes at offset {offset}, file has {len}")]
    Truncated { offset: u64, needed: u64, len: u64 },
    #[error("invalid metadata value type {code} for key `{key}`")]
    BadValueType { key: String, code: u32 },
    #[error("metadata key `{key}` is not valid UTF-8")]
    BadString { key: String },
    #[error("metadata nesting too deep at key `{key}`")]
    TooDeep { key: String },
    #[error("missing metadata key `{key}`")]
    MissingKey { key: String },
    #[error("metadata key `{key}` has type {found}, expected {expected}")]
    WrongType { key: String, expected: &'static str, found: &'static str },
    #[error("metadata key `{key}` has invalid value: {why}")]
    InvalidValue { key: String, why: String },
    #[error("tensor `{name}`: {why}")]
    BadTensor { name: String, why: String },
    #[error("missing tensor `{name}`")]
    MissingTensor { name: String },
    #[error("duplicate {what} `{name}`")]
    Duplicate { what: &'static str, name: String },
}

/// One entry of the tensor table.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions, innermost (contiguous) first, as ggml stores them.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes (derived from dims and type; checked to lie within the file).
    pub size: u64,
}

impl TensorInfo {
    /// Number of elements.
    pub fn elems(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file, and where its tensors' bytes are read from.
#[derive(Debug)]
pub struct GgufFile {
    version: u32,
    metadata: BTreeMap<String, Value>,
    tensors: Vec<TensorInfo>,
    data: Data,
    data_offset: usize,
}

/// Where a [`GgufFile`]'s tensors are.
#[derive(Debug)]
enum Data {
    /// The whole file, in memory ([`GgufFile::parse`]).
    Memory(Vec<u8>),
    /// In the open file, read a tensor at a time ([`GgufFile::open`]): a model is laid out
    /// from it without the whole file in memory beside the result.
    File { file: std::fs::File, path: std::path::PathBuf },
    /// Nowhere: [`GgufFile::open_metadata`].
    None,
}

// Metadata arrays nest; real files use one level. Refuse deeper nesting rather than recurse on
// attacker-controlled depth.
const MAX_DEPTH: usize = 4;
const MAX_DIMS: u32 = 8;

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], GgufError> {
        let len = self.bytes.len() as u64;
        let end = (self.pos as u64).checked_add(n).filter(|&e| e <= len).ok_or(GgufError::Truncated {
            offset: self.pos as u64,
            needed: n,
            len,
        })?;
        let s = &self.bytes[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N as u64)?);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }
    fn string(&mut self, key: &str) -> Result<String, GgufError> {
        let n = self.u64()?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| GgufError::BadString { key: key.to_string() })
    }
    fn value(&mut self, key: &str, code: u32, depth: usize) -> Result<Value, GgufError> {
        Ok(match code {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(i8::from_le_bytes(self.array()?)),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string(key)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(GgufError::TooDeep { key: key.to_string() });
                }
                let item = self.u32()?;
                let n = self.u64()?;
                // Every element takes at least one byte: a count beyond the remaining bytes is a
                // corrupt file, not a reason to allocate.
                if n > self.remaining() {
                    return Err(GgufError::Truncated { offset: self.pos as u64, needed: n, len: self.bytes.len() as u64 });
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(key, item, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            code => return Err(GgufError::BadValueType { key: key.to_string(), code }),
        })
    }
}

impl GgufFile {
    /// Open and parse a file, its header read now and each tensor when asked for
    /// ([`GgufFile::tensor`]); every tensor must lie within the file. Errors name the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let (file, head) = Self::read_header(path)?;
        let len = file.metadata().map_err(|source| GgufError::Io { path: path.to_path_buf(), source })?.len();
        let mut f = Self::parse_inner(head, Some(len)).map_err(|e| GgufError::InFile { path: path.to_path_buf(), source: Box::new(e) })?;
        f.data = Data::File { file, path: path.to_path_buf() };
        Ok(f)
    }

    /// Read only a file's metadata and tensor table (not the tensors' data, which cannot be
    /// read from the result): what deciding a model's shape needs, for a fraction of the I/O.
    pub fn open_metadata(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let (_, head) = Self::read_header(path)?;
        Self::parse_inner(head, None).map_err(|e| GgufError::InFile { path: path.to_path_buf(), source: Box::new(e) })
    }

    /// The open file and its first bytes, enough to parse its header and tensor table.
    fn read_header(path: &Path) -> Result<(std::fs::File, Vec<u8>), GgufError> {
        use std::io::Read;
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        let mut head = Vec::new();
        // Read more until the header parses: metadata sizes vary from kilobytes to tens of
        // megabytes (a large vocabulary).
        let mut want = 1 << 20;
        loop {
            let have = head.len() as u64;
            (&file).take(want - have).read_to_end(&mut head).map_err(io)?;
            let eof = (head.len() as u64) < want;
            match Self::parse_inner(head.clone(), None) {
                Err(GgufError::Truncated { .. }) if !eof => want *= 2,
                Err(e) => return Err(GgufError::InFile { path: path.to_path_buf(), source: Box::new(e) }),
                Ok(_) => return Ok((file, head)),
            }
        }
    }

    /// xxh3-64 of the whole file: the identity a gateway and its workers compare. `None` for
    /// a file opened for its metadata only, or one that can no longer be read. An opened file
    /// is read again for it, a few megabytes at a time.
    pub fn digest(&self) -> Option<u64> {
        match &self.data {
            Data::Memory(bytes) => Some(xxhash_rust::xxh3::xxh3_64(bytes)),
            Data::File { file, .. } => {
                use std::os::unix::fs::FileExt;
                let mut h = xxhash_rust::xxh3::Xxh3::new();
                let mut buf = vec![0u8; 8 << 20];
                let mut at = 0u64;
                loop {
                    match file.read_at(&mut buf, at) {
                        Ok(0) => return Some(h.digest()),
                        Ok(n) => {
                            h.update(&buf[..n]);
                            at += n as u64;
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => return None,
                    }
                }
            }
            Data::None => None,
        }
    }

    /// Parse a file's bytes, held in memory.
    pub fn parse(data: Vec<u8>) -> Result<Self, GgufError> {
        let len = data.len() as u64;
        Self::parse_inner(data, Some(len))
    }

    /// Parse a header held in `data`; with `file_len` (the whole file's length), every
    /// tensor must lie within it, and `data`, if it is the whole file, is kept.
    fn parse_inner(data: Vec<u8>, file_len: Option<u64>) -> Result<Self, GgufError> {
        let with_data = file_len.is_some();
        let mut c = Cursor { bytes: &data, pos: 0 };
        let magic: [u8; 4] = c.array()?;
        if &magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = c.u64()?;
        let n_kv = c.u64()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string("<key>")?;
            let code = c.u32()?;
            let v = c.value(&key, code, 0)?;
            if metadata.insert(key.clone(), v).is_some() {
                return Err(GgufError::Duplicate { what: "metadata key", name: key });
            }
        }
        if n_tensors > c.remaining() {
            return Err(GgufError::Truncated { offset: c.pos as u64, needed: n_tensors, len: data.len() as u64 });
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = c.string("<tensor name>")?;
            let n_dims = c.u32()?;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::BadTensor { name, why: format!("{n_dims} dimensions") });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64()?);
            }
            let ty = GgmlType::from_code(c.u32()?);
            let offset = c.u64()?;
            tensors.push(TensorInfo { name, dims, ty, offset, size: 0 });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => {
                    return Err(GgufError::InvalidValue { key: "general.alignment".into(), why: format!("{v:?} is not a power of two") });
                }
            },
        };
        let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
        // Every tensor, even one of no bytes, is read from the data section: it must start
        // within the file.
        let file_bytes = file_len.unwrap_or(data.len() as u64);
        if with_data && !tensors.is_empty() && data_offset > file_bytes {
            return Err(GgufError::Truncated { offset: c.pos as u64, needed: data_offset - c.pos as u64, len: file_bytes });
        }
        let data_len = file_bytes.saturating_sub(data_offset);
        let mut seen = std::collections::HashSet::new();
        for t in &mut tensors {
            if !seen.insert(t.name.clone()) {
                return Err(GgufError::Duplicate { what: "tensor", name: t.name.clone() });
            }
            let elems = t
                .dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| GgufError::BadTensor { name: t.name.clone(), why: "element count overflows".into() })?;
            // Unknown types are kept (size 0) so the model can name them in its error; they
            // can never be read.
            if t.ty.block().is_some() {
                t.size = t.ty.bytes_for(elems).ok_or_else(|| GgufError::BadTensor {
                    name: t.name.clone(),
                    why: format!("{elems} elements is not a whole number of {} blocks", t.ty),
                })?;
                let end = t.offset.checked_add(t.size);
                if end.is_none() || (with_data && end.is_some_and(|e| e > data_len)) {
                    return Err(GgufError::BadTensor {
                        name: t.name.clone(),
                        why: format!(
                            "data [{}..+{}] lies outside the file's {data_len}-byte data section (truncated file?)",
                            t.offset, t.size
                        ),
                    });
                }
            }
        }
        // The bytes are kept only when they are the whole file.
        let data = if file_len == Some(data.len() as u64) { Data::Memory(data) } else { Data::None };
        Ok(GgufFile { version, metadata, tensors, data_offset: data_offset as usize, data })
    }

    /// GGUF format version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata.
    pub fn metadata(&self) -> &BTreeMap<String, Value> {
        &self.metadata
    }

    /// The tensor table.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// A metadata value, or `MissingKey`.
    pub fn get(&self, key: &str) -> Result<&Value, GgufError> {
        self.metadata.get(key).ok_or_else(|| GgufError::MissingKey { key: key.to_string() })
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType { key: key.to_string(), expected, found: v.type_name() }
    }

    /// An unsigned integer value of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.get(key)?;
        v.as_u64().ok_or_else(|| Self::wrong(key, "unsigned integer", v))
    }

    /// An unsigned integer that must be at least 1 and fit in `usize`.
    pub fn get_count(&self, key: &str) -> Result<usize, GgufError> {
        let n = self.get_u64(key)?;
        usize::try_from(n)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| GgufError::InvalidValue { key: key.to_string(), why: format!("{n} is not a positive count") })
    }

    /// A float value (f32 or f64).
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.get(key)?;
        v.as_f64().ok_or_else(|| Self::wrong(key, "float", v))
    }

    /// A boolean value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.get(key)? {
            Value::Bool(b) => Ok(*b),
            v => Err(Self::wrong(key, "bool", v)),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.get(key)? {
            Value::String(s) => Ok(s),
            v => Err(Self::wrong(key, "string", v)),
        }
    }

    /// An array value.
    pub fn get_array(&self, key: &str) -> Result<&[Value], GgufError> {
        match self.get(key)? {
            Value::Array(a) => Ok(a),
            v => Err(Self::wrong(key, "array", v)),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.get_array(key)?
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                v => Err(Self::wrong(key, "array of strings", v)),
            })
            .collect()
    }

    /// An array of integers, as i64.
    pub fn get_int_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        self.get_array(key)?.iter().map(|v| v.as_i64().ok_or_else(|| Self::wrong(key, "array of integers", v))).collect()
    }

    /// A tensor's table entry.
    pub fn tensor_info(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors.iter().find(|t| t.name == name).ok_or_else(|| GgufError::MissingTensor { name: name.to_string() })
    }

    /// A tensor's entry and raw bytes: borrowed from a file parsed in memory, read from an
    /// opened one. Fails for a type whose size is unknown.
    pub fn tensor(&self, name: &str) -> Result<(&TensorInfo, Cow<'_, [u8]>), GgufError> {
        let t = self.tensor_info(name)?;
        if t.ty.block().is_none() {
            return Err(GgufError::BadTensor { name: name.to_string(), why: format!("unsupported tensor type {}", t.ty) });
        }
        // In range: checked against the data section at parse time.
        let start = self.data_offset + t.offset as usize;
        match &self.data {
            Data::Memory(bytes) => Ok((t, Cow::Borrowed(&bytes[start..start + t.size as usize]))),
            Data::File { file, path } => {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; t.size as usize];
                file.read_exact_at(&mut buf, start as u64).map_err(|source| GgufError::Io { path: path.clone(), source })?;
                Ok((t, Cow::Owned(buf)))
            }
            Data::None => Err(GgufError::BadTensor { name: name.to_string(), why: "the file was opened for its metadata only".into() }),
        }
    }
}
