"""Reading a run's state back for resume: the trainer state file and sharded (DCP) checkpoints, unpickling only what\nthis repository writes, and numpy's RNG state."""

from __future__ import annotations

import os

import numpy as np
import torch

import utils
from modeling import models
from runs import checkpoints


def numpy_rng_state() -> dict:
    """NumPy's global RNG state as plain values and a tensor, which ``torch.load(weights_only=True)``
    reads: ``np.random.get_state(legacy=False)`` with its 624-word key as an int64 tensor."""
    state = np.random.get_state(legacy=False)
    key = torch.from_numpy(state["state"]["key"].astype(np.int64))
    return {**state, "state": {**state["state"], "key": key}}


def set_numpy_rng_state(state) -> None:
    """Restore NumPy's global RNG from :func:`numpy_rng_state`'s dict, or from the tuple of
    ``np.random.get_state()`` that checkpoints of earlier versions hold."""
    if isinstance(state, dict):
        key = state["state"]["key"].numpy().astype(np.uint32)  # the int64 copy of MT19937's uint32 words
        state = {**state, "state": {**state["state"], "key": key}}
    np.random.set_state(state)


def read_checkpoint_file(checkpoint_dir: str, name: str):
    """Load ``name`` from ``checkpoint_dir`` onto the CPU with ``weights_only=True`` (trainer_state.pt: also NumPy's
    uint32 RNG key of older checkpoints); utils.ConfigError naming the file if it is missing, cut short or unsafe."""
    path = os.path.join(checkpoint_dir, name)
    problem = checkpoints.checkpoint_file_problem(checkpoint_dir, name)
    if problem is not None:  # also where no manifest was checked first (a checkpoint of an earlier version, Ray's copy)
        raise utils.ConfigError(checkpoints.damaged_checkpoint_message(checkpoint_dir, [(name, problem)]))
    reconstruct = np.empty(0).__reduce__()[0]  # numpy(._)core.multiarray._reconstruct: an empty ndarray of a given class
    old_numpy = (reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32)))  # the key's dtype: numpy.dtypes.UInt32DType
    return models.load_weights_file(
        path,
        f"The checkpoint file {os.path.realpath(path)}",  # step-N/, not LATEST/, which moves
        "resume only from checkpoints written by this repository's train.py",
        # only what rebuilds the array: no code of the file's choosing runs
        safe_globals=old_numpy if name == "trainer_state.pt" else (),
    )


SHARDED_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": None,  # None: every class defined there (the metadata's dataclasses, enums)
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},  # and torch's dtypes (``torch float32``)
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
}
"""The globals a DCP ``.metadata`` pickle may name (:func:`read_sharded_checkpoint`); any other is refused."""


def read_sharded_checkpoint(state: dict, folder: str) -> None:
    """``torch.distributed.checkpoint.load(state, folder)`` unpickling only :data:`SHARDED_METADATA_CLASSES` and
    ``weights_only=True`` entries; utils.ConfigError naming ``folder`` if it holds more, or a file is missing or cut short."""
    import torch.distributed.checkpoint as dcp

    def refuse(what: str) -> utils.ConfigError:
        return utils.ConfigError(
            f"The sharded checkpoint {os.path.realpath(folder)} holds more than tensors and plain values (e.g. {what}), and is not "
            "loaded because unpickling it could run code; resume only from checkpoints written by this repository's train.py."
        )

    def damaged(name: str, problem: str) -> utils.ConfigError:
        return utils.ConfigError(checkpoints.damaged_checkpoint_message(os.path.dirname(folder), [(f"sharded/{name}", problem)]))

    unpickler, reader, planner = _safe_loaders(refuse)
    _check_shard_files(folder, unpickler, damaged)
    try:
        dcp.load(state, storage_reader=reader(folder), planner=planner())
    except dcp.CheckpointException as e:  # DCP wraps each rank's error: (exception, stack) by rank
        failures = [exc for exc, _ in e.failures.values()]
        refusal = next((exc for exc in failures if isinstance(exc, utils.ConfigError)), None)
        if refusal is not None:
            raise refusal from None
        raise damaged("", f"could not be read ({utils.failure_reason(failures[0])})") from None


def _safe_loaders(refuse) -> tuple[type, type, type]:
    """DCP's metadata unpickler, FileSystemReader and DefaultLoadPlanner, each raising ``refuse(what)`` for what is more than
    :data:`SHARDED_METADATA_CLASSES` and ``weights_only=True`` entries."""
    import pickle
    import sys

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.metadata import StorageMeta

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            allowed = SHARDED_METADATA_CLASSES.get(module, set())
            found = getattr(sys.modules.get(module), name, None)
            if allowed is None and isinstance(found, type) and found.__module__ == module:
                return found
            if (module == "torch" and isinstance(found, torch.dtype)) or (allowed and name in allowed):
                return super().find_class(module, name)
            raise refuse(f"{module}.{name}")

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # FileSystemReader.read_metadata with the unpickler above
            rank = kwargs.get("rank")  # newer DCP: a rank's own __<rank>.metadata when there is no global one
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
            return metadata

    class Planner(dcp.DefaultLoadPlanner):
        def load_bytes(self, read_item, value):  # DefaultLoadPlanner.load_bytes with weights_only=True
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError:
                raise refuse(f"the entry {read_item.dest_index.fqn}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return MetadataUnpickler, Reader, Planner


def _check_shard_files(folder: str, unpickler: type, damaged) -> None:
    """Raise ``damaged(file, problem)`` when ``folder``'s .metadata cannot be read or a shard file it names is missing or cut short."""
    import pickle

    metadata = os.path.join(folder, ".metadata")
    if os.path.exists(metadata):  # read first here: DCP would turn a refusal into a fallback, then an AssertionError
        with open(metadata, "rb") as f:
            try:
                storage = getattr(unpickler(f).load(), "storage_data", None) or {}
            except (EOFError, pickle.UnpicklingError) as e:  # cut short
                raise damaged(".metadata", f"could not be read ({utils.failure_reason(e)})") from None
        ends = {}  # each shard file's length, from where its last entry ends
        for info in storage.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            path = os.path.join(folder, name)
            if not os.path.isfile(path) or os.path.getsize(path) < end:
                problem = f"is cut short ({os.path.getsize(path)} of its {end} bytes)" if os.path.isfile(path) else "is missing"
                raise damaged(name, problem)
