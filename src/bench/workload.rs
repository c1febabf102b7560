//! What a benchmark workload is (the list: [`super::catalogue`]; the files both sides read:
//! [`super::files`]).
//!
//! A workload is one [`Kind`] (the model with its data), its training and its [`Peer`];
//! everything else (the pipeline, the data and weights files, the reference's model, the FLOP
//! count, the report's columns) follows from the kind and the peer, the same way for every kind.
//! Against PyTorch FSDP2 and DTensor the data is a token file (`tokens.bin`, nanoGPT's uint16
//! ids) that both sides read where it lies, and the twin derives the order of its windows itself.
use anyhow::Context;

use crate::config::schema::{self, Optimizer};
use crate::model::{self, Architecture};

/// Every workload's run.seed: the runner's initialisation, data and shuffles follow from it.
pub const SEED: u64 = 0;

/// The runner's `wrap.strategy` against PyTorch FSDP2: its sharded data parallelism.
pub const FSDP_STRATEGY: &str = "fsdp";

/// Synthetic tokens: the chance of a random next token instead of one of the current token's
/// four successors.
pub const TOKEN_NOISE: f64 = 0.5;

/// What the runner is measured against, in the same run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Peer {
    /// PyTorch DDP: benches/reference/ddp_torch.py under torchrun, from data.npz. The runner runs
    /// DDP, and a second time with MKL's kernels for this CPU (the price of portable numerics).
    TorchDdp,
    /// PyTorch FSDP2: benches/reference/fsdp2_torch.py under torchrun (a language model), from
    /// tokens.bin, at world sizes of 2 and more. The runner runs [`FSDP_STRATEGY`], and a second
    /// time with DDP: its own step, against which sharding is priced.
    TorchFsdp2 {
        /// Target: the runner's largest per-rank peak resident memory at most this × FSDP2's.
        memory: f64,
        /// Target: the runner's step at most this × its own DDP step, at world size
        /// [`DDP_STEP_WORLD_SIZE`].
        ddp_step: f64,
    },
    /// PyTorch DTensor tensor parallelism: benches/reference/tp_torch.py under torchrun (a
    /// language model, q, k, v and the MLP's first layer column-parallel, the projections out
    /// row-parallel), from tokens.bin, at world size `tensor` (data 1). The runner runs DDP with
    /// `[wrap.mesh] tensor`: each rank holds 1 / tensor of every block.
    TorchTp {
        /// Ranks each block is split across, on both sides.
        tensor: usize,
        /// Target: the runner's largest per-rank peak resident memory at most this × DTensor's.
        memory: f64,
    },
}

impl Peer {
    /// Its script, relative to the repository's root.
    pub fn script(&self) -> &'static str {
        match self {
            Peer::TorchDdp => "benches/reference/ddp_torch.py",
            Peer::TorchFsdp2 { .. } => "benches/reference/fsdp2_torch.py",
            Peer::TorchTp { .. } => "benches/reference/tp_torch.py",
        }
    }

    /// Ranks each block of the runner's model is split across (1 but against DTensor).
    pub fn tensor(&self) -> usize {
        match self {
            Peer::TorchTp { tensor, .. } => *tensor,
            _ => 1,
        }
    }

    /// Whether it reads the token file (the language-model twins) rather than data.npz.
    pub fn reads_tokens(&self) -> bool {
        !matches!(self, Peer::TorchDdp)
    }
}

/// Where the runner's sharded step is priced against its DDP step.
pub const DDP_STEP_WORLD_SIZE: usize = 2;

/// What a workload trains: the model kind with the synthetic data it learns from.
#[derive(Debug, Clone)]
pub enum Kind {
    /// Rows of `features` numbers (the synthetic teacher's), `classes` labels; an MLP.
    Mlp { features: usize, classes: usize, model: schema::Mlp },
    /// Synthetic images (`load.image`: class templates shifted, plus noise), `classes` labels; a CNN.
    Cnn { image: [usize; 3], classes: usize, model: schema::Cnn },
    /// Synthetic tokens (a random Markov chain over the vocabulary) cut into windows of
    /// seq_len + 1; a transformer language model.
    Transformer(schema::Transformer),
}

impl Kind {
    /// The `[wrap.model]` table.
    pub fn model(&self) -> schema::Model {
        match self {
            Kind::Mlp { model, .. } => schema::Model::Mlp(model.clone()),
            Kind::Cnn { model, .. } => schema::Model::Cnn(model.clone()),
            Kind::Transformer(t) => schema::Model::Transformer(t.clone()),
        }
    }

    /// One sample's input shape.
    pub fn input(&self) -> Vec<usize> {
        match self {
            Kind::Mlp { features, .. } => vec![*features],
            Kind::Cnn { image, .. } => image.to_vec(),
            Kind::Transformer(t) => vec![t.seq_len],
        }
    }

    /// The model's outputs per sample (per position for a language model).
    pub fn outputs(&self) -> usize {
        match self {
            Kind::Mlp { classes, .. } | Kind::Cnn { classes, .. } => *classes,
            Kind::Transformer(t) => t.vocab,
        }
    }

    pub fn arch(&self) -> Box<dyn Architecture> {
        model::architecture(&self.model(), &self.input(), self.outputs(), None)
    }

    /// The throughput columns of the report: a name and the units per sample. A CNN's sample is
    /// one image; a language model's one window of seq_len tokens.
    pub fn throughput_units(&self) -> Vec<(&'static str, f64)> {
        match self {
            Kind::Mlp { .. } => vec![("samples/s", 1.0)],
            Kind::Cnn { .. } => vec![("images/s", 1.0)],
            Kind::Transformer(t) => vec![("samples/s", 1.0), ("tokens/s", t.seq_len as f64)],
        }
    }

    /// Both sides scale the MLP's features to [0, 1] with the statistics of each rank's rows (as
    /// the seed pipeline does); images and tokens are used as they are.
    fn normalize(&self) -> &'static str {
        match self {
            Kind::Mlp { .. } => "minmax",
            Kind::Cnn { .. } | Kind::Transformer(_) => "none",
        }
    }

    /// The `[load]` keys of the kind's data.
    fn load(&self) -> String {
        match self {
            Kind::Mlp { features, classes, .. } => {
                format!("features = {features}\nclasses = {classes}\nnoise = 0.3\n")
            }
            // Noise 12 (against templates of ±1.5) keeps the task hard enough that the loss falls
            // from about 1.6 to 0.24 over the 3 epochs instead of reaching 0 in the first, so
            // bf16's and fp32's final losses compare meaningfully.
            Kind::Cnn { image: [c, h, w], classes, .. } => {
                format!("image = [{c}, {h}, {w}]\nclasses = {classes}\nnoise = 12.0\n")
            }
            Kind::Transformer(_) => format!("noise = {TOKEN_NOISE}\n"),
        }
    }

    /// "10000 × 10", "4096 images 3×32×32", "2048 windows of 64 tokens".
    fn data(&self, rows: usize) -> String {
        match self {
            Kind::Mlp { features, .. } => format!("{rows} × {features}"),
            Kind::Cnn { image: [c, h, w], classes, .. } => {
                format!("{rows} synthetic images {c}×{h}×{w} of {classes} classes")
            }
            Kind::Transformer(t) => format!("{rows} windows of {} synthetic tokens", t.seq_len),
        }
    }
}

/// What a workload is expected to reach; each applies at world sizes up to `world_sizes`.
#[derive(Debug, Clone)]
pub struct Targets {
    /// The runner's throughput at least this × PyTorch's.
    pub throughput: f64,
    /// A higher throughput target at world size 1, where it differs.
    pub throughput_ws1: Option<f64>,
    /// The runner's end-to-end wall time at most this × torchrun's.
    pub wall: Option<f64>,
    /// At world size 1, at least this percentage of the matmul peak.
    pub peak: Option<f64>,
    /// Where the throughput and wall-time targets apply (`None`: every world size).
    pub world_sizes: Option<usize>,
    /// Every epoch's loss within this of PyTorch's, relative (at every world size).
    pub loss: f64,
}

#[derive(Debug, Clone)]
pub struct Workload {
    pub name: &'static str,
    pub kind: Kind,
    /// Training samples (rows, images, windows).
    pub rows: usize,
    /// Per rank.
    pub batch: usize,
    pub epochs: usize,
    pub optimizer: Optimizer,
    pub lr: f64,
    pub weight_decay: f64,
    /// Its time goes to matrix products and convolutions: the report gives the share of the
    /// matmul peak, and `--precision bf16` runs it too. A workload bound by per-step overhead
    /// has nothing for bf16 to speed up, so it runs in fp32 only.
    pub compute_bound: bool,
    pub targets: Targets,
    /// Both sides autocast the forward pass to bfloat16 (`--precision bf16`).
    pub bf16: bool,
    pub peer: Peer,
}

impl Workload {
    pub fn parameters(&self) -> usize {
        model::layer_parameters(self.kind.arch().as_ref()).iter().sum()
    }

    /// Optimizer steps in an epoch at world size `ws`: each rank's share of the rows (padded,
    /// as DistributedSampler) in batches, the last one short.
    pub fn steps_per_epoch(&self, ws: usize) -> usize {
        self.rows.div_ceil(ws).div_ceil(self.batch)
    }

    /// FLOPs of training one sample: 3 × its forward pass ([`Architecture::forward_flops`]).
    pub fn train_flops_per_sample(&self) -> f64 {
        3.0 * self.kind.arch().forward_flops().expect("every bench kind counts its FLOPs")
    }

    /// "" in fp32, "-bf16" in bf16: the files of each precision apart.
    pub fn precision_tag(&self) -> &'static str {
        if self.bf16 {
            "-bf16"
        } else {
            ""
        }
    }

    /// "cnn", "cnn bf16": the workload in its precision, as the targets name it.
    /// The workload in float32 or, with `bf16`, with both sides autocasting to bfloat16. In bf16
    /// the runner must still beat PyTorch by 1.1× in the same precision; the share of the float32
    /// matmul peak is not a bf16 target.
    pub fn in_precision(self, bf16: bool) -> Workload {
        if !bf16 {
            return Workload { bf16, ..self };
        }
        let targets = Targets { throughput: 1.1, throughput_ws1: None, peak: None, ..self.targets };
        Workload { bf16, targets, ..self }
    }

    pub fn label(&self) -> String {
        if self.bf16 {
            format!("{} bf16", self.name)
        } else {
            self.name.to_owned()
        }
    }

    /// "adam", "adamw": as the pipeline and the reference's --optimizer spell it.
    pub fn optimizer_name(&self) -> String {
        serde_json::to_value(self.optimizer).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default()
    }

    pub fn describe(&self) -> String {
        let decay =
            if self.weight_decay > 0.0 { format!(" weight decay {}", self.weight_decay) } else { String::new() };
        format!(
            "{}, {} ({} parameters, {:.1} MFLOP per sample forward), batch {} per rank, {} epochs, {} lr {}{decay}{}",
            self.kind.data(self.rows),
            self.kind.arch().describe(),
            self.parameters(),
            self.train_flops_per_sample() / 3e6,
            self.batch,
            self.epochs,
            match self.optimizer {
                Optimizer::Sgd => "SGD",
                Optimizer::Adam => "Adam",
                Optimizer::Adamw => "AdamW",
            },
            self.lr,
            if self.bf16 { ", bf16 autocast (both sides)" } else { "" }
        )
    }

    pub(super) fn pipeline(&self) -> anyhow::Result<String> {
        let model = toml::Table::try_from(self.kind.model()).context("the model as TOML")?;
        let model: String = model.iter().map(|(k, v)| format!("{k} = {v}\n")).collect();
        // Against FSDP2 and DTensor: every window of the token file trains (none held out), and
        // the strategy's own keys keep their defaults.
        let tokens = format!("source = \"tokens\"\npath = \"{}\"\n", super::files::TOKENS);
        let (load, wrap, validate) = match self.peer {
            Peer::TorchDdp => (
                format!("source = \"synthetic\"\nrows = {}\nvalidation_rows = 0\n{}", self.rows, self.kind.load()),
                "strategy = \"ddp\"\nbucket_cap_mb = 25\ninit = \"init.npz\"\n".to_string(),
                "every = 0\n",
            ),
            Peer::TorchFsdp2 { .. } => {
                (tokens, format!("strategy = \"{FSDP_STRATEGY}\"\ninit = \"init.npz\"\n"), "every = 0\nrows = 0\n")
            }
            Peer::TorchTp { tensor, .. } => (
                tokens,
                format!("strategy = \"ddp\"\ninit = \"init.npz\"\n\n[wrap.mesh]\ntensor = {tensor}\n"),
                "every = 0\nrows = 0\n",
            ),
        };
        Ok(format!(
            "# Written by `runner bench` for the {name} workload; world size and threads come with --set.\n\
             [run]\nname = \"bench-{name}\"\nseed = {SEED}\nworld_size = 1\ntimeout_s = 300\n\n\
             [load]\n{load}\n\
             [shard]\nstrategy = \"dataset\"\nshuffle = true\ndrop_last = false\n\n\
             [normalize]\nmethod = \"{normalize}\"\nscope = \"rank\"\n\n\
             [wrap]\n{wrap}\n\
             [wrap.model]\n{model}\n\
             [train]\nepochs = {epochs}\nbatch_size = {batch}\noptimizer = \"{optimizer}\"\nlr = {lr}\n\
             weight_decay = {weight_decay:?}\n\n\
             [validate]\n{validate}",
            name = self.name,
            normalize = self.kind.normalize(),
            epochs = self.epochs,
            batch = self.batch,
            optimizer = self.optimizer_name(),
            lr = self.lr,
            weight_decay = self.weight_decay,
        ))
    }

    /// What the reference builds its model from: the `[wrap.model]` table, the sample's shape,
    /// the outputs and the normalisation.
    pub(super) fn reference_model(&self) -> serde_json::Value {
        serde_json::json!({
            "model": self.kind.model(),
            "input": self.kind.input(),
            "outputs": self.kind.outputs(),
            "normalize": self.kind.normalize(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::catalogue::all;

    #[test]
    fn the_throughput_columns_follow_the_kind() {
        let units: Vec<Vec<&str>> =
            all().iter().map(|w| w.kind.throughput_units().iter().map(|u| u.0).collect()).collect();
        let lm = vec!["samples/s", "tokens/s"];
        assert_eq!(units, [vec!["samples/s"], vec!["samples/s"], vec!["images/s"], lm.clone(), lm.clone(), lm]);
    }
}
