"""Ranked lists without scores and LLaMA-Factory's alpaca layouts in the ``hf`` loader (issue 25):
``data.hf.ranked_order=best_first`` and the ``input`` / ``history`` / ``system`` columns.

Every file is a small .jsonl written here in the layout it stands for. Expected prompts, pairs
and renderings are worked out by hand from the rows: a best-first list of n responses ranks the
k-th (1-based) n - k + 1, every pair puts the earlier response first, and a prompt is the
instruction, "\\n", then a non-empty input (LLaMA-Factory's AlpacaDatasetConverter).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import compose_config, needs_shared
from test_hf_data import bot, key, short_chat_run, user
from transformers import AutoTokenizer

from data import chat, formats
from data import prompts as prompt_sets
from data.loading import load_examples
from data.report import DataReport
from utils import DataError

LF_RANKING = "data.hf.columns={prompt: instruction, input: input, responses: output, history: history}"
"""The override that reads LLaMA-Factory's alpaca ranking files (with format=ranked ranked_order=best_first)."""


def system(text: str) -> dict:
    return {"role": "system", "content": text}


def write_jsonl(tmp_path: Path, rows: list[dict], name: str = "rows.jsonl") -> str:
    f = tmp_path / name
    f.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(f)


def load(tmp_path: Path, f: str, report=None, **options) -> dict:
    options = {"path": {"train": f, "test": f}, "cache_dir": str(tmp_path / "hf_cache"), **options}
    return formats.get_hf("train", DataReport() if report is None else report, **options)


def pairs_of(data: dict) -> list[tuple]:
    return [(k, e["responses"][i], e["responses"][j]) for k, e in data.items() for i, j in e["pairs"]]


def config_data(tmp_path: Path, f: str, *overrides: str) -> dict:
    """``data`` of the composed config for ``datasets=[hf] data.hf.path=f <overrides>``, as the loaders get it."""
    from omegaconf import OmegaConf

    config = compose_config(["datasets=[hf]", f"data.hf.path={f}", f"data.hf.cache_dir={tmp_path / 'c'}", *overrides])
    data = OmegaConf.to_container(config.data, resolve=True)
    data["hf"]["path"] = {"train": f, "test": f}  # one file read for both splits: no held-out slice
    return data


# ----------------------------------------------------------------------------- ranked_order


def test_best_first_lists_give_every_pair_earlier_chosen_and_the_first_as_sft_target(tmp_path):
    f = write_jsonl(tmp_path, [{"prompt": "p", "responses": ["A", "B", "C", "D"]}, {"prompt": "solo", "responses": ["X"]}])
    report = DataReport()
    data = load(tmp_path, f, report, format="ranked", ranked_order="best_first")
    assert data["p"]["responses"] == ["A", "B", "C", "D"]
    assert data["p"]["pairs"] == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    assert data["p"]["sft_target"] == "A" and "solo" not in data
    assert report == {"skipped: fewer than 2 responses": 1}
    # the cap keeps the largest rank gaps: AD (3), AC and BD (2), then the first gap 1 (AB), in their order
    capped = load(tmp_path, f, format="ranked", ranked_order="best_first", max_pairs_per_prompt=4)
    assert capped["p"]["pairs"] == [(0, 1), (0, 2), (0, 3), (1, 3)]
    worst = load(tmp_path, f, format="ranked", ranked_order="worst_first")
    assert pairs_of(worst)[:3] == [("p", "B", "A"), ("p", "C", "A"), ("p", "D", "A")]
    assert worst["p"]["sft_target"] == "D"


def test_best_first_through_the_config_and_response_objects_without_scores(tmp_path):
    f = write_jsonl(tmp_path, [{"prompt": "p", "responses": [{"text": "good"}, {"text": "bad"}]}])
    data = config_data(tmp_path, f, "data.hf.format=ranked", "data.hf.ranked_order=best_first")
    examples = load_examples(["hf"], "train", data, sft_mode=False, silent=True)
    assert [(ex["prompt"], ex["chosen"], ex["rejected"]) for ex in examples] == [("p", "good", "bad")]


@pytest.mark.parametrize(
    "rows, options, sentence",
    [
        (
            [{"prompt": "p", "responses": ["A", "B"], "scores": [1, 2]}],
            {"ranked_order": "best_first"},
            "{f}, row 1: gives scores (column 'scores' or a 'score' in a response object) while "
            "data.hf.ranked_order=best_first ranks the responses by their order; drop data.hf.ranked_order to use the scores.",
        ),
        (
            [{"prompt": "p", "responses": ["A", "B"]}],
            {},
            "{f}, row 1: response 1 has no numeric score; give 'scores' or a 'score' in each response object, or set "
            "data.hf.ranked_order=best_first when the responses are listed best first.",
        ),
        (
            [{"prompt": "p", "chosen": "A", "rejected": "B"}],
            {"ranked_order": "best_first"},
            "data.hf.ranked_order=best_first orders ranked rows' responses, but {f} is read as standard; map the list of "
            "responses with data.hf.columns={{responses: <column>}} (and data.hf.format=ranked).",
        ),
        (
            [{"prompt": "p", "responses": ["A", "B"]}],
            {"ranked_order": "best"},
            "data.hf.ranked_order=best is unknown; use best_first or worst_first (or null: the rows give scores).",
        ),
    ],
)
def test_ranked_order_mistakes_are_one_sentence(tmp_path, rows, options, sentence):
    f = write_jsonl(tmp_path, rows)
    with pytest.raises(DataError) as e:
        load(tmp_path, f, **options)
    assert str(e.value) == sentence.format(f=f)


# ----------------------------------------------------------------------------- LLaMA-Factory's alpaca layouts


def test_alpaca_preference_rows_join_input_with_a_newline(tmp_path):
    """LLaMA-Factory's alpaca preference layout without history / system: prompts stay strings."""
    rows = [
        {"instruction": "Translate to Spanish.", "input": "Good morning", "chosen": "Buenos dias", "rejected": "Bonjour"},
        {"instruction": "Name a prime.", "input": "", "chosen": "7", "rejected": "9"},
        {"instruction": "", "input": "Only input", "chosen": "yes", "rejected": "no"},
    ]
    f = write_jsonl(tmp_path, rows)
    data = load(tmp_path, f, columns={"prompt": "instruction", "input": "input"})
    assert pairs_of(data) == [
        ("Translate to Spanish.\nGood morning", "Buenos dias", "Bonjour"),
        ("Name a prime.", "7", "9"),
        ("Only input", "yes", "no"),
    ]


def test_alpaca_preference_rows_with_history_and_system_are_conversations(tmp_path):
    rows = [
        {
            "instruction": "And in French?",
            "input": "",
            "chosen": "Bonjour",
            "rejected": "Hola",
            "history": [["Say hello in Spanish.", "Hola"], ["Louder.", "HOLA"]],
            "system": "Be brief.",
        },
        {"instruction": "Sum", "input": "2 3", "chosen": "5", "rejected": "6", "history": [], "system": ""},
    ]
    f = write_jsonl(tmp_path, rows)
    columns = {"prompt": "instruction", "input": "input", "history": "history", "system": "system"}
    data = load(tmp_path, f, columns=columns)
    first = [
        system("Be brief."),
        user("Say hello in Spanish."),
        bot("Hola"),
        user("Louder."),
        bot("HOLA"),
        user("And in French?"),
    ]
    assert pairs_of(data) == [
        (key(first), [bot("Bonjour")], [bot("Hola")]),
        (key([user("Sum\n2 3")]), [bot("5")], [bot("6")]),  # empty history and system add nothing
    ]
    assert data[key(first)]["prompt_messages"] == first


def ranking_rows() -> list[dict]:
    """Rows of LLaMA-Factory's alpaca ranking layout: ``output`` ordered best first."""
    return [
        {"instruction": "Capital of France?", "input": "", "output": ["Paris.", "Lyon.", "Rome."], "history": []},
        {
            "instruction": "Why?",
            "input": "Answer briefly.",
            "output": ["Because it is.", "No idea."],
            "history": [["Is the sky blue?", "Yes."]],
        },
    ]


def test_llamafactory_ranking_file_loads_with_the_documented_overrides(tmp_path):
    f = write_jsonl(tmp_path, ranking_rows())
    data = config_data(tmp_path, f, LF_RANKING, "data.hf.format=ranked", "data.hf.ranked_order=best_first")
    examples = load_examples(["hf"], "train", data, sft_mode=False, silent=True)
    q1, q2 = [user("Capital of France?")], [user("Is the sky blue?"), bot("Yes."), user("Why?\nAnswer briefly.")]
    assert [(ex["prompt"], ex["chosen"], ex["rejected"]) for ex in examples] == [
        (q1, [bot("Paris.")], [bot("Lyon.")]),
        (q1, [bot("Paris.")], [bot("Rome.")]),
        (q1, [bot("Lyon.")], [bot("Rome.")]),
        (q2, [bot("Because it is.")], [bot("No idea.")]),
    ]
    assert all(ex["conversation"] for ex in examples)
    # rendered by SmolLM2's chat template: the earlier turns come first, in order, then the question
    tok = AutoTokenizer.from_pretrained(str(needs_shared("tokenizers", "smollm2-135m-instruct")))
    rendered = chat.render_conversations(examples, tok, 256, 128, silent=True)
    assert rendered[3]["prompt"] == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nIs the sky blue?<|im_end|>\n<|im_start|>assistant\nYes.<|im_end|>\n"
        "<|im_start|>user\nWhy?\nAnswer briefly.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (rendered[3]["chosen"], rendered[3]["rejected"]) == ("Because it is.<|im_end|>", "No idea.<|im_end|>")
    sft = load_examples(["hf"], "train", data, sft_mode=True, silent=True)
    assert [(ex["prompt"], ex["chosen"]) for ex in sft] == [(q1, [bot("Paris.")]), (q2, [bot("Because it is.")])]


@pytest.mark.parametrize("history", [[["only the question"]], "Is the sky blue?", [["q", 3]]])
def test_malformed_history_is_one_sentence_naming_the_row(history):
    """Rows as the loader gets them (the datasets library cannot even write these mixed types to one file)."""
    rows = [ranking_rows()[0], {**ranking_rows()[1], "history": history}]
    columns = {"prompt": "instruction", "input": "input", "responses": "output", "history": "history"}
    with pytest.raises(DataError) as e:
        formats.hf_rows_to_data(rows, DataReport(), "lf.jsonl", "ranked", columns, ranked_order="best_first")
    assert str(e.value) == (
        "lf.jsonl, row 2: column 'history' (data.hf.columns history) is not a list of [user, assistant] string pairs "
        f"({json.dumps(history)}); give earlier turns as [[question, answer], ...] or []."
    )


def test_context_columns_on_a_conversational_file_are_one_sentence(tmp_path):
    """input / history join a prompt string; a mapped system heads a conversational prompt instead (ShareGPT's rule)."""
    f = write_jsonl(tmp_path, [{"prompt": [user("q")], "chosen": [bot("a")], "rejected": [bot("b")], "inp": "s"}])
    with pytest.raises(DataError) as e:
        load(tmp_path, f, columns={"input": "inp"})
    assert str(e.value) == (
        f"data.hf.columns maps input, which add to a prompt string of standard or ranked rows, but {f} is read as "
        "conversational; map prompt, chosen and rejected (or responses) to string columns."
    )


def test_prompts_for_online_dpo_take_input_and_history_too(tmp_path):
    rows = [{"instruction": "Why?", "input": "Briefly.", "history": [["Is the sky blue?", "Yes."]], "output": "x"}]
    f = write_jsonl(tmp_path, rows)
    options = {"path": {"train": f, "test": f}, "cache_dir": str(tmp_path / "c")}
    options["columns"] = {"prompt": "instruction", "input": "input", "history": "history"}
    got = prompt_sets.load_prompt_entries("hf", "train", {"hf": options}, silent=True)
    assert got == [([user("Is the sky blue?"), bot("Yes."), user("Why?\nBriefly.")], {"output": "x"})]


# ----------------------------------------------------------------------------- end to end


def test_tiny_dpo_run_on_a_llamafactory_ranking_file(tmp_path):
    """train.py's in-process path on a LLaMA-Factory ranking file (history rows included) with
    the documented overrides: a random tiny model with SmolLM2's chat template trains and evaluates."""
    tokenizer = needs_shared("tokenizers", "smollm2-135m-instruct")
    rows = [
        {
            "instruction": f"What is {i}+{i}?",
            "input": "Answer with a number." if i % 2 else "",
            "output": [f"{2 * i}", f"{2 * i + 1}", f"{2 * i + 7}"],
            "history": [[f"Hi {i}", "Hello."]] if i % 3 == 0 else [],
        }
        for i in range(24)
    ]
    f = write_jsonl(tmp_path, rows, "ranking.jsonl")
    short_chat_run(
        tmp_path,
        f,
        tokenizer,
        LF_RANKING,
        "data.hf.format=ranked",
        "data.hf.ranked_order=best_first",
        "data.hf.holdout_fraction=0.25",
    )
