"""Preference datasets: registered loaders returning ``{prompt: {"responses": [str, ...], "pairs": [(i_chosen, i_rejected),
...], "sft_target": str}}`` (docs/data.md), then tokenization and batching."""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
import torch

from losses import IGNORE_INDEX
from utils import DataError

if TYPE_CHECKING:  # the loaders' helpers in data/ are imported where they are called: data/__init__ imports this module
    from data.conversations import Messages
    from data.report import DatasetDict

ASSISTANT_TAG = "\n\nAssistant:"
HUMAN_TAG = "\n\nHuman:"


@dataclass(frozen=True)
class DatasetSpec:
    """A registered loader; ``truncation_mode`` keeps a too-long prompt's end (``keep_end``) or start (``keep_start``)."""

    loader: Callable[..., DatasetDict]
    truncation_mode: str
    reward_functions: tuple[str, ...] = ()  # what checks an answer to its prompts exactly (eval_reward_functions=auto)


REGISTRY: dict[str, dict[str, DatasetSpec]] = {}  # name -> {"pairs": spec, "prompts": spec (online DPO)}, either or both


def registered(kind: str) -> MappingProxyType:
    """A read-only ``{name: DatasetSpec}`` of the registered ``"pairs"`` or ``"prompts"`` (online DPO) loaders."""
    return MappingProxyType({name: specs[kind] for name, specs in REGISTRY.items() if kind in specs})


def _registrar(kind: str, label: str, name: str, truncation_mode: str, reward_functions=()):
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode must be keep_start or keep_end, not {truncation_mode!r}.")

    def wrap(fn):
        if kind in REGISTRY.get(name, {}):
            raise ValueError(f"A {label} named {name!r} is already registered.")
        REGISTRY.setdefault(name, {})[kind] = DatasetSpec(fn, truncation_mode, tuple(reward_functions))
        return fn

    return wrap


def register_dataset(name: str, truncation_mode: str = "keep_start", reward_functions: tuple[str, ...] = ()):
    """Decorator: register ``fn(split, report, **options) -> DatasetDict`` (options: ``data.<name>``) under ``name``."""
    return _registrar("pairs", "dataset", name, truncation_mode, reward_functions)


def declared_reward_functions(names) -> list[str]:
    """The reward functions the datasets ``names`` register as checking their answers exactly, in order."""
    pairs = registered("pairs")
    return [f for name in names if name in pairs for f in pairs[name].reward_functions]


def register_prompt_dataset(name: str, truncation_mode: str = "keep_start"):
    """Decorator: register an online-DPO ``fn(split, report, **options) -> list[str] | DatasetDict`` of prompts."""
    return _registrar("prompts", "prompt dataset", name, truncation_mode)


def split_prompt_and_responses(chosen: str, rejected: str) -> tuple[str, str, str] | None:
    """Split two HH dialogues at their longest common prefix ending with ``"\\n\\nAssistant:"``, or None."""
    n = 0
    limit = min(len(chosen), len(rejected))
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    idx = chosen.rfind(ASSISTANT_TAG, 0, n)
    if idx < 0:
        return None
    cut = idx + len(ASSISTANT_TAG)
    return chosen[:cut], chosen[cut:], rejected[cut:]


# ----------------------------------------------------------------------------- loaders


HH_ROLES = {HUMAN_TAG: "user", ASSISTANT_TAG: "assistant"}


def hh_messages(text: str) -> tuple[Messages, bool]:
    """(messages, whether merged): HH dialogue text as user / assistant messages, consecutive turns of one role merged."""
    pieces = re.split(r"(\n\nHuman:|\n\nAssistant:)", text)
    turns = [("user", pieces[0])] if pieces[0].strip() else []
    turns += [(HH_ROLES[tag], content) for tag, content in zip(pieces[1::2], pieces[2::2])]
    messages: Messages = []
    merged = False
    for role, content in turns:
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] = (messages[-1]["content"] + "\n\n" + content.strip()).strip()
            merged = True
        else:
            messages.append({"role": role, "content": content.strip()})
    return messages, merged


def _add_hh_conversation(data: DatasetDict, prompt: str, chosen: str, rejected: str, report, row: str) -> bool:
    """:func:`add_conversation_pair` of one split HH pair (prompt text ending with the Assistant tag)."""
    from data.conversations import add_conversation_pair, conversation_key
    from data.report import note_row

    prompt_messages, merged = hh_messages(prompt[: -len(ASSISTANT_TAG)])
    responses = [hh_messages(ASSISTANT_TAG + response) for response in (chosen, rejected)]
    key = conversation_key(prompt_messages)
    if not prompt_messages:
        note_row(report, "skipped: empty prompt", key)
        return False
    if any(messages[-1]["role"] != "assistant" for messages, _ in responses):
        note_row(report, "skipped: dialogue ends with a Human turn", key)
        return False
    added = add_conversation_pair(data, prompt_messages, responses[0][0], responses[1][0], report, row)
    if added and (merged or responses[0][1] or responses[1][1]):
        note_row(report, "repaired: consecutive turns of one role merged", key)
    return added


def hh_rows_to_data(
    rows, report: collections.Counter, source: str = "hh", data: DatasetDict | None = None, conversation: bool = False
) -> DatasetDict:
    """Anthropic HH rows ({"chosen": dialogue, "rejected": dialogue}) added to ``data`` (as messages with ``conversation``)."""
    data = {} if data is None else data
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("chosen"), str) or not isinstance(row.get("rejected"), str):
            raise DataError(f"{source}, row {i}: needs string fields 'chosen' and 'rejected'.")
        add_hh_pair(data, row["chosen"], row["rejected"], report, f"{source}, row {i}" if conversation else None, conversation)
    return data


def add_hh_pair(
    data: DatasetDict, chosen: str, rejected: str, report: collections.Counter, row: str | None, conversation: bool = False
) -> tuple[str, bool]:
    """Add two whole HH dialogues' pair to ``data``: (the prompt's key, or ``chosen`` if they share no turn; whether added)."""
    from data.conversations import conversation_key
    from data.report import add_pair, note_row

    split = split_prompt_and_responses(chosen, rejected)
    if split is None:
        note_row(report, "skipped: no common Assistant turn", chosen)
        return chosen, False
    prompt, chosen, rejected = split
    if conversation:
        added = _add_hh_conversation(data, prompt, chosen, rejected, report, row)
        key = conversation_key(hh_messages(prompt[: -len(ASSISTANT_TAG)])[0])
    else:
        added, key = add_pair(data, prompt, chosen, rejected, report, row), prompt
    if added and ASSISTANT_TAG in chosen:
        note_row(report, "repaired: dialogues diverge before the last Assistant turn", key)
    return key, added


@register_dataset("hh", truncation_mode="keep_end")
def get_hh(
    split: str,
    report: collections.Counter,
    local_dir: str | None = None,
    subsets: list[str] | None = None,
    holdout_fraction: float = 0.0,
    cache_dir: str | None = None,
    conversation: bool = False,
) -> DatasetDict:
    """Anthropic Helpful-Harmless (Bai et al. 2022): hub ``Anthropic/hh-rlhf``, or ``data.hh.local_dir`` laid out as
    ``<local_dir>/<subset>/<split>.jsonl.gz``."""
    from data.holdout import apply_holdout
    from data.readers import load_from_hub, read_json_records

    source_split = "train" if holdout_fraction else split
    if local_dir is None:
        hub = (
            load_from_hub("Anthropic/hh-rlhf", "data.hh.local_dir", data_dir=s, split=source_split, cache_dir=cache_dir)
            for s in subsets or [None]
        )
        data = hh_rows_to_data([row for rows in hub for row in rows], report, conversation=conversation)
    else:
        if not os.path.isdir(local_dir):
            raise DataError(f"data.hh.local_dir={local_dir} is not a folder; point it at a copy of the hh-rlhf repository.")
        names = subsets or sorted(d for d in os.listdir(local_dir) if os.path.isdir(os.path.join(local_dir, d)))
        if holdout_fraction:
            have = {s for s in ("train", "test") for n in names if os.path.exists(os.path.join(local_dir, n, f"{s}.jsonl.gz"))}
            source_split = "train" if "train" in have else "test"
        paths = [os.path.join(local_dir, n, f"{source_split}.jsonl.gz") for n in names]
        paths = [p for p in paths if os.path.exists(p)]
        if not paths:
            hint = " (set data.hh.holdout_fraction=0.1 to carve an eval slice from the split that exists)"
            raise DataError(
                f"No {source_split}.jsonl.gz under {local_dir} for subsets {names}{'' if holdout_fraction else hint}."
            )
        data: DatasetDict = {}
        for p in paths:
            hh_rows_to_data(read_json_records(p), report, p, data, conversation)
    return apply_holdout(data, split, holdout_fraction, report) if holdout_fraction else data


SHP_FIELDS = {"history": str, "human_ref_A": str, "human_ref_B": str}
SHP_FIELDS |= dict.fromkeys(("score_A", "score_B", "labels"), (int, float))


def shp_rows_to_data(
    rows, report: collections.Counter, max_pairs_per_prompt: int = 5, min_score_ratio: float = 2.0, source: str = "shp"
) -> DatasetDict:
    """SHP rows to a DatasetDict: pairs of score ratio >= ``min_score_ratio``, at most ``max_pairs_per_prompt`` a prompt
    (largest ratios), the best-scored response as sft_target."""
    from data.report import add_pair, note_row, require_fields

    data: DatasetDict = {}
    ratios: dict[str, list[float]] = {}
    scores: dict[str, dict[str, float]] = {}
    for i, row in enumerate(rows, 1):
        require_fields(row, SHP_FIELDS, source, i, "shp")
        prompt = "\n\nHuman: " + row["history"] + "\n\nAssistant:"
        a, b = " " + row["human_ref_A"], " " + row["human_ref_B"]
        sa, sb = float(row["score_A"]), float(row["score_B"])
        if sa == sb:
            note_row(report, "skipped: score tie", prompt)
            continue
        hi, lo = max(sa, sb), min(sa, sb)
        if lo <= 0:
            note_row(report, "kept: zero or negative score (ratio taken as infinite)", prompt)
            ratio = float("inf")
        else:
            ratio = hi / lo
        if ratio < min_score_ratio:
            note_row(report, "skipped: score ratio below min_score_ratio", prompt)
            continue
        chosen, rejected = (a, b) if int(row["labels"]) == 1 else (b, a)
        if add_pair(data, prompt, chosen, rejected, report):
            ratios.setdefault(prompt, []).append(ratio)
            scores.setdefault(prompt, {}).update({a: sa, b: sb})
    for prompt, entry in data.items():
        order = sorted(range(len(entry["pairs"])), key=lambda k: -ratios[prompt][k])
        if len(order) > max_pairs_per_prompt:
            note_row(report, "skipped: over max_pairs_per_prompt", prompt, len(order) - max_pairs_per_prompt)
        entry["pairs"] = [entry["pairs"][k] for k in order[:max_pairs_per_prompt]]
        entry["sft_target"] = max(entry["responses"], key=lambda r: scores[prompt][r])  # as the reference repo
    return data


@register_dataset("shp", truncation_mode="keep_start")
def get_shp(
    split: str,
    report: collections.Counter,
    path: str | None = None,
    max_pairs_per_prompt: int = 5,
    min_score_ratio: float = 2.0,
    cache_dir: str | None = None,
) -> DatasetDict:
    """Stanford Human Preferences (Ethayarajh et al. 2022), hub ``stanfordnlp/SHP``, or its rows' file ``data.shp.path``."""
    from data.readers import hub_or_file_rows

    rows = hub_or_file_rows(path, "stanfordnlp/SHP", "data.shp.path", split, cache_dir)
    return shp_rows_to_data(rows, report, max_pairs_per_prompt, min_score_ratio, path or "stanfordnlp/SHP")


def se_rows_to_data(rows, report: collections.Counter, source: str = "se") -> DatasetDict:
    """Stack Exchange rows ({question, answers: [{text, pm_score}]}) to a DatasetDict, the higher score chosen."""
    from data.readers import strip_html
    from data.report import add_pair, not_finite, note_row, require_fields

    data: DatasetDict = {}
    for k, row in enumerate(rows, 1):
        require_fields(row, {"question": str, "answers": list}, source, k, "se")
        for j, answer in enumerate(row["answers"], 1):
            score = answer.get("pm_score") if isinstance(answer, dict) else None
            if not isinstance(answer, dict) or not isinstance(answer.get("text"), str) or not isinstance(score, (int, float)):
                raise DataError(f"{source}, row {k}: answer {j} needs a string 'text' and a numeric 'pm_score'.")
            if not math.isfinite(score):
                raise DataError(not_finite(f"{source}, row {k}", f"answer {j}'s 'pm_score'", score))
        prompt = "\n\nHuman: " + strip_html(row["question"]) + "\n\nAssistant:"
        answers = [(" " + strip_html(a["text"]), a["pm_score"]) for a in row["answers"]]
        for i in range(len(answers)):
            for j in range(i + 1, len(answers)):
                (ti, si), (tj, sj) = answers[i], answers[j]
                if si == sj:
                    note_row(report, "skipped: answer score tie", prompt)
                    continue
                chosen, rejected = (ti, tj) if si > sj else (tj, ti)
                add_pair(data, prompt, chosen, rejected, report)
        if prompt in data and answers:
            data[prompt]["sft_target"] = max(answers, key=lambda a: a[1])[0]
    return data


@register_dataset("se", truncation_mode="keep_start")
def get_se(
    split: str, report: collections.Counter, path: str | None = None, holdout_fraction: float = 0.01, cache_dir: str | None = None
) -> DatasetDict:
    """Stack Exchange preferences (Lambert et al. 2023), hub id ``HuggingFaceH4/stack-exchange-preferences``."""
    from data.holdout import apply_holdout
    from data.readers import hub_or_file_rows

    rows = hub_or_file_rows(path, "HuggingFaceH4/stack-exchange-preferences", "data.se.path", "train", cache_dir)
    return apply_holdout(
        se_rows_to_data(rows, report, path or "HuggingFaceH4/stack-exchange-preferences"), split, holdout_fraction, report
    )


# ----------------------------------------------------------------------------- tokenization


def _encode(tokenizer, text: str, rendered: bool = False) -> list[int]:
    # plain text: a spelled "</s>" stays text (split_special_tokens); rendered text: a template's <|im_start|> is one token
    return tokenizer(text, add_special_tokens=False, split_special_tokens=not rendered)["input_ids"]


def example_key(prompt: str, chosen: str, rejected: str | None) -> str:
    """A stable id of one example (its texts), e.g. to look up precomputed reference log-probs."""
    return hashlib.sha256(json.dumps([prompt, chosen, rejected]).encode("utf-8")).hexdigest()[:32]


def truncate_prompt_ids(prompt_ids: list[int], max_prompt_length: int, truncation_mode: str, bos_id: int | None) -> list[int]:
    """``prompt_ids`` cut to at most ``max_prompt_length`` tokens, keeping its start or its end (behind ``bos_id``)."""
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"truncation_mode must be keep_start or keep_end, not {truncation_mode!r}.")
    if len(prompt_ids) <= max_prompt_length:
        return prompt_ids
    if truncation_mode == "keep_start":
        return prompt_ids[:max_prompt_length]
    head = prompt_ids[:1] if bos_id is not None and max_prompt_length > 0 else []
    return head + prompt_ids[len(prompt_ids) - (max_prompt_length - len(head)) :]


def _strip_eos(tokenizer, text: str) -> str:
    eos = tokenizer.eos_token
    return text[: -len(eos)] if eos and text.endswith(eos) else text


def _with_bos(tokenizer, ids: list[int]) -> list[int]:
    return ids if tokenizer.bos_token_id is None else [tokenizer.bos_token_id] + ids


_USE_TOKENIZER = object()


def truncate_pair_ids(
    prompt_ids: list[int],
    response_ids: list[list[int]],
    truncation_mode: str,
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    end_id=None,
    bos_id=_USE_TOKENIZER,
) -> tuple[list[int], list[list[int]]]:
    """(prompt ids, [response ids, ...]) cut to fit ``max_length`` tokens, each response still ending with EOS or ``end_id``."""
    end = tokenizer.eos_token_id if end_id is None else end_id
    bos = tokenizer.bos_token_id if bos_id is _USE_TOKENIZER else bos_id
    longest = max(len(r) for r in response_ids)
    if len(prompt_ids) + longest > max_length:
        prompt_ids = truncate_prompt_ids(prompt_ids, max_prompt_length, truncation_mode, bos)
    room = max_length - len(prompt_ids)
    return prompt_ids, [ids if len(ids) <= room else ids[: room - 1] + [end] for ids in response_ids]


def _leading_bos(tokenizer, ids: list[int]) -> int | None:
    """The BOS id when a rendered prompt starts with it exactly once (a sequence start), else None."""
    bos = tokenizer.bos_token_id
    return bos if bos is not None and ids[:1] == [bos] and ids.count(bos) == 1 else None


def _encode_pieces(encode, pieces) -> tuple[list[int], list[bool]]:
    """Ids of ``pieces`` ([[text, trained], ...]) tokenized one by one, and per id whether it is trained."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, trained in pieces:
        piece = encode(text)
        ids += piece
        mask += [bool(trained)] * len(piece)
    return ids, mask


def _example_ids(texts: dict, encode, tokenizer, end_id, pieces, truncation_mode, max_length, max_prompt_length):
    """(prompt ids, prompt mask, full response ids, cut prompt ids, cut response ids, cut prompt mask, cut response
    masks) of one example, masks True on trained tokens."""
    sides = [s for s in ("chosen", "rejected") if texts.get(s) is not None]
    pieces = pieces or {}
    if end_id is None:
        prompt_ids = _with_bos(tokenizer, encode(texts["prompt"]))
        prompt_mask = [False] * len(prompt_ids)
        full = [encode(_strip_eos(tokenizer, texts[s])) + [tokenizer.eos_token_id] for s in sides]
        masks = [[True] * len(ids) for ids in full]
        bos = tokenizer.bos_token_id
    else:
        prompt_ids, prompt_mask = _encode_pieces(encode, pieces.get("prompt") or [[texts["prompt"], False]])
        full, masks = zip(*(_encode_pieces(encode, pieces.get(s) or [[texts[s], True]]) for s in sides))
        full, masks = list(full), list(masks)
        bos = _leading_bos(tokenizer, prompt_ids)
    cut = (truncation_mode, tokenizer, max_length, max_prompt_length)
    cut_prompt, cut_responses = truncate_pair_ids(prompt_ids, full, *cut, end_id=end_id, bos_id=bos)
    cut_prompt_mask, cut_masks = truncate_pair_ids(prompt_mask, masks, *cut, end_id=True, bos_id=bos)  # same cut
    return prompt_ids, prompt_mask, full, cut_prompt, cut_responses, cut_prompt_mask, cut_masks


def tokenize_element(
    prompt: str,
    chosen: str,
    rejected: str | None,
    truncation_mode: str,
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    end_token_id: int | None = None,
    pieces: dict | None = None,
) -> dict:
    """One example as ``prompt_input_ids`` and per side ``{side}_input_ids``, ``{side}_attention_mask``, ``{side}_labels``
    (IGNORE_INDEX where not trained): BOS + prompt, each response + EOS, truncated to ``max_length``."""
    assert max_prompt_length < max_length, "checks.validate_config refuses this config"
    responses = {"chosen": chosen} if rejected is None else {"chosen": chosen, "rejected": rejected}

    def encode(text):
        return _encode(tokenizer, text, end_token_id is not None)

    texts = {"prompt": prompt, **responses}
    *_, prompt_ids, cut, prompt_mask, masks = _example_ids(
        texts, encode, tokenizer, end_token_id, pieces, truncation_mode, max_length, max_prompt_length
    )
    element = {"prompt": prompt, "prompt_input_ids": prompt_ids, "key": example_key(prompt, chosen, rejected)}
    for side, ids, mask in zip(responses, cut, masks):
        seq = prompt_ids + ids
        element[f"{side}_input_ids"] = seq
        element[f"{side}_attention_mask"] = [1] * len(seq)
        element[f"{side}_labels"] = [i if m else IGNORE_INDEX for i, m in zip(seq, prompt_mask + mask)]
        element[side] = responses[side]
    return element


def collate(elements: list[dict], pad_token_id: int) -> dict:
    """Pad tokenized elements into (B, T) long tensors, right-padded (``pad_token_id``, 0, IGNORE_INDEX),
    ``prompt_input_ids`` left-padded, an unpaired ``label`` a (B,) bool tensor."""
    batch: dict = {}
    for key in elements[0]:
        values = [e[key] for e in elements]
        if key == "label":
            batch[key] = torch.tensor(values, dtype=torch.bool)
            continue
        if not key.endswith(("_input_ids", "_attention_mask", "_labels")):
            batch[key] = values
            continue
        pad = IGNORE_INDEX if key.endswith("_labels") else 0 if key.endswith("_attention_mask") else pad_token_id
        width = max(len(v) for v in values)
        if key == "prompt_input_ids":
            batch[key], batch["prompt_attention_mask"] = left_pad(values, pad)
        else:
            batch[key] = torch.tensor([v + [pad] * (width - len(v)) for v in values])
    return batch


def left_pad(seqs: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad ``seqs`` to the longest: (ids, attention_mask), both (B, P) long, the mask 0 over the padding."""
    width = max(len(v) for v in seqs)
    ids = torch.tensor([[pad_token_id] * (width - len(v)) + list(v) for v in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(v)) + [1] * len(v) for v in seqs], dtype=torch.long)
    return ids, mask


def _prompt_only_ids(ids: list[int], tokenizer, rendered: bool, max_prompt_length: int, truncation_mode: str) -> list[int]:
    """A prompt's encoded ids as :func:`tokenize_prompt` gives them (before and after the cut)."""
    if not rendered:
        return truncate_prompt_ids(_with_bos(tokenizer, ids), max_prompt_length, truncation_mode, tokenizer.bos_token_id)
    return truncate_prompt_ids(ids, max_prompt_length, truncation_mode, _leading_bos(tokenizer, ids))


def tokenize_prompt(prompt: str, tokenizer, max_prompt_length: int, truncation_mode: str, rendered: bool = False) -> dict:
    """Tokenize one prompt for sampling as :func:`tokenize_element` does its prompt, no EOS: ``{"prompt",
    "prompt_input_ids"}``, at most ``max_prompt_length`` ids."""
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}.")
    ids = _encode(tokenizer, prompt, rendered)
    return {"prompt": prompt, "prompt_input_ids": _prompt_only_ids(ids, tokenizer, rendered, max_prompt_length, truncation_mode)}


EXAMPLE_TOKENIZERS: dict[str, Callable[..., dict]] = {}
"""Plugins' tokenizers by an example's field: an example holding ``field`` becomes
``EXAMPLE_TOKENIZERS[field](ex, tokenizer, max_length, max_prompt_length)``, :func:`tokenize_element`'s dict plus what it
adds (vision/: ``"images"``, adding ``model_inputs``, a dict of tensors :func:`stacked_model_inputs` batches)."""


def epoch_order(
    n: int, seed: int, epoch: int, shuffle: bool, lengths: list[int] | None = None, group_size: int = 0
) -> np.ndarray:
    """The order of ``n`` examples in ``epoch``: a permutation drawn from (seed, epoch), optionally length-grouped."""
    if not shuffle:
        return np.arange(n)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    if lengths is None or group_size <= 1:
        return order
    groups = [order[i : i + group_size] for i in range(0, n, group_size)]
    return np.concatenate([g[np.argsort([-lengths[j] for j in g], kind="stable")] for g in groups])


def get_batch_iterator(
    examples: list[dict],
    tokenizer,
    batch_size: int,
    max_length: int,
    max_prompt_length: int,
    shuffle: bool = True,
    seed: int = 0,
    n_epochs: int | None = None,
    n_examples: int | None = None,
    start_example: int = 0,
    length_grouped: bool = False,
) -> Iterator[dict]:
    """Yield collated batches of ``batch_size`` from ``examples`` over epochs, tokenizing lazily."""
    if not examples:
        raise ValueError("The dataset has no examples after filtering; check the datasets and data options.")
    if n_examples is None and n_epochs is None:
        raise ValueError("Set n_epochs or n_examples.")
    n = len(examples)
    total = n_examples if n_examples is not None else n_epochs * n
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    lengths = None
    if length_grouped:
        lengths = [len(e["prompt"]) + max(len(e.get("chosen", "")), len(e.get("rejected") or "")) for e in examples]
    with_fields = any("fields" in e for e in examples)  # every batch then has them: collate reads the first element's keys
    orders: dict[int, np.ndarray] = {}
    k = start_example
    while k < total:
        elements = []
        for idx in range(k, min(k + batch_size, total)):
            epoch = idx // n
            if epoch not in orders:
                orders = {epoch: epoch_order(n, seed, epoch, shuffle, lengths, 64 * batch_size)}
            ex = examples[orders[epoch][idx % n]]
            fields = {"fields": ex.get("fields", {})} if with_fields else {}
            plugin = next((fn for field, fn in EXAMPLE_TOKENIZERS.items() if field in ex), None)
            if plugin is not None:  # e.g. an image example (vision/)
                elements.append(plugin(ex, tokenizer, max_length, max_prompt_length) | fields)
                continue
            if "chosen" not in ex:  # a prompt alone (online DPO)
                rendered = "end_token_id" in ex
                element = tokenize_prompt(ex["prompt"], tokenizer, max_prompt_length, ex["truncation_mode"], rendered)
                elements.append(element | fields)
                continue
            texts = (ex["prompt"], ex["chosen"], ex.get("rejected"), ex["truncation_mode"])
            element = tokenize_element(*texts, tokenizer, max_length, max_prompt_length, ex.get("end_token_id"), ex.get("pieces"))
            if "label" in ex:  # an unpaired row: its completion is the chosen side
                element["label"] = bool(ex["label"])
            elements.append(element | fields)
        k += len(elements)
        yield collate(elements, pad_id)


def stacked_model_inputs(per_example: list[dict], copies: int = 1) -> dict:
    """The model's inputs beside the token ids (e.g. an image's pixel values and sizes) of ``copies`` x B examples in
    row order: each example's tensors concatenated along dim 0, their other dims zero-padded to the largest (as a
    processor pads a batch).

    Args:
        per_example: B dicts of tensors (an element's ``model_inputs``), e.g. ``pixel_values`` (n_images, C, H, W).
        copies: how often the B examples repeat (2: chosen rows over rejected rows, each pair's images in both).
    """
    out = {}
    for key in per_example[0] if per_example else ():
        tensors = [e[key] for e in per_example] * copies
        shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
        padded = []
        for t in tensors:
            pad = [p for d in reversed(range(1, t.dim())) for p in (0, shape[d - 1] - t.shape[d])]
            padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
        out[key] = torch.cat(padded, dim=0)
    return out


def concatenated_inputs(batch: dict) -> dict:
    """``input_ids``, ``attention_mask``, ``labels``, each (2B, max(T_c, T_r)): chosen (B, T_c) in rows [0, B)
    over rejected (B, T_r) in rows [B, 2B), right-padded to one width for one forward pass; with the batch's
    ``model_inputs`` (images), those of rows [0, B) and again of rows [B, 2B) (:func:`stacked_model_inputs`)."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    out = {}
    for key, pad in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX)):
        parts = []
        for side in ("chosen", "rejected"):
            t = batch[f"{side}_{key}"]
            parts.append(torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad))
        out[key] = torch.cat(parts, dim=0)
    if "model_inputs" in batch:  # the pair's images reach both of its sequences
        out |= stacked_model_inputs(batch["model_inputs"], copies=2)
    return out
