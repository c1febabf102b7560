//! Models built from `[wrap.model]`: an MLP over the features, logits over the classes.
pub mod optim;
pub mod partition;

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use tch::nn::{self, Module, ModuleT};
use tch::Tensor;

use crate::config::schema::{Activation, Model};
use crate::rng::Rng;

/// Linear layers with an activation (and dropout) between them: the whole model, or the
/// contiguous layers one pipeline stage holds.
#[derive(Debug)]
pub struct Mlp {
    /// Each layer with its index in the whole model (the activation goes before every layer but
    /// the model's first).
    layers: Vec<(usize, nn::Linear)>,
    activation: Activation,
    dropout: f64,
}

impl Mlp {
    /// The whole model.
    pub fn new(p: &nn::Path, features: usize, m: &Model, classes: usize, seed: u64) -> Mlp {
        Mlp::stage(p, features, m, classes, seed, 0..m.hidden.len() + 1)
    }

    /// Layers `range` of the model, named `layer{i}` as in the whole model. Layer i's initial
    /// weights depend only on (seed, i), so the stages of a pipeline together equal the whole model.
    pub fn stage(p: &nn::Path, features: usize, m: &Model, classes: usize, seed: u64, range: Range<usize>) -> Mlp {
        let widths = widths(features, &m.hidden, classes);
        let layers =
            range.map(|i| (i, init_linear(&(p / format!("layer{i}")), widths[i], widths[i + 1], seed, i))).collect();
        Mlp { layers, activation: m.activation, dropout: m.dropout }
    }
}

/// A linear layer with tch's default initialisation (weights uniform in ±√(6 / in), biases in
/// ±1 / √in), drawn from the layer's own stream of our generator rather than libtorch's global one:
/// the same numbers whatever else draws random numbers, in whichever thread.
fn init_linear(p: &nn::Path, inputs: usize, outputs: usize, seed: u64, layer: usize) -> nn::Linear {
    let mut rng = Rng::new(seed, LAYER_STREAM + layer as u64);
    let mut uniform = |n: usize, bound: f64| -> Tensor {
        let v: Vec<f32> = (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32).collect();
        Tensor::from_slice(&v)
    };
    let fan_in = inputs as f64;
    let w = uniform(inputs * outputs, (6.0 / fan_in).sqrt()).view([outputs as i64, inputs as i64]);
    let b = uniform(outputs, 1.0 / fan_in.sqrt());
    nn::Linear { ws: p.var_copy("weight", &w), bs: Some(p.var_copy("bias", &b)) }
}

/// Separates the layers' streams from other uses of the run's seed.
const LAYER_STREAM: u64 = 0x1A7E_0000;

impl ModuleT for Mlp {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let mut h = x.shallow_clone();
        for (i, layer) in &self.layers {
            if *i > 0 {
                h = match self.activation {
                    Activation::Relu => h.relu(),
                    Activation::Tanh => h.tanh(),
                    Activation::Gelu => h.gelu("none"),
                };
                if self.dropout > 0.0 {
                    h = h.dropout(self.dropout, train);
                }
            }
            h = layer.forward(&h);
        }
        h
    }
}

/// Input width, hidden widths, classes: layer i maps widths[i] to widths[i + 1].
pub fn widths(features: usize, hidden: &[usize], classes: usize) -> Vec<usize> {
    std::iter::once(features).chain(hidden.iter().copied()).chain([classes]).collect()
}

/// Weights and biases of each layer, computed from the widths alone (the plan uses it).
pub fn layer_parameters(features: usize, hidden: &[usize], classes: usize) -> Vec<usize> {
    widths(features, hidden, classes).windows(2).map(|w| w[0] * w[1] + w[1]).collect()
}

/// The parameter names and shapes of layers `range`, in the order a VarStore sorts them.
pub fn layer_shapes(features: usize, hidden: &[usize], classes: usize, range: Range<usize>) -> Vec<(String, Vec<i64>)> {
    let w = widths(features, hidden, classes);
    let mut v: Vec<(String, Vec<i64>)> = range
        .flat_map(|i| {
            let (i_, o) = (w[i] as i64, w[i + 1] as i64);
            [(format!("layer{i}.bias"), vec![o]), (format!("layer{i}.weight"), vec![o, i_])]
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Weights and biases of the whole MLP.
pub fn parameter_count(features: usize, hidden: &[usize], classes: usize) -> usize {
    layer_parameters(features, hidden, classes).iter().sum()
}

/// The parameters in the order torch's `Module.parameters()` gives for the same MLP: layer by
/// layer, weight then bias, whatever order the VarStore created them in. DDP's bucket layouts follow this order,
/// so gradients are summed in the same order as torch's.
pub fn parameters_in_module_order(vs: &nn::VarStore) -> Vec<Tensor> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    let key = |name: &str| {
        let (layer, kind) = name.split_once('.').unwrap_or((name, ""));
        (layer.trim_start_matches("layer").parse::<usize>().unwrap_or(usize::MAX), kind != "weight", name.to_owned())
    };
    named.sort_by_key(|(name, _)| key(name));
    named.into_iter().map(|(_, t)| t).collect()
}

/// Reads a weights file (.npz or .safetensors) holding exactly the parameters of `shapes`,
/// as float32; says what is missing, extra or misshapen otherwise.
pub fn read_weights(path: &Path, shapes: &[(String, Vec<i64>)]) -> Result<BTreeMap<String, Tensor>, String> {
    if !path.exists() {
        return Err(format!("{} does not exist (paths are relative to the pipeline file)", path.display()));
    }
    crate::input::regular_file(path)?;
    let read = match path.extension().and_then(|e| e.to_str()) {
        Some("npz") => Tensor::read_npz(path),
        Some("safetensors") => Tensor::read_safetensors(path),
        _ => return Err(format!("{}: use an .npz or .safetensors file", path.display())),
    };
    let mut tensors: BTreeMap<String, Tensor> =
        read.map_err(|e| format!("cannot read {}: {e}", path.display()))?.into_iter().collect();
    let mut problems = Vec::new();
    let mut out = BTreeMap::new();
    for (name, shape) in shapes {
        match tensors.remove(name) {
            None => problems.push(format!("no `{name}`")),
            Some(t) if t.size() != *shape => {
                problems.push(format!("`{name}` is {:?}, the model's is {shape:?}", t.size()))
            }
            Some(t) if !t.is_floating_point() => problems.push(format!("`{name}` holds {:?}, not floats", t.kind())),
            Some(t) if t.isfinite().all().int64_value(&[]) == 0 => {
                let bad = t.numel() as i64 - t.isfinite().sum(tch::Kind::Int64).int64_value(&[]);
                problems.push(format!("`{name}` holds {bad} NaN or infinite values"))
            }
            Some(t) => {
                out.insert(name.clone(), t.to_kind(tch::Kind::Float));
            }
        }
    }
    if !tensors.is_empty() {
        problems
            .push(format!("unexpected {}", tensors.keys().map(|k| format!("`{k}`")).collect::<Vec<_>>().join(", ")));
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(format!("{} does not fit the model: {}", path.display(), problems.join("; ")))
    }
}

/// "10-64-64-4" for a model's widths.
pub fn describe(features: usize, hidden: &[usize], classes: usize) -> String {
    widths(features, hidden, classes).iter().map(|w| w.to_string()).collect::<Vec<_>>().join("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_count_matches_the_built_model() {
        let m = Model { hidden: vec![64, 32], ..Model::default() };
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let _mlp = Mlp::new(&vs.root(), 10, &m, 4, 0);
        let built: i64 = vs.trainable_variables().iter().map(|t| t.numel() as i64).sum();
        assert_eq!(built as usize, parameter_count(10, &m.hidden, 4));
        assert_eq!(describe(10, &m.hidden, 4), "10-64-32-4");
        let mut named: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
        named.sort();
        assert_eq!(named, layer_shapes(10, &m.hidden, 4, 0..3));
        let sizes: Vec<Vec<i64>> = parameters_in_module_order(&vs).iter().map(|t| t.size()).collect();
        assert_eq!(sizes, [vec![64, 10], vec![64], vec![32, 64], vec![32], vec![4, 32], vec![4]]);
    }

    #[test]
    fn weights_files_are_checked_against_the_model() {
        let dir = tempfile::tempdir().unwrap();
        let shapes = layer_shapes(3, &[4], 2, 0..2);
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

    #[test]
    fn stages_together_equal_the_whole_model() {
        let m = Model { hidden: vec![8, 8, 8], ..Model::default() };
        let x = Tensor::randn([5, 6], (tch::Kind::Float, tch::Device::Cpu));
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let whole = Mlp::new(&vs.root(), 6, &m, 3, 7);
        let stages: Vec<Mlp> = [0..1, 1..3, 3..4]
            .into_iter()
            .map(|r| Mlp::stage(&nn::VarStore::new(tch::Device::Cpu).root(), 6, &m, 3, 7, r))
            .collect();
        let piped = stages.iter().fold(x.shallow_clone(), |h, s| s.forward_t(&h, false));
        assert!(whole.forward_t(&x, false).equal(&piped));
    }
}
