//! A search's plots: `search_progress.png`, the best metric against the optimizer steps spent
//! (every trial's result at every rung as a dot, the best full-budget result so far as a line),
//! and `search_parameters.png`, each searched key against the metric its trials reached.
//! The steps are counted in the order one worker would have run the trials' rungs (the
//! scheduler's: promotions first), so the plot is the same whatever ran the search.
use std::path::Path;

use plotters::prelude::*;

use super::plot::{atomic_png, color, fonts, span, Area, DrawResult};
use super::search::{groups, reached, Trial};
use crate::rundir::index::SearchIndex;
use crate::search::halving::{self, Outcome};

/// Writes both plots; returns their names.
pub fn write_all(dir: &Path, search: &SearchIndex, trials: &[Trial]) -> anyhow::Result<Vec<&'static str>> {
    fonts()?;
    atomic_png(&dir.join("search_progress.png"), |area| progress_chart(area, search, trials))?;
    atomic_png(&dir.join("search_parameters.png"), |area| parameters_chart(area, search, trials))?;
    Ok(vec!["search_progress.png", "search_parameters.png"])
}

fn value(o: Option<Outcome>) -> Option<f64> {
    match o {
        Some(Outcome::Value(v)) if v.is_finite() => Some(v),
        _ => None,
    }
}

/// Every (trial, rung) result of a group in the order one worker runs them, with the steps spent
/// once each is known.
pub fn compute_order(search: &SearchIndex, trials: &[&Trial]) -> Vec<(usize, usize, u64)> {
    let results: Vec<Vec<Option<Outcome>>> = trials.iter().map(|t| t.trace.outcomes.clone()).collect();
    let rungs = results.first().map_or(1, |r| r.len());
    let mut known = vec![vec![None; rungs]; results.len()];
    let (mut order, mut spent) = (Vec::new(), 0u64);
    loop {
        let d = halving::decide(super::search::rule(search), &known, search.trials, search.minimize);
        let Some((t, k)) = d.pending(&known).into_iter().find(|(t, k)| results[*t][*k].is_some()) else { break };
        known[t][k] = results[t][k];
        let steps = &trials[t].trace.steps;
        let before = if k == 0 { 0 } else { steps[k - 1].unwrap_or(0) };
        spent += steps[k].unwrap_or(before).saturating_sub(before);
        order.push((t, k, spent));
    }
    order
}

/// A step line of the best result so far at each rung (one grid point), or at the full budget
/// (several: a line per point), over the dots of every result.
fn progress_chart(area: &Area, search: &SearchIndex, trials: &[Trial]) -> DrawResult {
    let all = groups(trials);
    let rungs = search.rungs.len().max(1);
    // (name, colour index, line) and (x, value, rung, colour index) of every group.
    let (mut lines, mut dots) = (Vec::new(), Vec::new());
    for (g, group) in all.iter().enumerate() {
        let mine: Vec<&Trial> = trials.iter().filter(|t| t.group == *group).collect();
        let order = compute_order(search, &mine);
        let results: Vec<(f64, f64, usize)> = order
            .iter()
            .filter_map(|(t, k, spent)| value(mine[*t].trace.outcomes[*k]).map(|v| (*spent as f64, v, *k)))
            .collect();
        let end = results.last().map_or(0.0, |r| r.0);
        let shown: Vec<usize> = if all.len() == 1 { (0..rungs).collect() } else { vec![rungs - 1] };
        for k in shown {
            let line = best_so_far(results.iter().filter(|r| r.2 == k).map(|r| (r.0, r.1)), end, search.minimize);
            let budget = search.rungs.get(k).map(|b| format!(" ({b} {})", search.unit.as_deref().unwrap_or("steps")));
            let name = match (all.len(), search.unit.is_some()) {
                (1, true) => format!("best at rung {k}{}", budget.unwrap_or_default()),
                (1, false) => "best so far".to_owned(),
                _ => format!("{group}: best at the full budget"),
            };
            lines.push((name, if all.len() == 1 { k } else { g }, line));
        }
        dots.extend(results.iter().map(|(x, v, k)| (*x, *v, *k, if all.len() == 1 { *k } else { g })));
    }
    let xmax = dots.iter().map(|d| d.0).fold(1.0, f64::max);
    let ys = span(dots.iter().map(|d| d.1), false);
    let mut chart = ChartBuilder::on(area)
        .caption(format!("Best {} against the optimizer steps spent", search.metric), ("sans-serif", 22))
        .margin(18)
        .x_label_area_size(48)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..xmax * 1.03, ys)?;
    chart
        .configure_mesh()
        .x_desc("optimizer steps spent by all trials, in the order one worker runs them")
        .y_desc(search.metric.as_str())
        .label_style(("sans-serif", 15))
        .draw()?;
    chart.draw_series(
        dots.iter().map(|(x, v, k, c)| Circle::new((*x, *v), 3 + 2 * (*k as i32), color(*c).mix(0.45).filled())),
    )?;
    for (name, c, line) in lines {
        let c = color(c);
        chart
            .draw_series(LineSeries::new(line, c.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(if search.minimize { SeriesLabelPosition::UpperRight } else { SeriesLabelPosition::LowerRight })
        .draw()?;
    Ok(())
}

/// The steps of the best value so far of `results` (x ascending), held until `end`.
fn best_so_far(results: impl Iterator<Item = (f64, f64)>, end: f64, minimize: bool) -> Vec<(f64, f64)> {
    let mut line: Vec<(f64, f64)> = Vec::new();
    for (x, v) in results {
        match line.last().copied() {
            None => line.push((x, v)),
            Some((_, b)) if (minimize && v < b) || (!minimize && v > b) => {
                line.push((x, b));
                line.push((x, v));
            }
            Some(_) => {}
        }
    }
    if let Some((x, b)) = line.last().copied() {
        line.push((end.max(x), b));
    }
    line
}

/// One panel per searched key: each trial's value against its metric at the highest rung it
/// reached (later rungs darker and larger; the best ringed). Log scales show log10 of the value;
/// a choice its place in the list.
fn parameters_chart(area: &Area, search: &SearchIndex, trials: &[Trial]) -> DrawResult {
    let n = search.space.len().max(1);
    let cols = n.min(3);
    let rows = n.div_ceil(cols);
    let panels = area.split_evenly((rows, cols));
    let ys = span(trials.iter().filter_map(|t| reached(&t.trace).and_then(|(_, o)| value(Some(o)))), false);
    for ((key, dist), panel) in search.space.iter().zip(panels.iter()) {
        let log = dist.starts_with("log_");
        let texts: Vec<Option<&str>> =
            trials.iter().map(|t| t.values.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())).collect();
        let numeric = !dist.starts_with("choice");
        let mut categories: Vec<&str> = Vec::new();
        for v in texts.iter().flatten() {
            if !numeric && !categories.contains(v) {
                categories.push(v);
            }
        }
        // In the order the experiment lists the choices.
        categories.sort_by_key(|c| dist.find(*c).unwrap_or(usize::MAX));
        let x_of = |v: &str| -> Option<f64> {
            if numeric {
                v.parse::<f64>().ok().map(|x| if log { x.log10() } else { x })
            } else {
                categories.iter().position(|c| *c == v).map(|i| i as f64)
            }
        };
        let points: Vec<(f64, f64, usize, bool)> = trials
            .iter()
            .zip(&texts)
            .filter_map(|(t, v)| {
                let (k, o) = reached(&t.trace)?;
                Some((x_of((*v)?)?, value(Some(o))?, k, t.best))
            })
            .collect();
        let xs = if numeric { span(points.iter().map(|p| p.0), false) } else { -0.5..categories.len() as f64 - 0.5 };
        let mut chart = ChartBuilder::on(panel)
            .caption(if log { format!("{key} (log scale)") } else { key.clone() }, ("sans-serif", 17))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(60)
            .build_cartesian_2d(xs, ys.clone())?;
        let labels = categories.clone();
        chart
            .configure_mesh()
            .y_desc(search.metric.as_str())
            .x_labels(if numeric { 6 } else { categories.len() + 1 })
            .x_label_formatter(&|x: &f64| {
                if numeric && log {
                    format!("{:.0e}", 10f64.powf(*x))
                } else if numeric {
                    format!("{x:.3}")
                } else if (x - x.round()).abs() < 1e-9 && *x >= 0.0 {
                    labels.get(x.round() as usize).map(|s| s.to_string()).unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .label_style(("sans-serif", 12))
            .draw()?;
        let rungs = search.rungs.len().max(1) as f64;
        chart.draw_series(points.iter().map(|(x, y, k, _)| {
            let shade = 0.35 + 0.65 * (*k as f64 + 1.0) / rungs;
            Circle::new((*x, *y), 3 + *k as i32, color(0).mix(shade).filled())
        }))?;
        chart.draw_series(
            points.iter().filter(|p| p.3).map(|(x, y, _, _)| Circle::new((*x, *y), 9, RED.stroke_width(2))),
        )?;
    }
    Ok(())
}
