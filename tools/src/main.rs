//! The `deltafin` command line.

mod bench_io;
mod layout_cmd;
mod progress;
mod synth_cmd;
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
    /// Write a synthetic checkpoint in the Hugging Face format (config.json + safetensors).
    Synth(synth_cmd::SynthArgs),
    /// Lay a checkpoint out over 1-4 drives (replicated or striped), with blake3 hashes.
    Layout(layout_cmd::LayoutArgs),
    /// Read every byte of a layout on every drive and check every hash.
    Verify(verify_cmd::VerifyArgs),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Read expert records as decoding does; compare with fio on the same files.
    Io(bench_io::BenchIoArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Synth(a) => synth_cmd::run(a),
        Command::Layout(a) => layout_cmd::run(a),
        Command::Verify(a) => verify_cmd::run(a),
        Command::Bench(BenchCommand::Io(a)) => bench_io::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
