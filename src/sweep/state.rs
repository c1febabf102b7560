//! Where a point stands in its run directory (complete, or stopped with a checkpoint to resume
//! from), and whether the sweep was told to stop: what the local and the Slurm runs of points
//! both ask.
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use super::grid::Point;
use crate::rundir::manifest::{Manifest, Status};

/// The signals that stop a sweep: forwarded to the running point, then the sweep ends.
const STOP: &[i32] = &[signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM, signal_hook::consts::SIGHUP];

/// The stop signal received so far (0: none); handlers are installed on first use.
pub fn stop_signal() -> usize {
    static FLAG: OnceLock<Arc<AtomicUsize>> = OnceLock::new();
    FLAG.get_or_init(|| {
        let flag = Arc::new(AtomicUsize::new(0));
        for &sig in STOP {
            let _ = signal_hook::flag::register_usize(sig, Arc::clone(&flag), sig as usize);
        }
        flag
    })
    .load(Ordering::SeqCst)
}

/// Whether `run_dir` holds a complete run of exactly this point's configuration; for a portable
/// point, one computed with every kernel family pinned (a run of an older runner, which pinned
/// MKL alone, has the same id but other bits, and runs again).
pub fn is_complete(point: &Point, run_dir: &Path) -> bool {
    let portable = point.plan.config.run.numerics == crate::config::schema::CpuNumerics::Portable;
    Manifest::read(run_dir).is_ok_and(|m| {
        m.status == Status::Complete
            && m.run_id == point.plan.run_id
            && run_dir.join(crate::rundir::TRACE).is_file()
            && (!portable || m.numerics.as_ref().is_some_and(|n| n.is_portable()))
    })
}

/// Whether the point in `run_dir` was stopped part-way (interrupted, or its launcher died) with
/// a checkpoint of this configuration to resume from.
pub fn resumable(point: &Point, run_dir: &Path) -> bool {
    let stopped = Manifest::read(run_dir).is_ok_and(|m| {
        matches!(m.status, Status::Interrupted | Status::Crashed | Status::Preempted) && m.run_id == point.plan.run_id
    });
    stopped && crate::checkpoint::newest_unread(run_dir, &point.plan).is_ok_and(|found| found.is_some())
}
