//! Checkpoints written in the background (`checkpoint.async`), as torchtitan's `async_mode` and
//! DCP's `async_save`. At the step, every rank begins the checkpoint together as a synchronous
//! one does ([`writer::begin`]: the directory, the free space) and copies its pieces to memory;
//! training then goes on while a thread of each rank writes and syncs its file. The threads
//! never take part in a collective (those belong to the training): each publishes what it wrote
//! (or its failure) in the job's store, and rank 0's thread, once every rank's is there, commits
//! the checkpoint as a synchronous one does ([`writer::commit`]). Until then the checkpoint is a
//! hidden directory: a kill at any moment leaves the one before whole. At most one is in flight:
//! the next checkpoint, a synchronous one, the model file and the run's end each wait for it,
//! and its failure fails the rank there.
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::index::Record;
use super::writer::{self, Begun, Spare, Staged, Written};
use super::Piece;
use crate::dist::{ProcessGroup, Store};
use crate::plan::Plan;

/// A checkpoint being written by this rank's thread.
pub struct InFlight {
    thread: JoinHandle<(anyhow::Result<()>, Spare)>,
    name: String,
}

/// The memory the copies of a rank's last checkpoint written in the background took, kept for
/// the next to copy into (its pages are then in place: faulting in a fresh copy of gigabytes is
/// most of what the copy costs). Held between checkpoints, as torchtitan's pinned staging buffers
/// are; the peak is the same, since the copy exists while it is written anyway.
#[derive(Default)]
pub struct Copies(Spare);

impl InFlight {
    /// Waits until this rank's part is done (rank 0: the checkpoint is committed) and says how it
    /// went; the copies it was written from go back to `copies`.
    pub fn wait(self, copies: &mut Copies) -> anyhow::Result<()> {
        match self.thread.join() {
            Ok((result, spare)) => {
                copies.0 = spare;
                result
            }
            Err(_) => anyhow::bail!("the thread writing the checkpoint {} panicked", self.name),
        }
    }
}

/// Begins the checkpoint of `record.step` on every rank (collective) and hands this rank's
/// `pieces`, copied (into `copies` where they fit), to a thread that writes them; rank 0's
/// thread commits it once every rank's file is written.
pub fn save(
    run_dir: &std::path::Path,
    plan: &Plan,
    pg: &ProcessGroup,
    pieces: Vec<Piece>,
    copies: &mut Copies,
    record: Record,
    keep: usize,
) -> anyhow::Result<InFlight> {
    let begun = writer::begin(run_dir, plan, pg, &pieces, &record, keep)?;
    // The training goes on with the tensors the pieces may share (a CPU parameter is its own
    // piece): the thread writes a copy of their bytes taken now, the file's bytes as they are.
    // A checkpoint's pieces are the last one's, in the same order: each reuses its copy.
    let mut spare = std::mem::take(&mut copies.0).into_iter();
    let pieces: Vec<Staged> = pieces.into_iter().map(|p| Staged::copied(p, spare.next().unwrap_or_default())).collect();
    drop(spare);
    let job = Job {
        run_dir: run_dir.to_path_buf(),
        plan: plan.clone(),
        store: Arc::clone(pg.store()),
        rank: pg.rank(),
        size: pg.size(),
        keep,
    };
    let name = begun.name.clone();
    let thread = std::thread::Builder::new()
        .name("checkpoint".into())
        .spawn(move || job.run(begun, pieces, record))
        .map_err(|e| anyhow::anyhow!("cannot start the thread that writes the checkpoint: {e}"))?;
    Ok(InFlight { thread, name })
}

/// What a rank's thread needs.
struct Job {
    run_dir: PathBuf,
    plan: Plan,
    store: Arc<Store>,
    rank: usize,
    size: usize,
    keep: usize,
}

/// How often rank 0's thread looks for the other ranks' results.
const POLL: Duration = Duration::from_millis(5);

impl Job {
    fn run(self, begun: Begun, pieces: Vec<Staged>, record: Record) -> (anyhow::Result<()>, Spare) {
        let (written, spare) = writer::write_mine(&begun, self.rank, pieces);
        (self.publish(begun, written, record), spare)
    }

    /// Publishes what this rank wrote; rank 0 commits the checkpoint once every rank has.
    fn publish(&self, begun: Begun, written: Result<Written, String>, record: Record) -> anyhow::Result<()> {
        self.store.set(&key(&begun, self.rank), serde_json::to_string(&written)?.as_bytes())?;
        if self.rank != 0 {
            return written.map(drop).map_err(anyhow::Error::msg);
        }
        let result = self
            .gather(&begun)
            .and_then(|results| writer::commit(&self.run_dir, &self.plan, &begun, results, record, self.keep));
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&begun.staging);
        }
        result
    }

    /// Rank 0: every rank's result, as each publishes it. A rank that dies before it publishes
    /// ends the run (its launcher stops every rank), and this thread with it.
    fn gather(&self, begun: &Begun) -> anyhow::Result<Vec<Result<Written, String>>> {
        let mut results = Vec::with_capacity(self.size);
        for r in 0..self.size {
            while !self.store.contains(&key(begun, r))? {
                std::thread::sleep(POLL);
            }
            let bytes = self.store.get(&key(begun, r))?;
            results.push(serde_json::from_slice(&bytes)?);
        }
        Ok(results)
    }
}

/// Where rank `rank` publishes what it wrote of checkpoint `begun`.
fn key(begun: &Begun, rank: usize) -> String {
    // The directory's name holds rank 0's pid: another attempt at the same step has another.
    let staging = begun.staging.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    format!("runner/checkpoint/{staging}/rank-{rank}")
}
