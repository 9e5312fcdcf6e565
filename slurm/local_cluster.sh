#!/usr/bin/env bash
# A single-node Slurm cluster on localhost, for trying the launchers and for the tests.
#
#   bash slurm/local_cluster.sh start     # munged + slurmctld + slurmd; prints `export SLURM_CONF=...`
#   bash slurm/local_cluster.sh status    # exit 0 if all three run, 3 if none, 1 if some
#   bash slurm/local_cluster.sh stop      # cancels this cluster's jobs, stops its daemons
#   bash slurm/local_cluster.sh env       # prints `export SLURM_CONF=...`
#
# Everything lives in one state directory, $SLURM_LOCAL_DIR (default /tmp/denseformer-slurm):
# slurm.conf, a private munge key and socket, PID files, logs, spool and state. Start and stop
# are idempotent and touch only the daemons named by this directory's PID files (a system
# munged or Slurm keeps running). Ports: $SLURM_LOCAL_CTLD_PORT (6817) and
# $SLURM_LOCAL_SLURMD_PORT (6818). Needs root (slurmd starts jobs as the submitting user) and
# Debian's slurm-wlm + munge (slurm/install_ci_deps.sh installs them).
#
# Settings that matter on small machines (docs/slurm.md#a-local-slurm-cluster): proctrack/linuxproc and
# task/none (no cgroups or systemd needed), cons_tres with CR_Core (CR_Core_Memory without
# DefMemPerCPU serialises jobs), JobRequeue=1, cred_expire=10 plus short scheduler intervals
# (otherwise a requeued job waits about two minutes).
set -euo pipefail

STATE="${SLURM_LOCAL_DIR:-/tmp/denseformer-slurm}"
CTLD_PORT="${SLURM_LOCAL_CTLD_PORT:-6817}"
SLURMD_PORT="${SLURM_LOCAL_SLURMD_PORT:-6818}"
CONF="$STATE/slurm.conf"
MUNGE_DIR="$STATE/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
DAEMONS=(munged slurmctld slurmd)

die() { echo "local_cluster: error: $*" >&2; exit 1; }
say() { echo "local_cluster: $*"; }

pid_file() { # daemon -> its PID file
    case "$1" in
        munged) echo "$MUNGE_DIR/munged.pid" ;;
        *) echo "$STATE/$1.pid" ;;
    esac
}

running_pid() { # daemon -> prints its PID and succeeds if our PID file names a live $1
    local file pid comm
    file="$(pid_file "$1")"
    [ -f "$file" ] || return 1
    pid="$(tr -dc 0-9 <"$file")"
    [ -n "$pid" ] || return 1
    comm="$(cat "/proc/$pid/comm" 2>/dev/null)" || return 1
    # A recycled PID belongs to someone else: never signal it.
    [ "$comm" = "$1" ] || return 1
    echo "$pid"
}

check_requirements() {
    [ "$(id -u)" -eq 0 ] || die "needs root (slurmd launches jobs as the submitting user); \
run it as root, e.g. sudo bash $0 start"
    local tool missing=()
    for tool in munged slurmctld slurmd sinfo sbatch scontrol; do
        command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
    done
    [ "${#missing[@]}" -eq 0 ] || die "missing ${missing[*]}: install Debian's slurm-wlm and \
munge (bash slurm/install_ci_deps.sh, or apt-get install slurm-wlm munge)"
}

check_traversable() { # munge clients must reach the socket: every parent needs o+x
    local dir="$MUNGE_DIR"
    while [ "$dir" != "/" ]; do
        dir="$(dirname "$dir")"
        [ "$(( 0$(stat -c %a "$dir") & 1 ))" -eq 1 ] || die "$dir is not searchable by \
others (mode $(stat -c %a "$dir")); munge needs a world-searchable path to its socket: \
choose another SLURM_LOCAL_DIR (e.g. under /tmp)"
    done
}

write_config() {
    local host node_line
    host="$(hostname -s)"
    # The node's hardware as slurmd sees it, whole (CPUs, sockets, cores, memory).
    node_line="$(slurmd -C | head -n 1)"
    case "$node_line" in
        NodeName=*) ;;
        *) die "unexpected output of 'slurmd -C': $node_line" ;;
    esac
    cat >"$CONF.tmp" <<EOF
# Written by slurm/local_cluster.sh; regenerated on each start while nothing runs.
ClusterName=denseformer-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/slurmd
TmpFS=$STATE/tmp
SlurmctldPidFile=$(pid_file slurmctld)
SlurmdPidFile=$(pid_file slurmd)
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
JobRequeue=1
ReturnToService=2
InactiveLimit=0
KillWait=10
MinJobAge=600
SlurmdTimeout=300
$node_line NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

wait_for() { # seconds, description, command...: poll until the command succeeds
    local seconds="$1" what="$2"
    shift 2
    local deadline=$(( $(date +%s) + seconds ))
    until "$@" >/dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$deadline" ]; then
            echo "local_cluster: error: $what did not come up within ${seconds}s" >&2
            show_logs >&2
            return 1
        fi
        sleep 0.2
    done
}

show_logs() {
    local log
    for log in "$MUNGE_DIR/munged.log" "$STATE/log/slurmctld.log" "$STATE/log/slurmd.log"; do
        [ -f "$log" ] && { echo "--- last lines of $log"; tail -n 15 "$log"; }
    done
    return 0
}

node_ready() {
    local state
    state="$(SLURM_CONF="$CONF" sinfo -h -N -o %T 2>/dev/null | head -n 1)"
    case "$state" in idle*|mixed*|allocated*|completing*) return 0 ;; esac
    return 1
}

cmd_start() {
    check_requirements
    mkdir -p "$STATE"
    chmod 0755 "$STATE"
    mkdir -p "$STATE/ctld" "$STATE/slurmd" "$STATE/tmp" "$STATE/log" "$MUNGE_DIR"
    chmod 0755 "$MUNGE_DIR"
    check_traversable
    local any=0 daemon
    for daemon in "${DAEMONS[@]}"; do
        running_pid "$daemon" >/dev/null && any=1
    done
    [ "$any" -eq 1 ] || write_config
    [ -f "$CONF" ] || die "$CONF is missing while some daemons run; run '$0 stop' first"

    if [ ! -s "$MUNGE_DIR/munge.key" ]; then
        (umask 077; head -c 1024 /dev/urandom >"$MUNGE_DIR/munge.key")
    fi
    if ! running_pid munged >/dev/null; then
        rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
        munged --socket="$MUNGE_SOCKET" --key-file="$MUNGE_DIR/munge.key" \
            --pid-file="$(pid_file munged)" --log-file="$MUNGE_DIR/munged.log" \
            --seed-file="$MUNGE_DIR/munged.seed" \
            || { show_logs >&2; die "munged failed to start"; }
        wait_for 10 "munged" test -S "$MUNGE_SOCKET"
    fi
    if ! running_pid slurmctld >/dev/null; then
        slurmctld -f "$CONF" || { show_logs >&2; die "slurmctld failed to start"; }
        wait_for 30 "slurmctld" env SLURM_CONF="$CONF" scontrol ping
    fi
    if ! running_pid slurmd >/dev/null; then
        slurmd -f "$CONF" || { show_logs >&2; die "slurmd failed to start"; }
    fi
    wait_for 30 "the node" node_ready
    getent hosts "$(hostname -s)" >/dev/null 2>&1 || say "warning: the host name \
$(hostname -s) does not resolve; jobs that rendezvous on it need DENSEFORMER_RDZV_HOST=127.0.0.1"
    # A node left DOWN/DRAINED by an earlier unclean stop comes back.
    SLURM_CONF="$CONF" scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 || true
    say "running (state in $STATE); use it with:"
    echo "export SLURM_CONF=$CONF"
}

stop_daemon() {
    local daemon="$1" pid
    pid="$(running_pid "$daemon")" || { rm -f "$(pid_file "$daemon")"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do
        [ -d "/proc/$pid" ] || break
        sleep 0.2
    done
    if [ -d "/proc/$pid" ]; then
        say "$daemon (pid $pid) ignored SIGTERM for 10s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$(pid_file "$daemon")"
    say "stopped $daemon (pid $pid)"
}

cmd_stop() {
    if running_pid slurmctld >/dev/null && [ -f "$CONF" ]; then
        local jobs
        jobs="$(SLURM_CONF="$CONF" squeue -h -o %A 2>/dev/null | tr '\n' ' ')"
        if [ -n "${jobs// /}" ]; then
            say "cancelling this cluster's jobs: $jobs"
            # shellcheck disable=SC2086  # job ids are plain numbers from squeue
            SLURM_CONF="$CONF" scancel $jobs 2>/dev/null || true
            for _ in $(seq 1 50); do
                [ -z "$(SLURM_CONF="$CONF" squeue -h -o %A 2>/dev/null)" ] && break
                sleep 0.2
            done
        fi
    fi
    stop_daemon slurmd
    stop_daemon slurmctld
    stop_daemon munged
}

cmd_status() {
    local up=0 daemon pid
    for daemon in "${DAEMONS[@]}"; do
        if pid="$(running_pid "$daemon")"; then
            echo "$daemon: running (pid $pid)"
            up=$((up + 1))
        else
            echo "$daemon: stopped"
        fi
    done
    if running_pid slurmctld >/dev/null; then
        SLURM_CONF="$CONF" sinfo -N -o "%N %T %c %m" 2>&1 || true
        SLURM_CONF="$CONF" squeue 2>&1 || true
    fi
    echo "state: $STATE"
    [ "$up" -eq "${#DAEMONS[@]}" ] && return 0
    [ "$up" -eq 0 ] && return 3
    return 1
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env   (state dir: \$SLURM_LOCAL_DIR, now $STATE)" >&2
       exit 2 ;;
esac
