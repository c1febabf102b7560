//! `kind = "cnn"`: convolution blocks over images (N × C × H × W), then linear layers. Block i
//! is `conv{i}` (`.weight` C_out × C_in × k × k, `.bias`), or with batch norm `conv{i}.weight`
//! and `bn{i}` (`.weight`, `.bias`, and the buffers `.running_mean`, `.running_var`; the
//! convolution has no bias, as batch norm would cancel it); linear layer j is `fc{j}`. Each
//! block and each linear layer is one layer of the model, so a pipeline cuts between blocks.
//!
//! Batch norm's running statistics are buffers: in the VarStore but not trainable, so the
//! optimizer and DDP's Reducer never see them, while checkpoints, `model.safetensors` and
//! `wrap.init` hold them beside the parameters. In training a batch is normalised by its own
//! statistics (per rank, as PyTorch's BatchNorm2d under DDP), or with `wrap.sync_batchnorm` under
//! DDP by the statistics of every rank's batch (torch's SyncBatchNorm, through the build
//! context's group); validation uses the running ones.
use std::ops::Range;
use std::sync::Arc;

use tch::nn::{self, Module, ModuleT};
use tch::Tensor;

use super::batchnorm::{StatsGroup, SyncBatchNorm};
use super::{Architecture, BuildContext, Layer};
use crate::config::schema::{Activation, Cnn, ConvBlock, Pool};
use crate::rng::Rng;

/// Separates the convolutions' streams from other uses of the run's seed.
const CONV_STREAM: u64 = 0xC0_0000;

/// The keys' own bounds; `false` when a size is too large to compute shapes from.
pub fn check(m: &Cnn, bad: &mut impl FnMut(&str, String)) -> bool {
    use crate::limits::{MAX_LAYERS, MAX_WIDTH};
    let mut ok = true;
    if m.conv.len() + m.hidden.len() > MAX_LAYERS {
        bad("wrap.model.conv", format!("{} layers are more than the {MAX_LAYERS} the runner takes", m.conv.len()));
        ok = false;
    }
    for (i, b) in m.conv.iter().enumerate() {
        for (name, v, min) in [
            ("channels", b.channels, 1),
            ("kernel", b.kernel, 1),
            ("stride", b.stride, 1),
            ("padding", b.padding, 0),
            ("pool_size", b.pool_size, 1),
        ] {
            if v < min || v > MAX_WIDTH {
                bad("wrap.model.conv", format!("block {i}: {name} = {v} is outside 1..={MAX_WIDTH}"));
                ok = false;
            }
        }
        if !(0.0..1.0).contains(&b.dropout) {
            bad("wrap.model.conv", format!("block {i}: dropout must be in [0, 1), got {}", b.dropout));
        }
    }
    if m.hidden.contains(&0) || m.hidden.iter().any(|&w| w > MAX_WIDTH) {
        bad("wrap.model.hidden", format!("layer widths must be in 1..={MAX_WIDTH}, got {:?}", m.hidden));
        ok = false;
    }
    if !(0.0..1.0).contains(&m.dropout) {
        bad("wrap.model.dropout", format!("must be in [0, 1), got {}", m.dropout));
    }
    ok
}

/// The data's shape against the stack: images, and at least one pixel after every block.
pub fn check_input(m: &Cnn, input: &[usize], bad: &mut impl FnMut(&str, String)) -> bool {
    let &[c, h, w] = input else {
        bad(
            "wrap.model.kind",
            format!(
                "a CNN takes images (channels × height × width), but the data's samples have shape {input:?}: use \
                 load.image = [C, H, W] or a tensors file of images"
            ),
        );
        return false;
    };
    let mut shape = [c, h, w];
    for (i, b) in m.conv.iter().enumerate() {
        match block_output(b, shape) {
            Ok(out) => shape = out,
            Err(why) => {
                bad(
                    "wrap.model.conv",
                    format!(
                        "block {i} reduces the image below 1 pixel: {why}; the data's images are {c} × {h} × {w}: use \
                         fewer or smaller kernels and pools, or more padding"
                    ),
                );
                return false;
            }
        }
    }
    true
}

/// The output shape of block `b` on `[c, h, w]`, or why it has no pixel left.
fn block_output(b: &ConvBlock, [_, h, w]: [usize; 3]) -> Result<[usize; 3], String> {
    let conv = |x: usize| (x + 2 * b.padding).checked_sub(b.kernel).map(|d| d / b.stride + 1);
    let (Some(ch), Some(cw)) = (conv(h), conv(w)) else {
        return Err(format!(
            "its {h} × {w} input padded by {} is smaller than its {k} × {k} kernel",
            b.padding,
            k = b.kernel
        ));
    };
    if b.pool == Pool::None {
        return Ok([b.channels, ch, cw]);
    }
    let (ph, pw) = (ch / b.pool_size, cw / b.pool_size);
    if ph == 0 || pw == 0 {
        return Err(format!(
            "its convolution's {ch} × {cw} output is smaller than its {p} × {p} pool",
            p = b.pool_size
        ));
    }
    Ok([b.channels, ph, pw])
}

/// A CNN's configuration with the data's shapes.
#[derive(Debug, Clone)]
pub struct CnnArch {
    blocks: Vec<ConvBlock>,
    /// The input of block i is shapes[i]; shapes[blocks] is the last block's output.
    shapes: Vec<[usize; 3]>,
    /// The linear layers' widths: the flattened last block, the hidden widths, the outputs.
    widths: Vec<usize>,
    activation: Activation,
    dropout: f64,
}

impl CnnArch {
    /// `input` must have passed [`check_input`].
    pub fn new(m: &Cnn, input: &[usize], outputs: usize) -> CnnArch {
        let mut shapes = vec![[input[0], input[1], input[2]]];
        for b in &m.conv {
            let last = *shapes.last().expect("the input");
            shapes.push(block_output(b, last).unwrap_or([b.channels, 1, 1]));
        }
        let flat: usize = shapes.last().expect("the input").iter().product();
        let widths = std::iter::once(flat).chain(m.hidden.iter().copied()).chain([outputs]).collect();
        CnnArch { blocks: m.conv.clone(), shapes, widths, activation: m.activation, dropout: m.dropout }
    }

    /// Values per sample block i keeps for its backward pass besides its output: the
    /// convolution's maps, batch norm's, the activation's and, for a max pool, the index of each
    /// maximum (an int64, two floats' worth).
    fn held(&self, i: usize) -> usize {
        let b = &self.blocks[i];
        let [c, h, w] = self.shapes[i];
        let conv =
            block_output(&ConvBlock { pool: Pool::None, ..b.clone() }, [c, h, w]).map_or(0, |s| s.iter().product());
        let out: usize = self.shapes[i + 1].iter().product();
        let maps = if b.pool == Pool::None { 1 + b.batch_norm as usize } else { 2 + b.batch_norm as usize };
        conv * maps + if b.pool == Pool::Max { 2 * out } else { 0 }
    }

    fn conv_parameters(&self, i: usize) -> Vec<(String, Vec<i64>)> {
        let b = &self.blocks[i];
        let (cin, cout, k) = (self.shapes[i][0] as i64, b.channels as i64, b.kernel as i64);
        let mut v = vec![(format!("conv{i}.weight"), vec![cout, cin, k, k])];
        // Batch norm subtracts the mean: a bias before it would have no effect (and a gradient
        // of rounding noise), so the convolution has none (PyTorch's `bias=False`).
        if b.batch_norm {
            v.extend([(format!("bn{i}.weight"), vec![cout]), (format!("bn{i}.bias"), vec![cout])]);
        } else {
            v.push((format!("conv{i}.bias"), vec![cout]));
        }
        v
    }
}

impl Architecture for CnnArch {
    fn describe(&self) -> String {
        let [c, h, w] = self.shapes[0];
        let mut parts = vec![format!("{c}×{h}×{w}")];
        parts.extend(self.shapes[1..].iter().map(|[c, h, w]| format!("{c}×{h}×{w}")));
        let linear: Vec<String> = self.widths[1..].iter().map(|w| w.to_string()).collect();
        format!("CNN {} → {}", parts.join(" → "), linear.join("-"))
    }

    fn layers(&self) -> Vec<Layer> {
        let blocks = self.blocks.iter().enumerate().map(|(i, b)| {
            let parameters = self.conv_parameters(i).iter().map(|(_, s)| s.iter().product::<i64>() as usize).sum();
            let mut name = format!("conv {}×{k}×{k} → {}", self.shapes[i][0], b.channels, k = b.kernel);
            if b.stride > 1 {
                name += &format!(" stride {}", b.stride);
            }
            if b.batch_norm {
                name += ", batch norm";
            }
            match b.pool {
                Pool::None => {}
                Pool::Max => name += &format!(", max pool {}", b.pool_size),
                Pool::Avg => name += &format!(", avg pool {}", b.pool_size),
            }
            Layer { name, parameters, output: self.shapes[i + 1].to_vec(), held: self.held(i) }
        });
        let linear = self.widths.windows(2).map(|w| Layer {
            name: format!("linear {} → {}", w[0], w[1]),
            parameters: w[0] * w[1] + w[1],
            output: vec![w[1]],
            held: 0,
        });
        blocks.chain(linear).collect()
    }

    fn parameters(&self, range: Range<usize>) -> Vec<(String, Vec<i64>)> {
        let nb = self.blocks.len();
        range
            .flat_map(|l| {
                if l < nb {
                    self.conv_parameters(l)
                } else {
                    let j = l - nb;
                    let (inputs, outputs) = (self.widths[j] as i64, self.widths[j + 1] as i64);
                    vec![(format!("fc{j}.weight"), vec![outputs, inputs]), (format!("fc{j}.bias"), vec![outputs])]
                }
            })
            .collect()
    }

    fn buffers(&self, range: Range<usize>) -> Vec<(String, Vec<i64>)> {
        range
            .filter(|&l| l < self.blocks.len() && self.blocks[l].batch_norm)
            .flat_map(|i| {
                let c = self.blocks[i].channels as i64;
                [(format!("bn{i}.running_mean"), vec![c]), (format!("bn{i}.running_var"), vec![c])]
            })
            .collect()
    }

    /// Each convolution: 2 × C_out × H_conv × W_conv × C_in × k² (its output before pooling);
    /// each linear layer: 2 × inputs × outputs.
    fn forward_flops(&self) -> Option<f64> {
        let conv = self.blocks.iter().enumerate().map(|(i, b)| {
            let [cin, h, w] = self.shapes[i];
            let out = |x: usize| (x + 2 * b.padding).saturating_sub(b.kernel) / b.stride + 1;
            2.0 * (b.channels * out(h) * out(w) * cin * b.kernel * b.kernel) as f64
        });
        let linear = self.widths.windows(2).map(|w| 2.0 * (w[0] * w[1]) as f64);
        Some(conv.chain(linear).sum())
    }

    fn build<'a>(&self, p: &nn::Path, range: Range<usize>, ctx: &BuildContext<'a>) -> Box<dyn ModuleT + 'a> {
        let nb = self.blocks.len();
        let mut layers = Vec::new();
        for l in range {
            if l < nb {
                layers.push(Built::Block(self.build_block(p, l, ctx.seed)));
            } else {
                let j = l - nb;
                let (inputs, outputs) = (self.widths[j], self.widths[j + 1]);
                let fc = super::mlp::init_linear(&(p / format!("fc{j}")), inputs, outputs, ctx.seed, l, &|_| None);
                layers.push(Built::Linear(j, fc));
            }
        }
        let batch_norm = ctx.batch_norm.clone();
        Box::new(CnnStage { layers, activation: self.activation, dropout: self.dropout, batch_norm })
    }

    fn has_batch_norm(&self) -> bool {
        self.blocks.iter().any(|b| b.batch_norm)
    }

    fn batch_norm_values(&self) -> Option<usize> {
        // Batch norm follows the convolution, before pooling: its maps are the convolution's.
        let conv = |i: usize| block_output(&ConvBlock { pool: Pool::None, ..self.blocks[i].clone() }, self.shapes[i]);
        (0..self.blocks.len())
            .filter(|&i| self.blocks[i].batch_norm)
            .map(|i| conv(i).map_or(1, |[_, h, w]| h * w))
            .min()
    }
}

impl CnnArch {
    /// Block `i` with PyTorch's default initialisation (weights and biases uniform in
    /// ±1 / √fan_in, fan_in = C_in × k × k; batch norm's scale 1 and shift 0), drawn from the
    /// block's own stream.
    fn build_block(&self, p: &nn::Path, i: usize, seed: u64) -> Block {
        let b = &self.blocks[i];
        let (cin, cout, k) = (self.shapes[i][0], b.channels, b.kernel);
        let fan_in = (cin * k * k) as f64;
        let bound = 1.0 / fan_in.sqrt();
        let mut rng = Rng::new(seed, CONV_STREAM + i as u64);
        let mut uniform = |n: usize| -> Tensor {
            let v: Vec<f32> = (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) * bound) as f32).collect();
            Tensor::from_slice(&v)
        };
        let w = uniform(cout * cin * k * k).view([cout as i64, cin as i64, k as i64, k as i64]);
        let bias = uniform(cout);
        let conv = p / format!("conv{i}");
        let weight = conv.var_copy("weight", &w);
        let bias = (!b.batch_norm).then(|| conv.var_copy("bias", &bias));
        let bn = b.batch_norm.then(|| SyncBatchNorm::new(&(p / format!("bn{i}")), cout as i64));
        Block {
            weight,
            bias,
            stride: b.stride as i64,
            padding: b.padding as i64,
            bn,
            pool: b.pool,
            pool_size: b.pool_size as i64,
            dropout: b.dropout,
        }
    }
}

#[derive(Debug)]
struct Block {
    weight: Tensor,
    /// None before a batch norm.
    bias: Option<Tensor>,
    stride: i64,
    padding: i64,
    bn: Option<SyncBatchNorm>,
    pool: Pool,
    pool_size: i64,
    dropout: f64,
}

#[derive(Debug)]
enum Built {
    Block(Block),
    /// A linear layer with its index among the linear layers (the first flattens its input).
    Linear(usize, nn::Linear),
}

/// The built layers of a CNN: the whole model, or one pipeline stage's contiguous layers.
#[derive(Debug)]
struct CnnStage<'a> {
    layers: Vec<Built>,
    activation: Activation,
    dropout: f64,
    /// The ranks whose batches the batch norm layers' statistics cover in training (none: this
    /// rank's batch alone).
    batch_norm: Option<Arc<StatsGroup<'a>>>,
}

fn activate(h: Tensor, a: Activation) -> Tensor {
    match a {
        Activation::Relu => h.relu(),
        Activation::Tanh => h.tanh(),
        Activation::Gelu => h.gelu("none"),
    }
}

impl ModuleT for CnnStage<'_> {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let mut h = x.shallow_clone();
        for layer in &self.layers {
            h = match layer {
                Built::Block(b) => {
                    let (s, p) = ([b.stride, b.stride], [b.padding, b.padding]);
                    let mut h = h.conv2d(&b.weight, b.bias.as_ref(), s, p, [1, 1], 1);
                    if let Some(bn) = &b.bn {
                        h = bn.forward_t(&h, train, self.batch_norm.as_deref());
                    }
                    h = activate(h, self.activation);
                    let k = [b.pool_size, b.pool_size];
                    h = match b.pool {
                        Pool::None => h,
                        Pool::Max => h.max_pool2d(k, k, [0, 0], [1, 1], false),
                        Pool::Avg => h.avg_pool2d(k, k, [0, 0], false, true, None::<i64>),
                    };
                    if b.dropout > 0.0 {
                        h = h.dropout(b.dropout, train);
                    }
                    h
                }
                Built::Linear(j, fc) => {
                    let h = if *j == 0 {
                        h.flatten(1, -1)
                    } else {
                        let h = activate(h, self.activation);
                        if self.dropout > 0.0 {
                            h.dropout(self.dropout, train)
                        } else {
                            h
                        }
                    };
                    fc.forward(&h)
                }
            };
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{parameters_in_module_order, sorted_parameters};

    fn cnn() -> Cnn {
        Cnn {
            conv: vec![
                ConvBlock { channels: 4, batch_norm: true, pool: Pool::Max, ..ConvBlock::default() },
                ConvBlock { channels: 6, kernel: 3, stride: 2, padding: 0, pool: Pool::Avg, ..ConvBlock::default() },
            ],
            hidden: vec![8],
            ..Cnn::default()
        }
    }

    #[test]
    fn shapes_parameter_counts_and_names_match_the_built_model() {
        let arch = CnnArch::new(&cnn(), &[2, 12, 12], 3);
        let layers = arch.layers();
        // 12 → conv (pad 1) 12 → pool 6; 6 → conv stride 2 → 2 → pool 1.
        let outputs: Vec<Vec<usize>> = layers.iter().map(|l| l.output.clone()).collect();
        assert_eq!(outputs, [vec![4, 6, 6], vec![6, 1, 1], vec![8], vec![3]]);
        assert_eq!(arch.describe(), "CNN 2×12×12 → 4×6×6 → 6×1×1 → 8-3");
        // conv0: 4 × 12 × 12 outputs of 2 × 3 × 3 inputs; conv1 (stride 2, no padding on 6 × 6):
        // 6 × 2 × 2 outputs of 4 × 3 × 3; then linear 6 → 8 → 3.
        let macs = 4 * 12 * 12 * 2 * 9 + 6 * 2 * 2 * 4 * 9 + 6 * 8 + 8 * 3;
        assert_eq!(arch.forward_flops(), Some(2.0 * macs as f64));
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let net = arch.build(&vs.root(), 0..4, &BuildContext::new(0));
        let trainable: i64 = vs.trainable_variables().iter().map(|t| t.numel() as i64).sum();
        assert_eq!(trainable as usize, layers.iter().map(|l| l.parameters).sum::<usize>());
        let mut named: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(n, t)| (n, t.size())).collect();
        named.sort();
        assert_eq!(named, sorted_parameters(&arch), "parameters and buffers");
        assert_eq!(parameters_in_module_order(&arch, 0..4, &vs).len(), 9, "no buffer among the parameters");
        let out = net.forward_t(&Tensor::randn([5, 2, 12, 12], (tch::Kind::Float, tch::Device::Cpu)), true);
        assert_eq!(out.size(), [5, 3]);
        let mean = &vs.variables()["bn0.running_mean"];
        assert!(mean.abs().sum(tch::Kind::Float).double_value(&[]) > 0.0, "training updates the running mean");
        assert!(arch.has_batch_norm());
        let plain = Cnn { conv: vec![ConvBlock::default()], ..Cnn::default() };
        assert!(!CnnArch::new(&plain, &[2, 12, 12], 3).has_batch_norm());
    }

    #[test]
    fn an_image_reduced_below_one_pixel_is_refused() {
        let mut errors = Vec::new();
        assert!(!check_input(&cnn(), &[2, 5, 5], &mut |k, m| errors.push(format!("{k}: {m}"))));
        assert_eq!(
            errors,
            ["wrap.model.conv: block 1 reduces the image below 1 pixel: its 2 × 2 input padded by 0 is smaller than \
              its 3 × 3 kernel; the data's images are 2 × 5 × 5: use fewer or smaller kernels and pools, or more \
              padding"]
        );
        errors.clear();
        assert!(!check_input(&cnn(), &[10], &mut |k, m| errors.push(format!("{k}: {m}"))));
        assert!(errors[0].contains("a CNN takes images"), "{errors:?}");
    }

    #[test]
    fn stages_together_equal_the_whole_model() {
        let m = Cnn { conv: vec![ConvBlock { channels: 3, ..ConvBlock::default() }; 2], ..Cnn::default() };
        let arch = CnnArch::new(&m, &[1, 6, 6], 4);
        let x = Tensor::randn([3, 1, 6, 6], (tch::Kind::Float, tch::Device::Cpu));
        crate::model::assert_stages_equal_whole(&arch, &x, &[0..1, 1..3, 3..4]);
    }
}
