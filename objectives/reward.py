"""``loss=reward``: a Bradley-Terry reward model (a one-output score head) that online DPO's scorer can be."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from losses import ObjectiveInputs, objective
from preference_datasets import concatenated_inputs


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry reward-model loss -log sigmoid(r_c - r_r) (Bradley & Terry 1952; Ouyang et al. 2022, Eq. 1):
    (B,) scores in, (B,) float32 losses in nats out."""
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float())


def last_token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(N,) float32 scores of right-padded (N, T) sequences at their last real token, from a one-label
    ``*ForSequenceClassification`` model's ``score`` head, gradients flowing (ValueError without such a head)."""
    head = getattr(model, "score", None)
    if head is None or getattr(head, "out_features", 1) != 1:
        raise ValueError(f"{type(model).__name__} has no one-output `score` head; load it with num_labels=1.")
    captured = []
    handle = head.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        handle.remove()
    per_position = captured[0][..., 0]  # (N, T)
    # not the model's own pooling (last non-pad token), which is wrong when pad is EOS and a sequence ends with EOS
    last = (attention_mask.sum(1) - 1).clamp(min=0).to(per_position.device)
    return per_position.gather(1, last.unsqueeze(1)).squeeze(1).float()


def score_inputs(trainer, batch: dict) -> ObjectiveInputs:
    """A reward model's inputs: the score head's output at each sequence's last token, chosen and rejected in one
    padded forward, (B,) each."""
    n = len(batch["prompt"])
    inputs = {k: v.to(trainer.device) for k, v in concatenated_inputs(batch).items()}
    scores = last_token_scores(trainer.policy, inputs["input_ids"], inputs["attention_mask"])
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
    needs=("chosen_scores", "rejected_scores"),
    unit="nats, −log σ(score margin)",
    inputs=score_inputs,
)
def reward_objective(inputs: ObjectiveInputs, loss):
    """Reward-model training: :func:`bradley_terry_loss` per pair, the scores as rewards; (B,) each."""
    chosen, rejected = inputs.chosen_scores, inputs.rejected_scores
    return bradley_terry_loss(chosen, rejected), chosen.detach(), rejected.detach()
