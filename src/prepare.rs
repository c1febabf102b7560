//! `runner prepare text FILE --out DIR`: a UTF-8 text turned into token files, as nanoGPT's
//! `prepare.py` scripts make them. `--tokenizer` chooses the vocabulary:
//! - `chars` (the default): nanoGPT's character-level prepare.py, the text's distinct characters
//!   in sorted order, written to `meta.json` (`vocab_size`, `itos`, `stoi`; nanoGPT pickles them);
//! - `bpe` with `--vocab N`: a byte-level BPE of at most N tokens trained on the text (Hugging
//!   Face's `tokenizers`), written to `tokenizer.json`;
//! - a tokenizer.json FILE: any Hugging Face tokenizer, copied to `tokenizer.json`.
//!
//! The text is encoded whole (in pieces with the same ids, [`crate::tokenizer::pieces`], so that
//! its size is not bound by memory); the first 90% of its tokens are `train`, the rest `val`
//! (nanoGPT's split, `int(n * 0.9)`): `train.bin` and `val.bin` of little-endian uint16 ids
//! while the vocabulary fits 16 bits (what `load.source = "tokens"` and nanoGPT's
//! `np.memmap(..., dtype=np.uint16)` read), `train.npy` and `val.npy` of uint32 past 65,536 ids.
use std::path::{Path, PathBuf};

use anyhow::Context;

use crate::config::ConfigError;
use crate::data::tokens::{token_file_name, TokenWriter, UINT16_IDS};
use crate::tokenizer::{Meta, Tokenizer, Vocabulary, META, TOKENIZER};

/// The vocabulary `runner prepare text` makes or takes.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    /// The text's characters (meta.json).
    Chars,
    /// A byte-level BPE of at most `vocab` tokens, trained on the text (tokenizer.json).
    Bpe { vocab: usize },
    /// This tokenizer.json.
    File(PathBuf),
}

impl Choice {
    /// `--tokenizer` and `--vocab` as given.
    pub fn of(tokenizer: &str, vocab: Option<usize>) -> Result<Choice, ConfigError> {
        let choice = match tokenizer {
            "chars" => Choice::Chars,
            "bpe" => match vocab {
                Some(vocab) => return Ok(Choice::Bpe { vocab }),
                None => return Err(ConfigError::new("--tokenizer bpe needs --vocab N, the most tokens it may have")),
            },
            file => Choice::File(PathBuf::from(file)),
        };
        match vocab {
            Some(_) => Err(ConfigError::new(format!(
                "--vocab sizes a BPE trained on the text (--tokenizer bpe); --tokenizer {tokenizer} has its own vocabulary"
            ))),
            None => Ok(choice),
        }
    }
}

/// Every file `runner prepare text` may write into its `--out` folder.
pub const OUTPUTS: [&str; 6] = ["train.bin", "val.bin", META, TOKENIZER, "train.npy", "val.npy"];

/// Writes the token files and the vocabulary of `file` into `out`, all or none, and prints what it
/// wrote. Files already there are replaced only with `force` (then the other files of an earlier
/// prepare go too), and never the input itself.
pub fn text(file: &Path, out: &Path, force: bool, choice: &Choice) -> anyhow::Result<u8> {
    // The text named on the command line: a missing one is a usage error (2), as a missing pipeline file.
    crate::input::regular_file(file).map_err(ConfigError::new)?;
    let known: Vec<PathBuf> = OUTPUTS.iter().map(|name| out.join(name)).collect();
    check_outputs(file, out, &known, force)?;
    // One pass checks the text (UTF-8, not empty) and gathers its characters.
    let mut chars = std::collections::BTreeSet::new();
    let mut count = 0u64;
    let bytes =
        crate::tokenizer::pieces(file, crate::tokenizer::Cut::Anywhere, crate::tokenizer::PIECE, &mut |piece| {
            count += piece.chars().count() as u64;
            if *choice == Choice::Chars {
                chars.extend(piece.chars());
            }
            Ok(())
        })?;
    if bytes == 0 {
        return Err(ConfigError::new(format!("{} is empty: there is nothing to prepare", file.display())).into());
    }
    let (vocabulary, vocabulary_file) = match choice {
        Choice::Chars => {
            let meta = Meta::of_chars(chars);
            anyhow::ensure!(
                meta.vocab_size <= UINT16_IDS,
                "{} has {} distinct characters, more than uint16 token ids hold ({UINT16_IDS})",
                file.display(),
                meta.vocab_size
            );
            let json = serde_json::to_string_pretty(&meta)? + "\n";
            (Vocabulary::Chars(meta), (META, json.into_bytes()))
        }
        Choice::Bpe { vocab } => {
            let t = Tokenizer::train_bpe(file, *vocab, &out.join(TOKENIZER))?;
            let json = t.to_json()?.into_bytes();
            (Vocabulary::Tokenizer(Box::new(t)), (TOKENIZER, json))
        }
        Choice::File(path) => {
            let t = Tokenizer::read(path)?;
            let json = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
            (Vocabulary::Tokenizer(Box::new(t)), (TOKENIZER, json))
        }
    };
    let size = vocabulary.size();
    let names = [token_file_name("train", size), token_file_name("val", size)];
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut staged = Staged::default();
    let (train, val) = write_split(&vocabulary, file, out, &names, &mut staged, count)?;
    staged.write(&out.join(vocabulary_file.0), &vocabulary_file.1)?;
    let written: Vec<PathBuf> = [&names[0], &names[1], vocabulary_file.0].iter().map(|n| out.join(n)).collect();
    staged.commit(out, &known.into_iter().filter(|p| !written.contains(p)).collect::<Vec<_>>())?;
    let [t, v] = &names;
    let (f, o) = (file.display(), out.display());
    match &vocabulary {
        Vocabulary::Chars(_) => crate::say!(
            "{f}: {} characters, vocabulary of {size}; {t} {train} tokens, {v} {val} tokens, {META} in {o}",
            train + val
        ),
        _ => {
            let made = match choice {
                Choice::Bpe { vocab } => {
                    format!("a byte-level BPE of {size} token ids trained on it (at most {vocab})")
                }
                Choice::File(path) => format!("the tokenizer of {}, {size} token ids", path.display()),
                Choice::Chars => unreachable!("characters are said above"),
            };
            crate::say!(
                "{f}: {count} characters, {} tokens; {made}; {t} {train} tokens, {v} {val} tokens, {TOKENIZER} in {o}",
                train + val
            )
        }
    }
    Ok(0)
}

/// Encodes `file` into the staged token files `names` (train, val) in `out`: every id into the
/// first, then the last 10% moved to the second. Returns their token counts.
fn write_split(
    vocabulary: &Vocabulary,
    file: &Path,
    out: &Path,
    names: &[String; 2],
    staged: &mut Staged,
    chars: u64,
) -> anyhow::Result<(u64, u64)> {
    let [train, val] = names.clone().map(|n| out.join(n));
    let cannot = |path: &Path| format!("cannot write {}", path.display());
    let mut w = TokenWriter::create(&staged.place(&train), vocabulary.size()).with_context(|| cannot(&train))?;
    vocabulary.encode_file(file, &mut |ids| w.push(ids).with_context(|| cannot(&train)))?;
    let n = w.count();
    let cut = (n as f64 * 0.9) as u64;
    if cut == 0 || cut == n {
        let what = match vocabulary {
            Vocabulary::Chars(_) => format!("holds {chars} character{}", if chars == 1 { "" } else { "s" }),
            _ => format!("encodes to {n} token{}", if n == 1 { "" } else { "s" }),
        };
        let why = format!(
            "{} {what}: {} (the first 90%) and {} (the rest) need one each at least; give a longer text",
            file.display(),
            names[0],
            names[1]
        );
        return Err(ConfigError::new(why).into());
    }
    let rest = TokenWriter::create(&staged.place(&val), vocabulary.size()).with_context(|| cannot(&val))?;
    w.split_off(cut, rest).with_context(|| format!("cannot write {} and {}", train.display(), val.display()))
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
    /// The temporary name to write `path` under; the file becomes `path` at [`Staged::commit`].
    fn place(&mut self, path: &Path) -> PathBuf {
        let tmp = crate::rundir::tmp_path(path);
        self.files.push((tmp.clone(), path.to_owned()));
        tmp
    }

    fn write(&mut self, path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
        use std::io::Write;
        let tmp = self.place(path);
        (|| -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(bytes)?;
            f.sync_all()
        })()
        .with_context(|| format!("cannot write {}", path.display()))
    }

    /// Renames every file into place in `dir`, then removes `stale` (an earlier prepare's other files).
    fn commit(mut self, dir: &Path, stale: &[PathBuf]) -> anyhow::Result<()> {
        for (tmp, path) in std::mem::take(&mut self.files) {
            std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
        }
        for path in stale.iter().filter(|p| p.symlink_metadata().is_ok()) {
            std::fs::remove_file(path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
        // The renames and removals last past a crash.
        let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
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
