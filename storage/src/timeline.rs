//! An opt-in event timeline: when each drive read ran, when the forward pass waited for one,
//! and (recorded by the inference crate) when each phase of the pass ran, on one clock. A
//! profile adds time up per phase; overlapping reads with compute is about *when*, so this
//! keeps the intervals (`generate --trace FILE` writes them as JSON lines). Off unless
//! [`set_enabled`]; while off, every record costs one relaxed load.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

static ENABLED: AtomicBool = AtomicBool::new(false);
static EVENTS: Mutex<Vec<Event>> = Mutex::new(Vec::new());
static EPOCH: OnceLock<Instant> = OnceLock::new();
/// Events kept at most, 48 bytes each: a long run stops recording rather than grow past a
/// memory budget (a decoded token of a 16-layer model records ~450).
const MAX_EVENTS: usize = 1 << 20;

/// One interval (an instant when `start_ns == end_ns`), nanoseconds since the timeline began.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Event {
    pub kind: &'static str,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Kind-specific: a drive read's drive; a batch's, a stall's or a prefetch's layer; 0 for
    /// a phase.
    pub a: u64,
    /// Kind-specific: a drive read's bytes; a batch's cached / in-flight / to-read counts
    /// (bits 0-15 / 16-31 / 32-); a prefetch's experts issued.
    pub b: u64,
}

/// Turn recording on or off (process-wide); turning it on starts the clock.
pub fn set_enabled(on: bool) {
    EPOCH.get_or_init(Instant::now);
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Nanoseconds from the timeline's start to `t` (0 before it).
pub fn ns(t: Instant) -> u64 {
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(t.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
}

/// Record the interval `[start, end]` of `kind` (nothing when off).
pub fn record(kind: &'static str, start: Instant, end: Instant, a: u64, b: u64) {
    if !enabled() {
        return;
    }
    let e = Event {
        kind,
        start_ns: ns(start),
        end_ns: ns(end),
        a,
        b,
    };
    let mut v = EVENTS.lock().unwrap_or_else(|p| p.into_inner());
    if v.len() < MAX_EVENTS {
        v.push(e);
    }
}

/// Record an instant of `kind` now.
pub fn mark(kind: &'static str, a: u64, b: u64) {
    if enabled() {
        let now = Instant::now();
        record(kind, now, now, a, b);
    }
}

/// Take every event recorded so far, in start order.
pub fn take() -> Vec<Event> {
    let mut v = std::mem::take(&mut *EVENTS.lock().unwrap_or_else(|p| p.into_inner()));
    v.sort_by_key(|e| (e.start_ns, e.end_ns));
    v
}

/// Write `events` to `path`, one JSON object per line.
pub fn write_jsonl(path: &Path, events: &[Event]) -> std::io::Result<()> {
    let mut w = std::io::BufWriter::new(std::fs::File::create(path)?);
    for e in events {
        serde_json::to_writer(&mut w, e)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_while_enabled_and_orders_by_start() {
        let t0 = Instant::now();
        record("off", t0, t0, 0, 0);
        set_enabled(true);
        let t1 = Instant::now();
        mark("later", 1, 2);
        record("earlier", t0, t1, 3, 4);
        set_enabled(false);
        mark("off again", 0, 0);
        let kinds: Vec<&str> = take()
            .iter()
            // Other tests may be reading while it is on: only this test's kinds.
            .filter(|e| ["off", "later", "earlier", "off again"].contains(&e.kind))
            .map(|e| e.kind)
            .collect();
        assert_eq!(kinds, ["earlier", "later"]);
    }
}
