//! `runner prepare text FILE --out DIR`: nanoGPT's character-level `prepare.py` for any UTF-8
//! text. The vocabulary is the text's characters in sorted order; the first 90% of the
//! characters are `train.bin`, the rest `val.bin` (token ids as little-endian uint16, what
//! `load.source = "tokens"` and nanoGPT's `np.memmap(..., dtype=np.uint16)` read), and
//! `meta.json` holds `vocab_size`, `itos` and `stoi` (nanoGPT writes them to meta.pkl).
use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use serde::{Deserialize, Serialize};

/// The file beside a token file that names its characters.
pub const META: &str = "meta.json";

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

/// Writes train.bin, val.bin and meta.json for `file` into `out`; prints what it wrote.
pub fn text(file: &Path, out: &Path) -> anyhow::Result<u8> {
    crate::input::regular_file(file).map_err(anyhow::Error::msg)?;
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
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let bin = |ids: &[u32]| -> Vec<u8> { ids.iter().flat_map(|&i| (i as u16).to_le_bytes()).collect() };
    crate::rundir::atomic_write(&out.join("train.bin"), &bin(&ids[..cut]))?;
    crate::rundir::atomic_write(&out.join("val.bin"), &bin(&ids[cut..]))?;
    let json = serde_json::to_string_pretty(&meta)? + "\n";
    crate::rundir::atomic_write(&out.join(META), json.as_bytes())?;
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
