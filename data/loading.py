"""Loading a registered dataset's split: its report printed (skipped, repaired, duplicated), an empty split refused
in one sentence, and its pairs flattened into examples."""

from __future__ import annotations

import collections
import hashlib
import json

from data.report import _LOADING, DataReport, DatasetDict, _share, fill_fields
from preference_datasets import REGISTRY, DatasetSpec, registered
from utils import DataError


def _notes(report: collections.Counter) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(report.items()))


def _nothing_left(name: str, split: str, report: DataReport, unit: str) -> DataError:
    """The DataError for an empty split of ``name``: every row skipped, the held-out slice taking all or none, or neither."""
    where = f"{name}/{split}" + (f" ({', '.join(report.files)})" if report.files else "")
    notes = _notes(report)
    skipped = any(k.startswith("skipped") for k in report)
    if report.holdout is not None and report.holdout[1]:
        fraction, n = report.holdout
        lower = f"lower it (e.g. {0.1 if fraction > 0.1 else fraction / 2:.2g}) so that some prompts are left to train on"
        higher = f"raise it (e.g. {max(fraction * 2, min(0.5, 3 / max(n, 1))):.2g}) so that some prompts are held out"
        taken, hint = (f"all {n} of its prompts", lower) if split == "train" else (f"none of its {n} prompts", higher)
        return DataError(
            f"{where} has no {unit}" + (f" ({notes})" if notes else "") + f": data.{name}.holdout_fraction={fraction} puts "
            f"{taken} in the eval slice; {hint}, or give more rows."
        )
    if skipped:
        return DataError(
            f"Every row of {where} was skipped ({notes}), so it has no {unit}; fix those rows or give data.{name} other data."
        )
    return DataError(f"{where} has no {unit} (its loader returned none and skipped no rows); check data.{name}.")


def _run_loader(spec: DatasetSpec, name: str, split: str, options: dict | None, unit: str):
    """(what ``spec``'s loader returned, its fresh :class:`DataReport`); a DataError if it returned nothing."""
    report = DataReport()
    token = _LOADING.set(report)
    try:
        got = spec.loader(split, report, **(options or {}))
    except TypeError as e:
        if "unexpected keyword" in str(e):  # an unknown option
            raise DataError(f"data.{name}: {e}; see the loader's docstring for its options.") from None
        raise
    finally:
        _LOADING.reset(token)
    if isinstance(got, dict):
        fill_fields(got)
    empty = not got if unit == "prompts" else not any(v["pairs"] or v.get("labels") for v in got.values())
    if empty:
        raise _nothing_left(name, split, report, unit)
    return got, report


def load_dataset_dict(
    name: str, split: str, options: dict | None = None, silent: bool = False, copies_trained: bool = False
) -> DatasetDict:
    """Load one registered dataset's split and print what was skipped, repaired or duplicated in it."""
    pairs = registered("pairs")
    if name not in pairs:
        raise DataError(f"Unknown dataset {name!r}; registered datasets are {sorted(pairs)}.")
    data, report = _run_loader(pairs[name], name, split, options, "pairs")
    if not silent:
        n_pairs = sum(len(v["pairs"]) for v in data.values())
        n_unpaired = sum(len(v.get("labels", ())) for v in data.values())
        unpaired = n_unpaired and not n_pairs
        counted = f"{n_unpaired} unpaired completions" if unpaired else f"{n_pairs} pairs"
        n_copies = count_duplicates(data)
        if n_copies:
            report[f"repeat an earlier {'completion' if unpaired else 'pair'} exactly (kept)"] = n_copies
        notes = _notes(report)
        print(f"[data] {name}/{split}: {len(data)} prompts, {counted}" + (f" ({notes})" if notes else ""))
        n = n_unpaired if unpaired else n_pairs
        if copies_trained and n_copies > DUPLICATE_WARNING_SHARE * n:
            what = (
                "unpaired completions (same prompt, completion and label)"
                if unpaired
                else "pairs (same prompt, chosen and rejected)"
            )
            print(
                f"[data] warning: {name}/{split}: {_share(n_copies, n)} of the {what} repeat an earlier one exactly; each copy "
                f"{'is trained on' if split == 'train' else 'counts in the eval metrics'}, so deduplicate the data unless the "
                "repetition is meant."
            )
    return data


DUPLICATE_WARNING_SHARE = 0.1  # the share of exact duplicate pairs in a split above which load_dataset_dict warns


def count_duplicates(data: DatasetDict) -> int:
    """How many pairs (or labelled completions) of ``data`` repeat an earlier one of the same prompt exactly."""
    return sum(
        len(items) - len(set(map(tuple, items))) for entry in data.values() for items in (entry["pairs"], entry.get("labels", ()))
    )


def _digest(value) -> str:
    """An image's digest (encoded bytes, or a PIL image's pixels), else ``str(value)`` (a path)."""
    if isinstance(value, bytes):
        return hashlib.sha1(value).hexdigest()
    if hasattr(value, "tobytes") and hasattr(value, "size"):  # a PIL image: its str is its memory address
        return hashlib.sha1(value.tobytes() + str(value.size).encode()).hexdigest()
    return str(value)


def split_overlap_warning(train: list[dict], test: list[dict]) -> str | None:
    """The warning when over :data:`DUPLICATE_WARNING_SHARE` of the ``test`` examples are also ``train`` examples (the
    same prompt and responses, e.g. one file given as both splits), else None."""

    def key(example: dict) -> str:  # an image by its bytes' digest: the same question on two images is two examples
        fields = [example.get(k) for k in ("prompt", "chosen", "rejected", "label", "images")]
        return json.dumps(fields, default=_digest)

    trained = set(map(key, train))
    n = sum(key(example) in trained for example in test)
    if not test or n <= DUPLICATE_WARNING_SHARE * len(test):
        return None
    return (
        f"[data] warning: {_share(n, len(test))} of the eval examples are also train examples (the same prompt and "
        "responses; one file given as both splits?), so the eval metrics measure trained examples, not held-out ones; "
        "give a test split of other examples unless that is meant."
    )


def flatten(name: str, data: DatasetDict, sft_mode: bool) -> list[dict]:
    """One ``{"prompt", "chosen", "rejected", "truncation_mode"}`` example per pair (SFT: per prompt, no ``"rejected"``;
    unpaired: per labelled completion), in a stable order."""
    mode = REGISTRY[name]["pairs"].truncation_mode
    examples = []
    for prompt, entry in data.items():
        extra = {"conversation": True} if "prompt_messages" in entry and "images" not in entry else {}
        if "images" in entry:  # an image example (vision/__init__.py): messages with image parts, answers as text
            extra["images"] = entry["images"]
        if "fields" in entry:
            extra["fields"] = entry["fields"]
        if "images" in entry:  # the prompt's images, one per image part (vision/)
            extra["images"] = entry["images"]
        prompt = entry.get("prompt_messages", prompt)
        if entry.get("labels"):
            rows = entry.get("rows") if len(entry.get("rows", ())) == len(entry["labels"]) else None
            for k, (i, label) in enumerate(entry["labels"]):
                where = {"row": rows[k]} if rows else {}
                chosen = entry["responses"][i]
                examples.append({"prompt": prompt, "chosen": chosen, "label": label, "truncation_mode": mode, **extra, **where})
            continue
        rows = entry.get("rows") if len(entry.get("rows", ())) == len(entry["pairs"]) else None
        if sft_mode:
            where = {"row": rows[0]} if rows else {}
            examples.append({"prompt": prompt, "chosen": entry["sft_target"], "truncation_mode": mode, **extra, **where})
            continue
        for k, (i, j) in enumerate(entry["pairs"]):
            r = entry["responses"]
            where = {"row": rows[k]} if rows else {}
            examples.append({"prompt": prompt, "chosen": r[i], "rejected": r[j], "truncation_mode": mode, **extra, **where})
    return examples


def load_examples(names: list[str], split: str, options: dict, sft_mode: bool, silent: bool = False) -> list[dict]:
    """Flat list of examples of all ``names`` for ``split`` (see :func:`flatten`)."""
    examples = []
    for name in names:
        data = load_dataset_dict(name, split, options.get(name), silent, copies_trained=not sft_mode)
        examples.extend(flatten(name, data, sft_mode))
    return examples
