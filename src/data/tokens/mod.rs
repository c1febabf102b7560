//! Data for a language model: a stream of token ids cut into windows of `seq_len` + 1 tokens
//! (window i starts at token i · seq_len; its first seq_len tokens are the input, its last
//! seq_len the targets, so consecutive windows share one token). The stream comes from files of
//! token ids (`load.source = "tokens"`: 1-D `.npy` arrays of integers, or the raw little-endian
//! uint16 `.bin` nanoGPT writes; several files or a glob read as one stream in sorted order), from
//! UTF-8 files read as bytes (`"text"`, ids 0..256), or from the synthetic source's token mode (a
//! random Markov chain over the vocabulary, for tests).
//!
//! Files are never loaded: the plan scans them once in chunks (ids below the vocabulary, UTF-8),
//! and a rank reads only the windows of its batch where they lie (positioned reads), keeping the
//! ids in their file's width until the batch is built. With `load.sampling = "random"` a rank
//! draws each batch's windows at uniformly random token offsets (nanoGPT's `get_batch`).
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Kind;

use super::npy::{Dtype, Npy};
use crate::config::schema::{Sampling, Source};

mod spec;
mod windows;
mod write;

pub use spec::spec;
pub use windows::*;
pub use write::*;

/// One file of a token stream: where its ids start and how wide each is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenFile {
    pub path: PathBuf,
    pub dtype: Dtype,
    /// Byte offset of the first id (a `.npy` header's length; 0 for `.bin` and text).
    pub offset: u64,
    pub tokens: usize,
}

/// A run of tokens over one or more files: tokens `start .. start + len` of their concatenation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stream {
    pub files: Vec<TokenFile>,
    pub start: usize,
    pub len: usize,
}

impl Stream {
    /// Whole windows of `seq_len` + 1 tokens at stride `seq_len`.
    pub fn windows(&self, seq_len: usize) -> usize {
        if seq_len == 0 || self.len < seq_len + 1 {
            0
        } else {
            (self.len - 1) / seq_len
        }
    }

    /// Its tokens from `from` on (relative to this stream), `len` of them.
    fn slice(&self, from: usize, len: usize) -> Stream {
        Stream { files: self.files.clone(), start: self.start + from, len }
    }
}

/// What the plan knows of a token source: the training and validation streams.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenSpec {
    pub source: Source,
    pub train: Stream,
    pub validation: Stream,
    pub sampling: Sampling,
    /// `validate.batches` × batch: the fixed validation windows (random offsets with random
    /// sampling, the first windows otherwise); `None`: every validation window.
    pub validation_windows: Option<usize>,
    /// run.seed: the random validation windows' generator.
    pub seed: u64,
}

impl TokenSpec {
    pub fn describe(&self) -> String {
        let files = &self.train.files;
        let name = match files.len() {
            1 => files[0].path.display().to_string(),
            n => format!("{} and {} more files", files[0].path.display(), n - 1),
        };
        let total: usize = files.iter().map(|f| f.tokens).sum();
        format!("{name} ({total} tokens)")
    }

    /// Every file read, for the plan's digests: (key, path).
    pub fn inputs(&self) -> Vec<(&'static str, PathBuf)> {
        let mut v: Vec<(&'static str, PathBuf)> =
            self.train.files.iter().map(|f| ("load.path", f.path.clone())).collect();
        if self.validation.files != self.train.files {
            v.extend(self.validation.files.iter().map(|f| ("load.validation_path", f.path.clone())));
        }
        v
    }
}

/// The files `load.path` names: one, a list, or a glob, relative to `base`, in sorted order for a
/// glob. Each must be a regular file.
pub fn resolve_paths(paths: &crate::config::schema::Paths, base: &Path) -> Result<Vec<PathBuf>, String> {
    use crate::config::schema::Paths;
    let given: Vec<PathBuf> = match paths {
        Paths::One(p) => vec![p.clone()],
        Paths::Many(v) if v.is_empty() => return Err("is an empty list: name at least one file".into()),
        Paths::Many(v) => v.clone(),
    };
    let mut out = Vec::new();
    for rel in given {
        let full = base.join(&rel);
        let text = full.to_string_lossy();
        if text.contains(['*', '?', '[']) {
            let mut found: Vec<PathBuf> = glob::glob(&text)
                .map_err(|e| format!("{text} is not a valid glob: {e}"))?
                .filter_map(Result::ok)
                .collect();
            if found.is_empty() {
                return Err(format!("{text} matches no file (paths are relative to the pipeline file)"));
            }
            found.sort();
            out.extend(found);
        } else {
            out.push(full);
        }
    }
    for p in &out {
        if !p.exists() {
            return Err(format!("{} does not exist (paths are relative to the pipeline file)", p.display()));
        }
        crate::input::regular_file(p)?;
    }
    Ok(out)
}

/// Opens a token file: its id width and count (checked against its size).
fn open(path: &Path, source: Source) -> Result<TokenFile, String> {
    let p = path.display();
    let bytes = std::fs::metadata(path).map_err(|e| format!("cannot read {p}: {e}"))?.len();
    if source == Source::Text {
        return Ok(TokenFile { path: path.to_owned(), dtype: Dtype::U8, offset: 0, tokens: bytes as usize });
    }
    match path.extension().and_then(|e| e.to_str()) {
        Some("bin") => {
            if bytes % 2 != 0 {
                return Err(format!("{p} has {bytes} bytes, not a whole number of little-endian uint16 token ids"));
            }
            Ok(TokenFile { path: path.to_owned(), dtype: Dtype::U16, offset: 0, tokens: (bytes / 2) as usize })
        }
        Some("npy") => {
            let a = Npy::open(path)?;
            if a.shape.len() != 1 {
                return Err(format!("{p} holds an array of shape {:?}; token ids are a 1-D array", a.shape));
            }
            if !a.dtype.is_integer() {
                return Err(format!("{p} holds {:?} values; token ids must be integers", a.dtype).to_lowercase());
            }
            Ok(TokenFile { path: path.to_owned(), dtype: a.dtype, offset: a.offset, tokens: a.shape[0] })
        }
        _ => {
            Err(format!("{p}: token ids are read from a .npy file or a .bin file of little-endian uint16 (nanoGPT's)"))
        }
    }
}

/// Ids per chunk of the plan's scan: 4 Mi ids at a time (the scan's memory does not grow with the file).
const SCAN_CHUNK: usize = 1 << 22;

/// Scans a file once, in chunks: every id must be below `vocab` (and not negative); a text file
/// must be UTF-8. Fast in any build: each chunk is checked by libtorch reductions over the ids in
/// their own width, on one thread (the scan is bound by memory, and a team of threads spinning
/// at each reduction's barrier only slows it on a busy machine).
fn scan(f: &TokenFile, source: Source, vocab: usize) -> Result<(), String> {
    let threads = tch::get_num_threads();
    tch::set_num_threads(1);
    let result = scan_chunks(f, source, vocab);
    tch::set_num_threads(threads);
    result
}

fn scan_chunks(f: &TokenFile, source: Source, vocab: usize) -> Result<(), String> {
    let file = File::open(&f.path).map_err(|e| format!("cannot read {}: {e}", f.path.display()))?;
    let size = f.dtype.size();
    let mut carry: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; SCAN_CHUNK * size];
    let mut at = 0usize;
    while at < f.tokens {
        let n = SCAN_CHUNK.min(f.tokens - at);
        let buf = &mut buf[..n * size];
        file.read_exact_at(buf, f.offset + (at * size) as u64)
            .map_err(|e| format!("cannot read {}: {e}", f.path.display()))?;
        if source == Source::Text {
            carry.extend_from_slice(buf);
            let valid = match std::str::from_utf8(&carry) {
                Ok(_) => carry.len(),
                // An incomplete character at the chunk's end continues in the next one.
                Err(e) if e.error_len().is_none() && at + n < f.tokens => e.valid_up_to(),
                Err(e) => {
                    return Err(format!(
                    "{} is not UTF-8 text (invalid byte at offset {}); a file of token ids needs source = \"tokens\"",
                    f.path.display(),
                    at + n - carry.len() + e.valid_up_to()
                ))
                }
            };
            carry.drain(..valid);
        }
        if let Some(i) = first_bad_id(buf, f.dtype, vocab)? {
            let id = f.dtype.get_i128(buf, i);
            let position = at + i;
            if id < 0 {
                return Err(format!("{}: token id at position {position} is negative, not an id", f.path.display()));
            }
            return Err(format!(
                "{} holds token id {id} (at position {position}), but wrap.model.vocab is {vocab}: every id must be below it",
                f.path.display()
            ));
        }
        at += n;
    }
    Ok(())
}

/// The position of the first id in `bytes` that is negative or not below `vocab`, if any. The ids
/// stay in their width, and the common case is two vectorised reductions (minimum, maximum):
/// unsigned ids are read through the signed kind of the same width with the sign bit flipped,
/// which keeps their order.
fn first_bad_id(bytes: &[u8], dtype: Dtype, vocab: usize) -> Result<Option<usize>, String> {
    let n = (bytes.len() / dtype.size()) as i64;
    let (kind, unsigned_bits) = match dtype {
        Dtype::U8 | Dtype::Bool => (Kind::Uint8, None),
        Dtype::I8 => (Kind::Int8, None),
        Dtype::U16 => (Kind::Int16, Some(16)),
        Dtype::I16 => (Kind::Int16, None),
        Dtype::U32 => (Kind::Int, Some(32)),
        Dtype::I32 => (Kind::Int, None),
        Dtype::I64 => (Kind::Int64, None),
        Dtype::U64 => (Kind::Int64, Some(64)),
        Dtype::F32 | Dtype::F64 => unreachable!("float token files are refused when opened"),
    };
    let raw = crate::checked::tensor(bytes, &[n], kind)?;
    // In the flipped order an unsigned id v is v - 2^(bits-1): the lowest allowed is -2^(bits-1).
    let (t, lowest, limit) = match unsigned_bits {
        Some(bits) => {
            let half = 1i128 << (bits - 1);
            (raw.bitwise_xor(i64::MIN >> (64 - bits)), -half, vocab as i128 - half)
        }
        None => (raw, 0, vocab as i128),
    };
    let (min, max) = (t.min().int64_value(&[]) as i128, t.max().int64_value(&[]) as i128);
    if min >= lowest && max < limit {
        return Ok(None);
    }
    let bad = t.lt(lowest as i64).logical_or(&t.ge(limit.min(i64::MAX as i128) as i64));
    Ok(Some(bad.nonzero().int64_value(&[0, 0]) as usize))
}

/// The files `paths`, opened and scanned (every id below `vocab`), as one stream; the first
/// problem found is the error.
pub fn scanned_stream(paths: &[PathBuf], source: Source, vocab: usize) -> Result<Stream, String> {
    let mut problem = None;
    let stream = stream("", paths, source, vocab, &mut |_: &str, e: String| problem = Some(e));
    stream.ok_or_else(|| problem.unwrap_or_default())
}

/// The files of `key`, opened and scanned, as one stream.
fn stream(
    key: &str,
    paths: &[PathBuf],
    source: Source,
    vocab: usize,
    bad: &mut impl FnMut(&str, String),
) -> Option<Stream> {
    let mut files = Vec::new();
    for p in paths {
        match open(p, source).and_then(|f| scan(&f, source, vocab).map(|()| f)) {
            Ok(f) => files.push(f),
            Err(e) => {
                bad(key, e);
                return None;
            }
        }
    }
    let len = files.iter().map(|f| f.tokens).sum();
    Some(Stream { files, start: 0, len })
}
#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    fn windows_of(paths: &[PathBuf], source: Source, seq_len: usize) -> Result<Windows, String> {
        let mut noop = |_: &str, e: String| panic!("{e}");
        let s = stream("load.path", paths, source, 70_000, &mut noop).unwrap();
        let count = s.windows(seq_len);
        Windows::open(&s, seq_len, count)
    }

    #[test]
    fn npy_bin_and_text_files_give_the_same_ids() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<i64> = vec![0, 5, 65535, 7];
        Tensor::from_slice(&ids).write_npy(dir.path().join("t.npy")).unwrap();
        let bin: Vec<u8> = ids.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect();
        std::fs::write(dir.path().join("t.bin"), bin).unwrap();
        for f in ["t.npy", "t.bin"] {
            let w = windows_of(&[dir.path().join(f)], Source::Tokens, 3).unwrap();
            assert_eq!(w.read(0, 4).unwrap(), ids, "{f}");
        }
        std::fs::write(dir.path().join("t.txt"), "héllo").unwrap();
        let w = windows_of(&[dir.path().join("t.txt")], Source::Text, 2).unwrap();
        assert_eq!(w.read(0, 6).unwrap(), [104, 195, 169, 108, 108, 111]);
    }

    #[test]
    fn bad_ids_and_bad_text_are_refused_with_their_position() {
        let dir = tempfile::tempdir().unwrap();
        let check = |name: &str, source, vocab| {
            let f = open(&dir.path().join(name), source).and_then(|f| scan(&f, source, vocab));
            f.unwrap_err()
        };
        Tensor::from_slice(&[1i64, -2]).write_npy(dir.path().join("neg.npy")).unwrap();
        assert!(check("neg.npy", Source::Tokens, 10).ends_with("token id at position 1 is negative, not an id"));
        std::fs::write(dir.path().join("big.bin"), [1u8, 0, 9, 0]).unwrap();
        assert!(
            check("big.bin", Source::Tokens, 5).contains("holds token id 9 (at position 1), but wrap.model.vocab is 5")
        );
        std::fs::write(dir.path().join("bad.txt"), [b'a', 0xff]).unwrap();
        assert!(check("bad.txt", Source::Text, 256).contains("not UTF-8 text (invalid byte at offset 1)"));
        // GPT-2's vocabulary is past int16's range: ids of 32768 and more are valid below it.
        let gpt2: Vec<u8> = [40000u16, 50256, 50257].iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.path().join("gpt2.bin"), gpt2).unwrap();
        assert!(check("gpt2.bin", Source::Tokens, 50257).contains("holds token id 50257 (at position 2)"));
        assert!(open(&dir.path().join("gpt2.bin"), Source::Tokens)
            .and_then(|f| scan(&f, Source::Tokens, 50258))
            .is_ok());
        std::fs::write(dir.path().join("odd.bin"), [1u8, 0, 9]).unwrap();
        assert!(check("odd.bin", Source::Tokens, 256).contains("not a whole number of little-endian uint16"));
        Tensor::from_slice(&[1.0f32]).write_npy(dir.path().join("f.npy")).unwrap();
        assert!(check("f.npy", Source::Tokens, 256).contains("token ids must be integers"));
    }

    #[test]
    fn a_stream_over_several_files_reads_across_their_boundaries() {
        let dir = tempfile::tempdir().unwrap();
        let all: Vec<u16> = (0..100).collect();
        let mut paths = Vec::new();
        for (i, part) in all.chunks(33).enumerate() {
            let p = dir.path().join(format!("part-{i}.bin"));
            std::fs::write(&p, part.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
            paths.push(p);
        }
        let w = windows_of(&paths, Source::Tokens, 8).unwrap();
        assert_eq!(w.count, 99 / 8);
        let (x, y) = w.gather(&[3, 4]).unwrap();
        let want: Vec<i64> = (24..40).collect();
        assert_eq!(Vec::<i64>::try_from(x.reshape([-1])).unwrap(), want);
        assert!(x.narrow(1, 1, 7).equal(&y.narrow(1, 0, 7)));
        let (a, _) = w.random_step(1, 3, 0..5).unwrap();
        let (b, _) = w.random_step(1, 3, 0..5).unwrap();
        let (c, _) = w.random_step(1, 4, 0..5).unwrap();
        assert!(a.equal(&b) && !a.equal(&c));
        // A step's windows are a function of the sample's index in the global batch, whoever
        // draws them: two ranks' halves are the whole batch's.
        let (lo, _) = w.random_step(1, 3, 0..2).unwrap();
        let (hi, _) = w.random_step(1, 3, 2..5).unwrap();
        assert!(tch::Tensor::cat(&[lo, hi], 0).equal(&a));
        // Random windows are consecutive tokens of the stream.
        let d = a.narrow(1, 1, 7) - a.narrow(1, 0, 7);
        assert!(d.eq(1).all().int64_value(&[]) == 1);
    }

    #[test]
    fn synthetic_windows_overlap_by_one_token_and_targets_are_the_next_tokens() {
        let (x, y) = synthetic_windows(50, 0.1, 5, 4, 1);
        assert_eq!(x.size(), [4, 5]);
        assert!(x.narrow(1, 1, 4).equal(&y.narrow(1, 0, 4)));
        assert!(y.narrow(0, 0, 3).select(1, 4).equal(&x.narrow(0, 1, 3).select(1, 0)));
        assert!(x.max().int64_value(&[]) < 50);
    }
}
