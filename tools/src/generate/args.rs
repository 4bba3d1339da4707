//! The command-line arguments of `deltafin generate` and `deltafin logits`.

use std::path::PathBuf;

use deltafin_inference::generate::DEFAULT_PREFILL_CHUNK;
use deltafin_inference::run::StreamChoice;
use deltafin_inference::CachePolicy;
use deltafin_storage::engine::HashCheck;

use crate::util::parse_size;

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
    /// Layouts: hash checks of records as they are read (XXH3-128; blake3 on older layouts):
    /// off, `sampled[:N]` (one in N) or all.
    #[arg(long, default_value = "all", value_name = "MODE")]
    pub hash_check: HashCheck,
    /// Layouts: RAM budget for the whole process (resident weights, KV cache, activations, I/O
    /// buffers and the expert cache); the expert cache gets what the rest leaves, allocated and
    /// faulted in before the prompt (up to one buffer per expert). Default: half of the memory
    /// available at start.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub ram_budget: Option<u64>,
    /// Layouts: expert cache policy: lfu (frequency-aware) or lru.
    #[arg(long, default_value = "lfu", value_name = "POLICY")]
    pub cache_policy: CachePolicy,
    /// Layouts: do not prefetch the next layer's predicted experts.
    #[arg(long)]
    pub no_prefetch: bool,
    /// Layouts, benchmarks on emulated drives: pace each drive's reads to SIZE bytes/s the way
    /// a real drive's bandwidth limits them, idle time earning no credit (the cgroup blkio
    /// throttle credits up to 100 ms of it to the next read).
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub pace_drives: Option<u64>,
    /// Layouts: decoder layers whose non-expert weights are read from the drives for every
    /// forward instead of held: auto (what --ram-budget cannot hold), none, all, or a list
    /// like 1,3,5.
    #[arg(long, default_value = "auto", value_name = "LAYERS")]
    pub stream_layers: StreamChoice,
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
    /// Count which routed experts every MoE layer chooses, position by position, and write
    /// the counts to FILE (JSON) for `deltafin plan --routing FILE`.
    #[arg(long, value_name = "FILE")]
    pub save_routing: Option<std::path::PathBuf>,
    /// Time the forward pass's phases (built-in span timer) over the generation and print
    /// them at the end (and under `profile` in --json): where the time went, I/O waits
    /// included (inside the feed-forward phases that fetch experts).
    #[arg(long)]
    pub profile: bool,
    /// Write a timeline of the generation to FILE (JSON lines, nanoseconds on one clock):
    /// every drive read (`read_demand` / `read_prefetch`: drive, bytes), every wait for one
    /// (`stall`), every expert fetch (`batch`: layer; cached, in flight and to read) and the
    /// forward pass's phases. What a profile cannot show: whether reads and compute overlap.
    /// Held in memory until the end (~20 KB per token of a 16-layer model, at most 48 MB);
    /// `benches/trace_overlap.py` summarises it.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub spec: SpecArgs,
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

/// Drafters for speculative decoding.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftKind {
    /// Prompt lookup: propose what followed the latest earlier occurrence of the last n-gram.
    Ngram,
    /// Benchmarks: propose --replay-ids, each replaced with probability --replay-corruption.
    Replay,
}

#[derive(clap::Args, Debug, Clone, Default)]
pub struct SpecArgs {
    /// Speculative decoding with a drafter that needs no model.
    #[arg(long, value_enum, value_name = "KIND", conflicts_with = "draft_model")]
    pub draft: Option<DraftKind>,
    /// Speculative decoding with a small draft model (Hugging Face directory, same
    /// vocabulary), run in RAM.
    #[arg(long, value_name = "DIR")]
    pub draft_model: Option<PathBuf>,
    /// Most tokens drafted per verification pass.
    #[arg(long, default_value_t = 8, value_name = "K")]
    pub draft_k: usize,
    /// Always draft --draft-k tokens (no adaptation to acceptance and verify cost).
    #[arg(long)]
    pub fixed_k: bool,
    /// Replay drafter: the recorded continuation (token ids, e.g. an earlier run's token_ids).
    #[arg(long, value_delimiter = ',', num_args = 1.., value_name = "IDS")]
    pub replay_ids: Option<Vec<u32>>,
    /// Replay drafter: probability that a proposed token is replaced by another one.
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    pub replay_corruption: f64,
    /// After generating, write the session (KV cache + token history) to FILE atomically.
    #[arg(long, value_name = "FILE")]
    pub save_session: Option<PathBuf>,
    /// Start from a saved session, reusing the longest common prefix with the prompt. A file
    /// for another model, truncated, corrupted or of a newer version is refused with a note
    /// and generation starts from scratch.
    #[arg(long, value_name = "FILE")]
    pub load_session: Option<PathBuf>,
}

impl SpecArgs {
    pub(crate) fn active(&self) -> bool {
        self.draft.is_some()
            || self.draft_model.is_some()
            || self.save_session.is_some()
            || self.load_session.is_some()
    }
}
