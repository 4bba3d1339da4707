//! How an engine is set up: lanes, hash checking, tuning and the I/O backend.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::{IoBackend, PosixBackend};
use crate::clock::{Clock, SystemClock};

/// Which queue a request waits in. Demand always overtakes prefetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    Demand = 0,
    Prefetch = 1,
}

/// How many completed records get their hash checked (XXH3-128, or blake3 on version 2
/// layouts: `record_hash`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashCheck {
    Off,
    /// One record in every N.
    Sampled(u32),
    All,
}

impl std::str::FromStr for HashCheck {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "off" => Ok(HashCheck::Off),
            "all" => Ok(HashCheck::All),
            s => s
                .strip_prefix("sampled")
                .map(|n| n.trim_start_matches([':', '=']))
                .map(|n| {
                    if n.is_empty() {
                        Ok(16)
                    } else {
                        n.parse::<u32>()
                    }
                })
                .and_then(|r| r.ok())
                .filter(|&n| n > 0)
                .map(HashCheck::Sampled)
                .ok_or_else(|| format!("hash check `{s}`: use off, all or sampled[:N]")),
        }
    }
}

impl std::fmt::Display for HashCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HashCheck::Off => f.write_str("off"),
            HashCheck::All => f.write_str("all"),
            HashCheck::Sampled(n) => write!(f, "sampled:{n}"),
        }
    }
}

/// Engine tuning. Defaults were chosen by measurement (see README, `benches/`).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Worker threads per drive = reads in flight per drive (the queue depth).
    pub threads_per_drive: usize,
    /// Hard cap on bytes of pooled buffers (in flight plus cached).
    pub buffer_cap_bytes: u64,
    /// Pending pieces each lane of each drive can hold before `submit` blocks.
    pub queue_capacity: usize,
    pub hash_check: HashCheck,
    pub backend: Arc<dyn IoBackend>,
    /// Replicate mode: after a read error a drive gets no new pieces (while another replica is
    /// healthy) for this long, then it is tried again; a drive that keeps failing is retried
    /// once per period.
    pub replica_retry_after: Duration,
    /// Replicate mode: drives not to read at all (copies that `open_layout_degraded` found
    /// missing, foreign or truncated); the others serve every record.
    pub unavailable_drives: Vec<usize>,
    /// Time for the retry period (the system clock; tests advance a manual one).
    pub clock: Arc<dyn Clock>,
    /// Replicate mode: rewrite a copy that failed its hash from the copy that matched
    /// (see `engine/repair.rs`). Off, a bad copy is only read around.
    pub repair: bool,
    /// Prefetch pieces each drive reads at once, at most (0: as many as it has workers).
    /// A demand read that arrives while the drive reads prefetched pieces waits for them, and a
    /// prefetch the router did not choose is cancelled only in its pieces not yet started.
    /// On the medium synthetic model at a 40% memory cap, one drive paced to 1 GiB/s, 2 of 4
    /// read 2.5% fewer bytes per decoded token and decoded 49.9 vs 50.7 ms per token (medians
    /// of 7, within the noise), but a 128-token prompt took ~1% longer and streamed layers'
    /// certain read-ahead shares the cap, so the default stays unlimited
    /// (`benches/results/prefetch_depth_session25.txt`).
    pub prefetch_depth: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads_per_drive: 4,
            buffer_cap_bytes: 1 << 30,
            queue_capacity: 8192,
            hash_check: HashCheck::All,
            backend: Arc::new(PosixBackend::default()),
            replica_retry_after: Duration::from_secs(10),
            unavailable_drives: Vec::new(),
            clock: Arc::new(SystemClock::default()),
            repair: true,
            prefetch_depth: 0,
        }
    }
}
