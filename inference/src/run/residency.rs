//! What of a layout stays in RAM under a budget, decided before its resident set is read: the
//! non-expert weights, the per-sequence state, scratch, and the expert buffers.
//!
//! Benefit per byte of RAM: a byte of a layer's matrices held saves one byte read per token
//! (every token runs every layer); a byte of expert cache saves at most `top_k / experts` of a
//! byte per token under uniform routing (measured hit rates on skewed routing stay below one
//! byte too). So the layers' weights are held first, once the expert buffers have their floor:
//! two layers' worth of routed experts (the layer being computed and the next one's prefetch),
//! below which every token stalls on its own experts. When the layers do not all fit, the
//! fewest are streamed, spread evenly over the depth so that each one's read overlaps the
//! compute of the held layers before it; the embeddings, head, norms and small tensors always
//! stay.

use serde::Serialize;

use crate::config::ModelConfig;
use crate::error::{InferenceError, Result};
use crate::streamed_layer::StreamableLayers;

/// The request: a budget for the whole process, and what it must serve.
#[derive(Clone, Copy, Debug)]
pub struct RamRequest {
    pub ram_budget: u64,
    /// The longest context the per-sequence state is reserved for.
    pub max_positions: usize,
    /// Positions per prefill chunk.
    pub chunk: usize,
}

/// The plan (bytes), printed at start and in `--json`.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Residency {
    pub ram_budget: u64,
    /// The process before the resident set is read (binary, tokenizer, runtime).
    pub base_rss: u64,
    /// Embeddings, head, final norm, every layer's small tensors: always held.
    pub fixed_resident: u64,
    /// The held layers' matrices.
    pub layer_resident: u64,
    /// Layers whose matrices are read for every forward.
    pub streamed_layers: Vec<usize>,
    /// Their bytes: read once per forward (a decode token or a prefill chunk).
    pub streamed_bytes_per_forward: u64,
    /// Buffers for the layer in use and the next one.
    pub stream_buffers: u64,
    pub kv_reserve: u64,
    pub scratch_reserve: u64,
    /// The least the expert buffers get before a layer is held.
    pub expert_floor: u64,
    /// What the expert buffers get.
    pub expert_memory: u64,
}

impl Residency {
    /// A plan with only the budget and what is fixed filled in (for an explicit choice the
    /// automatic one could not make fit; the budget split after loading says what is short).
    pub fn unplanned(streamable: &StreamableLayers, base_rss: u64, ram_budget: u64) -> Self {
        Residency {
            ram_budget,
            base_rss,
            fixed_resident: streamable.fixed_bytes(),
            layer_resident: 0,
            streamed_layers: Vec::new(),
            streamed_bytes_per_forward: 0,
            stream_buffers: 0,
            kv_reserve: 0,
            scratch_reserve: 0,
            expert_floor: 0,
            expert_memory: 0,
        }
    }

    /// The same budget with `layers` streamed instead (an explicit choice): the held and
    /// streamed bytes and buffers recomputed, the expert buffers get what is left.
    pub fn with_streamed(mut self, streamable: &StreamableLayers, mut layers: Vec<usize>) -> Self {
        layers.sort_unstable();
        layers.dedup();
        let bytes_of = |l: usize| streamable.layer(l).map_or(0, |w| w.bytes);
        let buffer_of = |l: usize| streamable.layer(l).map_or(0, |w| w.buffer_bytes);
        let all: u64 = streamable.layers.iter().map(|l| l.bytes).sum();
        let streamed: u64 = layers.iter().map(|&l| bytes_of(l)).sum();
        self.layer_resident = all.saturating_sub(streamed);
        self.streamed_bytes_per_forward = streamed;
        self.stream_buffers = STREAM_BUFFER_LAYERS
            .saturating_mul(layers.iter().map(|&l| buffer_of(l)).max().unwrap_or(0));
        self.streamed_layers = layers;
        self.expert_memory = self.ram_budget.saturating_sub(
            self.base_rss
                + self.fixed_resident
                + self.layer_resident
                + self.stream_buffers
                + self.kv_reserve
                + self.scratch_reserve,
        );
        self
    }
}

/// Layers streamed at once at most: the one computing and the next one (being read, or taken
/// early for its expert prediction once its read has landed).
pub const STREAM_BUFFER_LAYERS: u64 = 2;

/// Per-sequence state for `positions` (Vec growth can leave up to 2x capacity).
pub fn kv_reserve(per_position: u64, fixed: u64, positions: usize) -> u64 {
    2u64.saturating_mul(per_position)
        .saturating_mul(positions as u64)
        .saturating_add(fixed)
}

/// Memory a process is charged beyond what the budget counts: kernel page tables, the page
/// cache of the binary and of files read buffered, an evicted expert buffer still held by the
/// forward pass while its replacement is read. With the expert buffers allocated up front the
/// process sits at its budget from the first token. A cgroup limit at the budget once
/// OOM-killed an INT4 run (cap 745 MB, anonymous RSS 725 MB), with 64 MiB here: the cause was
/// glibc's per-thread arenas keeping freed expert buffers (`memory::tame_allocator`). With one
/// arena the same run peaks at 625 MB resident, 647 MB charged; at 16 MiB here, ~50 MB more
/// go to the expert cache (closing_note_session23.md).
pub const CHARGE_HEADROOM: u64 = 16 << 20;

/// Activations and scratch of one prefill chunk of `chunk` positions attending to up to
/// `positions`, plus allocator slack and [`CHARGE_HEADROOM`].
pub fn scratch_reserve(cfg: &ModelConfig, chunk: usize, positions: usize) -> u64 {
    let hidden = cfg.hidden_size() as u64;
    let heads = cfg.num_attention_heads() as u64;
    let top_k = cfg.experts_per_token().max(1) as u64;
    let inter = cfg.widest_intermediate() as u64;
    let c = chunk.clamp(1, positions.max(1)) as u64;
    (48u64 << 20)
        .saturating_add(CHARGE_HEADROOM)
        .saturating_add(4u64.saturating_mul(c).saturating_mul(
            hidden * (3 * top_k + 24) + 4 * inter + heads.saturating_mul(positions as u64),
        ))
        .saturating_add(8 * cfg.vocab_size() as u64)
}

/// `count` of `n` layers spread evenly (`count <= n`).
fn spread(layers: &[usize], count: usize) -> Vec<usize> {
    let n = layers.len();
    (0..count.min(n))
        .map(|i| layers[((2 * i + 1) * n) / (2 * count)])
        .collect()
}

/// Choose what to stream so that `request` holds: `streamable` from the layout, state sizes
/// from the config, `largest_expert` the largest expert record as stored.
pub fn choose_residency(
    streamable: &StreamableLayers,
    cfg: &ModelConfig,
    state: (u64, u64),
    largest_expert: u64,
    base_rss: u64,
    request: &RamRequest,
) -> Result<Residency> {
    let kv = kv_reserve(state.0, state.1, request.max_positions);
    let scratch = scratch_reserve(cfg, request.chunk, request.max_positions);
    let moe_layers = (0..cfg.num_hidden_layers())
        .filter(|&l| cfg.is_moe_layer(l))
        .count();
    let expert_floor = if moe_layers == 0 {
        0
    } else {
        largest_expert.saturating_mul(2 * cfg.experts_per_token().max(1) as u64)
    };
    let fixed = streamable.fixed_bytes();
    let mut by_bytes: Vec<usize> = streamable.layers.iter().map(|l| l.layer).collect();
    by_bytes.sort_unstable();
    let bytes_of = |l: usize| streamable.layer(l).map_or(0, |w| w.bytes);
    let buffer_of = |l: usize| streamable.layer(l).map_or(0, |w| w.buffer_bytes);
    let all_layers: u64 = by_bytes.iter().map(|&l| bytes_of(l)).sum();
    let base = base_rss
        .saturating_add(fixed)
        .saturating_add(kv)
        .saturating_add(scratch);
    for count in 0..=by_bytes.len() {
        let streamed = spread(&by_bytes, count);
        let streamed_bytes: u64 = streamed.iter().map(|&l| bytes_of(l)).sum();
        let buffers = STREAM_BUFFER_LAYERS
            .saturating_mul(streamed.iter().map(|&l| buffer_of(l)).max().unwrap_or(0));
        let held = all_layers - streamed_bytes;
        let need = base
            .saturating_add(held)
            .saturating_add(buffers)
            .saturating_add(expert_floor);
        if need <= request.ram_budget {
            return Ok(Residency {
                ram_budget: request.ram_budget,
                base_rss,
                fixed_resident: fixed,
                layer_resident: held,
                streamed_layers: streamed,
                streamed_bytes_per_forward: streamed_bytes,
                stream_buffers: buffers,
                kv_reserve: kv,
                scratch_reserve: scratch,
                expert_floor,
                expert_memory: request.ram_budget - (need - expert_floor),
            });
        }
    }
    let least = base
        .saturating_add(
            STREAM_BUFFER_LAYERS
                .saturating_mul(by_bytes.iter().map(|&l| buffer_of(l)).max().unwrap_or(0)),
        )
        .saturating_add(expert_floor);
    Err(InferenceError::InvalidArgument(format!(
        "a RAM budget of {} bytes is too small for this model even with every layer's weights \
         streamed: the process holds {base_rss} bytes, the embeddings, head and small tensors \
         {fixed}, the per-sequence state for {} positions up to {kv}, scratch {scratch}, \
         streaming buffers for {STREAM_BUFFER_LAYERS} layers and the expert buffers' floor \
         ({expert_floor}: two layers of routed experts); give at least {least}",
        request.ram_budget, request.max_positions
    )))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::streamed_layer::LayerWeightBytes;

    fn layers(n: usize, bytes: u64, fixed: u64) -> StreamableLayers {
        StreamableLayers {
            layers: (0..n)
                .map(|layer| LayerWeightBytes {
                    layer,
                    bytes,
                    buffer_bytes: bytes,
                    records: vec![layer],
                })
                .collect(),
            resident_bytes: fixed + n as u64 * bytes,
        }
    }

    fn config() -> ModelConfig {
        let v = crate::synth::presets::preset_config("deepseek_v3", "tiny").unwrap();
        ModelConfig::from_json(&v).unwrap()
    }

    #[test]
    fn spread_picks_evenly() {
        let ls: Vec<usize> = (0..8).collect();
        assert_eq!(spread(&ls, 0), Vec::<usize>::new());
        assert_eq!(spread(&ls, 1), vec![4]);
        assert_eq!(spread(&ls, 2), vec![2, 6]);
        assert_eq!(spread(&ls, 4), vec![1, 3, 5, 7]);
        assert_eq!(spread(&ls, 8), ls);
    }

    #[test]
    fn holds_layers_first_then_streams_the_fewest() {
        let cfg = config();
        let s = layers(8, 100 << 20, 50 << 20);
        let req = |ram: u64| RamRequest {
            ram_budget: ram,
            max_positions: 64,
            chunk: 16,
        };
        let plan = |ram| choose_residency(&s, &cfg, (1000, 0), 1 << 20, 10 << 20, &req(ram));
        // Plenty: nothing streamed, the rest to experts.
        let big = plan(4 << 30).unwrap();
        assert!(big.streamed_layers.is_empty());
        assert_eq!(big.layer_resident, 800 << 20);
        assert!(big.expert_memory > big.expert_floor);
        // Less than the layers: the fewest streamed, the experts at least at their floor,
        // and everything within the budget.
        let mid = plan(700 << 20).unwrap();
        assert!(!mid.streamed_layers.is_empty() && mid.streamed_layers.len() < 8);
        assert!(mid.expert_memory >= mid.expert_floor);
        let total = mid.base_rss
            + mid.fixed_resident
            + mid.layer_resident
            + mid.stream_buffers
            + mid.kv_reserve
            + mid.scratch_reserve
            + mid.expert_memory;
        assert_eq!(total, 700 << 20);
        let one_less = plan((700 << 20) - (100 << 20)).unwrap();
        assert!(one_less.streamed_layers.len() > mid.streamed_layers.len());
        // Too little even streaming everything: an error saying what is needed.
        let e = plan(100 << 20).unwrap_err().to_string();
        assert!(e.contains("give at least"), "{e}");
    }
}
