"""DPO throughput and model FLOPs utilisation on one GPU, BasicTrainer vs FSDPTrainer, bf16.

For the device machine (one command, under 10 minutes): Pythia-410M- and Pythia-1B-sized
GPT-NeoX models built from config (random weights, Pythia's 50,304-entry vocabulary), DPO on
the embedded arithmetic prompts padded out with a long shared preamble so sequences are
about ``--max-length`` tokens, global batch ``--batch-size`` pairs. Basic runs the policy in
bfloat16; FSDP keeps float32 parameters and computes in bfloat16 (``model.fsdp_policy_mp``).

MFU = tokens/s x 8N / peak, where N is the parameter count and 8N counts the policy's forward
and backward (6N) and the reference's forward (2N) per token, attention excluded; peak is the
GPU's dense bf16 FLOP/s (``--peak-tflops``, 989 for an H100/H200 SXM).

    python bench/bench_gpu.py [--steps 30] [--batch-size 16] [--max-length 512] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = {  # (hidden, layers, heads, intermediate): EleutherAI's Pythia configs
    "pythia-410m": (1024, 24, 16, 4096),
    "pythia-1b": (2048, 16, 8, 8192),
}


def run(size: str, trainer: str, args, out: Path) -> dict:
    hidden, layers, heads, inter = SIZES[size]
    n = args.batch_size * args.steps
    preamble = "x" * (args.max_length // 2)
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
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "data.jsonl", "w") as f:
        for a in range(400):
            f.write(
                json.dumps({"prompt": f"{preamble} Q: {a}+{a}=\nA:", "chosen": f" {2 * a}", "rejected": f" {2 * a + 1}"}) + "\n"
            )
    done = subprocess.run([sys.executable, "train.py", *overrides], cwd=REPO, capture_output=True, text=True, timeout=900)
    if done.returncode:
        sys.exit(f"{size} {trainer} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    run_dir = next(p for p in out.iterdir() if p.is_dir())
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in recs if "tokens_per_second" in r][len(recs) // 4 :]  # skip warm-up steps
    tps = sum(r["tokens_per_second"] for r in steady) / len(steady)
    params = 12 * layers * hidden**2 + 2 * 50304 * hidden  # GPT-NeoX: 12 L d^2 + embeddings
    mem = max((v for r in recs for k, v in r.items() if k.endswith("peak_cuda_mib")), default=float("nan"))
    return {"tokens_per_s": tps, "mfu": tps * 8 * params / (args.peak_tflops * 1e12), "params": params, "cuda_mib": mem}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in SIZES:
            for trainer in ("BasicTrainer", "FSDPTrainer"):
                r = run(size, trainer, args, Path(tmp) / f"{size}-{trainer}")
                rows.append((size, trainer, r))
                print(
                    f"{size:12} {trainer:14} {r['tokens_per_s']:10.0f} tok/s  MFU {r['mfu']:.1%}  peak {r['cuda_mib']:.0f} MiB",
                    flush=True,
                )
    print(f"\nDPO bf16, batch {args.batch_size} pairs, ~{args.max_length} tokens, {args.steps} steps")
    print(f"{'model':12} {'trainer':14} {'tokens/s':>10} {'MFU':>6} {'FSDP/Basic':>10}")
    for size, trainer, r in rows:
        base = next(x for s, t, x in rows if s == size and t == "BasicTrainer")
        print(
            f"{size:12} {trainer:14} {r['tokens_per_s']:10.0f} {r['mfu']:6.1%} {r['tokens_per_s'] / base['tokens_per_s']:10.2f}"
        )


if __name__ == "__main__":
    main()
