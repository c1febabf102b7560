//! The benchmark's workloads and the files both sides read: the runner's pipeline file, and for
//! the PyTorch reference the same training rows, the runner's per-epoch permutations and one
//! initial-weights file that both load.
use std::path::{Path, PathBuf};

use anyhow::Context;
use tch::Tensor;

use crate::config;
use crate::data::{self, shard};
use crate::model::{self, mlp::MlpArch, Architecture};
use crate::plan::Plan;

#[derive(Debug, Clone)]
pub struct Workload {
    pub name: &'static str,
    pub rows: usize,
    pub features: usize,
    pub classes: usize,
    pub hidden: Vec<usize>,
    /// Per rank.
    pub batch: usize,
    pub epochs: usize,
    pub lr: f64,
    /// Report the fraction of the measured matmul peak.
    pub compute_bound: bool,
    /// Both sides autocast the forward pass to bfloat16 (`--precision bf16`).
    pub bf16: bool,
}

pub fn all() -> Vec<Workload> {
    vec![
        // The seed workload (pipelines/ddp.toml without validation).
        Workload {
            name: "overhead-bound",
            rows: 10_000,
            features: 10,
            classes: 4,
            hidden: vec![64, 64],
            batch: 32,
            epochs: 5,
            lr: 0.005,
            compute_bound: false,
            bf16: false,
        },
        Workload {
            name: "compute-bound",
            rows: 20_000,
            features: 256,
            classes: 10,
            hidden: vec![1024, 1024],
            batch: 256,
            epochs: 2,
            lr: 0.001,
            compute_bound: true,
            bf16: false,
        },
    ]
}

impl Workload {
    fn model(&self) -> MlpArch {
        let m = config::schema::Mlp { hidden: self.hidden.clone(), ..Default::default() };
        MlpArch::new(&m, &[self.features], self.classes)
    }

    pub fn parameters(&self) -> usize {
        model::layer_parameters(&self.model()).iter().sum()
    }

    /// "" in fp32, "-bf16" in bf16: the files of each precision apart.
    pub fn precision_tag(&self) -> &'static str {
        if self.bf16 {
            "-bf16"
        } else {
            ""
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} × {}, {}, batch {} per rank, {} epochs, Adam lr {}{}",
            self.rows,
            self.features,
            self.model().describe(),
            self.batch,
            self.epochs,
            self.lr,
            if self.bf16 { ", bf16 autocast (both sides)" } else { "" }
        )
    }

    fn pipeline(&self) -> String {
        let hidden: Vec<String> = self.hidden.iter().map(|h| h.to_string()).collect();
        format!(
            "# Written by `runner bench` for the {name} workload; world size and threads come with --set.\n\
             [run]\nname = \"bench-{name}\"\nseed = 0\nworld_size = 1\ntimeout_s = 300\n\n\
             [load]\nsource = \"synthetic\"\nrows = {rows}\nfeatures = {features}\nclasses = {classes}\n\
             validation_rows = 0\nnoise = 0.3\n\n\
             [shard]\nstrategy = \"dataset\"\nshuffle = true\ndrop_last = false\n\n\
             [normalize]\nmethod = \"minmax\"\nscope = \"rank\"\n\n\
             [wrap]\nstrategy = \"ddp\"\nbucket_cap_mb = 25\ninit = \"init.npz\"\n\n\
             [wrap.model]\nkind = \"mlp\"\nhidden = [{hidden}]\nactivation = \"relu\"\ndropout = 0.0\n\n\
             [train]\nepochs = {epochs}\nbatch_size = {batch}\noptimizer = \"adam\"\nlr = {lr}\n\n\
             [validate]\nevery = 0\n",
            name = self.name,
            rows = self.rows,
            features = self.features,
            classes = self.classes,
            hidden = hidden.join(", "),
            epochs = self.epochs,
            batch = self.batch,
            lr = self.lr,
        )
    }
}

/// Where a workload's files are.
pub struct Files {
    pub dir: PathBuf,
    pub pipeline: PathBuf,
    pub data: PathBuf,
    pub init: PathBuf,
}

/// Writes the workload's pipeline, initial weights (the runner's own initialisation for
/// run.seed) and, for the reference, the training rows and the runner's permutations.
pub fn prepare(w: &Workload, dir: &Path) -> anyhow::Result<Files> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let files = Files {
        dir: dir.to_owned(),
        pipeline: dir.join("pipeline.toml"),
        data: dir.join("data.npz"),
        init: dir.join("init.npz"),
    };
    crate::rundir::atomic_write(&files.pipeline, w.pipeline().as_bytes())?;
    write_init(w, &files.init)?;
    let plan = Plan::new(config::resolve(&files.pipeline, &[])?)?;
    write_data(&plan, &files.data)?;
    Ok(files)
}

fn write_init(w: &Workload, path: &Path) -> anyhow::Result<()> {
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let arch = w.model();
    // The runner's own initialisation for run.seed = 0.
    let _model = arch.build(&vs.root(), 0..arch.layers().len(), &crate::model::BuildContext::new(0));
    let named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    write_npz(&named, path)
}

fn write_data(plan: &Plan, path: &Path) -> anyhow::Result<()> {
    let seed = plan.config.run.seed;
    let data = data::load(&plan.data, seed).map_err(anyhow::Error::msg)?;
    let epochs = plan.config.train.epochs;
    let rows = plan.data.rows;
    let perms: Vec<i64> = (1..=epochs).flat_map(|e| shard::permutation(seed, e, rows, true)).collect();
    let named = vec![
        ("train_x".to_string(), data.train_x.shallow_clone()),
        ("train_y".to_string(), data.train_y.shallow_clone()),
        ("permutations".to_string(), Tensor::from_slice(&perms).view([epochs as i64, rows as i64])),
    ];
    write_npz(&named, path)
}

fn write_npz(named: &[(String, Tensor)], path: &Path) -> anyhow::Result<()> {
    let part = path.with_extension("npz.part");
    Tensor::write_npz(named, &part).with_context(|| format!("cannot write {}", part.display()))?;
    std::fs::rename(&part, path).with_context(|| format!("cannot write {}", path.display()))
}
