//! Progress reports from long storage operations (the CLI maps them onto a progress bar).

/// Receives progress in bytes.
pub trait Progress: Send + Sync {
    fn start(&self, _total_bytes: u64, _what: &str) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

/// A progress sink that ignores everything.
#[derive(Debug, Default)]
pub struct NoProgress;
impl Progress for NoProgress {}
