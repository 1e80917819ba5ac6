#!/usr/bin/env bash
# One node, all its GPUs: train.py starts one FSDPTrainer rank per visible GPU itself.
#
# usage: scripts/run_node.sh <train.py overrides...>
#   e.g. scripts/run_node.sh model=pythia28 datasets=[hh] model.fsdp_policy_mp=bfloat16 batch_size=64
#   CUDA_VISIBLE_DEVICES=0,1 scripts/run_node.sh ...   (two of the GPUs)
#   scripts/run_node.sh world_size=2 ...               (CPU: 2 processes with gloo)
#
# Environment: PYTHON, the Python that runs train.py (default python).
# Ctrl-C, SIGTERM or SIGUSR1 make every rank save a checkpoint and stop (exit 130, 143, 138);
# continue with resume=auto or resume=<run folder>. Exit status: train.py's.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The reference repository's advice: many ranks open many files (shards, sockets).
ulimit -n 64000 2>/dev/null || echo "Warning: could not raise the open-file limit to 64000 (it stays $(ulimit -n)); ask for a higher hard limit (ulimit -Hn) if training fails with 'Too many open files'." >&2

exec "${PYTHON:-python}" "$REPO/train.py" trainer=FSDPTrainer "$@"
