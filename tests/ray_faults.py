"""Faults the Ray tests inject into ``train.main`` on the Ray workers: one rank exits once, so Ray restarts the run.

Pass ``functools.partial(exit_before_first_save, marker)`` (or ``exit_after_first_report``) to
``ray_launcher.launch`` in place of ``train.main``; the workers import this module from tests/
(on the cluster's PYTHONPATH). The marker file makes the fault happen once: the restarted worker trains on.
"""

from __future__ import annotations

import os

import train


def _with_save_wrapped(wrap, config, *, attach, **kwargs):
    """``train.main`` with ``trainer.save`` replaced by ``wrap(trainer, save)`` after ray_launcher's own ``attach``."""

    def attach_and_wrap(trainer) -> None:
        attach(trainer)
        trainer.save = wrap(trainer, trainer.save)

    return train.main(config, attach=attach_and_wrap, **kwargs)


def exit_before_first_save(marker: str, config, **kwargs):
    """Rank 0 exits (status 1) as it is about to write its first checkpoint, so no checkpoint is reported."""

    def wrap(trainer, save):
        def save_or_exit() -> str:
            if trainer.dist.rank == 0 and not os.path.exists(marker):
                open(marker, "w").close()
                print(f"[test fault] rank 0 exits before its checkpoint of {trainer.example_counter} examples.", flush=True)
                os._exit(1)
            return save()

        return save_or_exit

    return _with_save_wrapped(wrap, config, **kwargs)


def exit_after_first_report(marker: str, config, **kwargs):
    """Rank 1 exits (status 1) right after the first checkpoint it reports, once Ray has committed it."""

    def wrap(trainer, save):
        def save_then_exit() -> str:
            import ray.train

            path = save()
            if trainer.dist.rank == 1 and not os.path.exists(marker):
                # a worker dying right after a report can beat its registration; the restart would begin from the one before
                ray.train.get_all_reported_checkpoints(ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=120)
                open(marker, "w").close()
                print(f"[test fault] rank 1 exits after the checkpoint of {trainer.example_counter} examples.", flush=True)
                os._exit(1)
            return path

        return save_then_exit

    return _with_save_wrapped(wrap, config, **kwargs)
