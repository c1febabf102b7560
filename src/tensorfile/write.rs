//! Writing a `.safetensors` file: the same bytes as the crate's `serialize_to_file` (the header
//! JSON padded to 8 bytes, then each tensor's bytes in the crate's order), written through
//! [`DirectFile`] so that gigabytes of checkpoint do not pass through the page cache.
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, TensorInfo};
use serde::ser::{Serialize, SerializeMap, Serializer};
use tch::{Kind, Tensor};

use super::direct::DirectFile;
use super::{bytes_of, dtype_of};

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

/// Writes `entries` to `path` (replacing it), sorted by [`sort_for_layout`] and asked for their
/// bytes in that order, with `metadata` in the header; syncs the file. On an error the file is
/// removed.
pub fn write(path: &Path, metadata: Option<HashMap<String, String>>, mut entries: Vec<Entry>) -> anyhow::Result<()> {
    sort_for_layout(&mut entries);
    let result = (|| {
        let layout = entries.iter().map(layout_of).collect::<anyhow::Result<Vec<_>>>()?;
        let header = header(&metadata, &entries, &layout)?;
        let mut file = DirectFile::create(path)?;
        file.write_all(&(header.len() as u64).to_le_bytes())?;
        file.write_all(&header)?;
        for (e, (_, _, want)) in entries.iter_mut().zip(&layout) {
            let bytes = (e.bytes)()?;
            anyhow::ensure!(bytes.len() == *want, "`{}` gave {} bytes, its shape holds {want}", e.name, bytes.len());
            file.write_all(&bytes)?;
        }
        Ok(file.finish()?)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    result.map_err(|e| e.context(format!("cannot write {}", path.display())))
}

/// An entry's element type, shape and byte length in the format.
fn layout_of(e: &Entry) -> anyhow::Result<(Dtype, Vec<usize>, usize)> {
    let dtype = dtype_of(e.kind).ok_or_else(|| anyhow::anyhow!("`{}` is {:?}: no safetensors type", e.name, e.kind))?;
    let shape: Vec<usize> = e.shape.iter().map(|&d| d.max(0) as usize).collect();
    let len = shape.iter().product::<usize>() * dtype.size();
    Ok((dtype, shape, len))
}

/// The header of `entries` laid out in order (`layout`: each one's [`layout_of`]): its JSON as
/// the crate writes it (`__metadata__` first), padded with spaces to a multiple of 8 bytes.
fn header(
    metadata: &Option<HashMap<String, String>>,
    entries: &[Entry],
    layout: &[(Dtype, Vec<usize>, usize)],
) -> anyhow::Result<Vec<u8>> {
    let mut tensors = Vec::with_capacity(entries.len());
    let mut offset = 0;
    for (e, (dtype, shape, len)) in entries.iter().zip(layout) {
        let info = TensorInfo { dtype: *dtype, shape: shape.clone(), data_offsets: (offset, offset + len) };
        tensors.push((e.name.as_str(), info));
        offset += len;
    }
    let mut json = serde_json::to_vec(&Header { metadata, tensors })?;
    json.resize(json.len().next_multiple_of(8), b' ');
    Ok(json)
}

/// A header's JSON: an object of the metadata and then each tensor, in layout order.
struct Header<'a> {
    metadata: &'a Option<HashMap<String, String>>,
    tensors: Vec<(&'a str, TensorInfo)>,
}

impl Serialize for Header<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.tensors.len() + self.metadata.is_some() as usize))?;
        if let Some(metadata) = self.metadata {
            // Sorted by key: the same model gives the same bytes whatever the map's order.
            let sorted: std::collections::BTreeMap<&String, &String> = metadata.iter().collect();
            map.serialize_entry("__metadata__", &sorted)?;
        }
        for (name, info) in &self.tensors {
            map.serialize_entry(name, info)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::super::TensorFile;
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

    /// The file is the crate's own serialisation, byte for byte.
    #[test]
    fn the_bytes_are_the_crates() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let a = Tensor::arange(5, (Kind::Float, tch::Device::Cpu));
        let b = Tensor::from_slice(&[1i64, -2]);
        let c = Tensor::ones([2, 3], (Kind::BFloat16, tch::Device::Cpu));
        let meta = HashMap::from([("format".to_owned(), "pt".to_owned())]);
        let entries = vec![Entry::of("w".into(), &a), Entry::of("b".into(), &b), Entry::of("a.c".into(), &c)];
        write(&path, Some(meta.clone()), entries).unwrap();
        let bytes: Vec<(&str, Vec<u8>, Dtype, Vec<usize>)> = [("w", &a), ("b", &b), ("a.c", &c)]
            .map(|(n, t)| (n, bytes_of(t), dtype_of(t.kind()).unwrap(), t.size().iter().map(|&d| d as usize).collect()))
            .into();
        let views =
            bytes.iter().map(|(n, b, d, s)| (*n, safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()));
        assert_eq!(std::fs::read(&path).unwrap(), safetensors::serialize(views, &Some(meta)).unwrap());
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
