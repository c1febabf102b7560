//! The seed pages' views in the terminal: a table with aligned columns (fitted to the terminal's
//! width where there is one, [`fitted_table`]), the epoch trace with a small text chart of the loss.
use super::EpochRow;

/// Renders rows under a header as an aligned text table, each row on one line.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    fitted_table(header, rows, None)
}

/// The width a wide table is fitted to: `COLUMNS` where it is set, the terminal's where standard
/// output is one. `None` otherwise (a pipe, a file, the docs' snapshots): each row then takes one
/// line, as wide as its cells, the same wherever it runs.
pub fn terminal_width() -> Option<usize> {
    let columns = std::env::var("COLUMNS").ok().and_then(|c| c.trim().parse::<usize>().ok());
    if let Some(n) = columns.filter(|n| *n > 0) {
        return Some(n);
    }
    let term = console::Term::stdout();
    term.is_term().then(|| term.size_checked()).flatten().map(|(_, cols)| cols as usize)
}

/// As [`table`], but within `width` columns where one is given and the table is wider: the
/// widest columns narrow (none below its header or 12 characters) and their cells wrap at spaces
/// onto lines of their own.
pub fn fitted_table(header: &[&str], rows: &[Vec<String>], width: Option<usize>) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    if let Some(width) = width {
        narrow(&mut widths, header, width);
    }
    let line = |cells: &[String]| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        format!("  {}\n", padded.join("  ").trim_end())
    };
    let row_lines = |cells: Vec<&str>| {
        let wrapped: Vec<Vec<String>> = cells.iter().zip(&widths).map(|(c, w)| wrap(c, *w)).collect();
        let height = wrapped.iter().map(Vec::len).max().unwrap_or(1);
        (0..height)
            .map(|i| line(&wrapped.iter().map(|c| c.get(i).cloned().unwrap_or_default()).collect::<Vec<_>>()))
            .collect::<String>()
    };
    let mut out = row_lines(header.to_vec());
    out += &line(&widths.iter().map(|w| "─".repeat(*w)).collect::<Vec<_>>());
    for row in rows {
        out += &row_lines(row.iter().map(String::as_str).collect());
    }
    out
}

/// Narrows the widest columns, one character at a time, until the table (its indent and gaps
/// included) fits `width` or every column is at its floor.
fn narrow(widths: &mut [usize], header: &[&str], width: usize) {
    let floor: Vec<usize> = widths.iter().zip(header).map(|(w, h)| (*w).min(h.chars().count().max(12))).collect();
    let room = width.saturating_sub(2 * widths.len());
    while widths.iter().sum::<usize>() > room {
        let Some(i) = (0..widths.len()).filter(|i| widths[*i] > floor[*i]).max_by_key(|i| widths[*i]) else {
            break;
        };
        widths[i] -= 1;
    }
}

/// `text` as lines of at most `width` characters, broken at spaces (a longer word is cut); a
/// text that fits stays as it is.
fn wrap(text: &str, width: usize) -> Vec<String> {
    if text.chars().count() <= width {
        return vec![text.to_owned()];
    }
    let mut lines: Vec<String> = Vec::new();
    let mut current = String::new();
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        let mut word: Vec<char> = word.chars().collect();
        let used = current.chars().count();
        if used > 0 && used + 1 + word.len() <= width {
            current.push(' ');
            current.extend(&word);
            continue;
        }
        if used > 0 {
            lines.push(std::mem::take(&mut current));
        }
        while word.len() > width.max(1) {
            lines.push(word.drain(..width.max(1)).collect());
        }
        current = word.into_iter().collect();
    }
    lines.push(current);
    lines
}

/// The trace of rank 0's rows: global training metrics and validation, a row per epoch (or, for
/// runs counted in steps, per validation interval, `by_step`).
pub fn epoch_table(rows: &[EpochRow], by_step: bool) -> String {
    let fmt = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{v:.4}"));
    let body: Vec<Vec<String>> = rows
        .iter()
        .filter(|r| r.rank == 0)
        .map(|r| {
            vec![
                if by_step { r.step.to_string() } else { r.epoch.to_string() },
                format!("{:.4}", r.global_train_loss),
                format!("{:.4}", r.global_train_acc),
                fmt(r.val_loss),
                fmt(r.val_acc),
                format!("{:.2}", r.epoch_s),
                format!("{:.0}", r.samples_per_s),
            ]
        })
        .collect();
    let (first, time) = if by_step { ("step", "interval s") } else { ("epoch", "epoch s") };
    table(&[first, "loss ↓", "accuracy ↑", "val loss", "val accuracy", time, "samples/s (rank 0)"], &body)
}

/// A pipeline's ranks: compute time and bubble (time waiting for neighbours), mean per epoch.
/// Empty for the other strategies, which have no bubble.
pub fn pipeline_table(rows: &[EpochRow]) -> String {
    let ranks = rows.iter().filter(|r| r.bubble.is_some()).map(|r| r.rank).max();
    let Some(last) = ranks else { return String::new() };
    let body: Vec<Vec<String>> = (0..=last)
        .map(|rank| {
            let mine: Vec<&EpochRow> = rows.iter().filter(|r| r.rank == rank).collect();
            let n = mine.len().max(1) as f64;
            let mean = |f: fn(&EpochRow) -> f64| mine.iter().map(|r| f(r)).sum::<f64>() / n;
            vec![
                rank.to_string(),
                format!("{:.2}", mean(|r| r.compute_s)),
                format!("{:.2}", mean(|r| r.epoch_s)),
                format!("{:.0}%", 100.0 * mean(|r| r.bubble.unwrap_or(0.0))),
            ]
        })
        .collect();
    table(&["rank", "compute s", "epoch s", "bubble"], &body)
}

/// Each rank's peak resident memory as measured (the trace's `peak_rss_bytes`) beside the plan's
/// estimate for it (`by_rank`: each rank's, under a pipeline; else `estimate` for every rank):
/// "  peak memory: rank 0 192 MiB (estimated 190 MiB), rank 1 …". Empty where neither is known.
pub fn memory_line(
    rows: &[EpochRow],
    estimate: Option<&crate::limits::Estimate>,
    by_rank: &[crate::limits::Estimate],
) -> String {
    let ranks = rows.iter().map(|r| r.rank).max();
    let (Some(last), Some(e)) = (ranks, estimate) else { return String::new() };
    let peaks: Vec<String> = (0..=last)
        .map(|rank| {
            let peak = rows.iter().filter(|r| r.rank == rank).map(|r| r.peak_rss_bytes).max().unwrap_or(0);
            let size = crate::limits::size;
            let e = by_rank.get(rank as usize).unwrap_or(e);
            format!("rank {rank} {} (estimated {})", size(peak as f64), size(e.per_rank()))
        })
        .collect();
    format!("  peak memory: {}", peaks.join(", "))
}

/// A text chart of `values` (one column per epoch), `height` rows high, like the seed pages'.
pub fn chart(label: &str, values: &[f64], height: usize) -> String {
    if values.is_empty() {
        return String::new();
    }
    let (lo, hi) = values.iter().fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    let span = (hi - lo).max(1e-12);
    let level = |v: f64| (((v - lo) / span) * (height - 1) as f64).round() as usize;
    let mut out = String::new();
    for row in (0..height).rev() {
        let y = lo + span * row as f64 / (height - 1).max(1) as f64;
        let cells: String = values.iter().map(|v| if level(*v) == row { " * " } else { "   " }).collect();
        out += &format!("  {y:>7.3} |{}\n", cells.trim_end());
    }
    out += &format!("          +{}\n", "---".repeat(values.len()));
    out += &format!("          {}  {label}\n", (1..=values.len()).map(|e| format!("{e:>3}")).collect::<String>());
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_wide_table_fits_the_width_its_cells_wrapped_at_spaces() {
        let long = "every 1 epoch(s) and after the last, written in the background while training goes on".to_owned();
        let rows =
            vec![vec!["  checkpoint".to_owned(), long.clone()], vec!["1 load".to_owned(), "synthetic".to_owned()]];
        let natural = super::table(&["stage", "operation"], &rows);
        assert_eq!(natural.lines().nth(2).unwrap(), format!("    checkpoint  {long}"));
        assert_eq!(super::fitted_table(&["stage", "operation"], &rows, Some(200)), natural);
        let fitted = super::fitted_table(&["stage", "operation"], &rows, Some(40));
        assert!(fitted.lines().all(|l| l.chars().count() <= 40), "{fitted}");
        assert_eq!(
            fitted,
            "  stage         operation\n  ────────────  ────────────────────────\n    \
             checkpoint  every 1 epoch(s) and\n                after the last, written\n                in the background while\n                training goes on\n  \
             1 load        synthetic\n"
        );
        assert_eq!(super::wrap("abcdefghij k", 4), ["abcd", "efgh", "ij k"]);
    }

    use super::*;

    #[test]
    fn chart_puts_the_highest_value_on_top() {
        let c = chart("epochs", &[1.2, 0.6, 0.3], 3);
        let lines: Vec<&str> = c.lines().collect();
        assert!(lines[0].contains("1.200") && lines[0].ends_with('*'), "{c}");
        assert!(lines[2].contains("0.300"), "{c}");
        assert_eq!(lines.len(), 5);
    }

    #[test]
    fn pipeline_table_averages_each_rank_over_the_epochs() {
        let row = |epoch, rank, compute_s, bubble| EpochRow {
            step: epoch as u64,
            epoch,
            rank,
            world_size: 2,
            train_loss: 1.0,
            train_acc: 0.5,
            global_train_loss: 1.0,
            global_train_acc: 0.5,
            samples: 10,
            steps: 1,
            epoch_s: 2.0,
            samples_per_s: 5.0,
            compute_s,
            bubble,
            lr: 0.1,
            ..Default::default()
        };
        let rows = [
            row(1, 0, 1.0, Some(0.2)),
            row(1, 1, 1.5, Some(0.4)),
            row(2, 0, 2.0, Some(0.3)),
            row(2, 1, 1.5, Some(0.2)),
        ];
        let t = pipeline_table(&rows);
        assert!(t.contains("0     1.50       2.00     25%") && t.contains("1     1.50       2.00     30%"), "{t}");
        assert_eq!(pipeline_table(&[row(1, 0, 1.0, None)]), "");
    }

    #[test]
    fn table_aligns_columns() {
        let t = table(&["a", "bb"], &[vec!["xxx".into(), "y".into()]]);
        assert_eq!(t, "  a    bb\n  ───  ──\n  xxx  y\n");
    }
}
