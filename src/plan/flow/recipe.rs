//! The plan's rows of the training recipe: the learning rate's schedule, what each optimizer
//! step does, batch norm's statistics, early stopping.
use super::super::Plan;
use crate::config::schema::*;

impl Plan {
    /// The training recipe: the learning rate's shape, and what each optimizer step does besides.
    pub(super) fn recipe_rows(&self) -> Vec<Vec<String>> {
        let mut rows = vec![self.schedule_row(), self.step_row()];
        rows.extend(self.batch_norm_row());
        rows.extend(self.early_stop_row());
        rows
    }

    fn schedule_row(&self) -> Vec<String> {
        let schedule = crate::plan::schedule::Schedule::of(self);
        vec![
            "  schedule".into(),
            format!("optimizer step 1..{}", schedule.total),
            schedule.describe(),
            if schedule.kind == ScheduleKind::Constant && schedule.warmup == 0 {
                format!("lr {} at every step", self.config.train.lr)
            } else {
                format!("lr at steps {}", schedule.points())
            },
        ]
    }

    /// What an optimizer step does with the gradients: accumulation, clipping, precision, numerics.
    fn step_row(&self) -> Vec<String> {
        let t = &self.config.train;
        let steps = self.optimizer_steps_per_epoch();
        let mut step = Vec::new();
        if t.accumulate == 1 {
            step.push("an optimizer step per batch".into());
        } else {
            step.push(format!("{} batches per optimizer step ({steps} per epoch, synced on the last)", t.accumulate));
        }
        match t.clip_grad_norm {
            Some(max) => {
                let across = if self.is_pipeline() { " (global across the stages)" } else { "" };
                step.push(format!("clip to global norm {max} after averaging{across}"));
            }
            None => step.push("no clipping".into()),
        }
        if self.config.run.cuda_graphs {
            let at = crate::plan::graphs::WARMUP_STEPS + 1;
            step.push(format!(
                "forward and backward captured as a CUDA graph at step {at}, replayed from then on (run.cuda_graphs)"
            ));
        }
        step.push(match t.precision {
            Precision::Fp32 => "fp32".into(),
            Precision::Bf16 => "bf16 autocast, float32 weights and optimizer state".into(),
            Precision::Fp16 => "fp16".into(),
        });
        step.push(match self.config.run.numerics {
            CpuNumerics::Native => "this CPU's own kernels (run.numerics = \"native\")".into(),
            CpuNumerics::Portable => format!(
                "the same bits on any x86-64 CPU with AVX2 (run.numerics = \"portable\": MKL's COMPATIBLE branch, \
                 ATen's AVX2 kernels, oneDNN and NNPACK off, {} thread{} per rank)",
                self.threads_per_rank,
                if self.threads_per_rank == 1 { "" } else { "s" }
            ),
        });
        vec![
            "  step".into(),
            "gradients".into(),
            step.join("; "),
            (if t.steps.is_some() { "lr, grad norm per validation interval" } else { "lr, grad norm per epoch" })
                .into(),
        ]
    }

    fn batch_norm_row(&self) -> Option<Vec<String>> {
        if !self.config.wrap.sync_batchnorm {
            return None;
        }
        let w = self.world_size();
        let (input, op, output) = if self.syncs_batch_norm() {
            (
                format!("the {w} ranks' batches"),
                "SyncBatchNorm: per-channel sums all-reduced in the forward pass, their gradients in the \
                 backward pass; validation uses the running statistics"
                    .to_string(),
                "running statistics, the same on every rank",
            )
        } else {
            let why = if w == 1 { "one rank" } else { "with wrap.strategy = \"none\" the ranks train alone" };
            let op = format!("plain batch norm: nothing to synchronise ({why})");
            ("each rank's batch".into(), op, "running statistics")
        };
        Some(vec!["  batch norm".into(), input, op, output.into()])
    }

    fn early_stop_row(&self) -> Option<Vec<String>> {
        let e = self.config.train.early_stop.as_ref()?;
        let metric = match e.metric {
            StopMetric::ValLoss => "val_loss",
            StopMetric::ValAcc => "val_acc",
        };
        let mode = match e.mode() {
            StopMode::Min => "min",
            StopMode::Max => "max",
        };
        Some(vec![
            "  early stop".into(),
            metric.into(),
            format!("stop after {} validations without a {mode} improvement > {}", e.patience, e.min_delta),
            "model.best.safetensors".into(),
        ])
    }
}

/// "adamw (betas 0.9, 0.99; weight decay 0.1 on matrices)", "sgd (momentum 0.9)": the optimizer,
/// and each of its keys that is set (`given`: by a file, the environment or --set) or differs from
/// its default.
pub(super) fn optimizer_text(t: &Train, given: impl Fn(&str) -> bool) -> String {
    let mut values = Vec::new();
    if t.momentum != 0.0 || given("train.momentum") {
        values.push(format!("momentum {}", t.momentum));
    }
    if t.betas != DEFAULT_BETAS || given("train.betas") {
        values.push(format!("betas {}, {}", t.betas[0], t.betas[1]));
    }
    if t.eps != DEFAULT_EPS || given("train.eps") {
        values.push(format!("eps {:e}", t.eps));
    }
    if t.weight_decay > 0.0 || given("train.weight_decay") || given("train.weight_decay_on") {
        let on = match t.weight_decay_on {
            WeightDecayOn::All => "",
            WeightDecayOn::Matrices => " on matrices",
        };
        values.push(format!("weight decay {}{on}", t.weight_decay));
    }
    let name = format!("{:?}", t.optimizer).to_lowercase();
    if values.is_empty() {
        name
    } else {
        format!("{name} ({})", values.join("; "))
    }
}
