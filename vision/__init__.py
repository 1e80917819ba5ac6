"""Vision-language DPO (issue 38): preference pairs whose prompts hold images, for image-text-to-text models.

An image example is the text example's dict with ``prompt`` a list of messages whose ``content`` may hold
``{"type": "image"}`` parts and ``images``, one entry per image part in order (:mod:`vision.images`); ``chosen`` and
``rejected`` are the assistant's answers (str). Importing this package registers its pieces with the core (train.py does,
once)."""

from __future__ import annotations

import importlib
import pkgutil

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):  # every file here: a new one needs no line
    importlib.import_module(f"{__name__}.{_module}")  # each registers what it adds
