//! Metadata values and ggml tensor element types.

use std::fmt;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The GGUF type code of this value.
    pub fn type_code(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// A non-negative integer value of any width, widened.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// A signed integer value of any width, if it fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// A floating-point value (integers are not silently converted).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// Name of the value's type, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }
}

/// Tensor element types, by ggml's names. Only the ones Bulkhead computes with have names;
/// the rest are kept as their code so that the error can say which type a file uses.
#[allow(non_camel_case_types)] // ggml's own names (Q4_K), which users see in their files
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    /// Any other ggml type, by its code.
    Other(u32),
}

/// Every type with a known layout: (type, ggml code, name, elements per block, bytes per block).
const KNOWN: [(GgmlType, u32, &str, usize, usize); 13] = [
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::BF16, 30, "BF16", 1, 2),
];

impl GgmlType {
    /// Type from its ggml code.
    pub fn from_code(code: u32) -> Self {
        KNOWN.iter().find(|k| k.1 == code).map_or(GgmlType::Other(code), |k| k.0)
    }

    /// The ggml code.
    pub fn code(self) -> u32 {
        match self {
            GgmlType::Other(c) => c,
            t => KNOWN.iter().find(|k| k.0 == t).map_or(u32::MAX, |k| k.1),
        }
    }

    /// (elements per block, bytes per block), or None for a type we do not know the size of.
    pub fn block(self) -> Option<(usize, usize)> {
        KNOWN.iter().find(|k| k.0 == self).map(|k| (k.3, k.4))
    }

    /// Every type whose layout this crate knows.
    pub fn known() -> impl Iterator<Item = GgmlType> {
        KNOWN.iter().map(|k| k.0)
    }

    /// Bytes needed for `elems` elements, None when unknown, not a whole number of blocks,
    /// or overflowing.
    pub fn bytes_for(self, elems: u64) -> Option<u64> {
        let (be, bb) = self.block()?;
        let be = be as u64;
        if !elems.is_multiple_of(be) {
            return None;
        }
        (elems / be).checked_mul(bb as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match KNOWN.iter().find(|k| k.0 == *self) {
            Some(k) => f.write_str(k.2),
            None => write!(f, "ggml type {}", self.code()),
        }
    }
}
