"""``malloc_mmap_threshold_mib``: glibc's mmap threshold, fixed (utils.set_malloc_mmap_threshold).

What it must do is glibc's documented behaviour (mallopt(3)): by default the threshold rises to
the size of each mapped block freed, so after a 16 MiB block is freed a 2 MiB request comes from
the heap (and stays resident when freed); with the threshold fixed at 1 MiB the same request gets
its own mapping. ``mallinfo2().hblks`` (the number of mapped blocks) tells the two apart. Each
case runs in a fresh interpreter: the setting is process-wide.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, compose_config

PROBE = r"""
import ctypes, sys
sys.path.insert(0, {repo!r})
import torch
import utils

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
print("set", utils.set_malloc_mmap_threshold({mib}))
big = libc.malloc(16 << 20)  # mapped (above the 128 KiB starting threshold); freeing it raises glibc's dynamic threshold
libc.free(big)
base = libc.mallinfo2().hblks
p = libc.malloc(2 << 20)
print("malloc", libc.mallinfo2().hblks - base)
libc.free(p)
t = torch.empty(2 << 18)  # 2 MiB of float32: torch's CPU allocator goes through the same malloc
print("torch", libc.mallinfo2().hblks - base)
del t
"""


def _probe(mib) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(repo=str(REPO), mib=mib)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return dict(line.split() for line in out.stdout.splitlines() if line.split()[0] in ("set", "malloc", "torch"))


def _glibc_with_mallinfo2() -> bool:
    libc = ctypes.CDLL(None)
    return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")


needs_glibc = pytest.mark.skipif(not _glibc_with_mallinfo2(), reason="needs glibc >= 2.33 (mallopt, mallinfo2)")


@needs_glibc
def test_a_fixed_threshold_maps_what_the_default_takes_from_the_heap():
    default = _probe(None)
    assert default == {"set": "False", "malloc": "0", "torch": "0"}  # glibc's grown threshold: from the heap
    fixed = _probe(1)
    assert fixed == {"set": "True", "malloc": "1", "torch": "1"}  # its own mapping, returned to the OS on free


@needs_glibc
def test_a_threshold_above_2_mib_leaves_a_2_mib_block_on_the_heap():
    assert _probe(4) == {"set": "True", "malloc": "0", "torch": "0"}


def test_out_of_range_or_non_number_is_one_sentence_before_any_model_loads(monkeypatch):
    import utils
    from modeling import models
    from runs import checks

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    for value in ("0", "64", "abc", "-1", "true"):
        with pytest.raises(utils.ConfigError) as e:
            checks.validate_config(compose_config([f"malloc_mmap_threshold_mib={value}"]))
        assert str(e.value).startswith("malloc_mmap_threshold_mib must be null (glibc's default) or a number of MiB in (0, 32]")
    checks.validate_config(compose_config(["malloc_mmap_threshold_mib=1"]))
    checks.validate_config(compose_config(["malloc_mmap_threshold_mib=0.5"]))


def test_train_sets_it_in_each_process_before_the_model_loads(tmp_path, monkeypatch):
    from conftest import run_train

    import utils
    from modeling import models

    calls = []
    real = models.load_model
    monkeypatch.setattr(utils, "set_malloc_mmap_threshold", lambda mib: calls.append(("malloc", mib)))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (calls.append(("model",)), real(*a, **k))[1])
    run_train(["malloc_mmap_threshold_mib=1", "n_examples=4"], tmp_path)
    assert calls[0] == ("malloc", 1) and ("model",) in calls


def test_the_config_key_is_documented_null_by_default():
    text = (Path(REPO) / "config" / "config.yaml").read_text()
    assert "\nmalloc_mmap_threshold_mib: null" in text


TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


@pytest.mark.skipif(not TCMALLOC.exists(), reason=f"{TCMALLOC} is absent (apt install libtcmalloc-minimal4)")
def test_readme_tcmalloc_command_trains_and_the_glibc_setting_steps_aside(tmp_path):
    """README "Memory on CPU": ``LD_PRELOAD=<tcmalloc> python train.py ...`` trains (the same
    losses as glibc's run); ``malloc_mmap_threshold_mib`` under it says once that it is not set."""
    import json
    import os

    from conftest import TINY

    losses = {}
    for name, preload in (("glibc", None), ("tcmalloc", str(TCMALLOC))):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env.update({"LD_PRELOAD": preload} if preload else {})
        args = [*TINY, f"output_root={tmp_path / name}", "n_examples=8", "malloc_mmap_threshold_mib=1"]
        out = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        note = "malloc_mmap_threshold_mib is glibc's; " + str(TCMALLOC)
        assert (out.stdout.count(note) == 1) == bool(preload), out.stdout[-2000:]
        allocator = "CPU memory allocator: libtcmalloc_minimal.so.4" if preload else "CPU memory allocator: glibc"
        assert allocator in out.stdout, out.stdout[-2000:]
        (metrics,) = (tmp_path / name).rglob("metrics.jsonl")
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses[name] = [r["loss/train"] for r in records if "loss/train" in r]
    assert losses["glibc"] and losses["tcmalloc"] == pytest.approx(losses["glibc"], abs=1e-6)


@needs_glibc
def test_the_end_of_a_cpu_run_names_the_allocator(tmp_path):
    """A user could not tell from a run which allocator served it (found by a fresh-user trial):
    the end of a CPU run names it, here glibc with the threshold the run set (its own process:
    the setting is process-wide)."""
    import os

    from conftest import TINY

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    args = [*TINY, f"output_root={tmp_path}", "n_examples=8", "eval_every=8", "malloc_mmap_threshold_mib=2"]
    out = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("CPU memory allocator:")]
    assert len(lines) == 1 and lines[0].endswith(" malloc, mmap threshold 2 MiB (malloc_mmap_threshold_mib)."), lines
    assert lines[0].startswith("CPU memory allocator: glibc 2.")
