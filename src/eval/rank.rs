//! One rank of `runner eval`: its contiguous block of the windows, read batch by batch where they
//! lie, through the whole model; the loss and accuracy sums all-reduced, rank 0 writing them.
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tch::{Kind, Tensor};

use super::{Job, Results};
use crate::dist::{Backend, ProcessGroup, ReduceOp};
use crate::launch::env::RankEnv;
use crate::plan::Plan;
use crate::rundir::position::Position;

/// Runs this rank of the evaluation `job_file` describes.
pub fn rank(job_file: &Path) -> anyhow::Result<u8> {
    let env = RankEnv::from_env()?.context("--job is for the ranks `runner eval` starts (RANK is not set)")?;
    if let Some(pid) = env.launcher_pid {
        crate::launch::rank::die_with_launcher(pid);
    }
    let job: Job = serde_json::from_str(&std::fs::read_to_string(job_file)?)?;
    let plan = Plan::load(&job.plan)?;
    let timeout = Duration::from_secs_f64(plan.config.run.timeout_s);
    let store = Arc::new(crate::launch::rank::open_store(&env, timeout)?);
    let pg = ProcessGroup::new(Backend::Gloo, store, env.rank, env.world_size, "127.0.0.1", timeout)?;
    match evaluate(&job, &plan, &pg, env.local_rank, job_file.parent().unwrap_or(Path::new("."))) {
        Ok(()) => {
            pg.barrier()?;
            Ok(0)
        }
        Err(e) => {
            pg.leave(&format!("failed: {}", format!("{e:#}").lines().next().unwrap_or_default()));
            Err(e)
        }
    }
}

/// Windows `r·n/W .. (r+1)·n/W` of `n` for rank `r` of `W`: contiguous, sizes differing by one at most.
fn share(n: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
    rank * n / world..(rank + 1) * n / world
}

fn evaluate(job: &Job, plan: &Plan, pg: &ProcessGroup, local_rank: usize, tmp: &Path) -> anyhow::Result<()> {
    let device = plan.device(local_rank);
    crate::device::check_rank(device)?;
    tch::set_num_threads(job.threads as i32);
    let (_vs, model) = match job.initial {
        true => super::hf::module(plan, device)?,
        false => crate::predict::trained_module(plan, &job.run_dir, device)?,
    };
    let task = plan.data.task;
    let windows =
        crate::data::tokens::Windows::open(&job.stream, job.seq_len, job.windows).map_err(anyhow::Error::msg)?;
    let mine = share(job.windows, pg.size(), pg.rank());
    let position = Position::new(tmp, pg.rank());
    let start = Instant::now();
    let (mut loss, mut correct) = (0.0f64, 0.0f64);
    for (b, from) in mine.clone().step_by(job.batch).enumerate() {
        position.set("eval", 0, b + 1);
        let idx: Vec<i64> = (from as i64..(from + job.batch).min(mine.end) as i64).collect();
        let (x, y) = windows.gather(&idx).map_err(anyhow::Error::msg)?;
        let (x, y) = (x.to_device(device), y.to_device(device));
        let out = tch::no_grad(|| model.forward_t(&x, false));
        loss += tch::no_grad(|| task.per_sample_loss(&out, &y).sum(Kind::Double).double_value(&[]));
        correct += tch::no_grad(|| task.correct(&out, &y).sum(Kind::Double).double_value(&[]));
    }
    let seconds = start.elapsed().as_secs_f64();
    let mut sums = Tensor::from_slice(&[loss, correct, mine.len() as f64]);
    pg.all_reduce(&mut sums, ReduceOp::Sum)?;
    let mut slowest = Tensor::from_slice(&[seconds]);
    pg.all_reduce(&mut slowest, ReduceOp::Max)?;
    if pg.rank() != 0 {
        return Ok(());
    }
    let sums: Vec<f64> = Vec::try_from(sums)?;
    let seconds = slowest.double_value(&[0]);
    let (windows, loss) = (sums[2] as usize, sums[0] / sums[2]);
    let tokens = windows * job.seq_len;
    let results = Results {
        run_dir: job.run_dir.clone(),
        data: Default::default(),
        data_tokens: job.stream.len,
        windows,
        seq_len: job.seq_len,
        tokens,
        loss,
        perplexity: loss.exp(),
        accuracy: sums[1] / sums[2],
        world_size: pg.size(),
        threads_per_rank: job.threads,
        seconds,
        tokens_per_s: tokens as f64 / seconds,
    };
    crate::rundir::atomic_write(&job.results, serde_json::to_string(&results)?.as_bytes())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_shares_cover_every_window_once_in_order() {
        for (n, w) in [(10, 3), (2, 4), (7, 1), (0, 2)] {
            let all: Vec<usize> = (0..w).flat_map(|r| super::share(n, w, r)).collect();
            assert_eq!(all, (0..n).collect::<Vec<_>>(), "{n} over {w}");
        }
    }
}
