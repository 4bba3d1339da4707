//! `deltafin serve`: an OpenAI-compatible HTTP server (`POST /v1/chat/completions`,
//! `POST /v1/completions`, `GET /v1/models`, `GET /health`, `GET /metrics`) over one model.
//!
//! Threads: an accept loop hands each request to its own thread ([`http`]); generation runs on
//! this one, one request at a time, fed by a bounded queue (full: 429 with `Retry-After`).
//! Streamed replies are server-sent events written as tokens land; a client that goes away
//! makes the next write fail, and its generation stops. Conversation states are kept between
//! requests ([`crate::conversation::cache`]), so a follow-up turn prefills only its new tokens.

pub(crate) mod api;
mod http;
mod metrics;
mod wire;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use crossbeam_channel::{bounded, Receiver, Sender};
use deltafin_chat::reasoning::Delta;

use crate::conversation::{Engine, Reply};
use crate::generate::args::SourceArgs;
use crate::generate::loaded::load;
use crate::serve::api::{ApiError, Endpoint, GenRequest};
use crate::serve::metrics::Metrics;
use crate::util::parse_size;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The name clients ask for (`model` in requests); default: the model folder's name.
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// A chat template file to use instead of the model's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Requests waiting for the generator at most; more get 429.
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// Positions a conversation may reach (prompt + reply); default: the model's context, at
    /// most 8192. The RAM budget reserves state for this many positions twice: the running
    /// conversation and the kept ones.
    #[arg(long)]
    pub context: Option<usize>,
    /// `max_tokens` when a request gives none.
    #[arg(long, default_value_t = 256)]
    pub default_max_tokens: usize,
    /// Keep conversation states here as crash-safe snapshots too (found again after a restart).
    #[arg(long)]
    pub snapshot_dir: Option<PathBuf>,
    /// Memory for kept conversation states (default: what the budget reserved for them).
    #[arg(long, value_parser = parse_size)]
    pub session_memory: Option<u64>,
}

/// One queued generation.
pub(crate) struct Job {
    pub req: Arc<GenRequest>,
    pub events: Sender<Event>,
    pub cancelled: Arc<AtomicBool>,
}

/// What the generator tells a request's thread.
pub(crate) enum Event {
    /// The rendered prompt's size, before generation starts.
    Started,
    Delta(Delta),
    Done(Result<Reply, ApiError>),
}

pub fn run(a: &ServeArgs) -> anyhow::Result<()> {
    let mut loaded = load(&a.source, &|_, ctx| {
        Ok(a.context
            .unwrap_or(ctx.min(8192))
            .min(ctx)
            .saturating_mul(2))
    })?;
    let model_ctx = loaded.model().config().max_position_embeddings();
    let context = a.context.unwrap_or(model_ctx.min(8192)).min(model_ctx);
    loaded.apply_budget(&a.source, context.saturating_mul(2))?;
    // The model's folder name (a layout's folder when given its manifest).
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        let p = &a.source.model;
        let folder = if p.is_file() {
            p.parent()
        } else {
            Some(p.as_path())
        };
        folder
            .and_then(|f| f.file_name())
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| "model".into())
    });
    let per_position = loaded.model().state_bytes_per_position() as usize;
    let cache_bytes = a.session_memory.map(|b| b as usize).unwrap_or(
        per_position
            .saturating_mul(context)
            .saturating_add(loaded.model().fixed_state_bytes() as usize),
    );
    let template_dir = crate::generate::tokenizer::model_files_dir(&a.source)?;
    if let Some(d) = &a.snapshot_dir {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let mut engine = Engine::new(
        &loaded,
        &template_dir,
        a.chat_template.as_deref(),
        cache_bytes,
        a.snapshot_dir.as_deref(),
        a.source.prefill_chunk,
    )?;
    let server = std::net::TcpListener::bind((a.host.as_str(), a.port))
        .with_context(|| format!("listening on {}:{}", a.host, a.port))?;
    let (tx, rx) = bounded::<Job>(a.queue.max(1));
    let metrics = Arc::new(Metrics::default());
    // The bound address (a --port 0 gets one from the system), for people and scripts.
    let addr = server
        .local_addr()
        .map_or_else(|_| format!("{}:{}", a.host, a.port), |s| s.to_string());
    eprintln!(
        "deltafin serve: `{name}` on http://{addr} (context {context}, queue {})",
        a.queue
    );
    let ctx = http::Ctx {
        model: name.clone(),
        jobs: tx,
        metrics: metrics.clone(),
        default_max_tokens: a.default_max_tokens,
        layout: loaded.opened.layout.clone(),
        connections: Default::default(),
    };
    std::thread::scope(|s| {
        let (server, ctx) = (&server, &ctx);
        s.spawn(move || http::accept(server, ctx, s));
        generator(&mut engine, &rx, &metrics, context);
    });
    Ok(())
}

/// Run queued jobs one at a time, for as long as the server runs.
fn generator(engine: &mut Engine<'_>, jobs: &Receiver<Job>, metrics: &Metrics, context: usize) {
    for job in jobs.iter() {
        metrics.queued.fetch_sub(1, Ordering::Relaxed);
        if job.cancelled.load(Ordering::Relaxed) {
            continue;
        }
        let result = run_job(engine, &job, context);
        if let Ok(r) = &result {
            metrics.record(r);
        }
        metrics
            .kept_states
            .store(engine.cache.len(), Ordering::Relaxed);
        let _ = job.events.send(Event::Done(result));
    }
}

fn run_job(engine: &mut Engine<'_>, job: &Job, context: usize) -> Result<Reply, ApiError> {
    let internal = |e: anyhow::Error| ApiError {
        status: 500,
        kind: "server_error",
        param: None,
        message: format!("{e:#}"),
    };
    let (text, ids) = match job.req.endpoint {
        Endpoint::Chat => {
            let text = engine.render(&job.req.inputs).map_err(|e| {
                ApiError::bad("messages", format!("the chat template refused: {e:#}"))
            })?;
            let ids = engine.encode(&text).map_err(internal)?;
            (text, ids)
        }
        Endpoint::Completions => {
            let ids = engine.encode(&job.req.prompt).map_err(internal)?;
            (job.req.prompt.clone(), ids)
        }
    };
    if ids.is_empty() {
        return Err(ApiError::bad("prompt", "the prompt is empty"));
    }
    if ids.len() + job.req.params.max_tokens > context {
        return Err(ApiError {
            status: 400,
            kind: "invalid_request_error",
            param: Some("messages".into()),
            message: format!(
                "this model's context is {context} tokens; the prompt is {} tokens and max_tokens \
                 {} (context_length_exceeded)",
                ids.len(),
                job.req.params.max_tokens
            ),
        });
    }
    let _ = job.events.send(Event::Started);
    engine
        .complete(&text, &ids, &job.req.params, &mut |d| {
            !job.cancelled.load(Ordering::Relaxed)
                && job.events.send(Event::Delta(d.clone())).is_ok()
        })
        .map_err(internal)
}
