#!/usr/bin/env bash
# A real SLURM cluster on this one machine, for tests that want real sbatch/srun/scontrol/squeue:
# slurmctld + one slurmd (node "localhost"), or with SLURM_NODES=2 two slurmd daemons on the same
# machine posing as two nodes, "node1" and "node2" (both 127.0.0.1, slurmd ports 6818 and 6819), so
# that multi-node jobs (srun --nodes=2, SLURM_NODEID 0 and 1) run too. For that mode the script adds
# "127.0.0.1 node1 node2" to /etc/hosts (if they do not resolve yet): job scripts use node names as
# addresses (e.g. the head node of a torch.distributed rendezvous), as on a real cluster.
#
# Tested on Debian 12 (bookworm) with Debian's Slurm 22.05.8, as root, without systemd, 2 CPUs,
# inside a gVisor (runsc) sandbox. No cgroups there: proctrack/linuxproc and task/none (no CPU
# binding, no memory limits). No accounting daemon: `sacct` does not work; use squeue,
# `scontrol show job`, and the job completion log /var/log/slurm/jobcomp.log.
#
#   bash setup_slurm.sh            # install if needed, write the config, (re)start all daemons
#   bash setup_slurm.sh stop       # stop the daemons, by the PIDs in their pid files
#   bash setup_slurm.sh status     # which daemons run, and sinfo
#
# Environment:
#   SLURM_NODES=1|2        nodes to pose as (default 1); with 2, the machine's CPUs are split between them
#   SLURM_NODE_CPUS=N      CPUs per node (default: all CPUs / SLURM_NODES, at least 1)
#   SLURM_CLEAN_STATE=1    start slurmctld with -c: forget the jobs of a previous start
#   SLURM_OVERSUBSCRIBE=N  let N jobs share each CPU (default 1: none)
#
# Notes for job scripts:
#   - Requeued batch jobs wait about 2 minutes before they are eligible again (Reason=BeginTime):
#     Slurm's own delay, not a configuration choice here.
#   - There are no GPUs (no GRES): `--gpus-per-node=1` is refused ("Invalid generic resource");
#     pass --gpus-per-node=0. Ask for at most SLURM_NODE_CPUS CPUs per node, or the job pends
#     forever with Reason=PartitionConfig.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_ROOT=/var/spool/slurmd
LOG_DIR=/var/log/slurm
CTLD_PID=/run/slurmctld.pid
MUNGE_PID=/run/munge/munged.pid
NODES=${SLURM_NODES:-1}

log() { printf 'setup_slurm: %s\n' "$*"; }
die() { printf 'setup_slurm: ERROR: %s\n' "$*" >&2; exit 1; }

node_names() { # the NodeNames, one per line
  if [ "$NODES" = 2 ]; then printf 'node1\nnode2\n'; else echo localhost; fi
}
slurmd_pidfile() { echo "/run/slurmd-$1.pid"; }

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() { # stop_pidfile NAME FILE
  if pid_alive "$2"; then
    local pid
    pid=$(cat "$2")
    log "stopping $1 (pid $pid)"
    kill "$pid"
    for _ in $(seq 1 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
      log "$1 (pid $pid) still running after 10 s: SIGKILL"
      kill -9 "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$2"
}

stop_all() {
  local file
  # Every slurmd of any earlier start (one or two nodes), then the controller, then munge.
  for file in /run/slurmd-*.pid /run/slurmd.pid; do
    [ -e "$file" ] && stop_pidfile "slurmd ($(basename "$file" .pid))" "$file"
  done
  stop_pidfile slurmctld "$CTLD_PID"
  stop_pidfile munged "$MUNGE_PID"
}

status() {
  local file
  for file in "$MUNGE_PID" "$CTLD_PID" /run/slurmd-*.pid; do
    [ -e "$file" ] || continue
    if pid_alive "$file"; then log "$(basename "$file" .pid): running, pid $(cat "$file")"
    else log "$(basename "$file" .pid): not running (stale pid file)"; fi
  done
  sinfo 2>&1 || true
}

case ${1:-start} in
  stop) stop_all; exit 0 ;;
  status) status; exit 0 ;;
  start) ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac

[ "$(id -u)" = 0 ] || die "must run as root"
[[ $NODES =~ ^[12]$ ]] || die "SLURM_NODES must be 1 or 2, not '$NODES'"
if [ "$NODES" = 2 ] && ! { getent hosts node1 >/dev/null && getent hosts node2 >/dev/null; }; then
  log "adding '127.0.0.1 node1 node2' to /etc/hosts"
  echo "127.0.0.1 node1 node2 # setup_slurm.sh" >>/etc/hosts
fi
# nproc answers OMP_NUM_THREADS when it is set (the test suites set it to 1): without it, the CPUs this
# process may use. A node of 1 CPU would leave a 2-task job pending for ever (Reason=PartitionConfig).
CPUS=${SLURM_NODE_CPUS:-$(($(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc) / NODES))}
[ "$CPUS" -ge 1 ] || CPUS=1
started=$(date +%s)

# 1. Packages. Debian's slurm-wlm meta-package pulls in ~20 plugin and -dev packages; these suffice.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null ||
  ! command -v munged >/dev/null; then
  log "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
log "$(slurmctld -V) (Debian package $(dpkg-query -W -f='${Version}' slurmctld))"

# 2. Restart cleanly if a previous start left daemons running.
stop_all

# 3. munge: the key (Debian's package creates one; make it if missing), its directories, the daemon.
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  log "creating /etc/munge/munge.key"
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID"
for _ in $(seq 1 50); do
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
  sleep 0.2
done
munge -n | unmunge >/dev/null || die "munge does not work (see /var/log/munge/munged.log)"
log "munged: pid $(cat "$MUNGE_PID")"

# 4. slurm.conf: no cgroups, no accounting, requeue allowed.
install -d -m 0755 "$CONF_DIR" "$STATE_DIR" "$SPOOL_ROOT" "$LOG_DIR"
{
  cat <<EOF
# Written by setup_slurm.sh: a $NODES-node cluster on this one machine.
ClusterName=localcluster
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
SlurmctldPort=6817
StateSaveLocation=$STATE_DIR
# %n: the node's name, so that two slurmd daemons on one machine keep apart.
SlurmdSpoolDir=$SPOOL_ROOT/%n
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldPidFile=$CTLD_PID
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups (not usable in a gVisor sandbox): processes tracked by parentage, no CPU binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# No slurmdbd: sacct does not work; finished jobs are logged to the jobcomp file.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
JobRequeue=1
ReturnToService=2
# Finished jobs stay visible to squeue / scontrol show job for 10 minutes.
MinJobAge=600
KillWait=30
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
EOF
  # Not "localhost" in the 2-node mode: with it Slurm 22.05 stops with "Duplicated NodeHostName".
  port=6818
  for name in $(node_names); do
    echo "NodeName=$name NodeHostname=$name NodeAddr=127.0.0.1 Port=$port CPUs=$CPUS State=UNKNOWN"
    port=$((port + 1))
  done
  # OverSubscribe: up to SLURM_OVERSUBSCRIBE jobs share a CPU, so that tests run their jobs side by side.
  echo "PartitionName=debug Nodes=$(node_names | paste -sd, -) Default=YES MaxTime=INFINITE State=UP" \
    "OverSubscribe=FORCE:${SLURM_OVERSUBSCRIBE:-1}"
} >"$CONF_DIR/slurm.conf"

# 5. Daemons (each daemonizes itself). slurmd -N NAME: which node of slurm.conf this daemon is.
ctld_args=()
[ "${SLURM_CLEAN_STATE:-0}" = 1 ] && ctld_args+=(-c)
/usr/sbin/slurmctld "${ctld_args[@]}"
for name in $(node_names); do
  install -d -m 0755 "$SPOOL_ROOT/$name"
  /usr/sbin/slurmd -N "$name"
done

# 6. Wait until every node is idle (resume any left down by an earlier run), then run srun end to end.
for name in $(node_names); do
  state=""
  for _ in $(seq 1 60); do
    state=$(sinfo -h -n "$name" -o %T 2>/dev/null || true)
    case $state in idle | mixed | allocated | completing) break ;; esac
    sleep 0.5
  done
  case $state in
    idle | mixed | allocated | completing) ;;
    *)
      log "node $name is '$state': resuming it"
      scontrol update NodeName="$name" State=RESUME || true
      sleep 2
      ;;
  esac
  log "slurmd $name: pid $(cat "$(slurmd_pidfile "$name")")"
done
log "slurmctld: pid $(cat "$CTLD_PID")"
sinfo
# shellcheck disable=SC2016  # expands in the task, on its node
out=$(timeout 60 srun -N"$NODES" -n"$NODES" bash -c 'echo "node $SLURMD_NODENAME (rank $SLURM_NODEID)"' 2>&1) ||
  die "srun failed: $out"
printf '%s\n' "$out" | sort | sed 's/^/setup_slurm: srun -> /'
log "ready in $(($(date +%s) - started)) s"
