//! The data-flow view of a plan, as the seed pages show it: stage, input, operation, output,
//! per rank.
mod ranks;
mod recipe;

use recipe::optimizer_text;

use super::Plan;
use crate::config::schema::*;
use crate::trace::view::{fitted_table, terminal_width};

impl Plan {
    pub fn data_flow(&self) -> String {
        let (c, d, w) = (&self.config, &self.data, self.world_size());
        let f = self.sample_shape();
        let per = self.per_rank_label();
        let mut rows = vec![
            vec!["1 load".into(), d.describe(), self.load_op(), format!("{} × {f}", d.rows)],
            vec![
                "2 shard".into(),
                format!("{} × {f}", d.rows),
                self.shard_op(),
                format!("{} × {f} {per}", self.layout.per_rank),
            ],
            vec![
                "3 normalize".into(),
                format!("{} × {f} {per}", self.layout.per_rank),
                self.normalize_op(),
                format!("{} × {f} {per}", self.layout.per_rank),
            ],
            vec![
                "4 wrap".into(),
                format!("{} ({} parameters)", self.model().describe(), self.parameters),
                self.wrap_op(),
                self.wrap_out(),
            ],
        ];
        if self.is_pipeline() {
            rows.extend(self.stage_rows());
        }
        if self.is_sharded() {
            rows.extend(self.unit_rows());
        }
        rows.push(self.train_row());
        rows.extend(self.recipe_rows());
        rows.push(vec![
            "  validate".into(),
            format!("{} × {f}", d.validation_rows),
            self.validate_op(),
            "val loss, val accuracy".into(),
        ]);
        rows.push(self.checkpoint_row());
        format!(
            "run {} ({}): {w} rank{} × {} thread{}\n\n{}{}",
            c.run.name,
            self.run_id,
            if w == 1 { "" } else { "s" },
            self.threads_per_rank,
            if self.threads_per_rank == 1 { "" } else { "s" },
            fitted_table(&["stage", "input", "operation", "output"], &rows, terminal_width()),
            self.bubble_note() + &self.memory_note() + &super::mesh::note(self)
        )
    }

    /// One sample's shape: "10" for rows of 10 features, "3 × 32 × 32" for images.
    fn sample_shape(&self) -> String {
        self.data.input.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" × ")
    }

    /// Whose rows a shape counts: each rank's, each pipeline copy's, or every rank's.
    fn per_rank_label(&self) -> &'static str {
        match (self.is_pipeline(), self.layout.world_size) {
            (true, 1) => "on every rank",
            (true, _) => "per copy",
            (false, _) => "per rank",
        }
    }

    fn load_op(&self) -> String {
        let d = &self.data;
        match d.task {
            crate::data::Task::LanguageModel { vocab, masked: true } => match &d.source {
                crate::data::SourceSpec::Instructions(i) if i.packed.is_some() => format!(
                    "{} training + {} validation windows of {} tokens packed with examples (each attending to \
                     itself), the loss on the responses, vocab {vocab}",
                    d.rows,
                    d.validation_rows,
                    d.input_size()
                ),
                _ => format!(
                    "{} training + {} validation examples of at most {} + 1 tokens, padded, the loss on the \
                     responses, vocab {vocab}",
                    d.rows,
                    d.validation_rows,
                    d.input_size()
                ),
            },
            crate::data::Task::LanguageModel { vocab, .. } => format!(
                "{} training + {} validation windows of {} + 1 tokens, vocab {vocab}",
                d.rows,
                d.validation_rows,
                d.input_size()
            ),
            crate::data::Task::Regression => {
                format!("{} training + {} validation rows, a number to predict", d.rows, d.validation_rows)
            }
            crate::data::Task::Classification { classes } => {
                format!("{} training + {} validation rows, {classes} classes", d.rows, d.validation_rows)
            }
        }
    }

    fn shard_op(&self) -> String {
        let (c, l, w) = (&self.config, &self.layout, self.world_size());
        let order = if c.shard.shuffle { "reshuffled every epoch" } else { "file order" };
        let (stages, copies, tensor) = (self.pipeline_stages(), l.world_size, self.mesh().tensor);
        let pipeline = self.is_pipeline();
        if self.data.random_windows() {
            return format!(
                "random windows: every step, each rank draws {} windows at uniformly random token offsets (seeded by \
                 run.seed, step, rank)",
                self.batch_per_rank
            );
        }
        let mut op = match l.split_batch {
            None if pipeline && copies == 1 => {
                format!("none (one model, no replicas): every rank walks the same rows, {order}")
            }
            None if pipeline => format!(
                "DistributedSampler over {copies} copies of the pipeline (the {stages} ranks of a copy walk the same \
                 rows), {order}"
            ),
            None if tensor > 1 => format!(
                "DistributedSampler over {copies} data rank{} (the {tensor} ranks of a tensor group read the same \
                 rows), {order}",
                if copies == 1 { "" } else { "s" }
            ),
            None => format!("DistributedSampler over {w} rank{}, {order}", if w == 1 { "" } else { "s" }),
            Some(b) => format!("each global batch of {} split {copies} × {b}, {order}", b * copies),
        };
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        if l.padding() > 0 {
            op += &format!(", {} padding row{} (not counted in metrics)", l.padding(), plural(l.padding()));
        }
        if l.dropped() > 0 {
            op += &format!(", {} row{} dropped (drop_last)", l.dropped(), plural(l.dropped()));
        }
        op
    }

    fn normalize_op(&self) -> String {
        let c = &self.config;
        let norm = match c.normalize.method {
            NormalizeMethod::Minmax => "min-max to [0, 1]",
            NormalizeMethod::Standard => "standardise to mean 0, std 1",
            NormalizeMethod::None => "none",
        };
        let scope = match c.normalize.scope {
            _ if self.is_pipeline() && self.layout.world_size == 1 => {
                "statistics of the training set (every rank's rows)"
            }
            NormalizeScope::Rank if self.is_pipeline() => "statistics of each copy's shard",
            NormalizeScope::Rank => "statistics of each rank's shard",
            NormalizeScope::Global => "statistics all-reduced over ranks",
        };
        format!("{norm}, {scope}")
    }

    fn wrap_op(&self) -> String {
        let c = &self.config;
        let (stages, copies) = (self.pipeline_stages(), self.layout.world_size);
        let replicas = self.thread_replicas();
        if replicas > 1 {
            let per = self.threads_per_rank / replicas;
            let each = format!(
                "{replicas} replicas per rank sharing its weights, {per} thread{} each, computing their parts of every batch at once, gradients summed in order",
                if per == 1 { "" } else { "s" }
            );
            return match (c.wrap.strategy, self.world_size()) {
                (WrapStrategy::Ddp, w) if w > 1 => {
                    format!("{each}, then averaged across ranks in one all-reduce; weights broadcast from rank 0")
                }
                (WrapStrategy::None, w) if w > 1 => format!("{each}; no synchronisation between ranks"),
                _ => each,
            };
        }
        match c.wrap.strategy {
            WrapStrategy::Ddp => {
                format!("DDP (c10d Reducer, {} MiB buckets), weights broadcast from rank 0", c.wrap.bucket_cap_mb)
            }
            WrapStrategy::None => "no synchronisation: independent replicas".into(),
            WrapStrategy::Fsdp | WrapStrategy::Auto => self.fsdp_op(),
            WrapStrategy::Pipeline => format!(
                "pipeline over {stages} rank{}{}{}, layers {}; {}, {} micro-batch{} per batch",
                if stages == 1 { "" } else { "s" },
                match self.mesh().tensor {
                    1 => String::new(),
                    t => format!(" (each stage split across {t} tensor ranks)"),
                },
                if copies == 1 {
                    String::new()
                } else {
                    format!(" × {copies} copies (each stage's gradients averaged over the copies)")
                },
                if c.wrap.pipeline.stages.is_some() { "as wrap.pipeline.stages" } else { "balanced by parameters" },
                schedule_name(c.wrap.pipeline.schedule),
                c.wrap.pipeline.micro_batches,
                if c.wrap.pipeline.micro_batches == 1 { "" } else { "es" },
            ),
        }
    }

    fn wrap_out(&self) -> String {
        let (w, stages, copies) = (self.world_size(), self.pipeline_stages(), self.layout.world_size);
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        match self.config.wrap.strategy {
            WrapStrategy::Pipeline if copies > 1 => format!("{stages} stages × {copies} copies"),
            WrapStrategy::Pipeline => format!("{stages} stage{}", if stages == 1 { "" } else { "s" }),
            WrapStrategy::Fsdp if self.mesh().tensor > 1 => {
                format!("1/{} of a tensor slice of the model on each rank", self.mesh().data)
            }
            WrapStrategy::Fsdp => format!("1/{w} of the model on each rank"),
            _ if self.mesh().tensor > 1 => {
                format!("{copies} replica{}, each split over {} tensor ranks", plural(copies), self.mesh().tensor)
            }
            _ => format!("{w} replica{}", plural(w)),
        }
    }

    /// FSDP's wrap operation: how the model is cut and when its units are gathered.
    fn fsdp_op(&self) -> String {
        let (zero, when) = if self.config.wrap.fsdp.reshard_after_forward {
            ("ZeRO-3", "gathered for its forward and again for its backward")
        } else {
            ("ZeRO-2", "gathered from its forward to its backward")
        };
        let mesh = self.mesh();
        let of = if mesh.tensor > 1 { " of its tensor slice" } else { "" };
        format!(
            "FSDP ({zero}): each rank holds 1/{}{of} of every parameter, gradient and optimizer state; each unit {when}, \
             its gradients reduce-scattered as its backward ends",
            self.world_size() / mesh.tensor
        )
    }

    /// The train stage: the run's length, the batches, the optimizer.
    fn train_row(&self) -> Vec<String> {
        let (c, d) = (&self.config, &self.data);
        let (f, per) = (self.sample_shape(), self.per_rank_label());
        let copies = self.layout.world_size;
        let opt = optimizer_text(&c.train, |key| self.sources.get(key).is_some_and(|s| s != "default"));
        let length = match c.train.steps {
            Some(n) if c.train.accumulate > 1 => format!("{n} optimizer steps × {} batches", c.train.accumulate),
            Some(n) => format!("{n} steps"),
            None => format!("{} epochs × {} steps", c.train.epochs, self.steps_per_epoch()),
        };
        let op = if self.is_pipeline() {
            let micro = micro_text(self.batch_per_rank, c.wrap.pipeline.micro_batches);
            format!(
                "{length} of {} ({micro}){}, {opt} lr {}; loss on {}",
                self.batch_per_rank,
                if copies == 1 {
                    String::new()
                } else {
                    format!(" per copy ({} global)", self.batch_per_rank * copies)
                },
                c.train.lr,
                // The last stage's last tensor rank measures it.
                if copies == 1 {
                    format!("rank {}", self.pipeline_ranks() - 1)
                } else {
                    "the last rank of each copy".into()
                },
            )
        } else {
            format!(
                "{length} of {} per rank ({} global), {opt} lr {}",
                self.batch_per_rank,
                self.batch_per_rank * copies,
                c.train.lr
            )
        };
        let every = match c.validate.every_steps.or(c.train.steps) {
            Some(_) => "per validation interval",
            None => "per epoch",
        };
        let out = if d.task.is_language_model() {
            format!("loss, perplexity, next-token accuracy, tokens/s {every}")
        } else {
            format!("loss, accuracy {every}")
        };
        vec!["5 train".into(), format!("{} × {f} {per}", self.layout.per_rank), op, out]
    }

    fn validate_op(&self) -> String {
        let c = &self.config;
        let every = match (c.validate.every_steps, c.train.steps) {
            (Some(n), _) => format!("every {n} step(s)"),
            (None, Some(n)) => format!("after step {n}"),
            (None, None) => format!("every {} epoch(s)", c.validate.every),
        };
        let fixed = match c.validate.batches {
            Some(b) => {
                format!(" ({b} batch{} of {}, the same every time)", if b == 1 { "" } else { "es" }, c.train.batch_size)
            }
            None => String::new(),
        };
        match (c.validate.every, c.validate.on) {
            (0, _) => "off".to_string(),
            _ if self.is_pipeline() => {
                let last = self.pipeline_ranks() - 1;
                format!("{every}{fixed}, forward through ranks 0-{last}, measured on rank {last}")
            }
            (_, ValidateOn::All) => format!("{every}{fixed} on every rank"),
            (_, ValidateOn::Split) if self.world_size() > 1 => {
                format!("{every}{fixed}, each rank its share of the rows, measured on rank 0")
            }
            (_, ValidateOn::Rank0) if self.is_sharded() && self.world_size() > 1 => format!(
                "{every}{fixed}, measured on rank 0 (each rank runs its share of the rows through the layers, whose \
                 gathers are collectives, scaled as rank 0 scales them)"
            ),
            (_, ValidateOn::Rank0 | ValidateOn::Split) => format!("{every}{fixed} on rank 0"),
        }
    }
}

fn schedule_name(s: Schedule) -> &'static str {
    match s {
        Schedule::Gpipe => "GPipe",
        Schedule::OneFOneB => "1F1B",
    }
}

/// The rows of a micro-batch: "16", or "16-17" when the batch does not divide evenly.
fn micro_size(batch: usize, micro: usize) -> String {
    let (lo, hi) = (batch / micro, batch.div_ceil(micro));
    if lo == hi {
        lo.to_string()
    } else {
        format!("{lo}-{hi}")
    }
}

fn micro_text(batch: usize, micro: usize) -> String {
    match micro {
        1 => "1 micro-batch".into(),
        m => format!("{m} micro-batches of {}", micro_size(batch, m)),
    }
}

/// Bytes as MiB with three decimals.
fn fmt_mib(bytes: f64) -> String {
    format!("{:.3}", bytes / 1048576.0)
}

/// How a layout's training state compares with DDP's. Under FSDP, why the saving is less than
/// 1 - 1/N of DDP's: beside its shards a rank holds what is in flight at its peak, the units
/// gathered whole (computing and prefetched) and the whole gradients of the unit being reduced.
fn versus_ddp(
    layout: super::memory::Layout,
    state: &super::memory::State,
    ddp: &super::memory::State,
    world: usize,
) -> String {
    let (held, whole) = (state.total(), ddp.total());
    let size = crate::limits::size;
    if !matches!(layout, super::memory::Layout::Fsdp { .. }) || world < 2 || held >= whole {
        return format!("; DDP would hold {}", size(whole));
    }
    let shards = whole / world as f64;
    format!(
        "; DDP would hold {}, so FSDP saves {} ({:.0}%), not 1 - 1/{world} of it: beside its shards ({}) a rank \
         holds {} in flight at its peak (units gathered whole, gradients being reduced)",
        size(whole),
        size(whole - held),
        100.0 * (whole - held) / whole,
        size(shards),
        size((held - shards).max(0.0))
    )
}
