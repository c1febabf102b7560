//! The synthetic task: a deterministic function of the seed, so the same data on every rank and
//! at every world size.
use super::DataSpec;
use crate::rng::Rng;

/// Rows from a random teacher network: features on varied scales and offsets (so normalising
/// matters), labels = argmax of the teacher's logits plus `noise`-scaled Gaussian noise.
pub fn rows(d: &DataSpec, seed: u64) -> (Vec<f32>, Vec<i64>) {
    if let &[c, h, w] = d.input.as_slice() {
        return images(d, seed, [c, h, w]);
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
            .map(|k| (0..h).map(|i| hidden[i] * w2[i * c + k]).sum::<f64>() + d.noise * rng.normal())
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
fn images(d: &DataSpec, seed: u64, [c, h, w]: [usize; 3]) -> (Vec<f32>, Vec<i64>) {
    let classes = d.task.outputs();
    let mut rng = Rng::new(seed, 0x1AA6E);
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
                    xs.push((v + d.noise * rng.normal()) as f32);
                }
            }
        }
        ys.push(label as i64);
    }
    (xs, ys)
}
