//! [`ChatTemplate`]: a model's Jinja `chat_template` rendered the way Hugging Face's
//! `apply_chat_template` renders it (transformers' `render_jinja_template`): `trim_blocks` and
//! `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, a Python `tojson`
//! (non-ASCII kept, `indent`), Python string and dict methods, no trailing-newline keeping.
//! Inputs are a JSON object like `{"messages": [...], "tools": [...],
//! "add_generation_prompt": true, "bos_token": "<s>", ...}`, keys kept in their order.

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};

use crate::error::{ChatError, Result};
use crate::pyjson::PyJson;

const NAME: &str = "chat_template";

/// A compiled chat template.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where it came from (for messages).
    origin: Option<PathBuf>,
    /// The thinking-section tags the template writes, if any.
    think: Option<crate::reasoning::ThinkTags>,
}

/// The special-token strings `tokenizer_config.json` gives a template (`bos_token`, ...).
#[derive(Debug, Clone, Default)]
pub struct TemplateTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl TemplateTokens {
    /// Those of `dir/tokenizer_config.json` (none when it is missing or unreadable).
    pub fn from_model_dir(dir: &Path) -> TemplateTokens {
        std::fs::read(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .map(|v| template_tokens(&v))
            .unwrap_or_default()
    }
}

impl ChatTemplate {
    /// Compile `source`.
    pub fn new(source: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| template_error(None, &e))?;
        Ok(ChatTemplate {
            env,
            origin: None,
            think: crate::reasoning::ThinkTags::detect(source),
        })
    }

    /// The tags of the thinking section this template's model writes (`<think>`, K3's
    /// `<|open|>think<|sep|>`), found in the template source.
    pub fn think_tags(&self) -> Option<&crate::reasoning::ThinkTags> {
        self.think.as_ref()
    }

    /// The template a model directory ships: `chat_template.jinja`, else the `chat_template`
    /// of `tokenizer_config.json` (a string, or a list of `{name, template}` of which
    /// `default` is used); with the special-token strings of `tokenizer_config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<(ChatTemplate, TemplateTokens)> {
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Option<serde_json::Value> = match std::fs::read(&cfg_path) {
            Ok(b) => Some(serde_json::from_slice(&b).map_err(|e| ChatError::BadFile {
                path: cfg_path.clone(),
                reason: e.to_string(),
            })?),
            Err(_) => None,
        };
        let tokens = cfg.as_ref().map(template_tokens).unwrap_or_default();
        let jinja = dir.join("chat_template.jinja");
        if let Ok(src) = std::fs::read_to_string(&jinja) {
            let mut t = ChatTemplate::new(&src).map_err(|e| at(e, &jinja))?;
            t.origin = Some(jinja);
            return Ok((t, tokens));
        }
        let src = cfg
            .as_ref()
            .and_then(|c| c.get("chat_template"))
            .and_then(|t| match t {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Array(list) => list
                    .iter()
                    .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or_else(|| list.first())
                    .and_then(|e| e.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string),
                _ => None,
            })
            .ok_or_else(|| ChatError::NotFound {
                what: "chat template",
                path: dir.to_path_buf(),
                looked: "chat_template.jinja, tokenizer_config.json's chat_template".into(),
            })?;
        let mut t = ChatTemplate::new(&src).map_err(|e| at(e, &cfg_path))?;
        t.origin = Some(cfg_path);
        Ok((t, tokens))
    }

    /// Render with `inputs` (a JSON object: `messages`, optional `tools`,
    /// `add_generation_prompt`, and any other template variables).
    pub fn render(&self, inputs: &Value) -> Result<String> {
        let t = self
            .env
            .get_template(NAME)
            .map_err(|e| template_error(self.origin.as_deref(), &e))?;
        t.render(inputs).map_err(|e| match e.kind() {
            ErrorKind::InvalidOperation if e.to_string().contains(RAISED) => ChatError::Raised(
                e.detail()
                    .unwrap_or_default()
                    .trim_start_matches(RAISED)
                    .to_string(),
            ),
            _ => template_error(self.origin.as_deref(), &e),
        })
    }

    /// [`ChatTemplate::render`] from JSON text (objects keep their key order).
    pub fn render_json(&self, inputs: &str) -> Result<String> {
        let v: Value = serde_json::from_str(inputs).map_err(|e| ChatError::Template {
            name: None,
            reason: format!("inputs are not a JSON object: {e}"),
        })?;
        self.render(&v)
    }
}

const RAISED: &str = "raise_exception: ";

fn raise_exception(msg: String) -> std::result::Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{msg}"),
    ))
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
fn tojson(v: Value, kwargs: Kwargs) -> std::result::Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        Some(i) if i.is_none() || i.is_undefined() => None,
        Some(i) => Some(usize::try_from(i).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be an integer",
            )
        })?),
        None => None,
    };
    let separators = match separators {
        Some(s) if !s.is_none() && !s.is_undefined() => {
            let parts: Vec<String> = s
                .try_iter()?
                .map(|p| p.as_str().unwrap_or_default().to_string())
                .collect();
            match parts.as_slice() {
                [a, b] => Some((a.clone(), b.clone())),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be two strings",
                    ))
                }
            }
        }
        _ => None,
    };
    let j = PyJson {
        indent,
        separators,
        sort_keys: sort_keys.unwrap_or(false),
    };
    j.dumps(&v)
        .map(Value::from_safe_string)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
}

/// `strftime_now(format)`: the current UTC time, with the directives chat templates use.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
}

/// Format `unix` seconds (UTC) with `%Y %m %d %e %B %b %A %a %H %I %M %S %p %j %y %%`.
pub fn strftime(format: &str, unix: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix.div_euclid(86400);
    let sod = unix.rem_euclid(86400);
    let (h, mi, s) = (sod / 3600, sod % 3600 / 60, sod % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let wd = days.rem_euclid(7) as usize;
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y % 100)),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[wd]),
            Some('a') => out.push_str(&DAYS[wd][..3]),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('I') => out.push_str(&format!("{:02}", (h + 11) % 12 + 1)),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('p') => out.push_str(if h < 12 { "AM" } else { "PM" }),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// `bos_token` / `eos_token` of a `tokenizer_config.json` (strings or `{content: ...}`).
fn template_tokens(cfg: &serde_json::Value) -> TemplateTokens {
    let get = |k: &str| match cfg.get(k) {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    };
    TemplateTokens {
        bos_token: get("bos_token"),
        eos_token: get("eos_token"),
    }
}

fn template_error(origin: Option<&Path>, e: &Error) -> ChatError {
    let mut reason = e.to_string();
    if let Some(line) = e.line() {
        if !reason.contains("line") {
            reason.push_str(&format!(" (line {line})"));
        }
    }
    ChatError::Template {
        name: origin.map(|p| p.display().to_string()),
        reason,
    }
}

fn at(e: ChatError, path: &Path) -> ChatError {
    match e {
        ChatError::Template { reason, .. } => ChatError::Template {
            name: Some(path.display().to_string()),
            reason,
        },
        e => e,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_utc() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
        assert_eq!(
            strftime("%d %B %Y, %A %I%p %j", t),
            "29 February 2024, Thursday 01PM 060"
        );
        assert_eq!(strftime("%b %e %%", 0), "Jan  1 %");
    }

    #[test]
    fn raise_exception_is_its_own_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        let e = t.render_json("{}").unwrap_err();
        assert!(
            matches!(e, ChatError::Raised(ref m) if m == "no system role"),
            "{e}"
        );
        assert!(ChatTemplate::new("{% if %}").is_err());
    }

    #[test]
    fn tojson_and_python_methods() {
        let t = ChatTemplate::new(
            "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ 'a,b'.split(',') | length }}|{{ ' x '.strip() }}|{{ m.get('k', 'd') }}",
        )
        .unwrap();
        let out = t
            .render_json(r#"{"tools": [{"z": 1, "a": "é"}], "m": {}}"#)
            .unwrap();
        assert_eq!(
            out,
            "[{\"z\": 1, \"a\": \"é\"}]|{\n  \"z\": 1,\n  \"a\": \"é\"\n}|2|x|d"
        );
        // Objects keep their key order, as Python dicts do.
        let t = ChatTemplate::new("{% for k, v in d.items() %}{{ k }}{% endfor %}").unwrap();
        assert_eq!(
            t.render_json(r#"{"d": {"b": 1, "a": 2, "c": 3}}"#).unwrap(),
            "bac"
        );
    }
}
