//! `runner prepare text FILE --out DIR`: nanoGPT's character-level `prepare.py` for any UTF-8
//! text. The vocabulary is the text's characters in sorted order; the first 90% of the
//! characters are `train.bin`, the rest `val.bin` (token ids as little-endian uint16, what
//! `load.source = "tokens"` and nanoGPT's `np.memmap(..., dtype=np.uint16)` read), and
//! `meta.json` holds `vocab_size`, `itos` and `stoi` (nanoGPT writes them to meta.pkl).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// The file beside a token file that names its characters.
pub const META: &str = "meta.json";

/// The vocabulary of a token file: `meta.json` beside it.
pub fn meta_beside(file: &Path) -> PathBuf {
    file.parent().unwrap_or(Path::new(".")).join(META)
}

/// A character vocabulary as nanoGPT's prepare.py writes it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub vocab_size: usize,
    /// Token id (as a string, JSON's keys) → character.
    pub itos: BTreeMap<String, String>,
    pub stoi: BTreeMap<String, u32>,
}

impl Meta {
    /// The vocabulary of `text`: its distinct characters, sorted (Python's `sorted(set(data))`).
    pub fn of(text: &str) -> Meta {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let itos = chars.iter().enumerate().map(|(i, c)| (i.to_string(), c.to_string())).collect();
        let stoi = chars.iter().enumerate().map(|(i, c)| (c.to_string(), i as u32)).collect();
        Meta { vocab_size: chars.len(), itos, stoi }
    }

    /// Reads `meta.json` (nanoGPT's keys), checking that itos and stoi agree.
    pub fn read(path: &Path) -> anyhow::Result<Meta> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        let meta: Meta = serde_json::from_str(&text)
            .with_context(|| format!("{} is not a vocabulary (vocab_size, itos, stoi)", path.display()))?;
        let consistent = meta.itos.len() == meta.vocab_size
            && meta.stoi.len() == meta.vocab_size
            && meta.itos.iter().all(|(i, c)| meta.stoi.get(c).map(|s| s.to_string()).as_deref() == Some(i.as_str()));
        anyhow::ensure!(consistent, "{}: itos, stoi and vocab_size disagree", path.display());
        Ok(meta)
    }

    /// The ids of `text`; a character outside the vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        text.chars()
            .map(|c| {
                self.stoi
                    .get(&c.to_string())
                    .copied()
                    .with_context(|| format!("{c:?} is not in the vocabulary ({} characters)", self.vocab_size))
            })
            .collect()
    }

    /// The text of `ids`; an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[i64]) -> anyhow::Result<String> {
        ids.iter()
            .map(|i| {
                self.itos
                    .get(&i.to_string())
                    .map(String::as_str)
                    .with_context(|| format!("token id {i} is outside the vocabulary ({} characters)", self.vocab_size))
            })
            .collect()
    }
}

/// The files `runner prepare text` writes into its `--out` folder.
pub const OUTPUTS: [&str; 3] = ["train.bin", "val.bin", META];

/// Writes train.bin, val.bin and meta.json for `file` into `out`, all three or none; prints what
/// it wrote. Files already there are replaced only with `force`, and never the input itself.
pub fn text(file: &Path, out: &Path, force: bool) -> anyhow::Result<u8> {
    crate::input::regular_file(file).map_err(anyhow::Error::msg)?;
    let outputs: Vec<PathBuf> = OUTPUTS.iter().map(|name| out.join(name)).collect();
    check_outputs(file, out, &outputs, force)?;
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let data = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not UTF-8 text (byte {}): convert it first",
            file.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    let meta = Meta::of(&data);
    anyhow::ensure!(meta.vocab_size > 0, "{} is empty: there is nothing to prepare", file.display());
    anyhow::ensure!(
        meta.vocab_size <= 1 << 16,
        "{} has {} distinct characters, more than uint16 token ids hold (65536)",
        file.display(),
        meta.vocab_size
    );
    let ids = meta.encode(&data)?;
    // prepare.py: data[:int(n*0.9)] and data[int(n*0.9):], in characters.
    let cut = (ids.len() as f64 * 0.9) as usize;
    anyhow::ensure!(
        cut > 0 && cut < ids.len(),
        "{} holds {} character{}: train.bin (the first 90%) and val.bin (the rest) need one each at least; give a \
         longer text",
        file.display(),
        ids.len(),
        if ids.len() == 1 { "" } else { "s" }
    );
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let bin = |ids: &[u32]| -> Vec<u8> { ids.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect() };
    let json = serde_json::to_string_pretty(&meta)? + "\n";
    let mut staged = Staged::default();
    for (path, bytes) in outputs.iter().zip([bin(&ids[..cut]), bin(&ids[cut..]), json.into_bytes()]) {
        staged.write(path, &bytes)?;
    }
    staged.commit()?;
    crate::say!(
        "{}: {} characters, vocabulary of {}; train.bin {} tokens, val.bin {} tokens, meta.json in {}",
        file.display(),
        ids.len(),
        meta.vocab_size,
        cut,
        ids.len() - cut,
        out.display()
    );
    Ok(0)
}

/// Refuses outputs that are the input itself (whatever `force` says), and outputs that exist
/// unless `force`.
fn check_outputs(file: &Path, out: &Path, outputs: &[PathBuf], force: bool) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let input = std::fs::metadata(file).with_context(|| format!("cannot read {}", file.display()))?;
    let existing: Vec<&PathBuf> = outputs.iter().filter(|p| p.symlink_metadata().is_ok()).collect();
    for path in &existing {
        if std::fs::metadata(path).is_ok_and(|m| m.dev() == input.dev() && m.ino() == input.ino()) {
            return Err(ConfigError::new(format!(
                "{} is the input itself: prepare would replace the text with its token ids; choose another --out",
                path.display()
            ))
            .into());
        }
    }
    if !existing.is_empty() && !force {
        let names: Vec<String> = existing.iter().map(|p| p.display().to_string()).collect();
        return Err(ConfigError::new(format!(
            "{} already holds {}: pass --force to replace {}, or choose another --out",
            out.display(),
            names.join(", "),
            if existing.len() == 1 { "it" } else { "them" }
        ))
        .into());
    }
    Ok(())
}

/// Files that appear together or not at all: each is written and synced under a temporary name
/// beside its place, and [`Staged::commit`] renames them all into place once every one is
/// written. Dropped before that (an error, a panic), it removes what it wrote.
#[derive(Default)]
struct Staged {
    /// (temporary file, its place).
    files: Vec<(PathBuf, PathBuf)>,
}

impl Staged {
    fn write(&mut self, path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
        use std::io::Write;
        let tmp = crate::rundir::tmp_path(path);
        self.files.push((tmp.clone(), path.to_owned()));
        (|| -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()
        })()
        .with_context(|| format!("cannot write {}", path.display()))
    }

    fn commit(mut self) -> anyhow::Result<()> {
        for (tmp, path) in std::mem::take(&mut self.files) {
            std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
            }
        }
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (tmp, _) in &self.files {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_vocabulary_is_the_sorted_characters_and_round_trips() {
        let meta = Meta::of("hello, wörld\n");
        assert_eq!(meta.vocab_size, 11);
        assert_eq!(meta.itos["0"], "\n");
        assert_eq!(meta.stoi["ö"], 10);
        let ids = meta.encode("wörld").unwrap();
        let ids: Vec<i64> = ids.into_iter().map(i64::from).collect();
        assert_eq!(meta.decode(&ids).unwrap(), "wörld");
        assert!(meta.encode("x").unwrap_err().to_string().contains("'x' is not in the vocabulary"));
        assert!(meta.decode(&[11]).is_err());
    }
}
