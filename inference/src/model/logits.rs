//! What a forward pass returns: [`Logits`], which of them ([`LogitsMode`]), and optional
//! diagnostics ([`ForwardTrace`]).

use crate::ffn::router::Routing;

/// Which logits a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogitsMode {
    /// One row per input position.
    #[default]
    All,
    /// Only the last input position.
    Last,
    /// No logits (e.g. prefill whose logits are not needed).
    None,
}

/// Logits `[rows, vocab]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Logits {
    pub rows: usize,
    pub vocab: usize,
    pub data: Vec<f32>,
}

impl Logits {
    /// Row `i` (`None` past the last row).
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        if i >= self.rows {
            return None;
        }
        let start = i.checked_mul(self.vocab)?;
        self.data.get(start..start.checked_add(self.vocab)?)
    }
    pub fn last(&self) -> Option<&[f32]> {
        self.row(self.rows.checked_sub(1)?)
    }
}

/// Optional per-forward diagnostics.
#[derive(Debug, Clone, Default)]
pub struct ForwardTrace {
    /// `[layers + 1]` of `[n, hidden]`: `[0]` = embeddings, `[i]` = what layer i-1 hands on
    /// (the residual stream; with Attention Residuals the running block sum).
    pub hidden_states: Vec<Vec<f32>>,
    /// Per layer `[n, hidden]`: the token mixer's and the feed-forward's input before their
    /// norms.
    pub attn_inputs: Vec<Vec<f32>>,
    pub mlp_inputs: Vec<Vec<f32>>,
    /// `[n, hidden]`: the final norm's input.
    pub final_mixed: Vec<f32>,
    /// Attention Residuals: the completed blocks after the last layer.
    pub residual_blocks: Vec<Vec<f32>>,
    /// `(layer, routing of each input position)` for every MoE layer.
    pub routing: Vec<(usize, Vec<Routing>)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bad row index is `None`, not a panic.
    #[test]
    fn rows_past_the_end_are_none() {
        let l = Logits {
            rows: 2,
            vocab: 3,
            data: vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
        };
        assert_eq!(l.row(1), Some(&[3.0, 4.0, 5.0][..]));
        assert_eq!(l.row(2), None);
        assert_eq!(l.row(usize::MAX), None);
        assert_eq!(l.last(), Some(&[3.0, 4.0, 5.0][..]));
        let empty = Logits {
            rows: 0,
            vocab: 3,
            data: vec![],
        };
        assert_eq!(empty.last(), None);
    }
}
