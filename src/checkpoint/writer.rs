//! Writing a checkpoint, on every rank at once: each rank holding pieces writes and syncs its own
//! file; every rank's list of pieces (or its failure) is all-gathered; rank 0 checks that the
//! pieces hold every tensor once, writes and syncs the index, and renames the checkpoint's
//! directory into place. Before anything is written, the free space is checked against the
//! whole checkpoint. The phases ([`begin`], [`write_mine`], [`commit`]) are also those of a
//! checkpoint written in the background ([`super::background`]).
use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use tch::Tensor;

use super::index::{rows_of, Index, PieceEntry, Record, Role, TensorEntry, FORMAT};
use super::{describe, dir, list, prune, stem, Piece, INDEX};
use crate::dist::ProcessGroup;
use crate::plan::Plan;
use crate::tensorfile::{self, Entry, TensorFile};

/// One rank's pieces as written: (tensor name, its whole shape, its piece).
pub(super) type Written = Vec<(String, Vec<i64>, PieceEntry)>;

/// A piece as its rank's file takes it: its place in its tensor, and its bytes.
pub(super) struct Staged {
    place: Place,
    data: Data,
}

/// Where a piece lies: its tensor's name and whole shape, its first row there, its own shape
/// and type.
struct Place {
    name: String,
    shape: Vec<i64>,
    offset: i64,
    size: Vec<i64>,
    kind: tch::Kind,
}

enum Data {
    /// Read from the tensor when the file is written (a checkpoint written at the step).
    Read(Tensor),
    /// Copied out at the step (one written in the background while its tensors train on): the
    /// file is written from this copy, with no second one, and the copy is kept for the next.
    Copied(Vec<u8>),
}

/// The copies a checkpoint written in the background was written from, for the next one to copy
/// into (each piece's, in the order of its pieces).
pub(super) type Spare = Vec<Vec<u8>>;

impl Staged {
    /// `piece`, read when written.
    pub(super) fn read(piece: Piece) -> Staged {
        let (size, kind) = (piece.tensor.size(), piece.tensor.kind());
        let place = Place { name: piece.name, shape: piece.shape, offset: piece.offset, size, kind };
        Staged { place, data: Data::Read(piece.tensor) }
    }

    /// `piece`, its bytes copied now into `buffer` (reused where it is the size already).
    pub(super) fn copied(piece: Piece, buffer: Vec<u8>) -> Staged {
        let bytes = tensorfile::bytes_into(&piece.tensor, buffer);
        Staged { data: Data::Copied(bytes), ..Staged::read(piece) }
    }
}

/// Writes the checkpoint of `record.step` from every rank's `pieces` (every rank calls it, at the
/// same point) and prunes all but the newest `keep`. With `keep` ≥ 2 the oldest are pruned to
/// `keep - 1` before writing (the newest stays as the last good one), so `keep` checkpoints'
/// worth of disk and the model's is enough (each checkpoint checks that the model written at the
/// run's end still fits beside it); with `keep` = 1 the new one is complete before the old one
/// goes.
pub fn save(
    run_dir: &Path,
    plan: &Plan,
    pg: &ProcessGroup,
    pieces: Vec<Piece>,
    record: Record,
    keep: usize,
) -> anyhow::Result<()> {
    let begun = begin(run_dir, plan, pg, &pieces, &record, keep)?;
    let result = (|| {
        let (written, _) = write_mine(&begun, pg.rank(), pieces.into_iter().map(Staged::read).collect());
        // Every rank learns whether every rank wrote its file: all fail together, naming the first.
        let results: Vec<Result<Written, String>> = all_gather_json(pg, &written)?;
        if pg.rank() == 0 {
            commit(run_dir, plan, &begun, results, record, keep)?;
        } else if let Some(e) = first_error(&begun, &results) {
            anyhow::bail!(e);
        }
        Ok(())
    })();
    if result.is_err() && pg.rank() == 0 {
        let _ = std::fs::remove_dir_all(&begun.staging);
    }
    result
}

/// A checkpoint every rank has begun: its directory being written exists, and there is room.
pub(super) struct Begun {
    /// `checkpoints/.<name>.tmp-<rank 0's pid>/`.
    pub staging: PathBuf,
    pub name: String,
    pub step: usize,
}

/// Begins the checkpoint of `record.step` on every rank (collective): rank 0 prunes, makes the
/// directory the files go to and checks the free space against every rank's `pieces`; every rank
/// fails with its verdict.
pub(super) fn begin(
    run_dir: &Path,
    plan: &Plan,
    pg: &ProcessGroup,
    pieces: &[Piece],
    record: &Record,
    keep: usize,
) -> anyhow::Result<Begun> {
    let (rank, name) = (pg.rank(), stem(plan, record.step));
    let ck = dir(run_dir);
    if rank == 0 {
        std::fs::create_dir_all(&ck).with_context(|| format!("cannot create {}", ck.display()))?;
        if keep >= 2 {
            prune(run_dir, plan, keep - 1);
        }
        let staging = ck.join(format!(".{name}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir(&staging).with_context(|| format!("cannot create {}", staging.display()))?;
    }
    // Rank 0's pid names the directory being written; the gather is also the barrier after which
    // it exists.
    let mine: u64 = pieces.iter().map(Piece::bytes).sum();
    let model: std::collections::HashSet<&str> = record.parameters.iter().map(|(n, _)| n.as_str()).collect();
    let mine_model: u64 = pieces.iter().filter(|p| model.contains(p.name.as_str())).map(Piece::bytes).sum();
    let all = pg.all_gather(&Tensor::from_slice(&[mine as i64, std::process::id() as i64, mine_model as i64]))?;
    let all: Vec<Vec<i64>> = all.iter().map(|t| Vec::<i64>::try_from(t).expect("three int64 values")).collect();
    let staging = ck.join(format!(".{name}.tmp-{}", all[0][1]));
    let total: u64 = all.iter().map(|v| v[0] as u64).sum();
    // The tensors' bytes, and room for the headers and the index with its trace rows.
    let need = total + 64 * 1024 * pg.size() as u64 + 1024 * (record.rows.len() + record.steps.len()) as u64;
    // The model file still to come at the run's end (its parameters, with room for its header
    // and buffers): a later checkpoint takes the place of one pruned, the model takes its own.
    let model = all.iter().map(|v| v[2] as u64).sum::<u64>() + 64 * 1024;
    // Rank 0 looks, before any rank writes (a rank looking later would see the others' files):
    // every rank then fails with its verdict.
    let verdict = if rank == 0 { check_space(run_dir, plan, &ck, record.step, need, model) } else { Ok(()) };
    let verdicts: Vec<Result<(), String>> = all_gather_json(pg, &verdict.map_err(|e| format!("{e:#}")))?;
    if let Some(Err(e)) = verdicts.into_iter().find(Result::is_err) {
        if rank == 0 {
            let _ = std::fs::remove_dir_all(&staging);
        }
        anyhow::bail!(e);
    }
    Ok(Begun { staging, name, step: record.step })
}

/// Writes this rank's file of the checkpoint `begun` (none when it holds no piece); gives back
/// the copies it was written from.
pub(super) fn write_mine(begun: &Begun, rank: usize, pieces: Vec<Staged>) -> (Result<Written, String>, Spare) {
    let file = format!("rank-{rank}.safetensors");
    let (written, spare) = if pieces.is_empty() {
        (Ok(Vec::new()), Vec::new())
    } else {
        let (written, spare) = write_pieces(&begun.staging.join(&file), &file, pieces);
        (written.map_err(|e| format!("{e:#}")), spare)
    };
    // A test's kill in the middle of a checkpoint ([`crate::testhook`]).
    crate::testhook::stall_in_checkpoint(rank, begun.step);
    (written, spare)
}

/// The first rank's failure to write its file, said for the checkpoint `begun`.
fn first_error(begun: &Begun, results: &[Result<Written, String>]) -> Option<String> {
    results.iter().enumerate().find_map(|(r, result)| {
        let e = result.as_ref().err()?;
        Some(format!("the checkpoint of {} was not written: rank {r}: {e}", describe(&begun.name)))
    })
}

/// Rank 0, once every rank's file is written (`results`, by rank): checks that the pieces hold
/// every tensor once, writes and syncs the index, renames the directory into place, and prunes
/// all but the newest `keep`.
pub(super) fn commit(
    run_dir: &Path,
    plan: &Plan,
    begun: &Begun,
    results: Vec<Result<Written, String>>,
    record: Record,
    keep: usize,
) -> anyhow::Result<()> {
    if let Some(e) = first_error(begun, &results) {
        anyhow::bail!(e);
    }
    let (staging, ck) = (&begun.staging, dir(run_dir));
    let pieces: Vec<(usize, Written)> =
        results.into_iter().enumerate().map(|(r, w)| (r, w.expect("checked above"))).collect();
    let index = index_of(staging, pieces, record)?;
    crate::rundir::atomic_write(&staging.join(INDEX), serde_json::to_string(&index)?.as_bytes())?;
    let path = ck.join(&begun.name);
    if path.exists() {
        // Left by an earlier attempt at the same step.
        super::remove(&path);
    }
    std::fs::rename(staging, &path).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::File::open(&ck).and_then(|d| d.sync_all()).with_context(|| format!("cannot sync {}", ck.display()))?;
    prune(run_dir, plan, keep);
    Ok(())
}

/// Fails, naming the space and the last good checkpoint, when `need` bytes for the checkpoint
/// and `model` bytes for the model written at the run's end are not free.
fn check_space(run_dir: &Path, plan: &Plan, ck: &Path, step: usize, need: u64, model: u64) -> anyhow::Result<()> {
    let Some(free) = free_bytes(ck) else { return Ok(()) };
    if free >= need + model {
        return Ok(());
    }
    let last = list(run_dir, plan).pop().map_or("none yet".to_owned(), |(_, name)| describe(&name));
    let mib = |bytes: u64| bytes as f64 / 1048576.0;
    anyhow::bail!(
        "not enough free space for the checkpoint of {} and the model written at the run's end: they need about \
         {:.1} MiB (the checkpoint {:.1} MiB, the model {:.1} MiB), {:.1} MiB are free on {}; the last good checkpoint \
         ({last}) is kept: free some space (or lower checkpoint.keep) and resume with --resume",
        describe(&stem(plan, step)),
        mib(need + model),
        mib(need),
        mib(model),
        mib(free),
        ck.display()
    )
}

/// Fails before training when the model file written at the run's end (`model` bytes) would
/// not fit on the file system holding `run_dir`: better now than after every step is trained.
pub fn check_model_space(run_dir: &Path, model: u64) -> anyhow::Result<()> {
    let Some(free) = free_bytes(run_dir) else { return Ok(()) };
    if free >= model {
        return Ok(());
    }
    anyhow::bail!(
        "not enough free space for the model this run writes at its end: it needs about {:.1} MiB, {:.1} MiB are \
         free on {}: free some space, or run with --out on another file system",
        model as f64 / 1048576.0,
        free as f64 / 1048576.0,
        run_dir.display()
    )
}

/// Bytes free for this user on the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(s.blocks_available() as u64 * s.fragment_size() as u64)
}

/// Writes `pieces` to `path` (one entry per tensor, under the tensor's name), synced; returns
/// where each lies and its checksum, and the copies it was written from.
fn write_pieces(path: &Path, file: &str, pieces: Vec<Staged>) -> (anyhow::Result<Written>, Spare) {
    let (placed, data): (Vec<Place>, Vec<Data>) = pieces.into_iter().map(|p| (p.place, p.data)).unzip();
    let written = write_placed(path, file, &placed, &data);
    let spare = data.into_iter().filter_map(|d| if let Data::Copied(b) = d { Some(b) } else { None }).collect();
    (written, spare)
}

/// [`write_pieces`] of pieces `placed` with their `data`.
fn write_placed(path: &Path, file: &str, placed: &[Place], data: &[Data]) -> anyhow::Result<Written> {
    let mut seen = std::collections::HashSet::new();
    if let Some(p) = placed.iter().find(|p| !seen.insert(&p.name)) {
        anyhow::bail!("two pieces of `{}` on one rank", p.name);
    }
    let sums: RefCell<BTreeMap<String, String>> = RefCell::default();
    let entries = placed.iter().zip(data).map(|(Place { name, size, kind, .. }, data)| {
        let sums = &sums;
        Entry {
            name: name.clone(),
            kind: *kind,
            shape: size.clone(),
            bytes: Box::new(move || {
                let bytes: Cow<[u8]> = match data {
                    Data::Read(t) => tensorfile::bytes_of(t).into(),
                    Data::Copied(bytes) => bytes.as_slice().into(),
                };
                sums.borrow_mut().insert(name.clone(), format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)));
                Ok(bytes)
            }),
        }
    });
    tensorfile::write(path, None, entries.collect())?;
    let f = TensorFile::open(path).map_err(|e| anyhow::anyhow!("{} as written: {e}", path.display()))?;
    let sums = sums.into_inner();
    Ok(placed
        .iter()
        .map(|p| {
            let range = f.range(&p.name).expect("written");
            let entry = PieceEntry {
                file: file.to_owned(),
                offset: p.offset,
                rows: rows_of(&p.size),
                bytes: [range.start, range.end],
                xxh3: sums[&p.name].clone(),
            };
            (p.name.clone(), p.shape.clone(), entry)
        })
        .collect())
}

/// The index of every rank's pieces: each tensor's pieces must hold its rows once, in one type.
fn index_of(staging: &Path, pieces: Vec<(usize, Written)>, record: Record) -> anyhow::Result<Index> {
    let model: std::collections::HashSet<&str> = record.parameters.iter().map(|(n, _)| n.as_str()).collect();
    let mut files = BTreeMap::new();
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    for (rank, written) in pieces {
        if written.is_empty() {
            continue;
        }
        let file = format!("rank-{rank}.safetensors");
        let f = TensorFile::open(&staging.join(&file)).map_err(|e| anyhow::anyhow!("{file}: {e}"))?;
        files.insert(file.clone(), std::fs::metadata(staging.join(&file))?.len());
        for (name, shape, piece) in written {
            let dtype = f.info(&name).expect("written").dtype;
            let role = if model.contains(name.as_str()) {
                Role::Model
            } else if name.starts_with("trace.") {
                Role::Trace
            } else {
                Role::Optimizer
            };
            let t = tensors.entry(name.clone()).or_insert(TensorEntry {
                role,
                dtype,
                shape: shape.clone(),
                pieces: vec![],
            });
            anyhow::ensure!(
                t.shape == shape && t.dtype == dtype,
                "the pieces of `{name}` disagree on its shape or type ({:?} {:?} and {shape:?} {dtype:?})",
                t.shape,
                t.dtype
            );
            t.pieces.push(piece);
        }
    }
    for (name, t) in tensors.iter_mut() {
        t.pieces.sort_by_key(|p| p.offset);
        t.check_tiling(name).map_err(anyhow::Error::msg)?;
    }
    for (name, _) in &record.parameters {
        anyhow::ensure!(tensors.contains_key(name), "no rank wrote the model's `{name}`");
    }
    let record_xxh3 = Some(super::index::record_checksum(&serde_json::to_value(&record)?));
    Ok(Index { format: FORMAT.to_owned(), files, tensors, record, record_xxh3 })
}

/// Every rank's `value`, all-gathered as JSON (lengths first, then the bytes padded to the
/// longest).
fn all_gather_json<T: serde::Serialize + serde::de::DeserializeOwned>(
    pg: &ProcessGroup,
    value: &T,
) -> anyhow::Result<Vec<T>> {
    let bytes = serde_json::to_vec(value)?;
    let lens = pg.all_gather(&Tensor::from_slice(&[bytes.len() as i64]))?;
    let lens: Vec<usize> = lens.iter().map(|t| t.int64_value(&[0]) as usize).collect();
    let longest = lens.iter().copied().max().unwrap_or(0);
    let mut padded = bytes;
    padded.resize(longest, 0);
    let all = pg.all_gather(&Tensor::from_slice(&padded))?;
    all.iter()
        .zip(lens)
        .map(|(t, n)| {
            let v = Vec::<u8>::try_from(t).context("bytes")?;
            serde_json::from_slice(&v[..n]).context("a rank's checkpoint pieces")
        })
        .collect()
}
