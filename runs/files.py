"""Files a run appends to (logs, metrics), opened so that a symbolic link in their place is refused, never written through."""

from __future__ import annotations

import os

from utils import ConfigError


def link_refusal(path: str) -> str:
    """The sentence refusing to write into ``path``, a symbolic link: files are never written through one."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return (
        f"{path} is a symbolic link{target}, and files are never written through one: remove it, or put a copy of the "
        "file it points at in its place, then try again."
    )


def open_append(path: str, encoding: str = "utf-8"):
    """``open(path, "a")`` that refuses (ConfigError, :func:`link_refusal`) a symbolic link at ``path`` instead of
    appending to the file it points at."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    if not hasattr(os, "O_NOFOLLOW") and os.path.islink(path):  # no O_NOFOLLOW (Windows): asked first
        raise ConfigError(link_refusal(path))
    try:
        fd = os.open(path, flags, 0o666)  # open()'s mode, less the umask
    except OSError:
        if os.path.islink(path):  # O_NOFOLLOW's ELOOP
            raise ConfigError(link_refusal(path)) from None
        raise
    return os.fdopen(fd, "a", encoding=encoding)
