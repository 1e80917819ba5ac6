"""Several nodes, one run: every rank runs the same code and config, and every node sees the same ``output_root``."""

from __future__ import annotations

import contextlib
import os
import socket

from omegaconf import DictConfig

import utils
from runs.config_text import digest, flat_config, override_text

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # runs/ -> the repository root


def code_files(repo: str = REPO_DIR) -> dict[str, str]:
    """``{path relative to repo: sha256}`` of the checkout's code (the top-level ``.py`` files and its packages'
    modules) and ``config/**/*.yaml``."""
    import glob
    import hashlib

    packages = [os.path.dirname(p) for p in glob.glob(os.path.join(repo, "*", "__init__.py"))]
    paths = glob.glob(os.path.join(repo, "*.py")) + glob.glob(os.path.join(repo, "config", "**", "*.yaml"), recursive=True)
    paths += [p for package in packages for p in glob.glob(os.path.join(package, "**", "*.py"), recursive=True)]
    files = {}
    for path in sorted(paths):
        with open(path, "rb") as f:
            files[os.path.relpath(path, repo).replace(os.sep, "/")] = hashlib.sha256(f.read()).hexdigest()
    return files


CONFIG_CHECK_SKIPS = ("output_root",)
"""Keys left out of the config check across ranks: output_root is checked by what it must do
(:func:`check_shared_output_root`), since two nodes may mount one file system at two paths."""


def run_identity(config: DictConfig, host: str | None = None, repo: str = REPO_DIR) -> dict:
    """What every rank must agree on, with the host for messages: ``{"host", "config" (flat,
    without :data:`CONFIG_CHECK_SKIPS`), "config_hash", "code" (:func:`code_files`), "code_hash"}``."""
    flat = {k: v for k, v in flat_config(config).items() if k not in CONFIG_CHECK_SKIPS}
    code = code_files(repo)
    return {
        "host": host or socket.gethostname(),
        "config": flat,
        "config_hash": digest(flat),
        "code": code,
        "code_hash": digest(code),
    }


_UNSET = object()


def identity_mismatch(identities: list[dict], auto_resume: bool = False) -> str | None:
    """One sentence on how the first rank whose :func:`run_identity` (``identities``, in rank order) differs from rank 0's
    differs (code first, then config), else None; ``auto_resume``: ``resume=auto`` was given, so ranks found ``resume``."""
    base = identities[0]
    h0 = base["host"]
    for rank, other in enumerate(identities[1:], start=1):
        who = f"Rank {rank} (host {other['host']})"
        if other["code_hash"] != base["code_hash"]:
            names = list(base["code"]) + [p for p in other["code"] if p not in base["code"]]
            path = next((p for p in names if base["code"].get(p) != other["code"].get(p)), "a file")
            return f"{who} runs other code than rank 0 (host {h0}): {path} differs; give every node the same checkout."
        if other["config_hash"] == base["config_hash"]:
            continue
        mine, theirs = base["config"], other["config"]
        keys = list(mine) + [k for k in theirs if k not in mine]
        key = next((k for k in keys if mine.get(k, _UNSET) != theirs.get(k, _UNSET)), None)
        if key is None:
            return f"{who} was started with another config than rank 0 (host {h0}); start every node with the same command."
        if key == "resume" and auto_resume:
            return (
                f"resume=auto found resume={override_text(theirs.get(key))} on rank {rank} (host {other['host']}) but "
                f"resume={override_text(mine.get(key))} on rank 0 (host {h0}); every node must see the same output_root."
            )
        said = [f"with {key}={override_text(values[key])}" if key in values else f"without {key}" for values in (theirs, mine)]
        return f"{who} was started {said[0]}, rank 0 (host {h0}) {said[1]}; start every node with the same command."
    return None


def check_same_run(config: DictConfig, auto_resume: bool = False) -> None:
    """Raise ConfigError on every rank if any rank's :func:`run_identity` differs from rank 0's (a collective)."""
    problem = identity_mismatch(utils.all_gather_object(run_identity(config)), auto_resume)
    if problem is not None:
        raise utils.ConfigError(problem)


SHARED_MARKER = ".shared-"
"""The prefix of the file :func:`check_shared_output_root` writes into ``output_root`` (then removes)."""


def _sees(path: str, wait_s: float) -> bool:
    """Whether ``path`` exists, asking again for up to ``wait_s`` seconds (NFS may show a new file late)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(OSError):
            if os.path.exists(path) or os.path.basename(path) in os.listdir(os.path.dirname(path) or "."):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def check_shared_output_root(output_root: str, rank: int, wait_s: float = 5.0) -> None:
    """Raise ConfigError on every rank unless all see the file rank 0 writes in ``output_root`` within ``wait_s`` s
    (a collective)."""
    import uuid

    host = socket.gethostname()
    name = failure = None
    if rank == 0:
        name = f"{SHARED_MARKER}{uuid.uuid4().hex}"
        try:
            os.makedirs(output_root, exist_ok=True)
            utils.write_atomic(os.path.join(output_root, name), f"written by rank 0 on {host}\n")
        except OSError as e:
            failure = f"output_root={output_root} cannot be written on rank 0 (host {host}): {utils.failure_reason(e)}; give a folder it can write."
    name, failure = utils.broadcast_object((name, failure))
    if failure is not None:
        raise utils.ConfigError(failure)
    try:
        seen = utils.all_gather_object((_sees(os.path.join(output_root, name), wait_s), host, output_root))
    finally:
        if rank == 0:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(output_root, name))
    blind = next((r for r, (ok, _, _) in enumerate(seen) if not ok), None)
    if blind is not None:
        _, where, theirs = seen[blind]
        root = seen[0][2]
        there = f", looking in output_root={theirs}" if theirs != root else ""
        raise utils.ConfigError(
            f"output_root={root} is not shared: rank {blind} (host {where}{there}) does not see the file "
            f"rank 0 (host {seen[0][1]}) wrote there; put output_root on a file system every node mounts at the same path."
        )
