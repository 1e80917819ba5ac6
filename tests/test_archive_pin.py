"""model.archive: a run keeps the file it started from (through LATEST, which moves), resume and evaluate.py check it;
an archive into a model whose settings compute otherwise is refused."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config, run_train

import train
import utils
from evaluation import sampling
from modeling import loading, models
from runs import checkpoints, checks, setup

FAST = ["num_threads=1", "sample_during_eval=false", "save_hf_export=false"]


def save_step(run: Path, step: int, seed: int) -> Path:
    """A checkpoint ``step-<step>`` of run folder ``run`` holding a tiny random model (``seed``), LATEST on it."""
    config = compose_config(TINY)
    model = models.load_model(config.model, models.load_tokenizer(config.model), None, seed)
    write = lambda folder: torch.save({"step_idx": step, "state": model.state_dict()}, Path(folder, "policy.pt"))  # noqa: E731
    return Path(checkpoints.save_checkpoint_dir(str(run), f"step-{step}", write))


def sft_run(root: Path, overrides: tuple = ()) -> Path:
    """A run folder as an SFT run of the tiny model leaves it (config.yaml, step-8, LATEST), without training."""
    run = root / "sft"
    run.mkdir(parents=True)
    checkpoints.save_run_config(compose_config([*TINY, "loss=sft", *overrides]), str(run / "config.yaml"))
    save_step(run, 8, seed=1)
    return run


def resume(run: Path, overrides: list[str], attach=None):
    """What ``python train.py resume=<run> <overrides>`` does (hydra_main's steps), in-process."""
    args = [f"resume={run}", *overrides]
    config = compose_config([*TINY, *args])
    given = checks.given_keys(args)
    checks.settle_given(config, given)
    return train.main(config, attach=attach, budget=setup.budget_given(config, given))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_run_keeps_its_archive_through_latest_and_resume_and_evaluate_refuse_when_it_changed(tmp_path):
    sft = sft_run(tmp_path)
    given = f"{sft}/LATEST/policy.pt"
    dpo = run_train([*FAST, "n_examples=16", "eval_every=8", f"model.archive={given}"], tmp_path / "out")
    step8 = sft / "step-8" / "policy.pt"
    pin = json.loads((dpo / checkpoints.ARCHIVE_PIN).read_text())
    assert pin == {"archive": given, "path": str(step8), "bytes": step8.stat().st_size, "sha256": sha256(step8)}
    assert checkpoints.load_run_config(str(dpo / "config.yaml")).model.archive == given  # config.yaml: as asked

    # the SFT run is extended (resume=<sft> n_examples=<more>): LATEST moves on to other weights
    save_step(sft, 16, seed=2)
    seen = {}
    _, stop = resume(dpo, [*FAST, "n_examples=24"], attach=lambda trainer: seen.update(trainer.reference_model.state_dict()))
    assert stop is None
    step8_state = torch.load(step8, weights_only=True)["state"]
    step16_state = torch.load(sft / "step-16" / "policy.pt", weights_only=True)["state"]
    assert seen.keys() == step8_state.keys()
    assert all(torch.equal(seen[k], step8_state[k]) for k in seen)  # the reference it started with, not LATEST's
    assert not torch.equal(step16_state["lm_head.weight"], step8_state["lm_head.weight"])

    # step-8's file is rewritten (same name, other weights): resume and evaluate.py say so
    torch.save({"step_idx": 8, "state": step16_state}, step8)
    what = (
        f"{dpo} started from model.archive={given}, which was then {step8} (step-8, sha256 {pin['sha256'][:12]}, "
        f"recorded in archive.json), and that file holds other bytes now (another sha256); "
    )
    with pytest.raises(utils.ConfigError) as err:
        resume(dpo, [*FAST, "n_examples=32"])
    assert str(err.value) == what + (
        "restore that file to resume this run against the reference it trained with, or start a new run to train "
        "against the file there now."
    )
    policy = sampling.resolve_source(str(dpo), compose_config(TINY))
    with pytest.raises(utils.ConfigError) as err:
        sampling.reference_source(policy)
    assert str(err.value) == what + (
        "restore that file, or give the model you mean as baseline=<its checkpoint> (reference=<it> for the KL)."
    )
    step8.unlink()
    with pytest.raises(utils.ConfigError, match=r"\(step-8, sha256 \w{12}, recorded in archive\.json\), and that file is gone;"):
        resume(dpo, [*FAST, "n_examples=32"])


def test_an_archive_pin_names_the_step_latest_pointed_at(tmp_path):
    sft = sft_run(tmp_path)
    pin = checkpoints.archive_pin(f"{sft}/LATEST/policy.pt")
    file = sft / "step-8" / "policy.pt"
    assert pin["path"] == str(file) and pin["sha256"] == sha256(file) and pin["bytes"] == file.stat().st_size
    (tmp_path / "run").mkdir()
    checkpoints.write_archive_pin(str(tmp_path / "run"), pin)
    save_step(sft, 16, seed=2)  # LATEST moves on
    assert checkpoints.pinned_archive(str(tmp_path / "run"), f"{sft}/LATEST/policy.pt") == str(file)
    checkpoints.check_archive_pin(str(tmp_path / "run"), "fix it")  # step-8 unchanged: no word
    assert checkpoints.pinned_archive(str(tmp_path / "old"), "x/LATEST/policy.pt") == "x/LATEST/policy.pt"  # made before pins


def tiny_with(*overrides: str):
    return compose_config([*TINY, *FAST, *overrides])


@pytest.mark.parametrize(
    "overrides, theirs, ours",
    [
        (
            ["model.config.num_attention_heads=2", "model.config.num_key_value_heads=2"],  # the same shapes
            "head_dim=16, num_attention_heads=4, num_key_value_heads=4",
            "head_dim=32, num_attention_heads=2, num_key_value_heads=2",
        ),
        (["+model.config.hidden_act=gelu"], "hidden_act=silu", "hidden_act=gelu"),
    ],
)
def test_an_archive_into_a_model_that_computes_otherwise_is_refused(tmp_path, overrides, theirs, ours):
    sft = sft_run(tmp_path)
    config = tiny_with(f"model.archive={sft}/step-8/policy.pt", *overrides)
    with pytest.raises(utils.ConfigError) as err:
        loading.load_models(config, models.load_tokenizer(config.model), 0, False)
    assert str(err.value) == (
        f"model.archive={sft}/step-8/policy.pt holds the weights of a model with {theirs} ({sft}/config.yaml), and this "
        f"run builds one with {ours}, in which the same weights compute something else; give this run the archive's "
        "model settings, or the policy.pt of a run of this model."
    )


def test_an_archive_into_a_model_with_harmless_differences_loads_with_a_note(tmp_path, capsys):
    sft = sft_run(tmp_path)
    archive = f"{sft}/step-8/policy.pt"
    config = tiny_with(f"model.archive={archive}", "model.config.max_position_embeddings=1024")
    policy, _ = loading.load_models(config, models.load_tokenizer(config.model), 0, False)
    assert f"Note: model.archive={archive} comes from a model with max_position_embeddings=512, and this run's has " \
        "max_position_embeddings=1024; the weights mean the same in both." in capsys.readouterr().out  # fmt: skip
    state = torch.load(archive, weights_only=True)["state"]
    assert all(torch.equal(policy.state_dict()[k], state[k]) for k in state)
    config = tiny_with(f"model.archive={archive}")
    loading.load_models(config, models.load_tokenizer(config.model), 0, False)
    assert "Note:" not in capsys.readouterr().out  # the same settings: no word
