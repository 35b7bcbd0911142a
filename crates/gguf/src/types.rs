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

/// Tensor element types. Only the ones Bulkhead computes with have names; the rest are kept
/// as their code so that the error can say which type a file uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    /// Any other ggml type, by its code.
    Other(u32),
}

impl GgmlType {
    /// Type from its ggml code.
    pub fn from_code(code: u32) -> Self {
        match code {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            other => GgmlType::Other(other),
        }
    }

    /// The ggml code.
    pub fn code(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::Other(c) => c,
        }
    }

    /// (elements per block, bytes per block), or None for a type we do not know the size of.
    pub fn block(self) -> Option<(usize, usize)> {
        match self {
            GgmlType::F32 => Some((1, 4)),
            GgmlType::F16 => Some((1, 2)),
            GgmlType::Q4_0 => Some((32, 18)),
            GgmlType::Q4_1 => Some((32, 20)),
            GgmlType::Q8_0 => Some((32, 34)),
            GgmlType::Other(_) => None,
        }
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
        match self {
            GgmlType::F32 => f.write_str("F32"),
            GgmlType::F16 => f.write_str("F16"),
            GgmlType::Q4_0 => f.write_str("Q4_0"),
            GgmlType::Q4_1 => f.write_str("Q4_1"),
            GgmlType::Q8_0 => f.write_str("Q8_0"),
            GgmlType::Other(c) => write!(f, "ggml type {c}"),
        }
    }
}
