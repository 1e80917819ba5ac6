#!/usr/bin/env bash
# THE one command for the lent nvidia-h200 machine (bench/README.md, "On the lent GPU machine"):
# installs the carried wheels of bench/prepare_device.sh beside the image's packages (never its
# torch), then runs bench_gpu_dpo.py and bench_gpu.py, each under `timeout`, both inside
# $BUDGET seconds (9 minutes), and writes into $OUT (at most 8 files):
#   versions.txt        python, torch, CUDA, GPU, driver, and every package the runs import, with its path
#   install.log         pip's output
#   bench_gpu_dpo.log   .json   ours vs TRL (live and precomputed reference): the log and all figures
#   bench_gpu.log       .json   Basic vs FSDP, Pythia-410M and -1B: the log and all figures
#   summary.md          the versions, each run's exit status and wall time, and the two tables
# Each benchmark's temporary folder (models, run folders, checkpoints) is removed once it ends,
# and bench_gpu.py removes each run's folder as soon as its figures are read.
#
#   run(command="bash bench/device_run.sh", carry=[".whl"], timeout_s=600)     # on the device
#   OUT=/tmp/o DEVICE=cpu PYTHON=/tmp/devvenv/bin/python WHEELS=/tmp/whl311 bash bench/device_run.sh  # CPU check
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
START=$SECONDS
: "${OUT:?set OUT to the folder for the logs and figures (the device tool sets it)}"
DEVICE=${DEVICE:-cuda}       # cpu: the tiny sizes of bench/check_device_prep.sh
PY=${PYTHON:-python3}        # the image's python3 (the one holding torch)
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
BUDGET=${BUDGET:-540}        # seconds for everything; the device tool's limit is 600
DPO_CAP=${DPO_CAP:-240}      # seconds at most for bench_gpu_dpo.py; bench_gpu.py gets the rest
mkdir -p "$OUT"

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if [ ${#wheels[@]} -eq 0 ]; then
  echo "Error: no wheels in $WHEELS: run 'bash bench/prepare_device.sh' here and name .whl in carry." | tee "$OUT/summary.md"
  exit 2
fi
for w in "${wheels[@]}"; do
  case ${w##*/} in torch-* | triton-* | nvidia_* | nvidia-*)
    echo "Error: $w would replace the image's torch stack: remove it from $WHEELS." | tee "$OUT/summary.md"
    exit 2 ;;
  esac
done
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
  >"$OUT/install.log" 2>&1; then
  { echo "Error: installing the carried wheels failed:"; tail -20 "$OUT/install.log"; } | tee "$OUT/summary.md"
  exit 3
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export WANDB_MODE=disabled
[ "$DEVICE" = cpu ] && export CUDA_VISIBLE_DEVICES=

# Versions, and every import of the runs tried once here: a missing or broken package stops at
# once (seconds of device time) instead of in the middle of a benchmark.
if ! "$PY" - "$SITE" >"$OUT/versions.txt" 2>&1 <<'EOF'; then
import importlib
import importlib.metadata as md
import platform
import subprocess
import sys

site = sys.argv[1]
import torch

print(f"python {platform.python_version()} ({sys.executable})")
where = "carried (OVERRIDES THE IMAGE'S)" if torch.__file__.startswith(site) else "the image's"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {where}: {torch.__file__}")
if torch.__file__.startswith(site):
    sys.exit("Error: torch was imported from the carried wheels; the image's torch must be used.")
if torch.cuda.is_available():
    print(f"GPU {torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True)
    print(f"nvidia-smi: {smi.stdout.strip() or smi.stderr.strip()}")
else:
    print("GPU none (CPU run)")
failed = []  # a failed trl (say) stops bench_gpu_dpo.py only, in seconds; bench_gpu.py still runs
for dist, module in [("transformers", "transformers"), ("trl", "trl.trainer.dpo_trainer"), ("datasets", "datasets"),
                     ("hydra-core", "hydra"), ("omegaconf", "omegaconf"), ("antlr4-python3-runtime", "antlr4"),
                     ("dill", "dill"), ("multiprocess", "multiprocess"), ("accelerate", "accelerate"), ("peft", "peft"),
                     ("tokenizers", "tokenizers"), ("huggingface-hub", "huggingface_hub"), ("safetensors", "safetensors"),
                     ("numpy", "numpy"), ("pyarrow", "pyarrow"), ("pandas", "pandas"), ("fsspec", "fsspec"),
                     ("xxhash", "xxhash"), ("jinja2", "jinja2"), ("matplotlib", "matplotlib"), ("tqdm", "tqdm")]:
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - reported, and fatal below only for what both benchmarks need
        failed.append(dist)
        print(f"{dist}: IMPORT FAILED: {type(e).__name__}: {e}")
        continue
    path = getattr(mod, "__file__", "") or ""
    print(f"{dist} {md.version(dist)} ({'carried' if path.startswith(site) else 'image'})")
if fatal := [d for d in failed if d in ("transformers", "hydra-core", "omegaconf", "antlr4-python3-runtime")]:
    sys.exit(f"Error: {', '.join(fatal)} did not import; neither benchmark can run.")
import transformers.modeling_utils as mu

print(f"transformers has slice_logits_to_keep (packing.py's boolean logits_to_keep): {hasattr(mu, 'slice_logits_to_keep')}")
EOF
  { echo "Error: the packages of the runs do not import:"; tail -20 "$OUT/versions.txt"; } | tee "$OUT/summary.md"
  exit 4
fi
cat "$OUT/versions.txt"

if [ "$DEVICE" = cpu ]; then  # the mechanics only: tiny models, two steps
  DPO_ARGS=(--size tiny --device cpu --dtype bfloat16 --mode both --steps 2 --warmup 1 --batch-size 2 --max-length 64
    --peak-tflops 1 --timeout 600)
  GPU_ARGS=(--sizes tiny --device cpu --steps 2 --batch-size 2 --max-length 64 --peak-tflops 1 --timeout 600)
else  # sized to end inside BUDGET on an H200 (each process's own --timeout stops a stuck one sooner)
  DPO_ARGS=(--size pythia-410m --device cuda --dtype bfloat16 --mode both --steps 15 --warmup 5 --batch-size 16
    --max-length 512 --timeout 150)
  GPU_ARGS=(--sizes "pythia-410m,pythia-1b" --device cuda --steps 20 --batch-size 16 --max-length 512 --timeout 150)
fi

# Run folders in RAM where it has room (the 1B FSDP checkpoint is about 12 GB, written in seconds
# there), else under /tmp; one fresh folder per benchmark, removed when it ends.
scratch_root=/tmp
if [ "$DEVICE" != cpu ] && [ -d /dev/shm ] && [ "$(df -Pk /dev/shm | awk 'NR==2 {print $4}')" -gt $((24 * 1024 * 1024)) ]; then
  scratch_root=/dev/shm
fi

declare -A RC WALL
bench() {  # bench NAME SECONDS ARGS...: run bench/NAME.py under timeout, log and figures into $OUT
  local name=$1 limit=$2 t0=$SECONDS tmp
  shift 2
  tmp=$(mktemp -d "$scratch_root/$name.XXXXXX")
  echo "== $name (at most $limit s, scratch $tmp): python bench/$name.py $* --json $OUT/$name.json"
  TMPDIR=$tmp timeout -k 20 "$limit" "$PY" "bench/$name.py" "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  RC[$name]=${PIPESTATUS[0]}
  rm -rf "$tmp"
  WALL[$name]=$((SECONDS - t0))
  echo "== $name: exit ${RC[$name]} (124: over its $limit s) after ${WALL[$name]} s"
}
left() { echo $((BUDGET - (SECONDS - START))); }

limit=$(left)
[ "$limit" -gt "$DPO_CAP" ] && limit=$DPO_CAP
bench bench_gpu_dpo "$limit" "${DPO_ARGS[@]}" --budget "$((limit - 10))"  # its variants (issue 14) only if they fit
limit=$(($(left) - 10))
if [ "$limit" -lt 60 ]; then
  echo "== bench_gpu: not run, only $limit s left of $BUDGET"
  RC[bench_gpu]=skipped WALL[bench_gpu]=0
else
  bench bench_gpu "$limit" "${GPU_ARGS[@]}"
fi

{
  echo "# Device run, $(date -u '+%Y-%m-%d %H:%M UTC'), DEVICE=$DEVICE"
  echo
  echo '```'
  cat "$OUT/versions.txt"
  echo '```'
  for name in bench_gpu_dpo bench_gpu; do
    echo
    echo "## $name: exit ${RC[$name]}, ${WALL[$name]} s"
    echo
    echo '```'
    # the final table: from its title line (both scripts start it with "DPO") to the end
    if [ -f "$OUT/$name.log" ] && grep -q '^DPO ' "$OUT/$name.log"; then
      awk '/^DPO /{p=1} p' "$OUT/$name.log" | head -40
    elif [ -f "$OUT/$name.log" ]; then  # stopped before its table: its last lines (the runs it finished)
      tail -15 "$OUT/$name.log"
    fi
    echo '```'
  done
  echo
  echo "total $((SECONDS - START)) s of $BUDGET"
} >"$OUT/summary.md"
echo "== summary: $OUT/summary.md ($((SECONDS - START)) s)"
[ "${RC[bench_gpu_dpo]}" = 0 ] && [ "${RC[bench_gpu]}" = 0 ]
