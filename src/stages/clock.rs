//! Where every optimizer step of a run takes its batches (an epoch's shard, or random windows),
//! and where intervals end.
use std::ops::Range;

use crate::plan::Plan;

/// Where every optimizer step of a run takes its batches, and where intervals end.
#[derive(Debug, Clone)]
pub struct Clock {
    /// Optimizer steps in the run.
    pub total: usize,
    /// Batches per optimizer step (train.accumulate).
    pub accumulate: usize,
    /// Batches per epoch on a rank, and optimizer steps per epoch (groups of `accumulate`
    /// batches; the last group of an epoch may be shorter).
    pub batches_per_epoch: usize,
    pub steps_per_epoch: usize,
    /// Rows per batch, and rows in a rank's epoch.
    pub batch: usize,
    pub rows_per_epoch: usize,
    /// Windows at random offsets instead of an epoch's shard.
    pub random: bool,
    /// A trace row every this many steps (steps runs); `None`: every epoch.
    pub row_every: Option<usize>,
}

impl Clock {
    pub fn of(plan: &Plan) -> Clock {
        let c = &plan.config;
        Clock {
            total: plan.total_steps(),
            accumulate: c.train.accumulate,
            batches_per_epoch: plan.steps_per_epoch(),
            steps_per_epoch: plan.optimizer_steps_per_epoch(),
            batch: plan.batch_per_rank,
            rows_per_epoch: plan.layout.per_rank,
            random: plan.data.random_windows(),
            row_every: c.train.steps.map(|total| c.validate.every_steps.unwrap_or(total)),
        }
    }

    /// The (1-based) epoch of optimizer step `step` (0-based).
    pub fn epoch(&self, step: usize) -> usize {
        step / self.steps_per_epoch.max(1) + 1
    }

    /// The batches of optimizer step `step`: with epochs, indices within its epoch; with random
    /// windows, a global batch counter (each is `batch` rows).
    pub fn batches(&self, step: usize) -> Range<usize> {
        if self.random {
            return step * self.accumulate..(step + 1) * self.accumulate;
        }
        let g = step % self.steps_per_epoch.max(1);
        g * self.accumulate..((g + 1) * self.accumulate).min(self.batches_per_epoch)
    }

    /// Rows in batch `b` of an epoch (the last may be short); `batch` with random windows.
    pub fn rows(&self, b: usize) -> usize {
        if self.random {
            self.batch
        } else {
            self.batch.min(self.rows_per_epoch - b * self.batch)
        }
    }

    /// Whether a trace row ends after `done` optimizer steps.
    pub fn row_ends(&self, done: usize) -> bool {
        done == self.total
            || match self.row_every {
                Some(n) => done.is_multiple_of(n),
                None => done.is_multiple_of(self.steps_per_epoch.max(1)),
            }
    }

    /// The interval (from one row's end to the next) that holds optimizer step `step`.
    pub fn interval_of(&self, step: usize) -> Range<usize> {
        let mut start = step;
        while start > 0 && !self.row_ends(start) {
            start -= 1;
        }
        let mut end = step + 1;
        while !self.row_ends(end) {
            end += 1;
        }
        start..end
    }
}
