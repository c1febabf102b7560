//! The plan's checkpoint row: when the training state is saved, how (in the step or in the
//! background), how many are kept, and what a failed rank does then (`run.max_restarts`), so
//! that what a crash costs is read in the plan before the run.
use super::Plan;

impl Plan {
    /// `checkpoint` under the train stage: stage, input, operation, output.
    pub(super) fn checkpoint_row(&self) -> Vec<String> {
        let (k, restarts) = (&self.config.checkpoint, self.config.run.max_restarts);
        let when = match (k.every_steps, k.every) {
            (Some(n), 0) => Some(format!("every {n} optimizer step(s) and after the last")),
            (Some(n), e) => Some(format!("every {n} optimizer step(s), every {e} epoch(s) and after the last")),
            (None, 0) => None,
            (None, e) => Some(format!("every {e} epoch(s) and after the last")),
        };
        let from = if when.is_some() { "the newest checkpoint" } else { "the start" };
        let on_failure = match restarts {
            0 => "a failed rank ends the run (run.max_restarts = 0)".to_owned(),
            n => format!("a failed rank: every rank starts again from {from}, up to {n} time(s) (run.max_restarts)"),
        };
        let (operation, output) = match when {
            Some(when) => {
                let how = if k.asynchronous {
                    "written in the background while training goes on (checkpoint.async)"
                } else {
                    "written in the step (training waits for it)"
                };
                (format!("{when}, {how}, the {} newest kept; {on_failure}", k.keep), "RUN_DIR/checkpoints/".into())
            }
            None => (format!("none (checkpoint.every = 0): a stopped run starts over; {on_failure}"), "—".into()),
        };
        vec!["  checkpoint".into(), "model, optimizer, data position".into(), operation, output]
    }
}
