//! The sweep's one progress display: points done / total, the point running and an ETA from the
//! points run so far. An indicatif bar on a terminal, plain lines otherwise (logs, CI, pipes).
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub struct SweepProgress {
    bar: Option<ProgressBar>,
    total: usize,
    done: usize,
    /// Points that still have to run (skipped ones do not count).
    to_run: usize,
    ran: usize,
    run_time: Duration,
    started: Option<Instant>,
}

impl SweepProgress {
    /// `verb` names what happens to a point: "run", "check".
    pub fn new(total: usize, to_run: usize, verb: &str) -> SweepProgress {
        let bar = std::io::stdout().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stdout());
            bar.set_style(
                ProgressStyle::with_template(&format!(
                    "  {verb} [{{bar:30}}] {{pos}}/{{len}} points  {{elapsed}}  {{msg}}"
                ))
                .expect("a valid template")
                .progress_chars("=> "),
            );
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        SweepProgress { bar, total, done: 0, to_run, ran: 0, run_time: Duration::ZERO, started: None }
    }

    /// A point that does not need to run.
    pub fn skip(&mut self, label: &str, why: &str) {
        self.done += 1;
        self.line(&format!("{label}: {why}"));
        if let Some(bar) = &self.bar {
            bar.set_position(self.done as u64);
        }
    }

    pub fn start(&mut self, label: &str) {
        self.started = Some(Instant::now());
        let eta = self.eta().map(|e| format!(", about {e} left")).unwrap_or_default();
        match &self.bar {
            Some(bar) => bar.set_message(format!("{label}{eta}")),
            None => crate::say!("  [{}/{}] {label} ...{eta}", self.done + 1, self.total),
        }
    }

    /// The point started last has ended; `outcome` says how ("complete", "failed: ...").
    pub fn finish(&mut self, label: &str, outcome: &str) {
        let took = self.started.take().map(|t| t.elapsed()).unwrap_or_default();
        self.finish_after(label, outcome, took);
    }

    /// A point has ended after `took` (points that run side by side, as Slurm jobs).
    pub fn finish_after(&mut self, label: &str, outcome: &str, took: Duration) {
        self.done += 1;
        self.ran += 1;
        self.run_time += took;
        self.line(&format!("{label}: {outcome} in {:.1} s", took.as_secs_f64()));
        if let Some(bar) = &self.bar {
            bar.set_position(self.done as u64);
        }
    }

    pub fn clear(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    /// The bar's message (on a terminal only): what is going on now.
    pub fn message(&self, text: &str) {
        if let Some(bar) = &self.bar {
            bar.set_message(text.to_owned());
        }
    }

    pub fn line(&self, text: &str) {
        let text = format!("  [{}/{}] {text}", self.done, self.total);
        match &self.bar {
            Some(bar) => bar.println(text),
            None => crate::say!("{text}"),
        }
    }

    /// The remaining points' time at the mean pace of those run so far.
    fn eta(&self) -> Option<String> {
        if self.ran == 0 {
            return None;
        }
        let left = self.to_run.saturating_sub(self.ran);
        let secs = self.run_time.as_secs_f64() / self.ran as f64 * left as f64;
        Some(format_duration(secs))
    }
}

/// `42 s`, `3 min 05 s`, `1 h 02 min`.
pub fn format_duration(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {:02} s", s / 60, s % 60),
        _ => format!("{} h {:02} min", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_naturally() {
        assert_eq!(format_duration(41.6), "42 s");
        assert_eq!(format_duration(185.0), "3 min 05 s");
        assert_eq!(format_duration(3720.0), "1 h 02 min");
    }

    #[test]
    fn the_eta_counts_only_points_left_to_run() {
        let mut p = SweepProgress::new(6, 4, "run");
        p.skip("a", "already complete");
        p.skip("b", "already complete");
        assert_eq!(p.eta(), None, "no pace yet");
        p.ran = 1;
        p.run_time = Duration::from_secs(10);
        // 3 of the 4 points to run are left, at 10 s each.
        assert_eq!(p.eta().as_deref(), Some("30 s"));
    }
}
