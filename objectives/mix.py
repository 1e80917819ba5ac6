"""``loss=mix``: a weighted sum of registered pairwise objectives and the chosen NLL (TRL's list of ``loss_type``
with ``loss_weights``; config/loss/mpo.yaml is MPO, Wang et al. 2024)."""

from __future__ import annotations

import dataclasses
import difflib

import torch

from losses import (
    NLL_WEIGHT,
    OBJECTIVES,
    Key,
    Objective,
    ObjectiveConfigError,
    ObjectiveInputs,
    ObjectiveOutput,
    _get,
)
from objectives.pairwise import log_ratios, pair_rewards

# ---- loss=mix: sum_k weights[k] * (per-example loss of losses[k]); component nll is the chosen NLL per token
# (TRL's loss_type "sft"); the other keys are the components' keys, one value shared by all that have it, as in TRL.

MIX_NLL = "nll"


def _mixable(decl: Objective) -> bool:
    """True if ``decl`` can be a component of ``loss=mix``: a paired objective on (chosen,
    rejected) log-probs with a per-example loss, each token weighing 1 (the components share one forward)."""
    plain = not (decl.unpaired or decl.mismatched_kl or decl.per_token or decl.token_weights or decl.inputs)
    return decl.paired and plain and not isinstance(decl, MixObjective)


def _is_list(value) -> bool:
    return not isinstance(value, (str, bytes, dict)) and hasattr(value, "__iter__") and hasattr(value, "__len__")


def _mix_names(loss_config) -> list[str]:
    """``loss_config``'s ``losses``, the components of a ``mix``; ObjectiveConfigError for a bad list or component."""
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
        if name in OBJECTIVES and OBJECTIVES[name].token_weights is not None:
            raise ObjectiveConfigError(
                f"loss.losses of loss=mix names {name!r}, which weighs response tokens in its own log-probs, and the mix's "
                f"components share one forward; train loss={name} alone, or mix from {', '.join(choices)}."
            )
        if name in OBJECTIVES and OBJECTIVES[name].paired and OBJECTIVES[name].inputs and not OBJECTIVES[name].unpaired:
            raise ObjectiveConfigError(
                f"loss.losses of loss=mix names {name!r}, whose inputs come from a forward of its own, and the mix's "
                f"components share one forward; train loss={name} alone, or mix from {', '.join(choices)}."
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
    return names


def _check_mix_weights(loss_config, names: list[str]) -> None:
    """ObjectiveConfigError unless ``loss_config``'s ``weights`` are numbers >= 0, one per component of ``names``."""
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


def _mix_keys(loss_config) -> dict:
    """The keys of a ``mix`` of ``loss_config``'s ``losses``: ``losses``, ``weights``, each component's keys (the first's
    default, every component's range; not ``average_log_prob``), ``nll_weight``; ObjectiveConfigError for bad
    ``losses``/``weights``."""
    names = _mix_names(loss_config)
    _check_mix_weights(loss_config, names)
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
            chosen_rewards, rejected_rewards = pair_rewards(values["beta"], *log_ratios(inputs))
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
