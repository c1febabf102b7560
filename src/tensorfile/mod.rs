//! `.safetensors` files, every one the runner reads or writes (checkpoints' tensor files,
//! `model.safetensors`, `wrap.init`, the tensors source), with the `safetensors` crate's header
//! type. Files are written as the crate writes them, with direct I/O ([`write`]). A file is
//! opened by its header alone and each tensor is read at its own byte range, so a reader holds
//! one tensor at a time, never the whole file. Nothing in a header is trusted: the entries must tile the data exactly (the crate's own rule, checked
//! here because the crate checks it only over a whole file in memory).
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{Dtype, Metadata, TensorInfo};
use tch::{Kind, Tensor};

mod direct;
mod write;

pub use write::{sort_for_layout, write, Entry};

/// The largest header read: real ones are a few kB per hundred tensors (the crate's own bound).
const MAX_HEADER: u64 = 100_000_000;

/// Bytes of tensor data this process has read from `.safetensors` files (headers left out).
static DATA_READ: AtomicU64 = AtomicU64::new(0);

/// Bytes of tensor data this process has read from `.safetensors` files so far: what a rank
/// read of a checkpoint or of `wrap.init` (the tests hold it to the rank's share).
pub fn data_read() -> u64 {
    DATA_READ.load(Ordering::Relaxed)
}

/// The format's element type of a tensor kind (`None`: the format has none).
pub fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Bool => Dtype::BOOL,
        Kind::Uint8 => Dtype::U8,
        Kind::Int8 => Dtype::I8,
        Kind::Int16 => Dtype::I16,
        Kind::Int => Dtype::I32,
        Kind::Int64 => Dtype::I64,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Float => Dtype::F32,
        Kind::Double => Dtype::F64,
        _ => return None,
    })
}

/// The tensor kind of a format's element type (`None`: libtorch has no such kind: U16, U32, U64).
pub fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::BOOL => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        _ => return None,
    })
}

/// A tensor's bytes as the format stores them (little-endian, C order), from any device.
pub fn bytes_of(t: &Tensor) -> Vec<u8> {
    bytes_into(t, Vec::new())
}

/// [`bytes_of`] into `out`, whose memory is reused where it is the size already (a buffer
/// written before costs no new pages: a page fault each is what a fresh one of gigabytes costs).
pub fn bytes_into(t: &Tensor, mut out: Vec<u8>) -> Vec<u8> {
    let t = t.to_device(tch::Device::Cpu).contiguous();
    let numel = t.numel();
    out.resize(numel * t.kind().elt_size_in_bytes(), 0);
    t.copy_data_u8(&mut out, numel);
    out
}

/// An open `.safetensors` file whose header was read and checked.
pub struct TensorFile {
    file: File,
    path: PathBuf,
    /// Where the data starts (8 + the header's length).
    data_start: u64,
    /// The header's entries by name, built once: the crate's `Metadata::tensors` builds a new map
    /// of every name at each call, which made looking up each of a file's N tensors cost N².
    tensors: HashMap<String, TensorInfo>,
    metadata: Option<HashMap<String, String>>,
}

impl TensorFile {
    /// Reads and checks `path`'s header. Errors say what is wrong, without the path (the caller
    /// names the file as its reader knows it).
    pub fn open(path: &Path) -> Result<TensorFile, String> {
        let file = File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
        let len = file.metadata().map_err(|e| format!("cannot read it: {e}"))?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0).map_err(|_| "not a .safetensors file (shorter than 8 bytes)".to_owned())?;
        let header_len = u64::from_le_bytes(n);
        if header_len > MAX_HEADER || header_len > len - 8 {
            return Err(format!(
                "the header claims {header_len} bytes, the file has {len}: it is truncated or not a .safetensors file"
            ));
        }
        let mut text = vec![0u8; header_len as usize];
        file.read_exact_at(&mut text, 8).map_err(|e| format!("cannot read it: {e}"))?;
        if text.first() != Some(&b'{') {
            return Err("its header is not the JSON of a .safetensors file".into());
        }
        let header: Metadata = serde_json::from_slice(&text)
            .map_err(|e| format!("its header is not the JSON of a .safetensors file ({e})"))?;
        let tensors = header.tensors().into_iter().map(|(name, info)| (name, info.clone())).collect();
        let metadata = header.metadata().clone();
        let f = TensorFile { file, path: path.to_owned(), data_start: 8 + header_len, tensors, metadata };
        f.check_tiling(len - 8 - header_len)?;
        Ok(f)
    }

    /// The entries, by offset, must cover the `data_len` bytes of data exactly, each as long as
    /// its shape and element type say.
    fn check_tiling(&self, data_len: u64) -> Result<(), String> {
        let mut at = 0u64;
        for (name, info) in self.entries() {
            let (start, end) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
            let want = info
                .shape
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
                .and_then(|n| n.checked_mul(info.dtype.size() as u64));
            if start != at || want != Some(end.wrapping_sub(start)) || end > data_len {
                return Err(format!(
                    "`{name}` claims bytes {start}..{end} for shape {:?} of {:?} ({} bytes), the data holds {data_len} \
                     bytes: it is truncated or its header lies",
                    info.shape,
                    info.dtype,
                    want.map_or("too many".to_owned(), |w| w.to_string())
                ));
            }
            at = end;
        }
        if at != data_len {
            return Err(format!(
                "its entries cover {at} bytes of data, the file holds {data_len}: it is truncated or its header lies"
            ));
        }
        Ok(())
    }

    /// The entries in the order of their bytes in the file.
    pub fn entries(&self) -> Vec<(String, &TensorInfo)> {
        let mut v: Vec<(String, &TensorInfo)> = self.tensors.iter().map(|(name, info)| (name.clone(), info)).collect();
        v.sort_by_key(|(_, info)| info.data_offsets);
        v
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The header's `__metadata__` (string → string).
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.metadata.as_ref()
    }

    /// Where `name`'s bytes lie in the file (from its first byte).
    pub fn range(&self, name: &str) -> Option<Range<u64>> {
        let (s, e) = self.info(name)?.data_offsets;
        Some(self.data_start + s as u64..self.data_start + e as u64)
    }

    /// The bytes of `name`, refused when larger than `limit`.
    pub fn bytes(&self, name: &str, limit: u64) -> Result<Vec<u8>, String> {
        let range = self.range(name).ok_or_else(|| format!("it holds no `{name}`"))?;
        self.read_range(range, limit).map_err(|e| format!("`{name}`: {e}"))
    }

    /// Bytes `range` of the file, refused when longer than `limit`.
    pub fn read_range(&self, range: Range<u64>, limit: u64) -> Result<Vec<u8>, String> {
        let n = range.end.saturating_sub(range.start);
        if n > limit {
            return Err(format!("{n} bytes, larger than any tensor it may hold ({limit} bytes)"));
        }
        let mut out = vec![0u8; n as usize];
        self.read_into(&mut out, range.start)?;
        Ok(out)
    }

    /// Fills `out` from byte `at` of the file.
    pub fn read_into(&self, out: &mut [u8], at: u64) -> Result<(), String> {
        self.file.read_exact_at(out, at).map_err(|e| format!("cannot read it: {e}"))?;
        DATA_READ.fetch_add(out.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Rows `rows` (dim 0; a 0-dimensional tensor is one row) of `name`, in its own element
    /// type: only those rows' bytes are read, so a rank takes its share of a tensor (its FSDP
    /// shard of a parameter) without the whole ever being in memory. The bytes are read with
    /// `pread` into memory of this process's own, not mapped: a mapped file's pages would count
    /// in the process's resident size for as long as they stay mapped.
    pub fn rows(&self, name: &str, rows: Range<i64>) -> Result<Tensor, String> {
        let info = self.info(name).ok_or_else(|| format!("it holds no `{name}`"))?;
        let kind = kind_of(info.dtype).ok_or_else(|| format!("`{name}` holds {:?} values", info.dtype))?;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        let (row_shape, skip, want) = row_bytes(&shape, kind, &rows).map_err(|e| format!("`{name}`: {e}"))?;
        let start = self.range(name).expect("an entry has a range").start + skip;
        let mut bytes = vec![0u8; want as usize];
        self.read_into(&mut bytes, start).map_err(|e| format!("`{name}`: {e}"))?;
        crate::checked::tensor(&bytes, &row_shape, kind).map_err(|e| format!("`{name}`: {e}"))
    }

    /// `count` runs of `len` bytes, `stride` bytes apart, the first at byte `start` of the file
    /// (a block of columns of a matrix), in one buffer: only those bytes are read.
    pub fn read_strided(&self, start: u64, stride: u64, len: u64, count: u64) -> Result<Vec<u8>, String> {
        let mut out = vec![0u8; (len * count) as usize];
        if len > 0 {
            for (i, run) in out.chunks_mut(len as usize).enumerate() {
                self.read_into(run, start + i as u64 * stride)?;
            }
        }
        Ok(out)
    }

    /// `name` as a tensor, refused when larger than `limit` bytes or of a type libtorch lacks.
    pub fn tensor(&self, name: &str, limit: u64) -> Result<Tensor, String> {
        let info = self.info(name).ok_or_else(|| format!("it holds no `{name}`"))?;
        let kind = kind_of(info.dtype).ok_or_else(|| format!("`{name}` holds {:?} values, not floats", info.dtype))?;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        let bytes = self.bytes(name, limit)?;
        crate::checked::tensor(&bytes, &shape, kind).map_err(|e| format!("`{name}`: {e}"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// For rows `rows` of an array of `shape` and `kind`: their shape, the bytes before them and
/// their bytes; or why they are not rows of it.
pub fn row_bytes(shape: &[i64], kind: Kind, rows: &Range<i64>) -> Result<(Vec<i64>, u64, u64), String> {
    let total = shape.first().copied().unwrap_or(1);
    if !(0 <= rows.start && rows.start <= rows.end && rows.end <= total) {
        return Err(format!("rows {}..{} asked of an array of {total}", rows.start, rows.end));
    }
    let row = shape_bytes(shape.get(1..).unwrap_or(&[]), kind)?;
    let mut out = shape.to_vec();
    if let Some(d0) = out.first_mut() {
        *d0 = rows.end - rows.start;
    }
    Ok((out, row * rows.start as u64, row * (rows.end - rows.start) as u64))
}

/// Bytes of `shape` of `kind`, or why it is no shape.
pub fn shape_bytes(shape: &[i64], kind: Kind) -> Result<u64, String> {
    let n = shape.iter().try_fold(1u64, |n, &d| u64::try_from(d).ok().and_then(|d| n.checked_mul(d)));
    n.and_then(|n| n.checked_mul(kind.elt_size_in_bytes() as u64))
        .ok_or(format!("shape {shape:?} is not a shape of an array that fits in memory"))
}
