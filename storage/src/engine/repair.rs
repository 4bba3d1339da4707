//! Self-healing mirrors: a range of a drive's data file that served corrupt bytes is rewritten
//! from a copy that matched its hash, read back and compared, logged in the layout folder
//! (`repair.log`) and reported ([`Repair`]; `Engine::repairs`). Only replicated layouts have a
//! good copy to repair from.

use std::io::Write;
use std::sync::Arc;

use crate::backend::IoFile;
use crate::buffer::AlignedBuf;
use crate::engine::repair_report::{Repair, REPAIR_LOG_FILE};
use crate::engine::shared::Shared;

/// Rewrite `good` at `offset` of `drive`'s data file, read it back and compare; record and
/// log the outcome.
pub(crate) fn repair_range(
    shared: &Shared,
    drive: usize,
    offset: u64,
    good: &[u8],
    what: &str,
    from_drive: usize,
) -> Repair {
    let path = shared.drives[drive].path.clone();
    let result = rewrite(shared, drive, offset, good);
    let repair = Repair {
        drive,
        path,
        offset,
        len: good.len() as u64,
        what: what.to_string(),
        from_drive,
        error: result.err(),
    };
    log(&repair);
    shared
        .repairs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(repair.clone());
    repair
}

fn rewrite(shared: &Shared, drive: usize, offset: u64, good: &[u8]) -> Result<(), String> {
    let file = writer(shared, drive)?;
    file.write_all_at(good, offset)
        .map_err(|e| format!("write failed: {e}"))?;
    let mut back = AlignedBuf::zeroed(good.len());
    shared.drives[drive]
        .read(drive, &mut back, offset)
        .map_err(|e| format!("reading it back failed: {e}"))?;
    if &back[..] != good {
        return Err("it read back different from what was written".into());
    }
    Ok(())
}

/// The drive's data file opened for writing (once per drive).
fn writer(shared: &Shared, drive: usize) -> Result<Arc<dyn IoFile>, String> {
    let mut files = shared
        .repair_files
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(f) = files.get(&drive) {
        return Ok(f.clone());
    }
    let path = &shared.drives[drive].path;
    let f = shared
        .backend
        .open_for_repair(path)
        .map_err(|e| format!("cannot open for writing: {e}"))?;
    files.insert(drive, f.clone());
    Ok(f)
}

/// Append a line to `repair.log` beside the drive's data file (best effort: the repair is
/// reported either way).
fn log(r: &Repair) {
    let Some(dir) = r.path.parent() else { return };
    let when = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(REPAIR_LOG_FILE))
    {
        let _ = writeln!(f, "{when} {r}");
    }
}
