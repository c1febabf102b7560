//! The plan's view of a language model's data: the stream's files, windows and split.
use std::path::Path;

use super::{resolve_paths, stream, Stream, TokenSpec};
use crate::config::schema::{Config, Load, Sampling, Source, Transformer};
use crate::data::{self, DataSpec, SourceSpec, Task};

/// The plan's view of a language model's data: windows of `t.seq_len` + 1 tokens of the files
/// `load.path` (or synthetic ones), every id checked to be below `t.vocab`, split by
/// `validate.fraction` / `validate.rows` (windows from the stream's end) or `load.validation_path`.
pub fn spec(c: &Config, t: &Transformer, base: &Path, bad: &mut impl FnMut(&str, String)) -> Option<DataSpec> {
    let load = &c.load;
    unread_keys(load, bad);
    if t.seq_len == 0 {
        bad("wrap.model.seq_len", "must be at least 1 token".into());
        return None;
    }
    let task = Task::LanguageModel { vocab: t.vocab, masked: false };
    if load.source == Source::Synthetic {
        return synthetic_spec(c, t, task, bad);
    }
    let source_name = if load.source == Source::Text { "text" } else { "tokens" };
    let Some(given) = &load.path else {
        bad("load.path", format!("source = \"{source_name}\" needs a path to the file"));
        return None;
    };
    let paths = match resolve_paths(given, base) {
        Ok(p) => p,
        Err(e) => {
            bad("load.path", e);
            return None;
        }
    };
    let whole = stream("load.path", &paths, load.source, t.vocab, bad)?;
    if whole.windows(t.seq_len) == 0 {
        bad(
            "wrap.model.seq_len",
            format!(
                "{} is longer than the data: {} holds {} tokens, and one window needs seq_len + 1 = {}",
                t.seq_len,
                paths[0].display(),
                whole.len,
                t.seq_len + 1
            ),
        );
        return None;
    }
    // load.rows: the stream's first windows only, as a file's first rows (then the split).
    let mut whole = whole;
    if let Some(rows) = load.rows {
        let held = whole.windows(t.seq_len);
        if rows > held {
            bad(
                "load.rows",
                format!("asks for {rows} windows but the data holds {held} of seq_len + 1 = {}", t.seq_len + 1),
            );
        }
        whole.len = whole.len.min(rows.min(held) * t.seq_len + 1);
    }
    let (train, validation) = split(c, t, whole, base, bad)?;
    let windows = train.windows(t.seq_len);
    let (validation_rows, validation_windows) = validation_windows(c, t, &validation, bad);
    if validation.windows(t.seq_len) == 0 && c.validate.every > 0 {
        bad(
            if load.validation_path.is_some() { "load.validation_path" } else { "validate.fraction" },
            format!(
                "leaves no validation window of seq_len + 1 = {} tokens ({} tokens)",
                t.seq_len + 1,
                validation.len
            ),
        );
    }
    let tokens = TokenSpec {
        source: load.source,
        train,
        validation,
        sampling: load.sampling,
        validation_windows,
        seed: c.run.seed,
    };
    Some(DataSpec { rows: windows, validation_rows, input: vec![t.seq_len], task, source: SourceSpec::Tokens(tokens) })
}

/// How many validation windows a validation pass reads, and whether they are a fixed number
/// (`validate.batches`) rather than the whole held-out stream.
fn validation_windows(
    c: &Config,
    t: &Transformer,
    validation: &Stream,
    bad: &mut impl FnMut(&str, String),
) -> (usize, Option<usize>) {
    let batch = c.train.batch_size;
    // Random sampling draws the fixed validation windows anywhere in the stream; epoch sampling
    // takes the first ones.
    match (c.validate.batches, c.load.sampling) {
        (Some(b), Sampling::Random) => (b * batch, Some(b * batch)),
        (Some(b), Sampling::Epoch) => {
            let held = validation.windows(t.seq_len);
            if let Some(why) = data::batches_beyond(b, batch, held, "windows") {
                bad("validate.batches", why);
            }
            let n = (b * batch).min(held);
            (n, Some(n))
        }
        (None, _) => (validation.windows(t.seq_len), None),
    }
}

/// The load keys a language model does not read (the synthetic ones are checked by its source).
fn unread_keys(load: &Load, bad: &mut impl FnMut(&str, String)) {
    for (key, given) in [("load.features", load.features.is_some()), ("load.classes", load.classes.is_some())] {
        if given {
            bad(
                key,
                "is not read by a language model: its inputs are wrap.model.seq_len token ids over wrap.model.vocab"
                    .into(),
            );
        }
    }
    if load.target.is_some() {
        bad("load.target", "is not read by a language model: the targets are the next tokens".into());
    }
    if load.source == Source::Synthetic {
        return;
    }
    if load.noise != Load::default().noise {
        bad("load.noise", "is only read by source = \"synthetic\"".into());
    }
    if load.validation_rows != Load::default().validation_rows {
        bad("load.validation_rows", "is only read by source = \"synthetic\"; a token file's validation windows are validate.fraction (default 0.2), validate.rows or load.validation_path".into());
    }
}

/// The training and validation streams: `load.validation_path`'s, or the last windows of `whole`.
fn split(
    c: &Config,
    t: &Transformer,
    whole: Stream,
    base: &Path,
    bad: &mut impl FnMut(&str, String),
) -> Option<(Stream, Stream)> {
    let holdout = data::split::holdout(c, bad)?;
    Some(match (&c.load.validation_path, holdout) {
        (Some(vp), _) => {
            let vpaths = match resolve_paths(&crate::config::schema::Paths::One(vp.clone()), base) {
                Ok(p) => p,
                Err(e) => {
                    bad("load.validation_path", e);
                    return None;
                }
            };
            let v = stream("load.validation_path", &vpaths, c.load.source, t.vocab, bad)?;
            (whole, v)
        }
        (None, Some(h)) => {
            let windows = whole.windows(t.seq_len);
            let held = match h {
                data::split::Holdout::Fraction(f) => ((windows as f64) * f).round() as usize,
                data::split::Holdout::Rows(r) => r,
            };
            if held >= windows {
                let key = if c.validate.rows.is_some() { "validate.rows" } else { "validate.fraction" };
                bad(key, format!("holds out {held} of the {windows} windows of seq_len + 1 = {} tokens: none is left to train on", t.seq_len + 1));
                return None;
            }
            let train_windows = windows - held;
            let cut = train_windows * t.seq_len;
            (whole.slice(0, cut + 1), whole.slice(cut, whole.len - cut))
        }
        (None, None) => unreachable!("a holdout or a validation file"),
    })
}

fn synthetic_spec(c: &Config, t: &Transformer, task: Task, bad: &mut impl FnMut(&str, String)) -> Option<DataSpec> {
    let load = &c.load;
    if load.path.is_some() {
        bad("load.path", "is only read by source = \"csv\", \"parquet\", \"tensors\", \"tokens\" or \"text\"".into());
    }
    if !(0.0..=1.0).contains(&load.noise) {
        bad("load.noise", format!("is the chance of a random next token in [0, 1], got {}", load.noise));
    }
    if load.sampling == Sampling::Random {
        bad("load.sampling", "\"random\" draws windows from a token file: use source = \"tokens\" or \"text\"".into());
    }
    let synthetic = data::synthetic::Spec { noise: load.noise, seed: c.run.seed };
    Some(DataSpec {
        rows: load.rows.unwrap_or(10_000),
        validation_rows: load.validation_rows,
        input: vec![t.seq_len],
        task,
        source: SourceSpec::Synthetic(synthetic),
    })
}
