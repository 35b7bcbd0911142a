//! The output constraint of a request: OpenAI's `response_format`, vLLM's `guided_json`,
//! `guided_regex`, `guided_choice` and `guided_grammar`, and vLLM's newer
//! `structured_outputs` object. At most one may be given; its grammar is compiled (and a
//! bad one refused with 400) before the request is queued.

use bulkhead_protocol::GrammarSpec;
use serde_json::Value;

use super::{CompletionOptions, field, type_error};
use crate::error::ApiError;

/// The grammar a body asks for and the field it came from.
pub(super) fn parse(o: &CompletionOptions) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
    match &o.guided_decoding_backend {
        None => {}
        Some(Value::String(b)) if matches!(b.as_str(), "auto" | "llguidance" | "guidance") => {}
        Some(Value::String(b)) => {
            return Err(ApiError::invalid_request(
                "guided_decoding_backend",
                format!("Unknown guided_decoding_backend '{b}': this server uses llguidance ('auto', 'llguidance' or 'guidance')."),
            ));
        }
        Some(v) => return Err(type_error("guided_decoding_backend", "a string", v)),
    }
    let mut found: Vec<(GrammarSpec, &'static str)> = Vec::new();
    if let Some(v) = &o.response_format
        && let Some(g) = response_format(v)?
    {
        found.push((g, "response_format"));
    }
    let vllm: [(&'static str, &Option<Value>, GrammarParser); 4] = [
        ("guided_json", &o.guided_json, json_schema),
        ("guided_regex", &o.guided_regex, regex),
        ("guided_choice", &o.guided_choice, choice),
        ("guided_grammar", &o.guided_grammar, lark),
    ];
    for (name, v, f) in vllm {
        if let Some(v) = v {
            found.push((f(v, name)?, name));
        }
    }
    if let Some(v) = &o.structured_outputs {
        let Value::Object(o) = v else { return Err(type_error("structured_outputs", "an object", v)) };
        let kinds: [(&'static str, GrammarParser); 4] = [("json", json_schema), ("regex", regex), ("choice", choice), ("grammar", lark)];
        for (name, f) in kinds {
            if let Some(v) = field(o, name) {
                found.push((f(v, &format!("structured_outputs.{name}"))?, "structured_outputs"));
            }
        }
        if let Some(Value::Bool(true)) = field(o, "json_object") {
            found.push((GrammarSpec::JsonObject, "structured_outputs"));
        }
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop()),
        _ => {
            let names: Vec<&str> = found.iter().map(|f| f.1).collect();
            Err(ApiError::invalid_request(found[1].1, format!("Only one output constraint may be given, but got {}.", names.join(", "))))
        }
    }
}

/// Reads one field's value (named by the `&str`) into a grammar.
type GrammarParser = fn(&Value, &str) -> Result<GrammarSpec, ApiError>;

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with
/// its `schema` (`strict` is accepted either way: the grammar always holds).
fn response_format(v: &Value) -> Result<Option<GrammarSpec>, ApiError> {
    let Value::Object(o) = v else { return Err(type_error("response_format", "an object", v)) };
    match field(o, "type") {
        Some(Value::String(t)) => match t.as_str() {
            "text" => Ok(None),
            "json_object" => Ok(Some(GrammarSpec::JsonObject)),
            "json_schema" => {
                let Some(Value::Object(js)) = field(o, "json_schema") else {
                    return Err(ApiError::invalid_request(
                        "response_format.json_schema",
                        "response_format of type 'json_schema' needs a 'json_schema' object.",
                    ));
                };
                if let Some(s) = field(js, "strict")
                    && !s.is_boolean()
                {
                    return Err(type_error("response_format.json_schema.strict", "a boolean", s));
                }
                match field(js, "schema") {
                    None => Ok(Some(GrammarSpec::JsonSchema("{}".into()))),
                    Some(s) => json_schema(s, "response_format.json_schema.schema").map(Some),
                }
            }
            other => Err(ApiError::invalid_request(
                "response_format.type",
                format!("Invalid value: '{other}'. Supported values are: 'text', 'json_object' and 'json_schema'."),
            )),
        },
        Some(v) => Err(type_error("response_format.type", "a string", v)),
        None => Err(ApiError::invalid_request("response_format.type", "Missing required parameter: 'response_format.type'.")),
    }
}

/// A JSON Schema: an object, or (vLLM accepts it) its JSON text.
fn json_schema(v: &Value, param: &str) -> Result<GrammarSpec, ApiError> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(GrammarSpec::JsonSchema(v.to_string())),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(GrammarSpec::JsonSchema(schema.to_string())),
            _ => Err(ApiError::invalid_request(param, format!("Invalid '{param}': the string is not a JSON Schema object."))),
        },
        v => Err(type_error(param, "a JSON Schema object", v)),
    }
}

fn regex(v: &Value, param: &str) -> Result<GrammarSpec, ApiError> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(GrammarSpec::Regex(s.clone())),
        Value::String(_) => Err(ApiError::invalid_request(param, format!("Invalid '{param}': empty regular expression."))),
        v => Err(type_error(param, "a string", v)),
    }
}

fn choice(v: &Value, param: &str) -> Result<GrammarSpec, ApiError> {
    let Value::Array(items) = v else { return Err(type_error(param, "an array of strings", v)) };
    if items.is_empty() {
        return Err(ApiError::invalid_request(param, format!("Invalid '{param}': empty array.")));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, c)| match c {
            Value::String(s) if !s.is_empty() => Ok(s.clone()),
            Value::String(_) => Err(ApiError::invalid_request(format!("{param}[{i}]"), format!("Invalid '{param}[{i}]': empty choice."))),
            v => Err(type_error(&format!("{param}[{i}]"), "a string", v)),
        })
        .collect::<Result<_, _>>()
        .map(GrammarSpec::Choice)
}

fn lark(v: &Value, param: &str) -> Result<GrammarSpec, ApiError> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Ok(GrammarSpec::Lark(s.clone())),
        Value::String(_) => Err(ApiError::invalid_request(param, format!("Invalid '{param}': empty grammar."))),
        v => Err(type_error(param, "a string (a Lark grammar)", v)),
    }
}
