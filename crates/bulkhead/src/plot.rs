//! `bulkhead loadgen-plot A.json B.json -o OUT.png`: SLO attainment against offered rate
//! from open-loop loadgen reports, one line per report (server), one panel per SLO pair,
//! with the 90% line and each server's goodput, in one PNG.
//!
//! Drawn with `plotters`' bitmap backend; text goes through `ab_glyph` from a TTF file read
//! at run time (DejaVu Sans by default, Debian's fonts-dejavu-core), so no system font
//! library is needed.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use serde_json::Value;

/// DejaVu Sans where Debian and Ubuntu install it.
const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
/// The name the font is registered under and drawn with.
const FAMILY: &str = "sans-serif";
/// Pixels per panel.
const PANEL: (u32, u32) = (720, 520);
/// Line colours, one per report.
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// Open-loop reports (`bulkhead loadgen --rates ... --json-out FILE`), one line each.
    #[arg(required = true)]
    reports: Vec<PathBuf>,
    /// The PNG to write.
    #[arg(long, short = 'o', env = "BULKHEAD_PLOT_OUT")]
    out: PathBuf,
    /// A TrueType font for the text.
    #[arg(long, env = "BULKHEAD_PLOT_FONT", default_value = DEFAULT_FONT)]
    font: PathBuf,
    /// A title above the panels (default: the model and request shape of the first report).
    #[arg(long, env = "BULKHEAD_PLOT_TITLE")]
    title: Option<String>,
}

/// One report's attainment curve for one SLO pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Curve {
    /// The server's label.
    pub label: String,
    /// `(TTFT ms, TPOT ms)`.
    pub slo: (f64, f64),
    /// `(rate, attainment of both SLOs)`, by rate.
    pub points: Vec<(f64, f64)>,
    /// Goodput (requests/s) and how it was found (`interpolated`, `below_lowest_rate`, ...).
    pub goodput: Option<(f64, String)>,
}

/// The curves of one open-loop report, one per SLO pair; `fallback` names a report without
/// a label.
pub fn curves(report: &Value, fallback: &str) -> anyhow::Result<Vec<Curve>> {
    anyhow::ensure!(report["mode"] == "open-loop", "not an open-loop loadgen report (run loadgen with --rates and --json-out)");
    let label = report["label"].as_str().unwrap_or(fallback).to_string();
    let slos = report["slos"].as_array().context("the report has no `slos`")?;
    let points = report["points"].as_array().context("the report has no `points`")?;
    let mut out = Vec::new();
    for (i, s) in slos.iter().enumerate() {
        let slo = (s["ttft_ms"].as_f64().context("an SLO without ttft_ms")?, s["tpot_ms"].as_f64().context("an SLO without tpot_ms")?);
        let mut pts: Vec<(f64, f64)> =
            points.iter().filter_map(|p| Some((p["rate"].as_f64()?, p["attainment"].get(i)?["both"].as_f64()?))).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let goodput = report["goodput"].get(i).and_then(|g| Some((g["rate"].as_f64()?, g["kind"].as_str()?.to_string())));
        out.push(Curve { label: label.clone(), slo, points: pts, goodput });
    }
    Ok(out)
}

/// The SLO pairs of `curves` in first-seen order: one panel each.
fn panels(curves: &[Curve]) -> Vec<(f64, f64)> {
    let mut v: Vec<(f64, f64)> = Vec::new();
    for c in curves {
        if !v.contains(&c.slo) {
            v.push(c.slo);
        }
    }
    v
}

/// The 90% line's dash and gap (pixels).
const TARGET_DASH: (i32, i32) = (8, 6);

fn target_style() -> ShapeStyle {
    BLACK.mix(0.6).stroke_width(1)
}

/// The 90% line's legend sample at `(x, y)`: dashed like the line (two dashes).
fn target_legend((x, y): (i32, i32)) -> DashedPathElement<std::vec::IntoIter<(i32, i32)>, i32> {
    DashedPathElement::new(vec![(x, y), (x + 22, y)], TARGET_DASH.0, TARGET_DASH.1, target_style())
}

/// A legend entry: the label and its goodput in words.
fn legend(c: &Curve) -> String {
    match &c.goodput {
        Some((r, k)) if k == "below_lowest_rate" => format!("{}: goodput 0 (lowest rate < 90%)", c.label),
        Some((r, k)) if k == "at_least_highest_rate" => format!("{}: goodput >= {r:.2} req/s", c.label),
        Some((r, _)) => format!("{}: goodput {r:.2} req/s", c.label),
        None => c.label.clone(),
    }
}

pub fn run(a: PlotArgs) -> anyhow::Result<()> {
    let font = std::fs::read(&a.font).with_context(|| format!("cannot read the font {} (pass --font FILE.ttf)", a.font.display()))?;
    // plotters keeps registered fonts for the process: leaking one file once is the price.
    plotters::style::register_font(FAMILY, FontStyle::Normal, Box::leak(font.into_boxed_slice()))
        .map_err(|_| anyhow::anyhow!("{} is not a TrueType font plotters can read", a.font.display()))?;
    let mut all = Vec::new();
    let mut title = a.title.clone();
    for path in &a.reports {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
        let stem = path.file_stem().map_or_else(|| path.display().to_string(), |s| s.to_string_lossy().into_owned());
        all.extend(curves(&v, &stem).with_context(|| format!("{}", path.display()))?);
        if title.is_none() {
            title = Some(format!(
                "SLO attainment vs offered rate (Poisson arrivals): {}, prompt {} words, max_tokens {}",
                // A path (llama-server lists its model file) shortened to the file name.
                v["model"].as_str().map_or("?", |m| m.rsplit('/').next().unwrap_or(m)),
                dist(&v["prompt_words"]),
                dist(&v["max_tokens"])
            ));
        }
    }
    draw(&all, title.as_deref().unwrap_or(""), &a.out)?;
    println!("wrote {}", a.out.display());
    Ok(())
}

/// A `Dist` as JSON back to its flag form (`512`, `uniform:..`), roughly.
fn dist(v: &Value) -> String {
    match v["kind"].as_str() {
        Some("fixed") => v["value"].to_string(),
        Some("uniform") => format!("uniform:{}:{}", v["min"], v["max"]),
        Some("normal") => format!("normal:{}:{}", v["mean"], v["std"]),
        _ => "?".into(),
    }
}

/// Draw `curves` into a PNG at `out`.
pub fn draw(curves: &[Curve], title: &str, out: &Path) -> anyhow::Result<()> {
    let slos = panels(curves);
    anyhow::ensure!(!slos.is_empty(), "nothing to draw: the reports have no SLO pairs");
    let labels: Vec<&str> = {
        let mut l: Vec<&str> = Vec::new();
        for c in curves {
            if !l.contains(&c.label.as_str()) {
                l.push(&c.label);
            }
        }
        l
    };
    let max_rate = curves.iter().flat_map(|c| c.points.iter().map(|p| p.0)).fold(0.0f64, f64::max).max(0.1) * 1.05;
    let size = (PANEL.0 * slos.len() as u32, PANEL.1 + 40);
    let root = BitMapBackend::new(out, size).into_drawing_area();
    let e = |err: DrawingAreaErrorKind<_>| anyhow::anyhow!("drawing {}: {err}", out.display());
    root.fill(&WHITE).map_err(e)?;
    let (top, body) = root.split_vertically(40);
    top.draw(&Text::new(title.to_string(), (12, 12), (FAMILY, 18).into_font())).map_err(e)?;
    for (area, slo) in body.split_evenly((1, slos.len())).iter().zip(&slos) {
        let mut chart = ChartBuilder::on(area)
            .caption(format!("SLO: TTFT <= {} ms and TPOT <= {} ms", slo.0, slo.1), (FAMILY, 18))
            .margin(14)
            .x_label_area_size(42)
            .y_label_area_size(56)
            // Headroom above 100% for the legend, so it never hides a curve.
            .build_cartesian_2d(0.0..max_rate, 0.0..128.0)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("offered rate (requests/s)")
            .y_desc("requests meeting both SLOs (%)")
            .y_label_formatter(&|y| if *y <= 100.0 { format!("{y:.0}") } else { String::new() })
            // No minor grid: it only adds noise (and bytes to the PNG).
            .light_line_style(TRANSPARENT)
            .label_style((FAMILY, 14))
            .axis_desc_style((FAMILY, 15))
            .draw()
            .map_err(e)?;
        chart
            .draw_series(DashedLineSeries::new([(0.0, 90.0), (max_rate, 90.0)], TARGET_DASH.0, TARGET_DASH.1, target_style()))
            .map_err(e)?
            .label("90% target")
            .legend(target_legend);
        for c in curves.iter().filter(|c| c.slo == *slo) {
            let i = labels.iter().position(|l| *l == c.label).unwrap_or(0);
            let colour = COLOURS[i % COLOURS.len()];
            let pts: Vec<(f64, f64)> = c.points.iter().map(|&(r, at)| (r, at * 100.0)).collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(2)))
                .map_err(e)?
                .label(legend(c))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, colour.filled()))).map_err(e)?;
            if let Some((r, k)) = &c.goodput
                && k == "interpolated"
            {
                // Where the curve crosses 90%: the goodput.
                chart.draw_series([TriangleMarker::new((*r, 90.0), 8, colour.filled())]).map_err(e)?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.4))
            .label_font((FAMILY, 14))
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(label: &str) -> Value {
        serde_json::json!({
            "mode": "open-loop",
            "label": label,
            "slos": [{"ttft_ms": 2500.0, "tpot_ms": 100.0}, {"ttft_ms": 1200.0, "tpot_ms": 50.0}],
            "points": [
                {"rate": 2.0, "attainment": [{"both": 0.8}, {"both": 0.5}]},
                {"rate": 1.0, "attainment": [{"both": 1.0}, {"both": 0.95}]},
            ],
            "goodput": [{"rate": 1.5, "kind": "interpolated"}, {"rate": 1.1, "kind": "interpolated"}],
        })
    }

    #[test]
    fn a_report_gives_one_curve_per_slo_pair_sorted_by_rate() {
        let c = curves(&report("bulkhead"), "x").unwrap();
        assert_eq!(c.len(), 2);
        assert_eq!(c[0].label, "bulkhead");
        assert_eq!(c[0].slo, (2500.0, 100.0));
        assert_eq!(c[0].points, vec![(1.0, 1.0), (2.0, 0.8)]);
        assert_eq!(c[1].points, vec![(1.0, 0.95), (2.0, 0.5)]);
        assert_eq!(c[1].goodput, Some((1.1, "interpolated".to_string())));
        assert_eq!(legend(&c[0]), "bulkhead: goodput 1.50 req/s");
        assert!(curves(&serde_json::json!({"mode": "closed"}), "x").is_err());
    }

    #[test]
    fn the_legend_draws_the_90_percent_line_dashed() {
        // The legend sample alone, on a white strip: a dash, a gap, a dash.
        let (w, h) = (40u32, 5u32);
        let mut buf = vec![255u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
            root.draw(&target_legend((4, 2))).unwrap();
            root.present().unwrap();
        }
        let row: String = (0..w).map(|x| if buf[((2 * w + x) * 3) as usize] < 200 { '#' } else { '.' }).collect();
        let dashes = row.split('.').filter(|s| !s.is_empty()).count();
        assert!(dashes >= 2, "the legend's 90% sample is solid, the line is dashed: {row}");
    }

    #[test]
    fn two_reports_draw_into_one_png() {
        if !Path::new(DEFAULT_FONT).exists() {
            eprintln!("skipped: no {DEFAULT_FONT}");
            return;
        }
        let font = std::fs::read(DEFAULT_FONT).unwrap();
        assert!(plotters::style::register_font(FAMILY, FontStyle::Normal, Box::leak(font.into_boxed_slice())).is_ok());
        let mut all = curves(&report("bulkhead"), "a").unwrap();
        all.extend(curves(&report("llama-server"), "b").unwrap());
        let out = std::env::temp_dir().join(format!("bulkhead-plot-test-{}.png", std::process::id()));
        draw(&all, "test", &out).unwrap();
        let bytes = std::fs::read(&out).unwrap();
        let _ = std::fs::remove_file(&out);
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 5000, "{} bytes", bytes.len());
    }
}
