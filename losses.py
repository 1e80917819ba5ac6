"""Preference-learning losses and batch log-probabilities.

Every function here is pure: tensors in, tensors out, no model and no config.
The trainers call them; a new loss never touches a trainer's sharding code.

Notation (shared by all functions):
    B  number of preference pairs (or SFT sequences) in the batch
    T  sequence length (tokens), V vocabulary size
    logps  log-probability of a whole response, log pi(y | x), in nats
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label value marking a position that carries no loss (prompt or padding)."""


def get_batch_logps(
    logits: torch.Tensor, labels: torch.Tensor, average_log_prob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each sequence's labelled tokens under the given logits.

    Position t of ``logits`` predicts token t + 1 of ``labels``; positions whose
    label is ``IGNORE_INDEX`` (-100: the prompt and the padding) are excluded, so
    the result does not depend on how much padding there is or on which side.
    Computed in float32 whatever the logits' dtype, as ``logit[label] -
    logsumexp(logits)``, so no full-vocabulary log-softmax copy is made.

    Args:
        logits: (B, T, V) unnormalised scores from a causal LM.
        labels: (B, T) token ids, ``IGNORE_INDEX`` where no loss is wanted.
        average_log_prob: if True return the mean log-prob per labelled token
            (length-normalised, as IPO's authors use), else the sum.

    Returns:
        (logps, n_tokens): logps of shape (B,) in nats (sum, or mean per token),
        and n_tokens of shape (B,), the number of labelled tokens (float32).

    Raises:
        ValueError: if logits and labels disagree in batch size or length.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must share (B, T).")
    labels = labels[:, 1:]
    logits = logits[:, :-1, :]
    mask = labels != IGNORE_INDEX
    safe_labels = torch.where(mask, labels, 0)
    picked = torch.gather(logits, 2, safe_labels.unsqueeze(2)).squeeze(2).float()
    per_token = picked - torch.logsumexp(logits.float(), dim=-1)
    per_token = torch.where(mask, per_token, 0.0)  # not * mask: a NaN at a pad position must not leak
    n_tokens = mask.sum(-1).float()
    total = per_token.sum(-1)
    if average_log_prob:
        # A sequence with no labelled token gets 0, never NaN (0 / 0).
        return total / n_tokens.clamp(min=1.0), n_tokens
    return total, n_tokens


def gathered_token_logps(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits[rows[k]])[targets[k]] for every k, in float32, as in :func:`get_batch_logps`.

    For logits that were computed only where a token is predicted (the packed forward of
    ``packing.packed_sequence_logps``): one row of logits may predict several targets (a shared
    prompt's last position predicts the first token of both responses). Computed as
    ``logit[target] - logsumexp(logits)``, the logsumexp once per row of ``logits``, so no
    full-vocabulary log-softmax copy is made.

    Args:
        logits: (M, V) unnormalised scores, any float dtype.
        rows: (N,) long, which row of ``logits`` predicts each target (values in [0, M)).
        targets: (N,) long token ids (no ``IGNORE_INDEX``: only real targets are passed).

    Returns:
        (N,) float32 log-probabilities in nats.

    Raises:
        ValueError: if ``logits`` is not 2-D or ``rows`` and ``targets`` differ in shape.
    """
    if logits.dim() != 2 or rows.shape != targets.shape or rows.dim() != 1:
        raise ValueError(
            f"logits must be (M, V) and rows, targets (N,); got {tuple(logits.shape)}, {tuple(rows.shape)}, {tuple(targets.shape)}."
        )
    picked = logits[rows, targets].float()
    return picked - torch.logsumexp(logits.float(), dim=-1)[rows]


def sum_by_sequence(
    token_logps: torch.Tensor, sequence: torch.Tensor, n_sequences: int, average_log_prob: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence totals of per-token log-probs, the same reduction as :func:`get_batch_logps`.

    Args:
        token_logps: (N,) float32 log-probs of the labelled tokens of all sequences.
        sequence: (N,) long, which sequence each token belongs to (values in [0, n_sequences)).
        n_sequences: S, the number of sequences (one with no token gets 0 and a count of 0).
        average_log_prob: if True the mean per labelled token (0 for none), else the sum.

    Returns:
        (logps, n_tokens): each (S,) float32; logps in nats.
    """
    zeros = torch.zeros(n_sequences, dtype=torch.float32, device=token_logps.device)
    total = zeros.index_add(0, sequence, token_logps.float())
    n_tokens = zeros.index_add(0, sequence, torch.ones_like(token_logps, dtype=torch.float32))
    if average_log_prob:
        return total / n_tokens.clamp(min=1.0), n_tokens
    return total, n_tokens


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO loss, and conservative DPO when ``label_smoothing`` > 0.

    DPO (Rafailov et al. 2023, "Direct Preference Optimization", Eq. 7):
        h = (log pi(y_w|x) - log pi(y_l|x)) - (log ref(y_w|x) - log ref(y_l|x))
        loss = -log sigmoid(beta * h)
    Conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"):
    the label is flipped with probability eps = ``label_smoothing``,
        loss = -(1 - eps) log sigmoid(beta * h) - eps log sigmoid(-beta * h).
    With ``reference_free`` the reference terms are taken as 0 (a uniform reference).

    Args:
        policy_chosen_logps: (B,) log pi(y_w | x).
        policy_rejected_logps: (B,) log pi(y_l | x).
        reference_chosen_logps: (B,) log ref(y_w | x).
        reference_rejected_logps: (B,) log ref(y_l | x).
        beta: KL-penalty strength, > 0 (0.1 to 0.5 is typical).
        label_smoothing: assumed probability that a label is wrong, in [0, 0.5).
        reference_free: ignore the reference model.

    Returns:
        (losses, chosen_rewards, rejected_rewards), each (B,). The rewards are the
        implicit rewards beta * (log pi - log ref), detached.
    """
    pi_logratios = policy_chosen_logps - policy_rejected_logps
    ref_logratios = reference_chosen_logps - reference_rejected_logps
    if reference_free:
        ref_logratios = torch.zeros_like(ref_logratios)
    h = pi_logratios - ref_logratios
    losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    chosen_rewards, rejected_rewards = implicit_rewards(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        beta,
        reference_free,
    )
    return losses, chosen_rewards, rejected_rewards


def ipo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """IPO loss (Azar et al. 2023, "A General Theoretical Paradigm to Understand
    Learning from Human Preferences", Eq. 17, empirical form of IPO):

        h = (log pi(y_w|x) - log pi(y_l|x)) - (log ref(y_w|x) - log ref(y_l|x))
        loss = (h - 1 / (2 * beta)) ** 2

    Here ``beta`` is the paper's tau (the regularisation strength). IPO regresses
    the log-ratio gap to a finite target instead of pushing it to infinity. The
    authors use length-normalised log-probs, hence ``loss.average_log_prob: true``
    in config/loss/ipo.yaml.

    Args:
        policy_chosen_logps, policy_rejected_logps, reference_chosen_logps,
        reference_rejected_logps: (B,) each, as in :func:`dpo_loss`.
        beta: tau in the paper, > 0.

    Returns:
        (losses, chosen_rewards, rejected_rewards), each (B,); rewards as in DPO.
    """
    h = (policy_chosen_logps - policy_rejected_logps) - (reference_chosen_logps - reference_rejected_logps)
    losses = (h - 1 / (2 * beta)) ** 2
    chosen_rewards, rejected_rewards = implicit_rewards(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        beta,
    )
    return losses, chosen_rewards, rejected_rewards


def implicit_rewards(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
    reference_free: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards r = beta * (log pi(y|x) - log ref(y|x)) (Rafailov et al. 2023, Eq. 5
    up to the partition function), detached. With ``reference_free`` the reference is 0.

    Shapes: all inputs (B,); returns (chosen_rewards, rejected_rewards), each (B,).
    """
    if reference_free:
        reference_chosen_logps = torch.zeros_like(reference_chosen_logps)
        reference_rejected_logps = torch.zeros_like(reference_rejected_logps)
    chosen = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    return chosen, rejected


def sft_loss(policy_logps_sum: torch.Tensor, n_tokens_total: float | torch.Tensor) -> torch.Tensor:
    """Supervised fine-tuning loss: negative log-likelihood per target token.

    The sum of the target tokens' log-probs is divided by the number of target
    tokens in the *whole* batch, so the loss does not depend on sequence length,
    on how the batch is split into micro-batches, or on which sequences share a
    batch (the reference repository sums per sequence instead).

    Args:
        policy_logps_sum: (B,) summed log pi(y | x) of each sequence's target tokens.
        n_tokens_total: number of target tokens in the full batch (all micro-batches).

    Returns:
        Scalar loss in nats per token.
    """
    return -policy_logps_sum.sum() / n_tokens_total


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor) -> torch.Tensor:
    """Reward-model loss of the Bradley–Terry preference model, per pair.

    P(chosen > rejected) = sigmoid(r(x, y_c) - r(x, y_r)) (Bradley & Terry 1952; the reward
    model loss of Ouyang et al. 2022, Eq. 1, with one comparison per prompt), so the loss is
    ``-log sigmoid(r_c - r_r)``: ln 2 when the scores are equal.

    Args:
        chosen_scores, rejected_scores: (B,) scalar rewards of the chosen and rejected sequences.

    Returns:
        (B,) float32 losses, in nats.
    """
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float())


def last_token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar score of each right-padded sequence at its last real token, from a Hugging Face
    ``*ForSequenceClassification`` model with one label (its head is ``model.score``).

    The head's output is read at index ``attention_mask.sum(1) - 1`` of each row, not where the
    model's own pooling looks (the last token that is not ``pad_token_id``, which is wrong when
    the pad token is EOS and a sequence ends with EOS). Gradients flow (reward-model training).

    Args:
        model: e.g. ``LlamaForSequenceClassification`` with ``num_labels=1``.
        input_ids, attention_mask: (N, T) long, right-padded, each row with at least one real token.

    Returns:
        (N,) float32 scores.

    Raises:
        ValueError: if the model has no ``score`` head with one output.
    """
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
    last = (attention_mask.sum(1) - 1).clamp(min=0).to(per_position.device)
    return per_position.gather(1, last.unsqueeze(1)).squeeze(1).float()


# ============================================================================ the objectives registry
#
# One objective is one registered declaration: what it needs from the trainer, its config keys
# (defaults and valid ranges), and one pure function from those inputs to per-example losses
# and the rewards its metrics report. The trainer computes what the declaration asks for and
# names no objective; train.py, ray_launcher.py, the config checks and the README's table read
# the declarations. Adding one: a function below with ``@objective(...)``, a
# ``config/loss/<name>.yaml`` whose keys are the declared ones, and its tests.


class ObjectiveConfigError(ValueError):
    """A ``loss.*`` value is wrong; the message is one sentence naming the key and the fix
    (train.py reports it as ``utils.ConfigError``)."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One ``loss.<key>`` an objective accepts.

    Attributes:
        default: the value in ``config/loss/<name>.yaml`` (a test checks they agree).
        valid: a predicate the value must satisfy (None: any value of the default's type).
        rule: the valid range in words, for the error sentence (e.g. "> 0", "in [0, 0.5)").
        doc: what the key means, one line.
    """

    default: object
    valid: Callable[[object], bool] | None = None
    rule: str = ""
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class Objective:
    """The declaration of one training objective (see the module's registry notes).

    Attributes:
        name: ``loss=<name>`` (TRL's ``loss_type`` name where TRL has the objective).
        fn: the pure loss function. Its tensor arguments are named after the fields of
            :class:`ObjectiveInputs` it needs, its other arguments after its keys; it returns
            ``(losses, chosen_rewards, rejected_rewards)``, each (B,), optionally followed by a
            dict of extra per-example metric tensors. Rewards are detached.
        keys: the ``loss.*`` keys besides ``name``.
        source: paper and equation.
        summary: one line for the README's table.
        reference: uses the frozen reference's log-probs (False: reference-free). A key name
            (e.g. ``"reference_free"``) means: uses it unless that boolean key is true.
        average_log_prob: the log-probs it is given are length-normalised (mean per response
            token) rather than summed; None: as the key ``average_log_prob`` says.
        nll: uses the chosen responses' NLL per token (``policy_chosen_nll``).
        unpaired: also trains on unpaired rows ``{prompt, completion, label}``.
        mismatched_kl: uses log-probs of mismatched prompt-completion pairs (KTO's reference point).
        score_head: trains a one-output score head (a reward model) instead of a policy.
        sft_data: trains on each prompt's ``sft_target`` alone (no pairs).
        per_token: the batch loss is the sum of the losses over the batch's target tokens
            (SFT's per-token mean) instead of over its examples.
        reward_metric: metric name prefix of the rewards (``rewards`` or ``scores``).
    """

    name: str
    fn: Callable
    keys: dict
    source: str
    summary: str
    reference: bool | str = True
    average_log_prob: bool | None = None
    nll: bool = False
    unpaired: bool = False
    mismatched_kl: bool = False
    score_head: bool = False
    sft_data: bool = False
    per_token: bool = False
    reward_metric: str = "rewards"

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

    def uses_nll(self, loss_config) -> bool:
        """True if the chosen responses' NLL is needed (the function's own, or ``loss.nll_weight`` > 0)."""
        return self.nll or float(_get(loss_config, "nll_weight", 0.0) or 0.0) > 0

    @property
    def paired(self) -> bool:
        """True if it learns from (chosen, rejected) pairs of the same prompt."""
        return not (self.sft_data or self.score_head)

    def compute(self, inputs: ObjectiveInputs, loss_config, **overrides) -> ObjectiveOutput:
        """Call :attr:`fn` with the inputs and keys it names; add ``loss.nll_weight`` times the
        chosen NLL per token (RPO, Pang et al. 2024, Eq. 1) when that key is > 0.

        Args:
            inputs: what the trainer computed for one micro-batch of B examples.
            loss_config: the ``loss`` section (a mapping; missing keys take their defaults).
            overrides: key values that win over ``loss_config`` (e.g. this epoch's ``beta``).

        Returns:
            an :class:`ObjectiveOutput`.

        Raises:
            ValueError: if the function needs an input the trainer did not provide.
        """
        kwargs = {}
        for name in self._parameters():
            if name in overrides:
                kwargs[name] = overrides[name]
            elif name in self.keys:
                kwargs[name] = _get(loss_config, name, self.keys[name].default)
            else:
                value = getattr(inputs, name, None)
                if value is None:
                    raise ValueError(f"loss={self.name} needs {name}, which the trainer did not compute.")
                kwargs[name] = value
        out = self.fn(**kwargs)
        extra = out[3] if len(out) > 3 else {}
        per_example, chosen_rewards, rejected_rewards = out[:3]
        nll_weight = float(_get(loss_config, "nll_weight", 0.0) or 0.0)
        if nll_weight > 0:
            if inputs.policy_chosen_nll is None:
                raise ValueError(
                    f"loss.nll_weight > 0 needs the chosen NLL, which the trainer did not compute for loss={self.name}."
                )
            per_example = per_example + nll_weight * inputs.policy_chosen_nll
            extra = {**extra, "nll": inputs.policy_chosen_nll.detach()}
        return ObjectiveOutput(per_example, chosen_rewards, rejected_rewards, extra)

    def _parameters(self) -> list[str]:
        return list(inspect.signature(self.fn).parameters)


@dataclasses.dataclass
class ObjectiveInputs:
    """What the trainer computed for one micro-batch of B examples (None where not asked for).

    Log-probs are float32, in nats, summed over each response's tokens or, when the objective
    averages (:meth:`Objective.averages`), their mean per token.

    Attributes:
        policy_chosen_logps, policy_rejected_logps: (B,) log pi(y_w | x), log pi(y_l | x). For
            unpaired rows, ``policy_chosen_logps`` holds each completion's and ``label`` says
            whether it is desirable.
        reference_chosen_logps, reference_rejected_logps: (B,) the same under the reference.
        chosen_n_tokens, rejected_n_tokens: (B,) float32 response-token counts.
        policy_chosen_nll: (B,) -log pi(y_w | x) / |y_w|, the chosen NLL per token.
        chosen_scores, rejected_scores: (B,) a score head's outputs (reward models).
        policy_kl_logps, reference_kl_logps: (B,) log-probs of mismatched pairs (x_i, y_{i+1}).
        label: (B,) bool, unpaired rows only: the completion is desirable.
    """

    policy_chosen_logps: torch.Tensor | None = None
    policy_rejected_logps: torch.Tensor | None = None
    reference_chosen_logps: torch.Tensor | None = None
    reference_rejected_logps: torch.Tensor | None = None
    chosen_n_tokens: torch.Tensor | None = None
    rejected_n_tokens: torch.Tensor | None = None
    policy_chosen_nll: torch.Tensor | None = None
    chosen_scores: torch.Tensor | None = None
    rejected_scores: torch.Tensor | None = None
    policy_kl_logps: torch.Tensor | None = None
    reference_kl_logps: torch.Tensor | None = None
    label: torch.Tensor | None = None


class ObjectiveOutput(NamedTuple):
    """An objective's result for one micro-batch: ``losses`` (B,) per example (the trainer sums
    them and divides by the batch's examples, or tokens for a per-token objective), the rewards
    its metrics report (B,) each, detached (None: it reports none), and extra per-example
    metric tensors by name."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor | None
    rejected_rewards: torch.Tensor | None
    metrics: dict


OBJECTIVES: dict[str, Objective] = {}
"""Every registered objective by name (``loss=<name>``)."""


def objective(name: str, **declaration) -> Callable:
    """Register the decorated function as objective ``name`` (the other arguments are
    :class:`Objective`'s fields) and return the function unchanged.

    Raises:
        ValueError: if ``name`` is taken, or the function names an argument that is neither an
            input field nor a declared key.
    """

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
    """The registered objective ``name``.

    Raises:
        ObjectiveConfigError: one sentence listing the registered names (with "did you mean").
    """
    if name in OBJECTIVES:
        return OBJECTIVES[name]
    close = difflib.get_close_matches(str(name), list(OBJECTIVES), n=1)
    hint = f"did you mean loss={close[0]}? " if close else ""
    raise ObjectiveConfigError(f"Unknown loss {name!r}; {hint}registered losses are {', '.join(sorted(OBJECTIVES))}.")


def validate_loss_config(loss_config) -> Objective:
    """Check the ``loss`` section against its objective's declaration: the name is registered,
    every key is one of its keys, every value is in its range.

    Returns:
        the objective.

    Raises:
        ObjectiveConfigError: naming the first bad key and how to fix it.
    """
    decl = get_objective(loss_config["name"])
    allowed = {"name", *decl.keys}
    extra = sorted(k for k in loss_config if k not in allowed)
    if extra:
        raise ObjectiveConfigError(f"loss={decl.name} has no key {extra[0]!r} (its keys: {sorted(allowed)}); remove it.")
    for key, spec in decl.keys.items():
        value = _get(loss_config, key, spec.default)
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
)
def sft_objective(policy_chosen_logps: torch.Tensor):
    """SFT as an objective: per-example loss -log pi(y | x) summed over the target tokens; the
    trainer divides the batch's sum by its target tokens (see :func:`sft_loss`). No rewards.

    Shapes: (B,) in, (B,) out."""
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
)
def reward_objective(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor):
    """Reward-model training: :func:`bradley_terry_loss` per pair; the reported rewards are the
    scores. Shapes: (B,) each."""
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
)
def dpo_objective(
    policy_chosen_logps,
    policy_rejected_logps,
    reference_chosen_logps,
    reference_rejected_logps,
    beta,
    label_smoothing,
    reference_free,
):
    """:func:`dpo_loss` as an objective (with ``reference_free`` the trainer passes zeros)."""
    return dpo_loss(
        policy_chosen_logps,
        policy_rejected_logps,
        reference_chosen_logps,
        reference_rejected_logps,
        beta,
        label_smoothing,
        reference_free,
    )


@objective(
    "ipo",
    keys={"beta": BETA, "average_log_prob": Key(True, AVERAGE_LOG_PROB.valid, AVERAGE_LOG_PROB.rule), "nll_weight": NLL_WEIGHT},
    source="Azar et al. 2023, Eq. 17",
    summary="IPO: the log-ratio gap regressed to 1 / (2 beta)",
)
def ipo_objective(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, beta):
    """:func:`ipo_loss` as an objective."""
    return ipo_loss(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps, beta)


# ---------------------------------------------------------------------------- TRL's pairwise family
# (DPOTrainer's loss_types beyond sigmoid and ipo, and weighted combinations of objectives)


# ---------------------------------------------------------------------------- end of the pairwise family


# ---------------------------------------------------------------------------- reference-free objectives and KTO
# (SimPO, CPO, ORPO, KTO)


# ---------------------------------------------------------------------------- end of reference-free and KTO
