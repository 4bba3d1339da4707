//! [`ExpertCache`]: which routed experts are held in memory under a byte budget, which are
//! being read, and which to drop when room is needed. Plain bookkeeping with no I/O: the
//! caller passes the time (a use counter) and the buffers, so the policy is tested on recorded
//! routing traces without files.
//!
//! Every byte of expert buffers the store holds is counted here: landed experts, reads in
//! flight (their bytes are reserved when the read is submitted) and spare buffers kept for
//! reuse. `used() <= cap()` holds after every call, except that a lowered cap is reached as
//! room is next needed.

use std::collections::HashMap;
use std::sync::Arc;

/// `(layer, expert)`.
pub type ExpertKey = (u32, u32);

/// A buffer the cache can account for.
pub trait CacheBuffer {
    /// Bytes the buffer holds (its capacity).
    fn bytes(&self) -> u64;
}

/// Which landed expert to drop when the budget is full.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CachePolicy {
    /// Least recently used.
    Lru,
    /// Frequency-aware: the expert used least often (ties: least recently used). Decoding walks
    /// the layers cyclically, which makes plain LRU thrash when the cache is smaller than the
    /// working set; counting uses keeps the popular experts.
    #[default]
    Lfu,
}

impl std::str::FromStr for CachePolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "lru" => Ok(CachePolicy::Lru),
            "lfu" | "freq" => Ok(CachePolicy::Lfu),
            other => Err(format!("cache policy `{other}`: use lru or lfu")),
        }
    }
}

impl std::fmt::Display for CachePolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CachePolicy::Lru => "lru",
            CachePolicy::Lfu => "lfu",
        })
    }
}

/// What the cache knows of a key when the forward pass asks for it.
#[derive(Debug)]
pub enum Lookup<B> {
    /// Landed: here it is (counted as a cache hit, or as a prefetch hit on first use of a
    /// prefetched expert).
    Ready(Arc<B>),
    /// A prefetch read is in flight and now wanted (counted as a prefetch hit): promote it.
    PrefetchInFlight,
    /// A read is in flight (a demand read, or a cancelled prefetch to be re-read once it
    /// settles).
    InFlight,
    /// Not held: read it.
    Miss,
}

/// The budget cannot make room: everything left is pinned, in flight or not evictable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRoom;

#[derive(Debug)]
enum Slot<B> {
    Ready {
        buf: Arc<B>,
        last_use: u64,
        uses: u64,
        /// Prefetched and not yet asked for.
        unused_prefetch: bool,
    },
    Pending {
        bytes: u64,
        prefetch: bool,
        cancelled: bool,
    },
}

/// Counters of the cache (monotonic).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheCounters {
    /// Lookups served by a landed expert (excluding first uses of prefetched ones).
    pub hits: u64,
    /// Lookups served by a prefetch (landed or in flight).
    pub prefetch_hits: u64,
    /// Landed experts dropped to make room.
    pub evictions: u64,
    /// Prefetch reads cancelled before they landed.
    pub prefetch_cancelled: u64,
    /// Peak of [`ExpertCache::used`].
    pub peak_bytes: u64,
}

/// The expert cache (see the module docs).
#[derive(Debug)]
pub struct ExpertCache<B> {
    slots: HashMap<ExpertKey, Slot<B>>,
    pins: HashMap<ExpertKey, u32>,
    spare: Vec<B>,
    cap: u64,
    used: u64,
    policy: CachePolicy,
    counters: CacheCounters,
}

impl<B: CacheBuffer> ExpertCache<B> {
    pub fn new(cap: u64, policy: CachePolicy) -> Self {
        ExpertCache {
            slots: HashMap::new(),
            pins: HashMap::new(),
            spare: Vec::new(),
            cap,
            used: 0,
            policy,
            counters: CacheCounters::default(),
        }
    }

    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Change the budget; a lower one is reached as room is next needed.
    pub fn set_cap(&mut self, cap: u64) {
        self.cap = cap;
    }

    /// Keep `buf` as a spare if the budget has room for it, else hand it back.
    pub fn add_spare(&mut self, buf: B) -> Result<(), B> {
        let bytes = buf.bytes();
        if self.used.saturating_add(bytes) > self.cap {
            return Err(buf);
        }
        self.used += bytes;
        self.counters.peak_bytes = self.counters.peak_bytes.max(self.used);
        self.spare.push(buf);
        Ok(())
    }

    /// Bytes of expert buffers held: landed, reserved for reads in flight, spare.
    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn policy(&self) -> CachePolicy {
        self.policy
    }

    pub fn counters(&self) -> &CacheCounters {
        &self.counters
    }

    /// Whether the key is landed or in flight.
    pub fn contains(&self, key: ExpertKey) -> bool {
        self.slots.contains_key(&key)
    }

    /// Keys of landed experts.
    pub fn ready_keys(&self) -> impl Iterator<Item = ExpertKey> + '_ {
        self.slots
            .iter()
            .filter(|(_, s)| matches!(s, Slot::Ready { .. }))
            .map(|(k, _)| *k)
    }

    /// Keys of reads in flight (with whether each is an uncancelled prefetch).
    pub fn pending_keys(&self) -> impl Iterator<Item = (ExpertKey, bool)> + '_ {
        self.slots.iter().filter_map(|(k, s)| match s {
            Slot::Pending {
                prefetch,
                cancelled,
                ..
            } => Some((*k, *prefetch && !*cancelled)),
            _ => None,
        })
    }

    /// The forward pass wants `key` at time `now`: count the use and say what to do.
    pub fn lookup(&mut self, key: ExpertKey, now: u64) -> Lookup<B> {
        match self.slots.get_mut(&key) {
            Some(Slot::Ready {
                buf,
                last_use,
                uses,
                unused_prefetch,
            }) => {
                if std::mem::take(unused_prefetch) {
                    self.counters.prefetch_hits += 1;
                } else {
                    self.counters.hits += 1;
                }
                *last_use = now;
                *uses += 1;
                Lookup::Ready(buf.clone())
            }
            Some(Slot::Pending {
                prefetch: true,
                cancelled: false,
                ..
            }) => {
                self.counters.prefetch_hits += 1;
                Lookup::PrefetchInFlight
            }
            Some(Slot::Pending { .. }) => Lookup::InFlight,
            None => Lookup::Miss,
        }
    }

    /// A landed expert's buffer without counting a use.
    pub fn peek(&self, key: ExpertKey) -> Option<Arc<B>> {
        match self.slots.get(&key) {
            Some(Slot::Ready { buf, .. }) => Some(buf.clone()),
            _ => None,
        }
    }

    /// Keep `key` from being evicted until as many [`ExpertCache::unpin`] calls.
    pub fn pin(&mut self, key: ExpertKey) {
        *self.pins.entry(key).or_default() += 1;
    }

    pub fn unpin(&mut self, key: ExpertKey) {
        if let Some(n) = self.pins.get_mut(&key) {
            *n -= 1;
            if *n == 0 {
                self.pins.remove(&key);
            }
        }
    }

    /// Reserve `need` bytes for a read of `key` (a demand read, or a prefetch), evicting landed
    /// experts the policy picks among the unpinned ones `evictable` allows. Returns a spare
    /// buffer of a fitting size to read into, if one is kept; the slot then holds that
    /// buffer's bytes instead of `need`.
    pub fn reserve(
        &mut self,
        key: ExpertKey,
        need: u64,
        prefetch: bool,
        evictable: &dyn Fn(ExpertKey) -> bool,
    ) -> Result<Option<B>, NoRoom> {
        let (spare, bytes) = self.make_room(need, evictable)?;
        self.slots.insert(
            key,
            Slot::Pending {
                bytes,
                prefetch,
                cancelled: false,
            },
        );
        Ok(spare)
    }

    fn make_room(
        &mut self,
        need: u64,
        evictable: &dyn Fn(ExpertKey) -> bool,
    ) -> Result<(Option<B>, u64), NoRoom> {
        loop {
            // Within budget, a spare of about the right size is reused as is (its bytes are
            // already counted); over budget (a lowered cap) spares are dropped first.
            let fitting = self
                .spare
                .iter()
                .position(|b| b.bytes() >= need && b.bytes() < need.saturating_mul(2));
            if let Some(i) = fitting.filter(|_| self.used <= self.cap) {
                let b = self.spare.swap_remove(i);
                let bytes = b.bytes();
                return Ok((Some(b), bytes));
            }
            if self.used + need <= self.cap {
                self.used += need;
                self.counters.peak_bytes = self.counters.peak_bytes.max(self.used);
                return Ok((None, need));
            }
            if let Some(b) = self.spare.pop() {
                self.used -= b.bytes();
                continue;
            }
            let victim = self
                .slots
                .iter()
                .filter_map(|(k, s)| match s {
                    Slot::Ready { last_use, uses, .. }
                        if !self.pins.contains_key(k) && evictable(*k) =>
                    {
                        Some((*k, *last_use, *uses))
                    }
                    _ => None,
                })
                .min_by_key(|&(k, last, uses)| match self.policy {
                    CachePolicy::Lru => (0, last, k),
                    CachePolicy::Lfu => (uses, last, k),
                })
                .map(|(k, _, _)| k);
            let Some(k) = victim else {
                return Err(NoRoom);
            };
            if let Some(Slot::Ready { buf, .. }) = self.slots.remove(&k) {
                self.counters.evictions += 1;
                // A buffer nobody else holds becomes a spare; one still held elsewhere leaves
                // the budget with its last holder.
                match Arc::try_unwrap(buf) {
                    Ok(b) => self.spare.push(b),
                    Err(shared) => self.used -= shared.bytes(),
                }
            }
        }
    }

    /// Undo a reservation whose read could not be submitted.
    pub fn abort(&mut self, key: ExpertKey) {
        if let Some(Slot::Pending { bytes, .. }) = self.slots.remove(&key) {
            self.used -= bytes;
        }
    }

    /// Mark an in-flight prefetch of `key` as cancelled (the caller cancels the read). Returns
    /// whether there was one to cancel.
    pub fn cancel(&mut self, key: ExpertKey) -> bool {
        match self.slots.get_mut(&key) {
            Some(Slot::Pending { cancelled, .. }) if !*cancelled => {
                *cancelled = true;
                true
            }
            _ => false,
        }
    }

    /// The read of `key` finished: with its buffer it becomes a landed expert used at `now`
    /// (not counted as used if it was a prefetch), without one (failed or cancelled) the
    /// reservation is released. Returns whether the key had a read in flight.
    pub fn land(&mut self, key: ExpertKey, buf: Option<B>, now: u64) -> bool {
        let Some(Slot::Pending {
            bytes, prefetch, ..
        }) = self.slots.remove(&key)
        else {
            return false;
        };
        match buf {
            Some(b) => {
                self.used = (self.used + b.bytes()).saturating_sub(bytes);
                self.counters.peak_bytes = self.counters.peak_bytes.max(self.used);
                self.slots.insert(
                    key,
                    Slot::Ready {
                        buf: Arc::new(b),
                        last_use: now,
                        uses: 0,
                        unused_prefetch: prefetch,
                    },
                );
            }
            None => {
                self.used -= bytes;
                if prefetch {
                    self.counters.prefetch_cancelled += 1;
                }
            }
        }
        true
    }

    /// A demand read of `key` landed and is handed over at `now`: count the use.
    pub fn touch(&mut self, key: ExpertKey, now: u64) {
        if let Some(Slot::Ready {
            last_use,
            uses,
            unused_prefetch,
            ..
        }) = self.slots.get_mut(&key)
        {
            *last_use = now;
            *uses += 1;
            *unused_prefetch = false;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A stand-in buffer: only its size matters.
    #[derive(Debug, PartialEq)]
    struct Buf(u64);
    impl CacheBuffer for Buf {
        fn bytes(&self) -> u64 {
            self.0
        }
    }

    /// Routing traces recorded from real decodes (`deltafin generate --trace-routing`): one
    /// line per (token, MoE layer), `layer: expert expert ...`.
    const TRACES: &[(&str, &str)] = &[
        (
            "synth-medium",
            include_str!("../../tests/data/routing_medium.txt"),
        ),
        (
            "fixture-a",
            include_str!("../../tests/data/routing_fixture.txt"),
        ),
    ];

    fn parse(trace: &str) -> Vec<(u32, Vec<u32>)> {
        trace
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
            .map(|l| {
                let (layer, experts) = l.split_once(':').unwrap();
                (
                    layer.trim().parse().unwrap(),
                    experts
                        .split_whitespace()
                        .map(|e| e.parse().unwrap())
                        .collect(),
                )
            })
            .collect()
    }

    /// Replay a trace the way the store serves it (demand reads that land at once, the
    /// layer's experts pinned until handed over); returns (hits, misses) and checks the budget
    /// after every step.
    fn replay(trace: &[(u32, Vec<u32>)], cap: u64, size: u64, policy: CachePolicy) -> (u64, u64) {
        let mut c = ExpertCache::<Buf>::new(cap, policy);
        let (mut hits, mut misses, mut now) = (0, 0, 0);
        for (layer, experts) in trace {
            for &e in experts {
                c.pin((*layer, e));
            }
            for &e in experts {
                now += 1;
                let key = (*layer, e);
                match c.lookup(key, now) {
                    Lookup::Ready(_) => hits += 1,
                    Lookup::Miss => {
                        misses += 1;
                        let spare = c.reserve(key, size, false, &|_| true).unwrap();
                        assert!(c.used() <= c.cap(), "over budget after reserve");
                        assert!(c.land(key, Some(spare.unwrap_or(Buf(size))), now));
                        c.touch(key, now);
                    }
                    other => panic!("{other:?}"),
                }
                assert!(c.used() <= c.cap(), "{} > {}", c.used(), c.cap());
                c.unpin(key);
            }
        }
        (hits, misses)
    }

    /// On recorded traces, at several budgets: the budget holds after every step, every
    /// request is a hit or a read, LRU (a stack algorithm) never loses hits to a larger budget,
    /// and with room for everything each expert is read exactly once.
    #[test]
    fn recorded_traces_stay_within_the_budget() {
        for (name, text) in TRACES {
            let trace = parse(text);
            assert!(trace.len() > 100, "{name}");
            let max_k = trace.iter().map(|t| t.1.len()).max().unwrap() as u64;
            let distinct: std::collections::HashSet<(u32, u32)> = trace
                .iter()
                .flat_map(|(l, es)| es.iter().map(move |e| (*l, *e)))
                .collect();
            let total = trace.iter().map(|t| t.1.len() as u64).sum::<u64>();
            let size = 4096;
            let mut last_lru = 0;
            for frac in [0.1, 0.2, 0.4, 0.7] {
                let cap = ((distinct.len() as f64 * frac) as u64).max(max_k) * size;
                for policy in [CachePolicy::Lfu, CachePolicy::Lru] {
                    let (hits, misses) = replay(&trace, cap, size, policy);
                    assert_eq!(hits + misses, total, "{name} {frac} {policy}");
                    if policy == CachePolicy::Lru {
                        assert!(hits >= last_lru, "{name}: LRU lost hits at {frac}");
                        last_lru = hits;
                    }
                }
            }
            let (_, misses) = replay(&trace, distinct.len() as u64 * size, size, CachePolicy::Lfu);
            assert_eq!(misses, distinct.len() as u64, "{name}");
        }
    }

    /// Decoding cycles through the layers. Once some experts have proved popular, a token whose
    /// experts do not all fit makes LRU evict exactly what the next token needs first, while
    /// LFU keeps the popular ones and rotates the rest through the remaining room.
    #[test]
    fn lfu_keeps_popular_experts_that_lru_cycles_out() {
        let mut trace = Vec::new();
        // Warm-up: only the popular experts 0 and 1 of each of 8 layers (16 fit).
        for _ in 0..10 {
            for layer in 0..8u32 {
                trace.push((layer, vec![0, 1]));
            }
        }
        // Then every token also asks for two of a wide tail: 32 experts per token, room for 24.
        for token in 0..200u32 {
            for layer in 0..8u32 {
                let tail = 2 + (token * 7 + layer * 13) % 60;
                trace.push((layer, vec![0, 1, tail, 2 + (tail + 31) % 60]));
            }
        }
        let cap = 24 * 4096;
        let (lfu, _) = replay(&trace, cap, 4096, CachePolicy::Lfu);
        let (lru, _) = replay(&trace, cap, 4096, CachePolicy::Lru);
        // LFU: every popular request after the first hits (16 per token); LRU: none once the
        // tail starts.
        assert!(lfu >= 16 * 200 + 16 * 9, "lfu {lfu}");
        assert!(lru <= 16 * 9 + 16, "lru {lru}");
    }

    #[test]
    fn spares_count_in_the_budget_and_are_reused_before_new_bytes() {
        let mut c = ExpertCache::<Buf>::new(250, CachePolicy::Lru);
        assert!(c.add_spare(Buf(100)).is_ok());
        assert!(c.add_spare(Buf(100)).is_ok());
        assert_eq!(c.add_spare(Buf(100)), Err(Buf(100)), "over the cap");
        assert_eq!(c.used(), 200);
        // Two reads take the spares, a third the 50 bytes left is too small for, then none.
        assert_eq!(c.reserve((1, 0), 100, false, &|_| true), Ok(Some(Buf(100))));
        assert_eq!(c.reserve((1, 1), 60, false, &|_| true), Ok(Some(Buf(100))));
        assert_eq!(c.reserve((1, 2), 50, false, &|_| true), Ok(None));
        assert_eq!(c.used(), 250);
        assert_eq!(c.reserve((1, 3), 10, false, &|_| true), Err(NoRoom));
    }

    #[test]
    fn pinned_and_unevictable_experts_stay_and_no_room_is_reported() {
        let mut c = ExpertCache::<Buf>::new(300, CachePolicy::Lru);
        for e in 0..3 {
            c.reserve((1, e), 100, false, &|_| true).unwrap();
            c.land((1, e), Some(Buf(100)), e as u64);
        }
        c.pin((1, 0));
        // Expert 1 may not go (predicate), expert 0 is pinned: expert 2 is evicted.
        let spare = c.reserve((2, 0), 100, false, &|k| k != (1, 1)).unwrap();
        assert!(spare.is_some(), "the evicted buffer is reused");
        assert!(c.contains((1, 0)) && c.contains((1, 1)) && !c.contains((1, 2)));
        assert_eq!(c.counters().evictions, 1);
        // Nothing evictable left: the reservation fails and changes nothing.
        assert_eq!(c.reserve((2, 1), 100, false, &|k| k.0 == 2), Err(NoRoom));
        assert_eq!(c.used(), 300);
        c.abort((2, 0));
        assert_eq!(c.used(), 200);
    }

    #[test]
    fn prefetch_accounting_and_cancellation() {
        let mut c = ExpertCache::<Buf>::new(1000, CachePolicy::Lfu);
        c.reserve((3, 7), 100, true, &|_| true).unwrap();
        assert!(matches!(c.lookup((3, 7), 1), Lookup::PrefetchInFlight));
        assert_eq!(c.counters().prefetch_hits, 1);
        c.reserve((3, 8), 100, true, &|_| true).unwrap();
        assert!(c.cancel((3, 8)));
        assert!(!c.cancel((3, 8)), "cancelled once");
        assert!(matches!(c.lookup((3, 8), 2), Lookup::InFlight));
        c.land((3, 8), None, 3);
        assert_eq!(c.counters().prefetch_cancelled, 1);
        assert_eq!(c.used(), 100);
        // A landed prefetch counts as a prefetch hit on first use, then as cache hits.
        c.land((3, 7), Some(Buf(100)), 4);
        assert!(matches!(c.lookup((3, 7), 5), Lookup::Ready(_)));
        assert!(matches!(c.lookup((3, 7), 6), Lookup::Ready(_)));
        assert_eq!((c.counters().prefetch_hits, c.counters().hits), (2, 1));
    }

    #[test]
    fn a_lowered_cap_is_reached_as_room_is_needed() {
        let mut c = ExpertCache::<Buf>::new(400, CachePolicy::Lru);
        for e in 0..4 {
            c.reserve((0, e), 100, false, &|_| true).unwrap();
            c.land((0, e), Some(Buf(100)), e as u64);
        }
        c.set_cap(150);
        c.reserve((1, 0), 100, false, &|_| true).unwrap();
        assert!(c.used() <= c.cap(), "{}", c.used());
        c.land((1, 0), Some(Buf(100)), 9);
        c.reserve((1, 1), 100, false, &|_| true).unwrap();
        assert!(c.used() <= c.cap(), "{}", c.used());
    }
}
