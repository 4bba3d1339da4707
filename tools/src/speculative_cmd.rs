//! `deltafin generate` flags for speculative decoding (`--draft ngram|replay`,
//! `--draft-model DIR`) and session snapshots (`--save-session` / `--load-session`), and the
//! generation step that uses them.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use deltafin_inference::snapshot::{self, model_hash};
use deltafin_inference::speculative::{
    speculative_generate, Drafter, ModelDrafter, NgramDrafter, ReplayDrafter, SpecConfig,
};
use deltafin_inference::{generate, DirSource, GenerateConfig, GenerateOutput, Model};

use deltafin_inference::run::{measure_generation, Measured};

use crate::generate::args::{DraftKind, SpecArgs};
use crate::generate::loaded::Loaded;

/// Generate as `measure_generation` does, with the drafter and snapshots `args` ask for; their
/// metrics go into `metrics`.
pub(crate) fn run(
    args: &SpecArgs,
    loaded: &Loaded,
    prompt: &[u32],
    config: &GenerateConfig,
    metrics: &mut serde_json::Map<String, serde_json::Value>,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> anyhow::Result<Measured> {
    let model = loaded.model();
    let layout = loaded.opened.layout.as_deref();
    if !args.active() {
        return measure_generation(layout, on_token, &mut |on_tok| {
            Ok(generate(
                model,
                &mut model.new_session(),
                prompt,
                config,
                on_tok,
            )?)
        });
    }
    let vocab = model.vocab_size();
    let mut drafter: Option<Box<dyn Drafter>> = match (&args.draft, &args.draft_model) {
        (Some(DraftKind::Ngram), _) => Some(Box::new(NgramDrafter::default())),
        (Some(DraftKind::Replay), _) => {
            let ids = args
                .replay_ids
                .clone()
                .context("--draft replay needs --replay-ids 1,2,3")?;
            Some(Box::new(ReplayDrafter::new(
                prompt.len(),
                ids,
                args.replay_corruption,
                vocab,
                config.sampler.seed,
            )?))
        }
        (None, Some(dir)) => {
            let src = DirSource::open(dir)
                .with_context(|| format!("opening draft model {}", dir.display()))?;
            let m = Model::load(Arc::new(src)).context("loading the draft model")?;
            Some(Box::new(ModelDrafter::new(
                Arc::new(m),
                vocab,
                &config.sampler,
            )?))
        }
        (None, None) => None,
    };
    if drafter.is_some() && args.draft_k == 0 {
        bail!("--draft-k must be at least 1");
    }
    let needs_hash = args.save_session.is_some() || args.load_session.is_some();
    let hash = if needs_hash {
        let extra = match layout {
            Some(src) => serde_json::to_vec(src.manifest()).unwrap_or_default(),
            None => Vec::new(),
        };
        Some(model_hash(model, &extra))
    } else {
        None
    };
    let spec = SpecConfig {
        max_k: args.draft_k,
        adaptive: !args.fixed_k,
        bytes_read: loaded.opened.layout.clone().map(|s| {
            Arc::new(move || s.stats().fetch.read_bytes) as Arc<dyn Fn() -> u64 + Send + Sync>
        }),
    };
    let mut m = serde_json::Map::new();
    let measured = measure_generation::<anyhow::Error>(layout, on_token, &mut |on_tok| {
        let (mut session, reused) = match (&args.load_session, &hash) {
            (Some(path), Some(hash)) => {
                let t = Instant::now();
                let r = snapshot::load(path, model, hash);
                let (session, reused) = match r {
                    Ok((mut s, history)) => {
                        let reused = snapshot::reuse_prefix(&mut s, &history, prompt)?;
                        (s, reused)
                    }
                    Err(e) => {
                        eprintln!(
                            "note: not using session {}: {e}; starting from scratch",
                            path.display()
                        );
                        (model.new_session(), 0)
                    }
                };
                m.insert("snapshot_load_s".into(), t.elapsed().as_secs_f64().into());
                (session, reused)
            }
            _ => (model.new_session(), 0),
        };
        if args.save_session.is_some() {
            // Keep each position's last-layer output in the snapshot too, so that a later
            // prompt ending inside it needs no forward pass before its first new token.
            model.record_outputs(&mut session);
        }
        m.insert("prefix_reused_tokens".into(), reused.into());
        let output: GenerateOutput = match drafter.as_deref_mut() {
            Some(d) => {
                let (out, st) = speculative_generate(
                    model,
                    &mut session,
                    &prompt[..reused],
                    &prompt[reused..],
                    config,
                    &spec,
                    d,
                    on_tok,
                )?;
                m.insert("drafter".into(), d.name().into());
                m.insert("draft_tokens".into(), st.draft_tokens.into());
                m.insert("accepted_tokens".into(), st.accepted_tokens.into());
                m.insert("acceptance_rate".into(), st.acceptance_rate().into());
                m.insert("verify_passes".into(), st.verify_passes.into());
                m.insert("plain_decode_steps".into(), st.plain_steps.into());
                m.insert(
                    "bytes_read_per_verify".into(),
                    st.bytes_read_per_verify().into(),
                );
                m.insert("verify_s".into(), st.verify_time.as_secs_f64().into());
                m.insert("draft_s".into(), st.draft_time.as_secs_f64().into());
                m.insert("draft_k_histogram".into(), st.k_histogram.clone().into());
                out
            }
            None => generate(model, &mut session, &prompt[reused..], config, on_tok)?,
        };
        if let (Some(path), Some(hash)) = (&args.save_session, &hash) {
            let t = Instant::now();
            let mut history = prompt.to_vec();
            history.extend_from_slice(&output.tokens);
            history.truncate(session.len());
            snapshot::save(path, model, hash, &session, &history)
                .with_context(|| format!("saving the session to {}", path.display()))?;
            m.insert("snapshot_save_s".into(), t.elapsed().as_secs_f64().into());
            m.insert("snapshot_tokens".into(), history.len().into());
        }
        Ok(output)
    })?;
    metrics.extend(m);
    Ok(measured)
}
