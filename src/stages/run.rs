//! One rank's run: load, normalize, wrap (or resume from a checkpoint), then train interval by
//! interval, with checkpoints, early stopping and preemption between the steps, and the final
//! model at the end.
use std::path::Path;

use anyhow::Context;

use super::train::{Interval, Partial, Trainer};
use super::{checkpoint, checkpoint_due, interval_line, preempt, recipe, stop_metric, wrap, Tracker};
use crate::data;
use crate::dist::ProcessGroup;
use crate::plan::Plan;
use crate::rundir::position::Position;
use crate::trace::progress::Progress;
use crate::trace::{self, EpochRow, StepRow};

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
    let normalizer = super::fit_normalizer(plan, pg, &data, device)?;
    position.set("wrap", 0, 0);
    let groups = crate::strategy::MeshGroups::new(plan, pg)?;
    let (wrapped, resumed) = wrap_or_resume(plan, pg, &groups, device, run_dir, resume)?;
    let checkpoint::Resumed { rows, steps, done, mut partial } = resumed;
    accept()?;
    crate::preprocessing::write(plan, pg, &normalizer, run_dir)?;
    if rank == 0 {
        crate::checkpoint::writer::check_model_space(run_dir, super::model_file_bytes(plan, &wrapped))?;
    }
    let c = &plan.config;
    let epochs = c.train.steps.is_none().then_some(c.train.epochs);
    let len = if epochs.is_some() { plan.steps_per_epoch() } else { plan.total_steps() };
    let seq_len = plan.data.task.is_language_model().then(|| plan.data.input[0]);
    let progress = Progress::new(rank == 0, epochs, len, seq_len);
    let trainer = Trainer::new(plan, pg, device, &data, &normalizer, wrapped, progress, position);
    trainer.position.done(done);
    let mut run = Loop {
        plan,
        pg,
        device,
        run_dir,
        stopper: early_stopper(plan, &rows),
        tracker: Tracker::start(plan, run_dir, rank),
        agreement: preempt::Agreement::new(pg, device),
        background: checkpoint::Background::default(),
        trainer,
        rows,
        steps,
        done,
        preempted: None,
    };
    while run.done < run.trainer.clock.total {
        if run.interval(partial.take())? == Flow::Stop {
            break;
        }
    }
    run.finish()
}

/// The wrapped model: fresh, or as the run directory's newest checkpoint left it (`resume`), with
/// the rows, steps and position the checkpoint recorded.
fn wrap_or_resume<'pg>(
    plan: &Plan,
    pg: &'pg ProcessGroup,
    groups: &'pg crate::strategy::MeshGroups,
    device: tch::Device,
    run_dir: &Path,
    resume: bool,
) -> anyhow::Result<(wrap::Wrapped<'pg>, checkpoint::Resumed)> {
    let found =
        match resume {
            true => Some(crate::checkpoint::newest_unread(run_dir, plan).map_err(anyhow::Error::msg)?.with_context(
                || format!("{} holds no checkpoint to resume from", crate::checkpoint::dir(run_dir).display()),
            )?),
            false => None,
        };
    let buckets = found.as_ref().and_then(|f| checkpoint::buckets(f, plan));
    let mut wrapped = wrap::wrap(plan, pg, groups, device, buckets)?;
    let resumed = match &found {
        Some(found) => checkpoint::resume(found, plan, pg.rank(), &mut wrapped)?,
        None => checkpoint::Resumed { rows: Vec::new(), steps: Vec::new(), done: 0, partial: None },
    };
    checkpoint::test_hooks(plan, pg.rank(), &wrapped)?;
    Ok((wrapped, resumed))
}

/// Early stopping's state is a function of the validations so far: a resumed run replays them.
fn early_stopper(plan: &Plan, rows: &[EpochRow]) -> Option<recipe::EarlyStopper> {
    let mut stopper = plan.config.train.early_stop.as_ref().map(recipe::EarlyStopper::new)?;
    for r in rows.iter().filter(|r| r.rank == 0) {
        if let Some(v) = stop_metric(&stopper, r) {
            stopper.observe(r.epoch as usize, v);
        }
    }
    Some(stopper)
}

#[derive(PartialEq)]
enum Flow {
    Go,
    Stop,
}

/// The training loop's state between steps.
struct Loop<'a, 'pg> {
    plan: &'a Plan,
    pg: &'pg ProcessGroup,
    device: tch::Device,
    run_dir: &'a Path,
    trainer: Trainer<'a, 'pg>,
    tracker: Tracker,
    stopper: Option<recipe::EarlyStopper>,
    agreement: preempt::Agreement<'pg>,
    background: checkpoint::Background,
    rows: Vec<EpochRow>,
    steps: Vec<StepRow>,
    /// Optimizer steps done.
    done: usize,
    /// The signal (or a joining node) that stops every rank at the next checkpoint.
    preempted: Option<&'static str>,
}

impl Loop<'_, '_> {
    /// Trains the interval that starts at `self.done`, checkpointing inside it where due; a
    /// preemption ends it with [`preempt::Preempted`] once its checkpoint is written.
    fn interval(&mut self, partial: Option<Partial>) -> anyhow::Result<Flow> {
        let interval = self.trainer.clock.interval_of(self.done);
        let mut iv = self.trainer.begin(interval.clone(), self.done, partial);
        while self.done < interval.end {
            crate::dist::memory::phase();
            self.trainer.train(&mut iv, self.done..self.done + 1)?;
            self.done += 1;
            self.trainer.position.done(self.done);
            self.preempted = self.agreement.after_step(self.done)?;
            if self.tracker.wants_step(self.done) {
                self.tracker.step(self.done, iv.last_step(self.trainer.wrapped.optimizer.lr()));
            }
            let due = checkpoint_due(self.plan, &self.trainer.clock, self.done);
            if self.done < interval.end && (self.preempted.is_some() || due) {
                // A preemption's checkpoint is complete before the rank stops.
                self.checkpoint(Some(iv.partial()))?;
                self.stop_if_preempted()?;
            }
        }
        self.end_interval(iv)
    }

    /// The interval's rows into the traces (rank 0), the best model, the checkpoint due, and
    /// early stopping's verdict.
    fn end_interval(&mut self, iv: Interval) -> anyhow::Result<Flow> {
        checkpoint::memory_counters(self.pg.rank(), "interval")?;
        crate::dist::memory::phase();
        let out = self.trainer.finish(iv)?;
        let (plan, run_dir, done, total) = (self.plan, self.run_dir, self.done, self.trainer.clock.total);
        let epoch = self.trainer.clock.epoch(done - 1);
        // Every rank holds every rank's rows: they all reach the same verdict.
        let verdict = self.stopper.as_mut().and_then(|s| Some(s.observe(epoch, stop_metric(s, &out.rows[0])?)));
        if self.pg.rank() == 0 {
            self.trainer.progress.end_epoch(&interval_line(plan, &self.trainer.clock, done, &out.rows), true);
            self.tracker.row(&out.rows[0]);
            self.rows.extend(out.rows);
            self.steps.extend(out.steps);
            let (rows, steps) = (&self.rows, &self.steps);
            trace::write_parquet(&run_dir.join(crate::rundir::TRACE), &mut trace::epochs_frame(&plan.run_id, rows)?)?;
            trace::write_parquet(&run_dir.join(crate::rundir::STEPS), &mut trace::steps_frame(&plan.run_id, steps)?)?;
        }
        if verdict == Some(recipe::Verdict::Improved) {
            self.trainer.position.set("write best model", epoch, 0);
            let w = &self.trainer.wrapped;
            checkpoint::write_model(plan, self.pg, &w.strategy, &w.vs, run_dir, crate::rundir::BEST_MODEL, done)?;
        }
        if checkpoint_due(plan, &self.trainer.clock, done) || (self.preempted.is_some() && done < total) {
            self.checkpoint(None)?;
        }
        if verdict == Some(recipe::Verdict::Stop) {
            if self.pg.rank() == 0 {
                let why = self.stopper.as_ref().expect("a verdict").reason(epoch);
                crate::say!("  {why}");
                crate::rundir::atomic_write(&run_dir.join(crate::rundir::STOPPED), why.as_bytes())?;
            }
            return Ok(Flow::Stop);
        }
        if done < total {
            self.stop_if_preempted()?;
        }
        Ok(Flow::Go)
    }

    /// A checkpoint at `self.done` (`partial`: this rank's buffers of an unfinished interval).
    /// Asynchronous as configured, unless every rank stops after it: a node waiting to join the
    /// run stops them too.
    fn checkpoint(&mut self, partial: Option<Partial>) -> anyhow::Result<()> {
        let done = self.done;
        if self.preempted.is_none() && done < self.trainer.clock.total && preempt::rejoin_wanted(self.pg, self.device)?
        {
            self.preempted = Some(preempt::REJOINING);
        }
        if partial.is_some() {
            // Inside an interval: the check of the variables that finishing an interval makes.
            self.trainer.check_variables(done)?;
        }
        let asynchronous = self.plan.config.checkpoint.asynchronous && self.preempted.is_none();
        let (plan, pg, run_dir, b) = (self.plan, self.pg, self.run_dir, &mut self.background);
        checkpoint::save(&self.trainer, plan, pg, run_dir, done, &self.rows, &self.steps, partial, b, asynchronous)
    }

    /// Stops this rank ([`preempt::Preempted`]) once a preemption's checkpoint is written.
    fn stop_if_preempted(&mut self) -> anyhow::Result<()> {
        match self.preempted {
            Some(signal) => {
                self.trainer.progress.finish();
                Err(preempt::Preempted { step: self.done, signal }.into())
            }
            None => Ok(()),
        }
    }

    /// The final model, once any checkpoint still being written is complete.
    fn finish(mut self) -> anyhow::Result<Vec<EpochRow>> {
        self.trainer.progress.finish();
        self.trainer.position.set("write model", self.trainer.clock.epoch(self.done.max(1) - 1), 0);
        self.background.wait()?;
        let w = &self.trainer.wrapped;
        let (plan, pg, run_dir) = (self.plan, self.pg, self.run_dir);
        checkpoint::write_model(plan, pg, &w.strategy, &w.vs, run_dir, crate::rundir::MODEL, self.done)?;
        self.tracker.finish(run_dir);
        Ok(self.rows)
    }
}
