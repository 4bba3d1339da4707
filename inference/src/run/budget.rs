//! Splitting a RAM budget once a model is loaded from a layout: what the process holds, the
//! per-sequence state for the longest context, scratch for one prefill chunk, and the rest for
//! expert buffers (reads in flight, prefetched and cached experts).

use serde::Serialize;

use crate::error::{InferenceError, Result};
use crate::layout_source::LayoutSource;
use crate::model::forward::Model;
use crate::run::memory::rss_bytes;

/// How a RAM budget is split (bytes).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Budget {
    pub ram_budget: u64,
    /// Resident set of the process after loading (VmRSS): binary, resident weights.
    pub base_rss: u64,
    /// Per-sequence state (KV caches, recurrent states) for the longest context planned.
    pub kv_reserve: u64,
    /// Activations and scratch of one prefill chunk, allocator slack.
    pub scratch_reserve: u64,
    /// Expert buffers: reads in flight, prefetched and cached experts.
    pub expert_memory: u64,
}

/// The split of `ram_budget` for `model` over `src`, for `max_positions` positions prefilled
/// `chunk` at a time, given that the process holds `base_rss` bytes now. Fails when less than
/// one expert record would fit.
pub fn split_budget(
    model: &Model,
    src: &LayoutSource,
    ram_budget: u64,
    base_rss: u64,
    max_positions: usize,
    chunk: usize,
) -> Result<Budget> {
    let positions = max_positions as u64;
    // Vec growth can leave up to 2x capacity.
    let kv_reserve = 2u64
        .saturating_mul(model.state_bytes_per_position())
        .saturating_mul(positions)
        .saturating_add(model.fixed_state_bytes());
    let cfg = model.config();
    let hidden = model.hidden_size() as u64;
    let heads = cfg.num_attention_heads() as u64;
    let top_k = cfg.experts_per_token().max(1) as u64;
    let inter = cfg.widest_intermediate() as u64;
    let c = chunk.clamp(1, max_positions.max(1)) as u64;
    let scratch_reserve = (48u64 << 20)
        .saturating_add(4u64.saturating_mul(c).saturating_mul(
            hidden * (3 * top_k + 24) + 4 * inter + heads.saturating_mul(positions),
        ))
        .saturating_add(8 * model.vocab_size() as u64);
    let biggest = src.largest_expert_record();
    let fixed = base_rss
        .saturating_add(kv_reserve)
        .saturating_add(scratch_reserve);
    let expert_memory = ram_budget.saturating_sub(fixed);
    if expert_memory < biggest {
        return Err(InferenceError::InvalidArgument(format!(
            "a RAM budget of {ram_budget} bytes is too small for this model: the process holds \
             {base_rss} bytes after loading, the per-sequence state for {max_positions} \
             positions needs up to {kv_reserve} and scratch {scratch_reserve}, leaving \
             {expert_memory} for expert buffers, less than one expert record ({biggest}); give \
             at least {}",
            fixed.saturating_add(biggest)
        )));
    }
    Ok(Budget {
        ram_budget,
        base_rss,
        kv_reserve,
        scratch_reserve,
        expert_memory,
    })
}

/// [`split_budget`] with the process's resident set now, applied: the layout's expert buffers
/// get their share.
pub fn plan_budget(
    model: &Model,
    src: &LayoutSource,
    ram_budget: u64,
    max_positions: usize,
    chunk: usize,
) -> Result<Budget> {
    let b = split_budget(
        model,
        src,
        ram_budget,
        rss_bytes().unwrap_or(0),
        max_positions,
        chunk,
    )?;
    src.set_expert_memory_cap(b.expert_memory);
    Ok(b)
}
