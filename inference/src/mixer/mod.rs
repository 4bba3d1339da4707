//! Token mixers: the per-layer sequence-mixing module (attention today; linear attention or
//! other recurrent mixers later). Each mixer owns the type of its per-sequence state and creates
//! it with [`TokenMixer::new_state`]; the model keeps one boxed state per layer in a
//! [`crate::Session`].

use std::any::Any;

use crate::error::{InferenceError, Result};

pub mod gqa;
pub mod mla;

pub use gqa::{GqaAttention, KvCache};
pub use mla::{MlaAttention, MlaCache, QProj};

/// Per-sequence state of one token mixer (a KV cache, a recurrent state, ...).
pub trait MixerState: Send + std::fmt::Debug + Any {
    /// Number of positions the state has absorbed.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forget every position at or after `len` (speculative-decoding rollback). Must not copy
    /// the retained prefix. Errors if `len` exceeds the current length or the state cannot
    /// roll back.
    fn truncate(&mut self, len: usize) -> Result<()>;

    /// Bytes held.
    fn memory_bytes(&self) -> usize;

    fn as_any_mut(&mut self) -> &mut dyn Any;

    /// Snapshot hook: the state's arrays in a fixed order, each `[len, width]` row-major with
    /// the widths [`TokenMixer::state_widths`] gives. `None`: this state cannot be saved.
    fn export_arrays(&self) -> Option<Vec<&[f32]>> {
        None
    }

    /// Snapshot hook: replace the state by `len` positions given as arrays in
    /// [`MixerState::export_arrays`] order (shapes checked by the caller).
    fn import_arrays(&mut self, _len: usize, _arrays: Vec<Vec<f32>>) -> Result<()> {
        Err(InferenceError::Unsupported(
            "this mixer's state cannot be restored from a snapshot".into(),
        ))
    }
}

/// A sequence-mixing module.
pub trait TokenMixer: Send + Sync + std::fmt::Debug {
    /// A fresh, empty per-sequence state.
    fn new_state(&self) -> Box<dyn MixerState>;

    /// Mix `n` new consecutive positions: `x` is the normalised input `[n, hidden]` of
    /// positions `state.len() .. state.len() + n`; returns `[n, hidden]` and extends `state`.
    /// Position `i` attends causally to every earlier position and itself.
    fn forward(&self, x: &[f32], n: usize, state: &mut dyn MixerState) -> Result<Vec<f32>>;

    /// Bytes of per-sequence state each position adds (a KV cache's row).
    fn state_bytes_per_position(&self) -> usize {
        self.state_widths()
            .map_or(0, |w| w.iter().sum::<usize>() * std::mem::size_of::<f32>())
    }

    /// Bytes of per-sequence state that do not grow with the context (a recurrent state).
    fn fixed_state_bytes(&self) -> usize {
        0
    }

    /// Snapshot hook: floats per position of each array of this mixer's state, in
    /// [`MixerState::export_arrays`] order. `None`: the state cannot be saved.
    fn state_widths(&self) -> Option<Vec<usize>> {
        None
    }
}

/// Check `arrays` against `widths` for `len` positions (snapshot restore).
pub(crate) fn check_import(len: usize, arrays: &[Vec<f32>], count: usize) -> Result<()> {
    if arrays.len() != count {
        return Err(InferenceError::StateMismatch(format!(
            "snapshot state has {} arrays; expected {count}",
            arrays.len()
        )));
    }
    if len == 0 && arrays.iter().any(|a| !a.is_empty()) {
        return Err(InferenceError::StateMismatch(
            "snapshot state has data for 0 positions".into(),
        ));
    }
    if arrays.iter().any(|a| len > 0 && a.len() % len != 0) {
        return Err(InferenceError::StateMismatch(format!(
            "snapshot state arrays are not a whole number of rows of {len} positions"
        )));
    }
    Ok(())
}

/// Downcast a state to the concrete type its mixer expects.
pub(crate) fn state_as<'s, T: MixerState>(
    state: &'s mut dyn MixerState,
    who: &str,
) -> Result<&'s mut T> {
    state.as_any_mut().downcast_mut::<T>().ok_or_else(|| {
        InferenceError::StateMismatch(format!("{who} was given another mixer's state"))
    })
}

pub(crate) fn check_truncate(len: usize, requested: usize) -> Result<()> {
    if requested > len {
        return Err(InferenceError::Truncate { len, requested });
    }
    Ok(())
}
