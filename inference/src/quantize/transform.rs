//! [`QuantizeExperts`]: the layout-time transform that stores a BF16 checkpoint's routed experts
//! in a packed format (`deltafin layout --quantize-experts`).

use std::collections::BTreeMap;
use std::sync::Mutex;

use deltafin_formats::codec::float_bytes_to_f32;
use deltafin_formats::Dtype;
use deltafin_storage::layout::{ExpertTransform, PartSpec};
use deltafin_storage::naming::ExpertNaming;
use deltafin_storage::{Result, StorageError};
use serde_json::Value;

use crate::quantize::expert_format::{DenseFormats, ExpertFormat};

/// Error of one quantized expert tensor.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct TensorQuantError {
    /// Checkpoint name of the source tensor.
    pub tensor: String,
    pub layer: u32,
    pub expert: u32,
    pub max_abs: f32,
    pub rel_rms: f32,
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// A non-expert projection (`--quantize-dense`; `layer` is its decoder layer, or
    /// `u32::MAX` outside the layers, and `expert` is `u32::MAX`).
    #[serde(default)]
    pub dense: bool,
}

/// [`ExpertTransform`] quantizing every routed expert matrix (`*.weight`, or a fused
/// `gate_up_proj` / `down_proj` slice; BF16/F16/F32, columns a multiple of 32) to `format`;
/// other parts are copied. Records each tensor's error.
#[derive(Debug)]
pub struct QuantizeExperts {
    pub format: ExpertFormat,
    /// Which resident weights to pack too (`layout --quantize-dense / --quantize-head /
    /// --quantize-embeddings`).
    pub dense: DenseFormats,
    /// Names the source tensors in the error report.
    naming: ExpertNaming,
    errors: Mutex<Vec<TensorQuantError>>,
}

impl QuantizeExperts {
    pub fn new(format: ExpertFormat, naming: ExpertNaming) -> QuantizeExperts {
        QuantizeExperts {
            format,
            dense: DenseFormats::default(),
            naming,
            errors: Mutex::new(Vec::new()),
        }
    }

    /// The resident weights `dense` names too.
    pub fn with_dense(mut self, dense: DenseFormats) -> QuantizeExperts {
        self.dense = dense;
        self
    }

    /// Every tensor quantized so far, in (layer, expert, part) order.
    pub fn errors(&self) -> Vec<TensorQuantError> {
        let mut v = self.errors.lock().map(|e| e.clone()).unwrap_or_default();
        v.sort_by(|a, b| (a.layer, a.expert, &a.tensor).cmp(&(b.layer, b.expert, &b.tensor)));
        v
    }

    /// The matrix name (`gate_proj`; a fused transformers-5 slice is named `gate_up_proj`
    /// with no suffix), rows and columns of a part this transform quantizes.
    fn quantizable(&self, p: &PartSpec) -> Option<(String, u64, u64)> {
        let prefix = match p.name.strip_suffix(".weight") {
            Some(prefix) => prefix,
            None if !p.name.contains('.') => p.name.as_str(),
            None => return None,
        };
        let float = matches!(p.dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32);
        match p.shape[..] {
            [rows, cols] if float && self.format.fits(cols) => {
                Some((prefix.to_string(), rows, cols))
            }
            _ => None,
        }
    }

    /// The format, matrix prefix, rows and columns of a resident tensor this transform packs.
    fn dense_quantizable(&self, p: &PartSpec) -> Option<(ExpertFormat, String, u64, u64)> {
        let prefix = p.name.strip_suffix(".weight")?;
        let float = matches!(p.dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32);
        match p.shape[..] {
            [rows, cols] if float => self
                .dense
                .format_for(&p.name, rows, cols)
                .map(|f| (f, prefix.to_string(), rows, cols)),
            _ => None,
        }
    }
}

impl ExpertTransform for QuantizeExperts {
    fn parts(&self, source: &[PartSpec]) -> Result<Vec<PartSpec>> {
        let mut out = Vec::new();
        for p in source {
            if matches!(p.dtype, Dtype::F8E4m3 | Dtype::I32 | Dtype::U8 | Dtype::I8) {
                return Err(StorageError::InvalidArgument(format!(
                    "--quantize-experts needs a BF16/F16/F32 checkpoint; expert part `{}` is {}",
                    p.name, p.dtype
                )));
            }
            match self.quantizable(p) {
                Some((prefix, rows, cols)) => out.extend(self.format.parts(&prefix, rows, cols)),
                None => out.push(p.clone()),
            }
        }
        Ok(out)
    }

    fn apply(
        &self,
        layer: u32,
        expert: u32,
        source: &[(&PartSpec, &[u8])],
    ) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        let mut errs = Vec::new();
        for (p, bytes) in source {
            let Some((prefix, rows, cols)) = self.quantizable(p) else {
                out.push(bytes.to_vec());
                continue;
            };
            let w = float_bytes_to_f32(&p.dtype, bytes)
                .filter(|w| w.len() as u64 == rows * cols)
                .ok_or_else(|| {
                    StorageError::InvalidArgument(format!(
                        "layer {layer} expert {expert} `{}`: {} bytes do not hold {rows}x{cols} {}",
                        p.name,
                        bytes.len(),
                        p.dtype
                    ))
                })?;
            let (parts, error) = self.format.encode(&w, rows as usize, cols as usize);
            let tensor = if p.name.ends_with(".weight") {
                self.naming
                    .expert_tensor(layer, expert, &format!("{prefix}.weight"))
            } else {
                format!("{}[{expert}]", self.naming.fused_tensor(layer, &prefix))
            };
            errs.push(TensorQuantError {
                tensor,
                layer,
                expert,
                max_abs: error.max_abs,
                rel_rms: error.rel_rms,
                bytes_in: bytes.len() as u64,
                bytes_out: parts.iter().map(|b| b.len() as u64).sum(),
                dense: false,
            });
            out.extend(parts);
        }
        if let Ok(mut e) = self.errors.lock() {
            e.extend(errs);
        }
        Ok(out)
    }

    fn resident_parts(&self, source: &PartSpec) -> Result<Option<Vec<PartSpec>>> {
        Ok(self
            .dense_quantizable(source)
            .map(|(f, prefix, rows, cols)| f.parts(&prefix, rows, cols)))
    }

    fn apply_resident(&self, source: &PartSpec, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let Some((f, _, rows, cols)) = self.dense_quantizable(source) else {
            return Ok(vec![bytes.to_vec()]);
        };
        let w = float_bytes_to_f32(&source.dtype, bytes)
            .filter(|w| w.len() as u64 == rows * cols)
            .ok_or_else(|| {
                StorageError::InvalidArgument(format!(
                    "`{}`: {} bytes do not hold {rows}x{cols} {}",
                    source.name,
                    bytes.len(),
                    source.dtype
                ))
            })?;
        let (parts, error) = f.encode(&w, rows as usize, cols as usize);
        let layer = source
            .name
            .split(".layers.")
            .nth(1)
            .and_then(|r| r.split('.').next())
            .and_then(|l| l.parse().ok())
            .unwrap_or(u32::MAX);
        let e = TensorQuantError {
            tensor: source.name.clone(),
            layer,
            expert: u32::MAX,
            max_abs: error.max_abs,
            rel_rms: error.rel_rms,
            bytes_in: bytes.len() as u64,
            bytes_out: parts.iter().map(|b| b.len() as u64).sum(),
            dense: true,
        };
        if let Ok(mut errs) = self.errors.lock() {
            errs.push(e);
        }
        Ok(parts)
    }

    fn config(&self, source: &Value) -> Result<Value> {
        // Kimi K3 keeps the text model's settings in text_config.
        let k3 = source.get("model_type").and_then(Value::as_str) == Some("kimi_k3");
        let text = |v: &Value| -> Option<Value> {
            if k3 {
                v.get("text_config").cloned()
            } else {
                Some(v.clone())
            }
        };
        if text(source)
            .and_then(|t| t.get("quantization_config").cloned())
            .is_some_and(|q| !q.is_null())
        {
            return Err(StorageError::InvalidArgument(
                "--quantize-experts needs an unquantized (BF16) checkpoint; this one has a \
                 quantization_config"
                    .into(),
            ));
        }
        let mut cfg = source.clone();
        let target = if k3 {
            cfg.get_mut("text_config")
        } else {
            Some(&mut cfg)
        };
        if let Some(o) = target.and_then(Value::as_object_mut) {
            let q = if self.dense.any() {
                self.format.quantization_config_with_dense(self.dense)
            } else {
                self.format.quantization_config()
            };
            o.insert("quantization_config".into(), q);
        }
        Ok(cfg)
    }

    fn meta(&self) -> BTreeMap<String, String> {
        let errs = self.errors();
        let n = errs.len().max(1) as f64;
        let mut m = BTreeMap::new();
        m.insert("quantize_experts".into(), self.format.to_string());
        if self.dense.any() {
            m.insert("quantize_dense".into(), self.dense.to_string());
        }
        m.insert("quantize_tensors".into(), errs.len().to_string());
        let max_rel = errs.iter().fold(0f32, |a, e| a.max(e.rel_rms));
        let mean_rel = errs.iter().map(|e| e.rel_rms as f64).sum::<f64>() / n;
        let max_abs = errs.iter().fold(0f32, |a, e| a.max(e.max_abs));
        m.insert("quantize_rel_rms_max".into(), format!("{max_rel:.6}"));
        m.insert("quantize_rel_rms_mean".into(), format!("{mean_rel:.6}"));
        m.insert("quantize_max_abs".into(), format!("{max_abs:.6}"));
        let (bi, bo) = errs
            .iter()
            .fold((0u64, 0u64), |(a, b), e| (a + e.bytes_in, b + e.bytes_out));
        m.insert("quantize_bytes_in".into(), bi.to_string());
        m.insert("quantize_bytes_out".into(), bo.to_string());
        m
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn transform_parts_match_encode() {
        let t = QuantizeExperts::new(ExpertFormat::Int4, ExpertNaming::hf("mlp.experts."));
        let src = [PartSpec::new("gate_proj.weight", Dtype::Bf16, &[4, 64])];
        let parts = t.parts(&src).unwrap();
        let names: Vec<_> = parts.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "gate_proj.weight_packed",
                "gate_proj.weight_scale",
                "gate_proj.weight_shape"
            ]
        );
        let bytes = vec![0x3fu8; 4 * 64 * 2];
        let out = t.apply(1, 2, &[(&src[0], &bytes)]).unwrap();
        for (p, b) in parts.iter().zip(&out) {
            assert_eq!(p.len, b.len() as u64, "{}", p.name);
        }
        assert_eq!(t.errors().len(), 1);
    }
}
