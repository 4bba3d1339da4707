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

/// A piece of a streamed reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
}

/// [`split`] for a stream: text comes in pieces, deltas go out as soon as no tag can still be
/// forming at their end.
#[derive(Debug)]
pub struct ReasoningStream {
    tags: ThinkTags,
    state: State,
    pending: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the opening tag (the reply may open it, or just answer).
    Start,
    Reasoning,
    /// After the closing tag, before an answer-open tag (K3).
    AfterThink,
    Content,
    /// After the answer-close tag: nothing more is content.
    Done,
}

impl ReasoningStream {
    pub fn new(tags: ThinkTags, started_inside: bool) -> Self {
        ReasoningStream {
            tags,
            state: if started_inside {
                State::Reasoning
            } else {
                State::Start
            },
            pending: String::new(),
        }
    }

    /// Feed the next piece of text; returns the deltas that are now final.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            let before = (self.state, self.pending.len());
            self.step(&mut out, false);
            if (self.state, self.pending.len()) == before {
                break;
            }
        }
        out
    }

    /// The end of the reply: everything held back is final.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        self.step(&mut out, true);
        let rest = std::mem::take(&mut self.pending);
        emit(&mut out, self.kind(), rest);
        out
    }

    fn kind(&self) -> Option<fn(String) -> Delta> {
        match self.state {
            State::Reasoning => Some(Delta::Reasoning),
            State::Start | State::AfterThink | State::Content => Some(Delta::Content),
            State::Done => None,
        }
    }

    fn step(&mut self, out: &mut Vec<Delta>, last: bool) {
        let (tag, next) = match self.state {
            State::Start => {
                let t = self.pending.trim_start();
                if t.is_empty() && !last {
                    return;
                }
                if t.starts_with(self.tags.open.as_str()) {
                    let skip = self.pending.len() - t.len() + self.tags.open.len();
                    self.pending.drain(..skip);
                    self.state = State::Reasoning;
                } else if !self.tags.open.starts_with(t) || last {
                    self.state = State::Content;
                }
                return;
            }
            State::Reasoning => (self.tags.close.clone(), State::AfterThink),
            State::AfterThink => {
                let t = self.pending.trim_start();
                match &self.tags.answer {
                    Some((open, _)) if t.starts_with(open.as_str()) => {
                        let skip = self.pending.len() - t.len() + open.len();
                        self.pending.drain(..skip);
                        self.state = State::Content;
                    }
                    Some((open, _)) if open.starts_with(t) && !last => {}
                    _ if t.is_empty() && !last => {}
                    _ => {
                        self.pending = t.to_string();
                        self.state = State::Content;
                    }
                }
                return;
            }
            State::Content => match &self.tags.answer {
                Some((_, close)) => (close.clone(), State::Done),
                None => {
                    let rest = std::mem::take(&mut self.pending);
                    emit(out, self.kind(), rest);
                    return;
                }
            },
            State::Done => {
                self.pending.clear();
                return;
            }
        };
        if let Some(i) = self.pending.find(tag.as_str()) {
            let before: String = self.pending.drain(..i).collect();
            self.pending.drain(..tag.len());
            emit(out, self.kind(), before);
            self.state = next;
            if self.state == State::AfterThink {
                self.pending = self.pending.trim_start().to_string();
            }
            return;
        }
        // Emit all but a suffix that could be the start of the tag.
        let keep = (1..tag.len().min(self.pending.len() + 1))
            .rev()
            .find(|&k| {
                self.pending.is_char_boundary(self.pending.len() - k)
                    && tag.starts_with(&self.pending[self.pending.len() - k..])
            })
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let ready: String = self.pending.drain(..cut).collect();
        emit(out, self.kind(), ready);
    }
}

fn emit(out: &mut Vec<Delta>, kind: Option<fn(String) -> Delta>, text: String) {
    if text.is_empty() {
        return;
    }
    let Some(k) = kind else { return };
    match (out.last_mut(), k(text)) {
        (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
        (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
        (_, d) => out.push(d),
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

    /// Streaming in any pieces gives what splitting the whole reply gives.
    #[test]
    fn a_stream_splits_like_the_whole() {
        let qwen = ThinkTags::detect("<think>").unwrap_or_else(|| unreachable!());
        let k3 = ThinkTags::detect("<|open|>think<|sep|>").unwrap_or_else(|| unreachable!());
        let cases = [
            (&qwen, false, "<think>\nhmm, 2+2</think>\n\nIt is 4."),
            (
                &qwen,
                false,
                "Just an answer with </think> inside? no: plain.",
            ),
            (&qwen, true, "reasoning here</think>The answer."),
            (
                &k3,
                true,
                "plan<|close|>think<|sep|><|open|>response<|sep|>Answer é<|close|>response<|sep|>",
            ),
            (&k3, true, "never closed"),
        ];
        for (tags, inside, reply) in cases {
            let whole = split(reply, tags, inside);
            for step in [1, 2, 3, 7, 100] {
                let mut s = ReasoningStream::new(tags.clone(), inside);
                let mut deltas = Vec::new();
                let chars: Vec<char> = reply.chars().collect();
                for piece in chars.chunks(step) {
                    deltas.extend(s.push(&piece.iter().collect::<String>()));
                }
                deltas.extend(s.finish());
                let (mut r, mut c) = (String::new(), String::new());
                for d in deltas {
                    match d {
                        Delta::Reasoning(x) => r.push_str(&x),
                        Delta::Content(x) => c.push_str(&x),
                    }
                }
                assert_eq!(c.trim(), whole.content.trim(), "{reply:?} step {step}");
                assert_eq!(
                    (!r.trim().is_empty()).then(|| r.trim().to_string()),
                    whole.reasoning.clone().filter(|x| !x.is_empty()),
                    "{reply:?} step {step}"
                );
            }
        }
    }
}
