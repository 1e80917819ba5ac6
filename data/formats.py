"""Local JSON files and anything the ``datasets`` library reads (``data.json``, ``data.hf``): TRL's standard,
conversational, implicit and ranked formats, ShareGPT and Alpaca layouts, detected or mapped (docs/data.md)."""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Callable

from data.conversations import (
    Messages,
    _role_and_content,
    add_conversation_pair,
    check_ends_with_assistant,
    check_messages,
    check_roles_mapping,
    check_sharegpt_roles,
    conversation_key,
    split_conversations,
)
from data.holdout import apply_holdout
from data.readers import _json_kind, load_from_hub, read_json_records
from data.report import DatasetDict, _note_file, add_fields, add_pair, add_unpaired, not_finite, note_row
from preference_datasets import ASSISTANT_TAG, add_hh_pair, register_dataset
from utils import DataError


def _json_file(path, split: str) -> str:
    """The file ``data.json.path`` names for ``split`` (one file, or ``{train: file, test: file}``), else a DataError."""
    if path is None:
        raise DataError("datasets=[json] needs data.json.path=<file.jsonl> (rows with prompt, chosen, rejected).")
    if not isinstance(path, (str, dict)):
        raise DataError(f"data.json.path={path} is neither a file nor a mapping {{train: file, test: file}}; give one of them.")
    file = path if isinstance(path, str) else path.get(split)
    if file is None:
        raise DataError(f"data.json.path has no {split!r} file; give one or a single file with data.json.holdout_fraction.")
    return file


def _add_unpaired_row(data: DatasetDict, row: dict, file: str, i: int, report: collections.Counter) -> None:
    """Check the unpaired row ``i`` of ``file`` ({prompt, completion, label}) and add it to ``data``."""
    for field in ("prompt", "completion"):
        if not isinstance(row.get(field), str):
            raise DataError(
                f"{file}, row {i}: field {field!r} is missing or not a string; every unpaired row needs prompt, completion and label."
            )
    if not isinstance(row.get("label"), bool):
        value = json.dumps(row["label"]) if "label" in row else "missing"
        raise DataError(
            f"{file}, row {i}: field 'label' is {value}, not true or false; every unpaired row needs prompt, "
            "completion and label (true: the completion is desirable)."
        )
    if add_unpaired(data, row["prompt"], row["completion"], row["label"], report, f"{file}, row {i}"):
        add_fields(data[row["prompt"]], row, ("prompt", "completion", "label"))


def _check_paired_row(row, file: str, i: int) -> None:
    """Check that row ``i`` of ``file`` has string fields prompt, chosen and rejected; a DataError names another layout."""
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


@register_dataset("json", truncation_mode="keep_end")
def get_json(
    split: str, report: collections.Counter, path: str | dict | None = None, holdout_fraction: float = 0.1
) -> DatasetDict:
    """A local JSON/JSONL file (.gz allowed) of rows {prompt, chosen, rejected} or {prompt, completion, label}."""
    file = _json_file(path, split)
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
            _add_unpaired_row(data, row, file, i, report)
            continue
        _check_paired_row(row, file, i)
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
IMAGE_COLUMNS = ("images", "image")  # TRL's list of images; RLAIF-V's one image (read by vision/, refused elsewhere)
HF_FORMATS = ["auto", "standard", "conversational", "implicit", "ranked", "hh"]  # plugins add theirs (vision/: vision)
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
        data = to_data(rows, report, source, format, columns, max_pairs_per_prompt, roles, ranked_order, cast, path)
        return apply_holdout(data, split, holdout_fraction, report) if carve else data

    loader.__name__, loader.__qualname__, loader.__doc__ = to_data.__name__, to_data.__qualname__, to_data.__doc__
    return loader


# a plugin's readers of other row formats, tried in turn before TRL's (vision/formats.py: rows with images):
# read(rows, report, source, path, format, columns, max_pairs_per_prompt, roles, ranked_order, cast) -> DatasetDict, or
# None when the rows are not its format (``path``: data.hf.path, for files the rows name)
HF_ROW_READERS: list[Callable] = []


@register_dataset("hf", truncation_mode="keep_end")
@_hf_loader
def get_hf(rows, report, source, format, columns, max_pairs_per_prompt, roles, ranked_order, cast, path) -> DatasetDict:
    """Any preference data the ``datasets`` library reads, in TRL's formats or mapped to them (docs/configuration.md)."""
    options = (format, columns, max_pairs_per_prompt, roles, ranked_order, cast)
    for read in HF_ROW_READERS:
        data = read(rows, report, source, path, *options)
        if data is not None:
            return data
    refuse_image_rows(rows, source)  # rows no reader took (vision/ is imported by train.py only)
    return hf_rows_to_data(rows, report, source, *options)


def refuse_image_rows(rows: list[dict], source: str) -> None:
    """DataError when ``rows`` carry images (an ``images`` or ``image`` column), which text rows would drop unread."""
    image = next((c for c in IMAGE_COLUMNS if rows and c in rows[0] and any(row.get(c) for row in rows)), None)
    if image is not None:
        raise DataError(
            f"{source} has images (its column {image!r}), which this command does not read: image preference rows train "
            "with python train.py on an image-text-to-text model (docs/vision.md), and are not sampled from."
        )
