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
    "lr=3e-3",
    "sft_first.n_examples=null",
]


def one_run(args: list[str]) -> list[str]:
    """``args`` for a command line that trains one run: model=tiny's preset would run an SFT stage
    first (``sft_first``) unless the arguments say otherwise."""
    return args if any(a.startswith("sft_first") for a in args) else [*args, "sft_first.n_examples=null"]


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


def tiny_llama_scorer(vocab_size: int, pad_token_id: int, num_labels: int = 1, seed: int = 0):
    """A random 2-layer ``LlamaForSequenceClassification`` (hidden 16): a tiny reward model."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=pad_token_id,
    )
    return LlamaForSequenceClassification(config)


def run_train(overrides: list[str], tmp_path: Path) -> Path:
    """Run train.main in-process on the TINY settings plus ``overrides``; returns the run folder."""
    import train

    config = compose_config([*TINY, f"output_root={tmp_path}", *overrides])
    run_dir, stop_signal = train.main(config)
    assert stop_signal is None
    return Path(run_dir)


def metric_records(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_torchrun(args: list[str], timeout: float = 240, env: dict | None = None) -> tuple[int, str]:
    """``python -m torch.distributed.run --nproc_per_node 2 <args>`` from the repository root, one
    thread per rank, in its own process group (killed whole on timeout: the test then fails
    with the output's tail). Returns (exit status, stdout and stderr together)."""
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        pytest.fail(f"torchrun {' '.join(args[:1])} did not finish in {timeout:g} s (killed):\n{text[-3000:]}")
    return proc.returncode, text
