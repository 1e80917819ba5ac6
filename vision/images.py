"""The images of an example: what an ``images`` entry may be, and one function that opens it."""

from __future__ import annotations

import io
import os

from utils import DataError

# An ``images`` entry: a path to an image file (str or os.PathLike, absolute once loaded), its encoded bytes, a
# ``datasets.Image`` dict ({"bytes": ..., "path": ...}) or a PIL image. Entries stay unopened until tokenization.


def count_image_parts(messages: list[dict]) -> int:
    """The number of ``{"type": "image"}`` parts in ``messages``' contents (a str content holds none)."""
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


def _source(entry, where: str) -> tuple[object, str]:
    """(what PIL opens, how a message names it) of one ``images`` entry that is not a PIL image; DataError when missing."""
    if isinstance(entry, dict):  # datasets' Image feature: bytes when embedded, else a path
        entry = entry.get("bytes") or entry.get("path")
    if isinstance(entry, (bytes, bytearray)):
        return io.BytesIO(entry), "its embedded image"
    if isinstance(entry, (str, os.PathLike)):
        if not os.path.isfile(entry):
            raise DataError(f"{where}: the image {os.fspath(entry)} does not exist; fix the path or drop the row.")
        return entry, f"the image {os.fspath(entry)}"
    raise DataError(f"{where}: an images entry is {type(entry).__name__}, not a path, bytes or an image.")


def _unreadable(where: str, what: str, e: Exception) -> DataError:
    return DataError(f"{where}: {what} cannot be read as an image ({type(e).__name__}); replace it or drop the row.")


def open_image(entry, where: str):
    """The RGB PIL image of one ``images`` entry; DataError naming ``where`` (the row) when it is missing or unreadable.

    Args:
        entry: a path, encoded bytes, a ``datasets.Image`` dict or a PIL image.
        where: the row, for the message (for example ``"data.jsonl row 12"``).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(entry, Image.Image):
        return entry.convert("RGB")
    source, what = _source(entry, where)
    try:
        with Image.open(source) as image:
            return image.convert("RGB")  # reads the pixels now, while the file is open
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
        raise _unreadable(where, what, e) from e


def check_image(entry, where: str) -> None:
    """Check that one ``images`` entry is an image PIL can read, without decoding its pixels (the loaders' check).

    Reads the header and, for PNG, checks every chunk's checksum (a file cut short fails); a JPEG cut short after its
    header passes here and fails in :func:`open_image` at tokenization, with the same sentence.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(entry, Image.Image):
        return
    source, what = _source(entry, where)
    try:
        with Image.open(source) as image:
            image.verify()  # PNG: chunk checksums; other formats: the header only
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as e:
        raise _unreadable(where, what, e) from e
