//! The engines that start one `runner run` per node and say, through environment variables, how
//! many nodes the job has, which one this is and where node 0 listens:
//!
//! - Slurm: `SLURM_NNODES`, `SLURM_NODEID`, node 0 the first host of `SLURM_JOB_NODELIST`, the
//!   port derived from `SLURM_JOB_ID` ([`super::slurm`]);
//! - Kubeflow Trainer's TrainJob: `PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`,
//!   `PET_MASTER_ADDR`, `PET_MASTER_PORT` (torchrun reads them as its flags' defaults);
//! - SkyPilot: `SKYPILOT_NUM_NODES`, `SKYPILOT_NODE_RANK`, `SKYPILOT_NODE_IPS` (one per line,
//!   node 0 first) and `SKYPILOT_NUM_GPUS_PER_NODE`.
//!
//! The launcher's flags (`--nnodes`, `--node-rank`, `--master-addr`, `--master-port`) take
//! precedence; where two engines both set a value they must agree, or the run is refused naming
//! each variable.
use super::elastic::Nodes;
use super::slurm;

/// One value an engine set, and the variable that set it (`PET_NNODES=2`).
#[derive(Debug, Clone, PartialEq)]
pub struct Said<T> {
    pub value: T,
    pub from: String,
}

/// What the engines in this environment say of the job's nodes; `None` where none says it.
#[derive(Debug, Default, PartialEq)]
pub struct Layout {
    /// The engines found, by name ("Kubeflow TrainJob").
    pub engines: Vec<&'static str>,
    pub nnodes: Option<Said<Nodes>>,
    pub node_rank: Option<Said<usize>>,
    pub master_addr: Option<Said<String>>,
    pub master_port: Option<Said<u16>>,
    /// Ranks per node, where an engine fixes it (TrainJob's PET_NPROC_PER_NODE as a number).
    pub per_node: Option<Said<usize>>,
    /// What the plan prints of each engine's own values (SkyPilot's GPUs per node).
    pub notes: Vec<String>,
}

/// Reads the engines' variables through `var` (the process environment in [`from_env`]).
pub fn read(var: &dyn Fn(&str) -> Option<String>) -> Result<Layout, String> {
    let mut layout = Layout::default();
    for engine in [slurm_said(var)?, trainjob_said(var)?, skypilot_said(var)?].into_iter().flatten() {
        layout.merge(engine)?;
    }
    Ok(layout)
}

pub fn from_env() -> Result<Layout, String> {
    read(&|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()))
}

impl Layout {
    /// Adds one engine's values: a value two engines both set must be the same.
    fn merge(&mut self, other: Layout) -> Result<(), String> {
        fn one<T: PartialEq + std::fmt::Debug>(
            mine: &mut Option<Said<T>>,
            theirs: Option<Said<T>>,
        ) -> Result<(), String> {
            match (mine.as_ref(), theirs) {
                (Some(a), Some(b)) if a.value != b.value => Err(format!(
                    "the engines disagree: {} but {}; unset the variables of the engine that did not start this job",
                    a.from, b.from
                )),
                (None, theirs) => {
                    *mine = theirs;
                    Ok(())
                }
                _ => Ok(()),
            }
        }
        one(&mut self.nnodes, other.nnodes)?;
        one(&mut self.node_rank, other.node_rank)?;
        one(&mut self.master_addr, other.master_addr)?;
        one(&mut self.master_port, other.master_port)?;
        one(&mut self.per_node, other.per_node)?;
        self.engines.extend(other.engines);
        self.notes.extend(other.notes);
        Ok(())
    }

    /// "Kubeflow TrainJob (PET_NNODES=2, PET_NODE_RANK=1, ...)": the plan's line of where the
    /// layout came from.
    pub fn describe(&self) -> Option<String> {
        if self.engines.is_empty() {
            return None;
        }
        let mut said: Vec<String> = [
            self.nnodes.as_ref().map(|s| s.from.clone()),
            self.node_rank.as_ref().map(|s| s.from.clone()),
            self.master_addr.as_ref().map(|s| s.from.clone()),
            self.master_port.as_ref().map(|s| s.from.clone()),
            self.per_node.as_ref().map(|s| s.from.clone()),
        ]
        .into_iter()
        .flatten()
        .collect();
        said.extend(self.notes.iter().cloned());
        Some(format!("{} ({})", self.engines.join(" and "), said.join(", ")))
    }
}

fn number(var: &dyn Fn(&str) -> Option<String>, name: &str, what: &str) -> Result<Option<Said<usize>>, String> {
    let Some(v) = var(name) else { return Ok(None) };
    let value = v.trim().parse().map_err(|_| format!("{name}={v:?} is not a number ({what})"))?;
    Ok(Some(Said { value, from: format!("{name}={value}") }))
}

/// A number of nodes; with `elastic`, also torchrun's MIN:MAX.
fn nodes(
    var: &dyn Fn(&str) -> Option<String>,
    name: &str,
    engine: &str,
    elastic: bool,
) -> Result<Option<Said<Nodes>>, String> {
    let Some(v) = var(name) else { return Ok(None) };
    let value = match v.trim().parse::<usize>() {
        Ok(n) if n > 0 => Nodes { min: n, max: n },
        _ if elastic && v.contains(':') => v.trim().parse().map_err(|e| format!("{name}={v:?}: {e}"))?,
        _ => return Err(format!("{name}={v:?} is not a number (it gives --nnodes under {engine})")),
    };
    Ok(Some(Said { value, from: format!("{name}={}", v.trim()) }))
}

fn port(var: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<Said<u16>>, String> {
    let Some(v) = var(name) else { return Ok(None) };
    let value = v.trim().parse().map_err(|_| format!("{name}={v:?} is not a port number"))?;
    Ok(Some(Said { value, from: format!("{name}={value}") }))
}

fn text(var: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<Said<String>> {
    var(name).map(|v| Said { from: format!("{name}={}", v.trim()), value: v.trim().to_owned() })
}

/// A batch script's or a task's Slurm job (not a step of srun, which [`slurm::Step`] reads).
fn slurm_said(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Layout>, String> {
    let nnodes = nodes(var, "SLURM_NNODES", "Slurm", false)?;
    if nnodes.is_none() {
        return Ok(None);
    }
    let master_addr = match var("SLURM_JOB_NODELIST") {
        Some(list) => {
            let hosts = slurm::expand_nodelist(&list)
                .map_err(|e| format!("SLURM_JOB_NODELIST={list:?}: {e:#}; pass --master-addr HOST"))?;
            Some(Said { value: hosts[0].clone(), from: format!("SLURM_JOB_NODELIST={list}") })
        }
        None => None,
    };
    let master_port = match var("SLURM_JOB_ID") {
        Some(job) => Some(Said {
            value: slurm::master_port(&job).map_err(|e| format!("{e:#}"))?,
            from: format!("SLURM_JOB_ID={job}"),
        }),
        None => None,
    };
    let node_rank = number(var, "SLURM_NODEID", "the node's index")?;
    Ok(Some(Layout { engines: vec!["Slurm"], nnodes, node_rank, master_addr, master_port, ..Layout::default() }))
}

fn trainjob_said(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Layout>, String> {
    let names = ["PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NPROC_PER_NODE"];
    if names.iter().all(|n| var(n).is_none()) {
        return Ok(None);
    }
    // torchrun's --nproc-per-node also takes auto, cpu and gpu: no fixed count then.
    let per_node = match var("PET_NPROC_PER_NODE") {
        Some(v) if ["auto", "cpu", "gpu", "xpu"].contains(&v.trim()) => None,
        _ => number(var, "PET_NPROC_PER_NODE", "ranks per node")?,
    };
    Ok(Some(Layout {
        engines: vec!["Kubeflow TrainJob"],
        nnodes: nodes(var, "PET_NNODES", "Kubeflow TrainJob", true)?,
        node_rank: number(var, "PET_NODE_RANK", "the node's index")?,
        master_addr: text(var, "PET_MASTER_ADDR"),
        master_port: port(var, "PET_MASTER_PORT")?,
        per_node,
        notes: Vec::new(),
    }))
}

fn skypilot_said(var: &dyn Fn(&str) -> Option<String>) -> Result<Option<Layout>, String> {
    let names = ["SKYPILOT_NUM_NODES", "SKYPILOT_NODE_RANK", "SKYPILOT_NODE_IPS"];
    if names.iter().all(|n| var(n).is_none()) {
        return Ok(None);
    }
    let nnodes = number(var, "SKYPILOT_NUM_NODES", "the number of nodes")?;
    let ips: Vec<String> = var("SKYPILOT_NODE_IPS")
        .unwrap_or_default()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    if let Some(n) = &nnodes {
        if ips.len() != n.value {
            return Err(format!(
                "SKYPILOT_NODE_IPS lists {} address{} but {}: SkyPilot sets both, one address per node",
                ips.len(),
                if ips.len() == 1 { "" } else { "es" },
                n.from
            ));
        }
    }
    let master_addr =
        ips.first().map(|ip| Said { value: ip.clone(), from: format!("SKYPILOT_NODE_IPS (first: {ip})") });
    let gpus = var("SKYPILOT_NUM_GPUS_PER_NODE").map(|g| format!("SKYPILOT_NUM_GPUS_PER_NODE={}", g.trim()));
    Ok(Some(Layout {
        engines: vec!["SkyPilot"],
        nnodes: nnodes.map(|n| Said { value: Nodes { min: n.value, max: n.value }, from: n.from }),
        node_rank: number(var, "SKYPILOT_NODE_RANK", "the node's index")?,
        master_addr,
        notes: gpus.into_iter().collect(),
        ..Layout::default()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(vars: &[(&str, &str)]) -> Result<Layout, String> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        read(&|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
    }

    #[test]
    fn trainjob_s_variables_give_the_layout() {
        let l = layout(&[
            ("PET_NNODES", "2"),
            ("PET_NPROC_PER_NODE", "2"),
            ("PET_NODE_RANK", "1"),
            ("PET_MASTER_ADDR", "trainjob-node-0-0.trainjob"),
            ("PET_MASTER_PORT", "29400"),
        ])
        .unwrap();
        assert_eq!(l.nnodes.unwrap().value, Nodes { min: 2, max: 2 });
        assert_eq!(l.node_rank.unwrap().value, 1);
        assert_eq!(l.master_addr.unwrap().value, "trainjob-node-0-0.trainjob");
        assert_eq!(l.master_port.unwrap().value, 29400);
        assert_eq!(l.per_node.unwrap().value, 2);
        assert!(layout(&[("PET_NPROC_PER_NODE", "auto")]).unwrap().per_node.is_none());
    }

    #[test]
    fn skypilot_s_first_address_is_node_0() {
        let l = layout(&[
            ("SKYPILOT_NODE_IPS", "10.0.0.7\n10.0.0.9\n"),
            ("SKYPILOT_NUM_NODES", "2"),
            ("SKYPILOT_NODE_RANK", "0"),
            ("SKYPILOT_NUM_GPUS_PER_NODE", "0"),
        ])
        .unwrap();
        assert_eq!(l.master_addr.unwrap().value, "10.0.0.7");
        assert_eq!(l.nnodes.unwrap().value, Nodes { min: 2, max: 2 });
        assert!(l.notes.contains(&"SKYPILOT_NUM_GPUS_PER_NODE=0".to_owned()));
        let err = layout(&[("SKYPILOT_NODE_IPS", "10.0.0.7"), ("SKYPILOT_NUM_NODES", "2")]).unwrap_err();
        assert!(err.contains("SKYPILOT_NODE_IPS lists 1 address but SKYPILOT_NUM_NODES=2"), "{err}");
    }

    #[test]
    fn engines_that_contradict_each_other_are_refused_by_name() {
        let err = layout(&[("PET_NNODES", "2"), ("SLURM_NNODES", "3")]).unwrap_err();
        assert!(err.contains("the engines disagree: SLURM_NNODES=3 but PET_NNODES=2"), "{err}");
        let err =
            layout(&[("PET_NODE_RANK", "1"), ("SKYPILOT_NODE_RANK", "0"), ("SKYPILOT_NODE_IPS", "a")]).unwrap_err();
        assert!(err.contains("PET_NODE_RANK=1 but SKYPILOT_NODE_RANK=0"), "{err}");
        // Agreeing engines are one layout.
        let l = layout(&[("PET_NNODES", "2"), ("SLURM_NNODES", "2")]).unwrap();
        assert_eq!(l.engines, vec!["Slurm", "Kubeflow TrainJob"]);
    }

    #[test]
    fn malformed_values_are_named() {
        let err = layout(&[("PET_NNODES", "two")]).unwrap_err();
        assert_eq!(err, "PET_NNODES=\"two\" is not a number (it gives --nnodes under Kubeflow TrainJob)");
        assert_eq!(layout(&[("PET_NNODES", "1:3")]).unwrap().nnodes.unwrap().value, Nodes { min: 1, max: 3 });
        let err = layout(&[("PET_MASTER_PORT", "99999")]).unwrap_err();
        assert!(err.contains("PET_MASTER_PORT=\"99999\" is not a port number"), "{err}");
        assert_eq!(layout(&[]).unwrap(), Layout::default());
    }
}
