"""The main job (``python train.py``) on several seeds, with the controls a reviewer asks for; writes its table.

    python scripts/main_job_seeds.py [--seeds 0 1 2 3 4] [--jobs 2] [--out DIR] [--write docs/main_job_seeds.md]

For each seed, three commands of this repository, printed as they start (their output in ``<out>/logs/``):

1. ``python train.py seed=S``: the main job itself, SFT (80,000 examples) then DPO (16,000) from its policy;
2. RPO from the same SFT policy: DPO with the chosen answers' NLL added (``loss.nll_weight=1.0``);
3. SFT continued from the same SFT policy for DPO's examples at DPO's lr (``loss=sft``): what the extra examples give
   without a preference objective.

Each eval's ``answers_eval/arithmetic`` (the share of 256 held-out sums the greedy answer gets exactly right),
``rewards_eval/accuracies`` (held-out pairs ranked right; chance 0.5, 0 at step 0 where policy = reference) and
``logps_eval/chosen`` are read from each run's ``metrics.jsonl``; the table shows, per eval, the mean over seeds and
the range [min, max], and a second table each seed's values. ``seed`` sets the model's initial weights, the data order
and the sampling (the questions are the same for every seed). Writes ``<out>/main_job_seeds.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METRICS = {
    "answers_eval/arithmetic": "answers right",
    "rewards_eval/accuracies": "pairs ranked right",
    "logps_eval/chosen": "log-prob of the chosen answer",
}
STAGES = ("SFT", "DPO", "RPO", "SFT continued")
FINISHED = re.compile(r"^Both stages finished: the SFT run (\S+), then the \S+ run (\S+)\.$", re.M)
CHANCE = "chance 0.5; 0 at step 0, where every margin is 0"
RUNS = (
    "On each seed: the main job (`python train.py seed=S`: SFT, then DPO from its policy), and from the same SFT policy "
    "two controls: RPO (DPO with the chosen answers' NLL, `loss.nll_weight=1.0`) and SFT continued for DPO's examples at "
    "DPO's lr (`loss=sft`; it logs no pair ranking). `seed` sets the initial weights, the data order and the sampling; "
    "the questions are the same for every seed."
)


def run(command: list[str], log: Path) -> str:
    """Run ``python train.py <command>`` in the repository root, its output appended to ``log``; returns the output.

    Raises:
        SystemExit: naming the command and the end of its log when it fails.
    """
    shown = "python train.py " + shlex.join(command)
    print(f"$ {shown}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "train.py", *command], cwd=REPO, env=env, capture_output=True, text=True)
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {shown}\n{done.stdout}{done.stderr}")
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
        raise SystemExit(f"Error: {shown} exited with {done.returncode}; the end of {log}:\n{tail}")
    return done.stdout


def eval_records(run_dir: str) -> dict[int, dict]:
    """The eval records of a run folder's ``metrics.jsonl``, by examples seen (``step``)."""
    records = {}
    with open(Path(run_dir) / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if any(k in row for k in METRICS):
                records[int(row["step"])] = {k: row[k] for k in METRICS if k in row}
    return records


def one_seed(seed: int, out: Path, extra: list[str]) -> dict:
    """The main job and its two controls on ``seed``: {stage: {examples: {metric: value}}}, and the run folders."""
    log, common = out / "logs" / f"seed{seed}.log", [f"seed={seed}", "progress_bar=false", *extra]
    started = time.time()
    found = FINISHED.search(run([*common, f"output_root={out / f'seed{seed}'}"], log))
    if found is None:
        raise SystemExit(f"Error: the main job on seed {seed} did not print its two run folders; see {log}.")
    sft, dpo = found.groups()
    kept = [o for o in common if not o.startswith("sft_first")]  # the controls start from the SFT policy: no stage of their own
    stage2 = [*kept, "sft_first.n_examples=null", f"model.archive={Path(sft) / 'LATEST' / 'policy.pt'}"]
    folders = {"SFT": sft, "DPO": dpo}
    for stage, overrides in (("RPO", ["loss.nll_weight=1.0"]), ("SFT continued", ["loss=sft"])):
        name = stage.lower().replace(" ", "_")
        output = run([*stage2, *overrides, f"output_root={out / f'seed{seed}'}", f"exp_name={name}"], log)
        folders[stage] = re.search(r"^Run folder: (\S+)$", output, re.M).group(1)
    print(f"[seeds] seed {seed} done ({time.time() - started:.0f} s)", flush=True)
    return {"folders": folders, "evals": {stage: eval_records(folder) for stage, folder in folders.items()}}


def summary(results: dict[int, dict]) -> list[dict]:
    """One row per (stage, metric, examples): the per-seed values, their mean, min and max."""
    rows = []
    for stage in STAGES:
        for metric in METRICS:
            steps = sorted({s for r in results.values() for s, rec in r["evals"][stage].items() if metric in rec})
            for step in steps:
                values = {seed: r["evals"][stage][step][metric] for seed, r in results.items() if step in r["evals"][stage]}
                v = list(values.values())
                rows.append({"stage": stage, "metric": metric, "examples": step, "values": values,
                             "mean": sum(v) / len(v), "min": min(v), "max": max(v)})  # fmt: skip
    return rows


def markdown(rows: list[dict], seeds: list[int], seconds: float) -> str:
    """The tables: mean [min, max] over seeds per eval, then each seed's value."""
    steps = sorted({r["examples"] for r in rows})
    head = "| stage | metric | " + " | ".join(f"{s:,}" for s in steps) + " |"
    lines = [f"Seeds {', '.join(map(str, seeds))}: mean [min, max] over seeds at each eval (the columns: examples seen in "
             "that stage, so DPO's 8,000 is 8,000 DPO examples after the SFT stage). "
             f"A share of 256 questions has a 95% interval of about +-0.06 within one seed; `rewards_eval/accuracies`: "
             f"{CHANCE}.", "", head, "|" + "---|" * (len(steps) + 2)]  # fmt: skip
    for (stage, metric), group in _grouped(rows).items():
        cells = {r["examples"]: f"{r['mean']:.2f} [{r['min']:.2f}, {r['max']:.2f}]" for r in group}
        lines.append(f"| {stage} | {METRICS[metric]} | " + " | ".join(cells.get(s, "") for s in steps) + " |")
    lines += ["", "Each seed's value at the end of each stage:", "",
              "| stage | metric | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|" + "---|" * (len(seeds) + 2)]  # fmt: skip
    for (stage, metric), group in _grouped(rows).items():
        last = group[-1]
        lines.append(f"| {stage} | {METRICS[metric]} | " + " | ".join(f"{last['values'].get(s, float('nan')):.2f}" for s in seeds) + " |")  # fmt: skip
    lines += ["", f"Wall time {seconds / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def _grouped(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["stage"], r["metric"]), []).append(r)
    return groups


def title(args: argparse.Namespace) -> str:
    """The table's heading: what ran, when, on which versions."""
    import torch
    import transformers

    command = shlex.join(["python", "scripts/main_job_seeds.py", *sys.argv[1:]])
    return (f"# The main job across seeds\n\n`{command}`, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}. {RUNS}\n\n")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="default: 0 1 2 3 4 (about 30 min)")
    parser.add_argument("--jobs", type=int, default=2, help="seeds run at a time (one thread each)")
    parser.add_argument("--out", type=Path, default=None, help="default: outputs/main_job_seeds_<timestamp>")
    parser.add_argument("--write", type=Path, default=None, help="also copy the table to this file (e.g. docs/...)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides given to every command (key=value)")
    args = parser.parse_args(argv)
    out = (args.out or REPO / "outputs" / time.strftime("main_job_seeds_%Y-%m-%d_%H-%M-%S")).resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"Error: --out {out} is not empty; give a new folder.")
    (out / "logs").mkdir(parents=True)
    started = time.time()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        done = dict(zip(args.seeds, pool.map(lambda s: one_seed(s, out, args.overrides), args.seeds)))
    rows, seconds = summary(done), time.time() - started
    table = title(args) + markdown(rows, args.seeds, seconds)
    (out / "main_job_seeds.md").write_text(table, encoding="utf-8")
    results = {"seeds": args.seeds, "overrides": args.overrides, "seconds": seconds, "rows": rows,
               "folders": {s: r["folders"] for s, r in done.items()}}  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    if args.write:
        args.write.write_text(table, encoding="utf-8")
    print(table + f"\nWritten: {out / 'main_job_seeds.md'}, {out / 'results.json'}")
    return results


if __name__ == "__main__":
    main()
