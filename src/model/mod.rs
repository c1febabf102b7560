//! Models built from `[wrap.model]`: an MLP over the features, logits over the classes.
pub mod optim;

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
        assert_eq!(describe(10, &m.hidden, 4), "10-64-32-4");
    }
}
