"""Tensor parallelism (DTensor): the plan for a model's blocks, and GPT-2's Conv1D layers as Linear and back."""

from __future__ import annotations

import torch

from modeling.models import check_tensor_parallel


def tensor_parallel_plan(model: torch.nn.Module, world_size: int) -> dict:
    """Megatron-LM's plan for every block (Shoeybi et al. 2019, Sec. 3): q/k/v and MLP-in column-wise, attention-out
    and MLP-out row-wise, the rest replicated (GPT-2: Conv1D made ``nn.Linear`` first); utils.ConfigError for a family
    other than Llama, GPT-NeoX and GPT-2, or heads not divisible by ``world_size``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    check_tensor_parallel(model.config, world_size)
    family = model.config.model_type
    col, row = ColwiseParallel(), RowwiseParallel()
    if family == "llama":
        prefix = "model.layers.*."
        names = {"self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col, "self_attn.o_proj": row}
        names |= {"mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row}
    elif family == "gpt_neox":
        prefix = "gpt_neox.layers.*."
        names = {"attention.query_key_value": col, "attention.dense": row, "mlp.dense_h_to_4h": col, "mlp.dense_4h_to_h": row}
    else:
        prefix = "transformer.h.*."
        _gpt2_to_linear(model, world_size)
        names = {"attn.c_attn": col, "attn.c_proj": row, "mlp.c_fc": col, "mlp.c_proj": row}
    return {prefix + k: v for k, v in names.items()}


def _gpt2_to_linear(model: torch.nn.Module, world_size: int) -> None:
    from transformers.pytorch_utils import Conv1D

    def linear(conv: Conv1D, order: torch.Tensor | None = None) -> torch.nn.Linear:
        weight = conv.weight.detach().t()  # Conv1D stores (in, out); Linear (out, in)
        bias = conv.bias.detach()
        if order is not None:
            weight, bias = weight[order], bias[order]
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
        layer.weight.data.copy_(weight)
        layer.bias.data.copy_(bias)
        return layer

    for block in model.transformer.h:
        attn = block.attn
        e = attn.embed_dim
        local = e // world_size
        # output rows regrouped so that rank r's contiguous shard is [q_r | k_r | v_r]
        order = torch.cat(
            [torch.arange(part * e + r * local, part * e + (r + 1) * local) for r in range(world_size) for part in range(3)]
        )
        attn.c_attn = linear(attn.c_attn, order)
        attn.c_proj = linear(attn.c_proj)
        attn.split_size = local
        block.mlp.c_fc = linear(block.mlp.c_fc)
        block.mlp.c_proj = linear(block.mlp.c_proj)


def _gpt2_state_to_conv1d(state: dict, config, world_size: int) -> dict:
    """Undo :func:`_gpt2_to_linear` on a full state dict: GPT-2's own Conv1D layout and q|k|v order."""
    e = config.n_embd
    local = e // world_size
    order = torch.cat(
        [torch.arange(part * e + r * local, part * e + (r + 1) * local) for r in range(world_size) for part in range(3)]
    )
    inverse = torch.argsort(order)
    out = {}
    for k, v in state.items():
        if k.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            v = v[inverse]
        if k.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
            v = v.t().contiguous()
        out[k] = v
    return out


def shard_models(trainer) -> None:
    """Split each weight matrix of ``trainer``'s policy and reference over its mesh's ``tp`` dimension (every process),
    the weights sent from rank 0."""
    from torch.distributed.tensor.parallel import parallelize_module

    from parallel.dist import shard_from_rank0

    for model in (trainer.policy, trainer.reference_model):
        if model is None:
            continue
        plan = tensor_parallel_plan(model, trainer.dist.world_size)  # GPT-2: Conv1D -> Linear first, on every rank
        shard = lambda model, plan=plan: parallelize_module(model, trainer.dist.mesh["tp"], plan)  # noqa: E731
        shard_from_rank0(model, shard, trainer.dist.rank, trainer.device)
