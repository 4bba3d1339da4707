//! `deltafin layout`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use deltafin_inference::family::expert_naming;
use deltafin_inference::quantize::{DenseFormats, ExpertFormat, QuantizeExperts, TensorQuantError};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::expert_parts::skipped_tensors;
use deltafin_storage::layout::{write_layout, ExpertTransform, LayoutOptions, DEFAULT_STRIPE_UNIT};
use deltafin_storage::stripe::Mode;
use serde::Deserialize;

use crate::progress::Bar;
use crate::util::{human, parse_size};

#[derive(clap::Args, Debug)]
pub struct LayoutArgs {
    /// The checkpoint directory (config.json + *.safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// A drive (mount point or directory); repeat for 1-4 drives.
    #[arg(long = "drive")]
    pub drives: Vec<PathBuf>,
    /// replicate (full copy per drive) or stripe (RAID-0 over the drives).
    #[arg(long)]
    pub mode: Option<Mode>,
    /// Stripe unit in bytes (e.g. 512K).
    #[arg(long, value_parser = parse_size)]
    pub stripe_unit: Option<u64>,
    /// Layout name: the folder created on every drive.
    #[arg(long)]
    pub name: Option<String>,
    /// A JSON layout spec (see layouts/); flags given on the command line override it.
    #[arg(long)]
    pub spec: Option<PathBuf>,
    /// Replace an existing layout of the same name. The new layout is written beside the old
    /// one and swapped in when complete; when the drives cannot hold both, in place, but only
    /// after every check (space, writable drives, the checkpoint) has passed.
    #[arg(long)]
    pub force: bool,
    /// Leave at least this much free on every drive (e.g. 10G); a layout that would not is
    /// refused before anything is written.
    #[arg(long, value_parser = parse_size, default_value = "0")]
    pub keep_free: u64,
    /// Quantize routed experts of a BF16 checkpoint while laying out (RTN, one scale per 32
    /// values): mxfp4, int4 (compressed-tensors, as shipped) or q8. Errors per tensor go to
    /// `quantize_errors.json` next to each drive's manifest; a summary is printed.
    #[arg(long, value_name = "FORMAT")]
    pub quantize_experts: Option<ExpertFormat>,
    /// With --quantize-experts: also every non-expert projection (attention, shared experts,
    /// dense MLPs, latent projections) in this format (mxfp4, int4, q8). Routers, norms,
    /// embeddings, lm_head and one-row matrices stay as they are. Errors per tensor in
    /// `quantize_errors.json` too.
    #[arg(long, value_name = "FORMAT", requires = "quantize_experts")]
    pub quantize_dense: Option<ExpertFormat>,
    /// With --quantize-experts: lm_head too, in this format (selectable apart from the rest:
    /// the head's error reaches every logit).
    #[arg(long, value_name = "FORMAT", requires = "quantize_experts")]
    pub quantize_head: Option<ExpertFormat>,
    /// With --quantize-experts: the token embeddings too, in this format.
    #[arg(long, value_name = "FORMAT", requires = "quantize_experts")]
    pub quantize_embeddings: Option<ExpertFormat>,
    #[arg(long, short)]
    pub quiet: bool,
}

/// The `--spec` file format.
#[derive(Deserialize, Debug, Default)]
#[serde(deny_unknown_fields)]
struct Spec {
    name: Option<String>,
    mode: Option<Mode>,
    stripe_unit: Option<serde_json::Value>,
    drives: Option<Vec<PathBuf>>,
    #[serde(default)]
    comment: Option<String>,
}

pub fn run(a: &LayoutArgs) -> anyhow::Result<()> {
    let spec: Spec = match &a.spec {
        Some(p) => {
            let text = std::fs::read(p).with_context(|| format!("reading spec {}", p.display()))?;
            serde_json::from_slice(&text).with_context(|| format!("spec {}", p.display()))?
        }
        None => Spec::default(),
    };
    let _ = &spec.comment;
    let drives = if a.drives.is_empty() {
        spec.drives.clone().unwrap_or_default()
    } else {
        a.drives.clone()
    };
    if drives.is_empty() {
        bail!("no drives: give --drive PATH (1-4 times) or a --spec with \"drives\"");
    }
    if drives.len() > 4 {
        eprintln!(
            "warning: {} drives; deltafin is tuned and tested for 1-4",
            drives.len()
        );
    }
    let mode = a.mode.or(spec.mode).unwrap_or(Mode::Stripe);
    let unit = match (a.stripe_unit, &spec.stripe_unit) {
        (Some(u), _) => u,
        (None, Some(serde_json::Value::Number(n))) => n
            .as_u64()
            .context("stripe_unit must be a positive integer")?,
        (None, Some(serde_json::Value::String(s))) => parse_size(s).map_err(anyhow::Error::msg)?,
        (None, Some(other)) => bail!("stripe_unit {other} is neither a number nor a size string"),
        (None, None) => DEFAULT_STRIPE_UNIT,
    };
    let name = a
        .name
        .clone()
        .or(spec.name.clone())
        .context("give --name (or \"name\" in the spec)")?;
    let ckpt = Checkpoint::open(&a.model)
        .with_context(|| format!("opening checkpoint {}", a.model.display()))?;
    // The same config validation generate runs, before anything is written: a layout of a
    // checkpoint that could not be loaded would only fail later.
    deltafin_inference::ModelConfig::from_json(&ckpt.config)
        .with_context(|| format!("{}", a.model.join("config.json").display()))?;
    // Build the model over the checkpoint (its matrices keep ranges of the files' memory maps,
    // so little is read): every tensor the config implies must be there, shaped as it says.
    // A checkpoint that generate would refuse is refused now, before anything is written.
    let probe = deltafin_inference::DirSource::open(&a.model)
        .with_context(|| format!("opening {}", a.model.display()))?;
    deltafin_inference::Model::load(Arc::new(probe))
        .with_context(|| format!("checking that {} loads", a.model.display()))?;
    let naming = expert_naming(&ckpt.config)
        .with_context(|| format!("{}", a.model.join("config.json").display()))?;
    let skipped: Vec<&str> = skipped_tensors(&ckpt, &naming)
        .map(|t| t.info.name.as_str())
        .collect();
    if let Some(first) = skipped.first() {
        eprintln!(
            "note: {} tensors outside the language model (e.g. `{first}`) are not laid out",
            skipped.len()
        );
    }
    let quant = a.quantize_experts.map(|f| {
        Arc::new(
            QuantizeExperts::new(f, naming.clone()).with_dense(DenseFormats {
                projections: a.quantize_dense,
                head: a.quantize_head,
                embeddings: a.quantize_embeddings,
            }),
        )
    });
    let opts = LayoutOptions {
        name,
        drives,
        mode,
        stripe_unit: unit,
        force: a.force,
        naming,
        transform: quant.clone().map(|q| q as Arc<dyn ExpertTransform>),
        keep_free: a.keep_free,
    };
    let t = Instant::now();
    let m = write_layout(&ckpt, &opts, &Bar::new(a.quiet))?;
    let secs = t.elapsed().as_secs_f64();
    let experts = m.expert_records().count();
    println!(
        "laid out {} ({} {}, {} records, {} routed experts) over {} drive(s), {} mode, unit {}, in {:.1}s ({}/s)",
        m.name,
        m.model_type,
        human(m.logical_len),
        m.records.len(),
        experts,
        m.drives.len(),
        m.mode,
        human(m.stripe_unit),
        secs,
        human((m.logical_len as f64 / secs.max(1e-9)) as u64)
    );
    for d in &m.drives {
        println!(
            "  drive {}: {} ({})",
            d.index,
            d.path.join("manifest.json").display(),
            human(d.data_len)
        );
    }
    if let Some(q) = quant {
        let errors = q.errors();
        let report = serde_json::json!({
            "format": q.format.to_string(),
            "dense_formats": q.dense.any().then(|| q.dense.to_string()),
            "layout_id": m.layout_id,
            "tensors": errors,
        });
        let text = serde_json::to_vec_pretty(&report)?;
        for d in &m.drives {
            let p = d.path.join(QUANT_ERRORS_FILE);
            std::fs::write(&p, &text).with_context(|| format!("writing {}", p.display()))?;
        }
        let what = if q.dense.any() {
            format!("{} (resident weights: {})", q.format, q.dense)
        } else {
            q.format.to_string()
        };
        print_summary(&what, &errors);
    }
    Ok(())
}

/// Per-tensor quantization errors, next to each drive's manifest.
pub const QUANT_ERRORS_FILE: &str = "quantize_errors.json";

/// One line per projection kind (gate/up/down ...) and a total: tensors, bytes in/out, rel RMS
/// (mean, max) and max |error|.
fn print_summary(format: &str, errors: &[TensorQuantError]) {
    let mut kinds: std::collections::BTreeMap<String, Vec<&TensorQuantError>> = Default::default();
    for e in errors {
        let kind = e.tensor.rsplit('.').nth(1).unwrap_or("?");
        let kind = if e.dense {
            format!("dense {kind}")
        } else {
            kind.to_string()
        };
        kinds.entry(kind).or_default().push(e);
        kinds.entry("all".into()).or_default().push(e);
    }
    println!(
        "quantized routed experts to {format} ({} tensors):",
        errors.len()
    );
    println!(
        "  {:<28} {:>7} {:>10} {:>10} {:>7} {:>12} {:>12} {:>12}",
        "tensor",
        "count",
        "bytes in",
        "bytes out",
        "ratio",
        "rel rms mean",
        "rel rms max",
        "max |err|"
    );
    for (k, v) in &kinds {
        let n = v.len().max(1) as f64;
        let bi: u64 = v.iter().map(|e| e.bytes_in).sum();
        let bo: u64 = v.iter().map(|e| e.bytes_out).sum();
        println!(
            "  {:<28} {:>7} {:>10} {:>10} {:>6.2}x {:>12.5} {:>12.5} {:>12.5}",
            k,
            v.len(),
            human(bi),
            human(bo),
            bi as f64 / bo.max(1) as f64,
            v.iter().map(|e| e.rel_rms as f64).sum::<f64>() / n,
            v.iter().fold(0f32, |a, e| a.max(e.rel_rms)),
            v.iter().fold(0f32, |a, e| a.max(e.max_abs)),
        );
    }
}
