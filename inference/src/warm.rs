//! [`CacheWarmer`]: pulls resident weights into the CPU caches while the forward pass waits
//! for a drive, a slice at a time.
//!
//! Decoding from drives, a layer's last expert lands and then the next layer's attention runs
//! on the critical path: the drive has nothing certain to read until that layer routes. Its
//! weights (4 MB of BF16 per layer on the medium synthetic model) come from DRAM, cold, each
//! token. The compute threads meanwhile spend most of each layer waiting for reads; loading
//! those weights then leaves them in the last-level cache when the attention runs.

/// Bytes touched per [`CacheWarmer::step`]: short enough that an expert landing meanwhile
/// waits little (64 KiB is ~5 us from DRAM).
pub const WARM_STEP_BYTES: usize = 64 << 10;

/// Cache line size the loads step by.
const LINE: usize = 64;

/// Slices to pull into the caches, and how far it has got.
#[derive(Debug, Default)]
pub struct CacheWarmer<'a> {
    slices: Vec<&'a [u8]>,
    slice: usize,
    offset: usize,
}

impl<'a> CacheWarmer<'a> {
    pub fn new(slices: Vec<&'a [u8]>) -> Self {
        CacheWarmer {
            slices,
            slice: 0,
            offset: 0,
        }
    }

    /// Load about `budget` more bytes (one byte per cache line); `false` once all are loaded.
    pub fn step(&mut self, budget: usize) -> bool {
        let mut left = budget;
        let mut acc = 0u8;
        while left > 0 {
            let Some(s) = self.slices.get(self.slice) else {
                break;
            };
            let end = s.len().min(self.offset.saturating_add(left));
            for b in s[self.offset..end].iter().step_by(LINE) {
                acc ^= *b;
            }
            left -= end - self.offset;
            if end == s.len() {
                self.slice += 1;
                self.offset = 0;
            } else {
                self.offset = end;
            }
        }
        std::hint::black_box(acc);
        self.slice < self.slices.len()
    }

    /// Bytes still to load.
    pub fn remaining(&self) -> usize {
        self.slices
            .iter()
            .skip(self.slice)
            .map(|s| s.len())
            .sum::<usize>()
            .saturating_sub(self.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_through_every_slice_then_reports_done() {
        let a = vec![1u8; 1000];
        let b = vec![2u8; 10];
        let c: Vec<u8> = Vec::new();
        let mut w = CacheWarmer::new(vec![&a, &c, &b]);
        assert_eq!(w.remaining(), 1010);
        assert!(w.step(600));
        assert_eq!(w.remaining(), 410);
        assert!(w.step(400));
        assert_eq!(w.remaining(), 10);
        assert!(!w.step(600));
        assert_eq!(w.remaining(), 0);
        assert!(!w.step(600));
        assert!(!CacheWarmer::default().step(1));
    }
}
