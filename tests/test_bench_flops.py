"""bench/flops.py: the FLOPs of a DPO step (counted by hand here), the bf16 peak table, the GEMM
timer; and what bench_gpu.py / bench_gpu_dpo.py count per batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import flops  # noqa: E402

import losses  # noqa: E402
import preference_datasets as pdata  # noqa: E402
from modeling import packing  # noqa: E402

# 2 layers, hidden 8, MLP 16, 2 heads of 4, vocab 10, plain MLP (GPT-NeoX)
NEOX = {
    "model_type": "gpt_neox",
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 16,
    "vocab_size": 10,
}


def element(prompt: list[int], chosen: list[int], rejected: list[int]) -> dict:
    """A tokenized pair as preference_datasets.tokenize_element makes it: responses labelled, the prompt not."""
    el = {"prompt_input_ids": prompt}
    for side, resp in (("chosen", chosen), ("rejected", rejected)):
        el[f"{side}_input_ids"] = prompt + resp
        el[f"{side}_attention_mask"] = [1] * (len(prompt) + len(resp))
        el[f"{side}_labels"] = [losses.IGNORE_INDEX] * len(prompt) + resp
    return el


def test_block_params_by_hand_for_each_family():
    # GPT-NeoX: attention q, k, v, o = 4 * 8 * 8 = 256, MLP 2 * 8 * 16 = 256: 512 a layer, 2 layers
    neox = flops.ModelShape.from_config(NEOX)
    assert (neox.block_params, neox.head_params) == (1024, 80)
    assert neox.n_params() == 1024 + 80 + 80  # untied: embedding and output layer
    # Llama, 2 heads of 4, 1 KV head: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192; gated MLP 3 * 8 * 16 = 384
    llama = {**NEOX, "model_type": "llama", "num_key_value_heads": 1, "tie_word_embeddings": True}
    shape = flops.ModelShape.from_config(llama)
    assert shape.block_params == 2 * (192 + 384) and shape.n_params() == 1152 + 80
    # GPT-2: n_inner None means 4 * 8 = 32: MLP 2 * 8 * 32 = 512, attention 256
    gpt2 = {"model_type": "gpt2", "n_embd": 8, "n_layer": 2, "n_head": 2, "n_inner": None, "vocab_size": 10}
    assert flops.ModelShape.from_config(gpt2).block_params == 2 * (256 + 512)
    # a transformers config object is read the same way
    from transformers import GPTNeoXConfig

    assert flops.ModelShape.from_config(GPTNeoXConfig(**{k: v for k, v in NEOX.items() if k != "model_type"})) == neox
    with pytest.raises(ValueError, match="model_type 'bert'"):
        flops.ModelShape.from_config({"model_type": "bert"})


def test_forward_flops_of_a_row_by_hand():
    """A packed row of 5 tokens, 3 of its positions predicting a labelled token."""
    shape = flops.ModelShape.from_config(NEOX)
    row = packing.PackedRow([1, 2, 3, 4, 5], None, None, target_cols=[1, 2, 3], target_ids=[3, 4, 5], target_seqs=[0, 0, 0])
    fw = flops.rows_forwarded([row])
    # attention pairs, causal: position p sees p + 1 keys: 1 + 2 + 3 + 4 + 5 = 15
    assert fw == flops.Forwarded(block_tokens=5, head_tokens=3, attention_pairs=15)
    # blocks 2 * 1024 * 5 = 10240; output layer 2 * 8 * 10 * 3 = 480 (3 positions, not 5);
    # attention 4 * 2 layers * 2 heads * 4 dims * 15 pairs = 960
    assert flops.forward_flops(shape, fw) == 10240 + 480 + 960 == 11680
    # policy forward + backward (3x) + live reference forward (1x); precomputed reference: 3x only
    assert flops.training_flops(shape, fw, fw) == 4 * 11680
    assert flops.training_flops(shape, fw, None) == 3 * 11680


def test_shared_prompt_counted_once_per_pair():
    """Prompt P = 4 tokens, chosen C = 2, rejected R = 3, different first tokens: one packed row of
    P + C + R = 9 tokens (not 2P + C + R = 13)."""
    batch = pdata.collate([element([1, 2, 3, 4], [5, 6], [7, 8, 9])], pad_token_id=0)
    rows = packing.pack_preference_rows(batch, share_prompt=True)
    fw = flops.rows_forwarded(rows)
    # attention: chosen's 6 positions see 1..6 keys (21), rejected's 3 see 5, 6, 7 (18): 39;
    # output layer: columns 3 (predicts chosen's 5 and rejected's 7, computed once), 4, 6, 7 = 4
    assert fw == flops.Forwarded(9, 4, 39)
    # the implementation-free count of the same work: T(6) + T(7) - T(4) = 21 + 28 - 10 = 39, C + R - 1 = 4
    assert flops.pair_forwarded(4, 2, 3) == fw
    # as the hardware computes it: one call of width 9, causal 45 pairs
    assert flops.rows_forwarded(rows, packing.plan_chunks([len(r.ids) for r in rows])) == flops.Forwarded(9, 4, 45)
    # without a shared prompt (two rows of 6 and 7 tokens, chunked together: width 7, 2 rows)
    apart = packing.pack_preference_rows(batch, share_prompt=False)
    assert flops.rows_forwarded(apart) == flops.Forwarded(13, 5, 21 + 28)
    assert flops.rows_forwarded(apart, [[0, 1]]) == flops.Forwarded(14, 5, 2 * 28)


def test_output_layer_without_boolean_keep_covers_a_suffix():
    """A model without a boolean logits_to_keep gets the output layer from the call's first target
    column on: the row above has its first target at column 3, width 9: 6 positions."""
    batch = pdata.collate([element([1, 2, 3, 4], [5, 6], [7, 8, 9])], pad_token_id=0)
    rows = packing.pack_preference_rows(batch, share_prompt=True)
    assert flops.rows_forwarded(rows, [[0]], keep_bool=False).head_tokens == 6


def test_padded_batch_counts_padding():
    """TRL's batch for that pair: rows prompt + chosen (6) and prompt + rejected (7), padded to 7."""
    assert flops.padded_forwarded(2, 7, head_tokens=5) == flops.Forwarded(14, 5, 2 * 28)


def test_bench_gpu_dpo_counts_each_side_from_its_own_batch(monkeypatch):
    """bench_gpu_dpo.forwarded_per_batch on a batch of two pairs, (P, C, R) = (4, 2, 3) and (2, 1, 2)."""
    import bench_gpu_dpo
    import transformers.utils

    els = [element([1, 2, 3, 4], [5, 6], [7, 8, 9]), element([1, 2], [3], [4, 5])]
    pairs = [
        {"prompt_ids": [1, 2, 3, 4], "chosen_ids": [5, 6], "rejected_ids": [7, 8, 9]},
        {"prompt_ids": [1, 2], "chosen_ids": [3], "rejected_ids": [4, 5]},
    ]
    out = bench_gpu_dpo.forwarded_per_batch(els, pairs, 2, (True, True), cuda=False, pad=0)
    # ours: packed rows of 9 and 5 tokens; plan_chunks: one call costs 2 * 9 + 0.05 * 2 * 9 = 18.9,
    # two cost 9 + 5 + 2 * 0.9 = 15.8, so two calls, no padding: T(9) + T(5) = 45 + 15 attention
    # pairs; output layer C + R - 1 per pair: 4 + 2
    assert out["forwarded_ours"] == [{"block_tokens": 14, "head_tokens": 6, "attention_pairs": 60}]
    # TRL: 4 rows (6, 7, 3, 4 tokens) padded to 7: 28 positions, 4 * T(7) = 112 pairs; on CPU its
    # LM head runs at every position but the last of each row: 4 * 6
    assert out["forwarded_trl"] == [{"block_tokens": 28, "head_tokens": 24, "attention_pairs": 112}]
    # useful: 9 + 5 tokens; attention T(6) + T(7) - T(4) = 39 and T(3) + T(4) - T(2) = 13
    assert out["forwarded_useful"] == [{"block_tokens": 14, "head_tokens": 6, "attention_pairs": 52}]
    # on a GPU with Triton, TRL's LM head scores the completion tokens only: 2 + 3 + 1 + 2
    monkeypatch.setattr(transformers.utils, "is_triton_available", lambda: True)
    out = bench_gpu_dpo.forwarded_per_batch(els, pairs, 2, (True, True), cuda=True, pad=0)
    assert out["forwarded_trl"][0]["head_tokens"] == 8


def test_bench_gpu_counts_packed_rows(monkeypatch):
    """bench_gpu.packed_forward_counts: a pair of prompt "ab" and responses "c" / "d" (ByT5: one
    token per byte, EOS after each response) is one row of 2 + 2 + 2 = 6 tokens, output layer at 3."""
    import bench_gpu

    pairs = [{"prompt": "ab", "chosen": "c", "rejected": "d"}] * 3
    monkeypatch.setattr(bench_gpu, "HOLDOUT", 0.0)
    fw, n = bench_gpu.packed_forward_counts(pairs, batch_size=2, max_length=32, max_chunks=1)
    # one batch of 2 pairs (the third is left over), one call of 2 rows of width 6
    assert n == 2 and fw == flops.Forwarded(block_tokens=12, head_tokens=6, attention_pairs=2 * 21)


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10G", 70.0),
    ],
)
def test_peak_table(name, tflops):
    peak, why = flops.peak_bf16_tflops(name)
    assert peak == tflops and name in why and f"{tflops:g} TFLOP/s" in why


def test_peak_override_and_unknown():
    assert flops.peak_bf16_tflops("NVIDIA H200 NVL", 500.0) == (500.0, "500 TFLOP/s: given by --peak-tflops")
    peak, why = flops.peak_bf16_tflops("cpu")
    assert peak is None and "--peak-tflops" in why


def test_gemm_timer_on_cpu(monkeypatch):
    assert flops.measure_gemm_tflops("cpu", n=32, warmup=1, iters=2) > 0
    monkeypatch.setitem(flops.GEMM_SIZE, "cpu", 64)  # the report's path, not its figure: 1024^3 in bf16 took a minute on one core
    report = flops.device_report("cpu")
    assert report["gemm_tflops"] > 0 and "CPU figure" in report["gemm_note"]
    assert not torch.cuda.is_available() or report["name"] != "cpu"
