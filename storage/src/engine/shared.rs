//! What the engine's handle, tickets and workers share.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use crate::backend::{IoBackend, IoFile};
use crate::engine::repair_report::Repair;

use crate::buffer::BufferPool;
use crate::engine::config::HashCheck;
use crate::engine::drive::Drive;
use crate::manifest::{Manifest, RecordId};
use crate::stripe::Mode;

#[derive(Debug)]
pub(crate) struct Shared {
    pub manifest: Arc<Manifest>,
    pub drives: Vec<Drive>,
    pub pool: BufferPool,
    pub hash_check: HashCheck,
    pub completed: AtomicU64,
    pub index: HashMap<RecordId, usize>,
    /// Pieces or records served by another replica after a read error or a hash mismatch.
    pub replica_recoveries: AtomicU64,
    /// Whether bad copies are rewritten from good ones.
    pub repair: bool,
    /// Opens data files for repair.
    pub backend: Arc<dyn IoBackend>,
    /// Repairs done (or attempted), in order.
    pub repairs: Mutex<Vec<Repair>>,
    /// Data files opened for writing, by drive.
    pub repair_files: Mutex<HashMap<usize, Arc<dyn IoFile>>>,
    /// Prefetch pieces a drive reads at once, at most (`EngineConfig::prefetch_depth`; never 0).
    pub prefetch_depth: usize,
}

impl Shared {
    /// Whether records can be read from any drive (more than one full copy).
    pub fn replicated(&self) -> bool {
        self.manifest.mode == Mode::Replicate && self.drives.len() > 1
    }
}
