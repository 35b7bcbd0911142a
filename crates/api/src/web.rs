//! The browser pages: a chat page at `/` and a live isolation dashboard at `/dashboard`,
//! plain HTML, CSS and JavaScript built into the binary (`crates/api/web/`), so they need no
//! network and no build step. Both run under a strict Content-Security-Policy (no inline
//! script or style, connections to this origin only); the chat page renders model output by
//! building DOM text nodes, never as HTML. The dashboard reads nothing but `/metrics`.

use axum::Router;
use axum::http::{HeaderName, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::routes::method_not_allowed;

/// The Content-Security-Policy of every page and asset: scripts, styles and connections from
/// this origin only, no inline script or style, no plugins, no framing, no forms posted away.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                                           img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

const CHAT_HTML: &str = include_str!("../web/index.html");
const DASHBOARD_HTML: &str = include_str!("../web/dashboard.html");
/// The chat page's script (public so tests can hold it to its rules).
pub const CHAT_JS: &str = include_str!("../web/chat.js");
/// The dashboard's script (public so tests can read the metrics it names).
pub const DASHBOARD_JS: &str = include_str!("../web/dashboard.js");
const STYLE_CSS: &str = include_str!("../web/style.css");

/// Every embedded file, by the path it is served at: for tests that check all of them.
pub const FILES: [(&str, &str); 5] = [
    ("/", CHAT_HTML),
    ("/dashboard", DASHBOARD_HTML),
    ("/ui/chat.js", CHAT_JS),
    ("/ui/dashboard.js", DASHBOARD_JS),
    ("/ui/style.css", STYLE_CSS),
];

/// The placeholder in the chat page's `<html data-auth=…>` that says whether to ask for a key.
const AUTH_PLACEHOLDER: &str = "data-auth=\"open\"";

/// The pages and their assets. `api_key_required`: the server has tenants, so the chat page
/// asks for an API key up front (it also asks after any 401).
pub fn router(api_key_required: bool) -> Router {
    let chat: &'static str = if api_key_required { chat_page_with_key() } else { CHAT_HTML };
    // Another method on a page path is 405 as an OpenAI error body, as on the API's paths.
    let file = |ct: &'static str, body: &'static str| get(move || async move { page(ct, body) }).fallback(method_not_allowed);
    Router::new()
        .route("/", file("text/html; charset=utf-8", chat))
        .route("/dashboard", file("text/html; charset=utf-8", DASHBOARD_HTML))
        .route("/ui/chat.js", file("text/javascript; charset=utf-8", CHAT_JS))
        .route("/ui/dashboard.js", file("text/javascript; charset=utf-8", DASHBOARD_JS))
        .route("/ui/style.css", file("text/css; charset=utf-8", STYLE_CSS))
}

/// The chat page marked to ask for an API key; built once and kept for the process's life.
fn chat_page_with_key() -> &'static str {
    static PAGE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PAGE.get_or_init(|| CHAT_HTML.replacen(AUTH_PLACEHOLDER, "data-auth=\"required\"", 1))
}

/// One embedded file with its type and the security headers every page carries.
fn page(content_type: &'static str, body: &'static str) -> Response {
    let headers: [(HeaderName, HeaderValue); 6] = [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        (header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY)),
        (header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff")),
        (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        (header::REFERRER_POLICY, HeaderValue::from_static("no-referrer")),
        // Served from the binary: a new binary's pages must replace the old at once.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
    ];
    (headers, body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_placeholder_is_in_the_page() {
        assert_eq!(CHAT_HTML.matches(AUTH_PLACEHOLDER).count(), 1);
        assert!(chat_page_with_key().contains("data-auth=\"required\""));
    }
}
