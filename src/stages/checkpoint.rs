//! Checkpoints, at any optimizer step: rank 0 writes the model's parameters and the optimizer's
//! state (one tensor file) and a JSON record of the step and the data position, the world size,
//! the parameter shapes, a checksum of the tensor file and the trace rows so far. Sampler order,
//! random windows and dropout seeds derive from (seed, epoch, step, rank), so with the buffers of
//! an unfinished trace interval (every rank's, in the tensor file) nothing else is needed for a
//! resumed run to continue exactly where the first one stopped. A checkpoint at an epoch's end
//! (epoch runs) is `epoch-NNNN`, any other `step-NNNNNNNN`.
//! Every file is written atomically; a checkpoint that does not verify is refused, never loaded.
//! At the end of a run, rank 0 also writes the trained model alone (`model.safetensors`).
//!
//! A pipeline's ranks each hold other layers: every rank of its first copy writes its own stage
//! (`epoch-NNNN.rank-R.pt`, its parameters and optimizer state), and only once every stage is
//! written (an all-gather of their sizes and checksums) does rank 0 commit the record that makes
//! them a checkpoint. The record names the partition; another partition or world size is refused.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

use crate::dist::ProcessGroup;
use crate::model::optim::Optimizer;
use crate::plan::Plan;
use crate::strategy::Strategy;
use crate::trace::{EpochRow, StepRow};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Meta {
    /// The epoch in progress (or just finished) at the checkpoint.
    pub epoch: usize,
    /// Optimizer steps done over the run; older records (epoch ends only) lack it.
    #[serde(default)]
    pub step: Option<usize>,
    /// Where the data stood: "epoch E, batch B" (the sampler's epoch and the batches of it done)
    /// or "random windows, step S".
    #[serde(default)]
    pub position: String,
    pub world_size: usize,
    /// Parameter names and shapes, to refuse a checkpoint of another model.
    pub parameters: Vec<(String, Vec<i64>)>,
    pub tensors_bytes: u64,
    pub tensors_fnv1a: String,
    pub rows: Vec<EpochRow>,
    pub steps: Vec<StepRow>,
    /// DDP's gradient buckets (parameter indices in module order) as the Reducer had rebuilt
    /// them: a resumed run starts from them, so it sums gradients as an uninterrupted one.
    #[serde(default)]
    pub buckets: Option<Vec<Vec<usize>>>,
    /// A pipeline's checkpoint: each stage's file (the record's parameters list the whole model).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<Part>,
    /// A pipeline's checkpoint: the layers of each stage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stages: Option<Vec<std::ops::Range<usize>>>,
}

/// One pipeline stage's file in a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    pub file: String,
    pub bytes: u64,
    pub fnv1a: String,
}

/// A checkpoint that verified: its record and its tensor file (a pipeline: one per stage).
#[derive(Debug, Clone)]
pub struct Found {
    pub meta: Meta,
    pub tensors: PathBuf,
    pub parts: Vec<PathBuf>,
}

impl Found {
    /// The tensor file `rank` loads.
    fn file_for(&self, rank: usize) -> &Path {
        match self.parts.len() {
            0 => &self.tensors,
            n => &self.parts[rank % n],
        }
    }
}

fn part_path(run_dir: &Path, stem: &str, stage: usize) -> PathBuf {
    dir(run_dir).join(part_name(stem, stage))
}

fn part_name(stem: &str, stage: usize) -> String {
    format!("{stem}.rank-{stage}.pt")
}

pub fn dir(run_dir: &Path) -> PathBuf {
    crate::rundir::checkpoints(run_dir)
}

fn paths(run_dir: &Path, stem: &str) -> (PathBuf, PathBuf) {
    let d = dir(run_dir);
    (d.join(format!("{stem}.pt")), d.join(format!("{stem}.json")))
}

/// The name of the checkpoint after `step` optimizer steps: `epoch-NNNN` at an epoch's end of an
/// epoch run, `step-NNNNNNNN` elsewhere.
pub fn stem(plan: &Plan, step: usize) -> String {
    let per_epoch = plan.optimizer_steps_per_epoch().max(1);
    if plan.config.train.steps.is_none() && step.is_multiple_of(per_epoch) {
        format!("epoch-{:04}", step / per_epoch)
    } else {
        format!("step-{step:08}")
    }
}

/// "epoch 2" or "step 150", for messages.
fn describe(stem: &str) -> String {
    let (what, n) = stem.split_once('-').unwrap_or(("checkpoint", stem));
    format!("{what} {}", n.trim_start_matches('0').parse::<usize>().unwrap_or(0))
}

/// The checkpoints with a record, oldest first: (optimizer steps done, name).
fn list(run_dir: &Path, plan: &Plan) -> Vec<(usize, String)> {
    let per_epoch = plan.optimizer_steps_per_epoch().max(1);
    let mut v: Vec<(usize, String)> = std::fs::read_dir(dir(run_dir))
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_str()?.strip_suffix(".json")?.to_owned();
            let step = match (name.strip_prefix("epoch-"), name.strip_prefix("step-")) {
                (Some(e), _) => e.parse::<usize>().ok()? * per_epoch,
                (_, Some(s)) => s.parse().ok()?,
                _ => return None,
            };
            Some((step, name))
        })
        .collect();
    v.sort();
    v
}

fn fnv1a(bytes: &[u8]) -> String {
    format!("{:016x}", crate::rng::fnv1a(bytes))
}

fn named_parameters(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Writes the checkpoint of `epoch` and prunes all but the newest `keep`.
pub struct Snapshot<'a> {
    pub epoch: usize,
    /// Optimizer steps done.
    pub step: usize,
    pub position: String,
    /// Mid-interval: every rank's buffers of the unfinished interval (rank 0 holds them all).
    pub partial: Option<Vec<super::train::Partial>>,
    pub world_size: usize,
    pub vs: &'a nn::VarStore,
    pub optimizer: &'a Optimizer,
    pub rows: &'a [EpochRow],
    pub steps: &'a [StepRow],
    pub buckets: Option<Vec<Vec<usize>>>,
}

/// Disk space: a new checkpoint needs at most one checkpoint's size beyond the kept ones. With
/// `keep` ≥ 2 the oldest are pruned to `keep - 1` before writing (the newest stays as the last
/// good one), so `keep` checkpoints' worth of disk is enough; with `keep` = 1 the new one is
/// written before the old one goes. When the free space is short, the run fails before writing
/// and says so, with the last good checkpoint kept.
///
/// Every rank calls it: a replica's rank 0 writes the checkpoint alone; a pipeline's stages each
/// write their own file, and rank 0 commits the record once all are written.
pub fn save(run_dir: &Path, plan: &Plan, pg: &ProcessGroup, s: &Snapshot, keep: usize) -> anyhow::Result<()> {
    let rank = pg.rank();
    let stem = stem(plan, s.step);
    if !plan.is_pipeline() {
        return if rank == 0 { save_replica(run_dir, plan, &stem, s, keep) } else { Ok(()) };
    }
    let stages = plan.pipeline_ranks();
    let ck = dir(run_dir);
    if rank == 0 {
        std::fs::create_dir_all(&ck).with_context(|| format!("cannot create {}", ck.display()))?;
        if keep >= 2 {
            prune(run_dir, plan, keep - 1);
        }
    }
    // Every rank waits for the directory; then the first copy's ranks write their stages.
    pg.barrier()?;
    let mine = if rank < stages {
        let params = named_parameters(s.vs);
        // Files hold CPU tensors, whatever device trained them: they load anywhere.
        let cpu = tch::Device::Cpu;
        let mut named: Vec<(String, Tensor)> =
            params.iter().map(|(n, t)| (format!("model.{n}"), t.to_device(cpu))).collect();
        named.extend(s.optimizer.state().into_iter().map(|(n, t)| (n, t.to_device(cpu))));
        if rank == 0 {
            named.extend(partial_tensors(s.partial.as_deref()));
        }
        let (bytes, hash) = write_tensors(run_dir, plan, s.step, &part_path(run_dir, &stem, rank), &named, 0)?;
        [bytes as i64, hash as i64]
    } else {
        [0, 0]
    };
    // The all-gather is the commit's barrier: rank 0 learns that every stage is on disk.
    let all = pg.all_gather(&Tensor::from_slice(&mine))?;
    if rank != 0 {
        return Ok(());
    }
    let parts = all[..stages]
        .iter()
        .enumerate()
        .map(|(r, t)| {
            let v = Vec::<i64>::try_from(t).expect("two int64 values");
            Part { file: part_name(&stem, r), bytes: v[0] as u64, fnv1a: format!("{:016x}", v[1] as u64) }
        })
        .collect();
    let meta = Meta {
        epoch: s.epoch,
        step: Some(s.step),
        position: s.position.clone(),
        world_size: s.world_size,
        parameters: crate::model::sorted_parameters(plan.model().as_ref()),
        tensors_bytes: 0,
        tensors_fnv1a: String::new(),
        rows: s.rows.to_vec(),
        steps: s.steps.to_vec(),
        buckets: None,
        parts,
        stages: Some(plan.stages[..stages].to_vec()),
    };
    let (_, json) = paths(run_dir, &stem);
    crate::rundir::atomic_write(&json, serde_json::to_string(&meta)?.as_bytes())?;
    prune(run_dir, plan, keep);
    Ok(())
}

/// Every rank's buffers of an unfinished interval, as named tensors (`partial.R.losses`, ...).
fn partial_tensors(partial: Option<&[super::train::Partial]>) -> Vec<(String, Tensor)> {
    let mut named = Vec::new();
    for (r, p) in partial.unwrap_or_default().iter().enumerate() {
        named.push((format!("partial.{r}.losses"), Tensor::from_slice(&p.losses)));
        named.push((format!("partial.{r}.correct"), Tensor::from_slice(&p.correct)));
        named.push((format!("partial.{r}.weights"), Tensor::from_slice(&p.weights)));
        named.push((format!("partial.{r}.norms"), Tensor::from_slice(&p.norms)));
    }
    named
}

/// Writes `named` to `path` atomically, after checking the free space (`extra` bytes beyond the
/// tensors'); returns its size and checksum.
fn write_tensors(
    run_dir: &Path,
    plan: &Plan,
    step: usize,
    path: &Path,
    named: &[(String, Tensor)],
    extra: u64,
) -> anyhow::Result<(u64, u64)> {
    let ck = dir(run_dir);
    // The tensors' bytes, and room for the names and the record.
    let need: u64 =
        named.iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum::<u64>() + 64 * 1024 + extra;
    if let Some(free) = free_bytes(&ck) {
        if free < need {
            let last = list(run_dir, plan).pop().map_or("none yet".to_owned(), |(_, name)| describe(&name));
            anyhow::bail!(
                "not enough free space for the checkpoint of {}: it needs about {:.1} MiB, {:.1} MiB are \
                 free on {}; the last good checkpoint ({last}) is kept: free some space and resume with --resume",
                describe(&stem(plan, step)),
                need as f64 / 1048576.0,
                free as f64 / 1048576.0,
                ck.display()
            );
        }
    }
    let tmp = crate::rundir::tmp_path(path);
    if let Err(e) = Tensor::save_multi(named, &tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot write {}", path.display()));
    }
    let bytes = std::fs::read(&tmp)?;
    crate::rundir::commit(&tmp, path)?;
    Ok((bytes.len() as u64, crate::rng::fnv1a(&bytes)))
}

fn save_replica(run_dir: &Path, plan: &Plan, stem: &str, s: &Snapshot, keep: usize) -> anyhow::Result<()> {
    let (pt, json) = paths(run_dir, stem);
    let ck = dir(run_dir);
    std::fs::create_dir_all(&ck).with_context(|| format!("cannot create {}", ck.display()))?;
    let params = named_parameters(s.vs);
    // Files hold CPU tensors, whatever device trained them: they load anywhere.
    let cpu = tch::Device::Cpu;
    let mut named: Vec<(String, Tensor)> =
        params.iter().map(|(n, t)| (format!("model.{n}"), t.to_device(cpu))).collect();
    named.extend(s.optimizer.state().into_iter().map(|(n, t)| (n, t.to_device(cpu))));
    named.extend(partial_tensors(s.partial.as_deref()));
    if keep >= 2 {
        prune(run_dir, plan, keep - 1);
    }
    let extra = 512 * (s.rows.len() + s.steps.len()) as u64;
    let (bytes, hash) = write_tensors(run_dir, plan, s.step, &pt, &named, extra)?;
    let meta = Meta {
        epoch: s.epoch,
        step: Some(s.step),
        position: s.position.clone(),
        world_size: s.world_size,
        parameters: params.iter().map(|(n, t)| (n.clone(), t.size())).collect(),
        tensors_bytes: bytes,
        tensors_fnv1a: format!("{hash:016x}"),
        rows: s.rows.to_vec(),
        steps: s.steps.to_vec(),
        buckets: s.buckets.clone(),
        parts: Vec::new(),
        stages: None,
    };
    crate::rundir::atomic_write(&json, serde_json::to_string(&meta)?.as_bytes())?;
    prune(run_dir, plan, keep);
    Ok(())
}

/// Removes all but the newest `keep` checkpoints (record first: a checkpoint without its record
/// is not one).
fn prune(run_dir: &Path, plan: &Plan, keep: usize) {
    for (_, old) in list(run_dir, plan).into_iter().rev().skip(keep) {
        let (pt, json) = paths(run_dir, &old);
        let _ = std::fs::remove_file(json);
        let _ = std::fs::remove_file(pt);
        // A pipeline's stage files (the record, gone first, named them).
        let prefix = format!("{old}.rank-");
        for e in std::fs::read_dir(dir(run_dir)).into_iter().flatten().flatten() {
            if e.file_name().to_str().is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".pt")) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Bytes free for this user on the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(s.blocks_available() as u64 * s.fragment_size() as u64)
}

/// The newest checkpoint, verified against its checksum and against the plan (model shapes,
/// world size). An error names the file and says what to do.
pub fn latest(run_dir: &Path, plan: &Plan) -> Result<Option<Found>, String> {
    let expected = crate::model::sorted_parameters(plan.model().as_ref());
    let Some((step, name)) = list(run_dir, plan).pop() else { return Ok(None) };
    let (pt, json) = paths(run_dir, &name);
    let refuse = |why: String| {
        Err(format!(
            "checkpoint {} is refused: {why}; delete it to resume from the one before, or start a new run",
            pt.display()
        ))
    };
    let text = std::fs::read_to_string(&json).map_err(|e| format!("cannot read {}: {e}", json.display()))?;
    let mut meta: Meta = match serde_json::from_str(&text) {
        Ok(m) => m,
        Err(e) => return refuse(format!("its record {} is corrupt ({e})", json.display())),
    };
    if meta.world_size != plan.world_size() {
        return refuse(format!("it was written at world size {}, this run has {}", meta.world_size, plan.world_size()));
    }
    if meta.parameters != expected {
        return refuse("it holds a different model (parameter names or shapes differ from [wrap.model])".into());
    }
    let stages = plan.is_pipeline().then(|| plan.stages[..plan.pipeline_ranks()].to_vec());
    if meta.stages != stages {
        let show = |s: &Option<Vec<std::ops::Range<usize>>>| match s {
            None => "no pipeline (one file of the whole model)".to_owned(),
            Some(v) => format!("stages {}", v.iter().map(crate::model::layers_text).collect::<Vec<_>>().join(" | ")),
        };
        return refuse(format!(
            "it was written with another partition of the model: {}, this run has {}",
            show(&meta.stages),
            show(&stages)
        ));
    }
    // Records of epoch ends written before steps were counted.
    let recorded = *meta.step.get_or_insert(step);
    if recorded != step {
        return refuse(format!("its record says step {recorded}, its name {name} (step {step})"));
    }
    let verify = |path: &Path, want_bytes: u64, want: &str| -> Result<(), String> {
        let bytes = std::fs::read(path).map_err(|e| format!("cannot be read ({e})"))?;
        if bytes.len() as u64 != want_bytes || fnv1a(&bytes) != want {
            return Err(format!(
                "is truncated or corrupt ({} bytes, {want_bytes} expected, checksum mismatch)",
                bytes.len()
            ));
        }
        Ok(())
    };
    if let Err(why) = check_buckets(meta.buckets.as_deref(), plan) {
        return refuse(why);
    }
    let mut parts = Vec::new();
    if meta.parts.is_empty() {
        if let Err(e) = verify(&pt, meta.tensors_bytes, &meta.tensors_fnv1a) {
            return refuse(format!("it {e}"));
        }
    }
    for part in &meta.parts {
        let path = dir(run_dir).join(&part.file);
        if let Err(e) = verify(&path, part.bytes, &part.fnv1a) {
            return refuse(format!("its stage file {} {e}", path.display()));
        }
        parts.push(path);
    }
    Ok(Some(Found { meta, tensors: pt, parts }))
}

/// A record's DDP buckets name every trainable parameter (by its index in module order) exactly
/// once: the Reducer is handed them as they are.
fn check_buckets(buckets: Option<&[Vec<usize>]>, plan: &Plan) -> Result<(), String> {
    let Some(buckets) = buckets else { return Ok(()) };
    let arch = plan.model();
    let n = arch.parameters(0..arch.layers().len()).len();
    let mut seen = vec![false; n];
    for &i in buckets.iter().flatten() {
        if i >= n || std::mem::replace(&mut seen[i], true) {
            return Err(format!("its DDP buckets name parameter {i} twice or past the model's {n}"));
        }
    }
    if seen.contains(&false) || buckets.iter().any(Vec::is_empty) {
        return Err(format!("its DDP buckets do not hold each of the model's {n} parameters"));
    }
    Ok(())
}

/// Writes the trained model's parameters to `file` (`model.safetensors`, `model.best.safetensors`)
/// in the run directory, named as in the whole model (`layer0.weight`, ...) whatever the strategy
/// (it gathers them to rank 0; every rank calls it).
pub fn write_model(
    plan: &Plan,
    pg: &ProcessGroup,
    strategy: &Strategy,
    vs: &nn::VarStore,
    run_dir: &Path,
    file: &str,
) -> anyhow::Result<()> {
    let Some(named) = strategy.gather_model(plan, pg, vs)? else { return Ok(()) };
    let path = run_dir.join(file);
    let tmp = crate::rundir::tmp_path(&path);
    // The preprocessing travels in the model file's metadata: the file alone is usable.
    let pre = std::fs::read_to_string(run_dir.join(crate::predict::PREPROCESSING)).ok();
    let meta: Vec<(&str, String)> = pre.into_iter().map(|p| ("runner.preprocessing", p)).collect();
    if let Err(e) = crate::predict::write_safetensors(&named, &meta, &tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot write {}", path.display()));
    }
    crate::rundir::commit(&tmp, &path)
}

/// Loads a verified checkpoint's parameters and optimizer state.
/// `rank` loads its own stage's file in a pipeline.
pub fn load(found: &Found, rank: usize, vs: &nn::VarStore, optimizer: &mut Optimizer) -> anyhow::Result<()> {
    let file = found.file_for(rank);
    let saved: HashMap<String, Tensor> =
        Tensor::load_multi(file).with_context(|| format!("cannot load {}", file.display()))?.into_iter().collect();
    for (name, mut t) in named_parameters(vs) {
        let s = saved
            .get(&format!("model.{name}"))
            .with_context(|| format!("{} has no parameter {name}", file.display()))?;
        // Shapes and kinds as the model's (floats, or a module buffer's integer count).
        if s.size() != t.size() || s.is_floating_point() != t.is_floating_point() {
            anyhow::bail!(
                "{}: parameter {name} is {:?} {:?}, the model's is {:?} {:?}",
                file.display(),
                s.kind(),
                s.size(),
                t.kind(),
                t.size()
            );
        }
        tch::no_grad(|| t.f_copy_(s))
            .map_err(|e| anyhow::anyhow!("{}: {}", file.display(), crate::checked::torch_message(&e)))?;
    }
    optimizer.load_state(|n| saved.get(n).map(|t| t.shallow_clone())).map_err(anyhow::Error::msg)
}

/// `rank`'s buffers of the interval a checkpoint interrupted (`None` at an interval's end).
pub fn load_partial(found: &Found, rank: usize) -> anyhow::Result<Option<super::train::Partial>> {
    let file = found.file_for(0);
    let saved: HashMap<String, Tensor> =
        Tensor::load_multi(file).with_context(|| format!("cannot load {}", file.display()))?.into_iter().collect();
    let get = |what: &str| saved.get(&format!("partial.{rank}.{what}"));
    let (Some(losses), Some(correct), Some(weights), Some(norms)) =
        (get("losses"), get("correct"), get("weights"), get("norms"))
    else {
        return Ok(None);
    };
    let f32s = |t: &Tensor| {
        Vec::<f32>::try_from(t).with_context(|| format!("{} holds a damaged partial interval", file.display()))
    };
    Ok(Some(super::train::Partial {
        losses: f32s(losses)?,
        correct: f32s(correct)?,
        weights: f32s(weights)?,
        norms: Vec::<f64>::try_from(norms)
            .with_context(|| format!("{} holds damaged gradient norms", file.display()))?,
    }))
}
