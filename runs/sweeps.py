"""The summary of a ``python train.py -m`` sweep: a Hydra callback (``hydra.callbacks`` in config/config.yaml)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

import utils

RECORDS = ".jobs"
"""The sweep folder's subfolder where each job leaves its record, ``<job number>.json``."""

STOP_CODES = (130, 138, 140, 143)
"""Exit codes of a run that saved a checkpoint and stopped on a signal (SIGINT, SIGUSR1, SIGUSR2, SIGTERM)."""


def job_result(run_dir: str | None, code: int, failure: str | None) -> dict:
    """A sweep job's return value: its run folder, exit code and, if not 0, the sentence the sweep ends with
    (runs.launch.job_failure)."""
    return {"run_dir": run_dir, "code": code, "failure": failure}


def swept_keys(task_overrides: list[str]) -> set[str]:
    """The keys the sweep's command line gives more than one value (``loss=dpo,ipo``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.get_key_element() for o in OverridesParser.create().parse_overrides(task_overrides) if o.is_sweep_override()}


def state(code: int | None) -> str:
    """finished, stopped (exit code N) or failed (exit code N); ``None``: the job left no result."""
    if code == 0:
        return "finished"
    if code is None:
        return "failed (no result)"
    return f"{'stopped' if code in STOP_CODES else 'failed'} (exit code {code})"


class SweepSummary(Callback):
    """Records each job in ``<sweep dir>/.jobs`` (on_job_end runs in the job's own process), then prints
    one line per job and exits 1 with the first failed (or stopped) job's sentence."""

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode.name != "MULTIRUN":
            return
        result = job_return._return_value if job_return.status == JobStatus.COMPLETED else None
        if not isinstance(result, dict):  # the job raised: Hydra reports the exception itself
            result = job_result(None, None, None)
        record = {"num": config.hydra.job.num, "overrides": list(job_return.overrides or []), **result}
        folder = Path(config.hydra.sweep.dir) / RECORDS
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{config.hydra.job.num}.json"
        utils.write_atomic(str(path), json.dumps(record))  # whole, or absent

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        template = str(config.hydra.launcher.get("submitit_folder") or "")
        if "%j" in template:  # submitit_local's controllers make the unexpanded folder too; nothing is in it
            with contextlib.suppress(OSError):  # gone already, or not empty
                os.rmdir(template)
        records = sorted((json.loads(p.read_text()) for p in (sweep_dir / RECORDS).glob("*.json")), key=lambda r: r["num"])
        print()  # apart from the jobs' own output (the basic launcher runs them in this terminal)
        for line in summary(records, swept_keys(list(config.hydra.overrides.task)), str(sweep_dir), bool(template)):
            print(line)
        failed = next((r for r in records if r["code"] != 0 and r["failure"]), None)
        sys.stdout.flush()  # the summary before the sentence
        if failed is not None:  # SystemExit, not an exception: Hydra would turn that into a warning
            print(failed["failure"], file=sys.stderr)
            sys.exit(1)


def summary(records: list[dict], swept: set[str], sweep_dir: str, submitit: bool) -> list[str]:
    """The lines printed at a sweep's end: the job count, then per job its swept overrides, state and run folder."""
    where = "; each job's output under .submitit/" if submitit else ""
    lines = [f"Sweep done: {len(records)} job{'s' if len(records) != 1 else ''} ({sweep_dir}{where})."]
    names = [" ".join(o for o in r["overrides"] if o.split("=", 1)[0].lstrip("+~") in swept) or f"#{r['num']}" for r in records]
    states = [state(r["code"]) for r in records]
    width = (max(map(len, names), default=0), max(map(len, states), default=0))
    for name, said, record in zip(names, states, records):
        lines.append(f"  {name:<{width[0]}}  {said:<{width[1]}}  {record['run_dir'] or '(no run folder)'}".rstrip())
    return lines
