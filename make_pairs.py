"""``python make_pairs.py [key=value ...]``: offline preference pairs from a policy's samples, labelled by a judge.
The code is online/make_pairs.py; usage: docs/online.md."""

import hydra
from omegaconf import DictConfig

from online import make_pairs


@hydra.main(version_base="1.3", config_path="config", config_name="make_pairs")
def hydra_main(config: DictConfig) -> None:
    """The command line (config/make_pairs.yaml plus the overrides)."""
    make_pairs.command(config)


if __name__ == "__main__":
    hydra_main()
