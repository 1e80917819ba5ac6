"""``loss.use_weighting=true``: WPO (Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference Optimization",
arXiv:2406.11827, Eq. 2), TRL's ``use_weighting``: each pair's loss weighed by how likely its two responses are under the
policy, on DPO, IPO and TRL's pairwise family (not AOT, which sorts the pairs, nor a mix)."""

from __future__ import annotations

import dataclasses

import torch

from losses import OBJECTIVES, Key, ObjectiveInputs, _get
from objectives import f_divergence, ld_dpo, pairwise  # noqa: F401  (registered before they are given the key)

WEIGHTED = (  # TRL's loss types that take use_weighting, and the objectives built on its sigmoid
    *("dpo", "ipo", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard"),
    *("apo_zero", "apo_down", "discopop", "sigmoid_norm", "f_dpo", "ld_dpo"),
)
USE_WEIGHTING = Key(
    False,
    lambda v: isinstance(v, bool),
    "true or false",
    "WPO: weigh each pair's loss by its responses' per-token probabilities under the policy (TRL's use_weighting)",
)


def log_weight_per_token(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """WPO's log weight of each response token, log p(y_t) - log sum_v p_v^2 (Eq. 2 with TRL's normalisation by the
    output distribution's own sum of squares), p = softmax of the policy's logits at the position predicting y_t.

    Shapes: ``logits`` (M, V); ``rows``, ``targets`` (N,) long; returns (N,) float32 (float64 for float64 logits).
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    # log p_y - log sum p^2 = (z_y - lse(z)) - (lse(2z) - 2 lse(z)) = z_y + lse(z) - lse(2z)
    return z[rows, targets] + torch.logsumexp(z, dim=-1)[rows] - torch.logsumexp(2 * z, dim=-1)[rows]


def pair_weights(inputs: ObjectiveInputs) -> torch.Tensor:
    """(B,) w(y_w) w(y_l), w(y) = exp(mean over y's tokens of :func:`log_weight_per_token`), without gradient."""
    if inputs.policy_chosen_statistic is None or inputs.policy_rejected_statistic is None:
        raise ValueError("loss.use_weighting needs the policy's WPO weights, which the trainer did not compute.")
    return torch.exp(inputs.policy_chosen_statistic + inputs.policy_rejected_statistic).detach()


def weighted_pair_inputs(trainer, batch: dict) -> ObjectiveInputs:
    """The pairs' inputs (``trainer.pair_inputs``) and, with ``loss.use_weighting``, the means per response of
    :func:`log_weight_per_token` from the policy's forward (the same call as its log-probs), (B,) each."""
    if not _get(trainer.loss_config, "use_weighting", False):
        return trainer.pair_inputs(batch)
    n = len(batch["prompt"])
    chosen, rejected, n_tokens, statistic = trainer.concatenated_forward(trainer.policy, batch, log_weight_per_token)
    if trainer.uses_reference:
        ref_chosen, ref_rejected = trainer.reference_logps(batch)
    else:  # a uniform reference (reference_free), never computed
        ref_chosen, ref_rejected = torch.zeros_like(chosen), torch.zeros_like(rejected)
    return ObjectiveInputs(
        policy_chosen_logps=chosen,
        policy_rejected_logps=rejected,
        reference_chosen_logps=ref_chosen,
        reference_rejected_logps=ref_rejected,
        chosen_n_tokens=n_tokens[:n],
        rejected_n_tokens=n_tokens[n:],
        policy_chosen_statistic=statistic[:n],
        policy_rejected_statistic=statistic[n:],
    )


def weighted(fn):
    """``fn(inputs, loss)`` whose (B,) losses, with ``loss.use_weighting``, are multiplied by :func:`pair_weights`."""

    def wpo(inputs: ObjectiveInputs, loss):
        losses, *rest = fn(inputs, loss)
        return (losses * pair_weights(inputs) if loss.use_weighting else losses), *rest

    wpo.__name__, wpo.__doc__ = fn.__name__, fn.__doc__
    return wpo


for _name in WEIGHTED:  # each gets the key, WPO's builder of its inputs and its weighted function
    _decl = OBJECTIVES[_name]
    _keys = {**_decl.keys, "use_weighting": USE_WEIGHTING}
    OBJECTIVES[_name] = dataclasses.replace(_decl, keys=_keys, fn=weighted(_decl.fn), inputs=weighted_pair_inputs)
