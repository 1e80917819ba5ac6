"""Leaf helpers (no project imports): errors, threads and malloc, seeds, dtypes, atomic writes, disk space, objects across ranks."""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil

import numpy as np
import torch


class ConfigError(ValueError):
    """A config value is wrong; the message is one sentence naming the key and the fix."""


class DataError(ValueError):
    """A dataset option or a data file is wrong; the message says what and how to fix it."""


def set_threads(n: int | None) -> None:
    """Use ``n`` CPU threads for torch ops (None: torch's default)."""
    if n:
        torch.set_num_threads(n)


MALLOC_MMAP_THRESHOLD_MAX_MIB = 32  # glibc's largest mmap threshold on 64-bit Linux (HEAP_MAX_SIZE / 2)
MALLOC_STATE = {"threshold_mib": None, "noted": False}  # what set_malloc_mmap_threshold did in this process


def validate_malloc_mmap_threshold(value) -> None:
    """Check ``malloc_mmap_threshold_mib``: null, or a number of MiB in (0, 32]."""
    ok = value is None or (not isinstance(value, bool) and isinstance(value, (int, float)))
    if not ok or (value is not None and not 0 < value <= MALLOC_MMAP_THRESHOLD_MAX_MIB):
        raise ConfigError(
            f"malloc_mmap_threshold_mib must be null (glibc's default) or a number of MiB in (0, "
            f"{MALLOC_MMAP_THRESHOLD_MAX_MIB}], got {value!r}; e.g. malloc_mmap_threshold_mib=1."
        )


def preloaded_malloc() -> str | None:
    """The first ``*malloc*`` library of ``LD_PRELOAD`` or ``/proc/self/maps``, else None."""
    listed = [lib for lib in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if "malloc" in os.path.basename(lib)]
    if listed:
        return listed[0]
    try:
        with open("/proc/self/maps") as f:
            names = {os.path.basename(line.split()[-1]) for line in f if "/" in line}
    except OSError:
        return None
    return min((n for n in names if "malloc" in n), default=None)


def glibc():
    """This process's C library through ctypes if it is glibc, else None."""
    import ctypes

    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def set_malloc_mmap_threshold(mib: float | None) -> bool:
    """Serve allocations of ``mib`` MiB or more from their own maps, freed to the OS (mallopt(3)); False if unset."""
    validate_malloc_mmap_threshold(mib)
    if mib is None:
        return False
    preloaded, libc = preloaded_malloc(), glibc()
    if preloaded or libc is None:
        if not MALLOC_STATE["noted"]:
            print(
                f"malloc_mmap_threshold_mib is glibc's; {preloaded} is preloaded and allocates instead, so it is not set."
                if preloaded
                else "malloc_mmap_threshold_mib applies to glibc's malloc (Linux); this C library's allocator is left as it is."
            )
            MALLOC_STATE["noted"] = True
        return False
    m_mmap_threshold = -3  # malloc.h
    if not libc.mallopt(m_mmap_threshold, int(mib * 2**20)):
        raise ConfigError(f"glibc's mallopt refused malloc_mmap_threshold_mib={mib}; use a value in (0, 32].")
    MALLOC_STATE["threshold_mib"] = mib
    return True


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_dtype(name: str | None) -> torch.dtype | None:
    """torch dtype from a config string ("float32", "bfloat16", "float16"); None stays None."""
    return None if name is None else getattr(torch, name)


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message, stripped ("" when it has none): the one place that cuts a message."""
    return (str(error).strip().splitlines() or [""])[0].strip()


def write_atomic(path: str, text: str, then: str = "try again") -> None:
    """Write ``text`` to ``path`` atomically (a temporary file, fsynced, then ``os.replace``); a full disk says ``then``."""
    with replacing(path, then) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def replacing(path: str, then: str = "try again", tmp: str | None = None):
    """Replace ``path`` atomically with what the body writes into the yielded temporary file, removed on failure (a
    symbolic link at ``path`` is replaced, never written through)."""
    tmp = tmp or f"{path}.tmp-{os.getpid()}"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)  # a file or link left at the temporary name: the body writes a new file, not through it
        with saying_disk_full(path, "write", then):
            yield tmp
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class DiskFullError(OSError):
    """A file could not be written because its disk is full; the message names the file, the space left and the fix."""


NO_SPACE = "no space left on the device"  # how every sentence names a full disk
LOW_FREE_MIB = 16  # below this many MiB free, torch.save's short-write RuntimeError (no errno) is a full disk


def free_mib(path: str) -> float | None:
    """MiB free to this user on the disk holding ``path`` (or its nearest existing parent); None if unknown."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return None


def no_space(path: str) -> str:
    """``no space left on the device (N MiB free)`` for the disk holding ``path``."""
    free = free_mib(path)
    return NO_SPACE if free is None else f"{NO_SPACE} ({free:.0f} MiB free)"


def disk_full(error: BaseException, path: str) -> bool:
    """Whether ``error`` or its cause chain is a full disk: ENOSPC, or a short write with under LOW_FREE_MIB free."""
    short_write, seen = False, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if getattr(error, "errno", None) == errno.ENOSPC or os.strerror(errno.ENOSPC) in str(error):  # DCP, safetensors wrap it
            return True
        short_write |= isinstance(error, RuntimeError) and any(t in str(error) for t in ("unexpected pos", "file write failed"))
        error = error.__cause__ or error.__context__
    return short_write and (free_mib(path) or 0) < LOW_FREE_MIB


@contextlib.contextmanager
def saying_disk_full(path: str, doing: str = "write", then: str = "try again"):
    """Turn a full disk while the body writes ``path`` into one DiskFullError sentence ending in ``then``."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        if not disk_full(e, path):
            raise
        raise DiskFullError(f"Could not {doing} {path}: {no_space(path)}; free space on that disk and {then}.") from e


def failure_reason(error: BaseException) -> str:
    """``error`` as a short reason for a sentence: its type and the first line of its message."""
    line = first_line(error).rstrip(".")
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def broadcast_object(obj):
    """``obj`` as rank 0 has it, on every rank."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable) of ``group`` (default all), in rank order, on every rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
