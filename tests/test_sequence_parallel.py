"""Sequence parallelism (parallel/sequence_parallel.py) on CPU with gloo: one torchrun launch per group size, each
checking log-probs, loss and gradients against one process (tests/sequence_parallel_worker.py)."""

from __future__ import annotations

import pytest
from conftest import run_torchrun

CASES = ["packed", "packed chunked", "padded", "padded chunked averaged", "targets on some ranks only"]


@pytest.mark.parametrize("n_ranks", [2, 4])
def test_sequence_parallel_logps_loss_and_gradients_equal_one_process(n_ranks):
    # Rows of 13, 16 and 18 tokens over 2 or 4 ranks (not divisible), packed or padded, the output layer chunked or
    # not, the reference too; with 4 ranks also FSDP over all 4 x sequence parallelism over pairs (2-D).
    code, text = run_torchrun(["tests/sequence_parallel_worker.py"], timeout=240, n_procs=n_ranks)
    assert code == 0, text[-4000:]
    cases = CASES + (["fsdp x sp"] if n_ranks == 4 else [])
    for rank in range(n_ranks):
        for case in cases:
            assert f"rank {rank}: {case} ok" in text, text[-4000:]
