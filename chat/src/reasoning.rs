//! Splitting a thinking model's reply into its reasoning and its answer, as OpenAI-compatible
//! servers return them (`reasoning_content`, `content`). Kimi K2-Thinking and DeepSeek think
//! between `<think>` and `</think>`; Kimi K3 between `<|open|>think<|sep|>` and
//! `<|close|>think<|sep|>`, then answers between `<|open|>response<|sep|>` and
//! `<|close|>response<|sep|>`. A template that opens the thinking section itself (its generation
//! prompt ends with the opening tag) makes the model start inside it. Decode with special
//! tokens kept for this: the tags are special tokens.

/// The tags of one thinking format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkTags {
    pub open: String,
    pub close: String,
    /// Tags around the answer after the reasoning (K3), stripped from the content.
    pub answer: Option<(String, String)>,
}

impl ThinkTags {
    /// The format a rendered prompt uses, if any: looked up by the tags it contains.
    pub fn detect(template_source_or_prompt: &str) -> Option<ThinkTags> {
        if template_source_or_prompt.contains("<|open|>think<|sep|>") {
            Some(ThinkTags {
                open: "<|open|>think<|sep|>".into(),
                close: "<|close|>think<|sep|>".into(),
                answer: Some((
                    "<|open|>response<|sep|>".into(),
                    "<|close|>response<|sep|>".into(),
                )),
            })
        } else if template_source_or_prompt.contains("<think>") {
            Some(ThinkTags {
                open: "<think>".into(),
                close: "</think>".into(),
                answer: None,
            })
        } else {
            None
        }
    }
}

/// A reply split in two.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: Option<String>,
    pub content: String,
}

/// Split `reply` (the generated text). `started_inside`: the prompt ended with the opening tag,
/// so the reply begins in the reasoning.
pub fn split(reply: &str, tags: &ThinkTags, started_inside: bool) -> Split {
    let body = if started_inside {
        reply
    } else {
        match reply.trim_start().strip_prefix(tags.open.as_str()) {
            Some(rest) => rest,
            None => {
                return Split {
                    reasoning: None,
                    content: reply.to_string(),
                }
            }
        }
    };
    match body.find(tags.close.as_str()) {
        Some(i) => {
            let mut content = body[i + tags.close.len()..].trim_start();
            if let Some((open, close)) = &tags.answer {
                content = content.strip_prefix(open.as_str()).unwrap_or(content);
                if let Some(j) = content.find(close.as_str()) {
                    content = &content[..j];
                }
            }
            Split {
                reasoning: Some(body[..i].trim().to_string()),
                content: content.to_string(),
            }
        }
        // Still thinking when generation stopped: everything is reasoning.
        None => Split {
            reasoning: Some(body.trim().to_string()),
            content: String::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_both_formats() {
        let t = ThinkTags::detect("...<think>").unwrap_or_else(|| unreachable!());
        assert_eq!(
            split("<think>\nhmm\n</think>\n\nParis.", &t, false),
            Split {
                reasoning: Some("hmm".into()),
                content: "Paris.".into()
            }
        );
        assert_eq!(split("Paris.", &t, false).content, "Paris.");
        assert_eq!(
            split("a</think>b", &t, true).reasoning.as_deref(),
            Some("a")
        );
        let k3 = ThinkTags::detect("<|open|>think<|sep|>").unwrap_or_else(|| unreachable!());
        let s = split(
            "plan it<|close|>think<|sep|><|open|>response<|sep|>Answer<|close|>response<|sep|>",
            &k3,
            true,
        );
        assert_eq!(s.reasoning.as_deref(), Some("plan it"));
        assert_eq!(s.content, "Answer");
        assert_eq!(split("still", &k3, true).content, "");
    }
}
