"""What loading found: the report of skipped and repaired rows, the row checks, and the pairs (or unpaired
completions) a loader adds to its DatasetDict."""

from __future__ import annotations

import collections
import contextvars
import math
from collections.abc import Callable

from utils import DataError

DatasetDict = dict[str, dict]  # prompt -> {"responses": [...], "pairs": [(i_chosen, i_rejected), ...], "sft_target": ...}


class DataReport(collections.Counter):
    """A Counter of skipped or repaired records; ``keyed``: reason -> Counter(prompt -> n) of :func:`note_row` counts,
    ``holdout``: (fraction, prompts before the cut) of the last :func:`apply_holdout` or None, ``files``: the files read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.keyed: dict[str, collections.Counter] = {}
        self.holdout: tuple[float, int] | None = None
        self.files: list[str] = []

    def narrow(self, keep: Callable[[str], bool]) -> None:
        """Drop the keyed counts whose key ``keep`` refuses (plain ``report[reason] += 1`` counts stay)."""
        for reason, by_key in self.keyed.items():
            dropped = sum(n for key, n in by_key.items() if not keep(key))
            self.keyed[reason] = collections.Counter({key: n for key, n in by_key.items() if keep(key)})
            self[reason] -= dropped
            if self[reason] <= 0:
                del self[reason]


def note_row(report: collections.Counter, reason: str, key: str, n: int = 1) -> None:
    """Count ``n`` records under ``reason``, remembering ``key`` (their prompt) so that a held-out split counts its own."""
    report[reason] += n
    if isinstance(report, DataReport):
        report.keyed.setdefault(reason, collections.Counter())[key] += n


_KINDS = {str: "string", list: "list", dict: "object", (int, float): "number"}


def require_fields(row, fields: dict[str, type | tuple[type, ...]], source: str, i: int, name: str) -> None:
    """Check that ``row`` (1-based row ``i`` of ``source``) has each of ``fields`` with a value of its type, else a DataError."""
    for field, types in fields.items():
        value = row.get(field) if isinstance(row, dict) else None
        if not isinstance(value, types) or (isinstance(value, bool) and types is not bool):
            kind = _KINDS.get(types, getattr(types, "__name__", str(types)))
            raise DataError(
                f"{source}, row {i}: field {field!r} is missing or not a {kind}; every {name} row needs {', '.join(fields)}."
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise DataError(not_finite(f"{source}, row {i}", f"field {field!r}", value))


def not_finite(where: str, what: str, value: float) -> str:
    """The sentence refusing a score ``value`` that is NaN or infinite (it would rank a pair, NaN as the worst)."""
    return f"{where}: {what} is {value}, not a finite number, so it cannot rank the responses; fix that row or drop it."


_LOADING: contextvars.ContextVar[DataReport | None] = contextvars.ContextVar(
    "_LOADING", default=None
)  # set by loading._run_loader


def _note_file(path: str) -> None:
    report = _LOADING.get()
    if report is not None and path not in report.files:
        report.files.append(path)


def add_pair(
    data: DatasetDict, prompt: str, chosen: str, rejected: str, report: collections.Counter, row: str | None = None
) -> bool:
    """Add one (prompt, chosen, rejected) pair and its ``row`` to ``data`` unless a response is empty or both are equal."""
    if not chosen.strip() or not rejected.strip():
        note_row(report, "skipped: empty response", prompt)
        return False
    if chosen == rejected:
        note_row(report, "skipped: identical responses", prompt)
        return False
    entry = data.setdefault(prompt, {"responses": [], "pairs": [], "sft_target": chosen})
    _append_pair(entry, chosen, rejected, row)
    return True


def _append_pair(entry: dict, chosen, rejected, row: str | None) -> None:
    ids = []
    for response in (chosen, rejected):
        if response not in entry["responses"]:
            entry["responses"].append(response)
        ids.append(entry["responses"].index(response))
    entry["pairs"].append((ids[0], ids[1]))
    if row is not None:
        entry.setdefault("rows", []).append(row)


FIELD_TYPES = (str, int, float, bool, type(None), list, dict)  # JSON's; other kinds (bytes, dates, images) are left out


def add_fields(entry: dict, row: dict, consumed) -> None:
    """Keep ``row``'s columns other than ``consumed`` and ``messages`` in ``entry["fields"]`` (first non-None value wins)."""
    for column, value in row.items():
        if column not in consumed and column != "messages" and isinstance(value, FIELD_TYPES):
            if entry.get("fields", {}).get(column) is None:
                entry.setdefault("fields", {})[column] = value


def fill_fields(data: DatasetDict) -> None:
    """Give every entry of ``data`` every column any entry keeps as a field, None where its rows had none."""
    columns = list(dict.fromkeys(c for entry in data.values() for c in entry.get("fields", ())))
    for entry in data.values() if columns else ():
        entry["fields"] = {c: entry.get("fields", {}).get(c) for c in columns}


def add_unpaired(data: DatasetDict, prompt: str, completion: str, label: bool, report: collections.Counter, row: str) -> bool:
    """Add one unpaired row (TRL's prompt, completion, label) to ``data``: ``"pairs": []``, ``"labels"``
    ([(response index, label)]) and ``"rows"``; True if added."""
    if not completion.strip():
        note_row(report, "skipped: empty response", prompt)
        return False
    entry = data.setdefault(prompt, {"responses": [], "pairs": [], "labels": [], "sft_target": completion})
    if completion not in entry["responses"]:
        entry["responses"].append(completion)
    entry["labels"].append((entry["responses"].index(completion), bool(label)))
    entry.setdefault("rows", []).append(row)
    return True


def check_pairing(examples: list[dict], objective) -> None:
    """Refuse unpaired rows for an objective (``losses.Objective``) that learns from pairs, and unpaired mixed with paired."""
    unpaired = [ex for ex in examples if "label" in ex]
    if not unpaired:
        return
    where = unpaired[0].get("row", "the data")
    if not objective.unpaired:
        import losses

        names = ", ".join(f"loss={n}" for n, o in sorted(losses.OBJECTIVES.items()) if o.unpaired)
        raise DataError(
            f"{where} is an unpaired row {{prompt, completion, label}}, which loss={objective.name} cannot train on "
            f"(it needs rows {{prompt, chosen, rejected}}); train with {names}, or give a file of paired rows."
        )
    if len(unpaired) < len(examples):
        raise DataError(
            f"datasets=[...] mixes unpaired rows ({where}) with paired ones; train on one kind, e.g. write each pair as two "
            "unpaired rows (chosen with label true, rejected with label false)."
        )


def _share(k: int, n: int) -> str:
    return f"{k / n:.1%} ({k} of {n})" if n else "0"
