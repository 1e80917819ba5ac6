"""The precomputed reference's cache (precompute_ref_log_probs): reference log-probs on disk, named by a hash of the\nreference's weights, the tokenizer, the examples and the truncation settings."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os

import numpy as np
import torch
import tqdm

import losses
import utils
from modeling import models
from preference_datasets import get_batch_iterator
from runs import checkpoints


def reference_cache_path(reference, examples: list[dict], tokenizer, config, cache_dir: str) -> str:
    """The file in ``cache_dir`` for the reference log-probs of ``examples``, named by a hash of the
    reference's whole weights (LoRA: its base's; call it where they are whole), the tokenizer, the
    examples' texts, the truncation settings and ``loss.average_log_prob`` (and, for an objective that weighs tokens, its
    loss keys)."""
    from preference_datasets import example_key

    digest = hashlib.sha256()
    for name, tensor in sorted(models.base_state_dict(reference).items()):  # a LoRA policy: its base, the reference
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    settings = [type(tokenizer).__name__, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id]
    objective = losses.get_objective(config.loss.name)
    settings += [config.max_length, config.max_prompt_length, objective.averages(config.loss)]
    if objective.token_weights is not None:  # its log-probs weigh tokens by the loss's keys (LD-DPO's ld_alpha)
        settings.append({str(k): v for k, v in config.loss.items()})
    digest.update(json.dumps(settings).encode())
    for ex in examples:
        digest.update((ex.get("key") or example_key(ex["prompt"], ex["chosen"], ex.get("rejected"))).encode())  # own key: images
    return os.path.join(cache_dir, f"reference_logps-{digest.hexdigest()[:24]}.pt")


def read_reference_cache(path: str) -> dict | None:
    """The log-probs an earlier run cached in ``path`` (saying so), or None when there is no such
    file or it was cut short (saying so: the log-probs are computed again and the file rewritten)."""
    if not os.path.exists(path):
        return None
    if os.path.getsize(path) == 0 or checkpoints.cut_torch_archive(path):
        print(f"Note: the reference log-prob cache {path} is cut short ({os.path.getsize(path)} bytes); computing them again.")
        return None
    cache = models.load_weights_file(
        path,
        f"The reference log-prob cache {path}",
        "delete that file (this run then computes the log-probs again) and check who else can write to cache_dir",
    )
    print(f"Reference log-probs: reusing {path}")
    return cache


def write_reference_cache(path: str, cache: dict) -> str | None:
    """Write ``cache`` to ``path`` atomically; returns None, or why it could not be written."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(cache, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return utils.failure_reason(e)
    return None


def cached_reference(
    reference, examples: list[dict], tokenizer, config, distributed: bool = False, rank: int = 0
) -> tuple[str, dict | None]:
    """Where ``examples``' reference log-probs are cached and what an earlier run's file holds (None: the trainer computes them);
    rank 0 hashes and reads, then broadcasts under FSDP/TP."""
    found = None
    if rank == 0:
        path = reference_cache_path(reference, examples, tokenizer, config, config.cache_dir)
        try:
            found = (path, read_reference_cache(path))
        except utils.ConfigError as e:  # a file that is not a cache: every rank stops with the sentence
            found = (path, e)
    if distributed:
        found = utils.broadcast_object(found)
    if isinstance(found[1], utils.ConfigError):
        raise found[1]
    return found


def reference_inputs(
    config, policy, reference, examples: list[dict], tokenizer, distributed: bool, rank: int
) -> tuple[bool, str | None, dict | None]:
    """(whether reference log-probs are precomputed, their cache file, an earlier run's log-probs or None)."""
    lora_reference = models.is_lora_model(policy) and losses.get_objective(config.loss.name).uses_reference(config.loss)
    precompute = (reference is not None or lora_reference) and config.precompute_ref_log_probs
    if not precompute:
        return precompute, None, None
    source = policy if lora_reference else reference  # LoRA: the policy's base (models.base_state_dict names its weights)
    return (precompute, *cached_reference(source, examples, tokenizer, config, distributed, rank))


@torch.no_grad()
def precompute_reference(trainer, examples: list[dict], path: str) -> dict:
    """``trainer``'s live reference's log-probs of ``examples``, ``{example key: (chosen, rejected)}``, on every process,
    each data-parallel rank computing its share; rank 0 writes them to ``path`` (:func:`reference_cache_path`), with one
    warning if it cannot."""
    world, rank = trainer.dist.data_world_size, trainer.dist.data_rank
    bounds = np.linspace(0, len(examples), world + 1).round().astype(int)  # a contiguous share per data-parallel rank
    size = trainer.config.eval_batch_size
    # the same on every rank: FSDP's collectives need it
    n_calls = max(math.ceil((hi - lo) / size) for lo, hi in zip(bounds[:-1], bounds[1:]))
    mine = examples[bounds[rank] : bounds[rank + 1]]
    config = trainer.config
    batches = get_batch_iterator(
        mine or examples[:1], trainer.tokenizer, size, config.max_length, config.max_prompt_length, shuffle=False, n_epochs=1
    )
    computed, n_done, last = {}, 0, None
    for _ in tqdm.tqdm(range(n_calls), desc="reference log-probs", disable=not (config.progress_bar and trainer.dist.is_main)):
        batch = next(batches, None)
        real = batch is not None and bool(mine)  # else a stand-in: this rank's share is done
        batch = batch if batch is not None else last
        chosen, rejected = trainer.reference_logps(batch)  # computed here: no cache or remote workers yet
        if real:
            computed.update(zip(batch["key"], zip(chosen.tolist(), rejected.tolist())))
            n_done += len(batch["key"])
        last = batch
    trainer.dist.reshard(trainer.reference_model)
    shares = trainer.dist.gather_metrics({"cache": [computed], "n": [n_done]})
    cache = {}
    for part in shares["cache"]:
        cache.update(part)
    if trainer.dist.is_main:
        by_rank = "" if world == 1 else f" ({' + '.join(map(str, shares['n']))} computed by the {world} data-parallel ranks)"
        failure = write_reference_cache(path, cache)
        if failure is None:
            print(f"Reference log-probs: {len(cache)} pairs cached in {path}{by_rank}")
        else:
            print(
                f"Warning: the reference log-probs could not be cached in {path} ({failure}); training goes on with them in memory{by_rank}."
            )
    return cache
