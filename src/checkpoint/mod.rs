//! Checkpoints: one format for every strategy. A strategy hands its share of the training state
//! as [`Piece`]s: tensors under PyTorch's names (the optimizer's state as `optim.<kind>.<param>`,
//! its step count as `optim.steps`), each a range of rows (dim 0) of a tensor whose whole shape
//! it gives. Every rank holding pieces writes its own `.safetensors` file at the same time (no
//! gather); rank 0 then commits the index (tensor → pieces → file and byte range, and the record
//! of where the run stood). A loader asks a [`Reader`] for the rows it holds of any tensor,
//! whichever pieces hold them: a checkpoint resumes at another world size or strategy.
//!
//! On disk: `checkpoints/<name>/` holding `rank-R.safetensors` files and `index.json`; `<name>`
//! is `epoch-NNNN` at an epoch's end of an epoch run, `step-NNNNNNNN` elsewhere. It is written in
//! `checkpoints/.<name>.tmp-PID/` and renamed into place once its index is synced: a checkpoint
//! is one only when complete, and a kill at any moment leaves the previous one whole.
pub mod background;
pub mod index;
pub mod model;
pub mod reader;
pub mod writer;

use std::path::{Path, PathBuf};

use tch::Tensor;

use crate::plan::Plan;
pub use index::{rows_of, Index, Record, Role};
pub use reader::Reader;
pub use writer::save;

/// The index's file name in a checkpoint's directory.
pub const INDEX: &str = crate::rundir::CHECKPOINT_INDEX;

/// A piece of the training state: rows `offset..offset + rows` (dim 0) of the tensor `name`,
/// whose whole shape is `shape`; all other dimensions whole. A 0-dimensional tensor is one row.
pub struct Piece {
    pub name: String,
    /// The whole tensor's shape.
    pub shape: Vec<i64>,
    /// Its first row in the whole tensor.
    pub offset: i64,
    /// Rows `offset..offset + tensor.size()[0]` (the whole tensor when 0-dimensional), on the CPU.
    pub tensor: Tensor,
}

impl Piece {
    /// The whole of `t` as one piece (copied to the CPU, whatever device holds it).
    pub fn whole(name: String, t: &Tensor) -> Piece {
        let tensor = t.detach().to_device(tch::Device::Cpu);
        Piece { name, shape: tensor.size(), offset: 0, tensor }
    }

    /// Its rows (dim 0).
    pub fn rows(&self) -> i64 {
        rows_of(&self.tensor.size())
    }

    pub fn bytes(&self) -> u64 {
        (self.tensor.numel() * self.tensor.kind().elt_size_in_bytes()) as u64
    }
}

pub fn dir(run_dir: &Path) -> PathBuf {
    crate::rundir::checkpoints(run_dir)
}

/// The name of the checkpoint after `step` optimizer steps: `epoch-NNNN` at an epoch's end of an
/// epoch run, `step-NNNNNNNN` elsewhere.
pub fn stem(plan: &Plan, step: usize) -> String {
    let per_epoch = plan.optimizer_steps_per_epoch().max(1);
    if plan.config.train.steps.is_none() && step.is_multiple_of(per_epoch) {
        format!("epoch-{:04}", step / per_epoch)
    } else {
        format!("step-{step:08}")
    }
}

/// "epoch 2" or "step 150", for messages.
pub fn describe(stem: &str) -> String {
    let (what, n) = stem.split_once('-').unwrap_or(("checkpoint", stem));
    format!("{what} {}", n.trim_start_matches('0').parse::<usize>().unwrap_or(0))
}

/// The complete checkpoints (those with an index), oldest first: (optimizer steps done, name).
pub fn list(run_dir: &Path, plan: &Plan) -> Vec<(usize, String)> {
    let per_epoch = plan.optimizer_steps_per_epoch().max(1);
    let ck = dir(run_dir);
    let mut v: Vec<(usize, String)> = std::fs::read_dir(&ck)
        .into_iter()
        .flatten()
        .filter_map(|e| {
            let name = e.ok()?.file_name().to_str()?.to_owned();
            let step = match (name.strip_prefix("epoch-"), name.strip_prefix("step-")) {
                (Some(e), _) => e.parse::<usize>().ok()? * per_epoch,
                (_, Some(s)) => s.parse().ok()?,
                _ => return None,
            };
            ck.join(&name).join(INDEX).is_file().then_some((step, name))
        })
        .collect();
    v.sort();
    v
}

/// Removes all but the newest `keep` checkpoints (each index first: a checkpoint without its
/// index is not one).
pub fn prune(run_dir: &Path, plan: &Plan, keep: usize) {
    for (_, old) in list(run_dir, plan).into_iter().rev().skip(keep) {
        remove(&dir(run_dir).join(old));
    }
}

/// Removes a checkpoint's directory, its index first.
fn remove(path: &Path) {
    let _ = std::fs::remove_file(path.join(INDEX));
    let _ = std::fs::remove_dir_all(path);
}

/// A checkpoint found and checked: its directory and its index.
#[derive(Debug, Clone)]
pub struct Found {
    pub dir: PathBuf,
    pub name: String,
    pub index: Index,
}

impl Found {
    pub fn record(&self) -> &Record {
        &self.index.record
    }
}

/// The newest checkpoint, verified whole: its index against its files (sizes, headers, the
/// checksum of every piece) and against the plan (the model). `None` when there is none; an
/// error says which checkpoint, what is wrong, and which earlier one is whole.
pub fn latest(run_dir: &Path, plan: &Plan) -> Result<Option<Found>, String> {
    newest(run_dir, plan, true)
}

/// [`latest`] without reading the pieces' bytes (a rank checks those it reads as it reads them).
pub fn newest_unread(run_dir: &Path, plan: &Plan) -> Result<Option<Found>, String> {
    newest(run_dir, plan, false)
}

fn newest(run_dir: &Path, plan: &Plan, checksums: bool) -> Result<Option<Found>, String> {
    let mut all = list(run_dir, plan);
    let Some((step, name)) = all.pop() else { return Ok(None) };
    let path = dir(run_dir).join(&name);
    match reader::verify(&path, step, plan, checksums) {
        Ok(index) => Ok(Some(Found { dir: path, name, index })),
        Err(why) => {
            // The one before, if it verifies, is what the user can go back to.
            let before = all.pop().filter(|(s, n)| reader::verify(&dir(run_dir).join(n), *s, plan, checksums).is_ok());
            let advice = match before {
                Some((_, n)) => format!(
                    "the checkpoint before it ({}) is whole: move {} out of {} to resume from that one, or start a new \
                     run",
                    describe(&n),
                    path.display(),
                    dir(run_dir).display()
                ),
                None => "no earlier checkpoint is whole: start a new run (without --resume)".to_owned(),
            };
            Err(format!("checkpoint {} ({}) cannot be resumed: {why}; {advice}", describe(&name), path.display()))
        }
    }
}
