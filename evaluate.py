"""``python evaluate.py [key=value ...]``: win rates as the DPO paper measured them (Rafailov et al. 2023, Figs. 2-3).
The code is evaluation/evaluate.py; usage and outputs: docs/win-rates.md."""

import hydra
from omegaconf import DictConfig

from evaluation import evaluate


@hydra.main(version_base="1.3", config_path="config", config_name="evaluate")
def hydra_main(config: DictConfig) -> None:
    """The command line (config/evaluate.yaml plus the overrides)."""
    evaluate.command(config)


if __name__ == "__main__":
    evaluate.cli(hydra_main)
