//! A model opened from the command line's `--model`, with its tokenizer and RAM budget.

use std::path::PathBuf;

use anyhow::Context;
use deltafin_inference::family::expert_naming;
use deltafin_inference::run::budget::plan_budget;
use deltafin_inference::run::memory::default_ram_budget;
use deltafin_inference::run::{
    open_model, Budget, ModelPath, OpenOptions, OpenedModel, RamRequest,
};
use deltafin_inference::{CachePolicy, LoadProgress};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::expert_parts::skipped_tensors;
use indicatif::{ProgressBar, ProgressStyle};

use crate::generate::args::SourceArgs;
use crate::generate::tokenizer::load_tokenizer;
use crate::util::human;

/// A loaded model and facts about its source.
pub(crate) struct Loaded {
    pub opened: OpenedModel,
    pub tokenizer: Option<(PathBuf, deltafin_chat::ChatTokenizer)>,
    pub policy: CachePolicy,
    /// The RAM budget and how it was split (layouts).
    pub budget: Option<Budget>,
}

/// The longest context a command will run, from its tokenizer (a prompt's length) and the
/// model's `max_position_embeddings`: what a layout's RAM plan reserves state for.
pub(crate) type Positions<'a> =
    dyn Fn(Option<&deltafin_chat::ChatTokenizer>, usize) -> anyhow::Result<usize> + 'a;

/// Open `--model`, with a progress bar while a layout's resident weights load. A layout holds
/// what `--ram-budget` can hold for `positions` and streams the rest (`--stream-layers`).
pub(crate) fn load(args: &SourceArgs, positions: &Positions<'_>) -> anyhow::Result<Loaded> {
    let path = ModelPath::detect(&args.model)?;
    let tokenizer = load_tokenizer(args, &path)?;
    let ram = match &path {
        ModelPath::Layout(manifest) => {
            // Only for sizing the plan: the layout's own open authenticates the manifest (and
            // reads a mirror's good copy when this one is damaged), and reports what is wrong.
            let context = layout_context(manifest).unwrap_or(8192);
            let max_positions = positions(tokenizer.as_ref().map(|(_, t)| t), context)?;
            Some(RamRequest {
                ram_budget: args.ram_budget.unwrap_or_else(default_ram_budget),
                max_positions,
                chunk: if args.prefill_chunk == 0 {
                    max_positions
                } else {
                    args.prefill_chunk
                },
            })
        }
        ModelPath::Directory(_) => None,
    };
    let opts = OpenOptions {
        threads_per_drive: args.threads_per_drive,
        hash_check: args.hash_check,
        cache_policy: args.cache_policy,
        no_prefetch: args.no_prefetch,
        pace_drive_bytes_per_s: args.pace_drives,
        stream: args.stream_layers.clone(),
        ram,
        ..OpenOptions::default()
    };
    let bar = if args.quiet || matches!(path, ModelPath::Directory(_)) {
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
    let opened = open_model(&args.model, &opts, &mut |p: &LoadProgress| {
        bar.set_length(p.total_bytes);
        bar.set_position(p.done_bytes);
    })
    .with_context(|| format!("opening {}", args.model.display()));
    bar.finish_and_clear();
    let opened = opened?;
    if let ModelPath::Directory(dir) = &path {
        note_unused_tensors(dir);
    }
    if let (Some(r), false) = (&opened.residency, args.quiet) {
        eprintln!("{}", residency_text(r, opened.model.layers().len()));
    }
    if let Some(src) = &opened.layout {
        for problem in src.unavailable_drives() {
            eprintln!("warning: {problem}; reading from the other replicas");
        }
        if !src.direct_io() {
            eprintln!(
                "note: a drive's filesystem refused O_DIRECT; reading through the page cache"
            );
        }
    }
    Ok(Loaded {
        opened,
        tokenizer,
        policy: args.cache_policy,
        budget: None,
    })
}

/// `max_position_embeddings` from a layout manifest's config, read without checking anything
/// else (`None` when it cannot be read).
fn layout_context(manifest: &std::path::Path) -> Option<usize> {
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(manifest).ok()?).ok()?;
    let cfg = &v["config"];
    let text = if cfg["text_config"].is_object() {
        &cfg["text_config"]
    } else {
        cfg
    };
    text["max_position_embeddings"]
        .as_u64()
        .and_then(|n| usize::try_from(n).ok())
}

/// Say so when a checkpoint holds tensors the text model does not use (K3's vision tower and
/// projector), rather than ignoring them silently.
fn note_unused_tensors(dir: &std::path::Path) {
    let Ok(ckpt) = Checkpoint::open(dir) else {
        return; // the model opened, so this cannot fail in practice; nothing to note
    };
    let Ok(naming) = expert_naming(&ckpt.config) else {
        return;
    };
    let skipped: Vec<&str> = skipped_tensors(&ckpt, &naming)
        .map(|t| t.info.name.as_str())
        .collect();
    if let Some(first) = skipped.first() {
        eprintln!(
            "note: {} tensors outside the language model (e.g. `{first}`) are not used",
            skipped.len()
        );
    }
}

impl Loaded {
    pub(crate) fn model(&self) -> &deltafin_inference::Model {
        &self.opened.model
    }

    /// Token ids of `text` when a tokenizer was found.
    pub(crate) fn encode(&self, text: &str) -> anyhow::Result<Option<Vec<u32>>> {
        match &self.tokenizer {
            Some((_, t)) => Ok(Some(t.encode(text, true)?)),
            None => Ok(None),
        }
    }

    /// Split the RAM budget once the model is loaded and the longest context is known
    /// (layouts; a directory's weights are all in memory already).
    pub(crate) fn apply_budget(
        &mut self,
        args: &SourceArgs,
        max_positions: usize,
    ) -> anyhow::Result<()> {
        if let Some(src) = &self.opened.layout {
            let budget = args.ram_budget.unwrap_or_else(default_ram_budget);
            let chunk = if args.prefill_chunk == 0 {
                max_positions
            } else {
                args.prefill_chunk
            };
            self.budget = Some(plan_budget(
                &self.opened.model,
                src,
                budget,
                max_positions,
                chunk,
            )?);
        }
        Ok(())
    }
}

/// The RAM plan of a layout, as printed at start.
fn residency_text(r: &deltafin_inference::run::Residency, layers: usize) -> String {
    let held = layers.saturating_sub(r.streamed_layers.len());
    let mut s = format!(
        "RAM plan ({} budget): held: embeddings, head and small tensors {}, {held} of {layers} \
         layers' matrices {}; state {}; scratch {}",
        human(r.ram_budget),
        human(r.fixed_resident),
        human(r.layer_resident),
        human(r.kv_reserve),
        human(r.scratch_reserve),
    );
    if !r.streamed_layers.is_empty() {
        s.push_str(&format!(
            "; streamed: layers {:?}, {} read per forward, buffers {}",
            r.streamed_layers,
            human(r.streamed_bytes_per_forward),
            human(r.stream_buffers)
        ));
    }
    s.push_str(&format!(
        "; expert buffers {} (floor {}). Layers' weights are held before expert cache: each \
         byte held saves a byte read per token, a cached expert byte at most top-k/experts of one",
        human(r.expert_memory),
        human(r.expert_floor)
    ));
    s
}
