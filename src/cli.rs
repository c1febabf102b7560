//! The command line: `runner run`, `runner sweep`, `runner report`, `runner validate`.
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

use crate::checkpoint;
use crate::config::{self, ConfigError, Override};
use crate::launch::agree;
use crate::launch::env::{Launcher, RankEnv};
use crate::launch::rank;
use crate::launch::slurm;
use crate::launch::spawn::{self, Topology};
use crate::plan::Plan;
use crate::rundir;
use crate::rundir::lock::{self, RunLock};
use crate::rundir::manifest::Reshard;
use crate::rundir::manifest::{Manifest, Status};
use crate::stages::preempt;
use crate::trace::view;

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
    /// Run every point of an experiment's grid, then write its tables and plots.
    #[command(
        after_help = "Example:\n  runner sweep experiments/world_size.toml --check\n\nRead: docs/guide/sweeps.md"
    )]
    Sweep(SweepArgs),
    /// Rebuild a sweep directory's tables and plots from its traces; run nothing.
    #[command(after_help = "Example:\n  runner report results/world_size\n\nRead: docs/guide/sweeps.md")]
    Report(ReportArgs),
    /// Check a pipeline and print its resolved plan (the data-flow table); run nothing.
    #[command(after_help = "Example:\n  runner validate pipelines/ddp.toml --set run.world_size=2\n\n\
                            Read: docs/guide/configuration.md, docs/reference/configuration.md")]
    Validate(ConfigArgs),
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
    /// Make data files for the runner from other formats.
    #[command(subcommand)]
    Prepare(PrepareCommand),
}

#[derive(Debug, Args)]
pub struct SchemaArgs {
    /// Print the configuration reference instead, as Markdown: every key with its type, default
    /// and doc comment (docs/reference/configuration.md is this output).
    #[arg(long)]
    pub markdown: bool,
}

#[derive(Debug, Subcommand)]
pub enum PrepareCommand {
    /// A UTF-8 text as nanoGPT's character-level prepare.py makes it: train.bin and val.bin
    /// (uint16 ids, the first 90% of the characters and the rest) and meta.json (the vocabulary).
    #[command(after_help = "Example:\n  runner prepare text pipelines/data/tempest.txt --out data/book\n\n\
                            Read: docs/guide/language-models.md")]
    Text {
        /// The text file.
        file: PathBuf,
        /// The folder the three files go to (created if missing).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Replace train.bin, val.bin or meta.json already in DIR.
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, Args)]
pub struct PredictArgs {
    /// The run directory (results/<name>/<run-id>).
    pub run_dir: PathBuf,
    /// A csv or parquet file with the run's feature columns.
    #[arg(required_unless_present = "prompt")]
    pub data: Option<PathBuf>,
    /// Where the predictions go [default: RUN_DIR/predictions.parquet]
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    pub out: Option<PathBuf>,
    /// A language model: the text to continue (in the run's vocabulary).
    #[arg(long, conflicts_with = "data")]
    pub prompt: Option<String>,
    /// New tokens to sample after the prompt.
    #[arg(long, default_value_t = 500, requires = "prompt")]
    pub tokens: usize,
    /// Divides the logits: below 1 sharper, above 1 more random.
    #[arg(long, default_value_t = 0.8, requires = "prompt")]
    pub temperature: f64,
    /// Draw only among the k most likely tokens.
    #[arg(long, default_value_t = 200, requires = "prompt")]
    pub top_k: usize,
    /// Seeds the draws: the same seed, the same text.
    #[arg(long, default_value_t = 1337, requires = "prompt")]
    pub seed: u64,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// One repetition per cell; print the results, do not write them.
    #[arg(long)]
    pub quick: bool,
    /// Repetitions per workload and world size, runner and PyTorch alternating.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub repetitions: u64,
    /// World sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4", value_parser = clap::value_parser!(u64).range(1..=64))]
    pub world_sizes: Vec<u64>,
    /// Only these workloads (repeatable, or comma-separated) [default: all]
    #[arg(long = "workload", value_name = "NAME", value_delimiter = ',', value_parser = ["overhead-bound", "compute-bound", "cnn", "transformer", "fsdp"])]
    pub workloads: Vec<String>,
    /// Where the results go (the part between the markers is replaced; notes around it are kept).
    #[arg(long, value_name = "FILE", default_value = "benches/RESULTS.md")]
    pub out: PathBuf,
    /// Precisions, comma-separated: fp32, and bf16 (the runner's train.precision = "bf16" against
    /// torch.autocast("cpu", dtype=torch.bfloat16)); each workload runs in each.
    #[arg(long, value_delimiter = ',', default_value = "fp32", value_parser = ["fp32", "bf16"])]
    pub precision: Vec<String>,
}

#[derive(Debug, Args)]
pub struct ConfigArgs {
    /// The pipeline file (TOML).
    pub file: PathBuf,
    /// Override a value, e.g. --set train.lr=0.05 (repeatable; wins over file and environment).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// An override with the source config.toml names for it (`runner sweep` passes its axes so).
    #[arg(long = "set-as", num_args = 2, value_names = ["LABEL", "KEY=VALUE"], hide = true)]
    pub set_as: Vec<String>,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The pipeline file (TOML); with --resume, defaults to the run directory's config.toml.
    #[arg(required_unless_present_any = ["resume", "plan"])]
    pub file: Option<PathBuf>,
    /// The resolved plan a launcher saved (`runner run` passes it to the ranks it spawns).
    #[arg(long, value_name = "PLAN_JSON", hide = true, conflicts_with = "file")]
    pub plan: Option<PathBuf>,
    /// Override a value, e.g. --set train.lr=0.05 (repeatable; wins over file and environment).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// An override with the source config.toml names for it (`runner sweep` passes its axes so).
    #[arg(long = "set-as", num_args = 2, value_names = ["LABEL", "KEY=VALUE"], hide = true)]
    pub set_as: Vec<String>,
    /// The run directory [default: results/<run.name>/<run-id>]
    #[arg(long, value_name = "DIR", conflicts_with = "resume")]
    pub out: Option<PathBuf>,
    /// Continue the run in DIR from its newest checkpoint, on every rank.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Run in --out even when it holds files the runner did not write or another run's
    /// results (the runner still only replaces its own files there).
    #[arg(long, conflicts_with = "resume")]
    pub force: bool,
    /// Number of nodes, one `runner run` on each (as torchrun's --nnodes) [default: SLURM_NNODES,
    /// else 1]
    #[arg(long)]
    pub nnodes: Option<usize>,
    /// This node's index, 0 to nnodes - 1; node 0 hosts the rendezvous store [default:
    /// SLURM_NODEID, else 0]
    #[arg(long)]
    pub node_rank: Option<usize>,
    /// Node 0's address, reachable from every node (needed with --nnodes > 1).
    #[arg(long, value_name = "HOST")]
    pub master_addr: Option<String>,
    /// The port of node 0's rendezvous store [default: under Slurm, 15000 + the job id's last
    /// four digits; otherwise 29500]
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
}

/// A count given as a flag, or else by a Slurm variable: its value and how to name it.
fn flag_or_slurm(flag: Option<usize>, name: &str, var: &str, default: usize) -> Result<(usize, String), ConfigError> {
    if let Some(n) = flag {
        return Ok((n, format!("{name} {n}")));
    }
    match std::env::var(var).ok().filter(|v| !v.trim().is_empty()) {
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) => Ok((n, format!("{var}={n}"))),
            Err(_) => Err(ConfigError::new(format!("{var}={v:?} is not a number (it gives {name} under Slurm)"))),
        },
        None => Ok((default, format!("{name} {default}"))),
    }
}

impl RunArgs {
    fn topology(&self, world_size: usize) -> Result<Topology, ConfigError> {
        let (nnodes, nnodes_from) = flag_or_slurm(self.nnodes, "--nnodes", "SLURM_NNODES", 1)?;
        if nnodes <= 1 {
            return Ok(Topology::single());
        }
        let (node_rank, node_from) = flag_or_slurm(self.node_rank, "--node-rank", "SLURM_NODEID", 0)?;
        let fail = |m: String| Err(ConfigError::new(m));
        if node_rank >= nnodes {
            return fail(format!("{node_from} must be below {nnodes_from}"));
        }
        if !world_size.is_multiple_of(nnodes) {
            return fail(format!(
                "run.world_size ({world_size}) must divide evenly over {nnodes_from} (ranks per node)"
            ));
        }
        // Under Slurm, node 0 is the job's first host.
        let addr = match (&self.master_addr, std::env::var("SLURM_JOB_NODELIST")) {
            (Some(addr), _) => addr.clone(),
            (None, Ok(list)) => slurm::expand_nodelist(&list).map(|hosts| hosts[0].clone()).map_err(|e| {
                ConfigError::new(format!("SLURM_JOB_NODELIST={list:?}: {e:#}; pass --master-addr HOST"))
            })?,
            (None, Err(_)) => {
                return fail(format!(
                    "{nnodes_from} needs --master-addr, the address of node 0 that every node can reach"
                ))
            }
        };
        let port = match (self.master_port, std::env::var("SLURM_JOB_ID")) {
            (Some(port), _) => port,
            (None, Ok(job)) => slurm::master_port(&job).map_err(|e| ConfigError::new(format!("{e:#}")))?,
            (None, Err(_)) => 29500,
        };
        Ok(Topology { nnodes, node_rank, master: Some((addr, port)) })
    }
}

#[derive(Debug, Args)]
pub struct SweepArgs {
    /// The experiment file (TOML): a pipeline, [set], [sweep] and [scaling].
    pub file: PathBuf,
    /// The sweep directory [default: results/<experiment file stem>]
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Stop at the first point that fails (otherwise it is recorded and the sweep goes on).
    #[arg(long)]
    pub fail_fast: bool,
    /// Run points again even when they are already complete with the same configuration.
    #[arg(long, conflicts_with = "check")]
    pub force: bool,
    /// Rerun every point into a temporary directory and compare every non-timing trace value
    /// with the stored ones; exit 1 listing every difference.
    #[arg(long)]
    pub check: bool,
    /// Where the points run: local, one after another; slurm, each an sbatch job with the
    /// experiment file's [slurm] resources (srun tasks as ranks, requeued when preempted).
    #[arg(long, value_enum, default_value = "local")]
    pub launcher: crate::sweep::Launcher,
    /// With --check: float values whose relative difference is at most this count as equal
    /// (for results stored on another CPU where a path is not CPU-independent); the largest
    /// difference found is reported. Default: bit for bit.
    #[arg(long, value_name = "REL", requires = "check")]
    pub tolerance: Option<f64>,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The sweep directory (holding sweep.json), e.g. results/world_size.
    pub dir: PathBuf,
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
        // A rank the launcher started inherits the MKL_CBWR the launcher set and checked.
        Command::Run(args) if args.plan.is_some() => None,
        Command::Run(args) => match (&args.file, &args.resume) {
            (Some(file), _) => Some(resolved(file, &args.set, &args.set_as)),
            (None, Some(dir)) => Some(resolved(&dir.join(rundir::CONFIG), &args.set, &args.set_as)),
            (None, None) => Some(Default::default()),
        },
        Command::Validate(args) => Some(resolved(&args.file, &args.set, &args.set_as)),
        Command::Predict(args) => Some(resolved(&args.run_dir.join(rundir::CONFIG), &[], &[])),
        Command::Sweep(_) | Command::Bench(_) | Command::Schema(_) | Command::Report(_) | Command::Prepare(_) => None,
    }
}

/// What the process is, for its signals ([`crate::signals`]): `runner run` is a rank when its
/// launcher (runner's own, torchrun or srun) says so, else a launcher.
pub fn signal_role(cli: &Cli) -> crate::signals::Role {
    use crate::signals::Role;
    match &cli.command {
        Command::Run(args) if args.plan.is_some() || !matches!(RankEnv::from_env(), Ok(None)) => Role::Rank,
        Command::Run(_) => Role::Launcher,
        _ => Role::Other,
    }
}

pub fn main(cli: Cli) -> u8 {
    let result = match cli.command {
        Command::Validate(args) => validate(&args),
        Command::Schema(args) => {
            if args.markdown {
                crate::say!("{}", crate::config::reference::markdown());
            } else {
                crate::say!("{}", schema_json());
            }
            Ok(0)
        }
        Command::Run(args) => run(&args),
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
        Command::Predict(args) => match (&args.prompt, &args.data) {
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
            (None, Some(data)) => crate::predict::predict(&args.run_dir, data, args.out.as_deref()),
            (None, None) => unreachable!("clap requires DATA or --prompt"),
        },
        Command::Prepare(PrepareCommand::Text { file, out, force }) => crate::prepare::text(&file, &out, force),
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

/// The pipeline file's JSON Schema, generated from the serde types that read it.
pub fn schema_json() -> String {
    serde_json::to_string_pretty(&crate::config::reference::json_schema(false)).expect("a schema serializes")
}

/// `train.precision = "bf16"` on a CPU whose bfloat16 matmuls are slower than its float32 ones:
/// a warning with both rates, measured by a probe of about a second.
fn warn_of_slow_bf16(plan: &Plan) {
    use crate::config::schema::{Device, Precision};
    let t = &plan.config.train;
    if t.precision == Precision::Bf16 && plan.config.run.device == Device::Cpu {
        if let Some(warning) = crate::bench::peak::bf16_warning(plan.threads_per_rank) {
            crate::say_err!("{warning}");
        }
    }
}

/// The overrides of a command line: `--set-as LABEL KEY=VALUE` pairs (a sweep's), then `--set`.
fn overrides(set: &[String], set_as: &[String]) -> Vec<Override> {
    let labelled = set_as.chunks(2).map(|pair| Override { label: pair[0].clone(), text: pair[1].clone() });
    labelled.chain(set.iter().map(|s| Override::set(s))).collect()
}

pub fn plan(args: &ConfigArgs) -> Result<Plan, ConfigError> {
    crate::numerics::check_environment().map_err(ConfigError::new)?;
    Plan::new(config::resolve(&args.file, &overrides(&args.set, &args.set_as))?)
}

fn validate(args: &ConfigArgs) -> anyhow::Result<u8> {
    let plan = plan(args)?;
    if !plan.extends.is_empty() {
        let chain: Vec<String> =
            std::iter::once(&plan.pipeline_file).chain(&plan.extends).map(|f| f.display().to_string()).collect();
        crate::say!("extends: {}\n", chain.join(" → "));
    }
    crate::say!("{}", plan.data_flow().trim_end_matches('\n'));
    for note in plan.data.notes() {
        crate::say!("{note}");
    }
    warn_of_slow_bf16(&plan);
    for line in crate::stages::track::plan_lines(&plan, None) {
        crate::say!("{line}");
    }
    crate::say!("\n{} is valid; nothing was run.", args.file.display());
    Ok(0)
}

fn run(args: &RunArgs) -> anyhow::Result<u8> {
    let claim = Claim { resume: args.resume.is_some(), force: args.force };
    if let Some(path) = &args.plan {
        // A rank of runner's own launcher: the launcher resolved and saved the plan.
        let run_dir = args.resume.clone().or(args.out.clone()).context("--plan needs --out or --resume")?;
        let env = RankEnv::from_env()?.context("--plan is for the ranks `runner run` starts (RANK is not set)")?;
        return run_rank(Plan::load(path)?, &env, &|_| run_dir.clone(), claim);
    }
    let file = match (&args.file, &args.resume) {
        (Some(f), _) => f.clone(),
        (None, Some(dir)) => dir.join(rundir::CONFIG),
        (None, None) => unreachable!("clap requires FILE without --resume"),
    };
    let config = ConfigArgs { file, set: args.set.clone(), set_as: args.set_as.clone() };
    let resolved = config::resolve(&config.file, &overrides(&config.set, &config.set_as))?;
    if let Some(saved) = args.resume.as_ref().and_then(|dir| Plan::load(&dir.join(rundir::PLAN)).ok()) {
        saved.check_resumable_world_size(&resolved.config)?;
    }
    let asked = Plan::new(resolved)?;
    let plan = match &args.resume {
        Some(dir) => resumed_plan(dir, &asked)?,
        None => asked,
    };
    // The run directory of a plan: under torchrun or srun, rank 0's plan names it for every rank.
    let run_dir_of = |plan: &Plan| {
        args.resume
            .clone()
            .or(args.out.clone())
            .unwrap_or_else(|| Path::new("results").join(&plan.config.run.name).join(&plan.run_id))
    };
    if let Some(env) = RankEnv::from_env()? {
        return run_rank(plan, &env, &run_dir_of, claim);
    }
    let dir = run_dir_of(&plan);
    let (plan, claim) = match preempted_plan(&dir, &plan, claim)? {
        Some(resumed) => (resumed, Claim { resume: true, ..claim }),
        None => (plan, claim),
    };
    if claim.resume {
        say_resuming(&dir);
    }
    let topology = args.topology(plan.world_size())?;
    warn_of_slow_bf16(&plan);
    launch(&plan, &topology, claim, &dir)
}

/// The plan that continues a preempted run of `asked`'s configuration in `dir`: Slurm reruns
/// the command line it requeued, and that resumes from the checkpoint the preemption wrote.
/// `None` for any other directory, or when already resuming.
fn preempted_plan(dir: &Path, asked: &Plan, claim: Claim) -> anyhow::Result<Option<Plan>> {
    if claim.resume {
        return Ok(None);
    }
    match Manifest::read_raw(dir) {
        // Preempted before its first checkpoint: the run starts over.
        Ok(Some(m)) if m.status == Status::Preempted && m.run_id == asked.run_id && m.preempted_at_step.is_none() => {
            crate::say!("run {} was preempted before its first checkpoint: it starts over", m.run_id);
            Ok(None)
        }
        Ok(Some(m)) if m.status == Status::Preempted && m.run_id == asked.run_id => Ok(Some(resumed_plan(dir, asked)?)),
        _ => Ok(None),
    }
}

fn say_resuming(dir: &Path) {
    if let Ok(m) = Manifest::read(dir) {
        let why = match (m.failure, m.preempted_at_step) {
            (Some(f), _) => format!(": {f}"),
            (None, Some(step)) => format!(" at step {step}"),
            (None, None) => String::new(),
        };
        crate::say!("resuming run {} ({}{why})", m.run_id, format!("{:?}", m.status).to_lowercase());
    }
}

/// The plan of the run in `dir`, continued under the configuration the user resumes with
/// (`asked`); refused, before any rank starts, when a key other than those that extend a run or
/// spread it another way changed, or its newest checkpoint does not verify. A resume under
/// another world size or strategy is recorded in the plan (and so in the manifest).
fn resumed_plan(dir: &Path, asked: &Plan) -> anyhow::Result<Plan> {
    let saved_path = dir.join(rundir::PLAN);
    if !saved_path.is_file() {
        return Err(ConfigError::new(format!(
            "{} has no {} (it was made by an older runner, or is not a run directory): start a new run",
            dir.display(),
            rundir::PLAN
        ))
        .into());
    }
    let mut plan = Plan::load(&saved_path)?.resumed(asked)?;
    let found = checkpoint::latest(dir, &plan).map_err(ConfigError::new)?.ok_or_else(|| no_checkpoint(dir, &plan))?;
    let record = found.record();
    if record.global_batch != plan.global_batch() {
        return Err(ConfigError::new(format!(
            "checkpoint {} was written with a global batch of {} samples per step, this run's is {}: it belongs to \
             another run; move it out of {} to resume from the one before, or start a new run",
            found.dir.display(),
            record.global_batch,
            plan.global_batch(),
            checkpoint::dir(dir).display()
        ))
        .into());
    }
    if record.layout != plan.layout() {
        let reshard = Reshard { step: record.step, from: record.layout, to: plan.layout() };
        // A resume of the same checkpoint again (the last one stopped before its first) replaces it.
        if plan.reshards.last().is_some_and(|r| r.step == reshard.step && r.from == reshard.from) {
            plan.reshards.pop();
        }
        crate::say!(
            "resuming at step {} with {} (the checkpoint was written with {})",
            record.step,
            reshard.to,
            reshard.from
        );
        plan.reshards.push(reshard);
    }
    let done = found.record().step;
    if let (Some(steps), true) = (plan.config.train.steps, done >= plan.total_steps()) {
        let source = plan.sources.get("train.steps").map(String::as_str).unwrap_or("default");
        return Err(ConfigError::new(format!(
            "`train.steps` ({source}) is {steps} but the newest checkpoint of {} is at step {done}: nothing is left to \
             run; pass --set train.steps=N with N > {done} to train further",
            dir.display(),
        ))
        .into());
    }
    let epochs = plan.config.train.epochs;
    if done >= plan.total_steps() {
        let source = plan.sources.get("train.epochs").map(String::as_str).unwrap_or("default");
        return Err(ConfigError::new(format!(
            "`train.epochs` ({source}) is {epochs} but the newest checkpoint of {} is at epoch {}: nothing is left to \
             run; pass --set train.epochs=N with N > {} to train further",
            dir.display(),
            found.record().epoch,
            found.record().epoch
        ))
        .into());
    }
    Ok(plan)
}

/// Why `dir` holds no checkpoint to resume from, and what to do.
fn no_checkpoint(dir: &Path, plan: &Plan) -> anyhow::Error {
    let ck = checkpoint::dir(dir);
    let old: Vec<String> = std::fs::read_dir(&ck)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".pt"))
        .collect();
    let k = &plan.config.checkpoint;
    let why = if let Some(name) = old.first() {
        format!(
            "its checkpoints ({name}{}) are of an older runner's format, which this one cannot resume: start a new run",
            if old.len() > 1 { format!(" and {} more", old.len() - 1) } else { String::new() }
        )
    } else {
        match (k.every, k.every_steps) {
            (0, None) => "the run writes none: set checkpoint.every (epochs) or checkpoint.every_steps (optimizer \
                          steps) and start a new run"
                .to_owned(),
            (_, Some(n)) => format!(
                "the run stopped before its first checkpoint (checkpoint.every_steps = {n}): start it again without \
                 --resume"
            ),
            (e, None) => format!(
                "the run stopped before its first checkpoint (checkpoint.every = {e} epochs): start it again without \
                 --resume"
            ),
        }
    };
    ConfigError::new(format!("{} holds no checkpoint to resume from: {why}", ck.display())).into()
}

/// How a run takes its directory.
#[derive(Debug, Clone, Copy)]
struct Claim {
    resume: bool,
    force: bool,
}

/// This process is one rank. Under runner's own launcher the launcher owns the run directory
/// (config.toml, the manifest, the lock) and resolved the plan; under another launcher (torchrun,
/// srun) rank 0 does both, and every rank runs rank 0's plan or refuses, naming the keys that
/// differ ([`agree`]).
fn run_rank(plan: Plan, env: &RankEnv, run_dir_of: &dyn Fn(&Plan) -> PathBuf, claim: Claim) -> anyhow::Result<u8> {
    if let Some(pid) = env.launcher_pid {
        rank::die_with_launcher(pid);
    }
    preempt::watch(plan.config.run.preempt_signal);
    // Before the rendezvous: a rank that would be refused says why at once, not after waiting
    // for ranks that were never started.
    rank::check_world_size(&plan, env)?;
    let timeout = std::time::Duration::from_secs_f64(plan.config.run.timeout_s);
    let store = std::sync::Arc::new(rank::open_store(env, timeout)?);
    let (agreed, owned) = if env.launcher == Launcher::Runner {
        (agree::Agreed { plan, resume: claim.resume }, None)
    } else {
        let parties = agree::Parties { label: "rank", me: env.rank, count: env.world_size };
        agree::rank0_plan(&store, &plan, parties, |plan| {
            rank::check_world_size(plan, env)?;
            let run_dir = run_dir_of(plan);
            let (plan, resume) = match preempted_plan(&run_dir, plan, claim)? {
                Some(resumed) => (resumed, true),
                None => (plan.clone(), claim.resume),
            };
            if resume {
                say_resuming(&run_dir);
            }
            let manifest = plan.manifest();
            let lock = prepare_run_dir(&plan, &run_dir, &manifest, Claim { resume, ..claim })?;
            Ok((agree::Agreed { plan, resume }, (lock, manifest)))
        })?
    };
    let agree::Agreed { plan, resume } = agreed;
    let run_dir = run_dir_of(&plan);
    let (_lock, mut manifest) = owned.unzip();
    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rank::run(&plan, env, store, &run_dir, resume)))
            .unwrap_or_else(|panic| match panic.downcast::<crate::checked::Failure>() {
                // A model's forward pass failed (a user's module raised): its message is the error.
                Ok(failure) => Err(anyhow::anyhow!(failure.0)),
                Err(panic) => Err(anyhow::anyhow!("rank {} panicked: {}", env.rank, panic_text(&panic))),
            });
    let preempted = result.as_ref().err().and_then(|e| e.downcast_ref::<preempt::Preempted>()).copied();
    if let Some(manifest) = manifest.as_mut() {
        match (&result, preempted) {
            (Ok(_), _) => {
                manifest.end(Status::Complete, None);
                manifest.stopped(&run_dir, &plan.config.train);
            }
            (Err(_), Some(p)) => {
                manifest.end(Status::Preempted, None);
                manifest.preempted_at_step = Some(p.step);
            }
            (Err(e), None) => manifest.end(Status::Failed, Some(format!("rank 0: {e:#}"))),
        }
        manifest.write(&run_dir)?;
    }
    if let Some(p) = preempted {
        // Under srun rank 0 owns the run, and requeues the job once; under runner's launcher,
        // the launcher does.
        if manifest.is_some() {
            slurm::requeue(&format!("preempted at step {}: checkpoint written", p.step), true, &run_dir);
        }
        return Ok(128 + plan.config.run.preempt_signal.number() as u8);
    }
    let rows = result?;
    if env.rank == 0 {
        let by_step = plan.config.train.steps.is_some();
        crate::say!("\n{}", view::epoch_table(&rows, by_step));
        let pipeline = view::pipeline_table(&rows);
        if !pipeline.is_empty() {
            crate::say!("  per rank, mean of the epochs (bubble: share of the training time spent waiting in send/recv)\n{pipeline}");
        }
        let losses: Vec<f64> = rows.iter().filter(|r| r.rank == 0).map(|r| r.global_train_loss).collect();
        let unit = match (by_step, plan.config.validate.every_steps) {
            (false, _) => "epochs".to_owned(),
            (true, Some(n)) => format!("validations (every {n} steps)"),
            (true, None) => "validations".to_owned(),
        };
        crate::say!("  loss\n{}", view::chart(&unit, &losses, 6));
    }
    Ok(0)
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic".into())
}

fn launch(plan: &Plan, topology: &Topology, claim: Claim, run_dir: &Path) -> anyhow::Result<u8> {
    crate::say!("{}", plan.data_flow());
    for note in plan.data.notes() {
        crate::say!("{note}");
    }
    for line in crate::stages::track::plan_lines(plan, Some(run_dir)) {
        crate::say!("{line}");
    }
    if let Some(sweep) = std::env::var(crate::launch::env::SWEEP_PID).ok().and_then(|p| p.parse::<i32>().ok()) {
        // Started by `runner sweep`: its end (even by SIGKILL) interrupts this run.
        let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM);
        if nix::unistd::getppid().as_raw() != sweep {
            return Err(anyhow::anyhow!("the sweep that started this run has ended"));
        }
    }
    let mut manifest = plan.manifest();
    let _lock = prepare_run_dir(plan, run_dir, &manifest, claim)?;
    // Every rank runs the plan resolved here, never the pipeline file again.
    let child_args: Vec<OsString> = vec![
        "run".into(),
        "--plan".into(),
        run_dir.join(rundir::PLAN).into(),
        if claim.resume { "--resume" } else { "--out" }.into(),
        run_dir.into(),
    ];
    // Every way the launcher ends records how: an error (a store it cannot serve or join, a
    // configuration the other nodes do not share) or a panic is a failed run.
    let launched =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| spawn::launch(plan, topology, run_dir, &child_args)))
            .unwrap_or_else(|panic| Err(anyhow::anyhow!("the launcher panicked: {}", panic_text(&panic))));
    // Every rank has ended: what a write cut short left (a checkpoint being written when a signal
    // came, a temporary file) goes now, not at the next start.
    rundir::remove_unfinished(run_dir);
    let outcome = match launched {
        Ok(outcome) => outcome,
        Err(e) => {
            manifest.end(Status::Failed, Some(format!("{e:#}")));
            manifest.write(run_dir)?;
            return Err(e);
        }
    };
    if outcome.preempted {
        // The newest checkpoint: the one the ranks just wrote, or, when the signal came before
        // any rank started, the one a resumed run started from (none: the run starts over).
        let step = checkpoint::newest_unread(run_dir, plan).ok().flatten().map(|f| f.record().step);
        manifest.end(Status::Preempted, None);
        manifest.preempted_at_step = step;
        manifest.write(run_dir)?;
        let said = match (outcome.started, step) {
            (true, Some(step)) => format!("preempted at step {step}: checkpoint written"),
            (false, Some(step)) => format!("preempted before any rank started: it resumes from step {step}"),
            (_, None) => "preempted before its first checkpoint".to_owned(),
        };
        // One requeue per job: node 0's launcher asks for it.
        match topology.node_rank {
            0 => slurm::requeue(&said, step.is_some(), run_dir),
            _ => crate::say_err!("{said}; node 0 says how the run goes on"),
        }
        return Ok(128 + plan.config.run.preempt_signal.number() as u8);
    }
    if let Some(sig) = outcome.interrupted {
        manifest.end(Status::Interrupted, None);
        manifest.write(run_dir)?;
        let what = if outcome.started {
            "every rank was stopped; the trace keeps every finished epoch"
        } else {
            "no rank had started; nothing was written but the run's configuration"
        };
        crate::say_err!("\ninterrupted by {}: {what} in {}", crate::signals::name(sig), run_dir.display());
        return Ok(128 + sig as u8);
    }
    match &outcome.failure {
        None => {
            manifest.end(Status::Complete, None);
            manifest.stopped(run_dir, &plan.config.train);
            manifest.write(run_dir)?;
            crate::say!("  run directory: {}", run_dir.display());
            Ok(0)
        }
        Some(f) => {
            manifest.end(Status::Failed, Some(f.summary()));
            manifest.write(run_dir)?;
            crate::say_err!("\nerror: the run failed: {}", f.summary());
            if !f.stderr_tail.is_empty() {
                crate::say_err!("  last lines rank {} wrote to stderr:", f.rank);
                for line in &f.stderr_tail {
                    crate::say_err!("    {line}");
                }
            }
            crate::say_err!("  run directory (traces keep every finished epoch): {}", run_dir.display());
            Ok(1)
        }
    }
}

/// Takes the run directory for this run: creates it, locks it (a second launcher is refused,
/// naming the pid holding it), refuses one that is not this run's unless `--force`, removes
/// what a fresh run replaces (only the runner's own files) and stale temporary files, and writes
/// plan.json, config.toml and the manifest.
fn prepare_run_dir(plan: &Plan, run_dir: &Path, manifest: &Manifest, claim: Claim) -> anyhow::Result<RunLock> {
    std::fs::create_dir_all(run_dir)
        .with_context(|| format!("cannot create the run directory {}", run_dir.display()))?;
    let lock = lock::acquire(run_dir).map_err(|e| ConfigError::new(e.message(run_dir)))?;
    if claim.resume {
        rundir::remove_stale(run_dir);
        // Written again if the resumed run stops early.
        let _ = std::fs::remove_file(run_dir.join(rundir::STOPPED));
    } else {
        if !claim.force {
            if let Some(why) = rundir::foreign(run_dir, &plan.run_id) {
                return Err(ConfigError::new(format!(
                    "--out {} is not this run's directory: {why}; choose another --out, or pass --force to run there \
                     anyway (only the runner's own files are replaced)",
                    run_dir.display()
                ))
                .into());
            }
        }
        rundir::clear_for_fresh_run(run_dir);
    }
    // Rewritten on resume too: a resumed run may extend the configuration (train.epochs).
    plan.save(&run_dir.join(rundir::PLAN))?;
    rundir::atomic_write(&run_dir.join(rundir::CONFIG), plan.annotated_toml().as_bytes())?;
    manifest.write(run_dir)?;
    Ok(lock)
}
