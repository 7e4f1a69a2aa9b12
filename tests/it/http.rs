//! A plain HTTP/1.1 client for the tests that talk to the daemons' HTTP endpoints.

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// Sends `method` to `http://{addr}{path}` with `body` (JSON when not empty); the status,
/// the content type and the body.
pub async fn request(method: &str, addr: &str, path: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let request = hyper::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::copy_from_slice(body)))
        .expect("a valid request");
    let response = client.request(request).await.expect("the server answers");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("a whole body")
        .to_bytes()
        .to_vec();
    (status, content_type, body)
}

/// GET `path`: status and body as text.
pub async fn get(addr: &str, path: &str) -> (u16, String) {
    let (status, _, body) = request("GET", addr, path, &[]).await;
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// POST `body` to `path`: status and body.
pub async fn post_json(addr: &str, path: &str, body: &[u8]) -> (u16, Vec<u8>) {
    let (status, _, body) = request("POST", addr, path, body).await;
    (status, body)
}
