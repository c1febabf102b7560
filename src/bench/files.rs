//! The files both sides of a benchmark read: the runner's pipeline file, and for the PyTorch
//! reference the same training rows, the runner's per-epoch permutations, the model
//! (`model.json`: the same `[wrap.model]` table) and one initial-weights file that both load.
use std::path::{Path, PathBuf};

use anyhow::Context;
use tch::Tensor;

use super::workload::{Kind, Peer, Workload, SEED, TOKEN_NOISE};
use crate::config::{self, schema};
use crate::data::{self, shard};
use crate::model::Architecture;
use crate::plan::Plan;

/// Where a workload's files are.
pub struct Files {
    pub dir: PathBuf,
    pub pipeline: PathBuf,
    /// What the reference trains on: data.npz (the rows and the runner's permutations) for
    /// PyTorch DDP, the token file for PyTorch FSDP2.
    pub data: PathBuf,
    pub init: PathBuf,
    pub model: PathBuf,
}

/// The token file against PyTorch FSDP2, beside the pipeline (nanoGPT's format: uint16 ids).
pub(super) const TOKENS: &str = "tokens.bin";

/// Writes the workload's pipeline, initial weights (the runner's own initialisation for
/// run.seed) and, for the reference, the model and the data: the training rows and the runner's
/// permutations (PyTorch DDP), or the token file both sides read (PyTorch FSDP2 and DTensor).
pub fn prepare(w: &Workload, dir: &Path) -> anyhow::Result<Files> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let files = Files {
        dir: dir.to_owned(),
        pipeline: dir.join("pipeline.toml"),
        data: dir.join(if w.peer.reads_tokens() { TOKENS } else { "data.npz" }),
        init: dir.join("init.npz"),
        model: dir.join("model.json"),
    };
    crate::rundir::atomic_write(&files.pipeline, w.pipeline()?.as_bytes())?;
    let model = serde_json::to_string_pretty(&w.reference_model())?;
    crate::rundir::atomic_write(&files.model, model.as_bytes())?;
    // Before the plan, which reads wrap.init.
    write_init(w.kind.arch().as_ref(), SEED, &files.init)?;
    match (w.peer, &w.kind) {
        (Peer::TorchDdp, _) => {
            let plan = Plan::new(config::resolve(&files.pipeline, &[])?)?;
            write_data(&plan, &files.data)?;
        }
        (_, Kind::Transformer(t)) => write_tokens(t, w.rows, &files.data)?,
        (_, _) => anyhow::bail!("the {} workload: {} runs a language model", w.name, w.peer.script()),
    }
    Ok(files)
}

/// `windows` windows of synthetic tokens (the synthetic source's Markov chain) as one stream of
/// windows × seq_len + 1 little-endian uint16 ids.
fn write_tokens(t: &schema::Transformer, windows: usize, path: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(t.vocab <= 1 << 16, "a vocabulary of {} does not fit uint16 token ids", t.vocab);
    let (x, y) = data::tokens::synthetic_windows(t.vocab, TOKEN_NOISE, t.seq_len, windows, SEED);
    let mut ids = Vec::<i64>::try_from(x.reshape([-1]))?;
    // Windows overlap by one token: the stream ends with the last window's last target.
    ids.push(y.int64_value(&[windows as i64 - 1, t.seq_len as i64 - 1]));
    let bytes: Vec<u8> = ids.iter().flat_map(|&id| (id as u16).to_le_bytes()).collect();
    crate::rundir::atomic_write(path, &bytes)
}

/// The runner's own initialisation of `arch` for `seed`: every parameter and buffer.
fn write_init(arch: &dyn Architecture, seed: u64, path: &Path) -> anyhow::Result<()> {
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let _model = arch.build(&vs.root(), 0..arch.layers().len(), &crate::model::BuildContext::new(seed));
    let named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    write_npz(&named, path)
}

fn write_data(plan: &Plan, path: &Path) -> anyhow::Result<()> {
    let seed = plan.config.run.seed;
    let data = data::load(&plan.data).map_err(anyhow::Error::msg)?;
    let epochs = plan.config.train.epochs;
    let rows = plan.data.rows;
    let perms: Vec<i64> = (1..=epochs).flat_map(|e| shard::permutation(seed, e, rows, true)).collect();
    let (train_x, train_y) = data.train.gather(&(0..rows as i64).collect::<Vec<_>>())?;
    let named = vec![
        ("train_x".to_string(), train_x.contiguous()),
        ("train_y".to_string(), train_y.contiguous()),
        ("permutations".to_string(), Tensor::from_slice(&perms).view([epochs as i64, rows as i64])),
    ];
    write_npz(&named, path)
}

fn write_npz(named: &[(String, Tensor)], path: &Path) -> anyhow::Result<()> {
    let part = path.with_extension("npz.part");
    Tensor::write_npz(named, &part).with_context(|| format!("cannot write {}", part.display()))?;
    std::fs::rename(&part, path).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::bench::catalogue::all;
    use crate::bench::workload::FSDP_STRATEGY;
    use crate::model;

    #[test]
    fn every_workload_prepares_the_files_both_sides_read() {
        let dir = tempfile::tempdir().unwrap();
        for w in all() {
            let w = Workload { rows: 64, batch: 16, epochs: 2, ..w };
            let files = prepare(&w, &dir.path().join(w.name)).unwrap();
            // The data and the model, under DDP: the strategy is the runner's to check when it runs.
            let text = std::fs::read_to_string(&files.pipeline).unwrap();
            let ddp = files.dir.join("ddp.toml");
            let mut under_ddp = text.replace(&format!("strategy = \"{FSDP_STRATEGY}\""), "strategy = \"ddp\"");
            if let Peer::TorchTp { tensor, .. } = w.peer {
                // A tensor mesh fills the world: the plan refuses it at 1 rank.
                assert!(text.contains(&format!("[wrap.mesh]\ntensor = {tensor}\n")), "{text}");
                under_ddp = under_ddp.replace("world_size = 1", &format!("world_size = {tensor}"));
            }
            std::fs::write(&ddp, under_ddp).unwrap();
            let plan = Plan::new(config::resolve(&ddp, &[]).unwrap()).unwrap();
            assert_eq!(plan.config.wrap.model, w.kind.model(), "{}", w.name);
            assert_eq!((plan.data.rows, plan.data.input.clone()), (64, w.kind.input()), "{}", w.name);

            // Every parameter and buffer of the model, as the runner reads wrap.init.
            let arch = w.kind.arch();
            let init = model::read_weights(&files.init, &model::sorted_parameters(arch.as_ref())).unwrap();
            assert_eq!(init.contains_key("bn0.running_var"), matches!(w.kind, Kind::Cnn { .. }), "{}", w.name);

            // The reference's model: the same [wrap.model] table.
            let spec: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(&files.model).unwrap()).unwrap();
            let model: schema::Model = serde_json::from_value(spec["model"].clone()).unwrap();
            assert_eq!(model, w.kind.model(), "{}", w.name);
            assert_eq!(spec["outputs"], w.kind.outputs(), "{}", w.name);

            if w.peer.reads_tokens() {
                // Every window trains, read from the token file: 64 windows of seq_len + 1 ids.
                let strategy = if w.name == "tp" { "ddp" } else { FSDP_STRATEGY };
                assert!(text.contains(&format!("strategy = \"{strategy}\"\n")), "{text}");
                assert_eq!(plan.data.validation_rows, 0, "{}", w.name);
                let Kind::Transformer(t) = &w.kind else { panic!("{}: a language model", w.name) };
                let bytes = std::fs::metadata(&files.data).unwrap().len() as usize;
                assert_eq!(bytes, 2 * (64 * t.seq_len + 1), "{}", w.name);
                // The runner reads from it the synthetic source's windows.
                let read = data::load(&plan.data).unwrap().train.gather(&(0..64).collect::<Vec<i64>>()).unwrap();
                let (x, y) = data::tokens::synthetic_windows(t.vocab, TOKEN_NOISE, t.seq_len, 64, SEED);
                assert!(read.0.equal(&x) && read.1.equal(&y), "{}", w.name);
                continue;
            }

            // The training samples and the runner's shuffle of each epoch.
            let data: BTreeMap<String, Tensor> = Tensor::read_npz(&files.data).unwrap().into_iter().collect();
            let shape = |v: &[usize]| -> Vec<i64> { std::iter::once(64).chain(v.iter().map(|&d| d as i64)).collect() };
            assert_eq!(data["train_x"].size(), shape(&w.kind.input()), "{}", w.name);
            let lm = matches!(w.kind, Kind::Transformer(_));
            assert_eq!(data["train_y"].size(), if lm { shape(&w.kind.input()) } else { vec![64] }, "{}", w.name);
            let kind = if lm { tch::Kind::Int64 } else { tch::Kind::Float };
            assert_eq!(data["train_x"].kind(), kind, "{}", w.name);
            let perms: Vec<i64> = Vec::try_from(data["permutations"].view([-1])).unwrap();
            let want: Vec<i64> = (1..=2).flat_map(|e| shard::permutation(SEED, e, 64, true)).collect();
            assert_eq!(perms, want, "{}", w.name);
        }
    }
}
