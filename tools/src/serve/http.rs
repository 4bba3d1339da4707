//! The HTTP side of `deltafin serve`: routes, request bodies (size-capped), queueing with 429,
//! JSON replies and server-sent-event streams. Each request runs on its own thread; only the
//! generator touches the model.

use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::Scope;
use std::time::{SystemTime, UNIX_EPOCH};

use crossbeam_channel::{unbounded, Sender, TrySendError};
use deltafin_chat::reasoning::Delta;
use deltafin_inference::LayoutSource;
use serde_json::{json, Value};
use tiny_http::{Header, Method, Request, Response, Server};

use crate::serve::api::{self, ApiError, Endpoint};
use crate::serve::metrics::Metrics;
use crate::serve::{Event, Job};

/// Largest request body accepted (a long conversation with tools fits many times over).
pub(crate) const MAX_BODY_BYTES: usize = 16 << 20;

/// What every request thread shares.
pub(crate) struct Ctx {
    pub model: String,
    pub jobs: Sender<Job>,
    pub metrics: Arc<Metrics>,
    pub default_max_tokens: usize,
    pub layout: Option<Arc<LayoutSource>>,
}

/// Hand every incoming request to a thread of its own, for as long as the server runs.
pub(crate) fn accept<'scope>(
    server: &'scope Server,
    ctx: &'scope Ctx,
    scope: &'scope Scope<'scope, '_>,
) {
    for request in server.incoming_requests() {
        scope.spawn(move || handle(request, ctx));
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A new completion id.
fn completion_id(endpoint: Endpoint) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    format!("{prefix}-{:x}{n:06x}", now_s())
}

fn header(name: &str, value: &str) -> Header {
    // Names and values here are ASCII constants or numbers, which always make a header.
    Header::from_bytes(name.as_bytes(), value.as_bytes())
        .unwrap_or_else(|_| Header::from_bytes(&b"X-Invalid"[..], &b"1"[..]).expect("ASCII header"))
}

fn respond_json(request: Request, status: u16, body: &Value) {
    let response = Response::from_string(body.to_string())
        .with_status_code(status)
        .with_header(header("Content-Type", "application/json"));
    // A client that went away needs no answer.
    let _ = request.respond(response);
}

fn respond_error(request: Request, ctx: &Ctx, e: &ApiError) {
    let counter = if e.status >= 500 {
        &ctx.metrics.server_errors
    } else {
        &ctx.metrics.client_errors
    };
    counter.fetch_add(1, Ordering::Relaxed);
    respond_json(request, e.status, &e.json());
}

fn handle(mut request: Request, ctx: &Ctx) {
    let path = request
        .url()
        .split('?')
        .next()
        .unwrap_or("")
        .trim_end_matches('/')
        .to_string();
    let method = request.method().clone();
    match (method, path.as_str()) {
        (Method::Get, "/health") => respond_json(request, 200, &json!({"status": "ok"})),
        (Method::Get, "/v1/models") => {
            let body = json!({"object": "list", "data": [model_json(ctx)]});
            respond_json(request, 200, &body)
        }
        (Method::Get, p) if p.strip_prefix("/v1/models/") == Some(ctx.model.as_str()) => {
            respond_json(request, 200, &model_json(ctx))
        }
        (Method::Get, "/metrics") => {
            let text = ctx.metrics.render(ctx.layout.as_deref());
            let response = Response::from_string(text)
                .with_header(header("Content-Type", "text/plain; version=0.0.4"));
            let _ = request.respond(response);
        }
        (Method::Post, "/v1/chat/completions") => generate(request, ctx, Endpoint::Chat),
        (Method::Post, "/v1/completions") => generate(request, ctx, Endpoint::Completions),
        (_, "/health" | "/v1/models" | "/metrics" | "/v1/chat/completions" | "/v1/completions") => {
            let e = ApiError {
                status: 405,
                kind: "invalid_request_error",
                param: None,
                message: format!("{} is not allowed on {path}", request.method()),
            };
            respond_error(request, ctx, &e)
        }
        _ => {
            // Drain a small body so the connection stays usable.
            let _ = std::io::copy(&mut request.as_reader().take(1 << 16), &mut std::io::sink());
            let e = ApiError {
                status: 404,
                kind: "invalid_request_error",
                param: None,
                message: format!("no route {path}"),
            };
            respond_error(request, ctx, &e)
        }
    }
}

fn model_json(ctx: &Ctx) -> Value {
    json!({"id": ctx.model, "object": "model", "created": 0, "owned_by": "deltafin"})
}

/// Read the body, at most [`MAX_BODY_BYTES`].
fn read_body(request: &mut Request) -> Result<Vec<u8>, ApiError> {
    let too_big = || ApiError {
        status: 413,
        kind: "invalid_request_error",
        param: None,
        message: format!("the request body is over {MAX_BODY_BYTES} bytes"),
    };
    if request.body_length().is_some_and(|n| n > MAX_BODY_BYTES) {
        return Err(too_big());
    }
    let mut body = Vec::new();
    request
        .as_reader()
        .take(MAX_BODY_BYTES as u64 + 1)
        .read_to_end(&mut body)
        .map_err(|e| ApiError::bad("body", format!("reading the body: {e}")))?;
    if body.len() > MAX_BODY_BYTES {
        return Err(too_big());
    }
    Ok(body)
}

fn generate(mut request: Request, ctx: &Ctx, endpoint: Endpoint) {
    let req = match read_body(&mut request)
        .and_then(|b| api::parse(endpoint, &b, &ctx.model, ctx.default_max_tokens))
    {
        Ok(r) => r,
        Err(e) => return respond_error(request, ctx, &e),
    };
    let (events_tx, events) = unbounded();
    let cancelled = Arc::new(AtomicBool::new(false));
    let stream = req.stream;
    let req = Arc::new(req);
    ctx.metrics.queued.fetch_add(1, Ordering::Relaxed);
    let job = Job {
        req: req.clone(),
        events: events_tx,
        cancelled: cancelled.clone(),
    };
    match ctx.jobs.try_send(job) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            let waiting = ctx.metrics.queued.fetch_sub(1, Ordering::Relaxed);
            ctx.metrics.rejected.fetch_add(1, Ordering::Relaxed);
            let e = ApiError {
                status: 429,
                kind: "rate_limit_error",
                param: None,
                message: format!("the server is busy ({waiting} requests waiting); retry later"),
            };
            // Wait for the queue ahead to drain, at the mean generation time seen so far.
            let mean = ctx.metrics.mean_generation_s().unwrap_or(1.0);
            let retry = ((mean * waiting as f64).ceil() as u64).clamp(1, 3600).to_string();
            let response = Response::from_string(e.json().to_string())
                .with_status_code(429)
                .with_header(header("Content-Type", "application/json"))
                .with_header(header("Retry-After", &retry));
            let _ = request.respond(response);
            return;
        }
        Err(TrySendError::Disconnected(_)) => {
            ctx.metrics.queued.fetch_sub(1, Ordering::Relaxed);
            let e = ApiError {
                status: 503,
                kind: "server_error",
                param: None,
                message: "the generator has stopped".into(),
            };
            return respond_error(request, ctx, &e);
        }
    }
    let id = completion_id(endpoint);
    let created = now_s();
    if !stream {
        // Deltas are only for streams; wait for the end.
        let done = events.iter().find_map(|e| match e {
            Event::Done(r) => Some(r),
            _ => None,
        });
        match done {
            Some(Ok(reply)) => {
                let body = api::reply_json(&req, &reply, &id, &ctx.model, created);
                respond_json(request, 200, &body)
            }
            Some(Err(e)) => respond_error(request, ctx, &e),
            None => respond_error(request, ctx, &internal_gone()),
        }
        return;
    }
    // A stream: errors found before generation starts (template, context) are plain JSON
    // errors with their status; after that, events.
    let mut first = events.recv().ok();
    match first.take() {
        Some(Event::Started) => {}
        Some(Event::Done(Err(e))) => return respond_error(request, ctx, &e),
        Some(Event::Done(Ok(_)) | Event::Delta(_)) | None => {
            return respond_error(request, ctx, &internal_gone())
        }
    }
    let chunked = request.http_version() >= &tiny_http::HTTPVersion(1, 1);
    let mut sse = SseWriter {
        out: request.into_writer(),
        chunked,
    };
    let head = if chunked {
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
         Transfer-Encoding: chunked\r\n\r\n"
    } else {
        "HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n\
         Connection: close\r\n\r\n"
    };
    let chunk = |delta: Value, finish: Option<&str>| {
        api::chunk_json(&req, &id, &ctx.model, created, delta, finish)
    };
    let mut ok = sse.raw(head.as_bytes()).is_ok();
    if ok && endpoint == Endpoint::Chat {
        ok = sse
            .event(&chunk(json!({"role": "assistant", "content": ""}), None))
            .is_ok();
    }
    for event in events.iter() {
        if !ok {
            break;
        }
        match event {
            Event::Started => {}
            Event::Delta(d) => {
                let delta = match d {
                    Delta::Content(t) => json!({"content": t}),
                    Delta::Reasoning(t) => json!({"reasoning_content": t}),
                };
                ok = sse.event(&chunk(delta, None)).is_ok();
            }
            Event::Done(Ok(reply)) => {
                let finish = api::finish_reason(&reply);
                ok = sse.event(&chunk(json!({}), Some(finish))).is_ok();
                if ok && req.include_usage {
                    let mut u = chunk(json!({}), None);
                    u["choices"] = json!([]);
                    u["usage"] = api::usage(&reply);
                    ok = sse.event(&u).is_ok();
                }
                break;
            }
            Event::Done(Err(e)) => {
                ok = sse.event(&e.json()).is_ok();
                break;
            }
        }
    }
    if ok {
        ok = sse.raw(b"data: [DONE]\n\n").is_ok() && sse.end().is_ok();
    }
    if !ok {
        // The client went away: stop its generation (the generator also sees its events
        // channel closed once `events` is dropped).
        cancelled.store(true, Ordering::Relaxed);
    }
}

fn internal_gone() -> ApiError {
    ApiError {
        status: 500,
        kind: "server_error",
        param: None,
        message: "the generation ended without a result".into(),
    }
}

/// Server-sent events over the raw connection, chunk-encoded on HTTP/1.1 so the connection
/// stays usable afterwards, flushed after every event so tokens reach the client as they come.
struct SseWriter {
    out: Box<dyn Write + Send>,
    chunked: bool,
}

impl SseWriter {
    fn raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        if self.chunked && !bytes.starts_with(b"HTTP/") {
            write!(self.out, "{:x}\r\n", bytes.len())?;
            self.out.write_all(bytes)?;
            self.out.write_all(b"\r\n")?;
        } else {
            self.out.write_all(bytes)?;
        }
        self.out.flush()
    }

    fn event(&mut self, v: &Value) -> std::io::Result<()> {
        self.raw(format!("data: {v}\n\n").as_bytes())
    }

    fn end(&mut self) -> std::io::Result<()> {
        if self.chunked {
            self.out.write_all(b"0\r\n\r\n")?;
        }
        self.out.flush()
    }
}
