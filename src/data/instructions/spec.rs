//! The plan's view of instruction data: every example read, rendered and tokenized once (every
//! refusal names its file and line), split, and described in the plan's notes.
use std::path::{Path, PathBuf};

use super::{note, Encoded, Encoder, InstructionsSpec};
use crate::config::schema::{Config, Load, Paths, Sampling, Transformer, WrapStrategy};
use crate::data::{self, DataSpec, SourceSpec, Task};

/// The plan's view of `load.source = "instructions"` for the language model `t`.
pub fn spec(c: &Config, t: &Transformer, base: &Path, bad: &mut impl FnMut(&str, String)) -> Option<DataSpec> {
    refuse_unread_keys(&c.load, bad);
    if t.seq_len == 0 {
        bad("wrap.model.seq_len", "must be at least 1 token".into());
        return None;
    }
    let path = match &c.load.path {
        Some(Paths::One(p)) => base.join(p),
        Some(Paths::Many(_)) => {
            bad("load.path", "instructions are read from one file (JSON Lines, or parquet: a path ending in .parquet): give one path".into());
            return None;
        }
        None => {
            bad("load.path", "source = \"instructions\" needs a file of examples: JSON Lines, or parquet (a path ending in .parquet)".into());
            return None;
        }
    };
    if let Err(e) = crate::input::regular_file(&path) {
        bad("load.path", format!("{e} (paths are relative to the pipeline file)"));
        return None;
    }
    let (encoder, dir) = encoder(c, t, &path, base, bad)?;
    let read = |key: &str, p: &Path, bad: &mut dyn FnMut(&str, String)| {
        encoder.encode_file(p, t.seq_len, c.load.too_long).map_err(|e| bad(key, e)).ok()
    };
    let mut train = read("load.path", &path, bad)?;
    let (validation, validation_path) = split(c, base, &mut train, &read, bad)?;
    let (too_long, seq_len) = (c.load.too_long, t.seq_len);
    let packing = c.load.packing;
    if packing && c.wrap.strategy == WrapStrategy::Pipeline {
        bad(
            "load.packing",
            "is not built for wrap.strategy = \"pipeline\": the later stages, on other ranks, cannot tell the \
             examples of a window apart; use ddp or fsdp, or pad each example (load.packing = false)"
                .into(),
        );
    }
    let rows = |e: &[Encoded]| if packing { super::windows(e, seq_len).len() } else { e.len() };
    let mut notes = vec![note("training", &train, seq_len, too_long, packing)];
    if !validation.is_empty() {
        notes.push(note("validation", &validation, seq_len, too_long, packing));
    }
    let held = rows(&validation);
    let unit = if packing { "windows" } else { "examples" };
    let validation_rows = match c.validate.batches {
        Some(b) => {
            if let Some(why) = data::batches_beyond(b, c.train.batch_size, held, unit) {
                bad("validate.batches", why);
            }
            (b * c.train.batch_size).min(held)
        }
        None => held,
    };
    let spec = InstructionsSpec {
        path,
        validation_path,
        tokenizer: dir,
        seq_len,
        too_long,
        train_examples: train.len(),
        packed: packing.then_some(t.vocab),
        notes,
    };
    Some(DataSpec {
        rows: rows(&train),
        validation_rows,
        input: vec![seq_len],
        task: Task::LanguageModel { vocab: t.vocab, masked: true },
        source: SourceSpec::Instructions(spec),
    })
}

/// The tokenizer of `load.tokenizer` (default: the directory of the data file `path`), checked
/// against the model's vocabulary; and its directory.
fn encoder(
    c: &Config,
    t: &Transformer,
    path: &Path,
    base: &Path,
    bad: &mut impl FnMut(&str, String),
) -> Option<(Encoder, PathBuf)> {
    let dir = match &c.load.tokenizer {
        Some(dir) => base.join(dir),
        None => path.parent().unwrap_or(Path::new(".")).to_owned(),
    };
    let encoder = match Encoder::open(&dir) {
        Ok(e) => e,
        Err(e) => {
            let missing = c.load.tokenizer.is_none() && !dir.join(crate::tokenizer::TOKENIZER).exists();
            let hint = if missing { " (load.tokenizer names its directory)" } else { "" };
            bad("load.tokenizer", format!("{e}{hint}"));
            return None;
        }
    };
    if encoder.tokenizer.size() > t.vocab {
        bad(
            "wrap.model.vocab",
            format!(
                "{} is fewer than the {} token ids of {}: set wrap.model.vocab = {} or more",
                t.vocab,
                encoder.tokenizer.size(),
                encoder.tokenizer.path().display(),
                encoder.tokenizer.size()
            ),
        );
    }
    Some((encoder, dir))
}

type Read<'a> = dyn Fn(&str, &Path, &mut dyn FnMut(&str, String)) -> Option<Vec<Encoded>> + 'a;

/// The validation examples: `load.validation_path`'s, or the last of the training file's
/// (`validate.fraction`, default 0.2, or `validate.rows`), taken off `train`.
fn split(
    c: &Config,
    base: &Path,
    train: &mut Vec<Encoded>,
    read: &Read,
    bad: &mut impl FnMut(&str, String),
) -> Option<(Vec<Encoded>, Option<PathBuf>)> {
    let holdout = data::split::holdout(c, bad)?;
    let n = train.len();
    let (validation, validation_path) = match (&c.load.validation_path, holdout) {
        (Some(v), _) => {
            let v = base.join(v);
            if let Err(e) = crate::input::regular_file(&v) {
                bad("load.validation_path", format!("{e} (paths are relative to the pipeline file)"));
                return None;
            }
            (read("load.validation_path", &v, bad)?, Some(v))
        }
        (None, Some(h)) => {
            let held = match h {
                data::split::Holdout::Fraction(f) => ((n as f64) * f).round() as usize,
                data::split::Holdout::Rows(r) => r,
            };
            if held >= n {
                let key = if c.validate.rows.is_some() { "validate.rows" } else { "validate.fraction" };
                bad(key, format!("holds out {held} of the {n} examples: none is left to train on"));
                return None;
            }
            (train.split_off(n - held), None)
        }
        (None, None) => unreachable!("a holdout or a validation file"),
    };
    if validation.is_empty() && c.validate.every > 0 {
        bad(
            if validation_path.is_some() { "load.validation_path" } else { "validate.fraction" },
            format!("leaves no validation example of the {n}: hold out at least one, or set validate.every = 0"),
        );
    }
    Some((validation, validation_path))
}

/// Keys of other sources, refused by name rather than ignored.
fn refuse_unread_keys(load: &Load, bad: &mut impl FnMut(&str, String)) {
    let given = [
        ("load.features", load.features.is_some()),
        ("load.classes", load.classes.is_some()),
        ("load.target", load.target.is_some()),
        ("load.rows", load.rows.is_some()),
        ("load.noise", load.noise != Load::default().noise),
        ("load.validation_rows", load.validation_rows != Load::default().validation_rows),
        ("load.sampling", load.sampling != Sampling::Epoch),
    ];
    for (key, _) in given.iter().filter(|(_, g)| *g) {
        bad(
            key,
            "is not read by source = \"instructions\": every example of load.path is one sample (validation: \
             validate.fraction, validate.rows or load.validation_path)"
                .into(),
        );
    }
}
