//! Where each rank is (stage, epoch, step, and the optimizer steps the run has done), so that
//! when a rank dies the launcher can say where, and a restart how many steps it computes again.
//! A rank overwrites a small file in place every step (one `pwrite`, no fsync: cheap enough for
//! the hot loop); the launcher reads it after a failure and removes the files at the end.
use std::cell::Cell;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

const WIDTH: usize = 64;
/// The optimizer steps done, right-aligned after the text.
const DONE_WIDTH: usize = 20;

fn path(run_dir: &Path, rank: usize) -> PathBuf {
    run_dir.join(format!(".rank-{rank}.position"))
}

/// Whether `name` is a rank's position file.
pub fn is_position(name: &str) -> bool {
    name.strip_prefix(".rank-")
        .and_then(|r| r.strip_suffix(".position"))
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A rank's position writer; silent when the file cannot be created (it is diagnostics only).
pub struct Position {
    file: Option<File>,
    done: Cell<usize>,
    rank: usize,
}

impl Position {
    pub fn new(run_dir: &Path, rank: usize) -> Position {
        Position { file: File::create(path(run_dir, rank)).ok(), done: Cell::new(0), rank }
    }

    /// Records that the run has done `done` optimizer steps (written after the text).
    pub fn done(&self, done: usize) {
        self.done.set(done);
        if let Some(f) = &self.file {
            let _ = f.write_all_at(format!("{done:>DONE_WIDTH$}").as_bytes(), WIDTH as u64);
        }
    }

    pub fn set(&self, stage: &str, epoch: usize, step: usize) {
        if let Some(f) = &self.file {
            let mut text = match (epoch, step) {
                (0, _) => stage.to_string(),
                (e, 0) => format!("{stage}, epoch {e}"),
                (e, s) => format!("{stage}, epoch {e}, step {s}"),
            };
            text.truncate(WIDTH);
            let done = self.done.get();
            let _ = f.write_all_at(format!("{text:<WIDTH$}{done:>DONE_WIDTH$}").as_bytes(), 0);
            // Test hooks: a test stops rank R for good at a position, to kill it there, or holds
            // it there until it has done something else ([`crate::testhook`]).
            crate::testhook::stall_at(self.rank, &text);
            crate::testhook::wait_at(self.rank, &text);
        }
    }
}

/// The last position `rank` recorded, if any.
pub fn read(run_dir: &Path, rank: usize) -> Option<String> {
    let text = std::fs::read_to_string(path(run_dir, rank)).ok()?;
    let text = text.get(..WIDTH.min(text.len()))?;
    Some(text.trim().to_owned()).filter(|t| !t.is_empty())
}

/// The optimizer steps the run had done when `rank` last recorded its position.
pub fn read_done(run_dir: &Path, rank: usize) -> Option<usize> {
    let text = std::fs::read_to_string(path(run_dir, rank)).ok()?;
    text.get(WIDTH..)?.trim().parse().ok()
}

pub fn remove_all(run_dir: &Path, ranks: std::ops::Range<usize>) {
    for r in ranks {
        let _ = std::fs::remove_file(path(run_dir, r));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_position_wins_even_when_shorter() {
        let dir = tempfile::tempdir().unwrap();
        let p = Position::new(dir.path(), 3);
        p.set("train", 12, 345);
        p.done(17);
        p.set("validate", 2, 0);
        assert_eq!(read(dir.path(), 3).as_deref(), Some("validate, epoch 2"));
        assert_eq!(read_done(dir.path(), 3), Some(17));
        p.done(18);
        assert_eq!(read(dir.path(), 3).as_deref(), Some("validate, epoch 2"));
        assert_eq!(read_done(dir.path(), 3), Some(18));
        remove_all(dir.path(), 0..4);
        assert_eq!(read(dir.path(), 3), None);
    }
}
