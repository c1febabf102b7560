//! Hugging Face tokenizers: any `tokenizer.json` read, or a byte-level BPE trained, by the
//! `tokenizers` crate (the Rust code inside Python's `tokenizers`): the same file and text give
//! the same ids in both. Texts are encoded as they are, with no special token added
//! (`encode(text, add_special_tokens=False)`, tiktoken's `encode_ordinary`), and ids decoded
//! with the special tokens kept.
use std::path::{Path, PathBuf};

use anyhow::Context;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::AddedToken;

/// The file beside a token file that holds its tokenizer.
pub const TOKENIZER: &str = "tokenizer.json";
/// The one special token of a BPE trained here (id 0): GPT-2's end of a document. Nothing
/// inserts it; it is there for a user's document boundaries and for an export's `eos_token`.
pub const END_OF_TEXT: &str = "<|endoftext|>";
/// The smallest byte-level BPE: the 256 bytes and the end-of-text token, no merge.
pub const SMALLEST_BPE: usize = 257;

/// A tokenizer.json, read or trained.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Where it was read from, or will be written.
    path: PathBuf,
    /// Ids 0..size have a token (its largest id + 1).
    size: usize,
}

impl Tokenizer {
    /// Reads `path`; a file that is not a tokenizer.json is refused with the library's reason.
    pub fn read(path: &Path) -> anyhow::Result<Tokenizer> {
        crate::input::regular_file(path).map_err(anyhow::Error::msg)?;
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| {
            anyhow::anyhow!("{} is not a tokenizer.json that Hugging Face's tokenizers reads: {e}", path.display())
        })?;
        Ok(Tokenizer::new(inner, path))
    }

    fn new(inner: tokenizers::Tokenizer, path: &Path) -> Tokenizer {
        let size = inner.get_vocab(true).values().max().map_or(0, |&m| m as usize + 1);
        Tokenizer { inner, path: path.to_owned(), size }
    }

    /// A byte-level BPE of at most `vocab` tokens trained on the UTF-8 text `text`, to be written
    /// to `path`: GPT-2's scheme as Python's `ByteLevelBPETokenizer` trains it (GPT-2's
    /// pre-tokenizer regex, no prefix space, every byte in the base vocabulary so that any text
    /// encodes, merges of pairs seen at least twice, [`END_OF_TEXT`] as id 0). The text is read
    /// line by line, as `Tokenizer.train(files)` reads it. A text with fewer distinct pairs stops
    /// below `vocab`.
    pub fn train_bpe(text: &Path, vocab: usize, path: &Path) -> anyhow::Result<Tokenizer> {
        anyhow::ensure!(
            vocab >= SMALLEST_BPE,
            "--vocab {vocab} is too small for a byte-level BPE: its 256 bytes and {END_OF_TEXT} take {SMALLEST_BPE}; \
             give at least {SMALLEST_BPE}"
        );
        let trainer = BpeTrainerBuilder::new()
            .vocab_size(vocab)
            .min_frequency(2)
            .show_progress(false)
            .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build();
        let mut inner = tokenizers::Tokenizer::new(BPE::default());
        // Each part as Python sets it (`pre_tokenizers.ByteLevel(add_prefix_space=False)`,
        // `decoders.ByteLevel()`, `processors.ByteLevel(trim_offsets=False)`): the same file.
        inner.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        inner.with_decoder(Some(ByteLevel::default()));
        inner.with_post_processor(Some(ByteLevel::new(true, false, true)));
        let mut trainer = TrainerWrapper::from(trainer);
        let file = text.to_str().with_context(|| format!("{} is not a UTF-8 path", text.display()))?;
        inner
            .train_from_files(&mut trainer, vec![file.to_owned()])
            .map_err(|e| anyhow::anyhow!("training a BPE on {} failed: {e}", text.display()))?;
        Ok(Tokenizer::new(inner, path))
    }

    /// The ids of `text`, nothing added.
    pub fn encode(&self, text: &str) -> anyhow::Result<Vec<u32>> {
        let encoding = self.inner.encode_fast(text, false).map_err(|e| anyhow::anyhow!("{}: {e}", self.describe()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The ids of `text`, nothing added, each with the byte of `text` where its token starts.
    pub fn encode_with_starts(&self, text: &str) -> anyhow::Result<(Vec<u32>, Vec<usize>)> {
        let encoding = self.inner.encode(text, false).map_err(|e| anyhow::anyhow!("{}: {e}", self.describe()))?;
        Ok((encoding.get_ids().to_vec(), encoding.get_offsets().iter().map(|o| o.0).collect()))
    }

    /// The text of `ids` (bytes that make no character come out as U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> anyhow::Result<String> {
        self.inner.decode(ids, false).map_err(|e| anyhow::anyhow!("{}: {e}", self.describe()))
    }

    /// Ids 0..size have a token.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Where it was read from, or will be written (tokenizer.json beside the token files).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tokenizer.json, as Python's `Tokenizer.to_str(pretty=True)` writes it.
    pub fn to_json(&self) -> anyhow::Result<String> {
        self.inner.to_string(true).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", self.path.display()))
    }

    /// "a BPE tokenizer of 512 tokens (data/tokenizer.json)".
    pub fn describe(&self) -> String {
        use tokenizers::ModelWrapper;
        let kind = match self.inner.get_model() {
            ModelWrapper::BPE(_) => "BPE",
            ModelWrapper::WordPiece(_) => "WordPiece",
            ModelWrapper::WordLevel(_) => "WordLevel",
            ModelWrapper::Unigram(_) => "Unigram",
        };
        format!("a {kind} tokenizer of {} tokens ({})", self.size, self.path.display())
    }

    /// Whether a text encoded piece by piece, cut at line ends between two visible characters,
    /// gives the ids of the whole text: true of pre-tokenizers that always split there (GPT-2's
    /// and Llama 3's regexes, whitespace splitting), false of those that prepend something to
    /// every input (a prefix space, SentencePiece's ▁, a template's BOS) — asked of the
    /// tokenizer itself on a few such cuts.
    pub fn cuts_at_line_ends(&self) -> bool {
        const CUTS: [(&str, &str); 4] =
            [("Hello world.\n", "The end"), ("x\n", "y"), ("¿Qué?\n", "Ünïcødé 42"), ("a.\n", "'s")];
        CUTS.iter().all(|(a, b)| match (self.encode(&format!("{a}{b}")), self.encode(a), self.encode(b)) {
            (Ok(whole), Ok(x), Ok(y)) => whole == [x, y].concat(),
            _ => false,
        })
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trained_bpe_encodes_any_text_and_decodes_it_back() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("t.txt");
        std::fs::write(&text, "the cat sat on the mat.\nthe cat ate the rat.\n".repeat(20)).unwrap();
        let t = Tokenizer::train_bpe(&text, 300, &dir.path().join(TOKENIZER)).unwrap();
        assert!(t.size() > SMALLEST_BPE && t.size() <= 300, "{}", t.size());
        let ids = t.encode("the cat").unwrap();
        assert!(ids.len() < "the cat".len(), "merges shorten a seen text: {ids:?}");
        // Bytes it never saw still encode, one id per byte.
        let odd = "Ωμέγα → 🦀";
        assert_eq!(t.decode(&t.encode(odd).unwrap()).unwrap(), odd);
        assert_eq!(t.encode(END_OF_TEXT).unwrap(), [0]);
        assert!(t.cuts_at_line_ends());
        let e = Tokenizer::train_bpe(&text, 256, &dir.path().join(TOKENIZER)).unwrap_err();
        assert!(e.to_string().starts_with("--vocab 256 is too small for a byte-level BPE"), "{e}");
        std::fs::write(dir.path().join("bad.json"), "{\"model\": 3}").unwrap();
        let e = Tokenizer::read(&dir.path().join("bad.json")).unwrap_err().to_string();
        assert!(e.contains("bad.json is not a tokenizer.json that Hugging Face's tokenizers reads"), "{e}");
    }
}
