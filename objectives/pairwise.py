"""TRL's pairwise family beyond sigmoid and ipo (DPOTrainer's ``loss_type``): hinge, EXO, NCA, robust DPO, BCO, SPPO,
AOT, APO, DiscoPOP, sigmoid_norm; each one loss of the log-ratios (h_w, h_l), registered with :mod:`losses`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from losses import BETA, NLL_WEIGHT, PAIR_LOGPS, Key, ObjectiveInputs, _non_negative, _positive, objective

# ---------------------------------------------------------------------------- TRL's pairwise family
# DPOTrainer's loss_types beyond sigmoid and ipo, and loss=mix. Notation: h_w = log pi(y_w|x) - log ref(y_w|x),
# h_l likewise, d = h_w - h_l, on summed log-probs (TRL's convention); rewards beta * h_w, beta * h_l.


def log_ratios(inputs: ObjectiveInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_w, h_l): the chosen and rejected log-ratios log pi - log ref of ``inputs``, (B,) each."""
    return (
        inputs.policy_chosen_logps - inputs.reference_chosen_logps,
        inputs.policy_rejected_logps - inputs.reference_rejected_logps,
    )


def pair_rewards(beta, chosen_logratios, rejected_logratios):
    """TRL's reported rewards (beta * h_w, beta * h_l), detached."""
    return beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def _smoothed_logistic(z, label_smoothing):
    """-(1 - eps) log sigmoid(z) - eps log sigmoid(-z): the logistic loss when a label flips with probability eps."""
    return -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing


def _in_unit_interval(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1


def _below_half(value) -> bool:
    return _non_negative(value) and value < 0.5


PAIR_LABEL_SMOOTHING = Key(0.0, _below_half, "in [0, 0.5)", "assumed label-flip rate")


def pairwise(name: str, keys: dict, source: str, summary: str, unit: str, needs: tuple = PAIR_LOGPS, couples: str = ""):
    """Register the decorated ``fn(inputs, loss)`` as TRL's ``loss_type=name``: keys ``beta``, ``keys``, then
    ``nll_weight``; uses the reference; summed log-probs."""
    keys = {"beta": BETA, **keys, "nll_weight": NLL_WEIGHT}
    declaration = {"source": source, "summary": summary, "reference": True, "average_log_prob": False, "unit": unit}
    return objective(name, keys=keys, needs=needs, couples_micro_batch=couples, **declaration)


@pairwise(
    "hinge",
    {},
    "SLiC-HF, Zhao et al. 2023 (arXiv:2305.10425), its calibration loss with the reference (TRL)",
    "SLiC's hinge on the DPO gap: relu(1 - beta d)",
    "margin units, relu(1 − β·log-ratio gap)",
)
def hinge(inputs: ObjectiveInputs, loss):
    """SLiC-HF's calibration loss max(0, 1 - beta d) on the reference-corrected gap (TRL's ``hinge``), 1/beta the paper's
    margin delta: (B,) in and out."""
    h_w, h_l = log_ratios(inputs)
    return torch.relu(1 - loss.beta * (h_w - h_l)), *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "exo_pair",
    {"label_smoothing": Key(1e-3, _in_unit_interval, "in (0, 1)", "eps of the target distribution [1 - eps, eps]")},
    "EXO, Ji et al. 2024 (arXiv:2402.00856), Eq. 16 (EXO-pref, K = 2)",
    "EXO: reverse KL from softmax(beta h) over the pair to the target [1 - eps, eps]",
    "nats, KL(q_θ ‖ [1−ε, ε])",
)
def exo_pair(inputs: ObjectiveInputs, loss):
    """EXO for pairs (Eq. 16, K = 2), KL(q || p) = q_w (log q_w - log(1 - eps)) + q_l (log q_l - log eps) with
    q = (sigmoid(beta d), sigmoid(-beta d)) and eps = ``label_smoothing`` in (0, 1): (B,) in and out, in nats."""
    h_w, h_l = log_ratios(inputs)
    z = loss.beta * (h_w - h_l)
    log_q_w, log_q_l = F.logsigmoid(z), F.logsigmoid(-z)
    eps = loss.label_smoothing
    losses = log_q_w.exp() * (log_q_w - math.log1p(-eps)) + log_q_l.exp() * (log_q_l - math.log(eps))
    return losses, *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "nca_pair",
    {},
    "NCA, Chen et al. 2024 (arXiv:2402.05369), the pairwise NCA loss",
    "NCA: -log σ(β h_w) - ½ log σ(-β h_w) - ½ log σ(-β h_l) (absolute, not relative, likelihoods)",
    "nats",
)
def nca_pair(inputs: ObjectiveInputs, loss):
    """NCA for pairs (TRL's ``nca_pair``), -log sigmoid(r_w) - 1/2 log sigmoid(-r_w) - 1/2 log sigmoid(-r_l) with
    r = beta h: (B,) in and out, in nats."""
    h_w, h_l = log_ratios(inputs)
    r_w, r_l = loss.beta * h_w, loss.beta * h_l
    return -F.logsigmoid(r_w) - 0.5 * F.logsigmoid(-r_w) - 0.5 * F.logsigmoid(-r_l), *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "robust",
    {"label_smoothing": Key(0.0, _below_half, "in [0, 0.5)", "assumed label-flip rate eps (0: plain DPO)")},
    "robust DPO, Chowdhury et al. 2024 (arXiv:2403.00409), the unbiased rDPO loss",
    "rDPO: DPO de-biased for labels flipped with probability eps",
    "nats (may be negative when eps > 0)",
)
def robust(inputs: ObjectiveInputs, loss):
    """Robust DPO, ((1 - eps)(-log sigmoid(beta d)) - eps (-log sigmoid(-beta d))) / (1 - 2 eps), unbiased for labels
    flipped with probability eps = ``label_smoothing`` (unbounded below for eps > 0): (B,) in and out."""
    h_w, h_l = log_ratios(inputs)
    z = loss.beta * (h_w - h_l)
    eps = loss.label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps), *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "bco_pair",
    {},
    "BCO, Jung et al. 2024 (arXiv:2404.04656), on pairs without the reward shift (TRL)",
    "BCO: a binary classifier, chosen reward > 0 and rejected reward < 0",
    "nats",
)
def bco_pair(inputs: ObjectiveInputs, loss):
    """BCO on pairs (TRL's ``bco_pair``), -log sigmoid(beta h_w) - log sigmoid(-beta h_l) with the reward shift delta = 0
    as in TRL: (B,) in and out, in nats."""
    h_w, h_l = log_ratios(inputs)
    return -F.logsigmoid(loss.beta * h_w) - F.logsigmoid(-loss.beta * h_l), *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "sppo_hard",
    {},
    "SPPO, Wu et al. 2024 (arXiv:2405.00675), Eq. 4.7 with hard probabilities P = 1 / 0",
    "SPPO (hard): h_w regressed to 1/(2β), h_l to -1/(2β)",
    "nats², squared log-ratio errors",
)
def sppo_hard(inputs: ObjectiveInputs, loss):
    """SPPO (Eq. 4.7 with P = 1 / 0 and eta = 1 / beta; TRL's ``sppo_hard``), (h_w - 1 / (2 beta))^2 + (h_l + 1 / (2 beta))^2
    on summed log-ratios: (B,) in and out."""
    h_w, h_l = log_ratios(inputs)
    return (h_w - 0.5 / loss.beta) ** 2 + (h_l + 0.5 / loss.beta) ** 2, *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "aot",
    {"label_smoothing": PAIR_LABEL_SMOOTHING},
    "AOT, Melnyk et al. 2024 (arXiv:2406.05882), paired: sorted policy vs sorted reference margins",
    "AOT (paired): DPO between the sorted policy and reference margins of the micro-batch",
    "nats",
    couples="sorts the margins over each rank's micro-batch",
)
def aot(inputs: ObjectiveInputs, loss):
    """AOT, paired (TRL's ``aot``), -(1 - eps) log sigmoid(beta delta_i) - eps log sigmoid(-beta delta_i) with
    delta = sort(m_policy) - sort(m_reference) over the micro-batch, m = log pi(y_w) - log pi(y_l): (B,) in and out, loss i
    belonging to a rank, not to example i."""
    margins = torch.sort(inputs.policy_chosen_logps - inputs.policy_rejected_logps, dim=0).values
    reference_margins = torch.sort(inputs.reference_chosen_logps - inputs.reference_rejected_logps, dim=0).values
    losses = _smoothed_logistic(loss.beta * (margins - reference_margins), loss.label_smoothing)
    return losses, *pair_rewards(loss.beta, *log_ratios(inputs))


@pairwise(
    "aot_unpaired",
    {"label_smoothing": PAIR_LABEL_SMOOTHING},
    "AOT, Melnyk et al. 2024 (arXiv:2406.05882), unpaired: sorted chosen vs sorted rejected log-ratios",
    "AOT (unpaired): DPO between the sorted chosen and sorted rejected log-ratios of the micro-batch",
    "nats",
    couples="sorts the log-ratios over each rank's micro-batch",
)
def aot_unpaired(inputs: ObjectiveInputs, loss):
    """AOT, unpaired (TRL's ``aot_unpaired``), as :func:`aot` with delta = sort(h_w) - sort(h_l): (B,) in and out, loss i
    belonging to a rank."""
    h_w, h_l = log_ratios(inputs)
    delta = torch.sort(h_w, dim=0).values - torch.sort(h_l, dim=0).values
    return _smoothed_logistic(loss.beta * delta, loss.label_smoothing), *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "apo_zero",
    {},
    "APO, D'Oosterlinck et al. 2024 (arXiv:2408.06266), Eq. 7 (APO-zero)",
    "APO-zero: raise the chosen likelihood, lower the rejected (chosen better than the model)",
    "probability units, in [0, 2]",
)
def apo_zero(inputs: ObjectiveInputs, loss):
    """APO-zero (Eq. 7), (1 - sigmoid(beta h_w)) + sigmoid(beta h_l), for chosen responses better than the model's own:
    (B,) in and out."""
    h_w, h_l = log_ratios(inputs)
    return (1 - torch.sigmoid(loss.beta * h_w)) + torch.sigmoid(loss.beta * h_l), *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "apo_down",
    {},
    "APO, D'Oosterlinck et al. 2024 (arXiv:2408.06266), Eq. 8 (APO-down)",
    "APO-down: lower both likelihoods, the rejected more (chosen worse than the model)",
    "probability units, in [0, 2]",
)
def apo_down(inputs: ObjectiveInputs, loss):
    """APO-down (Eq. 8), sigmoid(beta h_w) + (1 - sigmoid(beta (h_w - h_l))), for chosen responses worse than the model's
    own: (B,) in and out."""
    h_w, h_l = log_ratios(inputs)
    losses = torch.sigmoid(loss.beta * h_w) + (1 - torch.sigmoid(loss.beta * (h_w - h_l)))
    return losses, *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "discopop",
    {"discopop_tau": Key(0.05, _positive, "> 0", "temperature of the blend between the logistic and exponential losses")},
    "DiscoPOP, Chris Lu et al. 2024 (arXiv:2406.08414), Eq. 5 (log-ratio modulated loss)",
    "DiscoPOP: logistic and exponential losses blended by sigmoid(beta d / tau)",
    "nats",
)
def discopop(inputs: ObjectiveInputs, loss):
    """DiscoPOP (Eq. 5; TRL's ``discopop``), (1 - m)(-log sigmoid(z)) + m exp(-z) with z = beta d and
    m = sigmoid(z / ``discopop_tau``): (B,) in and out."""
    h_w, h_l = log_ratios(inputs)
    z, tau = loss.beta * (h_w - h_l), loss.discopop_tau
    # m exp(-z) as exp(log sigmoid(z / tau) - z): finite for any z, where the product would be inf * 0 = nan
    losses = torch.sigmoid(-z / tau) * -F.logsigmoid(z) + torch.exp(F.logsigmoid(z / tau) - z)
    return losses, *pair_rewards(loss.beta, h_w, h_l)


@pairwise(
    "sigmoid_norm",
    {},
    "DPO (Rafailov et al. 2023, Eq. 7) on log-ratios divided by the response lengths (TRL's sigmoid_norm)",
    "DPO on length-normalised log-ratios: -log σ(β (h_w/|y_w| - h_l/|y_l|))",
    "nats, −log σ(β·per-token log-ratio gap)",
    needs=(*PAIR_LOGPS, "chosen_n_tokens", "rejected_n_tokens"),
)
def sigmoid_norm(inputs: ObjectiveInputs, loss):
    """DPO on length-normalised log-ratios (TRL's ``sigmoid_norm``), -log sigmoid(beta (h_w / |y_w| - h_l / |y_l|)) with
    |y| >= 1 the response-token counts: (B,) summed log-ratios in, (B,) losses out."""
    h_w, h_l = log_ratios(inputs)
    gap = h_w / inputs.chosen_n_tokens.clamp(min=1.0) - h_l / inputs.rejected_n_tokens.clamp(min=1.0)
    return -F.logsigmoid(loss.beta * gap), *pair_rewards(loss.beta, h_w, h_l)
