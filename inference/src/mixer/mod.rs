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
}

/// A sequence-mixing module.
pub trait TokenMixer: Send + Sync + std::fmt::Debug {
    /// A fresh, empty per-sequence state.
    fn new_state(&self) -> Box<dyn MixerState>;

    /// Mix `n` new consecutive positions: `x` is the normalised input `[n, hidden]` of
    /// positions `state.len() .. state.len() + n`; returns `[n, hidden]` and extends `state`.
    /// Position `i` attends causally to every earlier position and itself.
    fn forward(&self, x: &[f32], n: usize, state: &mut dyn MixerState) -> Result<Vec<f32>>;
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
