//! Request bodies parsed as JSON that names each key of an object once.
//!
//! `serde_json` keeps the last of two equal keys. A proxy or audit log that reads the first
//! (`"max_tokens":2,"max_tokens":100000`) would then see another request than the one
//! served, so a body with a repeated key is refused instead.

use serde::Deserializer;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::fmt;

/// Parse `bytes` as one JSON value; an object that repeats a key is an error naming it.
pub fn parse(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut d = serde_json::Deserializer::from_slice(bytes);
    let v = Strict.deserialize(&mut d)?;
    d.end()?;
    Ok(v)
}

/// Builds a [`Value`] like `Value`'s own `Deserialize`, but refuses repeated keys.
#[derive(Clone, Copy)]
struct Strict;

impl<'de> DeserializeSeed<'de> for Strict {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Strict {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, b: bool) -> Result<Value, E> {
        Ok(Value::Bool(b))
    }
    fn visit_i64<E>(self, n: i64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }
    fn visit_u64<E>(self, n: u64) -> Result<Value, E> {
        Ok(Value::Number(n.into()))
    }
    fn visit_f64<E>(self, n: f64) -> Result<Value, E> {
        // JSON text has no NaN or infinity, so this is always a number.
        Ok(Number::from_f64(n).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, s: &str) -> Result<Value, E> {
        Ok(Value::String(s.to_owned()))
    }
    fn visit_string<E>(self, s: String) -> Result<Value, E> {
        Ok(Value::String(s))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(v) = seq.next_element_seed(self)? {
            items.push(v);
        }
        Ok(Value::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                return Err(de::Error::custom(format_args!("the key '{key}' appears twice in one object")));
            }
            let v = map.next_value_seed(self)?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn values_parse_as_serde_json_parses_them() {
        let text = r#"{"a":[1,-2,3.5,"x",null,true,{"b":{}}],"c":18446744073709551615,"d":1e400}"#;
        let ours = parse(text.replace("1e400", "1e300").as_bytes()).unwrap();
        let theirs: Value = serde_json::from_str(&text.replace("1e400", "1e300")).unwrap();
        assert_eq!(ours, theirs);
        assert!(parse(text.as_bytes()).is_err(), "out of range, as serde_json");
        assert!(parse(b"{} x").is_err(), "trailing text");
    }

    #[test]
    fn a_repeated_key_is_refused_at_any_depth() {
        for text in [r#"{"max_tokens":2,"max_tokens":100000}"#, r#"{"m":[{"role":"a","role":"b"}]}"#] {
            let e = parse(text.as_bytes()).expect_err(text).to_string();
            assert!(e.contains("appears twice"), "{e}");
        }
        assert_eq!(parse(br#"{"a":{"k":1},"b":{"k":2}}"#).unwrap(), json!({"a":{"k":1},"b":{"k":2}}));
    }
}
