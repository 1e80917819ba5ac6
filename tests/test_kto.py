"""KTO end to end (Ethayarajh et al. 2024; TRL's KTOTrainer): the mismatched pairs of its KL
reference point z0, unpaired rows {prompt, completion, label}, and the losses the trainer reaches.

Hand values: ByT5 ids are byte + 3, EOS is 1, padding 0, no BOS. Log-probs are computed here one
sequence at a time with a plain forward and log_softmax, independent of the trainer's packed
forward; the loss then follows from ``kto.kto_objective`` (Eq. 8) or, when policy and
reference are equal (step 0), from its formula: r = 0, z0 = 0, so a desirable completion loses
lambda_D * (1 - sigmoid(0)) = lambda_D / 2 and an undesirable one lambda_U / 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, compose_config, metric_records, run_train
from omegaconf import OmegaConf

import losses
import preference_datasets as pd
import trainers
import utils
from data import formats
from data.loading import flatten, load_examples
from data.report import DataReport, check_pairing
from losses import IGNORE_INDEX
from modeling import models
from objectives import kto
from runs import checks
from utils import DataError

EOS = 1


def ids(text: str) -> list[int]:
    """ByT5's ids of ``text``, worked out by hand: byte + 3."""
    return [b + 3 for b in text.encode()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PAIRED = [{"prompt": f"q{i}?", "chosen": f" yes{i}", "rejected": f" no{'o' * i}"} for i in range(6)]
UNPAIRED = [{"prompt": f"q{i}?", "completion": f" c{'c' * (i % 3)}{i}", "label": i in (0, 3, 5)} for i in range(8)]


def build(tmp_path: Path, rows: list[dict], *overrides: str) -> trainers.BasicTrainer:
    """A BasicTrainer for loss=kto on ``rows`` (train and eval), built as train.main builds it."""
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    config = compose_config(
        [
            *TINY,
            f"output_root={tmp_path}",
            "loss=kto",
            "datasets=[json]",
            f"data.json.path={{train: {f}, test: {f}}}",
            "sample_during_eval=false",
            "eval_batch_size=4",
            "n_eval_examples=4",
            *overrides,
        ]
    )
    OmegaConf.resolve(config)
    tokenizer = models.load_tokenizer(config.model)
    options = OmegaConf.to_container(config.data)
    tr, ev = (load_examples(["json"], split, options, False, silent=True) for split in ("train", "test"))
    policy = models.load_model(config.model, tokenizer, torch.float32, config.seed)
    reference = models.load_model(config.model, tokenizer, torch.float32, config.seed)
    (tmp_path / "run").mkdir(exist_ok=True)
    return trainers.BasicTrainer(policy, config, str(tmp_path / "run"), tokenizer, tr, ev, reference)


def first_batch(trainer: trainers.BasicTrainer, size: int) -> dict:
    c = trainer.config
    return next(
        pd.get_batch_iterator(trainer.train_examples, trainer.tokenizer, size, c.max_length, c.max_prompt_length, n_epochs=1)
    )


@torch.no_grad()
def logp(model, prompt: str, response: str) -> float:
    """log p(response + EOS | prompt), summed over the response tokens: one unpadded sequence."""
    p, r = ids(prompt), ids(response) + [EOS]
    logits = model(input_ids=torch.tensor([p + r])).logits[0].float()
    lp = logits.log_softmax(-1)
    return float(sum(lp[len(p) - 1 + k, t] for k, t in enumerate(r)))


def perturb(model, seed: int = 1, scale: float = 0.2) -> None:
    """Move ``model``'s weights away from the policy's, so that log-ratios and z0 are not 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


# ----------------------------------------------------------------------------- (a) the mismatched batch


def test_mismatched_rows_pair_each_prompt_with_the_next_examples_chosen_completion():
    from transformers import ByT5Tokenizer

    tok = ByT5Tokenizer()
    texts = [("p", " a", " z"), ("qq", " bb", " zz"), ("r", " c", " y")]
    elements = [pd.tokenize_element(p, c, r, "keep_end", tok, 64, 32) for p, c, r in texts]
    batch = pd.collate(elements, tok.pad_token_id)
    rows = kto.mismatched_pairs(batch, max_length=64)
    # (x_0, y_1), (x_1, y_2), (x_2, y_0), by hand: 'p'=115, 'q'=116, 'r'=117, ' '=35, 'a'=100, 'b'=101, 'c'=102
    want = [([115], [35, 101, 101, EOS]), ([116, 116], [35, 102, EOS]), ([117], [35, 100, EOS])]
    assert rows["input_ids"].tolist() == [p + r + [0] * (5 - len(p + r)) for p, r in want]
    assert rows["attention_mask"].tolist() == [[1] * len(p + r) + [0] * (5 - len(p + r)) for p, r in want]
    assert rows["labels"].tolist() == [[IGNORE_INDEX] * len(p) + r + [IGNORE_INDEX] * (5 - len(p + r)) for p, r in want]
    # max_length cuts a row at its end (TRL's KL sequences alike): (x_1, y_2) is 5 tokens
    assert kto.mismatched_pairs(batch, max_length=4)["input_ids"][1].tolist() == [116, 116, 35, 102]
    # B == 1: the prompt is paired with its own completion (TRL refuses such a batch size)
    one = kto.mismatched_pairs(pd.collate(elements[1:2], 0), 64)
    assert one["input_ids"].tolist() == [[116, 116, 35, 101, 101, EOS]]


def test_objective_inputs_kl_logps_are_the_mismatched_pairs_without_gradient(tmp_path):
    t = build(tmp_path, PAIRED, "batch_size=4")
    perturb(t.reference_model)
    batch = first_batch(t, 4)
    inputs = t.objective_inputs(batch)
    n = len(batch["prompt"])
    for side, model in (("policy", t.policy), ("reference", t.reference_model)):
        got = getattr(inputs, f"{side}_kl_logps")
        assert not got.requires_grad  # the KL term is detached
        want = [logp(model, batch["prompt"][i], batch["chosen"][(i + 1) % n]) for i in range(n)]
        assert got.tolist() == pytest.approx(want, abs=1e-4)
    assert inputs.policy_chosen_logps.requires_grad


# ----------------------------------------------------------------------------- (b) one training step by hand


@pytest.mark.parametrize("kind", ["paired", "unpaired"])
def test_one_kto_step_loss_equals_the_hand_value(tmp_path, kind):
    rows = PAIRED if kind == "paired" else UNPAIRED
    weights = ["loss.beta=0.5", "loss.desirable_weight=1.5", "loss.undesirable_weight=0.75"]
    t = build(tmp_path, rows, "batch_size=4", *weights)
    perturb(t.reference_model)
    batch = first_batch(t, 4)
    n = len(batch["prompt"])
    x, y = batch["prompt"], batch["chosen"]

    def both(prompt_idx, responses):
        return [torch.tensor([logp(m, x[i], r) for i, r in zip(prompt_idx, responses)]) for m in (t.policy, t.reference_model)]

    pc, rc = both(range(n), y)
    pk, rk = both(range(n), [y[(i + 1) % n] for i in range(n)])
    extra = {}
    if kind == "paired":
        extra["policy_rejected_logps"], extra["reference_rejected_logps"] = both(range(n), batch["rejected"])
    else:
        label_of = {r["prompt"]: r["label"] for r in rows}  # from the file: each prompt has one row
        extra["label"] = torch.tensor([label_of[p] for p in x])
    want, *_ = kto.kto_objective(pc, rc, pk, rk, beta=0.5, desirable_weight=1.5, undesirable_weight=0.75, **extra)
    z0 = float((pk - rk).mean())
    assert z0 > 0.05  # the reference point matters here

    metrics = t.train_step(batch)
    assert metrics["loss/train"] == pytest.approx(want.tolist(), abs=2e-5)
    assert metrics["kl/train"] == pytest.approx([z0] * n, abs=2e-5)


# ----------------------------------------------------------------------------- (c), (d): unpaired rows


def test_unpaired_rows_train_end_to_end_with_the_hand_loss_at_step_0(tmp_path):
    f = write_jsonl(tmp_path / "u.jsonl", UNPAIRED)
    run_dir = run_train(
        [
            "loss=kto",
            "loss.desirable_weight=2.0",
            "loss.undesirable_weight=0.5",
            "datasets=[json]",
            f"data.json.path={{train: {f}, test: {f}}}",
            "batch_size=8",
            "eval_batch_size=8",
            "n_eval_examples=8",
            "n_examples=16",
            "eval_every=16",
            "sample_during_eval=false",
        ],
        tmp_path,
    )
    records = metric_records(run_dir)
    # 3 desirable rows lose 2.0 / 2 each, 5 undesirable 0.5 / 2 each, over all 8 rows of the batch
    hand = (3 * 1.0 + 5 * 0.25) / 8
    assert records[0]["step"] == 0 and records[0]["loss/eval"] == pytest.approx(hand, abs=1e-6)
    first_train = next(r for r in records if "loss/train" in r)
    assert first_train["step"] == 8 and first_train["loss/train"] == pytest.approx(hand, abs=1e-6)
    assert records[0]["rewards_desirable/eval"] == 0 and records[0]["kl/eval"] == 0
    last_eval = [r for r in records if "loss/eval" in r][-1]
    assert last_eval["step"] == 16 and last_eval["loss/eval"] < hand  # it learns
    assert (run_dir / "LATEST" / "policy.pt").exists()


def test_a_paired_objective_on_unpaired_rows_is_one_sentence_and_exit_2(tmp_path):
    f = write_jsonl(tmp_path / "u.jsonl", UNPAIRED)
    out = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "loss=dpo",
            "sft_first.n_examples=null",
            "datasets=[json]",
            f"data.json.path={{train: {f}, test: {f}}}",
            f"output_root={out}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (
        f"Error: {f}, row 1 is an unpaired row {{prompt, completion, label}}, which loss=dpo cannot train on "
        "(it needs rows {prompt, chosen, rejected}); train with loss=kto, or give a file of paired rows.\n"
    )
    assert "Policy:" not in proc.stdout and not out.exists()


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"label": "yes"}, "row 2: field 'label' is \"yes\", not true or false"),
        ({"label": 1}, "row 2: field 'label' is 1, not true or false"),
        ({"completion": None}, "row 2: field 'completion' is missing or not a string"),
    ],
)
def test_a_malformed_unpaired_row_is_one_sentence_naming_file_and_row(tmp_path, bad, message):
    f = write_jsonl(tmp_path / "u.jsonl", [UNPAIRED[0], {**UNPAIRED[1], **bad}])
    with pytest.raises(DataError) as e:
        formats.get_json("train", DataReport(), path=str(f), holdout_fraction=0)
    assert str(e.value).startswith(f"{f}, {message}")
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")


def test_mixed_paired_and_unpaired_rows_are_refused_in_one_sentence(tmp_path):
    f = write_jsonl(tmp_path / "m.jsonl", [PAIRED[0], PAIRED[1], UNPAIRED[2]])
    with pytest.raises(DataError) as e:
        formats.get_json("train", DataReport(), path=str(f), holdout_fraction=0)
    assert str(e.value) == (
        f"{f}, row 3 is unpaired {{prompt, completion, label}} but row 1 is paired {{prompt, chosen, rejected}}; a file "
        "holds one kind: write each pair as two unpaired rows (chosen with label true, rejected with label false)."
    )
    # across datasets: unpaired examples with paired ones
    kto = losses.get_objective("kto")
    paired = {"prompt": "p", "chosen": " a", "rejected": " b", "truncation_mode": "keep_end"}
    with pytest.raises(DataError, match=r"^datasets=\[\.\.\.\] mixes unpaired rows \(d.jsonl, row 1\) with paired ones"):
        check_pairing([paired, {"prompt": "p", "chosen": " a", "label": True, "row": "d.jsonl, row 1"}], kto)


def test_unpaired_rows_become_examples_and_label_tensors(tmp_path):
    f = write_jsonl(tmp_path / "u.jsonl", [*UNPAIRED[:3], {"prompt": "q0?", "completion": " other", "label": False}])
    data = formats.get_json("train", DataReport(), path=str(f), holdout_fraction=0)
    assert data["q0?"]["pairs"] == [] and data["q0?"]["labels"] == [(0, True), (1, False)]
    examples = flatten("json", data, sft_mode=False)
    assert [(e["prompt"], e["chosen"], e["label"], e["row"]) for e in examples] == [
        ("q0?", " c0", True, f"{f}, row 1"),
        ("q0?", " other", False, f"{f}, row 4"),
        ("q1?", " cc1", False, f"{f}, row 2"),
        ("q2?", " ccc2", False, f"{f}, row 3"),
    ]
    from transformers import ByT5Tokenizer

    batch = next(pd.get_batch_iterator(examples, ByT5Tokenizer(), 4, 64, 32, shuffle=False, n_epochs=1))
    assert batch["label"].dtype == torch.bool and batch["label"].tolist() == [True, False, False, False]
    assert "rejected_input_ids" not in batch
    assert batch["chosen_input_ids"][1, :10].tolist() == ids("q0? other") + [EOS]


# ----------------------------------------------------------------------------- (e) FSDP, (f) precomputed reference


def test_kto_under_fsdp_ends_as_basic_trainer(tmp_path):
    # One prompt for every pair: the mismatched pairs (x, y_{i+1}) are then the micro-batch's own
    # chosen completions whichever way the batch is split, so z0 = the mean over the whole batch
    # both ways, and FSDP (2 ranks, 2 examples each, z0 averaged over ranks) must equal one process.
    from test_distributed import assert_same_run, finished_run

    rows = [{"prompt": "2+2=", "chosen": f" 4{'!' * i}", "rejected": f" {i + 5}"} for i in range(8)]
    f = write_jsonl(tmp_path / "one_prompt.jsonl", rows)
    common = [
        "loss=kto",
        "loss.beta=0.5",
        "sft_first.n_examples=null",
        "datasets=[json]",
        f"data.json.path={{train: {f}, test: {f}}}",
        "batch_size=4",
        "eval_batch_size=4",
        "n_eval_examples=8",
        "n_examples=24",
        "eval_every=8",
        "progress_bar=false",
        "minimum_log_interval_secs=0",
        "warmup_steps=0",
        "keep_checkpoints=0",
        "sample_during_eval=false",
    ]
    basic = finished_run(common, tmp_path / "basic")
    fsdp = finished_run([*common, "trainer=FSDPTrainer", "world_size=2"], tmp_path / "fsdp")
    assert_same_run(basic, fsdp)
    kl = [r["kl/eval"] for r in metric_records(fsdp) if "kl/eval" in r]
    assert kl[0] == 0 and max(kl) > 0.01  # z0 moved off 0, so the gathered estimate was tested


def test_precomputed_reference_with_kto_is_one_sentence():
    config = compose_config(["loss=kto", "precompute_ref_log_probs=true"])
    with pytest.raises(utils.ConfigError) as e:
        checks.validate_config(config)
    assert str(e.value) == (
        "loss=kto needs the reference's log-probs of each prompt paired with another example's completion, pairs that "
        "change with every shuffled batch, so precompute_ref_log_probs=true cannot cache them; set it false."
    )
