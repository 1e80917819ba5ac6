"""The docs' example of adding a trainer runs as written: a file that registers with trainers.TRAINER_EXTENSIONS."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import TINY, compose_config
from omegaconf import OmegaConf

import trainers
import utils
from data.loading import load_examples
from modeling import models

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_docs_add_a_trainer_example_works_as_written(tmp_path):
    # docs/distributed.md's loss truncation with drop_hardest=0.5 on a batch of 2 pairs: the loss is the easier pair's
    # loss alone over 2 pairs, min(l_0, l_1) / 2, and only that pair's metrics are logged.
    code = re.search(r"```python\n(# my_trainer.py\n.*?)```", (DOCS / "distributed.md").read_text(), re.S).group(1)
    namespace: dict = {}
    exec(code, namespace)
    try:
        config = compose_config([*TINY, f"output_root={tmp_path}", "+drop_hardest=0.5", "sample_during_eval=false"])
        OmegaConf.resolve(config)
        cls = trainers.trainer_class(config)
        assert cls.__name__ == "DropHardestBasicTrainer" and issubclass(cls, trainers.BasicTrainer)
        tokenizer = models.load_tokenizer(config.model)
        examples = load_examples(list(config.datasets), "train", OmegaConf.to_container(config.data), False, silent=True)
        policy = models.load_model(config.model, tokenizer, torch.float32, config.seed)
        reference = models.load_model(config.model, tokenizer, torch.float32, config.seed + 1)  # another: losses differ
        trainer = cls(policy, config, str(tmp_path), tokenizer, examples, examples[:4], reference)
        batch = next(iter(trainers.get_batch_iterator(examples, tokenizer, 2, 64, 32, seed=0, n_examples=2)))
        trainer.policy.train()  # as in training; an eval (below) counts every pair
        with torch.no_grad():
            alone = [trainer.get_batch_metrics(pair, 1, 1.0, "train")[0] for pair in trainers.split_batch(batch, 2)]
            both, metrics = trainer.get_batch_metrics(batch, 2, 1.0, "train")
        assert alone[0] != alone[1]
        torch.testing.assert_close(both, min(alone) / 2)
        assert len(metrics["rewards_train/accuracies"]) == 1
        trainer.policy.eval()
        with torch.no_grad():
            evaluated, metrics = trainer.get_batch_metrics(batch, 2, 1.0, "eval")
        torch.testing.assert_close(evaluated, sum(alone) / 2)  # both pairs: the plain loss
        assert len(metrics["rewards_eval/accuracies"]) == 2
        for share in ("abc", 1.5):  # a wrong value of the plugin's own key: one sentence before any model loads
            bad = compose_config([*TINY, f"output_root={tmp_path}", f"+drop_hardest={share}"])
            with pytest.raises(utils.ConfigError, match=r"drop_hardest must be a share in \[0, 1\), got"):
                trainers.trainer_class(bad)
    finally:
        trainers.TRAINER_EXTENSIONS.remove(namespace["drop_hardest"])
    assert trainers.trainer_class(config) is trainers.BasicTrainer  # unregistered: the plain trainer again
