"""How ``python train.py`` starts its processes: one per GPU for FSDP/TP (:func:`launch`), ``sft_first``'s two stages
(:func:`run_stages`), and what a Hydra submitit job reports."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import torch
from omegaconf import DictConfig

import data  # noqa: F401  (registers the data formats and datasets beyond hh, shp and se)
import losses
import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)
import utils
from modeling import models
from parallel.process_group import check_gpu_count
from runs import checkpoints, checks, ending, processes
from runs.config_text import shell_line
from runs.processes import says_once

STAGE_ENV = "DPO_STAGE"  # set by run_stages in each stage's process


RUN_FOLDER_FD_ENV = "DPO_RUN_FOLDER_FD"  # set by launch in rank 0: a pipe main writes the run folder into, named if a rank dies


RUN_FOLDER_TOLD: str | None = None  # the run folder this command made or continued (tell_launcher), for a sweep's summary


def tell_launcher(run_dir: str) -> None:
    """Write ``run_dir`` into :func:`launch`'s pipe (``DPO_RUN_FOLDER_FD``), if any, and keep it as :data:`RUN_FOLDER_TOLD`."""
    global RUN_FOLDER_TOLD
    RUN_FOLDER_TOLD = run_dir
    fd = os.environ.pop(RUN_FOLDER_FD_ENV, None)
    if fd is not None:
        with contextlib.suppress(OSError, ValueError):
            os.write(int(fd), run_dir.encode())
            os.close(int(fd))


def process_count(config: DictConfig) -> int:
    """The processes ``config`` trains with: torchrun's WORLD_SIZE, else ``world_size`` (null: one per GPU, 1 on CPU);
    1 for BasicTrainer."""
    if config.trainer == "BasicTrainer":
        return 1
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return config.world_size or torch.cuda.device_count() or 1


def launch(config: DictConfig) -> int | None:
    """For FSDP/TP not under torchrun, start and wait for one process per GPU; returns the exit code, or None to train here."""
    if config.trainer == "BasicTrainer" or "RANK" in os.environ:
        return None
    n = process_count(config)
    checks.validate_config(config, n)
    check_gpu_count(n, f"world_size={n}")  # one process per GPU: not CUDA's "invalid device ordinal" in each
    models.check_parallel_model(config, n)
    lock = checkpoints.lock_run_dir(config.resume) if config.resume is not None else checkpoints.RunLock(None, "")
    with lock:
        return _run_processes(config, n, lock)


def _run_processes(config: DictConfig, n: int, lock: checkpoints.RunLock) -> int:
    """launch()'s work: start the ``n`` processes with ``lock``, forward signals, wait; returns the exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"Starting {n} {config.trainer} processes (gloo on CPU, NCCL on GPUs).")
    procs = []
    shared = {checkpoints.RUN_LOCK_FD_ENV: str(lock.fd)} if lock.fd is not None else {}
    folder_pipe = os.pipe()  # rank 0 writes the run folder into it once it has made it (tell_launcher)
    for rank in range(n):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n), **shared}
        env |= {"LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env |= {processes.LAUNCHER_PID_ENV: str(os.getpid())}
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
        fds = (lock.fd,) if lock.fd is not None else ()
        if rank == 0:
            env[RUN_FOLDER_FD_ENV], fds = str(folder_pipe[1]), (*fds, folder_pipe[1])
        procs.append(subprocess.Popen([sys.executable, *this_command()], env=env, start_new_session=True, pass_fds=fds))
    os.close(folder_pipe[1])

    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in ending.STOP_SIGNALS}
    stopped = {128 + s for s in ending.STOP_SIGNALS}  # the exit codes of a rank that saved and stopped
    codes: dict[int, int] = {}  # in the order the ranks were seen to end
    killed: set[int] = set()  # ranks stopped here because another one failed
    run_dir = None
    try:
        deadline = None  # when to kill the ranks still running
        while len(codes) < n:
            for rank, p in enumerate(procs):
                if rank not in codes and p.poll() is not None:
                    codes[rank] = p.returncode
                    if p.returncode == processes.PEER_LOST_EXIT:  # the rank that died is about to be seen: let it
                        deadline = deadline or time.time() + 5
                    elif p.returncode != 0 and p.returncode not in stopped:
                        deadline = time.time()
            if deadline is not None and time.time() >= deadline:
                for rank, p in enumerate(procs):  # the others would wait for the failed one forever
                    if p.poll() is None:
                        p.kill()
                        killed.add(rank)
            time.sleep(0.1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.set_blocking(folder_pipe[0], False)
        with contextlib.suppress(OSError):
            run_dir = os.read(folder_pipe[0], 1 << 16).decode() or None
        os.close(folder_pipe[0])
    if run_dir is not None:
        tell_launcher(run_dir)  # sft_first's run_stages started this launcher: it names the stage's folder
    return processes.rank_failure(codes, killed, stopped, config.resume or run_dir)


SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py"
)  # not sys.argv[0], which is submitit's in a submitit job


# keys (with sub-keys) the SFT stage sets itself; hub: only the second stage pushes
STAGE_KEYS = ("loss", "n_examples", "n_epochs", "sft_first", "exp_name", "lr", "hub")


def sft_stage_wanted(config: DictConfig, given: set[str]) -> bool:
    """Whether ``sft_first``'s SFT stage runs first; a preset's stage that cannot apply is noted, a command line's raises."""
    stage = config.sft_first or {}  # sft_first=null: no stage
    if stage.get("n_examples") is None or ("RANK" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ):
        return False  # a rank train.py started: its launcher ran the stages
    reason = checks.sft_first_skip(config, given)
    if reason is None and "TORCHELASTIC_RUN_ID" in os.environ:  # was: each rank trained DPO alone, from the random model
        source = "" if any(k.startswith("sft_first") for k in given) else " (set by the model preset)"
        n = stage.n_examples
        raise utils.ConfigError(
            f"sft_first.n_examples={n}{source} runs two runs (SFT, then this one), and torchrun runs each rank as one; run "
            f"the SFT stage first (loss=sft n_examples={n} sft_first.n_examples=null), then this command with "
            "sft_first.n_examples=null model.archive=<SFT run>/LATEST/policy.pt, or both stages on one node with "
            "python train.py trainer=FSDPTrainer world_size=<processes> (no torchrun)."
        )
    if reason is None:
        return True
    if says_once() and config.resume in (None, "auto"):  # a resume= is one run whatever the preset says: no note
        print(f"Note: no SFT stage (sft_first.n_examples={stage.n_examples} from the preset): {reason}.")
    return False


def stage_commands(config: DictConfig, overrides: list[str]) -> tuple[list[str], list[str]]:
    """The overrides of ``sft_first``'s SFT stage and of this run (``model.archive`` appended once the first finishes)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    kept = [text for text, o in zip(overrides, parsed) if o.key_or_group.split(".")[0].lstrip("+~") not in STAGE_KEYS]
    stage = config.sft_first
    sft = [*kept, "loss=sft", f"n_examples={stage.n_examples}", "sft_first.n_examples=null"]
    if stage.lr is not None:
        sft.append(f"lr={stage.lr}")
    given_name = next((o.value() for o in parsed if o.key_or_group == "exp_name"), None)
    if given_name is not None:
        sft.append(f"exp_name={given_name}_sft")
    second = [text for text, o in zip(overrides, parsed) if o.key_or_group.split(".")[0].lstrip("+~") != "sft_first"]
    return sft, [*second, "sft_first.n_examples=null"]  # the stage's own sft_first.* said once


def run_stages(config: DictConfig, overrides: list[str]) -> int:
    """Run ``sft_first``'s SFT stage, then this command from its policy, forwarding the trainer's stop signals; returns the exit code."""
    script = os.path.relpath(SCRIPT)
    sft, dpo = stage_commands(config, overrides)
    child: list[subprocess.Popen] = []
    folders: list[str | None] = []  # each stage's run folder, as the stage says it (tell_launcher)

    received: list[int] = []  # stop signals this runner was sent

    def forward(signum, frame):
        received.append(signum)
        if child and child[0].poll() is None:
            child[0].send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in ending.STOP_SIGNALS}
    try:
        for number, (what, args) in enumerate((("SFT on the chosen responses", sft), (None, dpo)), 1):
            if number == 2:
                if folders[0] is None or not os.path.exists(os.path.join(folders[0], checkpoints.FINISHED)):
                    print("Error: the SFT stage finished without a finished run folder in output_root.", file=sys.stderr)
                    return 1
                args = [*args, f"model.archive={os.path.join(folders[0], 'LATEST', 'policy.pt')}"]
                what = f"{config.loss.name} from the SFT policy"
                if received:  # stopped as stage 1 ended: stage 2 is not started
                    name = signal.Signals(received[0]).name
                    print(f"Stopped by {name} after stage 1 finished; stage 2: {shell_line(script, args)}", file=sys.stderr)
                    return 128 + received[0]
            print(f"\n=== Stage {number} of 2: {what}\n    {shell_line(script, args)}\n", flush=True)
            code, folder = _run_stage(script, args, number, child)
            folders.append(folder)
            if folders[-1] is not None:
                tell_launcher(folders[-1])  # this command's run folder is its last stage's
            if code != 0:
                if code != 2:  # 2: the stage said its one-sentence error already
                    folder, hint = folders[-1], ""
                    if number == 1 and folder is not None and os.path.exists(os.path.join(folder, "LATEST")):
                        hint = (
                            f" Continue it with {shell_line(script, [f'resume={folder}'])}, then stage 2: "
                            f"{shell_line(script, [*dpo, 'model.archive=' + os.path.join(folder, 'LATEST', 'policy.pt')])}"
                        )
                    print(f"Stage {number} of 2 ended with exit code {code}.{hint}", file=sys.stderr)
                return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sft_dir, run_dir = folders
    print(f"\nBoth stages finished: the SFT run {sft_dir}, then the {config.loss.name} run {run_dir}.")
    for line in stage_summary(sft_dir, run_dir):
        print(line)
    return 0


def _run_stage(script: str, args: list[str], number: int, child: list[subprocess.Popen]) -> tuple[int, str | None]:
    """Run stage ``number`` as ``script args`` (held in ``child`` for the stop signals); returns its exit code and run folder."""
    folder_pipe = os.pipe()  # the stage's own run folder, not another's: sweep jobs may share output_root and run at once
    env = {**os.environ, RUN_FOLDER_FD_ENV: str(folder_pipe[1]), STAGE_ENV: str(number)}
    env[processes.LAUNCHER_PID_ENV] = str(os.getpid())  # the stage dies with this runner, even by kill -9
    try:
        command = [sys.executable, script, *args]
        child[:] = [subprocess.Popen(command, start_new_session=True, env=env, pass_fds=folder_pipe[1:])]
    finally:
        os.close(folder_pipe[1])
    code = child[0].wait()
    os.set_blocking(folder_pipe[0], False)  # a process the stage left behind may hold the write end
    said = b""
    with contextlib.suppress(OSError):  # nothing written: the stage made no run folder
        said = os.read(folder_pipe[0], 1 << 16)
    os.close(folder_pipe[0])
    return code, said.decode() or None


def stage_summary(sft_dir: str | None, run_dir: str) -> list[str]:
    """Lines comparing the evals at the start, after the SFT stage in ``sft_dir`` (if any) and at the end of ``run_dir``:
    answers_eval scores and reward accuracy."""

    def evals(folder):
        path = os.path.join(folder, "metrics.jsonl")
        rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        return [r for r in rows if any(k.endswith("_eval/accuracies") or k.startswith("answers_eval/") for k in r)]

    second = evals(run_dir)
    if sft_dir is None and not (len(second) > 1 and second[0].get("step") == 0):
        return []  # one run alone is compared with its own step-0 eval
    first = evals(sft_dir) if sft_dir is not None else second[:1]
    loss = checkpoints.load_run_config(os.path.join(run_dir, "config.yaml")).loss
    loss_name = loss.name
    n = second[-1].get("answers_eval/n") if second else None
    n = int(n) if isinstance(n, (int, float)) else "the"
    lines = []
    if first and second:
        for key in sorted(k for k in second[-1] if k.startswith("answers_eval/") and not k.endswith(("_failed", "/ended", "/n"))):
            values = [first[0].get(key), first[-1].get(key), second[-1].get(key)]
            if all(isinstance(v, (int, float)) for v in values):
                after_sft = f"{values[1]:.2f} after SFT, " if sft_dir is not None else ""
                lines.append(
                    f"{key} (mean score of the greedy answers to the held-out prompts): {values[0]:.2f} at the start, "
                    f"{after_sft}{values[2]:.2f} after {loss_name} ({n} prompts)."
                )
    accuracy = [r.get("rewards_eval/accuracies") for r in (second[:1] + second[-1:])] if second else []
    if len(accuracy) == 2 and all(isinstance(v, (int, float)) for v in accuracy):
        start = (
            "policy = reference: every margin 0; chance 0.5"
            if losses.get_objective(loss_name).uses_reference(loss)
            else "chance 0.5"
        )
        lines.append(
            f"rewards_eval/accuracies (chosen ranked above rejected, held-out pairs): {accuracy[0]:.2f} at the start of "
            f"{loss_name} ({start}), {accuracy[1]:.2f} at its end."
        )
    return lines


def submitit_job() -> bool:
    """Whether this process is a job of Hydra's submitit launcher (``hydra/launcher=slurm``, ``submitit_*``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():  # train.main() or launch() called from Python
        return False
    hydra_config = HydraConfig.get()
    return hydra_config.mode == RunMode.MULTIRUN and "submitit" in str(hydra_config.launcher.get("_target_", ""))


def this_command() -> list[str]:
    """The command that reruns this one for FSDP/TP ranks: ``sys.argv``, or train.py with a submitit job's overrides."""
    if not submitit_job():
        return sys.argv
    from hydra.core.hydra_config import HydraConfig

    return [SCRIPT, *HydraConfig.get().overrides.task]


def job_failure(code: int) -> str:
    """The sentence for a submitit job that ended with ``code``: its last output line and where its output is."""
    import submitit

    sys.stdout.flush()
    sys.stderr.flush()
    env = submitit.JobEnvironment()
    paths = env.paths
    log = paths.stderr if code <= 128 and paths.stderr.exists() else paths.stdout  # stderr_to_stdout=true: one file
    lines = [line.split("\r")[-1].strip() for line in log.read_text(errors="replace").splitlines()] if log.exists() else []
    said = next((line for line in reversed(lines) if line), "").removeprefix("Error: ")
    return f"Job {env.job_id} ended with exit code {code}{': ' + said if said else ''} (its output: {paths.stdout})"
