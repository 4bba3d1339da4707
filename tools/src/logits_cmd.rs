//! `deltafin logits`: one forward pass over token ids; the logits [len, vocab] written as f32
//! safetensors.

use std::collections::BTreeMap;
use std::io::Write;

use anyhow::{bail, Context};
use deltafin_formats::Dtype;
use deltafin_storage::safetensors::{write_header, TensorSpec};

use crate::generate::args::LogitsArgs;
use crate::generate::loaded::load;

pub fn run_logits(args: &LogitsArgs) -> anyhow::Result<()> {
    if args.ids.is_empty() {
        bail!("give --ids 1,2,3");
    }
    crate::util::check_output_file(&args.out, "--out")?;
    let mut loaded = load(&args.source, &|_, _| Ok(args.ids.len()))?;
    loaded.apply_budget(&args.source, args.ids.len())?;
    let model = loaded.model();
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
        loaded.opened.load_time.as_secs_f64()
    );
    Ok(())
}
