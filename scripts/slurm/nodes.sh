# Sourced by scripts/slurm/local-slurm for `--nodes N`: a multi-node cluster on this machine.
# Every node is a network-namespace host of scripts/hosts (own address, TCP only, own hostname):
#   head  10.213.1.254  slurmctld (the login/head node: sbatch, squeue... run there; see below)
#   h1..hN 10.213.1.I   one slurmd each (NodeName=hI, CPUs=$CAPSTONE_SLURM_CPUS)
# munged runs once on the machine: its socket is a file, which every host sees (as every node of
# a site has the same key). The state dir is on the one filesystem all hosts share, as is every
# run directory: the cluster's shared filesystem. The hosts' prefix and network are
# $CAPSTONE_SLURM_HOSTS_PREFIX (default slm) and $CAPSTONE_SLURM_HOSTS_NET (default 10.213.1), so
# that tests/test_multihost.py's hosts (prefix cap) live beside them.
# The machine itself is not on the hosts' network: the client commands (sbatch, srun, scontrol,
# scancel, sinfo, squeue, salloc) are wrappers in <state dir>/bin that run the real one on `head`
# when called from outside the hosts (the export lines put them first on PATH), and the real one
# directly when called on a node (srun or mpirun inside a job).
# This file only defines functions and variables; local-slurm's main calls them.

HOSTS_SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/hosts"
CLIENTS=(sbatch srun scontrol scancel sinfo squeue salloc sacct)

nodes_setup() {  # nodes_setup N: the variables of an N-node cluster
  N="$1"
  [[ "$N" =~ ^[1-4]$ ]] || die "--nodes takes 1 to 4 (nodes of this machine's test cluster), not '$N'"
  export CAPSTONE_HOSTS_PREFIX="${CAPSTONE_SLURM_HOSTS_PREFIX:-slm}"
  export CAPSTONE_HOSTS_NET="${CAPSTONE_SLURM_HOSTS_NET:-10.213.1}"
  NET="$CAPSTONE_HOSTS_NET"
  KIND="$N-node" CTLD_HOST="head($NET.254)" PER_NODE="-%n" NODES_EXPR="h[1-$N]"
  # a node whose slurmd is gone for this long is DOWN (its jobs requeued or failed)
  SLURMD_TIMEOUT="${CAPSTONE_SLURM_SLURMD_TIMEOUT:-20}"
  # a requeued job may start again this long after it ended (Slurm's default 120 s, local-slurm's 30)
  CRED_EXPIRE="${CAPSTONE_SLURM_CRED_EXPIRE:-10}"
  NODE=h1
}

node_lines() {
  local i
  for i in $(seq 1 "$N"); do
    echo "NodeName=h$i NodeHostname=h$i NodeAddr=$NET.$i CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 State=UNKNOWN"
  done
}

hosts() { bash "$HOSTS_SCRIPT" "$@"; }

node_state() {  # the states of all nodes, as sinfo sees them, one line each (nothing if no answer)
  [[ -x "$DIR/bin/sinfo" ]] || return 0
  SLURM_CONF="$CONF" timeout 10 "$DIR/bin/sinfo" -h -N -o '%T' 2>/dev/null | sort -u | paste -sd, - || true
}

cluster_up() {
  [[ -f "$CONF" && "$(cat "$DIR/nodes" 2>/dev/null)" == "$N" ]] || return 1
  local states; states="$(node_state)"
  [[ -n "$states" && "$(SLURM_CONF="$CONF" timeout 10 "$DIR/bin/sinfo" -h -N -o %N 2>/dev/null | wc -l)" == "$N" ]] || return 1
  [[ ",$states," =~ ,(down|drain|fail|unknown|not_responding)[^,]*, ]] && return 1
  return 0
}

print_export() { echo "export SLURM_CONF=$CONF PATH=$DIR/bin:\$PATH"; }

write_clients() {  # <state dir>/bin/<client>: the real client, run on head unless already on a host
  local c real
  mkdir -p "$DIR/bin"
  for c in "${CLIENTS[@]}"; do
    real="$(PATH="${PATH//$DIR\/bin:/}" command -v "$c")" || continue
    cat >"$DIR/bin/$c.tmp" <<EOF
#!/bin/sh
# written by scripts/slurm/local-slurm --nodes: $c on the login node 'head' of the test cluster
if [ "\$(readlink /proc/self/ns/net)" = "$(readlink /proc/self/ns/net)" ]; then
  exec ip netns exec $CAPSTONE_HOSTS_PREFIX-head $real "\$@"
fi
exec $real "\$@"
EOF
    chmod 755 "$DIR/bin/$c.tmp"
    mv "$DIR/bin/$c.tmp" "$DIR/bin/$c"
  done
}

stop_cluster() {  # the daemons, every process left on a host (a failed test's job steps), the hosts
  local i
  stop_daemon slurmctld "$DIR/run/slurmctld.pid"
  for i in 1 2 3 4; do stop_daemon slurmd "$DIR/run/slurmd-h$i.pid"; done
  # every process left on a host (job steps of a failed test), then the hosts themselves
  if command -v ip >/dev/null; then hosts down >/dev/null 2>&1 || say "warning: scripts/hosts down failed"; fi
  rm -f "$DIR/nodes"
}

do_stop() {
  stop_cluster
  if [[ -f "$DIR/run/munged.started-by-local-slurm" ]]; then
    # (another cluster on this machine, whatever its state dir, may be using munged too)
    if ! slurm_daemon_running; then
      stop_daemon munged /run/munge/munged.pid
    fi
    rm -f "$DIR/run/munged.started-by-local-slurm"
  fi
  say "stopped the $KIND cluster and its hosts (state kept in $DIR; remove it for a clean start)"
}

start_slurm() {  # a fresh start (new hosts, empty Slurm state), or the repair of a running cluster
  local i _
  if [[ "$1" == 0 && -n "$(live_pid "$DIR/run/slurmctld.pid" slurmctld)" && "$(cat "$DIR/nodes" 2>/dev/null)" == "$N" ]]; then
    repair; return 0
  fi
  stop_cluster
  rm -rf "$DIR/state" "$DIR"/spool* "$DIR/nodetmp" && mkdir -p "$DIR/state"
  # srun --mpi=pmix: each node's PMIx directory (<base>/spmix_appdir_<uid>_<job>.<step>, the same
  # name on every node) must be node-local: <state dir>/nodetmp/local is each slurmd's own
  # <state dir>/nodetmp/hI (a bind mount in its host's mount namespace), as /tmp is on a real node.
  echo "PMIxCliTmpDirBase=$DIR/nodetmp/local" >"$DIR/mpi.conf"
  hosts up "$N" --head >"$DIR/log/hosts.log" 2>&1 || { cat "$DIR/log/hosts.log" >&2; die "scripts/hosts up $N --head failed"; }
  echo "$N" >"$DIR/nodes"
  write_clients
  say "starting slurmctld on head ($NET.254)"
  hosts exec head slurmctld -f "$CONF" || die "slurmctld failed to start: $(tail -n 5 "$DIR/log/slurmctld.log" 2>/dev/null)"
  for _ in $(seq 1 100); do
    SLURM_CONF="$CONF" timeout 10 "$DIR/bin/scontrol" ping >/dev/null 2>&1 && break
    sleep 0.2
  done
  SLURM_CONF="$CONF" timeout 10 "$DIR/bin/scontrol" ping >/dev/null 2>&1 \
    || die "slurmctld does not answer 'scontrol ping' (log: $DIR/log/slurmctld.log)"
  for i in $(seq 1 "$N"); do start_slurmd "$i"; done
}

repair() {  # the same cluster with a lost node (killed, cut off): its link back up, its slurmd again
  local i
  for i in $(seq 1 "$N"); do
    hosts heal "h$i" >/dev/null 2>&1 || true
    [[ -n "$(live_pid "$DIR/run/slurmd-h$i.pid" slurmd)" ]] && continue
    start_slurmd "$i"
    SLURM_CONF="$CONF" timeout 10 "$DIR/bin/scontrol" update NodeName="h$i" State=RESUME >/dev/null 2>&1 || true
  done
}

start_slurmd() {
  local i="$1"
  say "starting slurmd on h$i ($NET.$i)"
  mkdir -p "$DIR/spool-h$i" "$DIR/nodetmp/h$i" "$DIR/nodetmp/local"
  hosts exec "h$i" sh -c "$(cgroup_mounts) mount --bind '$DIR/nodetmp/h$i' '$DIR/nodetmp/local' &&
    exec slurmd -f '$CONF' -N h$i" \
    || die "slurmd on h$i failed to start: $(tail -n 5 "$DIR/log/slurmd-h$i.log" 2>/dev/null)"
}

# `ip netns exec` mounts a fresh /sys for the host, without /sys/fs/cgroup, which slurmd needs (its
# cgroup plugin initialises whatever the proctrack/task plugins): mount the machine's cgroup
# hierarchies again there (v1: a tmpfs and each hierarchy; v2: cgroup2), as a shell snippet.
cgroup_mounts() {
  local dev mnt type opts _
  while read -r dev mnt type opts _; do
    [[ "$mnt" == /sys/fs/cgroup || "$mnt" == /sys/fs/cgroup/* ]] || continue
    case "$type" in
      tmpfs) echo -n "mount -t tmpfs cgroup $mnt && " ;;
      cgroup|cgroup2) echo -n "mkdir -p $mnt && mount -t $type -o $opts $dev $mnt && " ;;
    esac
  done </proc/self/mounts
}

wait_idle() {
  local deadline=$((SECONDS + TIMEOUT)) state=""
  while (( SECONDS < deadline )); do
    cluster_up && return 0
    sleep 0.5
  done
  state="$(node_state)"
  SLURM_CONF="$CONF" timeout 10 "$DIR/bin/sinfo" -N >&2 2>/dev/null || true
  tail -n 15 "$DIR/log/slurmctld.log" >&2 2>/dev/null || true
  die "the $N nodes did not all become idle within ${TIMEOUT}s (states: ${state:-unknown}; logs: $DIR/log/)"
}
