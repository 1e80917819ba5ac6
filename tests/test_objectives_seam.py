"""The objectives seam: every objective is one declaration in losses.py, and the rest of the
project reads the declarations (issue: objectives as an independent axis).

* docs/objectives.md's table is the declarations' table; each config/loss yaml has the declared keys.
* docs/objectives.md's "adding an objective" example, registered as written, trains under BasicTrainer
  with no other change, and its first held-out loss is the hand value (policy = reference at
  step 0, so the gap is 0 and the hinge is the margin, 0.5).
* The trainers, train.py, utils.py and ray_launcher.py name no objective.
* What a declaration does not ask for is not computed: no reference model for a
  reference-free objective.
* Objectives of each family train under 2-process FSDP as under BasicTrainer, with a
  precomputed reference where they use one, and resume exactly.
"""

from __future__ import annotations

import ast
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, SHARED, TINY, compose_config, metric_records, run_train
from omegaconf import OmegaConf, open_dict

import losses
import objectives
import train
import trainers
from modeling import loading

OBJECTIVES_DOC = (REPO / "docs" / "objectives.md").read_text()


def test_the_readme_table_is_the_declarations_table():
    block = re.search(
        r"<!-- objectives table: objectives.objectives_table\(\) -->\n(.*?)\n<!-- end of the objectives table -->",
        OBJECTIVES_DOC,
        re.S,
    )
    assert block is not None, "docs/objectives.md has no objectives table block"
    assert block.group(1) == objectives.objectives_table()
    assert len(block.group(1).splitlines()) == 2 + len(losses.OBJECTIVES)


@pytest.mark.parametrize("path", sorted((REPO / "config" / "loss").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_loss_yaml_has_exactly_the_declared_keys_and_defaults(path):
    config = OmegaConf.to_container(OmegaConf.load(path))
    decl = losses.get_objective(config.pop("name"))
    keys = decl.keys  # its declaration; loss=wpo's loss_type brings that loss's keys, with their defaults, through keys_for
    if path.stem == decl.name:  # a preset (mpo.yaml: loss=mix with MPO's weights) may set other values
        assert config == {k: spec.default for k, spec in keys.items()}
    assert set(config) == set(keys)
    losses.validate_loss_config({"name": decl.name, **config})


def readme_example() -> str:
    start = OBJECTIVES_DOC.index("**Adding an objective**")
    return re.search(r"```python\n(.*?)```", OBJECTIVES_DOC[start:], re.S).group(1)


@pytest.fixture
def readme_objective():
    namespace = {k: getattr(losses, k) for k in ("objective", "Key", "BETA", "NLL_WEIGHT")}
    namespace["torch"] = torch
    added = losses.OBJECTIVES.pop("my_loss", None)  # a user who followed the README has it in losses.py
    exec(readme_example(), namespace)
    try:
        yield losses.OBJECTIVES["my_loss"]
    finally:
        del losses.OBJECTIVES["my_loss"]
        if added is not None:
            losses.OBJECTIVES["my_loss"] = added


def test_the_readme_example_objective_trains_with_no_other_change(readme_objective, tmp_path):
    config = compose_config([*TINY, f"output_root={tmp_path}", "sample_during_eval=false"])
    with open_dict(config):
        config.loss = OmegaConf.create({"name": "my_loss", "beta": 0.1, "margin": 0.5, "nll_weight": 0.0})
    run_dir, _ = train.main(config)
    records = metric_records(Path(run_dir))
    first_eval = next(r for r in records if "loss/eval" in r)
    assert first_eval["step"] == 0
    assert first_eval["loss/eval"] == pytest.approx(0.5, abs=1e-6)  # relu(0.5 - 0): policy equals reference
    assert first_eval["rewards_eval/margins"] == pytest.approx(0.0, abs=1e-6)
    assert any("loss/train" in r for r in records)
    with pytest.raises(losses.ObjectiveConfigError, match=r"^loss.margin must be >= 0 for loss=my_loss, got -1.$"):
        losses.validate_loss_config({"name": "my_loss", "margin": -1})
    # a value its check cannot compare is the same sentence, not the check's TypeError (seen by a new user)
    with pytest.raises(losses.ObjectiveConfigError, match=r"^loss.margin must be >= 0 for loss=my_loss, got abc.$"):
        losses.validate_loss_config({"name": "my_loss", "margin": "abc"})
    # the docs' yaml for it holds the declared keys and defaults
    start = OBJECTIVES_DOC.index("**Adding an objective**")
    yaml = OmegaConf.create(re.search(r"```yaml\n(.*?)```", OBJECTIVES_DOC[start:], re.S).group(1))
    assert dict(yaml) == {"name": "my_loss", **{k: spec.default for k, spec in readme_objective.keys.items()}}


OBJECTIVE_NAMES = set(losses.OBJECTIVES) - {"mix"}  # "mix" is also an English word in comments


@pytest.mark.parametrize(
    "module",
    [
        "trainers.py",
        "train.py",
        "utils.py",
        "modeling/models.py",
        "runs/checkpoints.py",
        "runs/tracking.py",
        "runs/checks.py",
        "parallel/ray_launcher.py",
        "online/trainer.py",
        "modeling/packing.py",
    ],
)
def test_the_loop_and_the_launchers_name_no_objective(module):
    tree = ast.parse((REPO / module).read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and ast.get_docstring(node):
            docstrings.add(id(node.body[0].value))
    named = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
        and node.value in OBJECTIVE_NAMES
    ]  # fmt: skip
    assert named == [], f"{module} tests for objective names {named}; read the declaration instead"


def test_no_import_circles_among_the_modules():
    script = SHARED / "scripts" / "import-circles.py"
    if not script.exists():
        pytest.skip(f"{script} is absent (the ../shared folder beside the repository)")
    proc = subprocess.run([sys.executable, str(script), str(REPO)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_a_reference_free_objective_loads_and_runs_no_reference(tmp_path, monkeypatch):
    def refuse(self, batch):
        raise AssertionError("a reference forward for a reference-free objective")

    monkeypatch.setattr(trainers.BasicTrainer, "reference_logps", refuse)
    seen = []
    real = loading.load_models
    monkeypatch.setattr(loading, "load_models", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    for name in ("simpo", "orpo", "cpo"):
        run_train([f"loss={name}", "sample_during_eval=false", "n_examples=16"], tmp_path / name)
    assert [reference for _, reference in seen] == [None, None, None]


# ----------------------------------------------------------------------------- under FSDP

COMMON = [*TINY, "sample_during_eval=false", "keep_checkpoints=0"]
FAMILIES = {
    "pairwise_mix": ["loss=mpo"],  # dpo + bco_pair + nll, with a live reference
    "reference_free": ["loss=simpo"],
    "pairwise_mix_precomputed_reference": ["loss=mpo", "precompute_ref_log_probs=true"],  # the mix's reference from the cache
}


def cli(args: list[str], out: Path, timeout: int = 300) -> Path | None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "train.py", *args, f"output_root={out}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return next((p for p in out.iterdir() if p.is_dir()), None) if out.exists() else None  # resume= writes in place


def policy(run_dir: Path, step: str = "LATEST") -> dict:
    return torch.load(run_dir / step / "policy.pt", weights_only=False)["state"]


@pytest.mark.parametrize(
    ("family", "trainer"),
    [
        ("pairwise_mix_precomputed_reference", "FSDPTrainer"),
        ("reference_free", "FSDPTrainer"),
        ("pairwise_mix", "TensorParallelTrainer"),  # (a live reference under FSDP: test_distributed.py)
    ],
)
def test_each_family_trains_sharded_as_under_basic_and_resumes_exactly(family, trainer, tmp_path):
    extra = [*FAMILIES[family], f"cache_dir={tmp_path / 'cache'}"]
    basic = run_train([*COMMON[len(TINY) :], *extra], tmp_path / "basic")
    sharded = cli([*COMMON, *extra, f"trainer={trainer}", "world_size=2"], tmp_path / "sharded")
    eb = [r for r in metric_records(basic) if "loss/eval" in r]
    es = [r for r in metric_records(sharded) if "loss/eval" in r]
    assert [r["step"] for r in es] == [r["step"] for r in eb] == [0, 24, 48]
    for rb, rs in zip(eb, es):
        for key in ("loss/eval", "rewards_eval/margins", "logps_eval/chosen"):
            assert rs[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-5), key
    for name, value in policy(basic).items():
        torch.testing.assert_close(policy(sharded)[name], value, rtol=1e-4, atol=5e-5, msg=name)
    cut = tmp_path / "cut" / sharded.name  # cut back to its step-24 shards, resumed
    shutil.copytree(sharded, cut, symlinks=True)
    shutil.rmtree(cut / "step-48")
    (cut / "LATEST").unlink()
    (cut / "LATEST").symlink_to("step-24")
    cli([f"resume={cut}"], tmp_path / "unused")
    for name, value in policy(sharded).items():
        torch.testing.assert_close(policy(cut)[name], value, rtol=0, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- the batch loss


def hand_logps(model, batch: dict, side: str) -> tuple[list[float], list[int]]:
    """Summed log-probs of each row's labelled tokens and their counts, by a plain padded forward."""
    ids, mask, labels = (batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels"))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.double(), -1)
    sums, counts = [], []
    for row in range(ids.shape[0]):
        total, n = 0.0, 0
        for t in range(1, ids.shape[1]):
            if labels[row, t] != -100:
                total += float(logprobs[row, t - 1, labels[row, t]])
                n += 1
        sums.append(total)
        counts.append(n)
    return sums, counts


@pytest.mark.parametrize("loss", ["sft", "dpo"])
def test_the_batch_loss_is_a_mean_per_token_for_sft_and_per_pair_otherwise(loss, tmp_path):
    from test_metrics import build

    trainer = build(tmp_path, [f"loss={loss}"])
    batch = trainer.eval_batches[0]
    n_tokens = float((batch["chosen_labels"] != -100).sum())
    value, _ = trainer.get_batch_metrics(batch, len(batch["prompt"]), n_tokens, "train")
    chosen, counts = hand_logps(trainer.policy, batch, "chosen")
    if loss == "sft":
        expected = -sum(chosen) / sum(counts)  # NLL per target token over the whole batch
    else:  # policy = reference at the start: every pair's loss is log 2, their mean too
        expected = math.log(2)
    assert float(value) == pytest.approx(expected, rel=1e-5)


def test_a_split_batch_of_an_objective_that_couples_its_pairs_is_noted():
    # A new user's trial: loss=aot gradient_accumulation_steps=4 ran silently, though aot sorts over each micro-batch.
    from conftest import compose_config

    from evaluation.equivalence import micro_batch_coupled
    from runs import checks

    assert set(micro_batch_coupled()) == {"aot", "aot_unpaired", "kto"}  # the matrix's declared differences, by hand
    note = checks.micro_batch_note(compose_config(["loss=aot", "batch_size=32", "gradient_accumulation_steps=4"]))
    assert note == (
        "Note: loss=aot sorts the margins over each rank's micro-batch, so its numbers depend on that micro-batch's size "
        "(8 pairs: batch_size / (gradient_accumulation_steps x data-parallel ranks)); compare its runs at the same size."
    )  # 32 / 4 = 8
    assert "loss=kto takes its reference point z0" in checks.micro_batch_note(
        compose_config(["loss=kto", "gradient_accumulation_steps=2"])
    )
    one = checks.micro_batch_note(compose_config(["loss=aot", "batch_size=8", "gradient_accumulation_steps=8"]))
    assert "size (1 pair: batch_size" in one  # 8 / 8 = 1: singular (the matrix's log read "1 pairs")
    assert checks.micro_batch_note(compose_config(["loss=aot"])) is None  # one micro-batch: nothing split
    assert checks.micro_batch_note(compose_config(["loss=dpo", "gradient_accumulation_steps=4"])) is None  # a per-pair sum
