"""A worker's clock and memory readings for bench_dpo.py's workers: RSS, threads, optimizer, busy CPUs, steady step times."""

from __future__ import annotations

import os
import sys
import time


def _rss_now_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mib() -> tuple[float, float]:
    """(ru_maxrss, VmHWM) in MiB: the process's own peak resident memory, two ways."""
    import resource

    hwm = float("nan")
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, hwm


def _set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _opt_desc(opt) -> str:
    """The optimizer class and the settings that change its arithmetic or kernels."""
    opt = getattr(opt, "optimizer", opt)  # accelerate wraps TRL's
    groups = opt.param_groups
    keys = ("lr", "weight_decay", "betas", "eps", "fused", "foreach")
    settings = {k: sorted({str(g.get(k)) for g in groups}) for k in keys}
    return f"{type(opt).__name__}(" + ", ".join(f"{k}={'/'.join(v)}" for k, v in settings.items()) + ")"


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat, all processes)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf("SC_CLK_TCK")


def _mark() -> tuple[float, float, float]:
    """(wall clock, this process's CPU seconds, the machine's busy CPU seconds), after the GPU's
    queued work has finished when a GPU is in use (bench_gpu_dpo.py), so a step is its own."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time(), _busy_cpu_s()


def _steady(marks: list[tuple[float, float, float]], warmup: int) -> dict:
    """Timing from the clock marks taken before the first step and after each: the median wall
    seconds per step after ``warmup`` steps (the median: robust to a stray hiccup), the mean,
    every step's seconds; over the measured steps, this process's CPU seconds per wall second
    (about the thread count when it had the cores) and the CPUs that OTHER processes used."""
    import statistics

    walls = [m[0] for m in marks]
    steps = [b - a for a, b in zip(walls[:-1], walls[1:])]
    measured = steps[warmup:]
    wall = walls[-1] - walls[warmup]
    own = marks[-1][1] - marks[warmup][1]
    return {
        "step_s": statistics.median(measured),
        "step_mean_s": sum(measured) / len(measured),
        "steps_s": steps,
        "cpu_util": own / wall,
        "others_cpu": max(0.0, (marks[-1][2] - marks[warmup][2] - own) / wall),
    }
