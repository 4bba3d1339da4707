//! `deltafin demo`: the main job end to end on a small synthetic model, in under a minute:
//! synthesize, lay out over four directories (stripe), verify every hash, benchmark expert
//! reads (and fio when installed), then generate with streaming under a small RAM budget and
//! print the statistics. Every step runs this same binary as a child process, so the peak RSS
//! reported by the generate step is that of generation alone.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context};

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Work directory (default: deltafin-demo under the system temp dir). Holds the checkpoint
    /// and four drive directories.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Synthetic model preset.
    #[arg(long, default_value = "small")]
    pub preset: String,
    /// RAM budget of the generate step (small, so experts are streamed and cached).
    #[arg(long, default_value = "160M")]
    pub ram_budget: String,
    /// Tokens to generate.
    #[arg(short = 'n', long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Seconds of `bench io`.
    #[arg(long, default_value = "2", value_parser = crate::util::parse_seconds)]
    pub bench_seconds: f64,
    /// Remove the work directory afterwards.
    #[arg(long)]
    pub clean: bool,
}

fn step(title: &str, args: &[&str]) -> anyhow::Result<()> {
    eprintln!("\n== {title}\n$ deltafin {}", args.join(" "));
    let exe = std::env::current_exe().context("locating the deltafin binary")?;
    let t = Instant::now();
    let status = Command::new(exe)
        .args(args)
        .status()
        .with_context(|| format!("running deltafin {}", args.join(" ")))?;
    if !status.success() {
        bail!("step `{title}` failed ({status})");
    }
    eprintln!("({:.1} s)", t.elapsed().as_secs_f64());
    Ok(())
}

fn s(p: &Path) -> anyhow::Result<&str> {
    p.to_str()
        .with_context(|| format!("{} is not valid UTF-8", p.display()))
}

pub fn run(a: &DemoArgs) -> anyhow::Result<()> {
    let start = Instant::now();
    let dir = a
        .dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("deltafin-demo"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let model = dir.join(format!("model-{}", a.preset));
    let drives: Vec<PathBuf> = (0..4).map(|i| dir.join(format!("drive{i}"))).collect();
    for d in &drives {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    eprintln!(
        "deltafin demo in {} (a synthetic deepseek_v3 `{}` model striped over 4 directories)",
        dir.display(),
        a.preset
    );

    step(
        "synthesize a checkpoint (config.json + bf16 safetensors)",
        &[
            "synth",
            "--out",
            s(&model)?,
            "--arch",
            "deepseek_v3",
            "--preset",
            &a.preset,
            "--seed",
            "1",
            "--force",
            "-q",
        ],
    )?;
    let mut layout = vec!["layout", "--model", s(&model)?];
    for d in &drives {
        layout.push("--drive");
        layout.push(s(d)?);
    }
    layout.extend(["--mode", "stripe", "--name", "demo", "--force", "-q"]);
    step(
        "lay it out over four drives (stripe, 512 KiB units)",
        &layout,
    )?;
    let layout_dir = drives[0].join("demo");
    step(
        "verify every byte against its blake3 hash",
        &["verify", s(&layout_dir)?, "-q"],
    )?;
    let secs = format!("{}", a.bench_seconds);
    step(
        "benchmark expert reads (and fio on the same files, when installed)",
        &["bench", "io", s(&layout_dir)?, "--seconds", &secs],
    )?;
    let n = a.max_new_tokens.to_string();
    // A fixed prompt, kept inside the vocabulary of whatever preset was synthesized.
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(model.join("config.json")).context("reading the synthesized config")?,
    )
    .context("parsing the synthesized config")?;
    let vocab = config["vocab_size"].as_u64().unwrap_or(512).max(2);
    let prompt = [1u64, 17, 42, 99, 123, 7, 256, 1024]
        .iter()
        .map(|&t| (t % vocab).to_string())
        .collect::<Vec<_>>()
        .join(",");
    step(
        "generate, streaming experts under a small RAM budget",
        &[
            "generate",
            "--model",
            s(&layout_dir)?,
            "--prompt-ids",
            &prompt,
            "-n",
            &n,
            "--ignore-eos",
            "--ram-budget",
            &a.ram_budget,
            "-q",
        ],
    )?;
    if a.clean {
        std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    eprintln!(
        "\ndemo finished in {:.1} s (work directory: {})",
        start.elapsed().as_secs_f64(),
        if a.clean {
            "removed".to_string()
        } else {
            dir.display().to_string()
        }
    );
    Ok(())
}
