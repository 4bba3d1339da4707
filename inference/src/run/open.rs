//! Opening a model from a path: a Hugging Face directory (memory-mapped) or a deltafin layout
//! (any drive's manifest or layout folder), with the options a command line offers.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deltafin_storage::backend::IoBackend;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::manifest::MANIFEST_FILE;
use deltafin_storage::paced_backend::PacedBackend;
use deltafin_storage::store::{CachePolicy, LoadProgress};

use crate::config::ModelConfig;
use crate::error::{InferenceError, Result};
use crate::kernels::isa::KernelConfig;
use crate::layout_source::{LayoutSource, LayoutSourceOptions};
use crate::model::forward::Model;
use crate::run::memory::rss_bytes;
use crate::run::residency::{choose_residency, RamRequest, Residency};
use crate::streamed_layer::StreamableLayers;
use crate::weights::DirSource;
use deltafin_storage::manifest::Manifest;

/// What a model path points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelPath {
    /// A Hugging Face model directory.
    Directory(PathBuf),
    /// A layout manifest file.
    Layout(PathBuf),
}

impl ModelPath {
    /// A directory with config.json, a folder with a layout manifest, config.json itself, or
    /// a manifest file.
    pub fn detect(path: &Path) -> Result<ModelPath> {
        if path.is_dir() {
            if path.join("config.json").is_file() {
                return Ok(ModelPath::Directory(path.to_path_buf()));
            }
            if path.join(MANIFEST_FILE).is_file() {
                return Ok(ModelPath::Layout(path.join(MANIFEST_FILE)));
            }
            return Err(InferenceError::InvalidArgument(format!(
                "{}: neither a model directory (no config.json) nor a layout folder (no \
                 {MANIFEST_FILE})",
                path.display()
            )));
        }
        if path.is_file() {
            if path.file_name().is_some_and(|n| n == "config.json") {
                let dir = path.parent().unwrap_or(Path::new("."));
                return Ok(ModelPath::Directory(dir.to_path_buf()));
            }
            return Ok(ModelPath::Layout(path.to_path_buf()));
        }
        Err(InferenceError::InvalidArgument(format!(
            "{}: no such file or directory",
            path.display()
        )))
    }
}

/// How to open a model.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Layouts: reads in flight per drive.
    pub threads_per_drive: usize,
    /// Layouts: hash checks of records as they are read.
    pub hash_check: HashCheck,
    /// Layouts: expert cache policy.
    pub cache_policy: CachePolicy,
    /// Layouts: do not prefetch the next layer's predicted experts.
    pub no_prefetch: bool,
    /// Layouts: pace each drive's reads to this rate ([`PacedBackend`]; emulated-drive
    /// benchmarks).
    pub pace_drive_bytes_per_s: Option<u64>,
    /// The kernels every matrix runs.
    pub kernels: KernelConfig,
    /// Layouts: which decoder layers' weights to stream instead of holding.
    pub stream: StreamChoice,
    /// Layouts: the RAM the process may use ([`StreamChoice::Auto`] streams what does not fit).
    pub ram: Option<RamRequest>,
}

/// Which decoder layers of a layout to stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum StreamChoice {
    /// As the RAM request needs ([`choose_residency`]); nothing without one.
    #[default]
    Auto,
    /// Hold every layer.
    None,
    /// Stream every layer that has streamable weights.
    All,
    /// Stream these layers.
    Layers(Vec<usize>),
}

impl std::str::FromStr for StreamChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(StreamChoice::Auto),
            "none" => Ok(StreamChoice::None),
            "all" => Ok(StreamChoice::All),
            list => list
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(StreamChoice::Layers)
                .map_err(|_| {
                    format!("`{s}`: expected auto, none, all or layer numbers like 1,3,5")
                }),
        }
    }
}

impl Default for OpenOptions {
    fn default() -> Self {
        let l = LayoutSourceOptions::default();
        OpenOptions {
            threads_per_drive: l.threads_per_drive,
            hash_check: l.hash_check,
            cache_policy: l.cache_policy,
            no_prefetch: false,
            pace_drive_bytes_per_s: None,
            kernels: KernelConfig::default(),
            stream: StreamChoice::Auto,
            ram: None,
        }
    }
}

/// A loaded model and where it came from.
#[derive(Debug)]
pub struct OpenedModel {
    pub model: Model,
    pub path: ModelPath,
    /// The layout the model streams its experts from (`None` for a directory).
    pub layout: Option<Arc<LayoutSource>>,
    /// What was held and what streamed under the RAM request (layouts with one).
    pub residency: Option<Residency>,
    pub load_time: Duration,
}

/// Open `path` and load the model. A layout's expert buffers start with no budget: give them
/// one with [`crate::run::budget::plan_budget`] before generating.
pub fn open_model(
    path: &Path,
    opts: &OpenOptions,
    on_progress: &mut dyn FnMut(&LoadProgress),
) -> Result<OpenedModel> {
    let start = Instant::now();
    let path = ModelPath::detect(path)?;
    let mut residency = None;
    let (model, layout) = match &path {
        ModelPath::Directory(d) => {
            let src = DirSource::open(d)?;
            // A directory model that fits comfortably in RAM is mapped in at load, as
            // llama.cpp copies its weights in: otherwise the first tokens take a page fault per
            // 64 KiB of weights they touch (7% of a 32-token prefill's time, in RAM). A larger
            // one stays lazily mapped (the page cache decides).
            if src.mapped_bytes() <= crate::run::memory::available_bytes().unwrap_or(0) / 2 {
                src.populate();
            }
            (Model::load_with(Arc::new(src), opts.kernels)?, None)
        }
        ModelPath::Layout(m) => {
            let defaults = LayoutSourceOptions::default();
            let backend = match opts.pace_drive_bytes_per_s {
                Some(bps) => Arc::new(
                    PacedBackend::new(defaults.backend.clone(), bps as f64).map_err(|e| {
                        InferenceError::InvalidArgument(format!("--pace-drives: {e}"))
                    })?,
                ) as Arc<dyn IoBackend>,
                None => defaults.backend.clone(),
            };
            let lopts = LayoutSourceOptions {
                threads_per_drive: opts.threads_per_drive,
                backend,
                // Raised to the budget's share once the model is loaded.
                buffer_cap_bytes: 0,
                cache_policy: opts.cache_policy,
                hash_check: opts.hash_check,
                ..defaults
            };
            let base_rss = rss_bytes().unwrap_or(0);
            let mut choose = |man: &Manifest, s: &StreamableLayers| -> Result<Vec<usize>> {
                let streamable = || s.layers.iter().map(|l| l.layer).collect::<Vec<_>>();
                let forced = match &opts.stream {
                    StreamChoice::Auto => None,
                    StreamChoice::None => Some(Vec::new()),
                    StreamChoice::All => Some(streamable()),
                    StreamChoice::Layers(l) => Some(l.clone()),
                };
                let Some(req) = &opts.ram else {
                    return Ok(forced.unwrap_or_default());
                };
                let cfg = ModelConfig::from_json(&man.config)?;
                let state = crate::run::model_bytes::state_bytes(&cfg);
                let mut r =
                    choose_residency(s, &cfg, state, man.largest_expert_record(), base_rss, req);
                // An explicit choice overrides the plan's (which then reports it), even when
                // the plan alone found no way to fit.
                if let Some(layers) = forced {
                    let fallback =
                        || crate::run::residency::Residency::unplanned(s, base_rss, req.ram_budget);
                    r = Ok(r.unwrap_or_else(|_| fallback()).with_streamed(s, layers));
                }
                let r = r?;
                let layers = r.streamed_layers.clone();
                residency = Some(r);
                Ok(layers)
            };
            let src = LayoutSource::open_streaming(m, &lopts, &mut choose, on_progress)?;
            // The model keeps its own copy of the resident weights; the layout's is dropped.
            let (model, src) = Model::load_owned_with(src, opts.kernels)?;
            (model, Some(src))
        }
    };
    if opts.no_prefetch {
        model.set_next_layer_prefetch(false);
    }
    Ok(OpenedModel {
        model,
        path,
        layout,
        residency,
        load_time: start.elapsed(),
    })
}
