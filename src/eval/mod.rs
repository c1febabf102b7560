//! `runner eval RUN_DIR DATA`: a trained language model's loss, perplexity and next-token
//! accuracy on a token file or a text, and the tokens per second it took; or of a Hugging Face
//! model directory's weights, before any training ([`hf`]). DATA is cut as
//! validation cuts a token stream: windows of seq_len + 1 tokens at stride seq_len, every whole
//! one (the loss is the mean over windows of each window's mean cross-entropy, the validation
//! loss's definition, so that evaluating a run's validation file gives its validation loss).
//!
//! A `.bin` (uint16) or `.npy` is read as token ids, checked below wrap.model.vocab; any other
//! file is a UTF-8 text, encoded piece by piece with the run's vocabulary
//! ([`Plan::read_vocabulary`]) into a temporary token file first (a run of
//! `load.source = "text"` reads it as bytes). Either way the file is never loaded: like
//! `runner run`, this process launches `--world-size` rank processes ([`crate::launch::spawn`],
//! supervised the same way), which share the windows in contiguous blocks, read them where
//! they lie, each with the whole model on its device in float32, and all-reduce their sums.
mod hf;
mod rank;

use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::config::schema::{Model, Source};
use crate::config::ConfigError;
use crate::data::tokens::{self, Stream};
use crate::launch::spawn::{self, Topology};
use crate::plan::Plan;

pub use rank::rank;

/// What to evaluate with.
#[derive(Debug, Clone)]
pub struct Options {
    /// Ranks (default: the run's run.world_size).
    pub world_size: Option<usize>,
    /// Windows per forward pass on each rank (default: the run's train.batch_size).
    pub batch_size: Option<usize>,
    /// Tokens per window (default: the run's seq_len, a directory's max_position_embeddings).
    pub seq_len: Option<usize>,
    /// Print the results as one JSON object.
    pub json: bool,
}

/// What the launcher hands its ranks (a JSON file in its temporary folder).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Job {
    /// The run directory, or the Hugging Face model directory.
    run_dir: PathBuf,
    /// The plan the ranks start under and build the model of.
    plan: PathBuf,
    /// Whether the model is the plan's initial weights (a model directory's), not a run's trained model.
    initial: bool,
    stream: Stream,
    seq_len: usize,
    /// Whole windows in the stream.
    windows: usize,
    batch: usize,
    threads: usize,
    /// Where rank 0 writes the [`Results`].
    results: PathBuf,
}

/// An evaluation's numbers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Results {
    pub run_dir: PathBuf,
    pub data: PathBuf,
    /// Tokens in DATA (after encoding a text).
    pub data_tokens: usize,
    pub windows: usize,
    pub seq_len: usize,
    /// Tokens predicted: windows × seq_len.
    pub tokens: usize,
    pub loss: f64,
    pub perplexity: f64,
    pub accuracy: f64,
    pub world_size: usize,
    pub threads_per_rank: usize,
    /// The slowest rank's time over its windows, from the first read to the last forward pass.
    pub seconds: f64,
    pub tokens_per_s: f64,
}

/// Evaluates the run in `run_dir` (or the Hugging Face model directory) on `data`.
pub fn eval(run_dir: &Path, data: &Path, o: &Options) -> anyhow::Result<u8> {
    crate::input::regular_file(data).map_err(ConfigError::new)?;
    let tmp = tempfile::Builder::new().prefix("runner-eval-").tempdir().context("cannot make a temporary folder")?;
    let initial = hf::is_model_dir(run_dir);
    let (plan, stream, plan_file) = if initial {
        let (plan, stream) = hf::prepare(run_dir, data, o.seq_len, tmp.path())?;
        let file = tmp.path().join(crate::rundir::PLAN);
        plan.save(&file)?;
        (plan, stream, file)
    } else {
        let file = run_dir.join(crate::rundir::PLAN);
        let plan = Plan::load(&file)?;
        let stream = run_stream(&plan, run_dir, data, o.seq_len, tmp.path())?;
        (plan, stream, file)
    };
    // Both kinds were checked to be transformers, at this seq_len (a directory's plan has it).
    let Model::Transformer(t) = &plan.config.wrap.model else { unreachable!("checked to be a transformer") };
    let seq_len = o.seq_len.unwrap_or(t.seq_len);
    let world = o.world_size.unwrap_or(plan.world_size());
    if world == 0 || world > crate::limits::MAX_WORLD_SIZE {
        return Err(ConfigError::new(format!("--world-size must be 1 to {}", crate::limits::MAX_WORLD_SIZE)).into());
    }
    let batch = o.batch_size.unwrap_or(if initial { hf::BATCH } else { plan.config.train.batch_size });
    if batch == 0 {
        return Err(ConfigError::new("--batch-size must be at least 1 window").into());
    }
    let windows = stream.windows(seq_len);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = plan.config.run.threads_per_rank.unwrap_or((cores / world).max(1));
    let job = Job {
        run_dir: run_dir.to_owned(),
        plan: plan_file,
        initial,
        stream: stream.clone(),
        seq_len,
        windows,
        batch,
        threads,
        results: tmp.path().join("results.json"),
    };
    let job_file = tmp.path().join("job.json");
    std::fs::write(&job_file, serde_json::to_string(&job)?)?;
    // The ranks run under the run's supervision settings (timeouts, abort_after_s).
    let mut launched = plan.clone();
    launched.config.run.world_size = world;
    launched.threads_per_rank = threads;
    let args = ["eval".into(), "--job".into(), job_file.into_os_string()];
    let outcome = spawn::launch(&launched, &Topology::single(), tmp.path(), &args, None, None)?;
    if let Some(sig) = outcome.interrupted {
        crate::say_err!("\ninterrupted by {}: no result", crate::signals::name(sig));
        return Ok(128 + sig as u8);
    }
    if let Some(f) = &outcome.failure {
        crate::say_err!("error: the evaluation failed: {}", f.summary());
        for line in &f.stderr_tail {
            crate::say_err!("    {line}");
        }
        return Ok(1);
    }
    let text = std::fs::read_to_string(&job.results).context("the ranks ended without a result")?;
    let mut results: Results = serde_json::from_str(&text)?;
    (results.data, results.data_tokens) = (data.to_owned(), stream.len);
    if o.json {
        crate::say!("{}", serde_json::to_string_pretty(&results)?);
    } else {
        say(&results);
    }
    Ok(0)
}

/// The trained model of the run in `run_dir` and `data` as its stream of windows of `seq_len`
/// (default: the run's) tokens.
fn run_stream(plan: &Plan, run_dir: &Path, data: &Path, seq_len: Option<usize>, tmp: &Path) -> anyhow::Result<Stream> {
    let Model::Transformer(t) = &plan.config.wrap.model else {
        let why = format!("runner eval measures a language model, not this run's {}", plan.model().describe());
        return Err(ConfigError::new(why).into());
    };
    crate::checkpoint::model::trained_model(run_dir)?;
    let max = crate::model::transformer::Spec::of(t).max_positions;
    if let Some(n) = seq_len.filter(|&n| n == 0 || n > max) {
        return Err(
            ConfigError::new(format!("--seq-len {n}: the run's model takes windows of 1 to {max} tokens")).into()
        );
    }
    let stream = token_stream(plan, t.vocab, data, tmp)?;
    enough(&stream, data, seq_len.unwrap_or(t.seq_len))?;
    Ok(stream)
}

/// A stream that holds at least one window of `seq_len` + 1 tokens (a shorter one is the
/// command line's mistake: exit code 2).
fn enough(stream: &Stream, data: &Path, seq_len: usize) -> anyhow::Result<()> {
    if stream.windows(seq_len) == 0 {
        let why = format!(
            "{} holds {} tokens, and one window needs seq_len + 1 = {}: give a longer text",
            data.display(),
            stream.len,
            seq_len + 1
        );
        return Err(ConfigError::new(why).into());
    }
    Ok(())
}

/// `data` as a stream of token ids below `vocab`: a token file as it is; a text as bytes for a
/// run of `load.source = "text"`, else encoded with the run's vocabulary into a token file in `tmp`.
fn token_stream(plan: &Plan, vocab: usize, data: &Path, tmp: &Path) -> anyhow::Result<Stream> {
    let text_run = matches!(&plan.data.source, crate::data::SourceSpec::Tokens(s) if s.source == Source::Text);
    let (file, source) = match data.extension().and_then(|e| e.to_str()) {
        Some("bin" | "npy") => (data.to_owned(), Source::Tokens),
        _ if text_run => (data.to_owned(), Source::Text),
        _ => {
            let vocabulary = plan.read_vocabulary()?;
            let file = tmp.join(tokens::token_file_name("data", vocabulary.size()));
            let mut w = tokens::TokenWriter::create(&file, vocabulary.size())?;
            vocabulary.encode_file(data, &mut |ids| Ok(w.push(ids)?))?;
            w.finish()?;
            (file, Source::Tokens)
        }
    };
    tokens::scanned_stream(&[file], source, vocab).map_err(|e| ConfigError::new(e).into())
}

/// The results as a person reads them.
fn say(r: &Results) {
    let ranks = if r.world_size == 1 { "1 rank".to_owned() } else { format!("{} ranks", r.world_size) };
    crate::say!(
        "{}: {} windows of {} + 1 tokens of {} ({} tokens predicted of {}), {ranks} × {} thread{}",
        r.run_dir.display(),
        r.windows,
        r.seq_len,
        r.data.display(),
        r.tokens,
        r.data_tokens,
        r.threads_per_rank,
        if r.threads_per_rank == 1 { "" } else { "s" }
    );
    crate::say!(
        "  loss {:.4}  perplexity {:.4}  accuracy {:.4}  {:.0} tokens/s ({:.0} per rank, {:.2}s)",
        r.loss,
        r.perplexity,
        r.accuracy,
        r.tokens_per_s,
        r.tokens_per_s / r.world_size as f64,
        r.seconds
    );
}
