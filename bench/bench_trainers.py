"""Basic vs FSDP vs tensor-parallel DPO on the same CPU work, in one run.

Each trainer trains the same random model (``--size``: a Llama with 4 layers, hidden 256, 8 heads,
intermediate 688, or a Pythia-160M-shaped GPT-NeoX; byte-level tokenizer) on the same real HH pairs from ../shared/data/hh-rlhf, with the same
global batch, max_length and steps; FSDP and TP use 2 processes (gloo). Prints DPO pairs/s
(steady state: the mean of the logged rates after the first), each rank's peak RSS over the
whole run and up to the end of model loading and sharding (under FSDP/TP only rank 0 reads the
weights), with ratios to BasicTrainer.

    python bench/bench_trainers.py [--examples 192] [--batch-size 8] [--max-length 256] [--size llama-4x256]
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
HH = REPO.parent / "shared" / "data" / "hh-rlhf"
MODELS = {  # random models built from config; the byte-level tokenizer's vocabulary
    "llama-4x256": "{model_type:llama,hidden_size:256,intermediate_size:688,num_hidden_layers:4,"
    "num_attention_heads:8,num_key_value_heads:8,max_position_embeddings:512}",
    "pythia-160m": "{model_type:gpt_neox,hidden_size:768,intermediate_size:3072,num_hidden_layers:12,"
    "num_attention_heads:12,max_position_embeddings:512,tie_word_embeddings:false}",
}
BLOCKS = {"llama-4x256": "LlamaDecoderLayer", "pythia-160m": "GPTNeoXLayer"}


def run(trainer: str, procs: int, args, out: Path) -> dict:
    overrides = [
        "~model.config",
        f"+model.config={MODELS[args.size]}",
        f"model.block_name={BLOCKS[args.size]}",
        "num_threads=null",
        f"trainer={trainer}",
        f"world_size={procs}",
        "datasets=[hh]",
        f"data.hh.local_dir={HH}",
        "data.hh.subsets=[harmless-base]",
        "data.hh.holdout_fraction=0.1",
        f"batch_size={args.batch_size}",
        "eval_batch_size=8",
        "n_eval_examples=8",
        f"n_examples={args.examples}",
        f"eval_every={args.examples * 10}",
        "do_first_eval=false",
        "sample_during_eval=false",
        "save_hf_export=false",
        f"max_length={args.max_length}",
        f"max_prompt_length={args.max_length // 2}",
        "progress_bar=false",
        "minimum_log_interval_secs=0",
        f"output_root={out}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // procs))}
    done = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=3600
    )
    if done.returncode:
        sys.exit(f"{trainer} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    run_dir = next(p for p in out.iterdir() if p.is_dir())
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["examples_per_second"] for r in recs if "examples_per_second" in r][1:]
    memory = {k: v for r in recs for k, v in r.items() if k.startswith("memory/")}
    return {
        "pairs_per_s": sum(rates) / len(rates),
        "rss": [memory[k] for k in sorted(memory) if k.endswith("_peak_rss_mib")],
        "setup_rss": [memory[k] for k in sorted(memory) if k.endswith("_peak_setup_rss_mib")],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=192, help="DPO pairs per trainer")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch (pairs)")
    parser.add_argument("--max-length", type=int, default=256, help="prompt + response bytes")
    parser.add_argument("--size", choices=sorted(MODELS), default="llama-4x256", help="the random model to train")
    args = parser.parse_args()
    if not HH.exists():
        sys.exit(f"{HH} is absent: this benchmark reads the real HH pairs in ../shared.")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, procs in (("BasicTrainer", 1), ("FSDPTrainer", 2), ("TensorParallelTrainer", 2)):
            results[name] = run(name, procs, args, Path(tmp) / name)
            print(f"done: {name}", flush=True)
    base = results["BasicTrainer"]
    print(f"\nDPO, random {args.size}, batch {args.batch_size}, max_length {args.max_length}, {args.examples} pairs, fp32, CPU")
    print(f"{'trainer':24} {'procs':>5} {'pairs/s':>8} {'vs Basic':>8}  {'peak RSS per rank (MiB)':>24}  after loading")
    for name, r in results.items():
        procs = len(r["rss"])
        rss = ", ".join(f"{v:.0f}" for v in r["rss"])
        setup = ", ".join(f"{v:.0f}" for v in r["setup_rss"])
        print(f"{name:24} {procs:>5} {r['pairs_per_s']:8.2f} {r['pairs_per_s'] / base['pairs_per_s']:8.2f}  {rss:>24}  {setup}")


if __name__ == "__main__":
    main()
