//! `deltafin layout --quantize-experts F --quantize-dense D`: on every architecture, a BF16
//! checkpoint laid out with its non-expert projections quantized holds exactly the bytes
//! `synth --format F --quantize-dense D` writes from the same values (both RTN), and the
//! layout's model computes exactly what that checkpoint's model computes. Routers and norms
//! stay as they were, lm_head and the embeddings unless asked for; every quantized resident
//! tensor has its error in the transform's report.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use deltafin_inference::quantize::{DenseFormats, ExpertFormat, QuantizeExperts};
use deltafin_inference::synth::presets::{preset_config, SYNTH_ARCHS};
use deltafin_inference::synth::{is_dense_projection, write_synth, SynthFormat};
use deltafin_inference::weights::WeightSource;
use deltafin_inference::{DirSource, LayoutSource, LayoutSourceOptions, Model};
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::checkpoint_writer::WriteOptions;
use deltafin_storage::engine::HashCheck;
use deltafin_storage::layout::{write_layout, ExpertTransform, LayoutOptions, NoProgress};
use deltafin_storage::manifest::RecordId;
use deltafin_storage::stripe::Mode;

const SEED: u64 = 5;

fn synth(dir: &std::path::Path, arch: &str, format: SynthFormat) {
    let cfg = preset_config(arch, "tiny").unwrap();
    let opts = WriteOptions {
        seed: SEED,
        shard_bytes: 1 << 30,
        force: false,
    };
    write_synth(dir, &cfg, format, &opts, &NoProgress).unwrap();
}

#[test]
fn dense_quantized_layouts_equal_dense_quantized_checkpoints() {
    let base = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..7).map(|i| (i * 53 + 11) % 500).collect();
    for arch in SYNTH_ARCHS {
        let bf16_dir = base.path().join(format!("{arch}-bf16"));
        synth(&bf16_dir, arch, SynthFormat::Bf16);
        let ckpt = Checkpoint::open(&bf16_dir).unwrap();
        let naming = deltafin_inference::family::expert_naming(&ckpt.config).unwrap();
        let all = DenseFormats {
            projections: Some(ExpertFormat::Int4),
            head: Some(ExpertFormat::Q8),
            embeddings: Some(ExpertFormat::Mxfp4),
        };
        for (experts, dense) in [
            (
                ExpertFormat::Int4,
                DenseFormats::projections(ExpertFormat::Q8),
            ),
            (
                ExpertFormat::Mxfp4,
                DenseFormats::projections(ExpertFormat::Mxfp4),
            ),
            (ExpertFormat::Q8, all),
        ] {
            let f = SynthFormat::Packed { experts, dense };
            let packed_dir = base.path().join(format!("{arch}-{f}"));
            synth(&packed_dir, arch, f);
            let drive = tempfile::tempdir().unwrap();
            let q = Arc::new(QuantizeExperts::new(experts, naming.clone()).with_dense(dense));
            let mut head_packed = false;
            let mut embeddings_packed = false;
            let opts = LayoutOptions {
                name: "d".into(),
                drives: vec![drive.path().to_path_buf()],
                mode: Mode::Stripe,
                stripe_unit: 8192,
                force: false,
                naming: naming.clone(),
                transform: Some(q.clone() as Arc<dyn ExpertTransform>),
                keep_free: 0,
            };
            let m = write_layout(&ckpt, &opts, &NoProgress).unwrap();

            // The resident records: each dense projection became its packed parts, the rest
            // is as it was.
            let src = LayoutSource::open(
                &m.drives[0].path,
                &LayoutSourceOptions {
                    threads_per_drive: 2,
                    hash_check: HashCheck::All,
                    ..LayoutSourceOptions::default()
                },
            )
            .unwrap();
            let packed = Checkpoint::open(&packed_dir).unwrap();
            let mut dense_records = 0;
            for r in &m.records {
                let RecordId::Resident { group } = &r.id else {
                    continue;
                };
                let info = &ckpt.get(group).unwrap().info;
                let module = group
                    .trim_end_matches(".weight")
                    .rsplit('.')
                    .next()
                    .unwrap();
                let want = match module {
                    "lm_head" => dense.head,
                    "embed_tokens" => dense.embeddings,
                    _ if is_dense_projection(group) => dense.projections,
                    _ => None,
                };
                let quantized = want.is_some()
                    && info.shape.len() == 2
                    && info.shape[0] > 1
                    && info.shape[1].is_multiple_of(32);
                let names: Vec<&str> = r.tensors.iter().map(|t| t.name.as_str()).collect();
                if quantized {
                    head_packed |= module == "lm_head";
                    embeddings_packed |= module == "embed_tokens";
                    dense_records += 1;
                    assert!(
                        names.iter().all(|n| n.contains(".weight_")),
                        "{arch} {f}: {group} -> {names:?}"
                    );
                } else {
                    assert_eq!(names, [group.as_str()], "{arch} {f}");
                }
                // Every tensor's bytes equal the packed checkpoint's.
                for t in &r.tensors {
                    let ours = src.tensor(&t.name).unwrap();
                    assert_eq!(
                        ours.bytes,
                        packed.bytes(&t.name).unwrap(),
                        "{arch} {f}: {}",
                        t.name
                    );
                }
            }
            assert!(dense_records > 0, "{arch}: no dense projection quantized");
            assert_eq!(head_packed, dense.head.is_some(), "{arch} {f}: lm_head");
            assert_eq!(
                embeddings_packed,
                dense.embeddings.is_some(),
                "{arch} {f}: embeddings"
            );
            let errors = q.errors();
            let dense_errors: Vec<_> = errors.iter().filter(|e| e.dense).collect();
            assert_eq!(dense_errors.len(), dense_records, "{arch} {f}");
            assert!(dense_errors
                .iter()
                .all(|e| e.rel_rms > 0.0 && e.rel_rms < 0.2 && e.bytes_out < e.bytes_in));
            assert!(m.meta.contains_key("quantize_dense"));

            // The same model either way, bit for bit.
            let logits = |src: Arc<dyn WeightSource>| {
                let model = Model::load(src).unwrap();
                model
                    .forward(&mut model.new_session(), &prompt)
                    .unwrap()
                    .data
            };
            let from_layout = logits(Arc::new(src));
            let from_dir = logits(Arc::new(DirSource::open(&packed_dir).unwrap()));
            assert_eq!(from_layout, from_dir, "{arch} {f}");
            println!(
                "{arch} {f}: {dense_records} resident weights quantized at layout time; logits equal the packed checkpoint's"
            );
        }
    }
}
