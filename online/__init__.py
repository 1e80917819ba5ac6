"""Online DPO (Guo et al. 2024): a trainer that samples, labels and trains on its own pairs (trainer.py), registered with
trainers.py on import (train.py imports this package once); make_pairs.py writes such pairs to a file instead."""

from __future__ import annotations

import trainers
from online.trainer import JudgeFailureError, OnlineSampling, online_trainer

trainers.TRAINER_EXTENSIONS.append(online_trainer)

__all__ = ["JudgeFailureError", "OnlineSampling", "online_trainer"]
