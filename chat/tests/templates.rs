//! The real chat templates of Kimi K3, Kimi K2 (Instruct, Thinking), DeepSeek-V3.1 and Qwen3
//! render exactly as transformers' `apply_chat_template` did for every reference case
//! (testdata/chat_templates/references.json, copied from shared/chat_templates).
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;

use deltafin_chat::ChatTemplate;
use minijinja::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/chat_templates")
}

#[test]
fn every_reference_rendering_matches() {
    // Parsed straight into template values, so every object keeps the file's key order.
    let refs: Value =
        serde_json::from_slice(&std::fs::read(dir().join("references.json")).unwrap()).unwrap();
    let mut failures = Vec::new();
    let mut n = 0;
    for name in refs.try_iter().unwrap() {
        let name = name.as_str().unwrap().to_string();
        let cases = refs.get_item(&Value::from(name.as_str())).unwrap();
        let src = std::fs::read_to_string(dir().join(format!("{name}.jinja"))).unwrap();
        let t = ChatTemplate::new(&src).unwrap();
        for case in cases.try_iter().unwrap() {
            n += 1;
            let c = cases.get_item(&case).unwrap();
            let inputs = c.get_attr("inputs").unwrap();
            let rendered = c.get_attr("rendered").unwrap();
            let want = rendered.as_str().unwrap();
            match t.render(&inputs) {
                Ok(got) if got == want => {}
                Ok(got) => {
                    let at = got
                        .chars()
                        .zip(want.chars())
                        .position(|(a, b)| a != b)
                        .unwrap_or(got.len().min(want.len()));
                    failures.push(format!(
                        "{name}/{case}: differs at char {at}:\n got: {:?}\nwant: {:?}",
                        got.chars()
                            .skip(at.saturating_sub(40))
                            .take(120)
                            .collect::<String>(),
                        want.chars()
                            .skip(at.saturating_sub(40))
                            .take(120)
                            .collect::<String>()
                    ))
                }
                Err(e) => failures.push(format!("{name}/{case}: {e}")),
            }
        }
    }
    eprintln!("{n} reference renderings");
    assert!(n >= 10, "only {n} cases");
    assert!(
        failures.is_empty(),
        "{} of {n} cases:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Cases beyond the given references - tools offered, a tool call and its result, reasoning
/// history, whitespace and Unicode, thinking off - rendered by transformers 5.24
/// (testdata/chat_templates/extra/make_references.py). Where transformers' template raised, so
/// must ours.
#[test]
fn extra_references_match_including_refusals() {
    let path = dir().join("extra/references_extra.json");
    let refs: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let mut failures = Vec::new();
    let mut n = 0;
    for name in refs.try_iter().unwrap() {
        let name = name.as_str().unwrap().to_string();
        let cases = refs.get_item(&Value::from(name.as_str())).unwrap();
        let src = std::fs::read_to_string(dir().join(format!("{name}.jinja"))).unwrap();
        let t = ChatTemplate::new(&src).unwrap();
        for case in cases.try_iter().unwrap() {
            n += 1;
            let c = cases.get_item(&case).unwrap();
            let inputs = c.get_attr("inputs").unwrap();
            let got = t.render(&inputs);
            let rendered = c.get_attr("rendered").unwrap();
            match (got, rendered.as_str()) {
                (Ok(g), Some(w)) if g == w => {}
                (Err(_), None) => {}
                (Ok(g), Some(w)) => {
                    let at = g
                        .chars()
                        .zip(w.chars())
                        .position(|(a, b)| a != b)
                        .unwrap_or(g.len().min(w.len()));
                    failures.push(format!(
                        "{name}/{case}: differs at char {at}:\n got: {:?}\nwant: {:?}",
                        g.chars()
                            .skip(at.saturating_sub(40))
                            .take(120)
                            .collect::<String>(),
                        w.chars()
                            .skip(at.saturating_sub(40))
                            .take(120)
                            .collect::<String>()
                    ));
                }
                (Ok(_), None) => failures.push(format!(
                    "{name}/{case}: rendered, but transformers raised {}",
                    c.get_attr("error").unwrap()
                )),
                (Err(e), Some(_)) => failures.push(format!("{name}/{case}: {e}")),
            }
        }
    }
    eprintln!("{n} extra renderings");
    assert!(
        failures.is_empty(),
        "{} of {n}:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
