//! Checkpoints: rank 0 writes the model's parameters and the optimizer's state (one tensor file)
//! and a JSON record of the epoch, the world size, the parameter shapes, a checksum of the tensor
//! file and the trace rows so far. Sampler order and dropout seeds derive from (seed, epoch), so
//! nothing else is needed for a resumed run to continue exactly where the first one stopped.
//! Every file is written atomically; a checkpoint that does not verify is refused, never loaded.
//! At the end of a run, rank 0 also writes the trained model alone (`model.safetensors`).
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
    pub epoch: usize,
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
}

/// A checkpoint that verified: its record and its tensor file.
#[derive(Debug, Clone)]
pub struct Found {
    pub meta: Meta,
    pub tensors: PathBuf,
}

pub fn dir(run_dir: &Path) -> PathBuf {
    crate::rundir::checkpoints(run_dir)
}

fn paths(run_dir: &Path, epoch: usize) -> (PathBuf, PathBuf) {
    let d = dir(run_dir);
    (d.join(format!("epoch-{epoch:04}.pt")), d.join(format!("epoch-{epoch:04}.json")))
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
pub fn save(run_dir: &Path, s: &Snapshot, keep: usize) -> anyhow::Result<()> {
    let Snapshot { epoch, world_size, vs, optimizer, rows, steps, ref buckets } = *s;
    let (pt, json) = paths(run_dir, epoch);
    let ck = dir(run_dir);
    std::fs::create_dir_all(&ck).with_context(|| format!("cannot create {}", ck.display()))?;
    let params = named_parameters(vs);
    // Files hold CPU tensors, whatever device trained them: they load anywhere.
    let cpu = tch::Device::Cpu;
    let mut named: Vec<(String, Tensor)> =
        params.iter().map(|(n, t)| (format!("model.{n}"), t.to_device(cpu))).collect();
    named.extend(optimizer.state().into_iter().map(|(n, t)| (n, t.to_device(cpu))));
    if keep >= 2 {
        prune(run_dir, keep - 1);
    }
    // The tensors' bytes, and room for the names, the record and the trace rows.
    let need: u64 = named.iter().map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64).sum::<u64>()
        + 64 * 1024
        + 512 * (rows.len() + steps.len()) as u64;
    if let Some(free) = free_bytes(&ck) {
        if free < need {
            let last = epochs(run_dir).pop().map_or("none yet".to_owned(), |e| format!("epoch {e}"));
            anyhow::bail!(
                "not enough free space for the checkpoint of epoch {epoch}: it needs about {:.1} MiB, {:.1} MiB are \
                 free on {}; the last good checkpoint ({last}) is kept: free some space and resume with --resume",
                need as f64 / 1048576.0,
                free as f64 / 1048576.0,
                ck.display()
            );
        }
    }
    let tmp = crate::rundir::tmp_path(&pt);
    if let Err(e) = Tensor::save_multi(&named, &tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("cannot write {}", pt.display()));
    }
    let bytes = std::fs::read(&tmp)?;
    crate::rundir::commit(&tmp, &pt)?;
    let meta = Meta {
        epoch,
        world_size,
        parameters: params.iter().map(|(n, t)| (n.clone(), t.size())).collect(),
        tensors_bytes: bytes.len() as u64,
        tensors_fnv1a: fnv1a(&bytes),
        rows: rows.to_vec(),
        steps: steps.to_vec(),
        buckets: buckets.clone(),
    };
    crate::rundir::atomic_write(&json, serde_json::to_string(&meta)?.as_bytes())?;
    prune(run_dir, keep);
    Ok(())
}

/// Removes all but the newest `keep` checkpoints (record first: a checkpoint without its record
/// is not one).
fn prune(run_dir: &Path, keep: usize) {
    for old in epochs(run_dir).into_iter().rev().skip(keep) {
        let (pt, json) = paths(run_dir, old);
        let _ = std::fs::remove_file(json);
        let _ = std::fs::remove_file(pt);
    }
}

/// Bytes free for this user on the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(s.blocks_available() as u64 * s.fragment_size() as u64)
}

/// Epochs with a checkpoint record, oldest first.
fn epochs(run_dir: &Path) -> Vec<usize> {
    let mut v: Vec<usize> = std::fs::read_dir(dir(run_dir))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("epoch-")?.strip_suffix(".json")?.parse().ok())
        .collect();
    v.sort();
    v
}

/// The newest checkpoint, verified against its checksum and against the plan (model shapes,
/// world size). An error names the file and says what to do.
pub fn latest(run_dir: &Path, plan: &Plan) -> Result<Option<Found>, String> {
    let expected = crate::model::sorted_parameters(plan.model().as_ref());
    let Some(epoch) = epochs(run_dir).pop() else { return Ok(None) };
    let (pt, json) = paths(run_dir, epoch);
    let refuse = |why: String| {
        Err(format!(
            "checkpoint {} is refused: {why}; delete it to resume from the one before, or start a new run",
            pt.display()
        ))
    };
    let text = std::fs::read_to_string(&json).map_err(|e| format!("cannot read {}: {e}", json.display()))?;
    let meta: Meta = match serde_json::from_str(&text) {
        Ok(m) => m,
        Err(e) => return refuse(format!("its record {} is corrupt ({e})", json.display())),
    };
    let bytes = match std::fs::read(&pt) {
        Ok(b) => b,
        Err(e) => return refuse(format!("cannot read it ({e})")),
    };
    if bytes.len() as u64 != meta.tensors_bytes || fnv1a(&bytes) != meta.tensors_fnv1a {
        return refuse(format!(
            "it is truncated or corrupt ({} bytes, {} expected, checksum mismatch)",
            bytes.len(),
            meta.tensors_bytes
        ));
    }
    if meta.world_size != plan.world_size() {
        return refuse(format!("it was written at world size {}, this run has {}", meta.world_size, plan.world_size()));
    }
    if meta.parameters != expected {
        return refuse("it holds a different model (parameter names or shapes differ from [wrap.model])".into());
    }
    Ok(Some(Found { meta, tensors: pt }))
}

/// Writes the trained model's parameters to `model.safetensors` in the run directory, named as
/// in the whole model (`layer0.weight`, ...) whatever the strategy (it gathers them to rank 0).
pub fn write_model(
    plan: &Plan,
    pg: &ProcessGroup,
    strategy: &Strategy,
    vs: &nn::VarStore,
    run_dir: &Path,
) -> anyhow::Result<()> {
    let Some(named) = strategy.gather_model(plan, pg, vs)? else { return Ok(()) };
    let path = run_dir.join(crate::rundir::MODEL);
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
pub fn load(found: &Found, vs: &nn::VarStore, optimizer: &mut Optimizer) -> anyhow::Result<()> {
    let saved: HashMap<String, Tensor> = Tensor::load_multi(&found.tensors)
        .with_context(|| format!("cannot load {}", found.tensors.display()))?
        .into_iter()
        .collect();
    for (name, mut t) in named_parameters(vs) {
        let s = saved
            .get(&format!("model.{name}"))
            .with_context(|| format!("{} has no parameter {name}", found.tensors.display()))?;
        tch::no_grad(|| t.copy_(s));
    }
    optimizer.load_state(|n| saved.get(n).map(|t| t.shallow_clone())).map_err(anyhow::Error::msg)
}
