//! The colocated backend on the real default model, through the HTTP router.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use bulkhead_api::{Backend, ColocatedBackend, router};
use bulkhead_kv::KvChecks;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tower::ServiceExt;

async fn post_chat(app: axum::Router, body: Value) -> (StatusCode, Value) {
    let req =
        Request::post("/v1/chat/completions").header(header::CONTENT_TYPE, "application/json").body(Body::from(body.to_string())).unwrap();
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    (status, serde_json::from_slice(&bytes).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_colocated_backend_answers_paris_and_refuses_a_prompt_longer_than_the_context() {
    let path = bulkhead_fetch::ensure_default_model(false).expect("default model");
    let loaded = bulkhead_engine::load_model(&path, 2).expect("load the default model");
    let context = loaded.model.config.context_length;
    let backend = Arc::new(ColocatedBackend::new(loaded, "smollm2", context, 16, KvChecks::all()).expect("start the engine"));
    assert!(backend.ready());
    assert_eq!(backend.models()[0].max_model_len, context);
    let app = router(backend.clone());

    let (status, v) = post_chat(
        app.clone(),
        json!({
            "model": "smollm2",
            "messages": [
                { "role": "system", "content": "You are a helpful assistant." },
                { "role": "user", "content": "What is the capital of France?" },
            ],
            "temperature": 0,
            "max_tokens": 24,
        }),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(content.contains("Paris"), "{content:?}");
    assert_eq!(v["usage"]["prompt_tokens"], 27, "{v}");
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((1..=24).contains(&completion), "{v}");
    assert_eq!(v["usage"]["total_tokens"], 27 + completion);

    // A client that goes away mid-stream: the engine aborts its request.
    let req = Request::post("/v1/chat/completions")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(
            json!({
                "model": "smollm2",
                "messages": [{ "role": "user", "content": "Count from 1 to 1000, separated by commas." }],
                "max_tokens": 2000,
                "stream": true,
            })
            .to_string(),
        ))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut frames = resp.into_body().into_data_stream();
    for _ in 0..3 {
        let frame = frames.next().await.unwrap().unwrap();
        assert!(frame.starts_with(b"data: {"), "{frame:?}");
    }
    assert_eq!(backend.active_requests(), 1);
    drop(frames);
    let deadline = Instant::now() + Duration::from_secs(10);
    while backend.active_requests() > 0 {
        assert!(Instant::now() < deadline, "the engine did not drop the abandoned request");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(backend.aborted_requests(), 1, "it was aborted, not finished");

    let long = "hello ".repeat(9000);
    let (status, v) = post_chat(app, json!({ "model": "smollm2", "messages": [{ "role": "user", "content": long }] })).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(backend.ready(), "a refused request leaves the engine serving");
}
