//! The Slurm environment: under `srun`, every task is one rank. Rank, world size, local rank
//! and node come from the SLURM_* variables of the job step; the master is the first host of
//! SLURM_JOB_NODELIST (expanded as Slurm does, `node[01-04,07]`), its port MASTER_PORT or one
//! derived from SLURM_JOB_ID, as Lightning's SLURMEnvironment does.
//!
//! ```text
//! srun -N 2 --ntasks-per-node=2 runner run pipelines/ddp.toml   # 4 ranks, 2 per node
//! srun -N 2 --ntasks-per-node=1 runner run pipelines/ddp.toml   # one launcher per node
//! ```
//!
//! A step with one task per node (or a batch script, which is not a step) keeps `runner run` the
//! node's launcher: it spawns the node's ranks itself ([`super::spawn`]).
use anyhow::{bail, Context};

use super::env::RankEnv;

/// A job step's tasks, as srun describes them to each task.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub task: usize,
    pub tasks: usize,
    pub local_task: usize,
    /// This node's tasks.
    pub local_tasks: usize,
    pub node: usize,
    pub nodes: usize,
    /// The job's hosts, in order.
    pub hosts: Vec<String>,
    pub job_id: String,
}

/// Reads a variable of the step: `None` when absent, an error naming it when it is not a number.
fn var(name: &str) -> anyhow::Result<Option<String>> {
    Ok(std::env::var(name).ok().filter(|v| !v.is_empty()))
}

fn number(name: &str) -> anyhow::Result<Option<usize>> {
    var(name)?.map(|v| v.trim().parse::<usize>().with_context(|| format!("{name}={v:?} is not a number"))).transpose()
}

fn required(name: &str) -> anyhow::Result<usize> {
    number(name)?.with_context(|| format!("srun sets {name} in every task, but it is not set here"))
}

impl Step {
    /// The step this process is a task of: `None` outside srun (no SLURM_STEP_ID: a batch
    /// script, a login shell).
    pub fn from_env() -> anyhow::Result<Option<Step>> {
        if var("SLURM_STEP_ID")?.is_none() || var("SLURM_PROCID")?.is_none() {
            return Ok(None);
        }
        let task = required("SLURM_PROCID")?;
        let tasks = match number("SLURM_STEP_NUM_TASKS")? {
            Some(n) => n,
            None => required("SLURM_NTASKS")?,
        };
        let nodes = match number("SLURM_STEP_NUM_NODES")? {
            Some(n) => n,
            None => required("SLURM_NNODES")?,
        };
        let node = required("SLURM_NODEID")?;
        let local_task = required("SLURM_LOCALID")?;
        let per_node = var("SLURM_STEP_TASKS_PER_NODE")?.or(var("SLURM_TASKS_PER_NODE")?);
        let local_tasks = match per_node {
            Some(spec) => tasks_on_node(&spec, node)
                .with_context(|| format!("SLURM_STEP_TASKS_PER_NODE={spec:?} has no count for node {node}"))?,
            None => tasks / nodes.max(1),
        };
        let list =
            var("SLURM_STEP_NODELIST")?.or(var("SLURM_JOB_NODELIST")?).context("SLURM_JOB_NODELIST is not set")?;
        let hosts = expand_nodelist(&list)?;
        let job_id = var("SLURM_JOB_ID")?.context("SLURM_JOB_ID is not set")?;
        if task >= tasks || node >= nodes || local_task >= local_tasks {
            bail!(
                "the Slurm variables disagree: SLURM_PROCID={task} of {tasks} tasks, SLURM_NODEID={node} of {nodes} \
                 nodes, SLURM_LOCALID={local_task} of {local_tasks} on this node"
            );
        }
        Ok(Some(Step { task, tasks, local_task, local_tasks, node, nodes, hosts, job_id }))
    }

    /// Whether every task is a rank: more tasks than nodes. With one task per node, each task
    /// is its node's launcher.
    pub fn tasks_are_ranks(&self) -> bool {
        self.tasks > self.nodes
    }

    /// This task as a rank: the store on the first host (loopback when the step has one node),
    /// at MASTER_PORT or 15000 + the job id's last four digits.
    pub fn rank_env(&self) -> anyhow::Result<RankEnv> {
        if self.tasks > crate::limits::MAX_WORLD_SIZE {
            bail!(
                "srun started {} tasks, more than the {} ranks the runner takes",
                self.tasks,
                crate::limits::MAX_WORLD_SIZE
            );
        }
        let master_addr = match (var("MASTER_ADDR")?, self.nodes) {
            (Some(addr), _) => addr,
            (None, 1) => "127.0.0.1".to_owned(),
            (None, _) => self.hosts.first().cloned().context("SLURM_JOB_NODELIST names no host")?,
        };
        Ok(RankEnv {
            rank: self.task,
            world_size: self.tasks,
            local_rank: self.local_task,
            local_world_size: self.local_tasks,
            master_addr,
            master_port: master_port(&self.job_id)?,
            agent_store: false,
            launcher_pid: None,
            launcher: super::env::Launcher::Srun,
            restarts: super::env::restarts(super::env::SLURM_RESTARTS),
        })
    }
}

/// MASTER_PORT when set, else 15000 + the last four digits of the job id (Lightning's rule:
/// two jobs sharing a node get different ports).
pub fn master_port(job_id: &str) -> anyhow::Result<u16> {
    if let Some(port) = var("MASTER_PORT")? {
        return port.parse().with_context(|| format!("MASTER_PORT={port:?} is not a port number"));
    }
    let digits: String = job_id.chars().filter(char::is_ascii_digit).collect();
    let tail = &digits[digits.len().saturating_sub(4)..];
    let n: u16 = tail.parse().with_context(|| format!("SLURM_JOB_ID={job_id:?} is not a job number"))?;
    Ok(15000 + n)
}

/// A preempted run's last word, `said` ("preempted at step 12: checkpoint written"): the manifest
/// says `preempted`. Under Slurm (SLURM_JOB_ID set), the job is requeued (`scontrol requeue`),
/// which ends it: Slurm reruns its script, and the same `runner run` resumes from the newest
/// checkpoint. Elsewhere, says how to resume.
/// `resumable`: a checkpoint is there to continue from (else the same command starts over).
pub fn requeue(said: &str, resumable: bool, run_dir: &std::path::Path) {
    let Some(job) = var("SLURM_JOB_ID").ok().flatten() else {
        match resumable {
            true => {
                crate::say_err!("{said}; the same command, or runner run --resume {}, continues it", run_dir.display())
            }
            false => crate::say_err!("{said}; the same command starts it over"),
        }
        return;
    };
    // Said first: the requeue ends this job, and this process with it.
    crate::say_err!("{said}, job requeued");
    match std::process::Command::new("scontrol").args(["requeue", &job]).output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => crate::say_err!(
            "error: scontrol requeue {job} failed ({}): resubmit the job, or run runner run --resume {}",
            String::from_utf8_lossy(&out.stderr).trim(),
            run_dir.display()
        ),
        Err(e) => crate::say_err!("error: cannot run scontrol requeue {job}: {e}; resubmit the job"),
    }
}

/// The task count of node `node` in a tasks-per-node list: `2(x3),1` is 2, 2, 2, 1.
fn tasks_on_node(spec: &str, node: usize) -> Option<usize> {
    let mut counts = Vec::new();
    for part in spec.split(',') {
        let (count, times) = match part.split_once("(x") {
            Some((c, t)) => (c, t.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (part, 1),
        };
        let count: usize = count.trim().parse().ok()?;
        counts.extend(std::iter::repeat_n(count, times));
    }
    counts.get(node).copied()
}

/// Slurm's host list, expanded: `node[01-04,07],gpu3` → node01 node02 node03 node04 node07 gpu3.
/// Ranges keep their zero padding; several brackets in one name multiply (`r[1-2]n[1-2]`).
pub fn expand_nodelist(list: &str) -> anyhow::Result<Vec<String>> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        hosts.extend(expand_one(item).with_context(|| format!("cannot read the Slurm host list {list:?}"))?);
    }
    if hosts.is_empty() {
        bail!("the Slurm host list {list:?} names no host");
    }
    Ok(hosts)
}

/// The comma-separated items of a host list, leaving commas inside brackets alone.
fn split_top_level(list: &str) -> anyhow::Result<Vec<&str>> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, ch) in list.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            bail!("unbalanced brackets in the Slurm host list {list:?}");
        }
    }
    if depth != 0 {
        bail!("unbalanced brackets in the Slurm host list {list:?}");
    }
    items.push(&list[start..]);
    Ok(items.into_iter().map(str::trim).filter(|s| !s.is_empty()).collect())
}

fn expand_one(item: &str) -> anyhow::Result<Vec<String>> {
    let Some(open) = item.find('[') else {
        return Ok(vec![item.to_owned()]);
    };
    let close = open + item[open..].find(']').context("a '[' without ']'")?;
    let (prefix, ranges, rest) = (&item[..open], &item[open + 1..close], &item[close + 1..]);
    let tails = expand_one(rest)?;
    let mut out = Vec::new();
    for range in ranges.split(',') {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let width = lo.len();
        let (a, b): (u64, u64) = (
            lo.parse().with_context(|| format!("{lo:?} is not a number"))?,
            hi.parse().with_context(|| format!("{hi:?} is not a number"))?,
        );
        if a > b || b - a > 100_000 {
            bail!("the range {range:?} is not a range of hosts");
        }
        for n in a..=b {
            for tail in &tails {
                out.push(format!("{prefix}{n:0width$}{tail}"));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(s: &str) -> Vec<String> {
        expand_nodelist(s).unwrap()
    }

    #[test]
    fn host_lists_expand_as_slurm_does() {
        assert_eq!(expand("vm"), ["vm"]);
        assert_eq!(expand("node[01-04,07]"), ["node01", "node02", "node03", "node04", "node07"]);
        assert_eq!(expand("a1,b[2-3],c"), ["a1", "b2", "b3", "c"]);
        assert_eq!(expand("gpu[8-10]"), ["gpu8", "gpu9", "gpu10"]);
        assert_eq!(expand("n[009-011]-ib"), ["n009-ib", "n010-ib", "n011-ib"]);
        assert_eq!(expand("r[1-2]n[1-2]"), ["r1n1", "r1n2", "r2n1", "r2n2"]);
        assert_eq!(expand("x[3]"), ["x3"]);
    }

    #[test]
    fn malformed_host_lists_are_refused() {
        for bad in ["node[01-04", "node]1[", "n[4-2]", "n[a-b]", ""] {
            assert!(expand_nodelist(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn tasks_per_node_lists_expand() {
        assert_eq!(tasks_on_node("2(x3),1", 0), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 2), Some(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Some(1));
        assert_eq!(tasks_on_node("4", 0), Some(4));
        assert_eq!(tasks_on_node("4", 1), None);
    }

    #[test]
    fn the_port_comes_from_the_job_id() {
        // MASTER_PORT is not set in the unit tests' environment.
        if std::env::var("MASTER_PORT").is_err() {
            assert_eq!(master_port("123456").unwrap(), 15000 + 3456);
            assert_eq!(master_port("7").unwrap(), 15007);
            assert_eq!(master_port("4242_3").unwrap(), 15000 + 2423);
        }
    }
}
