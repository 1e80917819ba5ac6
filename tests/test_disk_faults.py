"""Full disks and leftover files (issue 24): every write into a run folder that meets a full disk
ends in one sentence naming the file, "no space left on the device" and the MiB still free, and
leaves no temporary file; a run folder's temporary files of killed writers go when it is opened.

A full disk is shown honestly at the lowest level the code reaches: write(2) failing with ENOSPC
for files under one folder (Python's file objects and ``os.write``), ``torch.save`` raising the
RuntimeError its zip writer raises there, ``shutil.disk_usage`` giving the space left. The tests
of :func:`real_full_disk` fill a real tmpfs instead (they need root for ``mount``; else skipped).
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, compose_config, metric_records, one_run

import train
import trainers
import utils
from evaluation import in_training
from online import trainer as online
from runs import checkpoints, tracking

MIB = 2**20
FREE_MIB = 3  # what the patched shutil.disk_usage says is free
TORCH_ZIP_ENOSPC = "[enforce fail at inline_container.cc:672] . unexpected pos 400256 vs 400144"  # torch.save's words on ENOSPC


def enospc() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FullFile:
    """A file opened on a full disk: the open worked (an empty file exists), every write fails."""

    def __init__(self, f):
        self._f = f

    def write(self, *args):
        raise enospc()

    writelines = write

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __getattr__(self, name):
        return getattr(self._f, name)


def disk_full_under(monkeypatch, folder: Path, free_mib: float = FREE_MIB) -> None:
    """From now on writes to files under ``folder`` fail with ENOSPC, and the disk has ``free_mib`` free."""
    root = os.path.realpath(folder) + os.sep
    real_open, real_write, real_fdopen = builtins.open, os.write, os.fdopen

    def under(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.realpath(path).startswith(root)

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return FullFile(f) if under(file) and any(c in mode for c in "wax+") else f

    def full_fdopen(fd, mode="r", *args, **kwargs):  # runs/files.py open_append's file
        f = real_fdopen(fd, mode, *args, **kwargs)
        return FullFile(f) if under(f"/proc/self/fd/{fd}") and any(c in mode for c in "wax+") else f

    def full_write(fd, data):
        if under(f"/proc/self/fd/{fd}"):
            raise enospc()
        return real_write(fd, data)

    total = 100 * MIB
    usage = shutil._ntuple_diskusage(total, total - int(free_mib * MIB), int(free_mib * MIB))
    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(os, "write", full_write)
    monkeypatch.setattr(os, "fdopen", full_fdopen)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)


def assert_one_sentence(error: BaseException, path) -> None:
    """The full-disk sentence: names ``path``, says there is no space and how much is free; one
    line, no errno; a DiskFullError (or the CheckpointError of a checkpoint)."""
    message = str(error)
    assert str(path) in message, message
    assert f"no space left on the device ({FREE_MIB} MiB free)" in message, message
    assert "\n" not in message and "Errno" not in message and "unexpected pos" not in message, message
    assert message.endswith("."), message
    assert isinstance(error, (utils.DiskFullError, checkpoints.CheckpointError)), type(error)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name or ".old-" in p.name)


def dead_pid() -> int:
    """The pid of a process that has ended."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ----------------------------------------------------------------------------- 1. full disk: one sentence


def test_resume_on_a_full_disk_is_one_sentence_and_leaves_metrics_jsonl_as_it_was(tmp_path, monkeypatch):
    # Seen: OSError: [Errno 28] from rewind_jsonl, and metrics.jsonl.tmp-<pid> left for ever.
    path = tmp_path / "metrics.jsonl"
    before = "".join(json.dumps({"step": s, "loss/train": 1.0}) + "\n" for s in (8, 16, 24))
    path.write_text(before)
    disk_full_under(monkeypatch, tmp_path)
    with pytest.raises(OSError) as err:
        tracking.rewind_jsonl(str(path), 8)  # drops 16 and 24: a rewrite
    assert_one_sentence(err.value, path)
    assert path.read_text() == before and leftovers(tmp_path) == []


def test_a_fresh_run_on_a_full_disk_is_one_sentence_and_leaves_no_folder(tmp_path, monkeypatch):
    # Seen: OSError: [Errno 28] from lock_run_dir (the pid into .lock), and a folder holding only .lock.
    disk_full_under(monkeypatch, tmp_path)
    with pytest.raises(OSError) as err:
        checkpoints.new_run_dir(str(tmp_path), "exp", compose_config(TINY))
    assert_one_sentence(err.value, tmp_path)
    assert ".lock" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_a_fresh_run_that_cannot_write_config_yaml_leaves_no_folder(tmp_path, monkeypatch):
    def fsync(fd):  # config.yaml's text is written, then the disk fills before it reaches it
        raise enospc()

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(100 * MIB, 97 * MIB, FREE_MIB * MIB))
    with pytest.raises(OSError) as err:
        checkpoints.new_run_dir(str(tmp_path), "exp", compose_config(TINY))
    assert_one_sentence(err.value, tmp_path)
    assert "config.yaml" in str(err.value) and "start the run again" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_torch_saves_unexpected_pos_on_a_full_disk_says_no_space_left(tmp_path, monkeypatch):
    # Seen: "Could not write checkpoint step-16 ... (RuntimeError: [enforce fail ...] unexpected pos 400256 vs 400144; ...)".
    first = checkpoints.save_checkpoint_dir(
        str(tmp_path), "step-8", lambda folder: Path(folder, "policy.pt").write_bytes(b"x" * MIB)
    )

    def write(folder):
        Path(folder, "policy.pt").write_bytes(b"half")  # what torch.save wrote before the disk filled
        raise RuntimeError(TORCH_ZIP_ENOSPC)

    total = 100 * MIB
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(total, total - FREE_MIB * MIB, FREE_MIB * MIB))
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.save_checkpoint_dir(str(tmp_path), "step-16", write)
    message = str(err.value)
    assert_one_sentence(err.value, tmp_path)
    assert "step-16" in message and "LATEST still points at the complete step-8" in message
    assert "step-8 takes 1.0 MiB" in message and f"resume={tmp_path}" in message
    assert os.path.realpath(tmp_path / "LATEST") == os.path.realpath(first) and leftovers(tmp_path) == []


def test_torch_saves_unexpected_pos_with_space_free_is_not_called_a_full_disk(tmp_path, monkeypatch):
    # The same words from a disk with room (another fault): the reason is given as it is.
    total = 100 * MIB
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(total, 0, total))

    def write(folder):
        raise RuntimeError(TORCH_ZIP_ENOSPC)

    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.save_checkpoint_dir(str(tmp_path), "step-8", write)
    assert "unexpected pos 400256 vs 400144" in str(err.value) and "no space left" not in str(err.value)


def test_enospc_anywhere_in_the_chain_is_a_full_disk(tmp_path):
    try:
        try:
            raise enospc()
        except OSError as e:
            raise RuntimeError("saving failed") from e
    except RuntimeError as e:
        assert utils.disk_full(e, str(tmp_path))
    assert not utils.disk_full(RuntimeError("saving failed"), str(tmp_path))
    assert not utils.disk_full(OSError(errno.EIO, os.strerror(errno.EIO)), str(tmp_path))


def test_write_atomic_on_a_full_disk_is_one_sentence_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    (tmp_path / "FINISHED").write_text("old\n")
    disk_full_under(monkeypatch, tmp_path)
    with pytest.raises(OSError) as err:
        utils.write_atomic(str(tmp_path / "FINISHED"), "48\n")
    assert_one_sentence(err.value, tmp_path / "FINISHED")
    assert (tmp_path / "FINISHED").read_text() == "old\n" and leftovers(tmp_path) == []


def test_a_metrics_record_on_a_full_disk_is_one_sentence(tmp_path, monkeypatch):
    logger = tracking.MetricsLogger(str(tmp_path), compose_config(TINY))
    logger.log({"loss/train": 1.0}, step=8)
    disk_full_under(monkeypatch, tmp_path)
    with pytest.raises(OSError) as err:
        logger.log({"loss/train": 0.5}, step=16)
    assert_one_sentence(err.value, tmp_path / "metrics.jsonl")
    assert "start the run again" in str(err.value)  # no checkpoint yet


def test_samples_md_on_a_full_disk_is_one_sentence_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    (tmp_path / "samples.jsonl").write_text(json.dumps({"step": 8, "prompt": "1+1=", "policy": "2"}) + "\n")
    disk_full_under(monkeypatch, tmp_path)
    with pytest.raises(OSError) as err:
        in_training.write_samples_md(str(tmp_path))
    assert_one_sentence(err.value, tmp_path / "samples.md")
    assert leftovers(tmp_path) == [] and not (tmp_path / "samples.md").exists()


def test_completions_on_a_full_disk_are_one_sentence(tmp_path, monkeypatch):
    disk_full_under(monkeypatch, tmp_path)
    with pytest.raises(OSError) as err:
        online.write_completions(str(tmp_path), [{"step": 8, "prompt": "p", "completion": "c", "score": 1.0}])
    assert_one_sentence(err.value, tmp_path / "completions.jsonl")
    assert leftovers(tmp_path) == []


LOCK_ON_A_FULL_DISK = """
import errno, os

_real_write = os.write

def _write(fd, data):
    if os.readlink(f"/proc/self/fd/{fd}").endswith("/.lock"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return _real_write(fd, data)

os.write = _write
"""


def test_train_py_on_a_full_disk_exits_1_with_one_sentence_and_no_folder(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(LOCK_ON_A_FULL_DISK))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)]), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "out"
    args = one_run([*TINY, "sample_during_eval=false", "num_threads=1", f"output_root={out}"])
    result = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    text = result.stdout + result.stderr
    assert result.returncode == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "no space left on the device (" in errors[0] and "/.lock" in errors[0], text[-3000:]
    assert not out.exists() or list(out.iterdir()) == []


# ----------------------------------------------------------------------------- 2. leftovers of dead writers


def plant_leftovers(run_dir: Path) -> dict[str, int]:
    """The temporary files and folders that killed writers leave; returns their names and sizes."""
    dead = dead_pid()
    made = {}
    tmp = run_dir / ".step-40.tmp-abcd1234"  # kill -9 during save_checkpoint_dir
    tmp.mkdir()
    (tmp / "policy.pt").write_bytes(b"x" * 1000)
    made[tmp.name] = 1000
    old = run_dir / ".step-24.old-k3j_x9ab"  # kill -9 in publish_checkpoint, LATEST already back on step-24
    (old / "step-24").mkdir(parents=True)
    (old / "step-24" / "policy.pt").write_bytes(b"x" * 500)
    made[old.name] = 500
    fsdp = run_dir / ".step-48.tmp"  # FSDPTrainer's temporary folder
    fsdp.mkdir()
    (fsdp / "scheduler.pt").write_bytes(b"x" * 100)
    made[fsdp.name] = 100
    for name in (f"metrics.jsonl.tmp-{dead}", f".samples.md.tmp-{dead}", "completions.html.tmp"):
        (run_dir / name).write_bytes(b"y" * 10)
        made[name] = 10
    os.symlink("step-40", run_dir / ".LATEST.tmp")
    made[".LATEST.tmp"] = 0
    return made


def test_opening_a_run_folder_removes_what_dead_writers_left_and_says_so(tmp_path, capsys):
    # Seen: .step-N.tmp-XXXX/ (1.9 MB of a 2.5 MB checkpoint) for ever, after resume and FINISHED too.
    made = plant_leftovers(tmp_path)
    mine = tmp_path / f"metrics.jsonl.tmp-{os.getpid()}"  # this process's: not a dead writer's
    mine.write_text("live")
    kept = ["config.yaml", "metrics.jsonl", "notes.txt", "notes.tmp"]  # a user's notes.tmp is not a writer's
    for name in kept:
        (tmp_path / name).write_text("keep")
    with checkpoints.lock_run_dir(str(tmp_path)):
        pass
    assert leftovers(tmp_path) == sorted([mine.name, "notes.tmp"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, ".lock", mine.name])
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert len(lines) == 1, lines
    size = sum(made.values())  # 1,640 bytes
    assert f"{len(made)} temporary files and folders" in lines[0] and f"{size / 1024:.1f} KiB" in lines[0], lines[0]


def test_opening_a_clean_run_folder_says_nothing(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("")
    with checkpoints.lock_run_dir(str(tmp_path)):
        pass
    assert capsys.readouterr().out == ""


def test_a_temporary_folder_latest_points_into_is_kept(tmp_path):
    # A kill -9 inside publish_checkpoint can leave LATEST on the new folder before it is renamed.
    tmp = tmp_path / ".step-16.tmp-0123abcd"
    tmp.mkdir()
    (tmp / "policy.pt").write_text("complete")
    os.symlink(tmp.name, tmp_path / "LATEST")
    with checkpoints.lock_run_dir(str(tmp_path)):
        pass
    assert (tmp / "policy.pt").read_text() == "complete"


def crash_at_step(monkeypatch, n: int) -> None:
    """Make the n-th optimizer step (1-based) raise, after the steps before it were logged."""
    real = trainers.BasicTrainer.train_step

    def train_step(self, batch):
        if self.batch_counter + 1 == n:
            raise KeyboardInterrupt  # the process dying between checkpoints
        return real(self, batch)

    monkeypatch.setattr(trainers.BasicTrainer, "train_step", train_step)


def test_a_resume_removes_a_killed_saves_leftovers_and_finishes_clean(tmp_path, monkeypatch, capsys):
    # TINY: checkpoints at 24 and 48; the process dies at step 5 (32 -> 40), as after a kill -9 in
    # the save of step-40 and a full disk on an earlier resume.
    common = [*TINY, "sample_during_eval=false", "save_hf_export=false", f"output_root={tmp_path}"]
    with monkeypatch.context() as m:
        crash_at_step(m, 5)
        with pytest.raises(KeyboardInterrupt):
            train.main(compose_config(common))
    run_dir = next(tmp_path.iterdir())
    made = plant_leftovers(run_dir)
    capsys.readouterr()
    train.main(compose_config([f"resume={run_dir}"]))
    assert "temporary files and folders" in capsys.readouterr().out
    assert leftovers(run_dir) == [] and (run_dir / "FINISHED").exists(), sorted(os.listdir(run_dir))
    assert [r["step"] for r in metric_records(run_dir) if "loss/train" in r] == [8, 16, 24, 32, 40, 48]
    assert len(made) == 7


# ----------------------------------------------------------------------------- 3. a real full disk (tmpfs)


@pytest.fixture
def real_full_disk(tmp_path):
    """A 2 MiB tmpfs at ``tmp_path/disk`` holding ``metrics.jsonl`` and ``run/``, then filled to the
    last byte; skipped where ``mount`` is not allowed (it needs root)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        (disk / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (8, 16, 24)))
        (disk / "run").mkdir()
        with open(disk / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
        assert shutil.disk_usage(disk).free < MIB
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_real_full_disk_gives_the_sentences_and_leaves_nothing(real_full_disk):
    disk = real_full_disk
    before = (disk / "metrics.jsonl").read_text()
    with pytest.raises(OSError) as err:
        tracking.rewind_jsonl(str(disk / "metrics.jsonl"), 8)
    assert "no space left on the device (0 MiB free)" in str(err.value) and str(disk / "metrics.jsonl") in str(err.value)
    assert (disk / "metrics.jsonl").read_text() == before

    with pytest.raises(OSError) as err:
        checkpoints.new_run_dir(str(disk / "runs"), "exp", compose_config(TINY))
    assert "no space left on the device (0 MiB free)" in str(err.value)
    assert list((disk / "runs").iterdir()) == []

    run = disk / "run"

    def write(folder):
        torch.save({"w": torch.zeros(100_000)}, os.path.join(folder, "policy.pt"))  # 400 kB on a full disk

    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.save_checkpoint_dir(str(run), "step-8", write)
    assert "no space left on the device (0 MiB free)" in str(err.value) and "unexpected pos" not in str(err.value)
    assert sorted(os.listdir(disk)) == ["filler", "metrics.jsonl", "run", "runs"] and os.listdir(run) == []


def test_pruning_counts_no_checkpoint_past_latest(tmp_path):
    # Regression (issue 24's fresh-user pass): after a resume from step-152 past a damaged step-680,
    # keep_checkpoints=3 counted step-680 and deleted the intact step-152 and step-288.
    for step in (152, 288, 424, 680):
        (tmp_path / f"step-{step}").mkdir()
    (tmp_path / "LATEST").symlink_to("step-424")
    checkpoints.prune_checkpoints(str(tmp_path), 3)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-152",
        "step-288",
        "step-424",
        "step-680",
    ]
    (tmp_path / "step-560").mkdir()
    os.remove(tmp_path / "LATEST")
    (tmp_path / "LATEST").symlink_to("step-560")
    checkpoints.prune_checkpoints(str(tmp_path), 3)  # the newest 3 up to LATEST; step-680 waits to be saved again
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-288",
        "step-424",
        "step-560",
        "step-680",
    ]
