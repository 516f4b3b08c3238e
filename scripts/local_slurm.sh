#!/usr/bin/env bash
# A real SLURM (Debian's slurm-wlm, 22.05 on Debian 12) on this one machine, for trying the cluster path:
#
#   scripts/local_slurm.sh start    # install what is missing, write the config, start the daemons, wait for idle nodes
#   scripts/local_slurm.sh status   # daemons, nodes, and the line to export
#   scripts/local_slurm.sh stop     # stop every daemon this script started (safe to run twice)
#   eval "$(scripts/local_slurm.sh env)"   # SLURM_CONF (and the sacct stand-in on PATH) for this shell
#
# Everything lives in $LS_SLURM_DIR (default /tmp/ls-slurm): slurm.conf, cgroup.conf, its own munge key
# and socket, state, spool and log directories, pid files. Nothing under /etc is changed; the clients find
# the cluster through SLURM_CONF. Two node names (LS_SLURM_NODES, default 2) run as separate slurmd
# processes on this host (slurmd -N NAME, one port and spool directory each), so a 2-node job runs here.
# Every daemon binds 127.0.0.1 only (CommunicationParameters=NoCtldInAddrAny,NoInAddrAny; this host's name must resolve
# to a loopback address, which `start` checks). Needs root (apt-get, daemons running as root).
#
# Settings (environment): LS_SLURM_DIR, LS_SLURM_NODES (1-4), LS_SLURM_CPUS (CPUs each node announces,
# default 4: more than the machine has is fine for tests), LS_SLURM_MEM_MB (default 4096 per node),
# LS_SLURM_PORT (slurmctld; slurmd ports follow it; default 16817), LS_SLURM_WAIT_S (default 60).
set -euo pipefail

DIR="${LS_SLURM_DIR:-/tmp/ls-slurm}"
NODES="${LS_SLURM_NODES:-2}"
CPUS="${LS_SLURM_CPUS:-4}"
MEM="${LS_SLURM_MEM_MB:-4096}"
PORT="${LS_SLURM_PORT:-16817}"
WAIT_S="${LS_SLURM_WAIT_S:-60}"
CONF="$DIR/slurm.conf"
SOCK="$DIR/munge/munge.socket"

log() { echo "[local_slurm] $*" >&2; }
die() { echo "[local_slurm] error: $*" >&2; exit 1; }
node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "ls$i"; done; }

install_missing() {
  local missing=()
  command -v munged >/dev/null 2>&1 || missing+=(munge)
  command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
  command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "needs root to install ${missing[*]} (apt-get)"
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found; install ${missing[*]} (Slurm 22.05+, munge) yourself"
  log "installing ${missing[*]} (apt-get)"
  local t0=$SECONDS
  timeout 600 apt-get update -qq
  # policy-rc.d 101: the packages' own service scripts must not start the system-wide daemons
  local policy=/usr/sbin/policy-rc.d created_policy=0
  if [ ! -e "$policy" ]; then printf '#!/bin/sh\nexit 101\n' > "$policy"; chmod +x "$policy"; created_policy=1; fi
  DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
    || { [ $created_policy -eq 1 ] && rm -f "$policy"; die "apt-get install slurm-wlm munge failed"; }
  [ $created_policy -eq 1 ] && rm -f "$policy"
  log "installed in $((SECONDS - t0)) s"
}

write_config() {
  mkdir -p "$DIR"/{munge,state,log,run,spool}
  chmod 700 "$DIR/munge"
  local host; host="$(hostname -s)"
  local addr; addr="$(getent ahostsv4 "$host" | awk 'NR==1{print $1}')"
  case "$addr" in
    127.*) ;;
    *) die "this host's name '$host' resolves to '${addr:-nothing}', not a loopback address; the local cluster binds loopback only (add '127.0.1.1 $host' to /etc/hosts)";;
  esac
  local nodes=() i
  mapfile -t nodes < <(node_names)
  {
    echo "# written by scripts/local_slurm.sh; a one-machine test cluster, loopback only"
    echo "ClusterName=lightning-straggler"
    echo "SlurmctldHost=$host(127.0.0.1)"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "SlurmctldPort=$PORT"
    echo "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "AuthInfo=socket=$SOCK"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/pgid"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    echo "MpiDefault=none"
    echo "SwitchType=switch/none"
    echo "SchedulerType=sched/backfill"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_Core"
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "SlurmctldTimeout=30"
    echo "SlurmdTimeout=60"
    echo "InactiveLimit=0"
    echo "MinJobAge=300"
    echo "KillWait=5"
    echo "Waittime=0"
    echo "SrunPortRange=$((PORT + 100))-$((PORT + 199))"
    for ((i = 0; i < ${#nodes[@]}; i++)); do
      echo "NodeName=${nodes[$i]} NodeHostname=$host NodeAddr=127.0.0.1 Port=$((PORT + 1 + i)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=120 State=UP"
  } > "$CONF"
  # No cgroup plugin is configured (proctrack/pgid, task/none); this file only keeps slurmd from probing.
  printf 'CgroupPlugin=cgroup/v1\nIgnoreSystemd=yes\nConstrainCores=no\nConstrainRAMSpace=no\n' > "$DIR/cgroup.conf"
  # No accounting database here, so no real sacct: submitit polls `sacct -o JobID,State,NodeList --parsable2
  # -j ID...` to learn that a job failed (else it waits for a result file forever). This stand-in answers
  # from slurmctld's memory of recent jobs (kept MinJobAge=300 s after they end) via scontrol.
  mkdir -p "$DIR/bin"
  cat > "$DIR/bin/sacct" <<'SH'
#!/usr/bin/env bash
# sacct stand-in of scripts/local_slurm.sh (no accounting database): JobID|State|NodeList from scontrol
ids=()
while [ $# -gt 0 ]; do
  case "$1" in -j|--jobs) ids+=("${2//,/ }"); shift 2;; -j*) ids+=("${1#-j}"); shift;; *) shift;; esac
done
echo "JobID|State|NodeList"
for id in ${ids[@]}; do
  timeout 10 scontrol show job -o "${id%%_*}" 2>/dev/null | awk '{
    delete f; for (i = 1; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = substr($i, length(kv[1]) + 2) }
    id = f["JobId"]
    if (f["ArrayJobId"] != "") { t = f["ArrayTaskId"]; sub(/%.*/, "", t); id = f["ArrayJobId"] "_" (t ~ /^[0-9]+$/ ? t : "[" t "]") }
    print id "|" f["JobState"] "|" f["NodeList"] }'
done
SH
  chmod +x "$DIR/bin/sacct"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$DIR/munge/munge.key"
  fi
}

pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_daemons() {
  if ! pid_alive "$DIR/run/munged.pid"; then
    rm -f "$SOCK" "$SOCK.lock"
    munged --force --socket="$SOCK" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/run/munged.pid" \
      --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
      || die "munged did not start (see $DIR/log/munged.log)"
  fi
  export SLURM_CONF="$CONF"
  if ! pid_alive "$DIR/run/slurmctld.pid"; then
    slurmctld -f "$CONF" -i || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
  fi
  local n
  for n in $(node_names); do
    mkdir -p "$DIR/spool/$n"
    if ! pid_alive "$DIR/run/slurmd-$n.pid"; then
      slurmd -f "$CONF" -N "$n" || die "slurmd -N $n did not start (see $DIR/log/slurmd-$n.log)"
    fi
  done
}

wait_idle() {
  local deadline=$((SECONDS + WAIT_S)) states=""
  export SLURM_CONF="$CONF"
  while ((SECONDS < deadline)); do
    states="$(timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null || true)"
    if [ -n "$states" ] && [ "$(echo "$states" | grep -c ' idle$')" -eq "$NODES" ]; then
      log "cluster up: $NODES node(s) idle ($(echo "$states" | awk '{print $1}' | paste -sd,)); export SLURM_CONF=$CONF PATH=$DIR/bin:\$PATH"
      return 0
    fi
    # nodes that came back down (e.g. after an earlier stop) are resumed once
    echo "$states" | awk '$2 ~ /down|drain|drng/ {print $1}' | while read -r n; do
      timeout 10 scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
    done
    sleep 1
  done
  die "nodes not idle after $WAIT_S s: ${states:-sinfo gave no answer}; logs in $DIR/log/"
}

stop_pidfile() {
  local f="$1" pid
  [ -f "$f" ] || return 0
  pid="$(cat "$f")"
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

stop_all() {
  if [ -f "$CONF" ] && pid_alive "$DIR/run/slurmctld.pid"; then
    # jobs first, and wait (bounded) until they are gone, so that no slurmstepd is left running a task
    SLURM_CONF="$CONF" timeout 10 scancel --user="$(id -un)" >/dev/null 2>&1 || true
    local end=$((SECONDS + 20))
    while ((SECONDS < end)) && [ -n "$(SLURM_CONF="$CONF" timeout 10 squeue -h -o %i 2>/dev/null || true)" ]; do sleep 1; done
  fi
  local f
  for f in "$DIR"/run/slurmd-*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
  stop_pidfile "$DIR/run/slurmctld.pid"
  stop_pidfile "$DIR/run/munged.pid"
  rm -rf "$DIR/state" "$DIR/spool"
  log "stopped"
}

status() {
  local f any=0
  for f in "$DIR/run/munged.pid" "$DIR/run/slurmctld.pid" "$DIR"/run/slurmd-*.pid; do
    [ -e "$f" ] || continue
    if pid_alive "$f"; then echo "$(basename "$f" .pid): running (pid $(cat "$f"))"; any=1
    else echo "$(basename "$f" .pid): not running (stale pid file)"; fi
  done
  if [ $any -eq 0 ]; then echo "local cluster not running ($DIR)"; return 3; fi
  SLURM_CONF="$CONF" timeout 10 sinfo -N || true
  echo "export SLURM_CONF=$CONF PATH=$DIR/bin:\$PATH"
}

case "${1:-}" in
  start)
    t0=$SECONDS
    install_missing
    write_config
    start_daemons
    wait_idle
    log "started in $((SECONDS - t0)) s"
    ;;
  stop) stop_all ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF PATH=$DIR/bin:\$PATH" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
