"""``loss=wpo``: WPO (Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference Optimization", arXiv:2406.11827,
Eq. 2), TRL's ``use_weighting``: the loss of ``loss.loss_type`` (DPO, IPO, f-DPO or one of TRL's pairwise family; not AOT,
which sorts the pairs) with each pair's loss weighed by how likely its two responses are under the policy."""

from __future__ import annotations

import dataclasses

import torch

from losses import BETA, OBJECTIVES, Key, Objective, ObjectiveConfigError, ObjectiveInputs, ObjectiveOutput, _get
from objectives import f_divergence, pairwise  # noqa: F401  (registered before loss=wpo names them)

WEIGHTED = (  # TRL's loss types that take use_weighting, and f-DPO on its sigmoid (LD-DPO's weighted sums are its own)
    *("dpo", "ipo", "hinge", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard"),
    *("apo_zero", "apo_down", "discopop", "sigmoid_norm", "f_dpo"),
)
LOSS_TYPE = Key("dpo", lambda v: v in WEIGHTED, f"one of {', '.join(WEIGHTED)}", "the loss whose pairs WPO weighs")


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
        raise ValueError("loss=wpo needs the policy's WPO weights, which the trainer did not compute.")
    return torch.exp(inputs.policy_chosen_statistic + inputs.policy_rejected_statistic).detach()


def weighted_pair_inputs(trainer, batch: dict) -> ObjectiveInputs:
    """The pairs' inputs (``trainer.pair_inputs``) with the means per response of :func:`log_weight_per_token` from the
    policy's forward (the same call as its log-probs), (B,) each."""
    return trainer.pair_inputs(batch, log_weight_per_token)


@dataclasses.dataclass(frozen=True)
class WeightedObjective(Objective):
    """``loss=wpo``: the objective ``loss.loss_type`` (its keys, reference and log-probs) with each pair's loss, its
    ``nll_weight`` term included, multiplied by :func:`pair_weights` (TRL's ``per_sequence_loss *= weights``)."""

    def base(self, loss_config) -> Objective:
        """The weighed objective, ``loss.loss_type``'s (ObjectiveConfigError for another name)."""
        name = _get(loss_config, "loss_type", LOSS_TYPE.default)
        if name not in WEIGHTED:
            raise ObjectiveConfigError(f"loss.loss_type must be {LOSS_TYPE.rule} for loss=wpo, got {name}.")
        return OBJECTIVES[name]

    def keys_for(self, loss_config) -> dict:
        """``loss_type`` and the keys of the objective it names."""
        return {"loss_type": LOSS_TYPE, **self.base(loss_config).keys}

    def uses_reference(self, loss_config) -> bool:
        """As ``loss_type``'s."""
        return self.base(loss_config).uses_reference(loss_config)

    def averages(self, loss_config) -> bool:
        """As ``loss_type``'s."""
        return self.base(loss_config).averages(loss_config)

    def uses_nll(self, loss_config) -> bool:
        """As ``loss_type``'s."""
        return self.base(loss_config).uses_nll(loss_config)

    def compute(self, inputs: ObjectiveInputs, loss_config, **overrides) -> ObjectiveOutput:
        """The base objective's output with its (B,) losses multiplied by :func:`pair_weights` (rewards unweighted)."""
        out = self.base(loss_config).compute(inputs, loss_config, **overrides)
        return out._replace(losses=out.losses * pair_weights(inputs))


if "wpo" in OBJECTIVES:
    raise ValueError("objective 'wpo' is registered twice.")
OBJECTIVES["wpo"] = WeightedObjective(
    name="wpo",
    fn=pair_weights,
    keys={"loss_type": LOSS_TYPE, "beta": BETA},  # the keys every loss_type has; keys_for gives the rest
    source="WPO, Zhou et al. 2024 (arXiv:2406.11827), Eq. 2; TRL's use_weighting",
    summary="WPO: the loss_type's loss of each pair times w(y_w) w(y_l), w(y) = exp(mean_t log(p(y_t) / Σ_v p_v²)) under the policy",
    reference=True,
    inputs=weighted_pair_inputs,
    unit="nats per example, the weighed loss_type's",
)
