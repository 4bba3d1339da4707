//! [`KdaState`]: one sequence's state of a KDA layer — the recurrent state `S` (a `D x D`
//! matrix per head, indexed `[key, value]`) and the short convolution's tail (the last `K - 1`
//! pre-convolution inputs of every q/k/v channel) — fixed in size whatever the context length.
//!
//! A forward pass never overwrites the state it starts from: the first position reads the
//! checkpoint and writes the current state, later positions update the current state in place.
//! So the state before the last forward is always known (a failed forward rolls back to it),
//! and for a short forward (a speculative verification batch) the inputs of each position are
//! recorded, so that truncating to any position inside it replays the recurrence from the
//! checkpoint. Other positions' states are not kept: a recurrent state cannot be rolled back to
//! them.

use crate::error::{InferenceError, Result};
use crate::mixer::delta_rule::{push_tail, replay, Recorded};
use crate::mixer::state::{check_truncate, MixerState};

/// Forwards of at most this many positions record their inputs for rollback (speculative
/// verification batches are `k + 1 <= 16` positions; prefill chunks are not recorded).
pub const RECORD_MAX_POSITIONS: usize = 16;

/// The state of one KDA layer for one sequence.
#[derive(Debug, Clone)]
pub struct KdaState {
    pub(crate) heads: usize,
    pub(crate) dim: usize,
    pub(crate) kernel: usize,
    /// Positions absorbed.
    pub(crate) len: usize,
    /// Positions absorbed by `checkpoint`; `len == checkpoint_len` means the current state is
    /// the checkpoint (and `current` is scratch).
    pub(crate) checkpoint_len: usize,
    /// `[H, D, D]`, the state at `checkpoint_len` (empty: all zeros, not yet allocated).
    pub(crate) checkpoint: Vec<f32>,
    /// `[H, D, D]`, the state at `len` when `len > checkpoint_len`.
    pub(crate) current: Vec<f32>,
    /// `[3 * H * D, K - 1]` oldest first: the convolution tail at `len` and at the checkpoint.
    pub(crate) tail: Vec<f32>,
    pub(crate) checkpoint_tail: Vec<f32>,
    /// Inputs of positions `checkpoint_len..len`, when that forward was short enough to record
    /// (`None`: not recorded).
    pub(crate) recorded: Option<Vec<Recorded>>,
}

impl KdaState {
    pub fn new(heads: usize, dim: usize, kernel: usize) -> KdaState {
        let tail = vec![0f32; 3 * heads * dim * kernel.saturating_sub(1)];
        KdaState {
            heads,
            dim,
            kernel,
            len: 0,
            checkpoint_len: 0,
            checkpoint: Vec::new(),
            current: Vec::new(),
            checkpoint_tail: tail.clone(),
            tail,
            recorded: Some(Vec::new()),
        }
    }

    fn state_len(&self) -> usize {
        self.heads * self.dim * self.dim
    }

    /// The recurrent state at `len`, `[H, D, D]` (`S[h, key, value]`).
    pub fn recurrent(&self) -> Vec<f32> {
        let s = if self.len == self.checkpoint_len {
            &self.checkpoint
        } else {
            &self.current
        };
        if s.is_empty() {
            vec![0f32; self.state_len()]
        } else {
            s.clone()
        }
    }

    /// The convolution tail at `len`: `[3 * H * D, K - 1]`, channels q ‖ k ‖ v, oldest first.
    pub fn conv_tail(&self) -> &[f32] {
        &self.tail
    }

    /// Make the state at `len` the checkpoint before a forward: the current buffer becomes
    /// the checkpoint (no copy) and the old checkpoint the scratch the forward writes.
    pub(crate) fn begin_forward(&mut self, n: usize) {
        if self.checkpoint.is_empty() {
            self.checkpoint = vec![0f32; self.state_len()];
        }
        if self.current.is_empty() {
            self.current = vec![0f32; self.state_len()];
        }
        if self.len > self.checkpoint_len {
            std::mem::swap(&mut self.checkpoint, &mut self.current);
            self.checkpoint_tail.copy_from_slice(&self.tail);
            self.checkpoint_len = self.len;
        }
        self.recorded = (n <= RECORD_MAX_POSITIONS).then(Vec::new);
    }

    /// A forward wrote positions `checkpoint_len..checkpoint_len + n` into `current`.
    pub(crate) fn end_forward(&mut self, n: usize) {
        self.len = self.checkpoint_len + n;
    }

    fn reset(&mut self) {
        self.len = 0;
        self.checkpoint_len = 0;
        self.checkpoint.iter_mut().for_each(|v| *v = 0.0);
        self.tail.iter_mut().for_each(|v| *v = 0.0);
        self.checkpoint_tail.iter_mut().for_each(|v| *v = 0.0);
        self.recorded = Some(Vec::new());
    }
}

impl MixerState for KdaState {
    fn empty(&self) -> Box<dyn MixerState> {
        Box::new(KdaState::new(self.heads, self.dim, self.kernel))
    }
    fn len(&self) -> usize {
        self.len
    }

    fn can_truncate(&self, len: usize) -> bool {
        len == 0
            || len == self.len
            || len == self.checkpoint_len
            || (len > self.checkpoint_len
                && len < self.len
                && self
                    .recorded
                    .as_ref()
                    .is_some_and(|r| r.len() == self.len - self.checkpoint_len))
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        check_truncate(self.len, len)?;
        if len == self.len {
            return Ok(());
        }
        if !self.can_truncate(len) {
            return Err(InferenceError::StateMismatch(format!(
                "a KDA layer's recurrent state at position {len} is not known (it holds \
                 positions 0..{}; it can return to 0, {} or {})",
                self.len, self.checkpoint_len, self.len
            )));
        }
        if len == 0 {
            self.reset();
            return Ok(());
        }
        let keep = len - self.checkpoint_len;
        let recorded = self.recorded.take().unwrap_or_default();
        self.tail.copy_from_slice(&self.checkpoint_tail);
        if keep == 0 {
            self.len = self.checkpoint_len;
            self.recorded = Some(Vec::new());
            return Ok(());
        }
        // Replay the kept positions from the checkpoint.
        let (h, d, k1) = (self.heads, self.dim, self.kernel.saturating_sub(1));
        replay(&self.checkpoint, &mut self.current, h, d, &recorded[..keep]);
        for r in &recorded[..keep] {
            push_tail(&mut self.tail, &r.raw, k1);
        }
        self.len = len;
        self.recorded = Some(recorded.into_iter().take(keep).collect());
        Ok(())
    }

    /// The state at `len` as the copy's checkpoint (one `[H, D, D]` copy and the tail): a
    /// forward on the copy writes only the copy's buffers.
    fn scratch_copy(&self) -> Option<Box<dyn MixerState>> {
        let at_len = if self.len == self.checkpoint_len {
            &self.checkpoint
        } else {
            &self.current
        };
        Some(Box::new(KdaState {
            heads: self.heads,
            dim: self.dim,
            kernel: self.kernel,
            len: self.len,
            checkpoint_len: self.len,
            checkpoint: at_len.clone(),
            current: Vec::new(),
            tail: self.tail.clone(),
            checkpoint_tail: self.tail.clone(),
            recorded: Some(Vec::new()),
        }))
    }

    fn memory_bytes(&self) -> usize {
        (self.checkpoint.capacity()
            + self.current.capacity()
            + self.tail.capacity()
            + self.checkpoint_tail.capacity())
            * 4
            + self.recorded.as_ref().map_or(0, |r| {
                r.iter()
                    .map(|p| (p.q.len() * 4 + p.beta.len() + p.raw.len()) * 4)
                    .sum()
            })
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }

    fn export_arrays(&self) -> Option<Vec<&[f32]>> {
        Some(Vec::new())
    }

    fn export_fixed(&self) -> Vec<&[f32]> {
        let s: &[f32] = if self.len == self.checkpoint_len {
            &self.checkpoint
        } else {
            &self.current
        };
        vec![s, &self.tail]
    }

    fn import_arrays(
        &mut self,
        len: usize,
        arrays: Vec<Vec<f32>>,
        fixed: Vec<Vec<f32>>,
    ) -> Result<()> {
        let want = [self.state_len(), self.tail.len()];
        let sizes: Vec<usize> = fixed.iter().map(Vec::len).collect();
        if !arrays.is_empty() || sizes != want {
            return Err(InferenceError::StateMismatch(format!(
                "KDA state: {} per-position arrays and fixed arrays of {sizes:?} values; \
                 expected none and {want:?}",
                arrays.len()
            )));
        }
        let mut it = fixed.into_iter();
        let (Some(s), Some(tail)) = (it.next(), it.next()) else {
            return Err(InferenceError::StateMismatch(
                "KDA state arrays missing".into(),
            ));
        };
        self.checkpoint = s;
        self.current = Vec::new();
        self.checkpoint_tail = tail.clone();
        self.tail = tail;
        self.len = len;
        self.checkpoint_len = len;
        self.recorded = Some(Vec::new());
        Ok(())
    }
}
