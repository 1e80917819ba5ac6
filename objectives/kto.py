"""KTO (Ethayarajh et al. 2024, Eq. 8): a prospect-theoretic loss on desirable and undesirable completions, paired or
unpaired, its reference point z0 from mismatched pairs (TRL's KTOTrainer)."""

from __future__ import annotations

import torch

from losses import BETA, NLL_WEIGHT, Key, _positive, objective


@objective(
    "kto",
    keys={
        "beta": BETA,
        "desirable_weight": Key(1.0, _positive, "> 0", "lambda_D, weight of the desirable completions' losses"),
        "undesirable_weight": Key(1.0, _positive, "> 0", "lambda_U, weight of the undesirable completions' losses"),
        "nll_weight": NLL_WEIGHT,
    },
    source="Ethayarajh et al. 2024, Eq. 8",
    summary="KTO: prospect-theoretic loss on desirable / undesirable completions (paired or unpaired)",
    average_log_prob=False,
    unpaired=True,
    mismatched_kl=True,
    unit="value loss per completion, in [0, λ]",
)
def kto_objective(
    policy_chosen_logps,
    reference_chosen_logps,
    policy_kl_logps,
    reference_kl_logps,
    beta,
    desirable_weight,
    undesirable_weight,
    policy_rejected_logps=None,
    reference_rejected_logps=None,
    label=None,
):
    """KTO (Ethayarajh et al. 2024, Eq. 8; TRL KTOTrainer's ``kto``), desirable lambda_D (1 - sigmoid(beta (r - z0))) and
    undesirable lambda_U (1 - sigmoid(beta (z0 - r))) with r = log pi(y|x) - log ref(y|x) and z0 = max(0, mean r over the
    (N,) mismatched pairs (x_i, y_{i+1})) detached: (B,) summed log-probs in, (B,) losses and metric ``kl`` (z0) out.

    Paired (rejected log-probs, ``label`` None): a pair's loss is the mean of its two, rewards beta * r. Unpaired ((B,) bool
    ``label``): row i is desirable where ``label[i]``, rewards None, metrics ``rewards_desirable`` / ``rewards_undesirable``
    (left out when empty). ValueError for both or neither form.
    """
    paired = policy_rejected_logps is not None and reference_rejected_logps is not None
    if paired == (label is not None):
        raise ValueError("kto takes either rejected log-probs (paired rows) or a label (unpaired rows), not both or neither.")
    z0 = (policy_kl_logps - reference_kl_logps).mean().detach().clamp(min=0)
    chosen_logratios = policy_chosen_logps - reference_chosen_logps
    desirable = desirable_weight * (1 - torch.sigmoid(beta * (chosen_logratios - z0)))
    kl = z0.expand_as(policy_chosen_logps)
    if paired:
        rejected_logratios = policy_rejected_logps - reference_rejected_logps
        undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - rejected_logratios)))
        losses = (desirable + undesirable) / 2
        return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach(), {"kl": kl}
    label = label.to(device=policy_chosen_logps.device, dtype=torch.bool)
    undesirable = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - chosen_logratios)))
    losses = torch.where(label, desirable, undesirable)
    rewards = beta * chosen_logratios.detach()
    metrics = {"kl": kl}
    if label.any():
        metrics["rewards_desirable"] = rewards[label]
    if not label.all():
        metrics["rewards_undesirable"] = rewards[~label]
    return losses, None, None, metrics
