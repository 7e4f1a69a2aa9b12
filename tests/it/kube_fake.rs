//! A stand-in for the Kubernetes API server at the HTTP level (the one thing these
//! tests cannot run for real): pods to read and annotate, a `binding` subresource
//! that records every Binding and answers as the test scripts it, and an `eviction`
//! subresource that records every Eviction and answers with the codes the test
//! scripts (201 when none is left), leaving the pod as it is.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

/// How the fake answers a Binding.
#[derive(Clone, Copy, Debug)]
pub enum BindAnswer {
    /// 201: the pod is bound.
    Create,
    /// A definite refusal (e.g. 403 Forbidden); nothing changes.
    Refuse(u16),
    /// The Binding takes effect, but the answer comes only after this long.
    ApplyThenStall(Duration),
    /// 500 without binding: the outcome looks unknown to the client.
    FailUnapplied,
}

#[derive(Debug)]
struct Inner {
    pods: HashMap<String, Value>,
    bindings: Vec<(String, Value)>,
    patches: Vec<(String, Value)>,
    /// "METHOD PATH" of every request that reached the fake.
    requests: Vec<String>,
    answer: BindAnswer,
    evictions: Vec<(String, Value)>,
    /// HTTP codes of the next Evictions' answers, in order; 201 once empty.
    eviction_answers: VecDeque<u16>,
}

/// The fake API server and what it recorded.
#[derive(Clone, Debug)]
pub struct FakeKube {
    inner: Arc<Mutex<Inner>>,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

fn status(code: u16, reason: &str, message: &str) -> Response {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code});
    (
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Json(body),
    )
        .into_response()
}

type Shared = Arc<Mutex<Inner>>;

fn key(ns: &str, name: &str) -> String {
    format!("{ns}/{name}")
}

async fn get_pod(
    State(inner): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
) -> Response {
    let pod = inner
        .lock()
        .expect("lock")
        .pods
        .get(&key(&ns, &name))
        .cloned();
    match pod {
        Some(pod) => Json(pod).into_response(),
        None => status(404, "NotFound", &format!("pods \"{name}\" not found")),
    }
}

async fn patch_pod(
    State(inner): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let patch: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut inner = inner.lock().expect("lock");
    inner.patches.push((key(&ns, &name), patch.clone()));
    let Some(pod) = inner.pods.get_mut(&key(&ns, &name)) else {
        return status(404, "NotFound", &format!("pods \"{name}\" not found"));
    };
    if let Some(annotations) = patch["metadata"]["annotations"].as_object() {
        let target = &mut pod["metadata"]["annotations"];
        if !target.is_object() {
            *target = json!({});
        }
        for (k, v) in annotations {
            target[k] = v.clone();
        }
    }
    Json(pod.clone()).into_response()
}

async fn post_binding(
    State(inner): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let binding: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let answer = {
        let mut inner = inner.lock().expect("lock");
        inner.bindings.push((key(&ns, &name), binding.clone()));
        let answer = inner.answer;
        let applies = matches!(answer, BindAnswer::Create | BindAnswer::ApplyThenStall(_));
        if applies && let Some(pod) = inner.pods.get_mut(&key(&ns, &name)) {
            if pod["spec"]["nodeName"]
                .as_str()
                .is_some_and(|n| !n.is_empty())
            {
                return status(409, "Conflict", "pod is already assigned to a node");
            }
            pod["spec"]["nodeName"] = binding["target"]["name"].clone();
        }
        answer
    };
    match answer {
        BindAnswer::Create => (
            StatusCode::CREATED,
            Json(json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201})),
        )
            .into_response(),
        BindAnswer::Refuse(code) => status(code, "Forbidden", "cannot create pods/binding"),
        BindAnswer::ApplyThenStall(delay) => {
            tokio::time::sleep(delay).await;
            (
                StatusCode::CREATED,
                Json(json!({"kind": "Status", "code": 201})),
            )
                .into_response()
        }
        BindAnswer::FailUnapplied => status(500, "InternalError", "etcdserver: request timed out"),
    }
}

async fn post_eviction(
    State(inner): State<Shared>,
    Path((ns, name)): Path<(String, String)>,
    body: Bytes,
) -> Response {
    let eviction: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let mut inner = inner.lock().expect("lock");
    inner.evictions.push((key(&ns, &name), eviction));
    if !inner.pods.contains_key(&key(&ns, &name)) {
        return status(404, "NotFound", &format!("pods \"{name}\" not found"));
    }
    match inner.eviction_answers.pop_front().unwrap_or(201) {
        201 => (
            StatusCode::CREATED,
            Json(json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "code": 201})),
        )
            .into_response(),
        429 => status(
            429,
            "TooManyRequests",
            "Cannot evict pod as it would violate the pod's disruption budget.",
        ),
        code => status(code, "InternalError", "scripted failure"),
    }
}

/// Notes every request, whether a route matches it or not.
async fn record(
    State(inner): State<Shared>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let line = format!("{} {}", request.method(), request.uri().path());
    inner.lock().expect("lock").requests.push(line);
    next.run(request).await
}

impl FakeKube {
    /// Starts the fake on a free loopback port.
    pub async fn start() -> FakeKube {
        let inner = Arc::new(Mutex::new(Inner {
            pods: HashMap::new(),
            bindings: Vec::new(),
            patches: Vec::new(),
            requests: Vec::new(),
            answer: BindAnswer::Create,
            evictions: Vec::new(),
            eviction_answers: VecDeque::new(),
        }));
        let app = axum::Router::new()
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}",
                axum::routing::get(get_pod).patch(patch_pod),
            )
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}/binding",
                axum::routing::post(post_binding),
            )
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}/eviction",
                axum::routing::post(post_eviction),
            )
            .layer(axum::middleware::from_fn_with_state(inner.clone(), record))
            .with_state(inner.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the fake API server");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        tokio::spawn(async move { axum::serve(listener, app).await });
        FakeKube { inner, url }
    }

    /// Creates (or replaces) a pod, as `kubectl apply` would.
    pub fn add_pod(&self, pod: &Value) {
        let ns = pod["metadata"]["namespace"].as_str().unwrap_or("default");
        let name = pod["metadata"]["name"].as_str().expect("a named pod");
        let mut stored = pod.clone();
        stored["apiVersion"] = json!("v1");
        stored["kind"] = json!("Pod");
        self.inner
            .lock()
            .expect("lock")
            .pods
            .insert(key(ns, name), stored);
    }

    /// Scripts the answer to the next Bindings.
    pub fn answer_bindings(&self, answer: BindAnswer) {
        self.inner.lock().expect("lock").answer = answer;
    }

    /// Every Binding posted: (namespace/name, body).
    pub fn bindings(&self) -> Vec<(String, Value)> {
        self.inner.lock().expect("lock").bindings.clone()
    }

    /// Scripts the HTTP codes of the next Evictions' answers (201, 429, 500, ...).
    pub fn answer_evictions(&self, codes: &[u16]) {
        self.inner
            .lock()
            .expect("lock")
            .eviction_answers
            .extend(codes);
    }

    /// Every Eviction posted: (namespace/name, body).
    pub fn evictions(&self) -> Vec<(String, Value)> {
        self.inner.lock().expect("lock").evictions.clone()
    }

    /// "METHOD PATH" of every request received, in order.
    pub fn requests(&self) -> Vec<String> {
        self.inner.lock().expect("lock").requests.clone()
    }

    /// The pod as the fake has it now.
    pub fn pod(&self, ns: &str, name: &str) -> Value {
        self.inner.lock().expect("lock").pods[&key(ns, name)].clone()
    }
}
