//! `deltafin-plot`: draw benches/results/gen_scaling.json as an SVG of tokens/s against drive
//! count, one line per mode, with the ceiling fio's bandwidth allows at the measured bytes/token;
//! or benches/results/vs_llamacpp.json as bars of deltafin's speed over llama.cpp's (paired
//! medians, each run's ratio marked) per format and measurement.
//!
//!   deltafin-plot benches/results/gen_scaling.json benches/results/gen_scaling.svg `[PROMPT]`
//!   deltafin-plot benches/results/vs_llamacpp.json benches/results/vs_llamacpp.svg

use anyhow::{bail, Context};
use plotters::prelude::*;
use serde_json::Value;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        bail!("usage: deltafin-plot IN.json OUT.svg [PROMPT]");
    }
    let doc: Value =
        serde_json::from_slice(&std::fs::read(&args[1]).with_context(|| args[1].clone())?)
            .with_context(|| format!("parsing {}", args[1]))?;
    if doc["table"]
        .as_array()
        .is_some_and(|t| t.iter().any(|r| r["paired_ratios"].is_array()))
    {
        return plot_ratios(&doc, &args[2]);
    }
    let rows = doc["rows"].as_array().context("no rows")?;
    let prompt = match args.get(3) {
        Some(p) => p.clone(),
        None => rows
            .first()
            .and_then(|r| r["prompt"].as_str())
            .context("no prompt in rows")?
            .to_string(),
    };
    // (mode, drives, tokens/s, ceiling tokens/s)
    let mut pts: Vec<(String, f64, f64, Option<f64>)> = Vec::new();
    for r in rows
        .iter()
        .filter(|r| r["prompt"].as_str() == Some(prompt.as_str()))
    {
        let mode = r["mode"].as_str().unwrap_or("?").to_string();
        let drives = r["drives"].as_f64().unwrap_or(0.0);
        let tps = r["tokens_per_s_median"].as_f64().unwrap_or(0.0);
        let bpt = r["bytes_read_per_token_median"]
            .as_f64()
            .filter(|b| *b > 0.0);
        let ceiling = match (r["fio_gb_per_s"].as_f64(), bpt) {
            (Some(f), Some(b)) => Some(f * 1e9 / b),
            _ => None,
        };
        pts.push((mode, drives, tps, ceiling));
    }
    if pts.is_empty() {
        bail!("no rows for prompt {prompt:?}");
    }
    let ymax = pts
        .iter()
        .map(|p| p.2.max(p.3.unwrap_or(0.0)))
        .fold(0.0, f64::max)
        * 1.15;
    let root = SVGBackend::new(&args[2], (800, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let title = format!("deltafin decode tokens/s vs drives ({prompt})");
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5f64..4.5f64, 0f64..ymax.max(1e-3))?;
    chart
        .configure_mesh()
        .x_desc("drives")
        .y_desc("tokens/s")
        .x_labels(4)
        .draw()?;
    for (i, mode) in ["stripe", "replicate"].iter().enumerate() {
        let color = if i == 0 { BLUE } else { RED };
        let mut line: Vec<(f64, f64)> = pts
            .iter()
            .filter(|p| p.0 == *mode)
            .map(|p| (p.1, p.2))
            .collect();
        line.sort_by(|a, b| a.0.total_cmp(&b.0));
        if line.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))?
            .label(format!("{mode} (measured)"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart.draw_series(
            line.iter()
                .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
        )?;
        let mut ceil: Vec<(f64, f64)> = pts
            .iter()
            .filter(|p| p.0 == *mode)
            .filter_map(|p| p.3.map(|c| (p.1, c)))
            .collect();
        ceil.sort_by(|a, b| a.0.total_cmp(&b.0));
        if !ceil.is_empty() {
            let faint = color.mix(0.45);
            chart
                .draw_series(DashedLineSeries::new(ceil, 6, 4, faint.stroke_width(2)))?
                .label(format!("{mode} fio ceiling (fio GB/s / bytes per token)"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], faint.stroke_width(2))
                });
        }
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()?;
    root.present()?;
    eprintln!("wrote {}", args[2]);
    Ok(())
}

/// Bars of `ratio` (deltafin / llama.cpp) per table row, each run's paired ratio as a dot, and
/// the line of parity.
fn plot_ratios(doc: &Value, out: &str) -> anyhow::Result<()> {
    let table = doc["table"].as_array().context("no table")?;
    // (label, median ratio, per-run ratios)
    let bars: Vec<(String, f64, Vec<f64>)> = table
        .iter()
        .map(|r| {
            let file = r["llama_cpp_file"].as_str().unwrap_or("?");
            // Cells of a non-default activation precision (BF16 `DELTAFIN_ACTIVATIONS=bf16`)
            // say so; older files have no such field.
            let acts = match r["deltafin_activations"].as_str() {
                Some(a) if a != "default" => format!(" ({a} act.)"),
                _ => String::new(),
            };
            let label = format!(
                "{} {}{}{acts}",
                r["format"].as_str().unwrap_or("?"),
                r["kind"].as_str().unwrap_or("?"),
                if file.contains("experts") {
                    " (experts)"
                } else {
                    ""
                }
            );
            let runs = r["paired_ratios"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_f64).collect())
                .unwrap_or_default();
            (label, r["ratio"].as_f64().unwrap_or(0.0), runs)
        })
        .collect();
    if bars.is_empty() {
        bail!("the table is empty");
    }
    let ymax = bars
        .iter()
        .flat_map(|b| b.2.iter().copied().chain([b.1]))
        .fold(1.0, f64::max)
        * 1.15;
    let n = bars.len();
    let root = SVGBackend::new(out, (120 + 90 * n as u32, 520)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "deltafin / llama.cpp tokens/s, same model in RAM, 2 threads",
            ("sans-serif", 18),
        )
        .margin(15)
        .x_label_area_size(70)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..n as f64, 0f64..ymax)?;
    let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.26 {
                labels.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("ratio (median of paired runs)")
        .draw()?;
    chart.draw_series(bars.iter().enumerate().map(|(i, b)| {
        let color = if b.1 >= 1.0 {
            BLUE.mix(0.6)
        } else {
            RED.mix(0.6)
        };
        Rectangle::new(
            [(i as f64 + 0.2, 0.0), (i as f64 + 0.8, b.1)],
            color.filled(),
        )
    }))?;
    chart.draw_series(bars.iter().enumerate().flat_map(|(i, b)| {
        b.2.iter()
            .map(move |&r| Circle::new((i as f64 + 0.5, r), 3, BLACK.filled()))
    }))?;
    chart.draw_series(LineSeries::new(
        [(0.0, 1.0), (n as f64, 1.0)],
        BLACK.stroke_width(1),
    ))?;
    root.present()?;
    eprintln!("wrote {out}");
    Ok(())
}
