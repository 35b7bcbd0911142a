//! The web UI's routes (`bulkhead_api::web`) in-process, and its embedded files held to
//! their rules: every page and asset under the Content-Security-Policy, unknown paths 404,
//! and no script that could turn model output into markup.

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use bulkhead_api::web::{self, CONTENT_SECURITY_POLICY, FILES};
use tower::ServiceExt;

/// The web routes beside a stand-in for the API's 404 fallback.
fn app(api_key_required: bool) -> Router {
    web::router(api_key_required).fallback(|| async { StatusCode::NOT_FOUND })
}

async fn get(app: Router, path: &str) -> (StatusCode, axum::http::HeaderMap, String) {
    let resp = app.oneshot(Request::get(path).body(Body::empty()).unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (parts.status, parts.headers, String::from_utf8(bytes.to_vec()).unwrap())
}

#[tokio::test]
async fn every_page_and_asset_is_served_under_the_csp() {
    for (path, _) in FILES {
        let (status, headers, body) = get(app(false), path).await;
        assert_eq!(status, StatusCode::OK, "{path}");
        assert_eq!(headers[header::CONTENT_SECURITY_POLICY], CONTENT_SECURITY_POLICY, "{path}");
        assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff", "{path}");
        assert_eq!(headers[header::X_FRAME_OPTIONS], "DENY", "{path}");
        let ct = headers[header::CONTENT_TYPE].to_str().unwrap();
        let want = match path.rsplit_once('.').map(|(_, ext)| ext) {
            Some("js") => "text/javascript",
            Some("css") => "text/css",
            _ => "text/html",
        };
        assert!(ct.starts_with(want), "{path}: {ct}");
        assert!(!body.is_empty(), "{path}");
    }
}

#[tokio::test]
async fn the_chat_page_asks_for_a_key_only_when_tenants_need_one() {
    let (_, _, open) = get(app(false), "/").await;
    assert!(open.contains("data-auth=\"open\"") && open.contains("/ui/chat.js"), "{open}");
    let (_, _, keyed) = get(app(true), "/").await;
    assert!(keyed.contains("data-auth=\"required\""), "{keyed}");
}

#[tokio::test]
async fn unknown_paths_are_not_the_chat_page() {
    for path in ["/index.html", "/chat", "/dashboard/", "/ui/", "/ui/nope.js", "/ui/../ui/chat.js.map", "/favicon.ico"] {
        let (status, _, body) = get(app(false), path).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
    }
}

#[tokio::test]
async fn other_methods_on_a_page_are_405_error_bodies() {
    let resp = app(false).oneshot(Request::post("/").body(Body::empty()).unwrap()).await.unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    assert!(String::from_utf8_lossy(&body).contains("method_not_allowed"), "{body:?}");
}

#[test]
fn the_csp_allows_no_inline_code_and_no_other_origin() {
    for directive in ["default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"] {
        assert!(CONTENT_SECURITY_POLICY.contains(directive), "{directive}");
    }
    assert!(!CONTENT_SECURITY_POLICY.contains("unsafe"), "{CONTENT_SECURITY_POLICY}");
}

/// The pages must work under the CSP and never render text as markup: no inline script or
/// style, no HTML-parsing sinks, nothing fetched from another origin.
#[test]
fn the_embedded_files_obey_the_rules_the_csp_and_the_renderer_rely_on() {
    let sinks = ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function", "setAttribute(\"on", "srcdoc"];
    for (path, text) in FILES {
        for sink in sinks {
            assert!(!text.contains(sink), "{path} uses {sink}");
        }
        for origin in ["http://", "https://", "//cdn", "@import"] {
            assert!(!text.contains(origin), "{path} names another origin ({origin})");
        }
        if path.ends_with(".js") || path.ends_with(".css") {
            continue;
        }
        // HTML: scripts only by src, styles only by link, no event-handler attributes.
        for (i, _) in text.match_indices("<script") {
            let tag = &text[i..i + text[i..].find('>').unwrap()];
            assert!(tag.contains(" src=\"/ui/"), "{path}: inline script {tag}");
        }
        assert!(!text.contains("<style") && !text.contains(" style="), "{path}: inline style");
        let lower = text.to_ascii_lowercase();
        for (i, _) in lower.match_indices(" on") {
            let name: String = lower[i + 3..].chars().take_while(char::is_ascii_alphabetic).collect();
            assert!(!lower[i + 3 + name.len()..].starts_with('='), "{path}: an event-handler attribute on{name}");
        }
    }
}

/// The renderer sets model text with textContent or text nodes only, and makes links only
/// to http(s).
#[test]
fn the_chat_script_builds_text_nodes_and_checks_link_schemes() {
    assert!(web::CHAT_JS.contains("createTextNode") && web::CHAT_JS.contains("textContent"));
    assert!(web::CHAT_JS.contains("url.protocol === \"http:\" || url.protocol === \"https:\""));
    // The API key lives in session storage, never local storage or a cookie.
    assert!(web::CHAT_JS.contains("sessionStorage") && !web::CHAT_JS.contains("localStorage") && !web::CHAT_JS.contains("document.cookie"));
}

/// The dashboard reads `/metrics` and nothing else: it cannot show a key, prompt or completion.
#[test]
fn the_dashboard_fetches_only_metrics() {
    let fetches: Vec<&str> = web::DASHBOARD_JS.match_indices("fetch(").map(|(i, _)| &web::DASHBOARD_JS[i..i + 28]).collect();
    // The public page, and the operator's page (the cache series) with the operator's key.
    assert_eq!(fetches, ["fetch(\"/metrics\", { cache: \"", "fetch(\"/metrics/tenants\", { "], "{fetches:?}");
    // The only thing it keeps is that key, for the tab's life; never a tenant's API key.
    let stores: Vec<&str> = web::DASHBOARD_JS.match_indices("Storage.").map(|(i, _)| &web::DASHBOARD_JS[i..i + 24]).collect();
    assert!(stores.iter().all(|s| s.contains("(ADMIN")), "{stores:?}");
    assert!(
        !web::DASHBOARD_JS.contains("localStorage")
            && !web::DASHBOARD_JS.contains("bulkhead.apiKey")
            && !web::DASHBOARD_JS.contains("/v1/")
    );
}
