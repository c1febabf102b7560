//! The loop's side of checkpoints, at any optimizer step: the record of where the run stands
//! (the step and the data position, the trace rows, every rank's buffers of an unfinished
//! interval, DDP's buckets) and the training state the strategy hands over as pieces, both given
//! to the one writer ([`crate::checkpoint`]); on resume, the same read back under any world size
//! and strategy that keeps the global batch. Sampler order, random windows and dropout seeds
//! derive from (seed, epoch, step, rank), so nothing else is needed for a resumed run to go on
//! where the first one stopped. At the end of a run, rank 0 also writes the trained model alone
//! (`model.safetensors`), assembled one tensor at a time.
use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use tch::{nn, Tensor};

use super::train::{Partial, Trainer};
use crate::checkpoint::background::{Copies, InFlight};
use crate::checkpoint::{Found, Piece, Reader, Record};
use crate::dist::ProcessGroup;
use crate::plan::Plan;
use crate::strategy::Strategy;
use crate::tensorfile::{self, Entry};
use crate::trace::{EpochRow, StepRow};

/// The checkpoint this rank is writing in the background, if one is in flight
/// (`checkpoint.async`).
#[derive(Default)]
pub struct Background(Option<InFlight>, Copies);

impl Background {
    /// Waits for the checkpoint in flight, if any: its failure is this rank's.
    pub fn wait(&mut self) -> anyhow::Result<()> {
        self.0.take().map_or(Ok(()), |f| f.wait(&mut self.1))
    }
}

/// Writes the checkpoint after `done` optimizer steps (every rank calls it), once the one in
/// flight in `background` is done; in the background itself when `asynchronous`. `partial`: this
/// rank's buffers of the interval in progress, when the checkpoint falls inside one.
#[allow(clippy::too_many_arguments)]
pub fn save(
    trainer: &Trainer,
    plan: &Plan,
    pg: &ProcessGroup,
    run_dir: &Path,
    done: usize,
    rows: &[EpochRow],
    steps: &[StepRow],
    partial: Option<Partial>,
    background: &mut Background,
    asynchronous: bool,
) -> anyhow::Result<()> {
    trainer.position.set("checkpoint", trainer.clock.epoch(done - 1), 0);
    background.wait()?;
    crate::dist::memory::phase();
    let clock = &trainer.clock;
    let epoch = clock.epoch(done - 1);
    // Every rank takes part: the bucket layout is read on each (it is the same on all).
    let buckets = trainer.wrapped.strategy.bucket_layout()?;
    let interval_s = partial.as_ref().map(|mine| mine.seconds);
    let partial = partial.map(|mine| gather_partials(pg, mine)).transpose()?;
    let position = if clock.random {
        format!("random windows, step {done}")
    } else {
        let into = clock.batches(done - 1).end;
        format!("epoch {epoch}, batch {into} of {}", clock.batches_per_epoch)
    };
    let record = Record {
        epoch,
        step: done,
        position,
        layout: plan.layout(),
        global_batch: plan.global_batch(),
        steps_per_epoch: plan.optimizer_steps_per_epoch(),
        parameters: crate::model::saved_parameters(plan.model().as_ref()),
        rows: rows.to_vec(),
        steps: steps.to_vec(),
        buckets,
        partial: partial.is_some(),
        interval_s,
    };
    let w = &trainer.wrapped;
    let mut pieces = w.strategy.state_pieces(plan, pg, &w.vs, &w.optimizer)?;
    // Every rank holds every rank's buffers: rank 0 writes them.
    for (r, p) in partial.iter().flatten().enumerate().filter(|_| pg.rank() == 0) {
        let name = |what: &str| format!("trace.partial.{r}.{what}");
        pieces.push(Piece::whole(name("losses"), &Tensor::from_slice(&p.losses)));
        pieces.push(Piece::whole(name("correct"), &Tensor::from_slice(&p.correct)));
        pieces.push(Piece::whole(name("weights"), &Tensor::from_slice(&p.weights)));
        pieces.push(Piece::whole(name("norms"), &Tensor::from_slice(&p.norms)));
    }
    let keep = plan.config.checkpoint.keep;
    if asynchronous {
        let copies = &mut background.1;
        background.0 = Some(crate::checkpoint::background::save(run_dir, plan, pg, pieces, copies, record, keep)?);
        Ok(())
    } else {
        crate::checkpoint::save(run_dir, plan, pg, pieces, record, keep)
    }
}

/// Every rank's buffers of the unfinished interval, gathered to every rank (rank 0 writes them).
/// After a resume under another layout, ranks may hold more rows than others: each sends its
/// counts first, and its values padded to the longest.
fn gather_partials(pg: &ProcessGroup, mine: Partial) -> anyhow::Result<Vec<Partial>> {
    let (rows, norms) = (mine.losses.len(), mine.norms.len());
    let counts = pg.all_gather(&Tensor::from_slice(&[rows as i64, norms as i64]))?;
    let counts: Vec<(usize, usize)> =
        counts.iter().map(|t| (t.int64_value(&[0]) as usize, t.int64_value(&[1]) as usize)).collect();
    let longest = counts.iter().map(|(r, n)| 3 * r + n).max().unwrap_or(0);
    let mut flat: Vec<f64> = [&mine.losses, &mine.correct, &mine.weights]
        .iter()
        .flat_map(|v| v.iter().map(|&x| x as f64))
        .chain(mine.norms.iter().copied())
        .collect();
    flat.resize(longest, 0.0);
    let all = pg.all_gather(&Tensor::from_slice(&flat))?;
    Ok(all
        .iter()
        .zip(counts)
        .map(|(t, (rows, norms))| {
            let v = Vec::<f64>::try_from(t).expect("float64 values");
            let part = |k: usize| v[k * rows..(k + 1) * rows].iter().map(|&x| x as f32).collect();
            Partial {
                losses: part(0),
                correct: part(1),
                weights: part(2),
                norms: v[3 * rows..3 * rows + norms].to_vec(),
                seconds: 0.0,
            }
        })
        .collect())
}

/// Where a resumed run goes on from.
pub struct Resumed {
    pub rows: Vec<EpochRow>,
    pub steps: Vec<StepRow>,
    /// Optimizer steps done.
    pub done: usize,
    /// This rank's buffers of the interval the checkpoint interrupted.
    pub partial: Option<Partial>,
}

/// The DDP bucket layout to rebuild the Reducer with: the checkpoint's, when it was written
/// under DDP at this world size (another layout buckets other parameters' gradients together).
pub fn buckets<'a>(found: &'a Found, plan: &Plan) -> Option<&'a [Vec<usize>]> {
    let r = found.record();
    (r.layout == plan.layout()).then_some(r.buckets.as_deref()).flatten()
}

/// Loads `found` into this rank's strategy, model and optimizer, and its record.
pub fn resume(found: &Found, plan: &Plan, rank: usize, wrapped: &mut super::wrap::Wrapped) -> anyhow::Result<Resumed> {
    let reader = Reader::new(found);
    wrapped.strategy.load_state(plan, &reader, &wrapped.vs, &mut wrapped.optimizer)?;
    let partial = partial_for(&reader, plan, rank)?;
    let r = reader.record();
    // An older runner's rows do not say their world size: the checkpoint's writers' is the best known.
    let mut rows = r.rows.clone();
    for row in rows.iter_mut().filter(|row| row.world_size == 0) {
        row.world_size = r.layout.world_size as u32;
    }
    Ok(Resumed { rows, steps: r.steps.clone(), done: r.step, partial })
}

/// Test hooks on what a run starts from, once its model is built or loaded (every rank calls it):
/// - with `RUNNER_TEST_DUMP_LOADED=DIR` in its environment, each rank writes what it starts
///   from (its variables and its optimizer's state, whole: under FSDP every rank's shards
///   gathered; and the step count, under their checkpoint names) to `DIR/rank-R.safetensors`,
///   so that a test can compare it with what was saved, or with another strategy's;
/// - with `RUNNER_TEST_READ_BYTES=DIR`, each rank writes to `DIR/rank-R` the bytes of tensor data
///   it has read (of `wrap.init`, of the checkpoint it resumed from), which a test holds to the
///   rank's share;
/// - with `RUNNER_TEST_MEMORY=DIR`, each rank writes to `DIR/rank-R` its tensor block cache's
///   counters ([`crate::dist::memory::stats`]) and its peak resident bytes so far: what building
///   the model left mapped, cached and in use; and to `DIR/rank-R.interval`, the same at the end
///   of each interval's steps, whose peaks say what the cache held beside the tensors in use
///   (docs/fsdp.md measures both).
pub fn test_hooks(plan: &Plan, rank: usize, wrapped: &super::wrap::Wrapped) -> anyhow::Result<()> {
    if let Ok(dir) = std::env::var("RUNNER_TEST_READ_BYTES") {
        std::fs::write(Path::new(&dir).join(format!("rank-{rank}")), tensorfile::data_read().to_string())?;
    }
    memory_counters(rank, "")?;
    if let Ok(dir) = std::env::var("RUNNER_TEST_DUMP_LOADED") {
        dump_loaded(Path::new(&dir), plan, rank, wrapped)?;
    }
    Ok(())
}

/// With `RUNNER_TEST_MEMORY=DIR`: the block cache's counters and the peak resident bytes so far,
/// to `DIR/rank-R` (`when` empty) or `DIR/rank-R.WHEN`.
pub fn memory_counters(rank: usize, when: &str) -> anyhow::Result<()> {
    if let Ok(dir) = std::env::var("RUNNER_TEST_MEMORY") {
        let (stats, peak) = (crate::dist::memory::stats()?, crate::dist::peak_resident_bytes());
        let name = if when.is_empty() { format!("rank-{rank}") } else { format!("rank-{rank}.{when}") };
        std::fs::write(Path::new(&dir).join(name), format!("{stats:?} peak_resident: {peak}\n"))?;
    }
    Ok(())
}

fn dump_loaded(dir: &Path, plan: &Plan, rank: usize, wrapped: &super::wrap::Wrapped) -> anyhow::Result<()> {
    let steps = Tensor::from(wrapped.optimizer.steps() as i64);
    let loaded = wrapped.strategy.loaded(plan, &wrapped.vs, &wrapped.optimizer)?;
    let mut entries: Vec<Entry> = loaded.iter().map(|(n, t)| Entry::of(n.clone(), t)).collect();
    entries.push(Entry::of(crate::model::optim::STEPS.to_owned(), &steps));
    tensorfile::write(&dir.join(format!("rank-{rank}.safetensors")), None, entries)
}

/// `rank`'s buffers of the interval a checkpoint interrupted (`None` at an interval's end): its
/// own under the layout that wrote them. Under another layout the samples trained so far are
/// folded onto the new copies of the model: old copy k's (measured on its last rank) go to new
/// copy k mod copies, so the interval's global metrics count every sample once; its per-rank
/// rows count them on the ranks they were folded onto.
fn partial_for(reader: &Reader, plan: &Plan, rank: usize) -> anyhow::Result<Option<Partial>> {
    let r = reader.record();
    if !r.partial {
        return Ok(None);
    }
    let floats = |name: String| -> anyhow::Result<Vec<f64>> {
        let t = reader.whole(&name)?.to_kind(tch::Kind::Double);
        Vec::<f64>::try_from(&t).with_context(|| format!("the checkpoint's `{name}` is damaged"))
    };
    let load = |k: usize| -> anyhow::Result<Partial> {
        let f32s = |what: &str| -> anyhow::Result<Vec<f32>> {
            Ok(floats(format!("trace.partial.{k}.{what}"))?.into_iter().map(|x| x as f32).collect())
        };
        Ok(Partial {
            losses: f32s("losses")?,
            correct: f32s("correct")?,
            weights: f32s("weights")?,
            norms: floats(format!("trace.partial.{k}.norms"))?,
            // Rank 0's time so far (a checkpoint of an older runner does not say: 0).
            seconds: r.interval_s.unwrap_or(0.0),
        })
    };
    let old = r.layout;
    if old == plan.layout() {
        return load(rank).map(Some);
    }
    let per_copy = old.ranks_per_copy.max(1);
    let (old_copies, new_copies) = (old.world_size / per_copy, plan.layout.world_size);
    let first = load(0)?;
    let mut folded = Partial { norms: first.norms, seconds: first.seconds, ..Partial::default() };
    for k in (plan.replica(rank)..old_copies).step_by(new_copies) {
        let p = load(k * per_copy + per_copy - 1)?;
        folded.losses.extend(p.losses);
        folded.correct.extend(p.correct);
        folded.weights.extend(p.weights);
    }
    Ok(Some(folded))
}

/// Writes the trained model after `step` optimizer steps (every parameter and buffer, under
/// PyTorch's names) to `file` (`model.safetensors`, `model.best.safetensors`) in the run
/// directory, with the preprocessing and the step in its metadata (the step tells a reader
/// whether the run went on past this model: [`crate::checkpoint::model::trained_model`]). Every rank calls it: the strategy gathers each tensor to rank 0 in turn, in
/// the order the file lays them out, so no rank holds more than its share and one tensor.
pub fn write_model(
    plan: &Plan,
    pg: &ProcessGroup,
    strategy: &Strategy,
    vs: &nn::VarStore,
    run_dir: &Path,
    file: &str,
    step: usize,
) -> anyhow::Result<()> {
    crate::dist::memory::phase();
    let tensors = strategy.model_tensors(plan, vs);
    let mut entries: Vec<Entry> = tensors
        .iter()
        .map(|t| Entry {
            name: t.name.clone(),
            kind: t.kind,
            shape: t.shape.clone(),
            bytes: Box::new(move || {
                Ok(strategy.gather_tensor(pg, vs, t)?.map_or(Vec::new(), |x| tensorfile::bytes_of(&x)).into())
            }),
        })
        .collect();
    if pg.rank() != 0 {
        tensorfile::sort_for_layout(&mut entries);
        for e in &mut entries {
            (e.bytes)()?;
        }
        return Ok(());
    }
    let path = run_dir.join(file);
    let tmp = crate::rundir::tmp_path(&path);
    // The preprocessing travels in the model file's metadata: the file alone is usable.
    let pre = std::fs::read_to_string(run_dir.join(crate::rundir::PREPROCESSING)).ok();
    let mut meta = HashMap::from([(crate::checkpoint::model::MODEL_STEP.to_owned(), step.to_string())]);
    meta.extend(pre.map(|p| ("runner.preprocessing".to_owned(), p)));
    tensorfile::write(&tmp, Some(meta), entries)?;
    crate::rundir::commit(&tmp, &path)
}
