"""TR-DPO reference updates (Gorbatovski et al. 2024): ``reference_update.mode=soft|hard``.

Expected weights are worked out from the paper's update rules on weights read independently
(the run's own checkpoints of the policy, and the starting model rebuilt from its seed):
soft  theta_ref <- alpha * theta + (1 - alpha) * theta_ref,  hard  theta_ref <- theta,
every ``reference_update.every`` optimizer steps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, TINY, compose_config, run_train

import trainers
import utils
from modeling import models
from objectives import tr_dpo
from parallel.dist import Dist
from runs import checks


def state(path: Path) -> dict:
    return torch.load(path, weights_only=False)["state"]


def start_weights(overrides: list[str]) -> dict:
    """The model the run starts from (policy and reference alike), rebuilt from the config's seed."""
    config = compose_config([*TINY, *overrides])
    tokenizer = models.load_tokenizer(config.model)
    return models.load_model(config.model, tokenizer, None, config.seed).state_dict()


def test_soft_and_hard_updates_follow_the_rules_on_each_parameter():
    policy, reference = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with torch.no_grad():
        policy.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        policy.bias.copy_(torch.tensor([8.0, -8.0]))
        reference.weight.copy_(torch.tensor([[5.0, 6.0], [7.0, 8.0]]))
        reference.bias.copy_(torch.tensor([0.0, 4.0]))
    trainer = SimpleNamespace(policy=policy, reference_model=reference, dist=Dist())
    tr_dpo.update_reference(trainer, "soft", 0.25)  # 0.25 * policy + 0.75 * reference
    assert reference.weight.tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert reference.bias.tolist() == [2.0, 1.0]
    assert not reference.weight.requires_grad or reference.weight.grad is None
    tr_dpo.update_reference(trainer, "hard", 0.25)  # alpha is ignored: a copy
    assert reference.weight.tolist() == [[1.0, 2.0], [3.0, 4.0]] and reference.bias.tolist() == [8.0, -8.0]


SOFT = ["reference_update.mode=soft", "reference_update.alpha=0.5", "reference_update.every=3", "sample_during_eval=false"]
# TINY: 48 examples in batches of 8 = 6 optimizer steps, checkpoints after 24 and 48 examples
# (steps 3 and 6); with every=3 the reference is updated after steps 3 and 6.


@pytest.fixture(scope="module")
def soft_run(tmp_path_factory):
    return run_train(SOFT, tmp_path_factory.mktemp("soft"))


def test_soft_updates_every_tau_steps_mix_the_policy_into_the_reference(soft_run):
    theta0 = start_weights(SOFT)
    theta3, theta6 = state(soft_run / "step-24" / "policy.pt"), state(soft_run / "step-48" / "policy.pt")
    ref3, ref6 = state(soft_run / "step-24" / "reference.pt"), state(soft_run / "step-48" / "reference.pt")
    assert set(ref6) == set(theta6)
    moved = 0
    for name in theta6:
        expected3 = 0.5 * theta3[name] + 0.5 * theta0[name]
        torch.testing.assert_close(ref3[name], expected3, rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(ref6[name], 0.5 * theta6[name] + 0.5 * expected3, rtol=0, atol=1e-6, msg=name)
        moved += int(not torch.equal(ref6[name], theta0[name]))
    assert moved > 0  # the policy did move, so the test can tell an update from none


def test_hard_update_every_step_keeps_the_reference_equal_to_the_policy(tmp_path):
    run_dir = run_train(["reference_update.mode=hard", "reference_update.every=1", "sample_during_eval=false"], tmp_path)
    policy, reference = state(run_dir / "LATEST" / "policy.pt"), state(run_dir / "LATEST" / "reference.pt")
    for name, value in policy.items():
        assert torch.equal(reference[name], value), name


def test_a_resumed_soft_run_continues_from_the_moved_reference_exactly(soft_run, tmp_path):
    cut = tmp_path / soft_run.name
    shutil.copytree(soft_run, cut, symlinks=True)
    shutil.rmtree(cut / "step-48")
    (cut / "LATEST").unlink()
    (cut / "LATEST").symlink_to("step-24")
    resumed = run_train([f"resume={cut}"], tmp_path / "unused")
    assert resumed == cut
    for name in ("policy.pt", "reference.pt"):
        full, again = state(soft_run / "LATEST" / name), state(cut / "LATEST" / name)
        for key, value in full.items():
            torch.testing.assert_close(again[key], value, rtol=0, atol=1e-6, msg=f"{name} {key}")


@pytest.mark.parametrize("trainer", ["FSDPTrainer", "TensorParallelTrainer"])
def test_sharded_soft_updates_match_the_single_process_run(soft_run, tmp_path, trainer):
    cmd = [sys.executable, "train.py", *TINY, *SOFT, f"trainer={trainer}", "world_size=2", f"output_root={tmp_path}"]
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    # the gathered policy equals the single-process one; the moved reference lives in the DCP shards
    for key, value in state(soft_run / "LATEST" / "policy.pt").items():
        torch.testing.assert_close(state(run_dir / "LATEST" / "policy.pt")[key], value, rtol=1e-4, atol=5e-5, msg=key)
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(run_dir / "LATEST" / "sharded")).read_metadata()
    reference_keys = {k for k in metadata.state_dict_metadata if k.startswith("reference.")}
    assert reference_keys, "the moved reference is in the sharded checkpoint"
    reference = {k.removeprefix("reference."): torch.empty(metadata.state_dict_metadata[k].size) for k in reference_keys}
    dcp.load({"reference": reference}, checkpoint_id=str(run_dir / "LATEST" / "sharded"), no_dist=True)
    for key, value in state(soft_run / "LATEST" / "reference.pt").items():
        torch.testing.assert_close(reference[key], value, rtol=1e-4, atol=5e-5, msg=key)


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        (["reference_update.mode=sometimes"], "reference_update.mode must be null or one of bema, hard, soft, got sometimes."),
        (["reference_update.mode=soft", "reference_update.alpha=0"], "reference_update.alpha must be in (0, 1]"),
        (["reference_update.mode=hard", "reference_update.every=0"], "reference_update.every must be a whole number"),
        (
            ["reference_update.mode=soft", "precompute_ref_log_probs=true"],
            "precomputed reference log-probs would go stale; set precompute_ref_log_probs=false.",
        ),
        (["reference_update.mode=soft", "loss=simpo"], "but loss=simpo uses none; remove it."),
        (["reference_update.mode=soft", "loss.reference_free=true"], "but loss=dpo uses none; remove it."),
    ],
)
def test_reference_update_mistakes_are_one_sentence_before_any_model_loads(overrides, sentence):
    config = compose_config([*TINY, *overrides])
    with pytest.raises(utils.ConfigError) as e:
        checks.validate_config(config)
    assert sentence in str(e.value)


def test_the_train_records_count_the_reference_updates(soft_run):
    from conftest import metric_records

    counts = [r["counters/reference_updates"] for r in metric_records(soft_run) if "counters/reference_updates" in r]
    assert counts and counts[-1] == 2.0  # 6 optimizer steps, an update after steps 3 and 6
    assert counts == sorted(counts)


def test_a_log_over_several_steps_keeps_the_count_not_its_mean():
    # regression (a new user): 4 updates in one 1-second log window were logged as 2.5, the mean of 1, 2, 3, 4
    logged = {}
    trainer = SimpleNamespace(
        example_counter=32, batch_counter=4, logger=SimpleNamespace(log=lambda means, step: logged.update(means))
    )
    pending = {"counters/reference_updates": [1.0, 2.0, 3.0, 4.0], "loss/train": [1.0, 3.0]}
    bar = SimpleNamespace(set_postfix=lambda _: None)
    trainers.BasicTrainer.log_train(trainer, pending, 32, 100, 1.0, bar)
    assert logged["counters/reference_updates"] == 4.0 and logged["loss/train"] == 2.0
