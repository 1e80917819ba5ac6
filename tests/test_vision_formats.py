"""Image preference rows through ``datasets=[hf]`` (issue 38, vision/formats.py): TRL's vision format, RLAIF-V's layout
and LLaMA-Factory's, each from a small file written here, and the one sentence for each bad row.

Every image is a tiny PNG written here with PIL, its pixels listed by hand; an example's images are opened back with
vision.images.open_image and compared pixel for pixel. Expected prompts are worked out by hand from the rows: image
parts where the row puts them ({"type": "image"} parts, else each <image> of LLaMA-Factory's text, else the start of
the first user turn, as TRL and RLAIF-V place them).
"""

from __future__ import annotations

import io
import json
import os
import re
from pathlib import Path

import datasets
import pytest
from PIL import Image

import utils
import vision  # noqa: F401  (registers vision/formats.py's reader with the hf loader)
from data import formats
from data.loading import load_examples, split_overlap_warning
from data.report import DataReport
from utils import DataError
from vision.formats import read_vision_rows
from vision.images import open_image

RED = [(255, 0, 0), (250, 1, 2), (240, 3, 4), (230, 5, 6)]  # 2x2 pixels, row by row: each image is told apart by them
BLUE = [(0, 0, 255), (1, 2, 250), (3, 4, 240), (5, 6, 230)]
IMAGE = {"type": "image"}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def png_bytes(pixels: list[tuple]) -> bytes:
    image = Image.new("RGB", (2, 2))
    image.putdata(pixels)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def write_png(path: Path, pixels: list[tuple]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes(pixels))
    return str(path)


def pixels(entry) -> list[tuple]:
    return list(open_image(entry, "test").get_flattened_data())


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def load(tmp_path: Path, f: str, **options) -> dict:
    """What datasets=[hf] data.hf.path=f reads (the file for both splits: no held-out slice)."""
    options = {"path": {"train": f, "test": f}, "cache_dir": str(tmp_path / "hf_cache"), **options}
    return formats.get_hf("train", DataReport(), **options)


def entries(data: dict) -> list[tuple]:
    """(prompt messages, images, chosen, rejected) of each pair, in order."""
    return [
        (e["prompt_messages"], e["images"], e["responses"][i], e["responses"][j]) for e in data.values() for i, j in e["pairs"]
    ]


def refused(tmp_path: Path, f: str, **options) -> str:
    with pytest.raises(DataError) as e:
        load(tmp_path, f, **options)
    return str(e.value)


# ----------------------------------------------------------------------------- the formats


def test_trl_vision_rows_from_jsonl_give_the_prompt_parts_answers_and_images(tmp_path):
    red = write_png(tmp_path / "data" / "img" / "red.png", RED)
    blue = write_png(tmp_path / "elsewhere" / "blue.png", BLUE)  # given by its absolute path
    system = {"role": "system", "content": "Look closely."}
    rows = [
        {  # parts as TRL writes them: the image where its part is; the answers as one assistant message or a string
            "prompt": [{"role": "user", "content": [IMAGE, text("What colour is it?")]}],
            "images": ["img/red.png"],
            "chosen": [{"role": "assistant", "content": [text("Red.")]}],
            "rejected": "Blue.",
        },
        {  # two images between the words
            "prompt": [system, {"role": "user", "content": [text("Left:"), IMAGE, text("right:"), IMAGE]}],
            "images": ["img/red.png", blue],
            "chosen": [{"role": "assistant", "content": "Red, then blue."}],
            "rejected": [{"role": "assistant", "content": "Blue, then red."}],
        },
        {  # text content: TRL puts the images at the start of the first user turn
            "prompt": [system, {"role": "user", "content": "Which colour?"}],
            "images": [blue],
            "chosen": "Blue.",
            "rejected": "Red.",
        },
    ]
    got = entries(load(tmp_path, write_jsonl(tmp_path / "data" / "rows.jsonl", rows)))
    assert [(prompt, chosen, rejected) for prompt, _, chosen, rejected in got] == [
        ([{"role": "user", "content": [IMAGE, text("What colour is it?")]}], "Red.", "Blue."),
        (
            [system, {"role": "user", "content": [text("Left:"), IMAGE, text("right:"), IMAGE]}],
            "Red, then blue.",
            "Blue, then red.",
        ),
        ([system, {"role": "user", "content": [IMAGE, text("Which colour?")]}], "Blue.", "Red."),
    ]
    assert [images for _, images, _, _ in got] == [[red], [red, blue], [blue]]  # absolute: relative ones from the file's folder
    assert [[pixels(i) for i in images] for _, images, _, _ in got] == [[RED], [RED, BLUE], [BLUE]]


def test_trl_vision_rows_from_parquet_with_embedded_images(tmp_path):
    """trl-lib/rlaif-v's layout: every column messages of parts, ``images`` a list of datasets.Image (bytes embedded)."""
    prompt = [{"role": "user", "content": [IMAGE, text("Colour?")]}]
    row = {
        "prompt": prompt,
        "chosen": [{"role": "assistant", "content": [text("Blue.")]}],
        "rejected": [{"role": "assistant", "content": [text("Green.")]}],
        "images": [{"bytes": png_bytes(BLUE), "path": None}],
    }
    features = datasets.Features(
        {
            key: [
                {
                    "role": datasets.Value("string"),
                    "content": [{"type": datasets.Value("string"), "text": datasets.Value("string")}],
                }
            ]
            for key in ("prompt", "chosen", "rejected")
        }
        | {"images": datasets.Sequence(datasets.Image())}
    )
    f = str(tmp_path / "rlaif-v.parquet")
    datasets.Dataset.from_list([row], features=features).to_parquet(f)
    ((got_prompt, images, chosen, rejected),) = entries(load(tmp_path, f))
    assert (got_prompt, chosen, rejected) == (prompt, "Blue.", "Green.")  # Arrow's {"text": None} of an image part dropped
    assert isinstance(images[0], bytes) and pixels(images[0]) == BLUE


def test_rlaif_v_rows_one_image_a_question_two_answers(tmp_path):
    """openbmb/RLAIF-V-Dataset's columns; the same question of two images is two prompts."""

    def row(pixels_, idx):
        return {
            "ds_name": "RLAIF-V",
            "image": {"bytes": png_bytes(pixels_), "path": f"{idx}.png"},
            "question": "Describe the image.",
            "chosen": f"A {idx} square.",
            "rejected": "A cat.",
            "origin_dataset": "made here",
            "origin_split": "{}",
            "idx": idx,
            "image_path": f"{idx}.png",
        }

    features = datasets.Features({k: datasets.Value("string") for k in row(RED, "x")} | {"image": datasets.Image()})
    f = str(tmp_path / "RLAIF-V-Dataset_000.parquet")
    datasets.Dataset.from_list([row(RED, "red"), row(BLUE, "blue")], features=features).to_parquet(f)
    data = load(tmp_path, f)
    got = entries(data)
    question = [{"role": "user", "content": [IMAGE, text("Describe the image.")]}]
    assert [(p, c, r) for p, _, c, r in got] == [(question, "A red square.", "A cat."), (question, "A blue square.", "A cat.")]
    assert [pixels(images[0]) for _, images, _, _ in got] == [RED, BLUE]
    assert [e["fields"]["idx"] for e in data.values()] == ["red", "blue"]  # the other columns kept as fields


def test_llamafactory_sharegpt_and_alpaca_rows_each_image_mark_an_image_part(tmp_path):
    a = write_png(tmp_path / "mllm_data" / "a.png", RED)
    b = write_png(tmp_path / "mllm_data" / "b.png", BLUE)
    sharegpt = {
        "conversations": [{"from": "human", "value": "<image>What is this?<image>And this?"}],
        "chosen": {"from": "gpt", "value": "Red and blue."},
        "rejected": {"from": "gpt", "value": "Two cats."},
        "images": ["mllm_data/a.png", "mllm_data/b.png"],
    }
    f = write_jsonl(tmp_path / "mllm_dpo_sharegpt.jsonl", [sharegpt])
    assert refused(tmp_path, f) == (
        f"{f}, row 1: the ShareGPT messages have role(s) 'human', 'gpt', not one of system, user, assistant, tool; "
        "map them with 'data.hf.roles={human: user, gpt: assistant}'."
    )
    got = entries(load(tmp_path, f, roles={"human": "user", "gpt": "assistant"}))
    parts = [IMAGE, text("What is this?"), IMAGE, text("And this?")]
    assert got == [([{"role": "user", "content": parts}], [a, b], "Red and blue.", "Two cats.")]
    alpaca = {
        "instruction": "<image>\nDescribe it",
        "input": "in a word",
        "chosen": "Red.",
        "rejected": "Blue.",
        "images": ["mllm_data/a.png"],
    }
    got = entries(load(tmp_path, write_jsonl(tmp_path / "mllm_dpo_alpaca.jsonl", [alpaca])))
    assert got == [([{"role": "user", "content": [IMAGE, text("\nDescribe it\nin a word")]}], [a], "Red.", "Blue.")]


def test_examples_carry_the_images_and_a_question_on_two_images_is_no_overlap(tmp_path):
    """The example contract (vision/__init__.py) through load_examples; train and test asking one question of two images."""
    write_png(tmp_path / "red.png", RED)
    write_png(tmp_path / "blue.png", BLUE)
    ask = [{"role": "user", "content": "Colour?"}]
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": ask, "images": ["red.png"], "chosen": "Red.", "rejected": "Blue."}])
    test = write_jsonl(tmp_path / "test.jsonl", [{"prompt": ask, "images": ["blue.png"], "chosen": "Red.", "rejected": "Blue."}])
    options = {"hf": {"path": {"train": train, "test": test}, "cache_dir": str(tmp_path / "hf_cache")}}
    (example,) = load_examples(["hf"], "train", options, sft_mode=False, silent=True)
    assert example == {
        "prompt": [{"role": "user", "content": [IMAGE, text("Colour?")]}],
        "chosen": "Red.",
        "rejected": "Blue.",
        "truncation_mode": "keep_end",
        "images": [str(tmp_path / "red.png")],
        "row": f"{train}, row 1",
    }
    (sft,) = load_examples(["hf"], "train", options, sft_mode=True, silent=True)
    assert (sft["chosen"], sft["images"], "rejected" in sft) == ("Red.", [str(tmp_path / "red.png")], False)
    held_out = load_examples(["hf"], "test", options, sft_mode=False, silent=True)
    assert split_overlap_warning([example], held_out) is None  # same words, another image: not a train example


def test_paths_as_written_and_nothing_written_beside_the_data(tmp_path):
    """A ../ path is read as written, from the data file's folder; the held-out slice does not depend on where the data
    lies (the key holds paths as written); the data's folders hold after loading what they held before."""
    write_png(tmp_path / "shared" / "img" / "red.png", RED)
    row = {"prompt": "Colour?", "images": ["../img/red.png"], "chosen": "Red.", "rejected": "Blue."}
    f = write_jsonl(tmp_path / "shared" / "data" / "rows.jsonl", [row])
    before = sorted(str(p) for p in (tmp_path / "shared").rglob("*"))
    data = load(tmp_path, f)
    assert entries(data)[0][1] == [os.path.join(str(tmp_path / "shared" / "data"), "../img/red.png")]
    assert pixels(entries(data)[0][1][0]) == RED
    assert sorted(str(p) for p in (tmp_path / "shared").rglob("*")) == before
    moved = tmp_path / "moved"
    write_png(moved / "img" / "red.png", RED)
    assert list(load(tmp_path, write_jsonl(moved / "data" / "rows.jsonl", [row]))) == list(data)


def test_text_rows_keep_the_text_path(tmp_path):
    f = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
    assert load(tmp_path, f) == {"2+2=": {"responses": ["4", "5"], "pairs": [(0, 1)], "sft_target": "4", "rows": [f"{f}, row 1"]}}


# ----------------------------------------------------------------------------- one sentence per bad row


def good(images: list, **overrides) -> dict:
    return {
        "prompt": [{"role": "user", "content": [IMAGE, text("Colour?")]}],
        "images": images,
        "chosen": "Red.",
        "rejected": "Blue.",
    } | overrides


def test_a_missing_image_is_one_sentence_naming_the_row_and_path(tmp_path):
    write_png(tmp_path / "red.png", RED)
    f = write_jsonl(tmp_path / "rows.jsonl", [good(["red.png"]), good(["gone.png"])])
    assert refused(tmp_path, f) == f"{f}, row 2: the image {tmp_path / 'gone.png'} does not exist; fix the path or drop the row."


def test_an_unreadable_image_is_one_sentence_naming_the_row_and_path(tmp_path):
    (tmp_path / "notes.png").write_text("not an image")
    f = write_jsonl(tmp_path / "rows.jsonl", [good(["notes.png"])])
    assert refused(tmp_path, f) == (
        f"{f}, row 1: the image {tmp_path / 'notes.png'} cannot be read as an image (UnidentifiedImageError); replace it "
        "or drop the row."
    )
    (tmp_path / "cut.png").write_bytes(png_bytes(RED)[:-20])  # a copy cut short: its header reads, its chunks do not
    f = write_jsonl(tmp_path / "cut.jsonl", [good(["cut.png"])])
    assert refused(tmp_path, f) == (
        f"{f}, row 1: the image {tmp_path / 'cut.png'} cannot be read as an image (OSError); replace it or drop the row."
    )


def test_a_count_mismatch_is_one_sentence(tmp_path):
    write_png(tmp_path / "red.png", RED)
    two_parts = good(["red.png"], prompt=[{"role": "user", "content": [IMAGE, IMAGE, text("Colours?")]}])
    f = write_jsonl(tmp_path / "parts.jsonl", [good(["red.png"]), two_parts])
    assert refused(tmp_path, f) == (
        f'{f}, row 2: the prompt has 2 {{"type": "image"}} part(s) but \'images\' gives 1 image(s); give one image per '
        "part, in order."
    )
    unmarked = {
        "conversations": [{"from": "user", "value": "What is this?"}],
        "chosen": "A.",
        "rejected": "B.",
        "images": ["red.png"],
    }
    f = write_jsonl(tmp_path / "sharegpt.jsonl", [unmarked])
    assert refused(tmp_path, f) == (
        f"{f}, row 1: the prompt has 0 <image> mark(s) but 'images' gives 1 image(s); give one image per <image>, in order."
    )


def test_ambiguous_rows_are_refused_in_one_sentence(tmp_path):
    write_png(tmp_path / "red.png", RED)
    both_columns = good(["red.png"], image="red.png")
    f = write_jsonl(tmp_path / "both.jsonl", [both_columns])
    assert refused(tmp_path, f) == (
        f"{f} has both an 'images' and an 'image' column, so which holds the images is unclear; name it with "
        "data.hf.columns={images: <column>}."
    )
    assert len(entries(load(tmp_path, f, columns={"images": "image"}))) == 1  # named: read
    both_marks = good(["red.png"], prompt=[{"role": "user", "content": [IMAGE, text("<image>Colour?")]}])
    f = write_jsonl(tmp_path / "marks.jsonl", [both_marks])
    assert refused(tmp_path, f) == (
        f'{f}, row 1: the prompt marks images both with {{"type": "image"}} parts (1) and with <image> in its text (1); '
        "mark them one way only."
    )
    f = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "Colour?", "chosen": "Red.", "rejected": "Blue."}])
    assert refused(tmp_path, f, format="vision") == (
        f"{f} is read as image preference rows but has no column 'images' or 'image' (its columns: ['prompt', 'chosen', "
        "'rejected']); image rows need a prompt (one of prompt, question, conversations, messages, instruction), chosen, "
        "rejected and images (or image), or data.hf.columns={prompt: ..., chosen: ..., rejected: ..., images: ...}."
    )
    f = write_jsonl(tmp_path / "chat.jsonl", [good(["red.png"], prompt=[{"role": "user", "content": "Colour?"}])])
    assert refused(tmp_path, f, format="conversational") == (
        f"{f} has images (its column 'images') but data.hf.format=conversational reads text only; set "
        "data.hf.format=vision (or auto) to train on the images with them."
    )
    rows = [good(["red.png"])]
    with pytest.raises(DataError) as e:  # a hub dataset's relative path has no folder to be read from
        read_vision_rows(rows, DataReport(), "org/name (train split)", "org/name")
    assert str(e.value) == (
        "org/name (train split), row 1: image 1 of 'images' is the relative path 'red.png', but data.hf.path is not a "
        "local file or folder to read it from; give absolute paths or embed the images."
    )


# ----------------------------------------------------------------------------- what samples text only


def test_sampling_commands_refuse_image_rows_and_image_models_in_one_sentence(tmp_path, monkeypatch):
    # evaluate.py and make_pairs.py sample text from causal LMs: image rows and an image-text-to-text model are one
    # sentence each, whether or not vision/ was imported in the process (it is here: its reader and model hook exist)
    from conftest import compose_config
    from omegaconf import OmegaConf

    from data import prompts
    from evaluation import sampling
    from modeling import models

    write_png(tmp_path / "img" / "red.png", RED)
    f = write_jsonl(
        tmp_path / "rows.jsonl", [{"prompt": "Colour?", "images": ["img/red.png"], "chosen": "Red.", "rejected": "Blue."}]
    )
    options = {"path": {"train": f, "test": f}, "cache_dir": str(tmp_path / "hf_cache")}
    with pytest.raises(DataError, match=r"rows.jsonl has images \(its column 'images'\), which this command does not read"):
        prompts.get_hf_prompts("test", DataReport(), **options)  # the prompts evaluate.py and make_pairs.py sample
    monkeypatch.setattr(formats, "HF_ROW_READERS", [])  # evaluate.py's process: no reader of image rows
    with pytest.raises(DataError, match=r"has images \(its column 'images'\)"):
        formats.get_hf("test", DataReport(), **options)
    monkeypatch.undo()
    config = OmegaConf.create({"datasets": ["hf"], "baseline": "chosen", "n_prompts": 4, "data": {"hf": options}})
    with pytest.raises(utils.ConfigError, match=r"datasets=\[hf\] holds image prompts, which are not sampled from"):
        sampling.load_items(config, silent=True)

    folder = tmp_path / "llava"  # a saved image-text-to-text model's config.json is all that is read
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llava"}))
    llava = OmegaConf.create({"name_or_path": str(folder)})
    assert models.causal_lm_problem(llava) is None  # train.py: vision/'s hook loads it
    assert models.causal_lm_problem(OmegaConf.create({"config": {"model_type": "llama"}}), hooks=False) is None
    expected = f"policy={folder} is a 'llava' model, which transformers' AutoModelForCausalLM does not load"
    assert models.causal_lm_problem(llava, f"policy={folder}", hooks=False).startswith(expected)
    with pytest.raises(utils.ConfigError, match=re.escape(expected)):
        sampling.resolve_source(str(folder), compose_config([f"output_root={tmp_path}", "model=blank_model"]))


def test_a_hub_image_model_not_cached_yet_is_told_apart_before_it_loads(tmp_path, monkeypatch):
    # model_type read only the hub cache: a first run of a hub VLM id took the text path (AutoModelForCausalLM) and its
    # refusals (here sequence parallelism, whose forward would drop the images) passed
    import transformers.utils
    from conftest import compose_config

    from modeling import models
    from runs import checks

    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps({"model_type": "idefics3"}))
    asked = []

    def hub(path, filename, local_files_only=False, **_):
        asked.append((path, local_files_only))
        if local_files_only:
            raise OSError("not in the cache")
        return str(config_file)  # the download

    monkeypatch.setattr(transformers.utils, "cached_file", hub)
    models._hub_config_file.cache_clear()
    hub_id = "HuggingFaceTB/SmolVLM-256M-Instruct"
    overrides = [f"output_root={tmp_path}", "model=blank_model", f"model.name_or_path={hub_id}", "trainer=FSDPTrainer"]
    with pytest.raises(utils.ConfigError, match="is an image-text-to-text model, which does not train with sequence_parallel"):
        checks.validate_config(compose_config([*overrides, "sequence_parallel_size=2"]), world_size=2)
    assert (hub_id, False) in asked
    asked.clear()
    assert models.model_type(compose_config([*overrides, "model.name_or_path=./not/here"]).model) is None
    assert asked == [("./not/here", True)]  # a local-looking path is never asked of the hub
    models._hub_config_file.cache_clear()


def test_a_mistyped_format_on_image_rows_is_unknown_with_vision_among_the_choices(tmp_path):
    # it said the format "reads text only", as if it were a text format
    write_png(tmp_path / "red.png", RED)
    f = write_jsonl(
        tmp_path / "rows.jsonl", [{"prompt": "Colour?", "images": ["red.png"], "chosen": "Red.", "rejected": "Blue."}]
    )
    assert refused(tmp_path, f, format="visoin") == (
        "data.hf.format=visoin is unknown; use one of auto, standard, conversational, implicit, ranked, hh, vision."
    )
