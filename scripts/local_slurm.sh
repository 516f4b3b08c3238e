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
# Settings (environment): LS_SLURM_DIR, LS_SLURM_NODES (1-16), LS_SLURM_CPUS (CPUs each node announces,
# default 4: more than the machine has is fine for tests), LS_SLURM_MEM_MB (default 4096 per node),
# LS_SLURM_PORT (slurmctld; slurmd ports follow it; default 16817), LS_SLURM_WAIT_S (default 60).
#
# Nodes as hosts: with LS_SLURM_NETNS="NS1 NS2 ..." (existing network namespaces, one per node, e.g. made by
# benchmarks/network.py's NamespacedHosts) and LS_SLURM_NODE_ADDRS="A1 A2 ..." (each node's address in its
# namespace), node i's slurmd runs inside NSi with NodeAddr=Ai, and slurmctld inside NS1 at A1, so a job's
# tasks run on separate network stacks and talk over the namespaces' links. The daemons then bind every
# address of their own namespace (no NoInAddrAny: the addresses there are the namespaces' only), nothing in
# the machine's own namespace; clients (sbatch, srun, sinfo, a Hydra sweep) must run inside NS1
# (`ip netns exec NS1 ...`), which `env` prints. The namespaces are the caller's: this script neither makes
# nor removes them.
set -euo pipefail

DIR="${LS_SLURM_DIR:-/tmp/ls-slurm}"
NODES="${LS_SLURM_NODES:-2}"
CPUS="${LS_SLURM_CPUS:-4}"
MEM="${LS_SLURM_MEM_MB:-4096}"
PORT="${LS_SLURM_PORT:-16817}"
WAIT_S="${LS_SLURM_WAIT_S:-60}"
CONF="$DIR/slurm.conf"
SOCK="$DIR/munge/munge.socket"
read -r -a NETNS <<< "${LS_SLURM_NETNS:-}"
read -r -a NODE_ADDRS <<< "${LS_SLURM_NODE_ADDRS:-}"

log() { echo "[local_slurm] $*" >&2; }
die() { echo "[local_slurm] error: $*" >&2; exit 1; }
node_names() { local i; for ((i = 1; i <= NODES; i++)); do echo "ls$i"; done; }
# run a command on node i's network stack (i from 0; the controller and the clients are node 0's)
on_node() { local i="$1"; shift; if [ ${#NETNS[@]} -gt 0 ]; then ip netns exec "${NETNS[$i]}" "$@"; else "$@"; fi; }

check_settings() {
  [[ "$NODES" =~ ^[0-9]+$ ]] && [ "$NODES" -ge 1 ] && [ "$NODES" -le 16 ] \
    || die "LS_SLURM_NODES must be an integer from 1 to 16 (got '$NODES')"
}

check_netns() {
  [ ${#NETNS[@]} -eq 0 ] && [ ${#NODE_ADDRS[@]} -eq 0 ] && return 0
  [ ${#NETNS[@]} -eq "$NODES" ] || die "LS_SLURM_NETNS names ${#NETNS[@]} namespace(s); LS_SLURM_NODES is $NODES: one per node"
  [ ${#NODE_ADDRS[@]} -eq "$NODES" ] || die "LS_SLURM_NODE_ADDRS has ${#NODE_ADDRS[@]} address(es) for $NODES node(s)"
  command -v ip >/dev/null 2>&1 || die "LS_SLURM_NETNS needs iproute2 (ip netns)"
  local i
  for ((i = 0; i < NODES; i++)); do
    ip netns exec "${NETNS[$i]}" true 2>/dev/null || die "LS_SLURM_NETNS: no namespace '${NETNS[$i]}' (make it first)"
    ip netns exec "${NETNS[$i]}" ip -4 -o addr show | grep -q " ${NODE_ADDRS[$i]}/" \
      || die "LS_SLURM_NODE_ADDRS: ${NODE_ADDRS[$i]} is not an address of namespace ${NETNS[$i]}"
  done
}

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
  local addrs=() i
  if [ ${#NETNS[@]} -gt 0 ]; then
    addrs=("${NODE_ADDRS[@]}")
  else
    local addr; addr="$(getent ahostsv4 "$host" | awk 'NR==1{print $1}')"
    case "$addr" in
      127.*) ;;
      *) die "this host's name '$host' resolves to '${addr:-nothing}', not a loopback address; the local cluster binds loopback only (add '127.0.1.1 $host' to /etc/hosts)";;
    esac
    for ((i = 0; i < NODES; i++)); do addrs+=(127.0.0.1); done
  fi
  local nodes=()
  mapfile -t nodes < <(node_names)
  {
    if [ ${#NETNS[@]} -gt 0 ]; then
      echo "# written by scripts/local_slurm.sh; a one-machine test cluster, one network namespace per node: ${NETNS[*]}"
    else
      echo "# written by scripts/local_slurm.sh; a one-machine test cluster, loopback only"
    fi
    echo "ClusterName=lightning-straggler"
    # slurmctld checks that it runs on this host name; the address is where the others reach it
    echo "SlurmctldHost=$host(${addrs[0]})"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "SlurmctldPort=$PORT"
    # on loopback, bind 127.0.0.1 only; in namespaces, their addresses are the only ones there are
    [ ${#NETNS[@]} -eq 0 ] && echo "CommunicationParameters=NoCtldInAddrAny,NoInAddrAny"
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
      echo "NodeName=${nodes[$i]} NodeHostname=$host NodeAddr=${addrs[$i]} Port=$((PORT + 1 + i)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
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
    on_node 0 slurmctld -f "$CONF" -i || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
  fi
  local n i=0
  for n in $(node_names); do
    mkdir -p "$DIR/spool/$n"
    if ! pid_alive "$DIR/run/slurmd-$n.pid"; then
      on_node "$i" slurmd -f "$CONF" -N "$n" || die "slurmd -N $n did not start (see $DIR/log/slurmd-$n.log)"
    fi
    i=$((i + 1))
  done
}

wait_idle() {
  local deadline=$((SECONDS + WAIT_S)) states=""
  export SLURM_CONF="$CONF"
  while ((SECONDS < deadline)); do
    states="$(on_node 0 timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null || true)"
    if [ -n "$states" ] && [ "$(echo "$states" | grep -c ' idle$')" -eq "$NODES" ]; then
      log "cluster up: $NODES node(s) idle ($(echo "$states" | awk '{print $1}' | paste -sd,)); export SLURM_CONF=$CONF PATH=$DIR/bin:\$PATH"
      return 0
    fi
    # nodes that came back down (e.g. after an earlier stop) are resumed once
    echo "$states" | awk '$2 ~ /down|drain|drng/ {print $1}' | while read -r n; do
      on_node 0 timeout 10 scontrol update NodeName="$n" State=RESUME >/dev/null 2>&1 || true
    done
    sleep 0.25
  done
  die "nodes not idle after $WAIT_S s: ${states:-sinfo gave no answer}; logs in $DIR/log/"
}

stop_pidfiles() {
  # TERM every daemon named, then wait for all of them together (each takes ~2 s to exit; one after the
  # other made a stop take 7 s); KILL whatever is left after 10 s
  local f pid pids=() alive
  for f in "$@"; do
    if [ -f "$f" ] && pid="$(cat "$f" 2>/dev/null)" && kill -TERM "$pid" 2>/dev/null; then pids+=("$pid"); fi
  done
  for _ in $(seq 100); do
    alive=""
    for pid in "${pids[@]}"; do
      if kill -0 "$pid" 2>/dev/null; then alive=1; fi
    done
    if [ -z "$alive" ]; then break; fi
    sleep 0.1
  done
  for pid in "${pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  done
  rm -f "$@"
}

stop_all() {
  if [ -f "$CONF" ] && pid_alive "$DIR/run/slurmctld.pid"; then
    # jobs first, and wait (bounded) until they are gone, so that no slurmstepd is left running a task
    export SLURM_CONF="$CONF"
    on_node 0 timeout 10 scancel --user="$(id -un)" >/dev/null 2>&1 || true
    local end=$((SECONDS + 20))
    while ((SECONDS < end)) && [ -n "$(on_node 0 timeout 10 squeue -h -o %i 2>/dev/null || true)" ]; do sleep 1; done
  fi
  # the nodes first, while the controller they report to still runs
  stop_pidfiles "$DIR"/run/slurmd-*.pid
  stop_pidfiles "$DIR/run/slurmctld.pid" "$DIR/run/munged.pid"
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
  SLURM_CONF="$CONF" on_node 0 timeout 10 sinfo -N || true
  env_line
}

env_line() {
  echo "export SLURM_CONF=$CONF PATH=$DIR/bin:\$PATH"
  [ ${#NETNS[@]} -gt 0 ] && echo "# clients run inside the first node's namespace: ip netns exec ${NETNS[0]} sbatch|srun|python ..."
  return 0
}

case "${1:-}" in
  start)
    t0=$SECONDS
    check_settings
    install_missing
    check_netns
    write_config
    start_daemons
    wait_idle
    log "started in $((SECONDS - t0)) s"
    ;;
  stop) stop_all ;;
  status) status ;;
  env) env_line ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
