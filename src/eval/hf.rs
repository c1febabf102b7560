//! `runner eval MODEL_DIR DATA` of a Hugging Face model directory (a base model before any
//! fine-tuning): its `config.json` gives the model, as `wrap.init` does for a run; a text is
//! encoded with the directory's own `tokenizer.json`. The ranks need a plan to start under and
//! build the model from: the one a pipeline of this directory and DATA makes (written in the
//! evaluation's temporary folder), so that the checkpoint is read and checked exactly as a run
//! that starts from it reads and checks it.
use std::path::{Path, PathBuf};

use anyhow::Context;
use tch::nn;

use crate::config::schema::Source;
use crate::config::ConfigError;
use crate::data::tokens::{self, Stream};
use crate::model::hf;
use crate::plan::Plan;
use crate::tokenizer::{Vocabulary, TOKENIZER};

/// Windows per forward pass on each rank when `--batch-size` is not given (a directory has no
/// train.batch_size).
pub const BATCH: usize = 8;

/// Whether `dir` is a Hugging Face model directory rather than a run directory.
pub fn is_model_dir(dir: &Path) -> bool {
    !dir.join(crate::rundir::PLAN).exists() && dir.join(hf::CONFIG).is_file()
}

/// The plan the ranks evaluate `dir` under, at `seq_len` (default: the checkpoint's
/// `max_position_embeddings`), and `data` as a stream of token ids (a text encoded in `tmp`).
pub fn prepare(dir: &Path, data: &Path, seq_len: Option<usize>, tmp: &Path) -> anyhow::Result<(Plan, Stream)> {
    let (_, t) = hf::read_config(dir).map_err(ConfigError::new)?;
    let max = t.max_positions.unwrap_or(t.seq_len);
    let seq_len = seq_len.unwrap_or(max);
    if seq_len == 0 || seq_len > max {
        return Err(ConfigError::new(format!(
            "--seq-len {seq_len}: {} takes windows of 1 to {max} tokens (its max_position_embeddings)",
            dir.join(hf::CONFIG).display()
        ))
        .into());
    }
    let file = match data.extension().and_then(|e| e.to_str()) {
        Some("bin" | "npy") => data.to_owned(),
        _ => encode(dir, data, tmp)?,
    };
    let stream =
        tokens::scanned_stream(std::slice::from_ref(&file), Source::Tokens, t.vocab).map_err(ConfigError::new)?;
    super::enough(&stream, data, seq_len)?;
    let pipeline = tmp.join("pipeline.toml");
    std::fs::write(&pipeline, pipeline_text(dir, &file, seq_len)?)?;
    let plan = Plan::new(crate::config::resolve(&pipeline, &[])?)?;
    Ok((plan, stream))
}

/// `data`, a UTF-8 text, encoded with `dir/tokenizer.json` into a token file in `tmp`.
fn encode(dir: &Path, data: &Path, tmp: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join(TOKENIZER);
    if !path.is_file() {
        return Err(ConfigError::new(format!(
            "{} is a text, but {} has no {TOKENIZER} to encode it with: give token ids (a .bin of uint16 or an \
             .npy), or put the model's {TOKENIZER} in the directory",
            data.display(),
            dir.display()
        ))
        .into());
    }
    let vocabulary = Vocabulary::read(&path)?;
    let file = tmp.join(tokens::token_file_name("data", vocabulary.size()));
    let mut w = tokens::TokenWriter::create(&file, vocabulary.size())?;
    vocabulary.encode_file(data, &mut |ids| Ok(w.push(ids)?))?;
    w.finish()?;
    Ok(file)
}

/// A pipeline that starts from `dir` on the token file `tokens`: one window a batch, so that any
/// file with a window makes a plan (the evaluation cuts its own windows and batches).
fn pipeline_text(dir: &Path, tokens: &Path, seq_len: usize) -> anyhow::Result<String> {
    let absolute = |p: &Path| std::path::absolute(p).with_context(|| format!("{}", p.display()));
    let text = format!(
        "[run]\nname = \"eval\"\n\n[load]\nsource = \"tokens\"\npath = {}\n\n[normalize]\nmethod = \"none\"\n\n\
         [wrap]\ninit = {}\n\n[wrap.model]\nkind = \"transformer\"\nseq_len = {seq_len}\n\n\
         [train]\nsteps = 1\nbatch_size = 1\n\n[validate]\nevery = 0\n",
        toml::Value::String(absolute(tokens)?.display().to_string()),
        toml::Value::String(absolute(dir)?.display().to_string()),
    );
    Ok(text)
}

/// The plan's model with its initial weights (the directory's), built on `device` for inference.
pub fn module(plan: &Plan, device: tch::Device) -> anyhow::Result<(nn::VarStore, Box<dyn nn::ModuleT + 'static>)> {
    let arch = plan.model();
    let vs = nn::VarStore::new(device);
    let model = arch.build(&vs.root(), 0..arch.layers().len(), &crate::model::BuildContext::new(plan.config.run.seed));
    let init = plan.init_weights.as_ref().context("the evaluation's plan has no wrap.init")?;
    crate::model::load_init(init, &plan.config.wrap.model, &vs)?;
    Ok((vs, model))
}
