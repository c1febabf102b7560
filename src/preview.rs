//! `runner data FILE.toml`: the data before training, as each stage hands it on. The first rows
//! of the load stage's output (the training rows), then per rank those of its shard (epoch 1's
//! DistributedSampler indices) and of the normalised shard, each with every column's minimum,
//! mean, standard deviation and maximum over the stage's rows. It runs no rank: every rank's view
//! is computed in this process, as the ranks compute it. Instruction data shows its first
//! examples instead: text, ids and the tokens in the loss.
use tch::{Kind, Tensor};

use crate::data::normalize::Normalizer;
use crate::data::{self, shard};
use crate::plan::Plan;

/// What to show.
#[derive(Debug, Clone)]
pub struct Options {
    /// Rows shown per stage.
    pub rows: usize,
    /// Only this rank (all ranks when absent).
    pub rank: Option<usize>,
}

/// Columns shown at most; wider data shows its first ones and its last.
const MAX_COLUMNS: usize = 8;
/// Rows read for the statistics of a source that is not held in memory (token windows, arrays).
const STATS_ROWS: usize = 10_000;

pub fn show(plan: &Plan, o: &Options) -> anyhow::Result<()> {
    let c = &plan.config;
    let replicas = plan.layout.world_size;
    if let Some(r) = o.rank {
        anyhow::ensure!(r < plan.world_size(), "--rank {r}: the run has ranks 0 to {}", plan.world_size() - 1);
    }
    if let data::SourceSpec::Instructions(spec) = &plan.data.source {
        crate::say!("run {} ({}): {}", c.run.name, plan.run_id, plan.data.describe());
        plan.data.notes().iter().for_each(|n| crate::say!("{n}"));
        return data::instructions::show(spec, o.rows);
    }
    let data = data::load(&plan.data).map_err(anyhow::Error::msg)?;
    let names = column_names(plan);
    let n = data.train.len();
    let held = data.train.in_memory() || n <= STATS_ROWS;
    let all: Vec<i64> = (0..if held { n } else { STATS_ROWS } as i64).collect();
    let (x, y) = data.train.gather(&all)?;
    crate::say!("run {} ({}): {}", c.run.name, plan.run_id, plan.data.describe());
    let over = if held { format!("all {n} rows") } else { format!("the first {STATS_ROWS} of {n} rows") };
    crate::say!("\n1 load: {n} training rows (statistics over {over})");
    table(&x, &y, &all, &names, o.rows);

    let perm = shard::permutation(c.run.seed, 1, plan.layout.rows, c.shard.shuffle);
    let shards: Vec<shard::RankShard> = (0..replicas).map(|r| shard::RankShard::take(&plan.layout, &perm, r)).collect();
    // scope = "global": one normaliser fitted on every replica's rows; "rank": each its own.
    let method = c.normalize.method;
    let global = c.normalize.scope == crate::config::schema::NormalizeScope::Global;
    let everyone = Normalizer::fit_rows(method, &x);
    for rank in 0..plan.world_size() {
        if o.rank.is_some_and(|r| r != rank) {
            continue;
        }
        let replica = plan.replica(rank);
        let s = &shards[replica];
        let real: Vec<i64> = s.indices.iter().zip(&s.weights).filter(|(_, w)| **w > 0.0).map(|(i, _)| *i).collect();
        let (sx, sy) = data.train.gather(&real)?;
        let shared = if replicas < plan.world_size() { format!(" (replica {replica}'s)") } else { String::new() };
        crate::say!(
            "\nrank {rank}\n2 shard: {} rows of epoch 1{shared}, {} of them padding (row = the training row)",
            s.indices.len(),
            s.indices.len() - real.len()
        );
        table(&sx, &sy, &real, &names, o.rows);
        let normalizer = if global || method == crate::config::schema::NormalizeMethod::None {
            &everyone
        } else {
            &Normalizer::fit_rows(method, &sx)
        };
        let nx = normalizer.apply(&sx.to_kind(if method == crate::config::schema::NormalizeMethod::None {
            sx.kind()
        } else {
            Kind::Float
        }));
        let how = format!("{:?}", method).to_lowercase();
        let scope = if global { "statistics of the whole training set" } else { "statistics of this rank's shard" };
        crate::say!("3 normalize: {how}, {scope}");
        table(&nx, &sy, &real, &names, o.rows);
    }
    Ok(())
}

/// The model's inputs by name: a table's columns (one-hot as `column=value`), else x0, x1, ...
/// (every value of a sample, images flattened).
fn column_names(plan: &Plan) -> Vec<String> {
    match plan.data.file() {
        Some(info) => info.columns.input_names(),
        None => (0..plan.data.input_size()).map(|j| format!("x{j}")).collect(),
    }
}

/// The first `rows` rows of `x` (with their targets and row numbers), then each column's
/// statistics over every row of `x`.
fn table(x: &Tensor, y: &Tensor, row_ids: &[i64], names: &[String], rows: usize) {
    let x = x.flatten(1, -1).to_kind(Kind::Double);
    let width = x.size()[1] as usize;
    let cols: Vec<usize> = if width <= MAX_COLUMNS {
        (0..width).collect()
    } else {
        (0..MAX_COLUMNS - 1).chain(std::iter::once(width - 1)).collect()
    };
    let elided = width > MAX_COLUMNS;
    let header: Vec<String> = cols.iter().map(|&j| names.get(j).cloned().unwrap_or_else(|| format!("x{j}"))).collect();
    let mut lines: Vec<Vec<String>> = Vec::new();
    let mut head = vec!["row".to_owned()];
    head.extend(header);
    head.push("target".into());
    lines.push(head);
    let shown = rows.min(x.size()[0] as usize);
    let values = |t: &Tensor| -> Vec<f64> { Vec::try_from(t.contiguous().view([-1])).unwrap_or_default() };
    let y1 = if y.dim() > 1 { y.select(1, 0) } else { y.shallow_clone() };
    for (i, id) in row_ids.iter().enumerate().take(shown) {
        let row = values(&x.get(i as i64));
        let mut line = vec![id.to_string()];
        line.extend(cols.iter().map(|&j| fmt(row[j])));
        line.push(fmt(y1.get(i as i64).to_kind(Kind::Double).double_value(&[])));
        lines.push(line);
    }
    if x.size()[0] > 0 {
        let stats = [
            ("min", x.amin([0].as_slice(), false)),
            ("mean", x.mean_dim([0].as_slice(), false, Kind::Double)),
            ("std", x.std_correction([0].as_slice(), 0, false)),
            ("max", x.amax([0].as_slice(), false)),
        ];
        for (name, t) in stats {
            let v = values(&t);
            let mut line = vec![name.to_owned()];
            line.extend(cols.iter().map(|&j| fmt(v[j])));
            line.push(String::new());
            lines.push(line);
        }
    }
    let widths: Vec<usize> =
        (0..lines[0].len()).map(|k| lines.iter().map(|l| l[k].chars().count()).max().unwrap_or(0)).collect();
    for (i, line) in lines.iter().enumerate() {
        let mut cells: Vec<String> = line.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        if elided {
            cells.insert(MAX_COLUMNS, if i == 0 { "…".into() } else { " ".into() });
        }
        crate::say!("  {}", cells.join("  ").trim_end());
    }
}

/// Four significant digits, integers as they are.
fn fmt(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e9 {
        format!("{v}")
    } else if v.abs() >= 1e4 || v.abs() < 1e-3 {
        format!("{v:.3e}")
    } else {
        format!("{v:.4}")
    }
}
