//! nanoGPT's character vocabulary: a text's distinct characters in sorted order, kept in
//! `meta.json` beside the token files (nanoGPT pickles the same dictionary to `meta.pkl`).
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
        Meta::of_chars(text.chars())
    }

    /// The vocabulary of these characters, sorted and each once.
    pub fn of_chars(chars: impl IntoIterator<Item = char>) -> Meta {
        let mut chars: Vec<char> = chars.into_iter().collect();
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
    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
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
        assert_eq!(meta.decode(&ids).unwrap(), "wörld");
        assert!(meta.encode("x").unwrap_err().to_string().contains("'x' is not in the vocabulary"));
        assert!(meta.decode(&[11]).is_err());
    }
}
