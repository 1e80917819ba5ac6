"""FSDP2 (PyTorch's fully_shard): each transformer block its own unit."""

from __future__ import annotations

import logging

import torch

import utils


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
