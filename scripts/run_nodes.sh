#!/usr/bin/env bash
# Several nodes: run this same command on every node (by hand, pdsh, or srun: scripts/slurm_dpo.sbatch).
#
# usage: MASTER_ADDR=<a host every node reaches> NNODES=<nodes> scripts/run_nodes.sh <train.py overrides...>
#   e.g. MASTER_ADDR=node0 NNODES=2 scripts/run_nodes.sh model=pythia28 datasets=[hh] model.fsdp_policy_mp=bfloat16
#
# Environment:
#   MASTER_ADDR     required: the host of torchrun's c10d rendezvous (any node of the job)
#   MASTER_PORT     its port (default 29500)
#   NNODES          required: how many nodes run this command (>= 1; the same on every node)
#   NPROC_PER_NODE  processes on this node (default: the GPUs nvidia-smi -L lists)
#   RDZV_ID         the rendezvous id, the same on every node (default dpo-$MASTER_ADDR-$MASTER_PORT)
#   RDZV_TIMEOUT    seconds to wait for all NNODES nodes to join (default 600)
#   PYTHON          the Python that runs torchrun and train.py (default python)
#   FORWARD_SIGNALS 1 (default): a SIGUSR1 to this script is passed on to the ranks, a SIGTERM to
#                   torchrun; 0: not passed on, for a scheduler that signals every process of
#                   the job itself (scripts/slurm_dpo.sbatch sets it from Slurm's ProctrackType)
#
# Runs `torchrun --nnodes NNODES --nproc_per_node NPROC_PER_NODE ... train.py trainer=FSDPTrainer <overrides>`.
# SIGUSR1 (a scheduler's "time is nearly up") makes every rank save a checkpoint and stop; this
# script then exits 138 (128 + SIGUSR1), so that a batch script knows to requeue with resume=auto.
# torchrun itself does not handle SIGUSR1 (it would die of it), so it is started with SIGUSR1
# ignored, and the ranks, which train.py gives their own handler, get it from here.
# SIGTERM goes to torchrun, which passes it to the ranks (checkpoint and stop), as Ctrl-C does.
# Exit status: torchrun's (0 when training finished), 138 after a SIGUSR1 stopped training,
# 2 for a mistake in this environment or a rendezvous that did not gather NNODES nodes.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}

fail() {
    echo "Error: $1" >&2
    exit 2
}

[[ -n ${MASTER_ADDR:-} ]] || fail "MASTER_ADDR is not set; set it to a host every node reaches (the same on every node), e.g. MASTER_ADDR=node0 NNODES=2 $0 ..."
MASTER_PORT=${MASTER_PORT:-29500}
[[ $MASTER_PORT =~ ^[0-9]+$ ]] || fail "MASTER_PORT=$MASTER_PORT is not a port number; give a free TCP port (default 29500)."
[[ -n ${NNODES:-} ]] || fail "NNODES is not set; set it to the number of nodes that run this script (the same on every node)."
[[ $NNODES =~ ^[0-9]+$ && $NNODES -ge 1 ]] || fail "NNODES=$NNODES is not a number of nodes; give an integer >= 1."
if [[ -z ${NPROC_PER_NODE:-} ]]; then
    NPROC_PER_NODE=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [[ $NPROC_PER_NODE -ge 1 ]] || fail "nvidia-smi -L lists no GPU on $(hostname); set NPROC_PER_NODE to the processes to start on this node."
fi
[[ $NPROC_PER_NODE =~ ^[0-9]+$ && $NPROC_PER_NODE -ge 1 ]] || fail "NPROC_PER_NODE=$NPROC_PER_NODE is not a number of processes; give an integer >= 1."
RDZV_ID=${RDZV_ID:-dpo-$MASTER_ADDR-$MASTER_PORT}
RDZV_TIMEOUT=${RDZV_TIMEOUT:-600}
[[ $RDZV_TIMEOUT =~ ^[0-9]+$ && $RDZV_TIMEOUT -ge 1 ]] || fail "RDZV_TIMEOUT=$RDZV_TIMEOUT is not a number of seconds; give an integer >= 1."

# The reference repository's advice: many ranks open many files (shards, sockets).
ulimit -n 64000 2>/dev/null || echo "Warning: could not raise the open-file limit to 64000 (it stays $(ulimit -n)); ask for a higher hard limit (ulimit -Hn) if training fails with 'Too many open files'." >&2

# torchrun writes the exception that stopped it (e.g. RendezvousTimeoutError) here as JSON;
# each rank gets its own error file from torchrun.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export TORCHELASTIC_ERROR_FILE=$scratch/torchrun_error.json

torchrun_pid=
got_usr1=0
in_wait=0
forward=${FORWARD_SIGNALS:-1}
# shellcheck disable=SC2329 # invoked by the trap below
on_usr1() {
    got_usr1=1
    in_wait=0
    [[ -n $torchrun_pid ]] || return 0
    if ! pgrep -P "$torchrun_pid" >/dev/null; then
        # No rank started yet (still in the rendezvous): nothing to save, stop torchrun.
        kill -TERM "$torchrun_pid" 2>/dev/null || true
    elif [[ $forward == 1 ]]; then
        pkill -USR1 -P "$torchrun_pid" || true # the ranks: torchrun's children
    fi
}
# shellcheck disable=SC2329 # invoked by the trap below
on_term() {
    in_wait=0
    if [[ $forward == 1 && -n $torchrun_pid ]]; then
        kill -TERM "$torchrun_pid" 2>/dev/null || true # torchrun passes it to the ranks
    fi
}
trap on_usr1 USR1
trap on_term TERM
trap 'in_wait=0' INT # Ctrl-C reaches torchrun itself (the same process group); wait for it

# SIGUSR1 ignored in torchrun (and so, until train.py sets its handler, in the ranks it starts).
(
    trap '' USR1
    exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
        --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID" \
        --rdzv_conf "join_timeout=$RDZV_TIMEOUT" \
        "$REPO/train.py" trainer=FSDPTrainer "$@"
) &
torchrun_pid=$!

# `wait` returns early (status > 128) when a trapped signal arrives; wait again until torchrun ends.
while :; do
    in_wait=1
    status=0
    wait "$torchrun_pid" || status=$?
    [[ $in_wait == 0 ]] || break
done

if [[ $status != 0 && -f $TORCHELASTIC_ERROR_FILE ]] && grep -q RendezvousTimeoutError "$TORCHELASTIC_ERROR_FILE"; then
    fail "torchrun's rendezvous at $MASTER_ADDR:$MASTER_PORT did not gather NNODES=$NNODES nodes within $RDZV_TIMEOUT s; check NNODES (the same on every node) and that every node runs this script with the same MASTER_ADDR, MASTER_PORT and RDZV_ID."
fi
if [[ $got_usr1 == 1 && $status != 0 ]]; then
    echo "Stopped by SIGUSR1 after saving a checkpoint; continue with resume=auto (or resume=<run folder>)." >&2
    exit 138
fi
exit "$status"
