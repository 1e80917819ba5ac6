"""Shared test helpers: compose the Hydra config in-process, tiny-run overrides, shared/ paths."""

from __future__ import annotations

import ast
import functools
import inspect
import os
import re
import textwrap
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub here: a hub id fails at once (not after huggingface_hub's retries)

import pytest
from hydra import compose, initialize_config_dir

import data  # noqa: F401  (registers the data formats and datasets beyond hh, shp and se)
import evaluation.in_training  # noqa: F401  (registers answers_eval and samples with evaluate, as train.py does)
import export.hf  # noqa: F401  (registers the hf/ folder with each checkpoint, as train.py does)
import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO, as train.py does)
import online  # noqa: F401  (registers online DPO's trainer, as train.py does)
import vision  # noqa: F401  (registers image-text-to-text models, image examples and shapes, as train.py does)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# A run of a few seconds: the embedded arithmetic data, the tiny random model.
TINY = [
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=16",
    "n_examples=48",
    "eval_every=24",
    "data.arithmetic.n_train=64",
    "data.arithmetic.n_test=16",
    "n_eval_model_samples=2",
    "progress_bar=false",
    "minimum_log_interval_secs=0",
    "warmup_steps=2",
    "lr=3e-3",
    "sft_first.n_examples=null",
    "sample_during_eval=false",  # eval-time generation is about a third of a tiny run: on only where a test is about it
    "eval_reward_functions=null",
    "plot_curves=false",  # the curves' PNGs are a few seconds a run: on only where a test is about them
]


def one_run(args: list[str]) -> list[str]:
    """``args`` for a command line that trains one run: model=tiny's preset would run an SFT stage
    first (``sft_first``) unless the arguments say otherwise."""
    return args if any(a.startswith("sft_first") for a in args) else [*args, "sft_first.n_examples=null"]


def compose_config(overrides: list[str]):
    """The composed config for ``python train.py <overrides>``."""
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def needs_shared(*parts: str) -> Path:
    """Path under ../shared, or skip the test with the reason."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent (the ../shared folder beside the repository)")
    return path


def tiny_llama_scorer(vocab_size: int, pad_token_id: int, num_labels: int = 1, seed: int = 0):
    """A random 2-layer ``LlamaForSequenceClassification`` (hidden 16): a tiny reward model."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=pad_token_id,
    )
    return LlamaForSequenceClassification(config)


def run_train(overrides: list[str], tmp_path: Path) -> Path:
    """Run train.main in-process on the TINY settings plus ``overrides``; returns the run folder."""
    import train

    config = compose_config([*TINY, f"output_root={tmp_path}", *overrides])
    run_dir, stop_signal = train.main(config)
    assert stop_signal is None
    return Path(run_dir)


def metric_records(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_torchrun(args: list[str], timeout: float = 240, env: dict | None = None, n_procs: int = 2) -> tuple[int, str]:
    """``python -m torch.distributed.run --nproc_per_node <n_procs> <args>`` from the repository root, one
    thread per rank, in its own process group (killed whole on timeout: the test then fails
    with the output's tail). Returns (exit status, stdout and stderr together)."""
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n_procs), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"torchrun {' '.join(args[:1])} did not finish in {timeout:g} s (killed):\n{text[-3000:]}")
    return proc.returncode, text


# ----------------------------------------------------------------------------- tiers
# Every test gets one marker, worked out at collection from what it (with its fixtures and the test
# helpers they call) uses:
#   unit         none of the below: seconds at most
#   integration  an in-process training run (train.main)
#   system       a process of its own (subprocess, torchrun, the launch scripts) or a Ray cluster
# `pytest -m unit` is the fast loop. While a test runs, what it really starts is recorded: a test that
# trains or starts a Python process beyond its marker fails with the reason, so the tiers stay true.
# `xdist_group("launch")` keeps the runs of several processes (FSDP/TP ranks, torchrun and the launch scripts, a Ray
# cluster) on one pytest-xdist worker, one at a time: two at once on 2 cores (4-8 busy processes) each ran slower
# than both one after the other.
TIERS = ("unit", "integration", "system")
TIER_DOC = {
    "unit": "no training run and no process of its own (tests/conftest.py sets it)",
    "integration": "an in-process training run (tests/conftest.py sets it)",
    "system": "a process of its own (subprocess, torchrun, launch scripts) or a Ray cluster (tests/conftest.py sets it)",
}
PROCESS_MODULES = ("subprocess", "multiprocessing", "ray", "pty")  # calls into these start processes
PROCESS_CALLS = {"os.fork", "os.system", "os.execv", "os.execvp", "os.spawnv", "os.posix_spawn"}
# Words in a test's code (or its parameters) that mean several processes (kept on the "launch" worker).
LAUNCH_WORDS = (
    "world_size=",
    "FSDPTrainer",
    "TensorParallelTrainer",
    "torch.distributed.run",
    "torchrun",
    "run_torchrun",
    "NNODES",
    "ray.",
    "launcher=ray",
    "srun",
)


def _called_names(tree: ast.AST) -> list[str]:
    """The dotted names called in ``tree`` (``a.b.c(...)`` gives ``a.b.c``), and names imported inside it."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            parts, func = [], node.func
            while isinstance(func, ast.Attribute):
                parts.append(func.attr)
                func = func.value
            if isinstance(func, ast.Name):
                names.append(".".join([func.id, *reversed(parts)]))
        elif isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
            # a helper passed along rather than called (e.g. ``map(run_train, ...)``, a fixture's function)
            if isinstance(node, ast.Name):
                names.append(node.id)
    return names


def _imports_in(tree: ast.AST) -> dict[str, str]:
    """Names bound by import statements inside ``tree``: local name -> module (or module.attr)."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                bound[(a.asname or a.name).split(".")[0]] = a.name.split(".")[0] if not a.asname else a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def _resolve(name: str, scope: dict, local_imports: dict[str, str]):
    """The object ``name`` (dotted) refers to in a function whose globals are ``scope``, or None."""
    import importlib
    import sys

    head, *rest = name.split(".")
    if head in local_imports:
        target = local_imports[head]
        module, _, attr = target.rpartition(".")
        obj = sys.modules.get(target)
        try:
            if obj is None and module:
                obj = getattr(importlib.import_module(module), attr, None)
            elif obj is None:  # ``import train`` in a helper, before any test module imported train
                obj = importlib.import_module(target)
        except Exception:  # noqa: BLE001 - an optional package absent: nothing to follow
            obj = None
    else:
        obj = scope.get(head)
    for part in rest:
        if obj is None:
            return None
        obj = getattr(obj, part, None)
    return obj


def _in_tests(obj) -> bool:
    """Whether ``obj`` is a function or class written in tests/."""
    try:
        return (inspect.isfunction(obj) or inspect.isclass(obj)) and Path(inspect.getfile(obj)).resolve().parent == REPO / "tests"
    except TypeError:  # a built-in
        return False


@functools.cache
def _uses(func) -> frozenset[str]:
    """What ``func`` and the test helpers it reaches use: "train" (train.main), "process", "launch"."""
    func = inspect.unwrap(func)
    if func in _VISITING:  # helpers that call each other
        return frozenset()
    _VISITING.add(func)
    try:
        return _uses_of(func)
    finally:
        _VISITING.discard(func)


_VISITING: set = set()


def _uses_of(func) -> frozenset[str]:
    try:
        source = textwrap.dedent(inspect.getsource(func))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    found = set()
    if any(word in source for word in LAUNCH_WORDS):
        found.add("launch")
    scope = getattr(func, "__globals__", {})
    local_imports = _imports_in(tree)
    for node in ast.walk(tree):  # a constant the code reads (e.g. FSDP = [..., "world_size=2"]) may name a launch
        if isinstance(node, ast.Name) and isinstance(scope.get(node.id), str | list | tuple | dict):
            if any(word in repr(scope[node.id]) for word in LAUNCH_WORDS):
                found.add("launch")
    for node in ast.walk(tree):  # zoo("fsdp"): a zoo run of several processes, trained in a process of its own
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "zoo" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and any(word in repr(ZOO.get(arg.value)) for word in LAUNCH_WORDS):
                found |= {"process", "launch"}
    for name in _called_names(tree):
        head = name.split(".")[0]
        module_name = local_imports.get(head, "")
        obj = _resolve(name, scope, local_imports)
        if name in PROCESS_CALLS or head in PROCESS_MODULES or module_name.split(".")[0] in PROCESS_MODULES:
            found.add("process")
        elif inspect.ismodule(obj) and obj.__name__.split(".")[0] in PROCESS_MODULES:
            found.add("process")
        if obj is None:
            continue
        if getattr(obj, "__module__", None) == "train" and getattr(obj, "__name__", "") == "main":
            found.add("train")
        elif _in_tests(obj):  # a test helper: follow it (a class: its methods)
            for helper in [obj] if inspect.isfunction(obj) else [f for f in vars(obj).values() if inspect.isfunction(f)]:
                found |= _uses(helper)
    return frozenset(found)


def _tier(item) -> tuple[str, bool]:
    """(tier, whether it launches several training processes) from the test and its fixtures."""
    funcs = [item.function] if hasattr(item, "function") else []
    for name in getattr(item, "fixturenames", []):
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            if (
                fixturedef.argname != "_record_what_tests_start"
                and Path(inspect.getfile(fixturedef.func)).resolve().parent == REPO / "tests"
            ):
                funcs.append(fixturedef.func)
    uses = set().union(*map(_uses, funcs))
    params = repr(getattr(getattr(item, "callspec", None), "params", ""))
    if any(word in params for word in LAUNCH_WORDS) or re.search(r"fsdp|torchrun|tensor_parallel|ray|rank|node", item.name):
        uses.add("launch")
    tier = "system" if "process" in uses else "integration" if "train" in uses else "unit"
    return tier, tier == "system" and "launch" in uses


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # one thread per pytest-xdist worker: 2 workers on 2 cores, no oversubscription
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    for name in TIERS:
        config.addinivalue_line("markers", f"{name}: {TIER_DOC[name]}")


@pytest.hookimpl(tryfirst=True)  # before -m selects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        given = [m.name for m in item.iter_markers() if m.name in TIERS]
        tier, launch = _tier(item)
        if given:  # a marker written on the test (or module) wins
            tier = max(given, key=TIERS.index)
        item.add_marker(getattr(pytest.mark, tier))
        item.stash[TIER_KEY] = tier
        if launch or item.get_closest_marker("launch_group"):
            item.add_marker(pytest.mark.xdist_group("launch"))


TIER_KEY = pytest.StashKey[str]()
OBSERVED_KEY = pytest.StashKey[set]()
_RUNNING: list = []  # the item whose setup or call is running


def _observe(what: str) -> None:
    if _RUNNING:
        _RUNNING[-1].stash.setdefault(OBSERVED_KEY, set()).add(what)


def _is_python_process(args) -> bool:
    import sys

    argv = [args] if isinstance(args, str | os.PathLike) else list(args or [])
    first = os.path.basename(str(argv[0])) if argv else ""
    return (
        first == os.path.basename(sys.executable)
        or first.startswith(("python", "torchrun", "ray"))
        or first.endswith(".sh")
        or first in ("bash", "sh", "sbatch")
    )


@pytest.fixture(scope="session", autouse=True)
def _record_what_tests_start():
    """Record, per test, the training runs and Python processes it really starts (see ``TIERS``)."""
    import subprocess

    import train

    popen_init, main = subprocess.Popen.__init__, train.main

    def recording_popen(self, args, *rest, **kwargs):
        if _is_python_process(args):
            _observe("process")
        return popen_init(self, args, *rest, **kwargs)

    @functools.wraps(main)
    def recording_main(*args, **kwargs):
        _observe("train")
        return main(*args, **kwargs)

    subprocess.Popen.__init__, train.main = recording_popen, recording_main
    try:
        yield
    finally:
        subprocess.Popen.__init__, train.main = popen_init, main


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    _RUNNING.append(item)
    try:
        return (yield)
    finally:
        _RUNNING.pop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _RUNNING.append(item)
    try:
        result = yield
    finally:
        _RUNNING.pop()
    observed = item.stash.get(OBSERVED_KEY, set())
    tier = item.stash.get(TIER_KEY, "system")
    needed = "system" if "process" in observed else "integration" if "train" in observed else "unit"
    if TIERS.index(needed) > TIERS.index(tier):
        pytest.fail(
            f"{item.nodeid} is marked {tier} but {'started a Python process' if needed == 'system' else 'ran train.main'}: "
            f"mark it @pytest.mark.{needed} (tests/conftest.py's reading of its code missed it)"
        )
    return result


# ----------------------------------------------------------------------------- the zoo of finished runs
# Runs that several tests read, trained once per test session (once for all pytest-xdist workers: the first to ask
# trains it under a file lock, the others wait and read it). Read-only: a test that resumes, damages or extends one
# copies it first (copy_run); at the end of the session every zoo run must be byte for byte what it was when built.
ZOO = {
    "default": [],  # TINY as it is: 48 examples, checkpoints (with their Hugging Face export) at 24 and 48
    "no_export": ["save_hf_export=false", "keep_checkpoints=0", "plot_curves=true"],  # no exports; its curves/ plotted
    # 2 FSDP processes, started by train.py in a process of its own: 16 examples, sharded checkpoints at 8 and 16
    "fsdp": ["trainer=FSDPTrainer", "world_size=2", "n_examples=16", "eval_every=8", "data.arithmetic.n_train=16"]
    + ["save_hf_export=false", "num_threads=1"],
}


def _train_in_a_process(overrides: list[str], out: Path) -> Path:
    """``python train.py`` on TINY plus ``overrides`` in a process of its own (a run of several processes); its run folder."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "train.py", *TINY, *overrides, f"output_root={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return next(p for p in out.iterdir() if p.is_dir())


def _files_of(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file and link under ``folder``: relative path -> (size, modification time in ns)."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="session")
def zoo(tmp_path_factory):
    """``zoo(name)``: the folder of the finished run ``ZOO[name]`` (TINY plus those overrides). Read it; copy it to change it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "zoo"  # the workers share base.parent
    root.mkdir(exist_ok=True)
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            with FileLock(str(root / f"{name}.lock")):
                done = root / f"{name}.done"
                if not done.exists():
                    overrides = ZOO[name]
                    several = any(word in repr(overrides) for word in LAUNCH_WORDS)
                    run_dir = (_train_in_a_process if several else run_train)(overrides, root / name)
                    done.write_text(str(run_dir))
                run_dir = Path(done.read_text())
            built[name] = (run_dir, _files_of(run_dir))
        return built[name][0]

    yield get
    for name, (run_dir, files) in built.items():
        assert _files_of(run_dir) == files, f"a test wrote into the zoo's {name} run {run_dir}: copy it first (copy_run)"


def copy_run(run_dir: Path, parent: Path) -> Path:
    """A copy of the run folder ``run_dir`` in ``parent`` (links kept as links), to resume, damage or extend."""
    import shutil

    copy = parent / run_dir.name
    shutil.copytree(run_dir, copy, symlinks=True)
    return copy
