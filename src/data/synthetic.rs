//! The synthetic task: a deterministic function of the seed, so the same data on every rank and
//! at every world size.
use serde::{Deserialize, Serialize};

use super::{DataSpec, SourceSpec, Task};
use crate::config::schema::{Config, Features, Missing, Sampling, TaskKind};
use crate::rng::Rng;

/// What the plan knows of synthetic data besides its shapes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Spec {
    pub seed: u64,
    /// The label noise (rows, images) or the chance of a random next token (tokens).
    pub noise: f64,
}

/// The plan's view of synthetic rows or images; problems are reported through `bad`.
pub fn spec(c: &Config, bad: &mut impl FnMut(&str, String)) -> Option<DataSpec> {
    let l = &c.load;
    for (key, given) in [
        ("load.path", l.path.is_some()),
        ("load.target", l.target.is_some()),
        ("load.exclude", !l.exclude.is_empty()),
        ("load.validation_path", l.validation_path.is_some()),
        ("load.missing", l.missing != Missing::Error),
        ("load.delimiter", l.delimiter.is_some()),
        ("load.labels", l.labels.is_some()),
        ("validate.fraction", c.validate.fraction.is_some()),
        ("validate.rows", c.validate.rows.is_some()),
    ] {
        if given {
            let why = match key {
                "load.labels" => "is only read by source = \"tensors\"",
                "validate.fraction" | "validate.rows" => {
                    "is not read by source = \"synthetic\", which generates load.validation_rows validation rows"
                }
                _ => "is only read by source = \"csv\" or \"parquet\"",
            };
            bad(key, why.into());
        }
    }
    if l.sampling != Sampling::Epoch {
        bad("load.sampling", "\"random\" draws windows from a token file: use source = \"tokens\" or \"text\"".into());
    }
    if c.train.task != TaskKind::Classification {
        bad("train.task", "synthetic data is a classification; regression needs a csv or parquet file".into());
    }
    let input = match (l.image, &l.features) {
        (Some(_), Some(_)) => {
            bad("load.features", "images have load.image's shape, not features: give one of the two".into());
            vec![0]
        }
        (Some(image), None) if image.contains(&0) => {
            bad("load.image", format!("[channels, height, width] must all be at least 1, got {image:?}"));
            vec![0]
        }
        (Some(image), None) => image.to_vec(),
        (None, None) => vec![10],
        (None, Some(Features::Count(n))) => vec![*n],
        (None, Some(Features::Columns(_))) => {
            bad("load.features", "names columns of a file; synthetic data takes a number".into());
            vec![10]
        }
    };
    let spec = DataSpec {
        rows: l.rows.unwrap_or(10_000),
        input,
        task: Task::Classification { classes: l.classes.unwrap_or(2) },
        validation_rows: l.validation_rows,
        source: SourceSpec::Synthetic(Spec { seed: c.run.seed, noise: l.noise }),
    };
    if spec.input_size() == 0 && l.image.is_none() {
        bad("load.features", "must be at least 1".into());
    }
    if l.noise.partial_cmp(&0.0).is_none_or(|o| o == std::cmp::Ordering::Less) {
        bad("load.noise", format!("must be 0 or more, got {}", l.noise));
    }
    Some(spec)
}

/// Rows from a random teacher network: features on varied scales and offsets (so normalising
/// matters), labels = argmax of the teacher's logits plus `noise`-scaled Gaussian noise.
pub fn rows(d: &DataSpec, s: &Spec) -> (Vec<f32>, Vec<i64>) {
    let seed = s.seed;
    if let &[c, h, w] = d.input.as_slice() {
        return images(d, s, [c, h, w]);
    }
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
            .map(|k| (0..h).map(|i| hidden[i] * w2[i * c + k]).sum::<f64>() + s.noise * rng.normal())
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(k, _)| k as i64)
            .unwrap_or(0);
        ys.push(label);
    }
    (xs, ys)
}

/// Images of shape `[c, h, w]` (`load.image`): each class has a template, a few Gaussian blobs of
/// either sign on every channel; a sample is its class's template shifted by up to an eighth of
/// the image each way (wrapping around), plus `noise`-scaled Gaussian noise on every pixel. The
/// label is uniform over the classes. Shifts make a convolution's weight sharing pay.
fn images(d: &DataSpec, s: &Spec, [c, h, w]: [usize; 3]) -> (Vec<f32>, Vec<i64>) {
    let classes = d.task.outputs();
    let mut rng = Rng::new(s.seed, 0x1AA6E);
    let pixels = c * h * w;
    let mut templates = vec![0.0f64; classes * pixels];
    for t in templates.chunks_mut(pixels) {
        for ch in t.chunks_mut(h * w) {
            for _ in 0..3 {
                let (cy, cx) = (rng.uniform() * h as f64, rng.uniform() * w as f64);
                let r = (0.15 + 0.2 * rng.uniform()) * h.max(w) as f64;
                let a = if rng.uniform() < 0.5 { -1.5 } else { 1.5 };
                for y in 0..h {
                    for x in 0..w {
                        let d2 = (y as f64 - cy).powi(2) + (x as f64 - cx).powi(2);
                        ch[y * w + x] += a * (-d2 / (2.0 * r * r)).exp();
                    }
                }
            }
        }
    }
    let n = d.rows + d.validation_rows;
    let (sy, sx) = ((h / 8) as u64, (w / 8) as u64);
    let (mut xs, mut ys) = (Vec::with_capacity(n * pixels), Vec::with_capacity(n));
    for _ in 0..n {
        let label = rng.below(classes as u64) as usize;
        let dy = h + rng.below(2 * sy + 1) as usize - sy as usize;
        let dx = w + rng.below(2 * sx + 1) as usize - sx as usize;
        let t = &templates[label * pixels..(label + 1) * pixels];
        for ch in 0..c {
            for y in 0..h {
                for x in 0..w {
                    let v = t[ch * h * w + ((y + dy) % h) * w + (x + dx) % w];
                    xs.push((v + s.noise * rng.normal()) as f32);
                }
            }
        }
        ys.push(label as i64);
    }
    (xs, ys)
}
