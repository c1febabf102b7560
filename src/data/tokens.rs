//! Data for a language model: a stream of token ids cut into windows of `seq_len` + 1 tokens
//! (window i starts at token i · seq_len; its first seq_len tokens are the input, its last
//! seq_len the targets, so consecutive windows share one token). The stream comes from a file of
//! token ids (`load.source = "tokens"`: a 1-D `.npy` of integers, or the raw little-endian uint16
//! `.bin` nanoGPT writes), from any UTF-8 file read as bytes (`"text"`, ids 0..256), or from the
//! synthetic source's token mode (a random Markov chain over the vocabulary, for tests).
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::{DataSpec, Task};
use crate::config::schema::{Load, Source, Transformer};
use crate::rng::Rng;

/// What the plan knows of a token file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenFile {
    pub path: PathBuf,
    /// Token ids in the file.
    pub tokens: usize,
}

/// The token ids of a file of `source` ("tokens" or "text").
pub fn read(path: &Path, source: Source) -> Result<Vec<u32>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if source == Source::Text {
        if let Err(e) = std::str::from_utf8(&bytes) {
            return Err(format!(
                "{} is not UTF-8 text (invalid byte at offset {}); a file of token ids needs source = \"tokens\"",
                path.display(),
                e.valid_up_to()
            ));
        }
        return Ok(bytes.into_iter().map(u32::from).collect());
    }
    match path.extension().and_then(|e| e.to_str()) {
        Some("bin") => {
            if bytes.len() % 2 != 0 {
                return Err(format!(
                    "{} has {} bytes, not a whole number of little-endian uint16 token ids",
                    path.display(),
                    bytes.len()
                ));
            }
            Ok(bytes.chunks_exact(2).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]]))).collect())
        }
        Some("npy") => npy(&bytes).map_err(|e| format!("{}: {e}", path.display())),
        _ => Err(format!(
            "{}: token ids are read from a .npy file or a .bin file of little-endian uint16 (nanoGPT's)",
            path.display()
        )),
    }
}

/// The ids of a 1-D, C-order `.npy` array of unsigned or non-negative integers.
fn npy(bytes: &[u8]) -> Result<Vec<u32>, String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy file".into());
    }
    let (header_len, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        _ if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        _ => return Err("not a .npy file".into()),
    };
    let header = bytes
        .get(start..start + header_len)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or("a damaged .npy header")?;
    let field = |key: &str| -> Option<&str> {
        let rest = &header[header.find(&format!("'{key}'"))? + key.len() + 2..];
        Some(rest.trim_start_matches([':', ' ']))
    };
    let descr = field("descr").and_then(|r| r.split('\'').nth(1)).ok_or("no dtype in the .npy header")?;
    if field("fortran_order").is_some_and(|r| r.starts_with("True")) {
        return Err("a Fortran-order array; save it in C order".into());
    }
    let shape = field("shape").and_then(|r| r.split(')').next()).ok_or("no shape in the .npy header")?;
    let dims: Vec<&str> = shape.trim_start_matches('(').split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
    if dims.len() != 1 {
        return Err(format!("an array of shape ({shape}); token ids are a 1-D array"));
    }
    let data = &bytes[start + header_len..];
    let size = match descr {
        "|u1" | "<u1" | "|i1" => 1,
        "<u2" | "<i2" => 2,
        "<u4" | "<i4" => 4,
        "<u8" | "<i8" => 8,
        other => return Err(format!("dtype {other}: token ids must be little-endian integers")),
    };
    let signed = descr.contains('i');
    let mut ids = Vec::with_capacity(data.len() / size);
    for (i, c) in data.chunks_exact(size).enumerate() {
        let mut b = [0u8; 8];
        b[..size].copy_from_slice(c);
        let negative = signed && c[size - 1] & 0x80 != 0;
        let v = u64::from_le_bytes(b);
        if negative || v > u32::MAX as u64 {
            return Err(format!(
                "token id at position {i} is {}, not an id",
                if negative { "negative" } else { "huge" }
            ));
        }
        ids.push(v as u32);
    }
    Ok(ids)
}

/// The plan's view of a language model's data: windows of `t.seq_len` + 1 tokens of the file
/// `load.path` (or synthetic ones), every id checked to be below `t.vocab`.
pub fn spec(load: &Load, t: &Transformer, base: &Path, bad: &mut impl FnMut(&str, String)) -> Option<DataSpec> {
    for (key, given) in [("load.features", load.features.is_some()), ("load.classes", load.classes.is_some())] {
        if given {
            bad(
                key,
                "is not read by a language model: its inputs are wrap.model.seq_len token ids over wrap.model.vocab"
                    .into(),
            );
        }
    }
    if load.target.is_some() {
        bad("load.target", "is not read by a language model: the targets are the next tokens".into());
    }
    let task = Task::LanguageModel { vocab: t.vocab };
    let spec = |rows: usize, validation_rows: usize, file: Option<TokenFile>| DataSpec {
        source: load.source,
        rows,
        validation_rows,
        input: vec![t.seq_len],
        task,
        noise: if file.is_none() { load.noise } else { 0.0 },
        file: None,
        tokens: file,
        tensors: None,
    };
    if load.source == Source::Synthetic {
        if load.path.is_some() {
            bad("load.path", "is only read by source = \"csv\", \"parquet\", \"tokens\" or \"text\"".into());
        }
        if !(0.0..=1.0).contains(&load.noise) {
            bad("load.noise", format!("is the chance of a random next token in [0, 1], got {}", load.noise));
        }
        return Some(spec(load.rows.unwrap_or(10_000), load.validation_rows, None));
    }
    let source = if load.source == Source::Text { "text" } else { "tokens" };
    let Some(rel) = &load.path else {
        bad("load.path", format!("source = \"{source}\" needs a path to the file"));
        return None;
    };
    if load.noise != Load::default().noise {
        bad("load.noise", "is only read by source = \"synthetic\"".into());
    }
    let path = base.join(rel);
    if !path.exists() {
        bad("load.path", format!("{} does not exist (paths are relative to the pipeline file)", path.display()));
        return None;
    }
    if let Err(e) = crate::input::regular_file(&path) {
        bad("load.path", e);
        return None;
    }
    let ids = match read(&path, load.source) {
        Ok(ids) => ids,
        Err(e) => {
            bad("load.path", e);
            return None;
        }
    };
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= t.vocab) {
        bad(
            "load.path",
            format!(
                "{} holds token id {id} (at position {i}), but wrap.model.vocab is {}: every id must be below it",
                path.display(),
                t.vocab
            ),
        );
        return None;
    }
    if ids.len() < t.seq_len + 1 {
        bad(
            "wrap.model.seq_len",
            format!(
                "{} is longer than the data: {} holds {} tokens, and one window needs seq_len + 1 = {}",
                t.seq_len,
                path.display(),
                ids.len(),
                t.seq_len + 1
            ),
        );
        return None;
    }
    let windows = (ids.len() - 1) / t.seq_len;
    if let Some(rows) = load.rows.filter(|r| *r > windows) {
        bad(
            "load.rows",
            format!(
                "asks for {rows} windows but {} holds {windows} of seq_len + 1 = {} tokens",
                path.display(),
                t.seq_len + 1
            ),
        );
    }
    let total = load.rows.unwrap_or(windows).min(windows);
    if load.validation_rows >= total {
        bad(
            "load.validation_rows",
            format!(
                "{} leaves no training windows out of {total} (of {} tokens each)",
                load.validation_rows,
                t.seq_len + 1
            ),
        );
        return None;
    }
    Some(spec(total - load.validation_rows, load.validation_rows, Some(TokenFile { path, tokens: ids.len() })))
}

/// Inputs and targets (int64, N × seq_len) of the plan's N = rows + validation_rows windows.
pub fn windows(d: &DataSpec, seed: u64) -> Result<(Tensor, Tensor), String> {
    let t = d.input[0];
    let n = d.rows + d.validation_rows;
    let stream: Vec<i64> = match &d.tokens {
        Some(f) => read(&f.path, d.source)?.into_iter().take(n * t + 1).map(i64::from).collect(),
        None => synthetic(d, seed, n * t + 1),
    };
    if stream.len() < n * t + 1 {
        return Err(format!("the token data holds {} tokens; the plan needs {}", stream.len(), n * t + 1));
    }
    let all = Tensor::from_slice(&stream);
    // Window i: tokens i·t .. i·t + t + 1, as strided views of one stream.
    let x = all.narrow(0, 0, (n * t) as i64).view([n as i64, t as i64]);
    let y = all.narrow(0, 1, (n * t) as i64).view([n as i64, t as i64]);
    Ok((x, y))
}

/// `len` tokens of a random Markov chain over the vocabulary: each token is followed by one of
/// its four successors (drawn once from the seed), or, with probability `noise`, by any token.
fn synthetic(d: &DataSpec, seed: u64, len: usize) -> Vec<i64> {
    let vocab = d.task.outputs() as u64;
    let mut rng = Rng::new(seed, 0x70CE_0000);
    let successors: Vec<[u64; 4]> = (0..vocab).map(|_| std::array::from_fn(|_| rng.below(vocab))).collect();
    let mut token = rng.below(vocab);
    (0..len)
        .map(|_| {
            let current = token;
            token = if rng.uniform() < d.noise {
                rng.below(vocab)
            } else {
                successors[token as usize][rng.below(4) as usize]
            };
            current as i64
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_and_bin_files_give_the_same_ids() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<i64> = vec![0, 5, 65535, 7];
        Tensor::from_slice(&ids).write_npy(dir.path().join("t.npy")).unwrap();
        let bin: Vec<u8> = ids.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect();
        std::fs::write(dir.path().join("t.bin"), bin).unwrap();
        let want: Vec<u32> = vec![0, 5, 65535, 7];
        assert_eq!(read(&dir.path().join("t.npy"), Source::Tokens).unwrap(), want);
        assert_eq!(read(&dir.path().join("t.bin"), Source::Tokens).unwrap(), want);
        Tensor::from_slice(&[1i64, -2]).write_npy(dir.path().join("neg.npy")).unwrap();
        let err = read(&dir.path().join("neg.npy"), Source::Tokens).unwrap_err();
        assert!(err.ends_with("token id at position 1 is negative, not an id"), "{err}");
        std::fs::write(dir.path().join("t.txt"), "héllo").unwrap();
        assert_eq!(read(&dir.path().join("t.txt"), Source::Text).unwrap(), [104, 195, 169, 108, 108, 111]);
        std::fs::write(dir.path().join("bad.txt"), [b'a', 0xff]).unwrap();
        assert!(read(&dir.path().join("bad.txt"), Source::Text)
            .unwrap_err()
            .contains("not UTF-8 text (invalid byte at offset 1)"));
    }

    #[test]
    fn windows_overlap_by_one_token_and_targets_are_the_next_tokens() {
        let d = DataSpec {
            source: Source::Synthetic,
            rows: 3,
            validation_rows: 1,
            input: vec![5],
            task: Task::LanguageModel { vocab: 50 },
            noise: 0.1,
            file: None,
            tokens: None,
            tensors: None,
        };
        let (x, y) = windows(&d, 1).unwrap();
        assert_eq!(x.size(), [4, 5]);
        assert!(x.narrow(1, 1, 4).equal(&y.narrow(1, 0, 4)));
        assert!(y.narrow(0, 0, 3).select(1, 4).equal(&x.narrow(0, 1, 3).select(1, 0)));
        assert!(x.max().int64_value(&[]) < 50);
    }
}
