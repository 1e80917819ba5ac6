"""Shared test helpers: compose the Hydra config in-process, tiny-run overrides, shared/ paths."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

# A run of a few seconds: the embedded arithmetic data, the tiny random model.
TINY = [
    "batch_size=8",
    "eval_batch_size=8",
    "n_eval_examples=16",
    "n_examples=48",
    "eval_every=24",
    "data.arithmetic.n_train=64",
    "data.arithmetic.n_test=16",
    "n_eval_model_samples=2",
    "progress_bar=false",
    "minimum_log_interval_secs=0",
    "warmup_steps=2",
]


def compose_config(overrides: list[str]):
    """The composed config for ``python train.py <overrides>``."""
    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def needs_shared(*parts: str) -> Path:
    """Path under ../shared, or skip the test with the reason."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} is absent (the ../shared folder beside the repository)")
    return path
