//! The drives' manifest copies must agree: each copy is checked against its own content hash
//! when it is read ([`Manifest::from_bytes`]), and every copy against the one a layout was
//! opened from. A difference is named by its JSON path (`config.routed_scaling_factor`,
//! `records[12].id`) with both values.

use std::path::Path;

use serde_json::Value;

use crate::error::{Result, StorageError};
use crate::manifest::Manifest;

/// The first place where `a` and `b` differ, as (path, a's value, b's value).
pub fn first_difference(a: &Value, b: &Value) -> Option<(String, String, String)> {
    fn walk(a: &Value, b: &Value, at: &mut String) -> Option<(String, String, String)> {
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
                keys.sort();
                keys.dedup();
                for k in keys {
                    let len = at.len();
                    if !at.is_empty() {
                        at.push('.');
                    }
                    at.push_str(k);
                    let (va, vb) = (
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                    );
                    if let Some(d) = walk(va, vb, at) {
                        return Some(d);
                    }
                    at.truncate(len);
                }
                None
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                    let len = at.len();
                    at.push_str(&format!("[{i}]"));
                    if let Some(d) = walk(va, vb, at) {
                        return Some(d);
                    }
                    at.truncate(len);
                }
                None
            }
            _ if a == b => None,
            _ => Some((at.clone(), short(a), short(b))),
        }
    }
    walk(a, b, &mut String::new())
}

/// A value for an error message (long arrays and objects abbreviated).
fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 120 {
        let head: String = s.chars().take(100).collect();
        format!("{head}... ({} characters)", s.len())
    } else {
        s
    }
}

/// Check that `other` (drive `drive`'s copy, read from `path`) agrees with `here` (the copy the
/// layout was opened from, on drive `here_drive`).
pub(crate) fn check_agrees(
    here: &Manifest,
    other: &Manifest,
    drive: usize,
    path: &Path,
) -> Result<()> {
    let (a, b) = (here.shared_content(), other.shared_content());
    match first_difference(&a, &b) {
        None => Ok(()),
        Some((field, here_v, there_v)) => Err(StorageError::ManifestDisagrees {
            drive,
            path: path.to_path_buf(),
            here_drive: here.this_drive,
            field,
            here: here_v,
            there: there_v,
        }),
    }
}

/// A copy that failed its content hash (`err`), compared with another drive's good copy to
/// say what was changed: the same error, with the differing field added when one is found.
pub(crate) fn explain_tampered(
    err: StorageError,
    bad_bytes: &[u8],
    good: &Manifest,
) -> StorageError {
    let StorageError::ManifestTampered { path, reason, .. } = err else {
        return err;
    };
    let field = Manifest::from_bytes_unauthenticated(&path, bad_bytes)
        .ok()
        .and_then(|bad| first_difference(&bad.shared_content(), &good.shared_content()))
        .map(|(f, bad_v, good_v)| {
            format!(
                "`{f}` is {bad_v} there but {good_v} in drive {}'s copy",
                good.this_drive
            )
        });
    StorageError::ManifestTampered {
        path,
        reason,
        field,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn names_the_first_differing_path() {
        let a = json!({"config": {"x": 1, "y": [1, 2]}, "records": [{"id": "a"}, {"id": "b"}]});
        let mut b = a.clone();
        assert_eq!(first_difference(&a, &b), None);
        b["records"][1]["id"] = json!("c");
        assert_eq!(
            first_difference(&a, &b),
            Some(("records[1].id".into(), "\"b\"".into(), "\"c\"".into()))
        );
        let mut c = a.clone();
        c["config"]["y"] = json!([1, 2, 3]);
        assert_eq!(
            first_difference(&a, &c).map(|d| d.0),
            Some("config.y".into())
        );
        let mut d = a.clone();
        d["config"]["z"] = json!(true);
        assert_eq!(
            first_difference(&a, &d),
            Some(("config.z".into(), "null".into(), "true".into()))
        );
    }
}
