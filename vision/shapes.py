"""The embedded image default, ``datasets=[shapes]``: PIL-drawn images of a coloured square (with ``data.shapes.circle``,
beside a circle of another colour), the question "What colour is the square?", the right colour chosen over a wrong one; made on the spot from
``data.shapes.seed`` (no download), scored by the ``shapes`` reward function."""

from __future__ import annotations

import collections
import random

from data.report import DatasetDict
from evaluation.reward_functions import register_reward_function
from preference_datasets import register_dataset

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 210, 30),
    "purple": (140, 40, 170),
    "orange": (245, 130, 20),
}
QUESTION = "What colour is the square?"


def draw(rng: random.Random, colour: str, other: str | None, size: int = 32):
    """A ``size`` x ``size`` white image with a ``colour`` square (and an ``other`` circle) at random places and sizes."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for shape, name in (("square", colour), ("circle", other)) if other else (("square", colour),):
        side = rng.randint(size // 2, size * 3 // 4)
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        box = (x, y, x + side - 1, y + side - 1)
        (pen.rectangle if shape == "square" else pen.ellipse)(box, fill=COLOURS[name])
    return image


@register_dataset("shapes", truncation_mode="keep_end", reward_functions=("shapes",))
def get_shapes(
    split: str,
    report: collections.Counter,
    n_train: int = 2000,
    n_test: int = 128,
    seed: int = 0,
    image_size: int = 32,
    circle: bool = False,
) -> DatasetDict:
    """Generated image questions: ``n_train`` or ``n_test`` images of a coloured square (``circle``: beside a circle of
    another colour), "What colour is the square?", the square's colour chosen over another (the circle's half the time)."""
    rng = random.Random(f"shapes-{seed}-{split}")  # train and test drawn apart, both from the run's seed
    names = sorted(COLOURS)
    # the test images are held out: none equals a train image (2,000 draws from about 9,500 images repeat many)
    trained = set()
    if split == "test":
        train = get_shapes("train", collections.Counter(), n_train, n_test, seed, image_size, circle).values()
        trained = {e["images"][0].tobytes() for e in train}
    data: DatasetDict = {}
    while len(data) < (n_test if split == "test" else n_train):
        colour, other = rng.sample(names, 2)
        wrong = other if rng.random() < 0.5 else rng.choice([c for c in names if c != colour])
        image = draw(rng, colour, other if circle else None, image_size)
        if image.tobytes() in trained:
            continue
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        data[f"shapes/{split}/{len(data)}"] = {  # one prompt per image: the question is the same text each time
            "responses": [colour, wrong],
            "pairs": [(0, 1)],
            "sft_target": colour,
            "prompt_messages": messages,
            "images": [image],
            "fields": {"colour": colour},
        }
    return data


@register_reward_function("shapes")
def shapes(prompts: list[str], completions: list[str], colour: list[str] | None = None, **fields) -> list[float | None]:
    """1.0 when the completion's first word is the square's colour (the ``colour`` column), else 0.0; None without one."""
    if colour is None:
        return [None] * len(completions)
    scores: list[float | None] = []
    for completion, right in zip(completions, colour):
        words = completion.replace("<|im_end|>", " ").strip().lower().split()
        scores.append(None if right is None else float(bool(words) and words[0].strip(".,!") == right))
    return scores
