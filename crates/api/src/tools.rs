//! Tool calling: the request's `tools` and `tool_choice`, how they reach the prompt, the
//! grammar that enforces `required` and a named function, and the parser that turns the
//! model's `<tool_call>` blocks back into `message.tool_calls` (whole, or delta by delta
//! while streaming).
//!
//! The call form is Hermes' (also Qwen's and what vLLM and llama.cpp fall back on):
//!
//! ```text
//! <tool_call>
//! {"name": "get_weather", "arguments": {"city": "Paris"}}
//! </tool_call>
//! ```
//!
//! A template that reads `tools` gets them there. One that does not (SmolLM2's) gets
//! [`DEFAULT_PREAMBLE`] with the functions' JSON in the system message; they are never
//! dropped.

use bulkhead_protocol::GrammarSpec;
use serde_json::{Map, Value, json};

use crate::error::ApiError;

/// Opens a call in the model's output.
pub const CALL_OPEN: &str = "<tool_call>";
/// Closes it.
pub const CALL_CLOSE: &str = "</tool_call>";

/// The tool instructions put into the system message for templates that do not read
/// `tools`. `{tools}` is replaced by one JSON line per function (OpenAI's `tools` entries).
pub const DEFAULT_PREAMBLE: &str = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n\
For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n\
<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model may not call tools: they are left out of the prompt, nothing is parsed.
    None,
    /// The model decides; calls in its output are parsed.
    Auto,
    /// The model must call at least one (enforced by a grammar).
    Required,
    /// The model must call this function (enforced by a grammar).
    Function(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// OpenAI's `tools` entries, as sent (`{"type": "function", "function": {...}}`).
    pub defs: Vec<Value>,
    /// What the model may or must do.
    pub choice: ToolChoice,
    /// Whether several calls may come in one answer.
    pub parallel: bool,
}

impl Tools {
    /// Whether several calls may come in one answer: `parallel_tool_calls`, except under a
    /// named function, which is one call (OpenAI's "call this function").
    pub fn parallel_calls(&self) -> bool {
        self.parallel && !matches!(self.choice, ToolChoice::Function(_))
    }

    /// Whether the model's output is parsed for calls.
    pub fn parses(&self) -> bool {
        !self.defs.is_empty() && self.choice != ToolChoice::None
    }

    /// The tools the prompt shows (none under `tool_choice: "none"`).
    pub fn in_prompt(&self) -> &[Value] {
        if self.choice == ToolChoice::None { &[] } else { &self.defs }
    }

    /// The grammar that enforces `required` or a named function, if the choice asks for one.
    pub fn grammar(&self) -> Option<GrammarSpec> {
        let fns: Vec<&Map<String, Value>> = self.defs.iter().filter_map(|d| d.get("function")?.as_object()).collect();
        let chosen: Vec<&Map<String, Value>> = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => fns,
            ToolChoice::Function(name) => fns.into_iter().filter(|f| f.get("name").and_then(Value::as_str) == Some(name)).collect(),
        };
        let calls: Vec<Value> = chosen
            .iter()
            .map(|f| {
                let params = f.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object"}));
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f.get("name").cloned().unwrap_or(Value::Null)}, "arguments": params},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = if calls.len() == 1 { calls[0].clone() } else { json!({"anyOf": calls}) };
        let repeat = if self.parallel_calls() { "+" } else { "" };
        Some(GrammarSpec::Lark(format!(
            "start: call{repeat}\ncall: {open} \"\\n\" body \"\\n\" {close} \"\\n\"?\nbody: %json {schema}\n",
            open = Value::String(CALL_OPEN.into()),
            close = Value::String(CALL_CLOSE.into()),
        )))
    }

    /// The system-message text that shows the tools to a template that does not read them.
    pub fn preamble(&self) -> String {
        let lines: Vec<String> = self.in_prompt().iter().map(Value::to_string).collect();
        DEFAULT_PREAMBLE.replace("{tools}", &lines.join("\n"))
    }
}

/// Parse `tools`, `tool_choice` and `parallel_tool_calls` from a chat body; `None` when it
/// names no tools (a `tool_choice` without tools is refused, as OpenAI does).
pub fn parse(obj: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    parse_fields(get("tools"), get("tool_choice"), get("parallel_tool_calls"))
}

/// [`parse`] from the three fields as read (each `None` when absent or `null`).
pub fn parse_fields(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel_tool_calls: Option<&Value>,
) -> Result<Option<Tools>, ApiError> {
    let defs = match tools {
        None => Vec::new(),
        Some(Value::Array(items)) => {
            for (i, t) in items.iter().enumerate() {
                check_tool(i, t)?;
            }
            items.clone()
        }
        Some(_) => return Err(ApiError::invalid_request("tools", "Invalid type for 'tools': expected an array of tools.")),
    };
    let names: Vec<&str> = defs.iter().filter_map(|d| d.pointer("/function/name")?.as_str()).collect();
    let choice = match tool_choice {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid_request(
                    "tool_choice",
                    format!(
                        "Invalid value: '{other}'. Supported values are: 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}."
                    ),
                ));
            }
        },
        Some(Value::Object(o)) => match o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) {
            Some(name) if o.get("type").and_then(Value::as_str) == Some("function") => {
                if !names.contains(&name) {
                    return Err(ApiError::invalid_request(
                        "tool_choice",
                        format!("tool_choice names the function '{name}', which is not among 'tools'."),
                    ));
                }
                ToolChoice::Function(name.to_owned())
            }
            _ => {
                return Err(ApiError::invalid_request(
                    "tool_choice",
                    "Invalid 'tool_choice': expected {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                ));
            }
        },
        Some(_) => return Err(ApiError::invalid_request("tool_choice", "Invalid type for 'tool_choice': expected a string or an object.")),
    };
    let parallel = match parallel_tool_calls {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ApiError::invalid_request("parallel_tool_calls", "Invalid type for 'parallel_tool_calls': expected a boolean."));
        }
    };
    if defs.is_empty() {
        if matches!(choice, ToolChoice::Required | ToolChoice::Function(_)) {
            return Err(ApiError::invalid_request("tool_choice", "tool_choice requires 'tools'."));
        }
        return Ok(None);
    }
    Ok(Some(Tools { defs, choice, parallel }))
}

fn check_tool(i: usize, t: &Value) -> Result<(), ApiError> {
    let p = format!("tools[{i}]");
    let bad = |what: &str| ApiError::invalid_request(p.clone(), format!("Invalid '{p}': {what}."));
    let o = t.as_object().ok_or_else(|| bad("expected an object"))?;
    if o.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("only tools of type 'function' are supported"));
    }
    let f = o.get("function").and_then(Value::as_object).ok_or_else(|| bad("'function' must be an object"))?;
    match f.get("name").and_then(Value::as_str) {
        Some(n) if !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') => {}
        _ => return Err(bad("'function.name' must be 1 to 64 letters, digits, '_' or '-'")),
    }
    match f.get("parameters") {
        None | Some(Value::Object(_)) => Ok(()),
        Some(_) => Err(bad("'function.parameters' must be a JSON Schema object")),
    }
}

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// `call_...`, unique within the response.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments, as a JSON text (OpenAI's form).
    pub arguments: String,
}

/// What a `<tool_call>` block holds, if it is a call.
fn call_of(body: &str, id: String) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_owned();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
        None => "{}".into(),
    };
    Some(ToolCall { id, name, arguments })
}

/// A piece of a streamed answer, once calls are told from text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Text for `content`.
    Text(String),
    /// A complete call.
    Call(ToolCall),
}

/// Splits an answer's text into content and calls as it arrives. Text that may be the start
/// of [`CALL_OPEN`] is held back until it is known not to be; a call is released when its
/// block closes. Without `parallel`, text after the first call is dropped, as the grammar
/// would have ended there.
#[derive(Debug)]
pub struct CallParser {
    buf: String,
    inside: bool,
    calls: usize,
    parallel: bool,
    id_prefix: String,
}

impl CallParser {
    /// A parser whose call ids start with `id_prefix`.
    pub fn new(parallel: bool, id_prefix: impl Into<String>) -> Self {
        CallParser { buf: String::new(), inside: false, calls: 0, parallel, id_prefix: id_prefix.into() }
    }

    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    fn next_id(&mut self) -> String {
        self.calls += 1;
        format!("{}{}", self.id_prefix, self.calls - 1)
    }

    fn done(&self) -> bool {
        self.calls > 0 && !self.parallel
    }

    /// Feed more text; what is known now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.done() {
            return out;
        }
        self.buf.push_str(text);
        loop {
            if self.inside {
                let Some(end) = self.buf.find(CALL_CLOSE) else { return out };
                let body: String = self.buf[..end].to_owned();
                self.buf.drain(..end + CALL_CLOSE.len());
                self.inside = false;
                let id = format!("{}{}", self.id_prefix, self.calls);
                match call_of(&body, id) {
                    Some(c) => {
                        self.calls += 1;
                        out.push(Piece::Call(c));
                        if self.done() {
                            self.buf.clear();
                            return out;
                        }
                    }
                    // Not a call after all: it stays text.
                    None => out.push(Piece::Text(format!("{CALL_OPEN}{body}{CALL_CLOSE}"))),
                }
                continue;
            }
            match self.buf.find(CALL_OPEN) {
                Some(start) => {
                    let before: String = self.buf.drain(..start).collect();
                    self.buf.drain(..CALL_OPEN.len());
                    self.inside = true;
                    push_text(&mut out, before);
                }
                None => {
                    // Keep back the longest tail that could still become the opening tag.
                    let keep = (1..CALL_OPEN.len()).rev().find(|&k| self.buf.ends_with(&CALL_OPEN[..k])).unwrap_or(0);
                    let cut = self.buf.len() - keep;
                    let text: String = self.buf.drain(..cut).collect();
                    push_text(&mut out, text);
                    return out;
                }
            }
        }
    }

    /// The end of the answer: whatever is held back. An unclosed block is a call if its text
    /// parses as one (the grammar may end without the closing newline); otherwise it is a
    /// call cut short (by `max_tokens`, a stop), dropped: neither a call nor content.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        if self.done() {
            return out;
        }
        if self.inside {
            self.inside = false;
            let id = format!("{}{}", self.id_prefix, self.calls);
            if let Some(c) = call_of(&rest, id) {
                self.next_id();
                out.push(Piece::Call(c));
            }
        } else {
            push_text(&mut out, rest);
        }
        out
    }
}

fn push_text(out: &mut Vec<Piece>, text: String) {
    if !text.is_empty() {
        out.push(Piece::Text(text));
    }
}

/// Split a whole answer into its content (text outside calls, trimmed; `None` when only
/// whitespace is left around calls) and its calls.
pub fn split(text: &str, parallel: bool, id_prefix: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut p = CallParser::new(parallel, id_prefix);
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in p.push(text).into_iter().chain(p.finish()) {
        match piece {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    if calls.is_empty() {
        return (Some(content), calls);
    }
    let trimmed = content.trim();
    ((!trimmed.is_empty()).then(|| trimmed.to_owned()), calls)
}

/// An assistant message's `tool_calls` as the model wrote them, for templates that do not
/// render `tool_calls` themselves.
pub fn render_calls(calls: &Value) -> String {
    let mut out = Vec::new();
    for c in calls.as_array().into_iter().flatten() {
        let f = c.get("function").unwrap_or(c);
        let args = match f.get("arguments") {
            Some(Value::String(s)) => serde_json::from_str::<Value>(s).unwrap_or_else(|_| Value::String(s.clone())),
            Some(v) => v.clone(),
            None => json!({}),
        };
        let call = json!({"name": f.get("name").cloned().unwrap_or(Value::Null), "arguments": args});
        out.push(format!("{CALL_OPEN}\n{call}\n{CALL_CLOSE}"));
    }
    out.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_answers_split_into_content_and_calls() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (content, calls) = split(text, true, "call_");
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(calls, vec![ToolCall { id: "call_0".into(), name: "get_weather".into(), arguments: "{\"city\":\"Paris\"}".into() }]);
        let (content, calls) = split("no call here <tool", true, "c");
        assert_eq!((content.as_deref(), calls.len()), (Some("no call here <tool"), 0));
        // A block that is not a call stays text.
        let (content, calls) = split("<tool_call>oops</tool_call>", true, "c");
        assert_eq!((content.as_deref(), calls.len()), (Some("<tool_call>oops</tool_call>"), 0));
        // A call cut short is neither a call nor content; one the grammar ended without its
        // closing tag is a call.
        let (content, calls) = split("Sure. <tool_call>\n{\"name\": \"get_wea", true, "c");
        assert_eq!((content.as_deref(), calls.len()), (Some("Sure. "), 0));
        let (content, calls) = split("<tool_call>{\"name\":\"a\",\"arguments\":{}}", true, "c");
        assert_eq!((content, calls.len()), (None, 1));
        // Without parallel calls only the first counts.
        let two = "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call><tool_call>{\"name\":\"b\",\"arguments\":{}}</tool_call>";
        assert_eq!(split(two, false, "c").1.len(), 1);
        assert_eq!(split(two, true, "c").1.len(), 2);
    }

    #[test]
    fn a_stream_split_anywhere_gives_the_same_pieces() {
        let text = "Hi <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call> bye";
        for cut in 0..=text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let mut p = CallParser::new(true, "c");
            let mut pieces = p.push(&text[..cut]);
            pieces.extend(p.push(&text[cut..]));
            pieces.extend(p.finish());
            let texts: String = pieces.iter().filter_map(|x| if let Piece::Text(t) = x { Some(t.as_str()) } else { None }).collect();
            let calls: Vec<&ToolCall> = pieces.iter().filter_map(|x| if let Piece::Call(c) = x { Some(c) } else { None }).collect();
            assert_eq!(texts, "Hi  bye", "cut at {cut}");
            assert_eq!(calls.len(), 1, "cut at {cut}");
            assert_eq!(calls[0].arguments, "{\"x\":1}");
        }
    }

    #[test]
    fn a_named_function_is_the_only_one_its_grammar_allows() {
        let body = json!({"tools": [
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}},
            {"type": "function", "function": {"name": "b"}}],
            "tool_choice": {"type": "function", "function": {"name": "b"}}});
        let t = parse(body.as_object().unwrap()).unwrap().unwrap();
        let Some(GrammarSpec::Lark(g)) = t.grammar() else { panic!("a grammar") };
        assert!(g.contains("\"const\":\"b\"") && !g.contains("\"const\":\"a\""), "{g}");
        let bad = json!({"tools": [], "tool_choice": "required"});
        assert_eq!(parse(bad.as_object().unwrap()).unwrap_err().param.as_deref(), Some("tool_choice"));
        let unknown = json!({"tools": [{"type": "function", "function": {"name": "a"}}], "tool_choice": {"type": "function", "function": {"name": "zz"}}});
        assert_eq!(parse(unknown.as_object().unwrap()).unwrap_err().param.as_deref(), Some("tool_choice"));
        let not_fn = json!({"tools": [{"type": "code_interpreter"}]});
        assert_eq!(parse(not_fn.as_object().unwrap()).unwrap_err().param.as_deref(), Some("tools[0]"));
    }
}
