"""Preference-learning losses as pure tensor functions of (B,) log-probs log pi(y | x) in nats (SFT, DPO, cDPO, IPO),
and the objective registry that every objective plugs into."""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # the label of a position that carries no loss (prompt or padding)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The DPO loss (Rafailov et al. 2023, Eq. 7) of B pairs, or conservative DPO's (Mitchell 2023).

    L = -log sigmoid(beta h), h = (log pi(y_w|x) - log pi(y_l|x)) - (log ref(y_w|x) - log ref(y_l|x)); with
    eps = ``label_smoothing``, L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).

    Args:
        policy_chosen_logps, policy_rejected_logps: log pi(y_w|x), log pi(y_l|x), (B,), summed over response tokens.
        reference_chosen_logps, reference_rejected_logps: the same under the reference, (B,).
        beta: the KL penalty's weight, > 0.
        label_smoothing: eps, the assumed share of flipped labels, in [0, 0.5).
        reference_free: a uniform reference (log ref = 0).

    Returns:
        (losses, chosen_rewards, rejected_rewards), (B,) nats each; the rewards are beta (log pi - log ref) (Eq. 5),
        detached.
    """
    if reference_free:  # a uniform reference: log ref = 0
        reference_chosen_logps = torch.zeros_like(reference_chosen_logps)
        reference_rejected_logps = torch.zeros_like(reference_rejected_logps)
    h = (policy_chosen_logps - policy_rejected_logps) - (reference_chosen_logps - reference_rejected_logps)
    losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps).detach()  # Eq. 5's implicit rewards
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
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps).detach()  # DPO's implicit rewards (its Eq. 5)
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    return (h - 1 / (2 * beta)) ** 2, chosen_rewards, rejected_rewards


# ============================================================================ the objectives registry
# One declaration per objective (keys, inputs, function); the trainer names no objective. Adding one: docs/objectives.md.


class ObjectiveConfigError(ValueError):
    """A wrong ``loss.*`` value, in one sentence naming the key and the fix (train.py reports it as ``utils.ConfigError``)."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One ``loss.<key>`` an objective accepts."""

    default: object  # the value in config/loss/<name>.yaml (a test checks they agree)
    valid: Callable[[object], bool] | None = None  # None: any value of the default's type
    rule: str = ""  # the valid range in words, for the error sentence ("> 0", "in [0, 0.5)")
    doc: str = ""  # what the key means, one line


PAIR_LOGPS = ("policy_chosen_logps", "policy_rejected_logps", "reference_chosen_logps", "reference_rejected_logps")


@dataclasses.dataclass(frozen=True)
class Objective:
    """The declaration of objective ``loss=<name>``: its function, its keys and what the trainer computes for it."""

    name: str  # loss=<name> (TRL's loss_type name where TRL has it)
    fn: Callable  # (inputs: ObjectiveInputs, loss: the keys' values by name) -> (losses, chosen, rejected[, metrics]), (B,) each
    keys: dict  # the loss.* keys besides name
    source: str  # paper and equation
    summary: str  # one line for docs/objectives.md's table
    needs: tuple = PAIR_LOGPS  # the ObjectiveInputs fields fn reads (compute refuses inputs without one)
    reference: bool | str = True  # a key name: uses the reference unless that boolean key is true
    average_log_prob: bool | None = None  # log-probs are means per response token; None: as loss.average_log_prob says
    nll: bool = False  # uses the chosen NLL per token (policy_chosen_nll)
    unpaired: bool = False  # also trains on unpaired rows {prompt, completion, label}
    mismatched_kl: bool = False  # uses log-probs of mismatched prompt-completion pairs (KTO's reference point)
    score_head: bool = False  # trains a one-output score head (a reward model), not a policy
    sft_data: bool = False  # trains on each prompt's sft_target alone (no pairs)
    per_token: bool = False  # the batch loss sums over target tokens (SFT's per-token mean), not examples
    reward_metric: str = "rewards"  # metric name prefix of the rewards (rewards or scores)
    inputs: Callable | None = None  # (trainer, batch) -> ObjectiveInputs; None: the pairs' (trainers.BasicTrainer.pair_inputs)
    token_weights: Callable | None = None  # loss config -> sum_by_sequence's token_weight for the pairs; None: each weighs 1
    unit: str = "nats per example"  # the loss's unit, for plot axes
    couples_micro_batch: str = ""  # why one pair's loss depends on the micro-batch's other pairs ("": a per-pair sum)

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
        """The ``loss.*`` keys (name -> :class:`Key`) ``loss_config`` may set (a ``mix``'s depend on its components)."""
        return self.keys

    def uses_nll(self, loss_config) -> bool:
        """True if the chosen responses' NLL is needed (the function's own, or ``loss.nll_weight`` > 0)."""
        return self.nll or float(_get(loss_config, "nll_weight", 0.0) or 0.0) > 0

    @property
    def paired(self) -> bool:
        """True if it learns from (chosen, rejected) pairs of the same prompt."""
        return not (self.sft_data or self.score_head)

    def compute(self, inputs: ObjectiveInputs, loss_config, **overrides) -> ObjectiveOutput:
        """:attr:`fn` of ``inputs`` and the keys' values, plus ``loss.nll_weight`` times the chosen NLL per token (RPO,
        Pang et al. 2024, Eq. 1): per-example losses (B,), the detached rewards (B,) or None, and metrics by name.

        Args:
            inputs: what the trainer computed for B examples, (B,) tensors; the fields in :attr:`needs` are required.
            loss_config: the ``loss`` section; ``overrides`` win over it (the epoch's ``beta``), then the defaults.
        """
        nll_weight = float(loss_config.get("nll_weight", 0.0) or 0.0)
        needs = self.needs + (("policy_chosen_nll",) if nll_weight > 0 else ())
        missing = next((field for field in needs if getattr(inputs, field) is None), None)
        if missing is not None:
            raise ValueError(f"loss={self.name} needs {missing}, which the trainer did not compute.")
        values = {key: overrides.get(key, loss_config.get(key, spec.default)) for key, spec in self.keys.items()}
        per_example, chosen_rewards, rejected_rewards, *extra = self.fn(inputs, types.SimpleNamespace(**values))
        extra = extra[0] if extra else {}
        if nll_weight > 0:
            nll = inputs.policy_chosen_nll
            if inputs.label is not None:  # unpaired rows: only desirable completions are "chosen"
                nll = nll * inputs.label.to(nll.dtype)
            per_example = per_example + nll_weight * nll
            extra = {**extra, "nll": nll.detach()}
        return ObjectiveOutput(per_example, chosen_rewards, rejected_rewards, extra)


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
    policy_chosen_statistic: torch.Tensor | None = None  # mean per response of a token statistic of the policy's logits (WPO)
    policy_rejected_statistic: torch.Tensor | None = None


class ObjectiveOutput(NamedTuple):
    """An objective's result for one micro-batch: ``losses`` (B,), detached rewards (B,) or None, metric tensors by name."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor | None
    rejected_rewards: torch.Tensor | None
    metrics: dict


OBJECTIVES: dict[str, Objective] = {}  # every registered objective by name (loss=<name>)


def objective(name: str, **declaration) -> Callable:
    """Register the decorated ``fn(inputs, loss)`` as objective ``name`` (the other arguments: :class:`Objective`'s fields)
    and return it unchanged; ValueError for a taken name."""

    def register(fn: Callable) -> Callable:
        if name in OBJECTIVES:
            raise ValueError(f"objective {name!r} is registered twice.")
        OBJECTIVES[name] = Objective(name=name, fn=fn, **declaration)
        return fn

    return register


def get_objective(name: str) -> Objective:
    """The registered objective ``name``, else ObjectiveConfigError listing the registered names (with "did you mean")."""
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    close = difflib.get_close_matches(str(name), list(OBJECTIVES), n=1)
    hint = f"did you mean loss={close[0]}? " if close else ""
    raise ObjectiveConfigError(
        f"Unknown loss {name!r}; {hint}registered losses are {', '.join(sorted(OBJECTIVES))} (a file in objectives/ "
        "registers its losses when train.py imports that package)."
    )


def validate_loss_config(loss_config) -> Objective:
    """Check the ``loss`` section against its objective's declaration and return it (ObjectiveConfigError: key and fix)."""
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
        if spec.valid is not None and not _passes(spec.valid, value):
            raise ObjectiveConfigError(f"loss.{key} must be {spec.rule} for loss={decl.name}, got {value}.")
    return decl


def _passes(valid: Callable, value) -> bool:
    """``valid(value)``, False where the check itself fails on a value of another type (``"abc" >= 0``)."""
    try:
        return bool(valid(value))
    except (TypeError, ValueError):
        return False


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
    if isinstance(value, Sequence) and not isinstance(value, str):  # a list or a ListConfig
        return bool(value) and all(_positive(v) for v in value)
    return _positive(value)


def _non_negative(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


BETA = Key(0.1, _positive_or_list, "> 0 (or a list of values > 0, one per epoch)", "KL strength (the paper's beta)")
NLL_WEIGHT = Key(0.0, _non_negative, ">= 0", "weight of the chosen responses' NLL per token added to the loss (RPO)")
AVERAGE_LOG_PROB = Key(False, lambda v: isinstance(v, bool), "true or false", "length-normalised log-probs")


def sft_inputs(trainer, batch: dict) -> ObjectiveInputs:
    """SFT's inputs: each SFT target's (B,) log-prob under the policy (the ``chosen_*`` rows alone) and its target tokens."""
    chosen = {k: batch[f"chosen_{k}"] for k in ("input_ids", "attention_mask", "labels")}
    chosen.update({k: batch[k] for k in ("model_inputs",) if k in batch})  # each row's images (vision/)
    logps, n_tokens = trainer.one_side_logps(trainer.policy, chosen)
    return ObjectiveInputs(policy_chosen_logps=logps, chosen_n_tokens=n_tokens)


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
    needs=("policy_chosen_logps",),
    unit="nats per target token",
    inputs=sft_inputs,
)
def sft_objective(inputs: ObjectiveInputs, loss):
    """SFT as an objective: per-example -log pi(y | x) over the target tokens, no rewards; (B,) in and out."""
    return -inputs.policy_chosen_logps, None, None


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
def dpo_objective(inputs: ObjectiveInputs, loss):
    """DPO and conservative DPO as an objective: :func:`dpo_loss` of the trainer's log-probs and the loss keys.

    Args:
        inputs: the policy's and the reference's chosen and rejected log-probs (:data:`PAIR_LOGPS`), (B,) each.
        loss: ``beta``, ``label_smoothing``, ``reference_free`` (``config/loss/dpo.yaml``).
    """
    policy = inputs.policy_chosen_logps, inputs.policy_rejected_logps
    reference = inputs.reference_chosen_logps, inputs.reference_rejected_logps
    return dpo_loss(*policy, *reference, loss.beta, loss.label_smoothing, loss.reference_free)


@objective(
    "ipo",
    keys={"beta": BETA, "average_log_prob": Key(True, AVERAGE_LOG_PROB.valid, AVERAGE_LOG_PROB.rule), "nll_weight": NLL_WEIGHT},
    source="Azar et al. 2023, Eq. 17",
    summary="IPO: the log-ratio gap regressed to 1 / (2 beta)",
    unit="nats², (log-ratio gap − 1/(2β))²",
)
def ipo_objective(inputs: ObjectiveInputs, loss):
    """IPO as an objective: :func:`ipo_loss` of the trainer's (B,) log-probs (means per token by default) and ``beta``."""
    policy = inputs.policy_chosen_logps, inputs.policy_rejected_logps
    reference = inputs.reference_chosen_logps, inputs.reference_rejected_logps
    return ipo_loss(*policy, *reference, loss.beta)


REFERENCE_UPDATES: dict[str, type] = {}
"""``reference_update.mode`` -> the class that moves the reference during training (objectives/: TR-DPO, BEMA), set by
its plugin: built as ``cls(trainer)`` once the models are placed; ``step(step) -> dict`` (train metrics) after each
optimizer step; ``state_dict()``/``load_state_dict(state)``: what resume needs beyond the reference's weights;
``cls.check(update)``: None, or one sentence naming a wrong ``reference_update`` key."""
