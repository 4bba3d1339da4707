//! A model opened from the command line's `--model`, with its tokenizer and RAM budget.

use std::path::PathBuf;

use anyhow::Context;
use deltafin_inference::family::expert_naming;
use deltafin_inference::run::budget::plan_budget;
use deltafin_inference::run::memory::default_ram_budget;
use deltafin_inference::run::{
    open_model, Budget, ModelPath, OpenOptions, OpenedModel, RamRequest,
};
use deltafin_inference::ModelConfig;
use deltafin_inference::{CachePolicy, LoadProgress};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::expert_parts::skipped_tensors;
use deltafin_storage::manifest::Manifest;
use indicatif::{ProgressBar, ProgressStyle};

use crate::generate::args::SourceArgs;
use crate::generate::tokenizer::load_tokenizer;

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
            let m = Manifest::load(manifest)
                .with_context(|| format!("reading {}", manifest.display()))?;
            let cfg = ModelConfig::from_json(&m.config)
                .with_context(|| format!("the config in {}", manifest.display()))?;
            let max_positions = positions(
                tokenizer.as_ref().map(|(_, t)| t),
                cfg.max_position_embeddings(),
            )?;
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
        eprintln!(
            "{}",
            crate::generate::report::residency_text(r, opened.model.layers().len())
        );
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
