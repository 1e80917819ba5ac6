"""Run folders, the run lock, resume, atomic checkpoint save and publish, and checkpoint integrity."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import re
import shutil
import socket
import tempfile

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

import utils
from runs.files import link_refusal


def make_run_dir(root: str, exp_name: str) -> str:
    """Create and return ``<root>/<exp_name>_<timestamp>`` (unique)."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")
    path = os.path.join(root, f"{exp_name}_{stamp}")
    os.makedirs(path, exist_ok=False)
    return path


RUN_DIR_STAMP = r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d{6}"  # make_run_dir's timestamp; sorts as made

FINISHED = "FINISHED"  # written into a run folder when training ends normally, holding the examples trained on


def resume_hint(run_dir: str) -> str:
    """What to do after a fault in run folder ``run_dir``: continue from its checkpoint, or start again."""
    checkpoint = checkpoint_to_resume(run_dir)[0]
    if checkpoint is None:
        return "start the run again"
    return f"continue with resume={run_dir} (from {os.path.basename(os.path.realpath(checkpoint))})"


RUN_COMMAND_LINE = "# Made by: "  # how config.yaml begins when the command that made the run is known


def read_command(run_dir: str) -> str | None:
    """The command line recorded at the top of ``<run_dir>/config.yaml`` (:data:`RUN_COMMAND_LINE`), or None."""
    try:
        with open(os.path.join(run_dir, "config.yaml")) as f:
            first = f.readline().rstrip("\n")
    except OSError:
        return None
    return first[len(RUN_COMMAND_LINE) :] if first.startswith(RUN_COMMAND_LINE) else None


def save_run_config(config: DictConfig, path: str, command: str | None = None, then: str = "try again") -> None:
    """Save ``config`` as a run's config.yaml at ``path``, its first line ``# Made by: <command>`` when known."""
    first = "" if command is None else RUN_COMMAND_LINE + " ".join(command.split("\n")) + "\n"
    utils.write_atomic(path, first + OmegaConf.to_yaml(config), then)  # a link at path is replaced, not written through


CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "config")  # runs/ -> the repository root


@functools.cache
def _defaults(config_name: str, groups: tuple[tuple[str, str], ...]) -> DictConfig:
    """Today's ``config_name`` as Hydra composes it with the config ``groups`` options (``(("loss", "ipo"),)``; the rest
    default) and model=blank_model, not struct."""
    overrides = [f"{group}={option}" for group, option in groups]
    if config_name == "config":
        overrides.append("model=blank_model")  # no preset's top-level keys (tiny's lr...): config.yaml's own
    if GlobalHydra.instance().is_initialized():  # inside train.py's or evaluate.py's hydra.main: config/ is its path
        base = compose(config_name=config_name, overrides=overrides)
    else:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            base = compose(config_name=config_name, overrides=overrides)
    OmegaConf.set_struct(base, False)  # a saved key that no longer exists is kept
    return base


def load_run_config(path: str) -> DictConfig:
    """The config.yaml at ``path`` (train.py's, or evaluate.py's: it has ``policy``) merged over today's defaults, its
    values winning, so that a config saved before a key existed has that key's default."""
    saved = OmegaConf.load(path)
    if not isinstance(saved, DictConfig):
        return saved
    groups = {}  # the group options its values were composed from: the loss's, a reference update's (bema)
    for group, key in (("loss", "loss.name"), ("reference_update", "reference_update.mode")):
        option = OmegaConf.select(saved, key, default=None)
        if isinstance(option, str) and os.path.isfile(os.path.join(CONFIG_DIR, group, f"{option}.yaml")):
            groups[group] = option
    return OmegaConf.merge(_defaults("evaluate" if "policy" in saved else "config", tuple(groups.items())), saved)


def local_path(path) -> str:
    """``path`` with links resolved (a run's ``LATEST`` becomes its ``step-N``) if it exists here, else as it is (a hub id)."""
    expanded = os.path.expanduser(str(path))
    return os.path.realpath(expanded) if os.path.exists(expanded) else str(path)


def new_run_dir(
    root: str, exp_name: str, config: DictConfig, command: str | None = None, pin: dict | None = None
) -> tuple[str, RunLock]:
    """A new, locked run folder with ``config`` saved as config.yaml and ``pin`` (:func:`archive_pin`) as
    :data:`ARCHIVE_PIN` (removed again if that fails), and its lock."""
    run_dir, lock = make_run_dir(root, exp_name), None
    try:
        lock = lock_run_dir(run_dir)
        path = os.path.join(run_dir, "config.yaml")
        save_run_config(config, path, command, then="start the run again")
        if pin is not None:
            write_archive_pin(run_dir, pin)
        return run_dir, lock
    except BaseException:
        for name in (RUN_LOCK, "config.yaml", ARCHIVE_PIN):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(run_dir, name))
        if lock is not None:
            lock.release()
        with contextlib.suppress(OSError):  # anything else in it (not ours) keeps it
            os.rmdir(run_dir)
        raise


def mark_finished(run_dir: str, examples: int) -> None:
    """Write ``<run_dir>/FINISHED`` (:data:`FINISHED`), holding ``examples``, atomically."""
    utils.write_atomic(os.path.join(run_dir, FINISHED), f"{examples}\n")


def resumable_runs(root: str, exp_name: str, finished: bool = False) -> list[str]:
    """Run folders ``<root>/<exp_name>_<timestamp>`` that ``resume=auto`` may continue (a ``LATEST`` checkpoint, a
    config.yaml, no :data:`FINISHED`; with ``finished``, finished ones too), newest first."""
    import re

    if not os.path.isdir(root):
        return []
    pattern = re.compile(re.escape(exp_name) + "_(" + RUN_DIR_STAMP + ")")
    found = []
    for name in os.listdir(root):
        match = pattern.fullmatch(name)
        path = os.path.join(root, name)
        if match is None or not os.path.isdir(path):
            continue
        if (
            os.path.exists(os.path.join(path, "config.yaml"))
            and checkpoint_to_resume(path)[0] is not None
            and (finished or not os.path.exists(os.path.join(path, FINISHED)))
        ):
            found.append((match.group(1), path))
    return [path for _, path in sorted(found, reverse=True)]  # by the name's timestamp: every node orders them alike


def checkpoint_to_resume(run_dir: str) -> tuple[str | None, str | None]:
    """The checkpoint ``resume=<run_dir>`` continues from (``LATEST``, else the newest intact ``step-N`` with a
    note saying so), or (None, None)."""
    latest = os.path.join(run_dir, "LATEST")
    if os.path.isdir(latest):
        return latest, None
    name = intact_checkpoint(run_dir)
    if name is None:
        return None, None
    folder = os.path.join(run_dir, name)
    target = os.readlink(latest) if os.path.islink(latest) else None
    why = f"LATEST points at {target}, which is missing" if target else "LATEST is missing"
    return folder, f"{why}; continuing from {name}, the newest checkpoint with its files."


def examples_fingerprint(examples: list[dict]) -> dict:
    """``{"n": count, "sha256": hex digest in order}`` of a split's examples (less ``fields``), checked on resume."""
    import hashlib

    h = hashlib.sha256()
    for example in examples:
        # checkpoints from before fields were kept resume; images by their digest in the example's key (vision/)
        example = {k: v for k, v in example.items() if k != "fields" and not (k == "images" and "key" in example)}
        h.update(json.dumps(example, sort_keys=True, default=str).encode())
        h.update(b"\n")
    return {"n": len(examples), "sha256": h.hexdigest()}  # plain values: trainer_state.pt loads with weights_only


def data_change(saved: dict | None, now: dict, checkpoint_dir: str, auto: bool = False) -> str | None:
    """One sentence when a split's examples differ from those the checkpoint was trained on (``saved``: ``{split:
    examples_fingerprint}``), else None; ``auto``: the run was picked by ``resume=auto``."""
    if not saved:  # a checkpoint without fingerprints: the caller notes it
        return None
    for split, fp in now.items():
        old = saved.get(split)
        if old is None or (old["n"], old["sha256"]) == (fp["n"], fp["sha256"]):
            continue
        same = " (the same count, other contents)" if old["n"] == fp["n"] else ""
        fresh = "start a fresh run under another exp_name, or " if auto else ""
        return (
            f"The {split} split changed since this run's checkpoint: {old['n']} examples then, {fp['n']} now{same}; "
            f"restore that data to resume, or {fresh}start a new run from the checkpoint's weights (the optimizer and "
            f"learning-rate schedule start anew) with model.archive={os.path.join(os.path.realpath(checkpoint_dir), 'policy.pt')}."
        )
    return None


ARCHIVE_PIN = "archive.json"  # in a run folder started from model.archive: the file it resolved to, its size and sha256


def archive_pin(archive) -> dict:
    """``{"archive": model.archive as given, "path": the file it names (links resolved: LATEST -> step-N), "bytes",
    "sha256"}``, what a run started from; resume and evaluate.py check the file against it."""
    path = os.path.realpath(os.path.expanduser(str(archive)))
    return {"archive": str(archive), "path": path, **manifest_entry(path)}


def write_archive_pin(run_dir: str, pin: dict) -> None:
    """Write ``pin`` (:func:`archive_pin`) as ``<run_dir>/archive.json`` (:data:`ARCHIVE_PIN`), atomically."""
    path = os.path.join(run_dir, ARCHIVE_PIN)
    utils.write_atomic(path, json.dumps(pin, indent=1) + "\n", then="start the run again")


def read_archive_pin(run_dir: str) -> dict | None:
    """Run ``run_dir``'s :data:`ARCHIVE_PIN`, or None (a run without model.archive, or made before pins); ConfigError
    if it cannot be read."""
    path = os.path.join(run_dir, ARCHIVE_PIN)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            pin = json.load(f)
        if not isinstance(pin, dict) or not all(isinstance(pin.get(k), str) for k in ("archive", "path", "sha256")):
            raise ValueError("not the archive, path and sha256 it was written with")
    except (OSError, ValueError) as e:
        raise utils.ConfigError(
            f"{path} could not be read ({utils.failure_reason(e)}), so the model.archive this run started from is unknown; "
            "restore that file."
        ) from None
    return pin


def pinned_archive(run_dir: str, archive):
    """The file run ``run_dir`` started from as its ``model.archive`` (:data:`ARCHIVE_PIN`'s path, not a ``LATEST``
    that has moved on since), else (no pin, or that file is gone: :func:`check_archive_pin` says so) ``archive``."""
    pin = read_archive_pin(run_dir) if archive is not None else None
    return pin["path"] if pin is not None and os.path.isfile(pin["path"]) else archive


def check_archive_pin(run_dir: str, fix: str) -> None:
    """Raise ConfigError, ending in ``fix``, when the file run ``run_dir`` pinned as its ``model.archive`` is gone or
    holds other bytes (its sha256) than when the run started."""
    pin = read_archive_pin(run_dir)
    if pin is None:
        return
    path = pin["path"]
    if not os.path.isfile(path):
        what = "is gone"
    elif os.path.getsize(path) != pin.get("bytes") or file_sha256(path) != pin["sha256"]:
        what = "holds other bytes now (another sha256)"
    else:
        return
    step = os.path.basename(os.path.dirname(path))
    raise utils.ConfigError(
        f"{run_dir} started from model.archive={pin['archive']}, which was then {path} ({step}, sha256 "
        f"{pin['sha256'][:12]}, recorded in {ARCHIVE_PIN}), and that file {what}; {fix}."
    )


RUN_LOCK = ".lock"  # the lock file in every run folder (lock_run_dir)

RUN_LOCK_FD_ENV = "DPO_RUN_LOCK_FD"  # set by launch.launch in its children: the descriptor of the run lock it holds


class RunLock:
    """An open, locked ``<run folder>/.lock`` (``fd``, shared with child processes; ``path``); a context manager."""

    def __init__(self, fd: int | None, path: str):
        self.fd = fd
        self.path = path

    def release(self) -> None:
        """Close the descriptor (never ``LOCK_UN``, which would unlock it for the processes sharing it too)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def linked_files(run_dir: str) -> list[str]:
    """The symbolic links in ``run_dir`` and its ``curves/`` where a run writes, as ``name (to target)``: every link
    but ``LATEST`` and ``step-N`` (checkpoints, read and replaced but never written through)."""
    found = []
    for sub in ("", "curves"):
        folder = os.path.join(run_dir, sub)
        if sub and (os.path.islink(folder) or not os.path.isdir(folder)):
            continue  # a curves link is listed with the folder's own entries
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            # LATEST, step-N and a dead writer's temporary (.LATEST.tmp, removed before anything is written there) pass
            if os.path.islink(path) and (sub or not (re.fullmatch(r"LATEST|step-\d+", name) or LEFTOVER_FILE.fullmatch(name))):
                found.append(f"{os.path.join(sub, name)} (to {os.readlink(path)})")
    return found


def check_no_links(run_dir: str) -> None:
    """Raise ConfigError when ``run_dir`` holds a symbolic link where a run writes (:func:`linked_files`)."""
    linked = linked_files(run_dir) if os.path.isdir(run_dir) else []
    if linked:
        links = ", ".join(linked[:3]) + (f" and {len(linked) - 3} more" if len(linked) > 3 else "")
        what = "a symbolic link" if len(linked) == 1 else "symbolic links"
        raise utils.ConfigError(
            f"The folder {run_dir} holds {what} where it writes its own files, {links}, and files are never written "
            "through a link: remove each (or put a copy of the file it points at in its place), then try again."
        )


def lock_run_dir(run_dir: str) -> RunLock:
    """Hold ``run_dir`` with an exclusive ``flock`` on its ``.lock`` (or the launcher's, :data:`RUN_LOCK_FD_ENV`),
    raising ConfigError if a live process holds it or the folder holds a link where it writes (:func:`check_no_links`);
    nothing is locked without ``fcntl``."""
    check_no_links(run_dir)
    try:
        import fcntl
    except ImportError:  # no flock: nothing to hold
        return RunLock(None, os.path.join(run_dir, RUN_LOCK))
    path = os.path.join(run_dir, RUN_LOCK)
    inherited = os.environ.get(RUN_LOCK_FD_ENV)
    if inherited is not None:
        with contextlib.suppress(OSError, ValueError):
            fd = int(inherited)
            mine, there = os.fstat(fd), os.stat(path)
            if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                del os.environ[RUN_LOCK_FD_ENV]  # taken over once
                os.set_inheritable(fd, False)
                return RunLock(fd, path)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)  # a link planted since the check: refused, not truncated
    try:
        with utils.saying_disk_full(path, "write the lock file"):
            fd = os.open(path, flags, 0o644)  # the file stays; the OS drops the flock when its last holder dies
    except OSError:
        if os.path.islink(path):
            raise utils.ConfigError(link_refusal(path)) from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        with open(path) as f:
            holder = f.read().strip() or "unknown pid"
        os.close(fd)
        raise utils.ConfigError(
            f"The run folder {run_dir} is in use by a live run ({holder}); wait for that run to end or stop it, then try again."
        ) from None
    try:
        with utils.saying_disk_full(path, "write the lock file"):
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    except BaseException:
        os.close(fd)
        raise
    remove_leftovers(run_dir)  # no writer of this folder is alive now: what they left is garbage
    return RunLock(fd, path)


# writers' temporary folders: .step-N.tmp-XXXXXXXX (save_checkpoint_dir), .step-N.tmp (FSDP), .step-N.old-XXXXXXXX (publish)
LEFTOVER_FOLDER = re.compile(r"\..+\.(tmp(-[0-9a-f]{8})?|old-[a-z0-9_]{8})")

# writers' temporary files: <name>.tmp-<pid> (utils.replacing), .LATEST.tmp (point_latest), completions.html.tmp
LEFTOVER_FILE = re.compile(r".+\.tmp-(?P<pid>\d+)|\..+\.tmp|completions\.html\.tmp")


def holds_only_setup(run_dir: str) -> bool:
    """Whether ``run_dir`` holds nothing but its config.yaml, its lock and writers' leftovers (nothing a run logged)."""
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else ["?"]
    return all(n in ("config.yaml", RUN_LOCK) or LEFTOVER_FILE.fullmatch(n) for n in names)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (this process included)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # another user's process
        return True
    return True


def remove_leftovers(run_dir: str) -> None:
    """Remove (and report) the temporary files and folders killed writers left in ``run_dir``; hold its lock."""
    latest = os.path.realpath(os.path.join(run_dir, "LATEST")) + os.sep
    removed, size = [], 0
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            # kept when LATEST leads into it (a kill inside publish_checkpoint)
            if not LEFTOVER_FOLDER.fullmatch(name) or latest.startswith(path + os.sep):
                continue
            size += sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files)
            shutil.rmtree(path, ignore_errors=True)
        else:
            match = LEFTOVER_FILE.fullmatch(name)
            if match is None or (match.group("pid") and pid_alive(int(match.group("pid")))):  # a live pid's file is kept
                continue
            size += os.lstat(path).st_size
            with contextlib.suppress(OSError):
                os.remove(path)
        removed.append(name)
    if removed:
        names = ", ".join(removed[:3]) + (f" and {len(removed) - 3} more" if len(removed) > 3 else "")
        amount = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 1024:.1f} KiB"
        what = "temporary files and folders" if len(removed) > 1 else "temporary file or folder"
        print(f"Removed {len(removed)} {what} ({amount}) that killed writers left in {run_dir}: {names}.")


class CheckpointError(OSError):
    """A checkpoint could not be written; the message says why and where ``LATEST`` still points."""


def checkpoint_error_message(run_dir: str, name: str, reason: str) -> str:
    """The sentence for unwritten checkpoint ``name`` of ``run_dir``: ``reason`` (:func:`write_failure`), the free
    space, where ``LATEST`` still points, and how to continue."""
    latest = os.path.join(run_dir, "LATEST")
    full = reason == utils.NO_SPACE
    if full:
        why, fix = f": {utils.no_space(run_dir)}", "free space on that disk"
    else:
        mib = utils.free_mib(run_dir)
        why = f" ({reason}" + ("" if mib is None else f"; {mib:.0f} MiB are free on its disk") + ")"
        fix = "fix the cause"
    if os.path.exists(latest):
        last = os.path.realpath(latest)
        where = f"LATEST still points at the complete {os.path.basename(last)}"
        if full:  # how much the next one needs, about
            size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(last) for f in files)
            fix += f" ({os.path.basename(last)} takes {size / 2**20:.1f} MiB)"
        then = f"{fix} and continue with resume={run_dir}"
    else:
        where, then = "no earlier checkpoint exists", f"{fix} and start the run again"
    return f"Could not write checkpoint {name} in {run_dir}{why}; the partial folder was removed and {where}: {then}."


def save_checkpoint_dir(run_dir: str, name: str, write) -> str:
    """Atomically write ``<run_dir>/<name>`` (filled by ``write(tmp_dir)``), point ``LATEST`` at it and return its
    path; an ``Exception`` becomes a CheckpointError with ``LATEST`` untouched."""
    tmp = None
    try:
        tmp = make_folder(run_dir, f".{name}.tmp-")
        write(tmp)
        return publish_checkpoint(run_dir, name, tmp)
    except BaseException as e:
        reason = write_failure(e, run_dir) if isinstance(e, Exception) else None  # before the partial folder frees space
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if reason is not None and not isinstance(e, CheckpointError):
            raise CheckpointError(checkpoint_error_message(run_dir, name, reason)) from e
        raise


def write_failure(error: Exception, path: str) -> str:
    """Why writing under ``path`` failed: ``utils.NO_SPACE`` for a full disk (ask before removing what was written),
    else ``utils.failure_reason``."""
    return utils.NO_SPACE if utils.disk_full(error, path) else utils.failure_reason(error)


def make_folder(parent: str, prefix: str) -> str:
    """A new folder ``<parent>/<prefix><random hex>`` with ``mkdir``'s mode (not ``mkdtemp``'s private 0o700)."""
    import secrets

    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def publish_checkpoint(run_dir: str, name: str, tmp: str) -> str:
    """Rename the complete folder ``tmp`` to ``<run_dir>/<name>`` and swap ``LATEST`` to it (always naming a complete
    checkpoint); returns its path."""
    write_checkpoint_manifest(tmp)  # last into the folder: what resume checks (checkpoint_damage)
    final = os.path.join(run_dir, name)
    if os.path.exists(final):  # LATEST: the new folder, the old one moved aside, then the new one in place
        point_latest(run_dir, os.path.basename(tmp))
        old = tempfile.mkdtemp(prefix=f".{name}.old-", dir=run_dir)
        os.replace(final, os.path.join(old, name))
        point_latest(run_dir, os.path.join(os.path.basename(old), name))
        os.replace(tmp, final)
        point_latest(run_dir, name)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
        point_latest(run_dir, name)
    return final


CHECKPOINT_MANIFEST = (
    "manifest.json"  # {relative path: {"bytes", "sha256"}} of a checkpoint's files, written last, checked on resume
)

HASH_CHUNK = 1 << 20  # bytes read at a time when hashing a file


def file_sha256(path: str) -> str:
    """The sha256 hex digest of file ``path``, read in chunks of :data:`HASH_CHUNK` bytes."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def manifest_entry(path: str) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of file ``path``, as :data:`CHECKPOINT_MANIFEST` lists it."""
    return {"bytes": os.path.getsize(path), "sha256": file_sha256(path)}


def write_checkpoint_manifest(folder: str) -> None:
    """Write :data:`CHECKPOINT_MANIFEST` into the checkpoint ``folder``: each other file's path, size and sha256."""
    from concurrent.futures import ThreadPoolExecutor

    names = sorted(os.path.relpath(os.path.join(root, name), folder) for root, _, files in os.walk(folder) for name in files)
    names = [name for name in names if name != CHECKPOINT_MANIFEST]
    with ThreadPoolExecutor(max(1, min(8, len(names)))) as pool:  # hashlib releases the GIL: the files hash side by side
        entries = dict(zip(names, pool.map(lambda name: manifest_entry(os.path.join(folder, name)), names)))
    with open(os.path.join(folder, CHECKPOINT_MANIFEST), "w") as f:
        json.dump(entries, f, indent=1)


def record_in_manifest(folder: str, names: list[str]) -> None:
    """Record the files ``names`` of checkpoint ``folder`` anew in its manifest (those it lists; sizes only in an
    earlier version's), atomically."""
    path = os.path.join(folder, CHECKPOINT_MANIFEST)
    with open(path) as f:
        entries = json.load(f)
    for name in names:
        if name in entries:
            file = os.path.join(folder, name)
            entries[name] = manifest_entry(file) if isinstance(entries[name], dict) else os.path.getsize(file)
    utils.write_atomic(path, json.dumps(dict(sorted(entries.items())), indent=1))


def cut_torch_archive(path: str) -> bool:
    """Whether the ``torch.save`` zip archive ``path`` was cut short (it lost the central directory at its end)."""
    import zipfile

    with open(path, "rb") as f:
        if f.read(4) != b"PK\x03\x04":
            return False  # not a zip archive at all: the loader says what it is
    try:
        with zipfile.ZipFile(path):
            return False
    except zipfile.BadZipFile:
        return True


def checkpoint_file_problem(folder: str, name: str, size: int | None = None, sha256: str | None = None) -> str | None:
    """What is wrong with file ``name`` of checkpoint ``folder`` (``is missing``, ``is cut short ...``), or None;
    ``size``, ``sha256``: the manifest's (without a hash, ``.pt``/``.metadata`` are judged by their zip directory)."""
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return "is missing"
    have = os.path.getsize(path)
    written = "" if size is None else f" of the {size} written"
    if have == 0 and size != 0:
        return f"is empty (0 bytes{written})"
    if name.endswith((".pt", ".metadata")):
        if cut_torch_archive(path):
            return f"is cut short ({have} bytes{written}; its zip directory is gone)"
        if sha256 is None:  # a restricted unpickler reads these: one rewritten whole is left to it
            return None
    if size is not None and have != size:  # a torch archive whose zip directory is whole was rewritten, not cut
        whole = name.endswith((".pt", ".metadata"))
        return (
            f"is cut short ({have} of its {size} bytes)"
            if have < size and not whole
            else f"has {have} bytes, not the {size} written"
        )
    if sha256 is not None and file_sha256(path) != sha256:
        return f"holds other bytes than were written (its {have} bytes have another sha256 than {CHECKPOINT_MANIFEST} records)"
    return None


def checkpoint_damage(folder: str) -> list[tuple[str, str]]:
    """(path, what is wrong) for each damaged file of checkpoint ``folder`` its manifest lists (but ``hf/``), or
    without one, of the files every resume reads."""
    manifest = os.path.join(folder, CHECKPOINT_MANIFEST)
    if os.path.exists(manifest):
        try:
            with open(manifest) as f:
                entries = json.load(f)
            if not isinstance(entries, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            return [(CHECKPOINT_MANIFEST, f"could not be read ({utils.failure_reason(e)})")]
    else:  # FSDP/TP keep the optimizer in sharded/
        sharded = os.path.isdir(os.path.join(folder, "sharded"))
        entries = dict.fromkeys(
            ["policy.pt", "optimizer.pt" if not sharded else "sharded/.metadata", "scheduler.pt", "trainer_state.pt"]
        )
    found = (
        (name, checkpoint_file_problem(folder, name, *_written(entry)))
        for name, entry in entries.items()
        if not name.startswith("hf/")
    )
    return [(name, problem) for name, problem in found if problem is not None]


def _written(entry) -> tuple[int | None, str | None]:
    """(bytes, sha256) of a manifest entry: ``{"bytes", "sha256"}``, or an earlier version's size alone."""
    if isinstance(entry, dict):
        return entry.get("bytes"), entry.get("sha256")
    return entry, None


def intact_checkpoint(run_dir: str, but: str | None = None) -> str | None:
    """The newest ``step-N`` folder of ``run_dir`` (other than ``but``) whose files are whole, or None."""
    steps = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        match = re.fullmatch(r"step-(\d+)", name)
        if match and name != but and os.path.isdir(os.path.join(run_dir, name)):
            steps.append((int(match.group(1)), name))
    return next((name for _, name in sorted(steps, reverse=True) if not checkpoint_damage(os.path.join(run_dir, name))), None)


def damaged_checkpoint_message(folder: str, damage: list[tuple[str, str]]) -> str:
    """The sentence for checkpoint ``folder`` naming its first ``damage`` and how to resume from an intact one."""
    path = os.path.realpath(folder)
    run_dir, step = os.path.split(path)
    name, problem = damage[0]
    more = f" (and {len(damage) - 1} more file{'s' if len(damage) > 2 else ''})" if len(damage) > 1 else ""
    other = intact_checkpoint(run_dir, but=step) if re.fullmatch(r"step-\d+", step) else None
    if other is not None:  # LATEST pointed back at it; resume= takes a run folder
        fix = f"resume from {other}, which is intact: ln -sfn {other} {run_dir}/LATEST && python train.py resume={run_dir}"
    elif os.path.exists(os.path.join(run_dir, "config.yaml")):
        fix = f"no other checkpoint of {run_dir} is intact: restore that file, or start the run again with its config ({run_dir}/config.yaml)"
    else:
        fix = "restore that file"
    return f"The checkpoint {path} is damaged: {name} {problem}{more}; {fix}."


def check_checkpoint(folder: str) -> None:
    """Raise ConfigError unless the checkpoint ``folder``'s files are whole (call it before loading anything)."""
    damage = checkpoint_damage(folder)
    if damage:
        raise utils.ConfigError(damaged_checkpoint_message(folder, damage))


def point_latest(run_dir: str, name: str) -> None:
    """Swap the ``<run_dir>/LATEST`` symlink to ``name`` atomically (a new link, then ``os.replace``)."""
    link_tmp = os.path.join(run_dir, ".LATEST.tmp")
    if os.path.lexists(link_tmp):
        os.remove(link_tmp)
    os.symlink(name, link_tmp)
    os.replace(link_tmp, os.path.join(run_dir, "LATEST"))


def prune_checkpoints(run_dir: str, keep: int) -> None:
    """Delete all but the newest ``keep`` step-N folders up to LATEST's, never the one LATEST points to."""
    if keep is None or keep <= 0:
        return
    latest = os.path.realpath(os.path.join(run_dir, "LATEST"))
    name = os.path.basename(latest)
    newest = int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None
    steps = sorted(
        (d for d in os.listdir(run_dir) if d.startswith("step-") and d[5:].isdigit()),
        key=lambda d: int(d[5:]),
    )
    if newest is not None:  # folders past LATEST (a damaged one a resume went back from) are replaced, not counted
        steps = [d for d in steps if int(d[5:]) <= newest]
    for d in steps[:-keep]:
        if os.path.realpath(os.path.join(run_dir, d)) != latest:
            shutil.rmtree(os.path.join(run_dir, d))
