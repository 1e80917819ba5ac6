#!/usr/bin/env bash
# The wheels that the GPU benchmarks (bench/bench_gpu.py, bench/bench_gpu_dpo.py) need and the
# nvidia-h200 device image lacks, downloaded here into .whl/ (ignored by git), for
# `bash bench/device_run.sh` there (the device has no package index; run's `carry: [".whl"]`).
#
#   bash bench/prepare_device.sh                           # cp312 manylinux x86_64 (the device's Python 3.12)
#   PYVER=3.11 DEST=/tmp/whl311 bash bench/prepare_device.sh   # the same set for another Python (the CPU check)
#
# Each wheel is fetched with --no-deps, so every dependency is named below: the closure of
# each wheel's Requires-Dist (`unzip -p X.whl '*/METADATA' | grep ^Requires-Dist`), less what the
# image holds (bench/device_image_packages.txt). One version of each is kept (two stop the
# install there); the total is checked against the device tool's 64 MiB carry limit.
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl}
PY=${PYTHON:-python3}

# name==version: the distribution, then why it is carried and what it needs (image: in the image).
WHEELS=(
  transformers==5.24.0  # the image's 5.17 has no slice_logits_to_keep: packing.py's boolean logits_to_keep (README)
  #                       needs hub>=1.31,<3, tokenizers>=0.23.1,<0.24, safetensors>=0.8, regex, typer...: image
  hydra-core==1.3.8     # train.py, bench_dpo.py; needs omegaconf, antlr4-python3-runtime==4.9.*, packaging (image)
  omegaconf==2.3.1      # needs antlr4-python3-runtime==4.9.*, PyYAML (image)
  trl==1.16.0           # bench_gpu_dpo.py's other side (requirements-bench.txt); needs datasets, and
  #                       accelerate, hub, jinja2, numpy, packaging, pandas, psutil, pyarrow, pyyaml, transformers: image
  datasets==5.2.0       # trl; needs dill<0.4.2, multiprocess<0.70.20, and filelock, fsspec, hub, numpy,
  #                       packaging, pandas, pyarrow, pyyaml, tqdm, xxhash: image
  dill==0.4.1           # datasets, multiprocess
  multiprocess==0.70.19 # datasets; needs dill>=0.4.1 (a wheel per Python version: py312 for the device)
)
# Source-only on PyPI: built here with `pip wheel` (pure Python, so the wheel fits any Python 3).
SDISTS=(
  antlr4-python3-runtime==4.9.3  # omegaconf and hydra-core pin 4.9.*
)
LIMIT_MIB=64

mkdir -p "$DEST"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
echo "downloading ${#WHEELS[@]} wheels for cp${PYVER/./} manylinux x86_64 into $DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d "$DEST" "${WHEELS[@]}"
for spec in "${SDISTS[@]}"; do
  name=${spec%%==*}
  version=${spec#*==}
  if ! compgen -G "$DEST/${name//-/_}-${version}-*.whl" >/dev/null; then
    echo "building $spec from source"
    "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$DEST" "$spec"
  fi
done

# Keep exactly the listed versions (an older run's wheels would make two versions of one name),
# then check the count and the size.
"$PY" - "$DEST" "$LIMIT_MIB" "${WHEELS[@]}" "${SDISTS[@]}" <<'EOF'
import re
import subprocess
import sys
from pathlib import Path

dest, limit_mib, specs = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]


def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()


wanted = {norm(s.split("==")[0]): s.split("==")[1] for s in specs}
kept = {}
for whl in sorted(dest.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    if wanted.get(norm(name)) == version and norm(name) not in kept:
        kept[norm(name)] = whl
    else:
        print(f"removing {whl.name} (not in the list)")
        whl.unlink()
missing = sorted(set(wanted) - set(kept))
if missing:
    sys.exit(f"Error: no wheel for {', '.join(missing)} in {dest}: rerun bench/prepare_device.sh.")
for leftover in dest.iterdir():
    if leftover.suffix != ".whl":
        print(f"note: {leftover.name} in {dest} is not a wheel; it travels too")
size = sum(p.stat().st_size for p in dest.iterdir() if p.is_file())
for whl in kept.values():
    print(f"  {whl.stat().st_size / 2**20:6.2f} MiB  {whl.name}")
print(f"{len(kept)} wheels, {size / 2**20:.1f} MiB in {dest}")
try:  # what else travels: tracked and untracked-not-ignored files
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True
    ).stdout.split(b"\0")
    tree = sum(Path(f.decode()).stat().st_size for f in files if f and Path(f.decode()).is_file())
    print(f"working tree {tree / 2**20:.1f} MiB + wheels = {(tree + size) / 2**20:.1f} MiB (limit {limit_mib:.0f} MiB)")
except (OSError, subprocess.CalledProcessError):
    tree = 0
if tree + size >= limit_mib * 2**20:
    sys.exit(f"Error: {(tree + size) / 2**20:.1f} MiB would travel, over the device tool's {limit_mib:.0f} MiB: carry fewer wheels.")
EOF
