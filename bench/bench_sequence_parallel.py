"""Peak memory per rank against sequence length for sequence parallelism over 1, 2 and 4 ranks (one DPO pair, policy
forward and backward, packed, a live reference), and the longest pair that fits a memory budget for each.

    python bench/bench_sequence_parallel.py [--model ../shared/models/stories260K] [--lengths 512 1024 2048]
        [--ranks 1 2 4] [--budget-mib 300] [--forward packed|padded] [--out bench/results/sequence_parallel.json]

Each group size is one ``torch.distributed.run`` launch (gloo on CPU, NCCL on GPUs) that runs the lengths in increasing
order; a rank's peak is its peak RSS above the RSS after loading (CPU) or ``torch.cuda.max_memory_allocated`` above the
allocation after loading (GPU), the max over the group's ranks. The figures are printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(args) -> None:
    """One rank: for each length, one pair of that many tokens (prompt half, responses a quarter each), forward and backward."""
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist
    import transformers

    from parallel import process_group
    from parallel import sequence_parallel as sp

    process_group.init_distributed()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    policy = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").to(device)
    reference = transformers.AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").to(device)
    reference.requires_grad_(False)
    for model in (policy, reference):
        sp.use_sequence_parallel_attention(model)
    group = dist.new_group(list(range(dist.get_world_size())))

    def used() -> float:  # MiB
        if cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    base = used()
    rows = []
    for length in args.lengths:
        g = torch.Generator().manual_seed(length)
        prompt, response = length // 2, length // 4
        ids = torch.randint(3, policy.config.vocab_size, (2, prompt + response), generator=g)
        ids[1, :prompt] = ids[0, :prompt]  # the pair shares its prompt
        labels = ids.clone()
        labels[:, :prompt] = -100
        batch = {"chosen_input_ids": ids[:1], "rejected_input_ids": ids[1:], "chosen_labels": labels[:1],
                 "rejected_labels": labels[1:], "prompt": ["x"]}  # fmt: skip
        batch |= {f"{s}_attention_mask": torch.ones_like(ids[:1]) for s in ("chosen", "rejected")}
        start = time.perf_counter()
        packed = args.forward == "packed"
        logps, _ = sp.sequence_parallel_logps(policy, batch, group, device, packed=packed, chunk=1024)
        with torch.no_grad():
            ref, _ = sp.sequence_parallel_logps(reference, batch, group, device, packed=packed, chunk=1024)
        loss = -torch.nn.functional.logsigmoid(0.1 * ((logps[0] - ref[0]) - (logps[1] - ref[1])))
        loss.backward()
        policy.zero_grad(set_to_none=True)
        peak = torch.tensor([used() - base], dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows.append({"length": length, "peak_mib": round(peak.item(), 1), "seconds": round(time.perf_counter() - start, 2)})
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--budget-mib", type=float, default=300.0)
    parser.add_argument(
        "--forward",
        choices=("packed", "padded"),
        default="packed",
        help="packed: the pair one row, its prompt once (a dense block mask of S x S on every rank); padded: chosen and "
        "rejected each a causal row (no mask: what a long pair needs)",
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "sequence_parallel.json"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = {}
    for n in args.ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), __file__, "--worker",
               "--model", args.model, "--forward", args.forward, "--lengths", *map(str, args.lengths)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = next((s for s in done.stdout.splitlines() if s.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{n} ranks failed:\n{(done.stdout + done.stderr)[-3000:]}")
        results[n] = json.loads(line[len("RESULT ") :])
    print(
        f"peak memory per rank (MiB above the loaded model) by sequence length, {args.forward} forward; budget {args.budget_mib:g} MiB"
    )
    print("ranks " + " ".join(f"{length:>9}" for length in args.lengths) + "  longest within budget")
    summary = {}
    for n, rows in results.items():
        fits = [r["length"] for r in rows if r["peak_mib"] <= args.budget_mib]
        summary[n] = max(fits) if fits else None
        print(f"{n:>5} " + " ".join(f"{r['peak_mib']:>9.1f}" for r in rows) + f"  {summary[n]}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "forward": args.forward, "budget_mib": args.budget_mib, "per_rank": results,
                                          "longest_within_budget": summary}, indent=1) + "\n")  # fmt: skip
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
