"""Preference-learning losses and batch log-probabilities as pure tensor functions (B pairs, T tokens, V vocabulary;
log-probs log pi(y | x) in nats)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the label of a position that carries no loss (prompt or padding)


def get_batch_logps(
    logits: torch.Tensor, labels: torch.Tensor, average_log_prob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps, n_tokens), each (B,), of each sequence's labelled tokens from (B, T, V) ``logits`` and (B, T) ``labels``
    (position t predicts label t + 1): logps in nats, float32 (float64 for float64 logits), summed or, with
    ``average_log_prob``, per token; n_tokens float32; ValueError if the shapes disagree."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must share (B, T).")
    labels = labels[:, 1:]
    logits = logits[:, :-1, :]
    mask = labels != IGNORE_INDEX
    safe_labels = torch.where(mask, labels, 0)
    dtype = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 for float64 logits
    picked = torch.gather(logits, 2, safe_labels.unsqueeze(2)).squeeze(2).to(dtype)
    per_token = picked - torch.logsumexp(logits.to(dtype), dim=-1)  # no full-vocabulary log-softmax copy
    per_token = torch.where(mask, per_token, 0.0)  # not * mask: a NaN at a pad position must not leak
    n_tokens = mask.sum(-1).float()
    total = per_token.sum(-1)
    if average_log_prob:
        # A sequence with no labelled token gets 0, never NaN (0 / 0).
        return total / n_tokens.clamp(min=1.0), n_tokens
    return total, n_tokens


def gathered_token_logps(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N,) log softmax(logits[rows[k]])[targets[k]] in nats, float32 (float64 for float64 logits), from (M, V)
    ``logits`` and (N,) long ``rows`` and ``targets``; ValueError for other shapes."""
    if logits.dim() != 2 or rows.shape != targets.shape or rows.dim() != 1:
        raise ValueError(
            f"logits must be (M, V) and rows, targets (N,); got {tuple(logits.shape)}, {tuple(rows.shape)}, {tuple(targets.shape)}."
        )
    dtype = torch.promote_types(logits.dtype, torch.float32)
    picked = logits[rows, targets].to(dtype)
    return picked - torch.logsumexp(logits.to(dtype), dim=-1)[rows]  # logsumexp once per row, no log-softmax copy


def sum_by_sequence(token_logps, sequence, n_sequences: int, average_log_prob: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(logps, n_tokens), each (S = ``n_sequences``,), the sums (or means) of (N,) ``token_logps`` per (N,) ``sequence``:
    logps in nats, float32 (float64 for float64 input), n_tokens float32; a sequence without tokens gets 0."""
    total = torch.zeros(n_sequences, dtype=torch.promote_types(token_logps.dtype, torch.float32), device=token_logps.device)
    total = total.index_add(0, sequence, token_logps.to(total.dtype))
    ones = torch.ones_like(token_logps, dtype=torch.float32)
    n_tokens = torch.zeros(n_sequences, dtype=torch.float32, device=token_logps.device).index_add(0, sequence, ones)
    return (total / n_tokens.clamp(min=1.0) if average_log_prob else total), n_tokens


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO (Rafailov et al. 2023, Eq. 7), -log sigmoid(beta h), h = (log pi(y_w|x) - log pi(y_l|x)) - (log ref(y_w|x) -
    log ref(y_l|x)), or conservative DPO (Mitchell 2023) -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h), eps =
    ``label_smoothing``: (B,) log-probs in, (losses, chosen_rewards, rejected_rewards) out, (B,) nats each, the rewards
    detached beta (log pi - log ref) (Eq. 5)."""
    if reference_free:  # a uniform reference: log ref = 0
        reference_chosen_logps = torch.zeros_like(reference_chosen_logps)
        reference_rejected_logps = torch.zeros_like(reference_rejected_logps)
    h = (policy_chosen_logps - policy_rejected_logps) - (reference_chosen_logps - reference_rejected_logps)
    losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards


def ipo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IPO (Azar et al. 2023, Eq. 17, empirical form), (h - 1 / (2 beta))^2 on DPO's log-ratio gap h, ``beta`` the paper's
    tau > 0: (B,) log-probs in, (losses, chosen_rewards, rejected_rewards) out, each (B,), rewards as DPO's."""
    h = (policy_chosen_logps - policy_rejected_logps) - (reference_chosen_logps - reference_rejected_logps)
    losses = (h - 1 / (2 * beta)) ** 2
    return losses, *implicit_rewards(
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, beta
    )


def implicit_rewards(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards beta * (log pi(y|x) - log ref(y|x)) (Rafailov et al. 2023, Eq. 5, without the partition
    function), detached: (B,) inputs, (chosen_rewards, rejected_rewards) each (B,); ``reference_free``: reference 0."""
    if reference_free:
        reference_chosen_logps = torch.zeros_like(reference_chosen_logps)
        reference_rejected_logps = torch.zeros_like(reference_rejected_logps)
    chosen = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    return chosen, rejected


def sft_loss(policy_logps_sum: torch.Tensor, n_tokens_total: float | torch.Tensor) -> torch.Tensor:
    """Scalar SFT negative log-likelihood in nats per target token: -sum of (B,) ``policy_logps_sum`` / ``n_tokens_total``
    (the target tokens of the whole batch, all micro-batches)."""
    # divided by the whole batch's tokens: independent of sequence length and of the micro-batch split
    return -policy_logps_sum.sum() / n_tokens_total


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


# ============================================================================ the objectives registry
# One declaration per objective (inputs, loss.* keys, pure function); the trainer names no objective.
# Adding one: docs/objectives.md.


class ObjectiveConfigError(ValueError):
    """A wrong ``loss.*`` value, in one sentence naming the key and the fix (train.py reports it as ``utils.ConfigError``)."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One ``loss.<key>`` an objective accepts."""

    default: object  # the value in config/loss/<name>.yaml (a test checks they agree)
    valid: Callable[[object], bool] | None = None  # None: any value of the default's type
    rule: str = ""  # the valid range in words, for the error sentence ("> 0", "in [0, 0.5)")
    doc: str = ""  # what the key means, one line


@dataclasses.dataclass(frozen=True)
class Objective:
    """The declaration of one training objective ``loss=<name>``: its pure loss function, keys and what the trainer
    computes for it."""

    name: str  # loss=<name> (TRL's loss_type name where TRL has it)
    fn: Callable  # args named after ObjectiveInputs fields and keys; returns (losses, chosen, rejected[, metrics]), (B,) each
    keys: dict  # the loss.* keys besides name
    source: str  # paper and equation
    summary: str  # one line for docs/objectives.md's table
    reference: bool | str = True  # a key name: uses the reference unless that boolean key is true
    average_log_prob: bool | None = None  # log-probs are means per response token; None: as loss.average_log_prob says
    nll: bool = False  # uses the chosen NLL per token (policy_chosen_nll)
    unpaired: bool = False  # also trains on unpaired rows {prompt, completion, label}
    mismatched_kl: bool = False  # uses log-probs of mismatched prompt-completion pairs (KTO's reference point)
    score_head: bool = False  # trains a one-output score head (a reward model), not a policy
    sft_data: bool = False  # trains on each prompt's sft_target alone (no pairs)
    per_token: bool = False  # the batch loss sums over target tokens (SFT's per-token mean), not examples
    reward_metric: str = "rewards"  # metric name prefix of the rewards (rewards or scores)
    unit: str = "nats per example"  # the loss's unit, for plot axes

    def uses_reference(self, loss_config) -> bool:
        """True if, with ``loss_config`` (the ``loss`` section), the reference's log-probs are needed."""
        if isinstance(self.reference, str):
            return not bool(_get(loss_config, self.reference, self.keys[self.reference].default))
        return self.reference

    def averages(self, loss_config) -> bool:
        """True if the log-probs given to the function are means per response token."""
        if self.average_log_prob is not None:
            return self.average_log_prob
        return bool(_get(loss_config, "average_log_prob", self.keys.get("average_log_prob", Key(False)).default))

    def keys_for(self, loss_config) -> dict:
        """The ``loss.*`` keys (name -> :class:`Key`) ``loss_config`` may set (a ``mix``'s depend on its components;
        ObjectiveConfigError for bad ``losses``/``weights``)."""
        return self.keys

    def uses_nll(self, loss_config) -> bool:
        """True if the chosen responses' NLL is needed (the function's own, or ``loss.nll_weight`` > 0)."""
        return self.nll or float(_get(loss_config, "nll_weight", 0.0) or 0.0) > 0

    @property
    def paired(self) -> bool:
        """True if it learns from (chosen, rejected) pairs of the same prompt."""
        return not (self.sft_data or self.score_head)

    def compute(self, inputs: ObjectiveInputs, loss_config, **overrides) -> ObjectiveOutput:
        """Call :attr:`fn` with the inputs and keys it names (``overrides`` win over ``loss_config``), plus ``loss.nll_weight``
        times the chosen NLL per token (RPO, Pang et al. 2024, Eq. 1); ValueError for a missing input."""
        kwargs = {}
        for name, parameter in self._signature.items():
            if name in overrides:
                kwargs[name] = overrides[name]
            elif name in self.keys:
                kwargs[name] = _get(loss_config, name, self.keys[name].default)
            elif getattr(inputs, name, None) is not None:
                kwargs[name] = getattr(inputs, name)
            elif parameter.default is not None:  # None: an optional input (e.g. KTO's label), the function's default
                raise ValueError(f"loss={self.name} needs {name}, which the trainer did not compute.")
        per_example, chosen_rewards, rejected_rewards, *extra = self.fn(**kwargs)
        extra = extra[0] if extra else {}
        nll_weight = float(_get(loss_config, "nll_weight", 0.0) or 0.0)
        if nll_weight > 0:
            if inputs.policy_chosen_nll is None:
                raise ValueError(
                    f"loss.nll_weight > 0 needs the chosen NLL, which the trainer did not compute for loss={self.name}."
                )
            nll = inputs.policy_chosen_nll
            if inputs.label is not None:  # unpaired rows: only desirable completions are "chosen"
                nll = nll * inputs.label.to(nll.dtype)
            per_example = per_example + nll_weight * nll
            extra = {**extra, "nll": nll.detach()}
        return ObjectiveOutput(per_example, chosen_rewards, rejected_rewards, extra)

    def _parameters(self) -> list[str]:
        return list(self._signature)

    @functools.cached_property
    def _signature(self):
        """The function's parameters by name, read once (compute runs on every micro-batch)."""
        return inspect.signature(self.fn).parameters


@dataclasses.dataclass
class ObjectiveInputs:
    """What the trainer computed for one micro-batch of B examples, None where not asked for: (B,) float32 log-probs in
    nats, summed per response or, when the objective averages (:meth:`Objective.averages`), per token."""

    policy_chosen_logps: torch.Tensor | None = None  # log pi(y_w | x); unpaired rows: each completion's
    policy_rejected_logps: torch.Tensor | None = None  # log pi(y_l | x)
    reference_chosen_logps: torch.Tensor | None = None  # the same under the reference
    reference_rejected_logps: torch.Tensor | None = None
    chosen_n_tokens: torch.Tensor | None = None  # response-token counts, float32
    rejected_n_tokens: torch.Tensor | None = None
    policy_chosen_nll: torch.Tensor | None = None  # -log pi(y_w | x) / |y_w|, the chosen NLL per token
    chosen_scores: torch.Tensor | None = None  # a score head's outputs (reward models)
    rejected_scores: torch.Tensor | None = None
    policy_kl_logps: torch.Tensor | None = None  # log-probs of mismatched pairs (x_i, y_{i+1})
    reference_kl_logps: torch.Tensor | None = None
    label: torch.Tensor | None = None  # bool, unpaired rows only: the completion is desirable


class ObjectiveOutput(NamedTuple):
    """An objective's result for one micro-batch: ``losses`` (B,), detached rewards (B,) each (or None),
    and extra per-example metric tensors by name."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor | None
    rejected_rewards: torch.Tensor | None
    metrics: dict


OBJECTIVES: dict[str, Objective] = {}  # every registered objective by name (loss=<name>)


def objective(name: str, **declaration) -> Callable:
    """Register the decorated function as objective ``name`` (the other arguments: :class:`Objective`'s fields) and return
    it unchanged; ValueError for a taken name or an argument that is neither an input field nor a declared key."""

    def register(fn: Callable) -> Callable:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is registered twice.")
        decl = Objective(name=name, fn=fn, **declaration)
        fields = {f.name for f in dataclasses.fields(ObjectiveInputs)}
        unknown = [p for p in decl._parameters() if p not in fields and p not in decl.keys]
        if unknown:
            raise ValueError(f"objective {name!r}: argument {unknown[0]!r} is neither an input nor a declared key.")
        OBJECTIVES[name] = decl
        return fn

    return register


def get_objective(name: str) -> Objective:
    """The registered objective ``name``, else ObjectiveConfigError listing the registered names (with "did you mean")."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    close = difflib.get_close_matches(str(name), list(OBJECTIVES), n=1)
    hint = f"did you mean loss={close[0]}? " if close else ""
    raise ObjectiveConfigError(f"Unknown loss {name!r}; {hint}registered losses are {', '.join(sorted(OBJECTIVES))}.")


def validate_loss_config(loss_config) -> Objective:
    """Check the ``loss`` section against its objective's declaration and return the objective (ObjectiveConfigError
    names the first bad key and the fix)."""
    decl = get_objective(loss_config["name"])
    keys = decl.keys_for(loss_config)
    allowed = {"name", *keys}
    extra = sorted(k for k in loss_config if k not in allowed)
    if extra:
        owners = sorted(name for name, other in OBJECTIVES.items() if extra[0] in other.keys)
        hint = f"; {extra[0]} is a key of loss={', loss='.join(owners)}" if owners else ""
        raise ObjectiveConfigError(f"loss={decl.name} has no key {extra[0]!r} (its keys: {sorted(allowed)}){hint}; remove it.")
    for key, spec in keys.items():
        value = _get(loss_config, key, spec.default)
        if value is None and spec.default is not None:
            raise ObjectiveConfigError(f"loss={decl.name} needs loss.{key} (e.g. loss.{key}={spec.default}).")
        if spec.valid is not None and not spec.valid(value):
            raise ObjectiveConfigError(f"loss.{key} must be {spec.rule} for loss={decl.name}, got {value}.")
    return decl


def _get(mapping, key: str, default):
    """``mapping[key]``, or ``default`` when the key is absent (dicts and DictConfigs alike)."""
    try:
        return mapping[key] if key in mapping else default
    except TypeError:
        return default


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _positive_or_list(value) -> bool:
    """A number > 0, or a non-empty list of them (one per epoch; the last repeats)."""
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and not isinstance(value, (str, dict))):
        values = list(value)
        return bool(values) and all(_positive(v) for v in values)
    return _positive(value)


def _non_negative(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


BETA = Key(0.1, _positive_or_list, "> 0 (or a list of values > 0, one per epoch)", "KL strength (the paper's beta)")
NLL_WEIGHT = Key(0.0, _non_negative, ">= 0", "weight of the chosen responses' NLL per token added to the loss (RPO)")
AVERAGE_LOG_PROB = Key(False, lambda v: isinstance(v, bool), "true or false", "length-normalised log-probs")


@objective(
    "sft",
    keys={
        "all_assistant_turns": Key(
            False, lambda v: isinstance(v, bool), "true or false", "also train on the prompt's assistant turns"
        )
    },
    source="negative log-likelihood of the SFT targets",
    summary="supervised fine-tuning on each prompt's preferred response",
    reference=False,
    average_log_prob=False,
    sft_data=True,
    per_token=True,
    unit="nats per target token",
)
def sft_objective(policy_chosen_logps: torch.Tensor):
    """SFT as an objective: per-example -log pi(y | x) over the target tokens, no rewards; (B,) in and out."""
    return -policy_chosen_logps, None, None


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


@objective(
    "dpo",
    keys={
        "beta": BETA,
        "label_smoothing": Key(0.0, lambda v: _non_negative(v) and v < 0.5, "in [0, 0.5)", "assumed label-flip rate (cDPO)"),
        "reference_free": Key(False, lambda v: isinstance(v, bool), "true or false", "a uniform reference"),
        "average_log_prob": AVERAGE_LOG_PROB,
        "nll_weight": NLL_WEIGHT,
    },
    source="Rafailov et al. 2023, Eq. 7; conservative DPO: Mitchell 2023",
    summary="DPO (TRL's sigmoid); conservative DPO with label_smoothing > 0",
    reference="reference_free",
    unit="nats, −log σ(β·log-ratio gap)",
)
@functools.wraps(dpo_loss, assigned=())  # its signature, read by Objective.compute
def dpo_objective(*args, **kwargs):
    """:func:`dpo_loss` as an objective, looked up at each call (with ``reference_free`` the trainer passes zeros)."""
    return dpo_loss(*args, **kwargs)


@objective(
    "ipo",
    keys={"beta": BETA, "average_log_prob": Key(True, AVERAGE_LOG_PROB.valid, AVERAGE_LOG_PROB.rule), "nll_weight": NLL_WEIGHT},
    source="Azar et al. 2023, Eq. 17",
    summary="IPO: the log-ratio gap regressed to 1 / (2 beta)",
    unit="nats², (log-ratio gap − 1/(2β))²",
)
@functools.wraps(ipo_loss, assigned=())
def ipo_objective(*args, **kwargs):
    """:func:`ipo_loss` as an objective, looked up at each call."""
    return ipo_loss(*args, **kwargs)


# ---------------------------------------------------------------------------- TRL's pairwise family
# DPOTrainer's loss_types beyond sigmoid and ipo, and loss=mix. Notation: h_w = log pi(y_w|x) - log ref(y_w|x),
# h_l likewise, d = h_w - h_l, on summed log-probs (TRL's convention); rewards beta * h_w, beta * h_l.


def _log_ratios(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps):
    """(h_w, h_l): the chosen and rejected log-ratios log pi - log ref, (B,) each."""
    return policy_chosen_logps - reference_chosen_logps, policy_rejected_logps - reference_rejected_logps


def _pair_rewards(beta, chosen_logratios, rejected_logratios):
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

_PAIR_LOGPS = ("policy_chosen_logps", "policy_rejected_logps", "reference_chosen_logps", "reference_rejected_logps")


def _hinge(h_w, h_l, beta):
    """SLiC-HF's calibration loss max(0, 1 - beta d) on the reference-corrected gap (Zhao et al. 2023, arXiv:2305.10425;
    TRL's ``hinge``), 1/beta the paper's margin delta: (B,) in and out."""
    return torch.relu(1 - beta * (h_w - h_l))


def _exo_pair(h_w, h_l, beta, label_smoothing):
    """EXO for pairs (Ji et al. 2024, arXiv:2402.00856, Eq. 16, K = 2), KL(q || p) = q_w (log q_w - log(1 - eps)) +
    q_l (log q_l - log eps) with q = (sigmoid(beta d), sigmoid(-beta d)) and eps = ``label_smoothing`` in (0, 1): (B,) in and
    out, in nats."""
    z = beta * (h_w - h_l)
    log_q_w, log_q_l = F.logsigmoid(z), F.logsigmoid(-z)
    return log_q_w.exp() * (log_q_w - math.log1p(-label_smoothing)) + log_q_l.exp() * (log_q_l - math.log(label_smoothing))


def _nca_pair(h_w, h_l, beta):
    """NCA for pairs (Chen et al. 2024, arXiv:2402.05369; TRL's ``nca_pair``), -log sigmoid(r_w) - 1/2 log sigmoid(-r_w)
    - 1/2 log sigmoid(-r_l) with r = beta h: (B,) in and out, in nats."""
    r_w, r_l = beta * h_w, beta * h_l
    return -F.logsigmoid(r_w) - 0.5 * F.logsigmoid(-r_w) - 0.5 * F.logsigmoid(-r_l)


def _robust(h_w, h_l, beta, label_smoothing):
    """Robust DPO (Chowdhury et al. 2024, arXiv:2403.00409), ((1 - eps)(-log sigmoid(beta d)) - eps (-log sigmoid(-beta d)))
    / (1 - 2 eps), unbiased for labels flipped with probability eps = ``label_smoothing`` (unbounded below for eps > 0):
    (B,) in and out."""
    z = beta * (h_w - h_l)
    eps = label_smoothing
    return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)


def _bco_pair(h_w, h_l, beta):
    """BCO on pairs (Jung et al. 2024, arXiv:2404.04656; TRL's ``bco_pair``), -log sigmoid(beta h_w) - log sigmoid(-beta h_l)
    with the reward shift delta = 0 as in TRL: (B,) in and out, in nats."""
    return -F.logsigmoid(beta * h_w) - F.logsigmoid(-beta * h_l)


def _sppo_hard(h_w, h_l, beta):
    """SPPO (Wu et al. 2024, arXiv:2405.00675, Eq. 4.7 with P = 1 / 0 and eta = 1 / beta; TRL's ``sppo_hard``),
    (h_w - 1 / (2 beta))^2 + (h_l + 1 / (2 beta))^2 on summed log-ratios: (B,) in and out."""
    return (h_w - 0.5 / beta) ** 2 + (h_l + 0.5 / beta) ** 2


def _aot(
    h_w, h_l, beta, label_smoothing, policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps
):
    """AOT, paired (Melnyk et al. 2024, arXiv:2406.05882; TRL's ``aot``), -(1 - eps) log sigmoid(beta delta_i) - eps log
    sigmoid(-beta delta_i) with delta = sort(m_policy) - sort(m_reference) over the micro-batch, m = log pi(y_w) - log pi(y_l):
    (B,) in and out, loss i belonging to a rank, not to example i."""
    margins = torch.sort(policy_chosen_logps - policy_rejected_logps, dim=0).values
    reference_margins = torch.sort(reference_chosen_logps - reference_rejected_logps, dim=0).values
    return _smoothed_logistic(beta * (margins - reference_margins), label_smoothing)


def _aot_unpaired(h_w, h_l, beta, label_smoothing):
    """AOT, unpaired (Melnyk et al. 2024, arXiv:2406.05882; TRL's ``aot_unpaired``), as :func:`_aot` with
    delta = sort(h_w) - sort(h_l): (B,) in and out, loss i belonging to a rank."""
    delta = torch.sort(h_w, dim=0).values - torch.sort(h_l, dim=0).values
    return _smoothed_logistic(beta * delta, label_smoothing)


def _apo_zero(h_w, h_l, beta):
    """APO-zero (D'Oosterlinck et al. 2024, arXiv:2408.06266, Eq. 7), (1 - sigmoid(beta h_w)) + sigmoid(beta h_l), for
    chosen responses better than the model's own: (B,) in and out."""
    return (1 - torch.sigmoid(beta * h_w)) + torch.sigmoid(beta * h_l)


def _apo_down(h_w, h_l, beta):
    """APO-down (D'Oosterlinck et al. 2024, arXiv:2408.06266, Eq. 8), sigmoid(beta h_w) + (1 - sigmoid(beta (h_w - h_l))),
    for chosen responses worse than the model's own: (B,) in and out."""
    return torch.sigmoid(beta * h_w) + (1 - torch.sigmoid(beta * (h_w - h_l)))


def _discopop(h_w, h_l, beta, discopop_tau):
    """DiscoPOP (Chris Lu et al. 2024, arXiv:2406.08414, Eq. 5; TRL's ``discopop``), (1 - m)(-log sigmoid(z)) + m exp(-z)
    with z = beta d and m = sigmoid(z / ``discopop_tau``): (B,) in and out."""
    z = beta * (h_w - h_l)
    # m exp(-z) as exp(log sigmoid(z / tau) - z): finite for any z, where the product would be inf * 0 = nan
    return torch.sigmoid(-z / discopop_tau) * -F.logsigmoid(z) + torch.exp(F.logsigmoid(z / discopop_tau) - z)


def _sigmoid_norm(h_w, h_l, chosen_n_tokens, rejected_n_tokens, beta):
    """DPO (Rafailov et al. 2023, Eq. 7) on length-normalised log-ratios (TRL's ``sigmoid_norm``),
    -log sigmoid(beta (h_w / |y_w| - h_l / |y_l|)) with |y| >= 1 the response-token counts: (B,) summed log-ratios in,
    (B,) losses out."""
    gap = h_w / chosen_n_tokens.clamp(min=1.0) - h_l / rejected_n_tokens.clamp(min=1.0)
    return -F.logsigmoid(beta * gap)


# loss=<name>: (its (B,) loss of h_w, h_l and what else it names, its keys besides beta and nll_weight, source, summary, unit)
_PAIRWISE = {
    "hinge": (
        _hinge,
        {},
        "SLiC-HF, Zhao et al. 2023 (arXiv:2305.10425), its calibration loss with the reference (TRL)",
        "SLiC's hinge on the DPO gap: relu(1 - beta d)",
        "margin units, relu(1 − β·log-ratio gap)",
    ),
    "exo_pair": (
        _exo_pair,
        {"label_smoothing": Key(1e-3, _in_unit_interval, "in (0, 1)", "eps of the target distribution [1 - eps, eps]")},
        "EXO, Ji et al. 2024 (arXiv:2402.00856), Eq. 16 (EXO-pref, K = 2)",
        "EXO: reverse KL from softmax(beta h) over the pair to the target [1 - eps, eps]",
        "nats, KL(q_θ ‖ [1−ε, ε])",
    ),
    "nca_pair": (
        _nca_pair,
        {},
        "NCA, Chen et al. 2024 (arXiv:2402.05369), the pairwise NCA loss",
        "NCA: -log σ(β h_w) - ½ log σ(-β h_w) - ½ log σ(-β h_l) (absolute, not relative, likelihoods)",
        "nats",
    ),
    "robust": (
        _robust,
        {"label_smoothing": Key(0.0, _below_half, "in [0, 0.5)", "assumed label-flip rate eps (0: plain DPO)")},
        "robust DPO, Chowdhury et al. 2024 (arXiv:2403.00409), the unbiased rDPO loss",
        "rDPO: DPO de-biased for labels flipped with probability eps",
        "nats (may be negative when eps > 0)",
    ),
    "bco_pair": (
        _bco_pair,
        {},
        "BCO, Jung et al. 2024 (arXiv:2404.04656), on pairs without the reward shift (TRL)",
        "BCO: a binary classifier, chosen reward > 0 and rejected reward < 0",
        "nats",
    ),
    "sppo_hard": (
        _sppo_hard,
        {},
        "SPPO, Wu et al. 2024 (arXiv:2405.00675), Eq. 4.7 with hard probabilities P = 1 / 0",
        "SPPO (hard): h_w regressed to 1/(2β), h_l to -1/(2β)",
        "nats², squared log-ratio errors",
    ),
    "aot": (
        _aot,
        {"label_smoothing": PAIR_LABEL_SMOOTHING},
        "AOT, Melnyk et al. 2024 (arXiv:2406.05882), paired: sorted policy vs sorted reference margins",
        "AOT (paired): DPO between the sorted policy and reference margins of the micro-batch",
        "nats",
    ),
    "aot_unpaired": (
        _aot_unpaired,
        {"label_smoothing": PAIR_LABEL_SMOOTHING},
        "AOT, Melnyk et al. 2024 (arXiv:2406.05882), unpaired: sorted chosen vs sorted rejected log-ratios",
        "AOT (unpaired): DPO between the sorted chosen and sorted rejected log-ratios of the micro-batch",
        "nats",
    ),
    "apo_zero": (
        _apo_zero,
        {},
        "APO, D'Oosterlinck et al. 2024 (arXiv:2408.06266), Eq. 7 (APO-zero)",
        "APO-zero: raise the chosen likelihood, lower the rejected (chosen better than the model)",
        "probability units, in [0, 2]",
    ),
    "apo_down": (
        _apo_down,
        {},
        "APO, D'Oosterlinck et al. 2024 (arXiv:2408.06266), Eq. 8 (APO-down)",
        "APO-down: lower both likelihoods, the rejected more (chosen worse than the model)",
        "probability units, in [0, 2]",
    ),
    "discopop": (
        _discopop,
        {"discopop_tau": Key(0.05, _positive, "> 0", "temperature of the blend between the logistic and exponential losses")},
        "DiscoPOP, Chris Lu et al. 2024 (arXiv:2406.08414), Eq. 5 (log-ratio modulated loss)",
        "DiscoPOP: logistic and exponential losses blended by sigmoid(beta d / tau)",
        "nats",
    ),
    "sigmoid_norm": (
        _sigmoid_norm,
        {},
        "DPO (Rafailov et al. 2023, Eq. 7) on log-ratios divided by the response lengths (TRL's sigmoid_norm)",
        "DPO on length-normalised log-ratios: -log σ(β (h_w/|y_w| - h_l/|y_l|))",
        "nats, −log σ(β·per-token log-ratio gap)",
    ),
}


class _PairObjective:
    """The objective function of a pairwise ``loss(h_w, h_l, ...)``: the four (B,) log-probs and what else ``loss`` names
    (``beta``, its keys, other inputs) in, (losses, beta * h_w, beta * h_l detached) out, (B,) each."""

    def __init__(self, loss: Callable):
        self.loss = loss
        self.named = [p for p in inspect.signature(loss).parameters if p not in ("h_w", "h_l")]
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
        self.__signature__ = inspect.Signature([inspect.Parameter(p, kind) for p in dict.fromkeys([*_PAIR_LOGPS, *self.named])])
        self.__name__ = loss.__name__.lstrip("_") + "_objective"
        self.__doc__ = loss.__doc__

    def __call__(self, *args, **kwargs):
        values = self.__signature__.bind(*args, **kwargs).arguments
        h_w, h_l = _log_ratios(*(values[p] for p in _PAIR_LOGPS))
        return self.loss(h_w, h_l, **{p: values[p] for p in self.named}), *_pair_rewards(values["beta"], h_w, h_l)


def _register_pairwise() -> None:
    """Register each of :data:`_PAIRWISE` (TRL's ``loss_type=name``): keys ``beta``, its own, then ``nll_weight``; uses the
    reference; summed log-probs."""
    for name, (loss, keys, source, summary, unit) in _PAIRWISE.items():
        declaration = {"source": source, "summary": summary, "reference": True, "average_log_prob": False, "unit": unit}
        objective(name, keys={"beta": BETA, **keys, "nll_weight": NLL_WEIGHT}, **declaration)(_PairObjective(loss))


_register_pairwise()


# ---- loss=mix: sum_k weights[k] * (per-example loss of losses[k]); component nll is the chosen NLL per token
# (TRL's loss_type "sft"); the other keys are the components' keys, one value shared by all that have it, as in TRL.

MIX_NLL = "nll"


def _mixable(decl: Objective) -> bool:
    """True if ``decl`` can be a component of ``loss=mix``: a paired objective on (chosen,
    rejected) log-probs with a per-example loss."""
    return decl.paired and not (decl.unpaired or decl.mismatched_kl or decl.per_token) and not isinstance(decl, MixObjective)


def _is_list(value) -> bool:
    return not isinstance(value, (str, bytes, dict)) and hasattr(value, "__iter__") and hasattr(value, "__len__")


def _mix_keys(loss_config) -> dict:
    """The keys of a ``mix`` of ``loss_config``'s ``losses``: ``losses``, ``weights``, each component's keys (the first's
    default, every component's range; not ``average_log_prob``), ``nll_weight``; ObjectiveConfigError for bad
    ``losses``/``weights``."""
    names = _get(loss_config, "losses", MIX_LOSSES.default)
    choices = sorted([n for n, d in OBJECTIVES.items() if _mixable(d)] + [MIX_NLL])
    if not _is_list(names) or not list(names) or not all(isinstance(n, str) for n in names):
        raise ObjectiveConfigError(
            f"loss.losses must be a non-empty list of objective names (e.g. [dpo, bco_pair, nll]) for loss=mix, got {names}."
        )
    names = list(names)
    for name in names:
        if name == "sft":
            raise ObjectiveConfigError(
                "loss.losses of loss=mix names 'sft'; write 'nll' for the chosen responses' NLL per token "
                "(TRL's loss_type sft; loss=sft is SFT on targets alone)."
            )
        if name != MIX_NLL and not (name in OBJECTIVES and _mixable(OBJECTIVES[name])):
            close = difflib.get_close_matches(name, choices, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ObjectiveConfigError(
                f"loss.losses of loss=mix names {name!r}, which is not a pairwise objective; {hint}choose from {', '.join(choices)}."
            )
    duplicate = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if duplicate is not None:
        raise ObjectiveConfigError(f"loss.losses of loss=mix names {duplicate} twice; give it once with the summed weight.")
    weights = _get(loss_config, "weights", MIX_WEIGHTS.default)
    if not _is_list(weights) or not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
        raise ObjectiveConfigError(
            f"loss.weights must be a list of numbers, one per entry of loss.losses, for loss=mix, got {weights}."
        )
    weights = list(weights)
    if len(weights) != len(names):
        raise ObjectiveConfigError(
            f"loss.weights has {len(weights)} entries but loss.losses has {len(names)} ({', '.join(names)}); give one weight per loss."
        )
    negative = next((i for i, w in enumerate(weights) if w < 0), None)
    if negative is not None:
        raise ObjectiveConfigError(
            f"loss.weights[{negative}] (the weight of {names[negative]}) is {weights[negative]}; weights must be >= 0."
        )
    keys = {"losses": MIX_LOSSES, "weights": MIX_WEIGHTS}
    for name in names:
        if name == MIX_NLL:
            continue
        for key, spec in OBJECTIVES[name].keys.items():
            if key in ("average_log_prob", "nll_weight"):
                continue
            if key not in keys:
                keys[key] = spec
            elif spec.rule != keys[key].rule:  # both ranges apply to the one shared value
                first = keys[key]
                keys[key] = Key(
                    first.default,
                    lambda v, a=first, b=spec: (a.valid is None or a.valid(v)) and (b.valid is None or b.valid(v)),
                    f"{first.rule} and {spec.rule} ({name} shares it)",
                    first.doc,
                )
    keys["nll_weight"] = NLL_WEIGHT
    return keys


@dataclasses.dataclass(frozen=True)
class MixObjective(Objective):
    """``loss=mix``: a weighted sum of registered pairwise objectives and ``nll``, on summed log-probs
    (per-token means for an averaging component such as ``ipo``)."""

    def keys_for(self, loss_config) -> dict:
        """See :func:`_mix_keys` (raises :class:`ObjectiveConfigError` for bad ``losses``/``weights``)."""
        return _mix_keys(loss_config)

    def resolved(self, loss_config, overrides: dict | None = None) -> dict:
        """Every key's value (``overrides``, else ``loss_config``, else the default); lists as lists."""
        overrides = overrides or {}
        values = {}
        for key, spec in self.keys_for(loss_config).items():
            value = overrides[key] if key in overrides else _get(loss_config, key, spec.default)
            values[key] = list(value) if _is_list(value) else value
        return values

    def components(self, loss_config) -> list[Objective]:
        """The component objectives (without ``nll``)."""
        return [OBJECTIVES[n] for n in self.resolved(loss_config)["losses"] if n != MIX_NLL]

    def uses_reference(self, loss_config) -> bool:
        """True if any component uses the reference."""
        values = self.resolved(loss_config)
        return any(c.uses_reference(values) for c in self.components(values))

    def averages(self, loss_config) -> bool:
        """False: a mix takes summed log-probs (and averages them for a component that averages)."""
        return False

    def uses_nll(self, loss_config) -> bool:
        """True if ``nll`` is a component, ``loss.nll_weight`` > 0, or a component needs the NLL."""
        values = self.resolved(loss_config)
        return MIX_NLL in values["losses"] or values["nll_weight"] > 0 or any(c.uses_nll(values) for c in self.components(values))

    def compute(self, inputs: ObjectiveInputs, loss_config, **overrides) -> ObjectiveOutput:
        """The weighted sum of the components' (B,) losses (metrics ``loss_<component>``, unweighted) plus ``loss.nll_weight``
        times the chosen NLL, as :meth:`Objective.compute`; rewards beta * (log pi - log ref) on sums, None without ``beta``."""
        values = self.resolved(loss_config, overrides)
        inner = {**values, "nll_weight": 0.0}
        parts, metrics = [], {}
        for name in values["losses"]:
            if name == MIX_NLL:
                if inputs.policy_chosen_nll is None:
                    raise ValueError("loss=mix with nll needs policy_chosen_nll, which the trainer did not compute.")
                part = inputs.policy_chosen_nll
            else:
                component = OBJECTIVES[name]
                view = _per_token_view(inputs) if component.averages(inner) else inputs
                part = component.compute(view, inner).losses
            parts.append(part)
            metrics[f"loss_{name}"] = part.detach()
        losses = weighted_sum(parts, values["weights"])
        chosen_rewards = rejected_rewards = None
        if "beta" in values:
            h_w, h_l = _log_ratios(
                inputs.policy_chosen_logps,
                inputs.policy_rejected_logps,
                inputs.reference_chosen_logps,
                inputs.reference_rejected_logps,
            )
            chosen_rewards, rejected_rewards = _pair_rewards(values["beta"], h_w, h_l)
        if values["nll_weight"] > 0:
            if inputs.policy_chosen_nll is None:
                raise ValueError("loss.nll_weight > 0 needs the chosen NLL, which the trainer did not compute for loss=mix.")
            losses = losses + values["nll_weight"] * inputs.policy_chosen_nll
            metrics["nll"] = inputs.policy_chosen_nll.detach()
        return ObjectiveOutput(losses, chosen_rewards, rejected_rewards, metrics)


def weighted_sum(parts: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """sum_k weights[k] * parts[k]: (B,) per-example losses, one weight each (>= 0)."""
    total = torch.zeros_like(parts[0])
    for part, weight in zip(parts, weights, strict=True):
        total = total + float(weight) * part
    return total


def _per_token_view(inputs: ObjectiveInputs) -> ObjectiveInputs:
    """``inputs`` with the four summed log-probs divided by their response-token counts (>= 1)."""
    n_w, n_l = inputs.chosen_n_tokens.clamp(min=1.0), inputs.rejected_n_tokens.clamp(min=1.0)
    return dataclasses.replace(
        inputs,
        policy_chosen_logps=inputs.policy_chosen_logps / n_w,
        policy_rejected_logps=inputs.policy_rejected_logps / n_l,
        reference_chosen_logps=inputs.reference_chosen_logps / n_w,
        reference_rejected_logps=inputs.reference_rejected_logps / n_l,
    )


MIX_LOSSES = Key(["dpo"], _is_list, "a non-empty list of pairwise objective names and nll", "the components")
MIX_WEIGHTS = Key([1.0], _is_list, "a list of numbers >= 0, one per entry of loss.losses", "one weight per component")

if "mix" in OBJECTIVES:
    raise ValueError("objective 'mix' is registered twice.")
OBJECTIVES["mix"] = MixObjective(
    name="mix",
    fn=weighted_sum,
    keys=_mix_keys({}),
    source="a weighted sum of objectives (TRL's loss_type list with loss_weights); MPO: Wang et al. 2024 (arXiv:2411.10442)",
    summary="weights · (the listed objectives' losses); config/loss/mpo.yaml is MPO",
    average_log_prob=False,
    unit="nats per example, weighted sum of the components' losses",
)


# ---------------------------------------------------------------------------- end of the pairwise family


# ---------------------------------------------------------------- reference-free objectives (SimPO, CPO, ORPO) and KTO

LABEL_SMOOTHING = Key(
    0.0, lambda v: _non_negative(v) and v < 0.5, "in [0, 0.5)", "assumed label-flip rate (conservative loss, as TRL's CPO)"
)


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
    unit="nats, −log σ(β·avg log-prob gap − γ)",
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
    unit="nats, −log σ(β·log-prob gap) + α·NLL per token",
)
def cpo_objective(policy_chosen_logps, policy_rejected_logps, policy_chosen_nll, beta, label_smoothing, cpo_alpha):
    """CPO (Xu et al. 2024, Eq. 3 plus the NLL term; TRL CPOTrainer's ``sigmoid``), -(1 - eps) log sigmoid(beta (log pi(y_w|x)
    - log pi(y_l|x))) - eps log sigmoid(-...) + cpo_alpha * NLL(y_w): (B,) summed log-probs and NLL per token in, (B,) losses,
    rewards beta * log pi(y|x) detached and metric ``nll`` out."""
    losses = _smoothed_logistic(beta * (policy_chosen_logps - policy_rejected_logps), label_smoothing)
    losses = losses + cpo_alpha * policy_chosen_nll
    chosen_rewards = beta * policy_chosen_logps.detach()
    rejected_rewards = beta * policy_rejected_logps.detach()
    return losses, chosen_rewards, rejected_rewards, {"nll": policy_chosen_nll.detach()}


def log_odds(avg_logps: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) for p = exp(``avg_logps``), computed stably; (B,) in (nats, <= 0), (B,) out."""
    x = avg_logps.clamp(max=-torch.finfo(avg_logps.dtype).eps)  # p = 1 gives a finite value and gradient, not inf / NaN
    # log(1 - e^x) as Mächler 2012 recommends: log(-expm1(x)) for x > -ln 2, log1p(-exp(x)) below
    log_one_minus_p = torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))
    return x - log_one_minus_p


@objective(
    "orpo",
    keys={"beta": Key(0.1, _positive_or_list, BETA.rule, "weight lambda of the odds-ratio term (TRL's beta)")},
    source="Hong et al. 2024, Eqs. 6-7",
    summary="ORPO: chosen NLL plus lambda times an odds-ratio preference loss, no reference",
    reference=False,
    average_log_prob=True,
    nll=True,
    unit="nats, NLL per token + λ·(−log σ(log odds ratio))",
)
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


# ---------------------------------------------------------------------------- end of reference-free and KTO


def objectives_table() -> str:
    """docs/objectives.md's Markdown table of the registered objectives, with their sources and ``loss.*`` defaults."""
    rows = [
        "| `loss=` | objective | source | reference | log-probs | keys (defaults) |",
        "|---|---|---|---|---|---|",
    ]
    for name, decl in sorted(OBJECTIVES.items()):
        keys = decl.keys_for({}) if hasattr(decl, "keys_for") else decl.keys
        if isinstance(decl.reference, str):
            reference = f"yes (none with `{decl.reference}=true`)"
        else:
            reference = "yes" if decl.reference else "no"
        if decl.score_head:
            logps = "score head"
        elif decl.average_log_prob is None:
            logps = "per token" if keys["average_log_prob"].default else "summed"
            logps += " (`average_log_prob`)"
        else:
            logps = "per token" if decl.average_log_prob else "summed"
        defaults = ", ".join(f"`{k}={_yaml_value(spec.default)}`" for k, spec in keys.items()) or "none"
        cells = [f"`{name}`", decl.summary, decl.source, reference, logps, defaults]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def _yaml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml_value(v) for v in value) + "]"
    return "null" if value is None else str(value)
