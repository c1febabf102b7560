//! `.safetensors` files, every one the runner reads or writes (checkpoints' tensor files,
//! `model.safetensors`, `wrap.init`, the tensors source), through the `safetensors` crate: its
//! header type and its writer. A file is opened by its header alone and each tensor is read at
//! its own byte range, so a reader holds one tensor at a time, never the whole file. Nothing in
//! a header is trusted: the entries must tile the data exactly (the crate's own rule, checked
//! here because the crate checks it only over a whole file in memory).
use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{Dtype, Metadata, TensorInfo, View};
use tch::{Kind, Tensor};

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
    header: Metadata,
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
        let f = TensorFile { file, path: path.to_owned(), data_start: 8 + header_len, header };
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
        let mut v: Vec<(String, &TensorInfo)> = self.header.tensors().into_iter().collect();
        v.sort_by_key(|(_, info)| info.data_offsets);
        v
    }

    pub fn info(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensors().get(name).copied()
    }

    /// The header's `__metadata__` (string → string).
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.header.metadata().as_ref()
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

/// One tensor to write: its name, element type and shape, and a function giving its bytes when
/// the writer reaches it (so that a writer holds one tensor's bytes at a time).
pub struct Entry<'a> {
    pub name: String,
    pub kind: Kind,
    pub shape: Vec<i64>,
    /// Its bytes, when the writer reaches it: made then, or lent (a copy the caller keeps).
    pub bytes: Box<dyn FnMut() -> anyhow::Result<Cow<'a, [u8]>> + 'a>,
}

impl<'a> Entry<'a> {
    /// An entry whose bytes are `t`'s (copied to the CPU when written).
    pub fn of(name: String, t: &'a Tensor) -> Entry<'a> {
        Entry { name, kind: t.kind(), shape: t.size(), bytes: Box::new(move || Ok(bytes_of(t).into())) }
    }
}

/// The order in which the format lays tensors out, and [`write`] asks for their bytes: by
/// element type (widest first), then by name. Callers whose byte functions are collectives
/// (every rank calls them in turn) sort their entries with it.
pub fn sort_for_layout(entries: &mut [Entry]) {
    entries.sort_by(|a, b| layout_key(b).cmp(&layout_key(a)).then_with(|| a.name.cmp(&b.name)));
}

fn layout_key(e: &Entry) -> Option<Dtype> {
    dtype_of(e.kind)
}

/// A tensor the crate's writer reaches: its bytes are produced when it asks, in the order of
/// [`sort_for_layout`]; the first error is kept (the writer itself cannot return one).
struct Lazy<'w, 'a> {
    index: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
    entry: &'w RefCell<Entry<'a>>,
    next: &'w Cell<usize>,
    failure: &'w RefCell<Option<anyhow::Error>>,
}

impl View for Lazy<'_, '_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let fail = |e: anyhow::Error| {
            self.failure.borrow_mut().get_or_insert(e);
            Cow::Owned(vec![0u8; self.len])
        };
        if self.failure.borrow().is_some() {
            return Cow::Owned(vec![0u8; self.len]);
        }
        if self.next.get() != self.index {
            return fail(anyhow::anyhow!("the safetensors writer asked for its tensors out of order"));
        }
        self.next.set(self.index + 1);
        match (self.entry.borrow_mut().bytes)() {
            Ok(b) if b.len() == self.len => b,
            Ok(b) => {
                let name = &self.entry.borrow().name;
                fail(anyhow::anyhow!("`{name}` gave {} bytes, its shape holds {}", b.len(), self.len))
            }
            Err(e) => fail(e),
        }
    }

    fn data_len(&self) -> usize {
        self.len
    }
}

/// Writes `entries` to `path` (replacing it), sorted by [`sort_for_layout`] and asked for their
/// bytes in that order, with `metadata` in the header; syncs the file. On an error the file is
/// removed.
pub fn write(path: &Path, metadata: Option<HashMap<String, String>>, mut entries: Vec<Entry>) -> anyhow::Result<()> {
    sort_for_layout(&mut entries);
    let mut shapes = Vec::with_capacity(entries.len());
    for e in &entries {
        let dtype =
            dtype_of(e.kind).ok_or_else(|| anyhow::anyhow!("`{}` is {:?}: no safetensors type", e.name, e.kind))?;
        let shape: Vec<usize> = e.shape.iter().map(|&d| d.max(0) as usize).collect();
        let len = shape.iter().product::<usize>() * dtype.size();
        shapes.push((dtype, shape, len));
    }
    let names: Vec<String> = entries.iter().map(|e| e.name.clone()).collect();
    let cells: Vec<RefCell<Entry>> = entries.into_iter().map(RefCell::new).collect();
    let (next, failure) = (Cell::new(0), RefCell::new(None));
    let views = shapes.into_iter().zip(&cells).enumerate().map(|(index, ((dtype, shape, len), entry))| Lazy {
        index,
        dtype,
        shape,
        len,
        entry,
        next: &next,
        failure: &failure,
    });
    let written = safetensors::serialize_to_file(names.iter().zip(views), &metadata, path)
        .map_err(|e| anyhow::anyhow!("{e}"))
        .and_then(|()| Ok(File::open(path)?.sync_all()?));
    let result = match (written, failure.into_inner()) {
        (_, Some(e)) | (Err(e), None) => Err(e),
        (Ok(()), None) => Ok(()),
    };
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    result.map_err(|e| e.context(format!("cannot write {}", path.display())))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_written_read_back_by_byte_range_and_in_the_layout_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let a = Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).view([2, 3]);
        let b = Tensor::from(7i64);
        let c = Tensor::ones([4], (Kind::Double, tch::Device::Cpu));
        let entries = vec![Entry::of("z.a".into(), &a), Entry::of("b".into(), &b), Entry::of("c".into(), &c)];
        let meta = HashMap::from([("k".to_owned(), "v".to_owned())]);
        write(&path, Some(meta), entries).unwrap();
        let f = TensorFile::open(&path).unwrap();
        let names: Vec<String> = f.entries().into_iter().map(|(n, _)| n).collect();
        // Int64 and float64 (8 bytes) before float32; then by name.
        assert_eq!(names, ["b", "c", "z.a"]);
        assert!(f.tensor("z.a", 1 << 20).unwrap().equal(&a));
        assert_eq!(f.tensor("b", 1 << 20).unwrap().int64_value(&[]), 7);
        assert_eq!(f.metadata().unwrap()["k"], "v");
        let r = f.range("c").unwrap();
        assert_eq!(r.end - r.start, 32);
        // tch's own reader agrees.
        let theirs: HashMap<String, Tensor> = Tensor::read_safetensors(&path).unwrap().into_iter().collect();
        assert!(theirs["c"].equal(&c));
    }

    #[test]
    fn a_failing_byte_function_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let entry = Entry {
            name: "x".into(),
            kind: Kind::Float,
            shape: vec![2],
            bytes: Box::new(|| Err(anyhow::anyhow!("gather failed"))),
        };
        let e = write(&path, None, vec![entry]).unwrap_err();
        assert!(format!("{e:#}").contains("gather failed"), "{e:#}");
        assert!(!path.exists());
    }
}
