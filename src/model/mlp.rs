//! `kind = "mlp"`: linear layers with an activation (and dropout) between them, over rows of
//! features, logits over the classes. Layer i is `layer{i}` (`.weight`, `.bias`).
use std::ops::Range;

use tch::nn::{self, Module, ModuleT};
use tch::Tensor;

use std::sync::Arc;

use super::tensor_group::TensorGroup;
use super::{Architecture, BuildContext, Layer, TensorSlice};
use crate::config::schema::{Activation, ActivationCheckpointing, Mlp};
use crate::rng::Rng;

/// The keys' own bounds; `false` when the widths are too large to compute shapes from.
pub fn check(m: &Mlp, bad: &mut impl FnMut(&str, String)) -> bool {
    use crate::limits::{MAX_LAYERS, MAX_WIDTH};
    if m.hidden.contains(&0) {
        bad("wrap.model.hidden", format!("layer widths must be at least 1, got {:?}", m.hidden));
    }
    let mut ok = true;
    if m.hidden.len() > MAX_LAYERS {
        bad("wrap.model.hidden", format!("{} is more than the {MAX_LAYERS} the runner takes", m.hidden.len()));
        ok = false;
    }
    if let Some(w) = m.hidden.iter().copied().max().filter(|&w| w > MAX_WIDTH) {
        bad("wrap.model.hidden", format!("{w} is more than the {MAX_WIDTH} the runner takes"));
        ok = false;
    }
    if !(0.0..1.0).contains(&m.dropout) {
        bad("wrap.model.dropout", format!("must be in [0, 1), got {}", m.dropout));
    }
    ok
}

/// An MLP's configuration with the data's widths.
#[derive(Debug, Clone)]
pub struct MlpArch {
    /// Input width, hidden widths, outputs: layer i maps widths[i] to widths[i + 1].
    widths: Vec<usize>,
    activation: Activation,
    dropout: f64,
}

impl MlpArch {
    pub fn new(m: &Mlp, input: &[usize], outputs: usize) -> MlpArch {
        let features = input.iter().product();
        let widths = std::iter::once(features).chain(m.hidden.iter().copied()).chain([outputs]).collect();
        MlpArch { widths, activation: m.activation, dropout: m.dropout }
    }
}

impl Architecture for MlpArch {
    fn describe(&self) -> String {
        format!("MLP {}", self.widths.iter().map(|w| w.to_string()).collect::<Vec<_>>().join("-"))
    }

    fn layers(&self) -> Vec<Layer> {
        self.widths
            .windows(2)
            .map(|w| Layer {
                name: format!("linear {} → {}", w[0], w[1]),
                parameters: w[0] * w[1] + w[1],
                output: vec![w[1]],
                // The pre-activation is counted with every output (limits::estimate).
                held: 0,
            })
            .collect()
    }

    fn parameters(&self, range: Range<usize>) -> Vec<(String, Vec<i64>)> {
        range
            .flat_map(|i| {
                let (inputs, outputs) = (self.widths[i] as i64, self.widths[i + 1] as i64);
                [(format!("layer{i}.weight"), vec![outputs, inputs]), (format!("layer{i}.bias"), vec![outputs])]
            })
            .collect()
    }

    fn forward_flops(&self) -> Option<f64> {
        Some(self.widths.windows(2).map(|w| 2.0 * (w[0] * w[1]) as f64).sum())
    }

    fn build<'a>(&self, p: &nn::Path, range: Range<usize>, ctx: &BuildContext<'a>) -> Box<dyn ModuleT + 'a> {
        let at = ctx.tensor.as_ref().map(|g| (g.rank(), g.size()));
        let layers = range
            .map(|i| {
                let cut = |leaf: &str| at.and_then(|(k, n)| self.tensor_slice(&format!("layer{i}.{leaf}"), k, n));
                let (inputs, outputs) = (self.widths[i], self.widths[i + 1]);
                (i, init_linear(&(p / format!("layer{i}")), inputs, outputs, ctx.seed, i, &cut))
            })
            .collect();
        Box::new(MlpStage {
            layers,
            activation: self.activation,
            dropout: self.dropout,
            checkpointing: ctx.checkpointing,
            tensor: ctx.tensor.clone(),
        })
    }

    /// Megatron's pairs: layer 0 column-parallel (each tensor rank its share of the outputs),
    /// layer 1 row-parallel (the same share of its inputs, the partial outputs summed), and so on;
    /// a last layer left without a partner (an odd count) is replicated.
    fn tensor_slice(&self, name: &str, k: usize, n: usize) -> Option<TensorSlice> {
        let (layer, leaf) = name.strip_prefix("layer")?.split_once('.')?;
        let i: usize = layer.parse().ok()?;
        let (layers, outputs) = (self.widths.len() - 1, self.widths[i + 1] as i64);
        match (i % 2, leaf) {
            (0, _) if i + 1 < layers => Some(TensorSlice::of_blocks(0, &[outputs], k, n)),
            (1, "weight") => Some(TensorSlice::of_blocks(1, &[self.widths[i] as i64], k, n)),
            _ => None,
        }
    }
}

/// Whether layer `i` of `layers` is row-parallel under tensor parallelism (its input is split).
fn row_parallel(i: usize) -> bool {
    i % 2 == 1
}

/// The built layers of an MLP: the whole model, or the contiguous layers one pipeline stage holds.
#[derive(Debug)]
struct MlpStage {
    /// Each layer with its index in the whole model (the activation goes before every layer but
    /// the model's first).
    layers: Vec<(usize, nn::Linear)>,
    activation: Activation,
    dropout: f64,
    /// Which layers recompute their activations in the backward pass: layer i ≥ 1 is block i - 1
    /// (its activation, dropout and product; the first layer reads the data).
    checkpointing: ActivationCheckpointing,
    /// Under tensor parallelism, the group the layers' pairs are split across.
    tensor: Option<Arc<TensorGroup>>,
}

/// A linear layer with tch's default initialisation (weights uniform in ±√(6 / in), biases in
/// ±1 / √in), drawn from the layer's own stream of our generator rather than libtorch's global one:
/// the same numbers whatever else draws random numbers, in whichever thread. `cut`: the slice of
/// the weight or bias this tensor rank keeps (`None`: whole).
pub(super) fn init_linear(
    p: &nn::Path,
    inputs: usize,
    outputs: usize,
    seed: u64,
    layer: usize,
    cut: &dyn Fn(&str) -> Option<TensorSlice>,
) -> nn::Linear {
    let mut rng = Rng::new(seed, LAYER_STREAM + layer as u64);
    let mut uniform = |n: usize, bound: f64| -> Tensor {
        let v: Vec<f32> = (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32).collect();
        Tensor::from_slice(&v)
    };
    let fan_in = inputs as f64;
    let w = uniform(inputs * outputs, (6.0 / fan_in).sqrt()).view([outputs as i64, inputs as i64]);
    let b = uniform(outputs, 1.0 / fan_in.sqrt());
    let keep = |leaf: &str, whole: Tensor| cut(leaf).map_or(whole.shallow_clone(), |s| s.cut(&whole));
    nn::Linear { ws: p.var_copy("weight", &keep("weight", w)), bs: Some(p.var_copy("bias", &keep("bias", b))) }
}

/// Separates the layers' streams from other uses of the run's seed.
const LAYER_STREAM: u64 = 0x1A7E_0000;

fn activate(activation: Activation, h: &Tensor) -> Tensor {
    match activation {
        Activation::Relu => h.relu(),
        Activation::Tanh => h.tanh(),
        Activation::Gelu => h.gelu("none"),
    }
}

impl ModuleT for MlpStage {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let mut h = x.shallow_clone();
        for (i, layer) in &self.layers {
            let step = self.step(*i, layer);
            h = if *i > 0 && train && self.checkpointing.applies(i - 1) {
                // The recomputation owns its handles on the layer's parameters (and the group).
                let params = [layer.ws.shallow_clone(), layer.bs.as_ref().expect("a bias").shallow_clone()];
                let recompute = move |x: &Tensor| step.forward(x, train);
                // A forward pass returns no Result: a failure ends the rank.
                crate::dist::checkpoint(&h, &params, recompute).unwrap_or_else(|e| crate::checked::fail(e.to_string()))
            } else {
                step.forward(&h, train)
            };
        }
        h
    }
}

impl MlpStage {
    fn step(&self, i: usize, layer: &nn::Linear) -> LayerStep {
        let layer = nn::Linear { ws: layer.ws.shallow_clone(), bs: layer.bs.as_ref().map(Tensor::shallow_clone) };
        let split = self.tensor.clone().map(|g| {
            let column = !row_parallel(i) && self.layers.iter().any(|(j, _)| *j == i + 1);
            (
                g,
                if row_parallel(i) {
                    Split::Row
                } else if column {
                    Split::Column
                } else {
                    Split::Whole
                },
            )
        });
        LayerStep { first: i == 0, layer, activation: self.activation, dropout: self.dropout, split }
    }
}

/// How a tensor rank runs a layer: column-parallel (a row-parallel partner follows it),
/// row-parallel, or whole (a last layer without a partner).
#[derive(Clone, Copy)]
enum Split {
    Column,
    Row,
    Whole,
}

/// One layer's step, owning what it reads: on the previous layer's output the activation,
/// dropout and the product; the first layer reads the (flattened) data.
struct LayerStep {
    first: bool,
    layer: nn::Linear,
    activation: Activation,
    dropout: f64,
    split: Option<(Arc<TensorGroup>, Split)>,
}

impl LayerStep {
    /// Under tensor parallelism a column-parallel layer takes the whole input and a row-parallel
    /// one this rank's part of it, its dropout drawn whole as one process draws it.
    fn forward(&self, h: &Tensor, train: bool) -> Tensor {
        if self.first {
            let h = if h.dim() > 2 { h.flatten(1, -1) } else { h.shallow_clone() };
            return self.product(&h);
        }
        let mut h = activate(self.activation, h);
        if self.dropout > 0.0 {
            h = match &self.split {
                Some((g, Split::Row)) => g.dropout(&h, self.dropout, 1, train),
                _ => h.dropout(self.dropout, train),
            };
        }
        self.product(&h)
    }

    fn product(&self, h: &Tensor) -> Tensor {
        match (&self.split, self.layer.bs.as_ref()) {
            (Some((g, Split::Row)), Some(b)) => g.leave(&h.linear(&self.layer.ws, None::<Tensor>)) + b,
            (Some((g, Split::Column)), _) => self.layer.forward(&g.enter(h)),
            _ => self.layer.forward(h),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{parameters_in_module_order, sorted_parameters};

    #[test]
    fn parameter_counts_and_shapes_match_the_built_model() {
        let m = Mlp { hidden: vec![64, 32], ..Mlp::default() };
        let arch = MlpArch::new(&m, &[10], 4);
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let _net = arch.build(&vs.root(), 0..3, &BuildContext::new(0));
        let built: i64 = vs.trainable_variables().iter().map(|t| t.numel() as i64).sum();
        assert_eq!(built as usize, arch.layers().iter().map(|l| l.parameters).sum::<usize>());
        assert_eq!(arch.describe(), "MLP 10-64-32-4");
        let mut named: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
        named.sort();
        assert_eq!(named, sorted_parameters(&arch));
        let sizes: Vec<Vec<i64>> = parameters_in_module_order(&arch, 0..3, &vs).iter().map(|t| t.size()).collect();
        assert_eq!(sizes, [vec![64, 10], vec![64], vec![32, 64], vec![32], vec![4, 32], vec![4]]);
        assert_eq!(arch.forward_flops(), Some(2.0 * (10.0 * 64.0 + 64.0 * 32.0 + 32.0 * 4.0)));
    }

    #[test]
    fn stages_together_equal_the_whole_model() {
        let m = Mlp { hidden: vec![8, 8, 8], ..Mlp::default() };
        let arch = MlpArch::new(&m, &[6], 3);
        let x = Tensor::randn([5, 6], (tch::Kind::Float, tch::Device::Cpu));
        crate::model::assert_stages_equal_whole(&arch, &x, &[0..1, 1..3, 3..4]);
    }
}
