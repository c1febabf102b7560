//! A checkpoint's `index.json`: every tensor of the training state with its global shape, element
//! type and pieces (file, first row, rows, byte range in the file, checksum), and the record of
//! where the run stood. Written last, by rank 0: a checkpoint whose index is there is complete.
use std::collections::BTreeMap;
use std::ops::Range;

use safetensors::tensor::Dtype;
use serde::{Deserialize, Serialize};

use crate::config::schema::WrapStrategy;
use crate::rundir::manifest::Layout;
use crate::trace::{EpochRow, StepRow};

/// The format's name and version, first in every index.
pub const FORMAT: &str = "runner checkpoint 1";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Index {
    pub format: String,
    /// Every file of the checkpoint (in its directory) and its size in bytes.
    pub files: BTreeMap<String, u64>,
    pub tensors: BTreeMap<String, TensorEntry>,
    pub record: Record,
    /// XXH3-64 of the record (its JSON, keys sorted, numbers in their shortest exact form), as
    /// the tensors' pieces have theirs: an edited record is refused like a damaged tensor.
    /// Absent from an older runner's checkpoints, whose record is still checked against the run
    /// (its layout, its trace rows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record_xxh3: Option<String>,
}

/// The checksum of a record, given as JSON (as written, or as read back from an index).
pub fn record_checksum(record: &serde_json::Value) -> String {
    let bytes = serde_json::to_vec(record).expect("a JSON value serializes");
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes))
}

/// What a tensor is part of: the model (`model.safetensors` holds the same tensors), the
/// optimizer's state, or the trace's unfinished interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Model,
    Optimizer,
    Trace,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorEntry {
    pub role: Role,
    pub dtype: Dtype,
    /// The whole tensor's shape.
    pub shape: Vec<i64>,
    /// Its pieces, by first row: together they hold every row (dim 0) once.
    pub pieces: Vec<PieceEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PieceEntry {
    /// The file holding it, stored there under the tensor's name.
    pub file: String,
    /// Its first row (dim 0) in the whole tensor, and its rows; other dimensions are whole.
    pub offset: i64,
    pub rows: i64,
    /// Its bytes in the file, from the file's first byte.
    pub bytes: [u64; 2],
    /// xxh3-64 of those bytes, in hex.
    pub xxh3: String,
}

/// Where the run stood at the checkpoint: a resumed run goes on from here.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The epoch in progress (or just finished).
    pub epoch: usize,
    /// Optimizer steps done over the run.
    pub step: usize,
    /// Where the data stood: "epoch E, batch B of N" or "random windows, step S".
    pub position: String,
    /// The ranks and strategy that wrote it.
    pub layout: Layout,
    /// Samples per optimizer step over all ranks, and optimizer steps per epoch: a resumed run
    /// keeps both, so its steps cover the same samples.
    pub global_batch: usize,
    pub steps_per_epoch: usize,
    /// The model's parameters and buffers (names and shapes, sorted): the tensors of role model.
    pub parameters: Vec<(String, Vec<i64>)>,
    /// The trace rows so far.
    pub rows: Vec<EpochRow>,
    pub steps: Vec<StepRow>,
    /// DDP's gradient buckets (parameter indices in module order) as the Reducer had rebuilt
    /// them: a run resumed at the same world size under DDP starts from them, so it sums
    /// gradients as an uninterrupted one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buckets: Option<Vec<Vec<usize>>>,
    /// Mid-interval: every rank's buffers of the unfinished interval are the tensors
    /// `trace.partial.R.{losses,correct,weights,norms}`, R < the layout's world size.
    pub partial: bool,
    /// Mid-interval: the seconds rank 0 had trained the interval for (its time so far), which a
    /// resumed run adds to its own, so that the interval's steps are each timed once (kept out
    /// of the tensor files: two writes of the same state hold the same bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interval_s: Option<f64>,
}

impl Record {
    pub fn strategy(&self) -> WrapStrategy {
        self.layout.strategy
    }
}

/// A tensor's rows (dim 0); a 0-dimensional tensor is one row.
pub fn rows_of(shape: &[i64]) -> i64 {
    shape.first().copied().unwrap_or(1)
}

/// The shape of rows `rows` of a tensor of `shape`.
pub fn piece_shape(shape: &[i64], rows: i64) -> Vec<i64> {
    match shape.split_first() {
        None => Vec::new(),
        Some((_, rest)) => std::iter::once(rows).chain(rest.iter().copied()).collect(),
    }
}

impl TensorEntry {
    /// Its pieces tile rows 0..rows exactly once (sorted by offset; an empty piece, such as a
    /// rank's share of a tensor shorter than the ranks, holds nothing).
    pub fn check_tiling(&self, name: &str) -> Result<(), String> {
        let mut at = 0;
        for p in self.pieces.iter().filter(|p| p.rows != 0) {
            if p.offset != at || p.rows < 0 {
                return Err(format!(
                    "the pieces of `{name}` do not cover its {} rows once (a piece at row {} of {} rows, row {at} \
                     expected)",
                    rows_of(&self.shape),
                    p.offset,
                    p.rows
                ));
            }
            at += p.rows;
        }
        if at != rows_of(&self.shape) {
            return Err(format!("the pieces of `{name}` hold {at} of its {} rows", rows_of(&self.shape)));
        }
        Ok(())
    }

    /// The pieces holding some of `rows`.
    pub fn pieces_in(&self, rows: Range<i64>) -> impl Iterator<Item = &PieceEntry> {
        self.pieces.iter().filter(move |p| p.offset < rows.end && p.offset + p.rows > rows.start)
    }
}
