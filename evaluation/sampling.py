"""Policies evaluate.py and make_pairs.py sample from (run, checkpoint, hf folder, hub id), their prompts, and the one
generate call and samples-file row writer of evaluate.py, make_pairs.py, eval samples and online DPO."""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from omegaconf import DictConfig, OmegaConf

import data  # noqa: F401  (registers the data formats and datasets beyond hh, shp and se)
import preference_datasets
import utils
from data import chat
from data import prompts as prompt_sets
from data.loading import load_dataset_dict
from modeling import models
from runs import checkpoints, checks
from runs.config_text import digest
from runs.files import open_append
from utils import ConfigError


@dataclasses.dataclass
class Source:
    """A model to sample from, as ``policy=`` / ``baseline=`` named it."""

    label: str  # how results name it: the run folder's name, <run>/<step>, a hub id, ...
    kind: str  # "run", "checkpoint", "hf", "hub" or "reference"
    model_config: DictConfig  # the model.* it is built from: its run's, or evaluate's with name_or_path set to it
    weights: str | None  # a policy.pt loaded over that model
    seed: int  # builds a random model.config model as its run built it
    run_dir: str | None = None  # the training run folder it belongs to
    run_config: DictConfig | None = None  # that run's config.yaml
    fingerprint: str = ""  # a digest of what identifies its weights and tokenizer (cache keys)
    adapter: str | None = None  # a peft adapter folder loaded onto the model


def _stat(path: str) -> list:
    st = os.stat(path)
    return [os.path.realpath(path), st.st_size, st.st_mtime_ns]


def _folder_stat(path: str) -> list:
    names = sorted(n for n in os.listdir(path) if n.endswith((".json", ".safetensors", ".bin", ".model", ".txt", ".jinja")))
    return [_stat(os.path.join(path, n)) for n in names]


def _fingerprint(source: Source) -> str:
    model = OmegaConf.to_container(source.model_config, resolve=True)
    where = _folder_stat(source.model_config.name_or_path) if source.kind == "hf" else None
    adapter = _folder_stat(source.adapter) if source.adapter else None
    return digest([source.kind, model, source.seed, source.weights and _stat(source.weights), where, adapter])


def _enclosing_run(path: str) -> str | None:
    """The training run folder (a config.yaml without ``policy``) within three levels above ``path`` (a checkpoint's
    ``hf/`` or ``hf/merged``), or None."""
    folder = os.path.realpath(path)
    for _ in range(3):
        folder = os.path.dirname(folder)
        saved = os.path.join(folder, "config.yaml")
        if os.path.isfile(saved) and "policy" not in OmegaConf.load(saved):
            return folder
    return None


def _checkpoint_source(checkpoint: str, spec: str, what: str, kind: str) -> Source:
    real = os.path.realpath(checkpoint)
    run_dir = os.path.dirname(real)
    saved = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(saved):
        raise ConfigError(
            f"{what}={spec}: its run folder {run_dir} has no config.yaml, which says what model the checkpoint is; "
            "give the checkpoint of a run made by train.py, or its hf/ folder."
        )
    run_config = checkpoints.load_run_config(saved)
    if run_config.loss.name == "reward":
        raise ConfigError(
            f"{what}={spec} is a reward model (loss=reward), not a policy; give it to the judge as "
            f"reward_model.name_or_path={os.path.join(run_dir, 'LATEST', 'hf')}."
        )
    label = os.path.basename(run_dir) + ("" if kind == "run" else "/" + os.path.basename(real))
    source = Source(label, kind, run_config.model, os.path.join(real, "policy.pt"), int(run_config.seed), run_dir, run_config)
    source.fingerprint = _fingerprint(source)
    return source


def resolve_source(spec, config: DictConfig, what: str = "policy") -> Source:
    """The model ``spec`` names: a run folder (its LATEST), a checkpoint or its ``policy.pt`` (built from the run's saved
    ``model``), or a Hugging Face folder, adapter folder or hub id (evaluate's ``model.*`` with ``name_or_path`` set to it);
    ConfigError for a model that is not a causal LM (an image-text-to-text run) before any prompt is read."""
    source = _resolve_source(spec, config, what)
    problem = models.causal_lm_problem(source.model_config, f"{what}={spec}", hooks=False)  # sampling takes text alone
    if problem is not None:
        raise ConfigError(problem)
    return source


def _resolve_source(spec, config: DictConfig, what: str) -> Source:
    spec = str(spec)
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        if not path.endswith(".pt"):
            raise ConfigError(
                f"{what}={spec} is a file but not a checkpoint's policy.pt; give a run folder, a checkpoint, a Hugging Face folder or a hub id."
            )
        return _checkpoint_source(os.path.dirname(path), spec, what, "checkpoint")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "policy.pt")):
            return _checkpoint_source(path, spec, what, "checkpoint")
        if os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(os.path.join(path, "config.json")):
            return _adapter_source(path, spec, config, what)
        if os.path.isfile(os.path.join(path, "config.json")):
            with open(os.path.join(path, "config.json")) as f:
                architectures = json.load(f).get("architectures") or []
            if any(a.endswith("ForSequenceClassification") for a in architectures):
                raise ConfigError(
                    f"{what}={spec} is a sequence-classification (reward) model, not a policy; give it as reward_model.name_or_path."
                )
            model_config = config.model.copy()
            model_config.name_or_path, model_config.config = path, None
            run_dir = _enclosing_run(path)
            label = (
                f"{os.path.basename(run_dir)}/{os.path.relpath(os.path.realpath(path), run_dir)}"
                if run_dir
                else os.path.basename(os.path.abspath(path))
            )
            source = Source(label, "hf", model_config, None, int(config.seed), run_dir)
            source.fingerprint = _fingerprint(source)
            return source
        if os.path.isfile(os.path.join(path, "config.yaml")):
            if os.path.isfile(os.path.join(path, "LATEST", "policy.pt")):
                return _checkpoint_source(os.path.join(path, "LATEST"), spec, what, "run")
            raise ConfigError(
                f"{what}={spec} is a run folder without a checkpoint (no LATEST/policy.pt); evaluate a run that has saved one."
            )
        raise ConfigError(
            f"{what}={spec} is a folder but not a model: it holds no config.yaml with LATEST/policy.pt (a run folder), "
            "no policy.pt (a checkpoint) and no config.json (a Hugging Face model folder)."
        )
    if checks.looks_local(spec):
        raise ConfigError(f"{what}={spec} does not exist; give a run folder, a checkpoint, a Hugging Face folder or a hub id.")
    model_config = config.model.copy()
    model_config.name_or_path, model_config.config = spec, None
    source = Source(spec, "hub", model_config, None, int(config.seed))
    source.fingerprint = _fingerprint(source)
    return source


def _adapter_source(path: str, spec: str, config: DictConfig, what: str) -> Source:
    """A peft adapter folder (e.g. a LoRA run's ``hf/``): the checkpoint it was exported from when it lies in one,
    else its ``base_model_name_or_path`` with the adapters on top."""
    parent = os.path.dirname(os.path.realpath(path))
    if os.path.isfile(os.path.join(parent, "policy.pt")) and _enclosing_run(path):
        return _checkpoint_source(parent, spec, what, "checkpoint")
    with open(os.path.join(path, "adapter_config.json")) as f:
        base = json.load(f).get("base_model_name_or_path")
    if not base:
        raise ConfigError(
            f"{what}={spec} is a LoRA adapter folder whose adapter_config.json names no base model "
            "(base_model_name_or_path); give the checkpoint it came from, or its hf/merged folder."
        )
    model_config = config.model.copy()
    model_config.name_or_path, model_config.config = base, None
    run_dir = _enclosing_run(path)
    label = (
        f"{os.path.basename(run_dir)}/{os.path.relpath(os.path.realpath(path), run_dir)}" if run_dir else os.path.basename(path)
    )
    source = Source(
        label, "hub" if not os.path.isdir(base) else "hf", model_config, None, int(config.seed), run_dir, adapter=path
    )
    source.fingerprint = _fingerprint(source)
    return source


def reference_source(policy: Source) -> Source:
    """The reference of a policy trained here: its run's ``model.archive`` (the SFT checkpoint DPO started from), else
    its model before training (pretrained or seeded random init)."""
    if policy.run_config is None:
        raise ConfigError(
            f"baseline=reference needs a policy trained here (a run folder or checkpoint), whose model.archive or base model is "
            f"its reference; {policy.label} is not one: give its base model as baseline=<folder or hub id>."
        )
    archive = run_archive(policy, "give the model you mean as baseline=<its checkpoint> (reference=<it> for the KL)")
    if archive is not None and not os.path.isfile(archive):
        raise ConfigError(
            f"The reference of {policy.label} is model.archive={archive}, which is not a file here; run evaluate.py from the "
            "folder that run was started in, or give that checkpoint as baseline=<its folder>."
        )
    label = f"reference ({policy.model_config.archive or policy.model_config.get('name_or_path') or 'random init'})"
    source = Source(label, "reference", policy.model_config, archive, policy.seed, policy.run_dir, policy.run_config)
    source.fingerprint = _fingerprint(source)
    return source


def run_archive(source: Source, fix: str) -> str | None:
    """The ``model.archive`` of ``source``'s run: the file it started from (checkpoints.ARCHIVE_PIN), ConfigError ending in
    ``fix`` when that file changed since; as its config.yaml says for a run made before pins."""
    archive = source.model_config.archive
    if archive is None or source.run_dir is None:
        return archive
    checkpoints.check_archive_pin(source.run_dir, f"restore that file, or {fix}")
    return checkpoints.pinned_archive(source.run_dir, archive)


def load_source(source: Source, device) -> tuple[torch.nn.Module, object]:
    """(model in eval mode on ``device``, tokenizer) of ``source``; a LoRA run's ``policy.pt`` (adapters only) goes
    onto its base with its ``model.archive`` (``models.apply_lora``)."""
    try:
        tokenizer = models.load_tokenizer(source.model_config)
        model = models.load_model(source.model_config, tokenizer, utils.get_dtype(source.model_config.policy_dtype), source.seed)
    except ConfigError as e:
        if source.kind != "hub":
            raise
        raise ConfigError(
            f"{source.model_config.name_or_path} is not a folder here and could not be loaded as a hub id "
            f"({str(e)[:160]}); give a run folder, a checkpoint, a Hugging Face folder or a hub id this machine can reach."
        ) from None
    if source.adapter is not None:
        import pickle

        import peft

        problem = models.custom_code_problem(source.adapter, "The adapter folder")
        if problem is not None:
            raise ConfigError(problem)
        try:
            model = peft.PeftModel.from_pretrained(model, source.adapter, trust_remote_code=False)
        except pickle.UnpicklingError as e:  # a pickled adapter_model.bin that holds more than tensors
            raise ConfigError(models.pickled_weights_problem(e, source.adapter, "The adapter folder")) from None
    if source.weights is not None:
        try:
            checkpoint = models.load_weights_file(
                source.weights, f"The weights file {source.weights}", "give a checkpoint written by train.py"
            )
            if checkpoint.get("lora") is None:
                model.load_state_dict(checkpoint["state"])
            else:
                archive = run_archive(source, "train a new LoRA run on the file there now")  # its base
                if archive is not None:
                    base = models.load_weights_file(
                        archive, f"{source.label}'s model.archive={archive}", "give the policy.pt of an earlier run"
                    )
                    model.load_state_dict(base["state"])
                model = models.apply_lora(model, OmegaConf.create(checkpoint["lora"]))
                # the adapters are named as in the base that peft injected them into (trainers: policy_checkpoint)
                unexpected = model.get_base_model().load_state_dict(checkpoint["state"], strict=False).unexpected_keys
                if unexpected:
                    raise RuntimeError(f"unexpected adapter weights, e.g. {unexpected[0]!r}")
        except (RuntimeError, KeyError, TypeError, AttributeError, OSError, EOFError) as e:
            detail = (utils.first_line(e) or type(e).__name__)[:200]
            raise ConfigError(
                f"{source.weights} could not be loaded into {source.label}'s model ({detail}); give a checkpoint of a run of that model."
            ) from e
    model.to(device).eval()
    return model, tokenizer


ROLE_TAGS = {"user": "Human", "assistant": "Assistant", "system": "System"}


def messages_text(messages: list[dict]) -> str:
    """A conversation as HH's plain text (``"\\n\\nHuman: ...\\n\\nAssistant:"``), as a plain-text HH reward model or an
    LLM judge reads it."""
    turns = "".join(f"\n\n{ROLE_TAGS.get(m['role'], m['role'].capitalize())}: {m['content']}" for m in messages)
    return turns + preference_datasets.ASSISTANT_TAG


def response_text(response) -> str:
    """A chosen response as text: a string as it is, a message list as its assistant contents."""
    if isinstance(response, str):
        return response
    return "\n\n".join(m["content"] for m in response if m.get("role") == "assistant")


def load_items(config: DictConfig, silent: bool = False, split: str = "test") -> list[dict]:
    """The first ``n_prompts`` prompts of ``split`` of each of ``datasets``, in order: ``prompt`` as the dataset gives it,
    ``judge_prompt`` as the judge reads it, ``chosen`` only with ``baseline=chosen``, ``fields`` for reward functions."""
    options = OmegaConf.to_container(config.data, resolve=True)
    items = []
    for name in config.datasets:
        if config.get("baseline") == "chosen":
            if name not in preference_datasets.registered("pairs"):
                raise ConfigError(
                    f"baseline=chosen compares with the dataset's chosen responses, and {name} has prompts only; "
                    "use baseline=reference or another policy."
                )
            data = load_dataset_dict(name, split, options.get(name), silent)
            if any(e.get("images") for e in data.values()):  # read by vision/ where a process imported it
                raise ConfigError(f"datasets=[{name}] holds image prompts, which are not sampled from; give text prompts.")
            entries = [(e.get("prompt_messages", key), e["sft_target"], e.get("fields", {})) for key, e in data.items()]
        else:
            entries = [(p, None, f) for p, f in prompt_sets.load_prompt_entries(name, split, options, silent)]
        mode = prompt_sets.prompt_truncation_mode(name)
        for k, (prompt, chosen, fields) in enumerate(entries[: config.n_prompts]):
            conversation = isinstance(prompt, list)
            items.append(
                {
                    "id": f"{name}/{k}",
                    "index": len(items),
                    "dataset": name,
                    "prompt": prompt,
                    "judge_prompt": messages_text(prompt) if conversation else prompt,
                    "chosen": None if chosen is None else judged_response(response_text(chosen), conversation),
                    "conversation": conversation,
                    "truncation_mode": mode,
                    "fields": fields,
                }
            )
    return items


def judged_response(text: str, conversation: bool) -> str:
    """A response as the judge reads it: as it is after a plain-text prompt, else one space and the text stripped."""
    return " " + text.strip() if conversation else text  # a chat model's reply and the chosen one look alike


def prompt_ids(items: list[dict], tokenizer, config: DictConfig) -> list[list[int]]:
    """Each item's prompt token ids as ``tokenizer``'s model sees them when sampling (chat template, BOS, cut to
    ``max_prompt_length``)."""
    examples = [
        {
            "prompt": it["prompt"],
            "truncation_mode": it["truncation_mode"],
            **({"conversation": True} if it["conversation"] else {}),
        }
        for it in items
    ]
    examples = chat.render_conversations(
        examples, tokenizer, config.max_length, config.max_prompt_length, silent=True, split="test"
    )
    return [
        preference_datasets.tokenize_prompt(
            ex["prompt"], tokenizer, config.max_prompt_length, ex["truncation_mode"], "end_token_id" in ex
        )["prompt_input_ids"]
        for ex in examples
    ]


def completion_text(tokenizer, prompt: list[int], completion: list[int], stop_ids=()) -> str:
    """The text ``completion`` adds after ``prompt`` as every scorer reads it: ``decode(prompt + completion)`` after
    ``decode(prompt)``, special tokens skipped and a last token in ``stop_ids`` dropped; where the decoded prompt is not
    a prefix of the whole (a byte-fallback character split between the two), the whole from where the two first differ."""
    # decoded alone, a SentencePiece "▁girl" loses its space: "a littlegirl"
    if completion and completion[-1] in stop_ids:
        completion = completion[:-1]
    whole = tokenizer.decode(list(prompt) + list(completion), skip_special_tokens=True)
    head = tokenizer.decode(list(prompt), skip_special_tokens=True)
    if whole.startswith(head):
        return whole[len(head) :]
    return whole[len(os.path.commonprefix([whole, head])) :]  # the split character whole, as the completion's first


def completion_mask(completions: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """(N, T) bool: the tokens of each (N, T) completion up to and including its first stop token in
    ``eos_token_id`` (all when none)."""
    is_eos = torch.isin(completions, torch.as_tensor(eos_token_id, device=completions.device)).long()
    return (is_eos.cumsum(1) - is_eos) == 0


def generate(
    model,
    ids: torch.Tensor,
    mask: torch.Tensor,
    stop_ids: list[int],
    pad_token_id: int,
    *,
    device=None,
    seed: int | None = None,
    as_config: bool = False,
    generate_kwargs: dict | None = None,
    **settings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model``'s completions of the left-padded prompts ``ids`` / ``mask`` (B, P) in eval mode (its mode restored),
    stopping at ``stop_ids``, ``settings`` (do_sample, top_p, ...) over the model's generation_config, seeded with ``seed``:
    (completions (B * num_return_sequences, T), their :func:`completion_mask`), on the CPU."""
    settings |= {"pad_token_id": pad_token_id, "eos_token_id": stop_ids}  # the rest: the model's generation_config
    if as_config:  # as one GenerationConfig: transformers 4 swaps a setting equal to its default for the model's
        from transformers import GenerationConfig

        settings = {"generation_config": GenerationConfig(**settings)}
    device = next(model.parameters()).device if device is None else device
    if seed is not None:
        torch.manual_seed(seed)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **settings, **(generate_kwargs or {}))
    finally:
        model.train(training)
    completions = out[:, ids.shape[1] :].cpu()
    return completions, completion_mask(completions, stop_ids)


def completion_texts(tokenizer, prompts: list[list[int]], completions: torch.Tensor, mask: torch.Tensor, stop_ids) -> list[str]:
    """Each (N, T) completion's tokens under ``mask`` as the text they add after its prompt ``prompts[i]`` (token ids,
    unpadded): :func:`completion_text`."""
    return [completion_text(tokenizer, p, c[m].tolist(), stop_ids) for p, c, m in zip(prompts, completions, mask)]


def append_rows(path: str, rows: list[dict], then: str) -> None:
    """Append ``rows`` to the JSON-lines file ``path`` (a run's samples.jsonl or completions.jsonl); a full disk:
    utils.DiskFullError ending with ``then``."""
    with utils.saying_disk_full(path, "append to", then), open_append(path) as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def generate_batch(
    model, tokenizer, stop_ids: list[int], prompts: list[list[int]], temperature: float, config, seed: int
) -> list[dict]:
    """One sample per prompt from one left-padded ``generate`` call seeded with ``seed`` (greedy at temperature 0),
    each ``{"text", "n_tokens" (with the stop token), "ended" (at a stop token), "tokens"}``."""
    ids, mask = preference_datasets.left_pad(prompts, tokenizer.pad_token_id)
    sampling = temperature > 0
    completions, keep = generate(
        model,
        ids,
        mask,
        stop_ids,
        tokenizer.pad_token_id,
        seed=seed,
        as_config=True,
        do_sample=sampling,
        temperature=temperature if sampling else 1.0,
        top_k=config.top_k if sampling else None,
        top_p=config.top_p if sampling else 1.0,
        max_new_tokens=config.max_new_tokens,
    )
    samples = []
    for prompt, row, m in zip(prompts, completions, keep):
        tokens = row[m].tolist()
        ended = bool(tokens) and tokens[-1] in stop_ids
        text = completion_text(tokenizer, list(prompt), tokens, stop_ids)
        samples.append({"text": text, "n_tokens": len(tokens), "ended": ended, "tokens": tokens})
    return samples


def decode_completions(tokenizer, completions: torch.Tensor, stop_ids: list[int]) -> list[str]:
    """Each (N, T) row's text up to its first stop token, special tokens skipped, ending with the stop token's
    own text when it stopped at one (a chat model's ``<|im_end|>``)."""
    mask = completion_mask(completions, stop_ids)
    texts = []
    for row, m in zip(completions, mask):
        row = row[m].tolist()
        stopped = bool(row) and row[-1] in stop_ids
        text = tokenizer.decode(row[:-1] if stopped else row, skip_special_tokens=True)
        texts.append(text + (tokenizer.convert_ids_to_tokens(row[-1]) if stopped else ""))
    return texts
