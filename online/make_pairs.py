"""An offline preference file from a policy's own scored samples: ``python make_pairs.py policy=... output=pairs.jsonl``.

Every two of a prompt's ``k`` completions with different reward-function scores make a pair, the higher
chosen (Rafailov et al. 2023, section 6.1, the IMDb data); see docs/online.md.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys

import torch
from omegaconf import DictConfig, OmegaConf

import data  # noqa: F401  (registers the data formats and datasets beyond hh, shp and se)
import utils
from data.chat import stop_token_ids
from evaluation import rewards, sampling
from runs import checks
from runs.config_text import digest
from utils import ConfigError, DataError

SAMPLES_SUFFIX = ".samples.jsonl"  # <output><this>: every completion and its score, beside the pairs


def make_pairs(completions: list[str], scores: list[float | None]) -> tuple[list[tuple[int, int]], int, int]:
    """(pairs (chosen, rejected index), the higher score chosen, in index order; ties; failures: None or NaN scores),
    a text that repeats an earlier scored completion left out (it would repeat that completion's pairs)."""
    scored = [i for i, s in enumerate(scores) if s is not None and not math.isnan(s)]
    distinct = sorted({completions[i]: i for i in reversed(scored)}.values())  # each text's first index
    pairs, ties = [], 0
    for i, j in itertools.combinations(distinct, 2):
        if scores[i] == scores[j]:
            ties += 1
        else:
            pairs.append((i, j) if scores[i] > scores[j] else (j, i))
    return pairs, ties, len(completions) - len(scored)


def widest_pairs(pairs: list[tuple[int, int]], scores: list[float], limit: int) -> list[tuple[int, int]]:
    """The ``limit`` pairs of ``pairs`` with the largest score gaps, in their order (equal gaps: the earlier first)."""
    widest = sorted(range(len(pairs)), key=lambda n: scores[pairs[n][1]] - scores[pairs[n][0]])[:limit]
    return [pairs[n] for n in sorted(widest)]


def pair_record(item: dict, chosen: str, rejected: str, chosen_score: float, rejected_score: float) -> dict:
    """One output row after the prompt row's other columns: text as the ``json`` loader reads it, a conversation as ``hf``'s."""
    if item["conversation"]:
        chosen, rejected = ([{"role": "assistant", "content": t.strip()}] for t in (chosen, rejected))
    row = {"prompt": item["prompt"], "chosen": chosen, "rejected": rejected}
    return {**item.get("fields", {}), **row, "chosen_score": chosen_score, "rejected_score": rejected_score, "id": item["id"]}


def check_config(config: DictConfig) -> None:
    """Raise ConfigError (one sentence) for the first bad key."""
    if OmegaConf.is_missing(config, "policy") or config.policy is None:
        raise ConfigError("Give the policy to sample from: policy=<run folder | checkpoint | hf folder | hub id>.")
    if OmegaConf.is_missing(config, "output") or not config.output:
        raise ConfigError("Give the file to write: output=<pairs.jsonl>.")
    if not isinstance(config.k, int) or config.k < 2:
        raise ConfigError(f"k must be an integer >= 2 (completions per prompt; a pair needs two), got {config.k}.")
    for key in ("n_prompts", "max_new_tokens", "generate_batch_size"):
        if not isinstance(config[key], int) or config[key] < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {config[key]}.")
    limit = config.get("max_pairs_per_prompt")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigError(f"max_pairs_per_prompt must be null (every pair) or an integer >= 1, got {limit}.")
    if not isinstance(config.temperature, (int, float)) or config.temperature < 0:
        raise ConfigError(
            f"temperature must be a number >= 0 (0: greedy, which gives k equal completions), got {config.temperature}."
        )
    problem = checks.sampling_problem(config)
    if problem is not None:
        raise ConfigError(problem)
    if config.split not in ("train", "test"):
        raise ConfigError(f"split must be train or test (the prompts' split), got {config.split}.")
    checks.validate_fraction(config.max_failure_rate, "max_failure_rate")
    if not OmegaConf.is_list(config.datasets) or not len(config.datasets):
        raise ConfigError(f"datasets must be a non-empty list: write datasets=[{config.datasets}].")


def read_paths(config: DictConfig) -> list[tuple[str, str, str]]:
    """(key, value, real path) of each file or folder here that make_pairs.py reads: ``policy`` and the ``data.*`` values of
    ``datasets``."""
    found = [("policy", config.policy)]

    def walk(value, key: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}.{k}")
        elif isinstance(value, list):
            for n, v in enumerate(value):
                walk(v, f"{key}[{n}]")
        else:
            found.append((key, value))

    for name in config.datasets:
        if name in config.data:
            walk(OmegaConf.to_container(config.data[name], resolve=True), f"data.{name}")
    paths = [(key, v, os.path.expanduser(v)) for key, v in found if isinstance(v, str) and v]
    return [(key, v, os.path.realpath(path)) for key, v, path in paths if os.path.exists(path)]


def output_problem(config: DictConfig) -> str | None:
    """One sentence when ``output`` (or its samples file) cannot be written: a folder, or what make_pairs.py reads."""
    output = os.path.abspath(os.path.expanduser(str(config.output)))
    if os.path.isdir(output):
        return f"output={config.output} is a folder; give the pairs file to write, e.g. output={os.path.join(config.output, 'pairs.jsonl')}."
    parent = os.path.dirname(output)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"output={config.output} lies under {parent}, which is a file, not a folder; give a file in a folder."
    for path in (output, output + SAMPLES_SUFFIX):
        real = os.path.realpath(path)
        for key, value, read in read_paths(config):
            if real == read or real.startswith(read.rstrip(os.sep) + os.sep):
                where = "is" if real == read else "lies inside"
                return (
                    f"output={config.output} would write {path}, which {where} {key}={value}, what make_pairs.py reads; "
                    "give an output file outside what it reads."
                )
    return None


def train_command(policy: sampling.Source, output: str, conversational: bool = False) -> str:
    """The train.py command that trains on ``output``, starting from ``policy``."""
    model = policy.model_config
    name = model.get("name_or_path")
    start = []  # no name: the run's model=tiny, train.py's default
    if name:  # model=tiny refuses a name_or_path; the base preset takes one
        start = ["model=blank_model", f"model.name_or_path={name}"]
        start += [f"model.{k}={model[k]}" for k in ("tokenizer_name_or_path", "tokenizer_class", "block_name") if model.get(k)]
    if policy.weights:
        start.append(f"model.archive={policy.weights}")
    dataset_args = f"datasets=[hf] data.hf.path={output}" if conversational else f"datasets=[json] data.json.path={output}"
    return " ".join(["python train.py", dataset_args, *start])


def main(config: DictConfig) -> dict:
    """Sample, score, pair and write; returns the counts; ConfigError or DataError for bad input or no pair."""
    check_config(config)
    problem = output_problem(config)  # before any model loads or sample is drawn
    if problem is not None:
        raise ConfigError(problem)
    scorer = rewards.RewardFunctionScorer.from_config(config)  # an unknown function is refused before any model loads
    utils.set_threads(config.num_threads)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    policy = sampling.resolve_source(config.policy, config, "policy")
    items, conversational = _prompt_items(config)
    output = os.path.abspath(os.path.expanduser(str(config.output)))
    os.makedirs(os.path.dirname(output), exist_ok=True)

    model, tokenizer = sampling.load_source(policy, device)
    samples, pairs, counts = _sample_and_pair(config, scorer, model, tokenizer, items)
    del model

    _write(config, scorer, output, samples, pairs, counts)
    print(f"Train on them: {train_command(policy, output, conversational.pop())}")
    return counts


def _prompt_items(config: DictConfig) -> tuple[list[dict], set[bool]]:
    """The prompts of ``split`` and {whether they are conversations}; DataError or ConfigError for prompts it cannot use."""
    items = sampling.load_items(config, silent=False, split=config.split)
    if not items:
        raise DataError(f"datasets={list(config.datasets)} gave no {config.split} prompts; give a dataset with that split.")
    conversational = {it["conversation"] for it in items}
    if len(conversational) > 1:
        raise ConfigError(
            f"datasets={list(config.datasets)} mix text prompts and conversations, and a preference file holds one kind; "
            "make one file per kind (one make_pairs.py run each)."
        )
    rewards.field_columns([it["fields"] for it in items])  # a column the reward functions cannot take: one sentence now
    return items, conversational


def _sample_and_pair(config: DictConfig, scorer, model, tokenizer, items: list[dict]) -> tuple[list, list, dict]:
    """(every sample, the pair rows, the counts) of ``k`` scored completions of each of ``items``."""
    stop_ids = stop_token_ids(tokenizer)
    k, size, limit = int(config.k), int(config.generate_batch_size), config.get("max_pairs_per_prompt")
    samples, pairs, counts = [], [], {"prompts": 0, "completions": 0, "pairs": 0, "ties": 0, "failures": 0}
    if limit is not None:
        counts["left out by max_pairs_per_prompt"] = 0
    for start in range(0, len(items), size):
        batch = items[start : start + size]
        out, texts, scores, errors = _generate_and_score(config, scorer, model, tokenizer, stop_ids, batch)
        for n, it in enumerate(batch):
            mine = [None if math.isnan(s) else s for s in scores[n * k : (n + 1) * k]]
            completions = texts[n * k : (n + 1) * k]
            samples += _prompt_samples(it, out[n * k : (n + 1) * k], completions, mine, errors)
            pairs += _prompt_pairs(it, completions, mine, limit, counts)
            counts["prompts"] += 1
            counts["completions"] += k
    return samples, pairs, counts


def _generate_and_score(config: DictConfig, scorer, model, tokenizer, stop_ids, batch: list[dict]) -> tuple:
    """(generate_batch's output, the texts, their scores (NaN: failed), an iterator of the failures' reasons), ``k`` a prompt."""
    k = int(config.k)
    ids = sampling.prompt_ids(batch, tokenizer, config)
    seed = int(digest([config.seed, k, [json.dumps(it["prompt"]) for it in batch]])[:15], 16)
    out = sampling.generate_batch(
        model, tokenizer, stop_ids, [p for p in ids for _ in range(k)], float(config.temperature), config, seed
    )
    texts = [sampling.judged_response(out[n * k + j]["text"], it["conversation"]) for n, it in enumerate(batch) for j in range(k)]
    prompts = [it["judge_prompt"] for it in batch for _ in range(k)]
    fields = rewards.field_columns([it["fields"] for it in batch for _ in range(k)])  # each prompt's row's other columns
    scores = scorer.score(prompts, texts, **fields).tolist()
    return out, texts, scores, iter(scorer.last_errors)  # one sentence per failed completion, in order


def _prompt_samples(item: dict, out: list[dict], completions: list[str], scores: list, errors) -> list[dict]:
    """The samples file's rows of one prompt's completions (score None: failed, with the next reason of ``errors``)."""
    return [
        {
            "id": item["id"],
            "prompt": item["prompt"],
            "completion": text,
            "score": score,
            "ended": sample["ended"],
            "n_tokens": sample["n_tokens"],
            "error": next(errors) if score is None else None,
        }
        for text, score, sample in zip(completions, scores, out)
    ]


def _prompt_pairs(item: dict, completions: list[str], scores: list, limit: int | None, counts: dict) -> list[dict]:
    """The pair rows of one prompt's completions (at most ``limit``), counted into ``counts``."""
    chosen_rejected, ties, failures = make_pairs(completions, scores)
    repeats = len(completions) - failures - len({c for c, s in zip(completions, scores) if s is not None})
    if repeats:
        counts["repeated completions left out"] = counts.get("repeated completions left out", 0) + repeats
    if limit is not None and len(chosen_rejected) > limit:
        counts["left out by max_pairs_per_prompt"] += len(chosen_rejected) - limit
        chosen_rejected = widest_pairs(chosen_rejected, scores, limit)
    counts["pairs"] += len(chosen_rejected)
    counts["ties"] += ties
    counts["failures"] += failures
    return [pair_record(item, completions[c], completions[r], scores[c], scores[r]) for c, r in chosen_rejected]


def _write(config: DictConfig, scorer, output: str, samples: list, pairs: list, counts: dict) -> None:
    """Write the samples file, print the counts, then write the pairs; DataError (after the samples) when there is none."""
    samples_path = output + SAMPLES_SUFFIX
    utils.write_atomic(samples_path, "".join(json.dumps(s) + "\n" for s in samples))
    summary = ", ".join(f"{v} {name}" for name, v in counts.items())
    print(f"{summary} (k={int(config.k)}, temperature={config.temperature}, reward_functions={list(scorer.names)})")
    if counts["failures"] > config.max_failure_rate * counts["completions"]:
        first = next((s["error"] for s in samples if s["error"]), "")
        print(
            f"Warning: {counts['failures']} of {counts['completions']} completions could not be scored "
            f"(> max_failure_rate={config.max_failure_rate}), e.g. {first}; see {samples_path}."
        )
    if not pairs:
        raise DataError(
            f"No pair: every prompt's completions scored the same or failed ({summary}); {samples_path} holds them: "
            "raise temperature or k, or give reward functions that tell the completions apart."
        )
    utils.write_atomic(output, "".join(json.dumps(p) + "\n" for p in pairs))
    print(f"Pairs: {output} (every completion: {samples_path})")


def command(config: DictConfig) -> None:
    """``python make_pairs.py``'s body: bad input exits 2 with its one sentence."""
    try:
        main(config)
    except (ConfigError, DataError) as e:
        print(f"Error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
