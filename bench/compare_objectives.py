"""One table comparing training objectives, from the run folders a sweep left behind.

    python train.py -m hydra/launcher=submitit_local hydra.sweeper.max_batch_size=1 \
        loss=dpo,ipo,simpo,... <same budget> output_root=outputs/compare
    python bench/compare_objectives.py outputs/compare        # or run folders, or a glob

``hydra/launcher=submitit_local`` runs each job in a process of its own (Hydra's submitit
launcher), so each run's memory is its own; ``hydra.sweeper.max_batch_size=1`` runs them one at
a time, so that their times do not share the CPUs (``hydra/launcher=slurm``: each a SLURM job).

Reads each run folder's config.yaml and metrics.jsonl (one JSON record a line, ``step`` the
example counter; see tracking.MetricsLogger) and writes, per objective (one row per run):

  accuracy    held-out reward accuracy at the last eval (``rewards_eval/accuracies``): the
              fraction of eval pairs whose chosen reward is strictly above the rejected's,
              each objective by its own reward (beta * log-ratio for DPO-like objectives,
              beta * mean log-prob for SimPO, ...); objectives without rewards (sft): "-"
  margin      ``rewards_eval/margins`` at the last eval (mean chosen minus rejected reward)
  ... start   the same at the first eval (do_first_eval=true: step 0, the start). With a
              reference, every reward is 0 there (accuracy 0: no pair is strictly above);
              reference-free rewards (simpo, cpo, orpo) already rank the pairs at the start
  Δ chosen logp  ``logps_eval/chosen`` at the last eval minus at the first: how far the mean
              held-out chosen log-prob moved (nats). Its unit is the objective's: summed over
              the response's tokens ("seq") or their mean ("tok": objectives with
              average_log_prob, e.g. ipo, simpo, orpo), so compare rows of one unit only
  eval loss   ``loss/eval`` at the last eval (each objective's own loss and unit)
  train s     the training loop up to its last logged step, the evals and checkpoints in it
              included: the sum of the logged intervals, counters/examples step /
              examples_per_second (the records hold no timestamps)
  peak MiB    the run's peak resident memory (``memory/rank0_peak_rss_mib``, rank 0); the
              job's own with one process per job (submitit_local), else the sweep process's
  wall s      from the run folder's config.yaml (written once the models are loaded) to
              metrics.jsonl's last write (the peak-memory record after the final eval and
              checkpoint), from the files' modification times

The table goes to stdout (markdown) and to ``<out>/comparison.md``, ``.csv``, ``.json``, and a
PNG (``comparison.png``: one panel per quantity, one bar per objective). ``--out`` defaults to
the folder the runs are in. Runs whose configs differ in anything but ``loss.*``, ``exp_name``
and ``output_root`` are compared anyway, with a note naming the keys that differ (the budget
should be the same). With several runs of one objective, only the newest is kept unless
``--all``. A mix objective is labelled by its components (``loss=mpo`` is
``mix(dpo 0.8, bco_pair 0.2, nll 1)``).
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMNS = [  # (key in a row, markdown header)
    ("objective", "objective"),
    ("beta", "β"),
    ("accuracy_first", "accuracy start"),
    ("accuracy", "accuracy"),
    ("margin_first", "margin start"),
    ("margin", "margin"),
    ("chosen_logp_first", "chosen logp start"),
    ("chosen_logp_delta", "Δ chosen logp"),
    ("logp_unit", "logp unit"),
    ("eval_loss", "eval loss"),
    ("examples", "examples"),
    ("train_s", "train s"),
    ("wall_s", "wall s"),
    ("peak_mib", "peak MiB"),
    ("run", "run folder"),
]
MARKDOWN_COLUMNS = [c for c in COLUMNS if c[0] != "run"]  # the run folder is in the CSV and JSON
PEAK_KEY = "memory/rank0_peak_rss_mib"
"""The run's peak resident memory (MiB) as its trainer logs it at the end: the job's own only when the
job had a process of its own (``hydra/launcher=submitit_local``), else the sweep process's so far."""
SAME_BUDGET_IGNORED = ("loss", "exp_name", "output_root", "resume", "wandb")


class RunFolderError(ValueError):
    """A path given is not a run folder, nor a folder or glob holding run folders."""


def is_run_dir(path: Path) -> bool:
    """True if ``path`` holds a run's config.yaml and metrics.jsonl."""
    return (path / "config.yaml").is_file() and (path / "metrics.jsonl").is_file()


def find_runs(paths: list[str]) -> list[Path]:
    """The run folders named by ``paths``: each a run folder, a folder whose subfolders are run
    folders (a sweep's output_root), or a glob pattern of either. Sorted, without repeats.

    Raises:
        RunFolderError: if a path matches no run folder.
    """
    found: list[Path] = []
    for pattern in paths:
        matches = [Path(p) for p in sorted(glob.glob(pattern))] or [Path(pattern)]
        runs = []
        for match in matches:
            if is_run_dir(match):
                runs.append(match)
            elif match.is_dir():
                runs.extend(sorted(p for p in match.iterdir() if p.is_dir() and is_run_dir(p)))
        if not runs:
            raise RunFolderError(
                f"{pattern} holds no run folder (a folder with config.yaml and metrics.jsonl); give run folders or their output_root."
            )
        found.extend(runs)
    unique = {p.resolve(): p for p in found}
    return sorted(unique.values(), key=lambda p: str(p))


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl; a line cut short by a crash is skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def objective_label(loss: dict) -> str:
    """``loss.name``; for a mix, its components and weights (``mix(dpo 0.8, bco_pair 0.2, nll 1)``)."""
    name = str(loss.get("name"))
    if name == "mix" and loss.get("losses"):
        weights = loss.get("weights") or [1.0] * len(loss["losses"])
        return f"mix({', '.join(f'{n} {float(w):g}' for n, w in zip(loss['losses'], weights))})"
    return name


def averages_log_probs(loss: dict) -> bool:
    """True if the run's log-probs are means per response token (the objective's declaration,
    else ``loss.average_log_prob``)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import losses
    import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)

    objective = losses.OBJECTIVES.get(str(loss.get("name")))
    if objective is not None:
        return objective.averages(loss)
    return bool(loss.get("average_log_prob", False))


def train_seconds(records: list[dict]) -> float | None:
    """The training loop's time up to its last logged step: the sum over train records (those
    with ``examples_per_second``) of the examples since the previous one divided by that rate.
    None when there is no train record."""
    total, previous, seen = 0.0, 0.0, False
    for rec in records:
        rate = rec.get("examples_per_second")
        if rate is None or "counters/examples" not in rec:
            continue
        seen = True
        n = rec["counters/examples"] - previous
        previous = rec["counters/examples"]
        if rate > 0 and n > 0:
            total += n / rate
    return total if seen else None


def summarize_run(run_dir: Path) -> dict:
    """One row of the table for ``run_dir`` (keys: :data:`COLUMNS`' plus ``config``, the
    run's config as a dict, and ``eval_steps``, the example counts of its evals). Missing
    quantities are None (an objective without rewards, a run without evals)."""
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=False)
    loss = config.get("loss") or {}
    records = read_records(run_dir / "metrics.jsonl")
    evals = [r for r in records if "loss/eval" in r or any(k.startswith("rewards_eval/") for k in r)]
    first, last = (evals[0], evals[-1]) if evals else ({}, {})
    chosen_first, chosen_last = first.get("logps_eval/chosen"), last.get("logps_eval/chosen")
    counters = [r["counters/examples"] for r in records if "counters/examples" in r]
    wall = (run_dir / "metrics.jsonl").stat().st_mtime - (run_dir / "config.yaml").stat().st_mtime
    return {
        "objective": objective_label(loss),
        "beta": loss.get("beta"),
        "accuracy_first": first.get("rewards_eval/accuracies"),
        "accuracy": last.get("rewards_eval/accuracies"),
        "margin_first": first.get("rewards_eval/margins"),
        "margin": last.get("rewards_eval/margins"),
        "chosen_logp_first": chosen_first,
        "chosen_logp_delta": None if chosen_first is None or chosen_last is None else chosen_last - chosen_first,
        "logp_unit": "tok" if averages_log_probs(loss) else "seq",
        "eval_loss": last.get("loss/eval"),
        "examples": int(max(counters)) if counters else max((r.get("step", 0) for r in records), default=0),
        "train_s": train_seconds(records),
        "wall_s": wall,
        "peak_mib": max((r[PEAK_KEY] for r in records if PEAK_KEY in r), default=None),
        "run": run_dir.name,
        "eval_steps": [r.get("step") for r in evals],
        "config": config,
    }


def _flat(node, prefix: str = "") -> dict:
    """A nested dict as {"a.b": value}."""
    if not isinstance(node, dict):
        return {prefix[:-1]: node}
    out = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def budget_differences(rows: list[dict]) -> list[str]:
    """Config keys (dotted) whose values differ between the rows' runs, ``loss.*``,
    ``exp_name``, ``output_root``, ``resume`` and ``wandb.*`` left out."""
    flats = [{k: v for k, v in _flat(r["config"]).items() if k.split(".")[0] not in SAME_BUDGET_IGNORED} for r in rows]
    keys = sorted(set().union(*flats)) if flats else []
    return [k for k in keys if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flats}) > 1]


def build_table(paths: list[str], keep_all: bool = False) -> tuple[list[dict], list[str]]:
    """Rows (one per run, sorted by objective) and notes for the runs named by ``paths`` (see
    :func:`find_runs`). Without ``keep_all`` only the newest run of each objective is kept
    (by its config.yaml's modification time).

    Raises:
        RunFolderError: if a path holds no run folder.
    """
    runs = find_runs(paths)
    rows = [summarize_run(p) for p in runs]
    notes = []
    if not keep_all:
        newest: dict[str, tuple[float, dict]] = {}
        for row, path in zip(rows, runs):
            made = (path / "config.yaml").stat().st_mtime
            if row["objective"] not in newest or made > newest[row["objective"]][0]:
                newest[row["objective"]] = (made, row)
        if len(newest) < len(rows):
            notes.append(
                f"{len(rows) - len(newest)} older run(s) of an objective already in the table left out (--all keeps them)."
            )
        rows = [row for _, row in newest.values()]
    rows.sort(key=lambda r: (r["objective"], r["run"]))
    differ = budget_differences(rows)
    if differ:
        notes.append(f"The runs' configs differ in {', '.join(differ)}: not one budget.")
    no_start = [r["objective"] for r in rows if r["eval_steps"] and r["eval_steps"][0] != 0]
    if no_start:
        notes.append(f"No eval at step 0 (do_first_eval=false) in {', '.join(no_start)}: Δ chosen logp is from their first eval.")
    no_rewards = [r["objective"] for r in rows if r["accuracy"] is None]
    if no_rewards:
        notes.append(f"No rewards_eval/* (no implicit reward): {', '.join(no_rewards)}.")
    return rows, notes


def _cell(value, key: str) -> str:
    """A markdown cell: '-' for a missing value, floats to 3 decimals (seconds to whole ones)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if key in ("train_s", "wall_s", "peak_mib"):
        return f"{value:.0f}"
    if isinstance(value, float):
        return f"{value:.3g}" if key == "beta" else f"{value:.3f}"
    return str(value)


def to_markdown(rows: list[dict], notes: list[str]) -> str:
    """The rows as a markdown table, the notes below it."""
    lines = ["| " + " | ".join(h for _, h in MARKDOWN_COLUMNS) + " |", "|" + "---|" * len(MARKDOWN_COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[k], k) for k, _ in MARKDOWN_COLUMNS) + " |" for r in rows]
    return "\n".join(lines + [""] + [f"Note: {n}" for n in notes]).rstrip() + "\n"


def write_png(rows: list[dict], path: Path) -> None:
    """One panel per quantity (accuracy, margin, Δ chosen logp, wall s), one bar per objective
    (orange: per-token log-probs), the accuracy at the start as a black tick; a missing value
    draws no bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("accuracy", "held-out reward accuracy"),
        ("margin", "held-out reward margin (nats)"),
        ("chosen_logp_delta", "Δ held-out chosen logp (nats; unit per objective)"),
        ("wall_s", "wall time (s)"),
    ]
    names = [r["objective"] for r in rows]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6, 0.45 * len(rows) + 2), 2.4 * len(panels)), sharex=True)
    for ax, (key, title) in zip(axes, panels):
        values = [r[key] if r[key] is not None else math.nan for r in rows]
        ax.bar(range(len(rows)), values, color=["tab:orange" if r["logp_unit"] == "tok" else "tab:blue" for r in rows])
        if key == "accuracy":  # where it started (0 with a reference), and chance
            starts = [r["accuracy_first"] if r["accuracy_first"] is not None else math.nan for r in rows]
            ax.plot(range(len(rows)), starts, "k_", markersize=12, label="at the start")
            ax.axhline(0.5, color="gray", linewidth=0.5, linestyle="--")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(title, fontsize=9)
        ax.axhline(0, color="black", linewidth=0.5)
    axes[-1].set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=8)
    fig.suptitle("objectives from one SFT checkpoint, one budget (orange: per-token log-probs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(rows: list[dict], notes: list[str], out: Path, png: bool = True) -> list[Path]:
    """Write comparison.md, .csv, .json (and .png) into ``out``; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "comparison.md", out / "comparison.csv", out / "comparison.json"]
    written[0].write_text(to_markdown(rows, notes))
    with open(written[1], "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([k for k, _ in COLUMNS])
        writer.writerows([["" if r[k] is None else r[k] for k, _ in COLUMNS] for r in rows])
    public = [{k: r[k] for k, _ in COLUMNS} | {"eval_steps": r["eval_steps"]} for r in rows]
    written[2].write_text(json.dumps({"rows": public, "notes": notes}, indent=1) + "\n")
    if png and rows:
        write_png(rows, out / "comparison.png")
        written.append(out / "comparison.png")
    return written


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module's docstring); returns the exit code (2: no run folder)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run folders, their output_root, or glob patterns (quote them)")
    parser.add_argument("--out", help="folder for comparison.{md,csv,json,png} (default: the folder the runs are in)")
    parser.add_argument("--all", action="store_true", help="keep every run, not only the newest of each objective")
    parser.add_argument("--no-png", action="store_true", help="skip the PNG")
    args = parser.parse_args(argv)
    try:
        rows, notes = build_table(args.paths, keep_all=args.all)
    except RunFolderError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(os.path.commonpath([str(p.parent.resolve()) for p in find_runs(args.paths)]))
    print(to_markdown(rows, notes), end="")
    written = write_outputs(rows, notes, out, png=not args.no_png)
    print(f"Wrote {', '.join(str(p) for p in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
