//! Helpers of the storage integration tests: small MoE-shaped checkpoints written with the
//! crate's own checkpoint writer (the storage crate knows no model family, so the tests name
//! their own tensors), drives as plain folders, layout and engine options.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use deltafin_formats::Dtype;
use deltafin_storage::backend::IoBackend;
use deltafin_storage::checkpoint::Checkpoint;
use deltafin_storage::checkpoint_writer::{write_checkpoint, Fill, PlannedTensor, WriteOptions};
use deltafin_storage::engine::{Engine, EngineConfig, HashCheck, Lane, Target};
use deltafin_storage::expert_parts::expert_sources;
use deltafin_storage::layout::{open_layout, LayoutOptions, NoProgress};
use deltafin_storage::manifest::RecordId;
use deltafin_storage::naming::ExpertNaming;
use deltafin_storage::safetensors::TensorSpec;
use deltafin_storage::stripe::Mode;

/// Shapes of a test model.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub layers: u64,
    /// Layers before this one are dense (no experts).
    pub first_moe: u64,
    pub experts: u64,
    pub hidden: u64,
    pub expert_inter: u64,
}

/// Four layers, the first dense, 16 experts of 12 KiB (like a tiny DeepSeek-V3).
pub const MODEL_A: Shape = Shape {
    layers: 4,
    first_moe: 1,
    experts: 16,
    hidden: 64,
    expert_inter: 32,
};

/// Four MoE layers, 16 experts (like a tiny Qwen3-MoE).
pub const MODEL_B: Shape = Shape {
    layers: 4,
    first_moe: 0,
    experts: 16,
    hidden: 64,
    expert_inter: 48,
};

/// The naming the test models use: `model.layers.N.mlp.experts.E.part`.
pub fn naming() -> ExpertNaming {
    ExpertNaming::hf("mlp.experts.")
}

fn lin(name: String, out: u64, inp: u64) -> PlannedTensor {
    PlannedTensor {
        spec: TensorSpec::new(name, Dtype::Bf16, &[out, inp]),
        fill: Fill::Linear { fan_in: inp },
    }
}

/// Write a test model of `shape` (seed `seed`, shards of 300 KiB) and open it.
pub fn write_model(dir: &Path, shape: Shape, seed: u64) -> Checkpoint {
    let h = shape.hidden;
    let mut t = vec![lin("model.embed_tokens.weight".into(), 512, h)];
    for l in 0..shape.layers {
        let p = format!("model.layers.{l}");
        t.push(PlannedTensor {
            spec: TensorSpec::new(format!("{p}.input_layernorm.weight"), Dtype::Bf16, &[h]),
            fill: Fill::Constant(1.0),
        });
        for m in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            t.push(lin(format!("{p}.self_attn.{m}.weight"), h, h));
        }
        if l < shape.first_moe {
            t.push(lin(format!("{p}.mlp.gate_proj.weight"), 2 * h, h));
            t.push(lin(format!("{p}.mlp.up_proj.weight"), 2 * h, h));
            t.push(lin(format!("{p}.mlp.down_proj.weight"), h, 2 * h));
            continue;
        }
        t.push(lin(format!("{p}.mlp.gate.weight"), shape.experts, h));
        for e in 0..shape.experts {
            let i = shape.expert_inter;
            t.push(lin(format!("{p}.mlp.experts.{e}.gate_proj.weight"), i, h));
            t.push(lin(format!("{p}.mlp.experts.{e}.up_proj.weight"), i, h));
            t.push(lin(format!("{p}.mlp.experts.{e}.down_proj.weight"), h, i));
        }
    }
    t.push(lin("lm_head.weight".into(), 512, h));
    let opts = WriteOptions {
        seed,
        shard_bytes: 300 << 10,
        force: false,
    };
    let config = serde_json::json!({"model_type": "test_moe", "n_routed_experts": shape.experts});
    write_checkpoint(dir, &config, t, &opts, &|_| Ok(Vec::new()), &NoProgress).unwrap();
    Checkpoint::open(dir).unwrap()
}

/// `n` drive folders under `root`.
pub fn drives(root: &Path, n: usize) -> Vec<PathBuf> {
    (0..n)
        .map(|i| {
            let d = root.join(format!("drive{i}"));
            std::fs::create_dir_all(&d).unwrap();
            d
        })
        .collect()
}

/// Layout `m` over `drives` in `mode` with stripe unit `unit`.
pub fn opts(drives: Vec<PathBuf>, mode: Mode, unit: u64) -> LayoutOptions {
    LayoutOptions {
        name: "m".into(),
        drives,
        mode,
        stripe_unit: unit,
        force: false,
        naming: naming(),
        transform: None,
        keep_free: 0,
    }
}

/// An engine config for tests: `threads` per drive, 64 MiB of buffers, `hash`, `backend`.
pub fn config(threads: usize, hash: HashCheck, backend: Arc<dyn IoBackend>) -> EngineConfig {
    EngineConfig {
        threads_per_drive: threads,
        buffer_cap_bytes: 64 << 20,
        queue_capacity: 1024,
        hash_check: hash,
        backend,
        ..EngineConfig::default()
    }
}

/// An engine over layout `m` on `dirs` (3 threads per drive).
pub fn engine_with(dirs: &[PathBuf], backend: Arc<dyn IoBackend>, hash: HashCheck) -> Engine {
    let (manifest, dirs) = open_layout(&dirs[0].join("m")).unwrap();
    Engine::open(Arc::new(manifest), &dirs, config(3, hash, backend)).unwrap()
}

/// Every expert part and resident tensor read through the engine equals the checkpoint bytes.
pub fn check_all_records(ckpt: &Checkpoint, engine: &Engine) {
    let m = engine.manifest().clone();
    let experts = expert_sources(ckpt, &naming()).unwrap();
    let all: Vec<usize> = (0..m.records.len()).collect();
    let (rx, _tickets) = engine.fetch(&all, Lane::Demand).unwrap();
    let mut seen = 0;
    for c in rx.iter().take(all.len()) {
        let loaded = c.result.unwrap();
        let Target::Record(i) = loaded.target else {
            panic!()
        };
        let rec = &m.records[i];
        assert_eq!(loaded.buf.len() as u64, rec.len);
        match &rec.id {
            RecordId::Resident { group } => {
                assert_eq!(&loaded.buf[..], ckpt.bytes(group).unwrap(), "{group}");
            }
            RecordId::Expert { layer, expert } => {
                let src = experts
                    .iter()
                    .find(|e| e.layer == *layer && e.expert == *expert)
                    .unwrap();
                for (t, p) in engine.record_tensors(i).iter().zip(&src.parts) {
                    assert_eq!(t.name, p.part);
                    let got = &loaded.buf[t.offset as usize..(t.offset + t.len) as usize];
                    assert_eq!(
                        got,
                        ckpt.slice(p.file, p.offset, p.len),
                        "{} {}",
                        rec.id,
                        t.name
                    );
                }
            }
        }
        seen += 1;
    }
    assert_eq!(seen, all.len());
}

/// Record indices of the expert records of a manifest.
pub fn expert_indices(m: &deltafin_storage::manifest::Manifest) -> Vec<usize> {
    m.records
        .iter()
        .enumerate()
        .filter(|(_, r)| matches!(r.id, RecordId::Expert { .. }))
        .map(|(i, _)| i)
        .collect()
}

/// A backend whose reads wait until [`Gate::open`], logging each read's offset as it starts:
/// tests of read order queue their requests behind a held worker, then let it go.
#[derive(Debug, Default)]
pub struct Gate {
    open: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
    pub log: std::sync::Mutex<Vec<u64>>,
}

impl Gate {
    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }
    pub fn close(&self) {
        *self.open.lock().unwrap() = false;
        self.log.lock().unwrap().clear();
    }
    /// Reads started so far.
    pub fn started(&self) -> usize {
        self.log.lock().unwrap().len()
    }
    fn wait(&self, offset: u64) {
        self.log.lock().unwrap().push(offset);
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
    }
}

/// [`Gate`] in front of the real files.
#[derive(Debug)]
pub struct GatedBackend {
    pub gate: Arc<Gate>,
    inner: deltafin_storage::backend::PosixBackend,
}

impl GatedBackend {
    pub fn new(gate: Arc<Gate>) -> Self {
        GatedBackend {
            gate,
            inner: deltafin_storage::backend::PosixBackend::default(),
        }
    }
}

#[derive(Debug)]
struct GatedFile {
    gate: Arc<Gate>,
    inner: Arc<dyn deltafin_storage::backend::IoFile>,
}

impl IoBackend for GatedBackend {
    fn open(&self, path: &Path) -> std::io::Result<Arc<dyn deltafin_storage::backend::IoFile>> {
        Ok(Arc::new(GatedFile {
            gate: self.gate.clone(),
            inner: self.inner.open(path)?,
        }))
    }
}

impl deltafin_storage::backend::IoFile for GatedFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        self.gate.wait(offset);
        self.inner.read_at(buf, offset)
    }
    fn is_direct(&self) -> bool {
        self.inner.is_direct()
    }
}

/// Wait (yielding) until `cond` holds; panics after a generous bound so a broken engine fails
/// the test instead of hanging it.
pub fn wait_until(what: &str, cond: impl Fn() -> bool) {
    for _ in 0..200_000 {
        if cond() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(50));
    }
    panic!("timed out waiting until {what}");
}

/// MODEL_A laid out on one drive under `root`, opened by an engine with one worker per drive
/// that a [`Gate`] holds: with the first read held, the order of the rest is decided by the
/// lanes alone, not by timing. Returns the engine, the layout's manifest and the gate.
pub fn gated_engine(root: &Path) -> (Engine, deltafin_storage::manifest::Manifest, Arc<Gate>) {
    let ckpt = write_model(&root.join("model"), MODEL_A, 11);
    let ds = drives(root, 1);
    let m = deltafin_storage::layout::write_layout(
        &ckpt,
        &opts(ds.clone(), Mode::Replicate, 1 << 20),
        &NoProgress,
    )
    .unwrap();
    let gate = Arc::new(Gate::default());
    let (manifest, dirs) = open_layout(&ds[0].join("m")).unwrap();
    let cfg = config(1, HashCheck::Off, Arc::new(GatedBackend::new(gate.clone())));
    let engine = Engine::open(Arc::new(manifest), &dirs, cfg).unwrap();
    (engine, m, gate)
}
