"""DPO throughput and model FLOPs utilisation on one GPU, BasicTrainer vs FSDPTrainer, bf16.

For the device machine (one command, under 10 minutes): Pythia-410M- and Pythia-1B-sized
GPT-NeoX models built from config (random weights, Pythia's 50,304-entry vocabulary), DPO on
the embedded arithmetic prompts padded out with a long shared preamble so sequences are
about ``--max-length`` tokens, global batch ``--batch-size`` pairs. Basic runs the policy in
bfloat16; FSDP keeps float32 parameters and computes in bfloat16 (``model.fsdp_policy_mp``).

MFU counts the FLOPs of what was forwarded (bench/flops.py, formula in bench/README.md): each
pair's packed row (the prompt once, then chosen's and rejected's responses) through the blocks,
each forward call padded to its longest row, the output layer at the labelled positions only,
causal attention; the policy's forward and backward (3x) plus the reference's forward. Its
peak is the GPU's dense bf16 figure found by device name (``--peak-tflops`` overrides); a
bf16 8192^3 GEMM timed in the same run gives the measured peak, and MFU is reported against both.

    python bench/bench_gpu.py [--steps 30] [--batch-size 16] [--max-length 512] [--peak-tflops TFLOPS]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import flops  # noqa: E402

SIZES = {  # (hidden, layers, heads, intermediate): EleutherAI's Pythia configs
    "pythia-410m": (1024, 24, 16, 4096),
    "pythia-1b": (2048, 16, 8, 8192),
    "tiny": (64, 2, 4, 256),  # a CPU check of the mechanics (bench/check_device_prep.sh)
}


HOLDOUT = 0.05  # data.json.holdout_fraction of the runs


def arithmetic_pairs(max_length: int) -> list[dict]:
    """The 400 pairs the runs train on: a preamble of ``max_length // 2`` x's, then "Q: a+a=\nA:";
    chosen " 2a", rejected " 2a+1"."""
    preamble = "x" * (max_length // 2)
    return [{"prompt": f"{preamble} Q: {a}+{a}=\nA:", "chosen": f" {2 * a}", "rejected": f" {2 * a + 1}"} for a in range(400)]


def packed_forward_counts(
    pairs: list[dict], batch_size: int, max_length: int, max_chunks: int | None
) -> tuple[flops.Forwarded, int]:
    """What the trainer's packed DPO forward computes over the train pairs, and their number.

    The pairs outside the holdout, tokenized as train.py does (ByT5, the tokenizer of the default
    ``model=tiny`` that the runs keep; json's keep_end truncation), are batched in file order (the
    trainer shuffles them, but the pairs differ by a few tokens only), packed one row per pair
    (``packing.pack_preference_rows``) and cut into forward calls as the trainer cuts them
    (``packing.plan_chunks``, ``max_chunks`` 1 for FSDP), each call's padding counted.
    """
    sys.path.insert(0, str(REPO))
    from transformers import ByT5Tokenizer

    import preference_datasets as pdata
    from data.holdout import in_holdout
    from modeling import packing

    tokenizer = ByT5Tokenizer()
    train = [p for p in pairs if not in_holdout(p["prompt"], HOLDOUT)]
    total, n = flops.Forwarded(), 0
    for k in range(0, len(train) - batch_size + 1, batch_size):
        elements = [
            pdata.tokenize_element(p["prompt"], p["chosen"], p["rejected"], "keep_end", tokenizer, max_length, max_length - 16)
            for p in train[k : k + batch_size]
        ]
        rows = packing.pack_preference_rows(pdata.collate(elements, tokenizer.pad_token_id))
        total += flops.rows_forwarded(rows, packing.plan_chunks([len(r.ids) for r in rows], max_chunks))
        n += batch_size
    return total, n


def train_overrides(size: str, trainer: str, args, out: Path) -> list[str]:
    """train.py's Hydra overrides for ``size`` trained by ``trainer`` on ``out``'s data.jsonl, outputs in ``out``."""
    hidden, layers, heads, inter = SIZES[size]
    n = args.batch_size * args.steps
    overrides = [
        "~model.config",
        f"+model.config={{model_type:gpt_neox,hidden_size:{hidden},num_hidden_layers:{layers},num_attention_heads:{heads},"
        f"intermediate_size:{inter},vocab_size:50304,max_position_embeddings:2048,tie_word_embeddings:false}}",
        "model.block_name=GPTNeoXLayer",
        "num_threads=null",
        f"trainer={trainer}",
        "world_size=1",
        f"batch_size={args.batch_size}",
        f"eval_batch_size={args.batch_size}",
        f"n_eval_examples={args.batch_size}",
        f"n_examples={n}",
        f"eval_every={n * 10}",
        "do_first_eval=false",
        "sample_during_eval=false",
        "save_hf_export=false",
        "lr=1e-5",
        "sft_first.n_examples=null",  # one run: model=tiny's preset would run an SFT stage first
        f"max_length={args.max_length}",
        f"max_prompt_length={args.max_length - 16}",
        "progress_bar=false",
        "minimum_log_interval_secs=0",
        f"output_root={out}",
        "datasets=[json]",
        f"data.json.path={out / 'data.jsonl'}",
        "data.json.holdout_fraction=0.05",
    ]
    if trainer == "FSDPTrainer":
        overrides.append("model.fsdp_policy_mp=bfloat16")
    else:
        overrides.append("model.policy_dtype=bfloat16")
    return overrides


def run(size: str, trainer: str, args, out: Path, peaks: dict) -> dict:
    """Train ``size`` with ``trainer`` for ``args.steps`` steps in a train.py subprocess; its
    steady tokens/s and pairs/s, its MFU against the table peak and the measured GEMM peak (None
    where unknown), the model's parameters and the peak CUDA memory (MiB)."""
    hidden, layers, heads, inter = SIZES[size]
    overrides = train_overrides(size, trainer, args, out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "data.jsonl", "w") as f:
        for pair in arithmetic_pairs(args.max_length):
            f.write(json.dumps(pair) + "\n")
    done = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=REPO, capture_output=True, text=True, timeout=args.timeout
    )
    if done.returncode:
        sys.exit(f"{size} {trainer} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    run_dir = next(p for p in out.iterdir() if p.is_dir())
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(out, ignore_errors=True)  # its checkpoint (GBs at 1B) is not needed once the figures are read
    steady = [r for r in recs if "tokens_per_second" in r][len(recs) // 4 :]  # skip warm-up steps
    tps = sum(r["tokens_per_second"] for r in steady) / len(steady)
    pairs_per_s = sum(r["examples_per_second"] for r in steady) / len(steady)
    shape = flops.ModelShape(layers, hidden, inter, heads, heads, 50304, hidden // heads, gated_mlp=False, tied=False)
    fw, n_pairs = packed_forward_counts(
        arithmetic_pairs(args.max_length), args.batch_size, args.max_length, 1 if trainer == "FSDPTrainer" else None
    )
    flop_per_s = pairs_per_s * flops.training_flops(shape, fw, fw) / n_pairs  # the live reference forwards the same rows
    mem = max((v for r in recs for k, v in r.items() if k.endswith("peak_cuda_mib")), default=float("nan"))
    return {
        "tokens_per_s": tps,
        "pairs_per_s": pairs_per_s,
        "tflop_per_s": flop_per_s / 1e12,
        **{f"mfu_{k}": flop_per_s / (v * 1e12) if v else None for k, v in peaks.items()},
        "params": shape.n_params(),
        "cuda_mib": mem,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by device name)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="default cuda (cpu: mechanics check)")
    parser.add_argument("--sizes", default="pythia-410m,pythia-1b", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--timeout", type=int, default=900, help="seconds allowed to each train.py run (default 900)")
    parser.add_argument("--json", help="also write all figures to this file")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    if unknown := [s for s in sizes if s not in SIZES]:
        parser.error(f"unknown --sizes {', '.join(unknown)}: choose from {', '.join(SIZES)}")
    if args.device == "cpu":  # every child (the GEMM check, train.py) then sees no GPU
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    gemm = subprocess.run([sys.executable, str(Path(flops.__file__))], capture_output=True, text=True, timeout=300)
    if gemm.returncode:
        sys.exit(f"the GEMM check failed:\n{gemm.stderr[-3000:]}")
    device = json.loads(gemm.stdout)
    peak, why = flops.peak_bf16_tflops(device["name"], args.peak_tflops)
    print(flops.peak_lines(device, peak, why), flush=True)
    peaks = {"table": peak, "gemm": device["gemm_tflops"]}

    def pct(x):
        return f"{x:.1%}" if x is not None else "n/a"

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            for trainer in ("BasicTrainer", "FSDPTrainer"):
                r = run(size, trainer, args, Path(tmp) / f"{size}-{trainer}", peaks)
                rows.append((size, trainer, r))
                print(
                    f"{size:12} {trainer:14} {r['tokens_per_s']:10.0f} tok/s  {r['tflop_per_s']:.4g} TFLOP/s  "
                    f"MFU {pct(r['mfu_table'])} (of GEMM {pct(r['mfu_gemm'])})  peak {r['cuda_mib']:.0f} MiB",
                    flush=True,
                )
    print(f"\nDPO bf16, batch {args.batch_size} pairs, ~{args.max_length} tokens, {args.steps} steps; {device['name']}")
    print(f"MFU: of the table peak ({why}); of GEMM: of the measured {device['gemm_note']}, {device['gemm_tflops']:.4g} TFLOP/s")
    print(
        f"{'model':12} {'trainer':14} {'tokens/s':>10} {'pairs/s':>8} {'TFLOP/s':>8} {'MFU':>6} {'of GEMM':>7} {'FSDP/Basic':>10}"
    )
    for size, trainer, r in rows:
        base = next(x for s, t, x in rows if s == size and t == "BasicTrainer")
        print(
            f"{size:12} {trainer:14} {r['tokens_per_s']:10.0f} {r['pairs_per_s']:8.1f} {r['tflop_per_s']:8.4g} "
            f"{pct(r['mfu_table']):>6} {pct(r['mfu_gemm']):>7} {r['tokens_per_s'] / base['tokens_per_s']:10.2f}"
        )
    if args.json:
        rows_json = [{"size": s, "trainer": t, **r} for s, t, r in rows]
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "device": device, "peak": [peak, why], "rows": rows_json}, indent=1)
        )


if __name__ == "__main__":
    main()
