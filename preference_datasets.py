"""Preference datasets: registered loaders returning ``{prompt: {"responses": [str, ...], "pairs": [(i_chosen, i_rejected),
...], "sft_target": str}}`` (docs/data.md), then tokenization and batching."""

from __future__ import annotations

import collections
import contextvars
import gzip
import hashlib
import html
import html.parser
import json
import math
import os
import random
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import numpy as np
import torch

from losses import IGNORE_INDEX

DatasetDict = dict[str, dict]
ASSISTANT_TAG = "\n\nAssistant:"
HUMAN_TAG = "\n\nHuman:"


class DataError(ValueError):
    """A dataset option or a data file is wrong; the message says what and how to fix it."""


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


# ----------------------------------------------------------------------------- helpers


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


_LOADING: contextvars.ContextVar[DataReport | None] = contextvars.ContextVar("_LOADING", default=None)  # set by _run_loader


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


Messages = list[dict]  # a conversation: [{"role": str, "content": str}, ...]


def conversation_key(prompt_messages: Messages) -> str:
    """The DatasetDict key of a conversational prompt: its messages as JSON text (hashed and counted as a text prompt)."""
    return json.dumps(prompt_messages, ensure_ascii=False)


def add_conversation_pair(
    data: DatasetDict,
    prompt_messages: Messages,
    chosen_messages: Messages,
    rejected_messages: Messages,
    report: collections.Counter,
    row: str | None = None,
) -> bool:
    """Add one conversational pair (message lists ending with the assistant's) under :func:`conversation_key`; True if added."""
    key = conversation_key(prompt_messages)
    if not chosen_messages[-1]["content"].strip() or not rejected_messages[-1]["content"].strip():
        note_row(report, "skipped: empty response", key)
        return False
    if chosen_messages == rejected_messages:
        note_row(report, "skipped: identical responses", key)
        return False
    entry = data.setdefault(
        key, {"responses": [], "pairs": [], "sft_target": chosen_messages, "prompt_messages": prompt_messages}
    )
    _append_pair(entry, chosen_messages, rejected_messages, row)
    return True


STANDARD_ROLES = ("system", "user", "assistant", "tool")  # others are refused: templates (SmolLM2's) render any role as text

ROLES_EXAMPLE = "'data.hf.roles={human: user, gpt: assistant}'"


def check_roles_mapping(roles) -> dict[str, str]:
    """``data.hf.roles`` (your role -> one of :data:`STANDARD_ROLES`) as a dict, else a DataError."""
    if roles is None:
        return {}
    if not isinstance(roles, dict):  # e.g. bash split an unquoted {a: b, c: d} into two overrides
        raise DataError(
            f"data.hf.roles must be a mapping such as {{human: user, gpt: assistant}}, got {roles!r}; "
            f"quote the whole override in the shell: {ROLES_EXAMPLE}."
        )
    for name, role in roles.items():
        if role not in STANDARD_ROLES:
            raise DataError(
                f"data.hf.roles maps {name!r} to {role!r}, which is not one of {', '.join(STANDARD_ROLES)}; map each of "
                "your roles to one of them."
            )
    return {str(name): role for name, role in roles.items()}


def _role_and_content(m, roles: dict[str, str]) -> tuple:
    """A message's (role, content): ``role`` / ``content``, else ShareGPT's ``from`` / ``value``, the role mapped by ``roles``."""
    if not isinstance(m, dict):
        return None, None
    if m.get("role") is None and m.get("content") is None and ("from" in m or "value" in m):  # ShareGPT's keys
        role, content = m.get("from"), m.get("value")
    else:
        role, content = m.get("role"), m.get("content")
    return roles.get(role, role) if isinstance(role, str) else role, content


# role names other formats use (lower-cased) -> the standard role each usually means, for role_hint
LIKELY_ROLES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant"}
LIKELY_ROLES |= {"function": "tool", "observation": "tool", "ipython": "tool", "function_call": "assistant"}


def role_hint(role: str, roles: dict[str, str]) -> str:
    """How to map the non-standard ``role`` with ``data.hf.roles`` (``roles``: the mapping given so far)."""
    target = LIKELY_ROLES.get(role.lower(), "<user, assistant, system or tool>")
    mapping = ", ".join(f"{name}: {standard}" for name, standard in {**roles, role: target}.items())
    return f"map it with 'data.hf.roles={{{mapping}}}'"


def unknown_role(role: str, where: str, what: str, hint: str) -> DataError:
    """The one sentence for a message of ``what`` (e.g. "message 2 of 'chosen'") in ``where`` whose role is not standard."""
    return DataError(f"{where}: {what} has role {role!r}, which is not one of {', '.join(STANDARD_ROLES)}; {hint}.")


def check_messages(value, where: str, column: str, roles: dict[str, str] | None = None) -> Messages:
    """``value`` (column ``column`` of row ``where``) as a non-empty list of standard ``{role, content}`` messages
    (ShareGPT's ``from`` / ``value`` read, roles renamed by ``roles``, other keys dropped)."""
    roles = roles or {}
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: column {column!r} is not a list of messages ({_json_kind(value)}); give a list of {{role, content}}."
        )
    messages = []
    for k, m in enumerate(value, 1):
        role, content = _role_and_content(m, roles)
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataError(
                f"{where}: message {k} of {column!r} has no string 'role' and 'content' ({json.dumps(m, ensure_ascii=False)[:80]});"
                " every message needs both."
            )
        if role not in STANDARD_ROLES:
            raise unknown_role(role, where, f"message {k} of {column!r}", role_hint(role, roles))
        messages.append({"role": role, "content": content})
    return messages


def check_ends_with_assistant(messages: Messages, where: str, column: str) -> None:
    """Raises DataError (naming the row and column) if the last message of ``messages`` is not the assistant's."""
    if messages[-1]["role"] != "assistant":
        raise DataError(
            f"{where}: the last message of {column!r} is the {messages[-1]['role']}'s, not the assistant's; "
            "a response must end with the assistant's turn."
        )


def split_conversations(chosen: Messages, rejected: Messages) -> tuple[Messages, Messages, Messages] | None:
    """Split two conversations after their longest common messages before an assistant turn, or None."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    for k in range(min(n, len(chosen) - 1, len(rejected) - 1), 0, -1):
        if chosen[k]["role"] == "assistant" and rejected[k]["role"] == "assistant":
            return chosen[:k], chosen[k:], rejected[k:]
    return None


def in_holdout(prompt: str, fraction: float) -> bool:
    """True if ``prompt`` belongs to the held-out eval slice of size ``fraction``."""
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()  # the prompt alone: same slice on every machine and seed
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def apply_holdout(data: DatasetDict, split: str, fraction: float, report: collections.Counter | None = None) -> DatasetDict:
    """Keep the held-out slice (split "test") or the rest (split "train") of ``data``, narrowing ``report`` alike."""
    want_eval = split == "test"

    def keep(prompt: str) -> bool:
        return in_holdout(prompt, fraction) == want_eval

    report = _LOADING.get() if report is None else report
    if isinstance(report, DataReport):
        report.narrow(keep)
        report.holdout = (fraction, len(data))
    return {p: v for p, v in data.items() if keep(p)}


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


class _TextExtractor(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts: list[str] = []

    def handle_data(self, data):
        self.parts.append(data)


def strip_html(text: str) -> str:
    """Plain text of an HTML fragment (Stack Exchange posts), entities unescaped."""
    parser = _TextExtractor()
    parser.feed(text)
    parser.close()
    return html.unescape("".join(parser.parts)).strip()


def _read_text(path: str) -> str:
    """The text of the file ``path`` (gunzipped when .gz, a UTF-8 BOM dropped); a DataError when it is bad."""
    if os.path.isdir(path):
        raise DataError(f"{path} is a folder, not a data file; give the path of a .jsonl, .json or .parquet file.")
    if not os.path.exists(path):
        raise DataError(f"Data file {path} does not exist; check the path in your data.* override.")
    _note_file(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            return f.read()
    except EOFError:
        raise DataError(
            f"{path} is cut short (its gzip stream ends early, as after an interrupted copy); copy the whole file again."
        ) from None
    except gzip.BadGzipFile as e:
        if "not a gzipped file" in str(e).lower():
            raise DataError(
                f"{path} is not a gzip file although its name ends with .gz; rename it without .gz if it is plain text."
            ) from None
        raise DataError(f"{path} is a corrupt gzip file ({e}); copy it again.") from None
    except zlib.error as e:
        raise DataError(f"{path} is a corrupt gzip file ({e}); copy it again.") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text (byte {e.start} of the text cannot be decoded); save it as UTF-8.") from None
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror or e}); check that it is a readable file.") from None


def _json_kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _ends_inside(text: str, e: json.JSONDecodeError) -> bool:
    """True if the JSON error ``e`` of ``text`` comes from the text ending early (at the end, or in a string to the end)."""
    rest = text[e.pos :].rstrip()
    return e.pos >= len(text.rstrip()) or (e.msg.startswith("Unterminated string") and "\n" not in rest)


ONE_OBJECT = "{path} holds one JSON object, not a list of rows; write its rows as a JSON list [{{...}}, ...] or one object a line (.jsonl)."


def _is_one_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _first_line_is_json(lines: list[str]) -> bool:
    try:
        json.loads(next((line for line in lines if line.strip()), ""))
        return True
    except json.JSONDecodeError:
        return False


def read_json_records(path: str) -> list[dict]:
    """Rows of a .jsonl or .json file (a JSON list, or JSON lines), .gz allowed; a DataError naming a bad file."""
    text = _read_text(path)
    is_json = (path[:-3] if path.endswith(".gz") else path).endswith(".json")
    stripped = text.strip()
    lines = text.splitlines()
    if stripped.startswith("[") or (is_json and stripped and not _first_line_is_json(lines)):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            if _ends_inside(text, e):
                raise DataError(
                    f"{path} is cut short (its JSON ends early, on line {e.lineno}); copy the whole file again."
                ) from None
            raise DataError(
                f"{path} is not valid JSON at line {e.lineno}, column {e.colno} ({e.msg}); fix the file there."
            ) from None
        if isinstance(value, dict):
            raise DataError(ONE_OBJECT.format(path=path))
        if not isinstance(value, list):
            raise DataError(f"{path} holds a single JSON {_json_kind(value)}, not rows; write one JSON object a line (.jsonl).")
        rows = value
    else:
        rows = []
        last = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                if not rows and _is_one_object(text):  # a pretty-printed object in a .jsonl file
                    raise DataError(ONE_OBJECT.format(path=path)) from None
                if i == last and _ends_inside(line, e):
                    raise DataError(
                        f"{path}, line {i} (the last) is cut short; copy the whole file again, or delete that line."
                    ) from None
                raise DataError(f"{path}, line {i}: not valid JSON ({e.msg}); fix or delete that line.") from None
        if is_json and len(rows) == 1 and isinstance(rows[0], dict):  # a .json file is a list of rows, not one object
            raise DataError(ONE_OBJECT.format(path=path))
    if not rows:
        raise DataError(f"{path} has no rows; give a file with one JSON object a line, or a JSON list of them.")
    return rows


def load_from_hub(hub_id: str, option: str, **kwargs):
    """``datasets.load_dataset(hub_id, **kwargs)``; offline, a DataError naming the ``option`` that reads a local copy."""
    import datasets

    try:
        return datasets.load_dataset(hub_id, **kwargs)
    except (ConnectionError, OSError, FileNotFoundError) as e:
        raise DataError(
            f"Could not load {hub_id} from the Hugging Face hub ({type(e).__name__}); offline? set {option} to a local copy."
        ) from None


def hub_or_file_rows(path: str | None, hub_id: str, option: str, split: str, cache_dir: str | None):
    """The rows of the JSON/JSONL file ``path``, else of ``hub_id``'s ``split`` (``option``: the ``data.*`` key of ``path``)."""
    if path is None:
        return load_from_hub(hub_id, option, split=split, cache_dir=cache_dir)
    return read_json_records(path)


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
    rows = hub_or_file_rows(path, "stanfordnlp/SHP", "data.shp.path", split, cache_dir)
    return shp_rows_to_data(rows, report, max_pairs_per_prompt, min_score_ratio, path or "stanfordnlp/SHP")


def se_rows_to_data(rows, report: collections.Counter, source: str = "se") -> DatasetDict:
    """Stack Exchange rows ({question, answers: [{text, pm_score}]}) to a DatasetDict, the higher score chosen."""
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
    rows = hub_or_file_rows(path, "HuggingFaceH4/stack-exchange-preferences", "data.se.path", "train", cache_dir)
    return apply_holdout(
        se_rows_to_data(rows, report, path or "HuggingFaceH4/stack-exchange-preferences"), split, holdout_fraction, report
    )


@register_dataset("json", truncation_mode="keep_end")
def get_json(
    split: str, report: collections.Counter, path: str | dict | None = None, holdout_fraction: float = 0.1
) -> DatasetDict:
    """A local JSON/JSONL file (.gz allowed) of rows {prompt, chosen, rejected} or {prompt, completion, label}."""
    if path is None:
        raise DataError("datasets=[json] needs data.json.path=<file.jsonl> (rows with prompt, chosen, rejected).")
    if not isinstance(path, (str, dict)):
        raise DataError(f"data.json.path={path} is neither a file nor a mapping {{train: file, test: file}}; give one of them.")
    file = path if isinstance(path, str) else path.get(split)
    if file is None:
        raise DataError(f"data.json.path has no {split!r} file; give one or a single file with data.json.holdout_fraction.")
    data: DatasetDict = {}
    first: tuple[int, bool] | None = None  # (row, unpaired) of the first row: the file's kind
    for i, row in enumerate(read_json_records(file), 1):
        unpaired = isinstance(row, dict) and ("completion" in row or "label" in row)
        first = first or (i, unpaired)
        if unpaired != first[1]:
            kinds = ("paired {prompt, chosen, rejected}", "unpaired {prompt, completion, label}")
            raise DataError(
                f"{file}, row {i} is {kinds[unpaired]} but row {first[0]} is {kinds[first[1]]}; a file holds one kind: "
                "write each pair as two unpaired rows (chosen with label true, rejected with label false)."
            )
        if unpaired:
            for field in ("prompt", "completion"):
                if not isinstance(row.get(field), str):
                    raise DataError(
                        f"{file}, row {i}: field {field!r} is missing or not a string; "
                        "every unpaired row needs prompt, completion and label."
                    )
            if not isinstance(row.get("label"), bool):
                value = json.dumps(row["label"]) if "label" in row else "missing"
                raise DataError(
                    f"{file}, row {i}: field 'label' is {value}, not true or false; every unpaired row needs prompt, "
                    "completion and label (true: the completion is desirable)."
                )
            if add_unpaired(data, row["prompt"], row["completion"], row["label"], report, f"{file}, row {i}"):
                add_fields(data[row["prompt"]], row, ("prompt", "completion", "label"))
            continue
        for field in ("prompt", "chosen", "rejected"):
            if isinstance(row, dict) and isinstance(row.get(field), (list, dict)):  # conversations: the hf loader reads them
                what = "a list of messages" if isinstance(row[field], list) else "a message"
                raise DataError(
                    f"{file}, row {i}: field {field!r} is {what}, which datasets=[json] does not read; read "
                    f"conversations with datasets=[hf] data.hf.path={file}."
                )
            if isinstance(row, dict) and field == "prompt" and field not in row and SHAREGPT_PROMPT in row:
                raise DataError(
                    f"{file}, row {i} is a ShareGPT row (conversations, no prompt), which datasets=[json] does not read; "
                    f"read it with datasets=[hf] data.hf.path={file} 'data.hf.roles={{human: user, gpt: assistant}}'."
                )
            if isinstance(row, dict) and field == "prompt" and field not in row and ASSISTANT_TAG in str(row.get("chosen")):
                raise DataError(
                    f"{file}, row {i} is an HH row (whole dialogues, no prompt), which datasets=[json] does not read; read "
                    f"it with datasets=[hf] data.hf.path={file}."
                )
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise DataError(
                    f"{file}, row {i}: field {field!r} is missing or not a string; every row needs prompt, chosen and rejected."
                )
        if add_pair(data, row["prompt"], row["chosen"], row["rejected"], report):
            add_fields(data[row["prompt"]], row, ("prompt", "chosen", "rejected"))
    if not isinstance(path, str):
        return data
    if not holdout_fraction:
        print(
            f"[data] warning: json/{split} reads all of {file} (data.json.holdout_fraction=0): eval examples are training examples."
        )
        return data
    return apply_holdout(data, split, holdout_fraction, report)


# ----------------------------------------------------------------------------- hf: any preference data, via `datasets`

HF_COLUMNS = ("prompt", "chosen", "rejected", "responses", "scores", "system")  # data.hf.columns maps them to other names
# read into a text prompt only when data.hf.columns maps them (LLaMA-Factory's alpaca layout): text joined to the prompt,
# earlier [user, assistant] turns, and a system message
HF_CONTEXT_COLUMNS = ("input", "history", "system")
HF_FORMATS = ("auto", "standard", "conversational", "implicit", "ranked", "hh")
HF_RANKED_ORDERS = ("best_first", "worst_first")  # data.hf.ranked_order: a ranked row's order when it gives no scores
SHAREGPT_PROMPT = "conversations"  # ShareGPT's column of the prompt's messages, the prompt when there is no prompt column
HF_READERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv", "arrow": "arrow"}  # compressed too


def _hf_reader(path: str) -> str | None:
    base = os.path.basename(path).lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        base = base.removesuffix(suffix)
    return HF_READERS.get(base.rsplit(".", 1)[-1]) if "." in base else None


def _rows(dataset, source: str) -> list[dict]:
    try:
        return dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
    except UnicodeDecodeError as e:  # Arrow keeps a JSON file's bytes: they are decoded here
        raise DataError(_not_utf8(source, e)) from None


def _not_utf8(what: str, e: UnicodeDecodeError) -> str:
    return f"{what} is not UTF-8 text (byte {e.start} of a value cannot be decoded); save it as UTF-8."


def _first_line(error: Exception, text: str | None = None) -> str:
    """The first line of ``text`` (default ``str(error)``), at most 160 characters; the error's type name when empty."""
    return ((str(error) if text is None else text).splitlines() or [type(error).__name__])[0][:160]


def _read_with_datasets(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` (a ``datasets`` reader) with progress bars off; a DataError naming ``what`` when it fails."""
    import datasets

    bars_were_on = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # the readers raise many kinds (DatasetGenerationError, ArrowInvalid, JSON errors, ...)
        cause = e
        while cause is not None and not isinstance(cause, UnicodeDecodeError):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            raise DataError(_not_utf8(what, cause)) from None
        detail = _first_line(e)
        raise DataError(
            f"{what} could not be read by the datasets library ({detail}); check that it is complete and in its format."
        ) from None
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def _as_text(dataset, text_columns, reread: Callable | None = None) -> tuple[object, dict[str, str]]:
    """(``dataset`` with its ``text_columns`` read as numbers or booleans turned into strings, {column: the note})."""
    import datasets

    features = getattr(dataset, "features", None) or {}
    kinds = {}
    for column in dict.fromkeys(text_columns):
        dtype = getattr(features.get(column), "dtype", None)
        if isinstance(features.get(column), datasets.Value) and (dtype == "bool" or dtype.startswith(("int", "uint", "float"))):
            kinds[column] = "booleans" if dtype == "bool" else "floats" if dtype.startswith("float") else "numbers"
    if not kinds:
        return dataset, {}
    features = features.copy()
    for column in kinds:
        features[column] = datasets.Value("string")
    dataset = reread(features) if reread is not None else dataset.cast(features)
    notes = {}
    examples = {"floats": ": 1.50 becomes 1.5", "booleans": ": true, false", "numbers": ""}  # a float's text is lost once read
    for column, kind in kinds.items():
        how = "kept as written in the file" if reread is not None else f"written by Arrow{examples[kind]}"
        notes[column] = f"cast to text: column {column!r} was read as {kind.replace('floats', 'numbers')} by datasets; {how}"
    return dataset, notes


def open_hf_source(
    path, name: str | None, cache_dir: str | None, text_columns=()
) -> tuple[list[str], Callable[[str], tuple[list[dict], str, dict[str, str]]]]:
    """(split names, ``read(split) -> (rows, source, {column cast to text: note})``) of ``data.hf.path``: a file, a
    mapping {split: file}, a folder, or a hub id."""
    import datasets

    def one_file(file: str) -> tuple[list[dict], str, dict[str, str]]:
        if not os.path.isfile(file):
            raise DataError(f"Data file {file} does not exist; check data.hf.path.")
        reader = _hf_reader(file)
        if reader is None:
            raise DataError(
                f"{file} is not a .json, .jsonl, .parquet, .csv or .arrow file; data.hf.path reads those (or a folder)."
            )
        _note_file(file)

        def load(**kwargs):
            return _read_with_datasets(
                file, datasets.load_dataset, reader, data_files=file, split="train", cache_dir=cache_dir, **kwargs
            )

        got, cast = _as_text(load(), text_columns, (lambda features: load(features=features)) if reader == "csv" else None)
        return _rows(got, file), file, cast

    def rows_of(dataset, source: str) -> tuple[list[dict], str, dict[str, str]]:
        got, cast = _as_text(dataset, text_columns)
        return _rows(got, source), source, cast

    if isinstance(path, dict):
        return list(path), lambda s: one_file(path[s])
    path = str(path)
    if os.path.isfile(path):
        return ["train"], lambda s: one_file(path)
    if os.path.isdir(path):
        _note_file(path)
        if os.path.exists(os.path.join(path, "dataset_dict.json")) or os.path.exists(os.path.join(path, "state.json")):
            got = _read_with_datasets(path, datasets.load_from_disk, path)
        else:
            got = _read_with_datasets(path, datasets.load_dataset, path, name=name, cache_dir=cache_dir)
        if isinstance(got, datasets.Dataset):
            return ["train"], lambda s: rows_of(got, path)
        return list(got), lambda s: rows_of(got[s], f"{path} ({s} split)")
    if path.startswith((".", "/", "~")) or path.count("/") > 1 or _hf_reader(path):
        raise DataError(f"data.hf.path={path} does not exist; give a data file, a folder or a hub id (org/name).")
    try:
        names = datasets.get_dataset_split_names(path, name)
    except (ConnectionError, OSError, FileNotFoundError) as e:
        raise DataError(
            f"Could not load {path} from the Hugging Face hub ({type(e).__name__}); offline? set data.hf.path to a local copy."
        ) from None
    kwargs = {"name": name} if name else {}
    return list(names), lambda s: rows_of(
        load_from_hub(path, "data.hf.path", split=s, cache_dir=cache_dir, **kwargs), f"{path} ({s} split)"
    )


def detect_hf_format(found: list[str], first: dict, columns: dict[str, str], source: str, roles: dict | None = None) -> str:
    """The format of rows with columns ``found``: ``ranked``, ``conversational``, ``implicit``, ``standard`` or ``hh``."""
    has = {key: columns[key] in found for key in HF_COLUMNS}
    if has["responses"] and has["prompt"]:
        return "ranked"
    if has["chosen"] and has["rejected"]:
        chosen, prompt = first.get(columns["chosen"]), first.get(columns["prompt"])
        chosen = [chosen] if isinstance(chosen, dict) else chosen  # one message (LLaMA-Factory's ShareGPT layout)
        if isinstance(chosen, list):
            starts_with_answer = bool(chosen) and _role_and_content(chosen[0], roles or {})[0] == "assistant"
            return (
                "conversational" if isinstance(prompt, list) or (isinstance(prompt, str) and starts_with_answer) else "implicit"
            )
        if has["prompt"]:
            return "standard"
        if isinstance(chosen, str) and isinstance(first.get(columns["rejected"]), str) and ASSISTANT_TAG in chosen:
            return "hh"
    raise DataError(
        f"{source} has columns {found}, which match no preference format (prompt / chosen / rejected, chosen / rejected "
        "conversations, or prompt / responses / scores); name yours with data.hf.columns={prompt: <column>, chosen: <column>, "
        "rejected: <column>} (or {prompt: ..., responses: ..., scores: ...})."
    )


def _hf_prompt(value, where: str, column: str, conversation: bool, roles: dict[str, str]) -> str | Messages:
    if isinstance(value, str) and not conversation:
        return value
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    return check_messages(value, where, column, roles)


def _prompt_turns(prompt: Messages, text: str | None, messages: Messages) -> int | None:
    """How many leading messages of ``messages`` (a chosen or rejected column) are the prompt's; None when no reading fits."""
    if messages[0]["role"] == "assistant":
        return 0
    if text is None:
        n = len(prompt)
        return n if messages[:n] == prompt and messages[n:] and messages[n]["role"] == "assistant" else None
    turns = [k for k, m in enumerate(messages) if m["role"] == "user" and m["content"].strip() == text.strip()]
    if turns and messages[turns[-1] + 1 :] and messages[turns[-1] + 1]["role"] == "assistant":
        return turns[-1] + 1
    return None


def _conversational_pair(raw_prompt, chosen: Messages, rejected: Messages, columns: dict, where: str, roles: dict):
    """(prompt messages, chosen response, rejected response) of a conversational row, else a DataError naming the row."""
    c, r, p = (columns[k] for k in ("chosen", "rejected", "prompt"))
    prompt = _hf_prompt(raw_prompt, where, p, True, roles)
    text = raw_prompt if isinstance(raw_prompt, str) else None
    cuts = [_prompt_turns(prompt, text, messages) for messages in (chosen, rejected)]
    for column, messages, cut in zip((c, r), (chosen, rejected), cuts):
        if cut is None:
            which = (
                f"none of its user turns followed by the assistant's is the {p!r} text"
                if text is not None
                else f"it does not begin with the {p!r} messages followed by the assistant's turn"
            )
            raise DataError(
                f"{where}: {column!r} starts with a {messages[0]['role']} message, so it holds more than the response, but "
                f"{which}, so its prompt cannot be told from its response; fix the row, or set data.hf.format=implicit to "
                f"split chosen and rejected at their common messages and ignore {p!r}."
            )
    for column, messages, cut in zip((c, r), (chosen, rejected), cuts):
        later = sum(m["role"] == "user" for m in messages[cut:])
        if later:  # Capybara's layout: the prompt is an earlier turn; format=implicit reads the later ones as prompt
            raise DataError(
                f"{where}: {column!r} has {later} user turn{'s' * (later > 1)} after the {p!r} "
                f"{'text' if text is not None else 'messages'}, so its response would hold the user's words; set "
                "data.hf.format=implicit to take the turns chosen and rejected share as the prompt, or fix the row."
            )
    prompts = [messages[:cut] if cut else prompt for messages, cut in zip((chosen, rejected), cuts)]
    if prompts[0] != prompts[1]:
        raise DataError(
            f"{where}: {c!r} and {r!r} hold different conversations before their responses ({len(prompts[0])} and "
            f"{len(prompts[1])} messages); a pair answers one prompt, so give both the same earlier turns."
        )
    return prompts[0], chosen[cuts[0] :], rejected[cuts[1] :]


def _hf_context_prompt(row: dict, columns: dict[str, str], where: str):
    """The prompt of ``row`` with the mapped :data:`HF_CONTEXT_COLUMNS` applied as LLaMA-Factory's alpaca converter does."""
    mapped = {k: columns[k] for k in HF_CONTEXT_COLUMNS if k in columns}
    prompt = row.get(columns["prompt"])
    if not mapped:
        return prompt
    if not isinstance(prompt, str):
        raise DataError(
            f"{where}: column {columns['prompt']!r} is not a string, but data.hf.columns maps {', '.join(mapped)}, which "
            "add to a prompt string (LLaMA-Factory's alpaca layout); map prompt to the instruction column."
        )
    for k in ("input", "system"):
        if k in mapped and row.get(mapped[k]) is not None and not isinstance(row[mapped[k]], str):
            raise DataError(f"{where}: column {mapped[k]!r} (data.hf.columns {k}) is not a string; give text or null.")
    if row.get(mapped.get("input")):
        prompt = "\n".join([prompt, row[mapped["input"]]]) if prompt else row[mapped["input"]]  # LLaMA-Factory's rule
    history = row.get(mapped["history"]) if "history" in mapped else None
    if history is not None and not (
        isinstance(history, list)
        and all(isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in history)
    ):
        raise DataError(
            f"{where}: column {mapped['history']!r} (data.hf.columns history) is not a list of [user, assistant] string "
            f"pairs ({json.dumps(history, ensure_ascii=False, default=str)[:80]}); give earlier turns as [[question, answer], ...] or []."
        )
    system = row.get(mapped["system"]) if "system" in mapped else None
    if "history" not in mapped and "system" not in mapped:
        return prompt
    turns = [{"role": role, "content": text} for pair in history or [] for role, text in zip(("user", "assistant"), pair)]
    return [{"role": "system", "content": system}] * bool(system) + turns + [{"role": "user", "content": prompt}]


def _hf_pair(row: dict, fmt: str, columns: dict[str, str], where: str, roles: dict[str, str]):
    """(prompt, chosen, rejected) of one row of format ``fmt``: strings, or message lists for a conversational row."""
    c, r, p = (columns[k] for k in ("chosen", "rejected", "prompt"))
    if fmt == "standard":
        for column in (p, c, r):
            if not isinstance(row.get(column), str):
                raise DataError(
                    f"{where}: column {column!r} is missing or not a string; standard rows need prompt, chosen and rejected strings."
                )
        prompt = _hf_context_prompt(row, columns, where)
        if isinstance(prompt, list):  # history or system mapped: the row is conversational
            return (
                check_messages(prompt, where, p, roles),
                [{"role": "assistant", "content": row[c]}],
                [{"role": "assistant", "content": row[r]}],
            )
        return prompt, row[c], row[r]
    chosen, rejected = check_messages(row.get(c), where, c, roles), check_messages(row.get(r), where, r, roles)
    check_ends_with_assistant(chosen, where, c)
    check_ends_with_assistant(rejected, where, r)
    if fmt == "conversational":
        return _conversational_pair(row.get(p), chosen, rejected, columns, where, roles)
    split = split_conversations(chosen, rejected)
    if split is None:
        raise DataError(
            f"{where}: {c!r} and {r!r} share no prompt (no common messages before an assistant turn); "
            "give the prompt in a column of its own (data.hf.columns={prompt: <column>})."
        )
    return split


def _hf_ranked(
    row: dict, columns: dict[str, str], where: str, roles: dict[str, str], order: str | None = None
) -> tuple[str | Messages, list[tuple[str | Messages, float]]]:
    """(prompt, [(response, score), ...]) of a ranked row; with ``order`` the k-th of n scores n - k + 1 (best_first) or k."""
    rc, sc, pc = columns["responses"], columns["scores"], columns["prompt"]
    responses, scores = row.get(rc), row.get(sc)
    if not isinstance(responses, list) or not responses:
        raise DataError(f"{where}: column {rc!r} is not a list of responses; ranked rows need prompt, responses (and scores).")
    if order is not None:
        if scores is not None or any(isinstance(a, dict) and a.get("score") is not None for a in responses):
            raise DataError(
                f"{where}: gives scores (column {sc!r} or a 'score' in a response object) while data.hf.ranked_order={order} "
                "ranks the responses by their order; drop data.hf.ranked_order to use the scores."
            )
        n = len(responses)
        items = [
            (a.get("text", a.get("response")) if isinstance(a, dict) else a, n - k if order == "best_first" else k + 1)
            for k, a in enumerate(responses)
        ]
    elif scores is None:
        items = [(a.get("text", a.get("response")), a.get("score")) if isinstance(a, dict) else (a, None) for a in responses]
    elif not isinstance(scores, list) or len(scores) != len(responses):
        raise DataError(f"{where}: column {sc!r} is not a list of {len(responses)} scores, one per response in {rc!r}.")
    else:
        items = list(zip(responses, scores))
    raw_prompt = _hf_context_prompt(row, columns, where)
    conversation = isinstance(raw_prompt, list) or any(isinstance(t, list) for t, _ in items)
    prompt = _hf_prompt(raw_prompt, where, pc, conversation, roles)
    if not isinstance(prompt, (str, list)):
        raise DataError(f"{where}: column {pc!r} is missing or not a string or a list of messages.")
    ranked = []
    for k, (text, score) in enumerate(items, 1):
        if not isinstance(score, (int, float)) or isinstance(score, bool):
            raise DataError(
                f"{where}: response {k} has no numeric score; give {sc!r} or a 'score' in each response object, or set "
                "data.hf.ranked_order=best_first when the responses are listed best first."
            )
        if not math.isfinite(score):
            raise DataError(not_finite(where, f"response {k}'s score", score))
        if conversation:
            text = [{"role": "assistant", "content": text}] if isinstance(text, str) else check_messages(text, where, rc, roles)
            check_ends_with_assistant(text, where, rc)
        elif not isinstance(text, str):
            raise DataError(f"{where}: response {k} of {rc!r} has no text; give strings or {{text, score}} objects.")
        ranked.append((text, float(score)))
    return prompt, ranked


def _hf_columns(columns: dict | None, found: list[str]) -> dict[str, str]:
    """Each of :data:`HF_COLUMNS` -> its column: ``columns``, else its name (prompt: ``conversations`` if no ``prompt``)."""
    mapped = {key: key for key in HF_COLUMNS} | dict(columns or {})
    if "prompt" not in (columns or {}) and "prompt" not in found and SHAREGPT_PROMPT in found:
        mapped["prompt"] = SHAREGPT_PROMPT
    return mapped


def _context_columns(columns: dict[str, str], given: dict) -> dict[str, str]:
    """``columns`` without ``system`` unless ``given`` maps it (an unmapped one heads conversational prompts only)."""
    return columns if "system" in given else {k: v for k, v in columns.items() if k != "system"}


def note_cast(report: collections.Counter, cast: dict[str, str] | None, row: dict, key: str) -> None:
    """Count ``row`` (its prompt's key ``key``) under the note of each of its columns in ``cast`` that holds a value."""
    for column, note in (cast or {}).items():
        if row.get(column) is not None:
            note_row(report, note, key)


def _hh_dialogues(row: dict, columns: dict[str, str], where: str) -> tuple[str, str]:
    """(chosen, rejected) whole dialogues of an ``hh`` row, else a DataError naming the row."""
    c, r = columns["chosen"], columns["rejected"]
    for column in (c, r):
        if not isinstance(row.get(column), str):
            raise DataError(
                f"{where}: column {column!r} is missing or not a string; hh rows need chosen and rejected dialogues "
                "('\\n\\nHuman: ...\\n\\nAssistant: ...')."
            )
    return row[c], row[r]


def check_sharegpt_roles(row: dict, columns: dict[str, str], where: str, roles: dict[str, str]) -> None:
    """Check that ``roles`` maps every non-standard role of a ShareGPT row, else a DataError naming them all."""
    unknown = []
    for column in (columns["prompt"], columns["chosen"], columns["rejected"]):
        value = row.get(column)
        for m in [value] if isinstance(value, dict) else value if isinstance(value, list) else []:
            role = _role_and_content(m, roles)[0]
            if isinstance(role, str) and role not in STANDARD_ROLES and role not in unknown:
                unknown.append(role)
    if unknown:
        mapping = roles | {role: LIKELY_ROLES.get(role.lower(), "<user, assistant, system or tool>") for role in unknown}
        raise DataError(
            f"{where}: the ShareGPT messages have role(s) {', '.join(map(repr, unknown))}, not one of "
            f"{', '.join(STANDARD_ROLES)}; map them with 'data.hf.roles={{{', '.join(f'{k}: {v}' for k, v in mapping.items())}}}'."
        )


def _with_system(prompt: str | Messages, system, where: str, column: str) -> str | Messages:
    """``prompt`` with ``system`` as its first message when it is a conversation not already starting with one."""
    if system is None or isinstance(prompt, str):
        return prompt
    if not isinstance(system, str):
        raise DataError(
            f"{where}: column {column!r} is a JSON {_json_kind(system)}, not a string; give the system prompt as text."
        )
    if not system.strip() or prompt[0]["role"] == "system":  # a system message in the conversation wins (LLaMA-Factory)
        return prompt
    return [{"role": "system", "content": system}, *prompt]


def _check_hf_options(format: str, columns, ranked_order: str | None) -> None:
    """Check ``data.hf.format``, ``data.hf.columns`` (a mapping of known keys) and ``data.hf.ranked_order``."""
    if format not in HF_FORMATS:
        raise DataError(f"data.hf.format={format} is unknown; use one of {', '.join(HF_FORMATS)}.")
    if columns is not None and not isinstance(columns, dict):  # e.g. bash split an unquoted {a:b,c:d} into three overrides
        raise DataError(
            f"data.hf.columns must be a mapping such as {{prompt: question, chosen: good, rejected: bad}}, got {columns!r}; "
            "quote the whole override in the shell: 'data.hf.columns={prompt: question, chosen: good, rejected: bad}'."
        )
    unknown = sorted(set(columns or {}) - set(HF_COLUMNS) - set(HF_CONTEXT_COLUMNS))
    if unknown:
        raise DataError(
            f"data.hf.columns has unknown key(s) {unknown}; its keys are {', '.join(HF_COLUMNS + HF_CONTEXT_COLUMNS)} "
            "(each set to your column)."
        )
    if ranked_order is not None and ranked_order not in HF_RANKED_ORDERS:
        raise DataError(
            f"data.hf.ranked_order={ranked_order} is unknown; use best_first or worst_first (or null: the rows give scores)."
        )


def _check_hf_format_options(fmt: str, rows: list[dict], source: str, ranked_order: str | None, given: dict) -> None:
    """Check that ``ranked_order`` and a mapped ``input`` / ``history`` fit rows read as ``fmt``."""
    if ranked_order is not None and rows and fmt != "ranked":
        raise DataError(
            f"data.hf.ranked_order={ranked_order} orders ranked rows' responses, but {source} is read as {fmt}; map the "
            "list of responses with data.hf.columns={responses: <column>} (and data.hf.format=ranked)."
        )
    context = [k for k in ("input", "history") if k in given]  # a mapped system also heads conversational prompts
    if context and rows and fmt not in ("standard", "ranked"):
        raise DataError(
            f"data.hf.columns maps {', '.join(context)}, which add to a prompt string of standard or ranked rows, but "
            f"{source} is read as {fmt}; map prompt, chosen and rejected (or responses) to string columns."
        )


def _ranked_candidates(
    prompt: str | Messages, ranked: list[tuple[str | Messages, float]], report: collections.Counter
) -> list[tuple[tuple, float]]:
    """[((chosen, rejected), score gap), ...] of every two responses of a ranked row; ties skipped and counted."""
    if len(ranked) < 2:
        note_row(report, "skipped: fewer than 2 responses", prompt if isinstance(prompt, str) else conversation_key(prompt))
    candidates = []
    for a in range(len(ranked)):
        for b in range(a + 1, len(ranked)):
            (ta, sa), (tb, sb) = ranked[a], ranked[b]
            if sa == sb:
                note_row(report, "skipped: score tie", prompt if isinstance(prompt, str) else conversation_key(prompt))
            else:
                candidates.append(((ta, tb) if sa > sb else (tb, ta), abs(sa - sb)))
    return candidates


def _cap_pairs(data: DatasetDict, gaps: dict[str, list[float]], max_pairs_per_prompt: int, report: collections.Counter) -> None:
    """Keep at most ``max_pairs_per_prompt`` pairs of each prompt of ``data``, those of the largest ``gaps``."""
    for key, entry in data.items():
        n = len(entry["pairs"])
        if n > max_pairs_per_prompt:
            note_row(report, "skipped: over max_pairs_per_prompt", key, n - max_pairs_per_prompt)
            keep = sorted(sorted(range(n), key=lambda k: -gaps[key][k])[:max_pairs_per_prompt])
            entry["pairs"] = [entry["pairs"][k] for k in keep]
            if "rows" in entry:
                entry["rows"] = [entry["rows"][k] for k in keep]


def hf_rows_to_data(
    rows: list[dict],
    report: collections.Counter,
    source: str,
    format: str = "auto",
    columns: dict | None = None,
    max_pairs_per_prompt: int | None = None,
    roles: dict | None = None,
    ranked_order: str | None = None,
    cast: dict[str, str] | None = None,
) -> DatasetDict:
    """Preference rows in an ``hf`` format (:func:`detect_hf_format`) to a DatasetDict, counting rows of a ``cast`` column."""
    _check_hf_options(format, columns, ranked_order)
    found = list(rows[0]) if rows else []
    missing = [(key, col) for key, col in (columns or {}).items() if rows and col not in found]
    if missing:
        key, col = missing[0]
        raise DataError(f"data.hf.columns maps {key} to {col!r}, which is not a column of {source} (its columns: {found}).")
    given = dict(columns or {})
    columns = _hf_columns(columns, found)
    pair_columns = _context_columns(columns, given)
    roles = check_roles_mapping(roles)
    fmt = detect_hf_format(found, rows[0], columns, source, roles) if format == "auto" and rows else format
    _check_hf_format_options(fmt, rows, source, ranked_order, given)
    data: DatasetDict = {}
    gaps: dict[str, list[float]] = {}
    for i, row in enumerate(rows, 1):
        where = f"{source}, row {i}"
        if fmt == "hh":
            key, added = add_hh_pair(data, *_hh_dialogues(row, columns, where), report, where)
            note_cast(report, cast, row, key)
            if added:
                gaps.setdefault(key, []).append(0.0)
                add_fields(data[key], row, columns.values())
            continue
        if fmt == "ranked":
            prompt, ranked = _hf_ranked(row, pair_columns, where, roles, ranked_order)
            candidates = _ranked_candidates(prompt, ranked, report)
        else:
            if columns["prompt"] == SHAREGPT_PROMPT:
                check_sharegpt_roles(row, columns, where, roles)
            prompt, chosen, rejected = _hf_pair(row, fmt, pair_columns, where, roles)
            candidates = [((chosen, rejected), 0.0)]
        prompt = _with_system(prompt, row.get(columns["system"]), where, columns["system"])
        key = prompt if isinstance(prompt, str) else conversation_key(prompt)
        note_cast(report, cast, row, key)
        consumed = [c for k, c in columns.items() if k != "system" or not isinstance(prompt, str)]
        for (chosen, rejected), gap in candidates:
            if isinstance(prompt, str):
                added = add_pair(data, prompt, chosen, rejected, report, where)
            else:
                added = add_conversation_pair(data, prompt, chosen, rejected, report, where)
            if added:
                gaps.setdefault(key, []).append(gap)
                add_fields(data[key], row, consumed)
        if fmt == "ranked" and key in data:
            data[key]["sft_target"] = max(ranked, key=lambda t: t[1])[0]
    if max_pairs_per_prompt is not None:
        _cap_pairs(data, gaps, max_pairs_per_prompt, report)
    return data


def hf_split_rows(
    split: str, path, name: str | None, train_split: str, test_split: str | None, holdout_fraction: float, cache_dir, columns=None
) -> tuple[list[dict], str, bool, dict[str, str]]:
    """(rows, source, whether to carve the held-out slice, {column cast to text: note}) that ``hf`` reads for ``split``."""
    if path is None:
        raise DataError("datasets=[hf] needs data.hf.path=<hub id, data file or folder>.")
    mapped = {key: key for key in HF_COLUMNS} | (dict(columns) if isinstance(columns, dict) else {})
    names, read = open_hf_source(path, name, cache_dir, [mapped[k] for k in ("prompt", "chosen", "rejected", "system")])
    if train_split not in names:
        if len(names) != 1:
            raise DataError(
                f"{path} has no split {train_split!r} (its splits: {', '.join(names)}); set data.hf.train_split to one of them."
            )
        train_split = names[0]
    if test_split is not None and test_split not in names and len(names) > 1:  # a typo would evaluate on train data
        raise DataError(
            f"{path} has no split {test_split!r} (its splits: {', '.join(names)}); set data.hf.test_split to one of them, "
            f"or data.hf.test_split=null to hold out data.hf.holdout_fraction of {train_split!r}."
        )
    carve = test_split not in names or test_split == train_split
    if carve and not holdout_fraction:
        raise DataError(
            f"{path} has no split {test_split!r} (its splits: {', '.join(names)}); set data.hf.test_split to one of them, "
            f"or data.hf.holdout_fraction (e.g. 0.1) to hold out a slice of {train_split!r}."
        )
    rows, source, cast = read(train_split if carve or split == "train" else test_split)
    return rows, source, carve, cast


def _hf_loader(to_data: Callable) -> Callable:
    """The ``data.hf.*`` loader reading :func:`hf_split_rows` into ``to_data``, with ``to_data``'s name and docstring."""

    def loader(
        split: str,
        report: collections.Counter,
        path: str | dict | None = None,
        name: str | None = None,
        train_split: str = "train",
        test_split: str | None = "test",
        format: str = "auto",
        columns: dict | None = None,
        max_pairs_per_prompt: int | None = None,
        holdout_fraction: float = 0.1,
        cache_dir: str | None = None,
        roles: dict | None = None,
        ranked_order: str | None = None,
    ) -> DatasetDict:
        rows, source, carve, cast = hf_split_rows(
            split, path, name, train_split, test_split, holdout_fraction, cache_dir, columns
        )
        data = to_data(rows, report, source, format, columns, max_pairs_per_prompt, roles, ranked_order, cast)
        return apply_holdout(data, split, holdout_fraction, report) if carve else data

    loader.__name__, loader.__qualname__, loader.__doc__ = to_data.__name__, to_data.__qualname__, to_data.__doc__
    return loader


@register_dataset("hf", truncation_mode="keep_end")
@_hf_loader
def get_hf(rows, report, source, format, columns, max_pairs_per_prompt, roles, ranked_order, cast) -> DatasetDict:
    """Any preference data the ``datasets`` library reads, in TRL's formats or mapped to them (docs/configuration.md)."""
    return hf_rows_to_data(rows, report, source, format, columns, max_pairs_per_prompt, roles, ranked_order, cast)


@register_prompt_dataset("hf", truncation_mode="keep_end")
@_hf_loader
def get_hf_prompts(rows, report, source, format, columns, max_pairs_per_prompt, roles, ranked_order, cast) -> DatasetDict:
    """Prompts for online DPO from what :func:`get_hf` reads, with the same options, as a prompt-only DatasetDict."""
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


@register_dataset("arithmetic", truncation_mode="keep_start", reward_functions=("arithmetic",))
def get_arithmetic(
    split: str, report: collections.Counter, n_train: int = 4000, n_test: int = 256, max_operand: int = 99
) -> DatasetDict:
    """The embedded default: generated addition problems, e.g. ``"Q: 17+25=\\nA:"``, rejected a typical mistake."""
    rng = random.Random(1234)  # fixed, not config.seed: train/test prompts disjoint and the same everywhere
    problems = [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    rng.shuffle(problems)
    chosen_problems = problems[n_train : n_train + n_test] if split == "test" else problems[:n_train]
    data: DatasetDict = {}
    for a, b in chosen_problems:
        right = a + b
        mistakes = [int(f"{a}{b}"), abs(a - b), right + 1, right - 1]  # concatenated, subtracted, off by one
        if a % 10 + b % 10 >= 10:
            mistakes.append(right - 10)  # forgot the carry
        wrong = rng.choice([m for m in mistakes if m != right])
        add_pair(data, f"Q: {a}+{b}=\nA:", f" {right}", f" {wrong}", report)
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


# ----------------------------------------------------------------------------- loading


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


def split_overlap_warning(train: list[dict], test: list[dict]) -> str | None:
    """The warning when over :data:`DUPLICATE_WARNING_SHARE` of the ``test`` examples are also ``train`` examples (the
    same prompt and responses, e.g. one file given as both splits), else None."""

    def key(example: dict) -> str:
        return json.dumps([example.get(k) for k in ("prompt", "chosen", "rejected", "label")], default=str)

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
        extra = {"conversation": True} if "prompt_messages" in entry else {}
        if "fields" in entry:
            extra["fields"] = entry["fields"]
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


# ----------------------------------------------------------------------------- chat templates

_PROBE = "Probe1234"  # an assistant's content, to find what a chat template writes after it


def end_of_turn_token(tokenizer) -> str | None:
    """The special token the chat template writes right after an assistant's content (e.g. ``<|im_end|>``), or None."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    import jinja2

    for head in ([], [{"role": "system", "content": "S"}]):
        messages = [*head, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except (jinja2.TemplateError, ValueError, TypeError):
            continue
        k = text.find(_PROBE)
        if k < 0:
            continue
        after = _encode(tokenizer, text[k + len(_PROBE) :].lstrip(" \t\n"), rendered=True)
        special = set(tokenizer.all_special_ids) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
        }
        return tokenizer.convert_ids_to_tokens(after[0]) if after and after[0] in special else None
    return None


def stop_token_ids(tokenizer) -> list[int]:
    """The ids at which generation stops: EOS, and the chat template's end-of-turn token when it differs."""
    ids = [tokenizer.eos_token_id]
    eot = end_of_turn_token(tokenizer)
    if eot is not None and tokenizer.convert_tokens_to_ids(eot) not in ids:
        ids.append(tokenizer.convert_tokens_to_ids(eot))
    return ids


def _render(tokenizer, messages: list[dict], row: str, generation_prompt: bool = False) -> str:
    """``messages`` rendered by the chat template as text, else a DataError naming ``row`` with the template's message."""
    import jinja2

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except jinja2.TemplateError as e:
        roles = [m.get("role") for m in messages]
        raise DataError(
            f"{row}: the chat template rejects this conversation (roles {roles}): {e}; fix the roles or set model.chat_template."
        ) from e


def _check_tool_turns(tokenizer, conversations: list[Messages], row: str) -> None:
    """Check that the chat template renders every ``tool`` message of ``conversations`` with its content."""
    import jinja2

    for messages in conversations:
        contents = [m["content"].strip() for m in messages if m["role"] == "tool"]
        if not contents:
            continue
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            reason = f"it raises: {e}"
        else:
            if all(content in text for content in contents):
                continue
            reason = "its rendering leaves the tool message's content out"
        name = tokenizer.name_or_path or type(tokenizer).__name__
        raise DataError(
            f"{row} holds a 'tool' message, which the chat template of {name!r} cannot render ({reason}); set "
            "model.chat_template to a template that renders tool messages, or leave such rows out."
        )


def drop_earliest_turn(messages: list[dict]) -> list[dict] | None:
    """``messages`` without their earliest user turn (a leading system message kept); None when one user turn is left."""
    head = messages[:1] if messages and messages[0].get("role") == "system" else []
    rest = messages[len(head) :]
    later = [j for j, m in enumerate(rest) if j > 0 and m.get("role") == "user"]
    return head + rest[later[0] :] if later else None


def _assistant_spans(tokenizer, messages, indices, text, end_text, has_eot, row) -> list[tuple[int, int]] | None:
    """Character spans of ``text`` holding the assistant turns ``indices``; None when the template breaks the prefix property."""
    spans = []
    for k in indices:
        head = _render(tokenizer, messages[:k], row, generation_prompt=True)
        if not text.startswith(head):
            return None
        if has_eot:
            end = text.find(end_text, len(head))
            if end < 0:
                return None
            end += len(end_text)
        else:
            upto = _render(tokenizer, messages[: k + 1], row)
            if not text.startswith(upto):
                return None
            end = len(upto)
        spans.append((len(head), end))
    return spans


def _split(text: str, spans: list[tuple[int, int]], offset: int = 0) -> list[list]:
    """``text`` cut into [[piece, trained], ...] pieces, trained inside ``spans`` (shifted by ``offset``)."""
    pieces, at = [], 0
    for a, b in spans:
        a, b = max(a - offset, at), min(b - offset, len(text))
        if a >= b:
            continue
        pieces += [[text[at:a], False], [text[a:b], True]]
        at = b
    pieces.append([text[at:], False])
    return [p for p in pieces if p[0]]


def _check_messages(messages, row: str, what: str, last_assistant: bool) -> None:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"{row}: the {what} is not a non-empty list of {{role, content}} messages.")
    for k, m in enumerate(messages, 1):
        if m["role"] not in STANDARD_ROLES:
            hint = "map it to one of them where the data is read (datasets=[hf]: data.hf.roles)"
            raise unknown_role(m["role"], row, f"message {k} of the {what}", hint)
    if last_assistant and messages[-1]["role"] != "assistant":
        raise DataError(
            f"{row}: the {what} ends with a {messages[-1]['role']!r} message; a response must end with the assistant's message."
        )


def _render_example(ex: dict, prompt: list[dict], tokenizer, eot: str | None, all_turns: bool, row: str) -> tuple[dict, bool]:
    """One conversational example rendered (:func:`render_conversations`), and whether the template broke the prefix."""
    sides = [s for s in ("chosen", "rejected") if ex.get(s) is not None]
    end_text = eot or tokenizer.eos_token
    p = _render(tokenizer, prompt, row, generation_prompt=True)
    new = {k: v for k, v in ex.items() if k not in ("conversation", "prompt", *sides)}
    new.update(prompt=p, end_token_id=tokenizer.convert_tokens_to_ids(end_text), messages=prompt)
    pieces: dict[str, list] = {}
    broke = False
    if all_turns:
        spans = _assistant_spans(
            tokenizer, prompt, [k for k, m in enumerate(prompt) if m["role"] == "assistant"], p, end_text, eot, row
        )
        broke |= spans is None
        if spans:
            pieces["prompt"] = _split(p, spans)
    for side in sides:
        messages = ex[side]
        whole = _render(tokenizer, prompt + messages, row)
        if whole.startswith(p):
            start = len(p)
        else:  # the response starts where the template puts the first response message's content
            broke = True
            probe = _render(tokenizer, prompt + [{**messages[0], "content": _PROBE}], row)
            start = probe.find(_PROBE)
            if start < 0 or not whole.startswith(probe[:start]):
                raise DataError(
                    f"{row}: the chat template renders the {side} conversation so that its response cannot be told apart "
                    "from the prompt (the earlier turns render differently); set model.chat_template to a template that does not."
                )
        rest = whole[start:]
        k = rest.rfind(end_text) if eot else -1
        body = rest[: k + len(end_text)] if k >= 0 else rest  # what follows the end of turn is not trained
        response = body if k >= 0 else body + end_text  # no end-of-turn token: EOS ends it
        new[side] = response
        if len(messages) > 1 and start == len(p):  # a multi-turn response: only its assistant turns are trained
            indices = [len(prompt) + j for j, m in enumerate(messages) if m["role"] == "assistant"]
            spans = _assistant_spans(tokenizer, prompt + messages, indices, whole, end_text, eot, row)
            broke |= spans is None
            if spans:
                pieces[side] = _split(body, spans, offset=start) + ([] if response == body else [[end_text, True]])
    if pieces:
        new["pieces"] = pieces
    return new, broke


def render_conversations(
    examples: list[dict],
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    silent: bool = False,
    *,
    split: str = "train",
    all_assistant_turns: bool = False,
) -> list[dict]:
    """Render conversational examples by the chat template into texts with ``end_token_id``, ``messages`` and ``pieces``."""
    label = "eval" if split == "test" else split
    todo = [i for i, ex in enumerate(examples) if ex.get("conversation")]
    if not todo:
        return examples
    rows = {i: examples[i].get("row") or f"{label} example {i + 1}" for i in todo}
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"{rows[todo[0]]} is a conversation but the tokenizer {tokenizer.name_or_path or type(tokenizer).__name__!r} "
            "has no chat template; set one with model.chat_template=<file or Jinja string>."
        )
    eot = end_of_turn_token(tokenizer)
    out = list(examples)
    n_broke = n_dropped = n_turns = n_empty = 0
    first_empty = None
    for i in todo:
        ex, row = examples[i], rows[i]
        _check_messages(ex["prompt"], row, "prompt", last_assistant=False)
        sides = [ex[side] for side in ("chosen", "rejected") if ex.get(side) is not None]
        for side in ("chosen", "rejected"):
            if ex.get(side) is not None:
                _check_messages(ex[side], row, f"{side} response", last_assistant=True)
        _check_tool_turns(tokenizer, [ex["prompt"] + messages for messages in sides] or [ex["prompt"]], row)
        if any(m["role"] == "assistant" and not str(m.get("content", "")).strip() for m in sum(sides, ex["prompt"])):
            n_empty += 1
            first_empty = first_empty or row
        prompt, dropped = ex["prompt"], 0
        while True:
            new, broke = _render_example(ex, prompt, tokenizer, eot, all_assistant_turns, row)
            n_prompt = len(_encode(tokenizer, new["prompt"], rendered=True))
            responses = [len(_encode(tokenizer, new[s], rendered=True)) for s in ("chosen", "rejected") if s in new]
            too_long = n_prompt > max_prompt_length and (not responses or n_prompt + max(responses) > max_length)
            shorter = drop_earliest_turn(prompt) if too_long else None
            if shorter is None:
                break
            prompt, dropped = shorter, dropped + 1
        out[i] = new
        n_broke += broke
        n_dropped += dropped > 0
        n_turns += dropped
    if not silent:
        lengths = f"max_length={max_length} / max_prompt_length={max_prompt_length}"
        print(
            f"[data] {label}: {len(todo)} conversations rendered with the chat template (end of turn {eot or tokenizer.eos_token!r}); "
            f"{n_dropped} prompts lost their earliest turns ({n_turns} turns in all) to fit {lengths}"
        )
        if n_broke:
            print(
                f"[data] warning: {label}: the chat template renders {_share(n_broke, len(todo))} conversations so that the whole "
                "does not start with the prompt's rendering (it changes earlier turns, e.g. drops a thinking part or adds a "
                "default system message in one rendering only); their responses are tokenized after the prompt as rendered "
                "for generation, so no label shifts."
            )
        if n_empty:
            print(
                f"[data] warning: {label}: {_share(n_empty, len(todo))} conversations hold an empty assistant message before "
                f"their last turn (the first: {first_empty}); each is kept as an empty turn (trained as one where it is part of "
                "a response): fix or drop those rows if that is not meant."
            )
    return out


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


def _share(k: int, n: int) -> str:
    return f"{k / n:.1%} ({k} of {n})" if n else "0"


def screen_examples(
    examples: list[dict], split: str, tokenizer, max_length: int, max_prompt_length: int, silent: bool = False
) -> list[dict]:
    """The examples of ``split`` worth training on, in order: pairs identical once truncated are skipped with a warning."""
    label = "eval" if split == "test" else split
    if not examples:
        raise DataError(f"The {label} split has no examples; check datasets=[...] and their data.* options.")
    kept: list[dict] = []
    n_prompts_cut = n_responses = n_responses_cut = 0
    same_once_cut = same_tokens = 0
    for ex, t in zip(examples, truncated_ids(examples, tokenizer, max_length, max_prompt_length)):
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


def collate_prompts(elements: list[dict], pad_token_id: int) -> dict:
    """Batch :func:`tokenize_prompt` elements: ``prompt_input_ids`` and ``prompt_attention_mask`` (B, P) long, left-padded."""
    if not elements:
        raise ValueError("collate_prompts needs at least one element; the prompt batch is empty.")
    batch = {key: [e[key] for e in elements] for key in elements[0] if key != "prompt_input_ids"}
    batch["prompt_input_ids"], batch["prompt_attention_mask"] = left_pad([e["prompt_input_ids"] for e in elements], pad_token_id)
    return batch


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


# KTO's reference point z0 (Ethayarajh et al. 2024, Sec. 4.1): within each micro-batch of B examples, prompt x_i
# with the chosen (or only) completion y_{(i+1) mod B} (TRL's KTOTrainer: y_{i-1}, the same estimator); B == 1
# gives (x_i, y_i); under FSDP / data parallelism z0 is the mean over processes of each micro-batch mean.


def mismatched_pairs(batch: dict, max_length: int) -> dict:
    """The mismatched (x_i, y_{(i+1) mod B}) of a micro-batch: ``input_ids``, ``attention_mask``, ``labels`` (B, T) long."""
    device = batch["chosen_input_ids"].device
    ids, mask, labels = (batch[f"chosen_{k}"].cpu() for k in ("input_ids", "attention_mask", "labels"))
    prompt_lengths = batch["prompt_attention_mask"].sum(1).tolist()
    lengths = mask.sum(1).tolist()
    n = ids.shape[0]
    seqs, targets = [], []
    for i in range(n):
        j = (i + 1) % n
        p_i, p_j = prompt_lengths[i], prompt_lengths[j]
        seq = torch.cat([ids[i, :p_i], ids[j, p_j : lengths[j]]])[:max_length]  # cut at the end as TRL cuts its KL sequences
        lab = torch.cat([torch.full((p_i,), IGNORE_INDEX, dtype=labels.dtype), labels[j, p_j : lengths[j]]])
        seqs.append(seq)
        targets.append(lab[:max_length])
    width = max(len(s) for s in seqs)
    out = {
        "input_ids": torch.zeros(n, width, dtype=ids.dtype),
        "attention_mask": torch.zeros(n, width, dtype=mask.dtype),
        "labels": torch.full((n, width), IGNORE_INDEX, dtype=labels.dtype),
    }
    for i, (seq, lab) in enumerate(zip(seqs, targets)):
        out["input_ids"][i, : len(seq)] = seq
        out["attention_mask"][i, : len(seq)] = 1
        out["labels"][i, : len(lab)] = lab
    return {k: v.to(device) for k, v in out.items()}


def as_pair_batch(rows: dict) -> dict:
    """A pair batch whose chosen and rejected sides are both ``rows``; use the chosen half of the result."""
    return {f"{side}_{k}": v for side in ("chosen", "rejected") for k, v in rows.items()}


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
