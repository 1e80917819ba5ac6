"""The logged metrics, checked value by value against numbers worked out by hand.

The policy's and the reference's log-probs (or a reward model's scores, or SFT's summed
log-probs) are fixed by replacing the trainer's forward passes with hand-chosen tensors, so
every logged value follows from the definitions alone:

- implicit reward r = beta * (log pi(y|x) - log ref(y|x)) (Rafailov et al. 2023, Eq. 5; the
  reference term is 0 for reference_free); margin = r_chosen - r_rejected; accuracy =
  1 if r_chosen > r_rejected, strictly, as in the reference repository (a tie is not accurate);
- DPO loss -log sigmoid(beta h), h = (pi_c - pi_r) - (ref_c - ref_r), i.e. log(1 + e^(-beta h));
  cDPO (eps) (1 - eps) log(1 + e^(-beta h)) + eps log(1 + e^(beta h)); IPO (h - 1 / (2 beta))^2;
- reward model: margin = s_chosen - s_rejected, loss log(1 + e^(-margin)).

beta = 0.5 throughout, so every reward below is an exact binary fraction.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config, metric_records
from omegaconf import OmegaConf

import trainers
from data.loading import load_examples
from data.prompts import load_prompt_examples
from modeling import models
from objectives import reward

BETA = 0.5
L = math.log1p  # log(1 + x)
E = math.exp

# Four pairs. Policy and reference log-probs (chosen, rejected):
POLICY = ([-1.0, -4.0, -3.0, -2.0], [-3.0, -1.0, -5.0, -6.0])
REFERENCE = ([-2.0, -2.0, -2.0, -2.0], [-2.0, -2.0, -4.0, -2.0])
# r_chosen = 0.5 * (pi_c - ref_c):   0.5 * (1, -2, -1, 0)   = (0.5, -1, -0.5, 0)
# r_rejected = 0.5 * (pi_r - ref_r): 0.5 * (-1, 1, -1, -4)  = (-0.5, 0.5, -0.5, -2)
# margins (r_c - r_r) = (1, -1.5, 0, 2) = beta * h, h = (2, -3, 0, 4); pair 2 is a tie.
CHOSEN_REWARDS = [0.5, -1.0, -0.5, 0.0]
REJECTED_REWARDS = [-0.5, 0.5, -0.5, -2.0]
MARGINS = [1.0, -1.5, 0.0, 2.0]
ACCURACIES = [1.0, 0.0, 0.0, 1.0]  # the tie (pair 2) is not accurate
LOSSES = {
    # log(1 + e^(-beta h)), beta h = (1, -1.5, 0, 2)
    "dpo": [L(E(-1)), L(E(1.5)), math.log(2), L(E(-2))],
    # eps = 0.25: 0.75 log(1 + e^(-beta h)) + 0.25 log(1 + e^(beta h))
    "cdpo": [
        0.75 * L(E(-1)) + 0.25 * L(E(1)),
        0.75 * L(E(1.5)) + 0.25 * L(E(-1.5)),
        math.log(2),
        0.75 * L(E(-2)) + 0.25 * L(E(2)),
    ],
    # (h - 1 / (2 * 0.5))^2 = (h - 1)^2, h = (2, -3, 0, 4)
    "ipo": [1.0, 16.0, 1.0, 9.0],
}
B = f"loss.beta={BETA}"
OVERRIDES = {"dpo": ["loss=dpo", B], "cdpo": ["loss=dpo", B, "loss.label_smoothing=0.25"], "ipo": ["loss=ipo", B]}


def build(tmp_path: Path, overrides: list[str], online: bool = False) -> trainers.BasicTrainer:
    """A BasicTrainer on the tiny config built as train.main builds it (eval: 2 batches of 4)."""
    small = ["n_eval_examples=8", "eval_batch_size=4", "sample_during_eval=false"]
    config = compose_config([*TINY, f"output_root={tmp_path}", *small, *overrides])
    OmegaConf.resolve(config)
    tokenizer = models.load_tokenizer(config.model)
    options = OmegaConf.to_container(config.data)
    name = config.loss.name
    if online:
        tr, ev = (load_prompt_examples(list(config.datasets), split, options, silent=True) for split in ("train", "test"))
    else:
        tr, ev = (load_examples(list(config.datasets), split, options, name == "sft", silent=True) for split in ("train", "test"))
    policy = models.load_model(config.model, tokenizer, torch.float32, config.seed, reward_head=name == "reward")
    reference = None if name in ("sft", "reward") else models.load_model(config.model, tokenizer, torch.float32, config.seed)
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    return trainers.trainer_class(config)(policy, config, str(tmp_path / "run"), tokenizer, tr, ev, reference)


def fix_logps(trainer, policy_batches, reference_batches=None, n_tokens=None):
    """Make the trainer's policy and reference forward passes return the given (chosen, rejected)
    lists, one pair of lists per call, in order. The policy's carry a zero gradient path to a
    parameter, so a train step can run backward."""
    policy_calls, reference_calls = iter(policy_batches), iter(reference_batches or [])
    weight = next(trainer.policy.parameters())

    def concatenated_forward(model, batch):
        assert model is trainer.policy
        chosen, rejected = (torch.tensor(v) + 0.0 * weight.sum() for v in next(policy_calls))
        tokens = torch.tensor(n_tokens) if n_tokens is not None else torch.ones(2 * len(chosen))
        return chosen, rejected, tokens

    def reference_logps(batch):
        if reference_batches is None:
            raise AssertionError("this loss must not ask for reference log-probs")
        chosen, rejected = next(reference_calls)
        return torch.tensor(chosen), torch.tensor(rejected)

    trainer.concatenated_forward = concatenated_forward
    trainer.reference_logps = reference_logps


def approx(values):
    return pytest.approx(values, rel=1e-6, abs=1e-7)


# ----------------------------------------------------------------------------- one batch


@pytest.mark.parametrize("loss", ["dpo", "cdpo", "ipo"])
@pytest.mark.parametrize("split", ["train", "eval"])
def test_preference_metrics_of_one_batch_by_hand(tmp_path, loss, split):
    trainer = build(tmp_path, OVERRIDES[loss])
    fix_logps(trainer, [POLICY], [REFERENCE])
    batch = trainer.eval_batches[0]
    assert len(batch["prompt"]) == 4
    value, metrics = trainer.get_batch_metrics(batch, 8, 1.0, split)  # a micro-batch of 4 of a batch of 8
    expected = {
        f"rewards_{split}/chosen": CHOSEN_REWARDS,
        f"rewards_{split}/rejected": REJECTED_REWARDS,
        f"rewards_{split}/margins": MARGINS,
        f"rewards_{split}/accuracies": ACCURACIES,
        f"logps_{split}/chosen": POLICY[0],
        f"logps_{split}/rejected": POLICY[1],
        f"loss/{split}": LOSSES[loss],
    }
    assert set(metrics) == set(expected)
    for key, want in expected.items():
        assert metrics[key] == approx(want), key
    assert value.item() == approx(sum(LOSSES[loss]) / 8)


def test_reference_free_dpo_metrics_by_hand(tmp_path):
    # No reference: r = 0.5 * log pi. r_chosen = 0.5 * (-1, -4, -3, -2) = (-0.5, -2, -1.5, -1),
    # r_rejected = 0.5 * (-3, -1, -5, -6) = (-1.5, -0.5, -2.5, -3), margins (1, -1.5, 1, 2).
    trainer = build(tmp_path, ["loss=dpo", B, "loss.reference_free=true"])
    fix_logps(trainer, [POLICY])  # asking for the reference fails the test
    value, metrics = trainer.get_batch_metrics(trainer.eval_batches[0], 4, 1.0, "train")
    assert metrics["rewards_train/chosen"] == approx([-0.5, -2.0, -1.5, -1.0])
    assert metrics["rewards_train/rejected"] == approx([-1.5, -0.5, -2.5, -3.0])
    assert metrics["rewards_train/margins"] == approx([1.0, -1.5, 1.0, 2.0])
    assert metrics["rewards_train/accuracies"] == [1.0, 0.0, 1.0, 1.0]
    expected_loss = [L(E(-1)), L(E(1.5)), L(E(-1)), L(E(-2))]
    assert metrics["loss/train"] == approx(expected_loss)
    assert value.item() == approx(sum(expected_loss) / 4)


def test_reward_model_metrics_by_hand(tmp_path, monkeypatch):
    # Scores chosen (1, 0, 2, -1), rejected (0, 2, 2, -3): margins (1, -2, 0, 2), pair 2 a tie.
    trainer = build(tmp_path, ["loss=reward"])
    scores = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.0, 2.0, 2.0, -3.0])  # chosen rows, then rejected
    monkeypatch.setattr(reward, "last_token_scores", lambda model, ids, mask: scores.clone())
    for split in ("train", "eval"):
        value, metrics = trainer.get_batch_metrics(trainer.eval_batches[0], 8, 1.0, split)
        expected_loss = [L(E(-1)), L(E(2)), math.log(2), L(E(-2))]
        expected = {
            f"scores_{split}/chosen": [1.0, 0.0, 2.0, -1.0],
            f"scores_{split}/rejected": [0.0, 2.0, 2.0, -3.0],
            f"scores_{split}/margins": [1.0, -2.0, 0.0, 2.0],
            f"scores_{split}/accuracies": [1.0, 0.0, 0.0, 1.0],
            f"loss/{split}": expected_loss,
        }
        assert set(metrics) == set(expected)
        for key, want in expected.items():
            assert metrics[key] == approx(want), key
        assert value.item() == approx(sum(expected_loss) / 8)


def test_sft_metrics_by_hand(tmp_path, monkeypatch):
    # Summed log-probs (-3, -5, -2, -6) over (2, 6, 1, 3) target tokens: the logged loss is the
    # micro-batch's per-token NLL 16 / 12; the training loss divides by the whole batch's 32 tokens.
    trainer = build(tmp_path, ["loss=sft"])
    fixed = (torch.tensor([-3.0, -5.0, -2.0, -6.0]), torch.tensor([2.0, 6.0, 1.0, 3.0]))
    monkeypatch.setattr(trainer, "one_side_logps", lambda model, rows: fixed)  # SFT's forward: the chosen rows alone
    for split in ("train", "eval"):
        value, metrics = trainer.get_batch_metrics(trainer.eval_batches[0], 8, 32.0, split)
        assert set(metrics) == {f"logps_{split}/chosen", f"loss/{split}"}
        assert metrics[f"logps_{split}/chosen"] == [-3.0, -5.0, -2.0, -6.0]
        assert metrics[f"loss/{split}"] == approx([16 / 12])
        assert value.item() == approx(16 / 32)


# ----------------------------------------------------------------------------- what metrics.jsonl holds

# A second batch of four pairs. Policy (0, -1, -2, -3) / (-2, -1, -1, -4), reference -1 everywhere:
# r_chosen = 0.5 * (1, 0, -1, -2) = (0.5, 0, -0.5, -1), r_rejected = 0.5 * (-1, 0, 0, -3) =
# (-0.5, 0, 0, -1.5), margins (1, 0, -0.5, 0.5) (pair 1 a tie), accuracies (1, 0, 0, 1).
POLICY_2 = ([0.0, -1.0, -2.0, -3.0], [-2.0, -1.0, -1.0, -4.0])
REFERENCE_2 = ([-1.0] * 4, [-1.0] * 4)
# Means over the 8 pairs of both batches:
MEANS = {
    "accuracies": (1 + 0 + 0 + 1 + 1 + 0 + 0 + 1) / 8,  # 0.5
    "margins": (1 - 1.5 + 0 + 2 + 1 + 0 - 0.5 + 0.5) / 8,  # 0.3125
    "chosen": (0.5 - 1 - 0.5 + 0 + 0.5 + 0 - 0.5 - 1) / 8,  # -0.25
    "rejected": (-0.5 + 0.5 - 0.5 - 2 - 0.5 + 0 + 0 - 1.5) / 8,  # -0.5625
}
# DPO losses of the second batch: log(1 + e^(-beta h)), beta h = margins = (1, 0, -0.5, 0.5).
MEAN_DPO_LOSS = (sum(LOSSES["dpo"]) + L(E(-1)) + math.log(2) + L(E(0.5)) + L(E(-0.5))) / 8


def test_eval_means_written_to_metrics_jsonl(tmp_path):
    trainer = build(tmp_path, ["loss=dpo", B])
    assert [len(b["prompt"]) for b in trainer.eval_batches] == [4, 4]
    fix_logps(trainer, [POLICY, POLICY_2], [REFERENCE, REFERENCE_2])
    trainer.evaluate()
    (record,) = metric_records(Path(trainer.run_dir))
    assert record["step"] == 0
    for name, mean in MEANS.items():
        assert record[f"rewards_eval/{name}"] == approx(mean), name
    assert record["logps_eval/chosen"] == approx((-1 - 4 - 3 - 2 + 0 - 1 - 2 - 3) / 8)
    assert record["logps_eval/rejected"] == approx((-3 - 1 - 5 - 6 - 2 - 1 - 1 - 4) / 8)
    assert record["loss/eval"] == approx(MEAN_DPO_LOSS)


def test_train_means_written_to_metrics_jsonl_over_micro_batches(tmp_path):
    # One step on a batch of 8 in two micro-batches of 4: the logged means cover all 8 pairs.
    trainer = build(tmp_path, ["loss=dpo", B, "batch_size=8", "gradient_accumulation_steps=2"])
    fix_logps(trainer, [POLICY, POLICY_2], [REFERENCE, REFERENCE_2])
    batch = next(iter(trainers.get_batch_iterator(trainer.train_examples, trainer.tokenizer, 8, 64, 32, seed=0, n_examples=8)))
    metrics = trainer.train_step(batch)
    trainer.log_train(metrics, 8, 100, 1.0, type("Bar", (), {"set_postfix": lambda self, x: None})())
    (record,) = metric_records(Path(trainer.run_dir))
    for name, mean in MEANS.items():
        assert record[f"rewards_train/{name}"] == approx(mean), name
    assert record["loss/train"] == approx(MEAN_DPO_LOSS)


# ----------------------------------------------------------------------------- online DPO

ONLINE = ["online.enabled=true", "online.max_new_tokens=8", "reward_model.name_or_path=org/reward-model"]


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_online_metrics_by_hand(tmp_path, loss):
    # The four pairs above, pair 1 unlabelled (weight 0): the rewards, log-probs and losses list
    # pairs 0, 2, 3 only (TRL's names online); the objective/* statistics cover all 8 completions.
    trainer = build(tmp_path, [f"loss={loss}", B, *ONLINE], online=True)
    n_tokens = [2.0, 1.0, 1.0, 3.0, 1.0, 2.0, 1.0, 1.0]  # response tokens, chosen rows then rejected
    fix_logps(trainer, [POLICY], [REFERENCE], n_tokens)
    batch = {
        "prompt": ["p0", "p1", "p2", "p3"],
        "weight": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "chosen_scores": torch.tensor([3.0, 1.0, 2.0, 0.0]),
        "rejected_scores": torch.tensor([1.0, 2.0, 2.0, -1.0]),
    }
    value, metrics = trainer.get_batch_metrics(batch, 3, 1.0, "train")
    kept_losses = [LOSSES[loss][i] for i in (0, 2, 3)]
    expected = {
        "rewards/chosen": [0.5, -0.5, 0.0],
        "rewards/rejected": [-0.5, -0.5, -2.0],
        "rewards/margins": [1.0, 0.0, 2.0],
        "rewards/accuracies": [1.0, 0.0, 1.0],
        "logps_train/chosen": [-1.0, -3.0, -2.0],
        "logps_train/rejected": [-3.0, -5.0, -6.0],
        "loss/train": kept_losses,
        "beta": [0.5],
    }
    # log pi - log ref per completion: (1, -2, -1, 0) chosen, (-1, 1, -1, -4) rejected. DPO sums
    # log-probs already; IPO's are per-token means, so the sequence sums multiply by n_tokens.
    if loss == "dpo":
        kl, logp = [1.0, -2.0, -1.0, 0.0, -1.0, 1.0, -1.0, -4.0], [-1.0, -4.0, -3.0, -2.0, -3.0, -1.0, -5.0, -6.0]
    else:
        kl, logp = [2.0, -2.0, -1.0, 0.0, -1.0, 2.0, -1.0, -4.0], [-2.0, -4.0, -3.0, -6.0, -3.0, -2.0, -5.0, -6.0]
    scores = [3.0, 1.0, 2.0, 0.0, 1.0, 2.0, 2.0, -1.0]
    expected["objective/kl"] = kl
    expected["objective/entropy"] = [-v for v in logp]
    expected["objective/non_score_reward"] = [-0.5 * v for v in kl]
    expected["objective/rlhf_reward"] = [s - 0.5 * v for s, v in zip(scores, kl)]
    assert set(metrics) == set(expected)
    for key, want in expected.items():
        assert metrics[key] == approx(want), key
    assert value.item() == approx(sum(kept_losses) / 3)
