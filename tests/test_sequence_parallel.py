"""Sequence parallelism (parallel/sequence_parallel.py) on CPU with gloo: one torchrun launch per group size, each
checking log-probs, loss and gradients against one process (tests/sequence_parallel_worker.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import run_torchrun

import parallel.sequence_parallel  # noqa: F401  (its config rules, as train.py registers them)
import utils

CASES = ["packed", "packed chunked", "padded", "padded chunked averaged", "targets on some ranks only", "sft"]


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


def grad_norms(run_dir) -> list[float]:
    """The gradient norm of each logged train step of ``run_dir``."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    norms = [r["grad_norm"] for r in records if "grad_norm" in r]
    assert norms, records[:3]
    return norms


def test_fsdp_with_sequence_parallelism_trains_as_one_process_and_refuses_what_it_cannot_split(tmp_path):
    # train.py end to end: 2 ranks splitting every row (FSDP over both), a live reference and a chunked output layer,
    # must log the single-process run's evals and end with its weights; its mistakes are one sentence each.
    from test_distributed import BASE, UNCHUNKED, assert_same_run, cli, finished_run, parallel_run

    basic = finished_run([*BASE, UNCHUNKED], tmp_path / "basic")
    run_dir, text = parallel_run(["trainer=FSDPTrainer", "world_size=2", "sequence_parallel_size=2"], tmp_path / "sp")
    assert "Sequence parallelism: every row split over 2 ranks (Ulysses), 1 data-parallel group(s)." in text, text[-3000:]
    assert_same_run(basic, run_dir)
    assert grad_norms(run_dir) == pytest.approx(grad_norms(basic), rel=1e-4)  # Adam's steps would hide a scaled gradient
    for args, message in [
        (["trainer=BasicTrainer", "sequence_parallel_size=2"], "sequence_parallel_size > 1 is for trainer=FSDPTrainer"),
        (["trainer=FSDPTrainer", "world_size=3", "sequence_parallel_size=2"], "must divide the number of processes \\(3\\)"),
        (["trainer=FSDPTrainer", "world_size=4", "sequence_parallel_size=2", "tensor_parallel_size=2"], "choose one of them"),
        (
            ["trainer=FSDPTrainer", "world_size=2", "sequence_parallel_size=2", "loss=kto"],
            "loss=kto trains on unpaired rows",
        ),
        (["trainer=FSDPTrainer", "world_size=2", "sequence_parallel_size=2", "model.lora.r=4"], "untested with model.lora"),
    ]:
        code, out = cli([*BASE, *args], tmp_path / "refused")
        assert code == 2 and "Traceback" not in out, out[-3000:]

        assert re.search(message, out), out[-2000:]


def test_sft_with_sequence_parallelism_trains_as_one_process(tmp_path):
    # SFT's targets (the first stage of sft_first) split over 2 ranks: the single-process run's eval losses and weights
    from test_distributed import BASE, UNCHUNKED, evals, finished_run, parallel_run, weights

    basic = finished_run([*BASE, UNCHUNKED, "loss=sft"], tmp_path / "basic")
    run_dir, _ = parallel_run(["trainer=FSDPTrainer", "world_size=2", "sequence_parallel_size=2", "loss=sft"], tmp_path / "sp")
    ea, eb = evals(basic), evals(run_dir)
    assert [r["step"] for r in ea] == [r["step"] for r in eb] and len(ea) >= 2
    for ra, rb in zip(ea, eb):
        assert rb["loss/eval"] == pytest.approx(ra["loss/eval"], rel=1e-4, abs=1e-5)
    assert grad_norms(run_dir) == pytest.approx(grad_norms(basic), rel=1e-4)  # Adam's steps would hide a scaled gradient
    wa, wb = weights(basic), weights(run_dir)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=5e-5, msg=name)


def test_a_model_switched_to_sequence_parallel_attention_saves_a_folder_that_loads_with_sdpa(tmp_path):
    # the attention name lives in the run only: an export (hf/) must load where the plugin is not imported
    import json

    import transformers

    from parallel import sequence_parallel

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    sequence_parallel.use_sequence_parallel_attention(model)
    assert model.config._attn_implementation == sequence_parallel.ATTENTION
    model.save_pretrained(tmp_path)
    assert not any("attn" in k for k in json.loads((tmp_path / "config.json").read_text()))
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss=wpo"], "but loss=wpo computes its own per-token inputs (untested split); use another loss"),
        (["loss=ld_dpo"], "but loss=ld_dpo weighs each response token (untested split)"),
        (["loss=kto"], "but loss=kto trains on unpaired rows (untested split)"),
        (["loss=reward"], "but loss=reward trains a score head (untested split)"),
        (["precompute_ref_log_probs=true"], "is untested with precompute_ref_log_probs=true; set it false"),
    ],
)
def test_what_the_split_rows_do_not_compute_is_refused_in_one_sentence(tmp_path, overrides, message):
    from conftest import compose_config

    from runs import checks

    config = compose_config([f"output_root={tmp_path}", "trainer=FSDPTrainer", "sequence_parallel_size=2", *overrides])
    with pytest.raises(utils.ConfigError, match=re.escape(message)):
        checks.validate_config(config, world_size=2)
    checks.validate_config(
        compose_config([f"output_root={tmp_path}", "trainer=FSDPTrainer", "sequence_parallel_size=2"]), world_size=2
    )


def test_the_sft_stage_is_checked_over_the_processes_the_run_starts(tmp_path, monkeypatch):
    # model=tiny's sft_first stage was checked as one process: 1 // 2 sequence-parallel ranks = 0 data-parallel groups,
    # a ZeroDivisionError before any stage (and "must divide the number of processes (1)" for tensor_parallel_size)
    import subprocess
    import sys

    from conftest import REPO, compose_config

    from runs import launch, setup

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = [f"output_root={tmp_path}", "trainer=FSDPTrainer", "world_size=2", "n_examples=64", "sft_first.n_examples=64"]
    for split in (["sequence_parallel_size=2"], ["tensor_parallel_size=2"]):
        config = compose_config([*base, *split])
        assert launch.process_count(config) == 2
        setup.check_stages(config, launch.process_count(config))
    monkeypatch.setenv("WORLD_SIZE", "4")  # under torchrun its count wins
    assert launch.process_count(compose_config(base)) == 4
    monkeypatch.delenv("WORLD_SIZE")
    # the tiny model's 4 heads over 8 ranks: one sentence before any process starts, from the command line
    args = [*base, "world_size=8", "sequence_parallel_size=8"]
    done = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in out and "Starting" not in out, out[-3000:]
    assert "The model's 4 attention heads cannot be split over sequence_parallel_size=8 ranks" in out, out[-3000:]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["sequence_parallel_size=0"], "sequence_parallel_size must be a whole number >= 1, got 0."),
        (["sequence_parallel_size=1.5"], "sequence_parallel_size must be a whole number >= 1, got 1.5."),
        (["tensor_parallel_size=0"], "tensor_parallel_size must be a whole number >= 1, got 0"),
        (["tensor_parallel_size=true"], "tensor_parallel_size must be a whole number >= 1, got True"),
        (["world_size=8", "sequence_parallel_size=4", "batch_size=3"],
         "batch_size (3) must be divisible by the number of data-parallel groups (processes / sequence_parallel_size) (2)."),
    ],
)  # fmt: skip
def test_parallel_sizes_are_whole_numbers_and_the_batch_sentence_counts_data_groups(tmp_path, overrides, message):
    # 0 was taken as 1 and 1.5 met the batch rule first ("the number of processes (5.0)")
    from conftest import compose_config

    from runs import checks

    config = compose_config([f"output_root={tmp_path}", "trainer=FSDPTrainer", "gradient_accumulation_steps=1", *overrides])
    with pytest.raises(utils.ConfigError, match=re.escape(message)):
        checks.validate_config(config, world_size=config.world_size or 2)
