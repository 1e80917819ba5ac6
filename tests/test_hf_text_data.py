"""The ``hf`` dataset on three more layouts (issue 25): LLaMA-Factory's ShareGPT preference rows
(``conversations`` of ``{from, value}`` messages, one message as chosen / rejected, an optional
``system`` string), Anthropic HH's whole-dialogue text pairs in any file ``datasets`` reads, and
text columns that ``datasets`` reads as numbers. Expected prompts, responses and counts are
worked out by hand from the rows (HH: by the ``hh`` loader's definition of the split, the
longest common prefix ending in ``"\\n\\nAssistant:"``)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets
import pytest
from conftest import TINY, compose_config, metric_records, needs_shared, run_train
from omegaconf import OmegaConf
from test_hf_data import bot, key, pairs_of, user

import preference_datasets as pd
from data import formats
from data.holdout import in_holdout
from data.loading import load_dataset_dict, load_examples
from data.report import _LOADING, DataReport
from utils import DataError


def load(tmp_path: Path, f, split: str = "train", report: DataReport | None = None, **options) -> dict:
    """get_hf on ``f`` read for both splits (no held-out slice), counting into ``report``."""
    options = {"path": {"train": str(f), "test": str(f)}, "cache_dir": str(tmp_path / "hf_cache"), **options}
    return formats.get_hf(split, DataReport() if report is None else report, **options)


def sharegpt(text: str, speaker: str) -> dict:
    return {"from": speaker, "value": text}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


# ----------------------------------------------------------------------------- ShareGPT (LLaMA-Factory)

FACTORY_ROWS = [
    {  # LLaMA-Factory data/README.md, "Preference Dataset" of the sharegpt format, with a system column
        "conversations": [sharegpt("hi", "human"), sharegpt("hello", "gpt"), sharegpt("2+2?", "human")],
        "chosen": sharegpt("4", "gpt"),
        "rejected": sharegpt("5", "gpt"),
        "system": "Answer briefly.",
    },
    {  # a system message in the conversation wins over the system column (LLaMA-Factory's rule)
        "conversations": [sharegpt("Be exact.", "system"), sharegpt("3+3?", "human")],
        "chosen": sharegpt("6", "gpt"),
        "rejected": sharegpt("7", "gpt"),
        "system": "Answer briefly.",
    },
    {
        "conversations": [sharegpt("Name a colour.", "human")],
        "chosen": sharegpt("Blue.", "gpt"),
        "rejected": sharegpt("Seven.", "gpt"),
    },
]
ROLES = {"human": "user", "gpt": "assistant"}
FACTORY_PAIRS = [
    (key([system("Answer briefly."), user("hi"), bot("hello"), user("2+2?")]), [bot("4")], [bot("5")]),
    (key([system("Be exact."), user("3+3?")]), [bot("6")], [bot("7")]),
    (key([user("Name a colour.")]), [bot("Blue.")], [bot("Seven.")]),
]


@pytest.mark.parametrize("writer", ["jsonl", "json list"])
def test_sharegpt_layout_is_detected_with_its_conversations_as_the_prompt_and_the_system_column(tmp_path, writer):
    if writer == "jsonl":
        f = tmp_path / "factory.jsonl"
        datasets.Dataset.from_list(FACTORY_ROWS).to_json(str(f))  # row 3's missing system is null
    else:
        f = tmp_path / "factory.json"
        f.write_text(json.dumps(FACTORY_ROWS, indent=2))  # a JSON list, as LLaMA-Factory's data files
    assert pairs_of(load(tmp_path, f, roles=ROLES)) == FACTORY_PAIRS
    mapped = load(tmp_path, f, roles=ROLES, columns={"prompt": "conversations", "system": "system"})
    assert pairs_of(mapped) == FACTORY_PAIRS
    # without data.hf.roles: one sentence naming every ShareGPT role of the row and the mapping
    with pytest.raises(DataError) as e:
        load(tmp_path, f)
    assert str(e.value) == (
        f"{f}, row 1: the ShareGPT messages have role(s) 'human', 'gpt', not one of system, user, assistant, tool; "
        "map them with 'data.hf.roles={human: user, gpt: assistant}'."
    )
    with pytest.raises(DataError) as e:
        load(tmp_path, f, roles={"gpt": "assistant"})
    assert str(e.value).endswith("role(s) 'human', not one of system, user, assistant, tool; map them with "
                                 "'data.hf.roles={gpt: assistant, human: user}'.")  # fmt: skip


def test_sharegpt_tool_tags_and_a_bad_system_column(tmp_path):
    """LLaMA-Factory's other tags: function_call (the assistant's call) and observation (the tool's result)."""
    rows = [
        {
            "conversations": [
                sharegpt("Weather in Paris?", "human"),
                sharegpt('{"name": "weather", "arguments": {"city": "Paris"}}', "function_call"),
                sharegpt("18C, sunny", "observation"),
            ],
            "chosen": sharegpt("It is 18C and sunny.", "gpt"),
            "rejected": sharegpt("It is snowing.", "gpt"),
        }
    ]
    f = tmp_path / "tools.jsonl"
    datasets.Dataset.from_list(rows).to_json(str(f))
    with pytest.raises(DataError) as e:
        load(tmp_path, f, roles=ROLES)
    assert str(e.value).endswith(
        "role(s) 'function_call', 'observation', not one of system, user, assistant, tool; map them with "
        "'data.hf.roles={human: user, gpt: assistant, function_call: assistant, observation: tool}'."
    )
    roles = {**ROLES, "function_call": "assistant", "observation": "tool"}
    call = '{"name": "weather", "arguments": {"city": "Paris"}}'
    prompt = [user("Weather in Paris?"), bot(call), {"role": "tool", "content": "18C, sunny"}]
    assert pairs_of(load(tmp_path, f, roles=roles)) == [(key(prompt), [bot("It is 18C and sunny.")], [bot("It is snowing.")])]
    f = tmp_path / "bad_system.jsonl"
    datasets.Dataset.from_list([{**FACTORY_ROWS[2], "system": ["not", "text"]}]).to_json(str(f))
    with pytest.raises(DataError) as e:
        load(tmp_path, f, roles=ROLES)
    assert str(e.value) == f"{f}, row 1: column 'system' is a JSON list, not a string; give the system prompt as text."


def test_a_system_column_beside_text_prompts_is_kept_as_a_field(tmp_path):
    f = tmp_path / "text.jsonl"
    datasets.Dataset.from_list([{"prompt": "p", "chosen": "a", "rejected": "b", "system": "s"}]).to_json(str(f))
    data = load(tmp_path, f)
    assert pairs_of(data) == [("p", "a", "b")] and data["p"]["fields"] == {"system": "s"}


# ----------------------------------------------------------------------------- HH text pairs from any file

H, A = "\n\nHuman:", "\n\nAssistant:"
HAND_ROWS = [
    {"id": 1, "chosen": f"{H} Hi{A} Hello!", "rejected": f"{H} Hi{A} Go away."},
    {"id": 2, "chosen": f"{H} Q{A} A1{H} Q2{A} A2", "rejected": f"{H} Q{A} B1{H} Q3{A} B2"},  # diverge before the last turn
    {"id": 3, "chosen": f"{H} X{A} a", "rejected": f"{H} Y{A} b"},  # no common Assistant turn
]
HAND_PAIRS = [
    (f"{H} Hi{A}", " Hello!", " Go away."),
    (f"{H} Q{A}", f" A1{H} Q2{A} A2", f" B1{H} Q3{A} B2"),
]
HAND_REPORT = {"repaired: dialogues diverge before the last Assistant turn": 1, "skipped: no common Assistant turn": 1}


def write_rows(rows: list[dict], f: Path) -> Path:
    """``rows`` written by the datasets library in the format of ``f``'s suffix."""
    ds = datasets.Dataset.from_list(rows)
    {".jsonl": ds.to_json, ".parquet": ds.to_parquet, ".csv": lambda p: ds.to_csv(p, index=False)}[f.suffix](str(f))
    return f


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_hh_text_pairs_from_a_hand_made_file(tmp_path, suffix):
    f = write_rows(HAND_ROWS, tmp_path / f"hh{suffix}")
    report = DataReport()
    data = load(tmp_path, f, report=report)
    assert pairs_of(data) == HAND_PAIRS
    assert report == HAND_REPORT
    assert [e["rows"] for e in data.values()] == [[f"{f}, row 1"], [f"{f}, row 2"]]
    assert [e["fields"] for e in data.values()] == [{"id": 1}, {"id": 2}]  # the other columns, for reward functions
    assert formats.detect_hf_format(["chosen", "rejected"], HAND_ROWS[0], formats._hf_columns(None, []), "x") == "hh"


def test_hh_format_named_with_mapped_columns_and_a_bad_row(tmp_path):
    rows = [{"good": r["chosen"], "bad": r["rejected"]} for r in HAND_ROWS[:2]]
    f = write_rows(rows, tmp_path / "mapped.parquet")
    got = load(tmp_path, f, format="hh", columns={"chosen": "good", "rejected": "bad"})
    assert pairs_of(got) == HAND_PAIRS
    f = write_rows([{"chosen": f"{H} Hi{A} Hello!", "rejected": [1, 2]}], tmp_path / "bad.parquet")
    with pytest.raises(DataError) as e:
        load(tmp_path, f, format="hh")
    assert str(e.value) == (
        f"{f}, row 1: column 'rejected' is missing or not a string; hh rows need chosen and rejected dialogues "
        "('\\n\\nHuman: ...\\n\\nAssistant: ...')."
    )


REAL_ROWS = [*range(20), 1254, 1688]
"""Rows of harmless-base/test.jsonl.gz: its first 20, and two whose dialogues diverge before the last Assistant turn."""


def real_hh_rows() -> list[dict]:
    with gzip.open(needs_shared("data", "hh-rlhf", "harmless-base", "test.jsonl.gz"), "rt") as f:
        rows = [json.loads(line) for line in f]
    return [rows[i] for i in REAL_ROWS]


def test_real_hh_rows_in_any_file_give_the_hh_loaders_pairs_and_counts(tmp_path):
    rows = real_hh_rows()
    local = tmp_path / "hh-copy" / "harmless-base"
    local.mkdir(parents=True)
    with gzip.open(local / "test.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    want = DataReport()
    token = _LOADING.set(want)
    hh = pd.get_hh("test", want, local_dir=str(local.parent))
    _LOADING.reset(token)
    assert dict(want) == {"repaired: dialogues diverge before the last Assistant turn": 2}
    assert sum(len(e["pairs"]) for e in hh.values()) == len(REAL_ROWS)
    for suffix in (".jsonl", ".parquet", ".csv"):
        f = write_rows(rows, tmp_path / f"harmless{suffix}")
        report = DataReport()
        got = load(tmp_path, f, report=report)
        assert pairs_of(got) == pairs_of(hh), suffix
        assert report == want, suffix


# ----------------------------------------------------------------------------- text read as numbers


def write_csv(f: Path, lines: list[str]) -> Path:
    f.write_text("\n".join(lines) + "\n")
    return f


def test_numeric_columns_are_cast_once_noted_csv_exactly_json_as_arrow_writes(tmp_path):
    f = write_csv(tmp_path / "ints.csv", ["prompt,chosen,rejected,n", "6*7=,42,041,1", "3*5=,15,16,2", "2*1=,2.50,2.0,3"])
    report = DataReport()
    data = load(tmp_path, f, report=report)
    assert pairs_of(data) == [("6*7=", "42", "041"), ("3*5=", "15", "16"), ("2*1=", "2.50", "2.0")]
    assert [e["fields"] for e in data.values()] == [{"n": 1}, {"n": 2}, {"n": 3}]  # a column no format reads stays a number
    assert report == {
        "cast to text: column 'chosen' was read as numbers by datasets; kept as written in the file": 3,
        "cast to text: column 'rejected' was read as numbers by datasets; kept as written in the file": 3,
    }
    f = tmp_path / "numbers.jsonl"
    f.write_text('{"prompt": "6*7=", "chosen": 42, "rejected": 41.0}\n{"prompt": "1.5*1=", "chosen": 1, "rejected": 1.50}\n')
    report = DataReport()
    assert pairs_of(load(tmp_path, f, report=report)) == [("6*7=", "42", "41"), ("1.5*1=", "1", "1.5")]
    assert report == {
        "cast to text: column 'chosen' was read as numbers by datasets; written by Arrow": 2,
        "cast to text: column 'rejected' was read as numbers by datasets; written by Arrow: 1.50 becomes 1.5": 2,
    }
    f = write_rows([{"question": 7, "good": True, "bad": False}], tmp_path / "bools.parquet")
    report = DataReport()
    got = load(tmp_path, f, report=report, columns={"prompt": "question", "chosen": "good", "rejected": "bad"})
    assert pairs_of(got) == [("7", "true", "false")]
    assert sorted(report) == [
        "cast to text: column 'bad' was read as booleans by datasets; written by Arrow: true, false",
        "cast to text: column 'good' was read as booleans by datasets; written by Arrow: true, false",
        "cast to text: column 'question' was read as numbers by datasets; written by Arrow",
    ]


# ----------------------------------------------------------------------------- end to end


def test_tiny_dpo_run_on_a_csv_of_integer_answers_notes_the_cast_once(tmp_path, capsys):
    """Regression: a CSV whose answers datasets reads as int64 was refused ('is missing or not a string')."""
    lines = ["prompt,chosen,rejected"] + [f"What is {i}+{i}?,{2 * i},{2 * i + 1}" for i in range(40)]
    f = write_csv(tmp_path / "answers.csv", lines)
    run_dir = run_train(
        [
            "datasets=[hf]",
            f"data.hf.path={f}",
            "data.hf.holdout_fraction=0.2",
            f"data.hf.cache_dir={tmp_path / 'c'}",
            "n_examples=16",
            "eval_every=8",
            "n_eval_examples=8",
            "sample_during_eval=false",
        ],
        tmp_path,
    )
    assert [r for r in metric_records(run_dir) if "loss/eval" in r]
    out = capsys.readouterr().out
    held = [i for i in range(40) if in_holdout(f"What is {i}+{i}?", 0.2)]
    n_train, n_test = 40 - len(held), len(held)
    note = "cast to text: column '{}' was read as numbers by datasets; kept as written in the file"
    casts = f"{{n}} {note.format('chosen')}, {{n}} {note.format('rejected')}"
    assert f"[data] hf/train: {n_train} prompts, {n_train} pairs ({casts.format(n=n_train)})" in out.splitlines()
    assert f"[data] hf/test: {n_test} prompts, {n_test} pairs ({casts.format(n=n_test)})" in out.splitlines()
    assert out.count(note.format("chosen")) == 2  # once a split, not once a row


def test_every_layout_through_the_composed_config_gives_its_pairs(tmp_path):
    """ShareGPT jsonl, HH-text jsonl / parquet / csv and a numeric CSV, each read as train.py reads data.hf."""
    f = tmp_path / "factory.jsonl"
    datasets.Dataset.from_list(FACTORY_ROWS).to_json(str(f))
    layouts = {
        "sharegpt": ([f"data.hf.path={f}", "data.hf.roles={human: user, gpt: assistant}"], FACTORY_PAIRS),
        "numeric": (
            [f"data.hf.path={write_csv(tmp_path / 'n.csv', ['prompt,chosen,rejected', '6*7=,42,41', '3*5=,15,16'])}"],
            [("6*7=", "42", "41"), ("3*5=", "15", "16")],
        ),
    }
    for suffix in (".jsonl", ".parquet", ".csv"):
        layouts[f"hh{suffix}"] = ([f"data.hf.path={write_rows(HAND_ROWS, tmp_path / f'hh{suffix}')}"], HAND_PAIRS)
    for name, (overrides, want) in layouts.items():
        config = compose_config([*TINY, "datasets=[hf]", *overrides, f"data.hf.cache_dir={tmp_path / 'c'}"])
        options = OmegaConf.to_container(config.data, resolve=True)
        options["hf"]["path"] = {"train": options["hf"]["path"], "test": options["hf"]["path"]}
        got = load_examples(["hf"], "train", options, sft_mode=False, silent=True)
        as_pairs = [
            (ex["prompt"] if isinstance(ex["prompt"], str) else key(ex["prompt"]), ex["chosen"], ex["rejected"]) for ex in got
        ]
        assert as_pairs == want, name


def test_datasets_json_points_sharegpt_and_hh_rows_at_the_hf_loader(tmp_path):
    f = tmp_path / "factory.jsonl"
    f.write_text(json.dumps(FACTORY_ROWS[2]) + "\n")
    with pytest.raises(DataError) as e:
        load_dataset_dict("json", "train", {"path": str(f)}, silent=True)
    assert str(e.value) == (
        f"{f}, row 1 is a ShareGPT row (conversations, no prompt), which datasets=[json] does not read; read it with "
        f"datasets=[hf] data.hf.path={f} 'data.hf.roles={{human: user, gpt: assistant}}'."
    )
    f = tmp_path / "hh.jsonl"
    f.write_text(json.dumps(HAND_ROWS[0]) + "\n")
    with pytest.raises(DataError) as e:
        load_dataset_dict("json", "train", {"path": str(f)}, silent=True)
    assert str(e.value) == (
        f"{f}, row 1 is an HH row (whole dialogues, no prompt), which datasets=[json] does not read; read it with "
        f"datasets=[hf] data.hf.path={f}."
    )
    f = tmp_path / "one_message.jsonl"
    f.write_text(json.dumps({"prompt": "q", "chosen": bot("a"), "rejected": bot("b")}) + "\n")
    with pytest.raises(DataError, match=r"row 1: field 'chosen' is a message, which datasets=\[json\] does not read"):
        load_dataset_dict("json", "train", {"path": str(f)}, silent=True)
