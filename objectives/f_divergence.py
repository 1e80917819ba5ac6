"""f-DPO (Wang et al. 2024, "Beyond Reverse KL", arXiv:2309.16240): DPO with the reverse-KL regulariser replaced by
another f-divergence, registered with :mod:`losses` as ``loss=f_dpo`` (TRL's ``f_divergence_type``)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from losses import BETA, NLL_WEIGHT, Key, ObjectiveInputs, dpo_loss, objective
from objectives.pairwise import PAIR_LABEL_SMOOTHING

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


def f_prime(h: torch.Tensor, f_divergence_type: str, alpha: float) -> torch.Tensor:
    """f'(u) at u = pi/ref = exp(h) (Wang et al. 2024, Table 1): reverse KL log u, forward KL 1 - 1/u, Jensen-Shannon
    log(2u / (1 + u)), alpha-divergence (u^(alpha-1) - 1)/(alpha - 1) (log u at alpha = 1).

    Shapes: ``h`` (B,) log-ratios log pi - log ref in nats; returns (B,).
    """
    if f_divergence_type == "reverse_kl" or (f_divergence_type == "alpha_divergence" and abs(alpha - 1) < 1e-6):
        return h
    if f_divergence_type == "forward_kl":
        return 1 - torch.exp(-h)
    if f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(h)  # log(2u/(1+u)) = log 2 + log sigmoid(log u)
    t = (alpha - 1) * h
    t = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t  # exp in float32 at least
    max_exponent = 11.0 if h.dtype == torch.float16 else 80.0  # as TRL: exp(max) stays finite in h's dtype
    return (torch.exp(torch.clamp(t, max=max_exponent)) - 1).to(h.dtype) / (alpha - 1)


@objective(
    "f_dpo",
    keys={
        "beta": BETA,
        "f_divergence_type": Key(
            "reverse_kl",
            lambda v: v in F_DIVERGENCES,
            f"one of {', '.join(F_DIVERGENCES)}",
            "the divergence that regularises the policy",
        ),
        "f_alpha_divergence_coef": Key(
            0.5, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "> 0", "alpha (alpha_divergence)"
        ),
        "label_smoothing": PAIR_LABEL_SMOOTHING,
        "nll_weight": NLL_WEIGHT,
    },
    source="f-DPO, Wang et al. 2024 (arXiv:2309.16240), Eq. 13 with Table 1's f'",
    summary="DPO regularised by another f-divergence: -log σ(β (f'(π/π_ref)(y_w) - f'(π/π_ref)(y_l)))",
    reference=True,
    average_log_prob=False,
    unit="nats",
)
def f_dpo(inputs: ObjectiveInputs, loss):
    """-log sigmoid(beta (f'(u_w) - f'(u_l))), u = pi(y|x) / ref(y|x), as :func:`losses.dpo_loss` of the scores f'(u); reverse
    KL is DPO itself.

    Shapes: ``inputs``' four (B,) summed log-probs in nats; returns (losses, chosen_rewards, rejected_rewards), (B,) each,
    the rewards DPO's beta (log pi - log ref), detached.
    """
    h_w = inputs.policy_chosen_logps - inputs.reference_chosen_logps
    h_l = inputs.policy_rejected_logps - inputs.reference_rejected_logps
    scores_w, scores_l = (f_prime(h, loss.f_divergence_type, loss.f_alpha_divergence_coef) for h in (h_w, h_l))
    zero = torch.zeros_like(h_w)  # the scores are already relative to the reference
    losses, _, _ = dpo_loss(scores_w, scores_l, zero, zero, loss.beta, loss.label_smoothing)
    return losses, loss.beta * h_w.detach(), loss.beta * h_l.detach()
