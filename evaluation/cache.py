"""evaluate.py's on-disk cache of samples, log-probs and judgements: a run stopped midway redoes none of them."""

from __future__ import annotations

import glob
import json
import os

from runs.files import open_append


class Cache:
    """Records in ``<folder>/<name>-rank<r>.jsonl``: all ranks' files read on open, each rank appends to its own, fsynced."""

    def __init__(self, folder: str, name: str, rank: int = 0):
        self.records: dict[str, dict] = {}
        for path in sorted(glob.glob(os.path.join(folder, f"{name}-rank*.jsonl"))):
            with open(path, encoding="utf-8") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        continue
                    self.records[record["key"]] = record
        self.path = os.path.join(folder, f"{name}-rank{rank}.jsonl")
        if os.path.exists(self.path) and os.path.getsize(self.path):
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                cut = f.read(1) != b"\n"
            if cut:  # the last line of a killed process: start the next one on a line of its own
                with open_append(self.path) as f:
                    f.write("\n")
        self.added = 0

    def get(self, key: str) -> dict | None:
        """The record stored under ``key``, or None."""
        return self.records.get(key)

    def put(self, records: list[dict]) -> None:
        """Store ``records`` (each with its ``key``) in memory and on disk."""
        if not records:
            return
        with open_append(self.path) as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
                self.records[record["key"]] = record
            f.flush()
            os.fsync(f.fileno())
        self.added += len(records)
