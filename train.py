"""Entry point: ``python train.py [key=value ...]`` (Hydra): check the config, load data and models, run ``config.trainer``."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import signal
import sys
import time

import hydra
import transformers
from omegaconf import DictConfig

import data  # noqa: F401  (registers the data formats and datasets beyond hh, shp and se)
import evaluation.in_training  # noqa: F401  (registers answers_eval and samples with each eval)
import export.hf  # noqa: F401  (registers the Hugging Face folder hf/ with each checkpoint)
import losses
import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)
import online  # noqa: F401  (registers online DPO's trainer)
import parallel.sequence_parallel  # noqa: F401  (registers sequence parallelism's trainer and config rules)
import trainers
import utils
import vision  # noqa: F401  (registers image-text-to-text models, image examples and the shapes dataset)
from data import splits
from export import modelcard
from modeling import loading, models
from runs import checkpoints, checks, ending, launch, processes, reference_cache, setup, tracking, trainer_checkpoint
from utils import DataError


@dataclasses.dataclass
class Command:
    """What the command line gave :func:`main`: its overrides (atop a new run's config.yaml), whether ``resume=auto``
    chose the run, and the run folder once main knows it (named when another rank dies)."""

    overrides: list[str] | None = None
    auto_resumed: bool = False
    run_folder: str | None = None


def main(
    config: DictConfig,
    run_dir: str | None = None,
    checkpoint_dir: str | None = None,
    attach=None,
    budget: dict | None = None,
    command: Command | None = None,
) -> tuple[str, int | None]:
    """Run one training job (one rank) in ``run_dir`` from ``checkpoint_dir``; returns (run folder, stop signal or None)."""
    tracking.reset_peak_memory()  # this job's own peak: a Hydra multirun runs every job in this process
    made: list[str] = []  # the run folder this job makes
    with setup.SetupStops() as stops, contextlib.ExitStack() as held:
        try:
            return _main(config, run_dir, checkpoint_dir, attach, held, stops, made, budget, command or Command())
        except setup.StoppedDuringSetup as e:
            e.args = (setup.stopped_during_setup(e, made[0] if made else None, config.resume),)
            raise
        except BaseException:
            if made:  # a fault before anything but setup's files was written: no folder is left behind
                setup.remove_setup_only(made[0])
            raise


def _main(config, run_dir, checkpoint_dir, attach, held, stops, made: list[str], budget, command: Command):
    """main()'s work; ``held`` keeps the folder's lock, ``stops`` guards setup, ``made`` gets the run folder made here."""
    config = setup.effective_config(config, budget)
    resume_dir = config.resume
    command.run_folder = run_dir or resume_dir
    owns_folder = run_dir is None  # no launcher made it (Ray makes and holds its own)
    resuming = checkpoint_dir is None and resume_dir is not None  # not Ray's own checkpoint copy
    if resuming:
        checkpoint_dir, note = checkpoints.checkpoint_to_resume(resume_dir)
        if note is not None and processes.says_once():
            print(f"Note: {note}")
    distributed = config.trainer != "BasicTrainer"
    answer_functions = setup.check_config(config)
    rank = setup.start_ranks(config, command.auto_resumed) if distributed else 0
    if owns_folder and resume_dir is not None:  # one run at a time in a folder: rank 0 holds it, all ranks hear a refusal
        setup.hold_run_dir(resume_dir, rank, distributed, held)
    if resume_dir is not None:  # a missing, cut or changed file: one sentence before data and models load
        setup.check_resumed_files(resume_dir, checkpoint_dir if resuming else None, rank, distributed)
    utils.set_seed(config.seed)
    utils.set_threads(config.num_threads)
    utils.set_malloc_mmap_threshold(config.malloc_mmap_threshold_mib)
    if not config.progress_bar and transformers.utils.logging.is_progress_bar_enabled():  # Hugging Face's bars too
        transformers.utils.logging.disable_progress_bar()  # ("Writing model shards" at each checkpoint), for this run
        held.callback(transformers.utils.logging.enable_progress_bar)

    trainer, extended = _trainer(config, run_dir, checkpoint_dir, rank, distributed, held, made, command, answer_functions)
    run_dir = trainer.run_dir
    if attach is not None:
        attach(trainer)
    if checkpoint_dir is not None:
        trainer_checkpoint.load(trainer, checkpoint_dir)
        if rank == 0:
            print(f"Resuming after {trainer.example_counter} examples.")
        setup.scheduled_lr(trainer)
        if extended is not None:
            setup.apply_extension(trainer, config, extended, checkpoint_dir, rank)
    stops.hand_over(
        functools.partial(ending.request_stop, trainer)
    )  # no moment without a handler: the loop installs the same one
    stop_signal = trainer.train()
    setup.finish(config, run_dir, stop_signal, rank, distributed, owns_folder)
    if rank == 0 and stop_signal is None and launch.STAGE_ENV not in os.environ:  # launch.run_stages sums up both stages itself
        for line in launch.stage_summary(None, run_dir):
            print(line)
    return run_dir, stop_signal


def _trainer(config, run_dir, checkpoint_dir, rank, distributed, held, made, command, answer_functions):
    """The data, the models, the run folder and ``config.trainer`` built on them; returns (trainer, the run's extension)."""
    tokenizer = models.load_tokenizer(config.model)
    train_examples, eval_examples = splits.load_splits(config, tokenizer, rank, answer_functions)
    fingerprint = {
        "train": checkpoints.examples_fingerprint(train_examples),
        "eval": checkpoints.examples_fingerprint(eval_examples),
    }
    resume_state, extended = setup.resume_state(
        config, checkpoint_dir, fingerprint, len(train_examples), rank, command.auto_resumed
    )
    if rank == 0:
        print(checks.training_length(config, len(train_examples)))
        note = checks.micro_batch_note(config)
        if note is not None:
            print(note)
    trainer_cls = trainers.trainer_class(config)  # online DPO's trainer when online.enabled (online/)
    if rank == 0 and trainer_cls.__name__ != config.trainer:
        print(f"Trainer: {trainer_cls.__name__} (trainer={config.trainer}, as the plugins extend it).")
    made_here = trainer_cls.made_before_models(config)  # online DPO's scorer: before the run folder, failing fast

    recorded = copy.deepcopy(config)  # config.yaml: what was asked, before load_models picks a device_map
    pin = None
    if run_dir is None and config.resume is None and config.model.archive is not None:  # the file it names now, not LATEST
        pin = checkpoints.archive_pin(config.model.archive) if rank == 0 else None
        config.model.archive = pin["path"] if pin is not None else checkpoints.local_path(config.model.archive)
    policy, reference = loading.load_models(config, tokenizer, rank, distributed)  # a model that fails leaves no run folder
    run_dir = setup.run_folder(config, run_dir or config.resume, recorded, rank, distributed, held, made, pin, command.overrides)
    command.run_folder = run_dir
    _describe_run(config, run_dir, policy, len(train_examples), len(eval_examples), rank)

    logger = tracking.MetricsLogger(run_dir, config, resume_id=resume_state and resume_state["wandb_id"], enabled=rank == 0)
    examples = train_examples + eval_examples
    precompute, cache_path, cache = reference_cache.reference_inputs(
        config, policy, reference, examples, tokenizer, distributed, rank
    )
    if cache is not None:
        reference = None  # an earlier run's log-probs: the reference is not needed
    trainer = trainer_cls(
        policy, config, run_dir, tokenizer, train_examples, eval_examples, reference, logger,
        reference_cache=cache, data_fingerprint=fingerprint, **made_here,
    )  # fmt: skip
    if precompute and cache is None:  # one pass, sharded like training (each rank its share), then freed
        trainer.reference_cache = reference_cache.precompute_reference(trainer, examples, cache_path)
        trainer.reference_model = None
    return trainer, extended


def _describe_run(config: DictConfig, run_dir: str, policy, n_train: int, n_eval_examples: int, rank: int) -> None:
    """On rank 0: name the run folder (also to the launcher) and say the model's size in parameters and the examples used."""
    if rank != 0:
        return
    print(f"Run folder: {run_dir}")
    launch.tell_launcher(run_dir)
    n_params = sum(p.numel() for p in policy.parameters())
    n_eval = splits.n_eval_used(config, n_eval_examples)
    trainable = ""
    if models.is_lora_model(policy):
        n_lora = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        trainable = f" ({n_lora / 1e6:.3f}M trainable: LoRA r={config.model.lora.r}; the reference is the base)"
    model = "Reward model" if losses.get_objective(config.loss.name).score_head else "Policy"
    print(f"{model}: {n_params / 1e6:.2f}M parameters{trainable}; {n_train} train / {n_eval} eval examples.")


@hydra.main(version_base="1.3", config_path="config", config_name="config")
def hydra_main(config: DictConfig) -> dict | None:
    """The command line (:func:`run_command`); a sweep job returns its :func:`sweeps.job_result`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return run_command(config, Command())
    from runs import sweeps

    command = Command()
    launch.RUN_FOLDER_TOLD = None  # the basic launcher runs every job in this process
    submitit = launch.submitit_job()
    if submitit:  # submitit's USR2 before its time limit, outside the trainer's handlers: SIGTERM, not submitit's
        signal.signal(signal.SIGUSR2, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))
    try:
        run_command(config, command)
        code = 0
    except SystemExit as e:  # sft_first, FSDP/TP and Ray runs end with sys.exit, 0 included
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if code != 0 and not submitit:
            raise
    return sweeps.job_result(launch.RUN_FOLDER_TOLD or command.run_folder, code, launch.job_failure(code) if code else None)


def run_command(config: DictConfig, command: Command) -> None:
    """The command line: compose, launch, run; exit 2 (config/data), 1 (step, checkpoint, disk), 128+signal, or PEER_LOST_EXIT."""
    rank = int(os.environ.get("RANK", 0))
    try:
        stop_signal = _launch(config, command)
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
    except setup.StoppedDuringSetup as e:  # a stop during setup: nothing trained, nothing half-made left
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
                line += f"; {processes.how_to_continue(command.run_folder, 'torchrun <the same options> train.py')}"
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


def _launch(config: DictConfig, command: Command) -> int | None:
    """The command line's run: ``sft_first``'s two stages, a Ray or torchrun launch (each exits), or :func:`main` in this
    process; returns its stop signal or None."""
    from hydra.core.hydra_config import HydraConfig

    command.overrides = list(HydraConfig.get().overrides.task)
    given = checks.given_keys(command.overrides)
    checks.settle_given(config, given)  # the command line's n_epochs over a preset's n_examples
    if launch.sft_stage_wanted(config, given):
        setup.check_stages(config, launch.process_count(config))  # said once, before the first stage's banner
        sys.exit(launch.run_stages(config, command.overrides))
    budget = setup.budget_given(config, given)  # resume=<run> n_examples=<more>: the run is extended
    if config.resume not in (None, "auto"):
        problem = setup.resume_override_error(config, given)
        if problem is not None:
            raise utils.ConfigError(problem)
    command.auto_resumed = config.resume == "auto"
    config = setup.effective_config(config, budget)  # resume=auto resolved (a fresh run keeps the overrides)
    if config.launcher == "ray":
        from parallel import ray_launcher
        from train import main as rank_main  # this module by its name (not __main__), for Ray to send

        sys.exit(ray_launcher.launch(config, functools.partial(rank_main, budget=budget)))
    code = launch.launch(config)
    if code is not None:
        sys.exit(code)
    return main(config, budget=budget, command=command)[1]


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
