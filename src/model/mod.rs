//! Models, one module per `[wrap.model] kind`, each implementing [`Architecture`]: what the plan,
//! the pipeline partition, the memory check, the data-flow table, DDP, checkpoints and
//! `model.safetensors` need to know of a model. Adding a kind is one module here and one variant
//! of `config::schema::Model` (matched in [`architecture`] and [`check`]).
pub mod batchnorm;
pub mod cnn;
pub mod hf;
mod init;
pub mod mlp;
pub mod optim;
pub mod partition;
pub mod tensor_group;
pub mod torchscript;
pub mod transformer;
pub mod weights;

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tch::nn::{self, ModuleT};
use tch::Tensor;

use crate::config::schema::{ActivationCheckpointing, Lora, Model, Torchscript};
use batchnorm::StatsGroup;
pub use init::{load_init, InitWeights};
pub use weights::read_weights;

/// What building a model's layers takes besides its configuration and shapes.
#[derive(Debug, Clone, Default)]
pub struct BuildContext<'a> {
    /// Each layer's initial weights depend only on (seed, its index).
    pub seed: u64,
    /// The ranks whose batch statistics batch norm layers combine in training
    /// (`wrap.sync_batchnorm` under DDP: the data-parallel group, set by the wrap stage); `None`:
    /// each rank normalises by its own batch.
    pub batch_norm: Option<Arc<StatsGroup<'a>>>,
    /// The mesh's tensor group (`wrap.mesh.tensor` > 1): each layer holds its rank's slice of
    /// the parameters [`Architecture::tensor_slice`] cuts, and its forward pass sums the
    /// partial results across the group.
    pub tensor: Option<Arc<tensor_group::TensorGroup>>,
    /// Which blocks recompute their activations in the backward pass
    /// (`wrap.activation_checkpointing`; the plan allows it only for kinds that have blocks).
    pub checkpointing: ActivationCheckpointing,
}

impl BuildContext<'_> {
    /// Weights from `seed`, batch norm over this process's batch, every layer whole, every
    /// activation kept.
    pub fn new(seed: u64) -> BuildContext<'static> {
        BuildContext { seed, batch_norm: None, tensor: None, checkpointing: ActivationCheckpointing::default() }
    }
}

/// The part of a parameter one tensor rank holds: `ranges` of its dimension `dim`, concatenated
/// in order (Q, K and V's rows of one head group are three ranges of the fused `qkv`).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSlice {
    pub dim: i64,
    pub ranges: Vec<Range<i64>>,
}

impl TensorSlice {
    /// Rows (`dim` 0) or columns (`dim` 1) `k`/`n` of each of `blocks`, a tensor's consecutive
    /// parts of `len` each: Megatron's split of a fused matrix, each part cut the same way.
    pub fn of_blocks(dim: i64, blocks: &[i64], k: usize, n: usize) -> TensorSlice {
        let mut at = 0;
        let ranges = blocks
            .iter()
            .map(|&len| {
                let part = len / n as i64;
                let r = at + part * k as i64..at + part * (k as i64 + 1);
                at += len;
                r
            })
            .collect();
        TensorSlice { dim, ranges }
    }

    /// This slice of `whole`.
    pub fn cut(&self, whole: &Tensor) -> Tensor {
        let parts: Vec<Tensor> = self.ranges.iter().map(|r| whole.narrow(self.dim, r.start, r.end - r.start)).collect();
        Tensor::cat(&parts, self.dim)
    }

    /// `whole` with the slice's place in it set from `part` (what [`TensorSlice::cut`] took).
    pub fn put(&self, whole: &Tensor, part: &Tensor) {
        let mut at = 0;
        for r in &self.ranges {
            let n = r.end - r.start;
            whole.narrow(self.dim, r.start, n).copy_(&part.narrow(self.dim, at, n));
            at += n;
        }
    }
}

/// How a run computes its activations, which decides what they cost in memory.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Activations {
    pub checkpointing: ActivationCheckpointing,
    /// Under bf16 autocast: products in bfloat16.
    pub bf16: bool,
    /// The tensor ranks each block is split across (`wrap.mesh.tensor`; 0 and 1: whole).
    pub tensor: usize,
    /// Sequence parallelism (`wrap.mesh.sequence_parallel`): what runs between the split layers
    /// holds 1 / tensor of the sequence.
    pub sequence: bool,
}

/// One layer as the plan sees it. Layers are where a pipeline may cut the model.
#[derive(Debug, Clone, PartialEq)]
pub struct Layer {
    /// "linear 10 → 64".
    pub name: String,
    pub parameters: usize,
    /// The shape of one sample's output of this layer (its input is the previous layer's output,
    /// or the data's for layer 0).
    pub output: Vec<usize>,
    /// Values per sample the layer keeps inside it for the backward pass, besides its output
    /// (a convolution block's pre-pooling maps, a transformer block's attention and MLP
    /// intermediates): the memory estimate counts them.
    pub held: usize,
}

/// A model kind applied to the data's shapes: a sequence of layers, any contiguous range of
/// which can be built on its own (a pipeline stage) under the same parameter names as in the
/// whole model.
pub trait Architecture {
    /// "MLP 10-64-64-4".
    fn describe(&self) -> String;

    /// The layers in order.
    fn layers(&self) -> Vec<Layer>;

    /// Parameter names and shapes of layers `range`, in torch's module order (the order
    /// `Module.parameters()` gives for the same model): DDP's buckets follow it, so gradients are
    /// summed in the same order as torch's.
    fn parameters(&self, range: Range<usize>) -> Vec<(String, Vec<i64>)>;

    /// Names and shapes of the buffers of layers `range` (batch norm's running statistics):
    /// variables that are not trained but are saved with the parameters (checkpoints,
    /// `model.safetensors`) and read from `wrap.init`.
    fn buffers(&self, _range: Range<usize>) -> Vec<(String, Vec<i64>)> {
        Vec::new()
    }

    /// Layers `range` built under `p`. Each layer's initial weights depend only on (`ctx.seed`,
    /// its index), so the stages of a pipeline together equal the whole model on every rank. The
    /// built layers may hold on to `ctx`'s group (batch norm), hence the lifetime.
    fn build<'a>(&self, p: &nn::Path, range: Range<usize>, ctx: &BuildContext<'a>) -> Box<dyn ModuleT + 'a>;

    /// The layers whose parameters layer `layer`'s forward reads: its own, and another layer's
    /// where it shares a parameter with it (a transformer's output head tied to the token
    /// embedding reads layer 0's). Sharding gathers all of them around the layer.
    fn reads(&self, layer: usize) -> Vec<usize> {
        vec![layer]
    }

    /// Whether the parameter `name` is frozen: neither trained nor saved in checkpoints (a LoRA
    /// run's base model, read from `wrap.init` again on resume).
    fn frozen(&self, _name: &str) -> bool {
        false
    }

    /// Why a pipeline cannot hold the model in `stages` (one range of layers per rank), when
    /// parameters are shared across layers that the stages separate.
    fn check_stages(&self, _stages: &[Range<usize>]) -> Result<(), String> {
        Ok(())
    }

    /// Whether the model holds batch norm layers (`wrap.sync_batchnorm` applies only then); a kind
    /// with batch norm builds them with [`batchnorm::SyncBatchNorm`], synchronised over
    /// [`BuildContext::batch_norm`] when it is set.
    fn has_batch_norm(&self) -> bool {
        false
    }

    /// Of the batch norm layers, the fewest values each channel has per sample (the pixels of
    /// its maps): a training batch of `rows` gives it `rows ×` this to normalise by. `None`
    /// without batch norm layers.
    fn batch_norm_values(&self) -> Option<usize> {
        None
    }

    /// Floating-point operations of one sample's forward pass through the whole model, counted
    /// from the layers' shapes: the matrix products and convolutions, 2 per multiply-add
    /// (activations, norms, pooling, softmax and biases are left out: elementwise, a few percent at
    /// most). Training a sample takes 3 × this (the backward pass computes two products per
    /// forward one). `None` where the kind does not know its shapes (TorchScript).
    fn forward_flops(&self) -> Option<f64> {
        None
    }

    /// The slice of parameter `name` tensor rank `k` of `n` holds; `None`: every rank holds it
    /// whole (norms, embeddings, an output head). A kind without slices refuses tensor > 1 on
    /// the plan.
    fn tensor_slice(&self, _name: &str, _k: usize, _n: usize) -> Option<TensorSlice> {
        None
    }

    /// Bytes of activations a rank holds at its peak, training on `batch` samples or validating
    /// `validation` at once, where the kind counts them itself (what its kernels keep, in their
    /// dtypes, under checkpointing); `None`: the generic count of `limits::estimate` (every
    /// layer's output and [`Layer::held`], float32).
    fn activation_bytes(&self, _batch: usize, _validation: usize, _how: &Activations) -> Option<f64> {
        None
    }
}

/// The architecture of `model` for inputs of shape `input` (one sample) and `outputs` values out,
/// with `lora`'s adapters (checked by the plan: [`transformer::lora::resolve`]).
pub fn architecture(model: &Model, input: &[usize], outputs: usize, lora: Option<&Lora>) -> Box<dyn Architecture> {
    match model {
        Model::Mlp(m) => Box::new(mlp::MlpArch::new(m, input, outputs)),
        // The plan cuts the data into windows of the model's own seq_len over its vocab.
        Model::Transformer(t) => {
            let adapters = lora.and_then(|l| transformer::lora::resolve(&transformer::Spec::of(t), l).ok());
            Box::new(transformer::TransformerArch::new(t).with_lora(adapters))
        }
        Model::Cnn(m) => Box::new(cnn::CnnArch::new(m, input, outputs)),
        // The path was resolved against the pipeline file ([`resolve_paths`]) and checked by the plan.
        Model::Torchscript(t) => Box::new(torchscript::TorchScriptArch::new(&t.path, outputs)),
    }
}

/// `model` with the files it names resolved against `base` (the pipeline file's folder).
pub fn resolve_paths(model: &Model, base: &Path) -> Model {
    match model {
        Model::Torchscript(t) => Model::Torchscript(Torchscript { path: base.join(&t.path) }),
        m => m.clone(),
    }
}

/// The files `model` reads, with their keys (after [`resolve_paths`]).
pub fn files(model: &Model) -> Vec<(&'static str, PathBuf)> {
    match model {
        Model::Torchscript(t) => vec![("wrap.model.path", t.path.clone())],
        _ => Vec::new(),
    }
}

/// Checks the model against the data's sample shape `input` and `outputs` (`model` resolved by
/// [`resolve_paths`]); `false` when [`architecture`] cannot be made from them. A TorchScript
/// module runs on `probe`, a batch of the data (made only for it); without one (the data could
/// not be read) it is only loaded.
pub fn check_input(
    model: &Model,
    input: &[usize],
    outputs: usize,
    probe: impl FnOnce() -> Option<torchscript::Probe>,
    bad: &mut impl FnMut(&str, String),
) -> bool {
    match model {
        Model::Mlp(_) | Model::Transformer(_) => true,
        Model::Cnn(m) => cnn::check_input(m, input, bad),
        Model::Torchscript(t) => {
            if let Err(e) = crate::input::regular_file(&t.path) {
                bad("wrap.model.path", e);
                return false;
            }
            let checked = match probe() {
                Some(probe) => torchscript::check(&t.path, probe),
                None => torchscript::describe(&t.path, outputs),
            };
            match checked {
                Ok(_) => true,
                Err(e) => {
                    bad("wrap.model.path", e);
                    false
                }
            }
        }
    }
}

/// Checks the model's own keys, before any shape is known; `false` when a size is out of the
/// bounds within which its shapes can be computed.
pub fn check(model: &Model, bad: &mut impl FnMut(&str, String)) -> bool {
    match model {
        Model::Mlp(m) => mlp::check(m, bad),
        Model::Cnn(m) => cnn::check(m, bad),
        Model::Torchscript(_) => true,
        Model::Transformer(t) => transformer::check(t, bad),
    }
}

/// How a model shards under FSDP (`strategy::fsdp`): one unit per layer that has parameters, each layer reading its
/// own unit and those of the layers it shares parameters with ([`Architecture::reads`]).
pub fn shard_units(arch: &dyn Architecture) -> crate::dist::Units {
    let layers = arch.layers().len();
    let counts: Vec<usize> = (0..layers).map(|l| sharded_parameters(arch, l..l + 1).len()).collect();
    // The unit of each layer with parameters.
    let mut unit_of = vec![None; layers];
    let mut sizes = Vec::new();
    for (l, &n) in counts.iter().enumerate() {
        if n > 0 {
            unit_of[l] = Some(sizes.len());
            sizes.push(n);
        }
    }
    let layers = (0..layers).map(|l| arch.reads(l).into_iter().filter_map(|r| unit_of[r]).collect()).collect();
    crate::dist::Units { sizes, layers }
}

/// The parameters of layers `range` that FSDP shards, in module order: all of them, but in a
/// model with frozen parameters (a LoRA run) the frozen base alone. Its trained adapters are a
/// fraction of a percent of it: each rank holds them whole, and their gradients are all-reduced,
/// which is cheaper than a unit of its own to gather and reduce-scatter around every layer.
pub fn sharded_parameters(arch: &dyn Architecture, range: Range<usize>) -> Vec<(String, Vec<i64>)> {
    let mut v = arch.parameters(range);
    if has_frozen(arch) {
        v.retain(|(name, _)| arch.frozen(name));
    }
    v
}

/// Whether some parameter of the model is frozen (a LoRA run's base).
pub fn has_frozen(arch: &dyn Architecture) -> bool {
    arch.parameters(0..arch.layers().len()).iter().any(|(name, _)| arch.frozen(name))
}

/// MiB of `parameters` float32 values.
pub fn parameter_mib(parameters: usize) -> f64 {
    (parameters * 4) as f64 / (1024.0 * 1024.0)
}

/// "layer 3", "layers 3-5".
pub fn layers_text(r: &Range<usize>) -> String {
    if r.len() == 1 {
        format!("layer {}", r.start)
    } else {
        format!("layers {}-{}", r.start, r.end - 1)
    }
}

/// Parameters of each layer.
pub fn layer_parameters(arch: &dyn Architecture) -> Vec<usize> {
    arch.layers().iter().map(|l| l.parameters).collect()
}

/// The parameter and buffer names and shapes of the whole model, sorted by name (as a VarStore
/// lists them, and as checkpoints and weights files record them).
pub fn sorted_parameters(arch: &dyn Architecture) -> Vec<(String, Vec<i64>)> {
    let all = 0..arch.layers().len();
    let mut v = arch.parameters(all.clone());
    v.extend(arch.buffers(all));
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The parameters and buffers a checkpoint holds, sorted by name: [`sorted_parameters`] but the
/// frozen ones ([`Architecture::frozen`]).
pub fn saved_parameters(arch: &dyn Architecture) -> Vec<(String, Vec<i64>)> {
    let mut v = sorted_parameters(arch);
    v.retain(|(name, _)| !arch.frozen(name));
    v
}

/// The parameters the optimizer trains, in the architecture's module order (names and shapes):
/// all but the frozen ones.
pub fn trained_parameters(arch: &dyn Architecture) -> Vec<(String, Vec<i64>)> {
    let mut v = arch.parameters(0..arch.layers().len());
    v.retain(|(name, _)| !arch.frozen(name));
    v
}

/// The variables of `vs` in the architecture's module order for layers `range`.
pub fn parameters_in_module_order(arch: &dyn Architecture, range: Range<usize>, vs: &nn::VarStore) -> Vec<Tensor> {
    let vars = vs.variables();
    arch.parameters(range).iter().map(|(name, _)| vars[name].shallow_clone()).collect()
}

/// The trainable variables of `vs` with their names, in the store's own order (the order its
/// `trainable_variables` gives, which the optimizer and gradient clipping have always used).
pub fn named_trainable(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    vs.trainable_variables()
        .into_iter()
        .map(|t| {
            // The same variable: the same storage and shape (a name is taken once).
            let at = named
                .iter()
                .position(|(_, v)| v.data_ptr() == t.data_ptr() && v.size() == t.size())
                .expect("every trainable variable has a name");
            (named.remove(at).0, t)
        })
        .collect()
}

/// For the model kinds' tests: `arch` built as the stages `cuts` (fresh variable stores, the same
/// seed) and run one after another gives the whole model's output on `x`, to the bit.
#[cfg(test)]
pub(crate) fn assert_stages_equal_whole(arch: &dyn Architecture, x: &Tensor, cuts: &[Range<usize>]) {
    let build = |r: Range<usize>| arch.build(&nn::VarStore::new(tch::Device::Cpu).root(), r, &BuildContext::new(7));
    let whole = build(0..arch.layers().len());
    let piped = cuts.iter().fold(x.shallow_clone(), |h, r| build(r.clone()).forward_t(&h, false));
    assert!(whole.forward_t(x, false).equal(&piped));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_files_are_checked_against_the_model() {
        let dir = tempfile::tempdir().unwrap();
        let m = crate::config::schema::Mlp { hidden: vec![4], ..Default::default() };
        let arch = mlp::MlpArch::new(&m, &[3], 2);
        let shapes = sorted_parameters(&arch);
        let good: Vec<(String, Tensor)> = shapes
            .iter()
            .map(|(n, s)| (n.clone(), Tensor::ones(s.as_slice(), (tch::Kind::Double, tch::Device::Cpu))))
            .collect();
        let path = dir.path().join("init.npz");
        Tensor::write_npz(&good, &path).unwrap();
        let read = read_weights(&path, &shapes).unwrap();
        assert_eq!(read.len(), 4);
        assert_eq!(read["layer0.weight"].kind(), tch::Kind::Float);

        let mut bad: Vec<(String, Tensor)> = good.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        bad.retain(|(n, _)| n != "layer1.bias");
        bad[0].1 = Tensor::ones([5, 3], (tch::Kind::Float, tch::Device::Cpu));
        bad.push(("head.weight".into(), Tensor::ones([1], (tch::Kind::Float, tch::Device::Cpu))));
        let path = dir.path().join("bad.npz");
        Tensor::write_npz(&bad, &path).unwrap();
        let err = read_weights(&path, &shapes).unwrap_err();
        assert!(err.ends_with("does not fit the model: `layer0.bias` is [5, 3], the model's is [4]; no `layer1.bias`; unexpected `head.weight`"), "{err}");
        assert!(read_weights(&dir.path().join("none.npz"), &shapes).unwrap_err().contains("does not exist"));
    }
}
