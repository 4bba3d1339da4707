//! `tojson` as Hugging Face's chat-template environment defines it: Python's
//! `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)`
//! (`", "` and `": "` between items, `","` at line ends with an indent, non-ASCII kept,
//! Python's float repr) over minijinja values, keys in their given order.

use minijinja::value::{Value, ValueKind};

/// How to lay the JSON out.
#[derive(Debug, Clone, Default)]
pub struct PyJson {
    /// Spaces per level (`indent=N`); `None`: one line.
    pub indent: Option<usize>,
    /// `(item separator, key separator)`; Python's defaults when `None`.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
}

impl PyJson {
    pub fn dumps(&self, v: &Value) -> Result<String, String> {
        let mut out = String::new();
        self.write(v, 0, &mut out)?;
        Ok(out)
    }

    fn seps(&self) -> (&str, &str) {
        match &self.separators {
            Some((a, b)) => (a.as_str(), b.as_str()),
            None if self.indent.is_some() => (",", ": "),
            None => (", ", ": "),
        }
    }

    fn newline(&self, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    }

    fn write(&self, v: &Value, level: usize, out: &mut String) -> Result<(), String> {
        let (item_sep, key_sep) = self.seps();
        match v.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number if v.is_integer() => out.push_str(&v.to_string()),
            ValueKind::Number => {
                let f = f64::try_from(v.clone()).map_err(|e| e.to_string())?;
                out.push_str(&py_float(f));
            }
            ValueKind::String => write_str(v.as_str().unwrap_or(""), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter().map_err(|e| e.to_string())?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(item_sep);
                    }
                    self.newline(level + 1, out);
                    match k.as_str() {
                        Some(s) => write_str(s, out),
                        // Python turns non-string keys into strings.
                        None => write_str(&k.to_string(), out),
                    }
                    out.push_str(key_sep);
                    let item = v.get_item(k).map_err(|e| e.to_string())?;
                    self.write(&item, level + 1, out)?;
                }
                self.newline(level, out);
                out.push('}');
            }
            _ => write_str(&v.to_string(), out),
        }
        Ok(())
    }
}

/// A JSON string with `ensure_ascii=False`: quotes, backslashes and control characters escaped,
/// everything else as is.
fn write_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest digits that round-trip, positional for exponents from
/// -4 to 15, else `d.ddde+XX`; `NaN` / `Infinity` as `json.dumps` writes them.
pub fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Shortest round-trip digits and exponent from Rust's `{:e}`: "-1.2345e-7".
    let sci = format!("{f:e}");
    let (mant, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let neg = mant.starts_with('-');
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if neg { "-" } else { "" };
    if (-4..16).contains(&exp) {
        let point = exp + 1; // digits before the decimal point
        let s = if point <= 0 {
            format!("0.{}{}", "0".repeat((-point) as usize), digits)
        } else if point as usize >= digits.len() {
            format!("{}{}.0", digits, "0".repeat(point as usize - digits.len()))
        } else {
            format!(
                "{}.{}",
                &digits[..point as usize],
                &digits[point as usize..]
            )
        };
        format!("{sign}{s}")
    } else {
        let m = if digits.len() > 1 {
            format!("{}.{}", &digits[..1], &digits[1..])
        } else {
            digits
        };
        format!(
            "{sign}{m}e{}{:02}",
            if exp < 0 { '-' } else { '+' },
            exp.abs()
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_does() {
        for (f, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (100.0, "100.0"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (-2.5, "-2.5"),
            (2.71875, "2.71875"),
        ] {
            assert_eq!(py_float(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_like_python() {
        let v: Value = serde_json::from_str(
            r#"{"b": [1, 2.5, "é\n\"x\""], "a": {}, "c": null, "d": true, "e": []}"#,
        )
        .unwrap();
        assert_eq!(
            PyJson::default().dumps(&v).unwrap(),
            r#"{"b": [1, 2.5, "é\n\"x\""], "a": {}, "c": null, "d": true, "e": []}"#
        );
        let indented = PyJson {
            indent: Some(2),
            ..PyJson::default()
        };
        assert_eq!(
            indented.dumps(&v).unwrap(),
            "{\n  \"b\": [\n    1,\n    2.5,\n    \"é\\n\\\"x\\\"\"\n  ],\n  \"a\": {},\n  \"c\": null,\n  \"d\": true,\n  \"e\": []\n}"
        );
    }
}
