//! Rank 0's progress display: an indicatif bar on a terminal, plain lines otherwise.
use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub struct Progress {
    bar: Option<ProgressBar>,
    epochs: usize,
}

impl Progress {
    /// A display for rank 0; `None` (silent) on other ranks.
    pub fn new(show: bool, epochs: usize, steps: usize) -> Progress {
        let bar = (show && std::io::stdout().is_terminal()).then(|| {
            let bar = ProgressBar::with_draw_target(Some(steps as u64), ProgressDrawTarget::stdout());
            bar.set_style(
                ProgressStyle::with_template("  epoch {prefix} [{bar:30}] {pos}/{len} steps  {msg}")
                    .expect("a valid template")
                    .progress_chars("=> "),
            );
            bar.set_prefix(format!("1/{epochs}"));
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Progress { bar, epochs }
    }

    pub fn start_epoch(&self, epoch: usize) {
        if let Some(bar) = &self.bar {
            bar.reset();
            bar.set_prefix(format!("{epoch}/{}", self.epochs));
        }
    }

    pub fn step(&self, done: usize, loss: Option<f64>, samples_per_s: f64) {
        if let Some(bar) = &self.bar {
            bar.set_position(done as u64);
            if let Some(loss) = loss {
                bar.set_message(format!("loss {loss:.4}  {samples_per_s:.0} samples/s"));
            }
        }
    }

    /// The end-of-epoch line, printed whether or not a bar is drawn.
    pub fn end_epoch(&self, line: &str, show: bool) {
        match &self.bar {
            Some(bar) => bar.println(format!("  {line}")),
            None if show => crate::say!("  {line}"),
            None => {}
        }
    }

    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
