//! Record the routing of a greedy decode: one line per (token, MoE layer), `layer: expert ...`
//! in selection order. The expert cache's tests replay such traces.
//!
//! cargo run --release -p deltafin-inference --example routing_trace -- MODEL_DIR PROMPT_LEN NEW_TOKENS > trace.txt

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use deltafin_inference::model::ForwardTrace;
use deltafin_inference::{DirSource, LogitsMode, Model};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        return Err("usage: routing_trace MODEL_DIR PROMPT_LEN NEW_TOKENS".into());
    }
    let dir = PathBuf::from(&args[1]);
    let (prompt_len, new_tokens): (usize, usize) = (args[2].parse()?, args[3].parse()?);
    let model = Model::load(Arc::new(DirSource::open(&dir)?))?;
    let vocab = model.vocab_size() as u64;
    // A fixed pseudo-random prompt avoiding ids 0 and 1.
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut tokens: Vec<u32> = (0..prompt_len)
        .map(|_| {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (2 + (x >> 33) % (vocab.max(3) - 2)) as u32
        })
        .collect();
    let mut session = model.new_session();
    let out = std::io::stdout();
    let mut out = out.lock();
    writeln!(
        out,
        "# {} greedy, prompt {prompt_len} tokens, {new_tokens} decoded",
        dir.display()
    )?;
    let mut input = tokens.clone();
    for _ in 0..new_tokens {
        let mut trace = ForwardTrace::default();
        let logits =
            model.forward_with(&mut session, &input, LogitsMode::Last, Some(&mut trace))?;
        for (layer, routes) in &trace.routing {
            // Decode steps only (one position); the prompt's positions are folded in the cache's
            // first fill.
            if let Some(r) = routes.last() {
                let e: Vec<String> = r.experts.iter().map(|e| e.to_string()).collect();
                writeln!(out, "{layer}: {}", e.join(" "))?;
            }
        }
        let next = logits
            .last()
            .and_then(|row| {
                row.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i as u32)
            })
            .ok_or("no logits")?;
        tokens.push(next);
        input = vec![next];
    }
    Ok(())
}
