"""Joining torchrun's process group: NCCL on this rank's GPU (one GPU per process, checked) or gloo, with the run's timeout."""

from __future__ import annotations

import os

import torch

from utils import ConfigError

DEFAULT_DIST_TIMEOUT_MINUTES = 60  # dist_timeout_minutes when a config has none


def check_gpu_count(n_local: int, what: str = "world_size") -> None:
    """Check that this machine has a GPU for each of ``n_local`` processes (``what``: how the user chose it)."""
    if not torch.cuda.is_available():
        return
    n_gpus = torch.cuda.device_count()
    if n_local > n_gpus:
        raise ConfigError(
            f"{what} asks for {n_local} processes on this machine, one per GPU, but it has {n_gpus} GPU"
            f"{'' if n_gpus == 1 else 's'}; start at most {n_gpus} (world_size={n_gpus}, or torchrun --nproc_per_node={n_gpus})."
        )


def init_distributed(timeout_minutes: float = DEFAULT_DIST_TIMEOUT_MINUTES, store=None) -> int:
    """Join torchrun's process group (NCCL on ``cuda:<LOCAL_RANK>``, else gloo) and return the rank; ``store``: the
    rendezvous store to use instead of the environment's (a process that starts several groups one after another gives
    each a fresh ``PrefixStore``: a group started again on the same keys meets the last group's stale addresses)."""
    import datetime

    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        # NCCL's 10-minute default is shorter than what rank 0 may take alone while the others wait
        kwargs = {"timeout": datetime.timedelta(minutes=timeout_minutes)}
        if torch.cuda.is_available():
            local = int(os.environ.get("LOCAL_WORLD_SIZE", int(os.environ.get("LOCAL_RANK", 0)) + 1))
            check_gpu_count(local, f"LOCAL_WORLD_SIZE={local} (processes per node)")
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)
        if store is not None:
            kwargs |= {"store": store, "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
        dist.init_process_group(backend, **kwargs)
    return dist.get_rank()
