"""``loss=ld_dpo``: LD-DPO (Liu et al. 2024, "Length Desensitization in Directly Preference Optimization",
arXiv:2409.06411, Eq. 9), DPO on log-probs in which each response's tokens past the shorter response of its pair (the
"verbose" part) weigh ``ld_alpha``: TRL's ``ld_alpha``."""

from __future__ import annotations

import torch

from losses import BETA, NLL_WEIGHT, Key, ObjectiveInputs, _get, dpo_loss, objective


def length_desensitized_weight(alpha: float):
    """LD-DPO's token weight for :func:`modeling.logprobs.sum_by_sequence`: 1 for the first min(|y_w|, |y_l|) response tokens of
    each pair (the public part), ``alpha`` after them, so log pi(y|x) becomes the public log-prob plus alpha times the
    verbose one (Eq. 9). The 2B sequences are the pairs' chosen responses, then their rejected ones."""

    def weight(rank: torch.Tensor, sequence: torch.Tensor, n_tokens: torch.Tensor) -> torch.Tensor:
        n = n_tokens.shape[0] // 2
        public = torch.minimum(n_tokens[:n], n_tokens[n:]).repeat(2)  # (2B,): each pair's shorter length, on both sides
        return torch.where(rank < public[sequence], 1.0, alpha)

    return weight


@objective(
    "ld_dpo",
    keys={
        "beta": BETA,
        "ld_alpha": Key(
            0.5,
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1,
            "in [0, 1]",
            "weight of each response's tokens past the pair's shorter response (1: DPO)",
        ),
        "nll_weight": NLL_WEIGHT,
    },
    source="Liu et al. 2024 (arXiv:2409.06411), Eq. 9; TRL's ld_alpha",
    summary="LD-DPO: DPO with the tokens past the pair's shorter response weighed ld_alpha",
    average_log_prob=False,
    token_weights=lambda loss_config: length_desensitized_weight(float(_get(loss_config, "ld_alpha", 0.5))),
    unit="nats, −log σ(β·log-ratio gap)",
)
def ld_dpo_objective(inputs: ObjectiveInputs, loss):
    """LD-DPO's loss: :func:`losses.dpo_loss` of the length-desensitized (B,) log-probs of policy and reference."""
    return dpo_loss(
        inputs.policy_chosen_logps,
        inputs.policy_rejected_logps,
        inputs.reference_chosen_logps,
        inputs.reference_rejected_logps,
        loss.beta,
    )
