//! The training values: the optimizer's, the run's length (epochs or optimizer steps), when it
//! validates and checkpoints, and the training recipe's (schedule, clipping, accumulation,
//! precision, early stopping), each against the others and against the run's length.
// `!(x > 0.0)` is meant: it also rejects NaN, which `x <= 0.0` would let through.
#![allow(clippy::neg_cmp_op_on_partial_ord)]
use super::schedule;
use crate::config::schema::*;

/// Where each dotted key's value came from (`default`, `file p.toml:3`, `--set ...`).
type Sources = std::collections::BTreeMap<String, String>;

/// The optimizer's values and the run's length, in epochs or optimizer steps.
pub fn train_values(c: &Config, sources: &Sources, bad: &mut impl FnMut(&str, String)) {
    let t = &c.train;
    if t.epochs == 0 {
        bad("train.epochs", "must be at least 1".into());
    }
    if t.batch_size == 0 {
        bad("train.batch_size", "must be at least 1".into());
    }
    if !(t.lr > 0.0 && t.lr.is_finite()) {
        bad("train.lr", format!("must be positive, got {}", t.lr));
    }
    if t.optimizer != Optimizer::Sgd && t.momentum != 0.0 {
        bad(
            "train.momentum",
            format!("is only used by optimizer = \"sgd\", not {:?}: remove it", t.optimizer).to_lowercase(),
        );
    }
    if !(0.0..1.0).contains(&t.momentum) {
        bad("train.momentum", format!("must be in [0, 1), got {}", t.momentum));
    }
    adam_values(t, bad);
    if !(t.weight_decay >= 0.0) {
        bad("train.weight_decay", format!("must be 0 or more, got {}", t.weight_decay));
    }
    if c.wrap.bucket_cap_mb.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
        bad("wrap.bucket_cap_mb", format!("must be positive, got {}", c.wrap.bucket_cap_mb));
    }
    let checkpoints = c.checkpoint.every > 0 || c.checkpoint.every_steps.is_some();
    if checkpoints && c.checkpoint.keep == 0 {
        bad("checkpoint.keep", "must be at least 1 when checkpoint.every or checkpoint.every_steps is set".into());
    }
    step_values(c, sources, bad);
}

/// `train.betas` and `train.eps`: Adam's alone, each in its range.
fn adam_values(t: &Train, bad: &mut impl FnMut(&str, String)) {
    let given = [("train.betas", t.betas != DEFAULT_BETAS), ("train.eps", t.eps != DEFAULT_EPS)];
    for (key, _) in given.into_iter().filter(|&(_, set)| set && t.optimizer == Optimizer::Sgd) {
        bad(key, "is only used by optimizer = \"adam\" or \"adamw\", not \"sgd\": remove it".into());
    }
    if !t.betas.iter().all(|b| (0.0..1.0).contains(b)) {
        bad("train.betas", format!("must both be in [0, 1), got {:?}", t.betas));
    }
    if !(t.eps > 0.0 && t.eps.is_finite()) {
        bad("train.eps", format!("must be positive, got {}", t.eps));
    }
}

/// `train.steps` and the keys that count steps.
fn step_values(c: &Config, sources: &Sources, bad: &mut impl FnMut(&str, String)) {
    let t = &c.train;
    for (key, v) in [
        ("train.steps", t.steps),
        ("validate.every_steps", c.validate.every_steps),
        ("validate.batches", c.validate.batches),
        ("checkpoint.every_steps", c.checkpoint.every_steps),
    ] {
        if v == Some(0) {
            bad(key, "must be at least 1 (leave it out for none)".into());
        }
    }
    if t.steps.is_some_and(|s| s > crate::limits::MAX_ROWS) {
        bad("train.steps", format!("must be at most {}", crate::limits::MAX_ROWS));
    }
    // Given by a file, the environment or --set, whatever its value (a run's config.toml leaves
    // train.epochs out of a run in steps).
    let epochs_from = sources.get("train.epochs").filter(|s| s.as_str() != "default");
    match t.steps {
        Some(_) if epochs_from.is_some() || t.epochs != Train::default().epochs => {
            let from = |key: &str| sources.get(key).map_or("default", String::as_str).to_owned();
            bad(
                "train.steps",
                format!(
                    "and train.epochs = {} ({}) both set the run's length: keep one",
                    t.epochs,
                    from("train.epochs")
                ),
            )
        }
        Some(_) => {
            if !matches!(c.validate.every, 0 | 1) {
                bad(
                    "validate.every",
                    "counts epochs, but train.steps counts optimizer steps: use validate.every_steps (0 still turns \
                     validation off)"
                        .into(),
                );
            }
            if c.checkpoint.every > 0 {
                bad(
                    "checkpoint.every",
                    "counts epochs, but train.steps counts optimizer steps: use checkpoint.every_steps".into(),
                );
            }
        }
        None => {
            if c.validate.every_steps.is_some() {
                bad(
                    "validate.every_steps",
                    "counts optimizer steps: give the run as train.steps, or validate every validate.every epochs"
                        .into(),
                );
            }
            if c.load.sampling == Sampling::Random {
                bad(
                    "load.sampling",
                    "\"random\" draws each step's windows anywhere in the stream, so a run has no epochs: give \
                     train.steps instead of train.epochs"
                        .into(),
                );
            }
        }
    }
    if c.load.sampling == Sampling::Random {
        let s = &t.schedule;
        for (key, set) in
            [("train.schedule.warmup_epochs", s.warmup_epochs > 0), ("train.schedule.step_epochs", s.step_epochs > 0)]
        {
            if set {
                bad(key, "counts epochs, which random windows do not have: give it in optimizer steps".into());
            }
        }
    }
}

/// The training recipe's own values (schedule, clipping, accumulation, precision, early stopping).
pub fn recipe_values(c: &Config, validation_rows: Option<usize>, bad: &mut impl FnMut(&str, String)) {
    let t = &c.train;
    if t.accumulate == 0 {
        bad("train.accumulate", "must be at least 1 (1: an optimizer step per batch)".into());
    }
    if t.fused == Some(true) && t.optimizer == Optimizer::Sgd {
        bad(
            "train.fused",
            "the runner has a fused kernel for \"adam\" and \"adamw\" only; leave train.fused out with \"sgd\", \
             or choose optimizer = \"adamw\""
                .into(),
        );
    }
    if let Some(max) = t.clip_grad_norm {
        if !(max > 0.0 && max.is_finite()) {
            bad("train.clip_grad_norm", format!("must be a positive norm, got {max}"));
        }
    }
    match (t.precision, c.run.device) {
        (Precision::Fp16, Device::Cpu) => bad(
            "train.precision",
            "\"fp16\" (with dynamic loss scaling) needs a GPU: CPUs have no fast float16 arithmetic; use \"bf16\" on \
             CPU (autocast to bfloat16, float32 weights) or \"fp32\""
                .into(),
        ),
        (Precision::Fp16, Device::Cuda) => bad(
            "train.precision",
            "\"fp16\" with dynamic loss scaling is not built yet; use \"bf16\" (GPUs since Ampere compute in \
             bfloat16, which needs no loss scaling) or \"fp32\""
                .into(),
        ),
        _ => {}
    }
    schedule_values(t, bad);
    if let Some(e) = &t.early_stop {
        let why = "[train.early_stop] watches a validation metric: validate, or remove [train.early_stop]";
        if c.validate.every == 0 {
            bad("validate.every", format!("is 0 (no validation), but {why}"));
        } else if validation_rows == Some(0) {
            bad("load.validation_rows", format!("is 0 (no validation rows), but {why}"));
        }
        if e.patience == 0 {
            bad("train.early_stop.patience", "must be at least 1 validation".into());
        }
        if !(e.min_delta >= 0.0 && e.min_delta.is_finite()) {
            bad("train.early_stop.min_delta", format!("must be 0 or more, got {}", e.min_delta));
        }
    }
}

/// `[train.schedule]`'s values: each key read only by the kinds that read it.
fn schedule_values(t: &crate::config::schema::Train, bad: &mut impl FnMut(&str, String)) {
    let s = &t.schedule;
    if s.warmup_steps > 0 && s.warmup_epochs > 0 {
        bad("train.schedule.warmup_epochs", "give the warmup in steps or in epochs, not both".into());
    }
    let decays = matches!(s.kind, ScheduleKind::Linear | ScheduleKind::Cosine);
    if s.min_lr != 0.0 && !decays {
        bad("train.schedule.min_lr", "is only read by kind = \"linear\" or \"cosine\"".into());
    } else if decays && !(s.min_lr >= 0.0 && s.min_lr < t.lr) {
        bad("train.schedule.min_lr", format!("must be in [0, train.lr = {}), got {}", t.lr, s.min_lr));
    }
    if s.decay_end.is_some() && !decays {
        bad("train.schedule.decay_end", "is only read by kind = \"linear\" or \"cosine\"".into());
    }
    if s.kind == ScheduleKind::Step {
        if (s.step_size > 0) == (s.step_epochs > 0) {
            bad(
                "train.schedule.step_size",
                "kind = \"step\" needs step_size (optimizer steps) or step_epochs, one of them".into(),
            );
        }
        if let Some(g) = s.gamma.filter(|g| !(*g > 0.0 && *g <= 1.0)) {
            bad("train.schedule.gamma", format!("must be in (0, 1], got {g}"));
        }
    } else {
        for (key, set) in [
            ("train.schedule.step_size", s.step_size > 0),
            ("train.schedule.step_epochs", s.step_epochs > 0),
            ("train.schedule.gamma", s.gamma.is_some()),
        ] {
            if set {
                bad(key, "is only read by kind = \"step\"".into());
            }
        }
    }
}

/// `validate.on = "split"` measures one model from every rank's share of the rows: the ranks must
/// hold the same model (DDP), and each needs a row. So does FSDP whatever `validate.on` says but
/// "all": every rank runs the layers (their gathers are collectives) on its share. Checked once
/// the strategy is known (after `wrap.strategy = "auto"` chose).
pub fn split_validation(c: &Config, validation_rows: Option<usize>, bad: &mut impl FnMut(&str, String)) {
    let w = c.run.world_size;
    if c.validate.every == 0 || w < 2 {
        return;
    }
    if c.wrap.strategy == WrapStrategy::Fsdp && c.validate.on != ValidateOn::All {
        if let Some(rows) = validation_rows.filter(|&rows| rows < w) {
            bad(
                "validate.on",
                format!(
                    "\"{}\" under FSDP validates on every rank (each gathers the layers), each on its share of the \
                     {rows} validation row(s), but {w} ranks need at least {w}; hold out at least {w} rows, or set \
                     validate.on = \"all\" (every rank validates every row)",
                    format!("{:?}", c.validate.on).to_lowercase()
                ),
            );
        }
        return;
    }
    if c.validate.on != ValidateOn::Split {
        return;
    }
    if c.wrap.strategy == WrapStrategy::None {
        bad(
            "validate.on",
            "\"split\" measures one model from every rank's share of the rows, but with wrap.strategy = \"none\" \
             each rank trains a model of its own; use \"rank0\" (rank 0's model) or \"all\" (each rank's)"
                .into(),
        );
        return;
    }
    if let Some(rows) = validation_rows.filter(|&rows| rows < w) {
        bad(
            "validate.on",
            format!(
                "\"split\" shares the {rows} validation row(s) among {w} ranks, so some would have none; use \"rank0\", \
                 or hold out at least {w} rows"
            ),
        );
    }
}

/// The recipe's checks against the run's length: `batches` per epoch on a rank, `total`
/// optimizer steps in the run.
pub fn recipe_lengths(c: &Config, batches: usize, total: usize, bad: &mut impl FnMut(&str, String)) {
    let t = &c.train;
    if t.accumulate > batches {
        bad(
            "train.accumulate",
            format!(
                "{} batches per optimizer step, but an epoch has only {batches} batches per rank; use at most {batches}",
                t.accumulate
            ),
        );
        return;
    }
    let steps = batches.div_ceil(t.accumulate);
    let s = schedule::Schedule::new(&t.schedule, t.lr, total, steps);
    if let Some(why) = s.out_of_range() {
        bad("train.lr", why);
    }
    if t.schedule.decay_end.is_some_and(|end| end <= s.warmup) {
        bad(
            "train.schedule.decay_end",
            format!("must be after the warmup ({} optimizer steps), got {}", s.warmup, s.decay_end),
        );
    }
    // With decay_end the curve is defined past the run's end: a run shorter than its warmup is
    // then the start of a longer one (a search's first rung), not a mistake.
    if s.warmup >= s.total && s.warmup > 0 && t.schedule.decay_end.is_none() {
        let key =
            if t.schedule.warmup_epochs > 0 { "train.schedule.warmup_epochs" } else { "train.schedule.warmup_steps" };
        bad(
            key,
            match t.steps {
                None => format!(
                    "the warmup ({} optimizer steps) is as long as the run or longer ({} epochs × {steps} steps = {}); \
                     shorten it",
                    s.warmup, t.epochs, s.total
                ),
                Some(_) => format!(
                    "the warmup ({} optimizer steps) is as long as the run or longer (train.steps = {}); shorten it",
                    s.warmup, s.total
                ),
            },
        );
    }
}
