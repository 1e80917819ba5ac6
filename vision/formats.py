"""Image preference rows through ``datasets=[hf]``: TRL's vision format, RLAIF-V's layout and LLaMA-Factory's, read into
image examples (:mod:`vision`), every image checked before training.

A file is read here when it has an image column (``images``, or RLAIF-V's ``image``) or with ``data.hf.format=vision``.
Where its images go in the prompt: the ``{"type": "image"}`` parts of its messages (TRL), else each ``<image>`` in its
text (LLaMA-Factory), else, but for LLaMA-Factory's layouts (which need the marks), the start of the first user turn (as
TRL places the images of text prompts, and as RLAIF-V's question is asked of its image)."""

from __future__ import annotations

import collections
import hashlib
import json
import os

from data.conversations import (
    Messages,
    check_messages,
    check_roles_mapping,
    check_sharegpt_roles,
)
from data.formats import HF_FORMATS, HF_ROW_READERS, IMAGE_COLUMNS, _cap_pairs, _hf_context_prompt, _with_system, note_cast
from data.readers import _json_kind
from data.report import DatasetDict, add_fields, add_pair
from utils import DataError
from vision.images import check_image, count_image_parts

IMAGE_TOKEN = "<image>"  # LLaMA-Factory's place of an image in the text
# the prompt's column, the first found: TRL's, RLAIF-V's, LLaMA-Factory's ShareGPT, OpenAI and alpaca layouts
PROMPT_COLUMNS = ("prompt", "question", "conversations", "messages", "instruction")
MARKS_NEEDED = ("conversations", "messages", "instruction")  # LLaMA-Factory's: its images need <image> marks
VISION_COLUMNS = ("prompt", "chosen", "rejected", "images", "system", "input", "history")  # data.hf.columns' keys here


def _columns(found: list[str], given: dict, source: str) -> dict[str, str]:
    """Each key of :data:`VISION_COLUMNS` that the rows have -> its column: ``given``, else the layouts' names."""
    unknown = sorted(set(given) - set(VISION_COLUMNS))
    if unknown:
        raise DataError(
            f"data.hf.columns has key(s) {unknown} that image rows do not use; its keys here are {', '.join(VISION_COLUMNS)}."
        )
    missing = [(key, column) for key, column in given.items() if column not in found]
    if missing:
        key, column = missing[0]
        raise DataError(f"data.hf.columns maps {key} to {column!r}, which is not a column of {source} (its columns: {found}).")
    columns = dict(given)
    if "images" not in columns:
        present = [c for c in IMAGE_COLUMNS if c in found]
        if len(present) > 1:
            raise DataError(
                f"{source} has both an 'images' and an 'image' column, so which holds the images is unclear; name it with "
                "data.hf.columns={images: <column>}."
            )
        columns["images"] = present[0] if present else None
    if "prompt" not in columns:
        columns["prompt"] = next((c for c in PROMPT_COLUMNS if c in found), None)
        if columns["prompt"] == "instruction" and "input" in found:
            columns.setdefault("input", "input")  # LLaMA-Factory's alpaca rule: instruction, a newline, input
    for key in ("chosen", "rejected", "system"):
        columns.setdefault(key, key)
    for key in ("prompt", "chosen", "rejected", "images"):
        if columns[key] not in found:
            names = [columns[key]] if columns[key] else PROMPT_COLUMNS if key == "prompt" else IMAGE_COLUMNS
            what = f"no column {' or '.join(map(repr, names))}"
            raise DataError(
                f"{source} is read as image preference rows but has {what} (its columns: {found}); image rows need a "
                f"prompt (one of {', '.join(PROMPT_COLUMNS)}), chosen, rejected and images (or image), or "
                "data.hf.columns={prompt: ..., chosen: ..., rejected: ..., images: ...}."
            )
    return columns


def _part(part, where: str, column: str, k: int) -> dict:
    """One content part as ``{"type": "text", "text": ...}`` or ``{"type": "image"}`` (Arrow's None keys dropped)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    inline = [key for key in ("image", "url", "path", "image_url") if isinstance(part, dict) and part.get(key) is not None]
    if kind == "image" and not inline:
        return {"type": "image"}
    if inline:
        raise DataError(
            f"{where}: a content part of message {k} of {column!r} holds its image inline ({inline[0]!r}); give the part as "
            '{"type": "image"} and the image in the images column.'
        )
    shown = json.dumps(part, ensure_ascii=False, default=str)[:80]
    raise DataError(
        f"{where}: a content part of message {k} of {column!r} is {shown}, not "
        '{"type": "text", "text": ...} or {"type": "image"}; give text and image parts only.'
    )


def _messages(value, where: str, column: str, roles: dict[str, str]) -> Messages:
    """``value`` as standard ``{role, content}`` messages whose content is a str or a list of parts (ShareGPT's keys read)."""
    return check_messages(value, where, column, roles, part=lambda p, k: _part(p, where, column, k))


def _answer(value, where: str, column: str, roles: dict[str, str]) -> str:
    """The assistant's answer text of a ``chosen`` or ``rejected`` value: a str, or one assistant message."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (list, dict)):
        raise DataError(
            f"{where}: column {column!r} is {_json_kind(value)}, not an answer; give a string or one assistant message."
        )
    messages = _messages(value, where, column, roles)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise DataError(
            f"{where}: column {column!r} holds {len(messages)} message(s) starting with the {messages[0]['role']}'s; image "
            "rows give one answer there: a string or one assistant message (the prompt goes in its own column)."
        )
    content = messages[0]["content"]
    if isinstance(content, str):
        return content
    if any(part["type"] == "image" for part in content):
        raise DataError(f"{where}: the answer in {column!r} holds an image part; answers are text, images go in the prompt.")
    return "".join(part["text"] for part in content)


def _split_tokens(content) -> list[dict]:
    """``content`` (a str or parts) as parts, each ``<image>`` in its text an image part (empty text left out)."""
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    out = []
    for part in parts:
        if part["type"] != "text":
            out.append(part)
            continue
        pieces = part["text"].split(IMAGE_TOKEN)
        for k, piece in enumerate(pieces):
            out += [{"type": "image"}] * (k > 0) + [{"type": "text", "text": piece}] * bool(piece)
    return out


def _text_of(message: dict) -> list[str]:
    content = message["content"]
    return [content] if isinstance(content, str) else [p["text"] for p in content if p["type"] == "text"]


def place_images(prompt: Messages, n: int, where: str, image_column: str, text_first: bool) -> Messages:
    """``prompt`` with an image part for each of its ``n`` images: its parts, else its ``<image>`` tokens, else (``text_first``)
    all at the start of the first user turn; a DataError when the count of places differs from ``n``."""
    parts = count_image_parts(prompt)
    tokens = sum(text.count(IMAGE_TOKEN) for m in prompt for text in _text_of(m))
    if parts and tokens:
        raise DataError(
            f'{where}: the prompt marks images both with {{"type": "image"}} parts ({parts}) and with {IMAGE_TOKEN} in its '
            f"text ({tokens}); mark them one way only."
        )
    if tokens:
        prompt = [{**m, "content": _split_tokens(m["content"])} if IMAGE_TOKEN in "".join(_text_of(m)) else m for m in prompt]
    elif not parts and n and text_first:
        first = next((k for k, m in enumerate(prompt) if m["role"] == "user"), None)
        if first is None:
            raise DataError(f"{where}: the prompt has no user message to hold its {n} image(s); add one.")
        content = prompt[first]["content"]
        text = [{"type": "text", "text": content}] * bool(content) if isinstance(content, str) else content
        prompt = [*prompt[:first], {"role": "user", "content": [{"type": "image"}] * n + text}, *prompt[first + 1 :]]
    places = parts + tokens if (parts or tokens or not text_first) else n
    if places != n:
        marks = '{"type": "image"} part(s)' if parts else f"{IMAGE_TOKEN} mark(s)"
        raise DataError(
            f"{where}: the prompt has {places} {marks} but {image_column!r} gives {n} image(s); give one image per "
            f"{'part' if parts else IMAGE_TOKEN}, in order."
        )
    return prompt


def _entries(value, where: str, column: str, folder: str | None) -> tuple[list, list[str]]:
    """(the images of one row, each resolved: an absolute path, bytes or a PIL image; their ids for the row's key)."""
    from PIL import Image

    value = [] if value is None else value if isinstance(value, list) else [value]  # RLAIF-V's image: one, not a list
    images, ids = [], []
    for k, entry in enumerate(value, 1):
        if isinstance(entry, dict):  # datasets' Image feature: its bytes when embedded, else its path
            entry = entry.get("bytes") or entry.get("path")
        if isinstance(entry, (bytes, bytearray)):
            images.append(bytes(entry))
            ids.append("sha1:" + hashlib.sha1(entry).hexdigest())
        elif isinstance(entry, Image.Image):
            images.append(entry)
            ids.append("sha1:" + hashlib.sha1(entry.tobytes()).hexdigest())
        elif isinstance(entry, str) and entry.startswith(("http://", "https://")):
            raise DataError(f"{where}: image {k} of {column!r} is the URL {entry}; download the images and give their paths.")
        elif isinstance(entry, str) and entry.strip():
            if not os.path.isabs(entry) and folder is None:
                raise DataError(
                    f"{where}: image {k} of {column!r} is the relative path {entry!r}, but data.hf.path is not a local file "
                    "or folder to read it from; give absolute paths or embed the images."
                )
            images.append(entry if os.path.isabs(entry) else os.path.join(folder, entry))  # ../ kept as written
            ids.append(entry)  # as written: the held-out slice is the same wherever the data lies
        else:
            raise DataError(
                f"{where}: image {k} of {column!r} is {'an empty path' if isinstance(entry, str) else _json_kind(entry)}, "
                "not a path, bytes or an image; fix the row or drop it."
            )
    return images, ids


def _folder(path, source: str) -> str | None:
    """The folder relative image paths are read from: the data file's (its split's), or data.hf.path's when a folder."""
    if os.path.isfile(source):
        return os.path.dirname(os.path.abspath(source))
    return os.path.abspath(path) if isinstance(path, str) and os.path.isdir(path) else None


def read_vision_rows(
    rows: list[dict],
    report: collections.Counter,
    source: str,
    path=None,
    format: str = "auto",
    columns: dict | None = None,
    max_pairs_per_prompt: int | None = None,
    roles: dict | None = None,
    ranked_order: str | None = None,
    cast: dict[str, str] | None = None,
) -> DatasetDict | None:
    """Image preference rows to a DatasetDict of image entries (``prompt_messages``, ``images``); None for text rows.

    Args:
        rows: the rows ``datasets`` read from ``source``; ``path``: data.hf.path (relative images are read from its folder).
        format, columns, max_pairs_per_prompt, roles, ranked_order: the ``data.hf.*`` options; cast: columns read as text.
    """
    if format not in HF_FORMATS:  # a typo is unknown, not a text format that would drop the images
        raise DataError(f"data.hf.format={format} is unknown; use one of {', '.join(HF_FORMATS)}.")
    given = dict(columns) if isinstance(columns, dict) else {}
    found = list(rows[0]) if rows else []
    claimed = format == "vision" or (format == "auto" and ("images" in given or any(c in found for c in IMAGE_COLUMNS)))
    if not claimed and format != "auto" and any(row.get(c) for c in IMAGE_COLUMNS if c in found for row in rows):
        raise DataError(  # the images would be dropped without a word
            f"{source} has images (its column {next(c for c in IMAGE_COLUMNS if c in found)!r}) but data.hf.format={format} "
            "reads text only; set data.hf.format=vision (or auto) to train on the images with them."
        )
    if not claimed or not rows:
        return None
    if ranked_order is not None:
        raise DataError(
            f"data.hf.ranked_order={ranked_order} orders ranked rows' responses, but {source} is read as image rows (one "
            "chosen and one rejected answer each); drop data.hf.ranked_order."
        )
    columns, roles = _columns(found, given, source), check_roles_mapping(roles)
    p, c, r, im = (columns[k] for k in ("prompt", "chosen", "rejected", "images"))
    context = {k: v for k, v in columns.items() if k != "system"}  # the system column heads the messages below
    folder, data, gaps, checked = _folder(path, source), {}, {}, set()
    for i, row in enumerate(rows, 1):
        where = f"{source}, row {i}"
        if p in ("conversations", "messages"):  # ShareGPT's roles: one sentence naming every unmapped one
            check_sharegpt_roles(row, columns, where, roles)
        raw = _hf_context_prompt(row, context, where)
        if not isinstance(raw, (str, list)):
            raise DataError(f"{where}: column {p!r} is missing or not a string or a list of messages.")
        prompt = _messages([{"role": "user", "content": raw}] if isinstance(raw, str) else raw, where, p, roles)
        prompt = _with_system(prompt, row.get(columns["system"]), where, columns["system"])
        chosen, rejected = _answer(row.get(c), where, c, roles), _answer(row.get(r), where, r, roles)
        images, ids = _entries(row.get(im), where, im, folder)
        prompt = place_images(prompt, len(images), where, im, p not in MARKS_NEEDED)
        for entry, image_id in zip(images, ids):
            if image_id not in checked:  # an image asked about in many rows is read once
                check_image(entry, where)
                checked.add(image_id)
        key = json.dumps({"messages": prompt, "images": ids}, ensure_ascii=False)  # one question on two images: two prompts
        note_cast(report, cast, row, key)
        if add_pair(data, key, chosen, rejected, report, where):
            data[key].update(prompt_messages=prompt, images=images)
            gaps.setdefault(key, []).append(0.0)
            add_fields(data[key], row, [col for col in columns.values() if col])
    if max_pairs_per_prompt is not None:
        _cap_pairs(data, gaps, max_pairs_per_prompt, report)
    return data


HF_ROW_READERS.append(read_vision_rows)
HF_FORMATS.append("vision")
