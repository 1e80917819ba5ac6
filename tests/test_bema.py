"""BEMA as the reference (Block & Zhang 2025, arXiv 2508.00180): ``reference_update=bema``.

Checked three ways: against TRL 1.16's ``BEMACallback(update_ref_model=True)`` step by step; by hand on one weight
from the paper's rule theta'_t = EMA_t + alpha_t (theta_t - theta_0); and on a training run, from the run's own
policy checkpoints and the starting model rebuilt from its seed, with a resumed run continuing exactly and two FSDP
ranks equal to one process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, TINY, compose_config, run_train
from omegaconf import OmegaConf

import utils
from modeling import models
from objectives.bema import BEMAUpdate
from parallel.dist import Dist
from runs import checks

DEFAULTS = OmegaConf.load(REPO / "config" / "reference_update" / "bema.yaml")


def trainer_for(policy, reference, **keys) -> SimpleNamespace:
    """What BEMAUpdate reads of a trainer: the policy, the reference and ``reference_update``'s keys."""
    update = OmegaConf.merge(DEFAULTS, keys)
    config = OmegaConf.create({"reference_update": update})
    return SimpleNamespace(policy=policy, reference_model=reference, config=config, dist=Dist())


def test_one_weight_follows_the_papers_rule_by_hand():
    policy, reference = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        policy.weight.fill_(1.0)  # theta_0
        reference.weight.fill_(1.0)
    keys = dict(update_freq=1, ref_model_update_freq=1, lag=1, multiplier=1.0, ema_power=1.0, bias_power=1.0)
    bema = BEMAUpdate(trainer_for(policy, reference, **keys))
    with torch.no_grad():
        policy.weight.fill_(2.0)  # theta_1
    assert bema.step(1) == {"counters/reference_updates": 1.0}
    # beta_1 = alpha_1 = (1 + 1)^-1 = 1/2: EMA = 1/2 * 1 + 1/2 * 2 = 1.5; theta' = 1.5 + 1/2 * (2 - 1) = 2
    assert reference.weight.item() == pytest.approx(2.0, abs=1e-7)
    with torch.no_grad():
        policy.weight.fill_(4.0)  # theta_2
    bema.step(2)
    # beta_2 = alpha_2 = 1/3: EMA = 2/3 * 1.5 + 1/3 * 4 = 7/3; theta' = 7/3 + 1/3 * (4 - 1) = 10/3
    assert reference.weight.item() == pytest.approx(10 / 3, abs=1e-6)
    assert not reference.weight.requires_grad or reference.weight.grad is None


@pytest.mark.parametrize(
    "keys",
    [
        dict(update_freq=2, ref_model_update_freq=3),
        dict(update_freq=1, ref_model_update_freq=2, update_after=3, ref_model_update_after=1),
        dict(update_freq=1, ref_model_update_freq=1, ema_power=0.0, bias_power=0.7, lag=3, multiplier=2.0),
        dict(update_freq=3, ref_model_update_freq=1, min_ema_multiplier=0.4),
    ],
)
def test_the_reference_equals_trls_bema_callback_at_every_step(keys):
    callbacks = pytest.importorskip("trl.experimental.bema_for_ref_model.callback")
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerControl, TrainerState

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    torch.manual_seed(0)
    policy = LlamaForCausalLM(config)
    ours, theirs = LlamaForCausalLM(config), LlamaForCausalLM(config)
    ours.load_state_dict(policy.state_dict())
    theirs.load_state_dict(policy.state_dict())
    names = {k: keys.get(k, DEFAULTS[k]) for k in DEFAULTS if k != "mode"}
    trl = callbacks.BEMACallback(update_ref_model=True, **names)
    trl.on_train_begin(None, TrainerState(), TrainerControl(), model=policy)
    bema = BEMAUpdate(trainer_for(policy, ours, **keys))
    moved = 0
    for step in range(1, 13):
        with torch.no_grad():  # an optimizer step
            for p in policy.parameters():
                p.add_(0.1 * torch.randn_like(p))
        trl.on_step_end(None, TrainerState(global_step=step), TrainerControl(), model=policy, ref_model=theirs)
        bema.step(step)
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"step {step} {name}")
        moved += int(not torch.equal(ours.model.norm.weight, policy.model.norm.weight))
    assert moved > 0  # the reference is neither the policy nor fixed, so the comparison can tell


BEMA = [
    "reference_update=bema",
    "reference_update.update_freq=3",
    "reference_update.ref_model_update_freq=3",
    "sample_during_eval=false",
]
# TINY: 6 optimizer steps, checkpoints after steps 3 and 6; BEMA and the reference update after steps 3 and 6.


def state(path) -> dict:
    return torch.load(path, weights_only=False)["state"]


@pytest.fixture(scope="module")
def bema_run(tmp_path_factory):
    return run_train(BEMA, tmp_path_factory.mktemp("bema"))


def test_a_run_moves_the_reference_as_the_paper_says_from_its_own_checkpoints(bema_run):
    config = compose_config([*TINY, *BEMA])
    tokenizer = models.load_tokenizer(config.model)
    theta0 = models.load_model(config.model, tokenizer, None, config.seed).state_dict()
    theta3, theta6 = state(bema_run / "step-24" / "policy.pt"), state(bema_run / "step-48" / "policy.pt")
    ref3, ref6 = state(bema_run / "step-24" / "reference.pt"), state(bema_run / "step-48" / "reference.pt")
    beta = {t: (10 + t) ** -0.5 for t in (3, 6)}  # the defaults: lag 10, multiplier 1, ema_power 0.5, bias_power 0.2
    alpha = {t: (10 + t) ** -0.2 for t in (3, 6)}
    for name in theta6:
        ema3 = (1 - beta[3]) * theta0[name] + beta[3] * theta3[name]
        torch.testing.assert_close(ref3[name], ema3 + alpha[3] * (theta3[name] - theta0[name]), rtol=0, atol=1e-6)
        ema6 = (1 - beta[6]) * ema3 + beta[6] * theta6[name]
        torch.testing.assert_close(ref6[name], ema6 + alpha[6] * (theta6[name] - theta0[name]), rtol=0, atol=1e-6)
    assert not torch.equal(ref6["lm_head.weight"], theta6["lm_head.weight"])
    saved = torch.load(bema_run / "step-48" / "reference.pt", weights_only=False)["update"]
    assert set(saved) == {"theta0", "ema", "running"}
    from conftest import metric_records

    counts = [r["counters/reference_updates"] for r in metric_records(bema_run) if "counters/reference_updates" in r]
    assert counts[-1] == 2.0


def test_a_resumed_bema_run_continues_exactly(bema_run, tmp_path):
    cut = tmp_path / bema_run.name
    shutil.copytree(bema_run, cut, symlinks=True)
    shutil.rmtree(cut / "step-48")
    (cut / "LATEST").unlink()
    (cut / "LATEST").symlink_to("step-24")
    assert run_train([f"resume={cut}"], tmp_path / "unused") == cut
    for name in ("policy.pt", "reference.pt"):
        full, again = state(bema_run / "LATEST" / name), state(cut / "LATEST" / name)
        for key, value in full.items():
            torch.testing.assert_close(again[key], value, rtol=0, atol=1e-6, msg=f"{name} {key}")


def test_two_fsdp_ranks_move_the_reference_as_one_process(bema_run, tmp_path):
    cmd = [sys.executable, "train.py", *TINY, *BEMA, "trainer=FSDPTrainer", "world_size=2", f"output_root={tmp_path}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
    import torch.distributed.checkpoint as dcp

    sharded = str(run_dir / "LATEST" / "sharded")
    metadata = dcp.FileSystemReader(sharded).read_metadata().state_dict_metadata
    reference = {k.removeprefix("reference."): torch.empty(metadata[k].size) for k in metadata if k.startswith("reference.")}
    prefix = "reference_update.running."
    running = {k.removeprefix(prefix): torch.empty(metadata[k].size) for k in metadata if k.startswith(prefix)}
    assert running, "BEMA's averages are in the sharded checkpoint"
    dcp.load({"reference": reference, "reference_update": {"running": running}}, checkpoint_id=sharded, no_dist=True)
    single = torch.load(bema_run / "LATEST" / "reference.pt", weights_only=False)["update"]["running"]
    for key, value in single.items():
        torch.testing.assert_close(running[key], value, rtol=1e-4, atol=5e-5, msg=key)
    for key, value in state(bema_run / "LATEST" / "reference.pt").items():
        torch.testing.assert_close(reference[key], value, rtol=1e-4, atol=5e-5, msg=key)


@pytest.mark.parametrize(
    ("overrides", "sentence"),
    [
        (["reference_update.mode=bema"], "reference_update.mode=bema needs its keys (update_freq, lag,"),
        (["reference_update=bema", "reference_update.update_freq=0"], "reference_update.update_freq must be a whole number"),
        (["reference_update=bema", "reference_update.ema_power=-1"], "reference_update.ema_power must be a number >= 0"),
        (["reference_update=bema", "reference_update.lag=0", "reference_update.multiplier=0"], "are both 0"),
        (["reference_update=bema", "model.lora.r=4"], "reference_update moves the reference, but with model.lora"),
        (["reference_update=bema", "loss=simpo"], "but loss=simpo uses none; remove it."),
        # regressions (a new user): another mode's key was added with + and silently never read
        (["reference_update.mode=soft", "+reference_update.update_freq=2"], "reference_update.update_freq is not a key of"),
        (["reference_update=bema", "+reference_update.alpha=0.5"], "reference_update.alpha is not a key of reference_update"),
        (["reference_update=bema", "reference_update.mode=soft"], "select them with reference_update=tr_dpo."),
    ],
)
def test_bema_mistakes_are_one_sentence_before_any_model_loads(overrides, sentence):
    config = compose_config([*TINY, *overrides])
    with pytest.raises(utils.ConfigError) as e:
        checks.validate_config(config)
    assert sentence in str(e.value)
