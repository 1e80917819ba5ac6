"""Online DPO (Guo et al. 2024): a trainer that samples, labels and trains on its own pairs (trainer.py), registered with
trainers.py on import (train.py imports this package once); make_pairs.py writes such pairs to a file instead."""

from __future__ import annotations

import trainers
from online.trainer import JudgeFailureError, OnlineSampling, online_trainer
from runs import checks

trainers.TRAINER_EXTENSIONS.append(online_trainer)
checks.RULES.append(  # a float or a negative count would fail (or drop rows) at the first eval, after training steps
    ("online.n_log_completions", lambda c: not checks.online_enabled(c) or (
        isinstance(c.online.n_log_completions, int) and not isinstance(c.online.n_log_completions, bool)
        and c.online.n_log_completions >= 0),
     "online.n_log_completions must be a whole number >= 0 (eval prompts in the completions table), got "
     "{c.online.n_log_completions!r}.")
)  # fmt: skip

__all__ = ["JudgeFailureError", "OnlineSampling", "online_trainer"]
