//! Planning a layout: which records there are, what each holds and where it sits in the logical
//! byte space, before anything is written.

use crate::checkpoint::Checkpoint;
use crate::error::{Result, StorageError};
use crate::expert_parts::{expert_sources, resident_tensors};
use crate::layout::transform::{ExpertTransform, PartSpec};
use crate::manifest::{ExpertTemplate, RecordId, RecordTensor};
use crate::naming::ExpertNaming;
use crate::stripe::align_up;

/// One source byte range feeding a record.
#[derive(Clone, Debug)]
pub(crate) struct Source {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct PlannedRecord {
    pub id: RecordId,
    pub offset: u64,
    pub len: u64,
    pub sources: Vec<Source>,
    pub tensors: Vec<RecordTensor>,
    /// Expert records rewritten by the transform: the source parts, in `sources` order.
    pub transform_from: Option<Vec<PartSpec>>,
}

/// The records and their logical placement, before anything is written.
#[derive(Debug)]
pub struct Plan {
    pub(crate) records: Vec<PlannedRecord>,
    pub(crate) templates: Vec<ExpertTemplate>,
    pub logical_len: u64,
    pub resident_bytes: u64,
    pub expert_bytes: u64,
    pub expert_records: usize,
}

/// The tensors of one record, each starting 64-byte aligned inside it (so kernels can use
/// aligned loads), and the record's length.
fn pack_parts(parts: Vec<PartSpec>) -> (Vec<RecordTensor>, u64) {
    let mut tensors = Vec::with_capacity(parts.len());
    let mut len = 0u64;
    for p in parts {
        len = len.div_ceil(64) * 64;
        tensors.push(RecordTensor {
            name: p.name,
            dtype: p.dtype,
            shape: p.shape,
            offset: len,
            len: p.len,
        });
        len += p.len;
    }
    (tensors, len)
}

/// Decide the record order: resident tensors first (one record each, file order), then every
/// layer's experts in (layer, expert) order so a layer's records sit together.
pub fn plan(ckpt: &Checkpoint, naming: &ExpertNaming) -> Result<Plan> {
    plan_with(ckpt, naming, None)
}

/// [`plan`], with expert records (and the resident tensors it asks for) rewritten by
/// `transform` (lengths from its output parts).
pub fn plan_with(
    ckpt: &Checkpoint,
    naming: &ExpertNaming,
    transform: Option<&dyn ExpertTransform>,
) -> Result<Plan> {
    let mut records = Vec::new();
    let mut offset = 0u64;
    let mut resident_bytes = 0;
    for t in resident_tensors(ckpt, naming) {
        let source = Source {
            file: t.file,
            offset: t.info.offset,
            len: t.info.len,
        };
        let spec = PartSpec {
            name: t.info.name.clone(),
            dtype: t.info.dtype.clone(),
            shape: t.info.shape.clone(),
            len: t.info.len,
        };
        let rewritten = match transform {
            Some(tr) => tr.resident_parts(&spec)?,
            None => None,
        };
        let (tensors, len, transform_from) = match rewritten {
            Some(parts) => {
                let (tensors, len) = pack_parts(parts);
                (tensors, len, Some(vec![spec]))
            }
            None => (
                vec![RecordTensor {
                    name: spec.name.clone(),
                    dtype: spec.dtype.clone(),
                    shape: spec.shape.clone(),
                    offset: 0,
                    len: spec.len,
                }],
                spec.len,
                None,
            ),
        };
        records.push(PlannedRecord {
            id: RecordId::Resident {
                group: t.info.name.clone(),
            },
            offset,
            len,
            sources: vec![source],
            tensors,
            transform_from,
        });
        resident_bytes += len;
        offset += align_up(len.max(1));
    }
    let mut templates: Vec<ExpertTemplate> = Vec::new();
    let mut expert_bytes = 0;
    let experts = expert_sources(ckpt, naming)?;
    let expert_records = experts.len();
    for e in experts {
        let sources: Vec<Source> = e
            .parts
            .iter()
            .map(|p| Source {
                file: p.file,
                offset: p.offset,
                len: p.len,
            })
            .collect();
        let source_specs: Vec<PartSpec> = e
            .parts
            .iter()
            .map(|p| PartSpec {
                name: p.part.clone(),
                dtype: p.dtype.clone(),
                shape: p.shape.clone(),
                len: p.len,
            })
            .collect();
        let (out_specs, transform_from) = match transform {
            Some(t) => (t.parts(&source_specs)?, Some(source_specs)),
            None => (source_specs, None),
        };
        let (tensors, len) = pack_parts(out_specs);
        match templates.last() {
            Some(t) if t.layer == e.layer => {
                if t.len != len || t.tensors != tensors {
                    return Err(StorageError::InvalidArgument(format!(
                        "layer {} expert {}: tensors differ from the layer's other experts",
                        e.layer, e.expert
                    )));
                }
            }
            _ => templates.push(ExpertTemplate {
                layer: e.layer,
                len,
                tensors: tensors.clone(),
            }),
        }
        records.push(PlannedRecord {
            id: RecordId::Expert {
                layer: e.layer,
                expert: e.expert,
            },
            offset,
            len,
            sources,
            tensors: Vec::new(),
            transform_from,
        });
        expert_bytes += len;
        offset += align_up(len.max(1));
    }
    Ok(Plan {
        records,
        templates,
        logical_len: offset,
        resident_bytes,
        expert_bytes,
        expert_records,
    })
}
