//! `deltafin generate` (stream tokens from a prompt) and `deltafin logits` (one forward pass,
//! logits written as safetensors), over a Hugging Face model directory or a deltafin layout.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use deltafin_inference::generate::DEFAULT_PREFILL_CHUNK;
use deltafin_inference::{
    generate, CachePolicy, DirSource, FetchStats, GenerateConfig, LayoutSource,
    LayoutSourceOptions, LoadProgress, Model, SamplerConfig, StopReason, WeightSource,
};
use deltafin_storage::engine::HashCheck;
use deltafin_storage::manifest::{Manifest, MANIFEST_FILE};
use deltafin_storage::safetensors::{write_header, Dtype, TensorSpec};
use indicatif::{ProgressBar, ProgressStyle};

use crate::util::{drive_stats_json, human, machine, parse_size};

/// Where the weights come from and how a layout is read.
#[derive(clap::Args, Debug, Clone)]
pub struct SourceArgs {
    /// A Hugging Face model directory (config.json + safetensors), or a deltafin layout: its
    /// manifest.json or the layout folder on any of its drives.
    #[arg(long, value_name = "PATH")]
    pub model: PathBuf,
    /// Layouts: reads in flight per drive.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub threads_per_drive: usize,
    /// Layouts: blake3 checks of records as they are read: off, `sampled[:N]` (one in N) or all.
    #[arg(long, default_value = "sampled:16", value_name = "MODE")]
    pub hash_check: HashCheck,
    /// Layouts: RAM budget for the whole process (resident weights, KV cache, activations, I/O
    /// buffers and the expert cache); the expert cache gets what the rest leaves. Default: half
    /// of the memory available at start.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub ram_budget: Option<u64>,
    /// Layouts: expert cache policy: lfu (frequency-aware) or lru.
    #[arg(long, default_value = "lfu", value_name = "POLICY")]
    pub cache_policy: CachePolicy,
    /// Layouts: do not prefetch the next layer's predicted experts.
    #[arg(long)]
    pub no_prefetch: bool,
    /// Prefill the prompt in chunks of N positions (0 = all at once).
    #[arg(long, default_value_t = DEFAULT_PREFILL_CHUNK, value_name = "N")]
    pub prefill_chunk: usize,
    /// tokenizer.json to use (default: next to the model, or the layout's source checkpoint).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, short = 'q')]
    pub quiet: bool,
}

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Prompt text (needs a tokenizer.json).
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// Prompt as token ids: 1,2,3.
    #[arg(long, value_delimiter = ',', num_args = 1.., value_name = "IDS")]
    pub prompt_ids: Option<Vec<u32>>,
    /// Upper bound on generated tokens.
    #[arg(short = 'n', long, default_value_t = 64, value_name = "N")]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of tokens with probability >= P (1 = off).
    #[arg(long, default_value_t = 1.0, value_name = "P")]
    pub top_p: f32,
    /// Sampler seed.
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub seed: u64,
    /// Extra stop token (repeatable); the config's EOS ids always stop unless --ignore-eos.
    #[arg(long = "stop-id", value_name = "ID")]
    pub stop_ids: Vec<u32>,
    /// Do not stop at the config's EOS ids.
    #[arg(long)]
    pub ignore_eos: bool,
    /// End with one JSON object on stdout (statistics go to stderr).
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub spec: crate::speculative_cmd::SpecArgs,
}

#[derive(clap::Args, Debug)]
pub struct LogitsArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Input token ids: 1,2,3.
    #[arg(long, value_delimiter = ',', num_args = 1.., required = true, value_name = "IDS")]
    pub ids: Vec<u32>,
    /// Output safetensors file: f32 `logits` [len, vocab].
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

/// What `--model` points at.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ModelPath {
    /// A Hugging Face model directory.
    Directory(PathBuf),
    /// A layout manifest file.
    Layout(PathBuf),
}

fn detect(path: &Path) -> anyhow::Result<ModelPath> {
    if path.is_dir() {
        if path.join("config.json").is_file() {
            return Ok(ModelPath::Directory(path.to_path_buf()));
        }
        if path.join(MANIFEST_FILE).is_file() {
            return Ok(ModelPath::Layout(path.join(MANIFEST_FILE)));
        }
        bail!(
            "{}: neither a model directory (no config.json) nor a layout folder (no {MANIFEST_FILE})",
            path.display()
        );
    }
    if path.is_file() {
        if path.file_name().is_some_and(|n| n == "config.json") {
            let dir = path.parent().unwrap_or(Path::new("."));
            return Ok(ModelPath::Directory(dir.to_path_buf()));
        }
        return Ok(ModelPath::Layout(path.to_path_buf()));
    }
    bail!("{}: no such file or directory", path.display())
}

/// A loaded model and facts about its source.
pub(crate) struct Loaded {
    pub model: Model,
    path: ModelPath,
    pub layout: Option<Arc<LayoutSource>>,
    tokenizer: Option<(PathBuf, tokenizers::Tokenizer)>,
    pub load_time: Duration,
    pub policy: CachePolicy,
    /// The RAM budget and how it was split.
    pub budget: Option<Budget>,
}

/// How a RAM budget is split (bytes).
#[derive(Clone, Debug, serde::Serialize)]
pub(crate) struct Budget {
    pub ram_budget: u64,
    /// Resident set of the process after loading (VmRSS): binary, resident weights.
    pub base_rss: u64,
    /// KV cache for the longest context planned.
    pub kv_reserve: u64,
    /// Activations and scratch of one prefill chunk, allocator slack.
    pub scratch_reserve: u64,
    /// Expert buffers: reads in flight, prefetched and cached experts.
    pub expert_memory: u64,
}

/// Keep large allocations out of the heap arena so freed memory goes back to the system and
/// peak RSS tracks what is live (glibc otherwise raises the mmap threshold dynamically).
pub(crate) fn tame_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator tuning; called before any worker threads start.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
    }
}

/// A field of /proc/self/status in bytes (`VmRSS`, `VmHWM`).
pub(crate) fn proc_status_bytes(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())?;
    Some(kb * 1024)
}

/// Half of MemAvailable.
pub(crate) fn default_ram_budget() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kb| kb * 1024 / 2)
        .unwrap_or(4 << 30)
}

fn cfg_u64(cfg: &serde_json::Value, key: &str) -> Option<u64> {
    cfg.get(key).and_then(|v| v.as_u64())
}

/// KV cache bytes per position (all layers, f32), from config.json.
fn kv_bytes_per_position(cfg: &serde_json::Value) -> u64 {
    let layers = cfg_u64(cfg, "num_hidden_layers").unwrap_or(1);
    let per_layer = match (
        cfg_u64(cfg, "kv_lora_rank"),
        cfg_u64(cfg, "qk_rope_head_dim"),
    ) {
        (Some(r), Some(p)) => r + p,
        _ => {
            let heads = cfg_u64(cfg, "num_attention_heads").unwrap_or(1);
            let kv = cfg_u64(cfg, "num_key_value_heads").unwrap_or(heads);
            let hd = cfg_u64(cfg, "head_dim")
                .unwrap_or_else(|| cfg_u64(cfg, "hidden_size").unwrap_or(0) / heads.max(1));
            2 * kv * hd
        }
    };
    layers * per_layer * 4
}

/// Split `ram_budget` after the model is loaded: what the process holds now, the KV cache for
/// `max_positions`, scratch for a `chunk`-position forward, and the rest for expert buffers.
pub(crate) fn plan_budget(
    model: &Model,
    src: &LayoutSource,
    ram_budget: u64,
    max_positions: usize,
    chunk: usize,
) -> anyhow::Result<Budget> {
    let cfg = src.manifest().config.clone();
    let base_rss = proc_status_bytes("VmRSS").unwrap_or(0);
    // Vec growth can leave up to 2x capacity.
    let kv_reserve = 2 * kv_bytes_per_position(&cfg) * max_positions as u64;
    let hidden = model.hidden_size() as u64;
    let heads = cfg_u64(&cfg, "num_attention_heads").unwrap_or(1);
    let top_k = cfg_u64(&cfg, "num_experts_per_tok").unwrap_or(8);
    let inter = cfg_u64(&cfg, "moe_intermediate_size")
        .unwrap_or(0)
        .max(cfg_u64(&cfg, "intermediate_size").unwrap_or(0));
    let c = chunk.clamp(1, max_positions.max(1)) as u64;
    let scratch_reserve = (48 << 20)
        + 4 * c * (hidden * (3 * top_k + 24) + 4 * inter + heads * max_positions as u64)
        + 8 * model.vocab_size() as u64;
    let biggest = src
        .manifest()
        .records
        .iter()
        .filter(|r| matches!(r.id, deltafin_storage::manifest::RecordId::Expert { .. }))
        .map(|r| deltafin_storage::stripe::align_up(r.len))
        .max()
        .unwrap_or(0);
    let fixed = base_rss + kv_reserve + scratch_reserve;
    let expert_memory = ram_budget.saturating_sub(fixed);
    if expert_memory < biggest {
        bail!(
            "--ram-budget {ram_budget} is too small for this model: the process holds {base_rss} \
             bytes after loading, the KV cache for {max_positions} positions needs up to \
             {kv_reserve} and scratch {scratch_reserve}, leaving {expert_memory} for expert \
             buffers, less than one expert record ({biggest}); give at least {}",
            fixed + biggest
        );
    }
    src.set_expert_memory_cap(expert_memory);
    Ok(Budget {
        ram_budget,
        base_rss,
        kv_reserve,
        scratch_reserve,
        expert_memory,
    })
}

fn find_tokenizer(args: &SourceArgs, path: &ModelPath) -> anyhow::Result<Option<PathBuf>> {
    if let Some(t) = &args.tokenizer {
        if !t.is_file() {
            bail!("--tokenizer {}: no such file", t.display());
        }
        return Ok(Some(t.clone()));
    }
    let candidates: Vec<PathBuf> = match path {
        ModelPath::Directory(d) => vec![d.join("tokenizer.json")],
        ModelPath::Layout(m) => {
            let mut v = Vec::new();
            // The source checkpoint the layout was written from, if still there.
            if let Ok(manifest) = Manifest::load(m) {
                if let Some(src) = manifest.meta.get("source") {
                    v.push(Path::new(src).join("tokenizer.json"));
                }
            }
            if let Some(dir) = m.parent() {
                v.push(dir.join("tokenizer.json"));
            }
            v
        }
    };
    Ok(candidates.into_iter().find(|p| p.is_file()))
}

pub(crate) fn load(args: &SourceArgs) -> anyhow::Result<Loaded> {
    let start = Instant::now();
    let path = detect(&args.model)?;
    let tokenizer = match find_tokenizer(args, &path)? {
        Some(p) => {
            let t = tokenizers::Tokenizer::from_file(&p)
                .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
            Some((p, t))
        }
        None => None,
    };
    /// A directory is loaded below; a layout is loaded as soon as it is open so that its copy
    /// of the resident weights can be dropped.
    enum Source {
        Weights(Arc<dyn WeightSource>),
        Built(Box<Model>),
    }
    let (source, layout): (Source, Option<Arc<LayoutSource>>) = match &path {
        ModelPath::Directory(d) => (
            Source::Weights(Arc::new(
                DirSource::open(d)
                    .with_context(|| format!("opening model directory {}", d.display()))?,
            )),
            None,
        ),
        ModelPath::Layout(m) => {
            let opts = LayoutSourceOptions {
                threads_per_drive: args.threads_per_drive,
                // Raised to the budget's share once the model is loaded.
                buffer_cap_bytes: 0,
                cache_policy: args.cache_policy,
                hash_check: args.hash_check,
                ..LayoutSourceOptions::default()
            };
            let bar = if args.quiet {
                ProgressBar::hidden()
            } else {
                ProgressBar::new(0)
            };
            bar.set_style(
                ProgressStyle::with_template(
                    "{msg:>10} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            bar.set_message("resident");
            let src = LayoutSource::open_with_progress(m, &opts, &mut |p: &LoadProgress| {
                bar.set_length(p.total_bytes);
                bar.set_position(p.done_bytes);
            })
            .with_context(|| format!("opening layout {}", m.display()));
            bar.finish_and_clear();
            let src = src?;
            for problem in src.unavailable_drives() {
                eprintln!("warning: {problem}; reading from the other replicas");
            }
            if !src.engine().direct_io() {
                eprintln!(
                    "note: a drive's filesystem refused O_DIRECT; reading through the page cache"
                );
            }
            // The model keeps its own copy of the resident weights; the layout's is dropped.
            let (model, src) = Model::load_owned(src).context("loading the model")?;
            (Source::Built(Box::new(model)), Some(src))
        }
    };
    let model = match source {
        Source::Built(m) => *m,
        Source::Weights(w) => Model::load(w).context("loading the model")?,
    };
    if args.no_prefetch {
        model.set_next_layer_prefetch(false);
    }
    Ok(Loaded {
        model,
        path,
        layout,
        tokenizer,
        load_time: start.elapsed(),
        policy: args.cache_policy,
        budget: None,
    })
}

impl Loaded {
    /// Token ids of `text` when a tokenizer was found.
    pub(crate) fn encode(&self, text: &str) -> anyhow::Result<Option<Vec<u32>>> {
        match &self.tokenizer {
            Some((_, t)) => Ok(Some(
                t.encode(text, true)
                    .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?
                    .get_ids()
                    .to_vec(),
            )),
            None => Ok(None),
        }
    }
}

/// Facts about the source for the JSON report.
fn source_json(l: &Loaded) -> serde_json::Value {
    let mut v = serde_json::Map::new();
    match &l.path {
        ModelPath::Directory(d) => {
            v.insert("model".into(), d.display().to_string().into());
            v.insert("source".into(), "directory".into());
        }
        ModelPath::Layout(m) => {
            v.insert("model".into(), m.display().to_string().into());
            v.insert("source".into(), "layout".into());
        }
    }
    if let Some(src) = &l.layout {
        let s = src.stats();
        v.insert(
            "mode".into(),
            serde_json::to_value(src.mode()).unwrap_or_default(),
        );
        v.insert("drives".into(), src.drive_count().into());
        v.insert("bytes_read".into(), s.bytes_read.into());
        v.insert("resident_bytes".into(), s.resident_bytes.into());
        v.insert("expert_bytes".into(), s.expert_bytes.into());
        v.insert("experts_fetched".into(), s.experts_fetched.into());
        v.insert(
            "resident_load_s".into(),
            s.resident_load_time.as_secs_f64().into(),
        );
        v.insert("drive_stats".into(), drive_stats_json(&s.drives));
    } else {
        v.insert("bytes_read".into(), serde_json::Value::Null);
    }
    if let Some((p, _)) = &l.tokenizer {
        v.insert("tokenizer".into(), p.display().to_string().into());
    }
    v.into()
}

/// Incremental detokenization: emits only text that later tokens cannot change (the approach
/// of Hugging Face's text-generation-inference).
struct Detok<'t> {
    tok: &'t tokenizers::Tokenizer,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl Detok<'_> {
    fn push(&mut self, id: u32) -> anyhow::Result<String> {
        self.ids.push(id);
        let decode = |ids: &[u32]| {
            self.tok
                .decode(ids, true)
                .map_err(|e| anyhow::anyhow!("decoding tokens: {e}"))
        };
        let prefix = decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let full = decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(new) = full.get(prefix.len()..) {
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return Ok(new.to_string());
            }
        }
        Ok(String::new())
    }
}

fn stop_json(stop: StopReason) -> serde_json::Value {
    match stop {
        StopReason::MaxTokens => serde_json::json!("max_tokens"),
        StopReason::StopToken(id) => serde_json::json!({"stop_token": id}),
        StopReason::Callback => serde_json::json!("callback"),
    }
}

pub fn run_generate(args: &GenerateArgs) -> anyhow::Result<()> {
    tame_allocator();
    // Cheap argument checks before a possibly long load.
    if args.prompt.is_none() && args.prompt_ids.as_ref().is_none_or(|v| v.is_empty()) {
        bail!("give --prompt TEXT or --prompt-ids 1,2,3");
    }
    SamplerConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    }
    .validate()?;
    if args.prompt.is_some() {
        let path = detect(&args.source.model)?;
        if find_tokenizer(&args.source, &path)?.is_none() {
            bail!(
                "--prompt needs a tokenizer.json and none was found for {} (looked {}); give \
                 --tokenizer FILE, or pass token ids with --prompt-ids 1,2,3",
                args.source.model.display(),
                match path {
                    ModelPath::Layout(_) => {
                        "in the layout's source checkpoint folder and next to the manifest"
                    }
                    ModelPath::Directory(_) => "in the model directory",
                }
            );
        }
    }

    let loaded = load(&args.source)?;
    let model = &loaded.model;
    let prompt: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => {
            let (_, tok) = loaded
                .tokenizer
                .as_ref()
                .context("--prompt needs a tokenizer.json; use --prompt-ids")?;
            tok.encode(text.as_str(), true)
                .map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?
                .get_ids()
                .to_vec()
        }
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty (no tokens)");
    }

    let mut config = GenerateConfig::for_model(model, args.max_new_tokens);
    if args.ignore_eos {
        config.stop_tokens.clear();
    }
    config.stop_tokens.extend(&args.stop_ids);
    config.sampler = SamplerConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };

    config.prefill_chunk = args.source.prefill_chunk;
    let mut loaded = loaded;
    apply_budget(
        &mut loaded,
        &args.source,
        prompt.len() + args.max_new_tokens,
    )?;

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut detok = loaded.tokenizer.as_ref().map(|(_, t)| Detok {
        tok: t,
        ids: Vec::new(),
        prefix_offset: 0,
        read_offset: 0,
    });
    let mut text = String::new();
    let mut io_err: Option<std::io::Error> = None;
    let mut detok_err: Option<anyhow::Error> = None;
    let mut spec_metrics = serde_json::Map::new();
    let result = crate::speculative_cmd::run(
        &args.spec,
        &loaded,
        &prompt,
        &config,
        &mut spec_metrics,
        &mut |id| {
            let piece = match detok.as_mut() {
                Some(d) => match d.push(id) {
                    Ok(s) => s,
                    Err(e) => {
                        detok_err = Some(e);
                        return false;
                    }
                },
                None => format!("{id} "),
            };
            text.push_str(&piece);
            if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                io_err = Some(e);
                return false;
            }
            true
        },
    );
    if let Some(e) = detok_err {
        return Err(e);
    }
    if let Some(e) = io_err {
        // A closed pipe (e.g. `| head`) is not worth a report.
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(());
        }
        return Err(e).context("writing to stdout");
    }
    let run = result.context("generating")?;
    let output = &run.output;
    // Flush text held back by the detokenizer (an incomplete character at the very end).
    let text = match &loaded.tokenizer {
        Some((_, tok)) => {
            let full = tok
                .decode(&output.tokens, true)
                .map_err(|e| anyhow::anyhow!("decoding tokens: {e}"))?;
            if let Some(rest) = full.strip_prefix(text.as_str()) {
                out.write_all(rest.as_bytes())?;
            }
            Some(full)
        }
        None => None,
    };
    writeln!(out)?;
    out.flush()?;

    let stats = run.summary(&loaded, prompt.len());
    if args.json {
        eprintln!("{stats}");
        let mut v = run.to_json(&loaded, &prompt);
        if let Some(obj) = v.as_object_mut() {
            obj.extend(spec_metrics);
        }
        if let Some(t) = text {
            v["text"] = t.into();
        }
        if let Some(p) = &args.prompt {
            v["prompt"] = p.clone().into();
        }
        writeln!(out, "{}", serde_json::to_string(&v)?)?;
    } else {
        writeln!(out, "{stats}")?;
    }
    out.flush()?;
    Ok(())
}

/// Split the RAM budget once the model is loaded and the longest context is known (layouts).
pub(crate) fn apply_budget(
    loaded: &mut Loaded,
    args: &SourceArgs,
    max_positions: usize,
) -> anyhow::Result<()> {
    if let Some(src) = &loaded.layout {
        let budget = args.ram_budget.unwrap_or_else(default_ram_budget);
        let chunk = if args.prefill_chunk == 0 {
            max_positions
        } else {
            args.prefill_chunk
        };
        loaded.budget = Some(plan_budget(
            &loaded.model,
            src,
            budget,
            max_positions,
            chunk,
        )?);
    }
    Ok(())
}

/// One generation with its measurements.
pub(crate) struct Measured {
    pub output: deltafin_inference::GenerateOutput,
    pub ttft: Option<Duration>,
    pub total: Duration,
    /// Decode steps after the first token and their wall time.
    pub decode_steps: usize,
    pub decode_time: Duration,
    pub prefill_fetch: FetchStats,
    pub decode_fetch: FetchStats,
    pub drives: Vec<deltafin_storage::engine::DriveStats>,
    pub peak_rss: Option<u64>,
}

/// Run `generate` with `on_token`, measuring TTFT, decode rate and what the layout read in the
/// prefill and decode phases.
pub(crate) fn run_measured(
    loaded: &Loaded,
    prompt: &[u32],
    config: &GenerateConfig,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> anyhow::Result<Measured> {
    let model = &loaded.model;
    run_measured_with(loaded, on_token, &mut |on_tok| {
        Ok(generate(
            model,
            &mut model.new_session(),
            prompt,
            config,
            on_tok,
        )?)
    })
}

/// The generation step of [`run_measured`], supplied by the caller (speculative decoding,
/// session snapshots).
pub(crate) type GenStep<'a> = dyn FnMut(&mut dyn FnMut(u32) -> bool) -> anyhow::Result<deltafin_inference::GenerateOutput>
    + 'a;

/// [`run_measured`] with the generation step supplied.
pub(crate) fn run_measured_with(
    loaded: &Loaded,
    on_token: &mut dyn FnMut(u32) -> bool,
    gen: &mut GenStep<'_>,
) -> anyhow::Result<Measured> {
    let fetch = || {
        loaded
            .layout
            .as_ref()
            .map(|s| s.stats().fetch)
            .unwrap_or_default()
    };
    let drives0 = loaded
        .layout
        .as_ref()
        .map(|s| s.stats().drives)
        .unwrap_or_default();
    let f0 = fetch();
    let mut f1: Option<FetchStats> = None;
    let mut times: Vec<Instant> = Vec::new();
    let start = Instant::now();
    let output = gen(&mut |id| {
        times.push(Instant::now());
        if f1.is_none() {
            f1 = Some(fetch());
        }
        on_token(id)
    })?;
    let total = start.elapsed();
    let f2 = fetch();
    let f1 = f1.unwrap_or_else(|| f2.clone());
    let drives = loaded
        .layout
        .as_ref()
        .map(|s| {
            s.stats()
                .drives
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    let before = drives0.get(i).cloned().unwrap_or_default();
                    deltafin_storage::engine::DriveStats {
                        bytes_read: d.bytes_read - before.bytes_read,
                        reads: d.reads - before.reads,
                        busy: d.busy.saturating_sub(before.busy),
                        direct_io: d.direct_io,
                        read_errors: d.read_errors - before.read_errors,
                    }
                })
                .collect()
        })
        .unwrap_or_default();
    let (decode_steps, decode_time) = match (times.first(), times.last()) {
        (Some(a), Some(b)) if times.len() > 1 => (times.len() - 1, b.duration_since(*a)),
        _ => (0, Duration::ZERO),
    };
    Ok(Measured {
        ttft: times.first().map(|t| t.duration_since(start)),
        total,
        decode_steps,
        decode_time,
        prefill_fetch: f1.since(&f0),
        decode_fetch: f2.since(&f1),
        drives,
        peak_rss: proc_status_bytes("VmHWM"),
        output,
    })
}

impl Measured {
    pub fn tokens_per_s(&self) -> f64 {
        let n = self.output.tokens.len();
        if self.decode_steps > 0 && self.decode_time > Duration::ZERO {
            self.decode_steps as f64 / self.decode_time.as_secs_f64()
        } else if self.total > Duration::ZERO {
            n as f64 / self.total.as_secs_f64()
        } else {
            0.0
        }
    }

    pub fn all_fetch(&self) -> FetchStats {
        let (p, d) = (&self.prefill_fetch, &self.decode_fetch);
        FetchStats {
            batches: p.batches + d.batches,
            requests: p.requests + d.requests,
            cache_hits: p.cache_hits + d.cache_hits,
            prefetch_hits: p.prefetch_hits + d.prefetch_hits,
            reads: p.reads + d.reads,
            read_bytes: p.read_bytes + d.read_bytes,
            prefetch_reads: p.prefetch_reads + d.prefetch_reads,
            prefetch_cancelled: p.prefetch_cancelled + d.prefetch_cancelled,
            predicted: p.predicted + d.predicted,
            predicted_actual: p.predicted_actual + d.predicted_actual,
            predicted_correct: p.predicted_correct + d.predicted_correct,
            stall: p.stall + d.stall,
            peak_bytes: p.peak_bytes.max(d.peak_bytes),
            evictions: p.evictions + d.evictions,
            prefetch_gated: p.prefetch_gated + d.prefetch_gated,
        }
    }

    pub fn summary(&self, loaded: &Loaded, prompt_len: usize) -> String {
        let n = self.output.tokens.len();
        let rate = self.tokens_per_s();
        let mut s = format!(
            "{n} tokens from a {prompt_len}-token prompt; time to first token {}; {rate:.2} \
             tokens/s ({:.1} tokens/min); total {:.3} s; load {:.3} s",
            self.ttft
                .map(|t| format!("{:.3} s", t.as_secs_f64()))
                .unwrap_or_else(|| "n/a".into()),
            rate * 60.0,
            self.total.as_secs_f64(),
            loaded.load_time.as_secs_f64(),
        );
        if let Some(src) = &loaded.layout {
            let f = self.all_fetch();
            let d = &self.decode_fetch;
            s.push_str(&format!(
                "; read {} of experts ({} records) from {} drive(s); {} per decoded token; \
                 {} per prompt token; expert cache hit rate {}; prefetch recall {} precision \
                 {}; I/O stall {:.3} s; peak RSS {}",
                human(f.read_bytes),
                f.reads,
                src.drive_count(),
                human(d.read_bytes / self.decode_steps.max(1) as u64),
                human(self.prefill_fetch.read_bytes / prompt_len.max(1) as u64),
                pct(f.hit_rate()),
                pct(f.prefetch_recall()),
                pct(f.prefetch_precision()),
                f.stall.as_secs_f64(),
                self.peak_rss.map(human).unwrap_or_else(|| "n/a".into()),
            ));
            if let Some(b) = &loaded.budget {
                s.push_str(&format!(
                    " (budget {}, expert buffers {})",
                    human(b.ram_budget),
                    human(b.expert_memory)
                ));
            }
        }
        s
    }

    pub fn to_json(&self, loaded: &Loaded, prompt: &[u32]) -> serde_json::Value {
        let n = self.output.tokens.len();
        let rate = self.tokens_per_s();
        let f = self.all_fetch();
        let (p, d) = (&self.prefill_fetch, &self.decode_fetch);
        let stall = f.stall.as_secs_f64();
        let mut v = serde_json::json!({
            "tokens": n,
            "token_ids": self.output.tokens,
            "prompt_tokens": prompt.len(),
            "prompt_ids": prompt,
            "stop": stop_json(self.output.stop),
            "ttft_s": self.ttft.map(|t| t.as_secs_f64()),
            "tokens_per_s": rate,
            "tokens_per_min": rate * 60.0,
            "decode_s_per_token": (self.decode_steps > 0).then(|| self.decode_time.as_secs_f64() / self.decode_steps as f64),
            "total_s": self.total.as_secs_f64(),
            "load_s": loaded.load_time.as_secs_f64(),
            "compute_s": (self.total.as_secs_f64() - stall).max(0.0),
            "io_stall_s": stall,
            "prefill_io_stall_s": p.stall.as_secs_f64(),
            "decode_io_stall_s": d.stall.as_secs_f64(),
            "peak_rss_bytes": self.peak_rss,
            "next_layer_prefetch": loaded.model.next_layer_prefetch(),
            "machine": machine(),
        });
        if let (Some(obj), serde_json::Value::Object(src)) =
            (v.as_object_mut(), source_json(loaded))
        {
            obj.extend(src);
        }
        if let Some(src) = &loaded.layout {
            let m = src.manifest();
            v["layout"] = m.name.clone().into();
            v["bytes_read"] = f.read_bytes.into();
            v["prefill_bytes_read"] = p.read_bytes.into();
            v["decode_bytes_read"] = d.read_bytes.into();
            v["bytes_read_per_token"] =
                (d.read_bytes as f64 / self.decode_steps.max(1) as f64).into();
            v["bytes_read_per_prompt_token"] =
                (p.read_bytes as f64 / prompt.len().max(1) as f64).into();
            v["expert_cache_hit_rate"] = f.hit_rate().into();
            v["decode_expert_cache_hit_rate"] = d.hit_rate().into();
            v["prefetch_recall"] = f.prefetch_recall().into();
            v["prefetch_precision"] = f.prefetch_precision().into();
            v["prefetch_gated"] = f.prefetch_gated.into();
            v["decode_prefetch_recall"] = d.prefetch_recall().into();
            v["decode_prefetch_precision"] = d.prefetch_precision().into();
            v["fetch"] = serde_json::json!({
                "requests": f.requests, "cache_hits": f.cache_hits, "prefetch_hits": f.prefetch_hits,
                "reads": f.reads, "prefetch_reads": f.prefetch_reads,
                "prefetch_cancelled": f.prefetch_cancelled, "evictions": f.evictions,
                "expert_memory_peak_bytes": f.peak_bytes,
            });
            v["cache_policy"] = src_policy(loaded).into();
            v["budget"] = serde_json::to_value(&loaded.budget).unwrap_or_default();
            v["ram_budget_bytes"] = loaded.budget.as_ref().map(|b| b.ram_budget).into();
            v["expert_bytes_total"] = m
                .records
                .iter()
                .filter(|r| matches!(r.id, deltafin_storage::manifest::RecordId::Expert { .. }))
                .map(|r| r.len)
                .sum::<u64>()
                .into();
            v["drive_stats"] = drive_stats_json(&self.drives);
        }
        v
    }
}

fn src_policy(loaded: &Loaded) -> String {
    loaded.policy.to_string()
}

fn pct(x: Option<f64>) -> String {
    x.map(|x| format!("{:.1}%", 100.0 * x))
        .unwrap_or_else(|| "n/a".into())
}

pub fn run_logits(args: &LogitsArgs) -> anyhow::Result<()> {
    if args.ids.is_empty() {
        bail!("give --ids 1,2,3");
    }
    let mut loaded = load(&args.source)?;
    apply_budget(&mut loaded, &args.source, args.ids.len())?;
    let model = &loaded.model;
    let logits = model
        .forward(&mut model.new_session(), &args.ids)
        .context("forward pass")?;
    let mut meta = BTreeMap::new();
    meta.insert(
        "ids".to_string(),
        serde_json::to_string(&args.ids).unwrap_or_default(),
    );
    meta.insert("model".to_string(), args.source.model.display().to_string());
    let spec = TensorSpec::new(
        "logits",
        Dtype::F32,
        &[logits.rows as u64, logits.vocab as u64],
    );
    let file = std::fs::File::create(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let mut w = std::io::BufWriter::new(file);
    write_header(&mut w, &[spec], &meta)
        .with_context(|| format!("writing {}", args.out.display()))?;
    for x in &logits.data {
        w.write_all(&x.to_le_bytes())?;
    }
    w.into_inner()
        .map_err(|e| e.into_error())
        .and_then(|f| f.sync_all())
        .with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "wrote logits [{}, {}] to {} (load {:.3} s)",
        logits.rows,
        logits.vocab,
        args.out.display(),
        loaded.load_time.as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_detection() {
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert!(parse_size("lots").is_err());
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/fixtures/qwen3_moe_a");
        assert_eq!(
            detect(&fixture).ok(),
            Some(ModelPath::Directory(fixture.clone()))
        );
        assert_eq!(
            detect(&fixture.join("config.json")).ok(),
            Some(ModelPath::Directory(fixture.clone()))
        );
        assert!(detect(&fixture.join("nope")).is_err());
    }
}
