//! `deltafin generate`: stream tokens from a prompt, then print the measurements.

use std::io::Write;

use anyhow::{bail, Context};
use deltafin_inference::run::ModelPath;
use deltafin_inference::{GenerateConfig, SamplerConfig};

use crate::generate::args::GenerateArgs;
use crate::generate::loaded::load;
use crate::generate::report::{integrity_warnings, summary, to_json};
use crate::generate::tokenizer::find_tokenizer;
use deltafin_chat::detok::Detok;

pub fn run_generate(args: &GenerateArgs) -> anyhow::Result<()> {
    if let Some(p) = &args.spec.save_session {
        crate::util::check_output_file(p, "--save-session")?;
    }
    if let Some(p) = &args.save_routing {
        crate::util::check_output_file(p, "--save-routing")?;
    }
    // Cheap argument checks before a possibly long load.
    if args.prompt.is_none() && args.prompt_ids.as_ref().is_none_or(|v| v.is_empty()) {
        bail!("give --prompt TEXT or --prompt-ids 1,2,3");
    }
    SamplerConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    }
    .validate()?;
    if args.prompt.is_some() {
        let path = ModelPath::detect(&args.source.model)?;
        if find_tokenizer(&args.source, &path)?.is_none() {
            bail!(
                "--prompt needs a tokenizer (tokenizer.json or tiktoken.model) and none was found for {} (looked {}); give \
                 --tokenizer FILE, or pass token ids with --prompt-ids 1,2,3",
                args.source.model.display(),
                match path {
                    ModelPath::Layout(_) => {
                        "in the layout's source checkpoint folder and next to the manifest"
                    }
                    ModelPath::Directory(_) => "in the model directory",
                }
            );
        }
    }

    let prompt_positions = |tok: Option<&deltafin_chat::ChatTokenizer>, _ctx: usize| {
        let n = match (&args.prompt, &args.prompt_ids, tok) {
            (Some(text), _, Some(t)) => t.encode(text.as_str(), true)?.len(),
            (_, Some(ids), _) => ids.len(),
            // No tokenizer: the error comes below; reserve by characters meanwhile.
            (Some(text), _, None) => text.len(),
            (None, None, _) => 1,
        };
        Ok(n + args.max_new_tokens)
    };
    let mut loaded = load(&args.source, &prompt_positions)?;
    let prompt: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (Some(text), _) => {
            let (_, tok) = loaded
                .tokenizer
                .as_ref()
                .context("--prompt needs a tokenizer.json; use --prompt-ids")?;
            tok.encode(text.as_str(), true)
                .context("tokenizing the prompt")?
        }
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt TEXT or --prompt-ids 1,2,3"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty (no tokens)");
    }

    let mut config = GenerateConfig::for_model(loaded.model(), args.max_new_tokens);
    if args.ignore_eos {
        config.stop_tokens.clear();
    }
    config.stop_tokens.extend(&args.stop_ids);
    config.sampler = SamplerConfig {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
    };

    config.prefill_chunk = args.source.prefill_chunk;
    loaded.apply_budget(&args.source, prompt.len() + args.max_new_tokens)?;
    if args.save_routing.is_some() {
        loaded.model().record_routing(true);
    }
    deltafin_inference::spans::set_enabled(args.profile || args.trace.is_some());
    deltafin_inference::spans::reset();
    deltafin_storage::timeline::set_enabled(args.trace.is_some());

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut detok = loaded.tokenizer.as_ref().map(|(_, t)| Detok::new(t, true));
    let mut text = String::new();
    let mut io_err: Option<std::io::Error> = None;
    let mut detok_err: Option<anyhow::Error> = None;
    let mut spec_metrics = serde_json::Map::new();
    // The profile of the prompt's prefill, taken when the first token comes; the rest of the
    // run is decode.
    let mut prefill_profile: Option<Vec<deltafin_inference::spans::PhaseTime>> = None;
    let result = crate::speculative_cmd::run(
        &args.spec,
        &loaded,
        &prompt,
        &config,
        &mut spec_metrics,
        &mut |id| {
            if args.profile && prefill_profile.is_none() {
                prefill_profile = Some(deltafin_inference::spans::report());
                deltafin_inference::spans::reset();
            }
            let piece = match detok.as_mut() {
                Some(d) => match d.push(id) {
                    Ok(s) => s,
                    Err(e) => {
                        detok_err = Some(e.into());
                        return false;
                    }
                },
                None => format!("{id} "),
            };
            text.push_str(&piece);
            if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
                io_err = Some(e);
                return false;
            }
            true
        },
    );
    if let Some(e) = detok_err {
        return Err(e);
    }
    if let Some(e) = io_err {
        // A closed pipe (e.g. `| head`) is not worth a report.
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(());
        }
        return Err(e).context("writing to stdout");
    }
    let run = result.context("generating")?;
    deltafin_inference::spans::set_enabled(false);
    deltafin_storage::timeline::set_enabled(false);
    if let Some(p) = &args.trace {
        deltafin_storage::timeline::write_jsonl(p, &deltafin_storage::timeline::take())
            .with_context(|| format!("--trace {}", p.display()))?;
    }
    let profile = args.profile.then(deltafin_inference::spans::report);
    if let Some(p) = &args.save_routing {
        let counts = loaded
            .model()
            .routing_counts()
            .context("routing was not recorded")?;
        counts
            .save(p)
            .with_context(|| format!("--save-routing {}", p.display()))?;
    }
    let output = &run.output;
    // Flush text held back by the detokenizer (an incomplete character at the very end).
    let text = match &loaded.tokenizer {
        Some((_, tok)) => {
            let full = tok
                .decode(&output.tokens, true)
                .context("decoding tokens")?;
            if let Some(rest) = full.strip_prefix(text.as_str()) {
                out.write_all(rest.as_bytes())?;
            }
            Some(full)
        }
        None => None,
    };
    writeln!(out)?;
    out.flush()?;

    let stats = summary(&run, &loaded, prompt.len());
    for (what, p) in [("prefill", &prefill_profile), ("decode", &profile)] {
        let Some(p) = p else { continue };
        let forwards = p
            .iter()
            .find(|x| x.phase == "forward")
            .map_or(1, |x| x.calls.max(1));
        eprintln!("profile, {what}: {forwards} forward pass(es), per forward:");
        eprintln!("  {:24} {:>10} {:>10}", "phase", "self ms", "total ms");
        for x in p {
            eprintln!(
                "  {:24} {:10.3} {:10.3}",
                x.phase,
                1e3 * x.self_s / forwards as f64,
                1e3 * x.total_s / forwards as f64
            );
        }
    }
    for w in integrity_warnings(&loaded) {
        eprintln!("{w}");
    }
    if args.json {
        eprintln!("{stats}");
        let mut v = to_json(&run, &loaded, &prompt);
        if let Some(obj) = v.as_object_mut() {
            obj.extend(spec_metrics);
        }
        if let Some(t) = text {
            v["text"] = t.into();
        }
        if let Some(p) = &profile {
            v["profile"] = serde_json::json!({
                "prefill": prefill_profile,
                "decode": p,
            });
        }
        if let Some(p) = &args.prompt {
            v["prompt"] = p.clone().into();
        }
        writeln!(out, "{}", serde_json::to_string(&v)?)?;
    } else {
        writeln!(out, "{stats}")?;
    }
    out.flush()?;
    Ok(())
}
