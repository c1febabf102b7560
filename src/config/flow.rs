//! The data-flow view of a plan, as the seed pages show it: stage, input, operation, output,
//! per rank.
use super::schema::*;
use super::Plan;
use crate::trace::view::table;

impl Plan {
    pub fn data_flow(&self) -> String {
        let c = &self.config;
        let d = &self.data;
        let l = &self.layout;
        let w = self.world_size();
        let f = d.features;
        let source = match &d.file {
            None => format!("synthetic (seed {}, noise {})", c.run.seed, d.noise),
            Some(info) => info.path.display().to_string(),
        };
        let order = if c.shard.shuffle { "reshuffled every epoch" } else { "file order" };
        let mut shard_op = match l.split_batch {
            None => format!("DistributedSampler over {w} rank{}, {order}", if w == 1 { "" } else { "s" }),
            Some(b) => format!("each global batch of {} split {w} × {b}, {order}", b * w),
        };
        if l.padding() > 0 {
            shard_op += &format!(
                ", {} padding row{} (not counted in metrics)",
                l.padding(),
                if l.padding() == 1 { "" } else { "s" }
            );
        }
        if l.dropped() > 0 {
            shard_op +=
                &format!(", {} row{} dropped (drop_last)", l.dropped(), if l.dropped() == 1 { "" } else { "s" });
        }
        let norm = match c.normalize.method {
            NormalizeMethod::Minmax => "min-max to [0, 1]",
            NormalizeMethod::Standard => "standardise to mean 0, std 1",
            NormalizeMethod::None => "none",
        };
        let scope = match c.normalize.scope {
            NormalizeScope::Rank => "statistics of each rank's shard",
            NormalizeScope::Global => "statistics all-reduced over ranks",
        };
        let model = crate::model::describe(f, &c.wrap.model.hidden, d.classes);
        let wrap_op = match c.wrap.strategy {
            WrapStrategy::Ddp => {
                format!("DDP (c10d Reducer, {} MiB buckets), weights broadcast from rank 0", c.wrap.bucket_cap_mb)
            }
            WrapStrategy::None => "no synchronisation: independent replicas".into(),
        };
        let opt = format!("{:?}", c.train.optimizer).to_lowercase();
        let val = if c.validate.every == 0 {
            "off".to_string()
        } else {
            let on = if c.validate.on == ValidateOn::All { "every rank" } else { "rank 0" };
            format!("every {} epoch(s) on {on}", c.validate.every)
        };
        let rows = vec![
            vec![
                "1 load".into(),
                source,
                format!("{} training + {} validation rows, {} classes", d.rows, d.validation_rows, d.classes),
                format!("{} × {f}", d.rows),
            ],
            vec!["2 shard".into(), format!("{} × {f}", d.rows), shard_op, format!("{} × {f} per rank", l.per_rank)],
            vec![
                "3 normalize".into(),
                format!("{} × {f} per rank", l.per_rank),
                format!("{norm}, {scope}"),
                format!("{} × {f} per rank", l.per_rank),
            ],
            vec![
                "4 wrap".into(),
                format!("MLP {model} ({} parameters)", self.parameters),
                wrap_op,
                format!("{w} replica{}", if w == 1 { "" } else { "s" }),
            ],
            vec![
                "5 train".into(),
                format!("{} × {f} per rank", l.per_rank),
                format!(
                    "{} epochs × {} steps of {} per rank ({} global), {opt} lr {}",
                    c.train.epochs,
                    self.steps_per_epoch(),
                    self.batch_per_rank,
                    self.batch_per_rank * w,
                    c.train.lr
                ),
                "loss, accuracy per epoch".into(),
            ],
            vec!["  validate".into(), format!("{} × {f}", d.validation_rows), val, "val loss, val accuracy".into()],
        ];
        format!(
            "run {} ({}): {w} rank{} × {} thread{}\n\n{}",
            c.run.name,
            self.run_id,
            if w == 1 { "" } else { "s" },
            self.threads_per_rank,
            if self.threads_per_rank == 1 { "" } else { "s" },
            table(&["stage", "input", "operation", "output"], &rows)
        )
    }
}
