//! Streamed decoding: text is emitted only once later tokens cannot change it, so a multi-byte
//! character split across tokens is never printed broken (the approach of Hugging Face's
//! text-generation-inference: decode a window of ids, hold back while it ends in U+FFFD).

use crate::error::Result;
use crate::tokenizer::ChatTokenizer;

/// Incremental decoder over one tokenizer.
#[derive(Debug)]
pub struct Detok<'t> {
    tok: &'t ChatTokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl<'t> Detok<'t> {
    pub fn new(tok: &'t ChatTokenizer, skip_special: bool) -> Self {
        Detok {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Add one generated id; returns the text that became final (often empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = self.tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = self
            .tok
            .decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len()
            && !full.ends_with('\u{FFFD}')
            && full.is_char_boundary(prefix.len())
        {
            let new = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            return Ok(new);
        }
        Ok(String::new())
    }

    /// Text still held back at the end (an incomplete character is kept as U+FFFD).
    pub fn finish(&mut self) -> Result<String> {
        let prefix = self.tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = self
            .tok
            .decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}
