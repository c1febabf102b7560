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

use crate::config::Plan;
use crate::dist::ProcessGroup;
use crate::model::optim::Optimizer;
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
}

/// A checkpoint that verified: its record and its tensor file.
#[derive(Debug, Clone)]
pub struct Found {
    pub meta: Meta,
    pub tensors: PathBuf,
}

pub fn dir(run_dir: &Path) -> PathBuf {
    run_dir.join("checkpoints")
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
}

pub fn save(run_dir: &Path, s: &Snapshot, keep: usize) -> anyhow::Result<()> {
    let Snapshot { epoch, world_size, vs, optimizer, rows, steps } = *s;
    let (pt, json) = paths(run_dir, epoch);
    std::fs::create_dir_all(dir(run_dir)).with_context(|| format!("cannot create {}", dir(run_dir).display()))?;
    let params = named_parameters(vs);
    // Files hold CPU tensors, whatever device trained them: they load anywhere.
    let cpu = tch::Device::Cpu;
    let mut named: Vec<(String, Tensor)> =
        params.iter().map(|(n, t)| (format!("model.{n}"), t.to_device(cpu))).collect();
    named.extend(optimizer.state().into_iter().map(|(n, t)| (n, t.to_device(cpu))));
    let tmp = pt.with_extension("pt.tmp");
    Tensor::save_multi(&named, &tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    let bytes = std::fs::read(&tmp)?;
    crate::trace::atomic_write(&pt, &bytes)?;
    let _ = std::fs::remove_file(&tmp);
    let meta = Meta {
        epoch,
        world_size,
        parameters: params.iter().map(|(n, t)| (n.clone(), t.size())).collect(),
        tensors_bytes: bytes.len() as u64,
        tensors_fnv1a: fnv1a(&bytes),
        rows: rows.to_vec(),
        steps: steps.to_vec(),
    };
    crate::trace::atomic_write(&json, serde_json::to_string(&meta)?.as_bytes())?;
    for old in epochs(run_dir).into_iter().rev().skip(keep) {
        let (pt, json) = paths(run_dir, old);
        let _ = std::fs::remove_file(json);
        let _ = std::fs::remove_file(pt);
    }
    Ok(())
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
pub fn latest(run_dir: &Path, plan: &Plan, expected: &[(String, Vec<i64>)]) -> Result<Option<Found>, String> {
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

/// Parameter names and shapes of the plan's model, as a checkpoint records them.
pub fn shapes(plan: &Plan) -> Vec<(String, Vec<i64>)> {
    let (d, m) = (&plan.data, &plan.config.wrap.model);
    crate::model::layer_shapes(d.features, &m.hidden, d.classes, 0..m.hidden.len() + 1)
}

/// Writes the trained model's parameters to `model.safetensors` in the run directory, named as
/// in the whole model (`layer0.weight`, ...) whatever the strategy: rank 0's replica, or, in a
/// pipeline, the layers of every rank of its first copy sent to rank 0.
pub fn write_model(plan: &Plan, pg: &ProcessGroup, vs: &nn::VarStore, run_dir: &Path) -> anyhow::Result<()> {
    // On the CPU, whatever device trained them (as checkpoints).
    let mut named: Vec<(String, Tensor)> =
        named_parameters(vs).into_iter().map(|(n, t)| (n, t.to_device(tch::Device::Cpu))).collect();
    if plan.is_pipeline() {
        if pg.rank() >= plan.pipeline_ranks() {
            return Ok(());
        }
        if pg.rank() > 0 {
            for (i, (_, t)) in named.iter().enumerate() {
                pg.send(t, 0, i as i32)?;
            }
            return Ok(());
        }
        let (d, m) = (&plan.data, &plan.config.wrap.model);
        for r in 1..plan.pipeline_ranks() {
            for (i, (name, shape)) in
                crate::model::layer_shapes(d.features, &m.hidden, d.classes, plan.stages[r].clone())
                    .into_iter()
                    .enumerate()
            {
                let mut t = Tensor::zeros(shape.as_slice(), (tch::Kind::Float, tch::Device::Cpu));
                pg.recv(&mut t, r, i as i32)?;
                named.push((name, t));
            }
        }
    } else if pg.rank() > 0 {
        return Ok(());
    }
    let path = run_dir.join("model.safetensors");
    let tmp = run_dir.join(format!(".model.safetensors.tmp-{}", std::process::id()));
    Tensor::write_safetensors(&named, &tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    let bytes = std::fs::read(&tmp);
    let _ = std::fs::remove_file(&tmp);
    crate::trace::atomic_write(&path, &bytes?)
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
