"""This project's DPO training step vs TRL 1.16's DPOTrainer, on identical work, on CPU.

Both sides train the same model from the same saved folder on the same real HH pairs
(../shared/data/hh-rlhf, harmless-base, read by this repository's loader and tokenized by
its tokenize_element), fed as the SAME token ids, in the same order, with the same batch
(8 pairs), max_length (256), fp32, AdamW (same lr, no weight decay), constant schedule
without warmup, gradient clipping, sigmoid DPO loss (beta 0.1) and torch thread count.

Models (--model):
  stories  ../shared/models/stories260K (real Llama: 5 layers, hidden 64, vocab 512)
  random   a random Llama (4 layers, hidden 256, 8 heads, intermediate 688, vocab 512) with
           the stories260K tokenizer, saved to a temporary folder first (TRL rebuilds its
           reference from the policy's saved folder)
Modes (--mode):
  live         the reference model runs a forward pass every step
  precomputed  reference log-probs computed once before training (ours:
               reference_cache.precompute_reference + trainer.reference_model=None; TRL:
               precompute_ref_log_probs=True); the precompute time is reported apart and is
               not part of the step time

Each (model, mode, side) runs in its own subprocess, so its peak RSS
(getrusage(RUSAGE_SELF).ru_maxrss) is its own; sides alternate A B A B over --rounds. The
parent process imports no torch, so no child inherits its peak. Step time is wall time from
the end of one optimizer step to the end of the next (TRL: on_step_end callbacks; ours: a
loop of preference_datasets.collate + BasicTrainer.train_step), the median over --steps steps
after --warmup steps; it includes data collation, each side's per-step metrics and logging.
Tokens are the non-padding tokens (attention-mask ones) of chosen + rejected. The CPUs are
easily shared (two threads on two cores slow down several-fold when anything else runs), so
each run waits for a quiet machine first, measures the CPUs other processes used during its
timed steps (/proc/stat minus its own CPU time) and is rerun when that exceeds --max-others.

Fairness (what differs between the defaults, and what this script does about it):
  * TRL tokenizes text itself (no BOS with this tokenizer, prompt+response tokenized jointly),
    so the TRL dataset is built from our token ids (prompt_ids / chosen_ids / rejected_ids,
    the columns TRL's DataCollatorForPreference reads) and DPOTrainer._prepare_dataset is
    bypassed for such a dataset; every batch of TRL's collator is checked equal to ours.
  * TRL drops pairs whose prompt reaches max_length and cuts long sequences from the end;
    ours cuts the prompt first: only pairs with prompt + longest response <= max_length
    (after our tokenization) are used, so neither side truncates anything.
  * DPOConfig defaults to bf16 and gradient checkpointing: both are turned off (fp32).
  * TRL's default optimizer on torch >= 2.8 is fused AdamW; ours is torch.optim.AdamW
    (unfused): TRL is given optim=adamw_torch (--trl-optim changes it).
  * TRL samples randomly by default: train_sampling_strategy=sequential, so both sides see
    batch k = pairs [8k, 8k+8); the per-step losses of the two sides are compared.
  * TRL computes extra metrics every step (entropy, mean logits, top-1 accuracy, token
    counts) and ours its own (rewards, log-probs as lists): each counts in its own time.
  * How each side computes the same log-probs is its own: TRL 1.16 forwards chosen and
    rejected padded to a common width (its padding_free option is disabled in 1.16) and uses
    its chunked fused LM head; ours (packing.packed_sequence_logps) forwards no padding and
    each prompt once, with the output layer only where a response token is predicted. The
    batches, the log-probs and the losses are the same (the losses are compared per step).
  * Left as they are, and small: padding positions (attention mask 0) hold 0 or EOS ids on
    our side and EOS on TRL's; our precompute loads a second model as the
    reference (as train.py does) where TRL uses the policy before its first step; ours is
    timed on pre-tokenized pairs, where BasicTrainer.train() tokenizes each batch as it goes
    (about 1 ms a pair with this tokenizer, not counted).

    python bench/bench_dpo.py [--model stories|random|both] [--mode live|precomputed|both]
                              [--steps 20] [--warmup 3] [--rounds 2] [--threads N]
    python bench/bench_dpo.py --profile     # where our step spends its time (and TRL's)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dpo_prepare import HH, STORIES, worker_prepare  # noqa: E402
from dpo_profile import worker_profile  # noqa: E402
from dpo_report import _code_hash, _code_state, _mean, _version  # noqa: E402
from measure import _busy_cpu_s, _peak_rss_mib  # noqa: E402
from our_worker import worker_ours  # noqa: E402
from trl_worker import worker_trl  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SIDES = ("ours", "trl")


# ============================================================================ parent


def wait_quiet(max_wait: float, threshold: float = 0.15) -> tuple[float, float]:
    """Wait (at most ``max_wait`` s) until the machine's other processes use under ``threshold``
    CPUs over a 2-second window. Returns (seconds waited, CPUs in use at the last look)."""
    t0 = time.time()
    while True:
        b0 = _busy_cpu_s()
        time.sleep(2)
        used = (_busy_cpu_s() - b0) / 2
        if used < threshold or time.time() - t0 >= max_wait:
            return time.time() - t0, used


def base_spec(args, tmp: Path, n_pairs: int, **extra) -> dict:
    """The settings every worker of a run shares, from the command line's ``args`` (threads,
    seed, batch size, max_length with half of it for the prompt, lr, beta, warm-up and measured
    steps, TRL's optim), ``n_pairs`` pairs prepared into ``tmp``; ``extra`` adds or replaces
    keys (``models``, ``max_grad_norm``; bench_memory.py: the model folder, the LoRA rank)."""
    return {
        "threads": args.threads,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "max_prompt_length": args.max_length // 2,
        "lr": args.lr,
        "max_grad_norm": 1.0,
        "beta": args.beta,
        "warmup": args.warmup,
        "steps": args.steps,
        "n_pairs": n_pairs,
        "trl_optim": args.trl_optim,
        "pairs_file": str(tmp / "pairs.json"),
        "tmp": str(tmp),
        "models": [],
        **extra,
    }


def spawn(role: str, spec: dict, tmp: Path, timeout: int = 1200, script: str | None = None) -> dict:
    """Run one worker (``script --worker role``, this file by default) in a fresh interpreter;
    return its JSON result."""
    spec_file = tmp / f"spec-{role}-{time.monotonic_ns()}.json"
    result_file = spec_file.with_suffix(".out.json")
    spec_file.write_text(json.dumps(spec))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(spec["threads"]),
        "MKL_NUM_THREADS": str(spec["threads"]),
        **({} if spec.get("cuda") else {"CUDA_VISIBLE_DEVICES": ""}),  # a CPU benchmark (bench_gpu_dpo.py: a GPU), both sides
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TQDM_DISABLE": "1",
        "PYTHONWARNINGS": "ignore",
        **spec.get("env", {}),  # bench_memory.py --ours-preload: LD_PRELOAD for one side's process
    }
    cmd = [
        sys.executable,
        script or str(Path(__file__).resolve()),
        "--worker",
        role,
        "--spec",
        str(spec_file),
        "--result",
        str(result_file),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode or not result_file.exists():
        sys.exit(f"worker {role} ({spec.get('model')}, {spec.get('mode')}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return json.loads(result_file.read_text())


def run_worker(role: str, spec_path: str, result_path: str, workers: dict | None = None) -> None:
    """Run worker ``role`` (this file's, or one of ``workers``: bench_memory.py's) on the spec file
    and write its result with this process's own wall time and peak RSS (ru_maxrss, VmHWM)."""
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    fn = (workers or {"prepare": worker_prepare, "ours": worker_ours, "trl": worker_trl, "profile": worker_profile})[role]
    out = fn(spec)
    out["wall_s"] = time.perf_counter() - t0
    out["rss_peak"], out["rss_hwm"] = _peak_rss_mib()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(result_path).write_text(json.dumps(out))


def build_parser() -> argparse.ArgumentParser:
    """The command line (this module's docstring is its description)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["stories", "random", "both"], default="both", help="which model (default both)")
    parser.add_argument("--mode", choices=["live", "precomputed", "both"], default="both", help="reference mode (default both)")
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="steps run first and not measured (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="A B rounds per model and mode (default 2)")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step (default 8)")
    parser.add_argument("--max-length", type=int, default=256, help="prompt + response tokens (default 256)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate, both sides (default 1e-4)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping, both sides (default 1.0)")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (default 0.1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads, both sides (default: CPU count)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-optim",
        default="adamw_torch",
        help="TRL's optim (default adamw_torch = ours; TRL's own default is adamw_torch_fused)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=120,
        help="before each run, wait up to this many seconds for other processes to leave the CPUs (default 120)",
    )
    parser.add_argument(
        "--max-others",
        type=float,
        default=0.25,
        help="a run during which other processes used more CPUs than this (mean) is contended and rerun (default 0.25)",
    )
    parser.add_argument(
        "--retries", type=int, default=2, help="reruns of a contended run; the least contended is kept (default 2)"
    )
    parser.add_argument("--json", help="also write all figures to this file")
    parser.add_argument("--profile", action="store_true", help="instead of the benchmark: profile a few steps of each side")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser


def print_prepared(args, prep: dict, n_pairs: int, measured: slice) -> None:
    """The pairs used (how many fit, tokens and width per measured batch) and the collator check."""
    tokens = prep["tokens_per_batch"][measured]
    print(
        f"pairs: {prep['n_fitting']} of {prep['n_hh_pairs']} HH harmless-base train pairs fit max_length {args.max_length} "
        f"untruncated; using {n_pairs} ({len(prep['tokens_per_batch'])} batches of {args.batch_size}, "
        f"{_mean(tokens):.0f} non-padding tokens and width {_mean(prep['widths'][measured]):.0f} per measured batch). "
        f"TRL's collator gives our exact batches: checked for all.",
        flush=True,
    )
    if prep["trl_text_tokenization_identical"] is not None:
        print(
            f"(TRL tokenizing the texts itself would give the same ids for {prep['trl_text_tokenization_identical']}/{n_pairs} "
            "pairs, hence the pre-tokenized dataset.)",
            flush=True,
        )


def run_profiles(args, base: dict, models: list[str], modes: list[str], model_dirs: dict, tmp: Path) -> None:
    """--profile: each side of each model and mode profiled in its own worker, printed."""
    for model in models:
        for mode in modes:
            for side in SIDES:
                wait_quiet(args.wait_quiet)
                r = spawn("profile", {**base, "model": model, "mode": mode, "side": side, "model_dir": model_dirs[model]}, tmp)
                print(f"\n===== profile: {side}, {model}, {mode} reference ({args.steps} steps) =====")
                if "phases" in r:
                    total = sum(r["phases"].values())
                    print(
                        f"phase breakdown, ms per step (sum {total * 1e3:.0f} ms; other processes used "
                        f"{r['others_cpu']:.2f} CPUs meanwhile):"
                    )
                    for name, v in sorted(r["phases"].items(), key=lambda kv: -kv[1]):
                        print(f"  {name:48} {v * 1e3:8.1f}  {v / total:6.1%}")
                print(r["ops"])
                if "cprofile" in r:
                    print(r["cprofile"])


def run_side(args, spec: dict, tmp: Path, rnd: int) -> dict:
    """One side's run (rerun while contended, up to --retries times), printed; the least contended run."""
    best = None
    for _attempt in range(1 + args.retries):
        waited, _ = wait_quiet(args.wait_quiet)
        r = spawn(spec["side"], spec, tmp, script=spec.get("script"))  # bench_vision_dpo.py: its own workers
        r["waited_s"] = waited
        contended = r["others_cpu"] > args.max_others
        print(
            f"round {rnd + 1}: {spec['model']:7} {spec['mode']:11} {spec['side']:4} {args.batch_size / r['step_s']:6.2f} pairs/s, "
            f"peak RSS {r['rss_peak']:.0f} MiB (VmHWM {r['rss_hwm']:.0f}), {r['threads']} threads at "
            f"{r['cpu_util']:.2f} CPUs, other processes {r['others_cpu']:.2f} CPUs"
            + (" (CONTENDED)" if contended else "")
            + f", step-0 loss {r['losses'][0]:.6f}, run {r['wall_s']:.0f} s",
            flush=True,
        )
        if best is None or r["others_cpu"] < best["others_cpu"]:
            best = r
        if not contended:
            break
    return best


def side_row(args, rs: list[dict], tok_per_step: float) -> dict:
    """One side's figures of one model and mode over its rounds ``rs``."""
    step_s = _mean([r["step_s"] for r in rs])
    return {
        "pairs_per_s": _mean([args.batch_size / r["step_s"] for r in rs]),
        "tokens_per_s": _mean([tok_per_step / r["step_s"] for r in rs]),
        "step_ms": step_s * 1e3,
        "rss_peak_mib": max(r["rss_peak"] for r in rs),
        "rss_setup_mib": max(r["rss_setup"] for r in rs),
        "precompute_s": _mean([r["precompute_s"] for r in rs]) if rs[0]["precompute_s"] is not None else None,
        "pairs_per_s_rounds": [args.batch_size / r["step_s"] for r in rs],
        "losses": rs[0]["losses"],
        "threads": rs[0]["threads"],
        "optimizer": rs[0]["optimizer"],
        "others_cpu_max": max(r["others_cpu"] for r in rs),
        "cpu_util": [r["cpu_util"] for r in rs],
    }


def print_table(args, models: list[str], modes: list[str], results: dict, tok_per_step: float) -> list[dict]:
    """The table of ours vs TRL per model and mode, printed; its rows."""
    print(
        f"\nDPO step, this project (BasicTrainer) vs TRL {_version('trl')} DPOTrainer: batch {args.batch_size} pairs, "
        f"max_length {args.max_length}, fp32, {args.threads} threads, {args.steps} steps after {args.warmup} warm-up, "
        f"mean of {args.rounds} rounds; {_code_state()}"
    )
    header = (
        f"{'model':8} {'reference':12} | {'pairs/s ours':>12} {'TRL':>7} {'ratio':>6} | {'tokens/s ours':>13} {'TRL':>7} | "
        f"{'peak RSS MiB ours':>17} {'TRL':>6} {'ratio':>6} | {'precompute s ours':>17} {'TRL':>6}"
    )
    print(header)
    print("-" * len(header))
    table = []
    for model in models:
        for mode in modes:
            row = {"model": model, "mode": mode}
            for side in SIDES:
                row[side] = side_row(args, results[(model, mode, side)], tok_per_step)
            o, t = row["ours"], row["trl"]
            row["speed_ratio"] = o["pairs_per_s"] / t["pairs_per_s"]
            row["rss_ratio"] = o["rss_peak_mib"] / t["rss_peak_mib"]
            row["loss0"] = (o["losses"][0], t["losses"][0])
            row["max_loss_diff"] = max(abs(a - b) for a, b in zip(o["losses"], t["losses"]))
            table.append(row)
            pre = f"{'-':>17} {'-':>6}" if o["precompute_s"] is None else f"{o['precompute_s']:17.2f} {t['precompute_s']:6.2f}"
            print(
                f"{model:8} {mode:12} | {o['pairs_per_s']:12.2f} {t['pairs_per_s']:7.2f} {row['speed_ratio']:6.2f} | "
                f"{o['tokens_per_s']:13.0f} {t['tokens_per_s']:7.0f} | {o['rss_peak_mib']:17.0f} {t['rss_peak_mib']:6.0f} "
                f"{row['rss_ratio']:6.2f} | {pre}"
            )
    return table


def print_checks(table: list[dict]) -> None:
    """That both sides did the same work: step-0 losses, loss differences, per-round ratios, threads, optimizers."""
    print(f"\nsame work, checked (ln 2 = {math.log(2):.6f}):")
    for row in table:
        o, t = row["ours"], row["trl"]
        per_round = ", ".join(f"{a / b:.2f}" for a, b in zip(o["pairs_per_s_rounds"], t["pairs_per_s_rounds"]))
        print(
            f"  {row['model']:8} {row['mode']:12} step-0 loss ours {row['loss0'][0]:.6f}  TRL {row['loss0'][1]:.6f}; "
            f"max |loss ours - loss TRL| over {len(o['losses'])} steps {row['max_loss_diff']:.1e}; "
            f"speed ratio per round {per_round}; RSS after set-up ours {o['rss_setup_mib']:.0f} / TRL {t['rss_setup_mib']:.0f} MiB; "
            f"threads {o['threads']}/{t['threads']}; other processes at most {max(o['others_cpu_max'], t['others_cpu_max']):.2f} CPUs"
        )
    print(f"  optimizers: ours {table[0]['ours']['optimizer']}; TRL {table[0]['trl']['optimizer']}")


def main() -> None:
    """Parse the arguments, prepare the pairs, run the workers (or the profile), print the tables."""
    args = build_parser().parse_args()
    if args.worker:
        run_worker(args.worker, args.spec, args.result)
        return
    for path in (HH, STORIES):
        if not path.exists():
            sys.exit(f"{path} is absent: this benchmark reads ../shared (the folder beside the repository).")
    models = ["stories", "random"] if args.model == "both" else [args.model]
    modes = ["live", "precomputed"] if args.mode == "both" else [args.mode]
    if args.profile:
        args.warmup, args.steps = 2, 5
    n_pairs = (args.warmup + args.steps * (3 if args.profile else 1)) * args.batch_size
    started = time.time()
    code_before = _code_hash()
    load_before = os.getloadavg()[0]
    if load_before > 0.5:
        print(f"warning: 1-minute load average is {load_before:.2f} before starting: other work shares the CPUs", flush=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        base = base_spec(args, tmp, n_pairs, models=models, max_grad_norm=args.max_grad_norm)
        prep = spawn("prepare", base, tmp)
        model_dirs = {"stories": str(STORIES), "random": prep["random_dir"]}
        measured = slice(args.warmup, args.warmup + args.steps)
        tokens = prep["tokens_per_batch"][measured]
        print_prepared(args, prep, n_pairs, measured)
        if args.profile:
            run_profiles(args, base, models, modes, model_dirs, tmp)
            return
        results: dict = {}
        for rnd in range(args.rounds):
            for model in models:
                for mode in modes:
                    for side in SIDES:  # A B A B
                        spec = {**base, "model": model, "mode": mode, "side": side, "model_dir": model_dirs[model]}
                        results.setdefault((model, mode, side), []).append(run_side(args, spec, tmp, rnd))
    elapsed = time.time() - started
    if _code_hash() != code_before:
        print("WARNING: the project's code changed on disk during this run: rounds may have measured different code.")
    table = print_table(args, models, modes, results, _mean(tokens))
    print_checks(table)
    print(f"\ntotal wall time {elapsed:.0f} s; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "prepare": prep, "rows": table}, indent=1))


if __name__ == "__main__":
    main()
