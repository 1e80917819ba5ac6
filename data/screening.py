"""Screening before training: what truncation cuts from each example, and the examples dropped because nothing
of a response would be left (said once per split)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from data.report import _share
from preference_datasets import _example_ids, _prompt_only_ids, _strip_eos
from utils import DataError

# ----------------------------------------------------------------------------- screening before training


class TruncatedIds(NamedTuple):
    """The token ids one example gets in training and what truncation cut."""

    prompt_ids: list[int]
    response_ids: list[list[int]]
    """chosen (and rejected), each ending with EOS; empty for a prompt alone."""
    prompt_cut: bool
    responses_cut: list[bool]
    tokens_differ: bool | None
    """For a pair: whether chosen and rejected differ as token ids before truncation; else None."""


def truncated_ids(
    examples: list[dict], tokenizer, max_length: int, max_prompt_length: int, chunk_size: int = 1024
) -> Iterator[TruncatedIds]:
    """The :class:`TruncatedIds` of each example, exactly as :func:`get_batch_iterator` will give them, in order."""
    assert max_prompt_length < max_length, "checks.validate_config refuses this config"
    sides = ("chosen", "rejected")
    for start in range(0, len(examples), chunk_size):
        chunk = examples[start : start + chunk_size]
        texts: tuple[dict[str, None], dict[str, None]] = ({}, {})  # plain, rendered by a chat template
        for ex in chunk:
            if "end_token_id" in ex:
                pieces = ex.get("pieces") or {}
                for field in ("prompt", *sides):
                    if ex.get(field) is not None:
                        texts[1].update((text, None) for text, _ in pieces.get(field) or [[ex[field], None]])
                continue
            texts[0][ex["prompt"]] = None
            texts[0].update((_strip_eos(tokenizer, ex[side]), None) for side in sides if ex.get(side) is not None)
        encoded = []
        for rendered, unique in enumerate(map(list, texts)):
            ids = tokenizer(unique, add_special_tokens=False, split_special_tokens=not rendered)["input_ids"] if unique else []
            encoded.append(dict(zip(unique, ids)))
        for ex in chunk:
            end_id = ex.get("end_token_id")
            encode = encoded[end_id is not None].__getitem__
            mode = ex["truncation_mode"]
            if "chosen" not in ex:  # a prompt alone (online DPO)
                ids = encode(ex["prompt"])
                n_full = len(ids) + (end_id is None and tokenizer.bos_token_id is not None)
                cut_prompt = _prompt_only_ids(ids, tokenizer, end_id is not None, max_prompt_length, mode)
                yield TruncatedIds(cut_prompt, [], len(cut_prompt) < n_full, [], None)
                continue
            prompt_ids, _, full, cut_prompt, cut, _, _ = _example_ids(
                ex, encode, tokenizer, end_id, ex.get("pieces"), mode, max_length, max_prompt_length
            )
            differ = full[0] != full[1] if len(full) == 2 else None
            yield TruncatedIds(
                cut_prompt, cut, len(cut_prompt) < len(prompt_ids), [len(c) < len(f) for c, f in zip(cut, full)], differ
            )


def screen_examples(
    examples: list[dict], split: str, tokenizer, max_length: int, max_prompt_length: int, silent: bool = False
) -> list[dict]:
    """The examples of ``split`` worth training on, in order: pairs identical once truncated are skipped with a warning."""
    if not examples:
        label = "eval" if split == "test" else split
        raise DataError(f"The {label} split has no examples; check datasets=[...] and their data.* options.")
    truncated = truncated_ids(examples, tokenizer, max_length, max_prompt_length)
    return screen_truncated(examples, truncated, split, max_length, max_prompt_length, silent)


def screen_truncated(
    examples: list[dict], truncated, split: str, max_length: int, max_prompt_length: int, silent: bool = False
) -> list[dict]:
    """:func:`screen_examples` of examples whose :class:`TruncatedIds` (one each, in order) ``truncated`` gives: what
    truncation cuts said once, pairs identical once cut skipped (a plugin's examples too, e.g. vision/'s)."""
    label = "eval" if split == "test" else split
    kept: list[dict] = []
    n_prompts_cut = n_responses = n_responses_cut = 0
    same_once_cut = same_tokens = 0
    for ex, t in zip(examples, truncated):
        n_prompts_cut += t.prompt_cut
        n_responses += len(t.responses_cut)
        n_responses_cut += sum(t.responses_cut)
        if t.tokens_differ is not None and t.response_ids[0] == t.response_ids[1]:
            same_once_cut += t.tokens_differ
            same_tokens += not t.tokens_differ
            continue
        kept.append(ex)
    lengths = f"max_length={max_length} / max_prompt_length={max_prompt_length}"
    n = len(examples)
    if not kept:
        if same_once_cut:
            raise DataError(
                f"All {n} {label} pairs have the same chosen and rejected tokens once cut to {lengths} (they differ only "
                "past the cut), so there is nothing to learn; raise max_length or lower max_prompt_length."
            )
        raise DataError(
            f"All {n} {label} pairs have chosen and rejected that tokenize the same, so there is nothing to learn; fix the data."
        )
    if not silent:
        if n_responses:
            responses = _share(n_responses_cut, n_responses)
            print(
                f"[data] {label}: truncation to {lengths} cuts {_share(n_prompts_cut, n)} of prompts and {responses} of responses"
            )
        else:
            print(
                f"[data] {label}: truncation to max_prompt_length={max_prompt_length} cuts {_share(n_prompts_cut, n)} of prompts"
            )
        if same_once_cut:
            print(
                f"[data] warning: {label}: skipped {same_once_cut} of {n} pairs whose chosen and rejected are the same tokens once cut "
                f"to {lengths} (they differ only past the cut); raise max_length or lower max_prompt_length to keep them."
            )
        if same_tokens:
            print(f"[data] warning: {label}: skipped {same_tokens} of {n} pairs whose chosen and rejected tokenize the same.")
    return kept


def screen_splits(
    train_examples: list[dict],
    eval_examples: list[dict],
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    silent: bool = False,
) -> tuple[list[dict], list[dict]]:
    """(train examples kept, eval examples kept) by :func:`screen_examples`."""
    args = (tokenizer, max_length, max_prompt_length, silent)
    return screen_examples(train_examples, "train", *args), screen_examples(eval_examples, "test", *args)
