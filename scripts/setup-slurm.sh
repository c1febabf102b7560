#!/usr/bin/env bash
# Installs what the Slurm tests (tests/integration/slurm.rs, slurm_hosts.rs) start: Debian's slurm-wlm
# (slurmctld, slurmd, srun, sbatch, squeue, sacct, scancel, scontrol) and munge, its authentication
# daemon; and iproute2 and util-linux (ip, nsenter, unshare), which make scripts/slurm-cluster.sh's hosts.
# Called by scripts/setup.sh --tests. System packages need root: as root (CI) they are installed
# with apt-get; otherwise this says what to run and returns without failing, and the Slurm tests
# then fail under CI=true or print a SKIPPED line elsewhere.
# Nothing is started or enabled here: the tests start their own daemons, on their own ports and
# a temporary slurm.conf, and stop them when they end.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }
if have slurmctld && have slurmd && have srun && have munged && have ip && have nsenter && have unshare; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "setup: the Slurm tests need slurm-wlm, munge and iproute2, which only root can install:" >&2
  echo "       sudo apt-get install --no-install-recommends slurm-wlm munge iproute2 util-linux" >&2
  exit 0
fi
if ! have apt-get; then
  echo "setup: the Slurm tests need slurmctld, slurmd, srun and munged (Debian: slurm-wlm, munge)" >&2
  exit 0
fi
echo "setup: installing slurm-wlm and munge (Debian packages) for the Slurm tests"
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge iproute2 util-linux >/dev/null; }
if ! install; then
  echo "setup: refreshing the apt package lists"
  apt-get update -qq >/dev/null || { echo "setup: apt-get update failed" >&2; exit 1; }
  install || { echo "setup: apt-get could not install slurm-wlm and munge (see above)" >&2; exit 1; }
fi
# The packages' post-install scripts may start the daemons where systemd runs: the tests use their own.
