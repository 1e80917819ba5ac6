"""Helpers shared by train.py and the trainers: config checks, models and tokenizers,
run folders, atomic checkpoints, metric logging and curves."""

from __future__ import annotations

import contextlib
import datetime
import difflib
import errno
import json
import math
import os
import random
import re
import shlex
import shutil
import socket
import sys
import tempfile

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

import losses


class ConfigError(ValueError):
    """A config value is wrong; the message is one sentence naming the key and the fix."""


TRAINERS = ("BasicTrainer", "FSDPTrainer", "TensorParallelTrainer")

FLOAT16_UNSAFE_OPTIMIZERS = ("Adam", "AdamW", "RMSprop")
"""Optimizers whose state and epsilon underflow in float16 weights, making every weight NaN at the first step (SGD
does not)."""

DEFAULT_DIST_TIMEOUT_MINUTES = 60
"""``dist_timeout_minutes`` when a config has none."""


# ----------------------------------------------------------------------------- config


def validate_config(config: DictConfig, world_size: int = 1) -> None:
    """Check the composed config before any data or model is loaded.

    Raises:
        ConfigError: naming the first bad key and how to fix it.
    """
    from preference_datasets import DATASETS, PROMPT_DATASETS

    validate_numbers(config)
    validate_malloc_mmap_threshold(config.get("malloc_mmap_threshold_mib"))
    loss = config.loss
    try:
        objective = losses.validate_loss_config(loss)
    except losses.ObjectiveConfigError as e:
        raise ConfigError(str(e)) from None
    if objective.score_head and config.trainer == "TensorParallelTrainer":
        raise ConfigError(
            f"loss={loss.name} trains with BasicTrainer or FSDPTrainer; TensorParallelTrainer splits only causal LMs."
        )
    if config.precompute_ref_log_probs and not objective.uses_reference(loss):
        raise ConfigError(
            f"loss={loss.name} uses no reference model, so precompute_ref_log_probs=true has nothing to compute; set it false."
        )
    if config.precompute_ref_log_probs and objective.mismatched_kl:
        raise ConfigError(
            f"loss={loss.name} needs the reference's log-probs of each prompt paired with another example's completion, "
            "pairs that change with every shuffled batch, so precompute_ref_log_probs=true cannot cache them; set it false."
        )
    validate_reference_update(config, objective)
    validate_online(config)
    validate_lora(config, objective)
    validate_hub(config)
    online = bool(config.get("online") and config.online.enabled)
    if not OmegaConf.is_list(config.datasets):
        raise ConfigError(f"datasets must be a list: write datasets=[{config.datasets}], not datasets={config.datasets}.")
    for name in config.datasets:
        if name in PROMPT_DATASETS and name not in DATASETS and not online:
            raise ConfigError(f"Dataset {name!r} has prompts only; use it for online DPO (online.enabled=true).")
        if name not in DATASETS and name not in PROMPT_DATASETS:
            known = sorted({*DATASETS, *PROMPT_DATASETS})
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigError(f"Unknown dataset {name!r} in datasets; {hint}registered datasets are {known}.")
    if config.batch_size % config.gradient_accumulation_steps:
        raise ConfigError(
            f"batch_size ({config.batch_size}) must be divisible by gradient_accumulation_steps ({config.gradient_accumulation_steps})."
        )
    tp = config.get("tensor_parallel_size") or 1
    if tp != 1:
        if not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a whole number >= 1, got {tp}.")
        if config.trainer != "FSDPTrainer":
            raise ConfigError(
                f"tensor_parallel_size is for trainer=FSDPTrainer (2-D FSDP x TP); {config.trainer} does not use it: remove it."
            )
        if objective.score_head:
            raise ConfigError(
                f"loss={loss.name} does not support tensor_parallel_size > 1 (tensor parallelism splits causal LMs); remove it."
            )
        if world_size % tp:
            raise ConfigError(f"tensor_parallel_size ({tp}) must divide the number of processes ({world_size}).")
    data_parallel = data_parallel_size(config, world_size)
    if config.batch_size % data_parallel:
        groups = "processes" if tp == 1 else "data-parallel groups (processes / tensor_parallel_size)"
        raise ConfigError(f"batch_size ({config.batch_size}) must be divisible by the number of {groups} ({data_parallel}).")
    if config.max_prompt_length >= config.max_length:
        raise ConfigError(
            f"max_prompt_length ({config.max_prompt_length}) must be smaller than max_length ({config.max_length})."
        )
    if config.n_examples is None and config.n_epochs is None:
        raise ConfigError("Set n_epochs or n_examples (e.g. n_epochs=1).")
    if config.optimizer not in ("RMSprop", "AdamW", "Adam", "SGD"):
        raise ConfigError(f"optimizer must be one of RMSprop, AdamW, Adam, SGD, got {config.optimizer}.")
    if config.model.get("policy_dtype") == "float16" and config.optimizer in FLOAT16_UNSAFE_OPTIMIZERS:
        raise ConfigError(
            f"model.policy_dtype=float16 with optimizer={config.optimizer} turns the weights into NaN at the first step "
            f"(its epsilon 1e-8 is 0 in float16, and so is the square of a small gradient); use model.policy_dtype=bfloat16, "
            "or float32 weights with model.fsdp_policy_mp=float16 under trainer=FSDPTrainer for float16 compute."
        )
    foreach = config.get("optimizer_foreach")
    if foreach is not None and not isinstance(foreach, bool):
        raise ConfigError(
            f"optimizer_foreach must be true, false or null (torch's default: foreach kernels on GPU), got {foreach!r}."
        )
    chunk = config.get("output_layer_chunk")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
        raise ConfigError(
            f"output_layer_chunk must be a whole number of positions >= 0 (0 or null: the output layer over all "
            f"positions at once), got {chunk!r}; e.g. output_layer_chunk=1024."
        )
    timeout = config.get("dist_timeout_minutes", DEFAULT_DIST_TIMEOUT_MINUTES)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ConfigError(
            f"dist_timeout_minutes must be a number of minutes > 0 (how long a rank waits for the others "
            f"before the run aborts), got {timeout!r}; e.g. dist_timeout_minutes=60."
        )
    if config.lr_scheduler not in ("constant", "linear", "cosine"):
        raise ConfigError(f"lr_scheduler must be constant, linear or cosine, got {config.lr_scheduler}.")
    if config.wandb.mode not in ("online", "offline", "disabled"):
        raise ConfigError(f"wandb.mode must be online, offline or disabled, got {config.wandb.mode}.")
    if config.trainer not in TRAINERS:
        raise ConfigError(f"trainer={config.trainer} is unknown; choose one of {', '.join(TRAINERS)}.")
    if config.get("launcher", "local") not in ("local", "ray"):
        raise ConfigError(f"launcher={config.launcher} is unknown; choose launcher=local or launcher=ray.")
    if OmegaConf.is_missing(config.model, "name_or_path"):  # model=blank_model (or a preset built on it) alone
        raise ConfigError("model=blank_model needs the model to load: add model.name_or_path=<a hub id or a local folder>.")
    if config.model.name_or_path is None and config.model.get("config") is None:
        raise ConfigError("Set model.name_or_path (a hub id or a local folder), or model.config to build a random model.")
    if config.get("resume") is None:  # a fresh run (a resumed one keeps what it started with)
        problem = model_contradiction(config)
        if problem is not None:
            raise ConfigError(problem)
    path = config.model.name_or_path
    if (
        path is not None
        and config.model.get("config") is None
        and looks_local(path)
        and not os.path.isdir(os.path.expanduser(path))
    ):
        raise ConfigError(f"model.name_or_path={path} is not a folder; give a local Hugging Face model folder or a hub id.")
    if config.model.archive is not None and not os.path.exists(config.model.archive):
        raise ConfigError(f"model.archive={config.model.archive} does not exist; give the policy.pt of an earlier run.")
    if config.model.archive is not None and os.path.isdir(config.model.archive):
        folder = config.model.archive
        there = [
            os.path.join(folder, *p)
            for p in (("policy.pt",), ("LATEST", "policy.pt"))
            if os.path.exists(os.path.join(folder, *p))
        ]
        hint = (
            f"model.archive={there[0]}"
            if there
            else "the policy.pt of a checkpoint (<run>/LATEST/policy.pt); this folder holds none"
        )
        raise ConfigError(f"model.archive={folder} is a folder; give a checkpoint's policy.pt: {hint}.")


def model_contradiction(config: DictConfig) -> str | None:
    """One sentence when two ``model.*`` keys contradict (one would be silently ignored), else None."""
    model = config.model
    path, built = model.get("name_or_path"), model.get("config") is not None
    if path is not None and built:  # load_model builds from model.config and never reads the path's weights
        return (
            f"model.name_or_path={path} is not loaded when model.config is set (the default model=tiny builds a "
            "random model from it); add model=blank_model to train that model, or drop model.name_or_path."
        )
    if model.get("device_map") and built:
        return f"model.device_map={model.device_map} places loaded weights, but model.config builds a random model; drop it."
    if model.get("device_map") and config.get("trainer", "BasicTrainer") != "BasicTrainer":
        return (
            f"model.device_map={model.device_map} is for trainer=BasicTrainer (one process over the local GPUs); "
            f"{config.trainer} places the model itself: drop it."
        )
    return None


def given_keys(overrides: list[str]) -> set[str]:
    """The keys (and config groups) that command-line ``overrides`` set, deletions (``~key``) left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {o.key_or_group for o in OverridesParser.create().parse_overrides(overrides) if not o.is_delete()}


def settle_given(config: DictConfig, given: set[str]) -> None:
    """Let the command line's keys ``given`` win over a preset's values: ``n_epochs`` given without ``n_examples``
    sets ``n_examples`` to null.

    Raises:
        ConfigError: if the command line sets both ``n_epochs`` and ``n_examples``, or both ``model.tokenizer_class``
            and ``model.tokenizer_name_or_path``.
    """
    pairs = (
        ("n_epochs", "n_examples", "the training length"),
        ("model.tokenizer_class", "model.tokenizer_name_or_path", "the tokenizer"),
    )
    for a, b, what in pairs:
        va, vb = OmegaConf.select(config, a), OmegaConf.select(config, b)
        if a in given and b in given and va is not None and vb is not None:
            raise ConfigError(
                f"{a}={override_text(va)} and {b}={override_text(vb)} both set {what} and contradict; give only one."
            )
    if "n_epochs" in given and "n_examples" not in given and config.get("n_epochs") is not None:
        config.n_examples = None


def training_length(config: DictConfig, n_train: int) -> str:
    """One line saying which of ``n_examples`` and ``n_epochs`` governs and what it makes of ``n_train`` examples."""
    if config.get("n_examples"):
        total = config.n_examples
        epochs = total / max(n_train, 1)
        line = (
            f"Training length: n_examples={total} governs (n_epochs={config.n_epochs} is not used): "
            f"{epochs:.3g} epochs of {n_train} train examples."
        )
    else:
        total = config.n_epochs * n_train
        line = f"Training length: n_epochs={config.n_epochs} governs (n_examples=null): {total} examples ({n_train} per epoch)."
    steps = -(-total // config.batch_size)  # optimizer steps (the last batch may be short)
    if config.get("warmup_steps", 0) >= steps:  # a run inside its warmup never trains at lr
        line += (
            f" Note: warmup_steps={config.warmup_steps} is not shorter than the run's {steps} optimizer step{'s' * (steps != 1)}, so the "
            f"learning rate never reaches lr={config.lr}; lower warmup_steps."
        )
    return line


def data_parallel_size(config: DictConfig, world_size: int) -> int:
    """How many data-parallel parts each batch is split into over ``world_size`` processes."""
    if config.trainer == "TensorParallelTrainer":
        return 1
    if config.trainer == "FSDPTrainer":
        return world_size // (config.get("tensor_parallel_size") or 1)
    return world_size


def hf_folder_error(path: str, key: str) -> str | None:
    """One sentence when the local folder ``path`` (given as ``key``) is a run folder or a checkpoint
    of train.py rather than a Hugging Face model folder, naming the export inside it; else None."""
    folder = os.path.expanduser(str(path))
    if not os.path.isdir(folder) or os.path.exists(os.path.join(folder, "config.json")):
        return None
    for inner in (("hf",), ("LATEST", "hf")):
        export = os.path.join(folder, *inner)
        if os.path.exists(os.path.join(export, "config.json")):
            return f"{key}={path} is a run folder or checkpoint of train.py, not a model folder; give its export, {key}={export}."
    return f"{key}={path} holds no config.json, so it is not a Hugging Face model folder; give one (e.g. a loss=reward run's LATEST/hf)."


def looks_local(path: str) -> bool:
    """True if ``path`` can only be a local folder, not a hub id ("org/name" has one slash at most)."""
    path = str(path)
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.exists(path.split("/")[0])


NUMBER_KEYS = {  # key: (whole numbers only, the least value allowed, whether that value itself is allowed)
    "lr": (False, 0, False),
    "weight_decay": (False, 0, True),
    "max_grad_norm": (False, 0, False),
    "warmup_steps": (True, 0, True),
    "batch_size": (True, 1, True),
    "eval_batch_size": (True, 1, True),
    "gradient_accumulation_steps": (True, 1, True),
    "max_length": (True, 1, True),
    "max_prompt_length": (True, 1, True),
    "n_epochs": (True, 1, True),
    "n_eval_examples": (True, 0, True),
    "eval_every": (True, 1, True),
}
"""The top-level numeric keys :func:`validate_numbers` checks (null is left to the key's own meaning)."""


def validate_numbers(config: DictConfig) -> None:
    """Check that each :data:`NUMBER_KEYS` value present and not null is a number of the right kind and range.

    Raises:
        ConfigError: naming the key, what it needs and what it got.
    """
    for key, (whole, least, inclusive) in NUMBER_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        kind = "a whole number" if whole else "a number"
        ok = not isinstance(value, bool) and isinstance(value, int if whole else (int, float))
        if not ok or not (value >= least if inclusive else value > least):
            raise ConfigError(
                f"{key} must be {kind} {'>=' if inclusive else '>'} {least}, got {value!r}; e.g. {key}={config_default(key)}."
            )


def config_default(key: str):
    """The value ``key`` has in config/config.yaml (for examples in error messages)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config", "config.yaml")
    return OmegaConf.load(path).get(key)


def validate_reference_update(config: DictConfig, objective) -> None:
    """Check ``reference_update`` (TR-DPO) against the objective and the reference's placement.

    Raises:
        ConfigError: naming the first bad key and how to fix it.
    """
    update = config.get("reference_update")
    if update is None or update.get("mode") is None:
        return
    if update.mode not in ("soft", "hard"):
        raise ConfigError(f"reference_update.mode must be null, soft or hard, got {update.mode}.")
    if not objective.uses_reference(config.loss):
        raise ConfigError(f"reference_update moves the reference model, but loss={config.loss.name} uses none; remove it.")
    every = update.get("every")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"reference_update.every must be a whole number of optimizer steps >= 1, got {every}.")
    alpha = update.get("alpha")
    if update.mode == "soft" and not (isinstance(alpha, (int, float)) and 0 < alpha <= 1):
        raise ConfigError(f"reference_update.alpha must be in (0, 1] (the policy's weight in the mix), got {alpha}.")
    if config.precompute_ref_log_probs:
        raise ConfigError(
            "reference_update moves the reference during training, so precomputed reference log-probs would go stale; "
            "set precompute_ref_log_probs=false."
        )
    if ray_reference_workers(config):
        raise ConfigError(
            "reference_update moves the reference, which must then live with the policy; set ray.reference_workers=0."
        )


def ray_reference_workers(config: DictConfig) -> int:
    """How many Ray actors hold the reference apart from the policy: ``ray.reference_workers``
    under ``launcher=ray``, else 0."""
    ray_cfg = config.get("ray")
    return int(ray_cfg.get("reference_workers", 0) or 0) if config.get("launcher") == "ray" and ray_cfg is not None else 0


def lora_settings(model_config: DictConfig) -> DictConfig | None:
    """``model.lora`` when LoRA is on (``model.lora.r`` set), else None (full fine-tuning)."""
    lora = model_config.get("lora")
    return lora if lora is not None and lora.get("r") is not None else None


def validate_lora(config: DictConfig, objective) -> None:
    """Check ``model.lora`` and what it cannot be combined with (a LoRA run's reference is the policy with
    adapters off).

    Raises:
        ConfigError: naming the first bad key and how to fix it.
    """
    lora = lora_settings(config.model)
    if lora is None:
        return
    r, alpha, dropout, targets = lora.r, lora.get("alpha", 32), lora.get("dropout", 0.0), lora.get("target_modules")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConfigError(f"model.lora.r must be a whole number >= 1 (the adapters' rank, e.g. 16) or null, got {r!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ConfigError(f"model.lora.alpha must be a number > 0 (the adapters are scaled by alpha / r), got {alpha!r}.")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ConfigError(f"model.lora.dropout must be a number in [0, 1), got {dropout!r}.")
    names = OmegaConf.to_container(targets) if OmegaConf.is_list(targets) else targets
    if names != "all-linear" and not (isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)):
        raise ConfigError(
            f"model.lora.target_modules must be all-linear or a list of module names, e.g. [q_proj,v_proj], got {targets!r}."
        )
    if not isinstance(lora.get("export_merged", False), bool):
        raise ConfigError(f"model.lora.export_merged must be true or false, got {lora.export_merged!r}.")
    if objective.score_head:
        raise ConfigError(
            f"model.lora trains the adapters of a causal LM, not loss={config.loss.name}'s score head; set model.lora.r=null."
        )
    if config.trainer == "TensorParallelTrainer" or (config.get("tensor_parallel_size") or 1) > 1:
        raise ConfigError(
            "model.lora does not work with tensor parallelism (its plan splits plain linear layers, not LoRA's); "
            "use trainer=FSDPTrainer with tensor_parallel_size=1 or BasicTrainer."
        )
    update = config.get("reference_update")
    if update is not None and update.get("mode") is not None:
        raise ConfigError(
            "reference_update moves the reference, but with model.lora the reference is the frozen base (the policy with its "
            "adapters off), which never moves; set reference_update.mode=null or model.lora.r=null."
        )
    if ray_reference_workers(config):
        raise ConfigError(
            "with model.lora the reference is the policy with its adapters off, in each policy worker; set ray.reference_workers=0."
        )
    reference_dtype = config.model.get("reference_dtype")
    if reference_dtype is not None and reference_dtype != config.model.get("policy_dtype"):
        raise ConfigError(
            f"with model.lora the reference is the policy's own base, in model.policy_dtype={config.model.get('policy_dtype')}, "
            f"so model.reference_dtype={reference_dtype} cannot apply; set model.reference_dtype=null."
        )
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ConfigError("model.lora.r is set but the peft library is not installed; pip install -r requirements.txt.") from None


def validate_hub(config: DictConfig) -> None:
    """Check ``hub.*`` (absent: no push).

    Raises:
        ConfigError: for a non-boolean ``hub.push`` or ``hub.private``, or ``hub.push=true`` without a valid
            ``hub.model_id`` or without ``save_hf_export``.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    hub = config.get("hub") or {}
    for key in ("push", "private"):
        if not isinstance(hub.get(key, False), bool):
            raise ConfigError(f"hub.{key} must be true or false, got {hub.get(key)!r}.")
    if not hub.get("push"):
        return
    model_id = hub.get("model_id")
    if model_id is None:
        raise ConfigError("hub.push=true needs the repository to push to: add hub.model_id=<org or user>/<name>.")
    try:
        validate_repo_id(str(model_id))
    except HFValidationError:
        raise ConfigError(
            f"hub.model_id={model_id} is not a Hugging Face repository id; give <org or user>/<name>, e.g. hub.model_id=my-org/my-dpo-model."
        ) from None
    if not config.save_hf_export:
        raise ConfigError(
            "hub.push=true pushes the run's Hugging Face export, which save_hf_export=false leaves out; set save_hf_export=true."
        )


def online_capable(objective) -> bool:
    """True if online DPO can train with ``objective`` (a ``losses.Objective``): paired, with a reference and a
    ``beta``."""
    return objective.paired and objective.reference is not False and "beta" in objective.keys and not objective.mismatched_kl


def validate_online(config: DictConfig) -> None:
    """Check the ``online:`` section (online DPO) when ``online.enabled``.

    Raises:
        ConfigError: naming the first bad key and how to fix it.
    """
    online = config.get("online")
    if online is None or not online.enabled:
        return
    objective = losses.get_objective(config.loss.name)
    if not online_capable(objective):
        capable = [name for name, o in sorted(losses.OBJECTIVES.items()) if online_capable(o)]
        raise ConfigError(
            "online.enabled=true trains with loss=dpo or loss=ipo or another paired objective with a reference "
            f"({', '.join(capable)}), not loss={config.loss.name}."
        )
    if not objective.uses_reference(config.loss):
        raise ConfigError(f"online DPO needs the reference model: set loss.{objective.reference}=false.")
    if config.precompute_ref_log_probs:
        raise ConfigError(
            "online DPO samples new completions each step, so precompute_ref_log_probs=true cannot apply; set it false."
        )
    if online.scorer not in ("reward_model", "reward_model_judge", "http_judge", "reward_function"):
        raise ConfigError(
            f"online.scorer must be reward_model, reward_model_judge, http_judge or reward_function, got {online.scorer}."
        )
    if online.scorer in ("reward_model", "reward_model_judge") and config.reward_model.name_or_path is None:
        raise ConfigError(
            f"online.scorer={online.scorer} needs reward_model.name_or_path (e.g. the LATEST/hf of a loss=reward run)."
        )
    if online.scorer in ("reward_model", "reward_model_judge"):
        problem = hf_folder_error(config.reward_model.name_or_path, "reward_model.name_or_path")
        if problem is not None:
            raise ConfigError(problem)
    if online.scorer == "http_judge" and (config.judge.base_url is None or config.judge.model is None):
        raise ConfigError("online.scorer=http_judge needs judge.base_url (e.g. http://127.0.0.1:8000/v1) and judge.model.")
    if online.ties not in ("skip", "random"):
        raise ConfigError(f"online.ties must be skip or random, got {online.ties}.")
    if not online.max_new_tokens >= 1:
        raise ConfigError(f"online.max_new_tokens must be >= 1, got {online.max_new_tokens}.")
    if config.max_prompt_length + online.max_new_tokens > config.max_length:
        raise ConfigError(
            f"max_prompt_length ({config.max_prompt_length}) + online.max_new_tokens ({online.max_new_tokens}) "
            f"must be at most max_length ({config.max_length}); raise max_length or lower one of them."
        )
    if not online.temperature > 0:
        raise ConfigError(f"online.temperature must be > 0 (online DPO samples), got {online.temperature}.")
    if not 0 <= online.get("max_failure_rate", 0.1) <= 1:
        raise ConfigError(f"online.max_failure_rate must be in [0, 1], got {online.max_failure_rate}.")
    if config.trainer == "TensorParallelTrainer":
        raise ConfigError("online DPO runs with BasicTrainer or FSDPTrainer.")


def n_eval_used(config: DictConfig, n_eval: int) -> int:
    """How many eval examples are used: ``n_eval_examples`` capped by the eval split's size."""
    return min(config.n_eval_examples or n_eval, n_eval)


def check_eval_size(config: DictConfig, n_eval: int) -> None:
    """Raise ConfigError if the eval set cannot fill one eval batch."""
    if n_eval == 0:
        raise ConfigError("The eval split is empty; give the dataset a test split or a holdout_fraction.")
    used = n_eval_used(config, n_eval)
    if config.eval_batch_size > used:
        raise ConfigError(
            f"eval_batch_size ({config.eval_batch_size}) is larger than the eval set ({used} example{'s' if used != 1 else ''}); lower it."
        )


# ----------------------------------------------------------------------------- models


def set_threads(n: int | None) -> None:
    """Use ``n`` CPU threads for torch ops (None: torch's default)."""
    if n:
        torch.set_num_threads(n)


MALLOC_MMAP_THRESHOLD_MAX_MIB = 32
"""glibc's largest mmap threshold on 64-bit Linux (``HEAP_MAX_SIZE / 2`` = 32 MiB): ``mallopt`` refuses more."""


def validate_malloc_mmap_threshold(value) -> None:
    """Check ``malloc_mmap_threshold_mib`` (null, or a number of MiB in (0, 32]).

    Raises:
        ConfigError: naming the key, its range and what it got.
    """
    ok = value is None or (not isinstance(value, bool) and isinstance(value, (int, float)))
    if not ok or (value is not None and not 0 < value <= MALLOC_MMAP_THRESHOLD_MAX_MIB):
        raise ConfigError(
            f"malloc_mmap_threshold_mib must be null (glibc's default) or a number of MiB in (0, "
            f"{MALLOC_MMAP_THRESHOLD_MAX_MIB}], got {value!r}; e.g. malloc_mmap_threshold_mib=1."
        )


_MALLOC = {"threshold_mib": None, "noted": False}  # what set_malloc_mmap_threshold did in this process


def _preloaded_malloc() -> str | None:
    """The first ``*malloc*`` library of ``LD_PRELOAD``, else one mapped into the process (``/proc/self/maps``),
    else None."""
    listed = [lib for lib in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if "malloc" in os.path.basename(lib)]
    if listed:
        return listed[0]
    try:
        with open("/proc/self/maps") as f:
            names = {os.path.basename(line.split()[-1]) for line in f if "/" in line}
    except OSError:
        return None
    return min((n for n in names if "malloc" in n), default=None)


def _glibc():
    """This process's C library through ctypes if it is glibc (has ``gnu_get_libc_version`` and ``mallopt``), else
    None."""
    import ctypes

    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def set_malloc_mmap_threshold(mib: float | None) -> bool:
    """Make glibc's malloc serve allocations of at least ``mib`` MiB from their own memory maps, returned to the
    OS when freed (``mallopt(M_MMAP_THRESHOLD)``, mallopt(3)).

    Returns:
        True when set; False when ``mib`` is None, another allocator is preloaded or the C library is not glibc
        (a note is printed once in the last two cases).

    Raises:
        ConfigError: ``mib`` outside (0, 32].
    """
    validate_malloc_mmap_threshold(mib)
    if mib is None:
        return False
    preloaded, libc = _preloaded_malloc(), _glibc()
    if preloaded or libc is None:
        if not _MALLOC["noted"]:
            print(
                f"malloc_mmap_threshold_mib is glibc's; {preloaded} is preloaded and allocates instead, so it is not set."
                if preloaded
                else "malloc_mmap_threshold_mib applies to glibc's malloc (Linux); this C library's allocator is left as it is."
            )
            _MALLOC["noted"] = True
        return False
    m_mmap_threshold = -3  # malloc.h
    if not libc.mallopt(m_mmap_threshold, int(mib * 2**20)):
        raise ConfigError(f"glibc's mallopt refused malloc_mmap_threshold_mib={mib}; use a value in (0, 32].")
    _MALLOC["threshold_mib"] = mib
    return True


def cpu_allocator() -> str:
    """The allocator serving this process's memory, in words: a preloaded ``*malloc*`` library, glibc's malloc
    with its mmap threshold, or the C library's malloc."""
    preloaded = _preloaded_malloc()
    if preloaded:
        return f"{os.path.basename(preloaded)} (preloaded)"
    libc = _glibc()
    if libc is None:
        return "the C library's malloc"
    import ctypes

    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    version = libc.gnu_get_libc_version().decode()
    mib = _MALLOC["threshold_mib"]
    if mib is None:
        return f"glibc {version} malloc, its default mmap threshold (128 KiB, growing to 32 MiB)"
    return f"glibc {version} malloc, mmap threshold {mib:g} MiB (malloc_mmap_threshold_mib)"


_PEAK = {"reset": False, "jobs": 0}
"""Whether :func:`reset_peak_memory` could reset this process's resident peak, and how many jobs it started."""


def reset_peak_memory() -> None:
    """Reset this job's peak-memory counters (the kernel's resident high-water mark via ``/proc/self/clear_refs``,
    and CUDA's), so each job of a Hydra multirun reports its own peak."""
    _PEAK["jobs"] += 1
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak resident set size (Documentation/filesystems/proc.rst)
        _PEAK["reset"] = True
    except OSError:  # not Linux, or not allowed: the peak stays the process's
        _PEAK["reset"] = False
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_rss_mib() -> float:
    """This job's peak resident memory, MiB: ``VmHWM`` since :func:`reset_peak_memory` on Linux, else the
    process's peak (``ru_maxrss``)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)  # bytes / KiB


def peak_is_the_processes() -> bool:
    """Whether :func:`peak_rss_mib` includes earlier jobs of this process (it could not be reset)."""
    return _PEAK["jobs"] > 1 and not _PEAK["reset"]


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_dtype(name: str | None) -> torch.dtype | None:
    """torch dtype from a config string ("float32", "bfloat16", "float16"); None stays None."""
    return None if name is None else getattr(torch, name)


_LOAD_HINT = "Check model.name_or_path (a hub id, which needs the internet or the hub cache, or a local model folder)."


def _first_line(error: Exception) -> str:
    """The first line of ``error``'s message, ending in a full stop."""
    line = (str(error).strip().splitlines() or [type(error).__name__])[0].strip()
    return line if line.endswith(".") else line + "."


def load_tokenizer(model_config: DictConfig):
    """The tokenizer of ``model.tokenizer_name_or_path``, else built by ``model.tokenizer_class``, else
    ``model.name_or_path``'s, with pad set to EOS if absent and ``model.chat_template`` (a file or Jinja
    string) applied.

    Raises:
        ConfigError: when the tokenizer cannot be loaded, or ``model.chat_template`` is neither a file nor a Jinja
            template.
    """
    import transformers

    path = model_config.get("tokenizer_name_or_path")
    if model_config.get("tokenizer_class") and not path:
        tokenizer = getattr(transformers, model_config.tokenizer_class)()
    else:
        path = path or model_config.name_or_path
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"Could not load the tokenizer {path!r} (model.tokenizer_name_or_path, else model.name_or_path): "
                f"{_first_line(e)} {_LOAD_HINT}"
            ) from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model_config.get("chat_template"):
        tokenizer.chat_template = read_chat_template(model_config.chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """``model.chat_template``: the text of the file it names, or the Jinja string itself.

    Raises:
        ConfigError: if it is neither an existing file nor text with ``{{`` or ``{%``.
    """
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ConfigError(
        f"model.chat_template={value!r} is neither a file nor a Jinja template (no '{{{{' or '{{%'); "
        "give the path of a .jinja file or the template itself."
    )


def transformers_config(model_config: DictConfig, tokenizer=None):
    """The transformers config of the model ``model.*`` describes, without weights (a random model's vocab_size
    and pad/BOS/EOS ids default to the tokenizer's).

    Raises:
        ConfigError: if ``model.config.vocab_size`` is smaller than the tokenizer's vocabulary.
    """
    import transformers

    if model_config.get("config") is not None:
        fields = OmegaConf.to_container(model_config.config, resolve=True)
        if tokenizer is not None:
            if fields.get("vocab_size") is not None and fields["vocab_size"] < len(tokenizer):
                raise ConfigError(
                    f"model.config.vocab_size={fields['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} tokens; "
                    "remove it (it follows the tokenizer) or raise it."
                )
            fields.setdefault("vocab_size", len(tokenizer))
            fields.setdefault("pad_token_id", tokenizer.pad_token_id)
            fields.setdefault("eos_token_id", tokenizer.eos_token_id)
            fields.setdefault("bos_token_id", tokenizer.bos_token_id)
        return transformers.AutoConfig.for_model(**fields)
    return transformers.AutoConfig.from_pretrained(model_config.name_or_path)


def check_parallel_model(config: DictConfig, world_size: int) -> None:
    """Check that tensor parallelism can split this model (TensorParallelTrainer over ``world_size`` processes, or
    FSDPTrainer's ``tensor_parallel_size``).

    Raises:
        ConfigError: for an unsupported family or a head count not divisible by the TP size.
    """
    if config.trainer == "TensorParallelTrainer":
        tp, key = world_size, "world_size"
    else:
        tp, key = (config.get("tensor_parallel_size") or 1) if config.trainer == "FSDPTrainer" else 1, "tensor_parallel_size"
    if tp == 1:
        return
    check_tensor_parallel(transformers_config(config.model), tp, key)


def load_reference(config: DictConfig, tokenizer, apply_archive: bool = True) -> torch.nn.Module:
    """The frozen reference of ``model.*`` (a random one seeded by ``seed``, equal to the policy's start) in
    ``model.reference_dtype`` (null: the policy's), with ``model.archive``'s weights when set and
    ``apply_archive``."""
    dtype = get_dtype(config.model.reference_dtype) or get_dtype(config.model.policy_dtype)
    reference = load_model(config.model, tokenizer, dtype, config.seed)
    if apply_archive and config.model.archive is not None:
        archive = load_weights_file(
            config.model.archive, f"model.archive={config.model.archive}", "give the policy.pt of an earlier run"
        )
        reference.load_state_dict(archive["state"])
    return reference


TP_FAMILIES = ("llama", "gpt_neox", "gpt2")


def check_tensor_parallel(cfg, world_size: int, key: str = "world_size") -> None:
    """Raise ConfigError unless tensor parallelism can split a model with transformers config ``cfg`` over
    ``world_size`` processes; the message names ``key``, the setting to change."""
    family = cfg.model_type
    if family not in TP_FAMILIES:
        fix = (
            "use FSDPTrainer for this model" if key == "world_size" else "set tensor_parallel_size=1 (FSDP alone) for this model"
        )
        raise ConfigError(f"Tensor parallelism supports the Llama, GPT-NeoX (Pythia) and GPT-2 families, not {family!r}; {fix}.")
    heads = cfg.num_attention_heads if family != "gpt2" else cfg.n_head
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % world_size or kv_heads % world_size:
        raise ConfigError(
            f"{heads} attention heads ({kv_heads} key/value heads) cannot be split over {world_size} processes; "
            f"choose a {key} that divides them."
        )


def load_model(
    model_config: DictConfig, tokenizer, dtype: torch.dtype | None, seed: int, reward_head: bool = False
) -> torch.nn.Module:
    """A causal LM from ``model.name_or_path``, or a random one built from ``model.config``, with dropout
    disabled; with ``reward_head``, a one-output sequence-classification model (``loss=reward``; the head
    starts random).

    Raises:
        ConfigError: when the weights cannot be loaded.
    """
    import transformers

    auto = transformers.AutoModelForSequenceClassification if reward_head else transformers.AutoModelForCausalLM
    extra = {"num_labels": 1} if reward_head else {}
    if model_config.get("config") is not None:
        cfg = transformers_config(model_config, tokenizer)
        for key, value in extra.items():
            setattr(cfg, key, value)
        torch.manual_seed(seed)  # same random weights for policy and reference
        model = auto.from_config(cfg, dtype=dtype)
    else:
        kwargs = {"dtype": dtype, **extra}
        if model_config.get("device_map"):
            kwargs["device_map"] = model_config.device_map
        try:
            model = auto.from_pretrained(model_config.name_or_path, **kwargs)
        except (OSError, ValueError) as e:  # no such id or folder, offline, no weights, no model_type
            raise ConfigError(
                f"Could not load model.name_or_path={model_config.name_or_path}: {_first_line(e)} {_LOAD_HINT}"
            ) from e
    if reward_head and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id  # batches are padded
    disable_dropout(model)  # policy and reference must agree at step 0
    return model


def rank0_model(build, rank: int, reward_head: bool = False) -> torch.nn.Module:
    """``build()`` on rank 0; on the other ranks the same architecture on the meta device (from rank 0's configs),
    for the trainers to fill from rank 0.

    Args:
        build: returns the loaded model; called on rank 0 only.
        rank: this process's rank (every rank must call this, in the same order).
        reward_head: the model is a reward model (``AutoModelForSequenceClassification``).

    Raises:
        ConfigError: on every rank, when ``build`` raised a ConfigError or DataError on rank 0.
        RuntimeError: on the other ranks, when ``build`` raised anything else on rank 0.
    """
    import transformers

    model, spec = None, None
    if rank == 0:
        try:
            model = build()
            spec = ("ok", model.config, model.generation_config, next(model.parameters()).dtype)
        except Exception as e:
            from preference_datasets import DataError

            broadcast_object(("config" if isinstance(e, (ConfigError, DataError)) else "error", str(e), None, None))
            raise
    status, config, generation_config, dtype = broadcast_object(spec)
    if rank == 0:
        return model
    if status == "config":
        raise ConfigError(config)
    if status == "error":
        raise RuntimeError(f"Rank 0 could not load the model: {config}")
    auto = transformers.AutoModelForSequenceClassification if reward_head else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, dtype=dtype)
    model.generation_config = generation_config
    disable_dropout(model)
    return model


def keeping_ties(model: torch.nn.Module, apply) -> None:
    """``apply(model)`` (e.g. ``Module.to_empty``) with tied parameters (e.g. embeddings and LM head) tied again
    afterwards."""
    places: dict[int, list[tuple[str, str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        module, _, attr = name.rpartition(".")
        places.setdefault(id(param), []).append((module, attr))
    apply(model)  # to or from meta makes one new parameter per place, untying them
    for (first_module, first_attr), *others in places.values():
        shared = getattr(model.get_submodule(first_module), first_attr)
        for module, attr in others:
            if getattr(model.get_submodule(module), attr) is not shared:
                setattr(model.get_submodule(module), attr, shared)


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0: ``nn.Dropout`` modules, float ``*dropout*``/``*pdrop*``
    attributes (passed to SDPA as ``dropout_p``) and config fields."""
    for module in [model, *model.modules()]:
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if config is not None and module is model:
            for name, value in list(vars(config).items()):
                if ("dropout" in name or "pdrop" in name) and isinstance(value, float):
                    setattr(config, name, 0.0)


# ----------------------------------------------------------------------------- LoRA (peft)


def lora_peft_config(lora: DictConfig):
    """peft's ``LoraConfig`` for ``model.lora`` (causal LM; ``all-linear`` never includes the output layer)."""
    import peft

    targets = lora.target_modules
    targets = list(targets) if OmegaConf.is_list(targets) else targets
    return peft.LoraConfig(
        r=int(lora.r), lora_alpha=lora.alpha, lora_dropout=float(lora.dropout), target_modules=targets, task_type="CAUSAL_LM"
    )


def apply_lora(model: torch.nn.Module, lora: DictConfig) -> torch.nn.Module:
    """``model`` with LoRA adapters injected in place (``peft.get_peft_model``): a ``PeftModel`` with frozen base
    weights and adapters starting as the identity, in the base's dtype and device.

    Raises:
        ConfigError: when ``model.lora.target_modules`` matches no module of ``model`` (naming its linear layers).
    """
    import warnings

    import peft

    try:
        with warnings.catch_warnings():  # peft reads a deprecated transformers attribute
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return peft.get_peft_model(model, lora_peft_config(lora), autocast_adapter_dtype=False)
    except ValueError as e:
        from transformers.pytorch_utils import Conv1D

        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        linear = sorted(
            {
                name.rpartition(".")[2]
                for name, m in model.named_modules()
                if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not output
            }
        )
        targets = lora.target_modules
        targets = "[" + ",".join(targets) + "]" if OmegaConf.is_list(targets) else targets
        raise ConfigError(
            f"model.lora.target_modules={targets} matches no module of {type(model).__name__} ({_first_line(e)[:120]}); "
            f"its linear layers are named {', '.join(linear) or 'nothing'}: name some of them, or all-linear."
        ) from None


def is_lora_model(model) -> bool:
    """True if ``model`` is a ``peft.PeftModel`` (a LoRA policy)."""
    try:
        import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


def base_state_dict(model: torch.nn.Module) -> dict:
    """``model``'s weights named as without adapters: a LoRA policy's adapter entries dropped and ``.base_layer``
    taken out of the names."""
    if is_lora_model(model):
        model = model.get_base_model()
    state = model.state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}


def lora_base_path(config: DictConfig) -> str | None:
    """The base a LoRA run's adapter folder names (``base_model_name_or_path``): the ``hf/`` export beside
    ``model.archive`` if any, else ``model.name_or_path`` (absolute if local); None for a random model or an
    archive without export."""
    model = config.model
    if model.get("archive") is not None:
        beside = os.path.join(os.path.dirname(os.path.realpath(model.archive)), "hf")  # step-N/hf, not LATEST/hf
        return beside if os.path.isfile(os.path.join(beside, "config.json")) else None
    if model.get("config") is not None or model.name_or_path is None:
        return None
    path = str(model.name_or_path)
    return os.path.abspath(os.path.expanduser(path)) if os.path.isdir(os.path.expanduser(path)) else path


def lora_export_model(hf_config, lora: DictConfig, state: dict, base_path: str | None = None) -> torch.nn.Module:
    """A meta-device ``PeftModel`` of ``hf_config`` with ``model.lora``'s adapters, holding ``state`` without
    copying (``assign``), for writing a LoRA run's export.

    Args:
        state: the adapters alone (for ``save_pretrained``) or the whole model (for ``merge_and_unload``), named as
            ``get_base_model().state_dict()``.
        base_path: written into the adapter config.

    Raises:
        ValueError: if ``state`` has names the model does not have, or lacks an adapter weight.
    """
    import transformers

    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # building draws random numbers: resume stays exact
        base = transformers.AutoModelForCausalLM.from_config(hf_config)
        model = apply_lora(base, lora)
    missing, unexpected = base.load_state_dict(state, strict=False, assign=True)
    if unexpected or any(".lora_" in k for k in missing):
        raise ValueError(f"the weights do not fit the LoRA model (e.g. {(unexpected or missing)[0]!r})")
    if getattr(hf_config, "tie_word_embeddings", False):
        base.tie_weights()  # one output layer with the embeddings, also when the state names it once
    model.peft_config["default"].base_model_name_or_path = base_path
    return model


# ----------------------------------------------------------------------------- run folders


def make_run_dir(root: str, exp_name: str) -> str:
    """Create and return ``<root>/<exp_name>_<timestamp>`` (unique)."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")
    path = os.path.join(root, f"{exp_name}_{stamp}")
    os.makedirs(path, exist_ok=False)
    return path


RUN_DIR_STAMP = r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d{6}"
"""The timestamp :func:`make_run_dir` puts after ``<exp_name>_`` (sorts as it was made)."""

FINISHED = "FINISHED"
"""The file rank 0 writes into a run folder when training ends normally, holding the number of examples trained on."""


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temporary file, fsynced, then ``os.replace``).

    Raises:
        DiskFullError: when the disk is full (the old file is left as it was).
    """
    with replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def replacing(path: str, then: str = "try again", tmp: str | None = None):
    """Replace ``path`` atomically with what the body writes into the yielded temporary file (``tmp``, default
    ``<path>.tmp-<pid>``), removed on failure; a full disk is :class:`DiskFullError` (``then``: what to do once
    space is free)."""
    tmp = tmp or f"{path}.tmp-{os.getpid()}"
    try:
        with saying_disk_full(path, "write", then):
            yield tmp
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class DiskFullError(OSError):
    """A file could not be written because its disk is full; the message is one sentence naming
    the file, the space left and what to do."""


NO_SPACE = "no space left on the device"
"""How a full disk is named in every sentence (:func:`no_space`)."""

LOW_FREE_MIB = 16
"""Below this many MiB free, torch.save's short-write RuntimeError (no errno) is taken for a full disk
(:func:`disk_full`)."""


def free_mib(path: str) -> float | None:
    """MiB free to this user on the disk holding ``path`` (or its nearest existing parent); None if unknown."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return None


def no_space(path: str) -> str:
    """``no space left on the device (N MiB free)`` for the disk holding ``path``."""
    free = free_mib(path)
    return NO_SPACE if free is None else f"{NO_SPACE} ({free:.0f} MiB free)"


def disk_full(error: BaseException, path: str) -> bool:
    """Whether ``error`` or its cause/context chain is a full disk: ENOSPC (errno or text), or torch.save's short
    write while ``path``'s disk has under :data:`LOW_FREE_MIB` MiB free."""
    short_write, seen = False, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(error):  # DCP, safetensors wrap it
            return True
        short_write |= isinstance(error, RuntimeError) and any(t in str(error) for t in ("unexpected pos", "file write failed"))
        error = error.__cause__ or error.__context__
    return short_write and (free_mib(path) or 0) < LOW_FREE_MIB


@contextlib.contextmanager
def saying_disk_full(path: str, doing: str = "write", then: str = "try again"):
    """Turn a full disk while the body writes ``path`` into :class:`DiskFullError`: ``Could not
    <doing> <path>: no space left on the device (N MiB free); free space on that disk and <then>.``"""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        if not disk_full(e, path):
            raise
        raise DiskFullError(f"Could not {doing} {path}: {no_space(path)}; free space on that disk and {then}.") from e


def resume_hint(run_dir: str) -> str:
    """What to do after a fault in run folder ``run_dir``: continue from its checkpoint, or start again."""
    checkpoint = checkpoint_to_resume(run_dir)[0]
    if checkpoint is None:
        return "start the run again"
    return f"continue with resume={run_dir} (from {os.path.basename(os.path.realpath(checkpoint))})"


RUN_COMMAND_LINE = "# Made by: "
"""How a run folder's config.yaml begins when the command line that made the run is known (:func:`new_run_dir`)."""


def shell_line(script: str, args: list[str], launcher: str = "python") -> str:
    """``<launcher> <script> <args>`` as a line a shell gives back as these arguments (each quoted where needed)."""
    return " ".join([launcher, shlex.quote(script), *(shlex.quote(a) for a in args)])


def command_text(overrides: list[str]) -> str:
    """The command line that ran train.py with ``overrides`` (torchrun's options are not known here)."""
    return shell_line("train.py", overrides, "torchrun <options>" if "TORCHELASTIC_RUN_ID" in os.environ else "python")


def read_command(run_dir: str) -> str | None:
    """The command line recorded at the top of ``<run_dir>/config.yaml`` (:data:`RUN_COMMAND_LINE`), or None."""
    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            first = f.readline().rstrip("\n")
    except OSError:
        return None
    return first[len(RUN_COMMAND_LINE) :] if first.startswith(RUN_COMMAND_LINE) else None


def save_run_config(config: DictConfig, path: str, command: str | None = None) -> None:
    """Save ``config`` as a run's config.yaml at ``path``, its first line ``# Made by: <command>`` when known."""
    OmegaConf.save(config, path)
    if command is not None:
        with open(path, "r+") as f:
            text = f.read()
            f.seek(0)
            f.write(RUN_COMMAND_LINE + " ".join(command.split("\n")) + "\n" + text)


def local_path(path) -> str:
    """``path`` with its links resolved (a run's ``LATEST`` becomes the ``step-N`` it named) when it exists here; a hub id as it is."""
    expanded = os.path.expanduser(str(path))
    return os.path.realpath(expanded) if os.path.exists(expanded) else str(path)


def new_run_dir(root: str, exp_name: str, config: DictConfig, command: str | None = None) -> tuple[str, RunLock]:
    """A new, locked run folder with ``config`` saved as config.yaml (first line ``# Made by: <command>`` when
    known), removed again if any of that fails; returns the folder and its lock."""
    run_dir, lock = make_run_dir(root, exp_name), None
    try:
        lock = lock_run_dir(run_dir)
        path = os.path.join(run_dir, "config.yaml")
        with saying_disk_full(path, "write", "start the run again"):
            save_run_config(config, path, command)
        return run_dir, lock
    except BaseException:
        for name in (RUN_LOCK, "config.yaml"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(run_dir, name))
        if lock is not None:
            lock.release()
        with contextlib.suppress(OSError):  # anything else in it (not ours) keeps it
            os.rmdir(run_dir)
        raise


def mark_finished(run_dir: str, examples: int) -> None:
    """Write ``<run_dir>/FINISHED`` (:data:`FINISHED`), holding ``examples``, atomically."""
    write_atomic(os.path.join(run_dir, FINISHED), f"{examples}\n")


def resumable_runs(root: str, exp_name: str) -> list[str]:
    """Run folders ``<root>/<exp_name>_<timestamp>`` that ``resume=auto`` may continue (a ``LATEST`` checkpoint, a
    config.yaml, no :data:`FINISHED`), newest first."""
    import re

    if not os.path.isdir(root):
        return []
    pattern = re.compile(re.escape(exp_name) + "_(" + RUN_DIR_STAMP + ")")
    found = []
    for name in os.listdir(root):
        match = pattern.fullmatch(name)
        path = os.path.join(root, name)
        if match is None or not os.path.isdir(path):
            continue
        if (
            os.path.exists(os.path.join(path, "config.yaml"))
            and checkpoint_to_resume(path)[0] is not None
            and not os.path.exists(os.path.join(path, FINISHED))
        ):
            found.append((match.group(1), path))
    return [path for _, path in sorted(found, reverse=True)]  # by the name's timestamp: every node orders them alike


def checkpoint_to_resume(run_dir: str) -> tuple[str | None, str | None]:
    """The checkpoint ``resume=<run_dir>`` continues from (``LATEST``, else the newest intact ``step-N`` with a
    note saying so), or (None, None)."""
    latest = os.path.join(run_dir, "LATEST")
    if os.path.isdir(latest):
        return latest, None
    name = intact_checkpoint(run_dir)
    if name is None:
        return None, None
    folder = os.path.join(run_dir, name)
    target = os.readlink(latest) if os.path.islink(latest) else None
    why = f"LATEST points at {target}, which is missing" if target else "LATEST is missing"
    return folder, f"{why}; continuing from {name}, the newest checkpoint with its files."


RUN_FOLDER_KEYS = ("resume", "output_root", "ray.storage_path", "ray.name")
"""Keys that name where a run is, not what it trains: left out when a new command is compared
with a run's saved config (:func:`config_differences`)."""


def config_differences(saved: DictConfig, new: DictConfig, keys: list[str] | None = None) -> list[tuple[str, object, object]]:
    """``(dotted key, saved value, new value)`` for each leaf where the resolved configs differ (a
    key one lacks: ``"absent"``), in ``saved``'s key order, :data:`RUN_FOLDER_KEYS` left out;
    ``keys`` limits it to those keys and what lies under them (e.g. ``loss`` for ``loss=ipo``)."""
    a, b = flat_config(saved), flat_config(new)

    def inside(key: str, top: str) -> bool:
        return key == top or key.startswith(top + ".")

    out = []
    for key in list(a) + [k for k in b if k not in a]:
        if any(inside(key, skip) for skip in RUN_FOLDER_KEYS):
            continue
        if keys is not None and not any(inside(key, k) for k in keys):
            continue
        va, vb = a.get(key, "absent"), b.get(key, "absent")
        if va != vb:
            out.append((key, va, vb))
    return out


def describe_differences(differences: list[tuple[str, object, object]], limit: int = 3) -> str:
    """``lr (saved 0.003, given 1.0), loss.name (saved dpo, given ipo)``: the first ``limit`` of
    :func:`config_differences`, and how many more."""
    text = ", ".join(f"{k} (saved {override_text(a)}, given {override_text(b)})" for k, a, b in differences[:limit])
    more = len(differences) - limit
    return text + (f" and {more} more" if more > 0 else "")


def examples_fingerprint(examples: list[dict]) -> dict:
    """``{"n": number of examples, "sha256": hex digest of them in order}``, identifying a split's data on resume
    (an example's ``fields`` left out)."""
    import hashlib

    h = hashlib.sha256()
    for example in examples:
        example = {k: v for k, v in example.items() if k != "fields"}  # checkpoints from before fields were kept resume
        h.update(json.dumps(example, sort_keys=True, default=str).encode())
        h.update(b"\n")
    return {"n": len(examples), "sha256": h.hexdigest()}  # plain values: trainer_state.pt loads with weights_only


def data_change(saved: dict | None, now: dict, checkpoint_dir: str, auto: bool = False) -> str | None:
    """One sentence when a split's examples differ from those the checkpoint was trained on (``saved``: ``{split:
    examples_fingerprint}``), else None; ``auto``: the run was picked by ``resume=auto``."""
    if not saved:  # a checkpoint without fingerprints: the caller notes it
        return None
    for split, fp in now.items():
        old = saved.get(split)
        if old is None or (old["n"], old["sha256"]) == (fp["n"], fp["sha256"]):
            continue
        same = " (the same count, other contents)" if old["n"] == fp["n"] else ""
        fresh = "start a fresh run under another exp_name, or " if auto else ""
        return (
            f"The {split} split changed since this run's checkpoint: {old['n']} examples then, {fp['n']} now{same}; "
            f"restore that data to resume, or {fresh}start a new run from the checkpoint's weights (the optimizer and "
            f"learning-rate schedule start anew) with model.archive={os.path.join(os.path.realpath(checkpoint_dir), 'policy.pt')}."
        )
    return None


RUN_LOCK = ".lock"
"""The lock file in every run folder (see :func:`lock_run_dir`)."""

RUN_LOCK_FD_ENV = "DPO_RUN_LOCK_FD"
"""Set by ``train.launch`` in the processes it starts: the file descriptor of the run folder's lock it holds."""


class RunLock:
    """An open, locked ``<run folder>/.lock`` (see :func:`lock_run_dir`); a context manager.

    Attributes:
        fd: the file descriptor holding the lock (pass it to child processes to share the lock).
        path: the lock file.
    """

    def __init__(self, fd: int | None, path: str):
        self.fd = fd
        self.path = path

    def release(self) -> None:
        """Close the descriptor (the lock ends once no process holds one); never ``LOCK_UN``, which would unlock
        it for the processes sharing it too."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_run_dir(run_dir: str) -> RunLock:
    """Hold ``run_dir`` with an exclusive ``flock`` on ``<run_dir>/.lock`` (holding the pid and host), or take
    over the launcher's lock (:data:`RUN_LOCK_FD_ENV`); nothing is locked without ``fcntl``.

    Raises:
        ConfigError: if a live process holds the folder.
    """
    try:
        import fcntl
    except ImportError:  # no flock: nothing to hold
        return RunLock(None, os.path.join(run_dir, RUN_LOCK))
    path = os.path.join(run_dir, RUN_LOCK)
    inherited = os.environ.get(RUN_LOCK_FD_ENV)
    if inherited is not None:
        with contextlib.suppress(OSError, ValueError):
            fd = int(inherited)
            mine, there = os.fstat(fd), os.stat(path)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                del os.environ[RUN_LOCK_FD_ENV]  # taken over once
                os.set_inheritable(fd, False)
                return RunLock(fd, path)
    with saying_disk_full(path, "write the lock file"):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # the file stays; the OS drops the flock when its last holder dies
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        with open(path) as f:
            holder = f.read().strip() or "unknown pid"
        os.close(fd)
        raise ConfigError(
            f"The run folder {run_dir} is in use by a live run ({holder}); wait for that run to end or stop it, then try again."
        ) from None
    try:
        with saying_disk_full(path, "write the lock file"):
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    remove_leftovers(run_dir)  # no writer of this folder is alive now: what they left is garbage
    return RunLock(fd, path)


LEFTOVER_FOLDER = re.compile(r"\..+\.(tmp(-[0-9a-f]{8})?|old-[a-z0-9_]{8})")
"""Temporary folders of writers in a run folder: ``.step-N.tmp-XXXXXXXX`` (:func:`save_checkpoint_dir`),
``.step-N.tmp`` (FSDPTrainer's save), ``.step-N.old-XXXXXXXX`` (:func:`publish_checkpoint`)."""

LEFTOVER_FILE = re.compile(r".+\.tmp-(?P<pid>\d+)|\..+\.tmp|completions\.html\.tmp")
"""Temporary files of writers in a run folder: ``<name>.tmp-<pid>`` (:func:`replacing`), ``.LATEST.tmp``
(:func:`point_latest`), ``completions.html.tmp``."""


def remove_leftovers(run_dir: str) -> None:
    """Remove the temporary files and folders (:data:`LEFTOVER_FOLDER`, :data:`LEFTOVER_FILE`) killed writers left
    in ``run_dir``, printing how many and how big; call it holding the folder's lock."""
    latest = os.path.realpath(os.path.join(run_dir, "LATEST")) + os.sep
    removed, size = [], 0
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            # kept when LATEST leads into it (a kill inside publish_checkpoint)
            if not LEFTOVER_FOLDER.fullmatch(name) or latest.startswith(path + os.sep):
                continue
            size += sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files)
            shutil.rmtree(path, ignore_errors=True)
        else:
            match = LEFTOVER_FILE.fullmatch(name)
            if match is None or (match.group("pid") and pid_alive(int(match.group("pid")))):  # a live pid's file is kept
                continue
            size += os.lstat(path).st_size
            with contextlib.suppress(OSError):
                os.remove(path)
        removed.append(name)
    if removed:
        names = ", ".join(removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
        amount = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 1024:.1f} KiB"
        what = "temporary files and folders" if len(removed) > 1 else "temporary file or folder"
        print(f"Removed {len(removed)} {what} ({amount}) that killed writers left in {run_dir}: {names}.")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (this process included)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # another user's process
        return True
    return True


class CheckpointError(OSError):
    """A checkpoint could not be written (disk full, an I/O error); the message is one sentence
    saying why, that the partial folder was removed and where ``LATEST`` still points."""


def failure_reason(error: BaseException) -> str:
    """``error`` as a short reason for a sentence: its type and the first line of its message."""
    line = (str(error).strip().splitlines() or [""])[0].strip().rstrip(".")
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def load_weights_file(path: str, label: str, fix: str, safe_globals: tuple = ()):
    """``torch.load`` of ``path`` onto the CPU with ``weights_only=True``: tensors, plain values and
    ``safe_globals`` only, so nothing in the file can run code.

    Raises:
        ConfigError: naming the file (``label``) and the fix (``fix``) when it cannot be read or holds anything else.
    """
    import pickle

    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refuses a global, e.g. GLOBAL posix.system, before calling it
        found = re.search(r"GLOBAL (\S+)|but got <class '([^']+)'>", str(e))
        if found is None:  # not a pickle of ours at all (e.g. a text file)
            raise ConfigError(f"{label} could not be read (UnpicklingError); {fix}.") from None
        raise ConfigError(
            f"{label} holds more than tensors and plain values (e.g. {found.group(1) or found.group(2)}), and is not "
            f"loaded because unpickling it could run code; {fix}."
        ) from None
    except Exception as e:  # a missing, truncated or foreign file
        raise ConfigError(f"{label} could not be read ({failure_reason(e)}); {fix}.") from None


def checkpoint_error_message(run_dir: str, name: str, reason: str) -> str:
    """The sentence for checkpoint ``name`` of ``run_dir`` that could not be written: why
    (``reason``; :data:`NO_SPACE` for a full disk, :func:`write_failure`), the disk's free space,
    where ``LATEST`` still points, and how to continue."""
    latest = os.path.join(run_dir, "LATEST")
    full = reason == NO_SPACE
    if full:
        why, fix = f": {no_space(run_dir)}", "free space on that disk"
    else:
        mib = free_mib(run_dir)
        why = f" ({reason}" + ("" if mib is None else f"; {mib:.0f} MiB are free on its disk") + ")"
        fix = "fix the cause"
    if os.path.exists(latest):
        last = os.path.realpath(latest)
        where = f"LATEST still points at the complete {os.path.basename(last)}"
        if full:  # how much the next one needs, about
            size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(last) for f in files)
            fix += f" ({os.path.basename(last)} takes {size / 2**20:.1f} MiB)"
        then = f"{fix} and continue with resume={run_dir}"
    else:
        where, then = "no earlier checkpoint exists", f"{fix} and start the run again"
    return f"Could not write checkpoint {name} in {run_dir}{why}; the partial folder was removed and {where}: {then}."


def save_checkpoint_dir(run_dir: str, name: str, write) -> str:
    """Atomically write checkpoint folder ``<run_dir>/<name>`` (filled by ``write(tmp_dir)``) and point ``LATEST``
    at it; returns its path.

    Raises:
        CheckpointError: when writing or publishing raised an ``Exception`` (``LATEST`` untouched); others
            (KeyboardInterrupt) propagate as they are.
    """
    tmp = None
    try:
        tmp = make_folder(run_dir, f".{name}.tmp-")
        write(tmp)
        return publish_checkpoint(run_dir, name, tmp)
    except BaseException as e:
        reason = write_failure(e, run_dir) if isinstance(e, Exception) else None  # before the partial folder frees space
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if reason is not None and not isinstance(e, CheckpointError):
            raise CheckpointError(checkpoint_error_message(run_dir, name, reason)) from e
        raise


def write_failure(error: Exception, path: str) -> str:
    """Why writing under ``path`` failed, for a sentence: :data:`NO_SPACE` when its disk is full
    (:func:`disk_full`; call it before removing what was written), else :func:`failure_reason`."""
    return NO_SPACE if disk_full(error, path) else failure_reason(error)


def make_folder(parent: str, prefix: str) -> str:
    """A new folder ``<parent>/<prefix><random hex>`` with the mode ``mkdir`` gives (0o777 less the
    umask), unlike ``tempfile.mkdtemp``'s 0o700, so a checkpoint's folder is as shared as any other."""
    import secrets

    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def publish_checkpoint(run_dir: str, name: str, tmp: str) -> str:
    """Rename the complete folder ``tmp`` to ``<run_dir>/<name>`` and swap ``LATEST`` to it, ``LATEST`` naming a
    complete checkpoint at every moment; returns its path."""
    write_checkpoint_manifest(tmp)  # last into the folder: what resume checks (checkpoint_damage)
    final = os.path.join(run_dir, name)
    if os.path.exists(final):  # LATEST: the new folder, the old one moved aside, then the new one in place
        point_latest(run_dir, os.path.basename(tmp))
        old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=run_dir)
        os.replace(final, os.path.join(old, name))
        point_latest(run_dir, os.path.join(os.path.basename(old), name))
        os.replace(tmp, final)
        point_latest(run_dir, name)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
        point_latest(run_dir, name)
    return final


CHECKPOINT_MANIFEST = "manifest.json"
"""In each checkpoint folder, written last before it is published: ``{relative path: bytes}`` of
every other file, which :func:`checkpoint_damage` compares with the folder before a resume loads anything."""


def write_checkpoint_manifest(folder: str) -> None:
    """Write :data:`CHECKPOINT_MANIFEST` into the checkpoint ``folder``: each file's path and size."""
    sizes = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            sizes[os.path.relpath(path, folder)] = os.path.getsize(path)
    with open(os.path.join(folder, CHECKPOINT_MANIFEST), "w") as f:
        json.dump(dict(sorted(sizes.items())), f, indent=1)


def cut_torch_archive(path: str) -> bool:
    """Whether the ``torch.save`` file ``path`` (a zip archive) was cut short (an interrupted copy,
    a full disk): it begins as a zip archive but has lost the central directory at its end."""
    import zipfile

    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return False  # not a zip archive at all: the loader says what it is
    try:
        with zipfile.ZipFile(path):
            return False
    except zipfile.BadZipFile:
        return True


def checkpoint_file_problem(folder: str, name: str, size: int | None = None) -> str | None:
    """What is wrong with file ``name`` of checkpoint ``folder`` (``is missing``, ``is empty``, ``is cut short
    ...``), or None; ``size``: bytes the manifest recorded (``.pt``/``.metadata`` are judged by their zip
    directory instead)."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return "is missing"
    have = os.path.getsize(path)
    written = "" if size is None else f" of the {size} written"
    if have == 0 and size != 0:
        return f"is empty (0 bytes{written})"
    if name.endswith((".pt", ".metadata")):  # a restricted unpickler reads these: one rewritten whole is left to it
        return f"is cut short ({have} bytes{written}; its zip directory is gone)" if cut_torch_archive(path) else None
    if size is None or have == size:
        return None
    return f"is cut short ({have} of its {size} bytes)" if have < size else f"has {have} bytes, not the {size} written"


def checkpoint_damage(folder: str) -> list[tuple[str, str]]:
    """The damaged files of checkpoint ``folder`` as (path inside it, what is wrong): those
    :data:`CHECKPOINT_MANIFEST` lists but ``hf/``, or without a manifest those every resume reads."""
    manifest = os.path.join(folder, CHECKPOINT_MANIFEST)
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                sizes = json.load(f)
        except (OSError, ValueError) as e:
            return [(CHECKPOINT_MANIFEST, f"could not be read ({failure_reason(e)})")]
    else:  # FSDP/TP keep the optimizer in sharded/
        sharded = os.path.isdir(os.path.join(folder, "sharded"))
        sizes = dict.fromkeys(
            ["policy.pt", "optimizer.pt" if not sharded else "sharded/.metadata", "scheduler.pt", "trainer_state.pt"]
        )
    found = ((name, checkpoint_file_problem(folder, name, size)) for name, size in sizes.items() if not name.startswith("hf/"))
    return [(name, problem) for name, problem in found if problem is not None]


def intact_checkpoint(run_dir: str, but: str | None = None) -> str | None:
    """The newest ``step-N`` folder of ``run_dir`` (other than ``but``) whose files are whole
    (:func:`checkpoint_damage`), or None."""
    steps = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        match = re.fullmatch(r"step-(\d+)", name)
        if match and name != but and os.path.isdir(os.path.join(run_dir, name)):
            steps.append((int(match.group(1)), name))
    return next((name for _, name in sorted(steps, reverse=True) if not checkpoint_damage(os.path.join(run_dir, name))), None)


def damaged_checkpoint_message(folder: str, damage: list[tuple[str, str]]) -> str:
    """The sentence for the checkpoint ``folder`` whose files ``damage`` (:func:`checkpoint_damage`)
    are not whole: the first, and how to resume from the newest intact ``step-N`` of its run."""
    path = os.path.realpath(folder)
    run_dir, step = os.path.split(path)
    name, problem = damage[0]
    more = f" (and {len(damage) - 1} more file{'s' if len(damage) > 2 else ''})" if len(damage) > 1 else ""
    other = intact_checkpoint(run_dir, but=step) if re.fullmatch(r"step-\d+", step) else None
    if other is not None:  # LATEST pointed back at it; resume= takes a run folder
        fix = f"resume from {other}, which is intact: ln -sfn {other} {run_dir}/LATEST && python train.py resume={run_dir}"
    elif os.path.exists(os.path.join(run_dir, "config.yaml")):
        fix = f"no other checkpoint of {run_dir} is intact: restore that file, or start the run again with its config ({run_dir}/config.yaml)"
    else:
        fix = "restore that file"
    return f"The checkpoint {path} is damaged: {name} {problem}{more}; {fix}."


def check_checkpoint(folder: str) -> None:
    """Check, before anything is loaded from it, that the checkpoint ``folder``'s files are whole.

    Raises:
        ConfigError: :func:`damaged_checkpoint_message` when one is missing or cut short.
    """
    damage = checkpoint_damage(folder)
    if damage:
        raise ConfigError(damaged_checkpoint_message(folder, damage))


def point_latest(run_dir: str, name: str) -> None:
    """Swap the ``<run_dir>/LATEST`` symlink to ``name`` atomically (a new link, then ``os.replace``)."""
    link_tmp = os.path.join(run_dir, ".LATEST.tmp")
    if os.path.lexists(link_tmp):
        os.remove(link_tmp)
    os.symlink(name, link_tmp)
    os.replace(link_tmp, os.path.join(run_dir, "LATEST"))


def prune_checkpoints(run_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` step-N folders up to LATEST's, never the one LATEST points to."""
    if keep is None or keep <= 0:
        return
    latest = os.path.realpath(os.path.join(run_dir, "LATEST"))
    name = os.path.basename(latest)
    newest = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None
    steps = sorted(
        (d for d in os.listdir(run_dir) if d.startswith("step-") and d[5:].isdigit()),
        key=lambda d: int(d[5:]),
    )
    if newest is not None:  # folders past LATEST (a damaged one a resume went back from) are replaced, not counted
        steps = [d for d in steps if int(d[5:]) <= newest]
    for d in steps[:-keep]:
        if os.path.realpath(os.path.join(run_dir, d)) != latest:
            shutil.rmtree(os.path.join(run_dir, d))


# ----------------------------------------------------------------------------- metrics


def rewind_jsonl(path: str, step: int) -> int:
    """Drop the records of JSON-lines file ``path`` whose ``"step"`` is above ``step`` (and a line cut short),
    rewriting it atomically; returns how many lines were dropped.

    Raises:
        DiskFullError: when the disk is full (the file is left as it was).
    """
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), (int, float)) and record["step"] > step:
                dropped += 1
            else:
                kept.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        with replacing(path, f"resume again ({os.path.basename(path)} is unchanged)") as tmp, open(tmp, "w") as f:
            f.writelines(kept)
    return dropped


def jsonl_records(path: str) -> list[dict]:
    """The records of the JSON-lines file ``path``, less a line cut short by a crash."""
    records = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


class MetricsLogger:
    """Append metrics to ``<run_dir>/metrics.jsonl`` and, if enabled, to Weights & Biases; a resumed run
    (``resume_id``) continues its W&B run, opened by :meth:`rewind`."""

    def __init__(self, run_dir: str, config: DictConfig, resume_id: str | None = None, enabled: bool = True):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.enabled = enabled  # False on every process but rank 0
        self.wandb = None
        self.run_id = resume_id
        self._wandb_init = None  # wandb.init's arguments until the run is opened
        if enabled and config.wandb.enabled and config.wandb.mode != "disabled":
            self._wandb_init = {
                "entity": config.wandb.entity,
                "project": config.wandb.project,
                "name": config.exp_name,
                "mode": config.wandb.mode,
                "dir": run_dir,
                "config": OmegaConf.to_container(config, resolve=True),
            }
            if resume_id is None:
                self._open_wandb()

    def _open_wandb(self, rewind_to: int | None = None) -> None:
        """Open the W&B run: a new one, else run ``run_id`` rewound to step ``rewind_to`` (``resume_from``), else
        continued (``resume="allow"``; W&B ignores steps it already has)."""
        import wandb

        kwargs, self._wandb_init = self._wandb_init, None
        run = None
        if self.run_id is None:
            run = wandb.init(**kwargs)
        elif rewind_to is not None:
            try:
                run = wandb.init(**kwargs, resume_from=f"{self.run_id}?_step={int(rewind_to)}")
            except Exception as e:  # rewind is a W&B preview feature that a server may refuse
                print(
                    f"Note: W&B could not rewind run {self.run_id} to step {int(rewind_to)} ({failure_reason(e)}); "
                    "continuing it instead, where W&B ignores the steps it already has."
                )
        if run is None:
            run = wandb.init(**kwargs, id=self.run_id, resume="allow")
        self.wandb = run
        self.run_id = run.id

    def rewind(self, step: int) -> int:
        """Drop the metrics.jsonl records logged after a checkpoint of ``step`` examples and open the resumed W&B
        run rewound to ``step``; returns how many were dropped."""
        if not self.enabled:
            return 0
        dropped = rewind_jsonl(self.path, step)
        if self._wandb_init is not None:
            self._open_wandb(rewind_to=step)
        return dropped

    def log(self, metrics: dict, step: int) -> None:
        """Write one record; ``step`` is the example counter (a full disk: :class:`DiskFullError`)."""
        if not self.enabled:
            return
        clean = {k: (float(v) if isinstance(v, (int, float, np.floating)) else v) for k, v in metrics.items()}
        with saying_disk_full(self.path, "append to", resume_hint(os.path.dirname(self.path))), open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self._wandb_init is not None:
            self._open_wandb()
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

    def log_table(self, name: str, columns: list[str], rows: list[list], step: int) -> None:
        """Log a table (e.g. samples) to W&B; the trainer writes the same rows to a file."""
        if self._wandb_init is not None:
            self._open_wandb()
        if self.wandb is not None:
            import wandb

            self.wandb.log({name: wandb.Table(columns=columns, data=rows)}, step=step)

    def finish(self) -> None:
        """Close the W&B run, if any."""
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _curve_rules(loss: str | None, average_log_prob: bool) -> list[tuple]:
    """(key pattern, panel, title, y label, y limits) in panel order; panel None: not plotted.
    Units: log-probabilities, rewards (β·log-ratio), KL and DPO/SFT losses are in nats."""
    objective = losses.OBJECTIVES.get(loss) if loss is not None else None
    loss_unit = objective.unit if objective is not None else "nats, −log σ(β·log-ratio gap)"
    logp_unit = "nats per token, mean over response tokens" if average_log_prob else "nats, summed over response tokens"
    fraction = (-0.02, 1.02)
    return [
        (r"^(memory|counters)/|^answers_eval/n$", None, "", "", None),  # one value at the end / the x axis / a count
        (r"/accuracies$", "accuracy", "pair accuracy", "accuracy (fraction of pairs, chosen > rejected)", fraction),
        (r"^answers_eval/", "answers_eval", "the policy's greedy answers (eval)", "mean score (exact checks: share right)", None),
        (r"^loss/", "loss", "loss", f"loss ({loss_unit})", None),
        (r"^rewards(_train)?/", "rewards_train", "implicit rewards (train)", "reward β·log(π/π_ref) (nats)", None),
        (r"^rewards_eval/", "rewards_eval", "implicit rewards (eval)", "reward β·log(π/π_ref) (nats)", None),
        (r"^logps_train/", "logps_train", "policy log-probabilities (train)", f"log-probability ({logp_unit})", None),
        (r"^logps_eval/", "logps_eval", "policy log-probabilities (eval)", f"log-probability ({logp_unit})", None),
        (r"^scores_train/", "scores_train", "reward-model scores (train)", "score (logit)", None),
        (r"^scores_eval/", "scores_eval", "reward-model scores (eval)", "score (logit)", None),
        (
            r"^objective/(kl|entropy|non_score_reward)$",
            "objective_kl",
            "KL to the reference, entropy",
            "nats per completion",
            None,
        ),
        (
            r"^(objective/(scores|scores_margin|rlhf_reward)|eval/scores)$",
            "scores",
            "reward-model scores of samples",
            "score (logit)",
            None,
        ),
        (
            r"contain_eos_token$|^online/(ties|failed_judgements|labelled_pairs)$",
            "online_fractions",
            "online pairs",
            "fraction (0-1)",
            fraction,
        ),
        (r"completion_length$", "completion_length", "completion length", "tokens per completion", None),
        (r"^lr$", "lr", "learning rate", "learning rate (per optimizer step)", None),
        (r"^grad_norm$", "grad_norm", "gradient norm", "gradient L2 norm (before clipping)", None),
        (r"^examples_per_second$", "examples_per_second", "throughput", "examples / s", None),
        (r"^tokens_per_second$", "tokens_per_second", "throughput", "non-padding tokens / s", None),
        (r"^beta$", "beta", "beta", "β", None),
    ]


def curve_panels(series: dict[str, list], loss: str | None = None, average_log_prob: bool = False) -> list[dict]:
    """The plan of :func:`plot_curves`: which panel each metric goes to, with its title and y label (one unit per
    panel).

    Args:
        series: metric key -> its (step, value) points.
        loss: ``loss.name`` (the loss's unit), None if unknown.
        average_log_prob: log-probabilities are per-token means (``loss.average_log_prob``).

    Returns:
        [{"name": file stem, "title", "ylabel", "ylim": (lo, hi) or None, "keys": sorted}], in panel order,
        leaving out panels with no series of two points or more.
    """
    import re

    rules = _curve_rules(loss, average_log_prob)
    panels: dict[str, dict] = {}
    order = {rule[1]: i for i, rule in enumerate(rules)}
    for key in series:
        rule = next((r for r in rules if re.search(r[0], key)), None)
        if rule is None:  # a key no rule knows: a panel per prefix
            prefix = key.split("/")[0]
            rule = (None, prefix, prefix, prefix, None)
        _, name, title, ylabel, ylim = rule
        if name is None:
            continue
        panel = panels.setdefault(name, {"name": name, "title": title, "ylabel": ylabel, "ylim": ylim, "keys": []})
        panel["keys"].append(key)
    plan = []
    for panel in sorted(panels.values(), key=lambda p: (order.get(p["name"], len(order)), p["name"])):
        if max(len(series[k]) for k in panel["keys"]) >= 2:
            plan.append({**panel, "keys": sorted(panel["keys"])})
    return plan


def plot_curves(run_dir: str, out_dir: str | None = None, panels: tuple[str, ...] | None = None) -> list[str]:
    """Write one PNG per :func:`curve_panels` panel (x axis: examples seen) from ``metrics.jsonl`` into
    ``out_dir`` (default ``<run_dir>/curves/``), removing stale PNGs; ``panels``: only these; returns the files
    written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    series: dict[str, list[tuple[int, float]]] = {}
    for rec in jsonl_records(path):
        for k, v in rec.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                series.setdefault(k, []).append((rec["step"], v))
    loss, average = None, False
    saved = os.path.join(run_dir, "config.yaml")
    if os.path.exists(saved):
        loss_config = OmegaConf.load(saved).get("loss") or {}
        loss, average = loss_config.get("name"), bool(loss_config.get("average_log_prob", False))
    plan = [p for p in curve_panels(series, loss, average) if panels is None or p["name"] in panels]
    out_dir = out_dir or os.path.join(run_dir, "curves")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for panel in plan:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in panel["keys"]:
            xs, ys = zip(*series[key])
            ax.plot(xs, ys, label=key, marker="." if len(xs) < 30 else None)
        ax.set_xlabel("examples seen")
        ax.set_ylabel(panel["ylabel"])
        ax.set_title(panel["title"])
        if panel["ylim"] is not None:
            ax.set_ylim(*panel["ylim"])
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        file = os.path.join(out_dir, f"{panel['name']}.png")
        fig.tight_layout()
        fig.savefig(file, dpi=100)
        plt.close(fig)
        written.append(file)
    for stale in set(os.listdir(out_dir)) - {os.path.basename(f) for f in written}:
        if stale.endswith(".png"):
            os.remove(os.path.join(out_dir, stale))
    return written


def formatted_dict(d: dict) -> dict:
    """Round floats for printing."""
    return {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in d.items()}


# ----------------------------------------------------------------------------- distributed


def check_gpu_count(n_local: int, what: str = "world_size") -> None:
    """Check that this machine has a GPU for each process to start (else CUDA's "invalid device ordinal" later);
    nothing to check without CUDA.

    Args:
        n_local: the processes to start on this machine.
        what: how the user chose that number, for the sentence (``world_size=4``).

    Raises:
        ConfigError: when ``n_local`` exceeds ``torch.cuda.device_count()``.
    """
    if not torch.cuda.is_available():
        return
    n_gpus = torch.cuda.device_count()
    if n_local > n_gpus:
        raise ConfigError(
            f"{what} asks for {n_local} processes on this machine, one per GPU, but it has {n_gpus} GPU"
            f"{'' if n_gpus == 1 else 's'}; start at most {n_gpus} (world_size={n_gpus}, or torchrun --nproc_per_node={n_gpus})."
        )


def init_distributed(timeout_minutes: float = DEFAULT_DIST_TIMEOUT_MINUTES) -> int:
    """Join the process group torchrun describes (NCCL on GPUs, bound to ``cuda:<LOCAL_RANK>``; gloo on CPU);
    returns the rank.

    Args:
        timeout_minutes: how long a collective waits for the other ranks before the run aborts
            (``dist_timeout_minutes``).

    Raises:
        ConfigError: on every rank, when this machine has fewer GPUs than processes (``LOCAL_WORLD_SIZE``).
    """
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
        dist.init_process_group(backend, **kwargs)
    return dist.get_rank()


def broadcast_object(obj):
    """``obj`` as rank 0 has it, on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ----------------------------------------------------------------------------- several nodes: the same run everywhere

REPO_DIR = os.path.dirname(os.path.abspath(__file__))


def flat_config(config: DictConfig) -> dict:
    """``config`` resolved, as ``{dotted key: value}`` (``"loss.beta": 0.1``); lists and empty
    mappings are values, in the config's order."""
    flat: dict = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(OmegaConf.to_container(config, resolve=True), "")
    return flat


def code_files(repo: str = REPO_DIR) -> dict[str, str]:
    """The code version of the checkout ``repo``: ``{path: sha256 of its contents}`` of its
    top-level ``.py`` files and ``config/**/*.yaml``, paths relative to ``repo`` with ``/``."""
    import glob
    import hashlib

    paths = glob.glob(os.path.join(repo, "*.py")) + glob.glob(os.path.join(repo, "config", "**", "*.yaml"), recursive=True)
    files = {}
    for path in sorted(paths):
        with open(path, "rb") as f:
            files[os.path.relpath(path, repo).replace(os.sep, "/")] = hashlib.sha256(f.read()).hexdigest()
    return files


def digest(obj) -> str:
    """A sha256 of ``obj`` (JSON-able, or ``str()`` of what is not), the same on every machine."""
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


CONFIG_CHECK_SKIPS = ("output_root",)
"""Keys left out of the config check across ranks: output_root is checked by what it must do
(:func:`check_shared_output_root`), since two nodes may mount one file system at two paths."""


def run_identity(config: DictConfig, host: str | None = None, repo: str = REPO_DIR) -> dict:
    """What every rank must agree on, with the host for messages: ``{"host", "config" (flat,
    without :data:`CONFIG_CHECK_SKIPS`), "config_hash", "code" (:func:`code_files`), "code_hash"}``."""
    flat = {k: v for k, v in flat_config(config).items() if k not in CONFIG_CHECK_SKIPS}
    code = code_files(repo)
    return {
        "host": host or socket.gethostname(),
        "config": flat,
        "config_hash": digest(flat),
        "code": code,
        "code_hash": digest(code),
    }


_UNSET = object()


def override_text(value) -> str:
    """``value`` as it would be written on the command line (``null``, ``true``, ``[hh,shp]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def identity_mismatch(identities: list[dict], auto_resume: bool = False) -> str | None:
    """One sentence naming how the first rank that differs from rank 0 differs (code first, then the first
    differing config key), or None.

    Args:
        identities: :func:`run_identity` of every rank, in rank order.
        auto_resume: the command said ``resume=auto`` (a differing ``resume`` is then what the ranks found).
    """
    base = identities[0]
    h0 = base["host"]
    for rank, other in enumerate(identities[1:], start=1):
        who = f"Rank {rank} (host {other['host']})"
        if other["code_hash"] != base["code_hash"]:
            names = list(base["code"]) + [p for p in other["code"] if p not in base["code"]]
            path = next((p for p in names if base["code"].get(p) != other["code"].get(p)), "a file")
            return f"{who} runs other code than rank 0 (host {h0}): {path} differs; give every node the same checkout."
        if other["config_hash"] == base["config_hash"]:
            continue
        mine, theirs = base["config"], other["config"]
        keys = list(mine) + [k for k in theirs if k not in mine]
        key = next((k for k in keys if mine.get(k, _UNSET) != theirs.get(k, _UNSET)), None)
        if key is None:
            return f"{who} was started with another config than rank 0 (host {h0}); start every node with the same command."
        if key == "resume" and auto_resume:
            return (
                f"resume=auto found resume={override_text(theirs.get(key))} on rank {rank} (host {other['host']}) but "
                f"resume={override_text(mine.get(key))} on rank 0 (host {h0}); every node must see the same output_root."
            )
        said = [f"with {key}={override_text(values[key])}" if key in values else f"without {key}" for values in (theirs, mine)]
        return f"{who} was started {said[0]}, rank 0 (host {h0}) {said[1]}; start every node with the same command."
    return None


def check_same_run(config: DictConfig, auto_resume: bool = False) -> None:
    """All-gather every rank's :func:`run_identity` and compare it with rank 0's (a collective, before any model loads).

    Raises:
        ConfigError: on every rank, when a rank was given another config (``output_root`` aside) or runs other code.
    """
    problem = identity_mismatch(all_gather_object(run_identity(config)), auto_resume)
    if problem is not None:
        raise ConfigError(problem)


SHARED_MARKER = ".shared-"
"""The prefix of the file :func:`check_shared_output_root` writes into ``output_root`` (then removes)."""


def _sees(path: str, wait_s: float) -> bool:
    """Whether ``path`` exists, asking again for up to ``wait_s`` seconds (a network file system
    may show a new file late; listing the folder makes NFS look again)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError):
            if os.path.exists(path) or os.path.basename(path) in os.listdir(os.path.dirname(path) or "."):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_shared_output_root(output_root: str, rank: int, wait_s: float = 5.0) -> None:
    """Check that every rank sees ``output_root`` as rank 0 does: rank 0 writes a ``.shared-<random>`` file there
    for every rank to find within ``wait_s`` seconds, then removes it (a collective).

    Raises:
        ConfigError: on every rank, when rank 0 cannot write there or a rank does not see the file.
    """
    import uuid

    host = socket.gethostname()
    name = failure = None
    if rank == 0:
        name = f"{SHARED_MARKER}{uuid.uuid4().hex}"
        try:
            os.makedirs(output_root, exist_ok=True)
            write_atomic(os.path.join(output_root, name), f"written by rank 0 on {host}\n")
        except OSError as e:
            failure = f"output_root={output_root} cannot be written on rank 0 (host {host}): {failure_reason(e)}; give a folder it can write."
    name, failure = broadcast_object((name, failure))
    if failure is not None:
        raise ConfigError(failure)
    try:
        seen = all_gather_object((_sees(os.path.join(output_root, name), wait_s), host, output_root))
    finally:
        if rank == 0:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(output_root, name))
    blind = next((r for r, (ok, _, _) in enumerate(seen) if not ok), None)
    if blind is not None:
        _, where, theirs = seen[blind]
        root = seen[0][2]
        there = f", looking in output_root={theirs}" if theirs != root else ""
        raise ConfigError(
            f"output_root={root} is not shared: rank {blind} (host {where}{there}) does not see the file "
            f"rank 0 (host {seen[0][1]}) wrote there; put output_root on a file system every node mounts at the same path."
        )
