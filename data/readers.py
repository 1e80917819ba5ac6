"""Reading rows: local JSON / JSON-lines files (.gz allowed) with one DataError naming a bad file, the Hugging Face
hub, and HTML text."""

from __future__ import annotations

import gzip
import html
import html.parser
import json
import os
import zlib

from data.report import _note_file
from utils import DataError


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
