//! The traits of a token mixer and its per-sequence state, and helpers their implementations
//! share.

use std::any::Any;

use crate::error::{InferenceError, Result};
use crate::linear::Linear;

/// Per-sequence state of one token mixer (a KV cache, a recurrent state, ...).
pub trait MixerState: Send + std::fmt::Debug + Any {
    /// Number of positions the state has absorbed.
    fn len(&self) -> usize;

    /// A fresh, empty state of the same shape (what the mixer's `new_state` would give).
    fn empty(&self) -> Box<dyn MixerState>;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forget every position at or after `len` (speculative-decoding rollback). Must not copy
    /// the retained prefix. Errors if `len` exceeds the current length or the state cannot
    /// roll back.
    fn truncate(&mut self, len: usize) -> Result<()>;

    /// Bytes held.
    fn memory_bytes(&self) -> usize;

    /// A separate copy of this state at its current length, for a throwaway forward (the
    /// next-token guess) that must leave this state exactly as it is: a recurrent state,
    /// whose rollback checkpoint any forward past the current position would move. `None`
    /// (the default): the state is a cache of positions, which a truncate returns to any
    /// earlier length, so the throwaway forward runs on it in place.
    fn scratch_copy(&self) -> Option<Box<dyn MixerState>> {
        None
    }

    fn as_any(&self) -> &dyn Any;

    fn as_any_mut(&mut self) -> &mut dyn Any;

    /// Whether [`MixerState::truncate`] to `len` will succeed: any shorter length for a cache
    /// of positions; for a recurrent state only the lengths whose state is known (the start,
    /// the end, and positions of the last short forward).
    fn can_truncate(&self, len: usize) -> bool {
        len <= self.len()
    }

    /// Snapshot hook: the state's per-position arrays in a fixed order, each `[len, width]`
    /// row-major with the widths [`TokenMixer::state_widths`] gives. `None`: this state cannot
    /// be saved.
    fn export_arrays(&self) -> Option<Vec<&[f32]>> {
        None
    }

    /// Snapshot hook: the state's fixed-size arrays (a recurrent state), sized as
    /// [`TokenMixer::fixed_state_sizes`] says.
    fn export_fixed(&self) -> Vec<&[f32]> {
        Vec::new()
    }

    /// Snapshot hook: replace the state by `len` positions given as per-position arrays in
    /// [`MixerState::export_arrays`] order and fixed arrays in [`MixerState::export_fixed`]
    /// order (shapes checked by the caller).
    fn import_arrays(
        &mut self,
        _len: usize,
        _arrays: Vec<Vec<f32>>,
        _fixed: Vec<Vec<f32>>,
    ) -> Result<()> {
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

    /// Positions of one forward that a later truncate can return into (`None`: any). A
    /// recurrent state records at most this many positions of a forward for rollback, so a
    /// speculative verification batch must not be longer.
    fn rollback_window(&self) -> Option<usize> {
        None
    }

    /// The resident matrices a decode step reads, in the order it reads them (for warming
    /// the caches: [`crate::warm`]). Empty: nothing to warm.
    fn matrices(&self) -> Vec<&Linear> {
        Vec::new()
    }

    /// Bytes of per-sequence state each position adds (a KV cache's row).
    fn state_bytes_per_position(&self) -> usize {
        self.state_widths()
            .map_or(0, |w| w.iter().sum::<usize>() * std::mem::size_of::<f32>())
    }

    /// Bytes of per-sequence state that do not grow with the context (a recurrent state).
    fn fixed_state_bytes(&self) -> usize {
        self.fixed_state_sizes().iter().sum::<usize>() * std::mem::size_of::<f32>()
    }

    /// Snapshot hook: floats per position of each array of this mixer's state, in
    /// [`MixerState::export_arrays`] order. `None`: the state cannot be saved.
    fn state_widths(&self) -> Option<Vec<usize>> {
        None
    }

    /// Snapshot hook: floats in each fixed-size array of this mixer's state, in
    /// [`MixerState::export_fixed`] order.
    fn fixed_state_sizes(&self) -> Vec<usize> {
        Vec::new()
    }

    /// For tests and diagnostics that need the concrete mixer.
    fn as_any(&self) -> &dyn Any;
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
