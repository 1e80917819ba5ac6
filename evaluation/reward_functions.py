"""Reward functions ``fn(prompts, completions, **fields) -> list[float | None]`` (one score per completion,
None: not scored), named by ``reward_functions=[...]`` as a registered name or ``module:function`` (docs/online.md)."""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from collections.abc import Callable

from utils import ConfigError

REWARD_FUNCTIONS: dict[str, Callable] = {}
"""The registered reward functions by name (:func:`register_reward_function`)."""


REQUIRES: dict[str, str] = {}
"""The package a registered function imports when called, by name (checked when it is named)."""


def register_reward_function(name: str, requires: str | None = None):
    """A decorator adding the function to :data:`REWARD_FUNCTIONS` as ``name``; ``requires``: the module it
    imports when called."""

    def register(fn: Callable) -> Callable:
        REWARD_FUNCTIONS[name] = fn
        if requires:
            REQUIRES[name] = requires
        return fn

    return register


# ----------------------------------------------------------------------------- shipped functions


@register_reward_function("length")
def length(prompts: list[str], completions: list[str], **fields) -> list[float | None]:
    """The completion's length in characters (the example to copy: a negative weight rewards brevity)."""
    return [float(len(c)) for c in completions]


ARITHMETIC_PROMPT = re.compile(r"Q: (\d+)\+(\d+)=\nA:")
"""The embedded arithmetic dataset's prompt (data.arithmetic.get_arithmetic), e.g. ``"Q: 17+25=\\nA:"``."""


@register_reward_function("arithmetic")
def arithmetic(prompts: list[str], completions: list[str], **fields) -> list[float | None]:
    """1.0 when the completion, stripped of surrounding whitespace, is the sum's decimal digits
    (``" 42"`` after ``"Q: 17+25=\\nA:"``), else 0.0; None for a prompt that is no such question."""
    scores: list[float | None] = []
    for prompt, completion in zip(prompts, completions):
        question = ARITHMETIC_PROMPT.fullmatch(prompt)
        if question is None:
            scores.append(None)
            continue
        answer = str(int(question[1]) + int(question[2]))
        scores.append(float(completion.strip() == answer))
    return scores


@functools.cache
def _vader():
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    return SentimentIntensityAnalyzer()


@register_reward_function("sentiment", requires="vaderSentiment")
def sentiment(prompts: list[str], completions: list[str], **fields) -> list[float | None]:
    """VADER's compound score of the completion alone, in [-1, 1] (Hutto & Gilbert 2014; ``vaderSentiment``)."""
    analyzer = _vader()
    return [float(analyzer.polarity_scores(c)["compound"]) for c in completions]


# ----------------------------------------------------------------------------- from the config


def registered_names() -> str:
    """The registered names, comma-separated, for error sentences."""
    return ", ".join(sorted(REWARD_FUNCTIONS))


def resolve(spec: str, key: str = "reward_functions") -> Callable:
    """The reward function ``spec`` (a registered name or ``module:function``) names; ``key`` is the config key
    for error sentences; raises ConfigError for an unknown name, a failed import, or a non-callable."""
    spec = str(spec)
    choose = f"give a registered name ({registered_names()}) or module:function"
    if ":" not in spec:
        if spec in REWARD_FUNCTIONS:
            if spec in REQUIRES and importlib.util.find_spec(REQUIRES[spec]) is None:
                raise ConfigError(
                    f"{key}: {spec} needs the {REQUIRES[spec]} package, which is not installed; pip install -r requirements.txt."
                )
            return REWARD_FUNCTIONS[spec]
        close = difflib.get_close_matches(spec, list(REWARD_FUNCTIONS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{key}: {spec!r} is not a registered reward function; {hint}{choose}.")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # python path/to/train.py puts the script's folder there, not the current one
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a missing module, or one that fails while importing
        raise ConfigError(
            f"{key}: {spec!r} does not import ({type(e).__name__}: {e}); {choose}, "
            "the module importable from the current directory or PYTHONPATH."
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{key}: module {module_name} has no {attr!r}; {choose}.")
    if not callable(fn):
        raise ConfigError(f"{key}: {spec} is a {type(fn).__name__}, not a function; {choose}.")
    try:
        inspect.signature(fn).bind_partial([], [])  # the rest may be fields
    except TypeError as e:
        raise ConfigError(
            f"{key}: {spec} cannot be called as fn(prompts, completions, **fields) ({e}); give it that signature."
        ) from None
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return fn


def resolve_all(specs, weights) -> tuple[list[str], list[Callable], list[float]]:
    """The names, functions and weights of ``reward_functions`` / ``reward_weights`` (None: 1.0 each); raises ConfigError."""
    if isinstance(specs, str) or not specs or not all(isinstance(s, str) for s in specs):
        raise ConfigError(
            f"reward_functions must be a non-empty list of names, e.g. reward_functions=[sentiment], got {specs!r}."
        )
    names = [str(s) for s in specs]
    functions = [resolve(s) for s in names]
    if weights is None:
        return names, functions, [1.0] * len(names)
    weights = list(weights) if not isinstance(weights, (str, int, float)) else [weights]
    if len(weights) != len(names) or not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) for w in weights
    ):
        raise ConfigError(
            f"reward_weights={weights} must be {len(names)} number{'s' if len(names) > 1 else ''}, one per reward function "
            f"({', '.join(names)}), or null for 1.0 each."
        )
    return names, functions, [float(w) for w in weights]


def eval_functions(spec, declared: list[str]) -> list[tuple[str, Callable]]:
    """The ``(name, function)`` pairs of ``eval_reward_functions``: ``auto`` gives ``declared`` (the datasets'
    own answer checks), a list names them, null or [] none; raises ConfigError."""
    if spec is None:
        return []
    if isinstance(spec, str):
        if spec != "auto":
            raise ConfigError(
                f"eval_reward_functions={spec!r}: give auto (the datasets' own answer checks), a list such as "
                "[arithmetic] or [my_rewards:exact], or null for none."
            )
        names = list(dict.fromkeys(declared))
    else:
        names = list(spec)
        if not all(isinstance(s, str) for s in names):
            raise ConfigError(f"eval_reward_functions must be auto, null or a list of names, got {spec!r}.")
    return [(str(name), resolve(name, "eval_reward_functions")) for name in names]
