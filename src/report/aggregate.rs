//! From traces to table rows. [`load`] reads each point's trace with polars (the final epoch's
//! metrics and the per-epoch curves); [`rows`] groups points by world size and every other
//! non-seed axis and takes the spread across seeds, speedup and efficiency (pure, unit-tested).
use std::path::Path;

use anyhow::Context;
use polars::prelude::*;

use super::measured;
use super::stats::{self, Spread};
use crate::rundir::index::Index;
use crate::rundir::manifest::{Manifest, Status};

/// The axis whose values are repeats of the same experiment, not a dimension of the table.
pub const SEED_KEY: &str = "run.seed";
/// The axis the table is about; taken from each run's manifest, swept or not.
pub const WORLD_KEY: &str = "run.world_size";
/// The table's column of a named point's name (`[[points]]`).
pub const POINT_KEY: &str = "point";

/// One completed point.
#[derive(Debug, Clone, PartialEq)]
pub struct PointResult {
    pub dir: String,
    /// The values (TOML text) of the axes other than the seed and the world size.
    pub group: Vec<(String, String)>,
    pub world_size: usize,
    pub threads_per_rank: usize,
    pub cores: usize,
    /// Rank 0's global train loss per epoch, epoch 1 first.
    pub loss_curve: Vec<f64>,
    /// Rank 0's validation accuracy per epoch (none where it did not validate).
    pub val_acc_curve: Vec<Option<f64>>,
    pub last: Final,
    /// What failures cost the run, when it survived any: its restarts and goodput
    /// ([`crate::rundir::goodput`]).
    pub failures: Option<String>,
}

/// The final epoch of one point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Final {
    pub epoch: u32,
    pub train_loss: f64,
    pub train_acc: f64,
    pub val_loss: Option<f64>,
    pub val_acc: Option<f64>,
    /// Classification: validation macro-F1 (absent from traces written before it existed).
    pub val_f1: Option<f64>,
    /// The slowest rank's epoch time, in seconds.
    pub epoch_s: f64,
    /// Samples per second of all ranks together (a pipeline: its slowest rank's, as every rank
    /// passes the same samples).
    pub samples_per_s: f64,
    /// Bytes of training state (parameters + gradients + optimizer state) of the rank holding
    /// the most; absent from traces written before the memory columns.
    pub state_bytes: Option<f64>,
    /// The largest peak resident memory of any rank's process, in bytes (measured: it differs
    /// between reruns); absent from traces written before the memory columns.
    pub peak_rss_bytes: Option<f64>,
    /// Tokens per second of all ranks together, counted as `samples_per_s` is; a language model's.
    pub tokens_per_s: Option<f64>,
    /// The plan's estimate of the heaviest rank's process ([`measured::estimate`]).
    pub estimate_bytes: Option<f64>,
    /// The most any rank sent per step along each mesh dimension ([`measured::SENT`]).
    pub sent_bytes: [Option<f64>; 3],
}

/// The completed points of a sweep directory, and the others with why they are left out.
#[derive(Debug, Default)]
pub struct Loaded {
    pub points: Vec<PointResult>,
    pub missing: Vec<(String, String)>,
}

pub fn load(dir: &Path, index: &Index) -> anyhow::Result<Loaded> {
    let mut loaded = Loaded::default();
    for p in &index.points {
        let run = dir.join(&p.dir);
        let manifest = match Manifest::read(&run) {
            Ok(m) => m,
            Err(_) => {
                let why = "no manifest.json: not run, or it failed before it started";
                loaded.missing.push((p.dir.clone(), why.into()));
                continue;
            }
        };
        if manifest.status != Status::Complete {
            let why = match (&manifest.status, &manifest.failure) {
                (Status::Failed, Some(f)) => format!("failed: {f}"),
                (status, _) => format!("{status:?}").to_lowercase(),
            };
            loaded.missing.push((p.dir.clone(), why));
            continue;
        }
        let path = run.join(crate::rundir::TRACE);
        let named = p.point.iter().map(|name| (POINT_KEY.to_owned(), name.clone()));
        let group = named.chain(p.values.iter().filter(|(k, _)| k != SEED_KEY && k != WORLD_KEY).cloned()).collect();
        // The mesh and the memory estimate; a run of an older runner may have no plan this one reads.
        let plan = crate::plan::Plan::load(&run.join(crate::rundir::PLAN)).ok();
        let result = crate::trace::read_parquet(&path).and_then(|df| {
            point_result(&df, p.dir.clone(), group, &manifest, plan.as_ref())
                .with_context(|| format!("{} is not a runner trace", path.display()))
        });
        match result {
            Ok(point) => loaded.points.push(point),
            Err(e) => loaded.missing.push((p.dir.clone(), format!("{e:#}"))),
        }
    }
    Ok(loaded)
}

fn point_result(
    df: &DataFrame,
    dir: String,
    group: Vec<(String, String)>,
    m: &Manifest,
    plan: Option<&crate::plan::Plan>,
) -> anyhow::Result<PointResult> {
    let epoch = df.column("epoch")?.u32()?;
    let last_epoch = epoch.max().context("the trace has no rows")?;
    let rank0 = df.filter(&df.column("rank")?.u32()?.equal(0))?;
    let rank0 = rank0.sort(["epoch"], SortMultipleOptions::default())?;
    let final_rows = df.filter(&epoch.equal(last_epoch))?;
    let final_rank0 = rank0.filter(&rank0.column("epoch")?.u32()?.equal(last_epoch))?;
    let f64s =
        |df: &DataFrame, c: &str| -> anyhow::Result<Vec<Option<f64>>> { Ok(df.column(c)?.f64()?.iter().collect()) };
    let first =
        |df: &DataFrame, c: &str| -> anyhow::Result<Option<f64>> { Ok(f64s(df, c)?.into_iter().next().flatten()) };
    let needed = |v: Option<f64>, c: &str| v.with_context(|| format!("rank 0 has no {c}"));
    // Ranks that pass the same samples count them once (a pipeline's stages, a tensor group).
    // Only pipelines fill `bubble` (traces from before it have no such column).
    let pipeline = df.column("bubble").is_ok_and(|c| c.null_count() < c.len());
    let mesh = measured::mesh(plan, m.world_size);
    let rate = |c: &str| -> anyhow::Result<Option<f64>> {
        Ok(measured::per_rank(&final_rows, c)?.map(|r| measured::throughput(&r, pipeline, mesh)))
    };
    let sent = |i: usize| measured::most_on_a_rank(&final_rows, &[measured::SENT[i].0]);
    let last = Final {
        epoch: last_epoch,
        train_loss: needed(first(&final_rank0, "global_train_loss")?, "global_train_loss")?,
        train_acc: needed(first(&final_rank0, "global_train_acc")?, "global_train_acc")?,
        val_loss: first(&final_rank0, "val_loss")?,
        val_acc: first(&final_rank0, "val_acc")?,
        val_f1: if df.column("val_f1").is_ok() { first(&final_rank0, "val_f1")? } else { None },
        epoch_s: final_rows.column("epoch_s")?.f64()?.max().context("no epoch_s")?,
        samples_per_s: rate("samples_per_s")?.context("no samples_per_s")?,
        state_bytes: measured::most_on_a_rank(&final_rows, &["param_bytes", "grad_bytes", "optim_bytes"])?,
        // A peak so far: the final row's is the run's.
        peak_rss_bytes: measured::most_on_a_rank(&final_rows, &["peak_rss_bytes"])?,
        tokens_per_s: rate("tokens_per_s")?,
        estimate_bytes: measured::estimate(plan),
        sent_bytes: [sent(0)?, sent(1)?, sent(2)?],
    };
    Ok(PointResult {
        dir,
        group,
        world_size: m.world_size,
        threads_per_rank: m.threads_per_rank,
        cores: m.cores,
        loss_curve: f64s(&rank0, "global_train_loss")?.into_iter().flatten().collect(),
        val_acc_curve: f64s(&rank0, "val_acc")?,
        last,
        failures: m.goodput.as_ref().map(|g| {
            let n = m.restarts.len();
            format!("{n} restart{}; {}", if n == 1 { "" } else { "s" }, g.line(m.failures.len()))
        }),
    })
}

/// One row of the table: a world size (and values of the other non-seed axes) across seeds.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub group: Vec<(String, String)>,
    pub world_size: usize,
    pub seeds: usize,
    pub final_epoch: u32,
    pub train_loss: Spread,
    pub train_acc: Spread,
    pub val_loss: Option<Spread>,
    pub val_acc: Option<Spread>,
    /// Classification: validation macro-F1; absent when no point's trace has it.
    pub val_f1: Option<Spread>,
    pub epoch_s: Spread,
    pub samples_per_s: Spread,
    /// Mean samples/s ÷ that of the smallest world size with the same other axis values.
    pub speedup: f64,
    /// Speedup ÷ (world size ÷ that smallest world size).
    pub efficiency: f64,
    /// Per-rank memory ([`Final::state_bytes`], [`Final::peak_rss_bytes`]) across the seeds
    /// whose traces have it; absent when none has.
    pub state_bytes: Option<Spread>,
    pub peak_rss_bytes: Option<Spread>,
    pub tokens_per_s: Option<Spread>,
    pub estimate_bytes: Option<Spread>,
    pub sent_bytes: [Option<Spread>; 3],
    pub threads_per_rank: usize,
    pub cores: usize,
    /// Mean across seeds, per epoch.
    pub loss_curve: Vec<f64>,
    pub val_acc_curve: Vec<Option<f64>>,
}

impl Row {
    /// More threads than cores: the timings measure contention, not scaling.
    pub fn oversubscribed(&self) -> bool {
        self.world_size * self.threads_per_rank > self.cores
    }
}

/// Groups points into rows (in the order groups first appear, world sizes ascending).
pub fn rows(points: &[PointResult]) -> Vec<Row> {
    let mut groups: Vec<&[(String, String)]> = Vec::new();
    for p in points {
        if !groups.contains(&p.group.as_slice()) {
            groups.push(&p.group);
        }
    }
    let mut keys = Vec::new();
    for group in groups {
        let mut worlds: Vec<usize> = points.iter().filter(|p| p.group == group).map(|p| p.world_size).collect();
        worlds.sort_unstable();
        worlds.dedup();
        keys.extend(worlds.into_iter().map(|w| (group, w)));
    }
    let mut rows: Vec<Row> = keys
        .iter()
        .map(|(group, world)| {
            let same: Vec<&PointResult> =
                points.iter().filter(|p| p.group == *group && p.world_size == *world).collect();
            row(group, *world, &same)
        })
        .collect();
    for i in 0..rows.len() {
        let base = rows
            .iter()
            .filter(|r| r.group == rows[i].group)
            .min_by_key(|r| r.world_size)
            .map(|r| (r.samples_per_s.mean, r.world_size))
            .expect("the row itself");
        let r = &mut rows[i];
        r.speedup = stats::speedup(r.samples_per_s.mean, base.0);
        r.efficiency = stats::efficiency(r.speedup, r.world_size, base.1);
    }
    rows
}

fn row(group: &[(String, String)], world_size: usize, points: &[&PointResult]) -> Row {
    let spread = |f: fn(&Final) -> f64| {
        let v: Vec<f64> = points.iter().map(|p| f(&p.last)).collect();
        Spread::of(&v).expect("a row has points")
    };
    let optional = |f: fn(&Final) -> Option<f64>| {
        let v: Vec<f64> = points.iter().filter_map(|p| f(&p.last)).collect();
        Spread::of(&v)
    };
    let epochs = points.iter().map(|p| p.loss_curve.len()).max().unwrap_or(0);
    let per_epoch = |f: &dyn Fn(&PointResult, usize) -> Option<f64>| -> Vec<Option<f64>> {
        (0..epochs)
            .map(|e| {
                let v: Vec<f64> = points.iter().filter_map(|p| f(p, e)).collect();
                (!v.is_empty()).then(|| stats::mean(&v))
            })
            .collect()
    };
    Row {
        group: group.to_vec(),
        world_size,
        seeds: points.len(),
        final_epoch: points.iter().map(|p| p.last.epoch).max().unwrap_or(0),
        train_loss: spread(|f| f.train_loss),
        train_acc: spread(|f| f.train_acc),
        val_loss: optional(|f| f.val_loss),
        val_acc: optional(|f| f.val_acc),
        val_f1: optional(|f| f.val_f1),
        epoch_s: spread(|f| f.epoch_s),
        samples_per_s: spread(|f| f.samples_per_s),
        speedup: f64::NAN,
        efficiency: f64::NAN,
        state_bytes: optional(|f| f.state_bytes),
        peak_rss_bytes: optional(|f| f.peak_rss_bytes),
        tokens_per_s: optional(|f| f.tokens_per_s),
        estimate_bytes: optional(|f| f.estimate_bytes),
        sent_bytes: [optional(|f| f.sent_bytes[0]), optional(|f| f.sent_bytes[1]), optional(|f| f.sent_bytes[2])],
        threads_per_rank: points.iter().map(|p| p.threads_per_rank).max().unwrap_or(1),
        cores: points.iter().map(|p| p.cores).min().unwrap_or(1),
        loss_curve: per_epoch(&|p, e| p.loss_curve.get(e).copied()).into_iter().flatten().collect(),
        val_acc_curve: per_epoch(&|p, e| p.val_acc_curve.get(e).copied().flatten()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(world: usize, seed_loss: f64, samples_per_s: f64, lr: &str) -> PointResult {
        PointResult {
            dir: format!("w{world}"),
            group: vec![("train.lr".into(), lr.into())],
            world_size: world,
            threads_per_rank: if world == 1 { 2 } else { 1 },
            cores: 2,
            loss_curve: vec![1.0, seed_loss],
            val_acc_curve: vec![None, Some(0.8)],
            last: Final {
                epoch: 2,
                train_loss: seed_loss,
                train_acc: 0.9,
                val_loss: Some(0.4),
                val_acc: Some(0.8),
                val_f1: None,
                epoch_s: 1.0,
                samples_per_s,
                state_bytes: Some(1000.0 / world as f64),
                peak_rss_bytes: None,
                tokens_per_s: None,
                estimate_bytes: None,
                sent_bytes: [None; 3],
            },
            failures: None,
        }
    }

    #[test]
    fn the_table_names_the_points_that_survived_failures_and_what_they_cost() {
        let index = Index { experiment: "e.toml".into(), axes: vec![], points: vec![], numerics: None, search: None };
        let cost = "2 restarts; goodput 93.1% of 41.2 s: 2 failures cost 2.8 s (detection 0.3 s, restarts 2.1 s, 12 \
                    steps computed twice 0.4 s)";
        let points = vec![
            point(1, 0.3, 1000.0, "0.1"),
            PointResult { failures: Some(cost.into()), ..point(2, 0.3, 1900.0, "0.1") },
        ];
        let loaded = Loaded { points, missing: vec![] };
        let md = super::super::table::markdown(&index, &loaded, &rows(&loaded.points));
        assert!(
            md.contains(&format!(
                "Failures the runs survived (their results are those of uninterrupted runs):\n- `w2`: {cost}\n"
            )),
            "{md}"
        );
        assert!(!md.contains("`w1`: "), "{md}");
    }

    #[test]
    fn rows_take_the_spread_across_seeds_and_scale_against_the_smallest_world() {
        let points = [
            point(1, 0.30, 1000.0, "0.1"),
            point(1, 0.34, 1200.0, "0.1"),
            point(2, 0.31, 1900.0, "0.1"),
            point(2, 0.33, 2500.0, "0.1"),
            point(4, 0.32, 2200.0, "0.1"),
            point(4, 0.32, 2200.0, "0.2"),
        ];
        let rows = rows(&points);
        let summary: Vec<(&str, usize, usize)> =
            rows.iter().map(|r| (r.group[0].1.as_str(), r.world_size, r.seeds)).collect();
        assert_eq!(summary, [("0.1", 1, 2), ("0.1", 2, 2), ("0.1", 4, 1), ("0.2", 4, 1)]);
        // World size 1: loss 0.30, 0.34 → mean 0.32, std sqrt((0.02² + 0.02²) / 1) = 0.028284...
        let r1 = &rows[0];
        assert!((r1.train_loss.mean - 0.32).abs() < 1e-12);
        assert!((r1.train_loss.std.unwrap() - 0.02 * 2f64.sqrt()).abs() < 1e-12);
        // samples/s 1100 at world size 1, 2200 at 2: speedup 2, efficiency 1.
        assert!((rows[1].speedup - 2.0).abs() < 1e-12);
        assert!((rows[1].efficiency - 1.0).abs() < 1e-12);
        // 2200 at 4: speedup 2, efficiency 0.5; one seed, no std.
        assert!((rows[2].speedup - 2.0).abs() < 1e-12);
        assert!((rows[2].efficiency - 0.5).abs() < 1e-12);
        assert_eq!(rows[2].train_loss.std, None);
        // A group of its own is its own baseline.
        assert_eq!((rows[3].speedup, rows[3].efficiency), (1.0, 1.0));
        // 1 × 2 threads on 2 cores is fine; 4 × 1 is not.
        assert!(!rows[0].oversubscribed() && !rows[1].oversubscribed());
        assert!(rows[2].oversubscribed());
        assert_eq!(r1.loss_curve.len(), 2);
        assert!((r1.loss_curve[1] - 0.32).abs() < 1e-12);
        assert_eq!(r1.val_acc_curve, [None, Some(0.8)]);
    }

    #[test]
    fn a_rows_memory_spreads_over_the_seeds_that_have_it() {
        let mut points = [point(2, 0.3, 100.0, "0.1"), point(2, 0.3, 100.0, "0.1"), point(4, 0.3, 100.0, "0.1")];
        points[0].last.peak_rss_bytes = Some(300.0);
        points[1].last.peak_rss_bytes = Some(500.0);
        // Traces from before the memory columns.
        points[1].last.state_bytes = None;
        points[2].last.state_bytes = None;
        let rows = rows(&points);
        assert_eq!(rows[0].state_bytes, Spread::of(&[500.0]));
        assert_eq!(rows[0].peak_rss_bytes, Spread::of(&[300.0, 500.0]));
        assert_eq!((rows[1].state_bytes, rows[1].peak_rss_bytes), (None, None));
    }
}
