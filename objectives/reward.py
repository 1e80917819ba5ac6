"""``loss=reward``: a Bradley-Terry reward model (a one-output score head) that online DPO's scorer can be."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import losses
from losses import ObjectiveInputs, objective
from preference_datasets import concatenated_inputs


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry reward-model loss -log sigmoid(r_c - r_r) (Bradley & Terry 1952; Ouyang et al. 2022, Eq. 1):
    (B,) scores in, (B,) float32 losses in nats out."""
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float())


def score_inputs(trainer, batch: dict) -> ObjectiveInputs:
    """A reward model's inputs: the score head's output at each sequence's last token, chosen and rejected in one
    padded forward, (B,) each."""
    n = len(batch["prompt"])
    inputs = {k: v.to(trainer.device) for k, v in concatenated_inputs(batch).items()}
    scores = losses.last_token_scores(trainer.policy, inputs["input_ids"], inputs["attention_mask"])
    return ObjectiveInputs(chosen_scores=scores[:n], rejected_scores=scores[n:])


@objective(
    "reward",
    keys={},
    source="Bradley & Terry 1952; Ouyang et al. 2022, Eq. 1",
    summary="a Bradley-Terry reward model (score head) for online DPO",
    reference=False,
    average_log_prob=False,
    score_head=True,
    reward_metric="scores",
    unit="nats, −log σ(score margin)",
    inputs=score_inputs,
)
def reward_objective(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor):
    """Reward-model training: :func:`bradley_terry_loss` per pair, the scores as rewards; (B,) each."""
    return bradley_terry_loss(chosen_scores, rejected_scores), chosen_scores.detach(), rejected_scores.detach()
