//! `deltafin template`: render a model's chat template (or a template file) with an inputs file
//! and print exactly the rendered text - nothing added - so a user can see the prompt a
//! conversation becomes.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use deltafin_chat::template::TemplateTokens;
use deltafin_chat::ChatTemplate;

#[derive(clap::Args, Debug)]
pub struct TemplateArgs {
    /// A model directory (chat_template.jinja or tokenizer_config.json's chat_template; its
    /// bos_token / eos_token are passed to the template unless the inputs set them).
    #[arg(
        long,
        conflicts_with = "template",
        required_unless_present = "template"
    )]
    pub model: Option<PathBuf>,
    /// A template file (.jinja).
    #[arg(long)]
    pub template: Option<PathBuf>,
    /// A JSON object: `messages`, optional `tools`, `add_generation_prompt`, and any other
    /// template variables (`bos_token`, `thinking`, ...).
    #[arg(long)]
    pub inputs: PathBuf,
}

pub fn run(a: &TemplateArgs) -> anyhow::Result<()> {
    let (template, tokens) = match (&a.model, &a.template) {
        (Some(dir), _) => ChatTemplate::from_model_dir(dir)?,
        (None, Some(file)) => {
            let src = std::fs::read_to_string(file)
                .with_context(|| format!("reading {}", file.display()))?;
            let t = ChatTemplate::new(&src).with_context(|| file.display().to_string())?;
            (t, TemplateTokens::default())
        }
        (None, None) => bail!("give --model DIR or --template FILE.jinja"),
    };
    let text = std::fs::read_to_string(&a.inputs)
        .with_context(|| format!("reading {}", a.inputs.display()))?;
    // Parsed into template values directly, so objects keep the file's key order.
    let inputs: minijinja::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a JSON object", a.inputs.display()))?;
    let mut map: Vec<(String, minijinja::Value)> = Vec::new();
    for (k, v) in [
        ("bos_token", &tokens.bos_token),
        ("eos_token", &tokens.eos_token),
    ] {
        if let Some(v) = v {
            if inputs.get_attr(k).map(|x| x.is_undefined()).unwrap_or(true) {
                map.push((k.to_string(), minijinja::Value::from(v.as_str())));
            }
        }
    }
    let inputs = if map.is_empty() {
        inputs
    } else {
        let mut all: Vec<(String, minijinja::Value)> = Vec::new();
        for k in inputs.try_iter().context("inputs must be a JSON object")? {
            let key = k.as_str().unwrap_or_default().to_string();
            let v = inputs.get_item(&k).unwrap_or_default();
            all.push((key, v));
        }
        all.extend(map);
        minijinja::Value::from_iter(all)
    };
    let out = template
        .render(&inputs)
        .with_context(|| format!("rendering with {}", a.inputs.display()))?;
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()?;
    Ok(())
}
