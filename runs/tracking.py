"""The metrics logger (JSONL, wandb), training curves and peak memory."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import losses
import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)
import utils
from runs import checkpoints
from runs.files import link_refusal, open_append

_PEAK = {"reset": False, "jobs": 0}  # whether reset_peak_memory could reset the resident peak; jobs it started


def count_tokens(batch: dict) -> int:
    """Non-padding tokens of a batch: prompt + responses of every sequence (prompts alone for a
    batch of prompts)."""
    keys = [k for k in ("chosen_attention_mask", "rejected_attention_mask") if k in batch] or ["prompt_attention_mask"]
    return sum(int(batch[k].sum()) for k in keys)


def reset_peak_memory() -> None:
    """Reset the kernel's resident high-water mark and CUDA's peak, so each job of a Hydra multirun reports its own."""
    _PEAK["jobs"] += 1
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (Documentation/filesystems/proc.rst)
        _PEAK["reset"] = True
    except OSError:  # not Linux, or not allowed: the peak stays the process's
        _PEAK["reset"] = False
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_rss_mib() -> float:
    """This job's peak resident memory in MiB (``VmHWM`` on Linux, else the process's ``ru_maxrss``)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)  # bytes / KiB


def peak_is_the_processes() -> bool:
    """Whether :func:`peak_rss_mib` includes earlier jobs of this process (it could not be reset)."""
    return _PEAK["jobs"] > 1 and not _PEAK["reset"]


# ----------------------------------------------------------------------------- metrics


def rewind_jsonl(path: str, step: int) -> int:
    """Atomically drop the lines of JSON-lines file ``path`` cut short or with ``"step"`` above ``step``; returns how
    many were dropped."""
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), (int, float)) and record["step"] > step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        with utils.replacing(path, f"resume again ({os.path.basename(path)} is unchanged)") as tmp, open(tmp, "w") as f:
            f.writelines(kept)
    return dropped


def jsonl_records(path: str) -> list[dict]:
    """The records of the JSON-lines file ``path``, less a line cut short by a crash."""
    records = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


class MetricsLogger:
    """Append metrics to ``<run_dir>/metrics.jsonl`` and, if enabled, to W&B (run ``resume_id`` when resumed)."""

    def __init__(self, run_dir: str, config: DictConfig, resume_id: str | None = None, enabled: bool = True):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.enabled = enabled  # False on every process but rank 0
        self.wandb = None
        self.run_id = resume_id
        self._wandb_init = None  # wandb.init's arguments until the run is opened
        if enabled and config.wandb.enabled and config.wandb.mode != "disabled":
            self._wandb_init = {
                "entity": config.wandb.entity,
                "project": config.wandb.project,
                "name": config.exp_name,
                "mode": config.wandb.mode,
                "dir": run_dir,
                "config": OmegaConf.to_container(config, resolve=True),
            }
            if resume_id is None:
                self._open_wandb()

    def _open_wandb(self, rewind_to: int | None = None) -> None:
        """Open a new W&B run, or run ``run_id`` rewound to step ``rewind_to`` where W&B allows, else continued."""
        import wandb

        kwargs, self._wandb_init = self._wandb_init, None
        run = None
        if self.run_id is None:
            run = wandb.init(**kwargs)
        elif rewind_to is not None:
            try:
                run = wandb.init(**kwargs, resume_from=f"{self.run_id}?_step={int(rewind_to)}")
            except Exception as e:  # rewind is a W&B preview feature that a server may refuse
                print(
                    f"Note: W&B could not rewind run {self.run_id} to step {int(rewind_to)} ({utils.failure_reason(e)}); "
                    "continuing it instead, where W&B ignores the steps it already has."
                )
        if run is None:
            run = wandb.init(**kwargs, id=self.run_id, resume="allow")
        self.wandb = run
        self.run_id = run.id

    def rewind(self, step: int) -> int:
        """Drop the metrics.jsonl records after step ``step`` (examples) and rewind the W&B run there; returns how many."""
        if not self.enabled:
            return 0
        dropped = rewind_jsonl(self.path, step)
        if self._wandb_init is not None:
            self._open_wandb(rewind_to=step)
        return dropped

    def log(self, metrics: dict, step: int) -> None:
        """Write one record at ``step`` (examples seen)."""
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float, np.floating)) else v) for k, v in metrics.items()}
        with (
            utils.saying_disk_full(self.path, "append to", checkpoints.resume_hint(os.path.dirname(self.path))),
            open_append(self.path) as f,
        ):
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self._wandb_init is not None:
            self._open_wandb()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """Log a table (e.g. samples) to W&B; the trainer writes the same rows to a file."""
        if self._wandb_init is not None:
            self._open_wandb()
        if self.wandb is not None:
            import wandb

            self.wandb.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def finish(self) -> None:
        """Close the W&B run, if any."""
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _curve_rules(loss: str | None, average_log_prob: bool) -> list[tuple]:
    """(key pattern, panel or None for not plotted, title, y label, y limits) in panel order."""
    objective = losses.OBJECTIVES.get(loss) if loss is not None else None
    loss_unit = objective.unit if objective is not None else "nats, −log σ(β·log-ratio gap)"
    logp_unit = "nats per token, mean over response tokens" if average_log_prob else "nats, summed over response tokens"
    fraction = (-0.02, 1.02)
    return [
        (r"^(memory|counters)/|^answers_eval/n$", None, "", "", None),  # one value at the end / the x axis / a count
        (r"/accuracies$", "accuracy", "pair accuracy", "accuracy (fraction of pairs, chosen > rejected)", fraction),
        (r"^answers_eval/", "answers_eval", "the policy's greedy answers (eval)", "mean score (exact checks: share right)", None),
        (r"^loss/", "loss", "loss", f"loss ({loss_unit})", None),
        (r"^rewards(_train)?/", "rewards_train", "implicit rewards (train)", "reward β·log(π/π_ref) (nats)", None),
        (r"^rewards_eval/", "rewards_eval", "implicit rewards (eval)", "reward β·log(π/π_ref) (nats)", None),
        (r"^logps_train/", "logps_train", "policy log-probabilities (train)", f"log-probability ({logp_unit})", None),
        (r"^logps_eval/", "logps_eval", "policy log-probabilities (eval)", f"log-probability ({logp_unit})", None),
        (r"^scores_train/", "scores_train", "reward-model scores (train)", "score (logit)", None),
        (r"^scores_eval/", "scores_eval", "reward-model scores (eval)", "score (logit)", None),
        (
            r"^objective/(kl|entropy|non_score_reward)$",
            "objective_kl",
            "KL to the reference, entropy",
            "nats per completion",
            None,
        ),
        (
            r"^(objective/(scores|scores_margin|rlhf_reward)|eval/scores)$",
            "scores",
            "reward-model scores of samples",
            "score (logit)",
            None,
        ),
        (
            r"contain_eos_token$|^online/(ties|failed_judgements|labelled_pairs)$",
            "online_fractions",
            "online pairs",
            "fraction (0-1)",
            fraction,
        ),
        (r"completion_length$", "completion_length", "completion length", "tokens per completion", None),
        (r"^lr$", "lr", "learning rate", "learning rate (per optimizer step)", None),
        (r"^grad_norm$", "grad_norm", "gradient norm", "gradient L2 norm (before clipping)", None),
        (r"^examples_per_second$", "examples_per_second", "throughput", "examples / s", None),
        (r"^tokens_per_second$", "tokens_per_second", "throughput", "non-padding tokens / s", None),
        (r"^beta$", "beta", "beta", "β", None),
    ]


def curve_panels(series: dict[str, list], loss: str | None = None, average_log_prob: bool = False) -> list[dict]:
    """The panels of ``series`` ({key: [(step, value)]}) with two points or more, in order, as ``{"name": file stem,
    "title", "ylabel", "ylim": (lo, hi) or None, "keys"}`` (one unit per panel)."""
    import re

    rules = _curve_rules(loss, average_log_prob)
    panels: dict[str, dict] = {}
    order = {rule[1]: i for i, rule in enumerate(rules)}
    for key in series:
        rule = next((r for r in rules if re.search(r[0], key)), None)
        if rule is None:  # a key no rule knows: a panel per prefix
            prefix = key.split("/")[0]
            rule = (None, prefix, prefix, prefix, None)
        _, name, title, ylabel, ylim = rule
        if name is None:
            continue
        panel = panels.setdefault(name, {"name": name, "title": title, "ylabel": ylabel, "ylim": ylim, "keys": []})
        panel["keys"].append(key)
    plan = []
    for panel in sorted(panels.values(), key=lambda p: (order.get(p["name"], len(order)), p["name"])):
        if max(len(series[k]) for k in panel["keys"]) >= 2:
            plan.append({**panel, "keys": sorted(panel["keys"])})
    return plan


def plot_curves(run_dir: str, out_dir: str | None = None, panels: tuple[str, ...] | None = None) -> list[str]:
    """Write one PNG per panel of ``metrics.jsonl`` (x: examples seen; ``panels``: only these) into ``out_dir``
    (default ``<run_dir>/curves/``), removing stale ones; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    series: dict[str, list[tuple[int, float]]] = {}
    for rec in jsonl_records(path):
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                series.setdefault(k, []).append((rec["step"], v))
    loss, average = None, False
    saved = os.path.join(run_dir, "config.yaml")
    if os.path.exists(saved):
        loss_config = checkpoints.load_run_config(saved).loss
        loss, average = loss_config.name, bool(loss_config.get("average_log_prob", False))  # not every loss has it
    plan = [p for p in curve_panels(series, loss, average) if panels is None or p["name"] in panels]
    out_dir = out_dir or os.path.join(run_dir, "curves")
    if os.path.islink(out_dir):  # its plots would land in the folder it points at
        raise utils.ConfigError(link_refusal(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for panel in plan:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in panel["keys"]:
            xs, ys = zip(*series[key])
            ax.plot(xs, ys, label=key, marker="." if len(xs) < 30 else None)
        ax.set_xlabel("examples seen")
        ax.set_ylabel(panel["ylabel"])
        ax.set_title(panel["title"])
        if panel["ylim"] is not None:
            ax.set_ylim(*panel["ylim"])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        file = os.path.join(out_dir, f"{panel['name']}.png")
        fig.tight_layout()
        with utils.replacing(file) as tmp:  # a link at file is replaced, not written through
            fig.savefig(tmp, dpi=100, format="png")
        plt.close(fig)
        written.append(file)
    for stale in set(os.listdir(out_dir)) - {os.path.basename(f) for f in written}:
        if stale.endswith(".png"):
            os.remove(os.path.join(out_dir, stale))
    return written


def formatted_dict(d: dict) -> dict:
    """Round floats for printing."""
    return {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in d.items()}


def format_peak_memory(memory: dict[str, list[float]]) -> str:
    """One line for the end of a run from :func:`log_peak_memory`'s figures, e.g.
    ``Peak memory: 812 MiB resident (640 MiB by the end of model loading)``; one clause per rank
    when there are several, plus CUDA's peak allocation on a GPU."""
    n = len(memory["rss"])
    parts = []
    for rank in range(n):
        text = f"{memory['rss'][rank]:.0f} MiB resident ({memory['setup_rss'][rank]:.0f} MiB by the end of model loading)"
        if "cuda" in memory:
            text += f", {memory['cuda'][rank]:.0f} MiB CUDA"
        parts.append(f"rank {rank} {text}" if n > 1 else text)
    whose = " (this process's, over the earlier jobs of this multirun too: its peak cannot be reset here)"
    return "Peak memory" + (whose if peak_is_the_processes() else "") + ": " + "; ".join(parts) + "."


def log_peak_memory(dist, logger, setup_rss_mib: float, step: int) -> dict[str, list[float]]:
    """Log and return ``{"rss", "setup_rss"[, "cuda"]}``, each process's peak resident (overall, and ``setup_rss_mib``
    by the end of model loading) and CUDA memory in MiB, one value per rank (``dist``: the trainer's trainers.Dist;
    every process must call it, a gather)."""
    mine = {"rss": [peak_rss_mib()], "setup_rss": [setup_rss_mib]}
    if torch.cuda.is_available():
        mine["cuda"] = [torch.cuda.max_memory_allocated() / 2**20]
    gathered = dist.gather_per_rank(mine)
    record = {}
    for kind, values in gathered.items():
        for rank, value in enumerate(values):
            record[f"memory/rank{rank}_peak_{kind}_mib"] = value
    if dist.is_main:
        logger.log(record, step=step)
    return dict(gathered)


def cpu_allocator() -> str:
    """The allocator serving this process's memory, in words."""
    preloaded = utils.preloaded_malloc()
    if preloaded:
        return f"{os.path.basename(preloaded)} (preloaded)"
    libc = utils.glibc()
    if libc is None:
        return "the C library's malloc"
    import ctypes

    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    version = libc.gnu_get_libc_version().decode()
    mib = utils.MALLOC_STATE["threshold_mib"]
    if mib is None:
        return f"glibc {version} malloc, its default mmap threshold (128 KiB, growing to 32 MiB)"
    return f"glibc {version} malloc, mmap threshold {mib:g} MiB (malloc_mmap_threshold_mib)"


def say_peak_memory(memory: dict[str, list[float]]) -> None:
    """Print :func:`format_peak_memory`'s line and, without a GPU, the memory allocator (``cpu_allocator``), which
    decides much of the peak on CPU (docs/models.md, "Memory on CPU")."""
    print(format_peak_memory(memory))
    if "cuda" not in memory:
        print(f"CPU memory allocator: {cpu_allocator()}.")


def progress_postfix(means: dict) -> dict:
    """The progress bar's short figures of a train log: loss, accuracy, margin, examples per second."""
    names = {
        "loss/train": "loss",
        "rewards_train/accuracies": "acc",
        "rewards_train/margins": "margin",
        "examples_per_second": "ex/s",
    }
    return {short: f"{means[k]:.3g}" for k, short in names.items() if k in means}
