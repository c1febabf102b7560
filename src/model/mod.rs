//! Models built from `[wrap.model]`: an MLP over the features, logits over the classes.
pub mod optim;

use std::collections::BTreeMap;
use std::path::Path;

use tch::nn::{self, Module, ModuleT};
use tch::Tensor;

use crate::config::schema::{Activation, Model};

/// Linear layers with an activation (and dropout) between them.
#[derive(Debug)]
pub struct Mlp {
    layers: Vec<nn::Linear>,
    activation: Activation,
    dropout: f64,
}

impl Mlp {
    pub fn new(p: &nn::Path, features: usize, m: &Model, classes: usize) -> Mlp {
        let widths: Vec<i64> =
            std::iter::once(features).chain(m.hidden.iter().copied()).chain([classes]).map(|w| w as i64).collect();
        let layers = widths
            .windows(2)
            .enumerate()
            .map(|(i, w)| nn::linear(p / format!("layer{i}"), w[0], w[1], Default::default()))
            .collect();
        Mlp { layers, activation: m.activation, dropout: m.dropout }
    }
}

impl ModuleT for Mlp {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let last = self.layers.len() - 1;
        let mut h = self.layers[0].forward(x);
        for layer in &self.layers[1..=last] {
            h = match self.activation {
                Activation::Relu => h.relu(),
                Activation::Tanh => h.tanh(),
                Activation::Gelu => h.gelu("none"),
            };
            if self.dropout > 0.0 {
                h = h.dropout(self.dropout, train);
            }
            h = layer.forward(&h);
        }
        h
    }
}

/// Weights and biases of the MLP, computed from the widths alone (the plan uses it).
pub fn parameter_count(features: usize, hidden: &[usize], classes: usize) -> usize {
    let widths: Vec<usize> = std::iter::once(features).chain(hidden.iter().copied()).chain([classes]).collect();
    widths.windows(2).map(|w| w[0] * w[1] + w[1]).sum()
}

/// The parameters in the order torch's `Module.parameters()` gives for the same MLP: layer by
/// layer, weight then bias (tch creates the bias first). DDP's bucket layouts follow this order,
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

/// Each parameter's name (as the VarStore names it) and shape, computed from the widths alone.
pub fn parameter_shapes(features: usize, hidden: &[usize], classes: usize) -> Vec<(String, Vec<i64>)> {
    let widths: Vec<i64> =
        std::iter::once(features).chain(hidden.iter().copied()).chain([classes]).map(|w| w as i64).collect();
    let mut shapes: Vec<(String, Vec<i64>)> = widths
        .windows(2)
        .enumerate()
        .flat_map(|(i, w)| [(format!("layer{i}.weight"), vec![w[1], w[0]]), (format!("layer{i}.bias"), vec![w[1]])])
        .collect();
    shapes.sort();
    shapes
}

/// Reads a weights file (.npz or .safetensors) holding exactly the parameters of `shapes`,
/// as float32; says what is missing, extra or misshapen otherwise.
pub fn read_weights(path: &Path, shapes: &[(String, Vec<i64>)]) -> Result<BTreeMap<String, Tensor>, String> {
    if !path.is_file() {
        return Err(format!("{} does not exist (paths are relative to the pipeline file)", path.display()));
    }
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
    std::iter::once(features)
        .chain(hidden.iter().copied())
        .chain([classes])
        .map(|w| w.to_string())
        .collect::<Vec<_>>()
        .join("-")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_count_matches_the_built_model() {
        let m = Model { hidden: vec![64, 32], ..Model::default() };
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let _mlp = Mlp::new(&vs.root(), 10, &m, 4);
        let built: i64 = vs.trainable_variables().iter().map(|t| t.numel() as i64).sum();
        assert_eq!(built as usize, parameter_count(10, &m.hidden, 4));
        let mut names: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
        names.sort();
        assert_eq!(names, parameter_shapes(10, &m.hidden, 4));
        assert_eq!(describe(10, &m.hidden, 4), "10-64-32-4");
        let sizes: Vec<Vec<i64>> = parameters_in_module_order(&vs).iter().map(|t| t.size()).collect();
        assert_eq!(sizes, [vec![64, 10], vec![64], vec![32, 64], vec![32], vec![4, 32], vec![4]]);
    }

    #[test]
    fn weights_files_are_checked_against_the_model() {
        let dir = tempfile::tempdir().unwrap();
        let shapes = parameter_shapes(3, &[4], 2);
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
