"""Online DPO (Guo et al. 2024) and Bradley-Terry reward-model training (loss=reward).

Expected values are worked out by hand in the comments, or from the papers' formulas.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config
from omegaconf import OmegaConf

import losses
import rewards
import train
import trainers
import utils

# ----------------------------------------------------------------------------- small pieces


def test_beta_schedule_one_value_per_epoch_last_repeats():
    assert trainers.beta_for_epoch(0.1, 7) == 0.1
    schedule = OmegaConf.create({"beta": [0.5, 0.2, 0.1]}).beta  # as Hydra gives it: a ListConfig
    assert [trainers.beta_for_epoch(schedule, e) for e in range(5)] == [0.5, 0.2, 0.1, 0.1, 0.1]


def test_beta_list_is_validated():
    for bad in ("[0.1,-1]", "[]"):
        config = compose_config(["loss=dpo", f"loss.beta={bad}"])
        with pytest.raises(utils.ConfigError, match="loss.beta must be > 0"):
            utils.validate_config(config)


def test_completion_mask_stops_after_the_first_eos():
    eos = 1
    completions = torch.tensor([[3, 1, 0, 0], [3, 4, 5, 6], [1, 1, 1, 1], [4, 1, 5, 1]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(trainers.completion_mask(completions, eos), expected)


class FixedScorer:
    """Scores each completion by a table lookup (a stand-in reward model)."""

    def __init__(self, table: dict[str, float]):
        self.table = table
        self.calls = []

    def score(self, prompts, completions):
        self.calls.append((list(prompts), list(completions)))
        return torch.tensor([self.table[c] for c in completions])


class FixedJudge:
    def __init__(self, answers):
        self.answers = answers

    def judge(self, prompts, pairs):
        return list(self.answers)


def test_label_pairs_with_scores_ties_and_the_missing_eos_penalty():
    eos = 1
    texts = ["a", "b", "c", "d", "e", "f", "g", "h"]
    scorer = FixedScorer({"a": 2.0, "b": 1.0, "c": 1.0, "d": 3.0, "e": 1.5, "f": 1.5, "g": 2.0, "h": 1.5})
    # Completion g has no EOS: 2.0 - penalty 1.0 = 1.0 < 1.5, so h wins pair 3. All others end with EOS.
    completions = torch.tensor([[5, 1]] * 6 + [[5, 5], [5, 1]])
    mask = trainers.completion_mask(completions, eos)
    preferences, scores = trainers.label_pairs(scorer, ["p0", "p1", "p2", "p3"], texts, completions, mask, eos, 1.0)
    assert preferences == [0, 1, rewards.TIE, 1]
    assert scores.tolist() == [[2.0, 1.0], [1.0, 3.0], [1.5, 1.5], [1.0, 1.5]]
    # Each prompt is scored with both of its completions (rows 2i and 2i+1).
    assert scorer.calls[0][0] == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]


def test_label_pairs_with_a_judge_passes_failures_and_ties_through():
    completions = torch.tensor([[5, 1]] * 6)
    mask = trainers.completion_mask(completions, 1)
    judge = FixedJudge([1, None, rewards.TIE])
    preferences, scores = trainers.label_pairs(judge, ["p", "q", "r"], list("abcdef"), completions, mask, 1, 5.0)
    assert preferences == [1, None, rewards.TIE] and scores is None


def test_completions_table_is_jsonl_and_escaped_html(tmp_path):
    trainers.write_completions(str(tmp_path), [{"step": 0, "prompt": "<b>hi</b>", "completion": "x & y", "score": 1.5}])
    trainers.write_completions(str(tmp_path), [{"step": 8, "prompt": "p", "completion": "z", "score": None}])
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 8]
    page = (tmp_path / "completions.html").read_text()
    assert "&lt;b&gt;hi&lt;/b&gt;" in page and "x &amp; y" in page and page.count("<tr>") == 3  # header + 2 rows


# ----------------------------------------------------------------------------- reward model


def test_bradley_terry_loss_by_hand():
    # -log sigmoid(d): d = 0 -> ln 2; d = 2 -> log(1 + e^-2); d = -1 -> log(1 + e).
    got = losses.bradley_terry_loss(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([0.0, 1.0, 2.0]))
    expected = torch.tensor([math.log(2), math.log1p(math.exp(-2)), math.log1p(math.e)])
    torch.testing.assert_close(got, expected)


def tiny_reward_model(pad_token_id: int):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=pad_token_id,
    )
    return LlamaForSequenceClassification(cfg).eval()


def test_last_token_scores_read_the_last_real_token_even_when_pad_is_eos():
    eos = pad = 2
    model = tiny_reward_model(pad)
    a = torch.tensor([[5, 6, 7, eos]])  # ends with EOS, which is also the pad token
    b = torch.tensor([[5, 8, eos, 0, 0, 0]])[:, :3]
    batch = torch.tensor([[5, 6, 7, eos], [5, 8, eos, pad]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad():
        alone_a = losses.last_token_scores(model, a, torch.ones_like(a))
        alone_b = losses.last_token_scores(model, b, torch.ones_like(b))
        both = losses.last_token_scores(model, batch, mask)
        # Independent reference: the head applied to the backbone's hidden state at the EOS position.
        hidden = model.model(input_ids=a).last_hidden_state[:, -1]
        by_hand = model.score(hidden)[:, 0]
    torch.testing.assert_close(both, torch.cat([alone_a, alone_b]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(alone_a, by_hand, rtol=1e-5, atol=1e-6)


def run(overrides: list[str], tmp_path: Path) -> Path:
    config = compose_config([*TINY, f"output_root={tmp_path}", *overrides])
    run_dir, stop_signal = train.main(config)
    assert stop_signal is None
    return Path(run_dir)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_reward_model_training_starts_at_ln2_learns_and_exports_a_loadable_scorer(tmp_path):
    from transformers import AutoModelForSequenceClassification

    run_dir = run(["loss=reward", "n_examples=320", "eval_every=160", "data.arithmetic.n_train=320"], tmp_path)
    evals = [r for r in records(run_dir) if "loss/eval" in r]
    assert evals[0]["loss/eval"] == pytest.approx(math.log(2), abs=0.02)  # a fresh head scores ~0 for all
    assert evals[-1]["scores_eval/accuracies"] > evals[0]["scores_eval/accuracies"]
    hf = run_dir / "LATEST" / "hf"
    model = AutoModelForSequenceClassification.from_pretrained(hf)
    assert model.config.num_labels == 1
    # The saved folder is what online DPO loads as reward_model.name_or_path.
    scorer = rewards.RewardModelScorer(str(hf))
    got = scorer.score(["2+3="], ["5"])
    assert got.shape == (1,) and torch.isfinite(got).all()


def test_reward_model_starts_from_an_sft_archive(tmp_path, capsys):
    sft = run(["loss=sft", "sample_during_eval=false"], tmp_path / "sft")
    archive = sft / "LATEST" / "policy.pt"
    run_dir = run(["loss=reward", f"model.archive={archive}", "n_examples=8", "do_first_eval=false"], tmp_path / "rm")
    state = torch.load(run_dir / "LATEST" / "policy.pt", weights_only=False)["state"]
    sft_state = torch.load(archive, weights_only=False)["state"]
    # The body came from the archive: one AdamW step at lr 1.5e-3 (warmup) moves each weight by at
    # most ~1.5e-3, while SFT's six steps moved it further than that from the random start.
    key = "model.layers.0.mlp.up_proj.weight"
    config = compose_config([*TINY])
    start = utils.load_model(config.model, utils.load_tokenizer(config.model), torch.float32, config.seed).state_dict()[key]
    assert (state[key] - sft_state[key]).abs().max() < 2e-3
    assert (sft_state[key] - start).abs().max() > 5e-3
    assert "score.weight" in state and "lm_head.weight" not in state


def test_reward_loss_refuses_tensor_parallel():
    config = compose_config(["loss=reward", "trainer=TensorParallelTrainer"])
    with pytest.raises(utils.ConfigError, match="loss=reward trains with BasicTrainer or FSDPTrainer"):
        utils.validate_config(config)
