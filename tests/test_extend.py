"""Extending a run: ``python train.py resume=<run> n_examples=<more>`` (or ``n_epochs=``) continues
it from its LATEST checkpoint to the new length, as a fresh run of that length would have gone."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, compose_config, metric_records, run_train
from omegaconf import OmegaConf
from torch.optim.optimizer import register_optimizer_step_pre_hook

import train
import trainers
import utils
from runs import checkpoints, checks, setup

FAST = ["num_threads=1", "sample_during_eval=false", "save_hf_export=false"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Finished 48-example runs (TINY: 64 train examples, batches of 8, evals every 24): constant
    and cosine lr, and a fresh 96-example run of the constant one."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "constant": run_train([*FAST, "lr_scheduler=constant", "exp_name=constant"], root),
        "cosine": run_train([*FAST, "lr_scheduler=cosine", "exp_name=cosine"], root),
        "fresh96": run_train([*FAST, "lr_scheduler=constant", "exp_name=fresh", "n_examples=96"], root),
    }


def copy_run(run, tmp_path):
    """A copy of run folder ``run`` (symlinks kept), to extend without touching the shared one."""
    copy = tmp_path / run.name
    shutil.copytree(run, copy, symlinks=True)
    return copy


def extend(run, overrides: list[str]):
    """What ``python train.py resume=<run> <overrides>`` does (hydra_main's steps), in-process."""
    args = [f"resume={run}", *overrides]
    config = compose_config([*TINY, f"output_root={run.parent}", *args])
    given = checks.given_keys(args)
    checks.settle_given(config, given)
    budget = setup.budget_given(config, given)
    assert setup.resume_override_error(config, given) is None
    return train.main(config, budget=budget)


def weights(run) -> dict:
    return torch.load(run / "LATEST" / "policy.pt", weights_only=False)["state"]


def test_extending_equals_a_fresh_run_of_the_longer_length_bit_for_bit(finished, tmp_path, capsys):
    run = copy_run(finished["constant"], tmp_path)
    # the last checkpoint of the run (evals at 0, 24 and its end, 48) holds the next eval, at 72
    assert torch.load(run / "step-48" / "trainer_state.pt", weights_only=False)["next_eval_at"] == 72
    made_by = f"{checkpoints.RUN_COMMAND_LINE}python train.py n_examples=48\n"
    (run / "config.yaml").write_text(made_by + (run / "config.yaml").read_text())
    capsys.readouterr()
    _, stop = extend(run, ["n_examples=96"])
    out = capsys.readouterr().out
    assert stop is None
    assert (run / "config.yaml").read_text().startswith(made_by)  # the command that made the run is kept
    # 48 -> 96 crosses the epoch boundary at 64: the second epoch's order is epoch_order(64, seed, 1) in both
    fresh, extended = weights(finished["fresh96"]), weights(run)
    assert fresh.keys() == extended.keys() and all(torch.equal(fresh[k], extended[k]) for k in fresh)
    # the same evals (the one at 48, the short run's last, is not repeated), the same train steps
    eval_steps = [r["step"] for r in metric_records(run) if "loss/eval" in r]
    assert eval_steps == [r["step"] for r in metric_records(finished["fresh96"]) if "loss/eval" in r] == [0, 24, 48, 72, 96]
    assert out.count("[eval] after") == 2
    line = (
        f"Extending {run} from n_examples=48 (48 examples) to n_examples=96 (96 examples), continuing from step-48 "
        "after 48 examples."
    )
    # 48 examples in batches of 8: 6 steps taken, 12 in all; constant lr 3e-3 after 2 warmup steps
    schedule = (
        "lr_scheduler=constant: the schedule does not depend on the run's length, so it goes on unchanged "
        "(step 6 trains at lr 0.003, as in a fresh run of 12 steps)."
    )
    assert f"{line}\n{schedule}\n" in out
    assert OmegaConf.load(run / "config.yaml").n_examples == 96
    assert (run / "FINISHED").read_text() == "96\n"
    log = (run / setup.EXTENSIONS_LOG).read_text().splitlines()
    assert len(log) == 1 and log[0].endswith(f" {line} {schedule}")


def test_n_epochs_extends_and_a_cosine_schedule_is_stretched_over_the_new_total(finished, tmp_path, capsys, monkeypatch):
    run = copy_run(finished["cosine"], tmp_path)
    seen = {}
    original = trainers.BasicTrainer.train

    def train_watched(self):  # the folder as training starts: FINISHED gone, the new length saved
        seen["finished"] = (run / "FINISHED").exists()
        seen["config"] = OmegaConf.load(run / "config.yaml")
        return original(self)

    monkeypatch.setattr(trainers.BasicTrainer, "train", train_watched)
    stepped = []  # the lr each optimizer step of the extension actually used
    hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: stepped.append(optimizer.param_groups[0]["lr"]))
    capsys.readouterr()
    try:
        extend(run, ["n_epochs=2"])
    finally:
        hook.remove()
    out = capsys.readouterr().out
    assert seen["finished"] is False
    assert (seen["config"].n_examples, seen["config"].n_epochs) == (None, 2)
    assert "from n_examples=48 (48 examples) to n_epochs=2 (128 examples), continuing from step-48" in out
    # cosine after 2 warmup steps: lr * (1 + cos(pi * (step - 2) / (total - 2))) / 2
    old = 3e-3 * (1 + math.cos(math.pi * (5 - 2) / (6 - 2))) / 2  # the last step trained, step 5 of 6
    new = 3e-3 * (1 + math.cos(math.pi * (6 - 2) / (16 - 2))) / 2  # step 6 of 128 / 8 = 16
    assert (
        "lr_scheduler=cosine: the schedule is stretched over the new total of 16 steps (it was 6), as a fresh run of "
        f"that length has it, from step 6 (the lr jumps from {old:.3g} to {new:.3g})." in out
    )
    first = next(r for r in metric_records(run) if r["step"] == 56 and "lr" in r)  # step 6 trained examples 48..56
    assert first["lr"] == pytest.approx(new, rel=1e-9)
    assert stepped[0] == pytest.approx(new, rel=1e-9)  # not the old schedule's lr for step 6 (0: its decay had ended)
    assert (run / "FINISHED").read_text() == "128\n"


def test_a_length_not_beyond_what_was_trained_is_one_sentence_and_changes_nothing(finished, tmp_path):
    run = copy_run(finished["constant"], tmp_path)
    before = (run / "config.yaml").read_text()
    with pytest.raises(utils.ConfigError) as e:
        extend(run, ["n_examples=40"])
    assert str(e.value) == (
        f"resume={run} has trained 48 examples already, at or after n_examples=40 (40 examples); give a length of more "
        "than 48 examples to extend it."
    )
    assert (run / "config.yaml").read_text() == before and (run / "FINISHED").read_text() == "48\n"
    assert not (run / setup.EXTENSIONS_LOG).exists()


def test_other_keys_given_with_resume_are_still_refused(finished):
    run = finished["constant"]
    args = [f"resume={run}", "n_examples=96", "lr=1.0"]
    config = compose_config([*TINY, *args])
    problem = setup.resume_override_error(config, checks.given_keys(args))
    assert problem is not None and "changes lr (saved 0.003, given 1.0);" in problem and "n_examples" not in problem


def test_the_command_line_passes_the_new_length_on(finished, tmp_path):
    run = copy_run(finished["constant"], tmp_path)
    result = subprocess.run(
        [sys.executable, "train.py", f"resume={run}", "n_examples=40"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"Error: resume={run} has trained 48 examples already, at or after n_examples=40 (40 examples);" in result.stderr
