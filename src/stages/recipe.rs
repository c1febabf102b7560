//! The training recipe around each optimizer step: the learning-rate schedule (a pure function
//! of the step number, so a resumed run takes the same rates), gradient accumulation (which
//! batches make one step, and each batch's share of the step's mean loss), clipping by the global
//! gradient norm (after averaging, so every rank clips the same), mixed precision and early
//! stopping. The epoch loop asks it; the strategies only receive a loss scale and whether to sync.
use tch::{Kind, Tensor};

use crate::config::schema::{EarlyStop, StopMode};
use crate::dist::ReduceOp;
pub use crate::plan::schedule::Schedule;

/// Which batches of an epoch make one optimizer step: groups of `k` consecutive batches (the last
/// group may be shorter).
#[derive(Debug, Clone, Copy)]
pub struct Accumulation {
    pub k: usize,
    /// Rows per batch, and rows in the rank's epoch.
    pub batch: i64,
    pub rows: i64,
    pub batches: usize,
}

impl Accumulation {
    /// Whether batch `i` starts an optimizer step (zero the gradients), ends one (sync, clip,
    /// update), and its loss's share of the step: its rows over the step's rows, so the k batches'
    /// gradients add up to those of the mean loss over all of them.
    pub fn batch(&self, i: usize) -> (bool, bool, f64) {
        let start = i / self.k * self.k;
        let end = (start + self.k).min(self.batches);
        let rows = |from: usize, to: usize| (to as i64 * self.batch).min(self.rows) - from as i64 * self.batch;
        let scale = if self.k == 1 { 1.0 } else { rows(i, i + 1) as f64 / rows(start, end) as f64 };
        (i == start, i + 1 == end, scale)
    }
}

/// Clips `params`' gradients (already averaged) to a global L2 norm of `max` when they exceed it,
/// as `torch.nn.utils.clip_grad_norm_`; returns the norm before clipping, a float32 tensor of one
/// value on the parameters' device: nothing here waits for the device. `group`: the ranks holding
/// the other parts of the model (a pipeline's stages, each copy holding the same averaged
/// gradients `copies` times), whose squared norms add up to the global one.
pub fn clip_grad_norm(
    params: &[Tensor],
    max: Option<f64>,
    group: Option<crate::strategy::NormGroup>,
) -> anyhow::Result<Tensor> {
    let device = params.first().map_or(tch::Device::Cpu, Tensor::device);
    let norm = tch::no_grad(|| -> anyhow::Result<Tensor> {
        let share = |i: usize| group.as_ref().and_then(|g| g.weights.get(i).copied()).unwrap_or(1.0);
        let squares: Vec<Tensor> = params
            .iter()
            .enumerate()
            .filter(|(_, p)| p.grad().defined())
            .map(|(i, p)| {
                let sq = p.grad().norm().square();
                if share(i) == 1.0 {
                    sq
                } else {
                    sq * share(i)
                }
            })
            .collect();
        let mut sq = match squares.len() {
            0 => Tensor::zeros([1], (Kind::Float, device)),
            _ => Tensor::stack(&squares, 0).sum(Kind::Float).view([1]),
        };
        if let Some(g) = &group {
            g.pg.all_reduce(&mut sq, ReduceOp::Sum)?;
            if g.copies > 1 {
                sq /= g.copies as f64;
            }
        }
        Ok(sq.sqrt())
    })?;
    if let Some(max) = max {
        tch::no_grad(|| scale_gradients(params, &norm, max));
    }
    Ok(norm)
}

/// Multiplies the gradients by max / (norm + 1e-6) where that is below 1. The coefficient is
/// computed in float64 on the device and rounded to float32, as a float64 scalar multiplied into
/// a float32 tensor is: the same bits as computing it on the host, without reading the norm.
/// A product by 1 changes nothing, so on a GPU every step multiplies (torch does too); on the
/// CPU, where reading the norm costs no wait, an unclipped step skips the pass over the gradients.
fn scale_gradients(params: &[Tensor], norm: &Tensor, max: f64) {
    let max_t = Tensor::full([1], max, (Kind::Double, norm.device()));
    let coef = (max_t / (norm.to_kind(Kind::Double) + 1e-6)).clamp_max(1.0).to_kind(Kind::Float);
    if norm.device() == tch::Device::Cpu && coef.double_value(&[0]) == 1.0 {
        return;
    }
    for g in params.iter().map(Tensor::grad).filter(Tensor::defined) {
        let _ = g.shallow_clone().g_mul_(&coef);
    }
}

/// Early stopping's state: the best value of the metric and when it was seen. It is rebuilt from
/// the trace rows on resume, so it needs no checkpoint of its own.
#[derive(Debug, Clone)]
pub struct EarlyStopper {
    pub rule: EarlyStop,
    pub best: Option<(usize, f64)>,
    /// Validations since the best one.
    pub since: usize,
}

/// What one validation meant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Improved,
    Waiting,
    Stop,
}

impl EarlyStopper {
    pub fn new(rule: &EarlyStop) -> EarlyStopper {
        EarlyStopper { rule: rule.clone(), best: None, since: 0 }
    }

    /// Records epoch `epoch`'s metric value.
    pub fn observe(&mut self, epoch: usize, value: f64) -> Verdict {
        let better = match self.best {
            None => true,
            Some((_, best)) => match self.rule.mode() {
                StopMode::Min => value < best - self.rule.min_delta,
                StopMode::Max => value > best + self.rule.min_delta,
            },
        };
        if better {
            self.best = Some((epoch, value));
            self.since = 0;
            Verdict::Improved
        } else {
            self.since += 1;
            if self.since >= self.rule.patience {
                Verdict::Stop
            } else {
                Verdict::Waiting
            }
        }
    }

    /// Why the run stopped, for the manifest.
    pub fn reason(&self, epoch: usize) -> String {
        let (best_epoch, best) = self.best.expect("stopped after a validation");
        format!(
            "early stop after epoch {epoch}: {:?} did not improve by more than {} for {} validations (best {best} at \
             epoch {best_epoch})",
            self.rule.metric, self.rule.min_delta, self.rule.patience
        )
        .replace("ValLoss", "val_loss")
        .replace("ValAcc", "val_acc")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accumulation_shares_add_up_to_one_per_step() {
        // 10 rows in batches of 3: 4 batches (3, 3, 3, 1); k = 3 makes steps of 9 and 1 rows.
        let a = Accumulation { k: 3, batch: 3, rows: 10, batches: 4 };
        let v: Vec<_> = (0..4).map(|i| a.batch(i)).collect();
        assert_eq!(v[0], (true, false, 3.0 / 9.0));
        assert_eq!(v[2], (false, true, 3.0 / 9.0));
        assert_eq!(v[3], (true, true, 1.0));
    }

    #[test]
    fn early_stop_waits_patience_validations() {
        let rule = EarlyStop { patience: 2, min_delta: 0.01, ..EarlyStop::default() };
        let mut e = EarlyStopper::new(&rule);
        assert_eq!(e.observe(1, 1.0), Verdict::Improved);
        assert_eq!(e.observe(2, 0.995), Verdict::Waiting, "within min_delta");
        assert_eq!(e.observe(3, 0.5), Verdict::Improved);
        assert_eq!(e.observe(4, 0.6), Verdict::Waiting);
        assert_eq!(e.observe(5, 0.6), Verdict::Stop);
        assert_eq!(e.best, Some((3, 0.5)));
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let p = Tensor::from_slice(&[3.0f32, 4.0]).set_requires_grad(true);
        (&p * &p).sum(Kind::Float).backward(); // gradient (6, 8), norm 10
        let norm = clip_grad_norm(std::slice::from_ref(&p), Some(5.0), None).unwrap().double_value(&[0]);
        assert!((norm - 10.0).abs() < 1e-5);
        let g = Vec::<f32>::try_from(p.grad()).unwrap();
        assert!((g[0] - 3.0).abs() < 1e-4 && (g[1] - 4.0).abs() < 1e-4, "{g:?}");
    }
}
