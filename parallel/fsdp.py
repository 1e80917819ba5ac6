"""FSDP2 (PyTorch's fully_shard): each transformer block its own unit."""

from __future__ import annotations

import logging

import torch

import utils


def find_block_classes(model: torch.nn.Module, block_name) -> set[type]:
    """The transformer-block classes of ``model``: ``block_name`` (a class name or a list of them, e.g. an image model's
    language and vision blocks) if given, else the ``_no_split_modules`` of it and of its sub-models (an image model's
    vision tower and language model each name their own); utils.ConfigError if no module has such a class name."""
    own = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}
    names = ({block_name} if isinstance(block_name, str) else set(block_name)) if block_name else own
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(names - present) if block_name else []
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if missing or not classes:
        blocks = sorted(present & own)
        hint = (
            f"its blocks are {blocks}: set model.block_name={blocks[0]} or model.block_name=null"
            if blocks
            else "set model.block_name to the class name of its decoder layer"
        )
        shown = block_name if isinstance(block_name, str) or block_name is None else ",".join(missing)
        raise utils.ConfigError(f"model.block_name={shown} is not a module of {type(model).__name__}; {hint}.")
    return classes


def fully_shard_blocks(model: torch.nn.Module, blocks: set[type], **kwargs) -> None:
    """FSDP2: ``fully_shard`` every module of ``model`` whose class is in ``blocks``, then the root
    (``kwargs``: ``mesh``, ``mp_policy``)."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if type(module) in blocks:
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)


def shard_models(trainer) -> None:
    """FSDP2 of ``trainer``'s policy and reference over its mesh's ``dp`` dimension, each transformer block
    (``model.block_name``, or ``_no_split_modules``) and the root a unit; with ``tensor_parallel_size`` > 1 (2-D) each
    model first gets its tensor-parallel plan within each ``tp`` group. Weights are sent from rank 0."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from parallel.dist import shard_from_rank0
    from parallel.tensor_parallel import tensor_parallel_plan

    config, mesh, tp_size = trainer.config, trainer.dist.mesh, trainer.dist.tp_size
    kwargs = {"mesh": trainer.dist.shard_mesh}  # the data-parallel ranks (sequence parallelism: all ranks)
    if config.model.fsdp_policy_mp:
        dtype = utils.get_dtype(config.model.fsdp_policy_mp)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)  # float32 reduction
    if tp_size > 1:  # DTensor's hint that 2-D norms and full-state gathers take two collectives: known, rare
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for model in (trainer.policy, trainer.reference_model):
        if model is None:
            continue
        blocks = find_block_classes(model, config.model.block_name)
        plan = tensor_parallel_plan(model, tp_size) if tp_size > 1 else None

        def shard(model, blocks=blocks, plan=plan):
            if plan is not None:  # 2-D: tensor parallel within each group of tp_size ranks, then FSDP across groups
                from torch.distributed.tensor.parallel import parallelize_module

                parallelize_module(model, mesh["tp"], plan)
            fully_shard_blocks(model, blocks, **kwargs)

        shard_from_rank0(model, shard, trainer.dist.rank, trainer.device)
