//! PNG plots of a sweep, drawn in pure Rust with plotters: the training loss and the validation
//! accuracy per epoch (a line per world size), throughput against world size with the ideal
//! linear scaling, and per-rank memory (training state, peak resident) against world size. Text uses DejaVu Sans embedded in the binary: no system fonts are needed.
use std::path::Path;
use std::sync::OnceLock;

use anyhow::anyhow;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::aggregate::Row;
use super::stats::{Spread, MIB};

const SIZE: (u32, u32) = (900, 560);

/// Line colours that stay readable on white (Tableau 10).
const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

pub(super) fn color(i: usize) -> RGBColor {
    COLORS[i % COLORS.len()]
}

/// Writes `loss.png`, `val_accuracy.png` (when any point validated) and `throughput.png` into
/// `dir`, each atomically; returns the file names written.
pub fn write_all(dir: &Path, rows: &[Row]) -> anyhow::Result<Vec<&'static str>> {
    fonts()?;
    let mut written = Vec::new();
    let loss: Vec<(String, Vec<(f64, f64)>)> =
        rows.iter().map(|r| (label(r), curve(r.loss_curve.iter().map(|v| Some(*v))))).collect();
    atomic_png(&dir.join("loss.png"), |area| {
        let title = "Training loss per epoch (mean across seeds)";
        epochs_chart(area, title, "loss", &loss, SeriesLabelPosition::UpperRight)
    })?;
    written.push("loss.png");
    let acc: Vec<(String, Vec<(f64, f64)>)> = rows
        .iter()
        .map(|r| (label(r), curve(r.val_acc_curve.iter().copied())))
        .filter(|(_, c)| !c.is_empty())
        .collect();
    if !acc.is_empty() {
        atomic_png(&dir.join("val_accuracy.png"), |area| {
            let title = "Validation accuracy per epoch (mean across seeds)";
            epochs_chart(area, title, "accuracy", &acc, SeriesLabelPosition::LowerRight)
        })?;
        written.push("val_accuracy.png");
    }
    atomic_png(&dir.join("throughput.png"), |area| throughput_chart(area, rows))?;
    written.push("throughput.png");
    // Only where the traces have the memory columns (not for sweeps made before them).
    if super::table::has_memory(rows) {
        atomic_png(&dir.join("memory.png"), |area| memory_chart(area, rows))?;
        written.push("memory.png");
    }
    Ok(written)
}

pub(super) type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;
pub(super) type DrawResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

pub(super) fn fonts() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok =
        *REGISTERED.get_or_init(|| register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular()).is_ok());
    ok.then_some(()).ok_or_else(|| anyhow!("the embedded font could not be loaded"))
}

/// Draws into a temporary PNG beside `path`, then renames it over `path`.
pub(super) fn atomic_png(path: &Path, draw: impl FnOnce(&Area) -> DrawResult) -> anyhow::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("plot");
    // The backend picks the encoder from the extension: keep `.png` last.
    let tmp = dir.join(format!(".{stem}.tmp-{}.png", std::process::id()));
    let result = (|| -> DrawResult {
        let area = BitMapBackend::new(&tmp, SIZE).into_drawing_area();
        area.fill(&WHITE)?;
        draw(&area)?;
        area.present()?;
        Ok(())
    })();
    let result = result.map_err(|e| anyhow!("{e}")).and_then(|()| Ok(std::fs::rename(&tmp, path)?));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(|e| e.context(format!("cannot draw {}", path.display())))
}

fn label(r: &Row) -> String {
    let mut s = format!("world size {}", r.world_size);
    for (k, v) in &r.group {
        s += &format!(", {k} = {v}");
    }
    s
}

/// (epoch, value) for the epochs that have a value; epochs count from 1.
fn curve(values: impl Iterator<Item = Option<f64>>) -> Vec<(f64, f64)> {
    values.enumerate().filter_map(|(i, v)| v.map(|v| ((i + 1) as f64, v))).collect()
}

/// A range around `values` with a margin, never empty.
pub(super) fn span(values: impl Iterator<Item = f64>, from_zero: bool) -> std::ops::Range<f64> {
    let (lo, hi) = values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)));
    if lo > hi {
        return 0.0..1.0;
    }
    let pad = ((hi - lo) * 0.08).max(hi.abs() * 0.02).max(1e-6);
    let lo = if from_zero { 0.0 } else { lo - pad };
    lo..hi + pad
}

/// One line per row over the epochs; the legend goes where the curves are not (`legend`).
fn epochs_chart(
    area: &Area,
    title: &str,
    y: &str,
    lines: &[(String, Vec<(f64, f64)>)],
    legend: SeriesLabelPosition,
) -> DrawResult {
    let last = lines.iter().flat_map(|(_, c)| c.iter().map(|p| p.0)).fold(1.0, f64::max);
    let ys = span(lines.iter().flat_map(|(_, c)| c.iter().map(|p| p.1)), false);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 22))
        .margin(18)
        .x_label_area_size(48)
        .y_label_area_size(70)
        .build_cartesian_2d(0.8..last + 0.2, ys)?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc(y)
        .x_labels(last as usize + 1)
        .x_label_formatter(&|x| {
            if (x - x.round()).abs() < 1e-9 {
                format!("{x:.0}")
            } else {
                String::new()
            }
        })
        .label_style(("sans-serif", 15))
        .draw()?;
    for (i, (name, points)) in lines.iter().enumerate() {
        let color = color(i);
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2)));
        chart.draw_series(points.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(legend)
        .draw()?;
    Ok(())
}

fn throughput_chart(area: &Area, rows: &[Row]) -> DrawResult {
    let max_world = rows.iter().map(|r| r.world_size).max().unwrap_or(1) as f64;
    let base = rows.iter().min_by_key(|r| r.world_size);
    let ideal_top = base.map_or(0.0, |b| b.samples_per_s.mean * max_world / b.world_size as f64);
    let ys =
        span(rows.iter().map(|r| r.samples_per_s.mean + r.samples_per_s.std.unwrap_or(0.0)).chain([ideal_top]), true);
    let mut chart = ChartBuilder::on(area)
        .caption("Throughput against world size (samples/s, all ranks; mean ± std)", ("sans-serif", 22))
        .margin(18)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .build_cartesian_2d(0.5..max_world + 0.5, ys)?;
    chart
        .configure_mesh()
        .x_desc("world size (ranks)")
        .y_desc("samples/s")
        .x_labels(max_world as usize + 2)
        .x_label_formatter(&world_size_label)
        .y_label_formatter(&|y| format!("{y:.0}"))
        .label_style(("sans-serif", 15))
        .draw()?;
    if let Some(b) = base {
        let per_rank = b.samples_per_s.mean / b.world_size as f64;
        let ideal = [b.world_size as f64, max_world].map(|w| (w, per_rank * w));
        chart
            .draw_series(DashedLineSeries::new(ideal, 8, 6, BLACK.mix(0.5).stroke_width(1)))?
            .label("ideal linear scaling")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], BLACK.mix(0.5)));
    }
    group_lines(&mut chart, rows, "samples/s", |r| Some(r.samples_per_s), true)?;
    if rows.iter().any(Row::oversubscribed) {
        chart
            .draw_series(std::iter::empty::<Circle<(f64, f64), i32>>())?
            .label("oversubscribed: more threads than cores")
            .legend(|(x, y)| Circle::new((x + 12, y), 5, RED.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    Ok(())
}

type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// One line per group of rows (the values of the axes other than world size and seed) over the
/// world sizes, through each row's mean of `value`, with a ± std bar; `oversubscribed`: rows
/// with more threads than cores drawn as red rings. `single`: the line's name where there is
/// no other axis.
fn group_lines(
    chart: &mut Chart,
    rows: &[Row],
    single: &str,
    value: impl Fn(&Row) -> Option<Spread>,
    oversubscribed: bool,
) -> DrawResult {
    let mut groups: Vec<&[(String, String)]> = Vec::new();
    for r in rows {
        if !groups.contains(&r.group.as_slice()) {
            groups.push(&r.group);
        }
    }
    for (i, group) in groups.iter().enumerate() {
        let color = color(i);
        let mine: Vec<(&Row, Spread)> =
            rows.iter().filter(|r| r.group == *group).filter_map(|r| value(r).map(|v| (r, v))).collect();
        let name = if group.is_empty() {
            single.to_owned()
        } else {
            group.iter().map(|(k, v)| format!("{k} = {v}")).collect::<Vec<_>>().join(", ")
        };
        let points: Vec<(f64, f64)> = mine.iter().map(|(r, v)| (r.world_size as f64, v.mean)).collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2)));
        for (r, v) in &mine {
            let (x, m) = (r.world_size as f64, v.mean);
            if let Some(s) = v.std {
                let bar = [(x, m - s), (x, m + s)];
                chart.draw_series(std::iter::once(PathElement::new(bar, color.stroke_width(2))))?;
                for y in [m - s, m + s] {
                    let cap = [(x - 0.06, y), (x + 0.06, y)];
                    chart.draw_series(std::iter::once(PathElement::new(cap, color.stroke_width(2))))?;
                }
            }
            let style = if oversubscribed && r.oversubscribed() { RED.stroke_width(2) } else { color.filled() };
            chart.draw_series(std::iter::once(Circle::new((x, m), 5, style)))?;
        }
    }
    Ok(())
}

/// Per-rank memory against world size, in two panels: the training state (parameters,
/// gradients, optimizer state) of the rank holding the most, and the largest peak resident
/// memory of a rank's process.
fn memory_chart(area: &Area, rows: &[Row]) -> DrawResult {
    let (left, right) = area.split_horizontally(SIZE.0 / 2);
    memory_panel(&left, "Training state per rank (MiB)", "state", rows, |r| r.state_bytes)?;
    memory_panel(&right, "Peak resident memory per rank (MiB)", "peak RSS", rows, |r| r.peak_rss_bytes)
}

fn memory_panel(area: &Area, title: &str, single: &str, rows: &[Row], bytes: fn(&Row) -> Option<Spread>) -> DrawResult {
    let value = |r: &Row| bytes(r).map(|s| s.scaled(1.0 / MIB));
    let max_world = rows.iter().map(|r| r.world_size).max().unwrap_or(1) as f64;
    let ys = span(rows.iter().filter_map(value).map(|s| s.mean + s.std.unwrap_or(0.0)), true);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 19))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0.5..max_world + 0.5, ys)?;
    chart
        .configure_mesh()
        .x_desc("world size (ranks)")
        .y_desc("MiB")
        .x_labels(max_world as usize + 2)
        .x_label_formatter(&world_size_label)
        .label_style(("sans-serif", 14))
        .draw()?;
    group_lines(&mut chart, rows, single, value, false)?;
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::LowerLeft)
        .draw()?;
    Ok(())
}

/// An x-axis label of world sizes: whole numbers from 1, nothing between them.
fn world_size_label(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-9 && *x >= 1.0 {
        format!("{x:.0}")
    } else {
        String::new()
    }
}
