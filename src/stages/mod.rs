//! The five stages a rank runs: load → shard → normalize → wrap → train/validate. Each stage
//! receives what the previous one produced and the part of the plan it owns.
pub mod checkpoint;
pub mod recipe;
pub mod train;
pub mod wrap;

use std::path::Path;

use crate::config::schema::NormalizeScope;
use crate::data::{self, normalize, shard};
use crate::dist::ProcessGroup;
use crate::plan::Plan;
use crate::rundir::position::Position;
use crate::trace::progress::Progress;
use crate::trace::{self, EpochRow};
use anyhow::Context;

/// Runs the pipeline as `pg.rank()`. Rank 0 writes the traces after every epoch (atomically, so
/// they always hold every finished epoch), and the final model at the end; it returns every
/// rank's rows.
/// With `resume`, continues from the run directory's newest checkpoint.
/// `device`: where this rank keeps its model, data and batches ([`Plan::device`]).
pub fn run(
    plan: &Plan,
    pg: &ProcessGroup,
    device: tch::Device,
    run_dir: &Path,
    resume: bool,
) -> anyhow::Result<Vec<EpochRow>> {
    let c = &plan.config;
    let rank = pg.rank();
    tch::set_num_threads(plan.threads_per_rank as i32);
    let position = Position::new(run_dir, rank);

    position.set("load", 0, 0);
    let data = data::load(&plan.data, c.run.seed).map_err(anyhow::Error::msg)?.to_device(device);
    let first = shard::RankShard::take(
        &plan.layout,
        &shard::permutation(c.run.seed, 1, plan.layout.rows, c.shard.shuffle),
        plan.replica(rank),
    );
    position.set("normalize", 0, 0);
    // The ranks of a single pipeline all hold the whole training set: their own statistics are
    // the global ones.
    let scope =
        if plan.is_pipeline() && plan.layout.world_size == 1 { NormalizeScope::Rank } else { c.normalize.scope };
    let normalizer = normalize::Normalizer::fit(
        c.normalize.method,
        scope,
        &data.train_x.index_select(0, &first.index_tensor().to_device(device)),
        &first.weight_tensor().to_device(device),
        pg,
    )?;
    crate::predict::save(plan, pg, &normalizer, run_dir)?;
    position.set("wrap", 0, 0);
    let found = if resume {
        let found = checkpoint::latest(run_dir, plan)
            .map_err(anyhow::Error::msg)?
            .with_context(|| format!("{} holds no checkpoint to resume from", checkpoint::dir(run_dir).display()))?;
        Some(found)
    } else {
        None
    };
    let mut wrapped = wrap::wrap(plan, pg, device, found.as_ref().and_then(|f| f.meta.buckets.as_deref()))?;
    let (mut rows, mut steps, first_epoch) = match found {
        Some(found) => {
            checkpoint::load(&found, rank, &wrapped.vs, &mut wrapped.optimizer)?;
            (found.meta.rows, found.meta.steps, found.meta.epoch + 1)
        }
        None => (Vec::new(), Vec::new(), 1),
    };
    let progress = Progress::new(rank == 0, c.train.epochs, plan.steps_per_epoch());
    // DDP's Reducer counts iterations from 1 in every process, resumed or not.
    let mut trainer = train::Trainer {
        plan,
        pg,
        device,
        data: &data,
        normalizer: &normalizer,
        wrapped,
        progress,
        position,
        iteration: 0,
    };

    // Early stopping's state is a function of the validations so far: a resumed run replays them.
    let mut stopper = c.train.early_stop.as_ref().map(recipe::EarlyStopper::new);
    if let Some(stopper) = stopper.as_mut() {
        for r in rows.iter().filter(|r| r.rank == 0) {
            if let Some(v) = stop_metric(stopper, r) {
                stopper.observe(r.epoch as usize, v);
            }
        }
    }
    let mut last_epoch = c.train.epochs;
    for epoch in first_epoch..=c.train.epochs {
        let out = trainer.epoch(epoch)?;
        // Every rank takes part: the bucket layout is read on each (it is the same on all).
        let checkpointing =
            c.checkpoint.every > 0 && (epoch.is_multiple_of(c.checkpoint.every) || epoch == c.train.epochs);
        let buckets = if checkpointing { trainer.wrapped.strategy.bucket_layout()? } else { None };
        // Every rank holds every rank's rows: they all reach the same verdict.
        let verdict = stopper.as_mut().and_then(|s| Some(s.observe(epoch, stop_metric(s, &out.rows[0])?)));
        if rank == 0 {
            let r0 = &out.rows[0];
            let val = match (r0.val_loss, r0.val_acc, r0.val_rmse) {
                (Some(l), Some(a), _) => {
                    let f1 = r0.val_f1.map(|f| format!("  val f1 {f:.4}")).unwrap_or_default();
                    format!("  val loss {l:.4}  val acc {a:.4}{f1}")
                }
                (Some(l), None, Some(rmse)) => {
                    format!("  val loss {l:.4}  val rmse {rmse:.4}  val r2 {:.4}", r0.val_r2.unwrap_or(f64::NAN))
                }
                _ => String::new(),
            };
            // Regression has no accuracy.
            let acc =
                if r0.global_train_acc.is_nan() { String::new() } else { format!("  acc {:.4}", r0.global_train_acc) };
            let bubbles: Vec<f64> = out.rows.iter().filter_map(|r| r.bubble).collect();
            let bubble = match bubbles.len() {
                0 => String::new(),
                n => format!("  bubble {:.0}%", 100.0 * bubbles.iter().sum::<f64>() / n as f64),
            };
            let lm = match r0.tokens_per_s {
                Some(tokens) => format!(
                    "  ppl {:.2}{}  {tokens:.0} tokens/s per rank",
                    r0.global_train_loss.exp(),
                    r0.val_perplexity.map(|p| format!("  val ppl {p:.2}")).unwrap_or_default()
                ),
                None => String::new(),
            };
            trainer.progress.end_epoch(
                &format!(
                    "epoch {epoch}/{}  loss {:.4}{acc}{val}  {:.2}s  {:.0} samples/s per rank{bubble}{lm}",
                    c.train.epochs, r0.global_train_loss, r0.epoch_s, r0.samples_per_s
                ),
                true,
            );
            rows.extend(out.rows);
            steps.extend(out.steps);
            let ws = plan.world_size() as u32;
            trace::write_parquet(
                &run_dir.join(crate::rundir::TRACE),
                &mut trace::epochs_frame(&plan.run_id, ws, &rows)?,
            )?;
            trace::write_parquet(&run_dir.join(crate::rundir::STEPS), &mut trace::steps_frame(&plan.run_id, &steps)?)?;
        }
        if verdict == Some(recipe::Verdict::Improved) {
            trainer.position.set("write best model", epoch, 0);
            let w = &trainer.wrapped;
            checkpoint::write_model(plan, pg, &w.strategy, &w.vs, run_dir, crate::rundir::BEST_MODEL)?;
        }
        if checkpointing {
            trainer.position.set("checkpoint", epoch, 0);
            let w = &trainer.wrapped;
            let snapshot = checkpoint::Snapshot {
                epoch,
                world_size: plan.world_size(),
                vs: &w.vs,
                optimizer: &w.optimizer,
                rows: &rows,
                steps: &steps,
                buckets,
            };
            checkpoint::save(run_dir, plan, pg, &snapshot, c.checkpoint.keep)?;
        }
        if verdict == Some(recipe::Verdict::Stop) {
            last_epoch = epoch;
            if rank == 0 {
                let why = stopper.as_ref().expect("a verdict").reason(epoch);
                crate::say!("  {why}");
                crate::rundir::atomic_write(&run_dir.join(crate::rundir::STOPPED), why.as_bytes())?;
            }
            break;
        }
    }
    trainer.progress.finish();
    trainer.position.set("write model", last_epoch, 0);
    let w = &trainer.wrapped;
    checkpoint::write_model(plan, pg, &w.strategy, &w.vs, run_dir, crate::rundir::MODEL)?;
    Ok(rows)
}

/// The early-stopping metric of a trace row (rank 0's), where the epoch validated.
fn stop_metric(stopper: &recipe::EarlyStopper, row: &EpochRow) -> Option<f64> {
    match stopper.rule.metric {
        crate::config::schema::StopMetric::ValLoss => row.val_loss,
        crate::config::schema::StopMetric::ValAcc => row.val_acc,
    }
}
