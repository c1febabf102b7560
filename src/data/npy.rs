//! `.npy` arrays read without trusting them: the header's dtype and shape are checked against the
//! bytes actually in the file before anything is allocated, and the data is never loaded whole.
//! Rows are read where they lie (positioned reads), so a rank holds only the batch it trains on.
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// The element types a `.npy` array may hold here (little-endian, or single bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F32,
    F64,
}

impl Dtype {
    fn parse(descr: &str) -> Option<Dtype> {
        Some(match descr {
            "|b1" => Dtype::Bool,
            "|u1" | "<u1" => Dtype::U8,
            "|i1" | "<i1" => Dtype::I8,
            "<u2" => Dtype::U16,
            "<i2" => Dtype::I16,
            "<u4" => Dtype::U32,
            "<i4" => Dtype::I32,
            "<u8" => Dtype::U64,
            "<i8" => Dtype::I64,
            "<f4" => Dtype::F32,
            "<f8" => Dtype::F64,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 => 1,
            Dtype::U16 | Dtype::I16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::F64)
    }

    pub fn is_integer(self) -> bool {
        !self.is_float() && self != Dtype::Bool
    }

    /// Element `i` of little-endian `bytes`, as a float64 (integers above 2^53 round).
    pub fn get_f64(self, bytes: &[u8], i: usize) -> f64 {
        let b = &bytes[i * self.size()..(i + 1) * self.size()];
        match self {
            Dtype::F32 => f32::from_le_bytes(b.try_into().expect("4 bytes")) as f64,
            Dtype::F64 => f64::from_le_bytes(b.try_into().expect("8 bytes")),
            _ => self.get_i128(bytes, i) as f64,
        }
    }

    /// Integer element `i` of little-endian `bytes` (0 or 1 for booleans).
    pub fn get_i128(self, bytes: &[u8], i: usize) -> i128 {
        let b = &bytes[i * self.size()..(i + 1) * self.size()];
        let mut le = [0u8; 8];
        le[..b.len()].copy_from_slice(b);
        let u = u64::from_le_bytes(le);
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64 => u as i128,
            Dtype::I8 => b[0] as i8 as i128,
            Dtype::I16 => i16::from_le_bytes([b[0], b[1]]) as i128,
            Dtype::I32 => i32::from_le_bytes(b.try_into().expect("4 bytes")) as i128,
            Dtype::I64 => u as i64 as i128,
            Dtype::F32 | Dtype::F64 => self.get_f64(bytes, i) as i128,
        }
    }
}

/// An opened `.npy` array: its checked header and where its data starts.
#[derive(Debug)]
pub struct Npy {
    pub path: PathBuf,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte offset of the data in the file.
    pub offset: u64,
    file: File,
}

/// The largest header numpy writes is a few hundred bytes; this bounds what a lying length asks.
const MAX_HEADER: usize = 1 << 20;

impl Npy {
    /// Opens `path` and checks its header against the file's size: a shape whose bytes overflow or
    /// exceed what the file holds (a truncated array, a lying header) is refused here, before
    /// anything is read.
    pub fn open(path: &Path) -> Result<Npy, String> {
        let p = path.display();
        let file = File::open(path).map_err(|e| format!("cannot read {p}: {e}"))?;
        let len = file.metadata().map_err(|e| format!("cannot read {p}: {e}"))?.len();
        let mut magic = [0u8; 12];
        let got = read_at_most(&file, &mut magic, 0).map_err(|e| format!("cannot read {p}: {e}"))?;
        if got < 10 || &magic[..6] != b"\x93NUMPY" {
            return Err(format!("{p} is not a .npy file (no \\x93NUMPY magic)"));
        }
        let (header_len, start) = match magic[6] {
            1 => (u16::from_le_bytes([magic[8], magic[9]]) as usize, 10usize),
            2 | 3 if got == 12 => (u32::from_le_bytes([magic[8], magic[9], magic[10], magic[11]]) as usize, 12),
            v => return Err(format!("{p}: .npy format version {v} is not one numpy writes (1, 2 or 3)")),
        };
        if header_len > MAX_HEADER || (start + header_len) as u64 > len {
            return Err(format!(
                "{p}: the .npy header claims {header_len} bytes but the file has {len}: the file is truncated or not \
                 a .npy file"
            ));
        }
        let mut header = vec![0u8; header_len];
        file.read_exact_at(&mut header, start as u64).map_err(|e| format!("cannot read {p}: {e}"))?;
        let header = std::str::from_utf8(&header).map_err(|_| format!("{p}: the .npy header is not text"))?;
        let (dtype, shape) = parse_header(header).map_err(|e| format!("{p}: {e}"))?;
        let offset = (start + header_len) as u64;
        let elements = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let bytes = elements.and_then(|n| n.checked_mul(dtype.size())).map(|b| b as u64);
        match bytes {
            Some(b) if b <= len - offset => {}
            Some(b) => {
                return Err(format!(
                    "{p}: the header says shape {shape:?} of {} ({b} bytes), but the file holds {} bytes of data: it \
                     is truncated or its header lies",
                    dtype_name(dtype),
                    len - offset
                ))
            }
            None => return Err(format!("{p}: the header's shape {shape:?} is too large to be an array")),
        }
        Ok(Npy { path: path.to_owned(), dtype, shape, offset, file })
    }

    /// Elements in one row (everything after the first axis); 1 for a 1-D array.
    pub fn row_len(&self) -> usize {
        self.shape.iter().skip(1).product()
    }

    /// Rows: the first axis (the elements of a 1-D array).
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// The raw bytes of elements `start .. start + count` (in C order).
    pub fn read_elements(&self, start: usize, count: usize) -> Result<Vec<u8>, String> {
        let size = self.dtype.size();
        let mut buf = vec![0u8; count * size];
        self.file
            .read_exact_at(&mut buf, self.offset + (start * size) as u64)
            .map_err(|e| format!("cannot read {}: {e}", self.path.display()))?;
        Ok(buf)
    }

    /// Rows `indices` (each below [`Npy::rows`]) as a tensor of `kind`, shape
    /// `[indices.len(), ...shape[1..]]`.
    pub fn read_rows(&self, indices: &[i64], kind: Kind) -> Result<Tensor, String> {
        let w = self.row_len();
        let mut raw = Vec::with_capacity(indices.len() * w * self.dtype.size());
        for &i in indices {
            if i < 0 || i as usize >= self.rows() {
                return Err(format!("{}: row {i} is past its {} rows", self.path.display(), self.rows()));
            }
            raw.extend(self.read_elements(i as usize * w, w)?);
        }
        let shape: Vec<i64> =
            std::iter::once(indices.len() as i64).chain(self.shape.iter().skip(1).map(|&d| d as i64)).collect();
        Ok(to_tensor(&raw, self.dtype, &shape)?.to_kind(kind))
    }
}

/// Reads what there is (up to `buf.len()` bytes) at `offset`.
fn read_at_most(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64)? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}").to_lowercase()
}

/// Little-endian `bytes` of `dtype` as a tensor of `shape` (a copy, through the checked helper:
/// the bytes must be exactly the shape's).
pub fn to_tensor(bytes: &[u8], dtype: Dtype, shape: &[i64]) -> Result<Tensor, String> {
    let kind = match dtype {
        Dtype::Bool => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        // libtorch's unsigned 16/32/64-bit kinds lack most operations: widen them.
        Dtype::U16 | Dtype::U32 | Dtype::U64 => Kind::Int64,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
    };
    match dtype {
        Dtype::U16 | Dtype::U32 | Dtype::U64 => {
            let n = bytes.len() / dtype.size();
            let v: Vec<u8> =
                (0..n).flat_map(|i| (dtype.get_i128(bytes, i).min(i64::MAX as i128) as i64).to_le_bytes()).collect();
            crate::checked::tensor(&v, shape, kind)
        }
        _ => crate::checked::tensor(bytes, shape, kind),
    }
}

/// The dtype and shape of a `.npy` header (`{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`).
pub(crate) fn parse_header(header: &str) -> Result<(Dtype, Vec<usize>), String> {
    let value = |key: &str| -> Result<&str, String> {
        let at = header.find(&format!("'{key}'")).ok_or(format!("the .npy header has no '{key}'"))?;
        Ok(header[at + key.len() + 2..].trim_start().trim_start_matches(':').trim_start())
    };
    let descr = value("descr")?;
    let descr = descr
        .strip_prefix('\'')
        .and_then(|d| d.split('\'').next())
        .ok_or("the .npy header's descr is not a dtype string")?;
    let dtype = Dtype::parse(descr)
        .ok_or(format!("dtype {descr:?} is not supported: use little-endian integers, float32/float64 or booleans"))?;
    if value("fortran_order")?.starts_with("True") {
        return Err("a Fortran-order array; save it in C order (np.ascontiguousarray)".into());
    }
    let shape = value("shape")?;
    let inner =
        shape.strip_prefix('(').and_then(|s| s.split(')').next()).ok_or("the .npy header's shape is not a tuple")?;
    let dims = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|d| {
            d.trim_end_matches('L')
                .parse::<usize>()
                .map_err(|_| format!("the .npy shape ({inner}) holds {d:?}, not a size"))
        })
        .collect::<Result<Vec<usize>, String>>()?;
    Ok((dtype, dims))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
        let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + h.len() + 1) % 64 != 0 {
            h.push(' ');
        }
        h.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((h.len() as u16).to_le_bytes());
        out.extend(h.as_bytes());
        out.extend(data);
        out
    }

    #[test]
    fn reads_rows_where_they_lie_and_matches_libtorch() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        let t = Tensor::arange(24, (Kind::Float, tch::Device::Cpu)).view([6, 2, 2]);
        t.write_npy(&p).unwrap();
        let a = Npy::open(&p).unwrap();
        assert_eq!((a.dtype, a.shape.clone(), a.rows(), a.row_len()), (Dtype::F32, vec![6, 2, 2], 6, 4));
        let rows = a.read_rows(&[5, 0, 3], Kind::Float).unwrap();
        assert!(rows.equal(&t.index_select(0, &Tensor::from_slice(&[5i64, 0, 3]))));
    }

    #[test]
    fn lying_and_truncated_headers_are_refused_before_any_allocation() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.npy");
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (npy("<f8", "(100000000, 5)", &[0; 100]), "it is truncated or its header lies"),
            (npy("<f4", "(200, 5)", &[0; 100]), "it is truncated or its header lies"),
            (npy("<f4", "(18446744073709551615, 5)", &[]), "too large to be an array"),
            (npy("<f4", "(-3, 5)", &[]), "not a size"),
            (npy(">f4", "(1,)", &[0; 4]), "is not supported"),
            (npy("<c16", "(1,)", &[0; 16]), "is not supported"),
            (b"\x93NUMPY\x01\x00\xff\xff".to_vec(), "the file is truncated or not a .npy file"),
            (b"hello".to_vec(), "is not a .npy file"),
        ];
        for (bytes, want) in cases {
            std::fs::write(&p, &bytes).unwrap();
            let err = Npy::open(&p).unwrap_err();
            assert!(err.contains(want), "{want:?} not in {err:?}");
        }
        // Cut by 8 bytes: numpy refuses it, and so does the reader.
        let t = Tensor::arange(10, (Kind::Int64, tch::Device::Cpu));
        t.write_npy(&p).unwrap();
        let full = std::fs::read(&p).unwrap();
        std::fs::write(&p, &full[..full.len() - 8]).unwrap();
        assert!(Npy::open(&p).unwrap_err().contains("truncated"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 300, ..Default::default() })]
        /// Any mutation or truncation of a valid file opens cleanly or is refused: never a panic.
        #[test]
        fn mutated_files_never_panic(cut in 0usize..200, at in 0usize..200, byte in proptest::prelude::any::<u8>()) {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("m.npy");
            let mut bytes = npy("<i2", "(7, 3)", &[1; 42]);
            let at = at % bytes.len();
            bytes[at] = byte;
            bytes.truncate(bytes.len().saturating_sub(cut % 60));
            std::fs::write(&p, &bytes).unwrap();
            if let Ok(a) = Npy::open(&p) {
                let rows: Vec<i64> = (0..a.rows() as i64).collect();
                let _ = a.read_rows(&rows, Kind::Float);
            }
        }
    }
}
