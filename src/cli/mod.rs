//! The command line: `runner run`, `runner sweep`, `runner report`, `runner validate` and the
//! rest. This module holds the commands and their dispatch; `args` the arguments of each, `run`
//! what `runner run` does as a rank or before it launches, `launcher` what it does as the launcher,
//! `resume` how a run directory is continued.
use std::path::Path;

use clap::{Parser, Subcommand};

use crate::config::{self, ConfigError, Override};
use crate::launch::env::RankEnv;
use crate::plan::Plan;
use crate::rundir;

mod args;
mod launcher;
mod resume;
mod run;

pub use args::*;

#[derive(Debug, Parser)]
#[command(
    name = "runner",
    version,
    about = "Runs distributed data-parallel training experiments described by TOML files",
    after_help = "Example:\n  runner run pipelines/ddp.toml --set train.lr=0.01\n\n\
                  Read first: README.md; every page: docs/README.md"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a pipeline: world_size rank processes on this machine (or, under torchrun, this rank).
    #[command(
        after_help = "Examples:\n  runner run pipelines/ddp.toml --set train.lr=0.01 --set run.world_size=2\n  \
                            runner run --resume results/ddp/<run-id>\n\n\
                            Read: docs/guide/first-run.md, docs/guide/resume.md"
    )]
    Run(RunArgs),
    /// Run every point of an experiment's grid (or a search at each), then write its tables and plots.
    #[command(
        after_help = "Examples:\n  runner sweep experiments/world_size.toml --check\n  runner sweep experiments/search.toml\n\n\
                      Read: docs/guide/sweeps.md, docs/guide/search.md"
    )]
    Sweep(SweepArgs),
    /// Rebuild a sweep directory's tables and plots from its traces; run nothing.
    #[command(after_help = "Example:\n  runner report results/world_size\n\nRead: docs/guide/sweeps.md")]
    Report(ReportArgs),
    /// Check a pipeline and print its resolved plan (the data-flow table); run nothing.
    #[command(after_help = "Example:\n  runner validate pipelines/ddp.toml --set run.world_size=2\n\n\
                            Read: docs/guide/configuration.md, docs/reference/configuration.md")]
    Validate(ValidateArgs),
    /// Show a pipeline's data before training: the first rows of the load, shard and normalize
    /// stages' outputs, per rank, with each column's statistics; run nothing.
    #[command(after_help = "Example:\n  runner data pipelines/ddp.toml --rank 0 --rows 3\n\n\
                            Read: docs/guide/your-data.md")]
    Data(DataArgs),
    /// Print the JSON Schema of pipeline files, for editors that complete and check keys as you
    /// type (taplo / Even Better TOML read a `#:schema PATH` first line).
    #[command(after_help = "Example:\n  runner schema > pipelines/schema.json\n\n\
                            Read: docs/guide/configuration.md, docs/reference/configuration.md")]
    Schema(SchemaArgs),
    /// Measure the runner against the same pipeline in PyTorch DDP under torchrun, side by side
    /// (installs the reference's PyTorch into .deps/reference on first use, about 5 GB).
    #[command(after_help = "Example:\n  runner bench --quick --workload overhead-bound --world-sizes 1,2\n\n\
                            Read: docs/benchmarks.md")]
    Bench(BenchArgs),
    /// Apply a finished run's preprocessing and model to a csv or parquet file: predictions as
    /// parquet, and the metrics when the file holds the target column. For a language model,
    /// --prompt prints text sampled after it instead.
    #[command(after_help = "Examples:\n  runner predict results/cancer new_rows.csv --out predictions.parquet\n  \
                            runner predict results/book --prompt \"PROSPERO:\" --tokens 200\n\n\
                            Read: docs/guide/your-data.md, docs/guide/language-models.md")]
    Predict(PredictArgs),
    /// Write a finished run's model in another format: a Hugging Face model directory.
    #[command(after_help = "Example:\n  runner export results/book/<run-id> --hf book-hf\n\n\
                            Read: docs/guide/hugging-face.md")]
    Export(ExportArgs),
    /// A language model's loss, perplexity and accuracy on a token file or a text, over ranks
    /// that share its windows; the file is read where it lies, never loaded.
    #[command(after_help = "Examples:\n  runner eval results/book data/book/val.bin\n  \
                            runner eval results/book more_text.txt --world-size 2 --json\n  \
                            runner eval models/tiny-llama data/tempest-bpe/val.bin --seq-len 128\n\n\
                            Read: docs/guide/language-models.md")]
    Eval(EvalArgs),
    /// Make data files for the runner from other formats.
    #[command(subcommand)]
    Prepare(PrepareCommand),
}

/// Exit codes: 0 done, 1 the run failed, 2 the configuration is wrong.
/// The `run.numerics` a command computes under: its pipeline's (or its run directory's), resolved
/// before anything runs so that `main` can set MKL up; the default where the configuration does
/// not resolve (the command itself then reports why). None for commands that compute under no
/// plan of their own.
pub fn numerics_of(cli: &Cli) -> Option<crate::config::schema::CpuNumerics> {
    let resolved = |file: &Path, set: &[String], set_as: &[String]| {
        config::resolve(file, &overrides(set, set_as)).map(|r| r.config.run.numerics).unwrap_or_default()
    };
    match &cli.command {
        // A rank the launcher started inherits the environment the launcher set and checked, and
        // sets up its own process (oneDNN off under portable numerics) by the saved plan.
        Command::Run(RunArgs { plan: Some(plan), .. }) => Some(Plan::numerics_in(plan)),
        Command::Run(args) => match (&args.file, &args.resume) {
            (Some(file), _) => Some(resolved(file, &args.set, &args.set_as)),
            (None, Some(dir)) => Some(resolved(&dir.join(rundir::CONFIG), &args.set, &args.set_as)),
            (None, None) => Some(Default::default()),
        },
        Command::Validate(ValidateArgs { config: args, .. }) | Command::Data(DataArgs { config: args, .. }) => {
            Some(resolved(&args.file, &args.set, &args.set_as))
        }
        Command::Predict(args) => Some(resolved(&args.run_dir.join(rundir::CONFIG), &[], &[])),
        // Its ranks inherit the MKL_CBWR the launcher set.
        Command::Eval(args) if args.job.is_some() => None,
        Command::Eval(args) => args.run_dir.as_ref().map(|d| resolved(&d.join(rundir::CONFIG), &[], &[])),
        Command::Sweep(_)
        | Command::Bench(_)
        | Command::Schema(_)
        | Command::Report(_)
        | Command::Prepare(_)
        | Command::Export(_) => None,
    }
}

/// What the process is, for its signals ([`crate::signals`]): `runner run` is a rank when its
/// launcher (runner's own, torchrun or srun) says so, else a launcher.
pub fn signal_role(cli: &Cli) -> crate::signals::Role {
    use crate::signals::Role;
    match &cli.command {
        Command::Run(args) if args.plan.is_some() || !matches!(RankEnv::from_env(), Ok(None)) => Role::Rank,
        Command::Run(_) => Role::Launcher,
        Command::Eval(args) if args.job.is_none() => Role::Launcher,
        _ => Role::Other,
    }
}

pub fn main(cli: Cli) -> u8 {
    let result = match cli.command {
        Command::Validate(args) => validate(&args),
        Command::Data(args) => {
            let options = crate::preview::Options { rows: args.rows, rank: args.rank };
            plan(&args.config).map_err(anyhow::Error::from).and_then(|p| crate::preview::show(&p, &options)).map(|()| 0)
        }
        Command::Schema(args) => {
            let text = if args.markdown { crate::config::reference::markdown() } else { schema_json() };
            // The schema is the command's product (redirected into a file): unlike a run's
            // progress, writing it must not fail silently.
            crate::say::write_all(&text).map(|()| 0).map_err(|e| {
                anyhow::anyhow!("cannot write the schema to standard output ({e}): nothing complete was written")
            })
        }
        Command::Run(args) => run::run(&args),
        Command::Sweep(args) => crate::sweep::sweep(
            &args.file,
            &crate::sweep::Options {
                out: args.out,
                fail_fast: args.fail_fast,
                force: args.force,
                check: args.check,
                launcher: args.launcher,
                tolerance: args.tolerance,
            },
        ),
        Command::Report(args) => crate::report::write(&args.dir).map(|table| {
            crate::say!("{table}");
            0
        }),
        Command::Predict(args) => predict(&args),
        Command::Eval(args) => eval(&args),
        Command::Prepare(PrepareCommand::Text { file, out, force, tokenizer, vocab }) => {
            crate::prepare::Choice::of(&tokenizer, vocab)
                .map_err(anyhow::Error::from)
                .and_then(|choice| crate::prepare::text(&file, &out, force, &choice))
        }
        Command::Export(args) => export(&args),
        Command::Bench(args) => crate::bench::bench(&crate::bench::Options {
            quick: args.quick,
            repetitions: if args.quick { 1 } else { args.repetitions as usize },
            world_sizes: args.world_sizes.iter().map(|w| *w as usize).collect(),
            workloads: args.workloads,
            out: args.out,
            precisions: args.precision,
        }),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            let code = if e.downcast_ref::<ConfigError>().is_some() { 2 } else { 1 };
            let prefix = match RankEnv::from_env() {
                Ok(Some(env)) => format!("error: rank {}: ", env.rank),
                _ => "error: ".into(),
            };
            crate::say_err!("{prefix}{e:#}");
            code
        }
    }
}

/// `runner predict`: text sampled from a language model after a prompt, or a model's predictions
/// over a data file.
fn predict(args: &PredictArgs) -> anyhow::Result<u8> {
    match (&args.prompt, &args.data) {
        (Some(prompt), _) => crate::sample::sample(
            &args.run_dir,
            &crate::sample::Options {
                prompt: prompt.clone(),
                tokens: args.tokens,
                temperature: args.temperature,
                top_k: args.top_k,
                seed: args.seed,
            },
        ),
        (None, Some(data)) => crate::predict::predict(
            &args.run_dir,
            data,
            args.out.as_deref(),
            &crate::predict::Options { model: args.model.clone(), set: args.set.clone() },
        ),
        (None, None) => unreachable!("clap requires DATA or --prompt"),
    }
}

/// `runner eval`: a run's model measured on a data file (or, with `--job`, one rank of it).
fn eval(args: &EvalArgs) -> anyhow::Result<u8> {
    match (&args.job, &args.run_dir, &args.data) {
        (Some(job), _, _) => crate::eval::rank(job),
        (None, Some(run_dir), Some(data)) => crate::eval::eval(
            run_dir,
            data,
            &crate::eval::Options {
                world_size: args.world_size,
                batch_size: args.batch_size,
                seq_len: args.seq_len,
                json: args.json,
            },
        ),
        _ => unreachable!("clap requires RUN_DIR and DATA without --job"),
    }
}

/// `runner export`: a run's model as a Hugging Face directory, or its adapters for PEFT.
fn export(args: &ExportArgs) -> anyhow::Result<u8> {
    crate::export::parse_size(&args.max_shard_size)
        .map_err(|e| anyhow::Error::new(ConfigError::new(format!("--max-shard-size: {e}"))))
        .and_then(|max| {
            let hf = args.hf.as_ref().map(|out| crate::export::export(&args.run_dir, out, max)).transpose()?;
            let peft = args.peft.as_ref().map(|out| crate::export::export_peft(&args.run_dir, out)).transpose()?;
            Ok(hf.or(peft).unwrap_or(0))
        })
}

/// The pipeline file's JSON Schema, generated from the serde types that read it, its keys sorted:
/// the same bytes from every build (serde_json keeps insertion order in a build whose
/// dependencies enable its `preserve_order`, as the tests' do, and sorts otherwise), so that
/// `runner schema > pipelines/schema.json` never reorders the committed file.
pub fn schema_json() -> String {
    fn sorted(v: serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::Object(map) => {
                let mut entries: Vec<(String, serde_json::Value)> = map.into_iter().collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                serde_json::Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
            }
            serde_json::Value::Array(items) => serde_json::Value::Array(items.into_iter().map(sorted).collect()),
            other => other,
        }
    }
    let schema = sorted(crate::config::reference::json_schema(false));
    serde_json::to_string_pretty(&schema).expect("a schema serializes")
}

/// `train.precision = "bf16"` on a CPU whose bfloat16 matmuls are slower than its float32 ones:
/// a warning with both rates, measured by a probe of about a second.
pub(super) fn warn_of_slow_bf16(plan: &Plan) {
    use crate::config::schema::{Device, Precision};
    let t = &plan.config.train;
    if t.precision == Precision::Bf16 && plan.config.run.device == Device::Cpu {
        if let Some(warning) = crate::bench::peak::bf16_warning(plan.threads_per_rank) {
            crate::say_err!("{warning}");
        }
    }
}

/// The overrides of a command line: `--set-as LABEL KEY=VALUE` pairs (a sweep's), then `--set`.
pub(super) fn overrides(set: &[String], set_as: &[String]) -> Vec<Override> {
    let labelled = set_as.chunks(2).map(|pair| Override { label: pair[0].clone(), text: pair[1].clone() });
    labelled.chain(set.iter().map(|s| Override::set(s))).collect()
}

pub fn plan(args: &ConfigArgs) -> Result<Plan, ConfigError> {
    crate::numerics::check_environment().map_err(ConfigError::new)?;
    Plan::new(config::resolve(&args.file, &overrides(&args.set, &args.set_as))?)
}

fn validate(va: &ValidateArgs) -> anyhow::Result<u8> {
    let args = &va.config;
    let plan = match &va.device {
        None => plan(args)?,
        // Another machine's device: its checks against this build and machine are that machine's.
        Some(device) => {
            crate::numerics::check_environment().map_err(ConfigError::new)?;
            let mut sets = overrides(&args.set, &args.set_as);
            sets.push(Override { label: "--device".into(), text: format!("run.device=\"{device}\"") });
            Plan::elsewhere(config::resolve(&args.file, &sets)?)?
        }
    };
    if !plan.extends.is_empty() {
        let chain: Vec<String> =
            std::iter::once(&plan.pipeline_file).chain(&plan.extends).map(|f| f.display().to_string()).collect();
        crate::say!("extends: {}\n", chain.join(" → "));
    }
    crate::say!("{}", plan.data_flow().trim_end_matches('\n'));
    // What this machine's libtorch sees says nothing of the machine a run is planned for.
    let device = if va.device.is_some() { Vec::new() } else { crate::device::notes(plan.config.run.device) };
    for note in plan.data.notes().iter().cloned().chain(crate::numerics::notes()).chain(device) {
        crate::say!("{note}");
    }
    warn_of_slow_bf16(&plan);
    for line in crate::stages::track::plan_lines(&plan, None) {
        crate::say!("{line}");
    }
    crate::say!("\n{} is valid; nothing was run.", args.file.display());
    Ok(0)
}
