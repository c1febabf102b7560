//! Training steps that never end. Collectives are bounded by `run.timeout_s`, but a rank stuck
//! in computation (a module whose forward pass loops) holds no collective open, and when every
//! rank is stuck nothing else ends the run. The launcher watches each rank's position file
//! ([`crate::rundir::position`], rewritten at the start of every batch): a rank whose training
//! step does not change for `run.step_timeout_s` (default: 10 × the slowest step seen so far,
//! and at least `run.timeout_s`) is named as stalled, and the run fails.
use std::path::Path;
use std::time::{Duration, Instant};

use crate::config::schema::Run;
use crate::rundir::position;

/// How often the position files are read.
const EVERY: Duration = Duration::from_millis(100);

pub struct Watchdog {
    /// `run.step_timeout_s`, when set.
    limit: Option<Duration>,
    /// `run.timeout_s`: the default limit's floor.
    floor: Duration,
    /// The slowest training step seen so far, on any rank.
    slowest: Duration,
    /// Per rank: its last position and since when it has held it.
    ranks: Vec<Option<(String, Instant)>>,
    last_read: Instant,
}

/// "train, epoch E, step S" → (E, S).
fn training_step(position: &str) -> Option<(usize, usize)> {
    let (epoch, step) = position.strip_prefix("train, epoch ")?.split_once(", step ")?;
    Some((epoch.parse().ok()?, step.parse().ok()?))
}

impl Watchdog {
    pub fn new(run: &Run, ranks: usize) -> Watchdog {
        Watchdog {
            limit: run.step_timeout_s.map(Duration::from_secs_f64),
            floor: Duration::from_secs_f64(run.timeout_s),
            slowest: Duration::ZERO,
            ranks: vec![None; ranks],
            last_read: Instant::now(),
        }
    }

    /// How long a step may take now.
    fn limit(&self) -> Duration {
        self.limit.unwrap_or((self.slowest * 10).max(self.floor))
    }

    /// Whether every rank was training at the last reading (a restarted run is going again).
    pub fn all_training(&self) -> bool {
        self.ranks.iter().all(|held| held.as_ref().is_some_and(|(text, _)| training_step(text).is_some()))
    }

    /// The first of the `running` ranks (local indices; `first_rank` + index is the rank) whose
    /// training step has outlasted the limit, with what to say of it ("did not finish step 7 of
    /// epoch 1 in 5 s ...") and since when it has been in that step.
    pub fn stalled(&mut self, run_dir: &Path, first_rank: usize, running: &[bool]) -> Option<(usize, String, Instant)> {
        if self.last_read.elapsed() < EVERY {
            return None;
        }
        self.last_read = Instant::now();
        for (local, &live) in running.iter().enumerate() {
            let now = if live { position::read(run_dir, first_rank + local) } else { None };
            let held = &mut self.ranks[local];
            if held.as_ref().map(|h| &h.0) != now.as_ref() {
                if let Some((was, since)) = held.take() {
                    if training_step(&was).is_some() {
                        self.slowest = self.slowest.max(since.elapsed());
                    }
                }
                *held = now.map(|p| (p, Instant::now()));
            }
        }
        let limit = self.limit();
        self.ranks.iter().enumerate().find_map(|(local, held)| {
            let (text, since) = held.as_ref()?;
            let (epoch, step) = training_step(text)?;
            (since.elapsed() >= limit).then(|| {
                let why = match self.limit {
                    Some(_) => "run.step_timeout_s".to_owned(),
                    None => format!(
                        "the default of run.step_timeout_s: 10 × the slowest step so far ({:.2} s), at least \
                         run.timeout_s",
                        self.slowest.as_secs_f64()
                    ),
                };
                let how = format!(
                    "did not finish step {step} of epoch {epoch} in {} s ({why}): it is stuck in computation (a \
                     forward or backward pass that does not end?)",
                    fmt_secs(limit)
                );
                (local, how, *since)
            })
        })
    }
}

/// "5", "12.5".
fn fmt_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_that_outlasts_the_limit_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let run = Run { timeout_s: 0.3, ..Run::default() };
        let mut w = Watchdog::new(&run, 2);
        let (p0, p1) = (position::Position::new(dir.path(), 0), position::Position::new(dir.path(), 1));
        p0.set("train", 1, 1);
        p1.set("train", 1, 1);
        std::thread::sleep(EVERY);
        assert!(w.stalled(dir.path(), 0, &[true, true]).is_none());
        for step in 2..6 {
            std::thread::sleep(EVERY);
            p0.set("train", 1, step);
            p1.set("train", 1, step);
            assert!(w.stalled(dir.path(), 0, &[true, true]).is_none());
        }
        // Rank 1 stops moving; rank 0 goes on.
        let start = Instant::now();
        let stalled = loop {
            std::thread::sleep(EVERY);
            p0.set("train", 1, 6 + start.elapsed().as_millis() as usize);
            if let Some(s) = w.stalled(dir.path(), 0, &[true, true]) {
                break s;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "never named");
        };
        assert_eq!(stalled.0, 1);
        assert!(stalled.2.elapsed() >= Duration::from_millis(300));
        assert!(stalled.1.starts_with("did not finish step 5 of epoch 1 in "), "{}", stalled.1);
        assert!(start.elapsed() >= Duration::from_millis(300));
    }

    #[test]
    fn only_training_steps_are_timed() {
        assert_eq!(training_step("train, epoch 3, step 12"), Some((3, 12)));
        assert_eq!(training_step("validate, epoch 3"), None);
        assert_eq!(training_step("train, epoch 3"), None);
    }
}
