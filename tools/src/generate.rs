//! `deltafin generate` (stream tokens from a prompt) and `deltafin logits` (one forward pass,
//! logits written as safetensors), over a Hugging Face model directory or a deltafin layout.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use deltafin_inference::{
    generate, DirSource, GenerateConfig, LayoutSource, LayoutSourceOptions, LoadProgress, Model,
    SamplerConfig, StopReason, WeightSource,
};
use deltafin_storage::engine::HashCheck;
use deltafin_storage::manifest::{Manifest, MANIFEST_FILE};
use deltafin_storage::safetensors::{write_header, Dtype, TensorSpec};
use indicatif::{ProgressBar, ProgressStyle};

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
    /// Layouts: blake3 checks of records as they are read: off, sampled[:N] (one in N) or all.
    #[arg(long, default_value = "sampled:16", value_name = "MODE")]
    pub hash_check: HashCheck,
    /// Layouts: cap on buffer bytes for experts in flight (must hold the largest expert).
    #[arg(long, default_value = "1G", value_parser = parse_size, value_name = "SIZE")]
    pub buffer_cap: u64,
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

fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("`{s}` is not a size"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => return Err(format!("unknown size unit `{other}` in `{s}`")),
    };
    Ok((n * mult as f64) as u64)
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
struct Loaded {
    model: Model,
    path: ModelPath,
    layout: Option<Arc<LayoutSource>>,
    tokenizer: Option<(PathBuf, tokenizers::Tokenizer)>,
    load_time: Duration,
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

fn load(args: &SourceArgs) -> anyhow::Result<Loaded> {
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
    let (source, layout): (Arc<dyn WeightSource>, Option<Arc<LayoutSource>>) = match &path {
        ModelPath::Directory(d) => (
            Arc::new(
                DirSource::open(d)
                    .with_context(|| format!("opening model directory {}", d.display()))?,
            ),
            None,
        ),
        ModelPath::Layout(m) => {
            let opts = LayoutSourceOptions {
                threads_per_drive: args.threads_per_drive,
                buffer_cap_bytes: args.buffer_cap,
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
            let src = Arc::new(src?);
            if !src.engine().direct_io() {
                eprintln!(
                    "note: a drive's filesystem refused O_DIRECT; reading through the page cache"
                );
            }
            (src.clone(), Some(src))
        }
    };
    let model = Model::load(source).context("loading the model")?;
    Ok(Loaded {
        model,
        path,
        layout,
        tokenizer,
        load_time: start.elapsed(),
    })
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
        v.insert(
            "drive_stats".into(),
            s.drives
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    serde_json::json!({
                        "drive": i,
                        "bytes_read": d.bytes_read,
                        "reads": d.reads,
                        "busy_s": d.busy.as_secs_f64(),
                        "direct_io": d.direct_io,
                    })
                })
                .collect::<Vec<_>>()
                .into(),
        );
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

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut detok = loaded.tokenizer.as_ref().map(|(_, t)| Detok {
        tok: t,
        ids: Vec::new(),
        prefix_offset: 0,
        read_offset: 0,
    });
    let mut text = String::new();
    let mut times: Vec<Instant> = Vec::new();
    let mut io_err: Option<std::io::Error> = None;
    let mut detok_err: Option<anyhow::Error> = None;
    let start = Instant::now();
    let result = generate(
        model,
        &mut model.new_session(),
        &prompt,
        &config,
        &mut |id| {
            times.push(Instant::now());
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
    let total = start.elapsed();
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
    let output = result.context("generating")?;
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

    let n = output.tokens.len();
    let ttft = times.first().map(|t| t.duration_since(start));
    let decode_rate = match (times.first(), times.last()) {
        (Some(a), Some(b)) if n > 1 && b > a => (n - 1) as f64 / b.duration_since(*a).as_secs_f64(),
        _ if total.as_secs_f64() > 0.0 => n as f64 / total.as_secs_f64(),
        _ => 0.0,
    };
    let stats = format!(
        "{n} tokens from a {}-token prompt; time to first token {}; {decode_rate:.2} tokens/s \
         ({:.1} tokens/min); total {:.3} s; load {:.3} s{}",
        prompt.len(),
        ttft.map(|t| format!("{:.3} s", t.as_secs_f64()))
            .unwrap_or_else(|| "n/a".into()),
        decode_rate * 60.0,
        total.as_secs_f64(),
        loaded.load_time.as_secs_f64(),
        loaded
            .layout
            .as_ref()
            .map(|s| {
                let st = s.stats();
                format!(
                    "; read {} bytes ({} experts) from {} drives",
                    st.bytes_read,
                    st.experts_fetched,
                    s.drive_count()
                )
            })
            .unwrap_or_default()
    );
    if args.json {
        eprintln!("{stats}");
        let mut v = serde_json::json!({
            "tokens": output.tokens,
            "prompt_tokens": prompt.len(),
            "prompt_ids": prompt,
            "stop": stop_json(output.stop),
            "ttft_s": ttft.map(|t| t.as_secs_f64()),
            "tokens_per_s": decode_rate,
            "tokens_per_min": decode_rate * 60.0,
            "total_s": total.as_secs_f64(),
            "load_s": loaded.load_time.as_secs_f64(),
        });
        if let Some(t) = text {
            v["text"] = t.into();
        }
        if let (Some(obj), serde_json::Value::Object(src)) =
            (v.as_object_mut(), source_json(&loaded))
        {
            obj.extend(src);
        }
        writeln!(out, "{}", serde_json::to_string(&v)?)?;
    } else {
        writeln!(out, "{stats}")?;
    }
    out.flush()?;
    Ok(())
}

pub fn run_logits(args: &LogitsArgs) -> anyhow::Result<()> {
    if args.ids.is_empty() {
        bail!("give --ids 1,2,3");
    }
    let loaded = load(&args.source)?;
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
