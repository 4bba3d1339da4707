//! [`Session`]: one sequence's state (per-layer mixer states, length, recorded outputs).

use crate::error::{InferenceError, Result};
use crate::mixer::MixerState;
use crate::model::boundary::TokenGuess;

/// One sequence's state: per-layer mixer states and the number of positions processed.
#[derive(Debug)]
pub struct Session {
    pub(crate) model_id: u64,
    pub(crate) states: Vec<Box<dyn MixerState>>,
    pub(crate) len: usize,
    /// The last layer's output (before the final norm) of each position from `start` on, when
    /// recording ([`Model::record_outputs`]): a snapshot that holds them lets a later prompt
    /// that is entirely a prefix of the snapshot start generating without a forward pass.
    pub(crate) outputs: Option<OutputStates>,
    /// The last forward's guess of the next token ([`crate::model::boundary`]).
    pub(crate) token_guess: Option<TokenGuess>,
}

/// Per-position outputs of the last layer, `[len - start, hidden]`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct OutputStates {
    pub(crate) start: usize,
    pub(crate) data: Vec<f32>,
}

impl Session {
    /// Positions processed so far (the next token's position).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Whether [`Session::truncate`] to `len` will succeed (a recurrent state can only return to
    /// positions whose state is known).
    pub fn can_truncate(&self, len: usize) -> bool {
        len <= self.len && self.states.iter().all(|s| s.can_truncate(len))
    }

    /// Per-layer state (tests and diagnostics downcast it with `as_any`).
    pub fn state(&self, layer: usize) -> Option<&dyn MixerState> {
        self.states.get(layer).map(|s| &**s)
    }

    /// Roll back to the first `len` positions (speculative decoding); nothing is copied.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(InferenceError::Truncate {
                len: self.len,
                requested: len,
            });
        }
        // All or nothing: a state that cannot return to `len` refuses before any is changed.
        if let Some(s) = self.states.iter_mut().find(|s| !s.can_truncate(len)) {
            s.truncate(len)?;
        }
        for s in &mut self.states {
            s.truncate(len)?;
        }
        self.truncate_outputs(len);
        self.len = len;
        self.token_guess = None;
        Ok(())
    }
    fn truncate_outputs(&mut self, len: usize) {
        if let Some(o) = &mut self.outputs {
            if len <= o.start {
                o.start = len;
                o.data.clear();
            } else if let Some(per) = o.data.len().checked_div(self.len - o.start) {
                o.data.truncate((len - o.start) * per);
            }
        }
    }
    /// Bytes held by the caches.
    pub fn memory_bytes(&self) -> usize {
        self.states.iter().map(|s| s.memory_bytes()).sum::<usize>()
            + self.outputs.as_ref().map_or(0, |o| o.data.len() * 4)
    }
    /// Whether the last layer's output of position `pos` is recorded.
    pub fn has_output(&self, pos: usize) -> bool {
        self.outputs
            .as_ref()
            .is_some_and(|o| pos >= o.start && pos < self.len)
    }
    /// Recorded outputs (snapshots).
    pub(crate) fn outputs(&self) -> Option<&OutputStates> {
        self.outputs.as_ref()
    }
    pub(crate) fn set_outputs(&mut self, outputs: Option<OutputStates>) {
        self.outputs = outputs;
    }
    /// Per-layer mixer states (snapshots).
    pub(crate) fn states(&self) -> &[Box<dyn MixerState>] {
        &self.states
    }
    /// Per-layer mixer states and the length to set once they are restored (snapshots).
    pub(crate) fn restore_parts(&mut self) -> (&mut [Box<dyn MixerState>], &mut usize) {
        self.token_guess = None;
        (&mut self.states, &mut self.len)
    }
}
