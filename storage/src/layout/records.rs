//! Writing the planned records into the logical byte space: resident tensors and routed
//! experts copied from the checkpoint (or rewritten by a transform), each hashed as written.

use crate::checkpoint::Checkpoint;
use crate::error::{Result, StorageError};
use crate::layout::plan::{Plan, PlannedRecord};
use crate::layout::transform::{ExpertTransform, PartSpec};
use crate::layout::writer::LogicalWriter;
use crate::manifest::{RecordEntry, RecordId, RecordTensor};
use crate::record_hash::RecordHasher;

/// Bytes copied from the checkpoint per write.
const CHUNK: u64 = 4 << 20;

/// Write every record of `plan` in order; returns their manifest entries.
pub(crate) fn write_records(
    ckpt: &Checkpoint,
    plan: &Plan,
    transform: Option<&dyn ExpertTransform>,
    lw: &mut LogicalWriter<'_>,
) -> Result<Vec<RecordEntry>> {
    let mut entries = Vec::with_capacity(plan.records.len());
    for r in &plan.records {
        lw.pad_to(r.offset)?;
        let template = match &r.id {
            RecordId::Expert { layer, .. } => plan
                .templates
                .iter()
                .find(|t| t.layer == *layer)
                .map(|t| t.tensors.as_slice())
                .unwrap_or_default(),
            RecordId::Resident { .. } => &r.tensors[..],
        };
        let mut out = RecordOut {
            lw: &mut *lw,
            hasher: RecordHasher::new(),
            pos: 0,
        };
        match (&r.transform_from, transform, &r.id) {
            (Some(from), Some(t), RecordId::Expert { layer, expert }) => {
                write_transformed(ckpt, r, from, t, (*layer, *expert), template, &mut out)?
            }
            (Some(from), Some(t), RecordId::Resident { .. }) => {
                write_transformed_resident(ckpt, r, from, t, template, &mut out)?
            }
            _ => write_copied(ckpt, r, template, &mut out)?,
        }
        let (hash, xxh3) = out.hasher.finish();
        entries.push(RecordEntry {
            id: r.id.clone(),
            offset: r.offset,
            len: r.len,
            hash,
            xxh3: Some(xxh3),
            tensors: r.tensors.clone(),
        });
    }
    Ok(entries)
}

/// One record being written: its hash and position within it.
struct RecordOut<'w, 'p> {
    lw: &'w mut LogicalWriter<'p>,
    hasher: RecordHasher,
    pos: u64,
}

impl RecordOut<'_, '_> {
    /// Zero padding up to `at` (tensors start 64-byte aligned inside a record).
    fn pad_to(&mut self, at: u64) -> Result<()> {
        if at > self.pos {
            let zeros = vec![0u8; (at - self.pos) as usize];
            self.write(&zeros)?;
        }
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.hasher.update(bytes);
        self.lw.write(bytes)?;
        self.pos += bytes.len() as u64;
        Ok(())
    }
}

/// Copy a record's source ranges from the checkpoint at its tensors' offsets.
fn write_copied(
    ckpt: &Checkpoint,
    r: &PlannedRecord,
    template: &[RecordTensor],
    out: &mut RecordOut<'_, '_>,
) -> Result<()> {
    for (si, s) in r.sources.iter().enumerate() {
        let at = template.get(si).map_or(out.pos, |t| t.offset);
        out.pad_to(at)?;
        let mut done = 0;
        while done < s.len {
            let n = (s.len - done).min(CHUNK);
            out.write(ckpt.slice(s.file, s.offset + done, n))?;
            done += n;
        }
    }
    Ok(())
}

/// Run an expert's source parts through the transform and write what it returns, checking
/// each part against the planned length.
fn write_transformed(
    ckpt: &Checkpoint,
    r: &PlannedRecord,
    from: &[PartSpec],
    t: &dyn ExpertTransform,
    (layer, expert): (u32, u32),
    template: &[RecordTensor],
    out: &mut RecordOut<'_, '_>,
) -> Result<()> {
    let inputs: Vec<(&PartSpec, &[u8])> = from
        .iter()
        .zip(&r.sources)
        .map(|(p, s)| (p, ckpt.slice(s.file, s.offset, s.len)))
        .collect();
    let parts = t.apply(layer, expert, &inputs)?;
    write_parts(r, &parts, template, out)
}

/// A resident tensor rewritten by the transform.
fn write_transformed_resident(
    ckpt: &Checkpoint,
    r: &PlannedRecord,
    from: &[PartSpec],
    t: &dyn ExpertTransform,
    template: &[RecordTensor],
    out: &mut RecordOut<'_, '_>,
) -> Result<()> {
    let (Some(spec), Some(s)) = (from.first(), r.sources.first()) else {
        return Err(StorageError::InvalidArgument(format!(
            "{}: a rewritten resident record has one source tensor",
            r.id
        )));
    };
    let parts = t.apply_resident(spec, ckpt.slice(s.file, s.offset, s.len))?;
    write_parts(r, &parts, template, out)
}

/// Write a transform's output parts at the planned offsets, each checked against its planned
/// length.
fn write_parts(
    r: &PlannedRecord,
    parts: &[Vec<u8>],
    template: &[RecordTensor],
    out: &mut RecordOut<'_, '_>,
) -> Result<()> {
    if parts.len() != template.len() {
        return Err(StorageError::InvalidArgument(format!(
            "{}: transform returned {} parts, planned {}",
            r.id,
            parts.len(),
            template.len()
        )));
    }
    for (bytes, spec) in parts.iter().zip(template) {
        if bytes.len() as u64 != spec.len {
            return Err(StorageError::InvalidArgument(format!(
                "{}: transform returned {} bytes for `{}`, planned {}",
                r.id,
                bytes.len(),
                spec.name,
                spec.len
            )));
        }
        out.pad_to(spec.offset)?;
        out.write(bytes)?;
    }
    Ok(())
}
