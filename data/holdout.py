"""The held-out eval slice of a dataset with one split: the prompts whose hash falls below the fraction."""

from __future__ import annotations

import collections
import hashlib

from data.report import _LOADING, DataReport, DatasetDict


def in_holdout(prompt: str, fraction: float) -> bool:
    """True if ``prompt`` belongs to the held-out eval slice of size ``fraction``."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()  # the prompt alone: same slice on every machine and seed
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def apply_holdout(data: DatasetDict, split: str, fraction: float, report: collections.Counter | None = None) -> DatasetDict:
    """Keep the held-out slice (split "test") or the rest (split "train") of ``data``, narrowing ``report`` alike."""
    want_eval = split == "test"

    def keep(prompt: str) -> bool:
        return in_holdout(prompt, fraction) == want_eval

    report = _LOADING.get() if report is None else report
    if isinstance(report, DataReport):
        report.narrow(keep)
        report.holdout = (fraction, len(data))
    return {p: v for p, v in data.items() if keep(p)}
