"""Entry point: ``python train.py [key=value ...]`` (Hydra): check the config, load data and models, run ``config.trainer``."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import shutil
import signal
import sys
import threading
import time

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import data  # noqa: F401  (registers the data formats and datasets beyond hh, shp and se)
import evaluation.in_training  # noqa: F401  (registers answers_eval and samples with each eval)
import export.hf  # noqa: F401  (registers the Hugging Face folder hf/ with each checkpoint)
import losses
import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)
import online  # noqa: F401  (registers online DPO's trainer)
import preference_datasets
import trainers
import utils
from data import chat, screening
from evaluation import reward_functions, rewards
from export import modelcard
from modeling import models
from modeling.models import load_reference
from preference_datasets import DataError, load_examples
from runs import checkpoints, checks, launch, processes, reference_cache, tracking

AUTO_RESUMED = False  # whether resume=auto was resolved here (effective_config), for the cross-rank config check to say


BUDGET_KEYS = ("n_examples", "n_epochs")  # what resume=<run folder> may change, extending the run to the new length
EXTENSIONS_LOG = "extensions.log"  # in a run folder: one line per extension of its training length (apply_extension)


def effective_config(config: DictConfig, budget: dict | None = None) -> DictConfig:
    """The config to run: ``resume=auto`` resolved and, with ``resume=<run folder>``, its saved config with ``budget`` set
    (ConfigError when it names code or an endpoint ``config`` does not: :func:`checks.handed_error`)."""
    global AUTO_RESUMED
    if config.resume == "auto":
        AUTO_RESUMED = True
        root, exp_name = config.output_root, config.exp_name
        found, other = auto_resume_run(config)
        if processes.says_once():
            if found is None and other is None:
                print(f"resume=auto: no unfinished run of exp_name={exp_name} in {root}; starting a fresh run.")
            elif found is None:
                print(
                    f"resume=auto: the newest unfinished run of exp_name={exp_name}, {other[0]}, was started with "
                    f"another config ({checks.describe_differences(other[1])}); starting a fresh run."
                )
            elif other is None:
                print(f"resume=auto: continuing {found}, the newest unfinished run of exp_name={exp_name}.")
            else:
                print(
                    f"resume=auto: continuing {found}, the newest unfinished run of exp_name={exp_name} with this "
                    f"config (the newer {other[0]} differs in {checks.describe_differences(other[1])})."
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
        problem = checks.handed_error(resume_dir, run_config, config)  # the folder's code and endpoints: only if given too
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
            differences = checks.config_differences(saved, new)
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
    differences = checks.config_differences(checkpoints.load_run_config(saved), config, keys)
    if not differences:
        return None
    return (
        f"resume={config.resume} continues that run with its saved config, but this command changes "
        f"{checks.describe_differences(differences)}; drop those overrides to continue the run, or start a new run "
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
    before = config.lr * trainers.lr_multiplier(max(steps_done - 1, 0), warmup, old_steps, schedule)
    after = config.lr * trainers.lr_multiplier(steps_done, warmup, new_steps, schedule)
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
    with utils.open_append(os.path.join(run_dir, EXTENSIONS_LOG)) as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line} {schedule}\n")
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(run_dir, checkpoints.FINISHED))


def load_archive(model: torch.nn.Module, state: dict, path: str) -> None:
    """Load ``state`` (a policy.pt's weights) into ``model``; utils.ConfigError naming the first mismatch for another model's."""
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        detail = (lines[0] if lines else str(e))[:200]
        raise utils.ConfigError(
            f"model.archive={path} holds another model's weights ({detail}); give the policy.pt of a run of this model."
        ) from e


def check_archive_model(config: DictConfig, model: torch.nn.Module, tokenizer) -> None:
    """Refuse (utils.ConfigError) a ``model`` whose transformers config computes otherwise than that of the run
    ``model.archive`` comes from (its config.yaml beside the step), and note harmless differences."""
    run_dir = os.path.dirname(os.path.dirname(os.path.realpath(config.model.archive)))
    saved_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(saved_path):  # a policy.pt outside a run folder: nothing to compare with
        return
    saved = checkpoints.load_run_config(saved_path).model
    if saved.get("config") == config.model.get("config") and saved.get("name_or_path") == config.model.get("name_or_path"):
        return  # the same model settings
    try:
        theirs = models.transformers_config(saved, tokenizer)
    except (utils.ConfigError, OSError, ValueError):  # e.g. a hub id this machine cannot reach: nothing to compare with
        return
    changed, harmless = models.config_field_differences(theirs, model.config)

    def listed(fields: list, which: int) -> str:
        return ", ".join(f"{field}={utils.override_text(values[which - 1])}" for field, *values in fields)

    if changed:
        raise utils.ConfigError(
            f"model.archive={config.model.archive} holds the weights of a model with {listed(changed, 1)} ({saved_path}), "
            f"and this run builds one with {listed(changed, 2)}, in which the same weights compute something else; give "
            "this run the archive's model settings, or the policy.pt of a run of this model."
        )
    if harmless:
        print(
            f"Note: model.archive={config.model.archive} comes from a model with {listed(harmless, 1)}, and this run's "
            f"has {listed(harmless, 2)}; the weights mean the same in both."
        )


def load_models(config: DictConfig, tokenizer, rank: int, distributed: bool) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy (or reward model) and frozen reference (None without one or with LoRA), with ``model.archive``'s weights."""
    objective = losses.get_objective(config.loss.name)
    reward_head = objective.score_head
    lora = checks.lora_settings(config.model)
    needs_reference = objective.uses_reference(config.loss) and lora is None  # LoRA: the base is the reference
    remote_reference = config.launcher == "ray" and config.ray.reference_workers > 0  # on Ray actors
    local_reference = needs_reference and not remote_reference

    @functools.cache
    def archive() -> dict:
        state = models.load_weights_file(
            config.model.archive, f"model.archive={config.model.archive}", "give the policy.pt of an earlier run"
        )
        if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
            raise utils.ConfigError(
                f"model.archive={config.model.archive} holds no 'state' dict of weights; give the policy.pt of an earlier run."
            )
        if state.get("lora") is not None or any(".lora_" in k for k in state["state"]):
            raise utils.ConfigError(
                f"model.archive={config.model.archive} holds only the LoRA adapters of a run with model.lora.r set, not a "
                "whole model; give the policy.pt of a full fine-tuning run, or train from that run's merged export "
                "(model.lora.export_merged=true: model.name_or_path=<its checkpoint>/hf/merged)."
            )
        return state

    def build_policy() -> torch.nn.Module:
        policy = models.load_model(config.model, tokenizer, utils.get_dtype(config.model.policy_dtype), config.seed, reward_head)
        if config.model.archive is None:
            return policy
        state = archive()
        into = "the policy and reference" if local_reference else "the policy"
        into = "the policy's base (LoRA: also the reference)" if lora is not None else into
        print(f"Loading {config.model.archive} (after {state.get('step_idx')} examples) into {into}.")
        if reward_head:  # a causal LM's weights under a score head: all but the heads must match
            missing, unexpected = policy.load_state_dict(state["state"], strict=False)
            body = [k for k in missing + unexpected if k.split(".")[0] not in ("score", "lm_head")]
            if body:
                raise utils.ConfigError(f"model.archive={config.model.archive} does not fit this model (e.g. {body[0]!r}).")
        else:
            load_archive(policy, state["state"], config.model.archive)
        check_archive_model(config, policy, tokenizer)  # the shapes fit: do the settings that are not shapes?
        return policy

    def build_reference() -> torch.nn.Module:
        reference = load_reference(config, tokenizer, apply_archive=False)
        if config.model.archive is not None:
            load_archive(reference, archive()["state"], config.model.archive)
        return reference

    if config.model.device_map is None and config.trainer == "BasicTrainer" and torch.cuda.device_count() > 1:
        config.model.device_map = "balanced"  # one process, the model split over the local GPUs
    if not distributed:
        policy = build_policy()
        reference = build_reference() if local_reference else None
    else:
        policy = models.rank0_model(build_policy, rank, reward_head)
        reference = models.rank0_model(build_reference, rank) if local_reference else None
    if lora is not None:  # after the archive: LoRA on top of its weights (rank 0's; the others' arrive when sharded)
        policy = models.apply_lora(policy, lora)
    return policy, reference


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
        """From now on the signals go to ``handler`` (the trainer's ``_request_stop``)."""
        for s in self.previous:
            signal.signal(s, handler)

    def __enter__(self) -> SetupStops:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._stop) for s in trainers.STOP_SIGNALS}
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


def main(
    config: DictConfig, run_dir: str | None = None, checkpoint_dir: str | None = None, attach=None, budget: dict | None = None
) -> tuple[str, int | None]:
    """Run one training job (one rank) in ``run_dir`` from ``checkpoint_dir``; returns (run folder, stop signal or None)."""
    tracking.reset_peak_memory()  # this job's own peak: a Hydra multirun runs every job in this process
    made: list[str] = []  # the run folder this job makes
    with SetupStops() as stops, contextlib.ExitStack() as held:
        try:
            return _main(config, run_dir, checkpoint_dir, attach, held, stops, made, budget)
        except StoppedDuringSetup as e:
            e.args = (stopped_during_setup(e, made[0] if made else None, config.resume),)
            raise
        except BaseException:
            if made:  # a fault before anything but setup's files was written: no folder is left behind
                remove_setup_only(made[0])
            raise


def remove_setup_only(run_dir: str) -> None:
    """Remove the run folder ``run_dir`` this job made if it holds only config.yaml, its lock and writers' leftovers."""
    if checkpoints.holds_only_setup(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)


def _main(config, run_dir, checkpoint_dir, attach, held: contextlib.ExitStack, stops: SetupStops, made: list[str], budget=None):
    """main()'s work; ``held`` keeps the folder's lock, ``stops`` guards setup, ``made`` gets the run folder made here."""
    global RUN_FOLDER
    config = effective_config(config, budget)
    resume_dir = config.resume
    RUN_FOLDER = run_dir or resume_dir
    owns_folder = run_dir is None  # no launcher made it (Ray makes and holds its own)
    resuming = checkpoint_dir is None and resume_dir is not None  # not Ray's own checkpoint copy
    if resuming:
        checkpoint_dir, note = checkpoints.checkpoint_to_resume(resume_dir)
        if note is not None and processes.says_once():
            print(f"Note: {note}")
    distributed = config.trainer != "BasicTrainer"
    answer_functions = _check_config(config)
    rank = _start_ranks(config) if distributed else 0
    if owns_folder and resume_dir is not None:  # one run at a time in a folder: rank 0 holds it, all ranks hear a refusal
        _hold_run_dir(resume_dir, rank, distributed, held)
    if resume_dir is not None:  # a missing, cut or changed file: one sentence before data and models load
        _check_resumed_files(resume_dir, checkpoint_dir if resuming else None, rank, distributed)
    utils.set_seed(config.seed)
    utils.set_threads(config.num_threads)
    utils.set_malloc_mmap_threshold(config.malloc_mmap_threshold_mib)

    tokenizer = models.load_tokenizer(config.model)
    train_examples, eval_examples = _load_splits(config, tokenizer, rank, answer_functions)
    fingerprint = {
        "train": checkpoints.examples_fingerprint(train_examples),
        "eval": checkpoints.examples_fingerprint(eval_examples),
    }
    resume_state, extended = _resume_state(config, checkpoint_dir, fingerprint, len(train_examples), rank)
    if rank == 0:
        print(checks.training_length(config, len(train_examples)))
    scorer = None  # online DPO's scorer, when it runs here (not on Ray actors): before the run folder, failing fast
    if not (config.launcher == "ray" and config.ray.reward_workers > 0) and config.online.enabled:
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        scorer = rewards.build_scorer(config, device=device)

    recorded = copy.deepcopy(config)  # config.yaml: what was asked, before load_models picks a device_map
    pin = None
    if owns_folder and resume_dir is None and config.model.archive is not None:  # the file it names now, not LATEST
        pin = checkpoints.archive_pin(config.model.archive) if rank == 0 else None
        config.model.archive = pin["path"] if pin is not None else checkpoints.local_path(config.model.archive)
    policy, reference = load_models(config, tokenizer, rank, distributed)  # a model that fails leaves no run folder
    run_dir = _run_folder(config, run_dir or resume_dir, recorded, rank, distributed, held, made, pin)
    RUN_FOLDER = run_dir
    _describe_run(config, run_dir, policy, len(train_examples), len(eval_examples), rank)

    logger = tracking.MetricsLogger(run_dir, config, resume_id=resume_state and resume_state["wandb_id"], enabled=rank == 0)
    trainer_cls = trainers.trainer_class(config)  # online DPO's trainer when online.enabled (online/)
    precompute, cache_path, reference_cache = _reference_cache(
        config, policy, reference, train_examples + eval_examples, tokenizer, distributed, rank
    )
    if reference_cache is not None:
        reference = None  # an earlier run's log-probs: the reference is not needed
    made_here = {"reference_cache": reference_cache, "data_fingerprint": fingerprint}  # the fingerprint: for resume
    if config.online.enabled:
        made_here["scorer"] = scorer  # online DPO's trainer labels its pairs with it (None: Ray's actors, attached)
    trainer = trainer_cls(policy, config, run_dir, tokenizer, train_examples, eval_examples, reference, logger, **made_here)
    if precompute and reference_cache is None:  # one pass, sharded like training (each rank its share), then freed
        trainer.reference_cache = trainer.precompute_reference(train_examples + eval_examples, cache_path)
        trainer.reference_model = reference = None
    if attach is not None:
        attach(trainer)
    if checkpoint_dir is not None:
        trainer.load(checkpoint_dir)
        if rank == 0:
            print(f"Resuming after {trainer.example_counter} examples.")
        scheduled_lr(trainer)
        if extended is not None:
            apply_extension(trainer, config, extended, checkpoint_dir, rank)
    stops.hand_over(trainer._request_stop)  # no moment without a handler: the loop installs the same one
    stop_signal = trainer.train()
    _finish(config, run_dir, stop_signal, rank, distributed, owns_folder)
    if rank == 0 and stop_signal is None and launch.STAGE_ENV not in os.environ:  # launch.run_stages sums up both stages itself
        for line in launch.stage_summary(None, run_dir):
            print(line)
    return run_dir, stop_signal


def _check_config(config: DictConfig) -> list:
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


def _start_ranks(config: DictConfig) -> int:
    """Join the FSDP/TP process group and check that every rank runs the same config and code; returns this rank."""
    rank = utils.init_distributed(config.dist_timeout_minutes)
    checks.check_same_run(config, AUTO_RESUMED)  # every rank: the same config and code as rank 0, before any model loads
    checks.check_shared_output_root(config.output_root, rank)
    if rank != 0:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # one set of loading bars, not one per rank
    return rank


def _hold_run_dir(resume_dir: str, rank: int, distributed: bool, held: contextlib.ExitStack) -> None:
    """Lock ``resume_dir`` on rank 0 into ``held``; every rank raises utils.ConfigError when a live run holds it."""
    refusal = None
    if rank == 0:
        try:
            held.enter_context(checkpoints.lock_run_dir(resume_dir))
        except utils.ConfigError as e:
            refusal = str(e)
    if distributed:
        refusal = utils.broadcast_object(refusal)
    if refusal is not None:
        raise utils.ConfigError(refusal)


def _check_resumed_files(resume_dir: str, checkpoint_dir: str | None, rank: int, distributed: bool) -> None:
    """Rank 0 checks ``checkpoint_dir``'s files against its manifest and the run's model.archive against its pin;
    every rank raises utils.ConfigError with what it found."""
    refusal = None
    if rank == 0:  # hashing is reading every byte: once, not once per rank
        try:
            if checkpoint_dir is not None:  # (after the lock: a live run's checkpoint is its own business)
                checkpoints.check_checkpoint(checkpoint_dir)
            checkpoints.check_archive_pin(
                resume_dir,
                "restore that file to resume this run against the reference it trained with, or start a new run to "
                "train against the file there now",
            )
        except utils.ConfigError as e:
            refusal = str(e)
    if distributed:
        refusal = utils.broadcast_object(refusal)
    if refusal is not None:
        raise utils.ConfigError(refusal)


def _load_splits(config: DictConfig, tokenizer, rank: int, answer_functions: list) -> tuple[list[dict], list[dict]]:
    """The train and eval examples, checked, rendered through the chat template and screened for length."""
    sft_mode = losses.get_objective(config.loss.name).sft_data
    online_run = config.online.enabled
    options = OmegaConf.to_container(config.data, resolve=True)
    load = preference_datasets.load_prompt_examples if online_run else functools.partial(load_examples, sft_mode=sft_mode)
    train_examples = load(list(config.datasets), "train", options, silent=rank != 0)
    eval_examples = load(list(config.datasets), "test", options, silent=rank != 0)
    overlap = preference_datasets.split_overlap_warning(train_examples, eval_examples)
    if overlap is not None and rank == 0:
        print(overlap)
    preference_datasets.check_pairing(train_examples + eval_examples, losses.get_objective(config.loss.name))  # unpaired rows
    all_turns = sft_mode and bool(config.loss.get("all_assistant_turns", False))
    train_examples, eval_examples = (  # conversations through the chat template (plain text unchanged)
        chat.render_conversations(
            examples,
            tokenizer,
            config.max_length,
            config.max_prompt_length,
            rank != 0,
            split=split,
            all_assistant_turns=all_turns,
        )
        for examples, split in ((train_examples, "train"), (eval_examples, "test"))
    )
    train_examples, eval_examples = screening.screen_splits(
        train_examples, eval_examples, tokenizer, config.max_length, config.max_prompt_length, silent=rank != 0
    )
    note = checks.check_eval_size(config, len(eval_examples))
    if note is not None and rank == 0:
        print(f"Note: {note}")
    if answer_functions or (online_run and config.online.scorer == "reward_function"):  # a column they cannot take: now
        rewards.field_columns([ex.get("fields") for ex in train_examples + eval_examples])
    return train_examples, eval_examples


def _resume_state(
    config: DictConfig, checkpoint_dir: str | None, fingerprint: dict, n_train: int, rank: int
) -> tuple[dict | None, dict | None]:
    """The checkpoint's trainer_state.pt, checked against this data's ``fingerprint``, and the run's :func:`extension`."""
    resume_state = None
    if checkpoint_dir is not None:  # before any model loads: is this the data the checkpoint was trained on?
        resume_state = trainers.BasicTrainer.read(checkpoint_dir, "trainer_state.pt")
        problem = checkpoints.data_change(resume_state.get("data"), fingerprint, checkpoint_dir, auto=AUTO_RESUMED)
        if problem is not None:
            raise DataError(problem)
        if resume_state.get("data") is None and rank == 0:
            print(f"Note: {checkpoint_dir} predates data fingerprints, so resume cannot check that the data is unchanged.")
    extended = None
    if config.resume is not None and resume_state is not None:  # a new n_examples / n_epochs: checked before models load
        extended = extension(config, config.resume, resume_state["example_counter"], n_train)
    return resume_state, extended


def _run_folder(
    config: DictConfig,
    run_dir: str | None,
    recorded: DictConfig,
    rank: int,
    distributed: bool,
    held: contextlib.ExitStack,
    made: list[str],
    pin: dict | None = None,
) -> str:
    """``run_dir``, or a new run folder made by rank 0 (locked into ``held``, appended to ``made``, with the archive's
    ``pin``), as every rank sees it."""
    if run_dir is None and rank == 0:
        command = None if COMMAND is None else utils.command_text(COMMAND)
        run_dir, lock = checkpoints.new_run_dir(config.output_root, config.exp_name, recorded, command, pin)
        made.append(run_dir)
        held.enter_context(lock)  # taken before config.yaml was written
    if distributed:
        run_dir = utils.broadcast_object(run_dir)
    return run_dir


def _describe_run(config: DictConfig, run_dir: str, policy, n_train: int, n_eval_examples: int, rank: int) -> None:
    """On rank 0: name the run folder (also to the launcher) and say the model's size in parameters and the examples used."""
    if rank != 0:
        return
    print(f"Run folder: {run_dir}")
    launch.tell_launcher(run_dir)
    n_params = sum(p.numel() for p in policy.parameters())
    n_eval = checks.n_eval_used(config, n_eval_examples)
    trainable = ""
    if models.is_lora_model(policy):
        n_lora = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        trainable = f" ({n_lora / 1e6:.3f}M trainable: LoRA r={config.model.lora.r}; the reference is the base)"
    model = "Reward model" if losses.get_objective(config.loss.name).score_head else "Policy"
    print(f"{model}: {n_params / 1e6:.2f}M parameters{trainable}; {n_train} train / {n_eval} eval examples.")


def _reference_cache(
    config: DictConfig, policy, reference, examples: list[dict], tokenizer, distributed: bool, rank: int
) -> tuple[bool, str | None, dict | None]:
    """(whether reference log-probs are precomputed, their cache file, an earlier run's log-probs or None)."""
    lora_reference = models.is_lora_model(policy) and losses.get_objective(config.loss.name).uses_reference(config.loss)
    precompute = (reference is not None or lora_reference) and config.precompute_ref_log_probs
    if not precompute:
        return precompute, None, None
    source = policy if lora_reference else reference  # LoRA: the policy's base (models.base_state_dict names its weights)
    return (precompute, *reference_cache.cached_reference(source, examples, tokenizer, config, distributed, rank))


def _finish(config: DictConfig, run_dir: str, stop_signal: int | None, rank: int, distributed: bool, owns_folder: bool) -> None:
    """Leave the process group, and push a finished run's export when ``hub.push`` asks and no launcher owns the folder."""
    if distributed:
        import torch.distributed as dist

        dist.destroy_process_group()
    push = owns_folder and config.hub.push  # a launcher's run (Ray) is pushed by that launcher
    if stop_signal is None and rank == 0 and push:  # the run is FINISHED before the push
        print(modelcard.push_final(run_dir, config))


RUN_FOLDER: str | None = None  # this process's run folder once main knows it, named when another rank dies
COMMAND: list[str] | None = None  # the overrides train.py was started with (hydra_main), atop a new run's config.yaml


@hydra.main(version_base="1.3", config_path="config", config_name="config")
def hydra_main(config: DictConfig) -> dict | None:
    """The command line (:func:`run_command`); a sweep job returns its :func:`sweeps.job_result`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return run_command(config)
    from runs import sweeps

    global RUN_FOLDER
    RUN_FOLDER = launch.RUN_FOLDER_TOLD = None  # the basic launcher runs every job in this process
    submitit = launch.submitit_job()
    if submitit:  # submitit's USR2 before its time limit, outside the trainer's handlers: SIGTERM, not submitit's
        signal.signal(signal.SIGUSR2, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
    try:
        run_command(config)
        code = 0
    except SystemExit as e:  # sft_first, FSDP/TP and Ray runs end with sys.exit, 0 included
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if code != 0 and not submitit:
            raise
    return sweeps.job_result(launch.RUN_FOLDER_TOLD or RUN_FOLDER, code, launch.job_failure(code) if code else None)


def run_command(config: DictConfig) -> None:
    """The command line: compose, launch, run; exit 2 (config/data), 1 (step, checkpoint, disk), 128+signal, or PEER_LOST_EXIT."""
    global COMMAND
    rank = int(os.environ.get("RANK", 0))
    try:
        from hydra.core.hydra_config import HydraConfig

        COMMAND = overrides = list(HydraConfig.get().overrides.task)
        given = checks.given_keys(overrides)
        checks.settle_given(config, given)  # the command line's n_epochs over a preset's n_examples
        if launch.sft_stage_wanted(config, given):
            checks.validate_config(config)  # a bad value is said once, before either stage starts
            declared = preference_datasets.declared_reward_functions(config.datasets)
            reward_functions.eval_functions(config.eval_reward_functions, declared)
            options = OmegaConf.to_container(config.data, resolve=True)
            for split in ("train", "test"):  # a bad data file is said before the first stage's banner, not inside it
                load_examples(list(config.datasets), split, options, sft_mode=True, silent=True)
            sys.exit(launch.run_stages(config, overrides))
        budget = budget_given(config, given)  # resume=<run> n_examples=<more>: the run is extended
        if config.resume not in (None, "auto"):
            problem = resume_override_error(config, given)
            if problem is not None:
                raise utils.ConfigError(problem)
        config = effective_config(config, budget)  # resume=auto resolved (a fresh run keeps the overrides)
        if config.launcher == "ray":
            from parallel import ray_launcher
            from train import main as rank_main  # this module by its name (not __main__), for Ray to send

            sys.exit(ray_launcher.launch(config, functools.partial(rank_main, budget=budget)))
        code = launch.launch(config)
        if code is not None:
            sys.exit(code)
        _, stop_signal = main(config, budget=budget)
    except (utils.ConfigError, DataError) as e:
        processes.say_once_per_node(e, rank)
        sys.exit(2)
    except (
        trainers.NonFiniteLossError,
        trainers.RunStoppedError,
        checkpoints.CheckpointError,
        utils.DiskFullError,
        modelcard.PushError,
    ) as e:
        processes.say_once_per_node(e, rank)  # finished work is kept
        sys.exit(1)  # a rank leaves without interpreter teardown (exit_rank)
    except StoppedDuringSetup as e:  # a stop during setup: nothing trained, nothing half-made left
        if rank == 0:
            print(f"\n{e}", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)
    except KeyboardInterrupt:
        if rank == 0:
            print("\nStopped by a second interrupt before the checkpoint was complete.", file=sys.stderr)
        sys.exit(130)
    except Exception as e:  # a rank that lost another rank, or a full disk a writer did not name: one line
        reason = processes.lost_peer(e) if "RANK" in os.environ else None
        if reason is not None:  # its collective failed because another rank died: not gloo's traceback
            line = f"rank {rank}: another rank stopped answering ({reason}); stopping"
            if "TORCHELASTIC_RUN_ID" in os.environ:  # train.py's launcher names the rank and the folder itself
                line += f"; {processes.how_to_continue(RUN_FOLDER, 'torchrun <the same options> train.py')}"
            print(f"\n{line}.", file=sys.stderr, flush=True)  # below the progress bar, not glued to it
            sys.exit(processes.PEER_LOST_EXIT)
        path = getattr(e, "filename", None) or config.output_root
        if not utils.disk_full(e, path):
            raise
        processes.say_once_per_node(
            f"Could not write {path}: {utils.no_space(path)}; free space on that disk and try again.", rank
        )
        sys.exit(1)
    if stop_signal is not None:
        sys.exit(128 + stop_signal)  # 130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1, as a shell reports them


if __name__ == "__main__":
    # a job of Hydra's submitit launcher imports this folder's modules (utils, ...) to unpickle hydra_main
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    if processes.die_with_launcher() != "train.py":  # not a rank or stage train.py started (it checked the command line)
        problem = checks.command_line_error(sys.argv[1:])
        if problem is not None:
            if int(os.environ.get("LOCAL_RANK", 0)) == 0:  # once per node under torchrun
                print(f"Error: {problem}", file=sys.stderr, flush=True)
            else:
                time.sleep(1)  # let the node's first process say it before torchrun stops the group
            sys.exit(2)
    if "RANK" not in os.environ:
        hydra_main()
    else:
        processes.exit_rank(hydra_main)
