"""The device run's packages: every import of the GPU benchmarks and of the training path is either
in the nvidia-h200 image (bench/device_image_packages.txt) or carried as a wheel by
bench/prepare_device.sh, so a new import cannot silently break ``bash bench/device_run.sh`` there
(no package index on that machine). Static: no network, no GPU, well under a second."""

from __future__ import annotations

import ast
import re
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# what device_run.sh runs, and what they run
ROOTS = ["train.py", "bench/bench_gpu.py", "bench/bench_gpu_dpo.py", "bench/bench_memory.py"]
LOCAL_DIRS = [REPO, REPO / "bench"]  # where the repo's own modules are found (the bench scripts add bench/ to sys.path)
IMPORT_TO_DIST = {  # import name -> distribution name, where they differ
    "yaml": "pyyaml",
    "hydra": "hydra-core",
    "antlr4": "antlr4-python3-runtime",
    "huggingface_hub": "huggingface-hub",
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "cv2": "opencv-python-headless",
    "google": "protobuf",
    "dateutil": "python-dateutil",
}
OPTIONAL = {  # imported only with options the device run leaves off
    "wandb": "utils.WandbLogger, only with wandb.enabled=true",
    "ray": "ray_launcher, only with launcher=ray",
    "vaderSentiment": "reward_functions.sentiment, only with reward_functions=[sentiment]",
    "submitit": "launch.job_failure, only in a job of -m hydra/launcher=slurm or submitit_local",
}
OVERRIDES = {"transformers": "the image's 5.17 lacks slice_logits_to_keep (bench/README.md, device run)"}


def norm(name: str) -> str:
    """PEP 503 normalised distribution name: "PyYAML" -> "pyyaml", "hydra_core" -> "hydra-core"."""
    return re.sub(r"[-_.]+", "-", name).lower()


def image_dists() -> dict[str, str | None]:
    """bench/device_image_packages.txt: normalised name -> version (None where not recorded)."""
    dists = {}
    for line in (REPO / "bench/device_image_packages.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            dists[norm(name)] = version or None
    return dists


def carried_specs(script: Path = REPO / "bench/prepare_device.sh") -> list[tuple[str, str]]:
    """(name, version) of every ``name==version`` in prepare_device.sh's WHEELS and SDISTS arrays."""
    text = script.read_text()
    specs = []
    for array in ("WHEELS", "SDISTS"):
        block = re.search(rf"^{array}=\((.*?)^\)", text, re.M | re.S)
        assert block, f"no {array}=( ... ) array in {script}"
        for line in block.group(1).splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                name, sep, version = line.partition("==")
                assert sep and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name), f"not name==version: {line!r}"
                specs.append((name, version))
    return specs


def _local(name: str) -> Path | None:
    for d in LOCAL_DIRS:
        if (d / f"{name}.py").is_file():
            return d / f"{name}.py"
        if (d / name / "__init__.py").is_file():  # a package of the repository's: its modules, one after the other
            return d / name
    return None


def imported_modules(roots: list[Path]) -> dict[str, set[str]]:
    """Top-level names of every module imported anywhere (module level or inside functions) by
    ``roots`` and, transitively, by the repo's own modules they import: {name: {importing files}},
    standard library and the repo's own modules left out."""
    found: dict[str, set[str]] = {}
    todo, seen = list(roots), set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        if path.is_dir():
            todo.extend(sorted(path.glob("*.py")))
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "__future__":
                    continue
                if local := _local(top):
                    todo.append(local)
                    continue
                found.setdefault(top, set()).add(path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else str(path))
    return found


def unprovided(found: dict[str, set[str]], image: set[str], carried: set[str]) -> list[str]:
    """Sentences for the imports that neither the image nor the carried wheels provide."""
    missing = []
    for top, files in sorted(found.items()):
        dist = norm(IMPORT_TO_DIST.get(top, top))
        if top not in OPTIONAL and dist not in image and dist not in carried:
            missing.append(f"{top} (distribution {dist}, imported by {', '.join(sorted(files))})")
    return missing


def test_every_import_of_the_device_run_is_in_the_image_or_carried():
    found = imported_modules([REPO / r for r in ROOTS])
    carried = {norm(n) for n, _ in carried_specs()}
    missing = unprovided(found, set(image_dists()), carried)
    assert not missing, (
        "not in the device image (bench/device_image_packages.txt) nor carried by bench/prepare_device.sh: "
        + "; ".join(missing)
        + ". Add the wheel (and its dependencies) to prepare_device.sh, or mark the import optional here."
    )
    # the scan did reach what the benchmarks need: the packages the device image lacks are among them
    assert {"hydra", "omegaconf", "trl", "datasets", "torch", "transformers"} <= set(found)


def test_the_scan_flags_a_new_import(tmp_path):
    # a root importing a package of neither kind, plus one of each kind and an optional one
    (tmp_path / "root.py").write_text("import yaml\nimport trl\nimport wandb\n\ndef f():\n    from somepkg.sub import x\n")
    found = imported_modules([tmp_path / "root.py"])
    assert set(found) == {"yaml", "trl", "wandb", "somepkg"}
    missing = unprovided(found, {"pyyaml"}, {"trl"})
    assert len(missing) == 1 and missing[0].startswith("somepkg (distribution somepkg, imported by ")


def test_the_carried_wheels_are_one_version_each_and_not_the_image_s():
    specs = carried_specs()
    names = [norm(n) for n, _ in specs]
    assert len(names) == len(set(names)), f"a distribution listed twice: {names}"
    image = image_dists()
    assert {n for n in names if n in image} == set(OVERRIDES), "carry only what the image lacks, or a documented override"
    never = {"torch", "triton", "torchvision", "torchaudio"} | {n for n in image if n.startswith("nvidia-")}
    assert not never & set(names), "the image's torch stack must never be carried"
    assert ("antlr4-python3-runtime", "4.9.3") in [(norm(n), v) for n, v in specs]  # omegaconf/hydra pin 4.9.*


def test_device_run_installs_with_target_and_no_deps():
    text = (REPO / "bench/device_run.sh").read_text()
    install = next(line for line in text.splitlines() if "pip install" in line)
    for flag in ("--no-index", "--no-deps", "--target", "--upgrade"):
        assert flag in install, f"device_run.sh's pip install lacks {flag}"
    assert "export PYTHONPATH=$SITE" in text


def _requires(whl: Path) -> list[str]:
    """The Requires-Dist names of a wheel that apply on the device (Linux x86-64, CPython 3.12, no extra)."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux"}
    env |= {"platform_machine": "x86_64", "implementation_name": "cpython", "os_name": "posix", "extra": ""}
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    names = []
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(env):
                names.append(norm(req.name))
    return names


@pytest.mark.skipif(not any((REPO / ".whl").glob("*.whl")), reason="no .whl/: run bash bench/prepare_device.sh")
def test_prepared_wheels_are_the_listed_ones_and_their_needs_are_met():
    wheels = sorted((REPO / ".whl").glob("*.whl"))
    got = {(norm(w.name.split("-")[0]), w.name.split("-")[1]) for w in wheels}
    assert got == {(norm(n), v) for n, v in carried_specs()}, "rerun bash bench/prepare_device.sh"
    provided = set(image_dists()) | {n for n, _ in got}
    unmet = {f"{w.name}: {r}" for w in wheels for r in _requires(w) if r not in provided}
    assert not unmet, f"carried wheels need what neither the image nor the wheels hold: {sorted(unmet)}"
    assert sum(w.stat().st_size for w in wheels) < 64 * 2**20
