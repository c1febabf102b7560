//! The run's model file (`model.safetensors`) as the commands that read a run's model find it
//! (`predict`, `eval`, `export`): only the model of the run's newest state serves. The file
//! records the optimizer steps it was trained for ([`MODEL_STEP`]), which tells a model that a
//! run went on past (a complete run extended with `--resume` and stopped) from the run's own.
use std::path::Path;

use crate::plan::Plan;

/// The metadata key of the optimizer steps a model file was written after.
pub const MODEL_STEP: &str = "runner.step";

/// The run's model.safetensors, the model of the run's newest state. A run without one is
/// refused saying how the run ended, from its manifest; so is a run that went on past its model
/// (a complete run extended with `--resume` and stopped before its end), naming the checkpoint
/// that holds its newest state.
pub fn trained_model(run_dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    use crate::rundir::manifest::{Manifest, Status};
    let path = run_dir.join(crate::rundir::MODEL);
    let manifest = Manifest::read(run_dir);
    if path.exists() {
        return match manifest {
            Ok(m) if m.status != Status::Complete => newest_state(run_dir, &path, &m).map(|()| path),
            _ => Ok(path),
        };
    }
    let why = match manifest {
        Ok(m) if m.status == Status::Complete => "its manifest says complete, but the file is gone".to_owned(),
        Ok(m) => format!(
            "the run did not finish (its manifest says {}{}); runner run --resume {} continues it from its newest \
             checkpoint",
            format!("{:?}", m.status).to_lowercase(),
            m.failure.map(|f| format!(": {f}")).unwrap_or_default(),
            run_dir.display()
        ),
        Err(_) => "it is not a run directory (no readable manifest.json)".to_owned(),
    };
    anyhow::bail!("{} has no {}: {why}", run_dir.display(), crate::rundir::MODEL)
}

/// Fails when the model file `model` of a run that is not complete (its manifest `m`) is older
/// than the run's newest checkpoint: the run went on past it, and that model is not the run's.
fn newest_state(run_dir: &Path, model: &Path, m: &crate::rundir::manifest::Manifest) -> anyhow::Result<()> {
    let plan = Plan::load(&run_dir.join(crate::rundir::PLAN))?;
    let Some((newest, name)) = crate::checkpoint::list(run_dir, &plan).pop() else { return Ok(()) };
    // A model file of an older runner does not say its step: it serves only a complete run.
    let step = crate::tensorfile::TensorFile::open(model)
        .ok()
        .and_then(|f| f.metadata()?.get(MODEL_STEP)?.parse::<usize>().ok());
    if step.is_some_and(|s| s >= newest) {
        return Ok(());
    }
    let written = step.map_or("at an earlier step".to_owned(), |s| format!("after step {s}"));
    anyhow::bail!(
        "{} is not the model of the run's newest state: it was written {written}, and the run went on to its \
         checkpoint of {} ({}; its manifest says {}): runner run --resume {} finishes the run from there and \
         writes the model of its newest state (runner predict --model FILE takes another model file)",
        model.display(),
        crate::checkpoint::describe(&name),
        crate::checkpoint::dir(run_dir).join(&name).display(),
        format!("{:?}", m.status).to_lowercase(),
        run_dir.display()
    )
}
