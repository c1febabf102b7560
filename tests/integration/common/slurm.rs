//! A real single-node Slurm cluster for the tests: Debian's slurm-wlm (`slurmctld`, `slurmd`)
//! and its own `munged`, on free ports, with a temporary `slurm.conf`, state and spool folders.
//! One cluster per test binary ([`cluster`]), started on first use; a watchdog stops exactly the
//! daemons it started (by pid) and removes the folder when the test process ends, however it ends.
//!
//! It needs root (slurmd runs jobs as their users) and the packages `scripts/setup.sh --tests`
//! installs. Where either is missing, a test fails when CI=true and otherwise prints a SKIPPED
//! line and returns: [`cluster`] gives `None`.
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub struct Cluster {
    /// The cluster's folder: slurm.conf, state, spool, logs, munge's socket and key.
    pub dir: PathBuf,
    /// The slurm.conf every client command needs in SLURM_CONF.
    pub conf: PathBuf,
    /// The node's name (this machine's hostname).
    pub node: String,
    /// munged, slurmctld, slurmd and the watchdog, never waited for: the watchdog ends them.
    _processes: Vec<std::process::Child>,
}

/// The binary's cluster, started on first use; `None` (after a SKIPPED line) where it cannot run
/// here and CI is not set.
pub fn cluster() -> Option<&'static Cluster> {
    static CLUSTER: OnceLock<Option<Cluster>> = OnceLock::new();
    CLUSTER
        .get_or_init(|| match why_impossible() {
            None => Some(Cluster::start()),
            Some(why) => {
                let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
                assert!(!ci, "the Slurm tests cannot run here ({why}), and CI=true: they must");
                eprintln!("\n*** SKIPPED: the Slurm tests cannot run here: {why} ***\n");
                None
            }
        })
        .as_ref()
}

/// Why no cluster can be started on this machine, if so.
fn why_impossible() -> Option<String> {
    if !nix::unistd::Uid::effective().is_root() {
        return Some("they need root (slurmd starts jobs as their user)".into());
    }
    let missing: Vec<&str> = ["slurmctld", "slurmd", "srun", "sbatch", "munged"]
        .into_iter()
        .filter(|tool| Command::new("which").arg(tool).stdout(Stdio::null()).status().map_or(true, |s| !s.success()))
        .collect();
    (!missing.is_empty()).then(|| {
        format!(
            "{} missing; run ./scripts/setup.sh --tests as root (it installs slurm-wlm and munge)",
            missing.join(", ")
        )
    })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::Builder::new().prefix("runner-slurm-").tempdir().unwrap().keep();
        let node = nix::unistd::gethostname().unwrap().to_string_lossy().into_owned();
        let d = |p: &str| dir.join(p);
        for sub in ["state", "spool", "munge"] {
            std::fs::create_dir_all(d(sub)).unwrap();
        }
        // A key of its own: this cluster shares nothing with a munged the machine may run.
        let mut key = vec![0u8; 1024];
        std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom").unwrap(), &mut key).unwrap();
        std::fs::write(d("munge/munge.key"), key).unwrap();
        set_mode(&d("munge/munge.key"), 0o600);
        set_mode(&d("munge"), 0o755);
        let socket = d("munge/munge.socket");
        let conf = d("slurm.conf");
        std::fs::write(&conf, slurm_conf(&dir, &node, &socket)).unwrap();

        let munged = Command::new("munged")
            .args(["--foreground", "--force", "--key-file"])
            .arg(d("munge/munge.key"))
            .arg("--socket")
            .arg(&socket)
            .arg("--pid-file")
            .arg(d("munge/munged.pid"))
            .arg("--log-file")
            .arg(d("munge/munged.log"))
            .arg("--seed-file")
            .arg(d("munge/seed"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("munged starts");
        wait_for(|| socket.exists(), "munged's socket", &dir);
        // Foreground daemons (-D): their pids are known without reading pid files.
        let ctld = Command::new("slurmctld")
            .args(["-D", "-i"])
            .env("SLURM_CONF", &conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("slurmctld starts");
        let slurmd = Command::new("slurmd")
            .args(["-D", "-N", &node])
            .env("SLURM_CONF", &conf)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("slurmd starts");
        let pids = [munged.id(), ctld.id(), slurmd.id()];
        let watchdog = watchdog(&dir, &conf, &pids);
        let cluster = Cluster { dir: dir.clone(), conf, node, _processes: vec![munged, ctld, slurmd, watchdog] };
        wait_for(
            || {
                cluster
                    .command("sinfo")
                    .args(["-h", "-N", "-o", "%T"])
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "idle")
            },
            "the node to be idle in sinfo",
            &dir,
        );
        cluster
    }

    /// A Slurm client command (srun, sbatch, squeue, scontrol, ...) of this cluster, with the
    /// test process's runner variables removed as `common::runner` removes them.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new(program);
        for (k, _) in std::env::vars() {
            if k.starts_with("RUNNER_")
                || k.starts_with("SLURM_")
                || ["RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR"].contains(&k.as_str())
            {
                c.env_remove(k);
            }
        }
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// `runner` as `common::runner()`, as a client of this cluster (`runner sweep --launcher slurm`).
    pub fn runner(&self) -> Command {
        let mut c = super::runner();
        c.env("SLURM_CONF", &self.conf);
        c
    }

    /// `runner` under `srun ARGS`, e.g. `srun -n 2 runner run ...`.
    pub fn srun(&self, srun_args: &[&str]) -> Command {
        let mut c = self.command("srun");
        c.args(srun_args).arg(env!("CARGO_BIN_EXE_runner"));
        c
    }

    /// The state of job `id` (PENDING, RUNNING, COMPLETED, ...), or None once Slurm forgot it.
    pub fn job_state(&self, id: &str) -> Option<String> {
        let o = self.command("squeue").args(["-h", "--states=all", "-j", id, "-o", "%T"]).output().ok()?;
        let s = String::from_utf8_lossy(&o.stdout).trim().to_owned();
        (!s.is_empty()).then_some(s)
    }

    /// slurmctld's and slurmd's logs, for a failing test's message.
    pub fn logs(&self) -> String {
        let tail = |p: &str| {
            let text = std::fs::read_to_string(self.dir.join(p)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(15)..].join("\n")
        };
        format!("slurmctld.log:\n{}\nslurmd.log:\n{}", tail("slurmctld.log"), tail("slurmd.log"))
    }
}

/// The cluster's configuration: one node (this host, 8 CPUs declared over the machine's real ones
/// so that several 2-task jobs run at once), Linux process tracking without cgroups, no task
/// binding, no accounting, and a 5 s credential lifetime: Slurm holds a requeued job back for
/// that long (120 s by default).
fn slurm_conf(dir: &Path, node: &str, socket: &Path) -> String {
    let d = |p: &str| dir.join(p).display().to_string();
    format!(
        "ClusterName=runnertest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={socket},cred_expire=5
StateSaveLocation={state}
SlurmdSpoolDir={spool}
SlurmctldPidFile={ctld_pid}
SlurmdPidFile={slurmd_pid}
SlurmctldLogFile={ctld_log}
SlurmdLogFile={slurmd_log}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=600
NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
",
        ctld = free_port(),
        slurmd = free_port(),
        socket = socket.display(),
        state = d("state"),
        spool = d("spool"),
        ctld_pid = d("slurmctld.pid"),
        slurmd_pid = d("slurmd.pid"),
        ctld_log = d("slurmctld.log"),
        slurmd_log = d("slurmd.log"),
    )
}

/// A shell that outlives nothing: once this test process is gone it cancels the cluster's jobs,
/// stops the daemons started here (their pids, nothing else) and removes the folder.
fn watchdog(dir: &Path, conf: &Path, pids: &[u32]) -> std::process::Child {
    let pids: Vec<String> = pids.iter().map(|p| p.to_string()).collect();
    let script = format!(
        "while kill -0 {me} 2>/dev/null; do sleep 0.5; done
SLURM_CONF='{conf}' scancel --quiet --user=root 2>/dev/null
sleep 2
kill {pids} 2>/dev/null
sleep 1
kill -9 {pids} 2>/dev/null
rm -rf '{dir}'",
        me = std::process::id(),
        conf = conf.display(),
        pids = pids.join(" "),
        dir = dir.display(),
    );
    Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("sh starts")
}

fn wait_for(mut ready: impl FnMut() -> bool, what: &str, dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() {
        if Instant::now() > deadline {
            let log = |p: &str| std::fs::read_to_string(dir.join(p)).unwrap_or_default();
            panic!(
                "the test cluster did not come up: no {what} after 60 s\nslurmctld.log:\n{}\nslurmd.log:\n{}\nmunged.log:\n{}",
                log("slurmctld.log"),
                log("slurmd.log"),
                log("munge/munged.log")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}
