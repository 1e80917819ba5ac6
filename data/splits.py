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
from runs import checks


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
    train_examples, eval_examples = screening.screen_splits(
        train_examples, eval_examples, tokenizer, config.max_length, config.max_prompt_length, silent=rank != 0
    )
    note = checks.check_eval_size(config, len(eval_examples))
    if note is not None and rank == 0:
        print(f"Note: {note}")
    if answer_functions or (online_run and config.online.scorer == "reward_function"):  # a column they cannot take: now
        rewards.field_columns([ex.get("fields") for ex in train_examples + eval_examples])
    return train_examples, eval_examples
