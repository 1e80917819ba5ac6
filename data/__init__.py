"""Data formats and chat beyond the core's loaders (preference_datasets.py: the registry, hh, shp, se, tokenization,
batching): each module registers its datasets with :func:`preference_datasets.register_dataset`; importing this package
registers them all (train.py does, once). Adding a dataset: docs/data.md."""

from __future__ import annotations

from data import arithmetic, chat, formats, prompts, screening  # noqa: F401  (each registers its datasets)
