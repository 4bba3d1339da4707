//! The safetensors container: parse an untrusted header, write a new file.
//!
//! Layout: `u64 little-endian header length N`, `N bytes of JSON`, then the data section.
//! The JSON maps tensor names to `{dtype, shape, data_offsets: [begin, end]}` (offsets relative
//! to the data section) plus an optional `__metadata__` string map.
//!
//! Every number here comes from a file we did not write, so all arithmetic is checked, the header
//! is capped at [`MAX_HEADER_BYTES`], and tensors must lie inside the data section without
//! overlapping one another.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::Path;

use serde::Deserialize;

use crate::error::{SafetensorsError, StorageError};

/// Headers larger than this are refused (the reference implementation uses the same cap).
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

pub use deltafin_formats::Dtype;

/// One tensor's entry in a header, with offsets made absolute within the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Absolute byte offset of the first byte in the file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl TensorInfo {
    /// Number of elements (checked when the header was parsed).
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A parsed and validated header.
#[derive(Clone, Debug, Default)]
pub struct Header {
    /// Tensors in file order (by offset).
    pub tensors: Vec<TensorInfo>,
    pub metadata: BTreeMap<String, String>,
    /// Absolute offset of the data section (8 + header length).
    pub data_offset: u64,
    /// Length of the data section the header claims (end of the last tensor).
    pub data_len: u64,
}

impl Header {
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Total file length the header implies.
    pub fn file_len(&self) -> u64 {
        self.data_offset + self.data_len
    }
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// Reads the 8-byte length prefix and checks it against the cap and, if known, the file length.
pub fn parse_prefix(prefix: &[u8; 8], file_len: Option<u64>) -> Result<u64, SafetensorsError> {
    let n = u64::from_le_bytes(*prefix);
    if n > MAX_HEADER_BYTES {
        return Err(SafetensorsError::HeaderTooLarge {
            len: n,
            cap: MAX_HEADER_BYTES,
        });
    }
    if let Some(file_len) = file_len {
        let end = 8u64
            .checked_add(n)
            .ok_or(SafetensorsError::HeaderTooLarge {
                len: n,
                cap: MAX_HEADER_BYTES,
            })?;
        if end > file_len {
            return Err(SafetensorsError::HeaderPastEnd {
                header_len: n,
                file_len,
            });
        }
    }
    Ok(n)
}

/// Parse the JSON header (the `N` bytes after the prefix). `data_offset` is `8 + N`.
pub fn parse_header_json(json: &[u8], data_offset: u64) -> Result<Header, SafetensorsError> {
    let raw: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(json).map_err(|e| SafetensorsError::Json(e.to_string()))?;
    let mut header = Header {
        data_offset,
        ..Header::default()
    };
    for (name, value) in raw {
        if name == "__metadata__" {
            let map: BTreeMap<String, String> = serde_json::from_value(value)
                .map_err(|e| SafetensorsError::Json(format!("__metadata__: {e}")))?;
            header.metadata = map;
            continue;
        }
        let entry: RawEntry =
            serde_json::from_value(value).map_err(|e| SafetensorsError::BadEntry {
                tensor: name.clone(),
                reason: e.to_string(),
            })?;
        let [begin, end] = entry.data_offsets;
        if end < begin {
            return Err(SafetensorsError::BadEntry {
                tensor: name,
                reason: format!("data_offsets [{begin}, {end}] end before begin"),
            });
        }
        let len = end - begin;
        let dtype = Dtype::parse(&entry.dtype);
        let numel = entry
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| SafetensorsError::BadEntry {
                tensor: name.clone(),
                reason: format!("shape {:?} overflows", entry.shape),
            })?;
        if let Some(size) = dtype.size_bytes() {
            let want = numel
                .checked_mul(size)
                .ok_or_else(|| SafetensorsError::BadEntry {
                    tensor: name.clone(),
                    reason: format!("shape {:?} overflows", entry.shape),
                })?;
            if want != len {
                return Err(SafetensorsError::LengthMismatch {
                    tensor: name,
                    dtype: dtype.as_str().to_string(),
                    shape: entry.shape,
                    expected: want,
                    got: len,
                });
            }
        }
        let offset = data_offset
            .checked_add(begin)
            .ok_or_else(|| SafetensorsError::BadEntry {
                tensor: name.clone(),
                reason: "offset overflows".into(),
            })?;
        header.tensors.push(TensorInfo {
            name,
            dtype,
            shape: entry.shape,
            offset,
            len,
        });
    }
    header.tensors.sort_by_key(|t| (t.offset, t.len));
    // Tensors may not overlap; gaps are tolerated (some writers align tensors).
    let mut cursor = data_offset;
    for t in &header.tensors {
        if t.offset < cursor {
            return Err(SafetensorsError::Overlap {
                tensor: t.name.clone(),
                offset: t.offset,
            });
        }
        cursor = t.offset + t.len; // cannot overflow: offset+len <= data_offset + end, both u64-checked
    }
    header.data_len = cursor - data_offset;
    Ok(header)
}

/// Parse a whole in-memory file (header and data); checks every tensor lies within `bytes`.
pub fn parse_bytes(bytes: &[u8]) -> Result<Header, SafetensorsError> {
    let prefix: [u8; 8] =
        bytes
            .get(..8)
            .and_then(|p| p.try_into().ok())
            .ok_or(SafetensorsError::TooShort {
                len: bytes.len() as u64,
            })?;
    let n = parse_prefix(&prefix, Some(bytes.len() as u64))?;
    // n <= MAX_HEADER_BYTES and 8 + n <= bytes.len(), checked above.
    let json = &bytes[8..8 + n as usize];
    let header = parse_header_json(json, 8 + n)?;
    check_within(&header, bytes.len() as u64)?;
    Ok(header)
}

/// Every tensor must end within a file of `file_len` bytes.
pub fn check_within(header: &Header, file_len: u64) -> Result<(), SafetensorsError> {
    for t in &header.tensors {
        let end = t.offset + t.len;
        if end > file_len {
            return Err(SafetensorsError::Truncated {
                tensor: t.name.clone(),
                offset: t.offset,
                end,
                file_len,
            });
        }
    }
    Ok(())
}

/// Read and validate the header of a file on disk, including that the file holds all its data.
pub fn read_header(path: &Path) -> Result<Header, StorageError> {
    let wrap = |source| StorageError::Safetensors {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(|e| StorageError::io(path, "open", e))?;
    let file_len = file
        .metadata()
        .map_err(|e| StorageError::io(path, "stat", e))?
        .len();
    let mut prefix = [0u8; 8];
    if file_len < 8 {
        return Err(wrap(SafetensorsError::TooShort { len: file_len }));
    }
    file.read_exact(&mut prefix)
        .map_err(|e| StorageError::io(path, "read header", e))?;
    let n = parse_prefix(&prefix, Some(file_len)).map_err(wrap)?;
    let mut json = vec![0u8; n as usize];
    file.read_exact(&mut json)
        .map_err(|e| StorageError::io(path, "read header", e))?;
    let header = parse_header_json(&json, 8 + n).map_err(wrap)?;
    check_within(&header, file_len).map_err(wrap)?;
    Ok(header)
}

/// Declares one tensor to be written by [`write_header`].
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[u64]) -> Self {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    /// Byte length (opaque dtypes are not writable).
    pub fn byte_len(&self) -> u64 {
        self.shape.iter().product::<u64>() * self.dtype.size_bytes().unwrap_or(1)
    }
}

/// Writes a safetensors header for `tensors` (data follows in the same order) and returns the
/// header's total length including the prefix. The JSON is padded with spaces to a multiple of 8
/// so the data section is aligned, as the reference writer does.
pub fn write_header<W: Write>(
    out: &mut W,
    tensors: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
) -> std::io::Result<u64> {
    let mut map = serde_json::Map::new();
    if !metadata.is_empty() {
        map.insert("__metadata__".into(), serde_json::to_value(metadata)?);
    }
    let mut offset = 0u64;
    for t in tensors {
        let len = t.byte_len();
        map.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": t.dtype.as_str(),
                "shape": t.shape,
                "data_offsets": [offset, offset + len],
            }),
        );
        offset += len;
    }
    let mut json = serde_json::to_vec(&map)?;
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    out.write_all(&(json.len() as u64).to_le_bytes())?;
    out.write_all(&json)?;
    Ok(8 + json.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(json: &str, data_len: usize) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data_len));
        v
    }

    #[test]
    fn round_trip() {
        let specs = vec![
            TensorSpec::new("a", Dtype::Bf16, &[2, 3]),
            TensorSpec::new("b", Dtype::F8E4m3, &[5]),
            TensorSpec::new("c", Dtype::I32, &[1]),
        ];
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let mut out = Vec::new();
        let hl = write_header(&mut out, &specs, &meta).unwrap();
        assert_eq!(hl % 8, 0);
        out.extend(std::iter::repeat_n(7u8, 12 + 5 + 4));
        let h = parse_bytes(&out).unwrap();
        assert_eq!(h.tensors.len(), 3);
        assert_eq!(h.get("b").unwrap().dtype, Dtype::F8E4m3);
        assert_eq!(h.get("b").unwrap().offset, hl + 12);
        assert_eq!(h.metadata["format"], "pt");
        assert_eq!(h.file_len(), out.len() as u64);
    }

    #[test]
    fn rejects_lying_length() {
        let mut bytes = file_with(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            8,
        );
        bytes[0..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(matches!(
            parse_bytes(&bytes),
            Err(SafetensorsError::HeaderTooLarge { .. })
        ));
        bytes[0..8].copy_from_slice(&1000u64.to_le_bytes());
        assert!(matches!(
            parse_bytes(&bytes),
            Err(SafetensorsError::HeaderPastEnd { .. })
        ));
    }

    #[test]
    fn rejects_bad_offsets() {
        let b = file_with(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,12]}}"#,
            12,
        );
        match parse_bytes(&b) {
            Err(SafetensorsError::LengthMismatch {
                tensor,
                expected: 8,
                got: 12,
                ..
            }) => {
                assert_eq!(tensor, "a")
            }
            other => panic!("{other:?}"),
        }
        let b = file_with(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            4,
        );
        assert!(matches!(
            parse_bytes(&b),
            Err(SafetensorsError::Truncated { .. })
        ));
        let b = file_with(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
        );
        assert!(matches!(
            parse_bytes(&b),
            Err(SafetensorsError::Overlap { .. })
        ));
        let b = file_with(
            r#"{"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}}"#,
            8,
        );
        assert!(matches!(
            parse_bytes(&b),
            Err(SafetensorsError::BadEntry { .. })
        ));
        let b = file_with(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}}"#,
            8,
        );
        assert!(matches!(
            parse_bytes(&b),
            Err(SafetensorsError::BadEntry { .. })
        ));
        assert!(matches!(
            parse_bytes(b"abc"),
            Err(SafetensorsError::TooShort { .. })
        ));
        let b = file_with("{not json", 0);
        assert!(matches!(parse_bytes(&b), Err(SafetensorsError::Json(_))));
    }

    #[test]
    fn opaque_dtype_kept() {
        let b = file_with(
            r#"{"a":{"dtype":"F4_WEIRD","shape":[3],"data_offsets":[0,2]}}"#,
            2,
        );
        let h = parse_bytes(&b).unwrap();
        assert_eq!(h.tensors[0].dtype, Dtype::Opaque("F4_WEIRD".into()));
        assert_eq!(h.tensors[0].len, 2);
    }
}
