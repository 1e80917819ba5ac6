"""``loss=reward``: a Bradley-Terry reward model (a one-output score head) that online DPO's scorer can be."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from losses import objective


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry reward-model loss -log sigmoid(r_c - r_r) (Bradley & Terry 1952; Ouyang et al. 2022, Eq. 1):
    (B,) scores in, (B,) float32 losses in nats out."""
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float())


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
)
def reward_objective(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor):
    """Reward-model training: :func:`bradley_terry_loss` per pair, the scores as rewards; (B,) each."""
    return bradley_terry_loss(chosen_scores, rejected_scores), chosen_scores.detach(), rejected_scores.detach()
