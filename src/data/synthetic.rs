//! The synthetic task: a deterministic function of the seed, so the same data on every rank and
//! at every world size.
use super::DataSpec;
use crate::rng::Rng;

/// Rows from a random teacher network: features on varied scales and offsets (so normalising
/// matters), labels = argmax of the teacher's logits plus `noise`-scaled Gaussian noise.
pub fn rows(d: &DataSpec, seed: u64) -> (Vec<f32>, Vec<i64>) {
    let (f, c, h) = (d.input_size(), d.task.outputs(), 16);
    let mut rng = Rng::new(seed, 0xDA7A);
    let offset: Vec<f64> = (0..f).map(|_| rng.normal() * 5.0).collect();
    let scale: Vec<f64> = (0..f).map(|_| 0.5 + rng.uniform() * 4.5).collect();
    let w1: Vec<f64> = (0..f * h).map(|_| rng.normal() * 2.0 / (f as f64).sqrt()).collect();
    let b1: Vec<f64> = (0..h).map(|_| rng.normal() * 0.5).collect();
    let w2: Vec<f64> = (0..h * c).map(|_| rng.normal() * 2.0).collect();
    let n = d.rows + d.validation_rows;
    let (mut xs, mut ys) = (Vec::with_capacity(n * f), Vec::with_capacity(n));
    let mut z = vec![0.0; f];
    let mut hidden = vec![0.0; h];
    for _ in 0..n {
        for j in 0..f {
            z[j] = rng.normal();
            xs.push((offset[j] + scale[j] * z[j]) as f32);
        }
        for (k, out) in hidden.iter_mut().enumerate() {
            *out = (b1[k] + (0..f).map(|j| z[j] * w1[j * h + k]).sum::<f64>()).tanh();
        }
        let label = (0..c)
            .map(|k| (0..h).map(|i| hidden[i] * w2[i * c + k]).sum::<f64>() + d.noise * rng.normal())
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(k, _)| k as i64)
            .unwrap_or(0);
        ys.push(label);
    }
    (xs, ys)
}
