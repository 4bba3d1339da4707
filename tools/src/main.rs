//! The `deltafin` command line.

mod bench_compute;
mod bench_generate;
mod bench_io;
mod chat_cmd;
mod conversation;
mod demo;
mod generate;
mod layout_cmd;
mod logits_cmd;
mod plan_cmd;
mod progress;
mod serve;
mod speculative_cmd;
mod synth_cmd;
mod template_cmd;
mod util;
mod verify_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "deltafin",
    version,
    about = "Run Mixture-of-Experts models larger than RAM by streaming experts from 1-4 SSDs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The main job end to end on a small synthetic model: synthesize, lay out over four
    /// directories, verify, benchmark reads, generate under a small RAM budget.
    Demo(demo::DemoArgs),
    /// Write a synthetic checkpoint in the Hugging Face format (config.json + safetensors).
    Synth(synth_cmd::SynthArgs),
    /// Lay a checkpoint out over 1-4 drives (replicated or striped), with blake3 hashes.
    Layout(layout_cmd::LayoutArgs),
    /// Read every byte of a layout on every drive and check every hash.
    Verify(verify_cmd::VerifyArgs),
    /// Generate tokens from a prompt (model directory or layout), streaming them as they come.
    Generate(generate::args::GenerateArgs),
    /// One forward pass over token ids; write the logits [len, vocab] as f32 safetensors.
    Logits(generate::args::LogitsArgs),
    /// Render a chat template with the given inputs and print exactly the rendered text.
    Template(template_cmd::TemplateArgs),
    /// Talk to the model in the terminal (its chat template; each turn prefills only its new
    /// tokens).
    Chat(chat_cmd::ChatArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (chat and text completions).
    Serve(serve::ServeArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// The RAM plan and predicted decode and time-to-first-token of a model on a machine (RAM
    /// size, drives' read rates), from its config.json alone, with the cost model written out.
    Plan(plan_cmd::PlanArgs),
}

impl Command {
    /// True when the command reads its model from a layout (and so under a RAM budget).
    fn reads_a_layout(&self) -> bool {
        use deltafin_inference::run::open::ModelPath;
        let is_layout =
            |p: &std::path::Path| matches!(ModelPath::detect(p), Ok(ModelPath::Layout(_)));
        match self {
            Command::Demo(_) | Command::Bench(BenchCommand::Generate(_)) => true,
            Command::Generate(a) => is_layout(&a.source.model),
            Command::Logits(a) => is_layout(&a.source.model),
            Command::Chat(a) => is_layout(&a.source.model),
            Command::Serve(a) => is_layout(&a.source.model),
            Command::Bench(BenchCommand::Compute(a)) => is_layout(&a.model),
            _ => false,
        }
    }
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Read expert records as decoding does; compare with fio on the same files.
    Io(bench_io::BenchIoArgs),
    /// Generation over a layout: standard prompts, 128 and 512 new tokens, repeats, medians.
    Generate(bench_generate::BenchGenerateArgs),
    /// Prefill and decode speed of one loaded model after a warm-up, as llama-bench measures.
    Compute(bench_compute::BenchComputeArgs),
}

fn main() {
    let cli = Cli::parse();
    // Every command: peak RSS tracks what is live, without mapping each prefill buffer anew;
    // one reading a layout (held to a RAM budget) also reuses freed memory across threads.
    deltafin_inference::run::memory::tame_allocator(cli.command.reads_a_layout());
    // The command runs on a rayon worker, so that the model's many parallel kernel calls per
    // token start on a pool thread; from the main thread each call is handed to the pool and
    // waits for a wake-up (benches/results/pool_dispatch.json).
    // Rayon's workers get 2 MiB stacks by default; the command runs on one, so give them the
    // main thread's usual 8 MiB.
    let _ = rayon::ThreadPoolBuilder::new()
        .stack_size(8 << 20)
        .build_global();
    let result = rayon::scope(|_| run(&cli.command));
    if let Err(e) = result {
        // Library errors already spell out their causes; print each link of the chain once.
        let mut msg = e.to_string();
        for cause in e.chain().skip(1) {
            let c = cause.to_string();
            if !msg.contains(&c) {
                msg.push_str(": ");
                msg.push_str(&c);
            }
        }
        eprintln!("error: {msg}");
        std::process::exit(1);
    }
}

fn run(command: &Command) -> anyhow::Result<()> {
    // A misspelt kernel setting would otherwise be ignored, and an A/B would compare a run
    // with itself.
    let setting_errors = deltafin_inference::kernels::isa::KernelConfig::env_errors();
    if !setting_errors.is_empty() {
        anyhow::bail!("{}", setting_errors.join("; "));
    }
    match command {
        Command::Synth(a) => synth_cmd::run(a),
        Command::Layout(a) => layout_cmd::run(a),
        Command::Verify(a) => verify_cmd::run(a),
        Command::Bench(BenchCommand::Io(a)) => bench_io::run(a),
        Command::Bench(BenchCommand::Generate(a)) => bench_generate::run(a),
        Command::Bench(BenchCommand::Compute(a)) => bench_compute::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Generate(a) => generate::run::run_generate(a),
        Command::Logits(a) => logits_cmd::run_logits(a),
        Command::Template(a) => template_cmd::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Chat(a) => chat_cmd::run(a),
        Command::Plan(a) => plan_cmd::run(a),
    }
}
