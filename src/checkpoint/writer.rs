//! Writing a checkpoint, on every rank at once: each rank holding pieces writes and syncs its own
//! file; every rank's list of pieces (or its failure) is all-gathered; rank 0 checks that the
//! pieces hold every tensor once, writes and syncs the index, and renames the checkpoint's
//! directory into place. Before anything is written, the free space is checked against the
//! whole checkpoint.
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use tch::Tensor;

use super::index::{Index, PieceEntry, Record, Role, TensorEntry, FORMAT};
use super::{describe, dir, list, prune, stem, Piece, INDEX};
use crate::dist::ProcessGroup;
use crate::plan::Plan;
use crate::tensorfile::{self, Entry, TensorFile};

/// One rank's pieces as written: (tensor name, its whole shape, its piece).
type Written = Vec<(String, Vec<i64>, PieceEntry)>;

/// Writes the checkpoint of `record.step` from every rank's `pieces` (every rank calls it, at the
/// same point) and prunes all but the newest `keep`. With `keep` ≥ 2 the oldest are pruned to
/// `keep - 1` before writing (the newest stays as the last good one), so `keep` checkpoints'
/// worth of disk is enough; with `keep` = 1 the new one is complete before the old one goes.
pub fn save(
    run_dir: &Path,
    plan: &Plan,
    pg: &ProcessGroup,
    pieces: Vec<Piece>,
    record: Record,
    keep: usize,
) -> anyhow::Result<()> {
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
    let all = pg.all_gather(&Tensor::from_slice(&[mine as i64, std::process::id() as i64]))?;
    let all: Vec<Vec<i64>> = all.iter().map(|t| Vec::<i64>::try_from(t).expect("two int64 values")).collect();
    let staging = ck.join(format!(".{name}.tmp-{}", all[0][1]));
    let total: u64 = all.iter().map(|v| v[0] as u64).sum();
    let result = write_and_commit(run_dir, plan, pg, &staging, pieces, record, total, keep);
    if result.is_err() && rank == 0 {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}

/// [`save`] once the directory `staging` exists: every rank's file, then rank 0's index and
/// commit. `total`: the bytes of every rank's pieces.
#[allow(clippy::too_many_arguments)]
fn write_and_commit(
    run_dir: &Path,
    plan: &Plan,
    pg: &ProcessGroup,
    staging: &Path,
    pieces: Vec<Piece>,
    record: Record,
    total: u64,
    keep: usize,
) -> anyhow::Result<()> {
    let (rank, name, ck) = (pg.rank(), stem(plan, record.step), dir(run_dir));
    // The tensors' bytes, and room for the headers and the index with its trace rows.
    let need = total + 64 * 1024 * pg.size() as u64 + 1024 * (record.rows.len() + record.steps.len()) as u64;
    // Rank 0 looks, before any rank writes (a rank looking later would see the others' files):
    // every rank then fails with its verdict.
    let verdict = if rank == 0 { check_space(run_dir, plan, &ck, record.step, need) } else { Ok(()) };
    let verdicts: Vec<Result<(), String>> = all_gather_json(pg, &verdict.map_err(|e| format!("{e:#}")))?;
    if let Some(Err(e)) = verdicts.into_iter().find(Result::is_err) {
        anyhow::bail!(e);
    }

    let file = format!("rank-{rank}.safetensors");
    let written = if pieces.is_empty() {
        Ok(Vec::new())
    } else {
        write_pieces(&staging.join(&file), &file, &pieces).map_err(|e| format!("{e:#}"))
    };
    drop(pieces);
    stall_if_asked(rank, record.step);
    // Every rank learns whether every rank wrote its file: all fail together, naming the first.
    let results: Vec<Result<Written, String>> = all_gather_json(pg, &written)?;
    for (r, result) in results.iter().enumerate() {
        if let Err(e) = result {
            anyhow::bail!("the checkpoint of {} was not written: rank {r}: {e}", describe(&name));
        }
    }
    if rank != 0 {
        return Ok(());
    }
    let pieces: Vec<(usize, Written)> =
        results.into_iter().enumerate().map(|(r, w)| (r, w.expect("checked above"))).collect();
    let index = index_of(staging, pieces, record)?;
    crate::rundir::atomic_write(&staging.join(INDEX), serde_json::to_string(&index)?.as_bytes())?;
    let path = ck.join(&name);
    if path.exists() {
        // Left by an earlier attempt at the same step.
        super::remove(&path);
    }
    std::fs::rename(staging, &path).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::File::open(&ck).and_then(|d| d.sync_all()).with_context(|| format!("cannot sync {}", ck.display()))?;
    prune(run_dir, plan, keep);
    Ok(())
}

/// A test hook: with `RUNNER_TEST_STALL_CHECKPOINT=R:STEP` in its environment, rank R stops for
/// good once its file of the checkpoint of step STEP is written, before the checkpoint is
/// committed, so that a test can kill the run in the middle of a checkpoint.
fn stall_if_asked(rank: usize, step: usize) {
    if std::env::var("RUNNER_TEST_STALL_CHECKPOINT").is_ok_and(|v| v == format!("{rank}:{step}")) {
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

/// Fails, naming the space and the last good checkpoint, when `need` bytes are not free.
fn check_space(run_dir: &Path, plan: &Plan, ck: &Path, step: usize, need: u64) -> anyhow::Result<()> {
    let Some(free) = free_bytes(ck) else { return Ok(()) };
    if free >= need {
        return Ok(());
    }
    let last = list(run_dir, plan).pop().map_or("none yet".to_owned(), |(_, name)| describe(&name));
    anyhow::bail!(
        "not enough free space for the checkpoint of {}: it needs about {:.1} MiB, {:.1} MiB are free on {}; the last \
         good checkpoint ({last}) is kept: free some space and resume with --resume",
        describe(&stem(plan, step)),
        need as f64 / 1048576.0,
        free as f64 / 1048576.0,
        ck.display()
    )
}

/// Bytes free for this user on the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(s.blocks_available() as u64 * s.fragment_size() as u64)
}

/// Writes `pieces` to `path` (one entry per tensor, under the tensor's name), synced; returns
/// where each lies and its checksum.
fn write_pieces(path: &Path, file: &str, pieces: &[Piece]) -> anyhow::Result<Written> {
    let sums: RefCell<BTreeMap<String, String>> = RefCell::default();
    let mut entries = Vec::with_capacity(pieces.len());
    for p in pieces {
        let (name, t, sums) = (&p.name, &p.tensor, &sums);
        entries.push(Entry {
            name: name.clone(),
            kind: t.kind(),
            shape: t.size(),
            bytes: Box::new(move || {
                let bytes = tensorfile::bytes_of(t);
                sums.borrow_mut().insert(name.clone(), format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&bytes)));
                Ok(bytes)
            }),
        });
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(p) = pieces.iter().find(|p| !seen.insert(&p.name)) {
        anyhow::bail!("two pieces of `{}` on one rank", p.name);
    }
    tensorfile::write(path, None, entries)?;
    let f = TensorFile::open(path).map_err(|e| anyhow::anyhow!("{} as written: {e}", path.display()))?;
    let sums = sums.into_inner();
    Ok(pieces
        .iter()
        .map(|p| {
            let range = f.range(&p.name).expect("written");
            let entry = PieceEntry {
                file: file.to_owned(),
                offset: p.offset,
                rows: p.rows(),
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
