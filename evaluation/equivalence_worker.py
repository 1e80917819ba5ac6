"""The equivalence matrix's cells of several processes (evaluation/equivalence.py), one launch per cell for all its
objectives, so the imports, the processes' start and the Ray cluster's start are paid once per cell, not per objective.

:func:`launch` starts ``python -m torch.distributed.run --standalone --nproc_per_node N -m evaluation.equivalence_worker
<folder>`` (FSDP, TP, 2-D: N ranks, as train.py's own launcher starts them) or ``python -m evaluation.equivalence_worker
<folder>`` (the Ray cell: one driver, one Ray cluster); each process runs train.main (Ray: parallel/ray_launcher.launch) on
each objective's overrides in turn (:func:`main`) and appends what became of it to ``<folder>/outcomes-<rank>.jsonl``:
started, then done (its run folder), refused (the config check's sentence) or failed. :func:`launch` attributes each
outcome to its objective; an objective during which the processes died or fell silent is failed, and the objectives after
it run in a new launch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOBS = "jobs.json"  # in the launch's folder: [{"name": objective, "overrides": [...]}, ...] in the order they run
LOG = "output.log"  # the launch's stdout and stderr
TERMINAL = ("done", "refused", "failed")


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What became of one objective in a launch: ``status`` done, refused or failed; ``text`` its run folder, the
    refusal's sentence or what failed."""

    status: str
    text: str


# ----------------------------------------------------------------------------- the launcher's side


def launch(
    jobs: dict[str, list[str]],
    ranks: int | None,
    folder: Path,
    timeout: float = 600,
    on_done: Callable[[str], None] | None = None,
) -> dict[str, Outcome]:
    """Run each of ``jobs`` (objective -> train.py overrides) in one launch of ``ranks`` processes under torchrun (None:
    one process, a Ray driver); returns objective -> Outcome. An objective during which the launch died or wrote nothing
    for ``timeout`` s is failed, and those after it run in a new launch; ``on_done(objective)`` as each one ends."""
    outcomes: dict[str, Outcome] = {}
    attempt = 0
    while len(outcomes) < len(jobs):
        left = [n for n in jobs if n not in outcomes]
        here = folder / f"launch-{attempt}"
        here.mkdir(parents=True)
        (here / JOBS).write_text(json.dumps([{"name": n, "overrides": jobs[n]} for n in left]))

        def collect(here=here) -> None:  # the objectives ended so far, each told once
            for name, outcome in read_outcomes(here, ranks or 1).items():
                if name not in outcomes:
                    outcomes[name] = outcome
                    if on_done is not None:
                        on_done(name)

        how = _run(here, ranks, timeout, collect)
        collect()
        unfinished = [n for n in left if n not in outcomes]
        if not unfinished:
            break
        if not _started(here) & set(left):  # it died before its first objective: the next launch would too
            why = f"the launch {how} before its first objective: {_last_error(here / LOG)} (its output: {here / LOG})"
            outcomes.update({n: Outcome("failed", why) for n in unfinished})
            break
        outcomes[unfinished[0]] = Outcome("failed", f"the launch {how} during this objective (its output: {here / LOG})")
        print(f"{unfinished[0]}: the launch {how}; the end of its output:\n{_tail(here / LOG)}", file=sys.stderr)
        if on_done is not None:
            on_done(unfinished[0])
        attempt += 1
    return outcomes


def _run(here: Path, ranks: int | None, timeout: float, collect: Callable[[], None]) -> str:
    """Start the launch of ``here`` and wait for it, calling ``collect()`` whenever an objective starts or ends; returns
    how it ended (for a sentence: "ended with exit code 1", "was killed after 600 s without an objective starting or ending")."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks else []
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # Ray's workers import train too
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    command = [sys.executable, *torchrun, "-m", "evaluation.equivalence_worker", str(here)]
    with open(here / LOG, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    said, last = 0, time.time()
    try:
        while proc.poll() is None:
            size = sum(p.stat().st_size for p in here.glob("outcomes-*.jsonl"))
            if size != said:  # an objective started or ended: progress
                said, last = size, time.time()
                collect()
            if time.time() - last > timeout:
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks (a session of their own)
                proc.wait()
                return f"was killed after {timeout:g} s without an objective starting or ending"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # this process stopped (Ctrl-C): the launch, in a session of its own, stops with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return f"ended with exit code {proc.returncode}"


def read_outcomes(here: Path, n: int) -> dict[str, Outcome]:
    """The objectives every one of the ``n`` processes has ended in the launch in ``here``: a failure on any rank (one
    that is not only a lost peer first), else a refusal, else rank 0's run folder."""
    records: dict[str, list[dict]] = {}
    for rank in range(n):
        path = here / f"outcomes-{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        for record in (json.loads(line) for line in lines if line.endswith("}")):  # a line being written is left for later
            if record["status"] in TERMINAL:
                records.setdefault(record["name"], []).append({**record, "rank": rank})
    outcomes = {}
    for name, ended in records.items():
        if len(ended) < n:
            continue
        failed = sorted((r for r in ended if r["status"] == "failed"), key=lambda r: (r["lost_peer"], r["rank"]))
        refused = [r for r in ended if r["status"] == "refused"]
        if failed:
            first = failed[0]
            outcomes[name] = Outcome("failed", first["text"] + (f" (rank {first['rank']})" if n > 1 else ""))
        elif refused:
            outcomes[name] = Outcome("refused", refused[0]["text"])
        else:
            outcomes[name] = Outcome("done", next(r["text"] for r in ended if r["rank"] == 0))
    return outcomes


def _started(here: Path) -> set[str]:
    """The objectives rank 0 has started in the launch in ``here``."""
    path = here / "outcomes-0.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return {json.loads(line)["name"] for line in lines if line.endswith("}")}


def _tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:] if path.exists() else ""


def _last_error(path: Path) -> str:
    """The last line of the log at ``path`` that names an error, else its last line."""
    lines = [line.strip() for line in _tail(path, 20000).splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    return (named or lines or ["no output"])[-1][:300]


# ----------------------------------------------------------------------------- the worker's side


def compose(overrides: list[str]):
    """The composed config of ``python train.py <overrides>``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "config"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides)


def record(folder: Path, rank: int, name: str, status: str, text: str = "", lost_peer: bool = False) -> None:
    """Append one line on objective ``name`` to this process's ``outcomes-<rank>.jsonl``."""
    line = json.dumps({"name": name, "status": status, "text": text, "lost_peer": lost_peer})
    with open(folder / f"outcomes-{rank}.jsonl", "a") as f:
        f.write(line + "\n")


def run_job(overrides: list[str], run: Callable) -> tuple[str, str, bool]:
    """``run(config)`` on the config of ``overrides``, which returns the run folder; returns (status, text, whether it
    failed only because another rank was gone)."""
    import utils
    from runs import processes

    try:
        return "done", str(run(compose(overrides))), False
    except utils.ConfigError as e:
        return "refused", str(e), False
    except Exception as e:  # noqa: BLE001 - an objective that fails is recorded, the next ones still run
        traceback.print_exc()
        return "failed", utils.failure_reason(e), processes.lost_peer(e) is not None


def run_ranks(jobs: list[dict], folder: Path) -> None:
    """This torchrun rank's part of each job in turn: train.main, each job in a process group of its own."""
    import torch.distributed as dist

    import train
    from parallel import process_group

    store, rank, _ = next(dist.rendezvous("env://"))  # torchrun's store; each job's group gets its own keys in it
    for i, job in enumerate(jobs):

        def run(config, i=i) -> str:
            # a group of its own keys: one started again on the last job's keys would meet its stale addresses; train.main
            # finds it started and leaves it on success
            process_group.init_distributed(config.dist_timeout_minutes, dist.PrefixStore(f"equivalence/{i}/", store))
            run_dir, stop_signal = train.main(config)
            if stop_signal is not None:
                raise RuntimeError(f"the run stopped on signal {stop_signal}")
            return run_dir

        record(folder, rank, job["name"], "started")
        outcome = run_job(job["overrides"], run)
        if dist.is_initialized():  # a failed run leaves its group: the next job starts its own
            dist.destroy_process_group()
        record(folder, rank, job["name"], *outcome)


def run_ray(jobs: list[dict], folder: Path) -> None:
    """Each job in turn on one Ray cluster, started by the first (parallel/ray_launcher.launch uses a cluster this process
    is connected to and leaves it running), shut down at the end."""
    import ray

    import train
    from parallel import ray_launcher

    def run(config) -> Path:
        if not ray.is_initialized():
            ray_launcher.init_ray(ray, config.ray, ray_launcher.required_resources(config))
        code = ray_launcher.launch(config, train.main)
        if code != 0:
            raise RuntimeError(f"parallel/ray_launcher.launch returned exit code {code}")
        return next(p for p in Path(config.output_root).iterdir() if p.is_dir())

    try:
        for job in jobs:
            record(folder, 0, job["name"], "started")
            record(folder, 0, job["name"], *run_job(job["overrides"], run))
    finally:
        if ray.is_initialized():
            ray.shutdown()


def main(folder: Path) -> None:
    """Run the jobs of ``folder`` (:data:`JOBS`): as a torchrun rank when RANK is set, else as the Ray cell's driver."""
    jobs = json.loads((folder / JOBS).read_text())
    if "RANK" in os.environ:
        run_ranks(jobs, folder)
    else:
        run_ray(jobs, folder)


if __name__ == "__main__":
    import data  # noqa: F401  (registers the datasets, as train.py does)
    from runs import processes

    processes.die_with_launcher()  # a rank dies with torchrun, even by kill -9
    processes.exit_rank(lambda: main(Path(sys.argv[1])))  # os._exit: gloo's threads at teardown could abort it
