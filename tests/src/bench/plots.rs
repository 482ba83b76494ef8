//! PNG plots: per-replica read rate over time (as in the BookKeeper issue)
//! and latency CDFs per policy.
//!
//! Text needs a TrueType font; plotters' ab_glyph backend takes one from a
//! file here (DejaVu or Liberation, as Debian installs them), so nothing is
//! linked against a system font library.

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

use anyhow::{Result, anyhow, bail};
use plotters::{prelude::*, style::FontStyle};

use super::{
    report::{Report, RowResult, format_us},
    rows::Row,
};

/// Where Debian puts the fonts the plots can use.
pub const FONT_FILES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/liberation2/LiberationSans-Regular.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers a font as "sans-serif" once; the error says what to install.
fn font() -> Result<()> {
    static FONT: OnceLock<Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        for path in FONT_FILES {
            if let Ok(bytes) = std::fs::read(path) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err("no TrueType font found for the plots (apt-get install fonts-dejavu-core)".into())
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

/// One colour per replica, and per policy in the CDF plot.
const COLORS: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(0, 0, 0),
    RGBColor(120, 60, 0),
];

/// Draws every plot into `dir`; returns the files written.
pub fn draw(dir: &Path, report: &Report) -> Result<Vec<PathBuf>> {
    font()?;
    let mut written = Vec::new();
    let panels: Vec<&RowResult> = [Some(Row::PrimaryOnly), Some(Row::SlowList)]
        .into_iter()
        .flatten()
        .filter_map(|r| report.row(&r))
        .chain(report.best_selector())
        .collect();
    if let Some(first) = panels.first() {
        let secs = first.duration.as_secs_f64();
        // A window of a few stalls from the middle of the run, and the whole run.
        let start = (secs / 2.0).min((secs - 2.0).max(0.0)).floor();
        let zoom = (start, (start + 2.0).min(secs));
        let path = dir.join("replica_rates.png");
        replica_rates(&path, &panels, zoom, 5)?;
        written.push(path);
        let path = dir.join("replica_rates_full.png");
        // Bins of whole seconds hold whole stall periods: no aliasing.
        let bin = if secs > 20.0 { 1000 } else { 100 };
        replica_rates(&path, &panels, (0.0, secs), bin)?;
        written.push(path);
    }
    let path = dir.join("latency_cdf.png");
    latency_cdf(&path, &report.rows)?;
    written.push(path);
    Ok(written)
}

/// Reads per second per replica, by send time, in `bin_ms` bins.
fn rates(r: &RowResult, window: (f64, f64), bin_ms: usize) -> Vec<Vec<(f64, f64)>> {
    let (from, to) = ((window.0 * 1000.0) as usize, (window.1 * 1000.0) as usize);
    r.served
        .iter()
        .map(|bins| {
            (from..to)
                .step_by(bin_ms)
                .map(|b| {
                    let end = (b + bin_ms).min(to);
                    let n: u64 = bins.get(b..end).map_or(0, |s| s.iter().sum());
                    let t = (b as f64 + (end - b) as f64 / 2.0) / 1000.0;
                    (t, n as f64 * 1000.0 / (end - b).max(1) as f64)
                })
                .collect()
        })
        .collect()
}

fn replica_rates(
    path: &Path,
    rows: &[&RowResult],
    window: (f64, f64),
    bin_ms: usize,
) -> Result<()> {
    if window.1 <= window.0 {
        bail!("empty plot window");
    }
    let series: Vec<Vec<Vec<(f64, f64)>>> = rows.iter().map(|r| rates(r, window, bin_ms)).collect();
    let top = series
        .iter()
        .flatten()
        .flatten()
        .map(|p| p.1)
        .fold(1.0, f64::max)
        * 1.1;
    let root = BitMapBackend::new(path, (1200, 300 * rows.len() as u32)).into_drawing_area();
    root.fill(&WHITE)?;
    for ((area, row), lines) in root
        .split_evenly((rows.len(), 1))
        .iter()
        .zip(rows)
        .zip(&series)
    {
        let mut chart = ChartBuilder::on(area)
            .caption(
                format!(
                    "{}: reads/s per replica ({} ms bins, by send time; red: primary stalled)",
                    row.label(),
                    bin_ms
                ),
                ("sans-serif", 18),
            )
            .margin(8)
            .x_label_area_size(32)
            .y_label_area_size(64)
            .build_cartesian_2d(window.0..window.1, 0.0..top)?;
        chart
            .configure_mesh()
            .x_desc("load time (s)")
            .y_desc("reads/s")
            .y_label_formatter(&|v| format!("{v:.0}"))
            .light_line_style(WHITE)
            .draw()?;
        let shade = RGBColor(255, 190, 190).filled();
        chart.draw_series(
            row.stalls
                .iter()
                .filter(|(a, b)| *b >= window.0 && *a <= window.1)
                .map(|(a, b)| {
                    Rectangle::new([(a.max(window.0), 0.0), (b.min(window.1), top)], shade)
                }),
        )?;
        for (i, line) in lines.iter().enumerate() {
            let primary = if i == 0 { " (primary)" } else { "" };
            draw_line(
                &mut chart,
                line.clone(),
                i,
                2,
                format!("replica {i}{primary}"),
            )?;
        }
        draw_legend(&mut chart, SeriesLabelPosition::MiddleRight)?;
    }
    root.present()?;
    Ok(())
}

/// "Nines" scale: y = -log10(1 - q), so p90, p99, p99.9 are evenly spaced.
fn nines(q: f64) -> f64 {
    -(1.0 - q).max(1e-9).log10()
}

fn latency_cdf(path: &Path, rows: &[RowResult]) -> Result<()> {
    let samples = rows.iter().map(|r| r.hist.len()).min().unwrap_or(0).max(10);
    // Up to the quantile every row has samples for, at most p99.99.
    let top = (samples as f64).log10().floor().clamp(1.0, 4.0);
    let lo = rows.iter().map(|r| r.hist.min().max(1)).min().unwrap_or(1) as f64 * 0.8;
    let hi = rows.iter().map(|r| r.hist.max().max(2)).max().unwrap_or(2) as f64 * 1.25;
    let root = BitMapBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Read latency from intended send time, per policy (primary stalling)",
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("latency")
        .y_desc("percentile")
        .x_label_formatter(&|v| format_us(*v as u64))
        .y_labels(top as usize + 1)
        .y_label_formatter(&|y| {
            let k = y.round();
            if (y - k).abs() > 1e-6 {
                return String::new();
            }
            match k as i32 {
                0 => "p0".into(),
                1 => "p90".into(),
                n => format!(
                    "p99{}",
                    if n > 2 {
                        format!(".{}", "9".repeat(n as usize - 2))
                    } else {
                        String::new()
                    }
                ),
            }
        })
        .draw()?;
    for (i, r) in rows.iter().enumerate() {
        let steps = 400;
        let points: Vec<(f64, f64)> = (0..=steps)
            .map(|s| {
                let q = 1.0 - 10f64.powf(-top * f64::from(s) / f64::from(steps));
                (r.hist.value_at_quantile(q).max(1) as f64, nines(q))
            })
            .collect();
        let width = if r.row.selector().is_some() { 3 } else { 2 };
        draw_line(&mut chart, points, i, width, r.label())?;
    }
    draw_legend(&mut chart, SeriesLabelPosition::LowerRight)?;
    root.present()?;
    Ok(())
}

type Chart<'a, 'b, X, Y> = ChartContext<'a, BitMapBackend<'b>, Cartesian2d<X, Y>>;

/// A labelled line in the `index`-th colour.
fn draw_line<X, Y>(
    chart: &mut Chart<'_, '_, X, Y>,
    points: Vec<(f64, f64)>,
    index: usize,
    width: u32,
    label: String,
) -> Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    let color = COLORS[index % COLORS.len()];
    chart
        .draw_series(LineSeries::new(points, color.stroke_width(width)))?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(3)));
    Ok(())
}

fn draw_legend<'a, 'b: 'a, X, Y>(
    chart: &mut Chart<'a, 'b, X, Y>,
    position: SeriesLabelPosition,
) -> Result<()>
where
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}
