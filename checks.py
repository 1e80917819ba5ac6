"""Every config rule, checked once where a job starts, and the checks that all ranks run the same job."""

from __future__ import annotations

import contextlib
import difflib
import os
import socket

import torch
from omegaconf import DictConfig, OmegaConf

import checkpoints
import losses
import utils

TRAINERS = ("BasicTrainer", "FSDPTrainer", "TensorParallelTrainer")

SCORERS = ("reward_model", "reward_model_judge", "http_judge", "reward_function")  # values of online.scorer, evaluate.py's judge

FLOAT16_UNSAFE_OPTIMIZERS = ("Adam", "AdamW", "RMSprop")
"""Optimizers whose epsilon and state underflow in float16 weights, making every weight NaN at the first step."""


# ----------------------------------------------------------------------------- config


def validate_config(config: DictConfig, world_size: int = 1) -> None:
    """Raise ConfigError naming the first bad key of the composed config and its fix, before any data or model loads."""
    validate_numbers(config)
    utils.validate_malloc_mmap_threshold(config.get("malloc_mmap_threshold_mib"))
    objective = validate_objective(config)
    validate_reference_update(config, objective)
    validate_online(config)
    validate_lora(config, objective)
    validate_hub(config)
    validate_datasets(config)
    validate_batch_split(config, objective, world_size)
    validate_training(config)
    validate_choices(config)
    validate_model(config)


def validate_objective(config: DictConfig):
    """The ``losses.Objective`` of ``config.loss``, checked against the trainer and ``precompute_ref_log_probs``."""
    loss = config.loss
    try:
        objective = losses.validate_loss_config(loss)
    except losses.ObjectiveConfigError as e:
        raise utils.ConfigError(str(e)) from None
    if objective.score_head and config.trainer == "TensorParallelTrainer":
        raise utils.ConfigError(
            f"loss={loss.name} trains with BasicTrainer or FSDPTrainer; TensorParallelTrainer splits only causal LMs."
        )
    if config.precompute_ref_log_probs and not objective.uses_reference(loss):
        raise utils.ConfigError(
            f"loss={loss.name} uses no reference model, so precompute_ref_log_probs=true has nothing to compute; set it false."
        )
    if config.precompute_ref_log_probs and objective.mismatched_kl:
        raise utils.ConfigError(
            f"loss={loss.name} needs the reference's log-probs of each prompt paired with another example's completion, "
            "pairs that change with every shuffled batch, so precompute_ref_log_probs=true cannot cache them; set it false."
        )
    return objective


def validate_datasets(config: DictConfig) -> None:
    """Check that ``datasets`` is a list of registered names (prompt-only ones for online DPO alone)."""
    from preference_datasets import REGISTRY

    online = bool(config.get("online") and config.online.enabled)
    if not OmegaConf.is_list(config.datasets):
        raise utils.ConfigError(f"datasets must be a list: write datasets=[{config.datasets}], not datasets={config.datasets}.")
    for name in config.datasets:
        if name in REGISTRY and "pairs" not in REGISTRY[name] and not online:
            raise utils.ConfigError(f"Dataset {name!r} has prompts only; use it for online DPO (online.enabled=true).")
        if name not in REGISTRY:
            known = sorted(REGISTRY)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise utils.ConfigError(f"Unknown dataset {name!r} in datasets; {hint}registered datasets are {known}.")


def validate_batch_split(config: DictConfig, objective, world_size: int) -> None:
    """Check that ``batch_size`` splits into accumulation steps and data-parallel parts over ``world_size`` processes."""
    if config.batch_size % config.gradient_accumulation_steps:
        raise utils.ConfigError(
            f"batch_size ({config.batch_size}) must be divisible by gradient_accumulation_steps ({config.gradient_accumulation_steps})."
        )
    tp = config.get("tensor_parallel_size") or 1
    if tp != 1:
        if not isinstance(tp, int) or tp < 1:
            raise utils.ConfigError(f"tensor_parallel_size must be a whole number >= 1, got {tp}.")
        if config.trainer != "FSDPTrainer":
            raise utils.ConfigError(
                f"tensor_parallel_size is for trainer=FSDPTrainer (2-D FSDP x TP); {config.trainer} does not use it: remove it."
            )
        if objective.score_head:
            raise utils.ConfigError(
                f"loss={config.loss.name} does not support tensor_parallel_size > 1 (tensor parallelism splits causal LMs); remove it."
            )
        if world_size % tp:
            raise utils.ConfigError(f"tensor_parallel_size ({tp}) must divide the number of processes ({world_size}).")
    data_parallel = data_parallel_size(config, world_size)
    if config.batch_size % data_parallel:
        groups = "processes" if tp == 1 else "data-parallel groups (processes / tensor_parallel_size)"
        raise utils.ConfigError(
            f"batch_size ({config.batch_size}) must be divisible by the number of {groups} ({data_parallel})."
        )


def validate_training(config: DictConfig) -> None:
    """Check the lengths, the training length, the optimizer and its dtype, and the per-step knobs."""
    if config.max_prompt_length >= config.max_length:
        raise utils.ConfigError(
            f"max_prompt_length ({config.max_prompt_length}) must be smaller than max_length ({config.max_length})."
        )
    if config.n_examples is None and config.n_epochs is None:
        raise utils.ConfigError("Set n_epochs or n_examples (e.g. n_epochs=1).")
    if config.optimizer not in ("RMSprop", "AdamW", "Adam", "SGD"):
        raise utils.ConfigError(f"optimizer must be one of RMSprop, AdamW, Adam, SGD, got {config.optimizer}.")
    if config.model.get("policy_dtype") == "float16" and config.optimizer in FLOAT16_UNSAFE_OPTIMIZERS:
        raise utils.ConfigError(
            f"model.policy_dtype=float16 with optimizer={config.optimizer} turns the weights into NaN at the first step "
            f"(its epsilon 1e-8 is 0 in float16, and so is the square of a small gradient); use model.policy_dtype=bfloat16, "
            "or float32 weights with model.fsdp_policy_mp=float16 under trainer=FSDPTrainer for float16 compute."
        )
    foreach = config.get("optimizer_foreach")
    if foreach is not None and not isinstance(foreach, bool):
        raise utils.ConfigError(
            f"optimizer_foreach must be true, false or null (torch's default: foreach kernels on GPU), got {foreach!r}."
        )
    chunk = config.get("output_layer_chunk")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
        raise utils.ConfigError(
            f"output_layer_chunk must be a whole number of positions >= 0 (0 or null: the output layer over all "
            f"positions at once), got {chunk!r}; e.g. output_layer_chunk=1024."
        )
    timeout = config.get("dist_timeout_minutes", utils.DEFAULT_DIST_TIMEOUT_MINUTES)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise utils.ConfigError(
            f"dist_timeout_minutes must be a number of minutes > 0 (how long a rank waits for the others "
            f"before the run aborts), got {timeout!r}; e.g. dist_timeout_minutes=60."
        )


CHOICES = (  # (the key's value, the values allowed, the message with {} for the value), checked in this order
    (lambda c: c.lr_scheduler, ("constant", "linear", "cosine"), "lr_scheduler must be constant, linear or cosine, got {}."),
    (lambda c: c.wandb.mode, ("online", "offline", "disabled"), "wandb.mode must be online, offline or disabled, got {}."),
    (lambda c: c.trainer, TRAINERS, "trainer={} is unknown; choose one of " + ", ".join(TRAINERS) + "."),
    (lambda c: c.get("launcher", "local"), ("local", "ray"), "launcher={} is unknown; choose launcher=local or launcher=ray."),
)


def validate_choices(config: DictConfig) -> None:
    """Check that each :data:`CHOICES` key has one of its allowed values."""
    for value_of, allowed, message in CHOICES:
        value = value_of(config)
        if value not in allowed:
            raise utils.ConfigError(message.format(value))


def validate_model(config: DictConfig) -> None:
    """Check ``model.name_or_path``, ``model.config`` and ``model.archive`` name something that can be loaded."""
    if OmegaConf.is_missing(config.model, "name_or_path"):  # model=blank_model (or a preset built on it) alone
        raise utils.ConfigError("model=blank_model needs the model to load: add model.name_or_path=<a hub id or a local folder>.")
    if config.model.name_or_path is None and config.model.get("config") is None:
        raise utils.ConfigError("Set model.name_or_path (a hub id or a local folder), or model.config to build a random model.")
    if config.get("resume") is None:  # a fresh run (a resumed one keeps what it started with)
        problem = model_contradiction(config)
        if problem is not None:
            raise utils.ConfigError(problem)
    path = config.model.name_or_path
    if (
        path is not None
        and config.model.get("config") is None
        and looks_local(path)
        and not os.path.isdir(os.path.expanduser(path))
    ):
        raise utils.ConfigError(f"model.name_or_path={path} is not a folder; give a local Hugging Face model folder or a hub id.")
    if config.model.archive is not None and not os.path.exists(config.model.archive):
        raise utils.ConfigError(f"model.archive={config.model.archive} does not exist; give the policy.pt of an earlier run.")
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
        raise utils.ConfigError(f"model.archive={folder} is a folder; give a checkpoint's policy.pt: {hint}.")


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
    """Let the command line's keys ``given`` win over a preset's (``n_epochs`` alone nulls ``n_examples``); ConfigError
    if it sets both of ``n_epochs``/``n_examples`` or of ``model.tokenizer_class``/``model.tokenizer_name_or_path``."""
    pairs = (
        ("n_epochs", "n_examples", "the training length"),
        ("model.tokenizer_class", "model.tokenizer_name_or_path", "the tokenizer"),
    )
    for a, b, what in pairs:
        va, vb = OmegaConf.select(config, a), OmegaConf.select(config, b)
        if a in given and b in given and va is not None and vb is not None:
            raise utils.ConfigError(
                f"{a}={utils.override_text(va)} and {b}={utils.override_text(vb)} both set {what} and contradict; give only one."
            )
    if "n_epochs" in given and "n_examples" not in given and config.get("n_epochs") is not None:
        config.n_examples = None


def sft_first_skip(config: DictConfig, given: set[str]) -> str | None:
    """Why ``sft_first``'s SFT stage (``sft_first.n_examples`` set) cannot run before this run, or None when it can; raises
    ConfigError when the command line (``given``) set it or ``resume=auto`` asks for one run."""
    stage = config.sft_first
    objective = losses.OBJECTIVES.get(config.loss.name)
    reason = None
    if config.model.get("archive") is not None:
        reason = "model.archive is given (the SFT policy this run starts from)"
    elif config.resume not in (None, "auto"):
        reason = "resume= continues one run"
    elif objective is None or objective.score_head or not objective.uses_reference(config.loss):
        reason = f"loss={config.loss.name} has no reference model, so no SFT policy to start from"
    elif config.get("online") and config.online.enabled:
        reason = "online DPO samples from the model it starts from"
    elif config.resume == "auto":
        source = "" if any(k.startswith("sft_first") for k in given) else " (set by the model preset)"
        raise utils.ConfigError(
            f"sft_first.n_examples={stage.n_examples}{source} runs two runs (SFT, then this one) and resume=auto continues one: set "
            "sft_first.n_examples=null and give the SFT policy as model.archive=<SFT run>/LATEST/policy.pt."
        )
    if reason is not None and any(k == "sft_first" or k.startswith("sft_first.") for k in given):
        raise utils.ConfigError(f"sft_first.n_examples={stage.n_examples} cannot apply: {reason}; set sft_first.n_examples=null.")
    return reason


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
    """One sentence when the local folder ``path`` (given as ``key``) is not a Hugging Face model folder, else None."""
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
    """Raise ConfigError unless each non-null :data:`NUMBER_KEYS` value is a number of the right kind and range."""
    for key, (whole, least, inclusive) in NUMBER_KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        kind = "a whole number" if whole else "a number"
        ok = not isinstance(value, bool) and isinstance(value, int if whole else (int, float))
        if not ok or not (value >= least if inclusive else value > least):
            raise utils.ConfigError(
                f"{key} must be {kind} {'>=' if inclusive else '>'} {least}, got {value!r}; e.g. {key}={config_default(key)}."
            )


def config_default(key: str):
    """The value ``key`` has in config/config.yaml (for examples in error messages)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config", "config.yaml")
    return OmegaConf.load(path).get(key)


def validate_reference_update(config: DictConfig, objective) -> None:
    """Check ``reference_update`` (TR-DPO) against the objective and the reference's placement (ConfigError)."""
    update = config.get("reference_update")
    if update is None or update.get("mode") is None:
        return
    if update.mode not in ("soft", "hard"):
        raise utils.ConfigError(f"reference_update.mode must be null, soft or hard, got {update.mode}.")
    if not objective.uses_reference(config.loss):
        raise utils.ConfigError(f"reference_update moves the reference model, but loss={config.loss.name} uses none; remove it.")
    every = update.get("every")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise utils.ConfigError(f"reference_update.every must be a whole number of optimizer steps >= 1, got {every}.")
    alpha = update.get("alpha")
    if update.mode == "soft" and not (isinstance(alpha, (int, float)) and 0 < alpha <= 1):
        raise utils.ConfigError(f"reference_update.alpha must be in (0, 1] (the policy's weight in the mix), got {alpha}.")
    if config.precompute_ref_log_probs:
        raise utils.ConfigError(
            "reference_update moves the reference during training, so precomputed reference log-probs would go stale; "
            "set precompute_ref_log_probs=false."
        )
    if ray_reference_workers(config):
        raise utils.ConfigError(
            "reference_update moves the reference, which must then live with the policy; set ray.reference_workers=0."
        )


def ray_reference_workers(config: DictConfig) -> int:
    """How many Ray actors hold the reference apart from the policy: ``ray.reference_workers``
    under ``launcher=ray``, else 0."""
    ray_cfg = config.get("ray")
    return int(ray_cfg.get("reference_workers", 0) or 0) if config.get("launcher") == "ray" and ray_cfg is not None else 0


def ray_num_workers(config: DictConfig) -> int:
    """``ray.num_workers`` (the policy workers under ``launcher=ray``), checked against the trainer."""
    n = config.ray.num_workers
    if not isinstance(n, int) or n < 1:
        raise utils.ConfigError(f"ray.num_workers must be a whole number >= 1, got {n}.")
    if config.trainer == "BasicTrainer" and n != 1:
        raise utils.ConfigError(f"trainer=BasicTrainer is one process; use ray.num_workers=1 or trainer=FSDPTrainer (got {n}).")
    return n


def validate_ray(config: DictConfig) -> None:
    """Raise ConfigError naming the first bad key of the ``ray:`` section's CPUs, actors and resources."""
    ray_cfg = config.ray
    if not ray_cfg.cpus_per_worker > 0:
        raise utils.ConfigError(f"ray.cpus_per_worker must be > 0, got {ray_cfg.cpus_per_worker}.")
    for key in ("reference_workers", "reward_workers", "max_failures"):
        value = ray_cfg[key]
        if not isinstance(value, int) or value < (-1 if key == "max_failures" else 0):
            least = "-1 (no limit)" if key == "max_failures" else "0"
            raise utils.ConfigError(f"ray.{key} must be a whole number >= {least}, got {value}.")
    for key in ("reference_resources", "reward_resources"):
        resources = ray_cfg[key]
        bad = [k for k, v in resources.items() if not isinstance(v, (int, float)) or v < 0]
        if bad:
            raise utils.ConfigError(f"ray.{key}.{bad[0]} must be a number >= 0, got {resources[bad[0]]}.")
    needs_reference = losses.get_objective(config.loss.name).uses_reference(config.loss)
    if ray_cfg.reference_workers > 0:
        if not needs_reference:
            raise utils.ConfigError(
                f"ray.reference_workers={ray_cfg.reference_workers} but loss={config.loss.name} uses no reference; "
                "set ray.reference_workers=0."
            )
        if config.precompute_ref_log_probs:
            raise utils.ConfigError(
                "precompute_ref_log_probs=true runs the reference once in the policy workers; set ray.reference_workers=0 with it."
            )
    online = config.get("online")
    if ray_cfg.reward_workers > 0 and not (online is not None and online.enabled):
        raise utils.ConfigError(
            f"ray.reward_workers={ray_cfg.reward_workers} serves online DPO's scorer; set online.enabled=true or ray.reward_workers=0."
        )


def lora_settings(model_config: DictConfig) -> DictConfig | None:
    """``model.lora`` when LoRA is on (``model.lora.r`` set), else None (full fine-tuning)."""
    lora = model_config.get("lora")
    return lora if lora is not None and lora.get("r") is not None else None


def validate_lora(config: DictConfig, objective) -> None:
    """Check ``model.lora`` and what it cannot combine with, its reference being the policy with adapters off (ConfigError)."""
    lora = lora_settings(config.model)
    if lora is None:
        return
    r, alpha, dropout, targets = lora.r, lora.get("alpha", 32), lora.get("dropout", 0.0), lora.get("target_modules")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise utils.ConfigError(f"model.lora.r must be a whole number >= 1 (the adapters' rank, e.g. 16) or null, got {r!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise utils.ConfigError(f"model.lora.alpha must be a number > 0 (the adapters are scaled by alpha / r), got {alpha!r}.")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise utils.ConfigError(f"model.lora.dropout must be a number in [0, 1), got {dropout!r}.")
    names = OmegaConf.to_container(targets) if OmegaConf.is_list(targets) else targets
    if names != "all-linear" and not (isinstance(names, list) and names and all(isinstance(n, str) and n for n in names)):
        raise utils.ConfigError(
            f"model.lora.target_modules must be all-linear or a list of module names, e.g. [q_proj,v_proj], got {targets!r}."
        )
    if not isinstance(lora.get("export_merged", False), bool):
        raise utils.ConfigError(f"model.lora.export_merged must be true or false, got {lora.export_merged!r}.")
    if objective.score_head:
        raise utils.ConfigError(
            f"model.lora trains the adapters of a causal LM, not loss={config.loss.name}'s score head; set model.lora.r=null."
        )
    if config.trainer == "TensorParallelTrainer" or (config.get("tensor_parallel_size") or 1) > 1:
        raise utils.ConfigError(
            "model.lora does not work with tensor parallelism (its plan splits plain linear layers, not LoRA's); "
            "use trainer=FSDPTrainer with tensor_parallel_size=1 or BasicTrainer."
        )
    update = config.get("reference_update")
    if update is not None and update.get("mode") is not None:
        raise utils.ConfigError(
            "reference_update moves the reference, but with model.lora the reference is the frozen base (the policy with its "
            "adapters off), which never moves; set reference_update.mode=null or model.lora.r=null."
        )
    if ray_reference_workers(config):
        raise utils.ConfigError(
            "with model.lora the reference is the policy with its adapters off, in each policy worker; set ray.reference_workers=0."
        )
    reference_dtype = config.model.get("reference_dtype")
    if reference_dtype is not None and reference_dtype != config.model.get("policy_dtype"):
        raise utils.ConfigError(
            f"with model.lora the reference is the policy's own base, in model.policy_dtype={config.model.get('policy_dtype')}, "
            f"so model.reference_dtype={reference_dtype} cannot apply; set model.reference_dtype=null."
        )
    try:
        import peft  # noqa: F401
    except ImportError:
        raise utils.ConfigError(
            "model.lora.r is set but the peft library is not installed; pip install -r requirements.txt."
        ) from None


def validate_hub(config: DictConfig) -> None:
    """Check ``hub.*`` (absent: no push): boolean flags, and a valid ``hub.model_id`` and ``save_hf_export`` to push."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    hub = config.get("hub") or {}
    for key in ("push", "private"):
        if not isinstance(hub.get(key, False), bool):
            raise utils.ConfigError(f"hub.{key} must be true or false, got {hub.get(key)!r}.")
    if not hub.get("push"):
        return
    model_id = hub.get("model_id")
    if model_id is None:
        raise utils.ConfigError("hub.push=true needs the repository to push to: add hub.model_id=<org or user>/<name>.")
    try:
        validate_repo_id(str(model_id))
    except HFValidationError:
        raise utils.ConfigError(
            f"hub.model_id={model_id} is not a Hugging Face repository id; give <org or user>/<name>, e.g. hub.model_id=my-org/my-dpo-model."
        ) from None
    if not config.save_hf_export:
        raise utils.ConfigError(
            "hub.push=true pushes the run's Hugging Face export, which save_hf_export=false leaves out; set save_hf_export=true."
        )


def online_capable(objective) -> bool:
    """True if online DPO can train with ``objective`` (a ``losses.Objective``): paired, with a reference and a
    ``beta``."""
    return objective.paired and objective.reference is not False and "beta" in objective.keys and not objective.mismatched_kl


def validate_online(config: DictConfig) -> None:
    """Check the ``online:`` section (online DPO) when ``online.enabled`` (ConfigError)."""
    online = config.get("online")
    if online is None or not online.enabled:
        return
    objective = losses.get_objective(config.loss.name)
    if not online_capable(objective):
        capable = [name for name, o in sorted(losses.OBJECTIVES.items()) if online_capable(o)]
        raise utils.ConfigError(
            "online.enabled=true trains with loss=dpo or loss=ipo or another paired objective with a reference "
            f"({', '.join(capable)}), not loss={config.loss.name}."
        )
    if not objective.uses_reference(config.loss):
        raise utils.ConfigError(f"online DPO needs the reference model: set loss.{objective.reference}=false.")
    if config.precompute_ref_log_probs:
        raise utils.ConfigError(
            "online DPO samples new completions each step, so precompute_ref_log_probs=true cannot apply; set it false."
        )
    problem = scorer_error(online.scorer, config, "online.scorer")
    if problem is None and online.scorer in ("reward_model", "reward_model_judge"):
        problem = reward_model_error(config, f"online.scorer={online.scorer}")
    if problem is not None:
        raise utils.ConfigError(problem)
    if online.ties not in ("skip", "random"):
        raise utils.ConfigError(f"online.ties must be skip or random, got {online.ties}.")
    if not online.max_new_tokens >= 1:
        raise utils.ConfigError(f"online.max_new_tokens must be >= 1, got {online.max_new_tokens}.")
    if config.max_prompt_length + online.max_new_tokens > config.max_length:
        raise utils.ConfigError(
            f"max_prompt_length ({config.max_prompt_length}) + online.max_new_tokens ({online.max_new_tokens}) "
            f"must be at most max_length ({config.max_length}); raise max_length or lower one of them."
        )
    if not online.temperature > 0:
        raise utils.ConfigError(f"online.temperature must be > 0 (online DPO samples), got {online.temperature}.")
    validate_fraction(online.get("max_failure_rate", 0.1), "online.max_failure_rate")
    if config.trainer == "TensorParallelTrainer":
        raise utils.ConfigError("online DPO runs with BasicTrainer or FSDPTrainer.")


def scorer_error(kind, config: DictConfig, setting: str) -> str | None:
    """One sentence when the scorer ``kind`` (the value of ``setting``: online.scorer, or evaluate.py's judge) is unknown
    or its ``judge`` settings are missing or bad, else None (its reward model: :func:`reward_model_error`)."""
    if kind not in SCORERS:
        close = difflib.get_close_matches(str(kind), SCORERS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"Unknown {setting}={kind}; {hint}choose one of {', '.join(SCORERS)}."
    judge = config.judge
    if kind == "http_judge" and (not judge.get("base_url") or not judge.get("model")):
        return f"{setting}=http_judge needs judge.base_url (e.g. http://127.0.0.1:8000/v1) and judge.model."
    if kind == "http_judge" and not str(judge.base_url).startswith(("http://", "https://")):
        return f"judge.base_url={judge.base_url} must start with http:// or https://."
    return None


def reward_model_error(config: DictConfig, needed_by: str) -> str | None:
    """One sentence when ``reward_model.name_or_path`` (which ``needed_by``, e.g. online.scorer=reward_model, scores with)
    is missing, a local path but no folder, or a folder but no model, else None."""
    path = config.reward_model.name_or_path
    if path is None:
        return f"{needed_by} needs reward_model.name_or_path (e.g. the LATEST/hf of a loss=reward run)."
    if looks_local(path) and not os.path.isdir(os.path.expanduser(path)):
        return f"reward_model.name_or_path={path} is not a folder; give a local reward model folder or a hub id."
    return hf_folder_error(path, "reward_model.name_or_path")  # a run folder: name its hf export


def validate_fraction(value, key: str) -> None:
    """Raise ConfigError unless ``value`` (the value of ``key``, a share) is in [0, 1]."""
    if not 0 <= value <= 1:
        raise utils.ConfigError(f"{key} must be in [0, 1], got {value}.")


def n_eval_used(config: DictConfig, n_eval: int) -> int:
    """How many eval examples are used: ``n_eval_examples`` capped by the eval split's size."""
    return min(config.n_eval_examples or n_eval, n_eval)


def check_eval_size(config: DictConfig, n_eval: int) -> None:
    """Raise ConfigError if the eval set cannot fill one eval batch."""
    if n_eval == 0:
        raise utils.ConfigError("The eval split is empty; give the dataset a test split or a holdout_fraction.")
    used = n_eval_used(config, n_eval)
    if config.eval_batch_size > used:
        raise utils.ConfigError(
            f"eval_batch_size ({config.eval_batch_size}) is larger than the eval set ({used} example{'s' if used != 1 else ''}); lower it."
        )


RUN_FOLDER_KEYS = ("resume", "output_root", "ray.storage_path", "ray.name")
"""Keys that name where a run is, not what it trains: left out when a new command is compared
with a run's saved config (:func:`config_differences`)."""


def config_differences(saved: DictConfig, new: DictConfig, keys: list[str] | None = None) -> list[tuple[str, object, object]]:
    """``(dotted key, saved value, new value)`` for each leaf where the resolved configs differ (a
    key one lacks: ``"absent"``), in ``saved``'s key order, :data:`RUN_FOLDER_KEYS` left out;
    ``keys`` limits it to those keys and what lies under them (e.g. ``loss`` for ``loss=ipo``)."""
    a, b = utils.flat_config(saved), utils.flat_config(new)

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
    text = ", ".join(f"{k} (saved {utils.override_text(a)}, given {utils.override_text(b)})" for k, a, b in differences[:limit])
    more = len(differences) - limit
    return text + (f" and {more} more" if more > 0 else "")


# ----------------------------------------------------------------------------- several nodes: the same run everywhere

REPO_DIR = os.path.dirname(os.path.abspath(__file__))


def code_files(repo: str = REPO_DIR) -> dict[str, str]:
    """``{path relative to repo: sha256}`` of the checkout's top-level ``.py`` files and ``config/**/*.yaml``."""
    import glob
    import hashlib

    paths = glob.glob(os.path.join(repo, "*.py")) + glob.glob(os.path.join(repo, "config", "**", "*.yaml"), recursive=True)
    files = {}
    for path in sorted(paths):
        with open(path, "rb") as f:
            files[os.path.relpath(path, repo).replace(os.sep, "/")] = hashlib.sha256(f.read()).hexdigest()
    return files


CONFIG_CHECK_SKIPS = ("output_root",)
"""Keys left out of the config check across ranks: output_root is checked by what it must do
(:func:`check_shared_output_root`), since two nodes may mount one file system at two paths."""


def run_identity(config: DictConfig, host: str | None = None, repo: str = REPO_DIR) -> dict:
    """What every rank must agree on, with the host for messages: ``{"host", "config" (flat,
    without :data:`CONFIG_CHECK_SKIPS`), "config_hash", "code" (:func:`code_files`), "code_hash"}``."""
    flat = {k: v for k, v in utils.flat_config(config).items() if k not in CONFIG_CHECK_SKIPS}
    code = code_files(repo)
    return {
        "host": host or socket.gethostname(),
        "config": flat,
        "config_hash": utils.digest(flat),
        "code": code,
        "code_hash": utils.digest(code),
    }


_UNSET = object()


def identity_mismatch(identities: list[dict], auto_resume: bool = False) -> str | None:
    """One sentence on how the first rank whose :func:`run_identity` (``identities``, in rank order) differs from rank 0's
    differs (code first, then config), else None; ``auto_resume``: ``resume=auto`` was given, so ranks found ``resume``."""
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
                f"resume=auto found resume={utils.override_text(theirs.get(key))} on rank {rank} (host {other['host']}) but "
                f"resume={utils.override_text(mine.get(key))} on rank 0 (host {h0}); every node must see the same output_root."
            )
        said = [
            f"with {key}={utils.override_text(values[key])}" if key in values else f"without {key}" for values in (theirs, mine)
        ]
        return f"{who} was started {said[0]}, rank 0 (host {h0}) {said[1]}; start every node with the same command."
    return None


def check_same_run(config: DictConfig, auto_resume: bool = False) -> None:
    """Raise ConfigError on every rank if any rank's :func:`run_identity` differs from rank 0's (a collective)."""
    problem = identity_mismatch(utils.all_gather_object(run_identity(config)), auto_resume)
    if problem is not None:
        raise utils.ConfigError(problem)


SHARED_MARKER = ".shared-"
"""The prefix of the file :func:`check_shared_output_root` writes into ``output_root`` (then removes)."""


def _sees(path: str, wait_s: float) -> bool:
    """Whether ``path`` exists, asking again for up to ``wait_s`` seconds (NFS may show a new file late)."""
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
    """Raise ConfigError on every rank unless all see the file rank 0 writes in ``output_root`` within ``wait_s`` s
    (a collective)."""
    import uuid

    host = socket.gethostname()
    name = failure = None
    if rank == 0:
        name = f"{SHARED_MARKER}{uuid.uuid4().hex}"
        try:
            os.makedirs(output_root, exist_ok=True)
            utils.write_atomic(os.path.join(output_root, name), f"written by rank 0 on {host}\n")
        except OSError as e:
            failure = f"output_root={output_root} cannot be written on rank 0 (host {host}): {utils.failure_reason(e)}; give a folder it can write."
    name, failure = utils.broadcast_object((name, failure))
    if failure is not None:
        raise utils.ConfigError(failure)
    try:
        seen = utils.all_gather_object((_sees(os.path.join(output_root, name), wait_s), host, output_root))
    finally:
        if rank == 0:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(output_root, name))
    blind = next((r for r, (ok, _, _) in enumerate(seen) if not ok), None)
    if blind is not None:
        _, where, theirs = seen[blind]
        root = seen[0][2]
        there = f", looking in output_root={theirs}" if theirs != root else ""
        raise utils.ConfigError(
            f"output_root={root} is not shared: rank {blind} (host {where}{there}) does not see the file "
            f"rank 0 (host {seen[0][1]}) wrote there; put output_root on a file system every node mounts at the same path."
        )


CONFIG_DIR = checkpoints.CONFIG_DIR


def _keys(node: DictConfig, top: bool) -> str:
    """``node``'s keys, sorted and comma-separated (Hydra's own node left out at the top)."""
    return ", ".join(sorted(str(k) for k in node.keys() if not (top and k == "hydra")))


def override_error(overrides: list[str], config_name: str = "config") -> str | None:
    """One sentence when a command-line override names what ``config_name``'s config lacks (an unknown key, a near-miss ``+key``,
    a missing group option, a folder as ``model=``), else None (Hydra reports other failures)."""
    import difflib

    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return None
    for text, o in zip(overrides, parsed):  # model=<a folder or hub id>: a preset name was expected
        value = o.value() if o.key_or_group == "model" and not o.is_sweep_override() else None
        if isinstance(value, str) and ("/" in value or os.path.isdir(value)):
            return (
                f"{text}: model= takes a preset of config/model/ (e.g. tiny, pythia28); to load a folder or hub id, "
                f"give model=blank_model model.name_or_path={value}."
            )
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        try:
            config = compose(config_name=config_name, overrides=overrides)
        except MissingConfigException as e:  # a group option: e.missing_cfg_file is "<group>/<option>"
            group, _, option = (e.missing_cfg_file or "").rpartition("/")
            if not e.options or not any(o.key_or_group == group for o in parsed):
                return None
            close = difflib.get_close_matches(option, e.options, n=1)
            hint = f"; did you mean {group}={close[0]}?" if close else ""
            return f"{group}={option} is not an option of {group}{hint} (options: {', '.join(e.options)})."
        except ConfigCompositionException as e:
            cause = e.__cause__
            if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or not isinstance(cause.parent_node, DictConfig):
                return None
            missing, name, parent = str(cause.full_key), str(cause.key), cause.parent_node
            typed = next((o.key_or_group for o in parsed if f"{o.key_or_group}.".startswith(f"{missing}.")), missing)
            prefix = missing[: len(missing) - len(name)]  # "loss." for loss.betaa, "" at the top
            where = f" (keys of {prefix[:-1]}: {_keys(parent, False)})" if prefix else f" (keys: {_keys(parent, True)})"
            close = difflib.get_close_matches(name, [str(k) for k in parent.keys() if k != "hydra"], n=1)
            if close:
                return f"{typed} is not a config key; did you mean {prefix}{close[0]}{typed[len(missing) :]}?{where}"
            if prefix == "loss." and parent.get("name"):  # a loss has the keys its formula uses: adding one is no fix
                return f"loss={parent.name} has no key {name!r}{where}; remove it."
            text = next((t for t, o in zip(overrides, parsed) if o.key_or_group == typed), None)
            add = f"; to add it, write +{text}" if prefix and text is not None and not text.startswith("+") else ""
            return f"{typed} is not a config key{where}{add}."
        added = [  # +key near-misses of top-level keys; nested additions are validate_config's
            (text, o)
            for text, o in zip(overrides, parsed)
            if (o.is_add() or o.is_force_add()) and o.key_or_group in config and not any(c in o.key_or_group for c in "./@")
        ]
        if not added:
            return None
        base = compose(config_name=config_name, overrides=[text for text, o in zip(overrides, parsed) if (text, o) not in added])
    for text, o in added:
        if o.key_or_group not in base:
            close = difflib.get_close_matches(o.key_or_group, [str(k) for k in base.keys()], n=1, cutoff=0.8)
            if close:
                return (
                    f"{o.key_or_group} is not a config key; did you mean {close[0]}? "
                    f"({text} would add a key nothing reads; keys: {_keys(base, True)})"
                )
    return None


def command_line_error(argv: list[str]) -> str | None:
    """:func:`override_error` of ``argv``'s overrides, or with ``-m`` :func:`sweep_error` of every job before the first starts;
    None when another Hydra flag is given."""
    multirun = [a for a in argv if a in ("-m", "--multirun")]
    overrides = [a for a in argv if a not in multirun]
    if not overrides or any(a.startswith("-") for a in overrides):
        return None
    return sweep_error(overrides) if multirun else override_error(overrides)


def sweep_error(overrides: list[str]) -> str | None:
    """One sentence, led by the job's swept values, for the first job of the sweep ``overrides`` that :func:`override_error` or
    ``validate_config`` rejects; None when all pass or they do not parse."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except HydraException:
        return None
    swept = [i for i, o in enumerate(parsed) if o.is_sweep_override()]
    for job in jobs:
        problem = override_error(job)
        if problem is None:
            with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
                try:
                    config = compose(config_name="config", overrides=job)
                except HydraException:
                    return None
            try:
                settle_given(config, given_keys(job))  # as hydra_main does
                if config.resume is None:  # resume= runs the saved config, checked when it starts
                    n = 1 if config.trainer == "BasicTrainer" else (config.world_size or torch.cuda.device_count() or 1)
                    validate_config(config, n)
            except utils.ConfigError as e:
                problem = str(e)
        if problem is not None:
            return f"In the job {' '.join(job[i] for i in swept)}: {problem}" if swept else problem
    return None
