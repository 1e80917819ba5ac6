"""bench_dpo.py's parent-side reporting: means, the code measured, package versions."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mean(xs):
    return sum(xs) / len(xs)


def _code_hash() -> str:
    """A hash of the project's code and config as they are on disk now."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted([*REPO.glob("*.py"), *(REPO / "config").rglob("*.yaml")]):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _code_state() -> str:
    """The commit measured, and whether the project's files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "*.py", "config"], cwd=REPO, capture_output=True, text=True
        ).stdout.split()
        changed = [d for d in dirty[1::2] if not d.startswith("bench/")]
        return f"commit {head}" + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")
    except OSError:
        return "commit unknown"


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)
