//! The seed pages' views in the terminal: a table with aligned columns, the epoch trace with a
//! small text chart of the loss.
use super::EpochRow;

/// Renders rows under a header as an aligned text table.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        format!("  {}\n", padded.join("  ").trim_end())
    };
    let mut out = line(header.to_vec());
    out += &line(widths.iter().map(|w| "─".repeat(*w)).collect::<Vec<_>>().iter().map(String::as_str).collect());
    for row in rows {
        out += &line(row.iter().map(String::as_str).collect());
    }
    out
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
/// estimate for it: "  peak memory: rank 0 192 MiB (estimated 190 MiB), rank 1 …". Empty
/// where neither is known.
pub fn memory_line(rows: &[EpochRow], estimate: Option<&crate::limits::Estimate>) -> String {
    let ranks = rows.iter().map(|r| r.rank).max();
    let (Some(last), Some(e)) = (ranks, estimate) else { return String::new() };
    let peaks: Vec<String> = (0..=last)
        .map(|rank| {
            let peak = rows.iter().filter(|r| r.rank == rank).map(|r| r.peak_rss_bytes).max().unwrap_or(0);
            let size = crate::limits::size;
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
            val_loss: None,
            val_acc: None,
            samples: 10,
            steps: 1,
            epoch_s: 2.0,
            samples_per_s: 5.0,
            comm_s: 0.0,
            compute_s,
            bubble,
            val_f1: None,
            val_rmse: None,
            val_mae: None,
            val_r2: None,
            perplexity: None,
            val_perplexity: None,
            tokens_per_s: None,
            mfu: None,
            lr: 0.1,
            grad_norm_mean: None,
            grad_norm_max: None,
            param_bytes: 0,
            grad_bytes: 0,
            optim_bytes: 0,
            peak_rss_bytes: 0,
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
