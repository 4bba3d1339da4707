//! The OpenAI-compatible request and response bodies: parsing and validating a request (every
//! refusal an OpenAI-style error with its HTTP status), and the JSON of replies and stream
//! chunks.

use deltafin_inference::SamplerConfig;
use serde_json::{json, Value};

use crate::conversation::{Params, Reply};

/// An API error: status, OpenAI `type`, the offending parameter, message.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub param: Option<String>,
    pub message: String,
}

impl ApiError {
    pub(crate) fn bad(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            message: message.into(),
        }
    }

    pub(crate) fn json(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param,
                         "code": Value::Null}})
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completions,
}

/// A validated generation request.
#[derive(Debug)]
pub(crate) struct GenRequest {
    pub endpoint: Endpoint,
    /// Chat: the template inputs (`messages`, `tools`, extra variables), keys in the client's
    /// order. Completions: unused.
    pub inputs: minijinja::Value,
    /// Completions: the prompt text.
    pub prompt: String,
    pub params: Params,
    pub stream: bool,
    pub include_usage: bool,
}

/// Parse and validate a request body for `endpoint` served as `model`.
pub(crate) fn parse(
    endpoint: Endpoint,
    body: &[u8],
    model: &str,
    default_max_tokens: usize,
) -> Result<GenRequest, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("the body is not valid JSON: {e}")))?;
    // The same body again as template values, keeping the client's key order.
    let ordered: minijinja::Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("the body is not valid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| ApiError::bad("body", "the body must be a JSON object"))?;
    match obj.get("model") {
        Some(Value::String(m)) if m == model => {}
        Some(Value::String(m)) => {
            return Err(ApiError {
                status: 400,
                kind: "invalid_request_error",
                param: Some("model".into()),
                message: format!("the model `{m}` does not exist; this server serves `{model}`"),
            })
        }
        Some(_) => return Err(ApiError::bad("model", "`model` must be a string")),
        None => return Err(ApiError::bad("model", "`model` is required")),
    }
    if let Some(n) = obj.get("n") {
        if n.as_u64() != Some(1) {
            return Err(ApiError::bad("n", "only n = 1 is supported"));
        }
    }
    let num = |k: &str, lo: f64, hi: f64| -> Result<Option<f64>, ApiError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => match x.as_f64() {
                Some(f) if f.is_finite() && f >= lo && f <= hi => Ok(Some(f)),
                _ => Err(ApiError::bad(
                    k,
                    format!("`{k}` must be a number from {lo} to {hi}"),
                )),
            },
        }
    };
    let temperature = num("temperature", 0.0, 2.0)?.unwrap_or(1.0);
    let top_p = num("top_p", 0.0, 1.0)?.unwrap_or(1.0);
    if top_p == 0.0 {
        return Err(ApiError::bad("top_p", "`top_p` must be above 0"));
    }
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => 0,
        Some(s) => s
            .as_i64()
            .map(|s| s as u64)
            .ok_or_else(|| ApiError::bad("seed", "`seed` must be an integer"))?,
    };
    let max_tokens = match obj
        .get("max_completion_tokens")
        .or_else(|| obj.get("max_tokens"))
    {
        None | Some(Value::Null) => default_max_tokens,
        Some(m) => match m.as_u64() {
            Some(m) if m >= 1 => m as usize,
            _ => {
                return Err(ApiError::bad(
                    "max_tokens",
                    "`max_tokens` must be an integer >= 1",
                ))
            }
        },
    };
    let stop = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(Value::is_string) => a
            .iter()
            .filter_map(|s| s.as_str().map(str::to_string))
            .collect(),
        Some(_) => {
            return Err(ApiError::bad(
                "stop",
                "`stop` must be a string or up to 4 strings",
            ))
        }
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("stream", "`stream` must be a boolean")),
    };
    if obj
        .get("logprobs")
        .is_some_and(|p| !matches!(p, Value::Null | Value::Bool(false)))
    {
        return Err(ApiError::bad("logprobs", "logprobs are not supported"));
    }
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let sampler = if temperature == 0.0 {
        SamplerConfig::greedy()
    } else {
        SamplerConfig {
            temperature: temperature as f32,
            top_k: 0,
            top_p: top_p as f32,
            seed,
        }
    };
    let flag = |k: &str, default: bool| -> Result<bool, ApiError> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(ApiError::bad(k, format!("`{k}` must be a boolean"))),
        }
    };
    let params = Params {
        max_tokens,
        sampler,
        stop,
        ignore_eos: flag("ignore_eos", false)?,
        skip_special_tokens: flag("skip_special_tokens", true)?,
        cache_prompt: flag("cache_prompt", true)?,
    };
    let (inputs, prompt) = match endpoint {
        Endpoint::Chat => (chat_inputs(obj, &ordered)?, String::new()),
        Endpoint::Completions => {
            let p = match obj.get("prompt") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                    a[0].as_str().unwrap_or_default().to_string()
                }
                _ => return Err(ApiError::bad("prompt", "`prompt` must be a string")),
            };
            (minijinja::Value::UNDEFINED, p)
        }
    };
    Ok(GenRequest {
        endpoint,
        inputs,
        prompt,
        params,
        stream,
        include_usage,
    })
}

/// The template inputs of a chat request: `messages`, `tools`, and `chat_template_kwargs`
/// (extra template variables, as vLLM names them).
fn chat_inputs(
    obj: &serde_json::Map<String, Value>,
    ordered: &minijinja::Value,
) -> Result<minijinja::Value, ApiError> {
    let messages = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad("messages", "`messages` must be a non-empty array"))?;
    if messages.is_empty() {
        return Err(ApiError::bad(
            "messages",
            "`messages` must be a non-empty array",
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        if !matches!(
            role,
            Some("system" | "developer" | "user" | "assistant" | "tool")
        ) {
            return Err(ApiError::bad(
                &format!("messages[{i}].role"),
                "each message needs a role: system, developer, user, assistant or tool",
            ));
        }
    }
    let get = |k: &str| ordered.get_attr(k).ok().filter(|v| !v.is_undefined());
    let mut pairs: Vec<(String, minijinja::Value)> = Vec::new();
    if let Some(m) = get("messages") {
        pairs.push(("messages".into(), m));
    }
    if let Some(t) = get("tools").filter(|t| !t.is_none()) {
        pairs.push(("tools".into(), t));
    }
    if let Some(kw) = get("chat_template_kwargs") {
        if let Ok(keys) = kw.try_iter() {
            for k in keys {
                if let (Some(name), Ok(v)) = (k.as_str(), kw.get_item(&k)) {
                    pairs.push((name.to_string(), v));
                }
            }
        }
    }
    Ok(minijinja::Value::from_iter(pairs))
}

/// The usage object.
pub(crate) fn usage(r: &Reply) -> Value {
    json!({"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
           "total_tokens": r.prompt_tokens + r.completion_tokens,
           "prompt_tokens_reused": r.reused_tokens,
           "prompt_tokens_details": {"cached_tokens": r.reused_tokens}})
}

/// OpenAI's `finish_reason`: `stop` or `length` (a cancelled reply reached no one).
pub(crate) fn finish_reason(r: &Reply) -> &'static str {
    if r.finish_reason == "cancelled" {
        "stop"
    } else {
        r.finish_reason
    }
}

/// A non-streamed reply.
pub(crate) fn reply_json(
    req: &GenRequest,
    r: &Reply,
    id: &str,
    model: &str,
    created: u64,
) -> Value {
    let finish = finish_reason(r);
    match req.endpoint {
        Endpoint::Chat => {
            let mut message = json!({"role": "assistant", "content": r.content});
            if let Some(reasoning) = &r.reasoning {
                message["reasoning_content"] = reasoning.clone().into();
            }
            json!({"id": id, "object": "chat.completion", "created": created, "model": model,
                   "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                "logprobs": Value::Null}],
                   "usage": usage(r)})
        }
        Endpoint::Completions => json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": r.text, "finish_reason": finish, "logprobs": Value::Null}],
            "usage": usage(r)}),
    }
}

/// One stream chunk: a delta (`content` or `reasoning_content`, or the role), or the end.
pub(crate) fn chunk_json(
    req: &GenRequest,
    id: &str,
    model: &str,
    created: u64,
    delta: Value,
    finish: Option<&str>,
) -> Value {
    match req.endpoint {
        Endpoint::Chat => json!({"id": id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish,
                                         "logprobs": Value::Null}]}),
        Endpoint::Completions => json!({"id": id, "object": "text_completion", "created": created,
            "model": model, "choices": [{"index": 0,
                "text": delta.get("content").cloned().unwrap_or(Value::String(String::new())),
                "finish_reason": finish, "logprobs": Value::Null}]}),
    }
}
