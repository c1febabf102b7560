//! Goodput: how much of a run's wall time failures cost. A failure costs the time to detect it
//! (until every rank had stopped), the time to restart (until the ranks trained again), and the
//! steps done since the checkpoint the restart resumed from, which are computed a second time.
//! What is left is the time spent moving the run forward.
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::manifest::Manifest;

/// What the failures of a run cost, in seconds of its wall time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Goodput {
    /// From the run's start (its first launch) to its end.
    pub wall_s: f64,
    /// Detecting the failures: from each failure until every rank had stopped.
    pub detect_s: f64,
    /// Restarting: from every rank stopped until the restarted ranks trained again.
    pub restart_s: f64,
    /// Optimizer steps computed twice (done after the checkpoint a restart resumed from).
    pub recomputed_steps: usize,
    /// Those steps' time, at the run's mean time per optimizer step.
    pub recomputed_s: f64,
    /// The share of the wall time that moved the run forward: 1 - (detect + restart +
    /// recomputed) / wall.
    pub goodput: f64,
}

impl Goodput {
    /// The cost of `m`'s failures, the run having ended at `ended`; `step_s`: its mean seconds
    /// per optimizer step. `None` for a run that never failed.
    pub fn of(m: &Manifest, ended: &str, step_s: Option<f64>) -> Option<Goodput> {
        if m.failures.is_empty() {
            return None;
        }
        let wall_s = seconds_between(&m.started_at, ended).unwrap_or(0.0);
        // Folded from +0.0: an empty f64 sum is -0.0.
        let detect_s = m.failures.iter().filter_map(|f| f.detect_s).fold(0.0, |a, b| a + b);
        let restart_s = m.restarts.iter().filter_map(|r| r.restart_s).fold(0.0, |a, b| a + b);
        let recomputed_steps: usize = m.restarts.iter().map(|r| r.recomputed_steps).sum();
        let recomputed_s = recomputed_steps as f64 * step_s.unwrap_or(0.0);
        let lost = detect_s + restart_s + recomputed_s;
        let goodput = if wall_s > 0.0 { (1.0 - lost / wall_s).clamp(0.0, 1.0) } else { 0.0 };
        Some(Goodput { wall_s, detect_s, restart_s, recomputed_steps, recomputed_s, goodput })
    }

    /// "goodput 93.1% of 41.2 s: 2 failures cost 2.8 s (detection 0.3 s, restarts 2.1 s,
    /// 12 steps computed twice 0.4 s)".
    pub fn line(&self, failures: usize) -> String {
        let lost = self.detect_s + self.restart_s + self.recomputed_s;
        format!(
            "goodput {:.1}% of {:.1} s: {failures} failure{} cost {lost:.1} s (detection {:.1} s, restarts {:.1} s, {} \
             step{} computed twice {:.1} s)",
            100.0 * self.goodput,
            self.wall_s,
            if failures == 1 { "" } else { "s" },
            self.detect_s,
            self.restart_s,
            self.recomputed_steps,
            if self.recomputed_steps == 1 { "" } else { "s" },
            self.recomputed_s,
        )
    }
}

/// Seconds from one RFC 3339 time to another.
pub fn seconds_between(from: &str, to: &str) -> Option<f64> {
    let (a, b) = (chrono::DateTime::parse_from_rfc3339(from).ok()?, chrono::DateTime::parse_from_rfc3339(to).ok()?);
    Some((b - a).num_milliseconds() as f64 / 1000.0)
}

/// The mean seconds per optimizer step of the run in `run_dir`, from rank 0's rows of its trace
/// (their training time over the steps they cover); `None` without a trace.
pub fn step_seconds(run_dir: &Path) -> Option<f64> {
    // Read here, not through crate::trace (which writes into run directories: no cycle).
    let file = std::fs::File::open(run_dir.join(super::TRACE)).ok()?;
    let df = {
        use polars::prelude::{ParquetReader, SerReader};
        ParquetReader::new(file).finish().ok()?
    };
    let ranks = df.column("rank").ok()?.u32().ok()?.clone();
    let seconds = df.column("epoch_s").ok()?.f64().ok()?.clone();
    let steps = df.column("step").ok()?.u64().ok()?.clone();
    let (mut total_s, mut last) = (0.0, 0u64);
    for ((rank, s), step) in ranks.iter().zip(seconds.iter()).zip(steps.iter()) {
        if rank == Some(0) {
            total_s += s.unwrap_or(0.0);
            last = last.max(step.unwrap_or(0));
        }
    }
    (last > 0).then(|| total_s / last as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rundir::manifest::{FailureRecord, RestartRecord};

    #[test]
    fn failures_cost_detection_restart_and_the_steps_computed_twice() {
        let mut m = Manifest::start("id", "n", Path::new("p.toml"), 2, 1);
        m.started_at = "2026-01-01T00:00:00.000Z".into();
        assert_eq!(Goodput::of(&m, "2026-01-01T00:01:40.000Z", Some(0.5)), None);
        let failure = FailureRecord {
            rank: Some(1),
            node: "h".into(),
            cause: "was killed by SIGKILL".into(),
            position: None,
            step: 30,
            at: "2026-01-01T00:00:30.000Z".into(),
            detect_s: Some(2.0),
        };
        m.failures = vec![failure.clone(), failure];
        let restart = |s: Option<f64>| RestartRecord {
            at: String::new(),
            by: "runner".into(),
            from_step: 20,
            world_size: 2,
            recomputed_steps: 10,
            restart_s: s,
        };
        m.restarts = vec![restart(Some(3.0)), restart(None)];
        let g = Goodput::of(&m, "2026-01-01T00:01:40.000Z", Some(0.5)).unwrap();
        assert_eq!(g.wall_s, 100.0);
        assert_eq!((g.detect_s, g.restart_s, g.recomputed_steps, g.recomputed_s), (4.0, 3.0, 20, 10.0));
        assert!((g.goodput - 0.83).abs() < 1e-12, "{}", g.goodput);
        assert_eq!(
            g.line(2),
            "goodput 83.0% of 100.0 s: 2 failures cost 17.0 s (detection 4.0 s, restarts 3.0 s, 20 steps computed \
             twice 10.0 s)"
        );
    }
}
