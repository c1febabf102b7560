//! Reading a checkpoint: its index checked against its files, and any rows of any tensor
//! assembled from the pieces that hold them, each piece read at its byte range and checked
//! against its checksum. A rank keeps in memory only the rows it holds.
use std::cell::RefCell;
use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use tch::Tensor;

use super::index::{piece_shape, rows_of, Index, PieceEntry, Role, TensorEntry, FORMAT};
use super::{Found, Record, INDEX};
use crate::plan::Plan;
use crate::tensorfile::TensorFile;

/// The largest index read: its trace rows grow with the run (about 1 kB per rank per row).
const MAX_INDEX: u64 = 1 << 30;

/// Reads `dir`'s index and checks it: its format, its step (`step`, from the directory's name),
/// its model against the plan's, each tensor's pieces tiling it, and each file against the
/// index (size, and for every piece its name, type, shape and byte range in the file's header);
/// with `checksums`, also every piece's bytes. The error says what does not hold.
pub fn verify(dir: &Path, step: usize, plan: &Plan, checksums: bool) -> Result<Index, String> {
    let path = dir.join(INDEX);
    crate::input::capped_file(&path, MAX_INDEX, "a checkpoint's index")?;
    let text = std::fs::read(&path).map_err(|e| format!("its index {} cannot be read ({e})", path.display()))?;
    let unreadable = |e: serde_json::Error| {
        format!("its index {} is not a checkpoint index this runner can read ({e})", path.display())
    };
    let json: serde_json::Value = serde_json::from_slice(&text).map_err(unreadable)?;
    let record_sum = super::index::record_checksum(json.get("record").unwrap_or(&serde_json::Value::Null));
    let index: Index = serde_json::from_value(json).map_err(unreadable)?;
    if index.format != FORMAT {
        return Err(format!("its index is of format \"{}\", this runner reads \"{FORMAT}\"", index.format));
    }
    if let Some(sum) = index.record_xxh3.as_ref().filter(|s| **s != record_sum) {
        return Err(format!(
            "its record (where the run stood: the step, the layout, the trace's rows) fails its checksum ({sum} in the \
             index, {record_sum} computed): the index was edited or damaged"
        ));
    }
    let r = &index.record;
    if r.step != step {
        return Err(format!("its index says step {}, its name step {step}", r.step));
    }
    check_layout(r)?;
    if r.parameters != crate::model::saved_parameters(plan.model().as_ref()) {
        return Err("it holds a different model (parameter names or shapes differ from [wrap.model])".into());
    }
    check_model(&index)?;
    check_optimizer(&index, plan)?;
    check_buckets(r.buckets.as_deref(), plan)?;
    check_partial_trace(&index)?;
    if checksums {
        let run_dir = dir.parent().and_then(Path::parent).unwrap_or(Path::new("."));
        check_trace(r, &run_dir.join(crate::rundir::TRACE))?;
    }
    let files = open_files(dir, &index)?;
    for (name, t) in &index.tensors {
        t.check_tiling(name)?;
        for piece in &t.pieces {
            let f = files.get(&piece.file).ok_or_else(|| {
                format!("its index puts a piece of `{name}` in {}, which it does not list", piece.file)
            })?;
            check_piece(f, name, t, piece)?;
            if checksums {
                read_piece(f, name, piece)?;
            }
        }
    }
    Ok(index)
}

/// Each of the record's parameters is in the index as model state, of its shape.
fn check_model(index: &Index) -> Result<(), String> {
    for (name, shape) in &index.record.parameters {
        match index.tensors.get(name) {
            Some(t) if t.shape != *shape => {
                return Err(format!("its index holds the model's `{name}` as {:?}, the model's is {shape:?}", t.shape))
            }
            Some(t) if t.role == Role::Model => {}
            Some(t) => return Err(format!("its index holds the model's `{name}` as {:?} state", t.role)),
            None => return Err(format!("its index lacks the model's `{name}` of shape {shape:?}")),
        }
    }
    Ok(())
}

/// A checkpoint inside a trace interval holds every rank's partial sums of that interval.
fn check_partial_trace(index: &Index) -> Result<(), String> {
    let r = &index.record;
    if r.partial {
        for k in 0..r.layout.world_size {
            for what in ["losses", "correct", "weights", "norms"] {
                let name = format!("trace.partial.{k}.{what}");
                if index.tensors.get(&name).is_none_or(|t| t.role != Role::Trace) {
                    return Err(format!(
                        "its record says the checkpoint falls inside a trace interval, but its index lacks `{name}` \
                         (rank {k} of the {} that wrote it)",
                        r.layout.world_size
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Each file the index lists, of its size, opened: the index's names stay inside `dir`.
fn open_files(dir: &Path, index: &Index) -> Result<HashMap<String, TensorFile>, String> {
    let mut files = HashMap::new();
    for (file, bytes) in &index.files {
        let p = dir.join(file);
        if file.contains('/') || file.starts_with('.') {
            return Err(format!("its index names a file outside its directory ({file})"));
        }
        let len = match std::fs::metadata(&p) {
            Ok(m) => m.len(),
            Err(_) => return Err(format!("its index names {file}, which is missing")),
        };
        if len != *bytes {
            return Err(format!(
                "{file} is {len} bytes, its index says {bytes}: the file is truncated or was replaced"
            ));
        }
        let f = TensorFile::open(&p).map_err(|e| format!("{file} does not match its index: {e}"))?;
        files.insert(file.clone(), f);
    }
    Ok(files)
}

/// The record's trace rows are the run's trace up to the checkpoint: the rows of `trace` (when
/// there is one) up to its step, in order, with the same epoch, step, rank and losses. A resume
/// writes the trace again from the record: one that lost rows would lose them from the trace.
fn check_trace(r: &Record, trace: &Path) -> Result<(), String> {
    let Ok(df) = crate::trace::read_parquet(trace) else { return Ok(()) };
    let column = |name: &str| df.column(name).ok().map(|c| c.as_materialized_series().clone());
    let (Some(epoch), Some(step), Some(rank), Some(loss)) =
        (column("epoch"), column("step"), column("rank"), column("global_train_loss"))
    else {
        return Ok(());
    };
    let cast = |s: &polars::prelude::Series, t| s.cast(&t).ok();
    use polars::prelude::DataType;
    let (Some(epoch), Some(step), Some(rank), Some(loss)) = (
        cast(&epoch, DataType::UInt64),
        cast(&step, DataType::UInt64),
        cast(&rank, DataType::UInt64),
        cast(&loss, DataType::Float64),
    ) else {
        return Ok(());
    };
    let (epoch, step, rank, loss) = (epoch.u64(), step.u64(), rank.u64(), loss.f64());
    let (Ok(epoch), Ok(step), Ok(rank), Ok(loss)) = (epoch, step, rank, loss) else { return Ok(()) };
    let traced: Vec<(u64, u64, u64, Option<u64>)> = (0..df.height())
        .map(|i| {
            (
                epoch.get(i).unwrap_or(0),
                step.get(i).unwrap_or(0),
                rank.get(i).unwrap_or(0),
                loss.get(i).map(f64::to_bits),
            )
        })
        .filter(|row| row.1 <= r.step as u64)
        .collect();
    let recorded: Vec<(u64, u64, u64, Option<u64>)> = r
        .rows
        .iter()
        .map(|row| (row.epoch as u64, row.step, row.rank as u64, Some(row.global_train_loss.to_bits())))
        .collect();
    if traced == recorded {
        return Ok(());
    }
    let at = traced.iter().zip(&recorded).position(|(a, b)| a != b).unwrap_or(traced.len().min(recorded.len()));
    Err(format!(
        "its record holds {} trace rows up to step {}, but {} holds {} (they differ from row {at} on): the \
         checkpoint's record was edited, or it belongs to another run; a resume would rewrite the trace from it",
        recorded.len(),
        r.step,
        trace.display(),
        traced.len()
    ))
}

/// Who wrote the checkpoint, as the record says, is a layout a run can have: at least one rank,
/// a whole number of copies of the model, stages only in a pipeline.
fn check_layout(r: &Record) -> Result<(), String> {
    use crate::config::schema::WrapStrategy;
    let l = &r.layout;
    let pipeline = l.strategy == WrapStrategy::Pipeline;
    let fits = (1..=crate::limits::MAX_WORLD_SIZE).contains(&l.world_size)
        && l.ranks_per_copy >= 1
        && l.world_size.is_multiple_of(l.ranks_per_copy)
        && l.strategy != WrapStrategy::Auto
        && l.tensor >= 1
        && l.ranks_per_copy.is_multiple_of(l.tensor)
        && (pipeline || l.ranks_per_copy == l.tensor)
        && r.global_batch >= 1
        && r.steps_per_epoch >= 1;
    if !fits {
        return Err(format!(
            "its record's layout ({} rank(s), strategy {:?}, {} rank(s) per copy of the model; global batch {}, {} \
             steps per epoch) is not one a run can have: the index was edited or damaged",
            l.world_size, l.strategy, l.ranks_per_copy, r.global_batch, r.steps_per_epoch
        ));
    }
    Ok(())
}

/// The optimizer's state the plan's optimizer loads: its step count, and each kind of its state
/// (`optim.exp_avg.<param>`, ...) for every trainable parameter, shaped as the parameter.
fn check_optimizer(index: &Index, plan: &Plan) -> Result<(), String> {
    match index.tensors.get(crate::model::optim::STEPS) {
        Some(t) if t.role == Role::Optimizer && t.shape.is_empty() => {}
        Some(t) => return Err(format!("its `{}` is {:?}, not one integer", crate::model::optim::STEPS, t.shape)),
        None => {
            return Err(format!(
                "its index lacks the optimizer's step count `{}`: the checkpoint is incomplete",
                crate::model::optim::STEPS
            ))
        }
    }
    let kinds = crate::model::optim::state_kinds(&plan.config.train);
    for (param, shape) in crate::model::trained_parameters(plan.model().as_ref()) {
        for kind in kinds {
            let name = format!("optim.{kind}.{param}");
            match index.tensors.get(&name) {
                Some(t) if t.shape == shape && t.role == Role::Optimizer => {}
                Some(t) => {
                    return Err(format!("its index holds `{name}` as {:?}, the parameter is {shape:?}", t.shape))
                }
                None => {
                    return Err(format!(
                        "its index lacks the optimizer's `{name}` (train.optimizer = \"{}\" keeps it): the checkpoint \
                         is incomplete",
                        format!("{:?}", plan.config.train.optimizer).to_lowercase()
                    ))
                }
            }
        }
    }
    Ok(())
}

/// A record's DDP buckets name every trainable parameter (by its index in module order) exactly
/// once: the Reducer is handed them as they are.
fn check_buckets(buckets: Option<&[Vec<usize>]>, plan: &Plan) -> Result<(), String> {
    let Some(buckets) = buckets else { return Ok(()) };
    let n = crate::model::trained_parameters(plan.model().as_ref()).len();
    let mut seen = vec![false; n];
    for &i in buckets.iter().flatten() {
        if i >= n || std::mem::replace(&mut seen[i], true) {
            return Err(format!("its DDP buckets name parameter {i} twice or past the model's {n}"));
        }
    }
    if seen.contains(&false) || buckets.iter().any(Vec::is_empty) {
        return Err(format!("its DDP buckets do not hold each of the model's {n} parameters"));
    }
    Ok(())
}

/// A piece's entry in its file's header is the one the index describes.
fn check_piece(f: &TensorFile, name: &str, t: &TensorEntry, piece: &PieceEntry) -> Result<(), String> {
    let file = &piece.file;
    let info = f.info(name).ok_or_else(|| format!("its index puts `{name}` in {file}, which does not hold it"))?;
    let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
    let want = piece_shape(&t.shape, piece.rows);
    let range = f.range(name).expect("an entry has a range");
    if info.dtype != t.dtype || shape != want || [range.start, range.end] != piece.bytes {
        return Err(format!(
            "its index does not match {file}: `{name}` is {:?} {shape:?} at bytes {}..{} there, {:?} {want:?} at bytes \
             {}..{} in the index",
            info.dtype, range.start, range.end, t.dtype, piece.bytes[0], piece.bytes[1]
        ));
    }
    Ok(())
}

/// A piece's bytes, checked against its checksum.
fn read_piece(f: &TensorFile, name: &str, piece: &PieceEntry) -> Result<Vec<u8>, String> {
    let [start, end] = piece.bytes;
    let bytes = f.read_range(start..end, end - start).map_err(|e| format!("{}: {e}", piece.file))?;
    let sum = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes));
    if sum != piece.xxh3 {
        return Err(format!(
            "the piece of `{name}` (rows {}..{}) in {} fails its checksum: the file is damaged",
            piece.offset,
            piece.offset + piece.rows,
            piece.file
        ));
    }
    Ok(bytes)
}

/// Bytes `keep` (from the piece's first byte) of a piece, the whole piece read in chunks of 8
/// MiB to check its checksum: memory for the part kept and one chunk.
fn read_piece_part(f: &TensorFile, name: &str, piece: &PieceEntry, keep: Range<u64>) -> Result<Vec<u8>, String> {
    const CHUNK: u64 = 8 << 20;
    let [start, end] = piece.bytes;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut out = vec![0u8; (keep.end - keep.start) as usize];
    let mut chunk = vec![0u8; CHUNK.min(end - start) as usize];
    let mut at = 0u64;
    while at < end - start {
        let n = CHUNK.min(end - start - at);
        let buf = &mut chunk[..n as usize];
        f.read_into(buf, start + at).map_err(|e| format!("{}: {e}", piece.file))?;
        hasher.update(buf);
        // The part of this chunk that is kept.
        let (lo, hi) = (keep.start.max(at), keep.end.min(at + n));
        if lo < hi {
            out[(lo - keep.start) as usize..(hi - keep.start) as usize]
                .copy_from_slice(&buf[(lo - at) as usize..(hi - at) as usize]);
        }
        at += n;
    }
    if format!("{:016x}", hasher.digest()) != piece.xxh3 {
        return Err(format!(
            "the piece of `{name}` (rows {}..{}) in {} fails its checksum: the file is damaged",
            piece.offset,
            piece.offset + piece.rows,
            piece.file
        ));
    }
    Ok(out)
}

/// Rows of a checkpoint's tensors, read from their pieces. Files stay open between reads.
pub struct Reader {
    dir: PathBuf,
    index: Index,
    files: RefCell<HashMap<String, TensorFile>>,
}

impl Reader {
    pub fn new(found: &Found) -> Reader {
        Reader { dir: found.dir.clone(), index: found.index.clone(), files: RefCell::new(HashMap::new()) }
    }

    pub fn record(&self) -> &Record {
        &self.index.record
    }

    /// The whole shape of `name`, if the checkpoint holds it.
    pub fn shape(&self, name: &str) -> Option<&[i64]> {
        self.index.tensors.get(name).map(|t| t.shape.as_slice())
    }

    /// The whole of `name`.
    pub fn whole(&self, name: &str) -> anyhow::Result<Tensor> {
        let rows = rows_of(self.shape(name).ok_or_else(|| self.missing(name))?);
        self.rows(name, 0..rows)
    }

    fn missing(&self, name: &str) -> anyhow::Error {
        anyhow::anyhow!("checkpoint {} holds no `{name}`", self.dir.display())
    }

    /// Rows `rows` (dim 0) of `name`, from the pieces that hold them (a 0-dimensional tensor is
    /// row 0). Each piece is checked against its checksum as it is read; of a piece holding more
    /// rows than asked, only the rows asked are kept (the rest is read, in chunks, for the
    /// checksum alone): a rank holds its rows and never a whole tensor it does not hold.
    pub fn rows(&self, name: &str, rows: Range<i64>) -> anyhow::Result<Tensor> {
        let t = self.index.tensors.get(name).ok_or_else(|| self.missing(name))?;
        let total = rows_of(&t.shape);
        anyhow::ensure!(
            0 <= rows.start && rows.start <= rows.end && rows.end <= total,
            "rows {}..{} of `{name}` asked from checkpoint {}, which holds {total}",
            rows.start,
            rows.end,
            self.dir.display()
        );
        let kind = crate::tensorfile::kind_of(t.dtype)
            .ok_or_else(|| anyhow::anyhow!("`{name}` in checkpoint {} is {:?}", self.dir.display(), t.dtype))?;
        let row_bytes = (t.shape.iter().skip(1).product::<i64>() as u64) * kind.elt_size_in_bytes() as u64;
        let mut parts = Vec::new();
        for piece in t.pieces_in(rows.clone()) {
            let from = rows.start.max(piece.offset);
            let to = rows.end.min(piece.offset + piece.rows);
            let keep = if t.shape.is_empty() {
                None
            } else {
                let first = (from - piece.offset) as u64 * row_bytes;
                Some(first..first + (to - from) as u64 * row_bytes)
            };
            let bytes = self.piece_bytes(name, t, piece, keep)?;
            let shape = piece_shape(&t.shape, if t.shape.is_empty() { piece.rows } else { to - from });
            let part = crate::checked::tensor(&bytes, &shape, kind)
                .map_err(|e| anyhow::anyhow!("{}: `{name}`: {e}", self.dir.join(&piece.file).display()))?;
            if t.shape.is_empty() {
                return Ok(part);
            }
            parts.push(part);
        }
        Ok(match parts.len() {
            0 => Tensor::zeros(piece_shape(&t.shape, 0).as_slice(), (kind, tch::Device::Cpu)),
            1 => parts.pop().expect("one part"),
            _ => Tensor::cat(&parts, 0),
        })
    }

    /// The bytes `keep` of a piece (all of it: `None`), the piece checked against its checksum.
    fn piece_bytes(
        &self,
        name: &str,
        t: &TensorEntry,
        piece: &PieceEntry,
        keep: Option<Range<u64>>,
    ) -> anyhow::Result<Vec<u8>> {
        let mut files = self.files.borrow_mut();
        if !files.contains_key(&piece.file) {
            let path = self.dir.join(&piece.file);
            let f = TensorFile::open(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            files.insert(piece.file.clone(), f);
        }
        let f = &files[&piece.file];
        let at = |e: String| anyhow::anyhow!("checkpoint {}: {e}", self.dir.display());
        check_piece(f, name, t, piece).map_err(at)?;
        match keep {
            Some(keep) if keep.end - keep.start < piece.bytes[1] - piece.bytes[0] => {
                read_piece_part(f, name, piece, keep).map_err(at)
            }
            _ => read_piece(f, name, piece).map_err(at),
        }
    }
}
