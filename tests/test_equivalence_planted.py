"""The equivalence matrix catches a bug of each kind users met in the peer projects (issue 37): each test plants one
in a cell's run alone and checks that the cell goes over its tolerance against the clean padded baseline."""

from __future__ import annotations

import contextlib

import pytest
import torch

import trainers
from evaluation import equivalence
from modeling import models, packing

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """objective -> its clean padded one-process run (the matrix's baseline)."""
    root = tmp_path_factory.mktemp("baselines")
    return {
        n: equivalence.run_in_process([*equivalence.BASE, f"loss={n}", f"output_root={root / n}"], False) for n in ("dpo", "ipo")
    }


def planted_cell(baselines, tmp_path, name: str, cell: str) -> equivalence.Result:
    """Cell ``cell`` of objective ``name`` run with what the test planted, compared with the clean baseline."""
    c = equivalence.CELLS[cell]
    overrides = equivalence.cell_overrides(name, c, tmp_path)
    if c.how == "lora":
        clean = equivalence.run_in_process(overrides, False, equivalence.separate_reference)
        return equivalence.compare(name, c, clean, equivalence.run_in_process(overrides, False))
    return equivalence.compare(name, c, baselines[name], equivalence.run_in_process(overrides, c.packed))


def test_a_packed_boundary_off_by_one_is_caught(baselines, tmp_path, monkeypatch):
    # open-instruct #1900's kind: each packed target read one position early
    targets = packing._targets
    monkeypatch.setattr(
        packing, "_targets", lambda labels, seq, column=lambda p: p: targets(labels, seq, lambda p: column(p) - 1)
    )
    result = planted_cell(baselines, tmp_path, "dpo", "packed")
    assert result.over and result.loss_diff > 100 * equivalence.ONE_PROCESS.loss, result.text()


def test_the_reference_taken_from_the_policy_is_caught(baselines, tmp_path, monkeypatch):
    # TRL #6443's kind: a LoRA run whose reference forward keeps the trained adapters on
    @contextlib.contextmanager
    def adapters_left_on(peft_model):
        yield peft_model

    monkeypatch.setattr(models, "adapters_off", adapters_left_on)
    result = planted_cell(baselines, tmp_path, "dpo", "lora")
    assert result.over and result.loss_diff > 100 * equivalence.ONE_PROCESS.loss, result.text()


def test_a_reduction_skipped_under_accumulation_is_caught(baselines, tmp_path, monkeypatch):
    # TRL #7245's kind: each micro-batch's loss divided by its own size, not the batch's, so 8 micro-batches sum 8 means
    metrics = trainers.BasicTrainer.get_batch_metrics

    def per_micro_batch(self, batch, n_batch_examples, n_batch_tokens, split):
        return metrics(self, batch, len(batch["prompt"]), n_batch_tokens, split)

    monkeypatch.setattr(trainers.BasicTrainer, "get_batch_metrics", per_micro_batch)
    result = planted_cell(baselines, tmp_path, "dpo", "accum 8x1")
    assert result.over and result.weight_diff > 100 * equivalence.SPLIT.weight, result.text()


def test_an_option_ignored_on_one_path_is_caught(baselines, tmp_path, monkeypatch):
    # TRL #6559's kind: the packed forward drops IPO's average_log_prob (per-token log-probs) and sums instead
    packed = trainers.packed_sequence_logps
    monkeypatch.setattr(
        trainers, "packed_sequence_logps", lambda model, batch, average, *a, **k: packed(model, batch, False, *a, **k)
    )
    result = planted_cell(baselines, tmp_path, "ipo", "packed")
    assert result.over and result.loss_diff > 100 * equivalence.ONE_PROCESS.loss, result.text()


def test_the_reversed_cell_is_the_rounding_floor(baselines, tmp_path):
    result = planted_cell(baselines, tmp_path, "dpo", "reversed")  # nothing planted: the same sums in another order
    assert result.loss_diff < equivalence.ONE_PROCESS.loss / 10 and result.weight_diff < equivalence.ONE_PROCESS.weight / 10


def test_reverse_batches_hands_the_step_each_batch_reversed():
    seen = []
    trainer = type("Stub", (), {"train_step": staticmethod(lambda batch: seen.append(batch) or {})})()
    equivalence.reverse_batches(trainer)
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    trainer.train_step({"prompt": ["a", "b", "c"], "chosen_input_ids": ids, "chosen_labels": ids, "width": 2})
    assert seen[0]["prompt"] == ["c", "b", "a"] and seen[0]["width"] == 2
    assert seen[0]["chosen_input_ids"].tolist() == [[5, 6], [3, 4], [1, 2]] == seen[0]["chosen_labels"].tolist()
