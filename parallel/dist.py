"""The processes a trainer runs on: their collectives (:class:`Dist`, ``trainer.dist``), each returning its input on one
process, and a model's weights sharded from rank 0."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

import utils
from modeling import models


class Dist:
    """The processes a trainer runs on and their collectives: each returns its input on one process (``mesh`` None) and
    runs over the (dp, tp) device mesh's groups otherwise (tensor-parallel peers hold the same data)."""

    def __init__(self, rank: int = 0, world_size: int = 1, mesh=None):
        self.rank, self.world_size, self.mesh = rank, world_size, mesh

    @property
    def data_rank(self) -> int:
        """Which part of each batch this process takes: its place along the mesh's data-parallel dimension."""
        return self.rank if self.mesh is None else self.mesh["dp"].get_local_rank()  # tensor-parallel peers share it

    @property
    def data_world_size(self) -> int:
        """Into how many parts each batch is split: world size / tensor-parallel size."""
        return self.world_size if self.mesh is None else self.mesh["dp"].size()

    @property
    def tp_size(self) -> int:
        """Over how many processes each weight matrix is split (the mesh's ``tp`` dimension)."""
        return 1 if self.mesh is None else self.mesh["tp"].size()

    @property
    def shard_mesh(self):
        """The mesh FSDP shards over and averages gradients across: the data-parallel dimension."""
        return self.mesh["dp"]

    @property
    def is_main(self) -> bool:
        """True on the process that logs, prints and writes the run folder's files."""
        return self.rank == 0

    @property
    def data_group(self):
        """The data-parallel process group (None: every process, or one process)."""
        return None if self.mesh is None else self.mesh["dp"].get_group()

    def all_reduce(self, value: float, op: str, group=None) -> float:
        """``value`` reduced by ``torch.distributed.ReduceOp.<op>`` over ``group`` (default all processes), a float."""
        if self.mesh is None:
            return value
        import torch.distributed as dist

        t = torch.tensor([float(value)], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group)
        return t.item()

    def global_sum(self, value: float) -> float:
        """Sum of ``value`` over the data-parallel groups (tensor-parallel peers hold the same value)."""
        return self.all_reduce(value, "SUM", group=self.data_group)

    def gather_metrics(self, metrics: dict) -> dict:
        """Per-example metric lists of every data-parallel group, concatenated in order (tensor-parallel peers computed the same)."""
        return self.gather_per_rank(metrics, group=self.data_group)

    def gather_per_rank(self, metrics: dict, group=None) -> dict:
        """Every rank's lists (of ``group``, default all), concatenated in rank order, even when all processes see
        the same data (tensor parallelism): for per-process figures such as peak memory."""
        return metrics if self.mesh is None else concatenated_per_rank(metrics, group)

    def broadcast(self, obj):
        """``obj`` as the main process has it, on every process."""
        return obj if self.mesh is None else utils.broadcast_object(obj)

    def all_finite(self, value: torch.Tensor) -> bool:
        """True if ``value`` is finite on every process (all agree, so none hangs alone)."""
        return self.all_reduce(float(torch.isfinite(value).all()), "MIN") == 1.0

    def any_rank(self, flag: bool) -> bool:
        """True if ``flag`` is true on any process (a stop request reaches all ranks together)."""
        return self.all_reduce(float(flag), "MAX") == 1.0

    def local_batch(self, batch: dict) -> tuple[dict, float]:
        """This process's contiguous part of a global batch and the weight of its loss (1, or 0 for a stand-in part
        when a final batch has fewer examples than data-parallel processes, so that collectives match)."""
        if self.mesh is None:
            return batch, 1.0
        parts = split_batch(batch, self.data_world_size)
        if self.data_rank < len(parts):
            return parts[self.data_rank], 1.0
        return parts[0], 0.0

    def reshard(self, model) -> None:
        """Free ``model``'s gathered weights after a no-grad forward (FSDP2 keeps a root module's gathered for a
        backward that a frozen reference never runs)."""
        if self.mesh is None or model is None:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def sync_gradients(self, model, sync: bool) -> None:
        """Reduce ``model``'s gradients across ranks in the next backward only when ``sync`` (FSDP2: once per step,
        after the last micro-batch); nothing on one process."""
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(sync)

    def wait_for_all(self) -> None:
        """Return once every process has got here."""
        if self.mesh is not None:
            import torch.distributed as dist

            dist.barrier()  # at the end: gloo frees collective tensors before interpreter exit, which would abort


def split_batch(batch: dict, n_chunks: int) -> list[dict]:
    """Split a batch into ``n_chunks`` micro-batches along dim 0 (sizes differ by at most one;
    nothing is dropped). Lists are split the same way as tensors."""
    size = len(batch["prompt"])
    bounds = np.linspace(0, size, n_chunks + 1).round().astype(int)
    chunks = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi > lo:
            chunks.append({k: v[lo:hi] for k, v in batch.items()})
    return chunks


def concatenated_per_rank(metrics: dict, group=None) -> dict:
    """Every rank's metric lists (of ``group``, default all), concatenated in rank order."""
    out: dict = defaultdict(list)
    for part in utils.all_gather_object(dict(metrics), group=group):
        for k, v in part.items():
            out[k].extend(v)
    return out


def shard_from_rank0(model: torch.nn.Module, shard, rank: int, device: torch.device) -> None:
    """Shard ``model`` with ``shard`` (FSDP or a TP plan), its weights sent from rank 0: no rank holds the full model on
    its device, and only rank 0 reads the checkpoint."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = model.state_dict()
    full = state if rank == 0 else {}
    unsaved = {n: b.detach().clone() for n, b in model.named_buffers() if n not in state}
    # rank 0 holds the weights, the others meta tensors (models.rank0_model)
    models.keeping_ties(model, lambda model: model.to("meta"))
    shard(model)
    models.keeping_ties(model, lambda model: model.to_empty(device=device))
    # each rank allocates and receives only its slice
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():
        if name in unsaved:
            if rank == 0:
                buffer.copy_(unsaved[name])
            dist.broadcast(buffer, src=0)
