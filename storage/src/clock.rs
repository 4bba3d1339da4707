//! Time as the engine's drive-health logic sees it: the system clock in production, a manual
//! one in tests (so a retry period is tested by advancing time, not by sleeping).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Time elapsed since an arbitrary start.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn elapsed(&self) -> Duration;
}

/// The monotonic system clock, from when it was made.
#[derive(Debug)]
pub struct SystemClock {
    start: Instant,
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock {
            start: Instant::now(),
        }
    }
}

impl Clock for SystemClock {
    fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    pub fn advance(&self, by: Duration) {
        let n = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(n, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Relaxed))
    }
}
