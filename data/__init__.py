"""Data formats and chat beyond the core's loaders (preference_datasets.py: the registry, hh, shp, se, tokenization,
batching), and the helpers those loaders call (report.py, readers.py, conversations.py, holdout.py): a format module
registers its datasets with :func:`preference_datasets.register_dataset`; importing this package imports every module in
it and so registers them all (train.py does, once). Adding a dataset: docs/data.md."""

from __future__ import annotations

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):  # every file here: a new one needs no line
    importlib.import_module(f"{__name__}.{_module}")  # each registers its datasets
