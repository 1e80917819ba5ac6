"""Objectives without a reference model: SimPO (Meng et al. 2024), CPO (Xu et al. 2024) and ORPO (Hong et al. 2024),
as TRL's CPOTrainer and ORPOTrainer compute them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from losses import BETA, NLL_WEIGHT, Key, ObjectiveInputs, _non_negative, _positive_or_list, objective
from objectives.pairwise import _smoothed_logistic

# ---------------------------------------------------------------- reference-free objectives (SimPO, CPO, ORPO) and KTO

LABEL_SMOOTHING = Key(
    0.0, lambda v: _non_negative(v) and v < 0.5, "in [0, 0.5)", "assumed label-flip rate (conservative loss, as TRL's CPO)"
)


def simpo_objective(policy_chosen_logps, policy_rejected_logps, beta, gamma, label_smoothing):
    """SimPO (Meng et al. 2024, Eq. 6; TRL CPOTrainer's ``simpo`` with label smoothing), -(1 - eps) log sigmoid(r_w - r_l -
    gamma) - eps log sigmoid(-(r_w - r_l - gamma)) with r = beta * mean_t log pi(y_t | x, y_<t) (no reference), gamma TRL's
    ``simpo_gamma``: (B,) per-token log-probs in, (losses, rewards r detached) each (B,) out."""
    chosen_rewards = beta * policy_chosen_logps
    rejected_rewards = beta * policy_rejected_logps
    losses = _smoothed_logistic(chosen_rewards - rejected_rewards - gamma, label_smoothing)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


@objective(
    "simpo",
    keys={
        "beta": Key(2.0, _positive_or_list, BETA.rule, "reward scale beta (the paper uses 2.0-2.5)"),
        "gamma": Key(1.0, _non_negative, ">= 0", "target reward margin gamma (the paper's gamma, not gamma / beta)"),
        "label_smoothing": LABEL_SMOOTHING,
        "nll_weight": NLL_WEIGHT,
    },
    source="Meng et al. 2024, Eq. 6",
    summary="SimPO: reference-free, length-normalised rewards with a target margin",
    reference=False,
    average_log_prob=True,
    needs=("policy_chosen_logps", "policy_rejected_logps"),
    unit="nats, −log σ(β·avg log-prob gap − γ)",
)
def simpo(inputs: ObjectiveInputs, loss):
    """loss=simpo: :func:`simpo_objective` of the policy's (B,) per-token log-probs and the keys."""
    return simpo_objective(inputs.policy_chosen_logps, inputs.policy_rejected_logps, loss.beta, loss.gamma, loss.label_smoothing)


def cpo_objective(policy_chosen_logps, policy_rejected_logps, policy_chosen_nll, beta, label_smoothing, cpo_alpha):
    """CPO (Xu et al. 2024, Eq. 3 plus the NLL term; TRL CPOTrainer's ``sigmoid``), -(1 - eps) log sigmoid(beta (log pi(y_w|x)
    - log pi(y_l|x))) - eps log sigmoid(-...) + cpo_alpha * NLL(y_w): (B,) summed log-probs and NLL per token in, (B,) losses,
    rewards beta * log pi(y|x) detached and metric ``nll`` out."""
    losses = _smoothed_logistic(beta * (policy_chosen_logps - policy_rejected_logps), label_smoothing)
    losses = losses + cpo_alpha * policy_chosen_nll
    chosen_rewards = beta * policy_chosen_logps.detach()
    rejected_rewards = beta * policy_rejected_logps.detach()
    return losses, chosen_rewards, rejected_rewards, {"nll": policy_chosen_nll.detach()}


@objective(
    "cpo",
    keys={
        "beta": BETA,
        "label_smoothing": LABEL_SMOOTHING,
        "cpo_alpha": Key(1.0, _non_negative, ">= 0", "weight of the chosen responses' NLL per token"),
    },
    source="Xu et al. 2024, Eq. 3 and the CPO loss (Sec. 3)",
    summary="CPO: reference-free sigmoid preference loss plus the chosen NLL",
    reference=False,
    average_log_prob=False,
    nll=True,
    needs=("policy_chosen_logps", "policy_rejected_logps", "policy_chosen_nll"),
    unit="nats, −log σ(β·log-prob gap) + α·NLL per token",
)
def cpo(inputs: ObjectiveInputs, loss):
    """loss=cpo: :func:`cpo_objective` of the policy's (B,) summed log-probs, the chosen NLL per token and the keys."""
    return cpo_objective(
        inputs.policy_chosen_logps,
        inputs.policy_rejected_logps,
        inputs.policy_chosen_nll,
        loss.beta,
        loss.label_smoothing,
        loss.cpo_alpha,
    )


def log_odds(avg_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) for p = exp(``avg_logps``), computed stably; (B,) in (nats, <= 0), (B,) out."""
    x = avg_logps.clamp(max=-torch.finfo(avg_logps.dtype).eps)  # p = 1 gives a finite value and gradient, not inf / NaN
    # log(1 - e^x) as Mächler 2012 recommends: log(-expm1(x)) for x > -ln 2, log1p(-exp(x)) below
    log_one_minus_p = torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
    return x - log_one_minus_p


def orpo_objective(policy_chosen_logps, policy_rejected_logps, policy_chosen_nll, beta):
    """ORPO (Hong et al. 2024, Eqs. 6-7), NLL(y_w) - lambda log sigmoid(log odds(y_w) - log odds(y_l)) with odds(y) = p / (1 - p),
    p = exp(mean_t log pi(y_t | x, y_<t)), lambda = ``beta``: (B,) in and out, rewards beta * mean log-prob, TRL's metrics
    ``nll``, ``log_odds_ratio`` (log sigmoid of the log odds ratio) and ``log_odds_chosen`` (the log odds ratio)."""
    ratio = log_odds(policy_chosen_logps) - log_odds(policy_rejected_logps)
    log_sigmoid_ratio = F.logsigmoid(ratio)
    losses = policy_chosen_nll - beta * log_sigmoid_ratio
    metrics = {
        "nll": policy_chosen_nll.detach(),
        "log_odds_ratio": log_sigmoid_ratio.detach(),
        "log_odds_chosen": ratio.detach(),
    }
    return losses, beta * policy_chosen_logps.detach(), beta * policy_rejected_logps.detach(), metrics


@objective(
    "orpo",
    keys={"beta": Key(0.1, _positive_or_list, BETA.rule, "weight lambda of the odds-ratio term (TRL's beta)")},
    source="Hong et al. 2024, Eqs. 6-7",
    summary="ORPO: chosen NLL plus lambda times an odds-ratio preference loss, no reference",
    reference=False,
    average_log_prob=True,
    nll=True,
    needs=("policy_chosen_logps", "policy_rejected_logps", "policy_chosen_nll"),
    unit="nats, NLL per token + λ·(−log σ(log odds ratio))",
)
def orpo(inputs: ObjectiveInputs, loss):
    """loss=orpo: :func:`orpo_objective` of the policy's (B,) per-token log-probs, the chosen NLL per token and ``beta``."""
    return orpo_objective(inputs.policy_chosen_logps, inputs.policy_rejected_logps, inputs.policy_chosen_nll, loss.beta)
