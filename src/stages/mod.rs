//! The five stages a rank runs: load → shard → normalize → wrap → train/validate. Each stage
//! receives what the previous one produced and the part of the plan it owns.
pub mod checkpoint;
mod clock;
pub mod mfu;
pub mod preempt;
pub mod recipe;
mod rows;
pub mod track;
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
use track::Tracker;

/// Runs the pipeline as `pg.rank()`. Rank 0 writes the traces after every interval (atomically,
/// so they always hold every finished one), and the final model at the end; it returns every
/// rank's rows. With `resume`, continues from the run directory's newest checkpoint, at any step.
/// `device`: where this rank keeps its model, data and batches ([`Plan::device`]). `accept`: called
/// by every rank once the plan and the checkpoint are loaded, before anything is written into
/// the run directory (a resume commits its plan there).
pub fn run(
    plan: &Plan,
    pg: &ProcessGroup,
    device: tch::Device,
    run_dir: &Path,
    resume: bool,
    accept: &dyn Fn() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<EpochRow>> {
    let c = &plan.config;
    let rank = pg.rank();
    // With thread replicas this thread is the first replica's: it computes on its share of the
    // threads, the optimizer and validation too (a team of all the rank's threads here would spin
    // on the cores the other replicas compute on).
    tch::set_num_threads(plan.threads_per_replica() as i32);
    crate::dist::memory::install()?;
    let position = Position::new(run_dir, rank);

    position.set("load", 0, 0);
    let data = data::load(&plan.data).map_err(anyhow::Error::msg)?.to_device(device);
    position.set("normalize", 0, 0);
    let normalizer = fit_normalizer(plan, pg, &data, device)?;
    position.set("wrap", 0, 0);
    let found = if resume {
        let found =
            crate::checkpoint::newest_unread(run_dir, plan).map_err(anyhow::Error::msg)?.with_context(|| {
                format!("{} holds no checkpoint to resume from", crate::checkpoint::dir(run_dir).display())
            })?;
        Some(found)
    } else {
        None
    };
    let groups = crate::strategy::MeshGroups::new(plan, pg)?;
    let mut wrapped = wrap::wrap(plan, pg, &groups, device, found.as_ref().and_then(|f| checkpoint::buckets(f, plan)))?;
    let resumed = match &found {
        Some(found) => checkpoint::resume(found, plan, rank, &mut wrapped)?,
        None => checkpoint::Resumed { rows: Vec::new(), steps: Vec::new(), done: 0, partial: None },
    };
    checkpoint::test_hooks(plan, rank, &wrapped)?;
    let checkpoint::Resumed { mut rows, mut steps, mut done, mut partial } = resumed;
    accept()?;
    crate::preprocessing::write(plan, pg, &normalizer, run_dir)?;
    if rank == 0 {
        crate::checkpoint::writer::check_model_space(run_dir, model_file_bytes(plan, &wrapped))?;
    }
    let epochs = c.train.steps.is_none().then_some(c.train.epochs);
    let len = if epochs.is_some() { plan.steps_per_epoch() } else { plan.total_steps() };
    let seq_len = plan.data.task.is_language_model().then(|| plan.data.input[0]);
    let progress = Progress::new(rank == 0, epochs, len, seq_len);
    let mut tracker = Tracker::start(plan, run_dir, rank);
    let mut trainer = train::Trainer::new(plan, pg, device, &data, &normalizer, wrapped, progress, position);
    let clock = trainer.clock.clone();
    trainer.position.done(done);

    // Early stopping's state is a function of the validations so far: a resumed run replays them.
    let mut stopper = c.train.early_stop.as_ref().map(recipe::EarlyStopper::new);
    if let Some(stopper) = stopper.as_mut() {
        for r in rows.iter().filter(|r| r.rank == 0) {
            if let Some(v) = stop_metric(stopper, r) {
                stopper.observe(r.epoch as usize, v);
            }
        }
    }
    let mut preempted = None;
    let mut agreement = preempt::Agreement::new(pg, device);
    let mut background = checkpoint::Background::default();
    while done < clock.total {
        let interval = clock.interval_of(done);
        let mut iv = trainer.begin(interval.clone(), done, partial.take());
        while done < interval.end {
            crate::dist::memory::phase();
            trainer.train(&mut iv, done..done + 1)?;
            done += 1;
            trainer.position.done(done);
            preempted = agreement.after_step(done)?;
            if tracker.wants_step(done) {
                tracker.step(done, iv.last_step(trainer.wrapped.optimizer.lr()));
            }
            if done < interval.end && (preempted.is_some() || checkpoint_due(plan, &clock, done)) {
                if preempted.is_none() && preempt::rejoin_wanted(pg, device)? {
                    preempted = Some(preempt::REJOINING);
                }
                trainer.check_variables(done)?;
                // A preemption's checkpoint is complete before the rank stops.
                let asynchronous = c.checkpoint.asynchronous && preempted.is_none();
                let partial = Some(iv.partial());
                let b = &mut background;
                checkpoint::save(&trainer, plan, pg, run_dir, done, &rows, &steps, partial, b, asynchronous)?;
                if let Some(signal) = preempted {
                    trainer.progress.finish();
                    return Err(preempt::Preempted { step: done, signal }.into());
                }
            }
        }
        checkpoint::memory_counters(rank, "interval")?;
        crate::dist::memory::phase();
        let out = trainer.finish(iv)?;
        let epoch = clock.epoch(done - 1);
        // Every rank holds every rank's rows: they all reach the same verdict.
        let verdict = stopper.as_mut().and_then(|s| Some(s.observe(epoch, stop_metric(s, &out.rows[0])?)));
        if rank == 0 {
            trainer.progress.end_epoch(&interval_line(plan, &clock, done, &out.rows), true);
            tracker.row(&out.rows[0]);
            rows.extend(out.rows);
            steps.extend(out.steps);
            trace::write_parquet(&run_dir.join(crate::rundir::TRACE), &mut trace::epochs_frame(&plan.run_id, &rows)?)?;
            trace::write_parquet(&run_dir.join(crate::rundir::STEPS), &mut trace::steps_frame(&plan.run_id, &steps)?)?;
        }
        if verdict == Some(recipe::Verdict::Improved) {
            trainer.position.set("write best model", epoch, 0);
            let w = &trainer.wrapped;
            checkpoint::write_model(plan, pg, &w.strategy, &w.vs, run_dir, crate::rundir::BEST_MODEL, done)?;
        }
        if checkpoint_due(plan, &clock, done) || (preempted.is_some() && done < clock.total) {
            if preempted.is_none() && done < clock.total && preempt::rejoin_wanted(pg, device)? {
                preempted = Some(preempt::REJOINING);
            }
            let asynchronous = c.checkpoint.asynchronous && preempted.is_none();
            let b = &mut background;
            checkpoint::save(&trainer, plan, pg, run_dir, done, &rows, &steps, None, b, asynchronous)?;
        }
        if verdict == Some(recipe::Verdict::Stop) {
            if rank == 0 {
                let why = stopper.as_ref().expect("a verdict").reason(epoch);
                crate::say!("  {why}");
                crate::rundir::atomic_write(&run_dir.join(crate::rundir::STOPPED), why.as_bytes())?;
            }
            break;
        }
        if let Some(signal) = preempted.filter(|_| done < clock.total) {
            trainer.progress.finish();
            return Err(preempt::Preempted { step: done, signal }.into());
        }
    }
    trainer.progress.finish();
    trainer.position.set("write model", clock.epoch(done.max(1) - 1), 0);
    background.wait()?;
    let w = &trainer.wrapped;
    checkpoint::write_model(plan, pg, &w.strategy, &w.vs, run_dir, crate::rundir::MODEL, done)?;
    tracker.finish(run_dir);
    Ok(rows)
}

/// About the bytes of the model file written at the run's end (its tensors, and room for its
/// header).
fn model_file_bytes(plan: &Plan, w: &wrap::Wrapped) -> u64 {
    let tensors = w.strategy.model_tensors(plan, &w.vs);
    let bytes =
        |t: &crate::strategy::ModelTensor| t.shape.iter().product::<i64>() as u64 * t.kind.elt_size_in_bytes() as u64;
    tensors.iter().map(bytes).sum::<u64>() + 64 * 1024
}

/// Fitted once, on the rank's first-epoch shard (training rows only); token ids are never scaled.
fn fit_normalizer(
    plan: &Plan,
    pg: &ProcessGroup,
    data: &data::Dataset,
    device: tch::Device,
) -> anyhow::Result<normalize::Normalizer> {
    let c = &plan.config;
    if c.normalize.method == crate::config::schema::NormalizeMethod::None {
        return Ok(normalize::Normalizer::identity());
    }
    let first = shard::RankShard::take(
        &plan.layout,
        &shard::permutation(c.run.seed, 1, plan.layout.rows, c.shard.shuffle),
        plan.replica(pg.rank()),
    );
    // The ranks of a single pipeline all hold the whole training set: their own statistics are
    // the global ones.
    let scope =
        if plan.is_pipeline() && plan.layout.world_size == 1 { NormalizeScope::Rank } else { c.normalize.scope };
    let (x, _) = data.train.gather(&first.indices)?;
    Ok(normalize::Normalizer::fit(
        c.normalize.method,
        scope,
        &x.to_device(device),
        &first.weight_tensor().to_device(device),
        pg,
    )?)
}

/// Whether a checkpoint is written after `done` optimizer steps: at the epochs `checkpoint.every`
/// names, every `checkpoint.every_steps` steps, and at the run's end when either is set.
fn checkpoint_due(plan: &Plan, clock: &train::Clock, done: usize) -> bool {
    let k = &plan.config.checkpoint;
    let last = done == clock.total;
    let by_epoch =
        k.every > 0 && plan.config.train.steps.is_none() && done.is_multiple_of(clock.steps_per_epoch.max(1)) && {
            let epoch = done / clock.steps_per_epoch.max(1);
            epoch.is_multiple_of(k.every) || last
        };
    let by_step = k.every_steps.is_some_and(|n| done.is_multiple_of(n) || last);
    by_epoch || by_step
}

/// Rank 0's line at the end of an interval.
fn interval_line(plan: &Plan, clock: &train::Clock, done: usize, rows: &[EpochRow]) -> String {
    let c = &plan.config;
    let r0 = &rows[0];
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
    let acc = if r0.global_train_acc.is_nan() { String::new() } else { format!("  acc {:.4}", r0.global_train_acc) };
    let bubbles: Vec<f64> = rows.iter().filter_map(|r| r.bubble).collect();
    let bubble = match bubbles.len() {
        0 => String::new(),
        n => format!("  bubble {:.0}%", 100.0 * bubbles.iter().sum::<f64>() / n as f64),
    };
    let lm = match r0.tokens_per_s {
        Some(tokens) => format!(
            "  ppl {:.2}{}  {tokens:.0} tokens/s per rank{}",
            r0.global_train_loss.exp(),
            r0.val_perplexity.map(|p| format!("  val ppl {p:.2}")).unwrap_or_default(),
            r0.mfu.map(|m| format!("  MFU {:.1}%", 100.0 * m)).unwrap_or_default()
        ),
        None => String::new(),
    };
    let at = match c.train.steps {
        Some(total) => format!("step {done}/{total}"),
        None => format!("epoch {}/{}", clock.epoch(done - 1), c.train.epochs),
    };
    format!(
        "{at}  loss {:.4}{acc}{val}  {:.2}s  {:.0} samples/s per rank{bubble}{lm}",
        r0.global_train_loss, r0.epoch_s, r0.samples_per_s
    )
}

/// The early-stopping metric of a trace row (rank 0's), where the epoch validated.
fn stop_metric(stopper: &recipe::EarlyStopper, row: &EpochRow) -> Option<f64> {
    match stopper.rule.metric {
        crate::config::schema::StopMetric::ValLoss => row.val_loss,
        crate::config::schema::StopMetric::ValAcc => row.val_acc,
    }
}
