//! Splitting a RAM budget once a model is loaded from a layout: what the process holds, the
//! per-sequence state for the longest context, scratch for one prefill chunk, and the rest for
//! expert buffers (reads in flight, prefetched and cached experts).

use serde::Serialize;

use crate::error::{InferenceError, Result};
use crate::layout_source::LayoutSource;
use crate::model::forward::Model;
use crate::run::memory::rss_bytes;
use crate::run::residency::{kv_reserve, scratch_reserve, STREAM_BUFFER_LAYERS};

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
    /// Buffers of streamed layers' weights (none when every layer is held).
    pub stream_buffers: u64,
    /// Expert buffers: reads in flight, prefetched and cached experts.
    pub expert_memory: u64,
    /// Of those, bytes allocated and faulted in before generating (spare buffers of the
    /// largest expert's size, at most one per expert): 0 until [`plan_budget`] applies it.
    pub expert_memory_preallocated: u64,
    /// Milliseconds that took.
    pub expert_memory_preallocate_ms: u64,
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
    let kv_reserve = kv_reserve(
        model.state_bytes_per_position(),
        model.fixed_state_bytes(),
        max_positions,
    );
    let scratch_reserve = scratch_reserve(model.config(), chunk, max_positions);
    let stream_buffers = STREAM_BUFFER_LAYERS.saturating_mul(src.largest_streamed_layer());
    let biggest = src.largest_expert_record();
    let fixed = base_rss
        .saturating_add(kv_reserve)
        .saturating_add(scratch_reserve)
        .saturating_add(stream_buffers);
    let expert_memory = ram_budget.saturating_sub(fixed);
    if expert_memory < biggest {
        return Err(InferenceError::InvalidArgument(format!(
            "a RAM budget of {ram_budget} bytes is too small for this model: the process holds \
             {base_rss} bytes after loading, the per-sequence state for {max_positions} \
             positions needs up to {kv_reserve}, scratch {scratch_reserve} and streamed layers' \
             buffers {stream_buffers}, leaving \
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
        stream_buffers,
        expert_memory,
        expert_memory_preallocated: 0,
        expert_memory_preallocate_ms: 0,
    })
}

/// [`split_budget`] with the process's resident set now, applied: the layout's expert buffers
/// get their share, allocated and faulted in now on the compute threads' count of threads
/// (see `ExpertStore::preallocate_buffers`).
pub fn plan_budget(
    model: &Model,
    src: &LayoutSource,
    ram_budget: u64,
    max_positions: usize,
    chunk: usize,
) -> Result<Budget> {
    // The streamed layers' buffers are in the resident set now and reserved on their own.
    let base = rss_bytes()
        .unwrap_or(0)
        .saturating_sub(src.stream_stats().buffer_bytes);
    let mut b = split_budget(model, src, ram_budget, base, max_positions, chunk)?;
    src.set_expert_memory_cap(b.expert_memory);
    let t = std::time::Instant::now();
    b.expert_memory_preallocated = src.preallocate_expert_buffers(rayon::current_num_threads());
    b.expert_memory_preallocate_ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
    Ok(b)
}
