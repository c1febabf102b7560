//! How a language model's token ids map to text and back: its vocabulary. Three kinds — the
//! characters of a `meta.json` (nanoGPT's character vocabulary, `runner prepare text`), bytes
//! (`load.source = "text"`), and a Hugging Face `tokenizer.json` (a byte-level BPE that `runner
//! prepare text --tokenizer bpe` trains, or any tokenizer.json it is given), which the
//! `tokenizers` crate applies exactly as Python's `tokenizers` does.
//!
//! A run's vocabulary is the file beside its token file ([`file_beside`]): the plan records it
//! with its digest, and `runner predict --prompt`, `runner eval` and an HF export read it back
//! with `Plan::read_vocabulary`, which refuses a file that changed since.
mod chars;
mod hf;
mod pieces;

use std::path::{Path, PathBuf};

use anyhow::Context;

pub use chars::{Meta, META};
pub use hf::{Tokenizer, END_OF_TEXT, SMALLEST_BPE, TOKENIZER};
pub use pieces::{pieces, Cut, PIECE};

/// A language model's vocabulary.
pub enum Vocabulary {
    /// Characters, from meta.json.
    Chars(Meta),
    /// Bytes (`load.source = "text"`), decoded as UTF-8.
    Bytes,
    /// A tokenizer.json (boxed: far larger than the others).
    Tokenizer(Box<Tokenizer>),
}

/// The vocabulary file beside the token file `file`: tokenizer.json, else meta.json, when one is there.
pub fn file_beside(file: &Path) -> Option<PathBuf> {
    let dir = file.parent().unwrap_or(Path::new("."));
    [TOKENIZER, META].iter().map(|name| dir.join(name)).find(|p| p.is_file())
}

impl Vocabulary {
    /// A vocabulary file: a tokenizer.json, or a meta.json (by its name).
    pub fn read(path: &Path) -> anyhow::Result<Vocabulary> {
        if path.file_name().is_some_and(|n| n == META) {
            Ok(Vocabulary::Chars(Meta::read(path)?))
        } else {
            Ok(Vocabulary::Tokenizer(Box::new(Tokenizer::read(path)?)))
        }
    }

    /// Why this vocabulary does not fit a model of `model_vocab` token ids, if it does not
    /// ("names 80 characters, more than ...", said of its file).
    pub fn exceeds(&self, model_vocab: usize) -> Option<String> {
        (self.size() > model_vocab).then(|| match self {
            Vocabulary::Chars(m) => format!(
                "names {} characters, more than the model's {model_vocab} token ids (wrap.model.vocab)",
                m.vocab_size
            ),
            _ => format!("has {} token ids, more than the model's {model_vocab} (wrap.model.vocab)", self.size()),
        })
    }

    /// Ids 0..size have text.
    pub fn size(&self) -> usize {
        match self {
            Vocabulary::Chars(m) => m.vocab_size,
            Vocabulary::Bytes => 256,
            Vocabulary::Tokenizer(t) => t.size(),
        }
    }

    /// The ids of `text` (a character outside a meta.json is an error naming it).
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        match self {
            Vocabulary::Chars(m) => m.encode(text),
            Vocabulary::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Vocabulary::Tokenizer(t) => t.encode(text),
        }
    }

    /// The text of `ids`; bytes that make no character come out as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        match self {
            Vocabulary::Chars(m) => m.decode(ids),
            Vocabulary::Bytes => Ok(String::from_utf8_lossy(&ids.iter().map(|&i| i as u8).collect::<Vec<u8>>()).into()),
            Vocabulary::Tokenizer(t) => t.decode(ids),
        }
    }

    /// The tokenizer.json, for an export to copy (`None` for characters and bytes).
    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        match self {
            Vocabulary::Tokenizer(t) => Some(t),
            _ => None,
        }
    }

    /// Where a text may be cut into pieces encoded one at a time with the same ids as the whole.
    pub fn cut(&self) -> Cut {
        match self {
            Vocabulary::Chars(_) | Vocabulary::Bytes => Cut::Anywhere,
            Vocabulary::Tokenizer(t) if t.cuts_at_line_ends() => Cut::LineEnds,
            Vocabulary::Tokenizer(_) => Cut::Never,
        }
    }

    /// Encodes the UTF-8 text `path` piece by piece ([`pieces`]), handing each piece's ids to
    /// `sink`: the ids of the whole text. Returns the text's length in bytes.
    pub fn encode_file(&self, path: &Path, sink: &mut dyn FnMut(&[u32]) -> anyhow::Result<()>) -> anyhow::Result<u64> {
        self.encode_pieces(path, PIECE, sink)
    }

    fn encode_pieces(
        &self,
        path: &Path,
        piece: usize,
        sink: &mut dyn FnMut(&[u32]) -> anyhow::Result<()>,
    ) -> anyhow::Result<u64> {
        pieces(path, self.cut(), piece, &mut |piece| {
            let ids = self.encode(piece).with_context(|| path.display().to_string())?;
            sink(&ids)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ids of `path` encoded in pieces of about `piece` bytes, and how many pieces.
    fn in_pieces(v: &Vocabulary, path: &Path, piece: usize) -> (Vec<u32>, usize) {
        let (mut ids, mut n) = (Vec::new(), 0);
        v.encode_pieces(path, piece, &mut |p| {
            ids.extend_from_slice(p);
            n += 1;
            Ok(())
        })
        .unwrap();
        (ids, n)
    }

    #[test]
    fn a_text_encoded_in_pieces_has_the_ids_of_the_whole_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.txt");
        let text =
            "ROMEO.\nBut soft, what light through yonder window breaks?  \n\nJULIET.\nAy me; ô Roméo!\n".repeat(80);
        std::fs::write(&path, &text).unwrap();
        let bpe =
            Vocabulary::Tokenizer(Box::new(Tokenizer::train_bpe(&path, 400, &dir.path().join(TOKENIZER)).unwrap()));
        assert_eq!(bpe.cut(), Cut::LineEnds);
        for v in [bpe, Vocabulary::Chars(Meta::of(&text)), Vocabulary::Bytes] {
            let (ids, n) = in_pieces(&v, &path, 100);
            assert!(n > 20, "{n} pieces");
            assert_eq!(ids, v.encode(&text).unwrap());
            assert_eq!(v.decode(&ids).unwrap(), text);
        }
    }

    #[test]
    fn a_tokenizer_that_prefixes_every_input_is_not_cut() {
        // SentencePiece's scheme: every input starts with "▁".
        let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁",
            "prepend_scheme": "always", "split": true}, "post_processor": null,
            "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "▁a": 1, "▁b": 2, "\n": 3, "▁a\n": 4},
            "unk_token": "[UNK]"}}"#;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(TOKENIZER), json).unwrap();
        let t = Tokenizer::read(&dir.path().join(TOKENIZER)).unwrap();
        assert!(!t.cuts_at_line_ends());
        let v = Vocabulary::Tokenizer(Box::new(t));
        assert_eq!(v.cut(), Cut::Never);
        let path = dir.path().join("t.txt");
        std::fs::write(&path, "a\nb\n".repeat(100)).unwrap();
        let (ids, n) = in_pieces(&v, &path, 10);
        assert_eq!((ids, n), (v.encode(&"a\nb\n".repeat(100)).unwrap(), 1));
    }
}
