"""Faults around a run's setup (issue 24): each job of a Hydra multirun reports its own peak memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, compose_config, metric_records, one_run


def _rss_mib() -> float:
    """This process's resident memory now, MiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_each_job_of_a_multirun_reports_its_own_peak_memory(tmp_path):
    """A multirun runs its jobs in one process (train.main once per job); a job's memory/*
    peak is its own: 1 GiB touched and freed between two jobs does not reach the second job's peak
    (the process's peak would be at least 1 GiB above the memory in use when it starts)."""
    import train

    first, _ = train.main(compose_config([*TINY, f"output_root={tmp_path / 'a'}"]))
    block = bytearray(2**30)
    block[:: 2**12] = b"\x01" * (2**30 // 2**12)  # every page touched: resident
    del block  # one mmap'd block: back to the kernel at once
    before = _rss_mib()
    second, _ = train.main(compose_config([*TINY, f"output_root={tmp_path / 'b'}"]))
    for run_dir in (first, second):
        memory = next(r for r in metric_records(Path(run_dir)) if "memory/rank0_peak_rss_mib" in r)
        assert memory["memory/rank0_peak_rss_mib"] > 0
    memory = next(r for r in metric_records(Path(second)) if "memory/rank0_peak_rss_mib" in r)
    assert memory["memory/rank0_peak_rss_mib"] < before + 512, (memory, before)
    assert memory["memory/rank0_peak_setup_rss_mib"] < before + 512, (memory, before)


def test_a_peak_that_cannot_be_reset_says_it_is_the_processes(monkeypatch):
    """Where the kernel's peak cannot be reset (not Linux), a later job's line says whose peak it is."""
    from runs import tracking

    monkeypatch.setitem(tracking._PEAK, "jobs", 2)
    monkeypatch.setitem(tracking._PEAK, "reset", False)
    line = tracking.format_peak_memory({"rss": [812.0], "setup_rss": [600.0]})
    assert line.startswith("Peak memory (this process's, over the earlier jobs of this multirun too")
    monkeypatch.setitem(tracking._PEAK, "reset", True)
    assert tracking.format_peak_memory({"rss": [812.0], "setup_rss": [600.0]}) == (
        "Peak memory: 812 MiB resident (600 MiB by the end of model loading)."
    )


STOP_IN_SETUP = """
import os, runpy, signal, sys
import trainers
init = trainers.BasicTrainer.__init__
stop = getattr(signal, sys.argv[1])
def stopped_here(self, *args, **kwargs):  # the run folder is made; the training loop not yet started
    os.kill(os.getpid(), stop)
    init(self, *args, **kwargs)
trainers.BasicTrainer.__init__ = stopped_here
sys.argv = ["train.py", *sys.argv[2:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_stop_during_setup_is_one_sentence_and_leaves_no_run_folder(tmp_path, name):
    """SIGTERM or SIGUSR1 (SLURM's warning) after the run folder is made but before the loop's
    handlers: before, the process died without a word (exit -15 / -10) leaving config.yaml and
    .lock; now one sentence, the exit code 128 + the signal, and no folder."""
    args = one_run([*TINY, f"output_root={tmp_path}"])
    result = subprocess.run(
        [sys.executable, "-c", STOP_IN_SETUP, name, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    signum = getattr(signal, name)
    assert result.returncode == 128 + signum, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("Stopped by")]
    assert len(lines) == 1 and lines[0].startswith(f"Stopped by {name} during setup, before the first training step")
    assert "nothing was trained and its run folder" in lines[0] and lines[0].endswith("run the same command again to start.")
    assert list(tmp_path.iterdir()) == []


def test_a_stop_while_resuming_keeps_the_folder_and_names_the_resume_command(tmp_path):
    """A resumed run stopped during setup keeps its folder (its checkpoints) and says how to continue."""
    from runs import setup

    run_dir = tmp_path / "run"
    (run_dir / "step-8").mkdir(parents=True)
    (run_dir / "LATEST").symlink_to("step-8")
    error = setup.StoppedDuringSetup(signal.SIGTERM)
    message = setup.stopped_during_setup(error, None, str(run_dir))
    assert message == (
        "Stopped by SIGTERM during setup, before the first training step: nothing was trained since its "
        f"checkpoint; continue with: python train.py resume={run_dir}"
    )
    assert (run_dir / "step-8").is_dir()
    made = tmp_path / "made"
    (made / "step-8").mkdir(parents=True)
    (made / "step-8" / "policy.pt").write_bytes(b"x")
    (made / "step-8" / "trainer_state.pt").write_bytes(b"x")
    assert "was removed" not in setup.stopped_during_setup(error, str(made), None)  # a checkpoint: kept
    assert made.is_dir()


def test_a_stop_after_setup_is_the_trainers(tmp_path, monkeypatch):
    """Once setup is done the trainer's handler takes the signal (a checkpoint after the step under
    way), with no moment between without a handler: a SIGTERM just before the loop saves a checkpoint."""
    import train
    import trainers

    train_loop = trainers.BasicTrainer.train

    def stopped_before_the_loop(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return train_loop(self)

    monkeypatch.setattr(trainers.BasicTrainer, "train", stopped_before_the_loop)
    run_dir, stop = train.main(compose_config([*TINY, f"output_root={tmp_path}"]))
    assert stop == signal.SIGTERM
    assert (Path(run_dir) / "LATEST" / "policy.pt").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


# ----------------------------------------------------------------------------- RULES rows on what names and counts a run (issue 34)


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "n_examples=0",
            "n_examples must be a whole number of examples >= 1, or null to train n_epochs, got 0; e.g. n_examples=1000.",
        ),
        (
            "n_examples=-5",
            "n_examples must be a whole number of examples >= 1, or null to train n_epochs, got -5; e.g. n_examples=1000.",
        ),
        (
            "sft_first.n_examples=0",
            "sft_first.n_examples must be a whole number of examples >= 1, or null for no SFT stage, got 0.",
        ),
        ("seed=-1", "seed must be a whole number from 0 to 4294967295 (NumPy's range), got -1; e.g. seed=0."),
        ("seed=4294967296", "seed must be a whole number from 0 to 4294967295 (NumPy's range), got 4294967296; e.g. seed=0."),
        (
            "exp_name=../../x",
            "exp_name='../../x' is not a run name: use letters, digits, '_', '-' and '.' (not first), so that the run folder "
            "is one folder inside output_root that resume=auto finds again; e.g. exp_name=x.",
        ),
        (
            "exp_name=sweep/a",
            "exp_name='sweep/a' is not a run name: use letters, digits, '_', '-' and '.' (not first), so that the run folder "
            "is one folder inside output_root that resume=auto finds again; e.g. exp_name=sweep_a.",
        ),
    ],
)
def test_a_run_name_length_or_seed_out_of_range_is_one_sentence(override, message):
    import utils
    from runs import checks

    with pytest.raises(utils.ConfigError) as e:
        checks.validate_config(compose_config([override]))
    assert str(e.value) == message


@pytest.mark.parametrize("override", ["exp_name=dpo_nll0.2", "exp_name=rm_lr1e-3", "seed=4294967295", "n_examples=1"])
def test_the_run_names_and_values_the_docs_use_pass(override):
    from runs import checks

    checks.validate_config(compose_config([override]))


def test_output_root_that_is_a_file_or_inside_one_is_one_sentence(tmp_path):
    import utils
    from runs import checks

    afile = tmp_path / "notes.txt"
    afile.write_text("mine\n")
    for root, where in ((afile, "is a file"), (afile / "runs", f"lies inside the file {afile}")):
        with pytest.raises(utils.ConfigError) as e:
            checks.validate_config(compose_config([f"output_root={root}"]))
        assert (
            str(e.value)
            == f"output_root={root} {where}, not a folder; give a folder for the run folders (made if absent), e.g. output_root=outputs."
        )
    checks.validate_config(compose_config([f"output_root={tmp_path / 'new' / 'runs'}"]))  # made when the run starts
    assert afile.read_text() == "mine\n"


def test_n_examples_0_on_the_command_line_exits_2_with_one_sentence_and_writes_nothing(tmp_path):
    args = [a for a in one_run(TINY) if not a.startswith("n_examples=")]
    done = subprocess.run(
        [sys.executable, "train.py", *args, "n_examples=0", f"output_root={tmp_path / 'out'}"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("Error:")] == [
        "Error: n_examples must be a whole number of examples >= 1, or null to train n_epochs, got 0; e.g. n_examples=1000."
    ]
    assert not (tmp_path / "out").exists()
