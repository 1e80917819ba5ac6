"""A kill -9 pass (issue 24): a run SIGKILLed after its first checkpoint leaves no process and resumes bit-exact.

    python scripts/kill_pass.py [--cases basic,fsdp-torchrun] [--out DIR]     # all CASES: ~10 min on 2 CPU cores

Per case, on the tiny settings of tests/conftest.py (checkpoints at 24, 48, 72 examples): an
uninterrupted run; the same run with its train.py, launcher, torchrun or rank 1 SIGKILLed mid-step
(``-save`` cases: while the next checkpoint's temporary folder exists); no process naming its
output_root 3 s later (any left is killed); ``resume=`` to a final ``policy.pt`` equal tensor by
tensor to the uninterrupted run's; no ``*.tmp``, ``*.tmp-*``, ``.*.old-*`` or empty folder left.
One table line per case, exit status 1 if any fails (Linux: /proc). Logs: ``<out>/<case>/*.log``.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from conftest import TINY  # noqa: E402  (the tests' tiny settings, kept in one place)

BASE = [*TINY, "n_examples=72", "num_threads=1"]  # eval_every=24: checkpoints at 24, 48 and 72 examples
FSDP = ["trainer=FSDPTrainer", "world_size=2"]
LORA = ["model.lora.r=4"]
ONLINE = ["online.enabled=true", "online.scorer=reward_function", "reward_functions=[arithmetic]"]
ONLINE += ["online.max_new_tokens=8", "online.n_log_completions=3", "loss.beta=0.1"]
LEFTOVERS = ["*.tmp", "*.tmp-*", ".*.old-*"]  # a checkpoint, LATEST or file being written, a checkpoint moved aside
SETTLE_S = 3.0  # how long the run's other processes get to die after the kill
TIMEOUT_S = 900  # for any one run


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]  # overrides beyond BASE
    victim: str  # the process killed: main (the one started: train.py, the launcher or torchrun) or rank1
    moment: str = "step"  # step: once a step after the first checkpoint is logged; save: while the next checkpoint is written
    torchrun: bool = False


CASES = {
    "basic": Case((), "main"),
    "basic-save": Case((), "main", "save"),
    "fsdp-launcher": Case(tuple(FSDP), "main"),
    "fsdp-launcher-save": Case(tuple(FSDP), "main", "save"),
    "fsdp-torchrun": Case(("trainer=FSDPTrainer",), "main", torchrun=True),
    "fsdp-rank": Case(tuple(FSDP), "rank1"),
    "lora": Case(tuple(LORA), "main"),
    "online": Case(tuple(ONLINE), "main"),
}


def command(case: Case, args: list[str]) -> list[str]:
    """The command line of ``train.py <args>``, under torchrun (2 processes, a free port) for a torchrun case."""
    if not case.torchrun:
        return [sys.executable, "train.py", *args]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={port}", "train.py", *args]


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` in the repository root, its output in ``log``, in its own session."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT_S) -> int | None:
    """``proc``'s exit status, or None when it ran past ``timeout`` seconds (it is then killed)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def ancestors() -> set[int]:
    """This process and its ancestors' pids."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the field after the state: the parent's pid
        except OSError:
            break
    return pids


def processes(root: Path) -> dict[int, str]:
    """The live processes (not zombies) whose command line holds ``root``, each as 'pid name'."""
    found, mine = {}, ancestors()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in mine:  # this script and what started it (timeout, a shell)
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            if str(root) not in " ".join(argv):
                continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{entry}/environ", "rb") as f:
                rank = re.search(rb"(?:^|\0)RANK=(\d+)", f.read())
        except OSError:  # gone meanwhile, or not ours
            continue
        if state not in ("Z", "X"):
            name = "torchrun" if "torch.distributed.run" in argv else "train.py"
            found[int(entry)] = f"rank {rank.group(1).decode()}" if rank else name
    return found


def run_folder(root: Path) -> Path | None:
    """The run folder train.py made in ``root`` (one per root here), or None."""
    folders = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    return folders[0] if folders else None


def latest_step(run: Path | None) -> int | None:
    """The example count of the checkpoint ``LATEST`` of the run folder ``run`` names, or None before the first."""
    if run is None:
        return None
    try:
        return int(os.readlink(run / "LATEST").rsplit("step-", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def logged_step(run: Path) -> int:
    """The highest ``step`` in metrics.jsonl so far (a line being written is skipped)."""
    try:
        text = (run / "metrics.jsonl").read_text()
    except OSError:
        return 0
    return max((int(m) for m in re.findall(r'"step": (\d+)', text)), default=0)


def saving(run: Path, after: int) -> int | None:
    """The step of a checkpoint past ``after`` being written (its ``.step-N.tmp*`` folder exists), or None."""
    try:
        names = os.listdir(run)
    except OSError:
        return None
    steps = [int(m.group(1)) for m in map(re.compile(r"\.step-(\d+)\.tmp").match, names) if m]
    return next((s for s in steps if s > after), None)


def kill_moment(proc: subprocess.Popen, root: Path, case: Case) -> tuple[str, int | None]:
    """Wait for ``case``'s moment in the run ``proc`` writes under ``root`` and kill -9 its victim.

    Returns:
        What was killed when (for the table), and the victim's pid (None when the run ended or
        timed out first, said in the text).
    """
    deadline = time.time() + TIMEOUT_S
    first = run = None
    while first is None:  # the first checkpoint
        if proc.poll() is not None or time.time() > deadline:
            return f"nothing: the run ended ({proc.returncode}) before its first checkpoint", None
        run = run or run_folder(root)
        first = latest_step(run) if run else None
        time.sleep(0.05)
    victims = {pid: name for pid, name in processes(root).items() if case.victim == "main" or name == "rank 1"}
    pid = proc.pid if case.victim == "main" else next(iter(victims), None)
    if pid is None:
        return "nothing: no rank 1 process found", None
    what = (
        "rank 1"
        if case.victim == "rank1"
        else "torchrun"
        if case.torchrun
        else "launcher"
        if "world_size=2" in case.args
        else "train.py"
    )
    while proc.poll() is None and time.time() < deadline:
        if case.moment == "save" and (step := saving(run, first)) is not None:
            os.kill(pid, signal.SIGKILL)
            torn = saving(run, first) is not None and latest_step(run) == first
            return f"{what} during the save of step-{step}" + ("" if torn else " (the save had ended)"), pid
        if case.moment == "step" and (step := logged_step(run)) > first:
            os.kill(pid, signal.SIGKILL)
            return f"{what} after step {step} (LATEST step-{first})", pid
        time.sleep(0.001 if case.moment == "save" else 0.01)
    return f"nothing: the run ended ({proc.returncode}) before the moment", None


def compare(full: Path, resumed: Path) -> tuple[bool, float]:
    """Whether the two runs' final ``policy.pt`` are equal tensor by tensor, and the largest absolute difference."""
    import torch

    a = torch.load(full / "LATEST" / "policy.pt", weights_only=True)
    b = torch.load(resumed / "LATEST" / "policy.pt", weights_only=True)
    if a["step_idx"] != b["step_idx"] or a["state"].keys() != b["state"].keys():
        return False, float("inf")
    equal, diff = True, 0.0
    for name, x in a["state"].items():
        y = b["state"][name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return False, float("inf")
        equal &= torch.equal(x, y)
        if x.is_floating_point():
            diff = max(diff, (x.double() - y.double()).abs().max().item() if x.numel() else 0.0)
    return equal, diff


def leftovers(root: Path) -> list[str]:
    """Temporary or moved-aside files and folders and empty folders under ``root``, relative to it."""
    found = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        for name in dirs + files:
            if any(fnmatch.fnmatch(name, pattern) for pattern in LEFTOVERS):
                found.append(str((here / name).relative_to(root)))
        if not dirs and not files and here != root:
            found.append(f"{here.relative_to(root)}/ (empty)")
    return sorted(found)


def run_case(name: str, case: Case, out: Path, full_runs: dict) -> dict:
    """One case's (a)-(f); returns its table row, with ``ok``."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    row = {"case": name, "killed": "-", "left": "-", "resumed": "no", "exact": "-", "leftovers": "-", "ok": False}
    key = (case.args, case.torchrun)
    if key not in full_runs:  # (a), shared by the cases of the same run
        print(f"[{name}] the uninterrupted run ...", file=sys.stderr, flush=True)
        root = folder / "full"
        code = finish(start(command(case, [*BASE, *case.args, f"output_root={root}"]), folder / "full.log"))
        full_runs[key] = run_folder(root) if code == 0 else None
    full = full_runs[key]
    if full is None:
        row["killed"] = "nothing: the uninterrupted run failed (see its full.log)"
        return row

    print(f"[{name}] the killed run ...", file=sys.stderr, flush=True)  # (b)
    root = folder / "cut"
    proc = start(command(case, [*BASE, *case.args, f"output_root={root}"]), folder / "cut.log")
    try:
        row["killed"], pid = kill_moment(proc, root, case)
        deadline = time.time() + SETTLE_S  # (c)
        killed_at = latest_step(run_folder(root))  # a killed run's processes must not move it
        try:
            proc.wait(timeout=SETTLE_S)  # the launcher of a killed rank stops the other rank and exits itself
        except subprocess.TimeoutExpired:
            pass  # still running: reported below with the rest
        while (left := processes(root)) and time.time() < deadline:
            time.sleep(0.1)
    finally:
        left = processes(root)
        for other in left:
            os.kill(other, signal.SIGKILL)
        finish(proc, 30)
    run = run_folder(root)
    moved = run is not None and latest_step(run) != killed_at
    row["left"] = str(len(left))
    if left:
        row["left"] += f" ({', '.join(left.values())}{f'; LATEST moved to step-{latest_step(run)}' if moved else ''}; killed)"
    if pid is None or run is None:
        return row

    print(f"[{name}] resume= ...", file=sys.stderr, flush=True)  # (d)
    code = finish(start(command(case, [f"resume={run}"]), folder / "resume.log"))
    resumed = code == 0 and (run / "FINISHED").exists()
    since = re.search(r"Resuming after (\d+) examples", (folder / "resume.log").read_text())
    row["resumed"] = f"yes (from {since[1] if since else '?'})" if resumed else f"no (exit {code}; see resume.log)"
    exact = False
    if resumed:  # (e)
        exact, diff = compare(full, run)
        row["exact"] = f"{'yes' if exact else 'no'} (max abs diff {diff:.3g})"
    found = leftovers(root)  # (f)
    row["leftovers"] = ", ".join(found) if found else "none"
    row["ok"] = not left and not moved and resumed and exact and not found
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--out", help="where the runs and logs go (default: a temporary folder, removed if all pass)")
    options = parser.parse_args()
    names = [n.strip() for n in options.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        print(f"Error: unknown case {', '.join(unknown) or '(none given)'}; the cases are {', '.join(CASES)}.", file=sys.stderr)
        return 2
    out = Path(options.out).resolve() if options.out else Path(tempfile.mkdtemp(prefix="kill-pass-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"Runs and logs in {out}", flush=True)
    columns = ("case", "killed", "left", "resumed", "bit-exact", "leftovers")
    widths = (18, 56, 26, 14, 26)
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " | " + columns[-1], flush=True)
    rows, full_runs = [], {}
    try:
        for name in names:
            row = run_case(name, CASES[name], out, full_runs)
            rows.append(row)
            cells = [row[k] for k in ("case", "killed", "left", "resumed", "exact")]
            print(" | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " | " + row["leftovers"], flush=True)
    finally:
        stray = processes(out)
        for pid in stray:
            os.kill(pid, signal.SIGKILL)
        if stray:
            print(f"Killed {len(stray)} process(es) still running at the end: {stray}", file=sys.stderr)
    failed = [row["case"] for row in rows if not row["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} cases passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    if not failed and not options.out:
        shutil.rmtree(out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
