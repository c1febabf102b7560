//! The run directory: the one module that knows its layout (file names), writes into it
//! atomically, locks it for one run at a time, and cleans up only what the runner wrote there.
//!
//! ```text
//! <run dir>/
//!   .runner.lock          held (flock) by the launcher (node 0's) for the whole run; its pid, a token
//!   manifest.json         what ran and how it ended (running, complete, failed, interrupted)
//!   config.toml           the resolved configuration, each value annotated with its source
//!   plan.json             the resolved plan
//!   trace.parquet         one row per rank per epoch
//!   steps.parquet         the phases of sampled training steps
//!   model.safetensors     the trained model
//!   model.best.safetensors  with [train.early_stop]: the model of the best validation
//!   stopped.txt           with [train.early_stop]: why the run stopped early (into the manifest)
//!   checkpoints/          epoch-NNNN/ or step-NNNNNNNN/: rank-R.safetensors + index.json
//!   tensorboard/          events.out.tfevents.* (trace.tensorboard), one file per start
//!   run.log               a sweep point's output
//!   .rank-N.position      where each rank is, while it runs
//! ```
pub mod goodput;
pub mod index;
pub mod lock;
pub mod manifest;
pub mod position;

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;

pub const MANIFEST: &str = "manifest.json";
pub const CONFIG: &str = "config.toml";
pub const PLAN: &str = "plan.json";
/// The preprocessing a run fitted (`runner predict` applies it), and its train/validation split.
pub const PREPROCESSING: &str = "preprocessing.json";
pub const SPLIT: &str = "split.json";
pub const TRACE: &str = "trace.parquet";
pub const STEPS: &str = "steps.parquet";
pub const MODEL: &str = "model.safetensors";
pub const BEST_MODEL: &str = "model.best.safetensors";
pub const STOPPED: &str = "stopped.txt";
pub const CHECKPOINTS: &str = "checkpoints";
/// A checkpoint's index, in its directory: a checkpoint is complete once it is there.
pub const CHECKPOINT_INDEX: &str = "index.json";
/// TensorBoard's event files (`trace.tensorboard`).
pub const TENSORBOARD: &str = "tensorboard";
/// A sweep point's output, written by `runner sweep`.
pub const RUN_LOG: &str = "run.log";
pub const LOCK: &str = lock::FILE;

/// The files a run writes at the top of its directory (besides dot-files and `checkpoints/`).
const OWN_FILES: &[&str] =
    &[MANIFEST, CONFIG, PLAN, TRACE, STEPS, MODEL, BEST_MODEL, STOPPED, RUN_LOG, PREPROCESSING, SPLIT];

pub fn checkpoints(run_dir: &Path) -> PathBuf {
    run_dir.join(CHECKPOINTS)
}

/// Whether `name` (an entry of a run directory) is one the runner writes.
fn is_own(name: &str) -> bool {
    OWN_FILES.contains(&name)
        || name == CHECKPOINTS
        || name == TENSORBOARD
        || name == LOCK
        || is_tmp(name)
        || position::is_position(name)
}

/// `.NAME.tmp-PID`: an atomic write (a file, or a checkpoint's directory) in progress or
/// interrupted; `epoch-N.pt.tmp` (an older runner's) likewise.
fn is_tmp(name: &str) -> bool {
    let pid_tmp = name.starts_with('.')
        && name.rsplit_once(".tmp-").is_some_and(|(_, pid)| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
    pid_tmp || (name.starts_with("epoch-") && name.ends_with(".pt.tmp"))
}

fn names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .collect()
}

/// Why `run_dir` cannot take run `run_id` without `--force`: entries the runner did not write,
/// or another run's manifest. `None` when it is absent, empty, or this run's.
pub fn foreign(run_dir: &Path, run_id: &str) -> Option<String> {
    let mut strangers: Vec<String> = names(run_dir).into_iter().filter(|n| !is_own(n)).collect();
    if !strangers.is_empty() {
        strangers.sort();
        let shown: Vec<String> = strangers.iter().take(5).cloned().collect();
        let more = if strangers.len() > 5 { format!(" and {} more", strangers.len() - 5) } else { String::new() };
        return Some(format!("it holds files the runner did not write ({}{more})", shown.join(", ")));
    }
    match manifest::Manifest::read_raw(run_dir) {
        Ok(Some(m)) if m.run_id != run_id => {
            Some(format!("it holds run {} ({}), not this configuration's run {run_id}", m.run_id, m.name))
        }
        Err(e) => Some(format!("{e:#}")),
        _ => None,
    }
}

/// When `run_dir` holds a complete run, when it ended: a fresh run there would replace its
/// results, which only `--force` may do.
pub fn completed(run_dir: &Path) -> Option<String> {
    match manifest::Manifest::read_raw(run_dir) {
        Ok(Some(m)) if m.status == manifest::Status::Complete => Some(m.ended_at.unwrap_or(m.started_at)),
        _ => None,
    }
}

/// Removes the files a fresh (not resumed) run replaces: traces, model, checkpoints, positions,
/// temporary files. Only names the runner writes; anything else in the directory is left alone.
pub fn clear_for_fresh_run(run_dir: &Path) {
    for name in [TRACE, STEPS, MODEL, BEST_MODEL, STOPPED, PLAN] {
        let _ = std::fs::remove_file(run_dir.join(name));
    }
    let ck = checkpoints(run_dir);
    for name in names(&ck) {
        // Checkpoints (directories), and an older runner's checkpoint files.
        let checkpoint = name.starts_with("epoch-") || name.starts_with("step-");
        let old = name.ends_with(".pt") || name.ends_with(".json") || name.ends_with(".pt.tmp");
        if checkpoint && (ck.join(&name).is_dir() || old) || is_tmp(&name) {
            remove_entry(&ck.join(name));
        }
    }
    // Only when empty: a file the runner did not write keeps the folder.
    let _ = std::fs::remove_dir(&ck);
    let tb = run_dir.join(TENSORBOARD);
    for name in names(&tb).into_iter().filter(|n| n.starts_with("events.out.tfevents.")) {
        let _ = std::fs::remove_file(tb.join(name));
    }
    let _ = std::fs::remove_dir(&tb);
    remove_stale(run_dir);
}

/// Removes temporary files and rank positions left by an interrupted run. Called with the lock
/// held, before any rank starts: no writer of this directory is alive.
pub fn remove_stale(run_dir: &Path) {
    remove_unfinished(run_dir);
    for name in names(run_dir) {
        if position::is_position(&name) {
            let _ = std::fs::remove_file(run_dir.join(name));
        }
    }
}

/// Removes what writes cut short left: temporary files, checkpoints being written (and one whose
/// index a prune removed first). Called once no rank of the run is alive: before ranks start, and
/// by the launcher after they all ended, however they ended.
pub fn remove_unfinished(run_dir: &Path) {
    for dir in [run_dir.to_path_buf(), checkpoints(run_dir)] {
        for name in names(&dir).into_iter().filter(|n| is_tmp(n)) {
            remove_entry(&dir.join(name));
        }
    }
    let ck = checkpoints(run_dir);
    for name in names(&ck) {
        let path = ck.join(&name);
        let checkpoint = name.starts_with("epoch-") || name.starts_with("step-");
        if checkpoint && path.is_dir() && !path.join(CHECKPOINT_INDEX).exists() {
            remove_entry(&path);
        }
    }
}

/// Removes a file, or a directory with what it holds.
fn remove_entry(path: &Path) {
    if path.is_dir() {
        let _ = std::fs::remove_dir_all(path);
    } else {
        let _ = std::fs::remove_file(path);
    }
}

/// The name of `path`'s temporary file while it is written by this process.
pub fn tmp_path(path: &Path) -> PathBuf {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// Writes to a temporary file beside `path`, syncs it, then renames it over `path`.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    path.file_name().context("a file path")?;
    let tmp = tmp_path(path);
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.with_context(|| format!("cannot write {}", path.display()))
}

/// Renames a finished, synced temporary file over `path` and syncs the directory.
pub fn commit(tmp: &Path, path: &Path) -> anyhow::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let result = (|| -> std::io::Result<()> {
        std::fs::File::open(tmp)?.sync_all()?;
        std::fs::rename(tmp, path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    result.with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_runners_own_names_are_its_own() {
        for own in ["manifest.json", ".trace.parquet.tmp-123", "epoch-0003.pt.tmp", ".rank-2.position", ".runner.lock"]
        {
            assert!(is_own(own), "{own}");
        }
        for other in ["notes.txt", ".trace.parquet.tmp-", ".x.tmp-12a", "data.csv"] {
            assert!(!is_own(other), "{other}");
        }
    }

    #[test]
    fn a_fresh_run_removes_only_what_the_runner_wrote() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for f in [TRACE, MODEL, ".steps.parquet.tmp-99", "mine.txt"] {
            std::fs::write(d.join(f), "x").unwrap();
        }
        std::fs::create_dir(checkpoints(d)).unwrap();
        for f in ["epoch-0001.pt", "epoch-0001.json", "keep.me"] {
            std::fs::write(checkpoints(d).join(f), "x").unwrap();
        }
        std::fs::create_dir_all(checkpoints(d).join("step-00000020")).unwrap();
        std::fs::write(checkpoints(d).join("step-00000020/index.json"), "{}").unwrap();
        std::fs::create_dir_all(checkpoints(d).join(".step-00000030.tmp-77")).unwrap();
        clear_for_fresh_run(d);
        let mut left = names(d);
        left.sort();
        assert_eq!(left, ["checkpoints", "mine.txt"]);
        assert_eq!(names(&checkpoints(d)), ["keep.me"]);
        assert!(foreign(d, "x").unwrap().contains("mine.txt"));
    }

    #[test]
    fn unfinished_checkpoints_are_removed_and_complete_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let ck = checkpoints(dir.path());
        for (d, index) in [("epoch-0001", true), ("step-00000005", false), (".epoch-0002.tmp-12", false)] {
            std::fs::create_dir_all(ck.join(d)).unwrap();
            std::fs::write(ck.join(d).join("rank-0.safetensors"), "x").unwrap();
            if index {
                std::fs::write(ck.join(d).join("index.json"), "{}").unwrap();
            }
        }
        std::fs::write(ck.join(".x.tmp-3"), "x").unwrap();
        remove_unfinished(dir.path());
        assert_eq!(names(&ck), ["epoch-0001"]);
    }
}
