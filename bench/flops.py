"""Model FLOPs of a DPO step and the GPU's bf16 peak, for bench_gpu.py and bench_gpu_dpo.py.

Forward FLOPs of one forward call (the convention of Kaplan et al. 2020, sec. 2.1, and PaLM,
Chowdhery et al. 2022, appendix B: 2 FLOPs per multiply-add of a weight matrix, attention's two
matrix products counted, the causal half only as in FlashAttention's benchmarks; embedding
lookups, norms, biases, activations and softmax not counted)::

    F_fwd = 2 * N_block * T_block + 2 * d * V * T_head + 4 * n_layers * n_heads * d_head * A

    N_block = n_layers * (d * d_head * (2 * n_heads + 2 * n_kv_heads) + k * d * d_ff)
              (k = 3 for a gated MLP, Llama; 2 for GPT-NeoX, GPT-2, GPT-J)
    T_block = positions through the blocks, T_head = positions the output layer is applied at,
    A       = (query, key) pairs attended, summed over rows and query positions

and a training step is ``3 * F_fwd(policy) + F_fwd(reference)`` (backward = 2x forward; the
reference term is 0 when its log-probs are precomputed or there is none). MFU = step FLOPs /
step time / peak; recomputation (activation checkpointing, TRL's fused LM head recomputing the
logits in its backward) is not counted, as MFU requires (PaLM appendix B).

What "positions" are is the caller's: :func:`rows_forwarded` counts this project's packed rows
(each pair's prompt once; with ``groups``, the padding of each forward call to its longest row
included, as the hardware computes it), :func:`padded_forwarded` TRL's padded batch, and
:func:`pair_forwarded` the useful work of a pair (prompt once, both responses, no padding).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
from collections.abc import Mapping, Sequence

PEAK_BF16_TFLOPS = [  # (words of the device name, dense bf16 TFLOP/s, what it is); NVIDIA data sheets, no sparsity
    ("H100 PCIe", 756.0, "H100 PCIe"),
    ("H100 NVL", 835.0, "H100 NVL"),
    ("H200 NVL", 835.0, "H200 NVL"),
    ("H800 PCIe", 756.0, "H800 PCIe"),
    ("GH200", 989.0, "GH200"),
    ("H200", 989.0, "H200 SXM"),
    ("H100", 989.0, "H100 SXM"),
    ("H800", 989.0, "H800 SXM"),
    ("B200", 2250.0, "B200"),
    ("A100", 312.0, "A100"),
    ("A800", 312.0, "A800"),
    ("L40S", 362.0, "L40S"),
    ("L40", 181.0, "L40"),
    ("L4", 121.0, "L4"),
    ("A10G", 70.0, "A10G"),
    ("A10", 125.0, "A10"),
    ("RTX 4090", 165.0, "RTX 4090"),
    ("RTX 3090", 71.0, "RTX 3090"),
]
"""Tried in order; a key matches when its words appear, consecutively and whole, among the device
name's words (``torch.cuda.get_device_name``, split at anything not a letter or digit), so
"NVIDIA H200 NVL" is an H200 NVL (835), "NVIDIA H200" an H200 SXM (989), "NVIDIA L40S" no L4."""

GEMM_SIZE = {"cuda": 8192, "cpu": 1024}
"""The square matmul :func:`measure_gemm_tflops` times by default: 8192^3 on a GPU, a tiny one on CPU."""


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def peak_bf16_tflops(device_name: str, override: float | None = None) -> tuple[float | None, str]:
    """The dense bf16 peak of a device, and why.

    Args:
        device_name: e.g. ``torch.cuda.get_device_name(0)``, "NVIDIA H200 NVL".
        override: a peak in TFLOP/s given by the user (``--peak-tflops``); wins when set.

    Returns:
        (TFLOP/s or None when the name is in no row of :data:`PEAK_BF16_TFLOPS`, a phrase saying
        which figure was used, e.g. "989 TFLOP/s: NVIDIA H200 (H200 SXM, dense bf16)").
    """
    if override:
        return float(override), f"{override:g} TFLOP/s: given by --peak-tflops"
    name = _words(device_name)
    for key, value, what in PEAK_BF16_TFLOPS:
        k = _words(key)
        if any(name[i : i + len(k)] == k for i in range(len(name) - len(k) + 1)):
            return value, f"{value:g} TFLOP/s: {device_name} ({what}, dense bf16)"
    return None, f"unknown: {device_name!r} is not in the peak table (give --peak-tflops)"


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that set its FLOPs.

    Attributes:
        n_layers, hidden (d), intermediate (d_ff), n_heads, n_kv_heads, vocab (V), head_dim (d_head).
        gated_mlp: three MLP matrices (Llama's gate, up, down) instead of two.
        tied: the output layer shares the input embedding's weights (no effect on FLOPs: the
            output layer is a d x V product either way; it only changes :meth:`n_params`).
    """

    n_layers: int
    hidden: int
    intermediate: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    head_dim: int
    gated_mlp: bool
    tied: bool

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """The shape of a Hugging Face config (an object or a dict with ``model_type``) of the
        families this repository supports: Llama (and the gated-MLP families sharing its keys:
        Mistral, Qwen2/3), GPT-NeoX, GPT-2 and GPT-J.

        Raises:
            ValueError: for another ``model_type``.
        """

        def get(key, default=None):
            value = config.get(key, default) if isinstance(config, Mapping) else getattr(config, key, default)
            return default if value is None else value

        kind = get("model_type")
        if kind in ("gpt2", "gptj"):
            d, heads = get("n_embd"), get("n_head")
            tied = bool(get("tie_word_embeddings", kind == "gpt2"))
            return cls(get("n_layer"), d, get("n_inner", 4 * d), heads, heads, get("vocab_size"), d // heads, False, tied)
        if kind == "gpt_neox":
            d, heads = get("hidden_size"), get("num_attention_heads")
            return cls(
                get("num_hidden_layers"),
                d,
                get("intermediate_size"),
                heads,
                heads,
                get("vocab_size"),
                d // heads,
                False,
                bool(get("tie_word_embeddings", False)),
            )
        if kind in ("llama", "mistral", "qwen2", "qwen3"):
            d, heads = get("hidden_size"), get("num_attention_heads")
            return cls(
                get("num_hidden_layers"),
                d,
                get("intermediate_size"),
                heads,
                get("num_key_value_heads", heads),
                get("vocab_size"),
                get("head_dim", d // heads),
                True,
                bool(get("tie_word_embeddings", False)),
            )
        raise ValueError(f"FLOPs are counted for Llama, GPT-NeoX, GPT-2 and GPT-J configs, not model_type {kind!r}.")

    @property
    def block_params(self) -> int:
        """Weights in the blocks' matrix products (N_block; norms and biases not counted)."""
        attn = self.hidden * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.n_layers * (attn + mlp)

    @property
    def head_params(self) -> int:
        """Weights of the output layer, d x V."""
        return self.hidden * self.vocab

    def n_params(self) -> int:
        """Matrix weights of the model: blocks, input embedding, and the output layer unless tied."""
        return self.block_params + self.head_params * (1 if self.tied else 2)


@dataclasses.dataclass(frozen=True)
class Forwarded:
    """What one or more forward calls computed.

    Attributes:
        block_tokens: positions through the blocks (T_block).
        head_tokens: positions the output layer is applied at (T_head).
        attention_pairs: (query, key) pairs attended, causal (A).
    """

    block_tokens: int = 0
    head_tokens: int = 0
    attention_pairs: int = 0

    def __add__(self, other: Forwarded) -> Forwarded:
        return Forwarded(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def forward_flops(shape: ModelShape, fw: Forwarded) -> int:
    """FLOPs of the forward calls ``fw`` (the module docstring's F_fwd)."""
    attention = 4 * shape.n_layers * shape.n_heads * shape.head_dim * fw.attention_pairs
    return 2 * shape.block_params * fw.block_tokens + 2 * shape.head_params * fw.head_tokens + attention


def training_flops(shape: ModelShape, policy: Forwarded, reference: Forwarded | None) -> int:
    """FLOPs of a training step: the policy's forward and backward (3x forward) plus the
    reference's forward (``reference`` None when precomputed or absent: 0)."""
    return 3 * forward_flops(shape, policy) + (forward_flops(shape, reference) if reference is not None else 0)


def _triangle(n: int) -> int:
    """Causal (query, key) pairs of a row of n positions: 1 + 2 + ... + n."""
    return n * (n + 1) // 2


def pair_forwarded(prompt: int, chosen: int, rejected: int) -> Forwarded:
    """The useful work of a pair, the same for any implementation: the prompt once, both responses,
    no padding; each token attends to its own sequence's earlier tokens (chosen's to the prompt and
    chosen, rejected's to the prompt and rejected); the output layer at each position that
    predicts a response token, the prompt's last position once though it predicts the first token
    of each response (so C + R - 1 positions: what the packed forward computes for a pair whose
    responses differ from their first token).

    Args:
        prompt, chosen, rejected: token counts (the prompt with its BOS, responses with EOS; >= 1).
    """
    pairs = _triangle(prompt + chosen) + _triangle(prompt + rejected) - _triangle(prompt)
    return Forwarded(prompt + chosen + rejected, chosen + rejected - 1, pairs)


def rows_forwarded(rows: Sequence, groups: Sequence[Sequence[int]] | None = None, keep_bool: bool = True) -> Forwarded:
    """What this project's packed forward computes for ``rows`` (``packing.PackedRow``: ids,
    positions, target_cols), the output layer at the labelled positions only (each column once,
    as the boolean ``logits_to_keep`` keeps it, though a first response token both sides share
    is a target of each).

    Args:
        rows: the packed rows of one batch.
        groups: the forward calls (``packing.plan_chunks``): each call is padded to its longest
            row, and padding positions are counted as computed (T_block = rows x width, A = rows x
            width (width + 1) / 2 per call). None: the rows' own tokens only, no padding, each
            token attending to position + 1 keys (the packed mask's causal count).
        keep_bool: the model takes a boolean ``logits_to_keep`` (``packing.packed_forward_support``);
            False: the output layer covers each call's columns from its first target on (needs ``groups``).
    """
    head = sum(len(set(r.target_cols)) for r in rows)  # a column predicting a token both sides share is kept once
    if groups is None:
        pairs = sum(sum(p + 1 for p in (r.positions if r.positions is not None else range(len(r.ids)))) for r in rows)
        return Forwarded(sum(len(r.ids) for r in rows), head, pairs)
    groups = [g for g in groups if g]
    widths = [(len(g), max(len(rows[k].ids) for k in g)) for g in groups]
    if not keep_bool:
        firsts = [min((c for k in g for c in rows[k].target_cols), default=w - 1) for g, (_, w) in zip(groups, widths)]
        head = sum(n * (w - f) for (n, w), f in zip(widths, firsts))
    return Forwarded(sum(n * w for n, w in widths), head, sum(n * _triangle(w) for n, w in widths))


def padded_forwarded(n_rows: int, width: int, head_tokens: int) -> Forwarded:
    """A padded batch of ``n_rows`` sequences of ``width`` positions (padding included, as computed),
    the output layer at ``head_tokens`` positions (TRL 1.16's fused LM head: the completion
    tokens on a GPU with Triton, every position but the last of each row elsewhere)."""
    return Forwarded(n_rows * width, head_tokens, n_rows * _triangle(width))


def measure_gemm_tflops(device: str = "cuda", n: int | None = None, warmup: int = 3, iters: int = 10) -> float:
    """The bf16 matmul rate of ``device``: an n x n by n x n product (2 n^3 FLOPs) timed ``iters``
    times after ``warmup`` untimed ones (CUDA events on a GPU, ``time.perf_counter`` on CPU).

    Args:
        device: "cuda" or "cpu".
        n: the size (default :data:`GEMM_SIZE`: 8192 on a GPU, 1024 on CPU, where it is a CPU figure).

    Returns:
        TFLOP/s (> 0).
    """
    import torch

    n = n or GEMM_SIZE["cuda" if device.startswith("cuda") else "cpu"]
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    for _ in range(warmup):
        c = a @ b
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            c = a @ b
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            c = a @ b
        seconds = time.perf_counter() - t0
    del a, b, c
    return 2 * n**3 * iters / max(seconds, 1e-12) / 1e12


def device_report(device: str | None = None) -> dict:
    """The device's name and its measured bf16 GEMM rate: {"name", "device", "gemm_n",
    "gemm_tflops", "gemm_note"} (the note says when it is a CPU figure)."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    n = GEMM_SIZE[device]
    tflops = measure_gemm_tflops(device, n)
    note = f"bf16 GEMM {n}^3" + (" (a CPU figure, tiny size: not a GPU peak)" if device == "cpu" else "")
    return {"name": name, "device": device, "gemm_n": n, "gemm_tflops": tflops, "gemm_note": note}


def peak_lines(report: dict, peak: float | None, why: str) -> str:
    """Two lines for a benchmark's header: the table peak used and why, and the measured GEMM rate
    with its share of the table peak."""
    share = f", {report['gemm_tflops'] / peak:.0%} of the table peak" if peak else ""
    return f"peak {why}\nmeasured {report['gemm_note']}: {report['gemm_tflops']:.4g} TFLOP/s{share}"


def main() -> None:
    """``python bench/flops.py [--device cuda|cpu]``: print :func:`device_report` as JSON."""
    parser = argparse.ArgumentParser(description="The device's name and its measured bf16 GEMM rate, as JSON.")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    print(json.dumps(device_report(parser.parse_args().device)))


if __name__ == "__main__":
    main()
