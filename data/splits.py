"""A run's examples: both splits loaded, checked, rendered through the chat template and screened for length."""

from __future__ import annotations

import functools

from omegaconf import DictConfig, OmegaConf

import losses
from data import chat, screening
from data import prompts as prompt_sets
from data.loading import load_examples, split_overlap_warning
from data.report import check_pairing
from evaluation import rewards
from utils import ConfigError, DataError


def load_splits(config: DictConfig, tokenizer, rank: int, answer_functions: list) -> tuple[list[dict], list[dict]]:
    """The train and eval examples, checked, rendered through the chat template and screened for length."""
    sft_mode = losses.get_objective(config.loss.name).sft_data
    online_run = config.online.enabled
    options = OmegaConf.to_container(config.data, resolve=True)
    load = prompt_sets.load_prompt_examples if online_run else functools.partial(load_examples, sft_mode=sft_mode)
    train_examples = load(list(config.datasets), "train", options, silent=rank != 0)
    eval_examples = load(list(config.datasets), "test", options, silent=rank != 0)
    overlap = split_overlap_warning(train_examples, eval_examples)
    if overlap is not None and rank == 0:
        print(overlap)
    check_pairing(train_examples + eval_examples, losses.get_objective(config.loss.name))  # unpaired rows
    all_turns = sft_mode and bool(config.loss.get("all_assistant_turns", False))
    (train_examples, train_own), (eval_examples, eval_own) = (
        _set_apart(examples, split) for examples, split in ((train_examples, "train"), (eval_examples, "eval"))
    )  # a plugin's examples (vision/: images) are rendered and checked by it, the rest below
    train_examples, eval_examples = (  # conversations through the chat template (plain text unchanged)
        chat.render_conversations(
            examples,
            tokenizer,
            config.max_length,
            config.max_prompt_length,
            rank != 0,
            split=split,
            all_assistant_turns=all_turns,
        )
        for examples, split in ((train_examples, "train"), (eval_examples, "test"))
    )
    args = (tokenizer, config.max_length, config.max_prompt_length, rank != 0)
    train_examples, eval_examples = (  # a split of a plugin's examples alone has none to screen here
        screening.screen_examples(examples, split, *args) if examples or not any(own_examples.values()) else examples
        for examples, own_examples, split in ((train_examples, train_own, "train"), (eval_examples, eval_own, "test"))
    )
    for field, prepare in SPLIT_PREPARERS.items():
        train_examples += prepare(train_own[field], tokenizer, config, "train", rank != 0) if train_own[field] else []
        eval_examples += prepare(eval_own[field], tokenizer, config, "test", rank != 0) if eval_own[field] else []
    note = check_eval_size(config, len(eval_examples))
    if note is not None and rank == 0:
        print(f"Note: {note}")
    if answer_functions or (online_run and config.online.scorer == "reward_function"):  # a column they cannot take: now
        rewards.field_columns([ex.get("fields") for ex in train_examples + eval_examples])
    return train_examples, eval_examples


SPLIT_PREPARERS: dict = {}
"""Plugins' examples by a field they hold: those holding ``field`` skip the chat template's rendering and the length
screening here and become ``SPLIT_PREPARERS[field](examples, tokenizer, config, split, silent)`` (checked, ready for
``preference_datasets.EXAMPLE_TOKENIZERS[field]``), after the others (vision/: ``"images"``)."""


def _set_apart(examples: list[dict], label: str) -> tuple[list[dict], dict[str, list[dict]]]:
    """(the examples no plugin of :data:`SPLIT_PREPARERS` takes, ``{field: the examples holding field}``); DataError when
    the ``label`` split mixes kinds, which cannot share a batch."""
    own: dict[str, list[dict]] = {field: [] for field in SPLIT_PREPARERS}
    rest = []
    for ex in examples:
        field = next((f for f in SPLIT_PREPARERS if f in ex), None)
        (rest if field is None else own[field]).append(ex)
    kinds = [(len(v), f"'{f}'") for f, v in own.items() if v] + ([(len(rest), "none of those fields")] if rest else [])
    if len(kinds) > 1:
        held = " and ".join(f"{n} examples holding {what}" for n, what in kinds)
        raise DataError(f"The {label} split mixes {held}, which cannot share a batch; give them to separate runs.")
    return rest, own


def n_eval_used(config: DictConfig, n_eval: int) -> int:
    """How many eval examples are used: ``n_eval_examples`` capped by the eval split's size."""
    return min(config.n_eval_examples or n_eval, n_eval)


def check_eval_size(config: DictConfig, n_eval: int) -> str | None:
    """Raise ConfigError if the eval split is empty; the note to print when ``eval_batch_size`` exceeds the eval set, else None."""
    if n_eval == 0:
        raise ConfigError("The eval split is empty; give the dataset a test split or a holdout_fraction.")
    used = n_eval_used(config, n_eval)
    if config.eval_batch_size <= used:
        return None
    return (  # the eval iterator yields the short batch: each metric is a mean over examples, whatever the batch size
        f"eval_batch_size ({config.eval_batch_size}) is larger than the eval set ({used} example{'s' if used != 1 else ''}), "
        f"so the eval runs as one batch of {used}."
    )
