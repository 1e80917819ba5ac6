"""The ``hf`` dataset (issue 12): preference data read through the ``datasets`` library in the
hub's formats, prompt-only data for online DPO, HH as conversations, and bad input.

Every file is written by the ``datasets`` library (``Dataset.from_list(...).to_parquet`` /
``to_json`` / ``to_csv`` / ``save_to_disk``) in the column layout of the hub dataset it stands
for. Expected prompts, responses and pairs are worked out by hand from the rows; the held-out
slice by the documented rule (sha256's first 8 bytes / 2**64 < fraction).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
from pathlib import Path

import datasets
import pytest
from conftest import TINY, compose_config, needs_shared

import preference_datasets as pd
import train
from data import formats
from data import prompts as prompt_sets
from data.loading import load_dataset_dict, load_examples
from data.report import DataReport
from utils import DataError


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


def key(messages: list[dict]) -> str:
    return json.dumps(messages, ensure_ascii=False)


def held_out(prompt: str, fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") / 2**64 < fraction


def load(split: str, tmp_path: Path, **options) -> dict:
    return load_dataset_dict("hf", split, {"cache_dir": str(tmp_path / "hf_cache"), **options}, silent=True)


def examples(split: str, tmp_path: Path, sft: bool = False, **options) -> list[dict]:
    return load_examples(["hf"], split, {"hf": {"cache_dir": str(tmp_path / "hf_cache"), **options}}, sft)


def prompts(split: str, tmp_path: Path, **options) -> list:
    return prompt_sets.load_prompt_examples(
        ["hf"], split, {"hf": {"cache_dir": str(tmp_path / "hf_cache"), **options}}, silent=True
    )


def both(f) -> dict:
    """data.hf.path as a mapping that reads one file for both splits (no held-out slice)."""
    return {"train": str(f), "test": str(f)}


def pairs_of(data: dict) -> list[tuple]:
    """(prompt, chosen, rejected) of every pair, in order."""
    return [(k, e["responses"][i], e["responses"][j]) for k, e in data.items() for i, j in e["pairs"]]


# ----------------------------------------------------------------------------- the hub's layouts


def h4_row(i: int, question: str, good: str, bad: str) -> dict:
    """A row of HuggingFaceH4/ultrafeedback_binarized (its *_prefs splits)."""
    chosen = [user(question), bot(good)]
    return {
        "prompt": question,
        "prompt_id": f"{i:064x}",
        "chosen": chosen,
        "rejected": [user(question), bot(bad)],
        "messages": chosen,
        "score_chosen": 8.0,
        "score_rejected": 3.5,
    }


def write_h4(tmp_path: Path) -> Path:
    """A folder in the hub snapshot's layout: data/<split>-00000-of-00001.parquet."""
    folder = tmp_path / "ultrafeedback_binarized"
    (folder / "data").mkdir(parents=True)
    splits = {
        "train_prefs": [h4_row(0, "What is 2+2?", "4", "5"), h4_row(1, "Name a colour.", "Blue.", "Seven.")],
        "test_prefs": [h4_row(2, "Capital of France?", "Paris.", "Lyon.")],
        "train_sft": [h4_row(3, "sft only", "x", "y")],
    }
    for split, rows in splits.items():
        datasets.Dataset.from_list(rows).to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    return folder


def test_h4_ultrafeedback_layout_implicit_prompt_beside_a_prompt_string(tmp_path):
    folder = write_h4(tmp_path)
    options = {"path": str(folder), "train_split": "train_prefs", "test_split": "test_prefs"}
    train_data = load("train", tmp_path, **options)
    assert pairs_of(train_data) == [
        (key([user("What is 2+2?")]), [bot("4")], [bot("5")]),
        (key([user("Name a colour.")]), [bot("Blue.")], [bot("Seven.")]),
    ]
    entry = train_data[key([user("What is 2+2?")])]
    assert entry["prompt_messages"] == [user("What is 2+2?")] and entry["sft_target"] == [bot("4")]
    src = f"{folder} (train_prefs split)"
    assert examples("train", tmp_path, **options)[1] == {
        "prompt": [user("Name a colour.")],
        "chosen": [bot("Blue.")],
        "rejected": [bot("Seven.")],
        "truncation_mode": "keep_end",
        "conversation": True,
        "row": f"{src}, row 2",
        # the columns no format reads (messages aside: the whole conversation again) reach reward functions
        "fields": {"prompt_id": f"{1:064x}", "score_chosen": 8.0, "score_rejected": 3.5},
    }
    assert pairs_of(load("test", tmp_path, **options)) == [(key([user("Capital of France?")]), [bot("Paris.")], [bot("Lyon.")])]
    sft = examples("test", tmp_path, sft=True, **options)
    assert [(e["prompt"], e["chosen"], "rejected" in e) for e in sft] == [([user("Capital of France?")], [bot("Paris.")], False)]


def test_h4_layout_without_the_split_names_lists_the_splits(tmp_path):
    folder = write_h4(tmp_path)
    with pytest.raises(DataError) as e:
        load("train", tmp_path, path=str(folder))
    assert str(e.value) == (
        f"{folder} has no split 'train' (its splits: test_prefs, train_prefs, train_sft); set data.hf.train_split to one of them."
    )
    # Regression (fresh-user trial): a mistyped test split (here the default 'test') was silently
    # replaced by a held-out slice of train_prefs, with the real test_prefs ignored.
    for fraction in (0, 0.1):
        with pytest.raises(DataError) as e:
            load("test", tmp_path, path=str(folder), train_split="train_prefs", holdout_fraction=fraction)
        assert str(e.value) == (
            f"{folder} has no split 'test' (its splits: test_prefs, train_prefs, train_sft); set data.hf.test_split to "
            "one of them, or data.hf.test_split=null to hold out data.hf.holdout_fraction of 'train_prefs'."
        )


def test_trl_ultrafeedback_layout_conversational_implicit(tmp_path):
    """trl-lib/ultrafeedback_binarized: chosen / rejected message lists and scores, splits train and test."""
    folder = tmp_path / "trl_uf" / "data"
    folder.mkdir(parents=True)
    rows = {
        "train": [
            {
                "chosen": [user("Hi"), bot("Hello!")],
                "rejected": [user("Hi"), bot("Go away.")],
                "score_chosen": 9.0,
                "score_rejected": 2.0,
            },
            {
                "chosen": [user("2*3?"), bot("6")],
                "rejected": [user("2*3?"), bot("5")],
                "score_chosen": 10.0,
                "score_rejected": 1.0,
            },
        ],
        "test": [
            {
                "chosen": [user("Bye"), bot("Bye!")],
                "rejected": [user("Bye"), bot("No.")],
                "score_chosen": 7.0,
                "score_rejected": 6.0,
            }
        ],
    }
    for split, split_rows in rows.items():
        datasets.Dataset.from_list(split_rows).to_parquet(str(folder / f"{split}-00000-of-00001.parquet"))
    path = str(folder.parent)
    assert pairs_of(load("train", tmp_path, path=path)) == [
        (key([user("Hi")]), [bot("Hello!")], [bot("Go away.")]),
        (key([user("2*3?")]), [bot("6")], [bot("5")]),
    ]
    assert pairs_of(load("test", tmp_path, path=path)) == [(key([user("Bye")]), [bot("Bye!")], [bot("No.")])]


def test_explicit_conversational_jsonl_keeps_the_system_message(tmp_path):
    f = tmp_path / "conv.jsonl"
    system = {"role": "system", "content": "Be brief."}
    rows = [
        {"prompt": [system, user("Sky colour?")], "chosen": [bot("Blue.")], "rejected": [bot("Green.")]},
        {"prompt": [system, user("Sky colour?")], "chosen": [bot("Blue.")], "rejected": [bot("Red.")]},
    ]
    datasets.Dataset.from_list(rows).to_json(str(f))
    data = load("train", tmp_path, path=both(f))
    k = key([system, user("Sky colour?")])
    assert list(data) == [k]
    assert data[k]["responses"] == [[bot("Blue.")], [bot("Green.")], [bot("Red.")]]
    assert data[k]["pairs"] == [(0, 1), (0, 2)]
    assert data[k]["rows"] == [f"{f}, row 1", f"{f}, row 2"]


def test_implicit_multi_turn_prompt_is_the_common_run_before_an_assistant_turn(tmp_path):
    f = tmp_path / "multi.parquet"
    rows = [
        {  # diverge at the last assistant turn: the prompt is the three shared turns
            "chosen": [user("u1"), bot("a1"), user("u2"), bot("good")],
            "rejected": [user("u1"), bot("a1"), user("u2"), bot("bad")],
        },
        {  # diverge at a user turn: the prompt stops before the last shared assistant turn
            "chosen": [user("v1"), bot("b1"), user("v2"), bot("b2")],
            "rejected": [user("v1"), bot("b1"), user("v3"), bot("b3")],
        },
    ]
    datasets.Dataset.from_list(rows).to_parquet(str(f))
    data = load("train", tmp_path, path=both(f))
    assert pairs_of(data) == [
        (key([user("u1"), bot("a1"), user("u2")]), [bot("good")], [bot("bad")]),
        (key([user("v1")]), [bot("b1"), user("v2"), bot("b2")], [bot("b1"), user("v3"), bot("b3")]),
    ]


def test_csv_with_a_column_mapping_and_the_held_out_slice(tmp_path):
    """lvwerra/stack-exchange-paired's columns (question, response_j better than response_k), as csv."""
    f = tmp_path / "se.csv"
    rows = [
        {"qid": i, "question": f"Q{i}?", "date": "2020-01-01", "response_j": f" good {i}", "response_k": f" bad {i}"}
        for i in range(40)
    ]
    datasets.Dataset.from_list(rows).to_csv(str(f), index=False)
    with pytest.raises(DataError) as e:
        load("train", tmp_path, path=str(f))
    assert str(e.value).startswith(
        f"{f} has columns ['qid', 'question', 'date', 'response_j', 'response_k'], which match no preference format"
    )
    assert "data.hf.columns={prompt: <column>, chosen: <column>, rejected: <column>}" in str(e.value)
    # Regression (fresh-user trial): bash splits an unquoted data.hf.columns={prompt:question,...}
    # into three overrides, the last one a string, which was read letter by letter as mapping keys.
    with pytest.raises(DataError) as e:
        load("train", tmp_path, path=str(f), columns="rejected:response_k")
    assert str(e.value).startswith("data.hf.columns must be a mapping such as {prompt: question, chosen: good, rejected: bad}")
    assert "quote the whole override in the shell" in str(e.value)
    # Regression (fresh-user trial): a mapping to a column that is not there got the generic
    # "match no preference format" sentence, without naming the column.
    with pytest.raises(DataError) as e:
        load("train", tmp_path, path=str(f), columns={"prompt": "question", "chosen": "response_x", "rejected": "response_k"})
    assert str(e.value) == (
        f"data.hf.columns maps chosen to 'response_x', which is not a column of {f} "
        "(its columns: ['qid', 'question', 'date', 'response_j', 'response_k'])."
    )
    mapping = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}
    train_data = load("train", tmp_path, path=str(f), columns=mapping, holdout_fraction=0.25)
    test_data = load("test", tmp_path, path=str(f), columns=mapping, holdout_fraction=0.25)
    expected_test = [f"Q{i}?" for i in range(40) if held_out(f"Q{i}?", 0.25)]
    assert list(test_data) == expected_test and 0 < len(expected_test) < 40
    assert list(train_data) == [f"Q{i}?" for i in range(40) if not held_out(f"Q{i}?", 0.25)]
    assert pairs_of(train_data)[0] == (
        list(train_data)[0],
        f" good {list(train_data)[0][1:-1]}",
        f" bad {list(train_data)[0][1:-1]}",
    )


def test_ranked_responses_become_pairs_with_ties_skipped_and_a_cap(tmp_path):
    f = tmp_path / "ranked.parquet"
    objects = [{"text": "A", "score": 3}, {"text": "B", "score": 1}, {"text": "C", "score": 3}, {"text": "D", "score": 2}]
    datasets.Dataset.from_list([{"prompt": "p", "completions": objects}]).to_parquet(str(f))
    report = DataReport()
    data = formats.get_hf("train", report, path=both(f), columns={"responses": "completions"})
    # pairs in order (a, b), a < b: AB (gap 2), AC tie, AD (1), CB (2), DB (1), CD (1)
    assert data["p"]["responses"] == ["A", "B", "D", "C"]
    assert data["p"]["pairs"] == [(0, 1), (0, 2), (3, 1), (2, 1), (3, 2)]
    assert data["p"]["sft_target"] == "A" and report == {"skipped: score tie": 1}
    report = DataReport()
    capped = formats.get_hf("train", report, path=both(f), columns={"responses": "completions"}, max_pairs_per_prompt=3)
    assert capped["p"]["pairs"] == [(0, 1), (0, 2), (3, 1)]  # the gaps 2, 2 and the first gap 1, in their order
    assert capped["p"]["rows"] == [f"{f}, row 1"] * 3
    assert report == {"skipped: score tie": 1, "skipped: over max_pairs_per_prompt": 2}


def test_ranked_parallel_lists_of_conversational_responses(tmp_path):
    f = tmp_path / "ranked.jsonl"
    row = {"prompt": [user("q")], "responses": [[bot("x")], [bot("y")], [bot("z")]], "scores": [0.5, 2.0, 1.0]}
    datasets.Dataset.from_list([row]).to_json(str(f))
    data = load("train", tmp_path, path=both(f))
    # xy -> (y, x), xz -> (z, x), yz -> (y, z)
    assert pairs_of(data) == [
        (key([user("q")]), [bot("y")], [bot("x")]),
        (key([user("q")]), [bot("z")], [bot("x")]),
        (key([user("q")]), [bot("y")], [bot("z")]),
    ]
    assert data[key([user("q")])]["sft_target"] == [bot("y")]


def test_arrow_saved_to_disk_standard_strings(tmp_path):
    folder = tmp_path / "saved"
    train_rows = [{"prompt": "Q: 1+1=", "chosen": " 2", "rejected": " 3"}]
    test_rows = [{"prompt": "Q: 2+2=", "chosen": " 4", "rejected": " 5"}]
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train_rows), "test": datasets.Dataset.from_list(test_rows)}
    ).save_to_disk(str(folder))
    assert pairs_of(load("train", tmp_path, path=str(folder))) == [("Q: 1+1=", " 2", " 3")]
    assert examples("test", tmp_path, path=str(folder)) == [
        {
            "prompt": "Q: 2+2=",
            "chosen": " 4",
            "rejected": " 5",
            "truncation_mode": "keep_end",
            "row": f"{folder} (test split), row 1",
        }
    ]
    one = tmp_path / "one"  # a single Dataset: one split, so the held-out slice
    rows = [{"prompt": f"p{i}", "chosen": " a", "rejected": " b"} for i in range(30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(one))
    assert list(load("test", tmp_path, path=str(one), holdout_fraction=0.3)) == [
        f"p{i}" for i in range(30) if held_out(f"p{i}", 0.3)
    ]


def test_hub_id_calls_load_dataset_with_config_and_split_and_offline_is_one_sentence(monkeypatch):
    calls = []

    def split_names(path, config_name=None):
        calls.append(("names", path, config_name))
        return ["train_prefs", "test_prefs"]

    def fake_load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return datasets.Dataset.from_list([h4_row(0, f"{kwargs['split']} q", "good", "bad")])

    monkeypatch.setattr(datasets, "get_dataset_split_names", split_names)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    options = {
        "path": "HuggingFaceH4/ultrafeedback_binarized",
        "name": "default",
        "train_split": "train_prefs",
        "test_split": "test_prefs",
    }
    data = load_dataset_dict("hf", "test", options, silent=True)
    assert pairs_of(data) == [(key([user("test_prefs q")]), [bot("good")], [bot("bad")])]
    assert calls == [
        ("names", "HuggingFaceH4/ultrafeedback_binarized", "default"),
        ("HuggingFaceH4/ultrafeedback_binarized", {"split": "test_prefs", "cache_dir": None, "name": "default"}),
    ]

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/name' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "get_dataset_split_names", offline)
    with pytest.raises(DataError) as e:
        load_dataset_dict("hf", "train", {"path": "org/name"}, silent=True)
    assert (
        str(e.value)
        == "Could not load org/name from the Hugging Face hub (ConnectionError); offline? set data.hf.path to a local copy."
    )
    with pytest.raises(DataError, match=r"^data.hf.path=./nope.parquet does not exist; give a data file, a folder or a hub id"):
        load_dataset_dict("hf", "train", {"path": "./nope.parquet"}, silent=True)


# ----------------------------------------------------------------------------- prompts for online DPO


def test_prompt_only_files_strings_and_messages(tmp_path):
    f = tmp_path / "prompts.parquet"
    rows = [{"prompt": [user("Tell a joke.")]}, {"prompt": [user("Tell a joke.")]}, {"prompt": [user("Sing.")]}]
    datasets.Dataset.from_list(rows).to_parquet(str(f))
    got = prompts("train", tmp_path, path=both(f))
    assert got == [
        {"prompt": [user("Tell a joke.")], "truncation_mode": "keep_end", "conversation": True},
        {"prompt": [user("Sing.")], "truncation_mode": "keep_end", "conversation": True},
    ]
    g = tmp_path / "prompts.jsonl"
    datasets.Dataset.from_list([{"prompt": "TL;DR: a"}, {"prompt": "  "}, {"prompt": "TL;DR: b"}]).to_json(str(g))
    assert prompt_sets.load_prompts(["hf"], "train", {"hf": {"path": both(g)}}, silent=True) == ["TL;DR: a", "TL;DR: b"]


def test_prompts_of_conversations_are_their_implicit_prompts(tmp_path):
    folder = write_h4(tmp_path)
    options = {"path": str(folder), "train_split": "train_prefs", "test_split": "test_prefs", "cache_dir": str(tmp_path / "c")}
    assert prompt_sets.load_prompts(["hf"], "train", {"hf": options}, silent=True) == [
        [user("What is 2+2?")],
        [user("Name a colour.")],
    ]


# ----------------------------------------------------------------------------- HH as conversations


HH_ROWS = [
    {
        "chosen": "\n\nHuman: Hi there\n\nAssistant: Hello!  \n\nHuman: How are you?\n\nAssistant: Fine, thanks.",
        "rejected": "\n\nHuman: Hi there\n\nAssistant: Hello!  \n\nHuman: How are you?\n\nAssistant: Go away.",
    },
    {  # the dialogues diverge before the last Assistant turn (repaired as the text loader does)
        "chosen": "\n\nHuman: Q\n\nAssistant: A1\n\nHuman: Q2\n\nAssistant: A2",
        "rejected": "\n\nHuman: Q\n\nAssistant: B1\n\nHuman: Q3\n\nAssistant: B2",
    },
    {  # two Human turns in a row are merged into one user message
        "chosen": "\n\nHuman: one\n\nHuman: two\n\nAssistant: yes",
        "rejected": "\n\nHuman: one\n\nHuman: two\n\nAssistant: no",
    },
]


def write_hh(tmp_path: Path) -> Path:
    folder = tmp_path / "hh" / "helpful-base"
    folder.mkdir(parents=True)
    with gzip.open(folder / "train.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in HH_ROWS)
    return folder.parent


def test_hh_as_conversations(tmp_path):
    report = DataReport()
    data = pd.get_hh("train", report, local_dir=str(write_hh(tmp_path)), conversation=True)
    assert pairs_of(data) == [
        (key([user("Hi there"), bot("Hello!"), user("How are you?")]), [bot("Fine, thanks.")], [bot("Go away.")]),
        (key([user("Q")]), [bot("A1"), user("Q2"), bot("A2")], [bot("B1"), user("Q3"), bot("B2")]),
        (key([user("one\n\ntwo")]), [bot("yes")], [bot("no")]),
    ]
    assert report == {
        "repaired: dialogues diverge before the last Assistant turn": 1,
        "repaired: consecutive turns of one role merged": 1,
    }
    got = prompt_sets.load_prompts(
        ["hh"], "train", {"hh": {"local_dir": str(write_hh(tmp_path / "again")), "conversation": True}}, silent=True
    )
    assert got == [[user("Hi there"), bot("Hello!"), user("How are you?")], [user("Q")], [user("one\n\ntwo")]]


def test_hh_as_conversations_on_the_real_file_keeps_every_pair():
    local = needs_shared("data", "hh-rlhf")
    text = load_dataset_dict("hh", "test", {"local_dir": str(local)}, silent=True)
    conv = load_dataset_dict("hh", "test", {"local_dir": str(local), "conversation": True}, silent=True)
    assert sum(len(e["pairs"]) for e in conv.values()) == sum(len(e["pairs"]) for e in text.values())
    for entry in conv.values():
        assert entry["prompt_messages"][-1]["role"] == "user"
        assert all(r[-1]["role"] == "assistant" and r[0]["role"] == "assistant" for r in entry["responses"])
        roles = [m["role"] for m in entry["prompt_messages"]]
        assert all(a != b for a, b in zip(roles, roles[1:]))  # turns alternate once merged


# ----------------------------------------------------------------------------- bad input


def write(tmp_path: Path, rows: list[dict], name: str = "bad.parquet") -> str:
    f = str(tmp_path / name)
    datasets.Dataset.from_list(rows).to_parquet(f)
    return f


GOOD = {"chosen": [user("u"), bot("a")], "rejected": [user("u"), bot("b")]}


@pytest.mark.parametrize(
    "bad, sentence",
    [
        (
            {"chosen": [user("u"), bot("a"), user("more?")], "rejected": [user("u"), bot("b")]},
            "row 2: the last message of 'chosen' is the user's, not the assistant's; a response must end with the assistant's turn.",
        ),
        (
            {"chosen": [user("u1"), bot("a")], "rejected": [user("u2"), bot("b")]},
            "row 2: 'chosen' and 'rejected' share no prompt (no common messages before an assistant turn); "
            "give the prompt in a column of its own (data.hf.columns={prompt: <column>}).",
        ),
        (
            {"chosen": [user("u"), {"role": "assistant", "content": None}], "rejected": [user("u"), bot("b")]},
            "row 2: message 2 of 'chosen' has no string 'role' and 'content' "
            '({"role": "assistant", "content": null}); every message needs both.',
        ),
    ],
)
def test_bad_rows_are_one_sentence_naming_the_file_and_row_before_any_model(tmp_path, bad, sentence):
    f = write(tmp_path, [GOOD, bad])
    out = tmp_path / "runs"
    config = compose_config(
        [*TINY, f"output_root={out}", "datasets=[hf]", f"data.hf.path={f}", f"data.hf.cache_dir={tmp_path / 'c'}"]
    )
    with pytest.raises(DataError) as e:
        train.main(config)
    assert str(e.value) == f"{f}, {sentence}"
    assert not out.exists()


def test_columns_that_match_no_format_name_the_columns_and_the_key(tmp_path):
    f = write(tmp_path, [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError) as e:
        load("train", tmp_path, path=both(f))
    assert str(e.value) == (
        f"{f} has columns ['question', 'answer'], which match no preference format (prompt / chosen / rejected, chosen / rejected "
        "conversations, or prompt / responses / scores); name yours with data.hf.columns={prompt: <column>, chosen: <column>, "
        "rejected: <column>} (or {prompt: ..., responses: ..., scores: ...})."
    )
    with pytest.raises(DataError, match=r"^data.hf.columns has unknown key\(s\) \['answer'\]"):
        load("train", tmp_path, path=both(f), columns={"answer": "a"})


def test_config_composes_with_a_column_mapping_override():
    config = compose_config(
        ["datasets=[hf]", "data.hf.path=x.csv", "data.hf.columns={prompt: question, chosen: response_j, rejected: response_k}"]
    )
    assert dict(config.data.hf.columns) == {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}
    assert config.data.hf.format == "auto" and config.data.hf.test_split == "test"


# ----------------------------------------------------------------------------- end to end


def test_tiny_dpo_run_on_a_conversational_parquet_file_with_a_chat_template(tmp_path):
    """datasets=[hf] on a parquet file of TRL's implicit conversational layout, a random tiny
    model paired with SmolLM2's tokenizer (its chat template): the run trains and evaluates."""

    tokenizer = needs_shared("tokenizers", "smollm2-135m-instruct")
    rows = [
        {"chosen": [user(f"What is {i}+{i}?"), bot(f"{2 * i}")], "rejected": [user(f"What is {i}+{i}?"), bot(f"{2 * i + 1}")]}
        for i in range(40)
    ]
    f = write(tmp_path, rows, "chat.parquet")
    short_chat_run(tmp_path, f, tokenizer, "data.hf.holdout_fraction=0.2")


def short_chat_run(tmp_path, path, tokenizer, *options: str):
    """A 16-example DPO run of a random tiny model with ``tokenizer``'s chat template on ``datasets=[hf]
    data.hf.path=path`` (``options``: more data.hf.* keys); checks its evals at 0, 8 and 16 examples."""
    from conftest import metric_records, run_train

    args = ["datasets=[hf]", f"data.hf.path={path}", *options, f"data.hf.cache_dir={tmp_path / 'c'}"]
    args += ["model.tokenizer_class=null", f"model.tokenizer_name_or_path={tokenizer}"]
    args += ["n_examples=16", "eval_every=8", "n_eval_examples=8", "sample_during_eval=false"]
    run_dir = run_train(args, tmp_path)
    evals = [r for r in metric_records(run_dir) if "loss/eval" in r]
    assert len(evals) == 3  # at 0, 8 and 16 examples (do_first_eval, eval_every=8)
    assert evals[0]["loss/eval"] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference at the start
    return run_dir


def test_capybara_layout_a_prompt_that_is_an_earlier_turn_never_puts_a_user_turn_in_the_response(tmp_path):
    # argilla/distilabel-capybara-dpo: prompt is the first user turn, chosen / rejected the whole conversation.
    f = tmp_path / "capybara.jsonl"
    rows = [
        {
            "prompt": "u1",
            "chosen": [user("u1"), bot("a1"), user("u2"), bot("good")],
            "rejected": [user("u1"), bot("a1"), user("u2"), bot("bad")],
        }
    ]
    datasets.Dataset.from_list(rows).to_json(str(f))
    expected = [(key([user("u1"), bot("a1"), user("u2")]), [bot("good")], [bot("bad")])]
    assert pairs_of(load("train", tmp_path, path=both(f))) == expected  # auto reads it as implicit
    assert pairs_of(load("train", tmp_path, path=both(f), format="implicit")) == expected
    with pytest.raises(DataError) as e:  # conversational would make [a1, u2, good] the response: refused
        load("train", tmp_path, path=both(f), format="conversational")
    assert str(e.value) == (
        f"{f}, row 1: 'chosen' has 1 user turn after the 'prompt' text, so its response would hold the user's words; set "
        "data.hf.format=implicit to take the turns chosen and rejected share as the prompt, or fix the row."
    )
    rows[0]["prompt"] = [user("u1")]  # as messages: the same
    datasets.Dataset.from_list(rows).to_json(str(f))
    with pytest.raises(DataError, match=r"'chosen' has 1 user turn after the 'prompt' messages, so its response"):
        load("train", tmp_path, path=both(f))
    rows[0]["prompt"] = "u2"  # the last user turn: the prompt is every turn up to it, in both formats
    datasets.Dataset.from_list(rows).to_json(str(f))
    assert pairs_of(load("train", tmp_path, path=both(f), format="conversational")) == expected
