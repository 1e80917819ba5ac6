"""Objectives beyond SFT, DPO, cDPO and IPO (losses.py): each module registers its own with :func:`losses.objective`;
importing this package imports every module in it and so registers them all (train.py does, once). Adding one: docs/objectives.md."""

from __future__ import annotations

import importlib
import pkgutil

from losses import OBJECTIVES

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):  # every file here: a new one needs no line
    importlib.import_module(f"{__name__}.{_module}")  # each registers its objectives


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
