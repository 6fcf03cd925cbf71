#!/usr/bin/env bash
# A one-node Slurm cluster on this host, for trying deploy/slurm/*.sbatch and for
# `make slurm-test` (/work/shared/ENGINES.md, "Slurm"): Debian's slurm-wlm + munge.
#
#   bash deploy/slurm/local-cluster.sh up     install (apt, when missing), configure, start the
#                                             daemons that are not running, wait for the node idle
#   bash deploy/slurm/local-cluster.sh down   stop munged, slurmd, slurmctld (by their PID files)
#   bash deploy/slurm/local-cluster.sh status what runs, and sinfo
#
# Idempotent: `up` on a running cluster only checks it. /etc/slurm/slurm.conf is written (and
# rewritten when this host's name, cores or memory change) only when absent or written by this
# script; a slurm.conf of someone else's is used as it is. No cgroup plugins (task/none,
# proctrack/linuxproc): a container's cgroups are often not delegated. Runs as root (or with
# passwordless sudo); jobs then run as the submitting user.
set -euo pipefail

CONF=${SLURM_CONF:-/etc/slurm/slurm.conf}
LOGDIR=/var/log/slurm
MARK="# written by recsys-stack deploy/slurm/local-cluster.sh"
WAIT_S=${SLURM_UP_TIMEOUT:-120}
HOST=$(hostname -s)

if [ "$(id -u)" -eq 0 ]; then SUDO=(); elif sudo -n true 2>/dev/null; then SUDO=(sudo -n);
else SUDO=(); fi
need_root() {
  if [ "$(id -u)" -ne 0 ] && [ ${#SUDO[@]} -eq 0 ]; then
    echo "error: $1 needs root: run 'sudo bash deploy/slurm/local-cluster.sh up' once" >&2
    exit 1
  fi
}
as_root() { "${SUDO[@]}" "$@"; }

# The PID in FILE if that process runs and its command is NAME (not a recycled PID).
running() {  # NAME FILE
  local pid
  pid=$(as_root cat "$2" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && echo "$pid"
}

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
  need_root "installing slurm-wlm and munge (apt)"
  echo "installing slurm-wlm munge (apt)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq slurm-wlm munge >/dev/null
}

write_conf() {
  local cpus mem_mb conf
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc honours OMP_NUM_THREADS
  # 95% of MemTotal: slurmd drains a node whose configured memory exceeds what it finds.
  mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.95}' /proc/meminfo)
  conf="$MARK
ClusterName=recsys
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
MinJobAge=900
KillWait=30
NodeName=$HOST CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    echo "using the existing $CONF (not written by this script)"
    return 0
  fi
  if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$conf" ]; then return 0; fi
  need_root "writing $CONF"
  as_root mkdir -p "$(dirname "$CONF")"
  printf '%s\n' "$conf" | as_root tee "$CONF.tmp" >/dev/null
  as_root mv "$CONF.tmp" "$CONF"
  echo "wrote $CONF (node $HOST: $cpus CPUs, $mem_mb MB)"
  CONF_CHANGED=1
}

start() {
  need_root "starting munged, slurmctld and slurmd"
  as_root mkdir -p /var/spool/slurmctld /var/spool/slurmd "$LOGDIR" /run/munge /var/log/munge /var/lib/munge
  as_root chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if [ ! -s /etc/munge/munge.key ]; then
    as_root dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    as_root chown munge:munge /etc/munge/munge.key
    as_root chmod 400 /etc/munge/munge.key
  fi
  # stdio to /dev/null: a daemon that kept its starter's pipes open would keep that reader
  # (a test's subprocess.run) waiting for EOF forever.
  if ! running munged /run/munge/munged.pid >/dev/null; then
    as_root su -s /bin/sh munge -c /usr/sbin/munged </dev/null >/dev/null 2>&1
  fi
  if [ -n "${CONF_CHANGED:-}" ]; then stop_daemons slurmd slurmctld; fi
  if ! running slurmctld /run/slurmctld.pid >/dev/null; then
    as_root slurmctld </dev/null >/dev/null 2>&1 || fail "slurmctld did not start" slurmctld
  fi
  if ! running slurmd /run/slurmd.pid >/dev/null; then
    as_root slurmd </dev/null >/dev/null 2>&1 || fail "slurmd did not start" slurmd
  fi
}

fail() {  # MESSAGE DAEMON
  echo "error: $1; its log: $LOGDIR/$2.log (last lines below)" >&2
  as_root tail -n 15 "$LOGDIR/$2.log" >&2 2>/dev/null || true
  exit 1
}

wait_idle() {
  local deadline=$((SECONDS + WAIT_S)) state="" resumed=""
  while [ $SECONDS -lt $deadline ]; do
    state=$(sinfo -h -N -n "$HOST" -o %T 2>/dev/null | head -n1 || true)
    case "$state" in
      idle|mixed|allocated|completing) echo "slurm: node $HOST $state (sinfo)"; return 0 ;;
      drain*|down*)
        # a state saved by an earlier run (e.g. a reboot's "Not responding"): ours to resume
        if [ -z "$resumed" ] && [ $SECONDS -gt 5 ]; then
          as_root scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true
          resumed=1
        fi ;;
    esac
    sleep 1
  done
  echo "error: node $HOST not idle after ${WAIT_S} s (sinfo: '${state:-no answer}';" \
    "$(sinfo -h -R 2>/dev/null | head -n1)); logs: $LOGDIR/slurmctld.log, $LOGDIR/slurmd.log" >&2
  as_root tail -n 8 "$LOGDIR/slurmctld.log" "$LOGDIR/slurmd.log" >&2 2>/dev/null || true
  exit 1
}

stop_daemons() {  # NAME... (slurmd, slurmctld, munged)
  local name file pid
  for name in "$@"; do
    case $name in munged) file=/run/munge/munged.pid ;; *) file=/run/$name.pid ;; esac
    pid=$(running "$name" "$file") || continue
    as_root kill "$pid"
    for _ in $(seq 50); do [ -d "/proc/$pid" ] || break; sleep 0.2; done
    echo "stopped $name (pid $pid)"
  done
}

case ${1:-} in
  up) install; write_conf; start; wait_idle ;;
  down) stop_daemons slurmd slurmctld munged ;;
  status)
    for d in munged:/run/munge/munged.pid slurmctld:/run/slurmctld.pid slurmd:/run/slurmd.pid; do
      pid=$(running "${d%%:*}" "${d#*:}") && echo "${d%%:*}: pid $pid" || echo "${d%%:*}: not running"
    done
    sinfo 2>&1 || true ;;
  *) echo "usage: bash deploy/slurm/local-cluster.sh up|down|status" >&2; exit 2 ;;
esac
