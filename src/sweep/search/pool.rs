//! Trials' runs side by side: up to `parallel` at once, each `runner run` in a child process of
//! the sweep (its output in the trial's run.log) or a Slurm job, watched until it ends. A stop
//! signal to the sweep is forwarded to every running launcher (or cancels every job), which marks
//! its run interrupted; the pool then waits for them all.
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use crate::rundir::manifest::{Manifest, Status};
use crate::sweep::execute::Runs;
use crate::sweep::execute::{self, stop_signal};
use crate::sweep::grid::Point;
use crate::sweep::slurm;

/// One run of a trial to a rung.
#[derive(Debug, Clone)]
pub struct Job {
    /// The grid point's study, the trial and the rung it runs to.
    pub study: usize,
    pub trial: usize,
    pub rung: usize,
    /// How the progress lines name it: `trial-003 → rung 1 (30 steps)`.
    pub label: String,
    pub run_dir: PathBuf,
    /// Whether it continues the trial's run (else it starts it), and when it started.
    pub resumed: bool,
    pub started: std::time::SystemTime,
}

enum Handle {
    Local(Child),
    /// A Slurm job's id and the last state shown.
    Slurm(String, String),
}

pub struct Pool<'a> {
    runs: &'a Runs<'a>,
    capacity: usize,
    jobs: Vec<(Job, Handle, Instant)>,
}

/// A job that ended: how, and how long it took.
pub type Ended = (Job, Result<(), String>, Duration);

impl<'a> Pool<'a> {
    pub fn new(runs: &'a Runs<'a>, capacity: usize) -> Pool<'a> {
        Pool { runs, capacity: capacity.max(1), jobs: Vec::new() }
    }

    pub fn free(&self) -> usize {
        self.capacity.saturating_sub(self.jobs.len())
    }

    pub fn running(&self) -> usize {
        self.jobs.len()
    }

    /// Starts `job` as the run `point` (continuing its directory with `resume`).
    pub fn start(&mut self, job: Job, point: &Point, resume: bool) -> Result<(), String> {
        let handle = match self.runs {
            Runs::Local => Handle::Local(execute::start(point, &job.run_dir, resume).map_err(|e| format!("{e:#}"))?),
            Runs::Slurm(resources) => {
                let id = slurm::submit(point, &job.run_dir, resources, resume).map_err(|e| format!("{e:#}"))?;
                Handle::Slurm(id, String::new())
            }
        };
        self.jobs.push((job, handle, Instant::now()));
        Ok(())
    }

    /// Waits until a job ends or a stop signal comes (then every job is stopped and waited for);
    /// returns the jobs that ended. `say` shows a Slurm job's change of state.
    pub fn wait(&mut self, say: &mut dyn FnMut(&str)) -> anyhow::Result<Vec<Ended>> {
        let (mut forwarded, mut all) = (false, Vec::new());
        loop {
            let sig = stop_signal();
            if sig != 0 && !forwarded {
                self.stop(sig);
                forwarded = true;
            }
            all.extend(self.poll(say)?);
            if self.jobs.is_empty() || (!forwarded && !all.is_empty()) {
                return Ok(all);
            }
            std::thread::sleep(match self.runs {
                Runs::Local => Duration::from_millis(20),
                Runs::Slurm(_) => slurm::POLL,
            });
        }
    }

    /// Forwards `sig` to every local launcher; cancels every Slurm job.
    fn stop(&mut self, sig: usize) {
        let mut ids = Vec::new();
        for (_, handle, _) in &self.jobs {
            match handle {
                Handle::Local(child) => execute::forward(child, sig),
                Handle::Slurm(id, _) => ids.push(id.clone()),
            }
        }
        slurm::cancel(ids.iter());
    }

    /// The jobs that have ended since the last poll.
    fn poll(&mut self, say: &mut dyn FnMut(&str)) -> anyhow::Result<Vec<Ended>> {
        let states = match self.runs {
            Runs::Slurm(_) => slurm::states(self.jobs.iter().filter_map(|(_, h, _)| match h {
                Handle::Slurm(id, _) => Some(id),
                Handle::Local(_) => None,
            }))?,
            Runs::Local => Default::default(),
        };
        let mut ended = Vec::new();
        let mut i = 0;
        while i < self.jobs.len() {
            let (job, handle, since) = &mut self.jobs[i];
            let result = match handle {
                Handle::Local(child) => match child.try_wait()? {
                    None => None,
                    Some(status) => Some(match Manifest::read(&job.run_dir) {
                        Ok(m) if m.status == Status::Complete => Ok(()),
                        Ok(m) => {
                            Err(m.failure.unwrap_or_else(|| format!("the run ended {:?}", m.status).to_lowercase()))
                        }
                        Err(_) => Err(format!(
                            "`runner run` {status} before writing a manifest; see {}",
                            job.run_dir.join(crate::rundir::RUN_LOG).display()
                        )),
                    }),
                },
                Handle::Slurm(id, shown) => {
                    let state = states.get(id).cloned().unwrap_or_else(|| "ENDED".into());
                    if slurm::is_terminal(&state) {
                        Some(slurm::outcome(&job.run_dir, &state))
                    } else {
                        if *shown != state {
                            say(&format!("{}: job {id} {state}", job.label));
                            *shown = state;
                        }
                        None
                    }
                }
            };
            match result {
                Some(result) => {
                    let took = since.elapsed();
                    let (job, _, _) = self.jobs.remove(i);
                    ended.push((job, result, took));
                }
                None => i += 1,
            }
        }
        Ok(ended)
    }
}
