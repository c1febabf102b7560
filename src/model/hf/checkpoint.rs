//! A Hugging Face checkpoint's weights opened by their headers alone (`model.safetensors`, or the
//! shards `model.safetensors.index.json` names), checked against the model its `config.json`
//! makes, and read as rows of the model's parameters: a rank reads the bytes of the rows it asks
//! for and no others (of a transposed GPT-2 weight, the columns, row by row), never a whole file;
//! or columns of them (a tensor rank's slice of a row-parallel layer: a run of each stored row,
//! or of a transposed weight, its stored rows).
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::tensor::Dtype;
use tch::{Kind, Tensor};

use super::{Arch, Mapping, Part, CONFIG, INDEX, WEIGHTS};
use crate::model::transformer::Spec;
use crate::tensorfile::TensorFile;

/// The most an index may hold: real ones are a few hundred kB.
const INDEX_CAP: u64 = 64 << 20;

/// The output head's tensor, in every architecture the runner reads.
const HEAD: &str = "lm_head.weight";

/// Rows compared at a time when a head and an embedding are checked for equal values.
const COMPARED_ROWS: i64 = 4096;

/// An open checkpoint, its tensors located, as the model's parameters.
pub struct Checkpoint {
    dir: PathBuf,
    files: Vec<TensorFile>,
    /// Each of the checkpoint's tensors: the file (of `files`) that holds it.
    located: HashMap<String, usize>,
    mappings: BTreeMap<String, Mapping>,
    read: Cell<u64>,
}

/// The files of `dir`'s checkpoint: `config.json`, the index if there is one, and the weights'
/// files (what a run's id covers).
pub fn files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let (names, index) = weight_files(dir)?;
    let mut out = vec![dir.join(CONFIG)];
    out.extend(index.map(|_| dir.join(INDEX)));
    out.extend(names.iter().map(|n| dir.join(n)));
    Ok(out)
}

/// The index's map of tensor name → shard file.
type WeightMap = BTreeMap<String, String>;

/// The weights' file names, and the index's tensor → file map when the checkpoint is sharded.
/// A directory holding both `model.safetensors` and an index is read as transformers'
/// `from_pretrained` reads it: the single file, the shards left alone.
fn weight_files(dir: &Path) -> Result<(Vec<String>, Option<WeightMap>), String> {
    if dir.join(WEIGHTS).exists() {
        return Ok((vec![WEIGHTS.to_owned()], None));
    }
    let index = dir.join(INDEX);
    if index.exists() {
        let text = crate::input::read_capped(&index, INDEX_CAP, "the checkpoint's index")?;
        let at = |e: String| format!("{}: {e}", index.display());
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| at(format!("not JSON ({e})")))?;
        let map: BTreeMap<String, String> = json
            .get("weight_map")
            .map(|m| serde_json::from_value(m.clone()))
            .transpose()
            .map_err(|e| at(format!("its `weight_map` is not tensor names to file names ({e})")))?
            .ok_or_else(|| at("it has no `weight_map`".into()))?;
        let mut names: Vec<String> = map.values().cloned().collect();
        names.sort();
        names.dedup();
        if let Some(bad) = names.iter().find(|n| n.contains('/') || n.starts_with('.')) {
            return Err(at(format!("it names a file outside its directory ({bad})")));
        }
        return Ok((names, Some(map)));
    }
    let pickled = dir.join("pytorch_model.bin").exists();
    Err(format!(
        "{} holds neither {WEIGHTS} nor {INDEX}{}",
        dir.display(),
        if pickled {
            " but pytorch_model.bin (PyTorch's pickle format): save the model with save_pretrained's default \
             safe_serialization to convert it"
        } else {
            ""
        }
    ))
}

/// Whether the checkpoint in `dir` of `t` (whose config.json ties the head to the embedding)
/// holds a head of its own: transformers' rule (`tie_weights` in `from_pretrained`) for a file
/// that holds both `lm_head.weight` and the embedding is to tie them when their values are equal
/// and to keep them apart when they differ (the config is wrong about the file). A checkpoint
/// that does not fit an untied model is no such file: its problems are reported when it is opened.
pub fn head_apart(dir: &Path, arch: Arch, t: &crate::config::schema::Transformer) -> Result<bool, String> {
    let untied = Spec::of(&crate::config::schema::Transformer { tied: Some(false), ..t.clone() });
    let Ok(ckpt) = Checkpoint::open(dir, arch, &untied) else { return Ok(false) };
    Ok(!ckpt.same_values("tok.weight", "head.weight", untied.vocab as i64)?)
}

/// "`a`, `b` and 3 more".
fn listed(names: &[String]) -> String {
    const SHOWN: usize = 6;
    let shown: Vec<String> = names.iter().take(SHOWN).map(|n| format!("`{n}`")).collect();
    match names.len().saturating_sub(SHOWN) {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}

impl Checkpoint {
    /// Opens `dir`'s weights, a model of `spec` stored as `arch` stores it, and checks that they
    /// are exactly its tensors: none missing, none extra, every shape the model's, every type a
    /// float.
    pub fn open(dir: &Path, arch: Arch, spec: &Spec) -> Result<Checkpoint, String> {
        let (names, index) = weight_files(dir)?;
        let mut files = Vec::new();
        let mut located = HashMap::new();
        for (i, name) in names.iter().enumerate() {
            let path = dir.join(name);
            let f = TensorFile::open(&path).map_err(|e| format!("{}: {e}", path.display()))?;
            for (tensor, _) in f.entries() {
                if let Some(other) = located.insert(tensor.clone(), i) {
                    return Err(format!("`{tensor}` is in both {} and {name} of {}", names[other], dir.display()));
                }
            }
            files.push(f);
        }
        for (tensor, file) in index.iter().flatten() {
            if located.get(tensor).map(|&i| &names[i]) != Some(file) {
                return Err(format!(
                    "{}: it puts `{tensor}` in {file}, which does not hold it",
                    dir.join(INDEX).display()
                ));
            }
        }
        let prefix = if located.keys().any(|n| n.starts_with("transformer.")) { "transformer." } else { "" };
        let mut mappings: BTreeMap<String, Mapping> =
            arch.mappings(spec, prefix).into_iter().map(|m| (m.ours.clone(), m)).collect();
        // A tied model saved with its head and without its embedding: transformers ties the
        // embedding to the head that is there (`tie_weights` swaps source and target).
        if let Some(tok) = mappings.get_mut("tok.weight").filter(|_| spec.tied) {
            if !located.contains_key(&tok.parts[0].name) && located.contains_key(HEAD) {
                tok.parts[0].name = HEAD.to_owned();
            }
        }
        let ckpt = Checkpoint { dir: dir.to_owned(), files, located, mappings, read: Cell::new(0) };
        ckpt.check(arch, spec)?;
        Ok(ckpt)
    }

    /// Every tensor the model needs is there with its shape, and nothing else is.
    fn check(&self, arch: Arch, spec: &Spec) -> Result<(), String> {
        let (mut missing, mut misshapen, mut wanted) = (Vec::new(), Vec::new(), Vec::new());
        for m in self.mappings.values() {
            for part in &m.parts {
                wanted.push(part.name.as_str());
                let Some(&file) = self.located.get(&part.name) else {
                    missing.push(part.name.clone());
                    continue;
                };
                let info = self.files[file].info(&part.name).expect("located in its file");
                let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
                let want = part.stored_shape(&m.shape);
                if shape != want {
                    misshapen.push(format!("`{}` is {shape:?}, config.json makes it {want:?}", part.name));
                } else if !matches!(info.dtype, Dtype::F16 | Dtype::BF16 | Dtype::F32 | Dtype::F64) {
                    misshapen.push(format!("`{}` holds {:?} values, not floats", part.name, info.dtype));
                }
            }
        }
        // A tied head's own copy holds the embedding's values ([`head_apart`] unties a head that
        // does not): transformers ties it, and so does the model.
        let tolerated = |n: &str| arch.ignored(n) || (spec.tied && n == HEAD);
        let mut extra: Vec<String> =
            self.located.keys().filter(|n| !wanted.contains(&n.as_str()) && !tolerated(n)).cloned().collect();
        missing.sort();
        extra.sort();
        let mut problems = Vec::new();
        if !missing.is_empty() {
            problems.push(format!("no {}", listed(&missing)));
        }
        problems.extend(misshapen);
        if !extra.is_empty() {
            problems.push(format!("unexpected {}", listed(&extra)));
        }
        if problems.is_empty() {
            return Ok(());
        }
        Err(format!("{} does not fit its config.json ({}): {}", self.dir.display(), arch.class(), problems.join("; ")))
    }

    /// Whether rows `rows` of parameters `a` and `b` hold the same values, compared a block of
    /// rows at a time.
    fn same_values(&self, a: &str, b: &str, rows: i64) -> Result<bool, String> {
        for from in (0..rows).step_by(COMPARED_ROWS as usize) {
            let block = from..(from + COMPARED_ROWS).min(rows);
            if !self.rows(a, block.clone())?.equal(&self.rows(b, block)?) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Bytes of weights read so far.
    pub fn bytes_read(&self) -> u64 {
        self.read.get()
    }

    /// The whole of the model's parameter `ours`, as float32.
    pub fn whole(&self, ours: &str) -> Result<Tensor, String> {
        let rows = self.mappings.get(ours).map_or(0, |m| m.shape[0]);
        self.rows(ours, 0..rows)
    }

    /// Rows `rows` (dim 0) of the model's parameter `ours`, as float32, from the parts that hold
    /// them.
    pub fn rows(&self, ours: &str, rows: Range<i64>) -> Result<Tensor, String> {
        let m = self.mappings.get(ours).ok_or_else(|| format!("the model has no `{ours}`"))?;
        if rows.start < 0 || rows.start > rows.end || rows.end > m.shape[0] {
            return Err(format!("rows {}..{} of `{ours}` asked, which has {}", rows.start, rows.end, m.shape[0]));
        }
        let mut pieces = Vec::new();
        let mut at = 0;
        for part in &m.parts {
            let (from, to) = (rows.start.max(at), rows.end.min(at + part.rows));
            if from < to {
                pieces.push(self.part_rows(part, &m.shape, from - at..to - at)?);
            }
            at += part.rows;
        }
        let mut shape = m.shape.clone();
        shape[0] = rows.end - rows.start;
        Ok(match pieces.len() {
            0 => Tensor::zeros(shape.as_slice(), (Kind::Float, tch::Device::Cpu)),
            1 => pieces.pop().expect("one piece"),
            _ => Tensor::cat(&pieces, 0),
        })
    }

    /// Columns `cols` (dim 1) of the model's matrix `ours`, as float32: of each part that holds
    /// its rows, only those columns' bytes.
    pub fn columns(&self, ours: &str, cols: Range<i64>) -> Result<Tensor, String> {
        let m = self.mappings.get(ours).ok_or_else(|| format!("the model has no `{ours}`"))?;
        if m.shape.len() != 2 || cols.start < 0 || cols.start > cols.end || cols.end > m.shape[1] {
            return Err(format!("columns {}..{} of `{ours}` {:?} asked", cols.start, cols.end, m.shape));
        }
        let pieces: Result<Vec<Tensor>, String> =
            m.parts.iter().map(|part| self.part_columns(part, &m.shape, cols.clone())).collect();
        Ok(Tensor::cat(&pieces?, 0))
    }

    /// Columns `cols` of the parameter rows `part` makes: a run of each stored row, or of a
    /// transposed weight (whose columns are the stored rows) those rows.
    fn part_columns(&self, part: &Part, shape: &[i64], cols: Range<i64>) -> Result<Tensor, String> {
        let f = &self.files[self.located[&part.name]];
        let (size, start, stored) = self.located_part(part, shape);
        let n = cols.end - cols.start;
        let (bytes, read_shape) = if part.transposed {
            let row = stored[1] as u64 * size;
            let range = start + cols.start as u64 * row..start + cols.end as u64 * row;
            (f.read_range(range.clone(), range.end - range.start), vec![n, stored[1]])
        } else {
            let row = stored[1] as u64 * size;
            let bytes = f.read_strided(start + cols.start as u64 * size, row, n as u64 * size, stored[0] as u64);
            (bytes, vec![stored[0], n])
        };
        self.decode(part, bytes, &read_shape)
    }

    /// `part`'s element size, where its data start in its file, and its stored shape.
    fn located_part(&self, part: &Part, shape: &[i64]) -> (u64, u64, Vec<i64>) {
        let f = &self.files[self.located[&part.name]];
        let info = f.info(&part.name).expect("located in its file");
        let start = f.range(&part.name).expect("an entry has a range").start;
        (info.dtype.size() as u64, start, part.stored_shape(shape))
    }

    /// Rows `rows` of the parameter rows `part` makes, as float32 (checked to be finite).
    fn part_rows(&self, part: &Part, shape: &[i64], rows: Range<i64>) -> Result<Tensor, String> {
        let f = &self.files[self.located[&part.name]];
        let (size, start, stored) = self.located_part(part, shape);
        let n = rows.end - rows.start;
        let (bytes, read_shape) = if part.transposed {
            // The parameter's rows are the stored matrix's columns: a run of n values from each
            // of its rows.
            let row = stored[1] as u64 * size;
            let bytes = f.read_strided(start + rows.start as u64 * size, row, n as u64 * size, stored[0] as u64);
            (bytes, vec![stored[0], n])
        } else {
            let row = stored[1..].iter().product::<i64>() as u64 * size;
            let range = start + rows.start as u64 * row..start + rows.end as u64 * row;
            let bytes = f.read_range(range.clone(), range.end - range.start);
            (bytes, std::iter::once(n).chain(stored[1..].iter().copied()).collect())
        };
        self.decode(part, bytes, &read_shape)
    }

    /// `bytes` read of `part`, in its stored layout `read_shape`, as float32 in the model's
    /// layout (a transposed part transposed back), checked to be finite.
    fn decode(&self, part: &Part, bytes: Result<Vec<u8>, String>, read_shape: &[i64]) -> Result<Tensor, String> {
        let f = &self.files[self.located[&part.name]];
        let at = |e: String| format!("{}: `{}`: {e}", f.path().display(), part.name);
        let kind =
            crate::tensorfile::kind_of(f.info(&part.name).expect("located").dtype).expect("checked to be a float");
        let bytes = bytes.map_err(at)?;
        self.read.set(self.read.get() + bytes.len() as u64);
        let t = crate::checked::tensor(&bytes, read_shape, kind).map_err(at)?.to_kind(Kind::Float);
        let t = if part.transposed { t.tr().contiguous() } else { t };
        let finite = t.isfinite().sum(Kind::Int64).int64_value(&[]);
        if finite != t.numel() as i64 {
            return Err(at(format!("holds {} NaN or infinite values", t.numel() as i64 - finite)));
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::{Family, Transformer};

    fn write(path: &Path, tensors: &[(&str, Tensor)]) {
        let entries = tensors.iter().map(|(n, t)| crate::tensorfile::Entry::of(n.to_string(), t)).collect();
        crate::tensorfile::write(path, None, entries).unwrap();
    }

    #[test]
    fn rows_come_from_the_parts_that_hold_them_transposed_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let t = Transformer { vocab: 5, d_model: 4, heads: 2, layers: 1, seq_len: 3, ..Default::default() };
        let spec = Spec::of(&t);
        let mappings = Arch::Gpt2.mappings(&spec, "transformer.");
        // Every stored tensor holds its own values 0, 1, 2, ... (in bf16 for one of them).
        let tensors: Vec<(String, Tensor)> = mappings
            .iter()
            .flat_map(|m| m.parts.iter().map(move |p| (p.name.clone(), p.stored_shape(&m.shape))))
            .map(|(name, shape)| {
                let n: i64 = shape.iter().product();
                let kind = if name.ends_with("c_fc.weight") { Kind::BFloat16 } else { Kind::Float };
                (name, Tensor::arange(n, (kind, tch::Device::Cpu)).view(shape.as_slice()))
            })
            .collect();
        let refs: Vec<(&str, Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t.shallow_clone())).collect();
        write(&dir.path().join(WEIGHTS), &refs);
        let ckpt = Checkpoint::open(dir.path(), Arch::Gpt2, &spec).unwrap();
        let stored: HashMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        // qkv [12, 4] is c_attn [4, 12] transposed; rows 5..9 are its columns 5..9.
        let rows = ckpt.rows("blocks.0.qkv.weight", 5..9).unwrap();
        assert!(rows.equal(&stored["transformer.h.0.attn.c_attn.weight"].tr().narrow(0, 5, 4)));
        assert_eq!(ckpt.bytes_read(), 4 * 4 * 4, "4 values of each of 4 stored rows, nothing more");
        let fc = ckpt.whole("blocks.0.fc.weight").unwrap();
        assert!(fc.equal(&stored["transformer.h.0.mlp.c_fc.weight"].tr().to_kind(Kind::Float)));
        assert!(ckpt.rows("pos.weight", 1..3).unwrap().equal(&stored["transformer.wpe.weight"].narrow(0, 1, 2)));
        assert_eq!(ckpt.rows("tok.weight", 2..2).unwrap().size(), [0, 4]);
        // A tensor rank's columns: of proj [4, 4] (c_proj transposed) its stored rows 2..4, of
        // qkv its stored rows too; each read alone.
        let before = ckpt.bytes_read();
        assert!(ckpt.columns("blocks.0.proj.weight", 3..5).is_err(), "past its 4 columns");
        let proj = ckpt.columns("blocks.0.proj.weight", 2..4).unwrap();
        assert!(proj.equal(&stored["transformer.h.0.attn.c_proj.weight"].tr().narrow(1, 2, 2)));
        assert_eq!(ckpt.bytes_read() - before, 2 * 4 * 4, "2 stored rows of 4 values");
        let out = ckpt.columns("blocks.0.out.weight", 4..12).unwrap();
        assert!(out.equal(&stored["transformer.h.0.mlp.c_proj.weight"].tr().narrow(1, 4, 8)));
    }

    #[test]
    fn columns_of_a_stored_matrix_are_a_run_of_each_of_its_rows() {
        let dir = tempfile::tempdir().unwrap();
        let t = Transformer {
            family: Family::Llama,
            vocab: 5,
            d_model: 4,
            heads: 2,
            layers: 1,
            seq_len: 3,
            mlp_hidden: Some(6),
            ..Default::default()
        };
        let spec = Spec::of(&t);
        let mappings = Arch::Llama.mappings(&spec, "");
        let tensors: Vec<(String, Tensor)> = mappings
            .iter()
            .flat_map(|m| m.parts.iter().map(move |p| (p.name.clone(), p.stored_shape(&m.shape))))
            .map(|(name, shape)| {
                let n: i64 = shape.iter().product();
                (name, Tensor::arange(n, (Kind::Float, tch::Device::Cpu)).view(shape.as_slice()))
            })
            .collect();
        let refs: Vec<(&str, Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t.shallow_clone())).collect();
        write(&dir.path().join(WEIGHTS), &refs);
        let ckpt = Checkpoint::open(dir.path(), Arch::Llama, &spec).unwrap();
        let stored: HashMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        // down_proj [4, 6]: columns 3..6 are 3 values of each of its 4 rows.
        let out = ckpt.columns("blocks.0.out.weight", 3..6).unwrap();
        assert!(out.equal(&stored["model.layers.0.mlp.down_proj.weight"].narrow(1, 3, 3)));
        assert_eq!(ckpt.bytes_read(), 4 * 3 * 4);
        // fc is gate then up, fused by rows: each part's columns.
        let fc = ckpt.columns("blocks.0.fc.weight", 1..3).unwrap();
        let (gate, up) = (&stored["model.layers.0.mlp.gate_proj.weight"], &stored["model.layers.0.mlp.up_proj.weight"]);
        assert!(fc.equal(&Tensor::cat(&[gate.narrow(1, 1, 2), up.narrow(1, 1, 2)], 0)));
    }

    #[test]
    fn llama_s_fused_rows_span_their_parts_and_a_checkpoint_that_does_not_fit_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let t = Transformer {
            family: Family::Llama,
            vocab: 5,
            d_model: 4,
            heads: 2,
            kv_heads: Some(1),
            layers: 1,
            seq_len: 3,
            mlp_hidden: Some(3),
            ..Default::default()
        };
        let spec = Spec::of(&t);
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        for m in Arch::Llama.mappings(&spec, "") {
            for p in &m.parts {
                let shape = p.stored_shape(&m.shape);
                let n: i64 = shape.iter().product();
                let base = 100.0 * tensors.len() as f64;
                tensors.push((
                    p.name.clone(),
                    (Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) + base).view(shape.as_slice()),
                ));
            }
        }
        let refs: Vec<(&str, Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t.shallow_clone())).collect();
        write(&dir.path().join(WEIGHTS), &refs);
        let ckpt = Checkpoint::open(dir.path(), Arch::Llama, &spec).unwrap();
        let get = |n: &str| tensors.iter().find(|(m, _)| m == n).unwrap().1.shallow_clone();
        // qkv: q's 4 rows, k's 2, v's 2; rows 3..6 are q's last row and k's two.
        let rows = ckpt.rows("blocks.0.qkv.weight", 3..6).unwrap();
        let want = Tensor::cat(
            &[
                get("model.layers.0.self_attn.q_proj.weight").narrow(0, 3, 1),
                get("model.layers.0.self_attn.k_proj.weight"),
            ],
            0,
        );
        assert!(rows.equal(&want));
        let fc = ckpt.whole("blocks.0.fc.weight").unwrap();
        assert!(fc.equal(&Tensor::cat(
            &[get("model.layers.0.mlp.gate_proj.weight"), get("model.layers.0.mlp.up_proj.weight")],
            0
        )));

        // One missing, one misshapen, one extra.
        let mut bad: Vec<(&str, Tensor)> = refs
            .iter()
            .filter(|(n, _)| *n != "model.layers.0.mlp.up_proj.weight")
            .map(|(n, t)| (*n, t.shallow_clone()))
            .collect();
        bad.retain(|(n, _)| *n != "model.norm.weight");
        bad.push(("model.norm.weight", Tensor::zeros([5], (Kind::Float, tch::Device::Cpu))));
        bad.push(("model.layers.0.extra.weight", Tensor::zeros([1], (Kind::Float, tch::Device::Cpu))));
        write(&dir.path().join(WEIGHTS), &bad);
        let err = Checkpoint::open(dir.path(), Arch::Llama, &spec).err().unwrap();
        assert!(
            err.ends_with(
                "does not fit its config.json (LlamaForCausalLM): no `model.layers.0.mlp.up_proj.weight`; \
                 `model.norm.weight` is [5], config.json makes it [4]; unexpected `model.layers.0.extra.weight`"
            ),
            "{err}"
        );
    }
}
