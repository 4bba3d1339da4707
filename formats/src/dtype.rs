//! Tensor element types, spelled as safetensors headers spell them.

use serde::{Deserialize, Serialize};

/// Element types. Types we do not compute with are kept as opaque bytes under their name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    I16,
    U16,
    I32,
    U32,
    I64,
    U64,
    F16,
    Bf16,
    F32,
    F64,
    F8E4m3,
    F8E5m2,
    /// A dtype this version does not interpret; its bytes are carried verbatim.
    Opaque(String),
}

impl Dtype {
    /// Parse the safetensors spelling (`"BF16"`, `"F8_E4M3"`, ...).
    pub fn parse(name: &str) -> Dtype {
        match name {
            "BOOL" => Dtype::Bool,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "I16" => Dtype::I16,
            "U16" => Dtype::U16,
            "I32" => Dtype::I32,
            "U32" => Dtype::U32,
            "I64" => Dtype::I64,
            "U64" => Dtype::U64,
            "F16" => Dtype::F16,
            "BF16" => Dtype::Bf16,
            "F32" => Dtype::F32,
            "F64" => Dtype::F64,
            "F8_E4M3" => Dtype::F8E4m3,
            "F8_E5M2" => Dtype::F8E5m2,
            other => Dtype::Opaque(other.to_string()),
        }
    }

    /// The safetensors spelling.
    pub fn as_str(&self) -> &str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::F8E4m3 => "F8_E4M3",
            Dtype::F8E5m2 => "F8_E5M2",
            Dtype::Opaque(name) => name,
        }
    }

    /// Bytes per element, or `None` for opaque types whose size we cannot know.
    pub fn size_bytes(&self) -> Option<u64> {
        Some(match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4m3 | Dtype::F8E5m2 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
            Dtype::Opaque(_) => return None,
        })
    }
}

impl Serialize for Dtype {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Dtype {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Ok(Dtype::parse(&name))
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}
