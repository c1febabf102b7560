//! The result table: `table.md` for people, and one polars frame for `summary.parquet` and
//! `table.csv` (every mean and std as its own column, nothing formatted).
use polars::prelude::*;

use super::aggregate::{Loaded, Row, SEED_KEY};
use super::measured;
use super::stats::{Spread, MIB};
use crate::rundir::index::Index;

/// The markdown page: what was run, the table, and notes on oversubscribed and missing points.
pub fn markdown(index: &Index, loaded: &Loaded, rows: &[Row]) -> String {
    let mut out = intro(index, loaded, rows);
    out += &table(rows);
    out += &notes(loaded, rows);
    out
}

/// What was run: the experiment, the points complete, the cores, the seeds, what the columns mean.
fn intro(index: &Index, loaded: &Loaded, rows: &[Row]) -> String {
    let seeds: Vec<&str> =
        index.points.iter().flat_map(|p| p.values.iter()).filter(|(k, _)| k == SEED_KEY).map(|(_, v)| v.as_str()).fold(
            Vec::new(),
            |mut seen, v| {
                if !seen.contains(&v) {
                    seen.push(v);
                }
                seen
            },
        );
    let cores = rows.iter().map(|r| r.cores).min().unwrap_or(0);
    let epochs = rows.iter().map(|r| r.final_epoch).max().unwrap_or(0);
    format!(
        "# Sweep {}\n\n{} of {} points complete, run on {cores} cores. Final epoch ({epochs}) of each \
         point; mean ± sample standard deviation across {}. Loss and accuracy are global (all ranks); \
         val is rank 0's validation set; epoch s is the slowest rank's; samples/s is all ranks \
         together, each sample counted once however many ranks pass it (a tensor group, a \
         pipeline's stages). Speedup: samples/s ÷ samples/s at the smallest world size; efficiency: speedup ÷ \
         (world size ÷ smallest world size).\n\n",
        index.experiment,
        loaded.points.len(),
        index.points.len(),
        if seeds.is_empty() {
            "seeds (one per row here)".to_owned()
        } else {
            format!("seeds (run.seed = {})", seeds.join(", "))
        }
    )
}

/// The table: a row per point (mean ± spread over its seeds), memory where the traces have it.
fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    // Per-rank memory beside throughput, where the traces have it (not in tables of older traces).
    let memory = has_memory(rows);
    let estimate = memory && rows.iter().any(|r| r.estimate_bytes.is_some());
    let tokens = rows.iter().any(|r| r.tokens_per_s.is_some());
    let sent = sent_dimensions(rows);
    if memory {
        out += "State MiB: the training state (parameters, gradients and optimizer state) of the rank \
                holding the most at the final epoch, under FSDP its shards plus the most it had gathered \
                at once. Peak RSS MiB: the largest peak resident memory of any rank's process (measured, \
                like the timings: it differs between reruns)";
        out += if estimate { "; estimate MiB: the plan's estimate of that process" } else { "" };
        out += ". MiB = 2^20 bytes.\n\n";
    }
    if !sent.is_empty() {
        out += "Sent MiB/step: what the rank sending the most handed to the process group of each mesh \
                dimension per optimizer step at the final epoch (measured in the group; the wire carries \
                what the collective's algorithm makes of it).\n\n";
    }
    let group_keys: Vec<&str> =
        rows.first().map(|r| r.group.iter().map(|(k, _)| k.as_str()).collect()).unwrap_or_default();
    // Macro-F1 next to accuracy, where the traces have it (not in tables of older traces).
    let f1 = rows.iter().any(|r| r.val_f1.is_some());
    let mut header = vec!["world size"];
    header.extend(&group_keys);
    header.extend(["seeds", "train loss", "train acc", "val loss", "val acc"]);
    if f1 {
        header.push("val f1");
    }
    header.extend(["epoch s", "samples/s"]);
    if tokens {
        header.push("tokens/s");
    }
    header.extend(["speedup", "efficiency"]);
    let sent_headers: Vec<String> = sent.iter().map(|&i| format!("{} sent MiB/step", measured::SENT[i].1)).collect();
    header.extend(sent_headers.iter().map(String::as_str));
    if memory {
        header.extend(["state MiB", "peak RSS MiB"]);
    }
    if estimate {
        header.push("estimate MiB");
    }
    out += &format!("| {} |\n", header.join(" | "));
    let align: Vec<&str> = header.iter().map(|h| if group_keys.contains(h) { "---" } else { "---:" }).collect();
    out += &format!("| {} |\n", align.join(" | "));
    let opt = |s: &Option<Spread>, d| s.map_or("—".to_owned(), |s| s.display(d));
    for r in rows {
        let mut cells =
            vec![if r.oversubscribed() { format!("{} ⚠", r.world_size) } else { r.world_size.to_string() }];
        cells.extend(r.group.iter().map(|(_, v)| v.clone()));
        cells.extend([
            r.seeds.to_string(),
            r.train_loss.display(4),
            r.train_acc.display(4),
            opt(&r.val_loss, 4),
            opt(&r.val_acc, 4),
        ]);
        if f1 {
            cells.push(opt(&r.val_f1, 4));
        }
        cells.extend([r.epoch_s.display(3), r.samples_per_s.display(0)]);
        if tokens {
            cells.push(opt(&r.tokens_per_s, 0));
        }
        cells.extend([format!("{:.2}", r.speedup), format!("{:.2}", r.efficiency)]);
        cells.extend(sent.iter().map(|&i| mib(&r.sent_bytes[i])));
        if memory {
            cells.extend([mib(&r.state_bytes), mib(&r.peak_rss_bytes)]);
        }
        if estimate {
            cells.push(mib(&r.estimate_bytes));
        }
        out += &format!("| {} |\n", cells.join(" | "));
    }
    out
}

/// Notes under the table: oversubscribed points, failures the runs survived, points missing.
fn notes(loaded: &Loaded, rows: &[Row]) -> String {
    let mut out = String::new();
    let over: Vec<String> = rows
        .iter()
        .filter(|r| r.oversubscribed())
        .map(|r| {
            format!(
                "world size {} runs {} ranks × {} thread{} = {} threads on {} cores",
                r.world_size,
                r.world_size,
                r.threads_per_rank,
                if r.threads_per_rank == 1 { "" } else { "s" },
                r.world_size * r.threads_per_rank,
                r.cores
            )
        })
        .collect();
    if !over.is_empty() {
        out.push('\n');
        out += &format!(
            "⚠ oversubscribed: {}. Timings there measure contention for cores, not scaling.\n",
            dedup(over).join("; ")
        );
    }
    let survived: Vec<(&String, &String)> =
        loaded.points.iter().filter_map(|p| Some((&p.dir, p.failures.as_ref()?))).collect();
    if !survived.is_empty() {
        out += "\nFailures the runs survived (their results are those of uninterrupted runs):\n";
        for (dir, cost) in survived {
            out += &format!("- `{dir}`: {cost}\n");
        }
    }
    if !loaded.missing.is_empty() {
        out += "\nNot in the table:\n";
        for (dir, why) in &loaded.missing {
            out += &format!("- `{dir}`: {}\n", why.lines().next().unwrap_or(why));
        }
    }
    out
}

/// Bytes in MiB, the mean to three significant digits (0.0528, 4.86, 230); "—" where absent.
fn mib(bytes: &Option<Spread>) -> String {
    bytes.map_or("—".to_owned(), |s| {
        let s = s.scaled(1.0 / MIB);
        let digits = if s.mean > 0.0 { (2 - s.mean.log10().floor() as i64).clamp(0, 6) as usize } else { 0 };
        s.display(digits)
    })
}

/// The mesh dimensions ([`measured::SENT`]) along which any row sent bytes.
fn sent_dimensions(rows: &[Row]) -> Vec<usize> {
    (0..measured::SENT.len()).filter(|&i| rows.iter().any(|r| r.sent_bytes[i].is_some_and(|s| s.mean > 0.0))).collect()
}

/// Whether any row has the per-rank memory columns (traces from before them have none).
pub fn has_memory(rows: &[Row]) -> bool {
    rows.iter().any(|r| r.state_bytes.is_some() || r.peak_rss_bytes.is_some())
}

fn dedup(mut v: Vec<String>) -> Vec<String> {
    let mut seen = Vec::new();
    v.retain(|s| {
        let new = !seen.contains(s);
        seen.push(s.clone());
        new
    });
    v
}

/// The summary frame: the other axes' values (TOML text), then every statistic as a number.
pub fn frame(rows: &[Row]) -> PolarsResult<DataFrame> {
    let n = rows.len();
    let mut cols: Vec<Column> = Vec::new();
    let group_keys: Vec<String> =
        rows.first().map(|r| r.group.iter().map(|(k, _)| k.clone()).collect()).unwrap_or_default();
    for (i, key) in group_keys.iter().enumerate() {
        let values: Vec<String> = rows.iter().map(|r| r.group[i].1.clone()).collect();
        cols.push(Column::new(key.as_str().into(), values));
    }
    let u32s = |name: &str, f: fn(&Row) -> usize| {
        Column::new(name.into(), rows.iter().map(|r| f(r) as u32).collect::<Vec<_>>())
    };
    cols.push(u32s("world_size", |r| r.world_size));
    cols.push(u32s("seeds", |r| r.seeds));
    cols.push(u32s("final_epoch", |r| r.final_epoch as usize));
    type Stat = fn(&Row) -> Option<Spread>;
    let mut stats: Vec<(&str, Stat)> = vec![
        ("train_loss", |r| Some(r.train_loss)),
        ("train_acc", |r| Some(r.train_acc)),
        ("val_loss", |r| r.val_loss),
        ("val_acc", |r| r.val_acc),
    ];
    // Where the traces have it (tables of older traces keep their columns).
    if rows.iter().any(|r| r.val_f1.is_some()) {
        stats.push(("val_f1", |r| r.val_f1));
    }
    stats.extend([("epoch_s", (|r| Some(r.epoch_s)) as Stat), ("samples_per_s", |r| Some(r.samples_per_s))]);
    if rows.iter().any(|r| r.tokens_per_s.is_some()) {
        stats.push(("tokens_per_s", |r| r.tokens_per_s));
    }
    let sent: [(&str, Stat); 3] = [
        ("sent_data_bytes", |r| r.sent_bytes[0]),
        ("sent_tensor_bytes", |r| r.sent_bytes[1]),
        ("sent_pipeline_bytes", |r| r.sent_bytes[2]),
    ];
    stats.extend(sent_dimensions(rows).into_iter().map(|i| sent[i]));
    // In bytes; null for rows whose traces predate the memory columns.
    if has_memory(rows) {
        stats.extend([("state_bytes", (|r| r.state_bytes) as Stat), ("peak_rss_bytes", |r| r.peak_rss_bytes)]);
        if rows.iter().any(|r| r.estimate_bytes.is_some()) {
            stats.push(("estimate_bytes", |r| r.estimate_bytes));
        }
    }
    for (name, f) in stats {
        let mean: Vec<Option<f64>> = rows.iter().map(|r| f(r).map(|s| s.mean)).collect();
        let std: Vec<Option<f64>> = rows.iter().map(|r| f(r).and_then(|s| s.std)).collect();
        cols.push(Column::new(format!("{name}_mean").into(), mean));
        cols.push(Column::new(format!("{name}_std").into(), std));
    }
    cols.push(Column::new("speedup".into(), rows.iter().map(|r| r.speedup).collect::<Vec<_>>()));
    cols.push(Column::new("efficiency".into(), rows.iter().map(|r| r.efficiency).collect::<Vec<_>>()));
    cols.push(u32s("threads_per_rank", |r| r.threads_per_rank));
    cols.push(u32s("cores", |r| r.cores));
    cols.push(Column::new("oversubscribed".into(), rows.iter().map(Row::oversubscribed).collect::<Vec<_>>()));
    DataFrame::new(n, cols)
}

/// The frame as CSV text.
pub fn csv(df: &mut DataFrame) -> PolarsResult<Vec<u8>> {
    let mut buf = Vec::new();
    CsvWriter::new(&mut buf).finish(df)?;
    Ok(buf)
}
