//! Normalize: per-feature scaling (every value of a sample is a feature: a pixel of a channel) fitted on the rank's shard (`scope = "rank"`, what
//! the seed does) or on the whole training set through all-reduced statistics (`"global"`).
//! Fitted once, on the rank's first-epoch shard, then applied to every batch and to validation.
use tch::{Kind, Tensor};

use crate::config::schema::{NormalizeMethod, NormalizeScope};
use crate::dist::{self, ProcessGroup, ReduceOp};

/// x ↦ (x - offset) / scale, per feature; the identity for `method = "none"` (which a language
/// model's token ids require: they are never scaled, nor turned into floats).
#[derive(Debug)]
pub struct Normalizer {
    /// (offset, scale); `None`: the identity.
    scaling: Option<(Tensor, Tensor)>,
}

impl Normalizer {
    /// Fits on the rows of `x` whose `weight` is 1 (padding rows are left out of statistics).
    pub fn fit(
        method: NormalizeMethod,
        scope: NormalizeScope,
        x: &Tensor,
        weight: &Tensor,
        pg: &ProcessGroup,
    ) -> dist::Result<Normalizer> {
        // Every value of a sample is a feature (each pixel of each channel of an image).
        let x = &x.flatten(1, -1);
        let features = x.size()[1];
        let real = x.index_select(0, &weight.nonzero().squeeze_dim(1));
        let global = scope == NormalizeScope::Global;
        let (offset, scale) = match method {
            NormalizeMethod::None => return Ok(Normalizer { scaling: None }),
            NormalizeMethod::Minmax => {
                let mut min = real.amin([0].as_slice(), false);
                let mut max = real.amax([0].as_slice(), false);
                if global {
                    pg.all_reduce(&mut min, ReduceOp::Min)?;
                    pg.all_reduce(&mut max, ReduceOp::Max)?;
                }
                let range = &max - &min;
                (min, range.clamp_min(f64::EPSILON))
            }
            NormalizeMethod::Standard => {
                // Sums in float64 so the global mean and variance do not depend on the split.
                let xd = real.to_kind(Kind::Double);
                let mut stats = Tensor::cat(
                    &[
                        xd.sum_dim_intlist([0].as_slice(), false, Kind::Double),
                        (&xd * &xd).sum_dim_intlist([0].as_slice(), false, Kind::Double),
                        Tensor::from(real.size()[0] as f64).view([1]).to_device(x.device()),
                    ],
                    0,
                );
                if global {
                    pg.all_reduce(&mut stats, ReduceOp::Sum)?;
                }
                let n = stats.double_value(&[2 * features]);
                let mean = stats.narrow(0, 0, features) / n;
                let var = stats.narrow(0, features, features) / n - &mean * &mean;
                (mean.to_kind(Kind::Float), var.clamp_min(0.0).sqrt().to_kind(Kind::Float).clamp_min(f64::EPSILON))
            }
        };
        Ok(Normalizer { scaling: Some((offset, scale)) })
    }

    pub fn apply(&self, x: &Tensor) -> Tensor {
        match &self.scaling {
            None => x.shallow_clone(),
            Some((offset, scale)) if x.dim() == 2 => (x - offset) / scale,
            // Images: every value of a sample is a feature.
            Some((offset, scale)) => ((x.flatten(1, -1) - offset) / scale).view(x.size().as_slice()),
        }
    }
}
