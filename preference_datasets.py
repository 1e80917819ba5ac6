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
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import MappingProxyType

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


def _share(k: int, n: int) -> str:
    return f"{k / n:.1%} ({k} of {n})" if n else "0"


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


def concatenated_inputs(batch: dict) -> dict:
    """``input_ids``, ``attention_mask``, ``labels``, each (2B, max(T_c, T_r)): chosen (B, T_c) in rows [0, B)
    over rejected (B, T_r) in rows [B, 2B), right-padded to one width for one forward pass."""
    width = max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1])
    out = {}
    for key, pad in (("input_ids", 0), ("attention_mask", 0), ("labels", IGNORE_INDEX)):
        parts = []
        for side in ("chosen", "rejected"):
            t = batch[f"{side}_{key}"]
            parts.append(torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad))
        out[key] = torch.cat(parts, dim=0)
    return out
