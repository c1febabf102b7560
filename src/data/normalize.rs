//! Normalize: per-feature scaling (every value of a sample is a feature: a pixel of a channel) fitted on the rank's shard (`scope = "rank"`, what
//! the seed does) or on the whole training set through all-reduced statistics (`"global"`).
//! Fitted once, on the rank's first-epoch shard (training rows only), then applied to every
//! batch and to validation. A constant or near-constant column gets scale 1, as common scalers
//! do: a range of 1e-16 would blow a later value up to 1e15.
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

/// Whether a column whose values span `spread` (range or standard deviation) around values of
/// magnitude up to `magnitude` is constant but for float32 rounding.
pub fn is_constant(spread: f64, magnitude: f64) -> bool {
    // NaN spreads count as constant.
    spread.partial_cmp(&(10.0 * f32::EPSILON as f64 * magnitude)) != Some(std::cmp::Ordering::Greater)
}

/// `spread` where it is a real spread, 1 where the column is constant.
fn safe_scale(spread: &Tensor, magnitude: &Tensor) -> Tensor {
    let tol = magnitude.to_kind(Kind::Double) * (10.0 * f32::EPSILON as f64);
    let keep = spread.to_kind(Kind::Double).gt_tensor(&tol);
    spread.where_self(&keep, &Tensor::ones_like(spread))
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
        let global = scope == NormalizeScope::Global;
        Normalizer::fit_with(method, x, weight, &mut |t, op| if global { pg.all_reduce(t, op) } else { Ok(()) })
    }

    /// Fits on every row of `x` in this process alone (`runner data`'s preview, which holds
    /// every rank's rows: the whole training set for scope = "global").
    pub fn fit_rows(method: NormalizeMethod, x: &Tensor) -> Normalizer {
        let weight = Tensor::ones([x.size()[0]], (tch::Kind::Float, x.device()));
        Normalizer::fit_with(method, x, &weight, &mut |_, _| Ok(())).expect("no collective, no error")
    }

    /// The fit, with `reduce` combining statistics across the ranks that share them.
    fn fit_with(
        method: NormalizeMethod,
        x: &Tensor,
        weight: &Tensor,
        reduce: &mut dyn FnMut(&mut Tensor, ReduceOp) -> dist::Result<()>,
    ) -> dist::Result<Normalizer> {
        // Every value of a sample is a feature (each pixel of each channel of an image).
        let x = &x.flatten(1, -1);
        let features = x.size()[1];
        let real = x.index_select(0, &weight.nonzero().squeeze_dim(1));
        let magnitude = |reduce: &mut dyn FnMut(&mut Tensor, ReduceOp) -> dist::Result<()>| -> dist::Result<Tensor> {
            let mut m = real.abs().amax([0].as_slice(), false);
            reduce(&mut m, ReduceOp::Max)?;
            Ok(m)
        };
        let (offset, scale) = match method {
            NormalizeMethod::None => return Ok(Normalizer { scaling: None }),
            NormalizeMethod::Minmax => {
                let mut min = real.amin([0].as_slice(), false);
                let mut max = real.amax([0].as_slice(), false);
                reduce(&mut min, ReduceOp::Min)?;
                reduce(&mut max, ReduceOp::Max)?;
                let range = &max - &min;
                let scale = safe_scale(&range, &magnitude(reduce)?);
                (min, scale)
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
                reduce(&mut stats, ReduceOp::Sum)?;
                let n = stats.double_value(&[2 * features]);
                let mean = stats.narrow(0, 0, features) / n;
                let var = stats.narrow(0, features, features) / n - &mean * &mean;
                let std = var.clamp_min(0.0).sqrt().to_kind(Kind::Float);
                (mean.to_kind(Kind::Float), safe_scale(&std, &magnitude(reduce)?))
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

    /// x ↦ x (`method = "none"`).
    pub fn identity() -> Normalizer {
        Normalizer { scaling: None }
    }

    /// A normalizer with saved statistics (`runner predict`).
    pub fn from_parts(offset: &[f32], scale: &[f32]) -> Normalizer {
        Normalizer { scaling: Some((Tensor::from_slice(offset), Tensor::from_slice(scale))) }
    }

    /// Rank `root`'s normaliser, on every rank of `pg` (each calls it): what a rank applies to
    /// rows that rank `root`'s statistics must scale.
    pub fn of_rank(&self, pg: &crate::dist::ProcessGroup, root: usize) -> crate::dist::Result<Normalizer> {
        // The same method on every rank: all have statistics, or none has.
        let Some((offset, scale)) = &self.scaling else { return Ok(Normalizer::identity()) };
        let mut both = Tensor::cat(&[offset.reshape([-1]), scale.reshape([-1])], 0);
        pg.broadcast(&mut both, root)?;
        let n = offset.numel() as i64;
        Ok(Normalizer { scaling: Some((both.narrow(0, 0, n).view_as(offset), both.narrow(0, n, n).view_as(scale))) })
    }

    /// The offsets and scales, per feature (none for the identity).
    pub fn parts(&self) -> (Vec<f32>, Vec<f32>) {
        let v = |t: &Tensor| Vec::<f32>::try_from(t.to_kind(Kind::Float).contiguous()).unwrap_or_default();
        match &self.scaling {
            Some((offset, scale)) => (v(offset), v(scale)),
            None => (Vec::new(), Vec::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_constant;

    #[test]
    fn a_spread_within_float32_rounding_of_the_values_is_constant() {
        assert!(is_constant(0.0, 0.0));
        assert!(is_constant(2e-16, 1.0), "the 2e-16 range that blew digits up");
        assert!(is_constant(f64::NAN, 1.0));
        assert!(!is_constant(1e-3, 1.0));
        assert!(!is_constant(1e-30, 1e-30), "a column of tiny values that varies is not constant");
    }
}
