#!/usr/bin/env bash
# A real Slurm cluster of several hosts on this machine: each host is a network namespace with an
# address of its own, a hostname of its own (a UTS namespace) and its own spool folder, joined by
# a bridge; `ctl` runs slurmctld, `node1` to `nodeN` run one slurmd each; one munged (the key
# shared) serves them all through its socket. Debian's slurm-wlm and munge, as root
# (scripts/setup.sh --tests installs them). The tests of tests/integration/slurm_hosts.rs use it,
# and so can a person:
#
#   scripts/slurm-cluster.sh up DIR [NODES]   # NODES hosts (default 3); prints the env to source
#   DIR/on-ctl sbatch -N 2 --ntasks-per-node 2 job.sh   # a client command, from the ctl host
#   . DIR/env                                 # or: SLURM_CONF and on_ctl CMD... in this shell
#   scripts/slurm-cluster.sh down DIR         # stops exactly what `up` started, removes it all
#
# Partitions: `low` (the default) and `high` over the same nodes; a job in `high` preempts one in
# `low`, which Slurm requeues (PreemptType=preempt/partition_prio, PreemptMode=REQUEUE).
# Host names resolve inside the hosts (each daemon sees DIR/hosts as /etc/hosts): node0's launcher
# finds `node1` as any cluster's DNS would give it.
set -euo pipefail

usage() { echo "usage: scripts/slurm-cluster.sh up DIR [NODES] | down DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
action=$1 dir=$2 nodes=${3:-3}
[ "$(id -u)" = 0 ] || { echo "slurm-cluster: needs root (network namespaces, slurmd)" >&2; exit 1; }

# Names and a subnet of this cluster's own, from its folder: two clusters never share them.
id=$(printf '%s' "$(realpath -m "$dir")" | cksum | cut -c1-6)
subnet="10.$((200 + id % 50)).$((id / 50 % 250)).0"
net=${subnet%.0}
ns() { echo "rs${id}$1"; }

down() {
  [ -d "$dir" ] || return 0
  for pidfile in "$dir"/pids/*; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
  for pidfile in "$dir"/pids/*; do
    [ -f "$pidfile" ] && kill -9 "$(cat "$pidfile")" 2>/dev/null || true
  done
  for n in $(cat "$dir/namespaces" 2>/dev/null); do
    ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$n" 2>/dev/null || true
  done
  rm -rf "$dir"
}

if [ "$action" = down ]; then
  down
  exit 0
fi
[ "$action" = up ] || usage
[ ! -e "$dir" ] || { echo "slurm-cluster: $dir exists; run 'scripts/slurm-cluster.sh down $dir' first" >&2; exit 1; }
for tool in slurmctld slurmd munged sbatch ip unshare nsenter; do
  command -v "$tool" >/dev/null || { echo "slurm-cluster: $tool is missing; run ./scripts/setup.sh --tests" >&2; exit 1; }
done
mkdir -p "$dir"/{state,spool,log,pids,munge}
dir=$(realpath "$dir")
trap 'echo "slurm-cluster: up failed; logs in $dir/log" >&2' ERR

# The network: a bridge in a namespace of its own, a veth from it to each host.
bridge=$(ns br)
ip netns add "$bridge"
echo "$bridge" >"$dir/namespaces"
ip -n "$bridge" link add br0 type bridge
ip -n "$bridge" link set br0 up
hosts="ctl"
for i in $(seq 1 "$nodes"); do hosts="$hosts node$i"; done
: >"$dir/hosts"
echo "127.0.0.1 localhost" >>"$dir/hosts"
i=0
for h in $hosts; do
  i=$((i + 1))
  n=$(ns "$h")
  ip netns add "$n"
  echo "$n" >>"$dir/namespaces"
  ip link add "v${id}$i" type veth peer name "p${id}$i"
  ip link set "v${id}$i" netns "$n"
  ip link set "p${id}$i" netns "$bridge"
  ip -n "$bridge" link set "p${id}$i" master br0 up
  ip -n "$n" addr add "$net.$i/24" dev "v${id}$i"
  ip -n "$n" link set "v${id}$i" up
  ip -n "$n" link set lo up
  echo "$net.$i $h" >>"$dir/hosts"
done

# munge: one daemon, a fresh key; its socket is a file every namespace reaches.
head -c 1024 /dev/urandom >"$dir/munge/munge.key"
chmod 600 "$dir/munge/munge.key"
munged --force --key-file "$dir/munge/munge.key" --socket "$dir/munge/socket" \
  --pid-file "$dir/pids/munged" --log-file "$dir/log/munged.log" --seed-file "$dir/munge/seed"
for _ in $(seq 1 100); do [ -S "$dir/munge/socket" ] && break; sleep 0.1; done

nodelist="node[1-$nodes]"
cat >"$dir/slurm.conf" <<CONF
ClusterName=runnerhosts
SlurmctldHost=ctl($net.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/socket,cred_expire=5
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/pids/slurmctld.pidfile
SlurmdPidFile=$dir/pids/slurmd-%n.pidfile
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=600
SlurmdTimeout=10
CONF
for i in $(seq 1 "$nodes"); do
  echo "NodeName=node$i NodeAddr=$net.$((i + 1)) CPUs=4 State=UNKNOWN" >>"$dir/slurm.conf"
done
cat >>"$dir/slurm.conf" <<CONF
PartitionName=low Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=high Nodes=$nodelist MaxTime=INFINITE State=UP PriorityTier=2
CONF

# A daemon on host $1: its namespace, its hostname, DIR/hosts as /etc/hosts; its pid recorded.
on_host() {
  local host=$1
  shift
  # nsenter enters the network namespace only: `ip netns exec` would mount a sysfs of its own,
  # without the cgroup file system slurmd looks for.
  nsenter --net="/var/run/netns/$(ns "$host")" unshare --uts --mount --propagation private sh -c \
    "mount --bind '$dir/hosts' /etc/hosts && hostname $host && exec \"\$@\"" sh "$@" \
    >>"$dir/log/$host.out" 2>&1 &
  echo $! >"$dir/pids/$host"
}
export SLURM_CONF="$dir/slurm.conf"
for i in $(seq 1 "$nodes"); do mkdir -p "$dir/spool/node$i"; done
on_host ctl slurmctld -D -i
for i in $(seq 1 "$nodes"); do on_host "node$i" slurmd -D -N "node$i"; done

# A Slurm client command (sbatch, srun, squeue, scontrol, sinfo) run from the ctl host.
cat >"$dir/on-ctl" <<SCRIPT
#!/bin/sh
export SLURM_CONF=$dir/slurm.conf
exec nsenter --net=/var/run/netns/$(ns ctl) unshare --mount --propagation private sh -c \
  "mount --bind '$dir/hosts' /etc/hosts && exec \"\\\$@\"" sh "\$@"
SCRIPT
chmod +x "$dir/on-ctl"
cat >"$dir/env" <<ENV
export SLURM_CONF=$dir/slurm.conf
on_ctl() { $dir/on-ctl "\$@"; }
ENV
# shellcheck source=/dev/null
. "$dir/env"
for _ in $(seq 1 600); do
  idle=$(on_ctl sinfo -h -N -p low -o '%T' 2>/dev/null | grep -c '^idle$' || true)
  [ "$idle" = "$nodes" ] && break
  sleep 0.1
done
if [ "$idle" != "$nodes" ]; then
  echo "slurm-cluster: only $idle of $nodes nodes idle after 60 s; logs in $dir/log" >&2
  exit 1
fi
echo "slurm-cluster: $nodes hosts up ($nodelist at $net.2-$((nodes + 1)), slurmctld on ctl at $net.1); . $dir/env"
