//! The OpenAPI document: docs/openapi.json is what the code generates, the server serves it
//! at `/openapi.json`, and the request fields it documents are exactly those the parser reads.

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use bulkhead_api::openai::{Defaults, parse_chat, parse_completion};
use bulkhead_api::openapi::document;
use bulkhead_api::{ApiError, Backend, FinishReason, GenerationRequest, ModelCard, PromptEncoder, router};
use serde_json::{Value, json};
use tokio::sync::mpsc::Receiver;
use tower::ServiceExt;

const CHECKED_IN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
const REGENERATE: &str = "BULKHEAD_UPDATE_OPENAPI=1 cargo test -p bulkhead-api --test openapi";

fn generated() -> String {
    let mut s = serde_json::to_string_pretty(&document()).expect("the document serialises");
    s.push('\n');
    s
}

#[test]
fn checked_in_document_is_the_generated_one() {
    let want = generated();
    if std::env::var_os("BULKHEAD_UPDATE_OPENAPI").is_some_and(|v| v == "1") {
        std::fs::write(CHECKED_IN, &want).expect("write docs/openapi.json");
        return;
    }
    let have = std::fs::read_to_string(CHECKED_IN).unwrap_or_default();
    if have != want {
        let (n, (h, w)) = have
            .lines()
            .chain(std::iter::repeat("<end of file>"))
            .zip(want.lines().chain(std::iter::repeat("<end of file>")))
            .enumerate()
            .find(|(_, (h, w))| h != w)
            .unwrap_or((0, ("", "")));
        panic!(
            "docs/openapi.json is not what the code generates; first difference at line {}:\n  \
             checked in: {h}\n  generated:  {w}\nRegenerate it with:\n  {REGENERATE}",
            n + 1
        );
    }
}

/// A backend that serves nothing: enough to route `/openapi.json`.
struct NoBackend(PromptEncoder);

impl Backend for NoBackend {
    fn encoder(&self) -> &PromptEncoder {
        &self.0
    }
    fn models(&self) -> Vec<ModelCard> {
        Vec::new()
    }
    fn generate(&self, _: GenerationRequest) -> Result<Receiver<bulkhead_api::GenEvent>, ApiError> {
        Err(ApiError::overloaded("no backend"))
    }
    fn ready(&self) -> bool {
        true
    }
}

#[tokio::test]
async fn the_server_serves_the_document() {
    let req = Request::get("/openapi.json").body(Body::empty()).expect("request");
    let resp = router(Arc::new(NoBackend(bulkhead_api::testing::byte_level_encoder()))).oneshot(req).await.expect("response");
    assert_eq!(resp.status(), StatusCode::OK);
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX).await.expect("body");
    let served: Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(served, serde_json::to_value(document()).expect("document"));
    assert!(served["openapi"].as_str().is_some_and(|v| v.starts_with("3.")));
}

fn doc() -> Value {
    serde_json::to_value(document()).expect("document")
}

/// The properties of the component schema `name`, following `$ref` and `allOf`.
fn properties(doc: &Value, schema: &Value) -> BTreeSet<String> {
    if let Some(r) = schema["$ref"].as_str() {
        let name = r.trim_start_matches("#/components/schemas/");
        return properties(doc, &doc["components"]["schemas"][name]);
    }
    let mut out: BTreeSet<String> = schema["properties"].as_object().map(|p| p.keys().cloned().collect()).unwrap_or_default();
    for part in schema["allOf"].as_array().into_iter().flatten() {
        out.extend(properties(doc, part));
    }
    out
}

fn request_properties(name: &str) -> BTreeSet<String> {
    let d = doc();
    properties(&d, &json!({ "$ref": format!("#/components/schemas/{name}") }))
}

type Parser = fn(&Value, &Defaults) -> Result<bulkhead_api::openai::CompletionParams, ApiError>;

/// Each documented field, given a value of the wrong type on an otherwise valid body, is
/// refused naming that field: the parser reads every field the document promises.
#[test]
fn every_documented_request_field_is_one_the_parser_reads() {
    let cases: [(&str, Parser, Value); 2] = [
        ("ChatCompletionRequest", parse_chat, json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})),
        ("CompletionRequest", parse_completion, json!({"model": "m", "prompt": "hi"})),
    ];
    for (schema, parse, base) in cases {
        parse(&base, &Defaults::default()).unwrap_or_else(|e| panic!("{schema}: the base body is refused: {e}"));
        let props = request_properties(schema);
        assert!(props.len() > 5, "{schema}: {props:?}");
        for p in props {
            let refused = [json!(true), json!("x")].into_iter().any(|bad| {
                let mut body = base.clone();
                body[&p] = bad;
                parse(&body, &Defaults::default()).is_err_and(|e| e.param.as_deref() == Some(p.as_str()))
            });
            assert!(refused, "{schema}.{p} is documented but a wrong type is not refused naming it");
        }
    }
}

/// The other way round: the request types are the parser, so a field an endpoint's schema
/// does not document is refused by name, whether it is the other endpoint's (`prompt` on
/// chat, `messages` on text) or misspelt.
#[test]
fn every_field_the_parser_accepts_is_documented() {
    let chat = request_properties("ChatCompletionRequest");
    let text = request_properties("CompletionRequest");
    let cases: [(&str, Parser, Value, Vec<String>); 2] = [
        (
            "ChatCompletionRequest",
            parse_chat,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            text.difference(&chat).cloned().collect(),
        ),
        ("CompletionRequest", parse_completion, json!({"model": "m", "prompt": "hi"}), chat.difference(&text).cloned().collect()),
    ];
    for (schema, parse, base, others) in cases {
        assert!(!others.is_empty(), "{schema}: the endpoints document different fields");
        for p in others.into_iter().chain(["temprature".to_string(), "max_token".to_string()]) {
            let mut body = base.clone();
            body[&p] = json!(1);
            let e =
                parse(&body, &Defaults::default()).err().unwrap_or_else(|| panic!("{schema}: `{p}` is not documented but was accepted"));
            assert_eq!(e.param.as_deref(), Some(p.as_str()), "{schema}: `{p}` refused naming something else: {e}");
        }
    }
}

#[test]
fn finish_reason_schema_names_are_the_wire_names() {
    let names = &doc()["components"]["schemas"]["FinishReason"]["enum"];
    let want: Vec<&str> = [FinishReason::Stop, FinishReason::Length, FinishReason::Abort].iter().map(|r| r.as_str()).collect();
    assert_eq!(names, &json!(want));
}
