"""Every config rule, checked once where a job starts, and the command line checked before Hydra runs it."""

from __future__ import annotations

import difflib
import os
import re

import torch
from omegaconf import DictConfig, OmegaConf

import losses
import objectives  # noqa: F401  (registers the objectives beyond SFT, DPO and IPO)
import utils
from parallel.process_group import DEFAULT_DIST_TIMEOUT_MINUTES
from runs import checkpoints
from runs.config_text import override_text
from runs.overrides import override_error

TRAINERS = ("BasicTrainer", "FSDPTrainer", "TensorParallelTrainer")

SCORERS = ("reward_model", "reward_model_judge", "http_judge", "reward_function")  # values of online.scorer, evaluate.py's judge

FLOAT16_UNSAFE_OPTIMIZERS = ("Adam", "AdamW", "RMSprop")
"""Optimizers whose epsilon and state underflow in float16 weights, making every weight NaN at the first step."""


# ----------------------------------------------------------------------------- config


def online_enabled(config: DictConfig) -> bool:
    """True if the run trains with online DPO (``online.enabled``)."""
    return bool(config.get("online") and config.online.enabled)


def _objective(c: DictConfig):
    """The ``losses.Objective`` of ``loss.name`` (a registered name once the ``loss`` row passed)."""
    return losses.get_objective(c.loss.name)


def _tr_dpo(c: DictConfig) -> bool:
    """True if ``reference_update`` (TR-DPO) moves the reference."""
    update = c.get("reference_update")
    return update is not None and update.get("mode") is not None


def _lora(c: DictConfig) -> DictConfig | None:
    return lora_settings(c.model)


def _tp(c: DictConfig):
    return 1 if c.get("tensor_parallel_size") is None else c.tensor_parallel_size  # 0 is refused, not taken as 1


def _hub(c: DictConfig):
    return c.get("hub") or {}  # absent: no push


def _whole(value, least) -> bool:
    """True if ``value`` is an int (not a bool) >= ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value) -> bool:
    """True if ``value`` is an int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _raised(check, error):
    """A row function: the message of the ``error`` that ``check(config)`` raises, else None."""

    def problem(c: DictConfig, _) -> str | None:
        try:
            check(c)
        except error as e:
            return str(e)
        return None

    return problem


def _numbers_problem(c: DictConfig, _) -> str | None:
    """The first non-null :data:`NUMBER_KEYS` value of the wrong kind or range."""
    for key, (whole, least, inclusive) in NUMBER_KEYS.items():
        value = c.get(key)
        if value is None:
            continue
        kind = "a whole number" if whole else "a number"
        ok = not isinstance(value, bool) and isinstance(value, int if whole else (int, float))
        if not ok or not (value >= least if inclusive else value > least):
            return f"{key} must be {kind} {'>=' if inclusive else '>'} {least}, got {value!r}; e.g. {key}={config_default(key)}."
    return None


def _scorer_problem(c: DictConfig) -> str | None:
    """What is wrong with ``online.scorer``: its judge, its reward model, or a penalty on the scores a judge does not give."""
    problem = scorer_error(c.online.scorer, c, "online.scorer")
    if problem is None and c.online.scorer in ("reward_model", "reward_model_judge"):
        problem = reward_model_error(c, f"online.scorer={c.online.scorer}")
    if problem is None and c.online.scorer.endswith("_judge") and c.online.get("missing_eos_penalty") is not None:
        problem = f"online.missing_eos_penalty is subtracted from scores, and online.scorer={c.online.scorer} gives none (it picks one of two); set online.missing_eos_penalty=null, or online.scorer=reward_model or reward_function."
    return problem


def _lora_targets_ok(targets) -> bool:
    names = OmegaConf.to_container(targets) if OmegaConf.is_list(targets) else targets
    return names == "all-linear" or (isinstance(names, list) and bool(names) and all(isinstance(n, str) and n for n in names))


def _peft_problem(c: DictConfig, _) -> str | None:
    if not _lora(c):
        return None
    try:
        import peft  # noqa: F401
    except ImportError:
        return "model.lora.r is set but the peft library is not installed; pip install -r requirements.txt."
    return None


def _repo_id_problem(c: DictConfig, _) -> str | None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not _hub(c).get("push"):
        return None
    try:
        validate_repo_id(str(c.hub.model_id))
    except HFValidationError:
        return f"hub.model_id={c.hub.model_id} is not a Hugging Face repository id; give <org or user>/<name>, e.g. hub.model_id=my-org/my-dpo-model."
    return None


def _datasets_problem(c: DictConfig, _) -> str | None:
    """The first name of ``datasets`` that is unregistered, or prompt-only without online DPO."""
    from preference_datasets import REGISTRY

    for k, name in enumerate(c.datasets):
        if name in list(c.datasets)[:k]:  # data.<name> holds its one set of options: the same pairs again
            return (
                f"datasets lists {name!r} twice, so each of its examples would be trained on twice; list each dataset once "
                "(n_epochs sets how often the data is seen)."
            )
        if name in REGISTRY and "pairs" not in REGISTRY[name] and not online_enabled(c):
            return f"Dataset {name!r} has prompts only; use it for online DPO (online.enabled=true)."
        if name not in REGISTRY:
            known = sorted(REGISTRY)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            return f"Unknown dataset {name!r} in datasets; {hint}registered datasets are {known}."
    return None


def _data_parallel_problem(c: DictConfig, world_size: int) -> str | None:
    data_parallel = data_parallel_size(c, world_size)
    if not isinstance(data_parallel, int) or data_parallel < 1 or not c.batch_size % data_parallel:
        return None  # a size that is not whole or does not divide the processes: its own row says so
    split = [k for k in ("tensor_parallel_size", "sequence_parallel_size") if (c.get(k) or 1) != 1]
    groups = f"data-parallel groups (processes / {' x '.join(split)})" if split and c.trainer == "FSDPTrainer" else "processes"
    return f"batch_size ({c.batch_size}) must be divisible by the number of {groups} ({data_parallel})."


def _dist_timeout(c: DictConfig):
    return c.get("dist_timeout_minutes", DEFAULT_DIST_TIMEOUT_MINUTES)


def _not_a_folder(c: DictConfig) -> bool:
    """True if ``model.name_or_path`` (loaded, not built) can only be a local folder, and is none."""
    path = c.model.name_or_path
    return (
        path is not None and c.model.get("config") is None and looks_local(path) and not os.path.isdir(os.path.expanduser(path))
    )


def _archive_problem(c: DictConfig, _) -> str | None:
    folder = c.model.archive
    if folder is None or not os.path.isdir(folder):
        return None
    there = [
        os.path.join(folder, *p) for p in (("policy.pt",), ("LATEST", "policy.pt")) if os.path.exists(os.path.join(folder, *p))
    ]
    hint = (
        f"model.archive={there[0]}" if there else "the policy.pt of a checkpoint (<run>/LATEST/policy.pt); this folder holds none"
    )
    return f"model.archive={folder} is a folder; give a checkpoint's policy.pt: {hint}."


RUN_NAME = r"[\w-][\w.-]*"
"""What ``exp_name`` may be: letters, digits, ``_``, ``-`` and ``.``, not starting with ``.`` (one folder name under
``output_root``, that ``resume=auto`` finds again)."""


def _run_name_problem(c: DictConfig, _) -> str | None:
    name = str(c.exp_name)
    if re.fullmatch(RUN_NAME, name, flags=re.ASCII):
        return None
    safe = re.sub(r"[^\w-]+", "_", name, flags=re.ASCII).strip("_") or "my_run"
    return (
        f"exp_name={name!r} is not a run name: use letters, digits, '_', '-' and '.' (not first), so that the run folder "
        f"is one folder inside output_root that resume=auto finds again; e.g. exp_name={safe}."
    )


def _output_root_problem(c: DictConfig, _) -> str | None:
    """One sentence when ``output_root`` is a file or lies inside one (a folder that does not exist yet is made)."""
    root = os.path.expanduser(str(c.output_root))
    path = root
    while path and not os.path.exists(path):  # the nearest part of it that exists must be a folder
        parent = os.path.dirname(path)
        path = parent if parent != path else ""
    if not path or os.path.isdir(path):
        return None
    where = "is a file" if path == root else f"lies inside the file {path}"
    return f"output_root={c.output_root} {where}, not a folder; give a folder for the run folders (made if absent), e.g. output_root=outputs."


def _custom_code_problem(c: DictConfig, _) -> str | None:
    """:func:`models.custom_code_problem` of the local folders ``model.*`` loads from (a hub id is loaded without its code)."""
    from modeling import models

    if c.model.get("config") is not None:  # a random model: only the tokenizer is read
        keys = ["tokenizer_name_or_path"]
    else:
        keys = ["name_or_path", "tokenizer_name_or_path"]
    for key in keys:
        path = c.model.get(key)
        if path is not None and os.path.isdir(os.path.expanduser(str(path))):
            problem = models.custom_code_problem(os.path.expanduser(str(path)), f"model.{key}")
            if problem is not None:
                return problem
    return None


# Every config rule, checked in this order (the first that fails is the ConfigError): a row is (the key, the condition on
# the config c that must hold, the message: str.format'ted with c, or a function of c), or (the key, a function of
# (c, world_size) giving the message or None) for a rule with loops or calls into other modules.
RULES = [
    ("exp_name", _run_name_problem),
    ("output_root", _output_root_problem),
    ("numbers", _numbers_problem),
    ("malloc_mmap_threshold_mib", _raised(lambda c: utils.validate_malloc_mmap_threshold(c.get("malloc_mmap_threshold_mib")), utils.ConfigError)),
    ("loss", _raised(lambda c: losses.validate_loss_config(c.loss), losses.ObjectiveConfigError)),
    ("loss", lambda c: not (_objective(c).score_head and c.trainer == "TensorParallelTrainer"),
     "loss={c.loss.name} trains with BasicTrainer or FSDPTrainer; TensorParallelTrainer splits only causal LMs."),
    ("precompute_ref_log_probs", lambda c: not c.precompute_ref_log_probs or _objective(c).uses_reference(c.loss),
     "loss={c.loss.name} uses no reference model, so precompute_ref_log_probs=true has nothing to compute; set it false."),
    ("precompute_ref_log_probs", lambda c: not (c.precompute_ref_log_probs and _objective(c).mismatched_kl),
     "loss={c.loss.name} needs the reference's log-probs of each prompt paired with another example's completion, "
     "pairs that change with every shuffled batch, so precompute_ref_log_probs=true cannot cache them; set it false."),
    # reference_update (TR-DPO)
    ("reference_update.mode", lambda c: not _tr_dpo(c) or c.reference_update.mode in losses.REFERENCE_UPDATES,
     lambda c: f"reference_update.mode must be null or one of {', '.join(sorted(losses.REFERENCE_UPDATES))}, "
     f"got {c.reference_update.mode}."),
    ("reference_update", lambda c: not _tr_dpo(c) or c.reference_update.mode not in losses.REFERENCE_UPDATES
     or not losses.REFERENCE_UPDATES[c.reference_update.mode].check(c.reference_update),
     lambda c: losses.REFERENCE_UPDATES[c.reference_update.mode].check(c.reference_update)),
    ("reference_update", lambda c: not _tr_dpo(c) or _objective(c).uses_reference(c.loss),
     "reference_update moves the reference model, but loss={c.loss.name} uses none; remove it."),
    ("reference_update", lambda c: not (_tr_dpo(c) and c.precompute_ref_log_probs),
     "reference_update moves the reference during training, so precomputed reference log-probs would go stale; "
     "set precompute_ref_log_probs=false."),
    ("reference_update", lambda c: not (_tr_dpo(c) and ray_reference_workers(c)),
     "reference_update moves the reference, which must then live with the policy; set ray.reference_workers=0."),
    # online DPO
    ("online.enabled", lambda c: not online_enabled(c) or online_capable(_objective(c)),
     lambda c: "online.enabled=true trains with loss=dpo or loss=ipo or another paired objective with a reference "
     f"({', '.join(name for name, o in sorted(losses.OBJECTIVES.items()) if online_capable(o))}), not loss={c.loss.name}."),
    ("online.enabled", lambda c: not online_enabled(c) or _objective(c).uses_reference(c.loss),
     lambda c: f"online DPO needs the reference model: set loss.{_objective(c).reference}=false."),
    ("online.enabled", lambda c: not (online_enabled(c) and c.precompute_ref_log_probs),
     "online DPO samples new completions each step, so precompute_ref_log_probs=true cannot apply; set it false."),
    ("online.scorer", lambda c, _: _scorer_problem(c) if online_enabled(c) else None),
    ("online.ties", lambda c: not online_enabled(c) or c.online.ties in ("skip", "random"),
     "online.ties must be skip or random, got {c.online.ties}."),
    ("online.max_new_tokens", lambda c: not online_enabled(c) or c.online.max_new_tokens >= 1,
     "online.max_new_tokens must be >= 1, got {c.online.max_new_tokens}."),
    ("online.max_new_tokens", lambda c: not online_enabled(c) or c.max_prompt_length + c.online.max_new_tokens <= c.max_length,
     "max_prompt_length ({c.max_prompt_length}) + online.max_new_tokens ({c.online.max_new_tokens}) "
     "must be at most max_length ({c.max_length}); raise max_length or lower one of them."),
    ("online.temperature", lambda c: not online_enabled(c) or c.online.temperature > 0,
     "online.temperature must be > 0 (online DPO samples), got {c.online.temperature}."),
    ("online.top_k", lambda c, _: sampling_problem(c.online, "online.") if online_enabled(c) else None),
    ("online.max_failure_rate", lambda c: not online_enabled(c) or 0 <= c.online.get("max_failure_rate", 0.1) <= 1,
     lambda c: f"online.max_failure_rate must be in [0, 1], got {c.online.get('max_failure_rate', 0.1)}."),
    ("online.enabled", lambda c: not (online_enabled(c) and c.trainer == "TensorParallelTrainer"), "online DPO runs with BasicTrainer or FSDPTrainer."),
    # LoRA: its reference is the policy with its adapters off
    ("model.lora.r", lambda c: not _lora(c) or _whole(c.model.lora.r, 1),
     "model.lora.r must be a whole number >= 1 (the adapters' rank, e.g. 16) or null, got {c.model.lora.r!r}."),
    ("model.lora.alpha", lambda c: not _lora(c) or (_number(c.model.lora.get("alpha", 32)) and c.model.lora.get("alpha", 32) > 0),
     lambda c: f"model.lora.alpha must be a number > 0 (the adapters are scaled by alpha / r), got {c.model.lora.get('alpha', 32)!r}."),
    ("model.lora.dropout", lambda c: not _lora(c) or (_number(c.model.lora.get("dropout", 0.0)) and 0 <= c.model.lora.get("dropout", 0.0) < 1),
     lambda c: f"model.lora.dropout must be a number in [0, 1), got {c.model.lora.get('dropout', 0.0)!r}."),
    ("model.lora.target_modules", lambda c: not _lora(c) or _lora_targets_ok(c.model.lora.get("target_modules")),
     lambda c: "model.lora.target_modules must be all-linear or a list of module names, e.g. [q_proj,v_proj], "
     f"got {c.model.lora.get('target_modules')!r}."),
    ("model.lora.export_merged", lambda c: not _lora(c) or isinstance(c.model.lora.get("export_merged", False), bool),
     "model.lora.export_merged must be true or false, got {c.model.lora.export_merged!r}."),
    ("model.lora", lambda c: not (_lora(c) and _objective(c).score_head),
     "model.lora trains the adapters of a causal LM, not loss={c.loss.name}'s score head; set model.lora.r=null."),
    ("model.lora", lambda c: not _lora(c) or not (c.trainer == "TensorParallelTrainer" or _tp(c) > 1),
     "model.lora does not work with tensor parallelism (its plan splits plain linear layers, not LoRA's); "
     "use trainer=FSDPTrainer with tensor_parallel_size=1 or BasicTrainer."),
    ("model.lora", lambda c: not (_lora(c) and _tr_dpo(c)),
     "reference_update moves the reference, but with model.lora the reference is the frozen base (the policy with its "
     "adapters off), which never moves; set reference_update.mode=null or model.lora.r=null."),
    ("model.lora", lambda c: not (_lora(c) and ray_reference_workers(c)),
     "with model.lora the reference is the policy with its adapters off, in each policy worker; set ray.reference_workers=0."),
    ("model.reference_dtype", lambda c: not _lora(c) or c.model.get("reference_dtype") in (None, c.model.get("policy_dtype")),
     lambda c: f"with model.lora the reference is the policy's own base, in model.policy_dtype={c.model.get('policy_dtype')}, "
     f"so model.reference_dtype={c.model.get('reference_dtype')} cannot apply; set model.reference_dtype=null."),
    ("model.lora", _peft_problem),
    # hub (absent: no push)
    ("hub.push", lambda c: isinstance(_hub(c).get("push", False), bool),
     lambda c: f"hub.push must be true or false, got {_hub(c).get('push')!r}."),
    ("hub.private", lambda c: isinstance(_hub(c).get("private", False), bool),
     lambda c: f"hub.private must be true or false, got {_hub(c).get('private')!r}."),
    ("hub.model_id", lambda c: not _hub(c).get("push") or _hub(c).get("model_id") is not None,
     "hub.push=true needs the repository to push to: add hub.model_id=<org or user>/<name>."),
    ("hub.model_id", _repo_id_problem),
    ("save_hf_export", lambda c: not _hub(c).get("push") or c.save_hf_export,
     "hub.push=true pushes the run's Hugging Face export, which save_hf_export=false leaves out; set save_hf_export=true."),
    # data and batches
    ("datasets", lambda c: OmegaConf.is_list(c.datasets),
     "datasets must be a list: write datasets=[{c.datasets}], not datasets={c.datasets}."),
    ("datasets", _datasets_problem),
    ("batch_size", lambda c: not c.batch_size % c.gradient_accumulation_steps,
     "batch_size ({c.batch_size}) must be divisible by gradient_accumulation_steps ({c.gradient_accumulation_steps})."),
    ("tensor_parallel_size", lambda c: isinstance(_tp(c), int) and not isinstance(_tp(c), bool) and _tp(c) >= 1,
     "tensor_parallel_size must be a whole number >= 1, got {c.tensor_parallel_size}."),
    ("tensor_parallel_size", lambda c: _tp(c) == 1 or c.trainer == "FSDPTrainer",
     "tensor_parallel_size is for trainer=FSDPTrainer (2-D FSDP x TP); {c.trainer} does not use it: remove it."),
    ("tensor_parallel_size", lambda c: _tp(c) == 1 or not _objective(c).score_head,
     "loss={c.loss.name} does not support tensor_parallel_size > 1 (tensor parallelism splits causal LMs); remove it."),
    ("tensor_parallel_size", lambda c, world_size: None if _tp(c) == 1 or not world_size % _tp(c) else
     f"tensor_parallel_size ({_tp(c)}) must divide the number of processes ({world_size})."),
    ("batch_size", _data_parallel_problem),
    # training
    ("max_prompt_length", lambda c: c.max_prompt_length < c.max_length,
     "max_prompt_length ({c.max_prompt_length}) must be smaller than max_length ({c.max_length})."),
    ("n_epochs", lambda c: c.n_examples is not None or c.n_epochs is not None, "Set n_epochs or n_examples (e.g. n_epochs=1)."),
    ("n_examples", lambda c: c.n_examples is None or _whole(c.n_examples, 1),
     "n_examples must be a whole number of examples >= 1, or null to train n_epochs, got {c.n_examples!r}; e.g. n_examples=1000."),
    ("sft_first.n_examples", lambda c: (c.get("sft_first") or {}).get("n_examples") is None or _whole(c.sft_first.n_examples, 1),
     "sft_first.n_examples must be a whole number of examples >= 1, or null for no SFT stage, got {c.sft_first.n_examples!r}."),
    ("seed", lambda c: _whole(c.seed, 0) and c.seed < 2**32,
     "seed must be a whole number from 0 to 4294967295 (NumPy's range), got {c.seed!r}; e.g. seed=0."),
    ("optimizer", lambda c: c.optimizer in ("RMSprop", "AdamW", "Adam", "SGD"),
     "optimizer must be one of RMSprop, AdamW, Adam, SGD, got {c.optimizer}."),
    ("model.policy_dtype", lambda c: not (c.model.get("policy_dtype") == "float16" and c.optimizer in FLOAT16_UNSAFE_OPTIMIZERS),
     "model.policy_dtype=float16 with optimizer={c.optimizer} turns the weights into NaN at the first step "
     "(its epsilon 1e-8 is 0 in float16, and so is the square of a small gradient); use model.policy_dtype=bfloat16, "
     "or float32 weights with model.fsdp_policy_mp=float16 under trainer=FSDPTrainer for float16 compute."),
    ("optimizer_foreach", lambda c: c.get("optimizer_foreach") is None or isinstance(c.optimizer_foreach, bool),
     "optimizer_foreach must be true, false or null (torch's default: foreach kernels on GPU), got {c.optimizer_foreach!r}."),
    ("output_layer_chunk", lambda c: c.get("output_layer_chunk") is None or _whole(c.output_layer_chunk, 0),
     "output_layer_chunk must be a whole number of positions >= 0 (0 or null: the output layer over all "
     "positions at once), got {c.output_layer_chunk!r}; e.g. output_layer_chunk=1024."),
    ("dist_timeout_minutes", lambda c: _number(_dist_timeout(c)) and 0 < _dist_timeout(c) < float("inf"),
     lambda c: "dist_timeout_minutes must be a number of minutes > 0 (how long a rank waits for the others "
     f"before the run aborts), got {_dist_timeout(c)!r}; e.g. dist_timeout_minutes=60."),
    # choices
    ("lr_scheduler", lambda c: c.lr_scheduler in ("constant", "linear", "cosine"),
     "lr_scheduler must be constant, linear or cosine, got {c.lr_scheduler}."),
    ("wandb.mode", lambda c: c.wandb.mode in ("online", "offline", "disabled"),
     "wandb.mode must be online, offline or disabled, got {c.wandb.mode}."),
    ("trainer", lambda c: c.trainer in TRAINERS, "trainer={c.trainer} is unknown; choose one of " + ", ".join(TRAINERS) + "."),
    ("launcher", lambda c: c.get("launcher", "local") in ("local", "ray"),
     "launcher={c.launcher} is unknown; choose launcher=local or launcher=ray."),
    # the model to load
    ("model.name_or_path", lambda c: not OmegaConf.is_missing(c.model, "name_or_path"),  # model=blank_model alone
     "model=blank_model needs the model to load: add model.name_or_path=<a hub id or a local folder>."),
    ("model.name_or_path", lambda c: c.model.name_or_path is not None or c.model.get("config") is not None,
     "Set model.name_or_path (a hub id or a local folder), or model.config to build a random model."),
    ("model", lambda c, _: model_contradiction(c) if c.get("resume") is None else None),  # a resumed run keeps its own
    ("model.name_or_path", lambda c: not _not_a_folder(c),
     "model.name_or_path={c.model.name_or_path} is not a folder; give a local Hugging Face model folder or a hub id."),
    ("model.archive", lambda c: c.model.archive is None or os.path.exists(c.model.archive),
     "model.archive={c.model.archive} does not exist; give the policy.pt of an earlier run."),
    ("model.archive", _archive_problem),
    ("model.name_or_path", _custom_code_problem),
]  # fmt: skip


def validate_config(config: DictConfig, world_size: int = 1) -> None:
    """Raise ConfigError with the message of the first :data:`RULES` row ``config`` fails, before any data or model loads."""
    _check(config, world_size, RULES)


def validate_online(config: DictConfig) -> None:
    """Check the ``online.*`` rows of :data:`RULES` alone (ConfigError)."""
    _check(config, 1, [row for row in RULES if row[0].startswith("online.")])


def _check(config: DictConfig, world_size: int, rules: list) -> None:
    """Raise ConfigError with the message of the first of ``rules`` (rows of :data:`RULES`) ``config`` fails."""
    for _, *rule in rules:
        if len(rule) == 1:
            problem = rule[0](config, world_size)
        else:
            holds, message = rule
            problem = None if holds(config) else message(config) if callable(message) else message.format(c=config)
        if problem is not None:
            raise utils.ConfigError(problem)


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
                f"{a}={override_text(va)} and {b}={override_text(vb)} both set {what} and contradict; give only one."
            )
    if "n_epochs" in given and "n_examples" not in given and config.get("n_epochs") is not None:
        config.n_examples = None


def sft_first_skip(config: DictConfig, given: set[str]) -> str | None:
    """Why ``sft_first``'s SFT stage (``sft_first.n_examples`` set) cannot run before this run, or None when it can; raises
    ConfigError when the command line (``given``) set it or ``resume=auto`` asks for one run."""
    stage = config.sft_first
    try:
        objective = losses.get_objective(config.loss.name)
    except losses.ObjectiveConfigError as e:  # an unknown loss is said as such, not as "no reference model"
        raise utils.ConfigError(str(e)) from None
    reason = None
    if config.model.get("archive") is not None:
        reason = "model.archive is given (the SFT policy this run starts from)"
    elif config.resume not in (None, "auto"):
        reason = "resume= continues one run"
    elif objective.score_head or not objective.uses_reference(config.loss):
        reason = f"loss={config.loss.name} has no reference model, so no SFT policy to start from"
    elif online_enabled(config):
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
            f"{epochs:.3g} epoch{'s' * (f'{epochs:.3g}' != '1')} of {n_train} train examples."
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


def micro_batch_note(config: DictConfig) -> str | None:
    """A note when the objective couples a micro-batch's pairs (``Objective.couples_micro_batch``) and the batch is split."""
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    why = _objective(config).couples_micro_batch
    parts = config.gradient_accumulation_steps * data_parallel_size(config, world_size)
    if not why or parts == 1:
        return None
    return (f"Note: loss={config.loss.name} {why}, so its numbers depend on that micro-batch's size ({(size := config.batch_size // parts)} "
            f"pair{'s' * (size != 1)}: batch_size / (gradient_accumulation_steps x data-parallel ranks)); compare its runs at the same size.")  # fmt: skip


def data_parallel_size(config: DictConfig, world_size: int) -> int:
    """How many data-parallel parts each batch is split into over ``world_size`` processes."""
    if config.trainer == "TensorParallelTrainer":
        return 1
    if config.trainer == "FSDPTrainer":
        return world_size // ((config.get("tensor_parallel_size") or 1) * (config.get("sequence_parallel_size") or 1))
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
"""The top-level numeric keys :func:`_numbers_problem` checks (null is left to the key's own meaning)."""


def config_default(key: str):
    """The value ``key`` has in config/config.yaml (for examples in error messages)."""
    path = os.path.join(CONFIG_DIR, "config.yaml")
    return OmegaConf.load(path).get(key)


def ray_reference_workers(config: DictConfig) -> int:
    """How many Ray actors hold the reference apart from the policy: ``ray.reference_workers`` under ``launcher=ray``, else 0."""
    return int(config.ray.reference_workers or 0) if config.launcher == "ray" else 0


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
    if ray_cfg.reward_workers > 0 and not online_enabled(config):
        raise utils.ConfigError(
            f"ray.reward_workers={ray_cfg.reward_workers} serves online DPO's scorer; set online.enabled=true or ray.reward_workers=0."
        )


def lora_settings(model_config: DictConfig) -> DictConfig | None:
    """``model.lora`` when LoRA is on (``model.lora.r`` set), else None (full fine-tuning)."""
    lora = model_config.get("lora")
    return lora if lora is not None and lora.get("r") is not None else None


def online_capable(objective) -> bool:
    """True if online DPO can train with ``objective`` (a ``losses.Objective``): paired, with a reference and a ``beta``."""
    return objective.paired and objective.reference is not False and "beta" in objective.keys and not objective.mismatched_kl


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


def sampling_problem(settings: DictConfig, prefix: str = "") -> str | None:
    """One sentence for a ``top_k`` or ``top_p`` of ``settings`` that generate would fail on mid-run or ignore, else None."""
    if not _whole(settings.top_k, 0):
        return f"{prefix}top_k must be a whole number >= 0 (0: no top-k filtering), got {settings.top_k!r}."
    ok = _number(settings.top_p) and 0 < settings.top_p <= 1
    return None if ok else f"{prefix}top_p must be a number in (0, 1] (1.0: no nucleus filtering), got {settings.top_p!r}."


def validate_fraction(value, key: str) -> None:
    """Raise ConfigError unless ``value`` (the value of ``key``, a share) is in [0, 1]."""
    if not 0 <= value <= 1:
        raise utils.ConfigError(f"{key} must be in [0, 1], got {value}.")


# ----------------------------------------------------------------------------- the command line
CONFIG_DIR = checkpoints.CONFIG_DIR


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
