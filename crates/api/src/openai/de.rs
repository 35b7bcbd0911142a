//! How the request types read a body: serde with OpenAI's wording. A field's rule (a
//! `deserialize_with` function here, or a `Deserialize` impl in `request`) checks its JSON
//! value and refuses it with a [`Fault`]; serde_path_to_error finds where the field sits, and
//! [`typed`] turns the two into the 400 naming that `param`.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer};
use serde::{Deserialize as DeriveDeserialize, Serialize};
use serde_json::{Map, Number, Value};

use super::{MAX_CACHE_SALT, MAX_N, MAX_TEMPERATURE, MAX_TEXT_LOGPROBS, MAX_TOKEN_LIST, MAX_TOP_LOGPROBS};
use crate::error::ApiError;

/// Why a value was refused, before its `param` is known. It crosses serde as the text of a
/// custom error (as JSON, so that it comes back whole, whatever the request's strings hold).
#[derive(Debug, Serialize, DeriveDeserialize)]
pub(super) struct Fault {
    /// Where the fault is below the value that was read (`[2].text`); empty at the value.
    at: String,
    /// The message in pieces, to be joined with the `param`.
    text: Vec<String>,
    /// The error code, if any.
    code: Option<Code>,
}

/// The error codes a [`Fault`] may carry.
#[derive(Debug, Clone, Copy, Serialize, DeriveDeserialize)]
enum Code {
    Unsupported,
    Unknown,
}

impl Fault {
    /// A message (pieces joined with the `param`).
    pub(super) fn says(text: &[&str]) -> Self {
        Fault { at: String::new(), text: text.iter().map(|s| (*s).to_owned()).collect(), code: None }
    }

    /// `Invalid type for '{param}': expected {expected}, but got {got's type} instead.`
    pub(super) fn type_error(expected: &str, got: &Value) -> Self {
        let tail = format!("': expected {expected}, but got {} instead.", type_name(got));
        Fault::says(&["Invalid type for '", &tail])
    }

    /// `Invalid '{param}': expected {expected}, but got {got} instead.`
    pub(super) fn range(expected: &str, got: &Value) -> Self {
        // Integers past u64 arrive as floats (`1.8446744073709552e19`): print them whole.
        let shown = match got {
            Value::Number(n) if n.is_f64() && whole(n).is_some() => n.as_f64().map_or_else(|| got.to_string(), |f| format!("{f:.0}")),
            _ => got.to_string(),
        };
        Fault::says(&["Invalid '", &format!("': expected {expected}, but got {shown} instead.")])
    }

    /// `Missing required parameter: '{param}'.`
    pub(super) fn missing() -> Self {
        Fault::says(&["Missing required parameter: '", "'."])
    }

    /// An `unsupported_parameter` refusal.
    pub(super) fn unsupported(mut self) -> Self {
        self.code = Some(Code::Unsupported);
        self
    }

    /// The first key of `obj` that `known` refuses, as an `unknown_parameter` fault.
    pub(super) fn unknown_key(obj: &Map<String, Value>, known: impl Fn(&str) -> bool) -> Result<(), Fault> {
        match obj.keys().find(|k| !known(k)) {
            None => Ok(()),
            Some(k) => {
                let f = Fault::says(&["Unrecognized request argument supplied: ", ""]).within(&format!(".{k}"));
                Err(Fault { code: Some(Code::Unknown), ..f })
            }
        }
    }

    /// The same fault, seen from `prefix` above (`[2]`, `.content`).
    pub(super) fn within(mut self, prefix: &str) -> Self {
        self.at.insert_str(0, prefix);
        self
    }

    /// The 400 for this fault in the top-level field `field`.
    pub(super) fn named(self, field: &str) -> ApiError {
        self.within(&format!(".{field}")).into_error()
    }

    fn into_error(self) -> ApiError {
        let param = self.at.strip_prefix('.').unwrap_or(&self.at);
        let e = ApiError::invalid_request(param, self.text.join(param));
        match self.code {
            None => e,
            Some(Code::Unsupported) => e.with_code("unsupported_parameter"),
            Some(Code::Unknown) => e.with_code("unknown_parameter"),
        }
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&serde_json::to_string(self).map_err(|_| fmt::Error)?)
    }
}

/// Reads `T` from a body, or the 400 naming the faulty field.
pub(super) fn typed<'de, T: Deserialize<'de>>(body: &'de Value) -> Result<T, ApiError> {
    nested(body).map_err(Fault::into_error)
}

/// Reads `T` from `v`; a fault's place is given from `v` down.
pub(super) fn nested<'de, T: Deserialize<'de>>(v: &'de Value) -> Result<T, Fault> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        // Every rule speaks in faults; anything else would be serde's own words, kept.
        let fault = serde_json::from_str::<Fault>(&inner).unwrap_or_else(|_| Fault::says(&["Invalid '", &format!("': {inner}.")]));
        match path.as_str() {
            "." => fault,
            p if p.starts_with('[') => fault.within(p),
            p => fault.within(&format!(".{p}")),
        }
    })
}

/// Reads a value with `rule`, for a type's own `Deserialize`.
pub(super) fn read<'de, D: Deserializer<'de>, T>(d: D, rule: impl FnOnce(&Value) -> Result<T, Fault>) -> Result<T, D::Error> {
    let v = Value::deserialize(d)?;
    rule(&v).map_err(de::Error::custom)
}

/// Reads an optional field with `rule`: `null` (clients send it for "not given") is `None`.
pub(super) fn optional<'de, D: Deserializer<'de>, T>(d: D, rule: impl FnOnce(&Value) -> Result<T, Fault>) -> Result<Option<T>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None => Ok(None),
        Some(v) => rule(&v).map(Some).map_err(de::Error::custom),
    }
}

/// `deserialize_with` functions for optional fields, each from its rule over the value.
macro_rules! rules {
    ($($(#[$doc:meta])* $name:ident -> $t:ty = $rule:expr;)*) => {$(
        $(#[$doc])*
        pub(super) fn $name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<$t>, D::Error> {
            optional(d, $rule)
        }
    )*};
}

rules! {
    /// A boolean.
    boolean -> bool = |v| v.as_bool().ok_or_else(|| Fault::type_error("a boolean", v));
    /// A string.
    string -> String = |v| v.as_str().map(str::to_owned).ok_or_else(|| Fault::type_error("a string", v));
    /// A token count: at least 1.
    positive -> u64 = positive_int;
    /// `n` or `best_of`: 1 to [`MAX_N`].
    choices -> u32 = |v| match int(v, 1)? {
        x if x as usize <= MAX_N => Ok(x as u32),
        _ => Err(Fault::range(&format!("a value in [1, {MAX_N}]"), v)),
    };
    /// `priority`: any integer (or whole decimal) in `i64`.
    priority -> i64 = |v| match v {
        Value::Number(n) => match whole(n) {
            Some(x) => i64::try_from(x).map_err(|_| Fault::range("an integer in the 64-bit range", v)),
            None => Err(Fault::type_error("an integer", v)),
        },
        _ => Err(Fault::type_error("an integer", v)),
    };
    /// `temperature`: `[0, MAX_TEMPERATURE]`.
    temperature -> f64 = |v| bounded(v, 0.0, MAX_TEMPERATURE);
    /// `top_p`: `(0, 1]`.
    top_p -> f64 = |v| match number(v)? {
        p if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(Fault::range("a value in (0, 1]", v)),
    };
    /// `min_p`: `[0, 1]`.
    unit -> f64 = |v| bounded(v, 0.0, 1.0);
    /// `presence_penalty`, `frequency_penalty`: `[-2, 2]`.
    penalty -> f64 = |v| bounded(v, -2.0, 2.0);
    /// `repetition_penalty`: `(0, 2]`.
    repetition_penalty -> f64 = |v| match number(v)? {
        r if r > 0.0 && r <= 2.0 => Ok(r),
        _ => Err(Fault::range("a value in (0, 2]", v)),
    };
    /// `top_k`: 0 or -1 (vLLM's "off") is no limit; larger ones saturate.
    top_k -> u32 = |v| match v.as_f64() {
        Some(-1.0) => Ok(0),
        _ => Ok(u32::try_from(int(v, 0)?).unwrap_or(u32::MAX)),
    };
    /// Any non-negative integer (or whole decimal). Integers past `u64::MAX` (which JSON
    /// parsing turns into floats) are folded into a `u64` deterministically, so the same
    /// seed still gives the same output.
    seed -> u64 = |v| {
        let Value::Number(n) = v else { return Err(Fault::type_error("an integer", v)) };
        match whole(n) {
            None => Err(Fault::type_error("an integer", v)),
            Some(x) if x < 0 => Err(Fault::range("a value >= 0", v)),
            Some(x) => Ok(u64::try_from(x).unwrap_or_else(|_| n.as_f64().map_or(u64::MAX, f64::to_bits))),
        }
    };
    /// `min_tokens`.
    min_tokens -> u32 = |v| u32::try_from(int(v, 0)?).map_err(|_| Fault::range("a value that fits the context", v));
    /// Up to [`MAX_TOKEN_LIST`] token ids.
    stop_token_ids -> Vec<u32> = |v| match v {
        Value::Array(ids) if ids.len() <= MAX_TOKEN_LIST => each(ids, token_id),
        Value::Array(_) => Err(Fault::says(&[&format!("At most {MAX_TOKEN_LIST} stop_token_ids.")])),
        v => Err(Fault::type_error("an array of token ids", v)),
    };
    /// Token ids (as strings, OpenAI's form) to a bias in [-100, 100], sorted by id.
    logit_bias -> Vec<(u32, f32)> = logit_bias_of;
    /// Chat `top_logprobs`: 0 to [`MAX_TOP_LOGPROBS`].
    top_logprobs -> u32 = |v| at_most(v, MAX_TOP_LOGPROBS);
    /// Text `logprobs`: 0 to [`MAX_TEXT_LOGPROBS`] alternatives.
    text_logprobs -> u32 = |v| at_most(v, MAX_TEXT_LOGPROBS);
    /// vLLM's rule: an empty salt is refused rather than silently made a scope of its own
    /// (leave the field out to share the tenant's cache).
    cache_salt -> String = |v| match v {
        Value::String(s) if s.is_empty() => {
            Err(Fault::says(&["cache_salt must be a non-empty string if provided; leave it out to share the tenant's cache."]))
        }
        Value::String(s) if s.len() <= MAX_CACHE_SALT => Ok(s.clone()),
        Value::String(s) => Err(Fault::says(&[&format!("cache_salt is {} bytes; the most is {MAX_CACHE_SALT}.", s.len())])),
        v => Err(Fault::type_error("a string", v)),
    };
    /// Only `["text"]` (any number of `"text"`).
    modalities -> Vec<String> = |v| match v {
        Value::Array(m) if m.iter().all(|x| x.as_str() == Some("text")) => Ok(vec!["text".to_owned(); m.len()]),
        _ => Err(Fault::says(&["Only the 'text' modality is supported."]).unsupported()),
    };
    /// Only `true` is refused: anything else asks for nothing.
    store -> bool = |v| match v {
        Value::Bool(true) => Err(Fault::says(&["Stored completions are not supported: this server keeps no completions."]).unsupported()),
        _ => Ok(false),
    };
    /// Only `auto` or `default`.
    service_tier -> String = |v| match v.as_str() {
        Some(t @ ("auto" | "default")) => Ok(t.to_owned()),
        _ => Err(Fault::says(&["Only the 'auto' and 'default' service tiers exist here."]).unsupported()),
    };
    /// An object of strings.
    metadata -> Value = |v| match v {
        Value::Object(m) if m.values().all(Value::is_string) => Ok(v.clone()),
        v => Err(Fault::type_error("an object of strings", v)),
    };
    /// An array (of values checked elsewhere).
    array -> Vec<Value> = |v| v.as_array().cloned().ok_or_else(|| Fault::type_error("an array", v));
}

/// Each item of `items` by `rule`, a fault placed at its index.
pub(super) fn each<T>(items: &[Value], rule: impl Fn(&Value) -> Result<T, Fault>) -> Result<Vec<T>, Fault> {
    items.iter().enumerate().map(|(i, v)| rule(v).map_err(|f| f.within(&format!("[{i}]")))).collect()
}

fn logit_bias_of(v: &Value) -> Result<Vec<(u32, f32)>, Fault> {
    let Value::Object(map) = v else { return Err(Fault::type_error("an object of token ids to numbers", v)) };
    if map.len() > MAX_TOKEN_LIST {
        return Err(Fault::says(&[&format!("At most {MAX_TOKEN_LIST} logit_bias entries.")]));
    }
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let at = format!(".{k}");
        let id: u32 = k.parse().map_err(|_| Fault::says(&[&format!("Invalid 'logit_bias': '{k}' is not a token id.")]).within(&at))?;
        let bias = bounded(b, -100.0, 100.0).map_err(|f| f.within(&at))?;
        out.push((id, bias as f32));
    }
    out.sort_unstable_by_key(|e| e.0);
    Ok(out)
}

pub(super) fn token_id(v: &Value) -> Result<u32, Fault> {
    u32::try_from(int(v, 0)?).map_err(|_| Fault::range("a token id", v))
}

fn at_most(v: &Value, max: u64) -> Result<u32, Fault> {
    match int(v, 0)? {
        x if x <= max => Ok(x as u32),
        _ => Err(Fault::range(&format!("a value in [0, {max}]"), v)),
    }
}

/// A JSON integer (or whole decimal) of at least 1 that fits a `usize`.
pub(super) fn positive_int(v: &Value) -> Result<u64, Fault> {
    let x = int(v, 1)?;
    match usize::try_from(x) {
        Ok(_) => Ok(x),
        Err(_) => Err(Fault::range(&format!("a value <= {}", usize::MAX), v)),
    }
}

/// A JSON integer (or whole decimal) `>= min`.
fn int(v: &Value, min: u64) -> Result<u64, Fault> {
    let Value::Number(n) = v else {
        return Err(Fault::type_error("an integer", v));
    };
    match whole(n) {
        None => Err(Fault::type_error("an integer", v)),
        Some(x) if x < i128::from(min) => Err(Fault::range(&format!("a value >= {min}"), v)),
        Some(x) => u64::try_from(x).map_err(|_| Fault::range(&format!("a value <= {}", u64::MAX), v)),
    }
}

/// A finite JSON number.
fn number(v: &Value) -> Result<f64, Fault> {
    match v.as_f64() {
        Some(x) if x.is_finite() => Ok(x),
        _ => Err(Fault::type_error("a number", v)),
    }
}

/// A number in `[lo, hi]`.
fn bounded(v: &Value, lo: f64, hi: f64) -> Result<f64, Fault> {
    let x = number(v)?;
    if !(lo..=hi).contains(&x) {
        return Err(Fault::range(&format!("a value in [{lo}, {hi}]"), v));
    }
    Ok(x)
}

/// The value of a JSON number that is a whole number, `4` and `4.0` alike (JSON Schema's
/// `integer` admits both, so clients generated from a schema may send either); `None` for a
/// fraction. Whole numbers past the `i128` range saturate, which keeps them out of range.
fn whole(n: &Number) -> Option<i128> {
    if let Some(x) = n.as_u64() {
        return Some(x.into());
    }
    if let Some(x) = n.as_i64() {
        return Some(x.into());
    }
    n.as_f64().filter(|f| f.is_finite() && f.fract() == 0.0).map(|f| f as i128)
}

/// How an error message names the type of a JSON value.
pub(super) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_f64() => "a decimal number",
        Value::Number(_) => "an integer",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
