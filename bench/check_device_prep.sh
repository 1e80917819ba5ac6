#!/usr/bin/env bash
# CPU test of the whole device preparation, here, with no GPU:
#   1. a fresh virtual environment holding only distributions of the device image
#      (bench/device_image_packages.txt) at the image's versions where pip has them for this Python
#      (transformers 5.17.0, accelerate 1.15.0, huggingface-hub 1.33.0, tokenizers 0.23.2,
#      safetensors 0.8.0; torch 2.13.0+cpu from this machine's disk in place of the image's 2.11);
#      checked: every distribution in it is in the image's list, and the carried ones are absent;
#   2. the carried wheels of bench/prepare_device.sh, for this Python (PYVER);
#   3. bench/device_run.sh itself with DEVICE=cpu, in a copy of what the device tool sends (no
#      ../shared beside it): the same --target install and PYTHONPATH,
#      both GPU benchmarks at tiny sizes, logs and figures into $OUT;
#   4. what came back: at most 8 files with plain names, the JSON figures, transformers 5.24
#      carried, no scratch folder left behind.
#
#   bash bench/check_device_prep.sh        # about 5 minutes on 2 cores; OUT=/tmp/devprep-out
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONPATH
PYBASE=${PYBASE:-python3}
VENV=${VENV:-/tmp/devvenv}
SITE=${SITE:-/tmp/devsite}
OUT=${OUT:-/tmp/devprep-out}
TREE=${TREE:-/tmp/devtree/repo}  # a copy of the working tree, as the device gets it
PYVER=$("$PYBASE" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
WHL=${WHL:-/tmp/whl${PYVER/./}}
TORCH=${TORCH:-/opt/wheels/torch-2.13.0+cpu-cp${PYVER/./}-cp${PYVER/./}-manylinux_2_28_x86_64.whl}
[ -f "$TORCH" ] || TORCH=torch==2.13.0
IMAGE_PKGS=(
  "$TORCH" transformers==5.17.0 accelerate==1.15.0 huggingface-hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0
  numpy peft pyyaml jinja2 tqdm pyarrow pandas fsspec xxhash psutil matplotlib packaging filelock regex requests
  "typer<0.29" "python-dateutil<3"  # newer ones need pydantic and tzdata, which the image does not hold
)
t0=$SECONDS

echo "== 1. fresh venv $VENV (Python $PYVER), image packages only"
rm -rf "$VENV" "$SITE" "$OUT"
"$PYBASE" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "${IMAGE_PKGS[@]}" 2>&1 | grep -v '^WARNING: Location' || true
"$VENV/bin/python" - bench/device_image_packages.txt <<'EOF'
import importlib.metadata as md
import importlib.util
import re
import sys


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


image = {norm(line.split("==")[0].strip()) for line in open(sys.argv[1]) if line.strip() and not line.startswith("#")}
dists = sorted({norm(d.metadata["Name"]) for d in md.distributions()})
extra = [d for d in dists if d not in image]
if extra:
    sys.exit(f"Error: the venv holds distributions the device image lacks: {', '.join(extra)}")
present = [m for m in ("hydra", "omegaconf", "antlr4", "trl", "datasets", "dill", "multiprocess") if importlib.util.find_spec(m)]
if present:
    sys.exit(f"Error: the venv already holds {', '.join(present)}, which only the carried wheels may bring")
print(f"{len(dists)} distributions, all in the image's list; transformers {md.version('transformers')}, "
      f"torch {md.version('torch')}, numpy {md.version('numpy')}, pyarrow {md.version('pyarrow')}, "
      f"pandas {md.version('pandas')}, fsspec {md.version('fsspec')}, peft {md.version('peft')}")
EOF

echo "== 2. carried wheels for cp${PYVER/./} into $WHL"
PYVER=$PYVER DEST=$WHL bash bench/prepare_device.sh 2>&1 | grep -v '^WARNING: Location'

echo "== 3. bench/device_run.sh, DEVICE=cpu, in $TREE: what the device tool sends (tracked and"
echo "      untracked-not-ignored files, no ../shared beside it) and the carried .whl"
rm -rf "$TREE"
mkdir -p "$TREE"
git ls-files -co --exclude-standard -z | while IFS= read -r -d '' f; do
  if [ -f "$f" ]; then cp --parents "$f" "$TREE"; fi
done
cp -r "$WHL" "$TREE/.whl"
before=$(find /tmp /dev/shm -maxdepth 1 -name 'bench_gpu*' 2>/dev/null | sort)
rc=0
(cd "$TREE" && OUT=$OUT DEVICE=cpu PYTHON=$VENV/bin/python SITE=$SITE BUDGET=1800 DPO_CAP=1200 bash bench/device_run.sh) || rc=$?
after=$(find /tmp /dev/shm -maxdepth 1 -name 'bench_gpu*' 2>/dev/null | sort)
rm -rf "$TREE"

echo "== 4. what came back in $OUT"
ls -la "$OUT"
"$VENV/bin/python" - "$OUT" <<'EOF'
import json
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])
files = sorted(p for p in out.rglob("*") if p.is_file())
problems = []
if len(files) > 8:
    problems.append(f"{len(files)} files, the device tool returns at most 8")
problems += [f"{p.name}: not a plain name" for p in files if not re.fullmatch(r"[A-Za-z0-9._-]+", p.name)]
for name in ("bench_gpu_dpo.json", "bench_gpu.json"):
    if not (out / name).exists():
        problems.append(f"{name} missing")
        continue
    rows = json.loads((out / name).read_text())["rows"]
    print(f"{name}: {len(rows)} rows")
versions = (out / "versions.txt").read_text()
if not re.search(r"^transformers 5\.24\.\d+ \(carried\)", versions, re.M):
    problems.append("transformers 5.24 was not the carried one")
if "slice_logits_to_keep (packing.py's boolean logits_to_keep): True" not in versions:
    problems.append("slice_logits_to_keep missing")
if problems:
    sys.exit("Error: " + "; ".join(problems))
print(f"{len(files)} files, plain names, both JSON figures, transformers 5.24 carried")
EOF
if [ "$before" != "$after" ]; then
  echo "Error: scratch folders left behind: $after"
  exit 1
fi
echo "== device_run.sh exit $rc; check done in $((SECONDS - t0)) s"
exit "$rc"
