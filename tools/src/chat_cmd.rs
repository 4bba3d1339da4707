//! `deltafin chat`: talk to a model in the terminal. Each turn is rendered with the model's chat
//! template and generated on the conversation's kept state, so it prefills only its new
//! tokens. Replies stream as they come (thinking dimmed); Ctrl-C stops a reply and keeps the
//! session, Ctrl-C at the prompt or Ctrl-D quits.
//!
//! Input: a line is a message; end a line with `\` to go on, or put a block between two lines
//! of `"""`. Commands: `/reset`, `/save FILE` (the conversation as template inputs, plus its
//! state in FILE.snap, both resumable with `--resume FILE`), `/exit`, `/help`.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{bail, Context};
use deltafin_chat::reasoning::Delta;
use deltafin_inference::SamplerConfig;
use serde_json::{json, Value};

use crate::conversation::{Engine, Params};
use crate::generate::args::SourceArgs;
use crate::generate::loaded::load;

#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// A chat template file to use instead of the model's.
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// Most tokens per reply.
    #[arg(short = 'n', long, default_value_t = 1024)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.6)]
    pub temperature: f32,
    /// Nucleus sampling (1 = off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Positions the conversation may reach; default: the model's context, at most 8192.
    #[arg(long)]
    pub context: Option<usize>,
    /// Keep generating past end-of-turn tokens up to -n (benchmarks, tests).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Do not print the thinking part of replies.
    #[arg(long)]
    pub hide_reasoning: bool,
    /// Continue a conversation saved with `/save FILE` (and its state, FILE.snap, if valid).
    #[arg(long, value_name = "FILE")]
    pub resume: Option<PathBuf>,
}

/// Set by SIGINT while a reply is being generated.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// True while a reply is being generated (SIGINT then stops it instead of quitting).
static GENERATING: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    if GENERATING.load(Ordering::SeqCst) {
        INTERRUPTED.store(true, Ordering::SeqCst);
    } else {
        // SAFETY: _exit is async-signal-safe; nothing is half-written at the prompt.
        unsafe { libc::_exit(130) };
    }
}

fn install_sigint() {
    let handler: extern "C" fn(libc::c_int) = on_sigint;
    // SAFETY: installs a handler that only touches atomics or calls _exit, both
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
    }
}

/// What one read of the terminal gave.
enum Input {
    Message(String),
    Command(String, String),
    End,
}

fn read_input(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> Input {
    let mut text = String::new();
    let mut block = false;
    for line in lines.by_ref() {
        let Ok(line) = line else { return Input::End };
        if block {
            if line.trim() == "\"\"\"" {
                return Input::Message(text);
            }
            text.push_str(&line);
            text.push('\n');
            continue;
        }
        if text.is_empty() && line.trim() == "\"\"\"" {
            block = true;
            continue;
        }
        if text.is_empty() && line.starts_with('/') {
            let (cmd, rest) = line.split_once(' ').unwrap_or((line.as_str(), ""));
            return Input::Command(cmd.to_string(), rest.trim().to_string());
        }
        if let Some(head) = line.strip_suffix('\\') {
            text.push_str(head);
            text.push('\n');
            continue;
        }
        text.push_str(&line);
        if text.trim().is_empty() {
            text.clear();
            continue;
        }
        return Input::Message(text);
    }
    if text.trim().is_empty() {
        Input::End
    } else {
        Input::Message(text)
    }
}

pub fn run(a: &ChatArgs) -> anyhow::Result<()> {
    let mut loaded = load(&a.source, &|_, ctx| {
        Ok(a.context.unwrap_or(ctx.min(8192)).min(ctx))
    })?;
    let model_ctx = loaded.model().config().max_position_embeddings();
    let context = a.context.unwrap_or(model_ctx.min(8192)).min(model_ctx);
    loaded.apply_budget(&a.source, context)?;
    let per_position = loaded.model().state_bytes_per_position() as usize;
    let cache_bytes = per_position
        .saturating_mul(context)
        .saturating_add(loaded.model().fixed_state_bytes() as usize);
    let template_dir = crate::generate::tokenizer::model_files_dir(&a.source)?;
    let mut engine = Engine::new(
        &loaded,
        &template_dir,
        a.chat_template.as_deref(),
        cache_bytes,
        None,
        a.source.prefill_chunk,
    )?;
    let start_messages = || -> Vec<Value> {
        a.system
            .iter()
            .map(|s| json!({"role": "system", "content": s}))
            .collect()
    };
    let mut messages = start_messages();
    if let Some(f) = &a.resume {
        messages = load_conversation(f)?;
        let snap = snap_path(f);
        if snap.is_file() {
            match engine.cache.load_file(loaded.model(), &snap) {
                Ok(n) => eprintln!(
                    "resumed {} messages and their state ({n} positions)",
                    messages.len()
                ),
                Err(e) => eprintln!(
                    "note: {}: {e:#}; the history will be prefilled again",
                    snap.display()
                ),
            }
        }
    }
    install_sigint();
    let tty = std::io::stdout().is_terminal();
    let (dim, plain) = if tty {
        ("\x1b[2m", "\x1b[0m")
    } else {
        ("", "")
    };
    let sampler = if a.temperature <= 0.0 {
        SamplerConfig::greedy()
    } else {
        SamplerConfig {
            temperature: a.temperature,
            top_k: 0,
            top_p: a.top_p,
            seed: a.seed,
        }
    };
    let params = Params {
        max_tokens: a.max_tokens,
        sampler,
        stop: Vec::new(),
        ignore_eos: a.ignore_eos,
        skip_special_tokens: true,
        cache_prompt: true,
    };
    if std::io::stdin().is_terminal() {
        eprintln!(
            "deltafin chat: context {context} tokens. Enter sends; end a line with \\ or use \"\"\" \
             for more lines. /reset, /save FILE, /exit. Ctrl-C stops a reply."
        );
    }
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut out = std::io::stdout();
    loop {
        if tty {
            print!("> ");
            out.flush()?;
        }
        match read_input(&mut lines) {
            Input::End => return Ok(()),
            Input::Command(cmd, arg) => match cmd.as_str() {
                "/exit" | "/quit" => return Ok(()),
                "/reset" => {
                    messages = start_messages();
                    eprintln!("(conversation reset)");
                }
                "/save" => {
                    if arg.is_empty() {
                        eprintln!("usage: /save FILE");
                        continue;
                    }
                    match save_conversation(&engine, &messages, Path::new(&arg)) {
                        Ok(msg) => eprintln!("{msg}"),
                        Err(e) => eprintln!("error: {e:#}"),
                    }
                }
                "/help" => eprintln!(
                    "/reset: start over  /save FILE: save the conversation (resume with \
                     --resume FILE)  /exit: quit"
                ),
                other => eprintln!("unknown command {other}; /help lists them"),
            },
            Input::Message(text) => {
                messages.push(json!({"role": "user", "content": text}));
                let inputs = minijinja::Value::from_serialize(json!({"messages": messages}));
                let prompt = match engine.render(&inputs) {
                    Ok(p) => p,
                    Err(e) => {
                        messages.pop();
                        eprintln!("error: the chat template refused: {e:#}");
                        continue;
                    }
                };
                let ids = engine.encode(&prompt)?;
                if ids.len() + a.max_tokens > context {
                    messages.pop();
                    eprintln!(
                        "error: the conversation is {} tokens; with -n {} it would pass the \
                         context ({context}); /reset or a smaller -n",
                        ids.len(),
                        a.max_tokens
                    );
                    continue;
                }
                INTERRUPTED.store(false, Ordering::SeqCst);
                GENERATING.store(true, Ordering::SeqCst);
                let mut in_reasoning = false;
                let result = engine.complete(&prompt, &ids, &params, &mut |d| {
                    let _ = match d {
                        Delta::Reasoning(t) if !a.hide_reasoning => {
                            in_reasoning = true;
                            write!(out, "{dim}{t}{plain}")
                        }
                        Delta::Reasoning(_) => Ok(()),
                        Delta::Content(t) => {
                            if std::mem::take(&mut in_reasoning) {
                                let _ = writeln!(out);
                            }
                            write!(out, "{t}")
                        }
                    };
                    let _ = out.flush();
                    !INTERRUPTED.load(Ordering::SeqCst)
                });
                GENERATING.store(false, Ordering::SeqCst);
                println!();
                let reply = match result {
                    Ok(r) => r,
                    Err(e) => {
                        messages.pop();
                        eprintln!("error: {e:#}");
                        continue;
                    }
                };
                let mut m = json!({"role": "assistant", "content": reply.content});
                if let Some(r) = &reply.reasoning {
                    m["reasoning_content"] = r.clone().into();
                }
                messages.push(m);
                let decode = reply.total.saturating_sub(reply.ttft.unwrap_or_default());
                let rate = reply.completion_tokens.saturating_sub(1) as f64
                    / decode.as_secs_f64().max(1e-9);
                eprintln!(
                    "[{} tokens{}, {:.2} tok/s, first token {:.2} s, prompt {} tokens ({} reused)]",
                    reply.completion_tokens,
                    if reply.finish_reason == "cancelled" {
                        ", stopped"
                    } else {
                        ""
                    },
                    rate,
                    reply.ttft.unwrap_or_default().as_secs_f64(),
                    reply.prompt_tokens,
                    reply.reused_tokens
                );
            }
        }
    }
}

fn snap_path(f: &Path) -> PathBuf {
    let mut s = f.as_os_str().to_owned();
    s.push(".snap");
    PathBuf::from(s)
}

/// Write the messages (as `deltafin template` inputs) and the conversation's state.
fn save_conversation(
    engine: &Engine<'_>,
    messages: &[Value],
    path: &Path,
) -> anyhow::Result<String> {
    let body = serde_json::to_vec_pretty(&json!({"messages": messages}))?;
    crate::util::write_regular_file(path, &body)?;
    let inputs = minijinja::Value::from_serialize(
        json!({"messages": messages, "add_generation_prompt": false}),
    );
    let tokens = engine.encode(&engine.render(&inputs)?)?;
    let snap = snap_path(path);
    Ok(
        match engine
            .cache
            .save_best(engine.loaded.model(), &tokens, &snap)
        {
            Ok(n) => format!(
                "saved {} messages to {} and their state ({n} positions) to {}",
                messages.len(),
                path.display(),
                snap.display()
            ),
            Err(e) => format!(
                "saved {} messages to {} (no state: {e:#})",
                messages.len(),
                path.display()
            ),
        },
    )
}

fn load_conversation(path: &Path) -> anyhow::Result<Vec<Value>> {
    let bytes = crate::util::read_capped(path, 64 << 20)
        .with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_slice(&bytes)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    match v.get("messages").and_then(Value::as_array) {
        Some(m) => Ok(m.clone()),
        None => bail!("{}: no `messages` array", path.display()),
    }
}
