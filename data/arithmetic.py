"""The embedded default dataset: sums with a right and a wrong answer, made on the spot (no download)."""

from __future__ import annotations

import collections
import random

from data.report import DatasetDict, add_pair
from preference_datasets import register_dataset


@register_dataset("arithmetic", truncation_mode="keep_start", reward_functions=("arithmetic",))
def get_arithmetic(
    split: str, report: collections.Counter, n_train: int = 4000, n_test: int = 256, max_operand: int = 99
) -> DatasetDict:
    """The embedded default: generated addition problems, e.g. ``"Q: 17+25=\\nA:"``, rejected a typical mistake."""
    rng = random.Random(1234)  # fixed, not config.seed: train/test prompts disjoint and the same everywhere
    problems = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(problems)
    chosen_problems = problems[n_train : n_train + n_test] if split == "test" else problems[:n_train]
    data: DatasetDict = {}
    for a, b in chosen_problems:
        right = a + b
        mistakes = [int(f"{a}{b}"), abs(a - b), right + 1, right - 1]  # concatenated, subtracted, off by one
        if a % 10 + b % 10 >= 10:
            mistakes.append(right - 10)  # forgot the carry
        wrong = rng.choice([m for m in mistakes if m != right])
        add_pair(data, f"Q: {a}+{b}=\nA:", f" {right}", f" {wrong}", report)
    return data
