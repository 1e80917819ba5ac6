"""A run's setup around training: ``resume=auto`` and ``resume=<run folder>`` resolved, a longer length continued, the
folder held, its checkpoint checked, and stop signals before the first step."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
import time

from omegaconf import DictConfig, OmegaConf

import preference_datasets
import utils
from data.loading import load_examples
from evaluation import reward_functions
from export import modelcard
from modeling import models, optimization
from parallel import process_group
from runs import checkpoints, checks, ending, nodes, processes, saved_config
from runs.config_text import command_text
from runs.files import open_append
from runs.resume import read_checkpoint_file
from utils import DataError

BUDGET_KEYS = ("n_examples", "n_epochs")  # what resume=<run folder> may change, extending the run to the new length
EXTENSIONS_LOG = "extensions.log"  # in a run folder: one line per extension of its training length (apply_extension)


def effective_config(config: DictConfig, budget: dict | None = None) -> DictConfig:
    """The config to run: ``resume=auto`` resolved and, with ``resume=<run folder>``, its saved config with ``budget`` set
    (ConfigError when it names code or an endpoint ``config`` does not: :func:`saved_config.handed_error`)."""
    if config.resume == "auto":
        root, exp_name = config.output_root, config.exp_name
        found, other = auto_resume_run(config)
        if processes.says_once():
            if found is None and other is None:
                print(f"resume=auto: no unfinished run of exp_name={exp_name} in {root}; starting a fresh run.")
            elif found is None:
                print(
                    f"resume=auto: the newest unfinished run of exp_name={exp_name}, {other[0]}, was started with "
                    f"another config ({saved_config.describe_differences(other[1])}); starting a fresh run."
                )
            elif other is None:
                print(f"resume=auto: continuing {found}, the newest unfinished run of exp_name={exp_name}.")
            else:
                print(
                    f"resume=auto: continuing {found}, the newest unfinished run of exp_name={exp_name} with this "
                    f"config (the newer {other[0]} differs in {saved_config.describe_differences(other[1])})."
                )
        config.resume = found
    resume_dir = config.resume
    if resume_dir is not None:
        saved = os.path.join(resume_dir, "config.yaml")
        checkpoint, _ = checkpoints.checkpoint_to_resume(resume_dir)
        if os.path.exists(saved) and checkpoint is None:
            if processes.says_once():  # held for a moment: a live run is named, and what a killed first save left is removed
                checkpoints.lock_run_dir(resume_dir).release()
            raise utils.ConfigError(
                f"resume={resume_dir} has no checkpoint yet (the run stopped before its first): there is nothing to "
                "resume; start it again with the same command (its config is in config.yaml there)."
            )
        if checkpoint is None or not os.path.exists(saved):
            parent = os.path.dirname(os.path.normpath(resume_dir))
            hint = ""
            if os.path.exists(os.path.join(parent, "LATEST")) and os.path.exists(os.path.join(parent, "config.yaml")):
                hint = f"; it looks like a checkpoint inside one: give the run folder, resume={parent}"
            raise utils.ConfigError(f"resume={resume_dir} is not a run folder with a LATEST checkpoint and config.yaml{hint}.")
        run_config = checkpoints.load_run_config(saved)
        problem = saved_config.handed_error(resume_dir, run_config, config)  # the folder's code and endpoints: only if given too
        if problem is not None:
            raise utils.ConfigError(problem)
        config = run_config
        config.update(budget or {})
        config.resume = resume_dir
        config.model.archive = checkpoints.pinned_archive(resume_dir, config.model.archive)  # step-N, not LATEST
    OmegaConf.resolve(config)
    return config


def auto_resume_run(config: DictConfig, finished: bool = False) -> tuple[str | None, tuple[str, list] | None]:
    """``resume=auto``'s find: (newest unfinished run of ``exp_name`` with this config or None, newer differing run or
    None); with ``finished``, finished runs count too."""
    new = OmegaConf.create(OmegaConf.to_container(config, resolve=True))
    newest_other = None
    for run in checkpoints.resumable_runs(config.output_root, config.exp_name, finished):
        try:
            saved = checkpoints.load_run_config(os.path.join(run, "config.yaml"))
        except Exception as e:  # an unreadable config.yaml: that run cannot be matched
            differences = [("config.yaml", f"unreadable ({type(e).__name__})", "this command")]
        else:
            differences = saved_config.config_differences(saved, new)
        if not differences:
            return run, newest_other
        newest_other = newest_other or (run, differences)
    return None, newest_other


def resume_override_error(config: DictConfig, given: set[str]) -> str | None:
    """With ``resume=<run folder>``: one sentence when the given keys (budget aside) differ from its saved config, else None."""
    saved = os.path.join(str(config.resume), "config.yaml")
    keys = [k for k in given if k != "resume" and k not in BUDGET_KEYS]  # a new length extends the run
    if not keys or not os.path.isfile(saved):
        return None
    differences = saved_config.config_differences(checkpoints.load_run_config(saved), config, keys)
    if not differences:
        return None
    return (
        f"resume={config.resume} continues that run with its saved config, but this command changes "
        f"{saved_config.describe_differences(differences)}; drop those overrides to continue the run, or start a new run "
        f"from its checkpoint with model.archive={os.path.join(str(config.resume), 'LATEST', 'policy.pt')} and them."
    )


def budget_given(config: DictConfig, given: set[str]) -> dict | None:
    """With ``resume=<run folder>``: the ``n_examples``/``n_epochs`` the command line sets (n_epochs alone nulls n_examples)."""
    if config.resume in (None, "auto") or not any(k in given for k in BUDGET_KEYS):
        return None
    budget = {k: config[k] for k in BUDGET_KEYS if k in given}
    if "n_epochs" in given and "n_examples" not in given and config.n_epochs is not None:
        budget["n_examples"] = None
    return budget


def length_text(config) -> str:
    """``n_examples=96`` or ``n_epochs=2``: the key that sets ``config``'s training length."""
    return f"n_examples={config.n_examples}" if config.n_examples else f"n_epochs={config.n_epochs}"


def total_examples(config, n_train: int) -> int:
    """How many examples a run of ``config`` trains on, with ``n_train`` examples per epoch."""
    return config.n_examples or config.n_epochs * n_train


def extension(config: DictConfig, resume_dir: str, trained: int, n_train: int) -> dict | None:
    """When ``config``'s training length differs from ``resume_dir``'s: {old, old_total, new_total, trained}, else None."""
    saved = checkpoints.load_run_config(os.path.join(resume_dir, "config.yaml"))
    if all(saved[k] == config[k] for k in BUDGET_KEYS):
        return None
    new_total = total_examples(config, n_train)
    if new_total <= trained:
        raise utils.ConfigError(
            f"resume={resume_dir} has trained {trained} examples already, at or after {length_text(config)} ({new_total} "
            f"examples); give a length of more than {trained} examples to extend it."
        )
    return {"old": saved, "old_total": total_examples(saved, n_train), "new_total": new_total, "trained": trained}


def lr_line(config: DictConfig, steps_done: int, old_steps: int, new_steps: int) -> str:
    """The line saying what extending from ``old_steps`` to ``new_steps`` steps after ``steps_done`` does to the lr schedule."""
    schedule, warmup = config.lr_scheduler, config.warmup_steps
    before = config.lr * optimization.lr_multiplier(max(steps_done - 1, 0), warmup, old_steps, schedule)
    after = config.lr * optimization.lr_multiplier(steps_done, warmup, new_steps, schedule)
    if schedule == "constant":
        return (
            f"lr_scheduler=constant: the schedule does not depend on the run's length, so it goes on unchanged "
            f"(step {steps_done} trains at lr {after:.3g}, as in a fresh run of {new_steps} steps)."
        )
    return (
        f"lr_scheduler={schedule}: the schedule is stretched over the new total of {new_steps} steps (it was {old_steps}), "
        f"as a fresh run of that length has it, from step {steps_done} (the lr jumps from {before:.3g} to {after:.3g})."
    )


def scheduled_lr(trainer) -> None:
    """Set the lr of ``trainer``'s next step from its scheduler after a checkpoint load (an extension changes it)."""
    scheduler = trainer.scheduler
    lrs = [base * fn(scheduler.last_epoch) for fn, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(trainer.optimizer.param_groups, lrs):
        group["lr"] = lr  # what the step logs as its lr


def apply_extension(trainer, config: DictConfig, found: dict, checkpoint_dir: str, rank: int) -> None:
    """Continue the loaded run to ``config``'s new length: skip the eval it holds; rank 0 says so, saves and logs it."""
    run_dir, steps_done = trainer.run_dir, trainer.scheduler.last_epoch  # optimizer steps taken
    while trainer.next_eval_at <= trainer.example_counter:  # a run's end (saved before this was advanced there) evaluated here
        trainer.next_eval_at += config.eval_every
    if rank != 0:
        return
    old, new = length_text(found["old"]), length_text(config)
    line = (
        f"Extending {run_dir} from {old} ({found['old_total']} examples) to {new} ({found['new_total']} examples), "
        f"continuing from {os.path.basename(os.path.realpath(checkpoint_dir))} after {found['trained']} examples."
    )
    steps = [-(-n // config.batch_size) for n in (found["old_total"], found["new_total"])]
    schedule = lr_line(config, steps_done, *steps)
    print(f"{line}\n{schedule}")
    saved = OmegaConf.load(os.path.join(run_dir, "config.yaml"))  # the file as written: only its length changes
    saved.update({k: config[k] for k in BUDGET_KEYS})
    checkpoints.save_run_config(
        saved, os.path.join(run_dir, "config.yaml"), checkpoints.read_command(run_dir)
    )  # "# Made by:" kept
    with open_append(os.path.join(run_dir, EXTENSIONS_LOG)) as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line} {schedule}\n")
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(run_dir, checkpoints.FINISHED))


class StoppedDuringSetup(Exception):
    """SIGINT, SIGTERM or SIGUSR1 arrived during setup, before the training loop could save a checkpoint (:class:`SetupStops`)."""

    def __init__(self, signum: int):
        super().__init__(f"Stopped by {signal.Signals(signum).name} during setup, before the first training step")
        self.signum = signum


class SetupStops:
    """The first stop signal during setup raises :class:`StoppedDuringSetup`; :meth:`hand_over` passes them to the trainer."""

    def __init__(self):
        self.previous: dict = {}
        self.raised = False

    def _stop(self, signum, frame):
        if not self.raised:
            self.raised = True
            raise StoppedDuringSetup(signum)

    def hand_over(self, handler) -> None:
        """From now on the signals go to ``handler`` (``ending.request_stop`` of the trainer)."""
        for s in self.previous:
            signal.signal(s, handler)

    def __enter__(self) -> SetupStops:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._stop) for s in ending.STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def stopped_during_setup(error: StoppedDuringSetup, made: str | None, resume_dir: str | None) -> str:
    """The sentence for a stop during setup; removes ``made`` (this job's run folder) when it holds no checkpoint."""
    if resume_dir is not None:
        return f"{error}: nothing was trained since its checkpoint; continue with: python train.py resume={resume_dir}"
    removed = ""
    if made is not None and not any(n == "LATEST" or re.fullmatch(r"step-\d+", n) for n in os.listdir(made)):
        shutil.rmtree(made, ignore_errors=True)
        removed = f" and its run folder {made} was removed"
    return f"{error}: nothing was trained{removed}; run the same command again to start."


def remove_setup_only(run_dir: str) -> None:
    """Remove the run folder ``run_dir`` this job made if it holds only config.yaml, its lock and writers' leftovers."""
    if checkpoints.holds_only_setup(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)


def hold_run_dir(resume_dir: str, rank: int, distributed: bool, held: contextlib.ExitStack) -> None:
    """Lock ``resume_dir`` on rank 0 into ``held``; every rank raises utils.ConfigError when a live run holds it."""
    _refused_on_every_rank(lambda: held.enter_context(checkpoints.lock_run_dir(resume_dir)), rank, distributed)


def check_resumed_files(resume_dir: str, checkpoint_dir: str | None, rank: int, distributed: bool) -> None:
    """Rank 0 checks ``checkpoint_dir``'s files against its manifest and the run's model.archive against its pin;
    every rank raises utils.ConfigError with what it found."""

    def check() -> None:  # hashing is reading every byte: once, not once per rank
        if checkpoint_dir is not None:  # (after the lock: a live run's checkpoint is its own business)
            checkpoints.check_checkpoint(checkpoint_dir)
        checkpoints.check_archive_pin(
            resume_dir,
            "restore that file to resume this run against the reference it trained with, or start a new run to "
            "train against the file there now",
        )

    _refused_on_every_rank(check, rank, distributed)


def _refused_on_every_rank(check, rank: int, distributed: bool) -> None:
    """Run ``check`` on rank 0; the utils.ConfigError it raises is raised on every rank (no rank waits alone)."""
    refusal = None
    if rank == 0:
        try:
            check()
        except utils.ConfigError as e:
            refusal = str(e)
    if distributed:
        refusal = utils.broadcast_object(refusal)
    if refusal is not None:
        raise utils.ConfigError(refusal)


def resume_state(
    config: DictConfig, checkpoint_dir: str | None, fingerprint: dict, n_train: int, rank: int, auto: bool
) -> tuple[dict | None, dict | None]:
    """The checkpoint's trainer_state.pt, checked against this data's ``fingerprint`` (``auto``: resume=auto chose the
    run), and the run's :func:`extension`."""
    state = None
    if checkpoint_dir is not None:  # before any model loads: is this the data the checkpoint was trained on?
        state = read_checkpoint_file(checkpoint_dir, "trainer_state.pt")
        problem = checkpoints.data_change(state.get("data"), fingerprint, checkpoint_dir, auto=auto)
        if problem is not None:
            raise DataError(problem)
        if state.get("data") is None and rank == 0:
            print(f"Note: {checkpoint_dir} predates data fingerprints, so resume cannot check that the data is unchanged.")
    extended = None
    if config.resume is not None and state is not None:  # a new n_examples / n_epochs: checked before models load
        extended = extension(config, config.resume, state["example_counter"], n_train)
    return state, extended


def check_config(config: DictConfig) -> list:
    """Check ``config`` for this process's ``WORLD_SIZE`` and say its notes; returns the eval reward functions it names."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    checks.validate_config(config, world_size)
    declared = preference_datasets.declared_reward_functions(config.datasets)
    answer_functions = reward_functions.eval_functions(config.eval_reward_functions, declared)  # a bad name: now
    if config.model.fsdp_policy_mp == "float16" and int(os.environ.get("RANK", 0)) == 0:
        print(
            "Note: model.fsdp_policy_mp=float16 computes in float16 without a gradient scaler, so small gradients "
            "can underflow to 0; model.fsdp_policy_mp=bfloat16 has float32's range."
        )
    models.check_parallel_model(config, world_size)  # under torchrun too: before the run folder
    if config.trainer == "BasicTrainer" and (config.world_size or 1) > 1:
        print(f"Note: world_size={config.world_size} is for FSDPTrainer/TensorParallelTrainer; BasicTrainer uses one process.")
    return answer_functions


def start_ranks(config: DictConfig, auto: bool) -> int:
    """Join the FSDP/TP process group and check that every rank runs the same config and code; returns this rank."""
    rank = process_group.init_distributed(config.dist_timeout_minutes)
    nodes.check_same_run(config, auto)  # every rank: the same config and code as rank 0, before any model loads
    nodes.check_shared_output_root(config.output_root, rank)
    if rank != 0:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # one set of loading bars, not one per rank
    return rank


def run_folder(
    config: DictConfig,
    run_dir: str | None,
    recorded: DictConfig,
    rank: int,
    distributed: bool,
    held: contextlib.ExitStack,
    made: list[str],
    pin: dict | None = None,
    command: list[str] | None = None,
) -> str:
    """``run_dir``, or a new run folder made by rank 0 (locked into ``held``, appended to ``made``, with the archive's
    ``pin``), as every rank sees it."""
    if run_dir is None and rank == 0:
        command = None if command is None else command_text(command)
        run_dir, lock = checkpoints.new_run_dir(config.output_root, config.exp_name, recorded, command, pin)
        made.append(run_dir)
        held.enter_context(lock)  # taken before config.yaml was written
    if distributed:
        run_dir = utils.broadcast_object(run_dir)
    return run_dir


def finish(config: DictConfig, run_dir: str, stop_signal: int | None, rank: int, distributed: bool, owns_folder: bool) -> None:
    """Leave the process group, and push a finished run's export when ``hub.push`` asks and no launcher owns the folder."""
    if distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    push = owns_folder and config.hub.push  # a launcher's run (Ray) is pushed by that launcher
    if stop_signal is None and rank == 0 and push:  # the run is FINISHED before the push
        print(modelcard.push_final(run_dir, config))


RUN_FOLDER: str | None = None  # this process's run folder once main knows it, named when another rank dies
COMMAND: list[str] | None = None  # the overrides train.py was started with (hydra_main), atop a new run's config.yaml


def check_stages(config: DictConfig, world_size: int = 1) -> None:
    """Before ``sft_first``'s two stages: the config's values over ``world_size`` processes, the eval reward functions
    and both data splits (a utils.ConfigError or DataError is said once, not inside a stage)."""
    checks.validate_config(config, world_size)
    models.check_parallel_model(config, world_size)  # e.g. heads the tensor or sequence parallel ranks cannot split
    declared = preference_datasets.declared_reward_functions(config.datasets)
    reward_functions.eval_functions(config.eval_reward_functions, declared)
    options = OmegaConf.to_container(config.data, resolve=True)
    for split in ("train", "test"):
        load_examples(list(config.datasets), split, options, sft_mode=True, silent=True)
