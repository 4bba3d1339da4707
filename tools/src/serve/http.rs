//! The HTTP side of `deltafin serve`: routes, queueing with 429, JSON replies and
//! server-sent-event streams, and cancelling the generation of a client that went away. Each
//! connection runs on its own thread ([`wire`] frames its requests); only the generator touches
//! the model.

use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::Scope;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use deltafin_chat::reasoning::Delta;
use deltafin_inference::LayoutSource;
use serde_json::{json, Value};

use crate::serve::api::{self, ApiError, Endpoint};
use crate::serve::metrics::Metrics;
use crate::serve::wire::{Conn, HttpRequest, ReadError};
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
    /// Connections open now.
    pub connections: AtomicUsize,
}

/// Most connections served at once; more are answered 503 and closed.
const MAX_CONNECTIONS: usize = 256;
/// How often a request waiting on the generator checks that its client is still there.
const CLIENT_CHECK: Duration = Duration::from_millis(200);

/// Serve every connection on a thread of its own, for as long as the server runs.
pub(crate) fn accept<'scope>(
    listener: &'scope TcpListener,
    ctx: &'scope Ctx,
    scope: &'scope Scope<'scope, '_>,
) {
    for stream in listener.incoming() {
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                // Out of descriptors and the like: let connections finish, then go on.
                eprintln!("warning: accepting a connection: {e}");
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let mut conn = Conn::new(stream);
        if ctx.connections.fetch_add(1, Ordering::Relaxed) >= MAX_CONNECTIONS {
            ctx.connections.fetch_sub(1, Ordering::Relaxed);
            let e = ApiError {
                status: 503,
                kind: "server_error",
                param: None,
                message: format!("more than {MAX_CONNECTIONS} connections; retry later"),
            };
            let _ = conn.respond(503, JSON, &[], e.json().to_string().as_bytes(), false);
            continue;
        }
        scope.spawn(move || {
            serve_connection(conn, ctx);
            ctx.connections.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

const JSON: &str = "application/json";

fn serve_connection(mut conn: Conn, ctx: &Ctx) {
    loop {
        match conn.read_request(MAX_BODY_BYTES) {
            Ok(req) => {
                if !handle(&mut conn, req, ctx) {
                    return;
                }
            }
            Err(ReadError::Closed) => return,
            Err(ReadError::Refuse(status, message)) => {
                let e = ApiError {
                    status,
                    kind: "invalid_request_error",
                    param: None,
                    message,
                };
                respond_error(&mut conn, ctx, &e, false);
                conn.linger();
                return;
            }
        }
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

/// Write a JSON reply; false when the connection is unusable afterwards.
fn respond_json(conn: &mut Conn, status: u16, body: &Value, keep_alive: bool) -> bool {
    conn.respond(status, JSON, &[], body.to_string().as_bytes(), keep_alive)
        .is_ok()
        && keep_alive
}

fn respond_error(conn: &mut Conn, ctx: &Ctx, e: &ApiError, keep_alive: bool) -> bool {
    let counter = if e.status >= 500 {
        &ctx.metrics.server_errors
    } else {
        &ctx.metrics.client_errors
    };
    counter.fetch_add(1, Ordering::Relaxed);
    respond_json(conn, e.status, &e.json(), keep_alive)
}

/// Answer one request; false when the connection should close.
fn handle(conn: &mut Conn, req: HttpRequest, ctx: &Ctx) -> bool {
    let path = req.path.trim_end_matches('/');
    let keep = req.keep_alive;
    match (req.method.as_str(), path) {
        ("GET", "/health") => respond_json(conn, 200, &json!({"status": "ok"}), keep),
        ("GET", "/v1/models") => respond_json(
            conn,
            200,
            &json!({"object": "list", "data": [model_json(ctx)]}),
            keep,
        ),
        ("GET", p) if p.strip_prefix("/v1/models/") == Some(ctx.model.as_str()) => {
            respond_json(conn, 200, &model_json(ctx), keep)
        }
        ("GET", "/metrics") => {
            let text = ctx.metrics.render(ctx.layout.as_deref());
            conn.respond(200, "text/plain; version=0.0.4", &[], text.as_bytes(), keep)
                .is_ok()
                && keep
        }
        ("POST", "/v1/chat/completions") => generate(conn, &req, ctx, Endpoint::Chat),
        ("POST", "/v1/completions") => generate(conn, &req, ctx, Endpoint::Completions),
        (m, "/health" | "/v1/models" | "/metrics" | "/v1/chat/completions" | "/v1/completions") => {
            let e = ApiError {
                status: 405,
                kind: "invalid_request_error",
                param: None,
                message: format!("{m} is not allowed on {path}"),
            };
            respond_error(conn, ctx, &e, keep)
        }
        _ => {
            let e = ApiError {
                status: 404,
                kind: "invalid_request_error",
                param: None,
                message: format!("no route {} {path}", req.method),
            };
            respond_error(conn, ctx, &e, keep)
        }
    }
}

fn model_json(ctx: &Ctx) -> Value {
    json!({"id": ctx.model, "object": "model", "created": 0, "owned_by": "deltafin"})
}

/// Watches a job's client while its events come: every [`CLIENT_CHECK`] (whether events
/// arrive or not) it checks that the client is still there.
struct Watch<'a> {
    events: &'a Receiver<Event>,
    cancelled: &'a AtomicBool,
    last_check: Instant,
}

impl Watch<'_> {
    /// The next event; None when the client is gone (the job is then cancelled) or the
    /// generator dropped the job.
    fn next(&mut self, gone: &mut dyn FnMut() -> bool) -> Option<Event> {
        loop {
            if self.last_check.elapsed() >= CLIENT_CHECK {
                self.last_check = Instant::now();
                if gone() {
                    self.cancelled.store(true, Ordering::Relaxed);
                    return None;
                }
            }
            match self.events.recv_timeout(CLIENT_CHECK) {
                Ok(e) => return Some(e),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return None,
            }
        }
    }
}

fn generate(conn: &mut Conn, http: &HttpRequest, ctx: &Ctx, endpoint: Endpoint) -> bool {
    let keep = http.keep_alive;
    let req = match api::parse(endpoint, &http.body, &ctx.model, ctx.default_max_tokens) {
        Ok(r) => Arc::new(r),
        Err(e) => return respond_error(conn, ctx, &e, keep),
    };
    let (events_tx, events) = unbounded();
    let cancelled = Arc::new(AtomicBool::new(false));
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
            let retry = ((mean * waiting as f64).ceil() as u64).clamp(1, 3600);
            let body = e.json().to_string();
            return conn
                .respond(
                    429,
                    JSON,
                    &[("Retry-After", retry.to_string())],
                    body.as_bytes(),
                    keep,
                )
                .is_ok()
                && keep;
        }
        Err(TrySendError::Disconnected(_)) => {
            ctx.metrics.queued.fetch_sub(1, Ordering::Relaxed);
            let e = ApiError {
                status: 503,
                kind: "server_error",
                param: None,
                message: "the generator has stopped".into(),
            };
            return respond_error(conn, ctx, &e, false);
        }
    }
    let id = completion_id(endpoint);
    let created = now_s();
    let mut watch = Watch {
        events: &events,
        cancelled: &cancelled,
        last_check: Instant::now(),
    };
    if !req.stream {
        // Deltas are only for streams; wait for the end.
        loop {
            match watch.next(&mut || conn.client_gone()) {
                Some(Event::Done(Ok(reply))) => {
                    let body = api::reply_json(&req, &reply, &id, &ctx.model, created);
                    return respond_json(conn, 200, &body, keep);
                }
                Some(Event::Done(Err(e))) => return respond_error(conn, ctx, &e, keep),
                Some(_) => {}
                None if cancelled.load(Ordering::Relaxed) => return false,
                None => return respond_error(conn, ctx, &internal_gone(), false),
            }
        }
    }
    // A stream: errors found before generation starts (template, context) are plain JSON
    // errors with their status; after that, events.
    match watch.next(&mut || conn.client_gone()) {
        Some(Event::Started) => {}
        Some(Event::Done(Err(e))) => return respond_error(conn, ctx, &e, keep),
        None if cancelled.load(Ordering::Relaxed) => return false,
        Some(Event::Done(Ok(_)) | Event::Delta(_)) | None => {
            return respond_error(conn, ctx, &internal_gone(), false)
        }
    }
    let chunk = |delta: Value, finish: Option<&str>| {
        api::chunk_json(&req, &id, &ctx.model, created, delta, finish)
    };
    let Ok(mut sse) = conn.start_events(http.minor) else {
        cancelled.store(true, Ordering::Relaxed);
        return false;
    };
    let mut ok = true;
    if endpoint == Endpoint::Chat {
        ok = sse
            .data(&chunk(json!({"role": "assistant", "content": ""}), None).to_string())
            .is_ok();
    }
    while ok {
        let Some(event) = watch.next(&mut || sse.client_gone()) else {
            ok = false;
            break;
        };
        match event {
            Event::Started => {}
            Event::Delta(d) => {
                let delta = match d {
                    Delta::Content(t) => json!({"content": t}),
                    Delta::Reasoning(t) => json!({"reasoning_content": t}),
                };
                ok = sse.data(&chunk(delta, None).to_string()).is_ok();
            }
            Event::Done(Ok(reply)) => {
                let finish = api::finish_reason(&reply);
                ok = sse
                    .data(&chunk(json!({}), Some(finish)).to_string())
                    .is_ok();
                if ok && req.include_usage {
                    let mut u = chunk(json!({}), None);
                    u["choices"] = json!([]);
                    u["usage"] = api::usage(&reply);
                    ok = sse.data(&u.to_string()).is_ok();
                }
                break;
            }
            Event::Done(Err(e)) => {
                ok = sse.data(&e.json().to_string()).is_ok();
                break;
            }
        }
    }
    if ok {
        ok = sse.data("[DONE]").is_ok() && sse.finish().is_ok();
    }
    if !ok {
        // The client went away: stop its generation (the generator also sees its events
        // channel closed once `events` is dropped).
        cancelled.store(true, Ordering::Relaxed);
    }
    ok && keep && http.minor >= 1
}

fn internal_gone() -> ApiError {
    ApiError {
        status: 500,
        kind: "server_error",
        param: None,
        message: "the generation ended without a result".into(),
    }
}
