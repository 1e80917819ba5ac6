"""This project's DPO step vs TRL 1.16's DPOTrainer on one GPU at bf16: tokens/s and MFU.

The GPU part of bench_dpo.py (the same workers, the same fairness settings: see its --help),
as one command for a lent GPU machine, which has no ../shared folder: so the model and the
data are made here.

  * Model: a Pythia-410M-sized GPT-NeoX built from config (24 layers, hidden 1024, 16 heads,
    intermediate 4096, Pythia's 50,304-entry vocabulary, rotary on 25% of each head, parallel
    residual), random weights (seed 0), saved in --dtype to a temporary folder, from which
    both sides load the policy and TRL rebuilds its reference. ``--size tiny`` is a 2-layer,
    hidden-64 model of the same family, for checking the mechanics on a CPU.
  * Data: synthetic pairs as text that the byte-level ByT5 tokenizer (built with no files)
    turns into one token per character: prompt lengths uniform in [16, max_length / 2],
    each response uniform in [8, min(max_length / 2, what is left) - 1] plus EOS, seeded, so
    nothing is truncated on either side. Both sides get the same token ids in the same
    batches (bench_dpo.py's checks: our tokenizer's ids are TRL's ``prompt_ids`` /
    ``chosen_ids`` / ``rejected_ids``, TRL's dataset preparation bypassed).
  * Precision: both sides hold bf16 weights and run AdamW on them (ours:
    ``model.policy_dtype=bfloat16``; TRL: ``model_init_kwargs={"dtype": "bfloat16"}`` and
    ``bf16=True``); TRL's gradient checkpointing off; log-probs in float32 on both sides.
  * Timing: the median step after --warmup steps, the GPU synchronised at each mark; each
    (mode, side) in its own process, alternating ours, TRL; live and precomputed reference.

  * Variants (issue 14, ``--variants``, default chunk-off,lora): after the ours/TRL runs,
    live-reference runs of ours with ``output_layer_chunk=null`` (the logits of all labelled
    positions at once) and with LoRA r 16 on every linear layer (the reference: adapters off),
    and on request TRL with the same peft LoRA (trl-lora); each against ours with the config's
    defaults in a second table. ``--budget`` (device_run.sh: its cap) skips one that would end
    after it; a failed one is a row, and the exit status 1, after everything is written.

Reported per side: pairs/s; tokens/s of the shared work (non-padding tokens of chosen +
rejected, the prompt counted in both: the same count for both sides); hardware MFU, the FLOPs
of what that side forwarded itself (bench/flops.py, formula in bench/README.md: ours, each
pair's packed row with the prompt once, each forward call padded to its longest row, the
output layer at the labelled positions; TRL, chosen and rejected each with the prompt, padded
to the batch's longest, its fused LM head at the completion positions on a GPU, at every
position elsewhere; padding included as computed; policy forward + backward 3x, plus the live
reference's forward) per second over the peak, and useful MFU, the FLOPs of the same work for
both (prompt once, no padding); peak CUDA memory (``torch.cuda.max_memory_allocated``) and
peak RSS. The peak is the GPU's dense bf16 FLOP/s from flops.PEAK_BF16_TFLOPS by device name
(printed with the row used), or --peak-tflops; a bf16 8192^3 GEMM timed in the same run gives
the measured peak, and hardware MFU is also given against it.

    python bench/bench_gpu_dpo.py                      # pythia-410m, cuda, bf16, batch 16, 512 tokens
    python bench/bench_gpu_dpo.py --size tiny --device cpu --dtype float32 --steps 2 --warmup 1 --batch-size 2
    python bench/bench_gpu_dpo.py ... --variants chunk-off,lora,trl-lora --budget 230
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_dpo  # noqa: E402
import flops  # noqa: E402

REPO = bench_dpo.REPO
SIZES = {  # GPT-NeoX configs: EleutherAI's Pythia-410M, and a tiny one for CPU checks
    "pythia-410m": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096},
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 256},
}
VOCAB = 50304
SIDES = ("ours", "trl")
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}  # peft's all-linear: not the output layer
VARIANTS = {  # name -> (side, spec keys, what it is): extra live-reference runs after the ours/TRL table (issue 14)
    "chunk-off": (
        "ours",
        {"overrides": ["output_layer_chunk=null"], "lora": None},
        "ours, output_layer_chunk=null (the logits of all labelled positions at once)",
    ),
    "lora": (
        "ours",
        {
            "overrides": [
                f"model.lora.r={LORA['r']}",
                f"model.lora.alpha={LORA['alpha']}",
                f"model.lora.dropout={LORA['dropout']}",
                f"model.lora.target_modules={LORA['target_modules']}",
            ],
            "lora": LORA,
        },
        "ours, LoRA r 16 on every linear layer; the reference is the base, adapters off",
    ),
    "trl-lora": ("trl", {"lora": LORA}, "TRL, the same peft LoRA; its reference is the base, adapters off"),
}
DEFAULT_VARIANTS = ["chunk-off", "lora"]
CHECKED_WORKERS = str(Path(__file__).resolve().parent / "bench_memory.py")  # its ours / trl workers check the trainer first


def synthetic_texts(n_pairs: int, max_length: int, seed: int) -> list[dict]:
    """``n_pairs`` prompt/chosen/rejected texts of lowercase letters (one ByT5 token each),
    lengths as in the module docstring; no pair needs truncation at ``max_length``."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def text(n):
        return "".join(rng.choice(letters) for _ in range(n))

    pairs = []
    for _ in range(n_pairs):
        p = rng.randint(16, max_length // 2)
        room = min(max_length // 2, max_length - p) - 1  # - 1 for the EOS tokenize_element appends
        pairs.append({"prompt": text(p), "chosen": text(rng.randint(8, room)), "rejected": text(rng.randint(8, room))})
    return pairs


def _save_model(spec: dict, tokenizer):
    """The GPT-NeoX of ``spec``'s size with random weights (seeded), in ``spec``'s dtype, saved with
    ``tokenizer`` to a folder of the temporary directory. Returns (model, its folder)."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(spec["seed"])
    cfg = GPTNeoXConfig(
        **SIZES[spec["size"]],
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        rotary_pct=0.25,
        use_parallel_residual=True,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPTNeoXForCausalLM(cfg).to(getattr(torch, spec["dtype"]))
    model_dir = Path(spec["tmp"]) / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model, model_dir


def worker_prepare(spec: dict) -> dict:
    """Build and save the model and tokenizer; tokenize the pairs with this project's code and
    write them (texts and ids) where bench_dpo's workers read them."""
    sys.path.insert(0, str(REPO))
    from transformers import ByT5Tokenizer

    import preference_datasets as pdata
    from modeling import packing

    tokenizer = ByT5Tokenizer()
    model, model_dir = _save_model(spec, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = n_params - model.get_input_embeddings().weight.numel()
    max_len = spec["max_length"]
    pairs, elements = [], []
    for ex in synthetic_texts(spec["n_pairs"], max_len, spec["seed"]):
        el = pdata.tokenize_element(
            ex["prompt"], ex["chosen"], ex["rejected"], "keep_end", tokenizer, max_len, spec["max_prompt_length"]
        )
        p = len(el["prompt_input_ids"])
        assert len(el["chosen_input_ids"]) <= max_len and len(el["rejected_input_ids"]) <= max_len
        assert p == len(ex["prompt"]) + (tokenizer.bos_token_id is not None), "a prompt was truncated"
        elements.append(el)
        pairs.append(
            {
                **ex,
                "truncation_mode": "keep_end",
                "prompt_ids": el["prompt_input_ids"],
                "chosen_ids": el["chosen_input_ids"][p:],
                "rejected_ids": el["rejected_input_ids"][p:],
            }
        )
    with open(spec["pairs_file"], "w") as f:
        json.dump(pairs, f)
    bs = spec["batch_size"]
    tokens = [
        sum(len(r["prompt_ids"]) * 2 + len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in pairs[k : k + bs])
        for k in range(0, len(pairs), bs)
    ]
    return {
        "model_dir": str(model_dir),
        "n_params": n_params,
        "n_matmul_params": n_matmul,
        "tokens_per_batch": tokens,
        "shape": dataclasses.asdict(flops.ModelShape.from_config(model.config)),
        **forwarded_per_batch(elements, pairs, bs, packing.packed_forward_support(model), spec["cuda"], tokenizer.pad_token_id),
    }


def forwarded_per_batch(elements: list[dict], pairs: list[dict], bs: int, support, cuda: bool, pad: int) -> dict:
    """What each side's forward of each batch (``bs`` pairs in order) computes, as dicts of
    ``flops.Forwarded``: {"forwarded_ours", "forwarded_trl", "forwarded_useful"}, a list each.

    Ours: ``packing.packed_sequence_logps``'s rows and forward calls (BasicTrainer: as many as pay
    off), each call's padding counted. TRL 1.16's ``DataCollatorForPreference``: 2 x bs rows,
    prompt + chosen and prompt + rejected, right-padded to the longest (``max_length`` cuts
    nothing here); its fused LM head scores only the completion positions where Triton runs
    (``trl.kernels.chunked_logprob._use_triton``: CUDA with Triton), else every position but the
    last. Useful: :func:`flops.pair_forwarded` (prompt once, no padding), the same for both.
    """
    from transformers.utils import is_triton_available

    import preference_datasets as pdata
    from modeling import packing

    keep_bool, share = support
    out: dict = {"forwarded_ours": [], "forwarded_trl": [], "forwarded_useful": []}
    for k in range(0, len(pairs), bs):
        rows = packing.pack_preference_rows(pdata.collate(elements[k : k + bs], pad), share)
        ours = flops.rows_forwarded(rows, packing.plan_chunks([len(r.ids) for r in rows]), keep_bool)
        batch = pairs[k : k + bs]
        width = max(len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in batch)
        completions = sum(len(r["chosen_ids"]) + len(r["rejected_ids"]) for r in batch)
        compact = cuda and is_triton_available()
        trl = flops.padded_forwarded(2 * len(batch), width, completions if compact else 2 * len(batch) * (width - 1))
        useful = sum(
            (flops.pair_forwarded(len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"])) for r in batch),
            flops.Forwarded(),
        )
        for key, fw in (("ours", ours), ("trl", trl), ("useful", useful)):
            out[f"forwarded_{key}"].append(dataclasses.asdict(fw))
    return out


def worker_device(spec: dict) -> dict:
    """The device's name, the torch / CUDA versions and the measured bf16 GEMM rate
    (``flops.device_report``), from a process of its own."""
    import torch

    report = flops.device_report("cuda" if spec["cuda"] else "cpu")
    return {**report, "torch": torch.__version__, "cuda": torch.version.cuda if spec["cuda"] else None}


def spawn(role: str, spec: dict, tmp: Path) -> dict:
    """bench_dpo's workers (ours, trl), or this file's own (prepare, device), in a fresh process."""
    script = None if role in ("ours", "trl") else str(Path(__file__).resolve())
    return bench_dpo.spawn(role, spec, tmp, timeout=spec["timeout"], script=script)


def parse_variants(text: str) -> list[str]:
    """``--variants``: comma-separated names of VARIANTS ("" or "none": no variant).

    Raises:
        argparse.ArgumentTypeError: naming an unknown variant and the known ones.
    """
    names = [n.strip() for n in text.split(",") if n.strip() and n.strip() != "none"]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)} (or none)")
    return names


def variant_rows(variants: dict, ours: dict | None, trl: dict | None, batch_size: int, tok_per_step: float) -> list[dict]:
    """The variants' table rows from their worker results (``{"error": ...}`` or ``{"skipped": ...}``
    for one that did not run): pairs/s, tokens/s, peak CUDA memory and RSS (the variant's own
    process), and against ``ours`` (our live-reference run with the config's defaults; None: not
    run) the ratios variant / ours of pairs/s and of peak CUDA memory and the largest per-step
    loss difference; a TRL variant also against ``trl`` (TRL's live run): its ratios likewise."""
    rows = []
    for name, r in variants.items():
        side, _, what = VARIANTS[name]
        row = {"variant": name, "side": side, "what": what}
        if "error" in r or "skipped" in r:
            row["status"] = r.get("error") or r.get("skipped")
            rows.append(row)
            continue
        row.update(
            status="ok",
            pairs_per_s=batch_size / r["step_s"],
            tokens_per_s=tok_per_step / r["step_s"],
            cuda_peak_mib=r.get("cuda_peak_mib", float("nan")),
            rss_peak_mib=r["rss_peak"],
            losses=r["losses"],
        )
        for label, other in (("ours", ours), ("trl", trl if side == "trl" else None)):
            if other is None:
                continue
            row[f"speed_vs_{label}"] = other["step_s"] / r["step_s"]
            row[f"cuda_vs_{label}"] = r.get("cuda_peak_mib", float("nan")) / other.get("cuda_peak_mib", float("nan"))
            row[f"max_loss_diff_vs_{label}"] = max(abs(a - b) for a, b in zip(r["losses"], other["losses"]))
        rows.append(row)
    return rows


def print_variant_rows(rows: list[dict], default_chunk) -> None:
    """The variants' table, after the main one (its title does not start with "DPO ")."""
    print(
        f"\nVariants, live reference, each against ours with the config's defaults (output_layer_chunk: {default_chunk}, "
        "no LoRA); ratio = variant / ours"
    )
    header = (
        f"{'variant':10} | {'pairs/s':>8} {'vs ours':>7} | {'tokens/s':>9} | {'CUDA MiB':>9} {'vs ours':>7} | {'RSS MiB':>8} | "
        f"{'step-0 loss':>11} {'max |dloss| vs ours':>19} | what"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['variant']:10} | {r['status'][:100]} | {r['what']}")
            continue

        def num(key, spec, r=r):
            return format(r[key], spec) if key in r else "-"

        print(
            f"{r['variant']:10} | {r['pairs_per_s']:8.2f} {num('speed_vs_ours', '7.2f')} | {r['tokens_per_s']:9.0f} | "
            f"{r['cuda_peak_mib']:9.0f} {num('cuda_vs_ours', '7.2f')} | {r['rss_peak_mib']:8.0f} | {r['losses'][0]:11.6f} "
            f"{num('max_loss_diff_vs_ours', '19.1e')} | {r['what']}"
            + (f"; vs TRL full: pairs/s x{r['speed_vs_trl']:.2f}, CUDA x{r['cuda_vs_trl']:.2f}" if "speed_vs_trl" in r else "")
        )


def _default_output_layer_chunk():
    """config/config.yaml's output_layer_chunk (None where the key is absent)."""
    import yaml

    return (yaml.safe_load((REPO / "config" / "config.yaml").read_text()) or {}).get("output_layer_chunk")


def build_parser() -> argparse.ArgumentParser:
    """The command line (this module's docstring is its description)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="pythia-410m", help="model size (default pythia-410m)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="default cuda (cpu: mechanics check)")
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="weights and compute (default bfloat16)"
    )
    parser.add_argument("--mode", choices=["live", "precomputed", "both"], default="both", help="reference mode (default both)")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per step (default 16)")
    parser.add_argument("--max-length", type=int, default=512, help="prompt + response tokens (default 512)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="steps run first, not measured (default 5)")
    parser.add_argument("--rounds", type=int, default=1, help="ours, TRL rounds per mode (default 1)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate, both sides (default 1e-5)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by device name)")
    parser.add_argument("--timeout", type=int, default=540, help="seconds allowed to each worker process (default 540)")
    parser.add_argument(
        "--variants",
        type=parse_variants,
        default=DEFAULT_VARIANTS,
        help=f"extra live runs after the table, of {', '.join(VARIANTS)} (default {','.join(DEFAULT_VARIANTS)}; none: no variant)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds this whole script may take (device_run.sh: its cap): a variant that would end later is skipped",
    )
    parser.add_argument("--json", help="also write all figures to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def base_spec(args, tmp: Path, n_pairs: int) -> dict:
    """The settings every worker shares, from the command line's ``args``; ``n_pairs`` pairs prepared into ``tmp``."""
    return {
        "cuda": args.device == "cuda",
        "dtype": args.dtype,
        "size": args.size,
        "threads": os.cpu_count() or 1,
        "seed": 0,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "max_prompt_length": args.max_length // 2,
        "lr": args.lr,
        "max_grad_norm": 1.0,
        "beta": 0.1,
        "warmup": args.warmup,
        "steps": args.steps,
        "n_pairs": n_pairs,
        "trl_optim": "adamw_torch",
        "pairs_file": str(tmp / "pairs.json"),
        "tmp": str(tmp),
        "timeout": args.timeout,
    }


def step_flops(prep: dict, measured: slice, side: str, mode: str) -> float:
    """Mean FLOPs of a measured step of ``side`` (ours, trl, useful): policy forward and
    backward, plus the reference's forward when it is live."""
    shape = flops.ModelShape(**prep["shape"])
    fws = [flops.Forwarded(**f) for f in prep[f"forwarded_{side}"][measured]]
    return sum(flops.training_flops(shape, fw, fw if mode == "live" else None) for fw in fws) / len(fws)


def run_rounds(args, base: dict, prep: dict, modes: list[str], tmp: Path, tok_per_step: float) -> tuple[dict, float]:
    """Ours and TRL, alternating per mode, over --rounds, printed. Returns ({(mode, side): results},
    the longest training process's seconds, start to end)."""
    results: dict = {}
    longest = 0.0  # the longest training process so far, start to end (s): what a variant is expected to take
    for rnd in range(args.rounds):
        for mode in modes:
            for side in SIDES:
                t0 = time.time()
                r = spawn(side, {**base, "mode": mode, "side": side, "model_dir": prep["model_dir"]}, tmp)
                longest = max(longest, time.time() - t0)
                results.setdefault((mode, side), []).append(r)
                print(
                    f"round {rnd + 1}: {mode:11} {side:4} {args.batch_size / r['step_s']:7.2f} pairs/s, "
                    f"{tok_per_step / r['step_s']:9.0f} tokens/s, peak CUDA {r.get('cuda_peak_mib', float('nan')):.0f} MiB, "
                    f"RSS {r['rss_peak']:.0f} MiB, step-0 loss {r['losses'][0]:.6f}, run {r['wall_s']:.0f} s",
                    flush=True,
                )
    return results, longest


def run_variants(args, base: dict, prep: dict, tmp: Path, started: float, longest: float, tok_per_step: float) -> dict:
    """The --variants' live runs, each skipped where it would pass --budget, printed; {name: result,
    or {"error"} or {"skipped"}}."""
    variants: dict = {}
    for name in args.variants:
        side, keys, _ = VARIANTS[name]
        elapsed = time.time() - started
        if args.budget is not None and elapsed + longest + 15 > args.budget:
            variants[name] = {
                "skipped": f"skipped: {elapsed:.0f} s + about {longest:.0f} s would pass --budget {args.budget:.0f} s"
            }
            print(f"variant {name}: {variants[name]['skipped']}", flush=True)
            continue
        t0 = time.time()
        try:
            spec = {**base, "mode": "live", "side": side, "model_dir": prep["model_dir"], "task": "dpo", **keys}
            spec["activation_checkpointing"] = False
            # bench_memory's workers: bench_dpo's, after checking that the trainer is what the variant asks (LoRA or not)
            r = bench_dpo.spawn(side, spec, tmp, timeout=spec["timeout"], script=CHECKED_WORKERS)
        except SystemExit as e:  # bench_dpo.spawn's failure: recorded, the other runs stand
            lines = str(e).strip().splitlines()
            variants[name] = {
                "error": "FAILED: " + next((x for x in reversed(lines) if "Error" in x), lines[-1] if lines else "")
            }
            print(f"variant {name}: {str(e)[-3000:]}", flush=True)
            continue
        longest = max(longest, time.time() - t0)
        variants[name] = r
        print(
            f"variant {name:9} {side:4} {args.batch_size / r['step_s']:7.2f} pairs/s, {tok_per_step / r['step_s']:9.0f} tokens/s, "
            f"peak CUDA {r.get('cuda_peak_mib', float('nan')):.0f} MiB, RSS {r['rss_peak']:.0f} MiB, "
            f"step-0 loss {r['losses'][0]:.6f}, run {r['wall_s']:.0f} s",
            flush=True,
        )
    return variants


def side_row(args, rs: list[dict], prep: dict, device: dict, peak, mode: str, side: str, tok_per_step: float) -> dict:
    """One side's figures of one mode over its rounds ``rs``: speed, FLOP rates and MFUs, memory, losses."""
    measured = slice(args.warmup, args.warmup + args.steps)
    step_s = sum(r["step_s"] for r in rs) / len(rs)
    tps = tok_per_step / step_s
    hw, useful = step_flops(prep, measured, side, mode) / step_s, step_flops(prep, measured, "useful", mode) / step_s
    return {
        "pairs_per_s": args.batch_size / step_s,
        "tokens_per_s": tps,
        "hw_tflop_per_s": hw / 1e12,
        "useful_tflop_per_s": useful / 1e12,
        "mfu": hw / (peak * 1e12) if peak else None,
        "mfu_of_gemm": hw / (device["gemm_tflops"] * 1e12),
        "useful_mfu": useful / (peak * 1e12) if peak else None,
        "cuda_peak_mib": max(r.get("cuda_peak_mib", float("nan")) for r in rs),
        "rss_peak_mib": max(r["rss_peak"] for r in rs),
        "losses": rs[0]["losses"],
        "precompute_s": rs[0]["precompute_s"],
    }


def _pct(x):
    return f"{x:.1%}" if x is not None else "n/a"


def print_table(
    args, modes: list[str], results: dict, prep: dict, device: dict, peak, why: str, tok_per_step: float
) -> list[dict]:
    """The table of ours vs TRL per mode (speed, MFUs, memory, loss difference), printed; its rows."""
    rows = []
    header = (
        f"{'reference':12} | {'pairs/s ours':>12} {'TRL':>7} {'ratio':>6} | {'tokens/s ours':>13} {'TRL':>8} | "
        f"{'hw MFU ours':>11} {'TRL':>6} | {'of GEMM ours':>12} {'TRL':>6} | {'useful MFU ours':>15} {'TRL':>6} | "
        f"{'CUDA MiB ours':>13} {'TRL':>6} | {'max |dloss|':>11}"
    )
    print(f"\nDPO step, ours vs TRL DPOTrainer, {args.dtype}, {args.size}, median of {args.steps} steps, {args.rounds} round(s)")
    print(
        f"MFU of the table peak ({why}); of GEMM: of the measured {device['gemm_note']}, {device['gemm_tflops']:.4g} TFLOP/s; "
        "hw: each side's own forwarded positions, padding included; useful: prompt once, no padding, the same work for both"
    )
    print(header)
    print("-" * len(header))
    for mode in modes:
        row = {"mode": mode}
        for side in SIDES:
            row[side] = side_row(args, results[(mode, side)], prep, device, peak, mode, side, tok_per_step)
        o, t = row["ours"], row["trl"]
        row["ratio"] = o["pairs_per_s"] / t["pairs_per_s"]
        row["max_loss_diff"] = max(abs(a - b) for a, b in zip(o["losses"], t["losses"]))
        rows.append(row)
        print(
            f"{mode:12} | {o['pairs_per_s']:12.2f} {t['pairs_per_s']:7.2f} {row['ratio']:6.2f} | {o['tokens_per_s']:13.0f} "
            f"{t['tokens_per_s']:8.0f} | {_pct(o['mfu']):>11} {_pct(t['mfu']):>6} | {_pct(o['mfu_of_gemm']):>12} "
            f"{_pct(t['mfu_of_gemm']):>6} | {_pct(o['useful_mfu']):>15} {_pct(t['useful_mfu']):>6} | "
            f"{o['cuda_peak_mib']:13.0f} {t['cuda_peak_mib']:6.0f} | {row['max_loss_diff']:11.1e}"
        )
    print(
        "step-0 losses (ln 2 = 0.693147): "
        + ", ".join(f"{r['mode']} {r['ours']['losses'][0]:.6f} / {r['trl']['losses'][0]:.6f}" for r in rows)
    )
    return rows


def main() -> None:
    """Parse the arguments, run the workers (ours, TRL alternating per mode), print the table."""
    args = build_parser().parse_args()
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        out = {"prepare": worker_prepare, "device": worker_device}[args.worker](spec)
        Path(args.result).write_text(json.dumps(out))
        return
    started = time.time()
    modes = ["live", "precomputed"] if args.mode == "both" else [args.mode]
    n_pairs = (args.warmup + args.steps) * args.batch_size
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = base_spec(args, tmp, n_pairs)
        device = spawn("device", base, tmp)
        peak, why = flops.peak_bf16_tflops(device["name"], args.peak_tflops)
        prep = spawn("prepare", base, tmp)
        tokens = prep["tokens_per_batch"][args.warmup : args.warmup + args.steps]
        tok_per_step = sum(tokens) / len(tokens)
        print(
            f"{device['name']} (torch {device['torch']}, CUDA {device['cuda']}); {args.size}: {prep['n_params'] / 1e6:.1f}M "
            f"parameters ({prep['n_matmul_params'] / 1e6:.1f}M in matrix products), {args.dtype}; {n_pairs} synthetic pairs, "
            f"batch {args.batch_size}, {tok_per_step:.0f} non-padding tokens per measured batch\n"
            + flops.peak_lines(device, peak, why),
            flush=True,
        )
        results, longest = run_rounds(args, base, prep, modes, tmp, tok_per_step)
        variants = run_variants(args, base, prep, tmp, started, longest, tok_per_step)
    rows = print_table(args, modes, results, prep, device, peak, why, tok_per_step)
    first = {key: rs[0] for key, rs in results.items()}
    extra = variant_rows(variants, first.get(("live", "ours")), first.get(("live", "trl")), args.batch_size, tok_per_step)
    if extra:
        print_variant_rows(extra, _default_output_layer_chunk())
    print(f"total wall time {time.time() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "device": device, "peak": [peak, why], "prepare": prep, "rows": rows, "variants": extra},
                indent=1,
            )
        )
    if any(r["status"] not in ("ok",) and not r["status"].startswith("skipped") for r in extra):
        sys.exit(1)  # a variant failed: its row says so, the figures are written


if __name__ == "__main__":
    main()
