"""The policy's optimizer, its learning-rate schedule and gradient clipping, for plain tensors and DTensors alike
(FSDP, tensor parallelism, both)."""

from __future__ import annotations

import math

import torch


def beta_for_epoch(beta, epoch: int) -> float:
    """``loss.beta`` in ``epoch`` (0-based): a number, or a list with one value per epoch whose
    last value repeats (TRL's OnlineDPOConfig ``beta`` list has the same meaning)."""
    if isinstance(beta, (int, float)):
        return float(beta)
    values = list(beta)
    return float(values[min(epoch, len(values) - 1)])


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Learning-rate multiplier for optimizer step ``step`` (0-based): linear warmup
    ``min(1, (step + 1) / (warmup_steps + 1))``, then ``constant``, or ``linear`` / ``cosine`` decay to 0 at ``total_steps``."""
    warm = min(1.0, (step + 1) / (warmup_steps + 1))  # step 0 already moves the weights
    if schedule == "constant" or step < warmup_steps:
        return warm
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return warm * (1.0 - progress)
    return warm * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` in lists of one kind each: plain tensors, and DTensors by device mesh, in order of first
    appearance (the same on every rank); one list when all are of one kind (or there are none)."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(groups.values()) or [[]]  # torch's foreach kernels refuse a mix of kinds


def build_optimizer(policy: torch.nn.Module, config) -> torch.optim.Optimizer:
    """``config.optimizer`` over the policy's trainable parameters (AdamW, Adam, SGD: ``config.weight_decay``;
    ``optimizer_foreach`` null: torch's default), one param group per :func:`parameter_groups` group."""
    params = [p for p in policy.parameters() if p.requires_grad]
    cls = getattr(torch.optim, config.optimizer)
    kwargs = {"lr": config.lr}
    if config.optimizer in ("AdamW", "Adam", "SGD"):
        kwargs["weight_decay"] = config.weight_decay
    if config.optimizer_foreach is not None:
        kwargs["foreach"] = bool(config.optimizer_foreach)
    groups = parameter_groups(params)
    # foreach kernels take one group's tensors at once
    return cls(params if len(groups) == 1 else [{"params": group} for group in groups], **kwargs)


def build_scheduler(optimizer: torch.optim.Optimizer, config, n_steps: int):
    """The learning rate of each of ``n_steps`` optimizer steps: ``config.lr`` times :func:`lr_multiplier`."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, config.warmup_steps, n_steps, config.lr_scheduler)
    )


def clip_gradients(policy: torch.nn.Module, max_norm: float, dist, device) -> torch.Tensor:
    """Clip the policy's gradients to ``max_norm`` by their global L2 norm and return that norm (torch's own clipping,
    or :func:`clip_mixed_gradients` where the gradients live on several meshes of ``dist``, the trainer's processes)."""
    grads = [p.grad for p in policy.parameters() if p.grad is not None]
    if dist.mesh is None or (dist.tp_size == 1 and len(parameter_groups(grads)) == 1):
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
    return clip_mixed_gradients(grads, max_norm, device)


def clip_mixed_gradients(grads: list[torch.Tensor], max_norm: float, device) -> torch.Tensor:
    """Clip ``grads`` of several meshes, or DTensors beside plain tensors, by their global L2 norm summed one by one
    (torch's foreach norm refuses them)."""
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        n = torch.linalg.vector_norm(g, 2, dtype=torch.float32)
        total_sq += (n.full_tensor() if hasattr(n, "full_tensor") else n) ** 2
    total = total_sq.sqrt()
    coef = min(1.0, max_norm / (total.item() + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
