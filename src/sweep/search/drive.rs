//! The search's loop, at every grid point at once: propose the trials the sampler may propose
//! now, recompute every promotion from the results ([`crate::search::halving::decide`]), start the
//! runs still to do (promotions first) while fewer than `parallel` run, wait for one to end, read
//! its trial's results from its trace, and again. A decision depends on results only, never on
//! which run ended first: TPE proposes trial t from the trials before t − lag, each at the
//! highest rung their own promotions take it to, and a rung promotes in the order trials entered it.
use std::io::Write;
use std::path::Path;
use std::time::{Duration, SystemTime};

use super::pool::{Job, Pool};
use super::trial::Trial;
use super::Search;
use crate::search::halving::{self, Outcome};
use crate::search::Observation;
use crate::sweep::execute::{self, Runs};
use crate::sweep::experiment::Experiment;
use crate::sweep::grid::Point;

/// How the loop runs.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// Start every trial over, whatever its directory holds.
    pub force: bool,
    /// Start no run after the first that fails.
    pub fail_fast: bool,
}

/// How the loop ended.
#[derive(Debug, Default)]
pub struct Finished {
    /// The stop signal that ended it.
    pub stopped: Option<i32>,
    /// Whether every point's search is over (every rung settled).
    pub done: bool,
    /// The runs started, and the trials that failed with why.
    pub runs: usize,
    pub failed: Vec<(String, String)>,
}

/// One grid point's search: its trials so far and what is known of them.
pub struct Study<'a> {
    pub at: &'a Point,
    pub trials: Vec<Trial>,
    pub results: Vec<Vec<Option<Outcome>>>,
    failures: Vec<Option<String>>,
    busy: Vec<bool>,
    /// --force: the trial starts over at its next run.
    fresh: Vec<bool>,
}

impl<'a> Study<'a> {
    pub fn new(at: &'a Point) -> Study<'a> {
        Study { at, trials: vec![], results: vec![], failures: vec![], busy: vec![], fresh: vec![] }
    }

    /// Whether the next trial may be proposed: it learns from [`Study::history`], so that must be in.
    fn can_propose(&self, search: &Search) -> bool {
        let s = &search.spec;
        self.trials.len() < s.trials && (!s.sampler.learns() || self.history(search).is_some())
    }

    /// What the sampler learns from when it proposes the next trial t: the trials before t − lag,
    /// each at the highest rung that the promotions among those trials alone take it to, ranked
    /// by that rung first (as Optuna's TPE ranks a pruned trial by the step it reached, then by
    /// its value). Those promotions depend on these trials' results only, so the history is the
    /// same whatever order the runs end in. `None` while one of those runs has no result yet.
    /// ASHA's promotions among a prefix of the trials are the search's own; successive halving
    /// promotes only once every trial is in, so before that its history is the first rung's.
    fn history(&self, search: &Search) -> Option<Vec<Observation>> {
        let s = &search.spec;
        let m = self.trials.len().saturating_sub(s.lag);
        let rule = search.scheduler.rule();
        let planned = if rule.synchronous { s.trials } else { m };
        let d = halving::decide(rule, &self.results[..m], planned, s.minimize);
        let mut reached = vec![0; m];
        for (k, entrants) in d.entrants.iter().enumerate() {
            for &t in entrants {
                self.results[t][k]?;
                reached[t] = k;
            }
        }
        let observe = |(i, &rung): (usize, &usize)| match self.results[i][rung] {
            Some(o @ Outcome::Value(v)) if !v.is_nan() => {
                Some(Observation { point: self.trials[i].point.clone(), rung, score: halving::score(o, s.minimize) })
            }
            _ => None,
        };
        Some(reached.iter().enumerate().filter_map(observe).collect())
    }

    /// Proposes the next trial and reads what its directory already holds.
    fn propose(&mut self, experiment: &Experiment, search: &Search, sweep_dir: &Path, grid: bool, force: bool) {
        let (t, s) = (self.trials.len(), &search.spec);
        let known = if s.sampler.learns() { self.history(search).unwrap_or_default() } else { vec![] };
        let earlier: Vec<Vec<f64>> = self.trials.iter().map(|x| x.point.clone()).collect();
        let point = s.sampler.propose(&s.space, s.seed, t, &known, &earlier);
        let dir = super::trial_dir(self.at, grid, s.trials, t);
        let trial = Trial::new(experiment, search, self.at, t, dir, point);
        let results = if force {
            vec![None; search.scheduler.rungs()]
        } else {
            trial.results(&sweep_dir.join(&trial.dir), search).outcomes
        };
        self.trials.push(trial);
        self.results.push(results);
        self.failures.push(None);
        self.busy.push(false);
        self.fresh.push(force);
    }

    /// The runs still to do and not running: (trial, rung), promotions first.
    fn pending(&self, search: &Search) -> Vec<(usize, usize)> {
        let d = halving::decide(search.scheduler.rule(), &self.results, search.spec.trials, search.spec.minimize);
        d.pending(&self.results).into_iter().filter(|(t, _)| !self.busy[*t]).collect()
    }

    fn finished(&self, search: &Search) -> bool {
        halving::decide(search.scheduler.rule(), &self.results, search.spec.trials, search.spec.minimize).finished()
    }

    fn fail(&mut self, t: usize, rung: usize, why: String) {
        if self.results[t][rung].is_none() {
            self.results[t][rung] = Some(Outcome::Failed);
        }
        self.failures[t] = Some(why);
    }
}

/// Runs the search at every point of `points` into `sweep_dir`; `index` rewrites sweep.json
/// whenever trials are proposed, told whether a run has started.
pub fn run(
    experiment: &Experiment,
    search: &Search,
    points: &[Point],
    sweep_dir: &Path,
    runs: &Runs,
    opts: Options,
    index: &mut dyn FnMut(&[Study], bool) -> anyhow::Result<()>,
) -> anyhow::Result<Finished> {
    let grid = !experiment.axes.is_empty();
    let mut studies: Vec<Study> = points.iter().map(Study::new).collect();
    let mut pool = Pool::new(runs, search.spec.parallel);
    let mut out = Finished::default();
    let mut said = false;
    loop {
        let mut proposed = false;
        for study in &mut studies {
            while study.can_propose(search) {
                study.propose(experiment, search, sweep_dir, grid, opts.force);
                proposed = true;
            }
        }
        if proposed {
            index(&studies, out.runs > 0)?;
        }
        let stopping = execute::stop_signal() != 0 || (opts.fail_fast && !out.failed.is_empty());
        let (blocked, failed) = match stopping {
            true => (false, false),
            false => start_ready(experiment, search, &mut studies, sweep_dir, &mut pool, &mut out, &mut said),
        };
        if pool.running() == 0 {
            if !stopping && blocked {
                std::thread::sleep(std::time::Duration::from_millis(200));
                continue;
            }
            if !stopping && (proposed || failed) {
                continue;
            }
            // Nothing runs and nothing more can start: each search is over, or it was stopped.
            let sig = execute::stop_signal();
            out.stopped = (sig != 0).then_some(sig as i32);
            break;
        }
        for (job, result, took) in pool.wait(&mut |line| crate::say!("  {line}"))? {
            log_job(sweep_dir, &job, took, &result);
            studies[job.study].ended(&job, result, took, search, &mut out);
        }
        let sig = execute::stop_signal();
        if sig != 0 && pool.running() == 0 {
            out.stopped = Some(sig as i32);
            break;
        }
    }
    index(&studies, out.runs > 0)?;
    out.done = out.stopped.is_none() && studies.iter().all(|s| s.finished(search));
    Ok(out)
}

/// Starts the runs still to do while the pool has room; whether one waits for a directory
/// another runner holds, and whether one failed to start (which changes the decisions).
fn start_ready(
    experiment: &Experiment,
    search: &Search,
    studies: &mut [Study],
    sweep_dir: &Path,
    pool: &mut Pool,
    out: &mut Finished,
    said: &mut bool,
) -> (bool, bool) {
    let (mut blocked, mut failed) = (false, false);
    for (s, study) in studies.iter_mut().enumerate() {
        for (t, rung) in study.pending(search) {
            if pool.free() == 0 {
                return (blocked, failed);
            }
            match start(experiment, search, study, s, t, rung, sweep_dir, pool) {
                Started::Yes => out.runs += 1,
                Started::Locked(pid) => {
                    blocked = true;
                    if !*said {
                        crate::say!("  waiting for pid {pid}, an earlier runner, to leave {}", study.trials[t].dir);
                        *said = true;
                    }
                }
                Started::Failed(why) => {
                    let dir = study.trials[t].dir.clone();
                    crate::say!("  {dir} → rung {rung}: FAILED: {why}");
                    study.fail(t, rung, why.clone());
                    out.failed.push((dir, why));
                    failed = true;
                }
            }
        }
    }
    (blocked, failed)
}

impl Study<'_> {
    /// Reads what trial `job.trial`'s ended run left in its directory, and says how it went.
    fn ended(&mut self, job: &Job, result: Result<(), String>, took: Duration, search: &Search, out: &mut Finished) {
        self.busy[job.trial] = false;
        let trial = &self.trials[job.trial];
        let read = trial.results(&job.run_dir, search);
        self.results[job.trial] = read.outcomes;
        let failure = match result {
            Err(why) => Some(why),
            Ok(()) if self.results[job.trial][job.rung].is_none() => {
                Some(format!("the run ended without a trace row at rung {} of {}", job.rung, trial.dir))
            }
            Ok(()) => read.failure,
        };
        let secs = took.as_secs_f64();
        match failure {
            Some(why) if execute::stop_signal() != 0 => {
                crate::say!("  {}: interrupted after {secs:.1} s ({why})", job.label)
            }
            Some(why) => {
                crate::say!("  {}: FAILED in {secs:.1} s: {why}", job.label);
                out.failed.push((trial.dir.clone(), why.clone()));
                self.fail(job.trial, job.rung, why);
            }
            None => {
                let value = match self.results[job.trial][job.rung] {
                    Some(Outcome::Value(v)) => format!("{} {v:.4}", search.spec.metric),
                    _ => String::new(),
                };
                crate::say!("  {}: {value} in {secs:.1} s", job.label);
            }
        }
    }
}

enum Started {
    Yes,
    /// Another runner (an earlier sweep's, still stopping) holds the trial's directory.
    Locked(String),
    Failed(String),
}

/// Starts trial `t`'s run to `rung`: continuing its directory where it holds this trial's run
/// with a checkpoint before the rung's budget, else from the start (to the first rung: the
/// trial's identity is that run's).
#[allow(clippy::too_many_arguments)]
fn start(
    experiment: &Experiment,
    search: &Search,
    study: &mut Study,
    s: usize,
    t: usize,
    rung: usize,
    sweep_dir: &Path,
    pool: &mut Pool,
) -> Started {
    let trial = &study.trials[t];
    let run_dir = sweep_dir.join(&trial.dir);
    if let Some(pid) = crate::rundir::lock::holder(&run_dir) {
        return Started::Locked(pid.map_or("?".into(), |p| p.to_string()));
    }
    if let Err(why) = &trial.first {
        let why = format!("its configuration is invalid: {why}");
        // Its directory says so, for the report (which reads run directories only).
        let mut m = crate::rundir::manifest::Manifest::start("", &trial.dir, &experiment.pipeline, 0, 0);
        m.end(crate::rundir::manifest::Status::Failed, Some(why.clone()));
        if let Err(e) = std::fs::create_dir_all(&run_dir).map_err(anyhow::Error::from).and_then(|()| m.write(&run_dir))
        {
            crate::say_err!("warning: cannot record {}'s failure: {e:#}", trial.dir);
        }
        return Started::Failed(why);
    }
    let target = match trial.run_to(experiment, search, rung) {
        Ok(p) => p,
        Err(why) => return Started::Failed(format!("its configuration is invalid: {why}")),
    };
    let resume = !study.fresh[t] && trial.continues(&run_dir, &target);
    let (point, rung) = if resume || rung == 0 {
        (target, rung)
    } else {
        match trial.run_to(experiment, search, 0) {
            Ok(p) => (p, 0),
            Err(why) => return Started::Failed(why),
        }
    };
    let label = match search.unit {
        Some(unit) => format!("{} → rung {rung} ({})", trial.dir, unit.amount(search.rungs()[rung])),
        None => trial.dir.clone(),
    };
    let job =
        Job { study: s, trial: t, rung, label: label.clone(), run_dir, resumed: resume, started: SystemTime::now() };
    match pool.start(job, &point, resume) {
        Ok(()) => {
            crate::say!("  {label}: {}", if resume { "continues" } else { "starts" });
            study.busy[t] = true;
            study.fresh[t] = false;
            Started::Yes
        }
        Err(why) => Started::Failed(why),
    }
}

/// The file of every run a search started: when, for how long, and how it ended (a record of the
/// search's timing, which its tables leave out; nothing reads it back).
pub const JOBS: &str = "search_jobs.csv";

/// Appends `job`'s line to [`JOBS`].
fn log_job(sweep_dir: &Path, job: &Job, took: Duration, result: &Result<(), String>) {
    let path = sweep_dir.join(JOBS);
    let new = !path.exists();
    let Ok(mut file) = std::fs::OpenOptions::new().create(true).append(true).open(&path) else { return };
    let start = job.started.duration_since(SystemTime::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let outcome = match result {
        Ok(()) => "complete".to_owned(),
        Err(why) => format!("{:?}", why.lines().next().unwrap_or_default()),
    };
    let mut text = String::new();
    if new {
        text += "trial,rung,resumed,started_unix_s,seconds,outcome\n";
    }
    text += &format!(
        "{},{},{},{start:.3},{:.3},{outcome}\n",
        job.run_dir.strip_prefix(sweep_dir).unwrap_or(&job.run_dir).display(),
        job.rung,
        job.resumed,
        took.as_secs_f64()
    );
    let _ = file.write_all(text.as_bytes());
}
