//! Files of named arrays (`.npz`, `.safetensors`: `wrap.init`, a run's `model.safetensors`, a
//! tensors source) read without trusting them: every `.npz` member's header and every
//! `.safetensors` entry's dtype, shape and offsets are checked against the bytes actually there
//! before a tensor is made (through [`crate::checked::tensor`]; `.safetensors` through
//! [`crate::tensorfile`]), and nothing larger than `limit` bytes is read. Which arrays are weights (floats, the model's
//! names and shapes) is [`crate::model::read_weights`]'s to say.
use std::fs::File;
use std::io::Read;
use std::path::Path;

use tch::{Kind, Tensor};

use super::npy::{parse_header, Dtype};

/// The named tensors of an `.npz` or `.safetensors` file, none larger than `limit` bytes.
pub fn read(path: &Path, limit: u64) -> Result<Vec<(String, Tensor)>, String> {
    let p = path.display();
    match path.extension().and_then(|e| e.to_str()) {
        Some("npz") => read_npz(path, limit).map_err(|e| format!("{p}: {e}")),
        Some("safetensors") => read_safetensors(path, limit).map_err(|e| format!("{p}: {e}")),
        _ => Err(format!("{p}: use an .npz or .safetensors file")),
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

/// An `.npz` archive (numpy's `savez`, stored or deflated): each member a `.npy` array.
fn read_npz(path: &Path, limit: u64) -> Result<Vec<(String, Tensor)>, String> {
    let file = File::open(path).map_err(|e| format!("cannot read it: {e}"))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| format!("not an .npz archive ({e})"))?;
    let mut out = Vec::new();
    for i in 0..zip.len() {
        let member = zip.by_index(i).map_err(|e| format!("member {i} cannot be read ({e})"))?;
        let name = member.name().strip_suffix(".npy").unwrap_or(member.name()).to_owned();
        let tensor = read_npy_member(member, limit).map_err(|e| format!("member `{name}`: {e}"))?;
        out.push((name, tensor));
    }
    Ok(out)
}

/// One `.npy` stream: its header's shape must account for every byte after it.
fn read_npy_member(mut r: impl Read, limit: u64) -> Result<Tensor, String> {
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
    let want = shape_bytes(&shape, kind)?;
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

/// Bytes of `shape` of `kind`, or why it is no shape.
fn shape_bytes(shape: &[i64], kind: Kind) -> Result<u64, String> {
    let n = shape.iter().try_fold(1u64, |n, &d| u64::try_from(d).ok().and_then(|d| n.checked_mul(d)));
    n.and_then(|n| n.checked_mul(kind.elt_size_in_bytes() as u64))
        .ok_or(format!("shape {shape:?} is not a shape of an array that fits in memory"))
}

/// A `.safetensors` file (through [`crate::tensorfile`]), each tensor read at its own bytes.
fn read_safetensors(path: &Path, limit: u64) -> Result<Vec<(String, Tensor)>, String> {
    let file = crate::tensorfile::TensorFile::open(path)?;
    file.entries().into_iter().map(|(name, _)| Ok((name.clone(), file.tensor(&name, limit)?))).collect()
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
