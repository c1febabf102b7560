//! Rank 0's progress display: an indicatif bar on a terminal, plain lines otherwise.
use std::io::IsTerminal;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub struct Progress {
    bar: Option<ProgressBar>,
    /// Epoch runs: the epochs (the bar counts one epoch's batches); `None` for step runs (the
    /// bar counts the run's optimizer steps, with the ETA).
    epochs: Option<usize>,
    /// Language models: tokens per sample, to show tokens/s.
    seq_len: Option<usize>,
}

impl Progress {
    /// A display for rank 0; `None` (silent) on other ranks.
    /// `epochs`: an epoch run's epochs, its bar counting each epoch's `len` batches; `None`: a
    /// step run, its bar counting the run's `len` optimizer steps. `seq_len`: a language model's.
    pub fn new(show: bool, epochs: Option<usize>, len: usize, seq_len: Option<usize>) -> Progress {
        let bar = (show && std::io::stdout().is_terminal()).then(|| {
            let template = match epochs {
                Some(_) => "  epoch {prefix} [{bar:30}] {pos}/{len} steps  {msg}",
                None => "  step [{bar:30}] {pos}/{len}  ETA {eta}  {msg}",
            };
            let bar = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stdout());
            bar.set_style(ProgressStyle::with_template(template).expect("a valid template").progress_chars("=> "));
            if let Some(epochs) = epochs {
                bar.set_prefix(format!("1/{epochs}"));
            }
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Progress { bar, epochs, seq_len }
    }

    /// An epoch run's new epoch: the bar starts over.
    pub fn start_epoch(&self, epoch: usize) {
        if let (Some(bar), Some(epochs)) = (&self.bar, self.epochs) {
            bar.reset();
            bar.set_prefix(format!("{epoch}/{epochs}"));
        }
    }

    /// `done`: batches of the epoch (epoch runs) or optimizer steps of the run (step runs).
    /// `mfu`: a transformer's model FLOPs utilisation at that rate.
    pub fn step(&self, done: usize, loss: Option<f64>, samples_per_s: f64, mfu: Option<f64>) {
        if let Some(bar) = &self.bar {
            bar.set_position(done as u64);
            if let Some(loss) = loss {
                let rate = match self.seq_len {
                    Some(t) => format!("{:.0} tokens/s", samples_per_s * t as f64),
                    None => format!("{samples_per_s:.0} samples/s"),
                };
                let mfu = mfu.map(|m| format!("  MFU {:.1}%", 100.0 * m)).unwrap_or_default();
                bar.set_message(format!("loss {loss:.4}  {rate}{mfu}"));
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
