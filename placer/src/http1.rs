//! A minimal HTTP/1.1 client: one request per connection over plain TCP.
//!
//! The extender needs exactly one outgoing call, the pod Binding, to a
//! Kubernetes API reached through a local `kubectl proxy` (plain HTTP on
//! loopback, authentication done by the proxy). One request per connection
//! with `Connection: close` keeps this small enough to read in one sitting.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Longest a request may take, connect to last byte.
const TIMEOUT: Duration = Duration::from_secs(10);
/// Largest response read.
const MAX_RESPONSE: usize = 4 << 20;

/// A failed request, with what happened.
#[derive(Debug, thiserror::Error)]
#[error("{method} http://{addr}{path}: {reason}")]
pub struct HttpError {
    pub method: &'static str,
    pub addr: String,
    pub path: String,
    pub reason: String,
}

/// POSTs `body` (JSON) to `http://{addr}{path}`; returns the status code and body.
pub async fn post_json(addr: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>), HttpError> {
    request("POST", addr, path, body).await
}

/// GETs `http://{addr}{path}`; returns the status code and body.
pub async fn get(addr: &str, path: &str) -> Result<(u16, Vec<u8>), HttpError> {
    request("GET", addr, path, &[]).await
}

async fn request(
    method: &'static str,
    addr: &str,
    path: &str,
    body: &[u8],
) -> Result<(u16, Vec<u8>), HttpError> {
    let fail = |reason: String| HttpError {
        method,
        addr: addr.to_owned(),
        path: path.to_owned(),
        reason,
    };
    let exchange = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| fail(format!("connect: {e}")))?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Accept: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream
            .write_all(head.as_bytes())
            .await
            .map_err(|e| fail(format!("write: {e}")))?;
        stream
            .write_all(body)
            .await
            .map_err(|e| fail(format!("write: {e}")))?;
        let mut response = Vec::new();
        (&mut stream)
            .take(MAX_RESPONSE as u64)
            .read_to_end(&mut response)
            .await
            .map_err(|e| fail(format!("read: {e}")))?;
        parse_response(&response).map_err(|reason| fail(reason.to_owned()))
    };
    tokio::time::timeout(TIMEOUT, exchange)
        .await
        .map_err(|_| fail(format!("no answer within {TIMEOUT:?}")))?
}

/// Splits a whole `Connection: close` response into status and body (plain or chunked).
fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>), &'static str> {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("response has no header end")?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|_| "response header is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or("malformed status line")?;
    let chunked = lines.any(|l| {
        let l = l.to_ascii_lowercase();
        l.starts_with("transfer-encoding:") && l.contains("chunked")
    });
    let mut body = &raw[split + 4..];
    if !chunked {
        return Ok((status, body.to_vec()));
    }
    let mut out = Vec::new();
    loop {
        let line_end = body
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("truncated chunk size")?;
        let size_text = std::str::from_utf8(&body[..line_end]).map_err(|_| "bad chunk size")?;
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| "bad chunk size")?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Ok((status, out));
        }
        if body.len() < size {
            return Err("truncated chunk");
        }
        out.extend_from_slice(&body[..size]);
        body = body.get(size + 2..).ok_or("truncated chunk")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_bodies() {
        let plain = b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\n{}";
        assert_eq!(parse_response(plain), Ok((201, b"{}".to_vec())));
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked), Ok((200, b"abcde".to_vec())));
        assert!(parse_response(b"garbage").is_err());
    }
}
