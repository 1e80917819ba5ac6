#!/usr/bin/env bash
# A Ray job: launcher=ray on a running Ray cluster (docs/ray.md), submitted from any machine.
#
# usage: RAY_ADDRESS=http://<head>:8265 scripts/ray_job.sh output_root=/abs/runs <train.py overrides...>
#   e.g. RAY_ADDRESS=http://node0:8265 scripts/ray_job.sh output_root=/shared/runs ray.num_workers=16 \
#            ray.use_gpu=true model=pythia28 datasets=[hh] model.archive=/shared/runs/<sft run>/LATEST/policy.pt
#
# Needs Ray's dashboard on the head (pip install "ray[default]"). The repository is uploaded as
# the job's working directory (--working-dir; .gitignore'd files such as outputs/ are left out),
# and the job runs in Ray's copy of it: give output_root and every data, model and archive
# path as an absolute path on a filesystem the cluster's nodes share.
# Runs: python train.py launcher=ray ray.address=auto trainer=FSDPTrainer <overrides>.
# Exit status: ray job submit's (0 when the job succeeded).
set -euo pipefail

fail() {
    echo "Error: $1" >&2
    exit 2
}

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
[[ -n ${RAY_ADDRESS:-} ]] || fail "RAY_ADDRESS is not set; set it to the Ray dashboard of the cluster's head, e.g. RAY_ADDRESS=http://node0:8265 $0 ..."
output_root=
for arg in "$@"; do
    if [[ $arg == output_root=* ]]; then output_root=${arg#output_root=}; fi
done
[[ $output_root == /* ]] || fail "output_root is ${output_root:-not given}; give an absolute path on a filesystem every node shares (e.g. output_root=/shared/runs): the job runs in Ray's copy of the repository."
command -v ray >/dev/null || fail "the ray command is not installed; pip install -r requirements-ray.txt \"ray[default]\"."

cd "$REPO"
exec ray job submit --address "$RAY_ADDRESS" --working-dir . -- \
    python train.py launcher=ray ray.address=auto trainer=FSDPTrainer "$@"
