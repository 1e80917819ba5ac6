"""Tokenizers, models, the reference model, LoRA adapters and reading weight files."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pickle
import re

import torch
from omegaconf import DictConfig, OmegaConf

import utils

_LOAD_HINT = "Check model.name_or_path (a hub id, which needs the internet or the hub cache, or a local model folder)."


def _sentence(error: Exception) -> str:
    """The first line of ``error``'s message (else its type's name), ending in a full stop."""
    line = utils.first_line(error) or type(error).__name__
    return line if line.endswith(".") else line + "."


CODE_NAMING_FILES = (
    "config.json",
    "tokenizer_config.json",
    "adapter_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)
"""The files of a model, tokenizer or adapter folder whose ``auto_map`` would name Python code inside the folder."""


def custom_code_problem(folder, key: str = "model.name_or_path") -> str | None:
    """One sentence when the local ``folder`` (given as ``key``, or named by ``key`` when it has a space) names custom code
    (``auto_map``) that loading it would run, else None."""
    import json

    for name in CODE_NAMING_FILES:
        path = os.path.join(os.path.expanduser(str(folder)), name)
        try:
            with open(path, encoding="utf-8") as f:
                fields = json.load(f)
        except (OSError, ValueError):  # absent or unreadable: the loader says what is wrong with it
            continue
        auto_map = fields.get("auto_map") if isinstance(fields, dict) else None
        if auto_map:
            named = ", ".join(str(v) for v in (auto_map.values() if isinstance(auto_map, dict) else auto_map))[:120]
            return (
                f"{_named(key, folder)} names custom code ({name}'s auto_map: {named}), which this project never runs; "
                "give a folder that transformers' own classes load (no auto_map), e.g. one saved by save_pretrained of a built-in model."
            )
    return None


def _named(key: str, path) -> str:
    """``model.name_or_path=<path>``, or ``The adapter folder <path>`` for a ``key`` with a space."""
    return f"{key} {path}" if " " in key else f"{key}={path}"


def _refuse_custom_code(path, key: str) -> None:
    """Raise ConfigError when the local folder ``path`` names custom code (:func:`custom_code_problem`)."""
    if path is not None and os.path.isdir(os.path.expanduser(str(path))):
        problem = custom_code_problem(path, key)
        if problem is not None:
            raise utils.ConfigError(problem)


def pickled_weights_problem(error: Exception, path, key: str) -> str | None:
    """One sentence when ``error`` is ``torch.load``'s refusal of a pickled weights file (``pytorch_model.bin``) in ``path``."""
    if not isinstance(error, pickle.UnpicklingError):
        return None
    found = re.search(r"GLOBAL (\S+)|but got <class '([^']+)'>", str(error))
    what = f" (e.g. {found.group(1) or found.group(2)})" if found else ""
    return (
        f"{_named(key, path)} holds a pickled weights file with more than tensors{what}, and it is not loaded because unpickling "
        "it could run code; give the model as safetensors (model.safetensors, from save_pretrained) from a source you trust."
    )


MODEL_HOOKS: list = []
"""Plugins' model kinds, each an object with ``auto_class(model_config)`` (the transformers Auto class that loads or
builds ``model.*``, or None: not theirs) and ``tokenizer(model_config, tokenizer)`` (the tokenizer to use, e.g. a
processor's, called after the text one loads), and optionally ``lora_targets(model, lora)`` (the full names of the
modules LoRA adapts, or None: ``model.lora.target_modules`` as given) and ``config_auto_class(hf_config)`` (the Auto
class of a loaded model's config, or None); vision/ adds image-text-to-text models."""


def _hook_for(model_config: DictConfig):
    """The first of :data:`MODEL_HOOKS` that claims ``model_config``, or None."""
    return next((hook for hook in MODEL_HOOKS if hook.auto_class(model_config) is not None), None)


def model_type(model_config: DictConfig) -> str | None:
    """The transformers model_type ``model.*`` names (``model.config``'s, else a local folder's config.json, else a hub
    id's, from the cache or downloaded), or None (not found: transformers' own loading then says why)."""
    if model_config.get("config") is not None:
        return model_config.config.get("model_type")
    path = model_config.get("name_or_path")
    if path is None:
        return None
    config_file = os.path.join(os.path.expanduser(str(path)), "config.json")
    if not os.path.isfile(config_file):
        from transformers.utils import cached_file

        try:
            config_file = cached_file(str(path), "config.json", local_files_only=True)
        except (OSError, ValueError):
            config_file = _hub_config_file(path)  # not cached: a hub id's own, downloaded
        if config_file is None:  # a folder without config.json: transformers returns None, not an error
            return None
    try:
        with open(config_file, encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError):
        return None


@functools.cache  # one download (or one failed try) per hub id and process
def _hub_config_file(path) -> str | None:
    """A hub id's config.json, downloaded (so an image model is told apart before it loads); None for a name that is not
    a hub id, or a hub this machine cannot reach (HF_HUB_OFFLINE=1 answers at once)."""
    path = str(path)
    if path.startswith((".", "/", "~")) or path.count("/") != 1 or os.path.exists(path):
        return None
    from transformers.utils import cached_file

    try:
        return cached_file(path, "config.json")
    except (OSError, ValueError):
        return None


def causal_lm_problem(model_config: DictConfig, subject: str | None = None, hooks: bool = True) -> str | None:
    """One sentence (about ``subject``: by default ``model.name_or_path=...`` or ``model.config``) when ``model.*`` is a
    kind AutoModelForCausalLM does not load and (with ``hooks``) no plugin of :data:`MODEL_HOOKS` claims it, else None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = model_type(model_config)
    if kind is None or kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or (hooks and _hook_for(model_config) is not None):
        return None
    path = model_config.get("name_or_path")
    subject = subject or (f"model.name_or_path={path}" if path else "model.config")
    return (
        f"{subject} is a {kind!r} model, which transformers' AutoModelForCausalLM does not load; give a causal language "
        "model (an image-text-to-text model trains with python train.py, docs/vision.md, and is not sampled here)."
    )


def load_tokenizer(model_config: DictConfig):
    """The tokenizer of ``model.tokenizer_name_or_path`` (else built by ``model.tokenizer_class``, else
    ``model.name_or_path``'s) with pad set to EOS if absent and ``model.chat_template`` applied; ConfigError if it fails."""
    import transformers

    path = model_config.get("tokenizer_name_or_path")
    if model_config.get("tokenizer_class") and not path:
        cls = getattr(transformers, str(model_config.tokenizer_class), None)
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
            raise utils.ConfigError(
                f"model.tokenizer_class={model_config.tokenizer_class} is not a tokenizer class of transformers; give one "
                "that builds without files (e.g. ByT5Tokenizer), or a tokenizer folder as model.tokenizer_name_or_path."
            )
        tokenizer = cls()
    else:
        key = "model.tokenizer_name_or_path" if path else "model.name_or_path"
        path = path or model_config.name_or_path
        _refuse_custom_code(path, key)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise utils.ConfigError(
                f"Could not load the tokenizer {path!r} (model.tokenizer_name_or_path, else model.name_or_path): "
                f"{_sentence(e)} {_LOAD_HINT}"
            ) from e
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model_config.get("chat_template"):
        tokenizer.chat_template = read_chat_template(model_config.chat_template)
    templates = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else {None: tokenizer.chat_template}
    for name, template in templates.items():
        problem = chat_template_problem(template) if isinstance(template, str) else None
        if problem is not None:
            where = (
                "model.chat_template" if model_config.get("chat_template") else f"the chat template of {tokenizer.name_or_path!r}"
            )
            raise utils.ConfigError(f"{where}{f' {name!r}' if name else ''} {problem}")
    hook = _hook_for(model_config)
    return tokenizer if hook is None else hook.tokenizer(model_config, tokenizer)


def chat_template_problem(template: str) -> str | None:
    """What keeps the Jinja ``template`` from rendering alone (a syntax error, a template it loads), or None."""
    import jinja2
    import jinja2.nodes

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: its own render says what is wrong
        return None
    try:
        tree = _compile_jinja_template(template).environment.parse(template)  # transformers' sandbox, {% generation %}
    except jinja2.TemplateSyntaxError as e:
        return f"is not a valid Jinja template (line {e.lineno}: {e.message.rstrip('.')}); fix it or set model.chat_template to one that is."
    loads = next(tree.find_all((jinja2.nodes.Include, jinja2.nodes.Extends, jinja2.nodes.Import, jinja2.nodes.FromImport)), None)
    if loads is not None:
        tag = {"Include": "include", "Extends": "extends", "Import": "import", "FromImport": "from ... import"}[
            type(loads).__name__
        ]
        return (
            f"loads another template ({{% {tag} %}}, line {loads.lineno}), which a chat template cannot: transformers renders "
            "it alone, with no files; paste that template's text in its place."
        )
    return None


def read_chat_template(value: str) -> str:
    """``model.chat_template``: the text of the file it names, or the Jinja string itself (ConfigError if neither)."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise utils.ConfigError(
        f"model.chat_template={value!r} is neither a file nor a Jinja template (no '{{{{' or '{{%'); "
        "give the path of a .jinja file or the template itself."
    )


def transformers_config(model_config: DictConfig, tokenizer=None):
    """The transformers config ``model.*`` describes, without weights; a random model's vocab_size (ConfigError if
    below the tokenizer's) and pad/BOS/EOS ids default to the tokenizer's."""
    import transformers

    if model_config.get("config") is not None:
        fields = OmegaConf.to_container(model_config.config, resolve=True)
        if tokenizer is not None:
            if fields.get("vocab_size") is not None and fields["vocab_size"] < len(tokenizer):
                raise utils.ConfigError(
                    f"model.config.vocab_size={fields['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} tokens; "
                    "remove it (it follows the tokenizer) or raise it."
                )
            fields.setdefault("vocab_size", len(tokenizer))
            fields.setdefault("pad_token_id", tokenizer.pad_token_id)
            fields.setdefault("eos_token_id", tokenizer.eos_token_id)
            fields.setdefault("bos_token_id", tokenizer.bos_token_id)
        return transformers.AutoConfig.for_model(**fields)
    _refuse_custom_code(model_config.name_or_path, "model.name_or_path")
    return transformers.AutoConfig.from_pretrained(model_config.name_or_path, trust_remote_code=False)


PARALLEL_MODEL_CHECKS: list = []
"""Plugins' checks of a model before processes start: ``check(config, hf_config_of, world_size)`` raises ConfigError
(``hf_config_of()`` gives the model's transformers config); parallel/sequence_parallel.py adds its heads' check."""


def check_parallel_model(config: DictConfig, world_size: int) -> None:
    """Raise ConfigError unless tensor parallelism (TensorParallelTrainer over ``world_size`` processes, or
    FSDPTrainer's ``tensor_parallel_size``) and each of :data:`PARALLEL_MODEL_CHECKS` can split this model."""
    for check in PARALLEL_MODEL_CHECKS:
        check(config, lambda: transformers_config(config.model), world_size)
    if config.trainer == "TensorParallelTrainer":
        tp, key = world_size, "world_size"
    else:
        tp, key = (config.get("tensor_parallel_size") or 1) if config.trainer == "FSDPTrainer" else 1, "tensor_parallel_size"
    if tp == 1:
        return
    check_tensor_parallel(transformers_config(config.model), tp, key)


def load_reference(config: DictConfig, tokenizer, apply_archive: bool = True) -> torch.nn.Module:
    """The frozen reference of ``model.*`` (a random one equals the policy's start) in ``model.reference_dtype``
    (null: the policy's), with ``model.archive``'s weights when set and ``apply_archive``."""
    dtype = utils.get_dtype(config.model.reference_dtype) or utils.get_dtype(config.model.policy_dtype)
    reference = load_model(config.model, tokenizer, dtype, config.seed)
    if apply_archive and config.model.archive is not None:
        archive = load_weights_file(
            config.model.archive, f"model.archive={config.model.archive}", "give the policy.pt of an earlier run"
        )
        reference.load_state_dict(archive["state"])
    return reference


# transformers config fields that say nothing about what the weights compute (names, versions, heads' labels, caching)
BOOKKEEPING_FIELDS = {
    "architectures", "dtype", "torch_dtype", "transformers_version", "id2label", "label2id", "num_labels", "problem_type",
    "output_attentions", "output_hidden_states", "return_dict", "use_cache", "initializer_range", "chunk_size_feed_forward",
}  # fmt: skip
# fields that may differ while the weights mean the same: the positions allowed, the tokenizer's special ids
HARMLESS_FIELDS = {"max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id", "pretraining_tp"}


def config_field_differences(saved, built) -> tuple[list, list]:
    """(fields that change what the weights compute, harmless fields) where transformers configs ``saved`` and ``built``
    differ, each ``(field, saved value, built value)``; dropout and bookkeeping fields left out."""
    a, b = saved.to_dict(), built.to_dict()
    changed, harmless = [], []
    for key in sorted(set(a) | set(b)):
        if key.startswith("_") or key in BOOKKEEPING_FIELDS or "dropout" in key or "pdrop" in key:
            continue
        if a.get(key) != b.get(key):
            (harmless if key in HARMLESS_FIELDS else changed).append((key, a.get(key), b.get(key)))
    return changed, harmless


TP_FAMILIES = ("llama", "gpt_neox", "gpt2")


def check_tensor_parallel(cfg, world_size: int, key: str = "world_size") -> None:
    """Raise ConfigError unless tensor parallelism can split a model with transformers config ``cfg`` over
    ``world_size`` processes; the message names ``key``, the setting to change."""
    family = cfg.model_type
    if family not in TP_FAMILIES:
        fix = (
            "use FSDPTrainer for this model" if key == "world_size" else "set tensor_parallel_size=1 (FSDP alone) for this model"
        )
        raise utils.ConfigError(
            f"Tensor parallelism supports the Llama, GPT-NeoX (Pythia) and GPT-2 families, not {family!r}; {fix}."
        )
    heads = cfg.num_attention_heads if family != "gpt2" else cfg.n_head
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % world_size or kv_heads % world_size:
        raise utils.ConfigError(
            f"{heads} attention heads ({kv_heads} key/value heads) cannot be split over {world_size} processes; "
            f"choose a {key} that divides them."
        )


def load_model(
    model_config: DictConfig, tokenizer, dtype: torch.dtype | None, seed: int, reward_head: bool = False
) -> torch.nn.Module:
    """A causal LM from ``model.name_or_path`` (or random from ``model.config``) with dropout disabled, or with
    ``reward_head`` a one-output sequence-classification model whose head starts random; ConfigError if it fails."""
    import transformers

    auto = transformers.AutoModelForSequenceClassification if reward_head else transformers.AutoModelForCausalLM
    hook = None if reward_head else _hook_for(model_config)
    auto = auto if hook is None else hook.auto_class(model_config)  # e.g. AutoModelForImageTextToText (vision/)
    extra = {"num_labels": 1} if reward_head else {}
    if not reward_head and model_config.get("config") is not None and (problem := causal_lm_problem(model_config)):
        raise utils.ConfigError(problem)
    if model_config.get("config") is not None:
        cfg = transformers_config(model_config, tokenizer)
        for key, value in extra.items():
            setattr(cfg, key, value)
        torch.manual_seed(seed)  # same random weights for policy and reference
        model = auto.from_config(cfg, dtype=dtype)
    else:
        kwargs = {"dtype": dtype, "trust_remote_code": False, **extra}
        if model_config.get("device_map"):
            kwargs["device_map"] = model_config.device_map
        _refuse_custom_code(model_config.name_or_path, "model.name_or_path")
        if not reward_head and (problem := causal_lm_problem(model_config)):
            raise utils.ConfigError(problem)
        try:
            model = auto.from_pretrained(model_config.name_or_path, **kwargs)
        except (OSError, ValueError, pickle.UnpicklingError) as e:  # no such id or folder, offline, no weights, no model_type
            pickled = pickled_weights_problem(e, model_config.name_or_path, "model.name_or_path")
            if pickled is not None:  # one sentence, not torch's advice to unpickle it unsafely
                raise utils.ConfigError(pickled) from None
            raise utils.ConfigError(
                f"Could not load model.name_or_path={model_config.name_or_path}: {_sentence(e)} {_LOAD_HINT}"
            ) from e
    if reward_head and model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id  # batches are padded
    disable_dropout(model)  # policy and reference must agree at step 0
    return model


def rank0_model(build, rank: int) -> torch.nn.Module:
    """``build()`` on rank 0 and the same architecture on the meta device elsewhere (every rank calls it), rank 0's
    ConfigError/DataError raised on every rank as ConfigError and anything else as RuntimeError."""
    model, spec = None, None
    if rank == 0:
        try:
            model = build()
            # its class too: an image-text-to-text model (vision/) is no AutoModelForCausalLM
            spec = ("ok", model.config, model.generation_config, (next(model.parameters()).dtype, type(model)))
        except Exception as e:
            from utils import DataError

            utils.broadcast_object(("config" if isinstance(e, (utils.ConfigError, DataError)) else "error", str(e), None, None))
            raise
    status, config, generation_config, built = utils.broadcast_object(spec)
    if rank == 0:
        return model
    if status == "config":
        raise utils.ConfigError(config)
    if status == "error":
        raise RuntimeError(f"Rank 0 could not load the model: {config}")
    dtype, cls = built
    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)  # rank 0's class (what its Auto class or a MODEL_HOOKS entry chose)
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


def lora_peft_config(lora: DictConfig, targets=None):
    """peft's ``LoraConfig`` for ``model.lora`` (causal LM; ``all-linear`` never includes the output layer), on
    ``targets`` (full module names, a plugin's choice) instead of ``model.lora.target_modules`` when given."""
    import peft

    if targets is None:
        targets = lora.target_modules
        targets = list(targets) if OmegaConf.is_list(targets) else targets
    return peft.LoraConfig(
        r=int(lora.r), lora_alpha=lora.alpha, lora_dropout=float(lora.dropout), target_modules=targets, task_type="CAUSAL_LM"
    )


def _none(*_):
    return None


def apply_lora(model: torch.nn.Module, lora: DictConfig) -> torch.nn.Module:
    """``model`` as a ``PeftModel`` with frozen base weights and identity-initialised adapters in the base's dtype
    and device (ConfigError naming its linear layers when ``model.lora.target_modules`` matches none)."""
    import warnings

    import peft

    try:
        with warnings.catch_warnings():  # peft reads a deprecated transformers attribute
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            targets = next((t for h in MODEL_HOOKS if (t := getattr(h, "lora_targets", _none)(model, lora))), None)
            return peft.get_peft_model(model, lora_peft_config(lora, targets), autocast_adapter_dtype=False)
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
        raise utils.ConfigError(
            f"model.lora.target_modules={targets} matches no module of {type(model).__name__} ({_sentence(e)[:120]}); "
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
    """A LoRA export's ``base_model_name_or_path``: the ``hf/`` beside ``model.archive``, else ``model.name_or_path``
    (absolute if local); None for a random model or an archive without export."""
    model = config.model
    if model.get("archive") is not None:
        beside = os.path.join(os.path.dirname(os.path.realpath(model.archive)), "hf")  # step-N/hf, not LATEST/hf
        return beside if os.path.isfile(os.path.join(beside, "config.json")) else None
    if model.get("config") is not None or model.name_or_path is None:
        return None
    path = str(model.name_or_path)
    return os.path.abspath(os.path.expanduser(path)) if os.path.isdir(os.path.expanduser(path)) else path


def lora_export_model(hf_config, lora: DictConfig, state: dict, base_path: str | None = None) -> torch.nn.Module:
    """A meta-device ``PeftModel`` of ``hf_config`` holding ``state`` (adapters alone, or the whole model, named as
    ``get_base_model().state_dict()``) without copying, for a LoRA export; ValueError if ``state`` does not fit."""
    import transformers

    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # building draws random numbers: resume stays exact
        # a plugin's class for this config (vision/: AutoModelForImageTextToText), else a causal LM
        hooks = (getattr(h, "config_auto_class", _none)(hf_config) for h in MODEL_HOOKS)
        base = next((c for c in hooks if c is not None), transformers.AutoModelForCausalLM).from_config(hf_config)
        model = apply_lora(base, lora)
    missing, unexpected = base.load_state_dict(state, strict=False, assign=True)
    if unexpected or any(".lora_" in k for k in missing):
        raise ValueError(f"the weights do not fit the LoRA model (e.g. {(unexpected or missing)[0]!r})")
    if getattr(hf_config, "tie_word_embeddings", False):
        base.tie_weights()  # one output layer with the embeddings, also when the state names it once
    model.peft_config["default"].base_model_name_or_path = base_path
    return model


def load_weights_file(path: str, label: str, fix: str, safe_globals: tuple = ()):
    """``torch.load`` of ``path`` onto the CPU, tensors, plain values and ``safe_globals`` only (so nothing in it
    runs code), else a ConfigError naming the file (``label``) and the fix."""
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refuses a global, e.g. GLOBAL posix.system, before calling it
        found = re.search(r"GLOBAL (\S+)|but got <class '([^']+)'>", str(e))
        if found is None:  # not a pickle of ours at all (e.g. a text file)
            raise utils.ConfigError(f"{label} could not be read (UnpicklingError); {fix}.") from None
        raise utils.ConfigError(
            f"{label} holds more than tensors and plain values (e.g. {found.group(1) or found.group(2)}), and is not "
            f"loaded because unpickling it could run code; {fix}."
        ) from None
    except Exception as e:  # a missing, truncated or foreign file
        raise utils.ConfigError(f"{label} could not be read ({utils.failure_reason(e)}); {fix}.") from None


def enable_activation_checkpointing(policy) -> None:
    """Recompute each block's activations in the backward (non-reentrant: LoRA's gradients flow although the frozen
    inputs need none)."""
    enable = getattr(policy, "activation_checkpointing_enable", None)  # transformers >= 5.24's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def adapters_off(peft_model):
    """Within: the network under ``peft_model`` with every adapter bypassed (peft's ``disable_adapter``), in eval mode
    (a LoRA run's reference); adapters and mode are restored afterwards, also on an error."""
    network = peft_model.get_base_model()
    training = network.training
    network.eval()
    try:
        with peft_model.disable_adapter():
            yield network
    finally:
        network.train(training)
