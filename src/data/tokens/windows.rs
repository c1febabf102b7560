//! A rank's view of a token stream: the files open, windows read where they lie, random
//! windows drawn, synthetic windows made.
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;

use tch::Tensor;

use super::{Stream, TokenFile};
use crate::rng::Rng;

#[derive(Debug)]
pub struct Windows {
    files: Vec<(TokenFile, File)>,
    /// Each file's first token in the concatenation.
    starts: Vec<usize>,
    stream: Stream,
    seq_len: usize,
    /// Windows at stride seq_len (the sampler's rows).
    pub count: usize,
}

impl Windows {
    pub fn open(stream: &Stream, seq_len: usize, count: usize) -> Result<Windows, String> {
        let mut files = Vec::new();
        let mut starts = Vec::new();
        let mut at = 0;
        for f in &stream.files {
            let handle = File::open(&f.path).map_err(|e| format!("cannot read {}: {e}", f.path.display()))?;
            files.push((f.clone(), handle));
            starts.push(at);
            at += f.tokens;
        }
        Ok(Windows { files, starts, stream: stream.clone(), seq_len, count })
    }

    /// Tokens `from .. from + len` of the stream, as int64 ids.
    pub(super) fn read(&self, from: usize, len: usize) -> Result<Vec<i64>, String> {
        let mut out = Vec::with_capacity(len);
        let (mut at, end) = (self.stream.start + from, self.stream.start + from + len);
        while at < end {
            let i = self.starts.partition_point(|&s| s <= at) - 1;
            let (f, handle) = &self.files[i];
            let n = (end - at).min(self.starts[i] + f.tokens - at);
            let size = f.dtype.size();
            let mut buf = vec![0u8; n * size];
            handle
                .read_exact_at(&mut buf, f.offset + ((at - self.starts[i]) * size) as u64)
                .map_err(|e| format!("cannot read {} (was it changed since the plan?): {e}", f.path.display()))?;
            out.extend((0..n).map(|k| f.dtype.get_i128(&buf, k) as i64));
            at += n;
        }
        Ok(out)
    }

    /// Inputs and targets (int64, n × seq_len) of the windows starting at token `offsets`.
    pub fn at_offsets(&self, offsets: &[usize]) -> Result<(Tensor, Tensor), String> {
        let t = self.seq_len;
        let mut ids = Vec::with_capacity(offsets.len() * (t + 1));
        for &o in offsets {
            ids.extend(self.read(o, t + 1)?);
        }
        let all = Tensor::from_slice(&ids).view([offsets.len() as i64, t as i64 + 1]);
        Ok((all.narrow(1, 0, t as i64).contiguous(), all.narrow(1, 1, t as i64).contiguous()))
    }

    /// The fixed windows `idx` (window i starts at token i · seq_len).
    pub fn gather(&self, idx: &[i64]) -> Result<(Tensor, Tensor), String> {
        let offsets: Vec<usize> = idx.iter().map(|&i| i as usize * self.seq_len).collect();
        self.at_offsets(&offsets)
    }

    /// `n` windows at uniformly random token offsets, from a generator seeded by `(seed, stream)`.
    pub fn random(&self, n: usize, seed: u64, stream: u64) -> Result<(Tensor, Tensor), String> {
        let mut rng = Rng::new(seed, stream);
        let span = (self.stream.len - self.seq_len) as u64;
        let offsets: Vec<usize> = (0..n).map(|_| rng.below(span) as usize).collect();
        self.at_offsets(&offsets)
    }

    /// The windows of samples `samples` (indices in the global batch) of optimizer step `step`,
    /// each at a uniformly random token offset drawn from `(seed, step, sample)` alone: a step
    /// covers the same windows whichever ranks, copies and micro-batches share its global batch,
    /// so a run resumed at another world size keeping the global batch draws the same ones.
    pub fn random_step(&self, seed: u64, step: u64, samples: Range<u64>) -> Result<(Tensor, Tensor), String> {
        let span = (self.stream.len - self.seq_len) as u64;
        let offsets: Vec<usize> =
            samples.map(|i| Rng::new(seed, sample_stream(step, i)).below(span) as usize).collect();
        self.at_offsets(&offsets)
    }
}

/// The generator stream of sample `sample` of the global batch of optimizer step `step`: one
/// stream per pair (steps and samples below 2^32 each).
pub fn sample_stream(step: u64, sample: u64) -> u64 {
    0x7A4D_0000_0000_0000 ^ (step << 32) ^ (sample & 0xFFFF_FFFF)
}

/// The generator stream of the fixed random validation windows.
pub const VALIDATION_STREAM: u64 = 0x7A4D_5641_4C00;

/// Inputs and targets (int64, N × seq_len) of `n` synthetic windows (a Markov chain from `seed`).
pub fn synthetic_windows(vocab: usize, noise: f64, seq_len: usize, n: usize, seed: u64) -> (Tensor, Tensor) {
    let stream = synthetic(vocab, noise, seed, n * seq_len + 1);
    let all = Tensor::from_slice(&stream);
    // Window i: tokens i·t .. i·t + t + 1, as strided views of one stream.
    let (n, t) = (n as i64, seq_len as i64);
    (all.narrow(0, 0, n * t).view([n, t]), all.narrow(0, 1, n * t).view([n, t]))
}

/// `len` tokens of a random Markov chain over the vocabulary: each token is followed by one of
/// its four successors (drawn once from the seed), or, with probability `noise`, by any token.
fn synthetic(vocab: usize, noise: f64, seed: u64, len: usize) -> Vec<i64> {
    let vocab = vocab as u64;
    let mut rng = Rng::new(seed, 0x70CE_0000);
    let successors: Vec<[u64; 4]> = (0..vocab).map(|_| std::array::from_fn(|_| rng.below(vocab))).collect();
    let mut token = rng.below(vocab);
    (0..len)
        .map(|_| {
            let current = token;
            token = if rng.uniform() < noise {
                rng.below(vocab)
            } else {
                successors[token as usize][rng.below(4) as usize]
            };
            current as i64
        })
        .collect()
}
