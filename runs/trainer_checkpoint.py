"""A trainer's checkpoint: what ``step-<examples>/`` holds (one process: policy.pt, optimizer.pt, scheduler.pt,
trainer_state.pt; FSDP and tensor parallelism: each rank's DCP shard in ``sharded/`` and rank 0's gathered files) and
how resume reads it back. BasicTrainer's ``save`` and ``load`` call these."""

from __future__ import annotations

import os
import random
import shutil

import torch

from runs import checkpoints, tracking
from runs.resume import numpy_rng_state, read_checkpoint_file, read_sharded_checkpoint, set_numpy_rng_state

CHECKPOINT_EXTENSIONS: list = []
"""A plugin's ``fn(trainer, folder, full_state_dict or None)`` that writes beside a checkpoint's weights (export/: the
Hugging Face folder ``hf/``); returns None, or why it failed (the checkpoint is kept without it)."""

REWIND_EXTENSIONS: list = []
"""A plugin's ``fn(run_dir)`` run after a resume rewinds the run folder's logs (evaluation/: samples.md rewritten)."""


def moves_reference(trainer) -> bool:
    """True if ``reference_update`` moves the reference during training (so checkpoints hold it)."""
    return trainer.reference_update is not None and trainer.reference_model is not None


def save(trainer) -> str:
    """Write ``step-<examples>/`` atomically, point ``LATEST`` at it and return its path; checkpoints.CheckpointError
    on every process if it cannot be written."""
    step = trainer.example_counter
    trainer.hf_export_failure = None
    path = save_checkpoint_dir(trainer, f"step-{step}", lambda folder: write_checkpoint(trainer, folder, step))
    if trainer.dist.is_main:
        warn_export_failure(trainer, path)
        checkpoints.prune_checkpoints(trainer.run_dir, trainer.config.keep_checkpoints)
    return path


def save_checkpoint_dir(trainer, name: str, write) -> str:
    """checkpoints.save_checkpoint_dir of ``<run_dir>/<name>`` on the main process, with ``write(folder)`` run inside it
    on every process; checkpoints.CheckpointError on every process if it cannot be written."""
    if trainer.dist.mesh is None:
        return checkpoints.save_checkpoint_dir(trainer.run_dir, name, write)
    dist = trainer.dist
    sent = []  # the folder, once the main process has made it and sent it to the others

    def write_all(folder: str) -> None:
        sent.append(dist.broadcast(folder))
        write(folder)

    message = None
    if dist.is_main:
        try:
            checkpoints.save_checkpoint_dir(trainer.run_dir, name, write_all)
        except checkpoints.CheckpointError as e:
            message = str(e)
            if not sent:
                dist.broadcast(None)  # no folder: the others write nothing
    else:
        folder = dist.broadcast(None)
        if folder is not None:
            write(folder)
    message = dist.broadcast(message)  # every process waits here for the main one's files
    if message is not None:
        raise checkpoints.CheckpointError(message)
    return os.path.join(trainer.run_dir, name)


def write_checkpoint(trainer, folder: str, step: int) -> None:
    """One process: policy.pt, optimizer.pt, scheduler.pt, trainer_state.pt, reference.pt (a moving reference) and
    ``hf/`` (unless its export fails) into ``folder``; a parallel trainer: :func:`write_sharded`."""
    if trainer.dist.mesh is not None:
        return write_sharded(trainer, folder, step)
    torch.save(policy_checkpoint(trainer, step, trainer.policy.state_dict()), os.path.join(folder, "policy.pt"))
    torch.save({"step_idx": step, "state": trainer.optimizer.state_dict()}, os.path.join(folder, "optimizer.pt"))
    _write_shared_files(trainer, folder, step, None)
    if moves_reference(trainer):  # the reference has moved (TR-DPO, BEMA); resume needs it
        state = {"step_idx": step, "state": trainer.reference_model.state_dict()}
        update_state = trainer.reference_update.state_dict()
        if update_state:  # BEMA's running averages
            state["update"] = update_state
        torch.save(state, os.path.join(folder, "reference.pt"))


def _write_shared_files(trainer, folder: str, step: int, full_state: dict | None) -> None:
    """scheduler.pt, trainer_state.pt and the plugins' files (``hf/``), written by one process."""
    torch.save({"step_idx": step, "state": trainer.scheduler.state_dict()}, os.path.join(folder, "scheduler.pt"))
    torch.save(trainer.trainer_state(), os.path.join(folder, "trainer_state.pt"))
    for write in CHECKPOINT_EXTENSIONS:  # export/: the Hugging Face folder hf/ when save_hf_export
        trainer.hf_export_failure = write(trainer, folder, full_state) or trainer.hf_export_failure


def _sharded_state(trainer) -> dict:
    """What each rank's DCP shard holds: the policy, its optimizer and (a moving reference) the reference and its
    update's state, as ``torch.distributed.checkpoint.state_dict`` gives them."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.policy, trainer.optimizer, options=sharded_options(trainer))
    state = {"model": model_sd, "optimizer": optim_sd}
    if moves_reference(trainer):  # the moved reference, sharded like the policy
        state["reference"] = get_model_state_dict(trainer.reference_model)
        update_state = trainer.reference_update.state_dict()
        if update_state:
            state["reference_update"] = update_state
    return state


def write_sharded(trainer, folder: str, step: int) -> None:
    """Each rank its DCP shard into ``folder``/sharded, then rank 0 the gathered policy.pt, scheduler.pt,
    trainer_state.pt and ``hf/``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    error = None
    try:
        dcp.save(_sharded_state(trainer), checkpoint_id=os.path.join(folder, "sharded"))
    except Exception as e:  # DCP raises on every rank when any rank's write fails
        error = e
    if trainer.dist.any_rank(error is not None):
        if not trainer.dist.is_main:
            return  # rank 0 raises, and save_checkpoint_dir tells every rank
        if error is not None:
            raise error
        shutil.rmtree(folder, ignore_errors=True)  # before the message, which reports the free space
        reason = "another rank could not write its shard"
        raise checkpoints.CheckpointError(checkpoints.checkpoint_error_message(trainer.run_dir, f"step-{step}", reason))
    # LoRA: the adapters alone, unless the merged export needs the frozen base too
    lora = trainer.lora
    adapters_only = lora is not None and not (trainer.config.save_hf_export and lora.get("export_merged"))
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=adapters_only)
    full = get_model_state_dict(trainer.policy, options=full_options)
    if trainer.dist.is_main:
        write_rank0_files(trainer, folder, step, full)


def sharded_options(trainer):
    """The ``StateDictOptions`` of the sharded checkpoint (DCP): a LoRA policy's holds the adapters (the trainable
    weights) and their optimizer state alone, not the frozen base."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if trainer.lora is None:
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def write_rank0_files(trainer, folder: str, step: int, full_state: dict) -> None:
    """policy.pt (full weights), scheduler.pt, trainer_state.pt and hf/ into ``folder``; a tensor-parallel GPT-2's
    weights go back to its own Conv1D layout first."""
    policy = trainer.policy
    if trainer.dist.tp_size > 1 and policy.config.model_type == "gpt2":
        from transformers import AutoModelForCausalLM

        from parallel.tensor_parallel import _gpt2_state_to_conv1d

        full_state = _gpt2_state_to_conv1d(full_state, policy.config, trainer.dist.tp_size)
        trainer.policy = AutoModelForCausalLM.from_config(policy.config)  # the exporter sees a plain GPT-2
        trainer.policy.load_state_dict(full_state)
    try:
        torch.save(policy_checkpoint(trainer, step, full_state), os.path.join(folder, "policy.pt"))
        _write_shared_files(trainer, folder, step, full_state)
    finally:
        trainer.policy = policy


def policy_checkpoint(trainer, step: int, state: dict) -> dict:
    """What policy.pt holds: ``{step_idx, state}`` with the policy's weights ``state``; for a LoRA policy only the
    adapters' entries of it (the trainable weights) and ``lora``, the ``model.lora`` settings (so ``model.archive`` can
    tell it from a whole model)."""
    if trainer.peft_model is None:
        return {"step_idx": step, "state": state}
    from omegaconf import OmegaConf

    adapters = {k: v for k, v in state.items() if k in trainer.trainable_names}
    return {"step_idx": step, "state": adapters, "lora": OmegaConf.to_container(trainer.lora, resolve=True)}


def load_policy_state(trainer, state: dict) -> None:
    """Load policy.pt's ``state`` (a LoRA policy's: its adapters alone) into the policy; RuntimeError if it does not fit."""
    if trainer.peft_model is None:
        trainer.policy.load_state_dict(state)
        return
    missing, unexpected = trainer.policy.load_state_dict(state, strict=False)
    lost = sorted(trainer.trainable_names & set(missing))
    if unexpected or lost:
        raise RuntimeError(f"policy.pt does not hold this LoRA policy's adapters (e.g. {(unexpected or lost)[0]!r}).")


def warn_export_failure(trainer, path: str) -> None:
    """Print one sentence when checkpoint ``path`` was published without its ``hf/`` export."""
    if trainer.hf_export_failure and trainer.dist.is_main:
        print(
            f"Warning: the Hugging Face export {path}/hf could not be written ({trainer.hf_export_failure}); "
            f"the checkpoint is complete without it: resume= continues from it and "
            f"model.archive={path}/policy.pt loads its weights.",
            flush=True,
        )


def trainer_state(trainer) -> dict:
    """Counters, RNG states, the W&B run id and the data's fingerprint: what resume needs besides the weights."""
    state = {
        "example_counter": trainer.example_counter,
        "batch_counter": trainer.batch_counter,
        "next_eval_at": trainer.next_eval_at,
        "rng": {
            "python": random.getstate(),
            "numpy": numpy_rng_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
        "wandb_id": trainer.logger.run_id,
    }
    if trainer.data_fingerprint is not None:
        state["data"] = trainer.data_fingerprint
    return state


def restore_trainer_state(trainer, state: dict) -> None:
    """Restore counters and Python/NumPy/torch RNG states saved by :func:`trainer_state`, then rewind the logs."""
    trainer.example_counter = state["example_counter"]
    trainer.batch_counter = state["batch_counter"]
    trainer.next_eval_at = state["next_eval_at"]
    random.setstate(state["rng"]["python"])
    set_numpy_rng_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    dropped = rewind_logs(trainer, trainer.example_counter)
    if dropped:
        print(f"metrics.jsonl: removed {dropped} records logged after this checkpoint; training logs those steps again.")


def load(trainer, checkpoint_dir: str) -> None:
    """Restore policy, optimizer, scheduler, a moving reference, counters and RNG from a checkpoint folder (a parallel
    trainer: each rank its shard of ``sharded/``; LoRA: the adapters and their optimizer state)."""
    if trainer.dist.mesh is not None:
        _load_sharded(trainer, checkpoint_dir)
    else:
        load_policy_state(trainer, read_checkpoint_file(checkpoint_dir, "policy.pt")["state"])
        trainer.optimizer.load_state_dict(read_checkpoint_file(checkpoint_dir, "optimizer.pt")["state"])
        if moves_reference(trainer):
            saved = read_checkpoint_file(checkpoint_dir, "reference.pt")
            trainer.reference_model.load_state_dict(saved["state"])
            trainer.reference_update.load_state_dict(saved.get("update") or {})
    trainer.scheduler.load_state_dict(read_checkpoint_file(checkpoint_dir, "scheduler.pt")["state"])
    trainer.restore_trainer_state(read_checkpoint_file(checkpoint_dir, "trainer_state.pt"))


def _load_sharded(trainer, checkpoint_dir: str) -> None:
    """Each rank reads its shard of ``checkpoint_dir``/sharded into the policy, optimizer and a moving reference."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _sharded_state(trainer)
    read_sharded_checkpoint(state, os.path.join(checkpoint_dir, "sharded"))
    set_state_dict(
        trainer.policy,
        trainer.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=sharded_options(trainer),
    )
    if moves_reference(trainer):
        set_model_state_dict(trainer.reference_model, state["reference"])
        trainer.reference_update.load_state_dict(state.get("reference_update") or {})


def rewind_logs(trainer, step: int) -> int:
    """On rank 0, drop what was logged after ``step`` examples (metrics.jsonl and the resumed W&B run, samples.jsonl
    and samples.md, completions.jsonl), since training logs those steps again; ``step=-1`` drops all. Returns how many
    metrics.jsonl records were dropped."""
    if not trainer.dist.is_main:
        return 0
    dropped = trainer.logger.rewind(step)
    for name in ("samples.jsonl", "completions.jsonl"):
        tracking.rewind_jsonl(os.path.join(trainer.run_dir, name), step)
    for rewound in REWIND_EXTENSIONS:  # evaluation/: samples.md, its view of samples.jsonl, rewound with it
        rewound(trainer.run_dir)
    return dropped
