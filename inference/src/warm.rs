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

/// Bytes worth warming at once: a quarter of the last-level cache (Linux: cpu0's highest
/// cache level in sysfs), else 4 MiB. A DeepSeek-V3-sized layer's attention is ~370 MB of
/// BF16; loading all of it would evict its own first matrices before they are used.
pub fn warm_budget() -> usize {
    static BUDGET: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| last_level_cache_bytes().map_or(4 << 20, |b| b / 4))
}

fn last_level_cache_bytes() -> Option<usize> {
    (0..8)
        .rev()
        .find_map(|i| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cache/index{i}/size"))
                .ok()
        })
        .and_then(|s| parse_cache_size(s.trim()))
}

/// `32768K`, `8M`, `1048576` as bytes.
fn parse_cache_size(s: &str) -> Option<usize> {
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: usize = digits.parse().ok()?;
    let mult = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

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

    /// The first `cap` bytes of `slices` (in order: put what is read first, first).
    pub fn capped(slices: impl IntoIterator<Item = &'a [u8]>, cap: usize) -> Self {
        let mut left = cap;
        let mut kept = Vec::new();
        for s in slices {
            if left == 0 {
                break;
            }
            let take = s.len().min(left);
            kept.push(&s[..take]);
            left -= take;
        }
        CacheWarmer::new(kept)
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

/// Whether layers warm the next one's attention weights while waiting for experts (on unless
/// `DELTAFIN_WARM=0`, for measuring it).
pub fn warm_while_waiting() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("DELTAFIN_WARM").map_or(true, |v| v != "0"))
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
        assert_eq!(
            CacheWarmer::capped([&a[..], &b[..]], 1005).remaining(),
            1005
        );
        assert_eq!(
            CacheWarmer::capped([&a[..], &b[..]], 5000).remaining(),
            1010
        );
        assert_eq!(CacheWarmer::capped([&a[..], &b[..]], 0).remaining(), 0);
    }

    #[test]
    fn cache_sizes_parse() {
        assert_eq!(parse_cache_size("32768K"), Some(32 << 20));
        assert_eq!(parse_cache_size("8M"), Some(8 << 20));
        assert_eq!(parse_cache_size("1024"), Some(1024));
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size(""), None);
        assert!(warm_budget() > 0);
    }
}
