//! The states of recent conversations, so a follow-up turn prefills only its new tokens: in
//! memory under a byte cap (least recently used dropped first), and optionally as crash-safe
//! snapshots in a directory (`serve --snapshot-dir`), found again after a restart.

use std::path::{Path, PathBuf};

use deltafin_inference::{snapshot, Model, Session};

/// One kept conversation state: the tokens it holds and the session holding them.
struct Entry {
    history: Vec<u32>,
    session: Session,
    used: u64,
}

/// A snapshot on disk: its path and the history it holds.
struct OnDisk {
    path: PathBuf,
    history: Vec<u32>,
}

pub(crate) struct SessionCache {
    entries: Vec<Entry>,
    cap_bytes: usize,
    tick: u64,
    dir: Option<PathBuf>,
    disk: Vec<OnDisk>,
    hash: [u8; 32],
    max_files: usize,
}

/// Where a reused prefix came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reuse {
    None,
    Memory,
    Disk,
}

fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl SessionCache {
    /// Keep at most `cap_bytes` of session state in memory; with `dir`, also snapshots there
    /// (those already in it are indexed now).
    pub(crate) fn new(model: &Model, cap_bytes: usize, dir: Option<&Path>) -> SessionCache {
        let hash = snapshot::model_hash(model, b"deltafin serve");
        let mut disk = Vec::new();
        if let Some(d) = dir {
            if let Ok(rd) = std::fs::read_dir(d) {
                for e in rd.flatten() {
                    let p = e.path();
                    if p.extension().is_some_and(|x| x == "snap") {
                        // A file that does not load (another model, corrupt) is skipped.
                        if let Ok((_, history)) = snapshot::load(&p, model, &hash) {
                            disk.push(OnDisk { path: p, history });
                        }
                    }
                }
            }
        }
        SessionCache {
            entries: Vec::new(),
            cap_bytes,
            tick: 0,
            dir: dir.map(Path::to_path_buf),
            disk,
            hash,
            max_files: 64,
        }
    }

    /// The state that holds the longest prefix of `prompt`, truncated to what `prompt` shares
    /// with it (a fresh session when none does). Returns the session, how many prompt tokens
    /// it already holds, and where they came from.
    pub(crate) fn take(&mut self, model: &Model, prompt: &[u32]) -> (Session, usize, Reuse) {
        let best_mem = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (common(&e.history, prompt), i))
            .max();
        let best_disk = self
            .disk
            .iter()
            .enumerate()
            .map(|(i, e)| (common(&e.history, prompt), i))
            .max();
        let mem_len = best_mem.map_or(0, |b| b.0);
        let disk_len = best_disk.map_or(0, |b| b.0);
        if mem_len > 0 && mem_len >= disk_len {
            if let Some((_, i)) = best_mem {
                let e = self.entries.swap_remove(i);
                let mut session = e.session;
                if let Ok(k) = snapshot::reuse_prefix(&mut session, &e.history, prompt) {
                    if k > 0 {
                        return (session, k, Reuse::Memory);
                    }
                }
            }
        } else if disk_len > 0 {
            if let Some((_, i)) = best_disk {
                if let Ok((mut session, history)) =
                    snapshot::load(&self.disk[i].path, model, &self.hash)
                {
                    if let Ok(k) = snapshot::reuse_prefix(&mut session, &history, prompt) {
                        if k > 0 {
                            return (session, k, Reuse::Disk);
                        }
                    }
                }
            }
        }
        (model.new_session(), 0, Reuse::None)
    }

    /// Keep `session` (holding `history`) for later turns; drop the least recently used
    /// states beyond the cap; write a snapshot when a directory was given.
    pub(crate) fn put(&mut self, model: &Model, history: Vec<u32>, session: Session) {
        if history.is_empty() {
            return;
        }
        if let Some(dir) = &self.dir {
            let name = blake3::hash(
                &history
                    .iter()
                    .flat_map(|t| t.to_le_bytes())
                    .collect::<Vec<u8>>(),
            );
            let path = dir.join(format!("{}.snap", &name.to_hex()[..16]));
            if snapshot::save(&path, model, &self.hash, &session, &history).is_ok() {
                self.disk.retain(|d| d.path != path);
                self.disk.push(OnDisk {
                    path,
                    history: history.clone(),
                });
                while self.disk.len() > self.max_files {
                    let old = self.disk.remove(0);
                    let _ = std::fs::remove_file(&old.path);
                }
            }
        }
        self.tick += 1;
        self.entries.push(Entry {
            history,
            session,
            used: self.tick,
        });
        while self.entries.len() > 1 && self.bytes() > self.cap_bytes {
            if let Some((i, _)) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.used) {
                self.entries.swap_remove(i);
            }
        }
        if self.bytes() > self.cap_bytes {
            self.entries.clear();
        }
    }

    /// Write the kept state that shares the longest prefix with `tokens` to `path` (a
    /// snapshot, written atomically); returns the positions it holds.
    pub(crate) fn save_best(
        &self,
        model: &Model,
        tokens: &[u32],
        path: &Path,
    ) -> anyhow::Result<usize> {
        let best = self
            .entries
            .iter()
            .max_by_key(|e| common(&e.history, tokens))
            .filter(|e| common(&e.history, tokens) > 0)
            .ok_or_else(|| anyhow::anyhow!("no conversation state to save yet"))?;
        snapshot::save(path, model, &self.hash, &best.session, &best.history)?;
        Ok(best.history.len())
    }

    /// Keep the state of a snapshot written by [`SessionCache::save_best`]; returns the
    /// positions it holds.
    pub(crate) fn load_file(&mut self, model: &Model, path: &Path) -> anyhow::Result<usize> {
        let (session, history) = snapshot::load(path, model, &self.hash)?;
        let n = history.len();
        self.put(model, history, session);
        Ok(n)
    }

    /// Bytes of state held in memory.
    pub(crate) fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.session.memory_bytes()).sum()
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}
