//! Files of named arrays (`.npz`, `.safetensors`: `wrap.init`, a run's `model.safetensors`, a
//! tensors source) read without trusting them: every `.npz` member's header and every
//! `.safetensors` entry's dtype, shape and offsets are checked against the bytes actually there
//! before a tensor is made (through [`crate::checked::tensor`]; `.safetensors` through
//! [`crate::tensorfile`]), and nothing larger than `limit` bytes is read. Which arrays are weights (floats, the model's
//! names and shapes) is [`crate::model::weights`]'s to say. A file is read one array at a time
//! ([`visit`]), or as rows of one array ([`ArrayFile::rows`]: a rank's share of a parameter).
use std::fs::File;
use std::io::Read;
use std::ops::Range;
use std::path::Path;

use tch::{Kind, Tensor};

use super::npy::{parse_header, Dtype};

/// The named tensors of an `.npz` or `.safetensors` file, none larger than `limit` bytes.
pub fn read(path: &Path, limit: u64) -> Result<Vec<(String, Tensor)>, String> {
    let mut out = Vec::new();
    visit(path, limit, |name, t| {
        out.push((name, t));
        Ok(())
    })?;
    Ok(out)
}

/// Hands each named tensor of an `.npz` or `.safetensors` file, none larger than `limit` bytes,
/// to `f` in the file's order, one at a time: a caller that keeps none holds one at most.
pub fn visit(path: &Path, limit: u64, mut f: impl FnMut(String, Tensor) -> Result<(), String>) -> Result<(), String> {
    let p = path.display();
    match path.extension().and_then(|e| e.to_str()) {
        Some("npz") => visit_npz(path, limit, &mut f).map_err(|e| format!("{p}: {e}")),
        Some("safetensors") => visit_safetensors(path, limit, &mut f).map_err(|e| format!("{p}: {e}")),
        _ => Err(format!("{p}: use an .npz or .safetensors file")),
    }
}

/// An `.npz` or `.safetensors` file open for reading rows of its arrays.
pub enum ArrayFile {
    Npz(zip::ZipArchive<File>),
    Safetensors(crate::tensorfile::TensorFile),
}

impl ArrayFile {
    /// Errors say what is wrong, without the path.
    pub fn open(path: &Path) -> Result<ArrayFile, String> {
        match path.extension().and_then(|e| e.to_str()) {
            Some("npz") => {
                let file = File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
                Ok(ArrayFile::Npz(zip::ZipArchive::new(file).map_err(|e| format!("not an .npz archive ({e})"))?))
            }
            Some("safetensors") => Ok(ArrayFile::Safetensors(crate::tensorfile::TensorFile::open(path)?)),
            _ => Err("use an .npz or .safetensors file".into()),
        }
    }

    /// Rows `rows` (dim 0; a 0-dimensional array is one row) of the array `name`, in its own
    /// element type. Only those rows' bytes are read into memory: from a `.safetensors` file
    /// their byte range alone ([`crate::tensorfile::TensorFile::rows`]); from an `.npz` member,
    /// which may be compressed, the bytes before them are read and dropped as they come.
    pub fn rows(&mut self, name: &str, rows: Range<i64>) -> Result<Tensor, String> {
        match self {
            ArrayFile::Safetensors(f) => f.rows(name, rows),
            ArrayFile::Npz(zip) => {
                let mut member = zip.by_name(&format!("{name}.npy")).map_err(|_| format!("it holds no `{name}`"))?;
                let (kind, shape) = npy_header(&mut member).map_err(|e| format!("member `{name}`: {e}"))?;
                let (row_shape, skip, want) =
                    crate::tensorfile::row_bytes(&shape, kind, &rows).map_err(|e| format!("`{name}`: {e}"))?;
                let skipped = std::io::copy(&mut member.by_ref().take(skip), &mut std::io::sink());
                let mut data = Vec::new();
                let read = skipped.and_then(|_| member.take(want).read_to_end(&mut data));
                read.map_err(|e| format!("member `{name}`: its data cannot be read ({e})"))?;
                if data.len() as u64 != want {
                    return Err(format!(
                        "member `{name}` is truncated: rows {}..{} are not all there",
                        rows.start, rows.end
                    ));
                }
                crate::checked::tensor(&data, &row_shape, kind).map_err(|e| format!("member `{name}`: {e}"))
            }
        }
    }
}

/// The tensor kind of a `.npy` dtype; libtorch's unsigned kinds wider than a byte have none.
fn npy_kind(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::Bool => Kind::Bool,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::U16 | Dtype::U32 | Dtype::U64 => return None,
    })
}

/// What [`visit`] hands each tensor to.
type Visit<'a> = &'a mut dyn FnMut(String, Tensor) -> Result<(), String>;

/// An `.npz` archive (numpy's `savez`, stored or deflated): each member a `.npy` array.
fn visit_npz(path: &Path, limit: u64, f: Visit) -> Result<(), String> {
    let file = File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| format!("not an .npz archive ({e})"))?;
    for i in 0..zip.len() {
        let member = zip.by_index(i).map_err(|e| format!("member {i} cannot be read ({e})"))?;
        let name = member.name().strip_suffix(".npy").unwrap_or(member.name()).to_owned();
        let tensor = read_npy_member(member, limit).map_err(|e| format!("member `{name}`: {e}"))?;
        f(name, tensor)?;
    }
    Ok(())
}

/// One `.npy` stream: its header's shape must account for every byte after it.
fn read_npy_member(mut r: impl Read, limit: u64) -> Result<Tensor, String> {
    let (kind, shape) = npy_header(&mut r)?;
    let want = crate::tensorfile::shape_bytes(&shape, kind)?;
    if want > limit {
        return Err(format!("shape {shape:?} is {want} bytes, larger than any weight of the model"));
    }
    let mut data = Vec::new();
    r.take(want + 1).read_to_end(&mut data).map_err(|e| format!("its data cannot be read ({e})"))?;
    if data.len() as u64 != want {
        return Err(format!(
            "the header says shape {shape:?} ({want} bytes), the data holds {}{}: it is truncated or its header lies",
            data.len().min(want as usize),
            if data.len() as u64 > want { " and more" } else { "" }
        ));
    }
    crate::checked::tensor(&data, &shape, kind)
}

/// A `.npy` stream's header, read up to its data: the element type and shape.
fn npy_header(mut r: impl Read) -> Result<(Kind, Vec<i64>), String> {
    let mut magic = [0u8; 10];
    r.read_exact(&mut magic).map_err(|_| "not a .npy array (too short)".to_owned())?;
    if &magic[..6] != b"\x93NUMPY" {
        return Err("not a .npy array (no \\x93NUMPY magic)".into());
    }
    let header_len = match magic[6] {
        1 => u16::from_le_bytes([magic[8], magic[9]]) as u64,
        2 | 3 => {
            let mut more = [0u8; 2];
            r.read_exact(&mut more).map_err(|_| "the .npy header is cut".to_owned())?;
            u32::from_le_bytes([magic[8], magic[9], more[0], more[1]]) as u64
        }
        v => return Err(format!(".npy format version {v} is not one numpy writes")),
    };
    let mut header = Vec::new();
    r.by_ref().take(header_len.min(1 << 20)).read_to_end(&mut header).map_err(|e| e.to_string())?;
    if header.len() as u64 != header_len {
        return Err(format!("the .npy header claims {header_len} bytes, {} are there", header.len()));
    }
    let header = std::str::from_utf8(&header).map_err(|_| "the .npy header is not text".to_owned())?;
    let (dtype, shape) = parse_header(header)?;
    let kind = npy_kind(dtype).ok_or(format!("holds {dtype:?} values, not floats (float32 or float64)"))?;
    let shape: Vec<i64> = shape.iter().map(|&d| i64::try_from(d).unwrap_or(-1)).collect();
    Ok((kind, shape))
}

/// A `.safetensors` file (through [`crate::tensorfile`]), each tensor read at its own bytes.
fn visit_safetensors(path: &Path, limit: u64, f: Visit) -> Result<(), String> {
    let file = crate::tensorfile::TensorFile::open(path)?;
    for (name, _) in file.entries() {
        let t = file.tensor(&name, limit)?;
        f(name, t)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid(dir: &Path, ext: &str) -> Vec<u8> {
        let named = [
            ("a", Tensor::arange(6, (Kind::Float, tch::Device::Cpu)).view([2, 3])),
            ("b", Tensor::ones([4], (Kind::Double, tch::Device::Cpu))),
        ];
        let path = dir.join(format!("w.{ext}"));
        match ext {
            "npz" => Tensor::write_npz(&named, &path).unwrap(),
            _ => Tensor::write_safetensors(&named, &path).unwrap(),
        }
        std::fs::read(path).unwrap()
    }

    #[test]
    fn valid_files_read_back_and_lying_ones_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        for ext in ["npz", "safetensors"] {
            valid(dir.path(), ext);
            let read = read(&dir.path().join(format!("w.{ext}")), 1 << 20).unwrap();
            assert_eq!(read.len(), 2);
            assert!(read.iter().any(|(n, t)| n == "a" && t.size() == [2, 3]));
        }
        // A safetensors entry whose shape asks more than its offsets give.
        let mut bytes = valid(dir.path(), "safetensors");
        let text = String::from_utf8_lossy(&bytes).replace("[2,3]", "[9,3]");
        bytes = text.into_bytes();
        let p = dir.path().join("lie.safetensors");
        std::fs::write(&p, &bytes).unwrap();
        assert!(read(&p, 1 << 20).unwrap_err().contains("its header lies"), "{:?}", read(&p, 1 << 20).err());
    }

    #[test]
    fn mutated_weights_files_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let npz = valid(dir.path(), "npz");
        crate::checked::fuzz::reader("m.npz", &npz, 300, |p| read(p, 1 << 20));
        let st = valid(dir.path(), "safetensors");
        crate::checked::fuzz::reader("m.safetensors", &st, 300, |p| read(p, 1 << 20));
    }
}
