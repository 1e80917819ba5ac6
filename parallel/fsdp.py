"""FSDP2 (PyTorch's fully_shard): each transformer block its own unit."""

from __future__ import annotations

import signal

import torch

import utils

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2") if hasattr(signal, name))
"""The signals on which :meth:`BasicTrainer.train` saves a checkpoint and stops (SIGUSR1, SIGUSR2: SLURM's
``--signal=USR1@<seconds>``, submitit's USR2; absent on Windows); train.py then exits with 128 + the signal."""


def find_block_classes(model: torch.nn.Module, block_name: str | None) -> set[type]:
    """The transformer-block classes of ``model``: ``block_name`` if given, else its ``_no_split_modules``;
    utils.ConfigError if no module has that class name."""
    own = set(getattr(model, "_no_split_modules", None) or [])
    names = {block_name} if block_name else own
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        present = sorted({type(m).__name__ for m in model.modules()} & own)
        hint = (
            f"its blocks are {present}: set model.block_name={present[0]} or model.block_name=null"
            if present
            else "set model.block_name to the class name of its decoder layer"
        )
        raise utils.ConfigError(f"model.block_name={block_name} is not a module of {type(model).__name__}; {hint}.")
    return classes


def fully_shard_blocks(model: torch.nn.Module, blocks: set[type], **kwargs) -> None:
    """FSDP2: ``fully_shard`` every module of ``model`` whose class is in ``blocks``, then the root
    (``kwargs``: ``mesh``, ``mp_policy``)."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module) in blocks:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
