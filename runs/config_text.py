"""A run's config and command as text: the shell line that ran it, override values as typed, the flat keys and the
digest that fingerprints them."""

from __future__ import annotations

import json
import os
import shlex

from omegaconf import DictConfig, OmegaConf


def shell_line(script: str, args: list[str], launcher: str = "python") -> str:
    """``<launcher> <script> <args>`` as a line a shell gives back as these arguments (each quoted where needed)."""
    return " ".join([launcher, shlex.quote(script), *(shlex.quote(a) for a in args)])


def command_text(overrides: list[str]) -> str:
    """The command line that ran train.py with ``overrides`` (torchrun's options are not known here)."""
    return shell_line("train.py", overrides, "torchrun <options>" if "TORCHELASTIC_RUN_ID" in os.environ else "python")


def flat_config(config: DictConfig) -> dict:
    """``config`` resolved, as ``{dotted key: value}`` in the config's order (``"loss.beta": 0.1``)."""
    flat: dict = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(OmegaConf.to_container(config, resolve=True), "")
    return flat


def digest(obj) -> str:
    """A sha256 of ``obj`` (JSON-able, or ``str()`` of what is not), the same on every machine."""
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def override_text(value) -> str:
    """``value`` as it would be written on the command line (``null``, ``true``, ``[hh,shp]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_text(v)}" for k, v in value.items()) + "}"
    return str(value)
