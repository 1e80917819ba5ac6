"""The run a batch script starts next for ``python train.py <overrides>`` when each run is one torchrun launch.

usage: python scripts/next_stage.py resume=auto <train.py overrides...>

torchrun starts every rank as one run, so ``sft_first``'s two stages (model=tiny's default: SFT, then this run
from its policy) are two launches, and a requeued job must find which one to continue. Prints ``<k>/<n>`` and
the overrides of that run, each followed by a NUL byte (``mapfile -d ''`` reads them):

- one stage (``sft_first.n_examples=null``, ``model.archive=``, ``resume=<run>``, ...): ``1/1`` and the overrides;
- else, when the newest SFT run of these overrides (``<exp_name>_sft``, the same config) under ``output_root`` is
  finished: ``2/2`` and this run's overrides with ``model.archive=<that run>/LATEST/policy.pt``;
- else ``1/2`` and the SFT stage's (``resume=auto`` continues an unfinished one, or starts it).

scripts/slurm_dpo.sbatch runs what it prints, then asks again. Exit status 2 and one sentence for a mistake.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


RUN_NODES_OVERRIDES = ["trainer=FSDPTrainer"]  # what scripts/run_nodes.sh puts before the overrides it is given


def compose_config(overrides: list[str]):
    """``config/config.yaml`` with ``overrides``, as train.py's command line composes it (the given keys settled)."""
    from hydra import compose, initialize_config_dir

    from runs import checks

    with initialize_config_dir(config_dir=os.path.join(REPO, "config"), version_base="1.3"):
        config = compose(config_name="config", overrides=overrides)
    checks.settle_given(config, checks.given_keys(overrides))
    return config


def next_stage(overrides: list[str]) -> tuple[str, list[str]]:
    """(``k/n``, the overrides of the run to start next) for ``python train.py <overrides>`` (see the module)."""
    import train  # noqa: F401  (registers the plugins, as train.py's command line has them)
    from runs import checkpoints, checks, launch, setup

    given = checks.given_keys(overrides)
    config = compose_config(overrides)
    if config.resume not in (None, "auto") or (config.sft_first or {}).get("n_examples") is None:
        return "1/1", overrides
    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "resume"]  # each stage's own resume=auto
    config = compose_config(rest)
    if checks.sft_first_skip(config, given - {"resume"}) is not None:  # a preset's stage that cannot apply
        return "1/1", overrides
    sft, dpo = launch.stage_commands(config, rest)
    sft_config = compose_config([*RUN_NODES_OVERRIDES, *sft])  # the config the SFT launch's ranks saved
    found, _ = setup.auto_resume_run(sft_config, finished=True)  # the newest SFT run of this config
    if found is not None and os.path.exists(os.path.join(found, checkpoints.FINISHED)):
        return "2/2", ["resume=auto", *dpo, f"model.archive={os.path.join(found, 'LATEST', 'policy.pt')}"]
    return "1/2", ["resume=auto", *sft]


def main(argv: list[str]) -> int:
    from hydra.errors import HydraException

    import utils
    from utils import DataError

    try:
        stage, overrides = next_stage(argv)
    except (utils.ConfigError, DataError, HydraException) as e:
        print(f"Error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write("".join(f"{field}\0" for field in [stage, *overrides]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
