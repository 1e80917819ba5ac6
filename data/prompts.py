"""Prompt datasets for online DPO and evaluate.py: ``hf`` prompts, Anthropic HH's prompts and TL;DR (docs/online.md)."""

from __future__ import annotations

import collections
import os

from data.conversations import check_roles_mapping, conversation_key
from data.formats import (
    HF_COLUMNS,
    HF_CONTEXT_COLUMNS,
    _context_columns,
    _first_line,
    _hf_context_prompt,
    _hf_loader,
    _hf_prompt,
    hf_rows_to_data,
    note_cast,
    refuse_image_rows,
)
from data.loading import _notes, _run_loader, load_dataset_dict
from data.readers import load_from_hub, read_json_records
from data.report import DatasetDict, _note_file, add_fields, note_row
from preference_datasets import REGISTRY, get_hh, left_pad, register_prompt_dataset, registered
from utils import DataError


@register_prompt_dataset("hf", truncation_mode="keep_end")
@_hf_loader
def get_hf_prompts(rows, report, source, format, columns, max_pairs_per_prompt, roles, ranked_order, cast, path) -> DatasetDict:
    """Prompts for online DPO from what :func:`get_hf` reads, with the same options, as a prompt-only DatasetDict."""
    refuse_image_rows(rows, source)  # sampling takes text prompts only
    mapped = {key: key for key in HF_COLUMNS} | dict(columns or {})
    found = set(rows[0]) if rows else set()
    if {mapped["chosen"], mapped["rejected"]} <= found or mapped["responses"] in found or mapped["prompt"] not in found:
        return hf_rows_to_data(rows, report, source, format, columns, max_pairs_per_prompt, roles, ranked_order, cast)
    roles = check_roles_mapping(roles)
    data = {}
    column = mapped["prompt"]
    context = _context_columns(mapped, dict(columns or {}))
    for i, row in enumerate(rows, 1):
        value = _hf_context_prompt(row, context, f"{source}, row {i}")
        if not isinstance(value, (str, list)):
            raise DataError(f"{source}, row {i}: column {column!r} is not a string or a list of messages.")
        prompt = _hf_prompt(value, f"{source}, row {i}", column, isinstance(value, list), roles)
        key = prompt if isinstance(prompt, str) else conversation_key(prompt)
        if not (prompt if isinstance(prompt, str) else prompt[-1]["content"]).strip():
            note_row(report, "skipped: empty prompt", key)
        elif key in data:
            note_row(report, "skipped: repeated prompt", key)
        else:
            note_cast(report, cast, row, key)
            data[key] = {"prompt_messages": prompt} if isinstance(prompt, list) else {}
            add_fields(data[key], row, [column] + [context[k] for k in HF_CONTEXT_COLUMNS if k in context])
    return data


# ----------------------------------------------------------------------------- prompt datasets (online DPO)


def prompt_rows_to_list(rows, report: collections.Counter, source: str, name: str) -> list[str]:
    """The ``prompt`` field of each row, in order; empty and repeated prompts are skipped and counted."""
    prompts: list[str] = []
    seen: set[str] = set()
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise DataError(
                f"{source}, row {i}: field 'prompt' is missing or not a string; every {name} row needs a string prompt."
            )
        prompt = row["prompt"]
        if not prompt.strip():
            note_row(report, "skipped: empty prompt", prompt)
        elif prompt in seen:
            note_row(report, "skipped: repeated prompt", prompt)
        else:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


def read_records(path: str) -> list[dict]:
    """Rows of a .parquet file (via pyarrow), else of a .json/.jsonl file (:func:`read_json_records`)."""
    if not path.endswith(".parquet"):
        return read_json_records(path)
    if os.path.isdir(path):
        raise DataError(f"{path} is a folder, not a data file; give the path of a .parquet file.")
    if not os.path.exists(path):
        raise DataError(f"Data file {path} does not exist; check the path in your data.* override.")
    _note_file(path)
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.read_table(path).to_pylist()
    except (OSError, ValueError) as e:  # pyarrow's ArrowIOError and ArrowInvalid
        detail = _first_line(e, str(e).split("': ", 1)[-1])  # pyarrow repeats the path
        raise DataError(f"{path} is not a readable parquet file ({detail}); copy it again if it was cut short.") from None
    if not rows:
        raise DataError(f"{path} has no rows (the parquet table is empty); give a file with rows.")
    return rows


RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")


def split_files(folder: str, split_names: tuple[str, ...]) -> list[str]:
    """The data files under ``folder`` (any depth) of the first of ``split_names`` that has any, sorted."""
    found = [os.path.join(d, f) for d, _, files in os.walk(folder) for f in files if f.endswith(RECORD_SUFFIXES)]
    for name in split_names:
        files = [f for f in found if os.path.basename(f).startswith((f"{name}.", f"{name}-", f"{name}_"))]
        if files:
            return sorted(files)
    return []


TLDR_SPLITS = {"train": ("train",), "test": ("validation", "test")}  # first found wins: eval picks models, test stays untouched


@register_prompt_dataset("hh", truncation_mode="keep_end")
def get_hh_prompts(split: str, report: collections.Counter, **options) -> list[str]:
    """The unique prompts of :func:`get_hh`'s pairs, in first-seen order, with the same options and errors."""
    return [entry.get("prompt_messages", key) for key, entry in get_hh(split, report, **options).items()]


@register_prompt_dataset("tldr", truncation_mode="keep_end")  # the end holds the TL;DR: cue
def get_tldr(split: str, report: collections.Counter, path: str | dict | None = None, cache_dir: str | None = None) -> list[str]:
    """Reddit TL;DR prompts (Stiennon et al. 2020), ``trl-lib/tldr`` or ``data.tldr.path``; "test" reads ``validation``."""
    if path is None:
        source = TLDR_SPLITS.get(split, (split,))[0]
        rows = load_from_hub("trl-lib/tldr", "data.tldr.path", split=source, cache_dir=cache_dir)
        return prompt_rows_to_list(rows, report, f"trl-lib/tldr ({source} split)", "tldr")
    if not isinstance(path, str):
        files = [path[split]] if path.get(split) else []
    elif os.path.isdir(path):
        files = split_files(path, TLDR_SPLITS.get(split, (split,)))
    else:
        files = [path]
        print(f"[data] warning: tldr/{split} reads all of {path} (one file for both splits): eval prompts are training prompts.")
    if not files:
        names = " or ".join(TLDR_SPLITS.get(split, (split,)))
        raise DataError(f"data.tldr.path={path} has no {names} file for split {split!r}; give one (.jsonl, .json or .parquet).")
    rows_by_file = [(f, read_records(f)) for f in files]
    return [p for f, rows in rows_by_file for p in prompt_rows_to_list(rows, report, f, "tldr")]


def _unknown_prompt_dataset(name: str) -> DataError:
    return DataError(
        f"Unknown prompt dataset {name!r}; registered prompt datasets are {sorted(registered('prompts'))}, "
        f"and any preference dataset ({sorted(registered('pairs'))}) gives its prompts."
    )


def load_prompt_entries(name: str, split: str, options: dict, silent: bool = False) -> list[tuple]:
    """The prompts of dataset ``name`` for ``split`` as ``(prompt, fields)``: a string or messages, and {column: value}."""
    specs = REGISTRY.get(name, {})
    if "prompts" in specs:
        got, report = _run_loader(specs["prompts"], name, split, (options or {}).get(name), "prompts")
        if not silent:
            notes = _notes(report)
            print(f"[data] {name}/{split}: {len(got)} prompts" + (f" ({notes})" if notes else ""))
    elif "pairs" in specs:
        got = load_dataset_dict(name, split, (options or {}).get(name), silent)
    else:
        raise _unknown_prompt_dataset(name)
    if isinstance(got, dict):
        return [(entry.get("prompt_messages", key), entry.get("fields", {})) for key, entry in got.items()]
    return [(prompt, {}) for prompt in got]


def load_prompts(names: list[str], split: str, options: dict, silent: bool = False) -> list:
    """The prompts of all ``names`` for ``split``, concatenated in order (online DPO's data)."""
    return [prompt for name in names for prompt, _ in load_prompt_entries(name, split, options, silent)]


def load_prompt_examples(names: list[str], split: str, options: dict, silent: bool = False) -> list[dict]:
    """:func:`load_prompts` as ``{"prompt", "truncation_mode"}`` examples that :func:`get_batch_iterator` batches."""
    examples = []
    for name in names:
        mode = prompt_truncation_mode(name)
        for p, fields in load_prompt_entries(name, split, options, silent):
            extra = ({"conversation": True} if isinstance(p, list) else {}) | ({"fields": fields} if fields else {})
            examples.append({"prompt": p, "truncation_mode": mode, **extra})
    return examples


def prompt_truncation_mode(name: str) -> str:
    """``keep_start`` or ``keep_end``: which end of a too-long prompt of dataset ``name`` to keep."""
    specs = REGISTRY.get(name, {})
    spec = specs.get("prompts") or specs.get("pairs")
    if spec is None:
        raise _unknown_prompt_dataset(name)
    return spec.truncation_mode


def collate_prompts(elements: list[dict], pad_token_id: int) -> dict:
    """Batch :func:`tokenize_prompt` elements: ``prompt_input_ids`` and ``prompt_attention_mask`` (B, P) long, left-padded."""
    if not elements:
        raise ValueError("collate_prompts needs at least one element; the prompt batch is empty.")
    batch = {key: [e[key] for e in elements] for key in elements[0] if key != "prompt_input_ids"}
    batch["prompt_input_ids"], batch["prompt_attention_mask"] = left_pad([e["prompt_input_ids"] for e in elements], pad_token_id)
    return batch
