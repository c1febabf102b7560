//! Instruction data for supervised fine-tuning (`load.source = "instructions"`): JSON Lines of
//! prompt/response pairs or chat `messages` ([`jsonl`]), or the same in parquet columns
//! ([`parquet`], a path ending in `.parquet`), rendered as text (a pair as prompt +
//! response + the tokenizer's `eos_token`; messages by the tokenizer's chat [`template`]) and
//! tokenized whole with the run's `tokenizer.json`. A token counts in the loss when its text lies
//! in a response: the response (and `eos_token`) of a pair; of a conversation, the text each
//! assistant message adds to the rendering (the rendering of the messages up to it, less the
//! rendering of those before it with the generation prompt), as masking after each response
//! template and before the next instruction template does (TRL's completion-only collator).
//!
//! Every example is one sample of `seq_len` + 1 tokens: its tokens, then padding whose targets do
//! not count (right padding under a causal mask leaves the example's own positions unchanged);
//! or, with `load.packing`, examples are packed in order into windows ([`pack`]) that the
//! transformer splits back apart (`model::transformer::packed`). An example longer than
//! `seq_len` + 1 tokens is refused or cut (`load.too_long`), and counted in the plan's note.
pub mod jsonl;
mod parquet;
mod show;
mod spec;
pub mod template;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::config::schema::TooLong;
use crate::tokenizer::{Tokenizer, TOKENIZER};
use jsonl::{Example, Line};
pub use show::show;
pub use spec::spec;
use template::TokenizerConfig;

/// The target of a position that does not count (cross-entropy's `ignore_index`).
pub const IGNORE: i64 = -100;

/// What the plan knows of an instruction source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InstructionsSpec {
    /// The JSON Lines (or parquet) file of training examples (and of the validation ones, from its end, when
    /// `validation_path` is absent).
    pub path: PathBuf,
    pub validation_path: Option<PathBuf>,
    /// The directory of `tokenizer.json` (and `tokenizer_config.json`).
    pub tokenizer: PathBuf,
    pub seq_len: usize,
    pub too_long: TooLong,
    /// Examples of `path` kept for training (the first ones); the rest validate when there is no
    /// `validation_path`.
    pub train_examples: usize,
    /// `load.packing`: the model's vocabulary, by which each token's example slot in its window
    /// is marked in its id ([`pack`]); `None`: each example padded.
    pub packed: Option<usize>,
    /// What the plan says of them.
    pub notes: Vec<String>,
}

impl InstructionsSpec {
    pub fn describe(&self) -> String {
        format!("{} (instructions, {})", self.path.display(), self.tokenizer.join(TOKENIZER).display())
    }

    /// Every file read, for the plan's digests.
    pub fn inputs(&self) -> Vec<(&'static str, PathBuf)> {
        let mut v = vec![("load.path", self.path.clone()), ("load.tokenizer", self.tokenizer.join(TOKENIZER))];
        for name in [template::CONFIG, template::JINJA] {
            let p = self.tokenizer.join(name);
            if p.is_file() {
                v.push(("load.tokenizer", p));
            }
        }
        v.extend(self.validation_path.iter().map(|p| ("load.validation_path", p.clone())));
        v
    }
}

/// One example, tokenized: at most `seq_len` + 1 ids, and whether each counts in the loss.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    /// Its line in its file (from 1; of parquet, its row).
    pub line: usize,
    /// The rendered text (before any cut).
    pub text: String,
    pub ids: Vec<u32>,
    pub counted: Vec<bool>,
    /// Tokens cut off its end (`load.too_long = "truncate"`).
    pub cut: usize,
}

/// The tokenizer and its chat template.
pub struct Encoder {
    pub tokenizer: Tokenizer,
    pub config: TokenizerConfig,
}

impl Encoder {
    /// The tokenizer of directory `dir`.
    pub fn open(dir: &Path) -> Result<Encoder, String> {
        let tokenizer = Tokenizer::read(&dir.join(TOKENIZER)).map_err(|e| format!("{e:#}"))?;
        Ok(Encoder { tokenizer, config: TokenizerConfig::read(dir)? })
    }

    /// The example's text and the byte ranges of it that count.
    pub fn render(&self, example: &Example) -> Result<(String, Vec<(usize, usize)>), String> {
        match example {
            Example::Pair { prompt, response } => {
                let eos = self.config.token("eos_token").unwrap_or("");
                Ok((
                    format!("{prompt}{response}{eos}"),
                    vec![(prompt.len(), prompt.len() + response.len() + eos.len())],
                ))
            }
            Example::Chat(messages) => {
                let whole = self.config.render(messages, false)?;
                let mut spans = Vec::new();
                for (i, m) in messages.iter().enumerate().filter(|(_, m)| m.role == "assistant") {
                    let before = self.config.render(&messages[..i], true)?;
                    let through = self.config.render(&messages[..=i], false)?;
                    if !through.starts_with(&before) || !whole.starts_with(&through) {
                        return Err(format!(
                            "the chat template does not render this conversation as a growing text (the messages up \
                             to message {i}, of role {}, are not a prefix of the whole), so the assistant's part of it \
                             cannot be found",
                            m.role
                        ));
                    }
                    spans.push((before.len(), through.len()));
                }
                Ok((whole, spans))
            }
        }
    }

    /// Example `line` of `file` tokenized, cut or refused when longer than `seq_len` + 1 tokens.
    pub fn encode(&self, file: &Path, line: &Line, seq_len: usize, too_long: TooLong) -> Result<Encoded, String> {
        let at = place(file, line.line);
        let (text, spans) = self.render(&line.example).map_err(|e| format!("{at}: {e}"))?;
        let (mut ids, starts) = self.tokenizer.encode_with_starts(&text).map_err(|e| format!("{at}: {e:#}"))?;
        let mut counted: Vec<bool> = starts.iter().map(|&s| spans.iter().any(|&(a, b)| a <= s && s < b)).collect();
        let (n, most) = (ids.len(), seq_len + 1);
        let cut = n.saturating_sub(most);
        if cut > 0 && too_long == TooLong::Error {
            return Err(format!(
                "{at}: the example is {n} tokens, longer than wrap.model.seq_len + 1 = {most}: raise seq_len, shorten \
                 it, or set load.too_long = \"truncate\" to keep its first {most} tokens"
            ));
        }
        ids.truncate(most);
        counted.truncate(most);
        // The first token is never a target.
        if !counted.iter().skip(1).any(|&c| c) {
            let why = if cut > 0 { format!(" within its first {most} tokens (it has {n})") } else { String::new() };
            return Err(format!(
                "{at}: no response token{why}: nothing in it counts in the loss; shorten the prompt or raise \
                 wrap.model.seq_len"
            ));
        }
        Ok(Encoded { line: line.line, text, ids, counted, cut })
    }

    /// Every example of `file`, tokenized; the first problem is the error.
    pub fn encode_file(&self, file: &Path, seq_len: usize, too_long: TooLong) -> Result<Vec<Encoded>, String> {
        read(file)?.iter().map(|l| self.encode(file, l, seq_len, too_long)).collect()
    }
}

/// Whether `file` is read as parquet (its name ends in `.parquet`) rather than JSON Lines.
fn is_parquet(file: &Path) -> bool {
    file.extension().is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}

/// Every example of `file`, JSON Lines or parquet by its name.
pub fn read(file: &Path) -> Result<Vec<Line>, String> {
    if is_parquet(file) {
        parquet::read(file)
    } else {
        jsonl::read(file)
    }
}

/// Where example `line` of `file` is, as refusals and `runner data` name it: `file:line` of
/// JSON Lines, `file row N` of parquet.
pub fn place(file: &Path, line: usize) -> String {
    if is_parquet(file) {
        format!("{} row {line}", file.display())
    } else {
        format!("{}:{line}", file.display())
    }
}

/// Inputs and targets (int64, N × `seq_len`) of `examples`: an example's first tokens are the
/// inputs and its next ones the targets, [`IGNORE`] where a target does not count and over the
/// padding (padding inputs are id 0, never attended by the example's own positions).
pub fn tensors(examples: &[Encoded], seq_len: usize) -> (Tensor, Tensor) {
    let mut x = vec![0i64; examples.len() * seq_len];
    let mut y = vec![IGNORE; examples.len() * seq_len];
    for (e, row) in examples.iter().zip(0..) {
        for p in 0..e.ids.len() - 1 {
            x[row * seq_len + p] = e.ids[p] as i64;
            if e.counted[p + 1] {
                y[row * seq_len + p] = e.ids[p + 1] as i64;
            }
        }
    }
    let shape = [examples.len() as i64, seq_len as i64];
    (Tensor::from_slice(&x).view(shape), Tensor::from_slice(&y).view(shape))
}

/// The windows of `seq_len` positions that `examples` pack into, in order: each window's
/// examples (an example takes its length - 1 positions; the next starts a new window when it
/// does not fit).
pub fn windows(examples: &[Encoded], seq_len: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut used = seq_len;
    for (i, e) in examples.iter().enumerate() {
        let n = e.ids.len() - 1;
        if used + n > seq_len {
            out.push(Vec::new());
            used = 0;
        }
        out.last_mut().expect("a window").push(i);
        used += n;
    }
    out
}

/// Inputs and targets (int64, windows × `seq_len`) of `examples` packed ([`windows`]): the
/// inputs are `id + vocab × slot`, slot the example's place in its window (the padding after
/// the last example a slot of its own), which the transformer reads as a block-diagonal causal
/// mask and positions from 0 per example (`model::transformer::packed`).
pub fn pack(examples: &[Encoded], seq_len: usize, vocab: usize) -> (Tensor, Tensor) {
    let windows = windows(examples, seq_len);
    let mut x = vec![0i64; windows.len() * seq_len];
    let mut y = vec![IGNORE; windows.len() * seq_len];
    for (w, members) in windows.iter().enumerate() {
        let mut at = w * seq_len;
        for (slot, &i) in members.iter().enumerate() {
            let e = &examples[i];
            for p in 0..e.ids.len() - 1 {
                x[at + p] = e.ids[p] as i64 + (vocab * slot) as i64;
                if e.counted[p + 1] {
                    y[at + p] = e.ids[p + 1] as i64;
                }
            }
            at += e.ids.len() - 1;
        }
        x[at..(w + 1) * seq_len].fill((vocab * members.len()) as i64);
    }
    let shape = [windows.len() as i64, seq_len as i64];
    (Tensor::from_slice(&x).view(shape), Tensor::from_slice(&y).view(shape))
}

/// The training and validation examples the plan describes, tokenized.
pub fn examples(spec: &InstructionsSpec) -> Result<(Vec<Encoded>, Vec<Encoded>), String> {
    let encoder = Encoder::open(&spec.tokenizer)?;
    let mut train = encoder.encode_file(&spec.path, spec.seq_len, spec.too_long)?;
    let validation = match &spec.validation_path {
        Some(v) => encoder.encode_file(v, spec.seq_len, spec.too_long)?,
        None => train.split_off(spec.train_examples.min(train.len())),
    };
    train.truncate(spec.train_examples);
    Ok((train, validation))
}

/// The plan's note on a set of examples: tokens, those in the loss, padding or packing, cuts.
fn note(name: &str, examples: &[Encoded], seq_len: usize, too_long: TooLong, packing: bool) -> String {
    let tokens: usize = examples.iter().map(|e| e.ids.len()).sum();
    let counted: usize = examples.iter().map(|e| e.counted.iter().skip(1).filter(|&&c| c).count()).sum();
    let rows = if packing { windows(examples, seq_len).len() } else { examples.len() };
    let how = if packing {
        format!("packed into {rows} windows of seq_len {seq_len}")
    } else {
        format!("each padded to seq_len {seq_len}")
    };
    let positions = rows * seq_len;
    let padding = positions - examples.iter().map(|e| e.ids.len() - 1).sum::<usize>();
    let cut = examples.iter().filter(|e| e.cut > 0).count();
    let cut = match too_long {
        TooLong::Truncate => {
            format!("; {cut} cut to seq_len + 1 = {} tokens (load.too_long = \"truncate\")", seq_len + 1)
        }
        TooLong::Error => String::new(),
    };
    format!(
        "instructions, {name}: {} examples, {tokens} tokens, {counted} of the targets in the loss (the responses); \
         {how}: {padding} of the {positions} positions are padding ({:.1}%){cut}",
        examples.len(),
        100.0 * padding as f64 / positions.max(1) as f64
    )
}

/// Reads the examples into a rank's rows: (train x, train y, validation x, validation y).
pub fn load(spec: &InstructionsSpec) -> Result<(Tensor, Tensor, Tensor, Tensor), String> {
    let (train, validation) = examples(spec)?;
    let rows = |e: &[Encoded]| match spec.packed {
        Some(vocab) => pack(e, spec.seq_len, vocab),
        None => tensors(e, spec.seq_len),
    };
    let ((x, y), (vx, vy)) = (rows(&train), rows(&validation));
    Ok((x, y, vx, vy))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_example_is_its_tokens_then_padding_and_only_its_counted_targets_count() {
        let e = Encoded {
            line: 1,
            text: String::new(),
            ids: vec![5, 6, 7, 8],
            counted: vec![false, false, true, true],
            cut: 0,
        };
        let (x, y) = tensors(&[e], 6);
        assert_eq!(Vec::<i64>::try_from(x.view([-1])).unwrap(), [5, 6, 7, 0, 0, 0]);
        assert_eq!(Vec::<i64>::try_from(y.view([-1])).unwrap(), [IGNORE, 7, 8, IGNORE, IGNORE, IGNORE]);
    }

    #[test]
    fn examples_pack_in_order_each_marked_with_its_slot() {
        let e = |ids: Vec<u32>| Encoded { line: 1, text: String::new(), counted: vec![true; ids.len()], ids, cut: 0 };
        // 3 + 2 positions fill a window of 5; the next (4) starts another, padded by slot 1.
        let examples = [e(vec![1, 2, 3, 4]), e(vec![5, 6, 7]), e(vec![8, 9, 1, 2, 3])];
        assert_eq!(windows(&examples, 5), [vec![0, 1], vec![2]]);
        let (x, y) = pack(&examples, 5, 10);
        assert_eq!(Vec::<i64>::try_from(x.view([-1])).unwrap(), [1, 2, 3, 15, 16, 8, 9, 1, 2, 10]);
        assert_eq!(Vec::<i64>::try_from(y.view([-1])).unwrap(), [2, 3, 4, 6, 7, 9, 1, 2, 3, IGNORE]);
    }
}
