"""How a training run ends: finished (the last eval and checkpoint, the report, ``FINISHED``), stopped by a signal
(a checkpoint and how to resume), already complete, or stopped by a loss that is not finite (one sentence)."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading

from runs import checkpoints, tracking

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
"""The signals on which :meth:`BasicTrainer.train` saves a checkpoint and stops (SIGUSR1, SIGUSR2: SLURM's
``--signal=USR1@<seconds>``, submitit's USR2; absent on Windows); train.py then exits with 128 + the signal."""


def non_finite_message(trainer, what: str) -> str:
    """The NonFiniteLossError's one sentence: the step, the last good checkpoint and what to change (train.py prints
    it as one ``Error:`` line)."""
    latest = os.path.join(trainer.run_dir, "LATEST")
    where = (
        f"the last good checkpoint is {os.path.realpath(latest)}"
        if os.path.exists(latest)
        else "no checkpoint was written yet"
        + (
            " and its run folder, holding only its config, is removed"  # by train.main, as any setup fault's
            if checkpoints.holds_only_setup(trainer.run_dir)
            else f" (its run folder {trainer.run_dir} holds only logs: delete it once read)"
        )
    )
    fix = "lower lr or max_grad_norm, or check the data"
    if trainer.config.model.policy_dtype == "float16":
        fix += ", or train with model.policy_dtype=bfloat16 (float16 weights overflow and underflow easily)"
    return (
        f"Training stopped: {what} at step {trainer.batch_counter + 1} (after {trainer.example_counter} examples), "
        f"before its optimizer step; nothing was saved and {where}: {fix}."
    )


def say_already_complete(trainer) -> None:
    """On rank 0: say the run has nothing left to train, writing ``FINISHED`` if it is missing."""
    if trainer.dist.is_main:
        print(f"Nothing to do: this run is complete ({trainer.example_counter}/{trainer.total_examples} examples).")
        if not os.path.exists(os.path.join(trainer.run_dir, checkpoints.FINISHED)):  # finished before FINISHED existed
            checkpoints.mark_finished(trainer.run_dir, trainer.example_counter)


def stop_with_checkpoint(trainer) -> int:
    """After a stop signal: checkpoint, report and say how to resume; returns the signal's number."""
    path = trainer.save()
    memory = tracking.log_peak_memory(trainer.dist, trainer.logger, trainer.setup_peak_rss_mib, trainer.example_counter)
    if trainer.dist.is_main and trainer.config.get("plot_curves", True):  # .get: a config saved before the key existed
        tracking.plot_curves(trainer.run_dir)
    if trainer.dist.is_main:
        print(f"Interrupted after {trainer.example_counter} examples; checkpoint saved to {path}.")
        tracking.say_peak_memory(memory)
        how = "the same torchrun command on every node, with" if "TORCHELASTIC_RUN_ID" in os.environ else "python train.py"
        print(f"Resume with: {how} resume={trainer.run_dir}")
    trainer.dist.wait_for_all()
    return trainer.stop_signal or signal.SIGTERM


def finish_run(trainer) -> None:
    """At the end of training: the last eval and checkpoint, the report, then ``FINISHED`` once every rank is done."""
    path = trainer.evaluate_and_save(final=True)
    memory = tracking.log_peak_memory(trainer.dist, trainer.logger, trainer.setup_peak_rss_mib, trainer.example_counter)
    if trainer.dist.is_main:
        written = tracking.plot_curves(trainer.run_dir) if trainer.config.get("plot_curves", True) else []
        export = ""
        if trainer.config.save_hf_export:
            failed = trainer.hf_export_failure
            export = f" (no Hugging Face export: {failed})" if failed else f" (Hugging Face export in {path}/hf)"
        print(f"Done: {trainer.example_counter} examples. Checkpoint: {path}{export}.")
        tracking.say_peak_memory(memory)
        if written:
            print(f"Training curves: {os.path.dirname(written[0])}/")
    trainer.dist.wait_for_all()
    if trainer.dist.is_main:  # every rank's part of the last checkpoint is written
        checkpoints.mark_finished(trainer.run_dir, trainer.example_counter)


def request_stop(trainer, signum, frame) -> None:
    """The handler of :data:`STOP_SIGNALS`: stop after this step with a checkpoint; a second SIGINT raises
    KeyboardInterrupt, another repeated signal is ignored."""
    if trainer.stop_requested:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        return  # schedulers deliver these more than once (scancel, then torchrun); keep the checkpoint under way
    print(f"\nReceived {signal.Signals(signum).name}: saving a checkpoint after this step, then stopping.")
    trainer.stop_requested = True
    trainer.stop_signal = signum


@contextlib.contextmanager
def stop_signals(trainer):
    """Within the block, :data:`STOP_SIGNALS` call :func:`request_stop` (in the main thread only: Ray Train runs the
    loop in a thread, where signals cannot be handled); the previous handlers come back after it."""
    main_thread = threading.current_thread() is threading.main_thread()
    handler = functools.partial(request_stop, trainer)
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS} if main_thread else {}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
