//! The review web page: a static shell and script that call the admin API with the
//! reviewer's own token. No server-side session, no cookies; the page is served with the
//! same security headers as the API (no framing, same-origin scripts only).

use axum::http::header;
use axum::response::IntoResponse;

const INDEX: &str = include_str!("../assets/index.html");
const SCRIPT: &str = include_str!("../assets/app.js");
const STYLE: &str = include_str!("../assets/app.css");

/// The review page.
#[utoipa::path(get, path = "/", security(()), responses((status = 200, description = "the review page (HTML)")))]
pub async fn index() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX)
}

/// The review page's script.
#[utoipa::path(get, path = "/app.js", security(()), responses((status = 200, description = "the review page's script")))]
pub async fn script() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/javascript; charset=utf-8")], SCRIPT)
}

/// The review page's style sheet.
#[utoipa::path(get, path = "/app.css", security(()), responses((status = 200, description = "the review page's styles")))]
pub async fn style() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/css; charset=utf-8")], STYLE)
}
